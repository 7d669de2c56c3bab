"""`tiercache bench tiers --tiers redis,grpc,grpc-stream,grpc-shm`: L3 put/get beside the raw transport, in one run.

*put* writes L1's chunks down through the tier (encode with checksum, one
pipelined ``SET`` batch or one streamed ``Put`` per transfer job); *get*
promotes them back into L1 slots (pipelined ``GET`` or a streamed ``Get``,
verify, place). The raw baselines move the same chunk bytes with no protocol
of ours: redis-py pipelined ``SET``/``GET`` through the same kind of client,
and a bare gRPC bytes store (`tiercache.bench.grpc_echo`, in its own process
like `tiercache serve`, fed the same bytes in the tier's message size) for
``grpc-stream`` (the tier on gRPC streams alone); for ``grpc`` (the tier on
the server's data channel) a bare TCP bytes store in its own process
(`tiercache.bench.tcp_echo`) on as many connections as transfer workers. For
``grpc-shm`` (a `tiercache serve --shm-dir` and a client on the same host,
which moves chunks as files in that directory) the raw baseline is plain file
I/O of the same bytes in the same directory: each value written to a new file,
read back into pre-faulted buffers. Raw and tier swap order every repetition;
medians are reported.
"""
from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

from tiercache.bench.filled import filled_stack
from tiercache.bench.formats import format_section
from tiercache.errors import ConfigError


class RawBaseline(Protocol):
    def put(self, values: list[bytes]) -> None: ...
    def get(self) -> int: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...


class RedisRaw:
    def __init__(self, url: str, count: int) -> None:
        from tiercache.tiers.redis import fast_client
        self._client = fast_client(url, socket_timeout=30.0)
        self._keys = [f"tiercache-bench-raw:{i}".encode() for i in range(count)]

    def put(self, values: list[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for k, v in zip(self._keys, values):
            pipe.set(k, v)
        pipe.execute()

    def get(self) -> int:
        pipe = self._client.pipeline(transaction=False)
        for k in self._keys:
            pipe.get(k)
        return sum(len(v) for v in pipe.execute())

    def clear(self) -> None:
        self._client.delete(*self._keys)

    def close(self) -> None:
        self._client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subprocess:
    """A helper server (`tiercache serve`, an echo baseline) on a free port for the length of a benchmark."""

    def __init__(self, *argv: str, speaks_grpc: bool = True) -> None:
        self.port = _free_port()
        port_args = ["--port", str(self.port)] if argv[0] == "tiercache.cli" else [str(self.port)]
        self.proc = subprocess.Popen([sys.executable, "-m", *argv, *port_args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if speaks_grpc:
            import grpc
            channel = grpc.insecure_channel(self.address)
            try:
                grpc.channel_ready_future(channel).result(timeout=30)
            finally:
                channel.close()
            return
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"{argv[0]} did not start") from None
                time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class RedisServer:
    """A `redis-server` of the benchmark's own on a free loopback port, without persistence, for one run."""

    def __init__(self, maxmemory: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError("--redis-url", None, "no redis-server is installed to start one for the run; "
                                                   "pass --redis-url redis://HOST:PORT")
        self.port = _free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", str(maxmemory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_redis(self.url, deadline_s=10.0, process=self.proc)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _wait_for_redis(url: str, deadline_s: float, process: subprocess.Popen | None = None) -> None:
    """Return once ``url`` answers PING; ConfigError naming --redis-url when it does not within the deadline."""
    import redis

    deadline = time.monotonic() + deadline_s
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError as err:
                if time.monotonic() > deadline or (process is not None and process.poll() is not None):
                    raise ConfigError("--redis-url", url, f"redis does not answer ({err})") from None
                time.sleep(0.05)
    finally:
        client.close()


def _wait_for_grpc(address: str, deadline_s: float) -> None:
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=deadline_s)
    except grpc.FutureTimeoutError:
        raise ConfigError("--grpc-address", address, f"no gRPC server answers there within {deadline_s:g} s") \
            from None
    finally:
        channel.close()


class RemoteTarget:
    """Where one remote benchmark runs: the server it was given (checked to answer before any work), or one it
    started for the run — a `redis-server` for ``redis`` without a URL, a `tiercache serve` for the gRPC kinds
    without an address (always for ``grpc-shm``, which needs a server on this host with ``--shm-dir``)."""

    def __init__(self, kind: str, target: str | None, total_bytes: int) -> None:
        self.kind = kind
        self.shm: Path | None = None
        self._server: Subprocess | RedisServer | None = None
        if kind == "redis":
            if target is None:
                # the raw baseline's values beside the tier's, each in jemalloc size classes (a 32 MiB value takes 40)
                self._server = RedisServer(maxmemory=3 * total_bytes + (256 << 20))
                target = self._server.url
            else:
                _wait_for_redis(target, deadline_s=2.0)
        elif target is None or kind == "grpc-shm":
            if kind == "grpc-shm":
                self.shm = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=shm_root()))
            self._server = Subprocess("tiercache.cli", "serve", "--capacity", str(2 * total_bytes + (256 << 20)),
                                      "--log-format", "text",
                                      *(["--shm-dir", str(self.shm / "server")] if self.shm else []))
            target = self._server.address
        else:
            _wait_for_grpc(target, deadline_s=5.0)
        self.address = target

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)


