"""A hostile tenant of `tiercache serve`, and the victims' engines beside it: for the server's tests and benchmark.

A `HostileTenant` holds a valid token of its own and runs, from threads of this process, every kind of client
the server must withstand (`KINDS`), each kept up — reopened whenever the server ends it — until `stop`:

- ``silent_puts``: data-channel PUTs (four unless told) declaring 16 MiB values (unless told), sending 1 MiB
  of each, then nothing — the whole in-flight budget, held silently, and held again on a new connection
  whenever the server ends one;
- ``stalled_streams``: gRPC Put streams that stop mid-chunk (every stream slot it can get);
- ``silent_flood``: data connections that never say hello, and unary calls whose request never comes;
- ``maximal_calls``: rounds of concurrent gRPC Puts and Contains of one message of the server's largest size;
- ``reconnect_loop``: data connections opened (with its token), said hello on, and closed, in a loop;
- ``maximal_reads``: chunks of the largest message stored once, then read back as fast as it can, over
  data-channel ``GET``s and gRPC ``Get`` streams from several threads at once (the server's sending work).

`tenant_run` is one victim tenant's turn: a reference engine stores a workload through the server, a fresh
one takes its prefixes back; what comes out is that tenant's hit ratio, store success and outputs.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from tiercache.bench.demo import run_workload
from tiercache.bench.workloads import WorkloadSpec
from tiercache.config import TierCacheConfig
from tiercache.contracts.keys import BlockHash
from tiercache.engine import EngineConfig
from tiercache.wire import data_frames as dw
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta
from tiercache.wire.grpc_messages import AUTH_HEADER, encode_chunk, method

MiB = 1 << 20
NS = b"\xee" * 16
STOP_WITHIN_S = 15.0        # `HostileTenant.stop` waits this long at most for its clients' threads
KINDS = ("silent_puts", "stalled_streams", "silent_flood", "maximal_calls", "reconnect_loop", "maximal_reads")
READERS = 4                 # threads of each kind of maximal read


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid``; raises ProcessLookupError for one that has ended."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    raise ProcessLookupError(f"process {pid} has ended: no resident memory to read")


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used, user and system, all its threads."""
    from tiercache.metrics import stat_cpu_seconds

    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())[1]
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} has ended: no CPU time to read") from None


