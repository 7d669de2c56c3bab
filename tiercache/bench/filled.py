"""A lower-tier benchmark's starting point: an offload stack whose L1 holds a known set of chunks."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.bench.tiers import BLOCK_SIZE, SHAPES
from tiercache.config import TierCacheConfig
from tiercache.connectors.reference import ReferenceConnector
from tiercache.contracts.keys import BlockHash, BlockHasher, Namespace
from tiercache.index.tier_index import TierIndex
from tiercache.pool import BlockManager, BlockPool, PagedKVCache


def settled_contains(index: TierIndex, keys: Sequence[BlockHash], timeout: float = 10.0) -> int:
    """`contains` asked until its answer is in (a remote index answers None while its lookup runs)."""
    deadline = time.monotonic() + timeout
    while (n := index.contains(keys)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{index.name} did not answer a lookup within {timeout} s")
        time.sleep(0.001)
    return n


@dataclass
class FilledStack:
    stack: ReferenceConnector
    hashes: list[BlockHash]      # block hashes of the one request whose chunks fill L1
    keys: list[BlockHash]        # its chunk keys, all resident in L1
    chunk_bytes: int
    nbytes: int                  # bytes of all chunks

    def write_down(self) -> float:
        """Seconds to copy every L1 chunk into the lower tier (flush, then wait)."""
        manager = self.stack.scheduler.manager
        lower = manager.lower[0]
        t = time.perf_counter()
        self.stack.drain(flush=True)
        elapsed = time.perf_counter() - t
        if settled_contains(lower, self.keys) != len(self.keys):
            raise RuntimeError(f"{lower.name} does not hold every chunk after the put")
        return elapsed

    def promote_back(self, before: Callable[[], object] | None = None) -> float:
        """Seconds to bring every chunk back from the lower tier into L1 (``before`` runs untimed first)."""
        manager = self.stack.scheduler.manager
        cpu = manager.l1
        cpu.delete(self.keys)
        settled_contains(manager.lower[0], self.keys)   # the lookup's answer is in before the clock starts
        if before is not None:
            before()
        t = time.perf_counter()
        lookup = manager.lookup(self.hashes)
        while lookup.pending:
            lookup = manager.lookup(self.hashes)
        manager.promote(lookup)
        self.stack.drain()
        elapsed = time.perf_counter() - t
        if cpu.contains(self.keys) != len(self.keys):
            raise RuntimeError("promotion did not bring every chunk back to L1")
        return elapsed


def filled_stack(shape: str, chunk_tokens: int, total_bytes: int, model: str,
                 sections: dict[str, dict[str, Any]]) -> FilledStack:
    """Random KV for ``total_bytes`` of whole chunks, stored into an L1 sized to hold exactly them.

    ``sections`` adds config (the lower tier under test) on top of that L1.
    """
    geo = SHAPES[shape]
    cfg = TierCacheConfig().replace(keys={"block_size": BLOCK_SIZE, "chunk_tokens": chunk_tokens})
    blocks_per_chunk = cfg.keys.blocks_per_chunk
    chunk_bytes = blocks_per_chunk * PagedKVCache(geo, 1, BLOCK_SIZE, "cpu").block_bytes
    num_chunks = max(2, total_bytes // chunk_bytes)
    num_blocks = num_chunks * blocks_per_chunk
    nbytes = num_chunks * chunk_bytes
    kv = PagedKVCache(geo, num_blocks, BLOCK_SIZE, "cpu")
    kv.kv.normal_()
    blocks = BlockManager(BlockPool(num_blocks), BLOCK_SIZE)
    blocks.allocate("bench", num_blocks * BLOCK_SIZE)
    namespace = Namespace(model, geo, BLOCK_SIZE)
    hashes = BlockHasher(namespace).hash_blocks(list(range(num_blocks * BLOCK_SIZE)))
    stack = ReferenceConnector(cfg.replace(cpu={"capacity": nbytes}, **sections), namespace, kv)
    manager = stack.scheduler.manager
    stack.run([manager.plan_store(hashes, blocks.block_ids("bench"))])
    return FilledStack(stack, hashes, list(manager.l1.entries), chunk_bytes, nbytes)