class _ProcessBaseline:
    """A raw baseline whose server runs in its own process: a client to it, closed with it."""
    _client: RawBaseline
    _server: Subprocess

    def put(self, values: list[bytes]) -> None:
        self._client.put(values)

    def get(self) -> int:
        return self._client.get()

    def clear(self) -> None:
        self._client.clear()

    def close(self) -> None:
        self._client.close()
        self._server.close()


class GrpcRaw(_ProcessBaseline):
    """The same bytes through a bare gRPC stream, in the tier's message size (`wire.PART_BYTES`), pieces
    cut before the clock starts: the transport's limit, with no copy of ours in it."""

    def __init__(self) -> None:
        from tiercache.bench.grpc_echo import EchoClient
        self._server = Subprocess("tiercache.bench.grpc_echo")
        self._client = EchoClient(self._server.address)
        self._pieces: list[bytes] | None = None

    def put(self, values: list[bytes]) -> None:
        if self._pieces is None:
            from tiercache.wire.grpc_messages import PART_BYTES
            self._pieces = [v[i:i + PART_BYTES] for v in values for i in range(0, len(v), PART_BYTES)]
        self._client.put(self._pieces)


class TcpRaw(_ProcessBaseline):
    """The same bytes through bare TCP connections (`tiercache.bench.tcp_echo`, its own process), as many
    as the tier's transfer workers: the data channel's transport limit, with no header or check of ours."""

    def __init__(self, connections: int) -> None:
        from tiercache.bench.tcp_echo import TcpEchoClient
        self._server = Subprocess("tiercache.bench.tcp_echo", speaks_grpc=False)
        self._client = TcpEchoClient(("127.0.0.1", self._server.port), connections)


