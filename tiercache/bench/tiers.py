"""`tiercache bench tiers`: tier throughput beside the machine's raw limit, measured in one run.

For the CPU tier, a store moves chunks from the paged L0 pool into L1 slots
(plan, pin, gather, publish) and a load moves them back (lookup, plan, pin,
scatter); the raw baseline copies the same bytes, chunk by chunk, between two
pre-faulted contiguous buffers. Repetitions interleave raw, put and get so
drift on a noisy machine hits all three alike; medians are reported.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from tiercache.config import TierCacheConfig
from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace
from tiercache.pool import BlockManager, BlockPool, PagedKVCache

SHAPES = {
    "llama-8b": KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    "small": KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32"),
}
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class CpuBenchSpec:
    shape: str = "llama-8b"
    chunk_tokens: int = 256
    total_bytes: int = 1 << 30
    reps: int = 5
    scattered: bool = False   # blocks spread over the pool instead of one run per chunk
    seed: int = 0


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def bench_cpu(spec: CpuBenchSpec, progress=None) -> dict[str, object]:
    geo = SHAPES[spec.shape]
    cfg = TierCacheConfig().replace(keys={"block_size": BLOCK_SIZE, "chunk_tokens": spec.chunk_tokens})
    bpc = cfg.keys.blocks_per_chunk
    probe = PagedKVCache(geo, 1, BLOCK_SIZE, "cpu")
    chunk_bytes = bpc * probe.block_bytes
    num_chunks = max(2, spec.total_bytes // chunk_bytes)
    num_blocks = num_chunks * bpc
    nbytes = num_chunks * chunk_bytes

    kv = PagedKVCache(geo, num_blocks, BLOCK_SIZE, "cpu")
    kv.kv.normal_()  # real values, and every page faulted in
    pool = BlockPool(num_blocks)
    blocks = BlockManager(pool, BLOCK_SIZE)
    tokens = list(range(num_blocks * BLOCK_SIZE))
    namespace = Namespace("bench", geo, BLOCK_SIZE)
    hashes = BlockHasher(namespace).hash_blocks(tokens)
    blocks.allocate("bench", len(tokens))
    block_ids = blocks.block_ids("bench")
    if spec.scattered:
        random.Random(spec.seed).shuffle(block_ids)

    from tiercache.connectors.reference import ReferenceConnector

    cfg = cfg.replace(cpu={"capacity": nbytes}, device_pool={"device": "cpu"})
    stack = ReferenceConnector(cfg, namespace, kv)
    manager = stack.scheduler.manager
    cpu = manager.l1
    src = torch.empty(num_chunks, chunk_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(num_chunks, chunk_bytes, dtype=torch.uint8).fill_(0)

    def raw() -> float:
        t = time.perf_counter()
        dst.copy_(src)  # the same bytes in one bulk copy: the machine's memcpy limit
        return time.perf_counter() - t

    def put() -> float:
        t = time.perf_counter()
        (result,) = stack.run([manager.plan_store(hashes, block_ids)])
        elapsed = time.perf_counter() - t
        if not result.ok or cpu.num_chunks != num_chunks:
            raise RuntimeError(f"store failed: {result.error}")
        return elapsed

    def get() -> float:
        t = time.perf_counter()
        lookup = manager.lookup(hashes)
        results = stack.run(manager.plan_load(lookup, block_ids))
        elapsed = time.perf_counter() - t
        if lookup.num_hit_blocks != num_blocks or not all(r.ok for r in results):
            raise RuntimeError("load failed")
        return elapsed

    try:
        # One untimed round trip that checks the bytes come back bit-exact.
        expect = kv.kv.clone()
        put()
        kv.kv.zero_()
        get()
        if not torch.equal(kv.kv, expect):
            raise RuntimeError("L1 round trip is not bit-exact")
        del expect
        cpu.delete(list(cpu.entries))
        times: dict[str, list[float]] = {"raw": [], "put": [], "get": []}
        for _ in range(spec.reps):
            times["raw"].append(raw())
            times["put"].append(put())
            times["get"].append(get())
            cpu.delete(list(cpu.entries))
            if progress:
                progress()
    finally:
        stack.close()
    raw_gbps = _median_gbps(nbytes, times["raw"])
    put_gbps = _median_gbps(nbytes, times["put"])
    get_gbps = _median_gbps(nbytes, times["get"])
    return {
        "shape": spec.shape,
        "geometry": {
            "layers": geo.num_layers,
            "kv_heads": geo.num_kv_heads,
            "head_dim": geo.head_dim,
            "dtype": geo.dtype,
        },
        "block_layout": "scattered" if spec.scattered else "allocated",
        "chunk_tokens": spec.chunk_tokens,
        "chunk_bytes": chunk_bytes,
        "chunks": num_chunks,
        "bytes": nbytes,
        "reps": spec.reps,
        "put_gbps": round(put_gbps, 3),
        "get_gbps": round(get_gbps, 3),
        "raw_gbps": round(raw_gbps, 3),
        "put_ratio": round(put_gbps / raw_gbps, 3),
        "get_ratio": round(get_gbps / raw_gbps, 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
