"""`tiercache bench route`: a multi-replica chat workload through `tiercache route`, each routing policy in turn,
with its flags."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import signal
import sys
from pathlib import Path

from tiercache.cli.common import command_line, ready_directory, write_json
from tiercache.cli.options import add_report_flags, int_list, positive, positive_float, routing_list
from tiercache.config import load_config
from tiercache.errors import ConfigError, TierCacheError

SHARED = {"no": [False], "yes": [True], "both": [False, True]}    # `--shared`: replicas over a `tiercache serve`


def register(bench: argparse._SubParsersAction) -> None:
    rb = bench.add_parser("route", help="a multi-replica chat workload through `tiercache route`, each policy in "
                                        "turn: TTFT, throughput, hit ratio, load imbalance, prediction error")
    rb.add_argument("--replicas", type=int_list, default=[2, 4], help="fleet sizes, e.g. 2,4")
    rb.add_argument("--policies", type=routing_list,
                    default=["round-robin", "least-loaded", "prefix-affinity", "expected-ttft"],
                    help="comma-separated routing policies")
    rb.add_argument("--shared", choices=list(SHARED), default="both",
                    help="replicas with a shared `tiercache serve` under their L1 (yes), without (no), or both")
    rb.add_argument("--conversations", type=positive, default=120,
                    help="about 3.8 requests each; enough that a p99 is not the opening seconds' second slowest")
    rb.add_argument("--max-turns", type=positive, default=8)
    rb.add_argument("--system-prompts", type=positive, default=4)
    rb.add_argument("--system-tokens", type=positive, default=1200)
    rb.add_argument("--user-tokens", type=positive, default=300)
    rb.add_argument("--output-tokens", type=positive, default=8)
    rb.add_argument("--rate", type=positive_float, default=4.0,
                    help="conversations started per second (the default keeps two reference-engine replicas on a "
                         "2-core machine busy without saturating them)")
    rb.add_argument("--seed", type=int, default=0)
    rb.add_argument("--replica-set", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                    help="a config field for every replica (repeatable), e.g. keys.chunk_tokens=64: what a "
                         "deployment's settings do to the routing comparison")
    rb.add_argument("--overhead-pairs", type=int, default=30,
                    help="requests alternated direct and through the router to measure its overhead (0: skip)")
    add_report_flags(rb, "route.json, route.md and route.png")
    rb.set_defaults(func=cmd_bench_route)


def cmd_bench_route(args: argparse.Namespace) -> int:
    from tiercache.bench import route

    for module, extra in (("aiohttp", "fleet"), ("zmq", "fleet"), ("msgspec", "fleet"),
                          ("prometheus_client", "metrics")):
        if importlib.util.find_spec(module) is None:
            raise TierCacheError(f"bench route needs {module}, which is not installed: "
                                 f"pip install 'tiercache[{extra}]'")
    out = ready_directory(args.out, "--out")
    _check_replica_set(args.replica_set)
    workload = route.RouteWorkload(conversations=args.conversations, max_turns=args.max_turns,
                                   system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                                   user_tokens=args.user_tokens, output_tokens=args.output_tokens, rate=args.rate,
                                   seed=args.seed)
    # Stopped with SIGTERM, the bench unwinds as on Ctrl-C, so the fleet it started (replicas, router, server:
    # processes of their own) is stopped by `run_one`'s `finally` rather than left running.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    report = _run_fleets(args, workload)
    data = {**report.as_dict(), "command": command_line(), "machine": platform.node()}
    if out:
        _write_files(Path(out), data, report.overhead)
    write_json(args.json, data)
    if not args.quiet:
        _print(data, report.overhead)
    return 0


def _check_replica_set(pairs: list[str]) -> None:
    """A bad field or value of ``--replica-set`` is one line, before any replica starts."""
    try:
        load_config(env={}, overrides=pairs)
    except ConfigError as err:
        if err.field != "--set":
            raise
        raise ConfigError("--replica-set", err.value, err.reason) from None


def _run_fleets(args: argparse.Namespace, workload):
    """Each fleet size, with and without a shared server as asked, under each policy in turn."""
    from tqdm import tqdm

    from tiercache.bench import route

    fleets = [(n, s) for n in args.replicas for s in SHARED[args.shared]]
    requests = sum(len(c.questions) for c in route.conversations(workload))
    report = route.RouteReport(dataclasses.asdict(workload))
    with tqdm(total=requests * len(fleets) * len(args.policies), desc="bench route", file=sys.stderr,
              disable=args.quiet) as bar:
        for n, shared in fleets:
            for policy in args.policies:
                bar.set_postfix_str(f"{n} replicas{' + serve' if shared else ''}, {policy}")
                report.runs.append(route.run_one(n, policy, shared, workload, progress=lambda: bar.update(1),
                                                 replica_set=tuple(args.replica_set)))
    if args.overhead_pairs > 0:
        report.overhead = route.router_overhead(args.overhead_pairs)
    return report


def _write_files(out: Path, data: dict, overhead: dict | None) -> None:
    """route.json, route.md and route.png in ``out``."""
    from tiercache.bench import route
    from tiercache.bench.report import markdown_table
    from tiercache.bench.report import write_json as write

    write(out / "route.json", data)
    text = "# Routing benchmark\n\n" + markdown_table(route.HEADERS, route.rows(data))
    if overhead:
        text += "\nRouter overhead: " + json.dumps(overhead) + "\n"
    (out / "route.md").write_text(text)
    route.plot(out / "route.png", data)


def _print(data: dict, overhead: dict | None) -> None:
    """A column per run, a row per figure: readable in 80 columns."""
    from rich.console import Console
    from rich.table import Table

    from tiercache.bench import route

    rows = route.rows(data)
    table = Table(title="bench route")
    table.add_column("")
    for row in rows:
        table.add_column(f"{row[0]} replicas{' + serve' if row[1] == 'yes' else ''}, {row[2]}")
    for i, header in enumerate(route.HEADERS[3:], start=3):
        table.add_row(header, *(str(row[i]) for row in rows))
    Console().print(table)
    if overhead:
        Console().print(f"router overhead: {overhead}")
