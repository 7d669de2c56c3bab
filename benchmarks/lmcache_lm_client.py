"""LMCache 0.5.6's `lm://` (or `redis://`) connector, driven directly: put and get the chunks tiercache's bench moves.

Runs inside a virtualenv that has LMCache (it pins protobuf < 7, which
tiercache's stubs cannot use, so it cannot share tiercache's process); it
imports nothing from tiercache. `benchmarks/lmcache_side_by_side.py` starts
LMCache's server and this client, and tiercache's own bench, in one run.

    python benchmarks/lmcache_lm_client.py HOST PORT CHUNKS REPS [redis]  -> one JSON line of timings

With ``redis`` the same chunks go through LMCache's ``RedisConnector`` to the
Redis server at HOST:PORT (two keys per chunk: metadata and bytes).
"""
import asyncio
import contextlib
import json
import os
import sys
import threading
import time

import torch

LAYERS, HEADS, HEAD_DIM, TOKENS = 32, 8, 128, 256   # llama-8b, 256-token chunks: 32 MiB of bf16


def main(host: str, port: int, chunks: int, reps: int, kind: str = "lm") -> None:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    shape = (LAYERS, 2, TOKENS, HEADS * HEAD_DIM)
    # Room for the chunks and every repetition's gets: LMCache's Redis connector keeps a reference to what it
    # returned, so with room for two sets its allocator waited forever (the stall seen in session 2).
    sets = 2 if kind == "lm" else reps + 3
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, local_cpu=True,
                                            max_local_cpu_size=sets * chunks * 32 / 1024 + 1)
    meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, TOKENS, HEADS, HEAD_DIM), chunk_size=TOKENS)
    backend = LocalCPUBackend(cfg, meta)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    if kind == "redis":
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
        conn = RedisConnector(f"redis://{host}:{port}", loop, backend)
    else:
        conn = LMCServerConnector(host, port, loop, backend)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    gen = torch.Generator().manual_seed(0)
    objs, keys = [], []
    for i in range(chunks):
        obj = backend.allocate(torch.Size(shape), torch.bfloat16)
        obj.tensor.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
        objs.append(obj)
        keys.append(CacheEngineKey("bench", 1, 0, i + 1, torch.bfloat16))
    nbytes = sum(len(o.byte_array) for o in objs)
    times = {"put": [], "get": []}
    for rep in range(-1, reps):
        t = time.perf_counter()
        for key, obj in zip(keys, objs):
            run(conn.put(key, obj))
        run(conn.exists(keys[-1]))    # the server has taken the last put once it answers this
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        got = [run(conn.get(key)) for key in keys]
        get_s = time.perf_counter() - t
        if any(g is None for g in got) or not torch.equal(got[0].tensor, objs[0].tensor):
            raise RuntimeError("LMCache returned missing or different chunks")
        for g in got:
            g.ref_count_down()
        if rep >= 0:
            times["put"].append(put_s)
            times["get"].append(get_s)
    print(json.dumps({"bytes": nbytes, "chunks": chunks, "chunk_bytes": nbytes // chunks, **times}), flush=True)
    # LMCache's Redis connector can hang in close(): the timings are out, so wait 10 s at most, whatever it says
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(conn.close(), loop).result(timeout=10)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
