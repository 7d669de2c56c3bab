"""`tiercache bench engine`: reference-engine workloads across tier setups, or preemption modes side by side
under memory pressure, with its flags."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiercache.cli.common import command_line, write_json
from tiercache.cli.options import (
    add_config_flags,
    add_report_flags,
    add_reps_flag,
    positive,
    preemption_list,
    pressure_list,
)
from tiercache.config import load_config
from tiercache.errors import ConfigError


def register(bench: argparse._SubParsersAction) -> None:
    e = bench.add_parser("engine", help="reference-engine workloads across tier setups")
    e.add_argument("--workloads", default="shared-prefix,multi-turn,long-doc,no-reuse",
                   help="comma-separated: shared-prefix, multi-turn, long-doc, no-reuse")
    e.add_argument("--setups", default="none,cpu,cpu+disk",
                   help="comma-separated: none, cpu, cpu+disk, cpu+redis, cpu+disk+redis (against redis.url), "
                        "cpu+grpc, cpu+disk+grpc (a tiercache serve started for the run)")
    e.add_argument("--requests", type=positive, default=8)
    e.add_argument("--prefix-tokens", type=positive, default=1024)
    e.add_argument("--suffix-tokens", type=positive, default=64)
    e.add_argument("--output-tokens", type=positive, default=8)
    e.add_argument("--preemption", type=preemption_list, metavar="MODES",
                   help="instead of the setups: these preemption modes (e.g. recompute,swap,auto) side by side "
                        "under memory pressure, on the --pressure workloads, each with an L1 to swap to")
    e.add_argument("--pressure", type=pressure_list, default=["long-decode", "short", "shared-prefix"],
                   help="with --preemption: comma-separated, of long-decode, short, shared-prefix")
    add_reps_flag(e, 3, "with --preemption: runs per mode (medians)")
    add_report_flags(e, "engine.json, engine.md and engine.png")
    add_config_flags(e)
    e.set_defaults(func=cmd_bench_engine)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    if args.preemption:
        return _bench_preemption(args)
    from tqdm import tqdm

    from tiercache.bench.engine import SETUPS, bench_engine
    from tiercache.bench.engine_report import HEADERS, rows, write_engine_reports
    from tiercache.bench.report import print_table
    from tiercache.bench.workloads import WorkloadSpec
    from tiercache.engine import EngineConfig

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ConfigError("--setups", ",".join(unknown), f"unknown setup; known: {', '.join(SETUPS)}")
    workloads = [WorkloadSpec(w, requests=args.requests, prefix_tokens=args.prefix_tokens,
                              suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens)
                 for w in args.workloads.split(",")]
    base = load_config(args.config, overrides=args.set).replace(keys={"block_size": 16})
    total = sum(s.requests if s.name != "multi-turn" else max(1, s.requests // s.turns) * s.turns
                for s in workloads) * (len(setups) + 1)
    with tqdm(total=total, desc="bench engine", file=sys.stderr, disable=args.quiet) as bar:
        report = bench_engine(workloads, setups, EngineConfig(), base, progress=lambda: bar.update(1))
    report["command"] = command_line()
    if args.out:
        write_engine_reports(Path(args.out), report)
    write_json(args.json, report)
    print_table("engine benchmark (requests one after another)", HEADERS, rows(report["results"]), 120)
    return 0 if all(r["outputs_match_baseline"] for r in report["results"]) else 1


def _bench_preemption(args: argparse.Namespace) -> int:
    """`bench engine --preemption`: the modes side by side under memory pressure (`tiercache.bench.preemption`)."""
    from tqdm import tqdm

    from tiercache.bench.engine_report import preemption_headers, preemption_rows, write_preemption_reports
    from tiercache.bench.preemption import PRESSURE_WORKLOADS, bench_preemption
    from tiercache.bench.report import print_table

    base = load_config(args.config, overrides=args.set).replace(keys={"block_size": 16})
    workloads = [PRESSURE_WORKLOADS[w] for w in args.pressure]
    with tqdm(total=len(workloads) * len(args.preemption) * args.reps, desc="bench engine --preemption",
              file=sys.stderr, disable=args.quiet) as bar:
        report = bench_preemption(workloads, args.preemption, base, args.reps, progress=lambda: bar.update(1))
    report["command"] = command_line()
    if args.out:
        write_preemption_reports(Path(args.out), report, args.preemption[0], args.reps)
    write_json(args.json, report)
    print_table(f"preemption under memory pressure (medians of {args.reps} runs)",
                preemption_headers(args.preemption[0]), preemption_rows(report["results"]), 120)
    return 0 if all(r["outputs_match"] for r in report["results"]) else 1
