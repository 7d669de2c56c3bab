"""A shared `tiercache serve` with and without a hostile tenant: each other tenant's hits, stores and TTFT, and
the server's memory against its bound.

    python benchmarks/hostile_server.py --repeats 3 --json out.json

One `tiercache serve --capacity 64MiB --max-message 8MiB` with four tenants (acme, beta, rival, and ops, an
admin that reads the counters). A turn: tenants acme and beta, one after the other, each run a reference
engine that stores a shared-prefix workload through the server (write-through), then a fresh engine that
runs it again and takes its prefixes back (`tiercache.bench.hostile.tenant_run`, the gRPC tier's default
timeouts). A hostile turn does the same while tenant rival — a valid token, a process of its own — runs
every kind of `tiercache.bench.hostile.HostileTenant` at once: silent data-channel PUTs holding the
in-flight budget, stalled Put streams, a flood of data connections that never say hello and of unary calls
that never send their request, rounds of concurrent maximal Puts and Contains, and a reconnect loop. The
server's RSS is sampled from /proc every 20 ms throughout a turn. Quiet and hostile turns alternate;
medians over the repeats are reported, per tenant.

    python benchmarks/hostile_server.py --soak 120

runs the hostile tenant alone against a fresh server for that many seconds instead, and reports the
server's RSS every 5 s beside its bound: memory that a finished call does not give back shows as growth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tiercache.bench.hostile import RssSampler, TenantRun, rss_mib, tenant_run  # noqa: E402
from tiercache.bench.remote import Subprocess  # noqa: E402
from tiercache.bench.workloads import WorkloadSpec  # noqa: E402
from tiercache.server.app import ServeConfig  # noqa: E402
from tiercache.server.limits import memory_bound  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.grpc_messages import method  # noqa: E402

MiB = 1 << 20
CAPACITY, MAX_MESSAGE = 64 * MiB, 8 * MiB
VICTIMS = ("acme", "beta")
COUNTERS = ("streams_taken_back", "inflight_taken_back", "requests_taken_back", "data_hello_dropped",
            "data_idle_closed", "data_refused_connections", "rejected_resource_exhausted", "handler_faults")


def call(address: str, name: str, request: bytes, token: str | None = None) -> bytes:
    with grpc.insecure_channel(address) as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return channel.unary_unary(method(name), lambda b: b, lambda b: b)(request, timeout=10, metadata=metadata)


def turn(address: str, pid: int, tokens: Path, seed: int, requests: int) -> tuple[dict[str, TenantRun], float]:
    with RssSampler(pid) as rss:
        runs = {t: tenant_run(t, address, tokens / f"{t}.token",
                              WorkloadSpec("shared-prefix", requests=requests, prefix_tokens=512, output_tokens=2,
                                           seed=seed + i)) for i, t in enumerate(VICTIMS)}
    return runs, rss.peak_mib


def start_rival(address: str, data_port: int, tmp: Path, args) -> subprocess.Popen:
    """Tenant rival's `HostileTenant`, in a process of its own, given time to take what it can."""
    rival = subprocess.Popen(
        [sys.executable, "-m", "tiercache.bench.hostile", "--address", address, "--data-port", str(data_port),
         "--token-file", str(tmp / "rival.token"), "--max-message", str(MAX_MESSAGE),
         "--calls-per-round", str(args.calls_per_round), "--round-pause", str(args.round_pause)],
        stdout=subprocess.PIPE, text=True)
    if rival.stdout.readline().strip() != "started":
        raise RuntimeError("the hostile tenant did not start")
    time.sleep(1.5)
    return rival