class RssSampler:
    """The peak RSS of a process, sampled every ``every_s`` from /proc while running (a context manager). A
    process that ends meanwhile is an error on leaving, never a peak read too low."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_mib = rss_mib(pid)
        self._error: ProcessLookupError | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="tiercache-rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self._done.set()
        self._thread.join(5)
        if self._error is not None and exc_type is None:
            raise self._error

    def _sample(self) -> None:
        try:
            while not self._done.wait(self.every_s):
                self.peak_mib = max(self.peak_mib, rss_mib(self.pid))
        except ProcessLookupError as err:
            self._error = err


def header_for(key: bytes, payload_bytes: int, namespace: bytes = NS) -> bytes:
    """A well-formed chunk header (checksum and all) for ``payload_bytes`` of float16 under ``namespace``."""
    raw = np.zeros(payload_bytes // 2, dtype=np.float16)
    meta = ChunkMeta(namespace, BlockHash(key), 16, "float16", (payload_bytes // 2,))
    return bytes(ChunkFormat().encode_parts(meta, raw)[0])


class HostileTenant:
    """The kinds of clients in the module docstring, run as the tenant of ``token``, until `stop`."""

    def __init__(self, address: str, data_port: int, token: str, max_message: int,
                 kinds: tuple[str, ...] = KINDS, calls_per_round: int = 100, round_pause_s: float = 0.2,
                 silent_puts: int = 4, silent_value_bytes: int = 16 * MiB) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown hostile kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.address = address
        self.data_port = data_port
        self.token = token
        self.metadata = ((AUTH_HEADER, f"Bearer {token}"),)
        self.max_message = max_message
        self.kinds = kinds
        self.calls_per_round = calls_per_round
        self.round_pause_s = round_pause_s
        self.silent_puts = silent_puts
        self.silent_value_bytes = silent_value_bytes
        self.rounds = 0                       # rounds of maximal calls sent
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        jobs: dict[str, list[Callable[[int], None]]] = {
            "silent_puts": [self._silent_put] * self.silent_puts,
            "stalled_streams": [self._stalled_stream] * 8,
            "silent_flood": [self._never_hello] + [self._silent_unary] * 16,
            "maximal_calls": [self._maximal_calls],
            "reconnect_loop": [self._reconnect_loop],
            "maximal_reads": [self._data_reads] * READERS + [self._stream_reads] * READERS,
        }
        if "maximal_reads" in self.kinds:
            self._store_read_chunks()
        for kind in self.kinds:
            for i, job in enumerate(jobs[kind]):
                thread = threading.Thread(target=job, args=(i,), name=f"hostile-{kind}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def stop(self, within_s: float = STOP_WITHIN_S) -> None:
        """Tell every client to end, and wait ``within_s`` at most, in all, for their threads (daemons: one
        still in a call ends with the process)."""
        self._stop.set()
        deadline = time.monotonic() + within_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the data channel ------------------------------------------------------------------------------------
    def _hello(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.data_port), timeout=5)
        sock.sendall(dw.hello(self.token))
        if sock.recv(1) != bytes([dw.HELLO_OK]):
            sock.close()
            raise ConnectionError("refused")
        return sock

    def _until_closed(self, sock: socket.socket) -> None:
        sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                if sock.recv(1 << 16) == b"":
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def _silent_put(self, i: int) -> None:
        key = bytes([200 + i % 56]) * 32
        head = header_for(key, self.silent_value_bytes - 4096)
        while not self._stop.is_set():
            try:
                with self._hello() as sock:
                    sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(key)
                                 + dw.U64.pack(len(head) + self.silent_value_bytes - 4096) + head + b"\1" * MiB)
                    self._until_closed(sock)
            except OSError:
                self._stop.wait(0.1)

    def _never_hello(self, _: int) -> None:
        socks: list[socket.socket] = []
        while not self._stop.is_set():
            socks = [s for s in socks if not _closed(s)]
            while len(socks) < 256 and not self._stop.is_set():
                try:
                    socks.append(socket.create_connection(("127.0.0.1", self.data_port), timeout=5))
                except OSError:
                    break
            self._stop.wait(0.5)
        for sock in socks:
            sock.close()

    def _reconnect_loop(self, _: int) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self._hello().close()
            self._stop.wait(0.005)

    def _read_keys(self) -> list[bytes]:
        return [bytes([60 + i]) * 32 for i in range(4)]

    def _store_read_chunks(self) -> None:
        """The chunks `maximal_reads` reads: one message of the server's largest size each, stored once."""
        payload = self.max_message - 4096
        with self._hello() as sock:
            for key in self._read_keys():
                head = header_for(key, payload)
                sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(key) + dw.U64.pack(len(head) + payload)
                             + head)
                sock.sendall(bytes(payload))
                if sock.recv(1) not in (bytes([dw.PUT_STORED]), bytes([dw.PUT_PRESENT])):
                    raise ConnectionError("the server did not store the chunks to read")

    def _data_reads(self, i: int) -> None:
        keys = self._read_keys()
        request = dw.REQUEST.pack(dw.OP_GET, NS, len(keys)) + b"".join(dw.key_field(k) for k in keys)
        buf = bytearray(1 << 20)
        while not self._stop.is_set():
            try:
                with self._hello() as sock:
                    while not self._stop.is_set():
                        sock.sendall(request)
                        for _ in keys:
                            (size,) = dw.U64.unpack(_exactly(sock, dw.U64.size))
                            while size:
                                got = sock.recv_into(buf, min(size, len(buf)))
                                if not got:
                                    raise ConnectionError("closed")
                                size -= got
            except OSError:
                self._stop.wait(0.1)

    def _stream_reads(self, i: int) -> None:
        request = pb.GetRequest(namespace=NS, keys=self._read_keys()).SerializeToString()
        options = [("grpc.max_receive_message_length", 1 << 30)]
        with grpc.insecure_channel(self.address, options=options) as channel:
            get = channel.unary_stream(method("Get"), lambda b: b, lambda b: b)
            while not self._stop.is_set():
                try:
                    for _ in get(request, timeout=5, metadata=self.metadata):
                        pass
                except grpc.RpcError:
                    self._stop.wait(0.1)

    # -- gRPC ------------------------------------------------------------------------------------------------
    def _stalled_stream(self, i: int) -> None:
        head = header_for(bytes([128 + i]) * 32, 4 * MiB)
        first = encode_chunk(NS, bytes([128 + i]) * 32, head, b"\0" * MiB, value_len=len(head) + 4 * MiB)
        self._hold("Put", [first])

    def _silent_unary(self, i: int) -> None:
        self._hold("Health" if i % 2 else "Contains", [])

    def _hold(self, name: str, sent: list[bytes]) -> None:
        """Call ``name``, send ``sent`` and then nothing more, for as long as the server lets it stay open; again
        whenever it ends."""
        with grpc.insecure_channel(self.address) as channel:
            call = channel.stream_unary(method(name), lambda b: b, lambda b: b)

            def stream():
                yield from sent
                self._stop.wait(120)
            while not self._stop.is_set():
                try:
                    call(stream(), timeout=120, metadata=self.metadata)
                except grpc.RpcError:
                    self._stop.wait(0.1)

    def _maximal_calls(self, _: int) -> None:
        message = np.random.default_rng(0).integers(0, 256, self.max_message, dtype=np.uint8).tobytes()

        async def rounds() -> None:
            channels = [grpc.aio.insecure_channel(self.address, options=[("grpc.max_send_message_length",
                                                                           1 << 30)]) for _ in range(4)]

            async def one(i: int) -> None:
                channel = channels[i % len(channels)]
                with contextlib.suppress(grpc.aio.AioRpcError):
                    if i % 2:
                        await channel.unary_unary(method("Contains"))(message, timeout=10, metadata=self.metadata)
                    else:
                        await channel.stream_unary(method("Put"))(iter([message]), timeout=10,
                                                                  metadata=self.metadata)
            try:
                while not self._stop.is_set():
                    await asyncio.gather(*(one(i) for i in range(self.calls_per_round)))
                    self.rounds += 1
                    await asyncio.sleep(self.round_pause_s)
            finally:
                for channel in channels:
                    await channel.close()
        asyncio.run(rounds())


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("closed")
        data += got
    return data


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        gone = sock.recv(1) == b""
    except BlockingIOError:
        gone = False
    except OSError:
        gone = True
    if gone:
        sock.close()
    return gone


