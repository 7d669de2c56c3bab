"""Namespaced chained hashing: deterministic, prefix-stable, and separated by namespace."""
import subprocess
import sys

import numpy as np
import pytest

from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace, chunk_keys, hash_functions

GEO = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NS = Namespace("meta-llama/Llama-3.1-8B", GEO, block_size=16, revision="main")


@pytest.mark.parametrize("hash_name", hash_functions.names())
def test_chain_is_prefix_stable_and_sensitive(hash_name):
    hasher = BlockHasher(NS, hash_name)
    tokens = list(range(100))
    hashes = hasher.hash_blocks(tokens)
    assert len(hashes) == 6  # the partial 7th block is not hashed
    assert len(set(hashes)) == 6 and all(len(h) == 32 for h in hashes)
    # A longer prompt with the same prefix shares every earlier hash.
    assert hasher.hash_blocks(tokens + [7] * 40)[:6] == hashes
    # Changing one token in block 2 changes block 2 and everything after it, nothing before.
    changed = hasher.hash_blocks(tokens[:40] + [999] + tokens[41:])
    assert changed[:2] == hashes[:2]
    assert all(a != b for a, b in zip(changed[2:], hashes[2:]))
    # Continuing a chain from a parent equals hashing the whole thing.
    assert hasher.hash_blocks(tokens[32:], parent=hashes[1]) == hashes[2:]


def test_namespaces_never_share_keys():
    tokens = list(range(64))
    variants = [
        NS,
        Namespace("other-model", GEO, 16, "main"),
        Namespace(NS.model, GEO, 16, "v2"),
        Namespace(NS.model, KVGeometry(32, 8, 128, "float16"), 16, "main"),
        Namespace(NS.model, KVGeometry(32, 4, 128, "bfloat16"), 16, "main"),
        Namespace(NS.model, KVGeometry(32, 8, 128, "bfloat16", layout="LBKTHD"), 16, "main"),
        Namespace(NS.model, GEO, 16, "main", tenant_salt="tenant-a"),
    ]
    firsts = {BlockHasher(ns).hash_blocks(tokens)[0] for ns in variants}
    assert len(firsts) == len(variants)


def test_extra_keys_change_the_hash():
    hasher = BlockHasher(NS)
    tokens = list(range(32))
    plain = hasher.hash_blocks(tokens)
    lora = hasher.hash_blocks(tokens, extra_keys=[b"lora-1", b"lora-1"])
    assert plain[0] != lora[0]
    with pytest.raises(ValueError, match="extra_keys"):
        hasher.hash_blocks(tokens, extra_keys=[b"x"])


def test_token_ids_must_fit_uint32():
    with pytest.raises(ValueError, match="uint32"):
        BlockHasher(NS).hash_blocks([-1] * 16)


def test_same_hashes_in_a_fresh_process():
    """No per-process seed: another interpreter (another PYTHONHASHSEED) computes identical keys."""
    script = (
        "from tiercache.contracts.keys import *\n"
        "ns = Namespace('meta-llama/Llama-3.1-8B', KVGeometry(32, 8, 128, 'bfloat16'), 16, 'main')\n"
        "for name in ('sha256', 'blake3', 'xxh3_128'):\n"
        "    print(BlockHasher(ns, name).hash_blocks(list(range(100)))[-1].hex())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.split()
    here = [BlockHasher(NS, n).hash_blocks(list(range(100)))[-1].hex() for n in ("sha256", "blake3", "xxh3_128")]
    assert out == here


def test_numpy_and_list_tokens_hash_alike():
    hasher = BlockHasher(NS)
    tokens = np.arange(64, dtype=np.int64)
    assert hasher.hash_blocks(tokens) == hasher.hash_blocks(tokens.tolist())


def test_chunk_keys_are_last_block_hashes():
    hashes = BlockHasher(NS).hash_blocks(list(range(16 * 10)))
    assert chunk_keys(hashes, 4) == [hashes[3], hashes[7]]
    assert chunk_keys(hashes, 4, include_partial=True) == [hashes[3], hashes[7], hashes[9]]


def test_chunks_of_other_sizes_are_filed_apart():
    """A 512-token chunk and the second 256-token chunk of one prompt end at the same block (one key)."""
    digests = {NS.storage_digest(n) for n in (256, 512)} | {NS.digest()}
    assert len(digests) == 3 and NS.storage_digest(256) == NS.storage_digest(256)
