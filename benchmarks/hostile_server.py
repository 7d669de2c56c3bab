"""A shared `tiercache serve` with and without a hostile client: each victim's stores, hits and TTFT under each
attack, the server's memory against its bound, and the targets they are held to.

    python benchmarks/hostile_server.py --repeats 3 --json out.json

One `tiercache serve --capacity 64MiB --max-message 8MiB` with four tenants (acme, beta, rival, and ops, an
admin that reads the counters and purges). A turn: tenants acme and beta, one after the other, each run a reference
engine that stores a shared-prefix workload through the server (write-through), then a fresh engine that
runs it again and takes its prefixes back (`tiercache.bench.hostile.tenant_run`, the gRPC tier's default
timeouts). An attack turn does the same while a `tiercache.bench.hostile.HostileTenant`, in a process of its
own, runs one attack (`ATTACKS`): each kind of hostile client alone as tenant rival, every kind at once, and
``own-silent-puts`` — two silent data-channel PUTs declaring the whole in-flight budget under acme's own token,
the per-connection case. The server's RSS is sampled from /proc every 20 ms throughout a turn.

The victims' engines run in this process, beside the server and the hostile client on the same machine; each
runs its torch ops on one thread (``--engine-threads``). A hostile client runs on a machine of its own and so
does a server; here they share the engines' cores, and an engine whose ops are split across every core waits
at each op for the thread a busy server or client has preempted — which measures this machine, not the
server's fairness (RESULTS.md shows both).

Every turn begins with the victims' chunks purged, so that each stores into the same room: the tenants share
the server's pool, and once their earlier turns have filled it, its eviction, not the hostile client, would
decide which of a turn's new chunks are still there for its second engine.

Each repeat runs a quiet turn and every attack turn (the order reversed on odd repeats), so an attack is
compared with the quiet turn beside it: a victim's stores, hit ratio and TTFT p99 as ratios to that turn's,
and their medians over the repeats. The machine may be shared: side-by-side ratios and medians are what
hold still. The targets (`TARGETS`) are checked on the medians; the exit status is 1 when one is missed.

    python benchmarks/hostile_server.py --soak 120

runs every kind of hostile client against a fresh server for that many seconds instead, and reports the
server's RSS every 5 s beside its bound: memory that a finished call does not give back shows as growth.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tiercache.bench.hostile import KINDS, RssSampler, TenantRun, cpu_seconds, rss_mib, tenant_run  # noqa: E402
from tiercache.bench.remote import Subprocess  # noqa: E402
from tiercache.bench.workloads import WorkloadSpec  # noqa: E402
from tiercache.server.app import ServeConfig  # noqa: E402
from tiercache.server.limits import memory_bound  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.grpc_messages import method  # noqa: E402

MiB = 1 << 20
CAPACITY, MAX_MESSAGE = 64 * MiB, 8 * MiB
VICTIMS = ("acme", "beta")
# attack → (hostile kinds, whose token, extra flags of `python -m tiercache.bench.hostile`)
ATTACKS = {kind.replace("_", "-"): ((kind,), "rival", ()) for kind in KINDS}
ATTACKS["own-silent-puts"] = (("silent_puts",), "acme", ("--silent-puts", "2", "--silent-value-mib", "32"))
ATTACKS["all"] = (KINDS, "rival", ())
TARGETS = {"stores": 0.9, "hit_ratio": 0.8}     # of the quiet turn's, at least
TTFT_P99_MAX = 2.0                              # times the quiet turn's, at most
COUNTERS = ("cpu_waits", "cpu_waited_ms", "streams_taken_back", "inflight_taken_back", "requests_taken_back",
            "data_hello_dropped",
            "data_idle_closed", "data_refused_connections", "rejected_resource_exhausted", "handler_faults")


def call(address: str, name: str, request: bytes, token: str | None = None) -> bytes:
    with grpc.insecure_channel(address) as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return channel.unary_unary(method(name), lambda b: b, lambda b: b)(request, timeout=10, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn: each victim's run, the server's peak RSS, and the CPU the server and the hostile client used
    (in cores: CPU seconds per second of the turn)."""
    runs: dict[str, TenantRun]
    rss_peak_mib: float
    server_cores: float
    hostile_cores: float


def turn(address: str, pid: int, tokens: Path, seed: int, requests: int, hostile_pid: int | None = None) -> Turn:
    start = time.monotonic()
    server_cpu, hostile_cpu = cpu_seconds(pid), cpu_seconds(hostile_pid) if hostile_pid else 0.0
    with RssSampler(pid) as rss:
        runs = {t: tenant_run(t, address, tokens / f"{t}.token",
                              WorkloadSpec("shared-prefix", requests=requests, prefix_tokens=512, output_tokens=2,
                                           seed=seed + i)) for i, t in enumerate(VICTIMS)}
    seconds = time.monotonic() - start
    hostile = (cpu_seconds(hostile_pid) - hostile_cpu) / seconds if hostile_pid else 0.0
    return Turn(runs, rss.peak_mib, (cpu_seconds(pid) - server_cpu) / seconds, hostile)


