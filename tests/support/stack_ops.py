"""Store, look up and load a request's chunks through a test `Stack`'s manager and tiers."""
import time

import torch

from tests.conftest import BLOCK, CHUNK, Stack


def put(s: Stack, req: str, seed: int, chunks: int = 2, num_tokens: int | None = None):
    """Compute a request's KV (random by seed) over ``chunks`` chunks' tokens (or ``num_tokens``: a partial last
    chunk too) and store its chunks to L1; returns (hashes, kv copy). Its tokens are ``seed * 1000 + t``."""
    tokens = [seed * 1000 + t for t in range(num_tokens if num_tokens is not None else chunks * CHUNK)]
    hashes = s.hasher.hash_blocks(tokens)
    s.blocks.allocate(req, len(tokens))
    ids = s.blocks.block_ids(req)
    s.fill(req, ids, seed)
    s.run(s.manager.plan_store(hashes, ids))
    expect = s.kv.kv[:, :, ids].clone()
    s.blocks.free(req)
    return hashes, expect


def lookup(s: Stack, hashes):
    """A lookup asked until no tier's answer is still on its way (a remote index looks up on its own thread)."""
    deadline = time.monotonic() + 10
    found = s.manager.lookup(hashes)
    while found.pending:
        assert time.monotonic() < deadline, "a remote lookup never answered"
        time.sleep(0.002)
        found = s.manager.lookup(hashes)
    return found


def load(s: Stack, hashes) -> torch.Tensor | None:
    """Bring a request's prefix back into fresh L0 blocks through whatever tiers hold it."""
    found = lookup(s, hashes)
    if s.manager.promote(found):
        s.offload.drain()
        found = lookup(s, hashes)
    found = s.manager.in_l1(found)
    if found.num_hit_blocks < len(hashes):
        return None
    s.blocks.allocate("load", len(hashes) * BLOCK)
    ids = s.blocks.block_ids("load")
    s.kv.kv[:, :, ids] = 0
    s.run(s.manager.plan_load(found, ids))
    got = s.kv.kv[:, :, ids].clone()
    s.blocks.free("load")
    return got
