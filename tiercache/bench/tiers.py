"""`tiercache bench tiers`: tier throughput beside the machine's raw limit, both timed in one run.

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
    bench = _CpuBench(spec)
    try:
        bench.check_round_trip()
        times = bench.run(progress)
    finally:
        bench.stack.close()
    return _report(spec, bench, times)


class _CpuBench:
    """L0 blocks filled with random KV for whole chunks, an L1 sized to hold exactly them, and the raw baseline's
    two buffers of the same bytes."""

    def __init__(self, spec: CpuBenchSpec) -> None:
        from tiercache.connectors.reference import ReferenceConnector

        self.spec = spec
        self.geo = geo = SHAPES[spec.shape]
        cfg = TierCacheConfig().replace(keys={"block_size": BLOCK_SIZE, "chunk_tokens": spec.chunk_tokens})
        blocks_per_chunk = cfg.keys.blocks_per_chunk
        self.chunk_bytes = blocks_per_chunk * PagedKVCache(geo, 1, BLOCK_SIZE, "cpu").block_bytes
        self.num_chunks = max(2, spec.total_bytes // self.chunk_bytes)
        self.num_blocks = self.num_chunks * blocks_per_chunk
        self.nbytes = self.num_chunks * self.chunk_bytes

        self.kv = PagedKVCache(geo, self.num_blocks, BLOCK_SIZE, "cpu")
        self.kv.kv.normal_()  # real values, and every page faulted in
        blocks = BlockManager(BlockPool(self.num_blocks), BLOCK_SIZE)
        tokens = list(range(self.num_blocks * BLOCK_SIZE))
        namespace = Namespace("bench", geo, BLOCK_SIZE)
        self.hashes = BlockHasher(namespace).hash_blocks(tokens)
        blocks.allocate("bench", len(tokens))
        self.block_ids = blocks.block_ids("bench")
        if spec.scattered:
            random.Random(spec.seed).shuffle(self.block_ids)

        cfg = cfg.replace(cpu={"capacity": self.nbytes}, device_pool={"device": "cpu"})
        self.stack = ReferenceConnector(cfg, namespace, self.kv)
        self.manager = self.stack.scheduler.manager
        self.cpu = self.manager.l1
        self.src = torch.empty(self.num_chunks, self.chunk_bytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty(self.num_chunks, self.chunk_bytes, dtype=torch.uint8).fill_(0)

    def raw(self) -> float:
        t = time.perf_counter()
        self.dst.copy_(self.src)  # the same bytes in one bulk copy: the machine's memcpy limit
        return time.perf_counter() - t

    def put(self) -> float:
        t = time.perf_counter()
        (result,) = self.stack.run([self.manager.plan_store(self.hashes, self.block_ids)])
        elapsed = time.perf_counter() - t
        if not result.ok or self.cpu.num_chunks != self.num_chunks:
            raise RuntimeError(f"store failed: {result.error}")
        return elapsed

    def get(self) -> float:
        t = time.perf_counter()
        lookup = self.manager.lookup(self.hashes)
        results = self.stack.run(self.manager.plan_load(lookup, self.block_ids))
        elapsed = time.perf_counter() - t
        if lookup.num_hit_blocks != self.num_blocks or not all(r.ok for r in results):
            raise RuntimeError("load failed")
        return elapsed

    def check_round_trip(self) -> None:
        """One untimed put and get that checks the bytes come back bit-exact, L1 emptied after."""
        expect = self.kv.kv.clone()
        self.put()
        self.kv.kv.zero_()
        self.get()
        if not torch.equal(self.kv.kv, expect):
            raise RuntimeError("L1 round trip is not bit-exact")
        self.cpu.delete(list(self.cpu.entries))

    def run(self, progress=None) -> dict[str, list[float]]:
        """Each repetition times raw, put and get in turn, so drift hits all three alike."""
        times: dict[str, list[float]] = {"raw": [], "put": [], "get": []}
        for _ in range(self.spec.reps):
            times["raw"].append(self.raw())
            times["put"].append(self.put())
            times["get"].append(self.get())
            self.cpu.delete(list(self.cpu.entries))
            if progress:
                progress()
        return times


def _report(spec: CpuBenchSpec, bench: _CpuBench, times: dict[str, list[float]]) -> dict[str, object]:
    geo = bench.geo
    raw_gbps = _median_gbps(bench.nbytes, times["raw"])
    put_gbps = _median_gbps(bench.nbytes, times["put"])
    get_gbps = _median_gbps(bench.nbytes, times["get"])
    return {
        "shape": spec.shape,
        "geometry": {"layers": geo.num_layers, "kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
                     "dtype": geo.dtype},
        "block_layout": "scattered" if spec.scattered else "allocated",
        "chunk_tokens": spec.chunk_tokens,
        "chunk_bytes": bench.chunk_bytes,
        "chunks": bench.num_chunks,
        "bytes": bench.nbytes,
        "reps": spec.reps,
        "put_gbps": round(put_gbps, 3),
        "get_gbps": round(get_gbps, 3),
        "raw_gbps": round(raw_gbps, 3),
        "put_ratio": round(put_gbps / raw_gbps, 3),
        "get_ratio": round(get_gbps / raw_gbps, 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