def soak(server: Subprocess, data_port: int, tmp: Path, args, bound_mib: float) -> int:
    rival = start_rival(server.address, data_port, tmp, args)
    series = []
    try:
        with RssSampler(server.proc.pid) as rss:
            for t in range(5, int(args.soak) + 1, 5):
                time.sleep(5)
                series.append((t, round(rss_mib(server.proc.pid), 1)))
                print(f"{t:4d} s  rss {series[-1][1]:7.1f} MiB", file=sys.stderr, flush=True)
    finally:
        rival.terminate()
        stopped = rival.communicate(timeout=90)[0].strip()
    report = {"command": "python benchmarks/hostile_server.py " + " ".join(sys.argv[1:]), "rss_mib": series,
              "peak_mib": round(rss.peak_mib, 1), "memory_bound_mib": round(bound_mib, 1), "hostile": stopped}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests per tenant and turn")
    parser.add_argument("--calls-per-round", type=int, default=200, help="the hostile tenant's maximal calls")
    parser.add_argument("--round-pause", type=float, default=1.0)
    parser.add_argument("--soak", type=float, default=0, help="seconds of the hostile tenant alone (see above)")
    parser.add_argument("--json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-hostile-"))
    tokens = {name: f"{name}-token-0123456789" for name in (*VICTIMS, "rival", "ops")}
    (tmp / "tenants.toml").write_text("".join(f'[tenants.{n}]\ntoken = "{t}"\n' for n, t in tokens.items())
                                      + "admin = true\n")
    for name, token in tokens.items():
        (tmp / f"{name}.token").write_text(token)
    flags = ("--capacity", str(CAPACITY), "--max-message", str(MAX_MESSAGE), "--read-timeout", "20",
             "--auth-token-file", str(tmp / "tenants.toml"))
    config = ServeConfig(capacity=CAPACITY, max_message=MAX_MESSAGE, read_timeout=20)
    bound_mib = memory_bound(config.limits(), CAPACITY, MAX_MESSAGE) / MiB
    server = Subprocess("tiercache.cli", "serve", *flags)
    data_port = pb.HealthReply.FromString(call(server.address, "Health", b"")).data_port
    turns: dict[str, list[dict]] = {"quiet": [], "hostile": []}
    if args.soak:
        try:
            return soak(server, data_port, tmp, args, bound_mib)
        finally:
            server.close()
    try:
        for rep in range(args.repeats):
            for mode in ("quiet", "hostile") if rep % 2 == 0 else ("hostile", "quiet"):
                rival = start_rival(server.address, data_port, tmp, args) if mode == "hostile" else None
                try:
                    runs, peak = turn(server.address, server.proc.pid, tmp, seed=100 * rep + 10 * (mode == "hostile"),
                                      requests=args.requests)
                finally:
                    if rival is not None:
                        rival.terminate()
                        rival.communicate(timeout=90)
                record = {"server_rss_peak_mib": round(peak, 1)} | {
                    t: {"hit_ratio": round(r.hit_ratio, 4), "store_success": round(r.store_success, 4),
                        "stores": r.stores, "store_failures": r.store_failures, "ttft_ms_p50": r.ttft_ms_p50,
                        "outputs_match": r.outputs_match} for t, r in runs.items()}
                turns[mode].append(record)
                print(mode, json.dumps(record), file=sys.stderr, flush=True)
        counters = dict(pb.StatsReply.FromString(call(server.address, "Stats", b"", tokens["ops"])).counters)
    finally:
        server.close()
    summary = {mode: {"server_rss_peak_mib": statistics.median(r["server_rss_peak_mib"] for r in rs)} | {
        t: {k: statistics.median(r[t][k] for r in rs) for k in ("hit_ratio", "store_success", "ttft_ms_p50")}
        | {"outputs_match": all(r[t]["outputs_match"] for r in rs)} for t in VICTIMS} for mode, rs in turns.items()}
    summary["memory_bound_mib"] = round(bound_mib, 1)
    summary["server_counters"] = {k: counters.get(k, 0) for k in COUNTERS}
    report = {"command": "python benchmarks/hostile_server.py " + " ".join(sys.argv[1:]), "summary": summary,
              "turns": turns}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
