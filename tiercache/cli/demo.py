"""`tiercache demo`: a workload on the reference engine, cold and then cached, with its flags."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiercache.arith import ceil_div
from tiercache.cli.common import command_line, named_by_flags, offload_config, write_json
from tiercache.cli.options import (
    add_block_size_flag,
    add_config_flags,
    add_report_flags,
    add_tier_flags,
    port,
    positive,
)
from tiercache.errors import ConfigError

DEMO_DEFAULTS = {"cpu": {"capacity": "16MiB"}}   # L1 below the workload too, so chunks also come back from disk
DEMO_L0_BLOCKS = 160                               # the engine's own pool, below the docs workload too


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="a workload on the reference engine, cold vs cached")
    d.add_argument("--workload", choices=["docs", "shared-prefix", "multi-turn", "long-doc", "no-reuse"],
                   default="docs", help="docs (default): several documents, some asked about again soon, some long "
                                        "after; shared-prefix: one system prompt; ...")
    add_tier_flags(d, ["cpu", "disk"],
                   tiers_help="tiers below L0 (default cpu,disk): cpu, cpu,disk, cpu,redis, cpu,grpc, cpu,disk,grpc "
                              "... or none",
                   disk_help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2, kept across runs)",
                   redis_help="L3 Redis server for --tiers cpu,redis (default: redis.url)",
                   grpc_help="L3 `tiercache serve` host:port for --tiers cpu,grpc (default: grpc.address)")
    d.add_argument("--requests", type=positive, default=16)
    d.add_argument("--prefix-tokens", type=positive, default=2048, help="shared prefix / history / document length")
    d.add_argument("--suffix-tokens", type=positive, default=64, help="per-request question or user turn")
    d.add_argument("--output-tokens", type=positive, default=8)
    add_block_size_flag(d)
    d.add_argument("--l0-blocks", type=positive, default=None,
                   help="blocks in the engine's own pool (default: 160, or what the workload's longest request "
                        "needs if more: less than the workload, as in production)")
    d.add_argument("--no-prefix-caching", action="store_true", help="no L0 hits: every hit comes from a tier")
    d.add_argument("--model", choices=["llama", "hybrid"], default="llama",
                   help="llama (default): full attention in every layer; hybrid: sliding-window, linear-attention "
                        "and full-attention layers, stored per KV-cache group")
    d.add_argument("--metrics-port", type=port, help="serve Prometheus metrics of the cached run on this port")
    add_report_flags(d, "demo.json, demo.md and demo.png")
    add_config_flags(d)
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from tiercache.bench.demo import demo
    from tiercache.bench.demo_report import print_report, write_files
    from tiercache.bench.workloads import WorkloadSpec
    from tiercache.engine.config import HYBRID_MODEL

    spec = WorkloadSpec(args.workload, requests=args.requests, prefix_tokens=args.prefix_tokens,
                        suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens)
    engine_cfg = _engine_config(args, spec)
    offload = offload_config(args, base=DEMO_DEFAULTS)
    progress = _Progress(args, spec, offload)
    try:
        with named_by_flags({"metrics_port": "--metrics-port", "engine.num_blocks": "--l0-blocks"}):
            report = demo(spec, offload, engine_cfg, progress=progress.step, started=progress.start,
                          metrics_port=args.metrics_port, model_cfg=HYBRID_MODEL if args.model == "hybrid" else None)
    finally:
        progress.close()
    report["command"] = command_line()
    write_json(args.json, report)
    print_report(report, ",".join(args.tiers) or "none")
    if args.out:
        write_files(Path(args.out), report)
    return 0 if report["outputs_match"] else 1


def _engine_config(args: argparse.Namespace, spec):
    """The engine's pool: ``--l0-blocks``, else `DEMO_L0_BLOCKS` or what the longest request needs if more."""
    from tiercache.engine import EngineConfig

    needed = ceil_div(spec.max_tokens, args.block_size)
    if args.l0_blocks is not None and args.l0_blocks < needed:
        raise ConfigError("--l0-blocks", args.l0_blocks, f"the {spec.name} workload's longest request needs {needed} "
                                                         f"blocks of {args.block_size} tokens")
    return EngineConfig(block_size=args.block_size, num_blocks=args.l0_blocks or max(DEMO_L0_BLOCKS, needed),
                        enable_prefix_caching=not args.no_prefix_caching)


class _Progress:
    """The demo's progress bar, opened once the whole stack is built and checked (from there on it is the run),
    after the lines that say where the disk tier and the metrics are."""

    def __init__(self, args: argparse.Namespace, spec, offload) -> None:
        self.args, self.spec, self.offload = args, spec, offload
        turns = max(1, spec.requests // spec.turns) * spec.turns if spec.name == "multi-turn" else spec.requests
        self.total = 2 * turns          # cold, then warm
        self.bar = None

    def start(self, metrics_port: int | None) -> None:
        from tqdm import tqdm

        if self.offload is not None and self.offload.disk.enabled:
            print(f"tiercache: disk tier (L2) in {self.offload.disk.path}, up to "
                  f"{self.offload.disk.capacity / 2**30:.1f} GiB (disk.capacity), kept across runs; "
                  "`tiercache cache clear` empties it", file=sys.stderr)
        if metrics_port is not None:
            print(f"tiercache: Prometheus metrics of the cached run on http://127.0.0.1:{metrics_port}/metrics "
                  "(its counters start when it does, after the cold run; served until the demo exits)",
                  file=sys.stderr)
        self.bar = tqdm(total=self.total, desc=f"demo {self.spec.name} (cold, then warm)", file=sys.stderr,
                        disable=self.args.quiet)

    def step(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
