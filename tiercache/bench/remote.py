"""`tiercache bench tiers --tiers redis`: L3 put/get beside raw pipelined redis-py SET/GET, in one run.

*put* writes L1's chunks down through the tier (encode with checksum, one
pipelined ``SET`` batch per transfer job); *get* promotes them back into L1
slots (one pipelined ``GET`` batch, verify, place). The raw baseline sends the
same chunk bytes as one pipelined ``SET`` batch and reads them back with one
pipelined ``GET`` batch through the same kind of client. Raw and tier swap
order every repetition; medians are reported.
"""
from __future__ import annotations

import statistics
import time

from tiercache.bench.filled import filled_stack
from tiercache.tiers.redis import fast_client


def bench_redis(shape: str, chunk_tokens: int, total_bytes: int, reps: int, url: str, progress=None) -> dict:
    filled = filled_stack(shape, chunk_tokens, total_bytes, f"bench-redis-{time.time_ns()}",
                          {"redis": {"enabled": True, "url": url, "timeout": 30.0}})
    stack, keys = filled.stack, filled.keys
    chunk_bytes, nbytes, num_chunks = filled.chunk_bytes, filled.nbytes, len(filled.keys)
    cpu, remote = stack.tiers[0], stack.tiers[1]
    raw_client = fast_client(url, socket_timeout=30.0)
    raw_keys = [f"tiercache-bench-raw:{i}".encode() for i in range(num_chunks)]
    times: dict[str, list[float]] = {"raw_set": [], "put": [], "raw_get": [], "get": []}
    try:
        src = [bytes(cpu.slot_view(cpu.entries[k].slot).numpy()) for k in keys]

        def raw_set() -> None:
            t = time.perf_counter()
            pipe = raw_client.pipeline(transaction=False)
            for k, v in zip(raw_keys, src):
                pipe.set(k, v)
            pipe.execute()
            times["raw_set"].append(time.perf_counter() - t)

        def raw_get() -> None:
            t = time.perf_counter()
            pipe = raw_client.pipeline(transaction=False)
            for k in raw_keys:
                pipe.get(k)
            got = pipe.execute()
            times["raw_get"].append(time.perf_counter() - t)
            if sum(len(v) for v in got) != nbytes:
                raise RuntimeError("raw GET returned the wrong bytes")

        def put() -> None:
            times["put"].append(filled.write_down())

        def get() -> None:
            times["get"].append(filled.promote_back())

        for rep in range(-1, reps):
            for step in ((raw_set, put, raw_get, get) if rep % 2 == 0 else (put, raw_set, get, raw_get)):
                step()
            remote.delete(keys)
            raw_client.delete(*raw_keys)
            if rep < 0:
                for samples in times.values():
                    samples.clear()
            elif progress:
                progress()
    finally:
        stack.close()

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    put_g, get_g, rs, rg = gbps("put"), gbps("get"), gbps("raw_set"), gbps("raw_get")
    return {
        "tier": "redis", "shape": shape, "chunk_tokens": chunk_tokens, "chunk_bytes": chunk_bytes,
        "chunks": num_chunks, "bytes": nbytes, "reps": reps,
        "put_gbps": round(put_g, 3), "get_gbps": round(get_g, 3),
        "raw_set_gbps": round(rs, 3), "raw_get_gbps": round(rg, 3),
        "put_ratio": round(put_g / rs, 3), "get_ratio": round(get_g / rg, 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