def purge_victims(address: str, admin_token: str) -> None:
    """Every chunk of the victims gone from the server (no engine of theirs runs to wait for)."""
    for victim in VICTIMS:
        request = pb.PurgeRequest(spec=pb.PurgeSpec(everything=True), tenant=victim, wait_s=0.01)
        call(address, "Purge", request.SerializeToString(), admin_token)


def start_hostile(address: str, data_port: int, tmp: Path, args, attack: str) -> subprocess.Popen:
    """The attack's `HostileTenant`, in a process of its own at the lowest CPU priority — a hostile client runs on
    a machine of its own; here its own work would take the victims' cores, which is no measure of the server —
    given time to take what it can."""
    kinds, whose, extra = ATTACKS[attack]
    hostile = subprocess.Popen(
        [sys.executable, "-m", "tiercache.bench.hostile", "--address", address, "--data-port", str(data_port),
         "--token-file", str(tmp / f"{whose}.token"), "--max-message", str(MAX_MESSAGE), "--kinds", ",".join(kinds),
         "--calls-per-round", str(args.calls_per_round), "--round-pause", str(args.round_pause), *extra],
        stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(19))
    if hostile.stdout.readline().strip() != "started":
        raise RuntimeError(f"the hostile tenant of attack {attack} did not start")
    time.sleep(1.5)
    return hostile


def stop(hostile: subprocess.Popen) -> str:
    hostile.terminate()
    try:
        return hostile.communicate(timeout=90)[0].strip()
    except subprocess.TimeoutExpired:
        hostile.kill()
        return hostile.communicate()[0].strip() + " (killed)"


def soak(server: Subprocess, data_port: int, tmp: Path, args, bound_mib: float) -> int:
    hostile = start_hostile(server.address, data_port, tmp, args, "all")
    series = []
    try:
        with RssSampler(server.proc.pid) as rss:
            for t in range(5, int(args.soak) + 1, 5):
                time.sleep(5)
                series.append((t, round(rss_mib(server.proc.pid), 1)))
                print(f"{t:4d} s  rss {series[-1][1]:7.1f} MiB", file=sys.stderr, flush=True)
    finally:
        stopped = stop(hostile)
    report = {"command": "python benchmarks/hostile_server.py " + " ".join(sys.argv[1:]), "rss_mib": series,
              "peak_mib": round(rss.peak_mib, 1), "memory_bound_mib": round(bound_mib, 1), "hostile": stopped}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def record(done: Turn) -> dict:
    runs = done.runs
    return {"server_rss_peak_mib": round(done.rss_peak_mib, 1), "server_cores": round(done.server_cores, 2),
            "hostile_cores": round(done.hostile_cores, 2)} | {
        t: {"hit_ratio": round(r.hit_ratio, 4), "stores": r.stores, "store_planned": r.store_planned,
            "store_dropped": r.store_dropped, "store_failed": r.store_failures, "uncounted": r.uncounted,
            "ttft_ms_p99": r.ttft_ms_p99, "outputs_match": r.outputs_match} for t, r in runs.items()}


def ratio(attacked: float, quiet: float) -> float:
    return attacked / quiet if quiet else float(attacked == 0)


def summarize(repeats: list[dict[str, dict]], bound_mib: float) -> dict:
    """Per attack and victim, the medians over the repeats of its ratios to the quiet turn beside it; and
    whether every target holds."""
    out = {}
    for attack in repeats[0]:
        if attack == "quiet":
            continue
        row = {"server_rss_peak_mib": max(r[attack]["server_rss_peak_mib"] for r in repeats),
               **{k: statistics.median(r[attack][k] for r in repeats) for k in ("server_cores", "hostile_cores")},
               "quiet_server_cores": statistics.median(r["quiet"]["server_cores"] for r in repeats)}
        for t in VICTIMS:
            pairs = [(r[attack][t], r["quiet"][t]) for r in repeats]
            row[t] = {"stores": statistics.median(ratio(a["stores"], q["stores"]) for a, q in pairs),
                      "hit_ratio": statistics.median(ratio(a["hit_ratio"], q["hit_ratio"]) for a, q in pairs),
                      "ttft_p99": statistics.median(ratio(a["ttft_ms_p99"], q["ttft_ms_p99"]) for a, q in pairs),
                      "uncounted": sum(a["uncounted"] for a, _ in pairs),
                      "store_failed": sum(a["store_failed"] for a, _ in pairs),
                      "outputs_match": all(a["outputs_match"] for a, _ in pairs)}
        row["met"] = (row["server_rss_peak_mib"] <= bound_mib and all(
            all(row[t][k] >= v for k, v in TARGETS.items()) and row[t]["ttft_p99"] <= TTFT_P99_MAX
            and row[t]["uncounted"] == 0 and row[t]["outputs_match"] for t in VICTIMS))
        out[attack] = row
    return out


