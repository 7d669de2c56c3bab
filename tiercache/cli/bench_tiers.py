"""`tiercache bench tiers`: each tier's put and get throughput beside the machine's raw limit, with its flags."""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from tiercache.cli.common import command_line, ready_directory, write_json
from tiercache.cli.options import (
    add_chunk_tokens_flag,
    add_config_flags,
    add_report_flags,
    add_reps_flag,
    add_shape_flag,
    bench_tier_list,
    config_check,
    positive,
    tier_format_list,
)
from tiercache.config import TierCacheConfig, load_config

LAYOUTS = {"allocated": [False], "scattered": [True], "both": [False, True]}   # `--layout`: scattered or not


def register(bench: argparse._SubParsersAction) -> None:
    tiers = bench.add_parser("tiers", help="tier put/get throughput beside the raw machine limit")
    tiers.add_argument("--tiers", type=bench_tier_list, default=["cpu"],
                       help="comma-separated tiers: cpu, disk, redis, grpc (bytes on the server's data channel), "
                            "grpc-stream (bytes on gRPC streams), grpc-shm (a serve with --shm-dir, its memory "
                            "tier read and written as files on this host)")
    tiers.add_argument("--disk-path", help="directory on the disk to measure (default: disk.path, else $TMPDIR)")
    tiers.add_argument("--fsync", action="store_true", help="disk: fdatasync every chunk (and every raw file)")
    tiers.add_argument("--redis-url", help="redis: the server to measure (default: redis.url when set, else a "
                                            "redis-server started for the run)")
    tiers.add_argument("--grpc-address", help="grpc: a `tiercache serve` to measure (default: start one for the run)")
    add_shape_flag(tiers, "KV geometry: llama-8b (32 layers, 8 KV heads, dim 128, bf16) or small (4, 2, 64, fp32)")
    add_chunk_tokens_flag(tiers)
    tiers.add_argument("--total-mib", type=positive, default=1024, help="MiB moved per repetition")
    add_reps_flag(tiers, 5)
    tiers.add_argument("--layout", choices=list(LAYOUTS), default="both",
                       help="L0 block placement: as the pool allocates, shuffled, or both")
    tiers.add_argument("--codecs", type=tier_format_list, default=None,
                       help="disk and remote tiers: run each with these chunk codecs in turn and report tokens/s "
                            "against the first, e.g. raw,int8; NAME+aes encrypts too (AES-256-GCM), e.g. "
                            "raw,raw+aes (default: format.codec)")
    add_report_flags(tiers, "tiers.json, tiers.md and tiers.png", json_help="write the report as JSON",
                     quiet_help="no progress bar")
    add_config_flags(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from tiercache.bench.tiers import SHAPES
    from tiercache.bench.tiers_report import REMOTE_VARIANTS, codec_gains, print_tables, write_tier_reports

    config_check("--chunk-tokens", "keys", "chunk_tokens", args.chunk_tokens)
    cfg = load_config(args.config, overrides=args.set)
    remotes = [t for t in REMOTE_VARIANTS if t in args.tiers]
    if "disk" in args.tiers:
        args.disk_path = ready_directory(args.disk_path, "--disk-path") or ready_directory(cfg.disk.path,
                                                                                           "disk.path")
    targets = _remote_targets(args, cfg, remotes)    # checked (or started) before any run
    try:
        report = _run(args, cfg, remotes, targets)
    finally:
        for target in targets.values():
            target.close()
    codecs = args.codecs or [cfg.format.codec]
    report["codec_gains"] = codec_gains(report["runs"], codecs[0])
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    report["command"] = command_line()
    write_json(args.json, report)
    if args.out:
        write_tier_reports(Path(args.out), report)
    print_tables(report, f"tier throughput, {args.shape} ({SHAPES[args.shape].dtype}), medians of {args.reps}",
                 len(LAYOUTS[args.layout]), remotes, codecs)
    return 0


def _remote_targets(args: argparse.Namespace, cfg: TierCacheConfig, remotes: list[str]) -> dict:
    """The server each remote benchmark runs against: the one named (by flag, or by ``redis.url`` when set), else
    one started for the run."""
    if not remotes:
        return {}
    from tiercache.bench.remote import RemoteTarget
    from tiercache.config import RedisTierConfig

    configured = cfg.redis.url if cfg.redis.url != RedisTierConfig().url else None
    targets: dict = {}
    try:
        for kind in remotes:
            given = (args.redis_url or configured) if kind == "redis" else args.grpc_address
            targets[kind] = RemoteTarget(kind, given, args.total_mib << 20)
    except BaseException:
        for target in targets.values():
            target.close()
        raise
    return targets


def _run(args: argparse.Namespace, cfg: TierCacheConfig, remotes: list[str], targets: dict) -> dict:
    """Every run the flags ask for, under one progress bar: ``{"tiers": first run per tier, "runs": all}``."""
    from tqdm import tqdm

    codecs = args.codecs or [cfg.format.codec]
    layouts = LAYOUTS[args.layout]
    per_codec = (1 if "disk" in args.tiers else 0) + len(remotes)
    total = (len(layouts) if "cpu" in args.tiers else 0) + per_codec * len(codecs)
    report: dict = {"tiers": {}, "runs": []}
    with tqdm(total=total * args.reps, desc="bench tiers", file=sys.stderr, disable=args.quiet) as bar:
        step = lambda: bar.update(1)        # noqa: E731
        if "cpu" in args.tiers:
            runs = _cpu_runs(args, layouts, step)
            report["tiers"]["cpu"] = _cpu_headline(runs)
            report["runs"] += runs
        for codec in codecs:
            for run in _lower_tier_runs(args, cfg, codec, remotes, targets, step):
                report["tiers"].setdefault(run.get("tier", "disk"), run)
                report["runs"].append(run)
    return report


def _cpu_runs(args: argparse.Namespace, layouts: list[bool], step: Callable[[], None]) -> list[dict]:
    from tiercache.bench.tiers import CpuBenchSpec, bench_cpu

    return [bench_cpu(CpuBenchSpec(shape=args.shape, chunk_tokens=args.chunk_tokens, total_bytes=args.total_mib << 20,
                                   reps=args.reps, scattered=scattered), progress=step)
            for scattered in layouts]


def _cpu_headline(runs: list[dict]) -> dict:
    """The CPU tier's report: its first layout's run, with the scattered layout's figures beside them."""
    headline = dict(runs[0])
    if len(runs) > 1:
        headline["scattered"] = {k: runs[1][k] for k in ("put_gbps", "get_gbps", "raw_gbps", "put_ratio", "get_ratio")}
    return headline


def _lower_tier_runs(args: argparse.Namespace, cfg: TierCacheConfig, codec: str, remotes: list[str], targets: dict,
                     step: Callable[[], None]) -> list[dict]:
    """The disk's run and each remote tier's with chunks in ``codec``, the transfer settings as configured."""
    from tiercache.bench.disk import DiskBenchSpec, bench_disk
    from tiercache.bench.remote import bench_remote

    transfer = dataclasses.asdict(cfg.transfer)
    runs = []
    if "disk" in args.tiers:
        spec = DiskBenchSpec(args.shape, args.chunk_tokens, args.total_mib << 20, args.reps,
                             args.disk_path or cfg.disk.path or None, fsync=args.fsync, codec=codec,
                             o_direct=cfg.disk.o_direct, transfer_cfg=transfer)
        runs.append(bench_disk(spec, progress=step))
    for kind in remotes:
        runs.append(bench_remote(kind, args.shape, args.chunk_tokens, args.total_mib << 20, args.reps, targets[kind],
                                 progress=step, codec=codec, transfer_cfg=transfer))
    return runs

