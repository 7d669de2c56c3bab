"""How fast can anything move 32 MiB values through one redis-server? The ceilings behind the Redis tier's design.

Measures, on the same server and the same bytes, in alternating order:
redis-py pipelined SET/GET (as shipped: hiredis packs commands; and with
its Python packer, `tiercache bench tiers`' raw baseline), redis.asyncio
pipelined SET/GET, a bare socket
sending SETs and reading whole-value GET replies into pre-faulted buffers,
and a bare socket reading the values as 256 KiB GETRANGE pieces with two in
flight (what `tiercache.tiers.redis` does). Prints medians in GB/s.

    redis-server --port 16399 --save "" --appendonly no --daemonize yes
    python benchmarks/redis_clients.py --port 16399
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import time

import redis
import redis.asyncio as aredis

from tiercache.tiers.redis import fast_client
from tiercache.tiers.resp import ReplyReader, command, set_command

PIECE = 256 << 10


class BareSocket:
    """SETs sent from the caller's buffer; replies parsed by `ReplyReader` (no checksum, no header) into
    buffers faulted in once."""

    def __init__(self, port: int, keys: list[bytes], size: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.reader = ReplyReader(self.sock)
        self.keys, self.size = keys, size
        self.bufs = [memoryview(bytearray(size)) for _ in keys]
        for b in self.bufs:
            b[:] = bytes(size)

    def _bulk_into(self, dest: memoryview) -> None:
        n = self.reader.bulk_length()
        self.reader.read_into(dest[:n])
        self.reader.end_of_bulk()

    def put(self, value: memoryview) -> None:
        for key in self.keys:
            before, after = set_command(key, len(value))
            self.sock.sendall(before)
            self.sock.sendall(value)
            self.sock.sendall(after)
        for _ in self.keys:
            self.reader.status()

    def get_whole(self) -> None:
        self.sock.sendall(b"".join(command(b"GET", k) for k in self.keys))
        for buf in self.bufs:
            self._bulk_into(buf)

    def get_ranges(self) -> None:
        reqs = [(i, command(b"GETRANGE", k, b"%d" % s, b"%d" % (s + PIECE - 1)), s)
                for i, k in enumerate(self.keys) for s in range(0, self.size, PIECE)]
        self.sock.sendall(reqs[0][1] + reqs[1][1])
        for j, (i, _, start) in enumerate(reqs):
            if j + 2 < len(reqs):
                self.sock.sendall(reqs[j + 2][1])
            self._bulk_into(self.bufs[i][start:start + PIECE])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=16399)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--mib", type=int, default=32, help="value size in MiB")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    size = args.mib << 20
    keys = [b"redis-clients:%d" % i for i in range(args.chunks)]
    value = memoryview(bytearray(os.urandom(size)))
    nbytes = size * len(keys)
    sync = redis.Redis(port=args.port)
    packed = fast_client(f"redis://127.0.0.1:{args.port}/0")
    bare = BareSocket(args.port, keys, size)
    loop = asyncio.new_event_loop()
    aio = aredis.Redis(port=args.port)

    async def aio_put() -> None:
        pipe = aio.pipeline(transaction=False)
        for k in keys:
            pipe.set(k, value)
        await pipe.execute()

    async def aio_get() -> None:
        pipe = aio.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        await pipe.execute()

    def py_put(client) -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.set(k, value)
        pipe.execute()

    def py_get(client) -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        pipe.execute()

    ways = {
        "redis-py pipelined": (lambda: py_put(sync), lambda: py_get(sync)),
        "redis-py pipelined, Python packer": (lambda: py_put(packed), lambda: py_get(packed)),
        "redis.asyncio pipelined": (lambda: loop.run_until_complete(aio_put()),
                                    lambda: loop.run_until_complete(aio_get())),
        "bare socket, whole GET": (lambda: bare.put(value), bare.get_whole),
        "bare socket, 256 KiB GETRANGE x2": (lambda: bare.put(value), bare.get_ranges),
    }
    rates: dict[str, dict[str, list[float]]] = {w: {"put": [], "get": []} for w in ways}
    order = list(ways)
    for rep in range(args.reps + 1):
        for way in (order if rep % 2 == 0 else order[::-1]):
            for what, fn in zip(("put", "get"), ways[way]):
                t = time.perf_counter()
                fn()
                if rep:
                    rates[way][what].append(nbytes / (time.perf_counter() - t) / 1e9)
            sync.delete(*keys)
    assert bytes(bare.bufs[-1]) == bytes(value), "the bare reader got other bytes"
    print(f"{len(keys)} values of {args.mib} MiB, medians of {args.reps}, GB/s")
    for way, r in rates.items():
        print(f"  {way:36s} put {statistics.median(r['put']):5.2f}   get {statistics.median(r['get']):5.2f}")
    loop.run_until_complete(aio.aclose())
    loop.close()


if __name__ == "__main__":
    main()
