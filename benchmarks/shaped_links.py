"""`tiercache bench tiers` or `bench route` over links of a given speed: the network as a NIC of R bit/s, the
disk's reads at B/s.

    sudo python benchmarks/shaped_links.py --rates 5gbit,10gbit,none --runs 3 --json out.json \
        -- --tiers redis,grpc --codecs raw,int8,fp8-e4m3 --total-mib 512 --reps 3
    sudo python benchmarks/shaped_links.py --rates none --disk-read-rate 1GB --runs 3 \
        -- --tiers disk --codecs raw,int8 --total-mib 512 --reps 3
    sudo python benchmarks/shaped_links.py --bench route --rates 320mbit,none --burst 256kb --latency 200ms \
        --runs 2 -- --replicas 2 --shared yes --overhead-pairs 0

On one machine the "network" is loopback, which moves bytes as fast as the cores copy them, and a quantized
chunk's gain depends on how the link compares with the codec. Each run here is a fresh `tiercache bench
tiers` (its own redis-server and `tiercache serve`) in a network namespace of its own (``unshare --net``)
whose loopback is shaped by the kernel's token bucket (``tc qdisc ... tbf rate R``): real sockets, real TCP,
at a NIC's rate; requests and replies share the one queue, as a half-duplex link would. ``none`` leaves
loopback as it is. ``--disk-read-rate`` caps the reads of the benchmark's disk (the device under
``--disk-path``, else $TMPDIR) with the cgroup block-I/O throttle, as a cloud volume's provisioned
throughput would; writes go through the page cache, so measure durable writes with ``--fsync``.

Needs root (a network namespace, tc, a cgroup). Reports, per rate, tier and codec, the median over runs
of tokens/s and of the gain against the first codec in the same run; with ``--bench route`` (the router, its
replicas and their shared server all inside the namespace, so the KV a replica loads from the server crosses
the shaped loopback, and so do the router's requests, a few KB each), per rate, fleet and policy, the medians
of time to first token, of its p50 against round-robin's in the same run, and of the turns moved between
replicas.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tiercache.config import parse_size
from tiercache.errors import ConfigError

BURST = "4mb"       # the token bucket's depth: a few 64 KiB loopback packets beyond one 4 MiB send
LATENCY = "20ms"    # how long a packet may queue for tokens before tbf drops it
# A send smaller than the bucket passes at loopback's speed: for `bench tiers`' multi-MiB transfers the 4 MiB
# bucket is a rounding, for a router's fleet whose moved turns load 0.5-1.5 MiB it is the whole link (RESULTS.md,
# "A shared server behind a slower link"): give that one --burst 256kb (a few loopback packets) to make every
# load pay for its bytes, and --latency 200ms so that the queue it builds is delayed rather than dropped.


def fail(message: str) -> None:
    print(f"shaped_links: {message}", file=sys.stderr)
    sys.exit(2)


class ReadThrottle:
    """A cgroup whose reads from one block device are capped (v2 ``io.max``, else v1 blkio throttle)."""

    def __init__(self, path: Path, rate: int) -> None:
        st = os.stat(path)
        self.device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "io" in v2.read_text().split():
            self.dir = Path("/sys/fs/cgroup") / f"tiercache-shaped-{os.getpid()}"
            setting, value = "io.max", f"{self.device} rbps={rate}"
        elif Path("/sys/fs/cgroup/blkio").is_dir():
            self.dir = Path("/sys/fs/cgroup/blkio") / f"tiercache-shaped-{os.getpid()}"
            setting, value = "blkio.throttle.read_bps_device", f"{self.device} {rate}"
        else:
            fail("--disk-read-rate: no cgroup io controller (v2 io.max or v1 blkio) is mounted here")
        try:
            self.dir.mkdir(exist_ok=True)
            (self.dir / setting).write_text(value)
        except OSError as err:
            fail(f"--disk-read-rate: cannot cap reads of device {self.device} in {self.dir}: {err.strerror}")

    def enter_command(self) -> str:
        return f"echo $$ > {self.dir / 'cgroup.procs'}"

    def close(self) -> None:
        with contextlib.suppress(OSError):    # a process still in it: the kernel keeps the group until it ends
            self.dir.rmdir()


def in_shaped_namespace(rate: str, command: list[str], throttle: ReadThrottle | None = None,
                        burst: str = BURST, latency: str = LATENCY) -> subprocess.CompletedProcess:
    """Run ``command`` in a network namespace of its own whose loopback moves ``rate`` (tc's units, or
    ``none``) through a token bucket of ``burst``, its disk reads capped by ``throttle`` if given; output
    captured."""
    steps = ["ip link set lo up"]
    if rate != "none":
        steps.append(f"tc qdisc add dev lo root tbf rate {rate} burst {burst} latency {latency}")
    if throttle is not None:
        steps.append(throttle.enter_command())
    steps.append("exec " + " ".join(f"'{a}'" for a in command))
    return subprocess.run(["unshare", "--net", "sh", "-c", " && ".join(steps)], capture_output=True, text=True)


def run_once(rate: str, name: str, bench_args: list[str], throttle: ReadThrottle | None, burst: str,
             latency: str) -> dict:
    """One fresh `tiercache bench NAME` at loopback ``rate``: its JSON report."""
    with tempfile.TemporaryDirectory(prefix="tiercache-shaped-") as tmp:
        out = Path(tmp) / "run.json"
        bench = [sys.executable, "-m", "tiercache.cli", "bench", name, *bench_args, "--quiet", "--json", str(out)]
        done = in_shaped_namespace(rate, bench, throttle, burst, latency)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            fail(f"the run at rate {rate} failed: {tail[0]}")
        return json.loads(out.read_text())


def summarize_route(runs: dict[str, list[dict]]) -> list[dict]:
    """Per rate, fleet (replicas, shared server) and policy: medians over the runs."""
    rows = []
    for rate, reports in runs.items():
        fleets: dict[tuple, list[dict]] = {}
        for report in reports:
            by_fleet: dict[tuple, list[dict]] = {}
            for run in report["runs"]:
                by_fleet.setdefault((run["replicas"], run["shared_server"]), []).append(run)
            for fleet, fleet_runs in by_fleet.items():
                rr = next((r["ttft_ms_p50"] for r in fleet_runs if r["policy"] == "round-robin"), None)
                for run in fleet_runs:
                    fleets.setdefault((*fleet, run["policy"]), []).append(
                        {**run, "p50_vs_rr": run["ttft_ms_p50"] / rr if rr else None})
        for (replicas, shared, policy), per_run in fleets.items():
            ratios = [r["p50_vs_rr"] for r in per_run if r["p50_vs_rr"] is not None]
            rows.append({"rate": rate, "replicas": replicas, "shared_server": shared, "policy": policy,
                         "runs": len(per_run),
                         **{k: statistics.median(r[k] for r in per_run)
                            for k in ("ttft_ms_p50", "ttft_ms_p99", "moved", "throughput_req_s")},
                         "p50_vs_rr": statistics.median(ratios) if ratios else None,
                         "ttft_ms_p50_runs": [r["ttft_ms_p50"] for r in per_run],
                         "ttft_ms_p99_runs": [r["ttft_ms_p99"] for r in per_run]})
    return rows


def print_route(rows: list[dict]) -> None:
    print("| link | replicas | shared server | policy | TTFT p50 ms | p50 / round-robin's | p99 ms | moved turns "
          "| req/s |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{r['p50_vs_rr']:.2f}" if r["p50_vs_rr"] is not None else "–"
        print(f"| {r['rate']} | {r['replicas']} | {'yes' if r['shared_server'] else 'no'} | {r['policy']} | "
              f"{r['ttft_ms_p50']:.0f} | {ratio} | {r['ttft_ms_p99']:.0f} | {r['moved']:.0f} | "
              f"{r['throughput_req_s']:.1f} |")


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for rate, reports in runs.items():
        keys = [(g["tier"], g["codec"]) for g in reports[0]["codec_gains"]]
        for tier, codec in keys:
            per_run = [next(g for g in r["codec_gains"] if (g["tier"], g["codec"]) == (tier, codec)) for r in reports]
            rows.append({"rate": rate, "tier": tier, "codec": codec, "runs": len(per_run),
                         **{k: statistics.median(g[k] for g in per_run)
                            for k in ("put_tokens_per_s", "get_tokens_per_s", "put_gain", "get_gain")},
                         "put_gain_runs": [g["put_gain"] for g in per_run],
                         "get_gain_runs": [g["get_gain"] for g in per_run]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="5gbit,10gbit,none",
                   help="comma-separated loopback rates in tc's units (5gbit, 800mbit, ...), or none")
    p.add_argument("--disk-read-rate", help="cap the disk's reads at this many bytes/s (500MB, 1GiB, ...)")
    p.add_argument("--runs", type=int, default=3, help="fresh benchmark runs per rate (medians are reported)")
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument("--bench", choices=("tiers", "route"), default="tiers", help="which benchmark runs over the link")
    p.add_argument("--burst", default=BURST, help=f"the link's token bucket, in tc's units (default {BURST})")
    p.add_argument("--latency", default=LATENCY,
                   help=f"how long a packet may wait for tokens before it is dropped (default {LATENCY})")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then that `tiercache bench` command's flags")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if os.geteuid() != 0:
        fail("needs root: it makes a network namespace, shapes its loopback with tc and may make a cgroup")
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            fail(f"{tool} is not installed (util-linux, iproute2)")
    if args.runs < 1:
        fail(f"--runs {args.runs}: must be at least 1")
    throttle = None
    if args.disk_read_rate:
        where = next((bench_args[i + 1] for i, a in enumerate(bench_args[:-1]) if a == "--disk-path"),
                     tempfile.gettempdir())
        try:
            rate = parse_size(args.disk_read_rate, "--disk-read-rate")
        except ConfigError as err:
            fail(str(err))
        throttle = ReadThrottle(Path(where), rate)
    runs: dict[str, list[dict]] = {}
    try:
        for run in range(args.runs):
            for rate in args.rates.split(","):        # rates interleaved: drift hits them alike
                runs.setdefault(rate, []).append(run_once(rate, args.bench, bench_args, throttle, args.burst,
                                                          args.latency))
                print(f"run {run + 1}/{args.runs} at {rate}: done", file=sys.stderr)
    finally:
        if throttle is not None:
            throttle.close()
    if args.bench == "route":
        rows = summarize_route(runs)
        print_route(rows)
    else:
        rows = summarize(runs)
        print("| link | tier | codec | put tokens/s | get tokens/s | put gain | get gain |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['rate']} | {r['tier']} | {r['codec']} | {r['put_tokens_per_s']:,.0f} | "
                  f"{r['get_tokens_per_s']:,.0f} | {r['put_gain']:.2f}× | {r['get_gain']:.2f}× |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "disk_read_rate": args.disk_read_rate,
                                               "burst": args.burst, "latency": args.latency,
                                               "summary": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