@dataclass(frozen=True, slots=True)
class TenantRun:
    tenant: str
    hit_ratio: float            # the fresh engine's prompt tokens served from the server's tier
    stores: int                 # chunks the first engine stored on the server
    store_failures: int         # ... and those that failed (refused, or the tier away)
    outputs_match: bool         # the fresh engine generated the tokens the first one did
    ttft_ms_p50: float          # the fresh engine's
    ttft_ms_p99: float          # both engines' requests
    store_planned: int = 0      # stores the first engine planned for the server's tier
    store_dropped: int = 0      # ... given up by the engine (busy, deadline, full queue, ...), by any reason
    store_rejected: int = 0     # ... refused by the server's door

    @property
    def store_success(self) -> float:
        return self.stores / max(1, self.stores + self.store_failures)

    @property
    def uncounted(self) -> int:
        """Planned stores that ended in no counted outcome (stored, rejected, dropped by a reason, failed)."""
        return self.store_planned - self.stores - self.store_rejected - self.store_dropped - self.store_failures


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def tenant_run(tenant: str, address: str, token_file: Path | None, spec: WorkloadSpec,
               engine_cfg: EngineConfig = EngineConfig(num_blocks=64), timeout_s: float = 5.0,
               lookup_timeout_s: float = 0.25) -> TenantRun:
    """``tenant``'s turn: one engine stores ``spec`` through the server (write-through) and waits for its
    stores to end — landed or failed, each within the tier's ``timeout`` — then a fresh one runs it again and
    takes its prefixes from the server (``lookup_timeout`` for its lookups). So a turn measures whether the
    tenant's stores and loads get through, not how soon its first store lands."""
    cfg = TierCacheConfig().replace(keys={"block_size": 16, "chunk_tokens": 64},
                                    cpu={"capacity": "2MiB", "prefault": False},
                                    grpc={"enabled": True, "address": address, "write_mode": "write-through",
                                          "timeout": timeout_s, "lookup_timeout": lookup_timeout_s,
                                          "auth_token_file": str(token_file or "")})
    first = run_workload(spec, engine_cfg, cfg, drain=True)
    second = run_workload(spec, engine_cfg, cfg)
    tier = first.stats["connector"]["tiers"]["grpc"]
    dropped = sum(v for k, v in tier.items() if k.startswith("store_dropped_"))
    return TenantRun(tenant, second.tier_hit_tokens / max(1, second.prompt_tokens), tier["stored"],
                     tier["store_failed"], first.outputs == second.outputs,
                     round(_percentile(second.ttft_s, 0.5) * 1e3, 2),
                     round(_percentile(first.ttft_s + second.ttft_s, 0.99) * 1e3, 2),
                     tier["store_planned"], dropped, tier["store_rejected"])


def main(argv: list[str] | None = None) -> int:
    """Run a `HostileTenant` in a process of its own (as a hostile client is: its load is not the victims'),
    until SIGTERM or SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m tiercache.bench.hostile", description=main.__doc__)
    parser.add_argument("--address", required=True, help="the server's gRPC host:port")
    parser.add_argument("--data-port", type=int, required=True)
    parser.add_argument("--token-file", required=True, help="the hostile tenant's own (valid) token")
    parser.add_argument("--max-message", type=int, required=True, help="the server's --max-message, in bytes")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--calls-per-round", type=int, default=100)
    parser.add_argument("--round-pause", type=float, default=0.2, help="seconds between rounds of maximal calls")
    parser.add_argument("--silent-puts", type=int, default=4, help="silent data-channel PUT connections")
    parser.add_argument("--silent-value-mib", type=int, default=16, help="the value each silent PUT declares")
    args = parser.parse_args(argv)
    token = Path(args.token_file).read_text().strip()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    try:
        tenant = HostileTenant(args.address, args.data_port, token, args.max_message, kinds, args.calls_per_round,
                               args.round_pause, args.silent_puts, args.silent_value_mib * MiB)
    except ValueError as err:
        parser.error(str(err))
    # Blocked before any thread starts (they inherit the mask) and taken by `sigwait`: no handler runs inside a
    # lock another thread or the main one holds, so a SIGTERM is never lost to a deadlock.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    tenant.start()
    print("started", flush=True)
    signal.sigwait(stops)
    tenant.stop(STOP_WITHIN_S)
    print(f"stopped after {tenant.rounds} rounds of maximal calls", flush=True)
    os._exit(0)     # its clients' threads are daemons, some maybe still in a gRPC call: no interpreter shutdown


if __name__ == "__main__":
    raise SystemExit(main())
