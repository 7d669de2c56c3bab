"""`tiercache serve` with and without hostile clients: the server's memory, and an engine's hits through it.

    python benchmarks/hostile_server.py --repeats 3 --json out.json

One `tiercache serve --capacity 256MiB` on a free loopback port. Each run: a reference engine stores a
shared-prefix workload (write-through to the server), then a fresh engine runs it again and takes its
prefixes from the server; we record the second engine's token hit ratio and time to first token, whether
its tokens match the first's, and the server's peak RSS (sampled from /proc every 50 ms) over the run.
"Hostile" runs do the same while, from threads of this process, clients keep:
  - 12 data-channel PUTs declaring 64 MiB values, sending half of each, then nothing (re-opened when dropped);
  - 8 gRPC Puts declaring a 1 TiB value (refused at once; sent again in a loop);
  - 8 gRPC Put streams that stop mid-chunk (re-opened when the server cancels them);
  - 300 authenticated data-channel connections that say hello and then sit idle (re-opened when dropped);
  - 16 unary gRPC calls (Health, Contains) opened and never sent their request (re-opened as they end).
Quiet and hostile runs alternate; medians are reported.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tiercache.bench.demo import run_workload  # noqa: E402
from tiercache.bench.remote import Subprocess  # noqa: E402
from tiercache.bench.workloads import WorkloadSpec  # noqa: E402
from tiercache.config import TierCacheConfig  # noqa: E402
from tiercache.engine import EngineConfig  # noqa: E402
from tiercache.keys import BlockHash  # noqa: E402
from tiercache.wire import data_frames as dw  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta  # noqa: E402
from tiercache.wire.grpc_messages import encode_chunk, method  # noqa: E402

MiB = 1 << 20
NS = b"\xee" * 16


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def header_for(key: bytes, payload_bytes: int) -> bytes:
    raw = np.zeros(payload_bytes // 2, dtype=np.float16)
    return bytes(ChunkFormat().encode_parts(ChunkMeta(NS, BlockHash(key), 16, "float16", (payload_bytes // 2,)),
                                            raw)[0])


class Hostile:
    """The five kinds of clients above, kept up until `stop`."""

    def __init__(self, address: str, data_port: int) -> None:
        self.address = address
        self.data_port = data_port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._big = header_for(b"b" * 32, 64 * MiB - 4096)
        self._small = header_for(b"s" * 32, 4 * MiB)
        self._part = b"\1" * (32 * MiB)

    def start(self) -> None:
        jobs = ([self._declaring_put] * 12 + [self._one_tib] * 8 + [self._stalled_stream] * 8 + [self._idle_many]
                + [self._silent_unary] * 16)
        for i, job in enumerate(jobs):
            t = threading.Thread(target=job, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)

    def _hello(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.data_port), timeout=5)
        sock.sendall(dw.hello(None))
        if sock.recv(1) != bytes([dw.HELLO_OK]):
            sock.close()
            raise ConnectionError("refused")
        return sock

    def _declaring_put(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                sock = self._hello()
                key = bytes([i]) * 32
                sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(key)
                             + dw.U64.pack(len(self._big) + 64 * MiB - 4096) + self._big)
                sock.sendall(self._part)
                sock.settimeout(0.5)
                while not self._stop.is_set():
                    try:
                        if sock.recv(1) == b"":
                            break       # dropped by the server: open another
                    except TimeoutError:
                        continue
                sock.close()
            except OSError:
                self._stop.wait(0.1)

    def _one_tib(self, i: int) -> None:
        channel = grpc.insecure_channel(self.address)
        put = channel.stream_unary(method("Put"), lambda b: b, lambda b: b)
        first = encode_chunk(NS, bytes([64 + i]) * 32, self._small, b"\0" * MiB, value_len=1 << 40)
        while not self._stop.is_set():
            try:
                put(iter([first]), timeout=5)
            except grpc.RpcError:
                pass
            self._stop.wait(0.05)
        channel.close()

    def _stalled_stream(self, i: int) -> None:
        first = encode_chunk(NS, bytes([128 + i]) * 32, self._small, b"\0" * MiB, value_len=len(self._small) + 4 * MiB)
        self._hold("Put", [first])

    def _silent_unary(self, i: int) -> None:
        self._hold("Health" if i % 2 else "Contains", [])

    def _hold(self, name: str, sent: list[bytes]) -> None:
        """Call ``name``, send ``sent`` and then nothing more, for as long as the server lets it stay open; again
        whenever it ends."""
        channel = grpc.insecure_channel(self.address)
        call = channel.stream_unary(method(name), lambda b: b, lambda b: b)

        def stream():
            yield from sent
            self._stop.wait(120)
        while not self._stop.is_set():
            try:
                call(stream(), timeout=120)
            except grpc.RpcError:
                self._stop.wait(0.1)
        channel.close()

    def _idle_many(self, _: int) -> None:
        socks: list[socket.socket] = []
        while not self._stop.is_set():
            alive = []
            for sock in socks:      # keep the ones still open, replace the ones the server closed
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    sock.close()
                else:
                    alive.append(sock)
            socks = alive
            while len(socks) < 300 and not self._stop.is_set():
                try:
                    socks.append(self._hello())
                except OSError:
                    break
            self._stop.wait(0.5)
        for sock in socks:
            sock.close()


def one_run(address: str, pid: int, spec: WorkloadSpec) -> dict:
    cfg = TierCacheConfig().replace(keys={"block_size": 16, "chunk_tokens": 64},
                                    cpu={"capacity": "4MiB", "prefault": False},
                                    grpc={"enabled": True, "address": address, "write_mode": "write-through",
                                          "timeout": 5.0})
    engine_cfg = EngineConfig(num_blocks=160)
    peak = [rss_mib(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_mib(pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        first = run_workload(spec, engine_cfg, cfg)
        second = run_workload(spec, engine_cfg, cfg)
    finally:
        done.set()
        sampler.join()
    return {"server_rss_peak_mib": round(peak[0], 1),
            "tier_hit_ratio": round(second.tier_hit_tokens / second.prompt_tokens, 4),
            "ttft_ms_p50": round(statistics.median(second.ttft_s) * 1e3, 2),
            "outputs_match": first.outputs == second.outputs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    server = Subprocess("tiercache.cli", "serve", "--capacity", "256MiB", "--log-format", "text")
    channel = grpc.insecure_channel(server.address)
    health = pb.HealthReply.FromString(channel.unary_unary(method("Health"), lambda b: b, lambda b: b)(b"", timeout=5))
    channel.close()
    runs: dict[str, list[dict]] = {"quiet": [], "hostile": []}
    try:
        for rep in range(args.repeats):
            for mode in ("quiet", "hostile") if rep % 2 == 0 else ("hostile", "quiet"):
                spec = WorkloadSpec("shared-prefix", requests=6, prefix_tokens=1024, output_tokens=4, seed=rep)
                hostile = Hostile(server.address, health.data_port) if mode == "hostile" else None
                if hostile:
                    hostile.start()
                    time.sleep(2)       # let them take what they can
                try:
                    runs[mode].append(one_run(server.address, server.proc.pid, spec))
                finally:
                    if hostile:
                        hostile.stop()
                print(mode, runs[mode][-1], file=sys.stderr)
    finally:
        server.close()
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in ("server_rss_peak_mib", "tier_hit_ratio",
                                                                       "ttft_ms_p50")}
               | {"outputs_match": all(r["outputs_match"] for r in rs)} for mode, rs in runs.items()}
    report = {"command": "python benchmarks/hostile_server.py " + " ".join(sys.argv[1:]), "summary": summary,
              "runs": runs}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
