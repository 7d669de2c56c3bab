"""`tiercache bench`: the offload benchmarks, each subcommand registered by its own module."""
from __future__ import annotations

import argparse

from tiercache.cli import bench_codecs, bench_engine, bench_route, bench_tiers, bench_trace

SUBCOMMANDS = (bench_tiers, bench_trace, bench_codecs, bench_engine, bench_route)   # in `--help` order


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="offload benchmarks").add_subparsers(dest="bench", required=True)
    for module in SUBCOMMANDS:
        module.register(bench)