def table(summary: dict, bound_mib: float) -> str:
    """The summary as Markdown: one row per attack, each victim's median ratios."""
    lines = ["| attack | stores acme / beta | hit ratio acme / beta | TTFT p99 acme / beta | uncounted | "
             f"RSS peak (bound {bound_mib:.0f} MiB) | server / hostile cores | targets |",
             "|---|---|---|---|---|---|---|---|"]
    for attack, row in summary.items():
        a, b = row["acme"], row["beta"]
        lines.append(f"| {attack} | {a['stores']:.2f} / {b['stores']:.2f} | {a['hit_ratio']:.2f} / "
                     f"{b['hit_ratio']:.2f} | {a['ttft_p99']:.2f}× / {b['ttft_p99']:.2f}× | "
                     f"{a['uncounted'] + b['uncounted']} | {row['server_rss_peak_mib']:.0f} MiB | "
                     f"{row['server_cores']:.2f} / {row['hostile_cores']:.2f} | {'met' if row['met'] else 'missed'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="requests per tenant and engine")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of: {', '.join(ATTACKS)}")
    parser.add_argument("--calls-per-round", type=int, default=200, help="the hostile tenant's maximal calls")
    parser.add_argument("--round-pause", type=float, default=1.0)
    parser.add_argument("--soak", type=float, default=0, help="seconds of the hostile tenant alone (see above)")
    parser.add_argument("--cpu-cores", type=float, default=0.0,
                        help="the server's --cpu-cores: the CPU its tenants share (0: the server's default, every "
                             "core; a number above the machine's cores shares none)")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="torch threads of the victims' engines (see above)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.engine_threads < 1:
        parser.error(f"--engine-threads must be at least 1, got {args.engine_threads}")
    import torch
    torch.set_num_threads(args.engine_threads)
    attacks = [a for a in args.attacks.split(",") if a]
    if unknown := set(attacks) - set(ATTACKS):
        parser.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-hostile-"))
    tokens = {name: f"{name}-token-0123456789" for name in (*VICTIMS, "rival", "ops")}
    (tmp / "tenants.toml").write_text("".join(f'[tenants.{n}]\ntoken = "{t}"\n' for n, t in tokens.items())
                                      + "admin = true\npurge = true\n")
    for name, token in tokens.items():
        (tmp / f"{name}.token").write_text(token)
    flags = ("--capacity", str(CAPACITY), "--max-message", str(MAX_MESSAGE), "--read-timeout", "20",
             "--auth-token-file", str(tmp / "tenants.toml"), "--cpu-cores", str(args.cpu_cores))
    config = ServeConfig(capacity=CAPACITY, max_message=MAX_MESSAGE, read_timeout=20)
    bound_mib = memory_bound(config.limits(), CAPACITY, MAX_MESSAGE) / MiB
    server = Subprocess("tiercache.cli", "serve", *flags)
    data_port = pb.HealthReply.FromString(call(server.address, "Health", b"")).data_port
    if args.soak:
        try:
            return soak(server, data_port, tmp, args, bound_mib)
        finally:
            server.close()
    repeats: list[dict[str, dict]] = []
    try:
        # unrecorded: a first turn pays this process's and the server's start-up, not the first quiet turn
        turn(server.address, server.proc.pid, tmp, seed=-100, requests=1)
        for rep in range(args.repeats):
            order = ["quiet", *attacks]
            repeats.append({})
            for i, mode in enumerate(order if rep % 2 == 0 else order[::-1]):
                purge_victims(server.address, tokens["ops"])
                hostile = start_hostile(server.address, data_port, tmp, args, mode) if mode != "quiet" else None
                try:
                    done = turn(server.address, server.proc.pid, tmp, seed=1000 * rep + 10 * i,
                                requests=args.requests, hostile_pid=hostile.pid if hostile else None)
                finally:
                    if hostile is not None:
                        stop(hostile)
                repeats[-1][mode] = record(done)
                print(rep, mode, json.dumps(repeats[-1][mode]), file=sys.stderr, flush=True)
        counters = dict(pb.StatsReply.FromString(call(server.address, "Stats", b"", tokens["ops"])).counters)
    finally:
        server.close()
    summary = summarize(repeats, bound_mib)
    report = {"command": "python benchmarks/hostile_server.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
              "date": time.strftime("%Y-%m-%d"), "memory_bound_mib": round(bound_mib, 1), "summary": summary,
              "server_counters": {k: counters.get(k, 0) for k in COUNTERS}, "turns": repeats}
    print(table(summary, bound_mib))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row["met"] for row in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