class FilesRaw:
    """The same bytes as files in a directory (the server's shared memory): written to new files, read back
    with ``readinto`` into buffers allocated and faulted in once, on as many threads as the tier's transfer
    workers (file I/O releases the GIL, and the tier splits its jobs the same way)."""

    def __init__(self, directory: Path, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self._dir = directory / "raw-baseline"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._bufs: list[memoryview] = []
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads)

    def _each(self, fn, n: int) -> list:
        return list(self._pool.map(lambda part: [fn(i) for i in range(part, n, self._threads)], range(self._threads)))

    def put(self, values: list[bytes]) -> None:
        if not self._bufs:     # the warm-up repetition pays for these
            self._bufs = [memoryview(bytearray(len(v))) for v in values]
            for buf in self._bufs:
                buf[::4096] = b"\1" * len(buf[::4096])

        def write(i: int) -> None:
            fd = os.open(self._dir / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(values[i])
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            finally:
                os.close(fd)
        self._each(write, len(values))

    def get(self) -> int:
        def read(i: int) -> int:
            with open(self._dir / str(i), "rb", buffering=0) as f:
                return f.readinto(self._bufs[i])
        return sum(sum(part) for part in self._each(read, len(self._bufs)))

    def clear(self) -> None:
        for path in self._dir.iterdir():
            path.unlink()

    def close(self) -> None:
        self._pool.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


def shm_root() -> Path:
    """Where to put a benchmark server's shared memory: /dev/shm when the machine has it."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def bench_remote(kind: str, shape: str, chunk_tokens: int, total_bytes: int, reps: int, target: RemoteTarget,
                 progress=None, codec: str = "raw", transfer_cfg: dict | None = None) -> dict:
    """``kind`` is ``redis``, ``grpc`` (the data channel), ``grpc-stream`` (gRPC streams only) or ``grpc-shm``
    (chunks as files in a `tiercache serve --shm-dir` on this host), against ``target``; the caller closes it."""
    shm = target.shm
    section = {"enabled": True, "timeout": 30.0, "write_mode": "write-back",
               **({"url": target.address} if kind == "redis" else
                  {"address": target.address, "local": "auto" if shm else "off",
                   "bulk": "off" if kind == "grpc-stream" else "auto"})}
    section_name = "redis" if kind == "redis" else "grpc"
    filled = filled_stack(shape, chunk_tokens, total_bytes, f"bench-{kind}-{time.time_ns()}",
                          {section_name: section, "format": format_section(codec), "transfer": transfer_cfg or {}})
    stack, keys = filled.stack, filled.keys
    nbytes = filled.nbytes
    manager = stack.scheduler.manager
    cpu, remote = manager.l1, manager.lower[0]
    slab = stack.workers[0].stack.slab
    workers = manager.transfer_workers
    raw: RawBaseline = {"redis": lambda: RedisRaw(target.address, len(keys)), "grpc": lambda: TcpRaw(workers),
                        "grpc-stream": GrpcRaw, "grpc-shm": lambda: FilesRaw(shm, workers)}[kind]()
    times: dict[str, list[float]] = {"raw_put": [], "put": [], "raw_get": [], "get": []}
    try:
        src = [bytes(slab.memory(cpu.entries[k].slot)) for k in keys]

        def timed(name: str, fn) -> None:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)

        def raw_get() -> None:
            if raw.get() != nbytes:
                raise RuntimeError(f"raw {kind} get returned the wrong bytes")

        steps = {
            "raw_put": lambda: raw.put(src),
            "raw_get": raw_get,
            "put": lambda: times["put"].append(filled.write_down()),
            "get": lambda: times["get"].append(filled.promote_back()),
        }
        for rep in range(-1, reps):
            order = ("raw_put", "put", "raw_get", "get") if rep % 2 == 0 else ("put", "raw_put", "get", "raw_get")
            for name in order:
                if name.startswith("raw"):
                    timed(name, steps[name])
                else:
                    steps[name]()
            remote.delete(keys)
            stack.run(manager.take_background())   # the ranks delete their values
            raw.clear()
            if rep < 0:
                for samples in times.values():
                    samples.clear()
            elif progress:
                progress()
        cpu.delete(keys)       # nothing left in L1 for close to flush down: the server ends as it began
    finally:
        stack.close()
        raw.close()

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    put_g, get_g, rp, rg = gbps("put"), gbps("get"), gbps("raw_put"), gbps("raw_get")
    raw_name = {"redis": "pipelined redis-py SET/GET",
                "grpc": f"bare TCP bytes store, {workers} connections (own process)",
                "grpc-stream": "bare gRPC bytes stream, 4 MiB messages (own process)",
                "grpc-shm": "file write / readinto of the same bytes in the same shared-memory directory"}[kind]
    return {
        "tier": kind, "codec": codec, "shape": shape, "chunk_tokens": chunk_tokens, "chunk_bytes": filled.chunk_bytes,
        "chunks": len(keys), "bytes": nbytes, "reps": reps, "raw_baseline": raw_name,
        "put_tokens_per_s": round(len(keys) * chunk_tokens / statistics.median(times["put"])),
        "get_tokens_per_s": round(len(keys) * chunk_tokens / statistics.median(times["get"])),
        "put_gbps": round(put_g, 3), "get_gbps": round(get_g, 3),
        "raw_put_gbps": round(rp, 3), "raw_get_gbps": round(rg, 3),
        "put_ratio": round(put_g / rp, 3), "get_ratio": round(get_g / rg, 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
