"""The ``tiercache bench`` subcommands: tiers, trace, codecs and engine, each with a table and report files.

Called by `tiercache.cli`; bad input raises `ConfigError` / `ValueError`, which
the CLI prints as one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import signal
import sys
from pathlib import Path

from tiercache.config import load_config
from tiercache.errors import ConfigError, TierCacheError


def _write_json(path: str | None, data: dict) -> None:
    if path:
        from tiercache.bench.report import write_json
        write_json(path, data)


def _directory(path: str | None, flag: str) -> str | None:
    """A benchmark's directory made ready before any measurement (created if missing, as the disk tier
    does), or one line naming the flag."""
    if not path:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(flag, path, f"cannot create the directory: {err.strerror}") from None
    if not (Path(path).is_dir() and os.access(path, os.W_OK | os.X_OK)):
        raise ConfigError(flag, path, "is not a writable directory")
    return path


REMOTE_VARIANTS = {"redis": "pipelined", "grpc": "data channel", "grpc-stream": "gRPC streams",
                   "grpc-shm": "shared-memory files"}


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, overrides=args.set)
    layouts = {"allocated": [False], "scattered": [True], "both": [False, True]}[args.layout]
    remotes = [t for t in REMOTE_VARIANTS if t in args.tiers]
    if "disk" in args.tiers:
        args.disk_path = _directory(args.disk_path, "--disk-path") or _directory(cfg.disk.path, "disk.path")
    targets = _remote_targets(args, cfg, remotes)    # checked (or started) before any measurement
    try:
        return _bench_tiers(args, cfg, layouts, remotes, targets)
    finally:
        for target in targets.values():
            target.close()


def _remote_targets(args: argparse.Namespace, cfg, remotes: list[str]) -> dict:
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
            targets[kind] = RemoteTarget(kind, given, args.total_mib)
    except BaseException:
        for target in targets.values():
            target.close()
        raise
    return targets


def _bench_tiers(args: argparse.Namespace, cfg, layouts: list[list[bool]], remotes: list[str], targets: dict) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from tiercache.bench.disk import bench_disk
    from tiercache.bench.tiers import SHAPES, CpuBenchSpec, bench_cpu

    codecs = args.codecs or [cfg.format.codec]
    total = (len(layouts) if "cpu" in args.tiers else 0) + ((1 if "disk" in args.tiers else 0) + len(remotes)) * len(
        codecs
    )
    report: dict = {"tiers": {}, "runs": []}
    with tqdm(total=total * args.reps, desc="bench tiers", file=sys.stderr, disable=args.quiet) as bar:
        if "cpu" in args.tiers:
            runs = []
            for scattered in layouts:
                spec = CpuBenchSpec(shape=args.shape, chunk_tokens=args.chunk_tokens, total_bytes=args.total_mib,
                                    reps=args.reps, scattered=scattered)
                runs.append(bench_cpu(spec, progress=lambda: bar.update(1)))
            headline = dict(runs[0])
            if len(runs) > 1:
                headline["scattered"] = {
                    k: runs[1][k] for k in ("put_gbps", "get_gbps", "raw_gbps", "put_ratio", "get_ratio")
                }
            report["tiers"]["cpu"] = headline
            report["runs"] += runs
        transfer = dataclasses.asdict(cfg.transfer)    # the transfer threads and link limits as configured
        for codec in codecs:
            if "disk" in args.tiers:
                directory = args.disk_path or cfg.disk.path or None
                r = bench_disk(args.shape, args.chunk_tokens, args.total_mib, args.reps, directory,
                               fsync=args.fsync, codec=codec, o_direct=cfg.disk.o_direct,
                               progress=lambda: bar.update(1), transfer_cfg=transfer)
                report["tiers"].setdefault("disk", r)
                report["runs"].append(r)
            for kind in remotes:
                from tiercache.bench.remote import bench_remote
                r = bench_remote(kind, args.shape, args.chunk_tokens, args.total_mib, args.reps, targets[kind],
                                 progress=lambda: bar.update(1), codec=codec, transfer_cfg=transfer)
                report["tiers"].setdefault(kind, r)
                report["runs"].append(r)
    report["codec_gains"] = _codec_gains(report["runs"], codecs[0])
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    report["command"] = "tiercache " + " ".join(sys.argv[1:])
    _write_json(args.json, report)
    if args.out:
        _tier_reports(Path(args.out), report)
    table = Table(title=f"tier throughput, {args.shape} ({SHAPES[args.shape].dtype}), medians of {args.reps}")
    for col in (
        "tier",
        "variant",
        "chunk",
        "put GB/s",
        "get GB/s",
        "raw put GB/s",
        "raw get GB/s",
        "put/raw",
        "get/raw",
    ):
        table.add_column(col, justify="right")
    if "cpu" in report["tiers"]:
        for r in report["runs"][:len(layouts)]:
            table.add_row(
                "cpu",
                f"{r['block_layout']} blocks",
                f"{r['chunk_bytes'] / 2**20:.1f} MiB",
                f"{r['put_gbps']:.2f}",
                f"{r['get_gbps']:.2f}",
                f"{r['raw_gbps']:.2f}",
                f"{r['raw_gbps']:.2f}",
                f"{r['put_ratio']:.2f}",
                f"{r['get_ratio']:.2f}",
            )
    for kind in remotes:
        r = report["tiers"][kind]
        table.add_row(kind, REMOTE_VARIANTS[kind], f"{r['chunk_bytes'] / 2**20:.1f} MiB", f"{r['put_gbps']:.2f}",
                      f"{r['get_gbps']:.2f}", f"{r['raw_put_gbps']:.2f}", f"{r['raw_get_gbps']:.2f}",
                      f"{r['put_ratio']:.2f}", f"{r['get_ratio']:.2f}")
    if "disk" in report["tiers"]:
        r = report["tiers"]["disk"]
        variant = ("O_DIRECT" if r["o_direct"] else "fsync" if r["fsync"] else "buffered") \
            + (", cold reads" if r["reads"].startswith("cold") else ", cached reads")
        table.add_row(
            "disk",
            variant,
            f"{r['chunk_bytes'] / 2**20:.1f} MiB",
            f"{r['put_gbps']:.2f}",
            f"{r['get_gbps']:.2f}",
            f"{r['raw_write_gbps']:.2f}",
            f"{r['raw_read_gbps']:.2f}",
            f"{r['put_ratio']:.2f}",
            f"{r['get_ratio']:.2f}",
        )
    console = Console(width=max(110, Console().width))
    console.print(table)
    if len(codecs) > 1:
        gains = Table(title=f"tokens/s through each tier by codec, against {codecs[0]} in this run")
        for col in ("tier", "codec", "put tokens/s", "get tokens/s", "put gain", "get gain"):
            gains.add_column(col, justify="right")
        for g in report["codec_gains"]:
            gains.add_row(g["tier"], g["codec"], str(g["put_tokens_per_s"]), str(g["get_tokens_per_s"]),
                          f"{g['put_gain']:.2f}", f"{g['get_gain']:.2f}")
        console.print(gains)
    return 0


def _bench_preemption(args: argparse.Namespace) -> int:
    """`bench engine --preemption`: the modes side by side under memory pressure (`tiercache.bench.preemption`)."""
    from tqdm import tqdm

    from tiercache.bench.preemption import PRESSURE_WORKLOADS, bench_preemption
    from tiercache.bench.report import markdown_table, write_json

    base = load_config(args.config, overrides=args.set).replace(keys={"block_size": 16})
    workloads = [PRESSURE_WORKLOADS[w] for w in args.pressure]
    with tqdm(total=len(workloads) * len(args.preemption) * args.reps, desc="bench engine --preemption",
              file=sys.stderr, disable=args.quiet) as bar:
        report = bench_preemption(workloads, args.preemption, base, args.reps, progress=lambda: bar.update(1))
    report["command"] = "tiercache " + " ".join(sys.argv[1:])
    headers = ("workload", "preemption", "TTFT p50 ms", "TTFT p99 ms", "tok/s", "preemptions", "swapped",
               f"outputs = {args.preemption[0]}'s")
    rows = [(r["workload"], r["mode"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["throughput_tok_s"], r["preemptions"],
             r["swap_outs"], r["outputs_match"]) for r in report["results"]]
    if args.out:
        out = Path(args.out)
        write_json(out / "engine.json", report)
        (out / "engine.md").write_text(f"# Preemption under memory pressure (medians of {args.reps})\n\n"
                                       + markdown_table(headers, rows))
    if args.json:
        write_json(args.json, report)
    _print_table(f"preemption under memory pressure (medians of {args.reps} runs)", headers, rows, 120)
    return 0 if all(r["outputs_match"] for r in report["results"]) else 1


def _print_table(title: str, headers: tuple, rows: list[tuple], min_width: int) -> None:
    """``rows`` under ``headers`` as a right-aligned rich table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*map(str, row))
    Console(width=max(min_width, Console().width)).print(table)


def _codec_gains(runs: list[dict], base: str) -> list[dict]:
    """Per tier and codec: tokens/s put and got, and the gain over the ``base`` codec's run of that tier."""
    out = []
    tiered = [r for r in runs if "put_tokens_per_s" in r]
    for r in tiered:
        tier = r.get("tier", "disk")
        ref = next(x for x in tiered if x.get("tier", "disk") == tier and x["codec"] == base)
        out.append({"tier": tier, "codec": r["codec"], "put_tokens_per_s": r["put_tokens_per_s"],
                    "get_tokens_per_s": r["get_tokens_per_s"],
                    "put_gain": round(r["put_tokens_per_s"] / ref["put_tokens_per_s"], 3),
                    "get_gain": round(r["get_tokens_per_s"] / ref["get_tokens_per_s"], 3)})
    return out


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tiercache.bench.report import markdown_table, plot_lines, write_json
    from tiercache.bench.trace import (
        TRACE_BLOCK_TOKENS,
        load_trace,
        replay,
        replay_belady,
        replay_hierarchy,
        split_policy,
        unique_chunks,
    )
    from tiercache.policies import NOT_AN_ENTRY_GUARD, guards_entry
    from tiercache.registry import RegistryError

    l1 = args.l1_tokens[0] if args.l1_tokens else None
    if l1 is None and any("/" in p for p in args.policy):
        raise ConfigError("--policy", ",".join(args.policy), "L1/L2 names each tier's policy: it needs --l1-tokens")
    if args.promotion != "copy" and l1 is None:
        raise ConfigError("--promotion", args.promotion, "moves chunks from L2 up into L1: it needs --l1-tokens")
    if args.l1_admission != "always":
        if l1 is None:
            raise ConfigError("--l1-admission", args.l1_admission, "guards L1 of a hierarchy: it needs --l1-tokens")
        try:
            entry = guards_entry(args.l1_admission)
        except RegistryError as err:
            raise ConfigError("--l1-admission", args.l1_admission, str(err)) from None
        if not entry:
            raise ConfigError("--l1-admission", args.l1_admission, NOT_AN_ENTRY_GUARD)
    trace = load_trace(args.trace)
    ceiling = replay(trace, unique_chunks(trace) * TRACE_BLOCK_TOKENS, "lru")
    points = _trace_points(args)
    results = []
    if l1 is None:
        runs = [(policy, lambda cap, policy=policy: replay(trace, cap, policy)) for policy in args.policy]
        runs.append((BELADY_ROW, lambda cap: replay_belady(trace, cap)))      # the offline reference, always
    else:       # L1 over an L2 of each capacity; the reference holds L1's and L2's room as one
        runs = [(policy, lambda cap, parts=split_policy(policy): replay_hierarchy(
                    trace, l1, cap, eviction=parts[0], admission=parts[1], l1_admission=args.l1_admission,
                    promotion=args.promotion))
                for policy in args.policy]
        runs.append((BELADY_ROW, lambda cap: replay_belady(trace, l1 + cap)))
    with tqdm(total=len(points) * len(runs), desc="bench trace", file=sys.stderr, disable=args.quiet) as bar:
        for policy, run in runs:
            for point in points:
                r = run(point["capacity_tokens"])
                results.append({"policy": policy, **point, "token_hit_ratio": round(r.token_hit_ratio, 4),
                                "request_hit_ratio": round(r.request_hit_ratio, 4),
                                "written_chunks": r.written_chunks})
                bar.update(1)
    _against_lru(results)
    report = {"trace": str(args.trace), "requests": len(trace), "unique_chunks": unique_chunks(trace),
              "block_tokens": TRACE_BLOCK_TOKENS, "ceiling_token_hit_ratio": round(ceiling.token_hit_ratio, 4),
              "ceiling_request_hit_ratio": round(ceiling.request_hit_ratio, 4), "l1_tokens": l1,
              "l1_admission": args.l1_admission if l1 else None, "promotion": args.promotion if l1 else None,
              "results": results,
              "command": "tiercache " + " ".join(sys.argv[1:])}
    by_bytes = args.capacity_bytes is not None
    lead = ("codec", "capacity (bytes)") if by_bytes else ()
    rows = [
        (
            *((r["codec"], f"{r['capacity_bytes'] / 2**30:g} GiB") if by_bytes else ()),
            r["policy"],
            r["capacity_tokens"],
            r["token_hit_ratio"],
            r.get("vs_lru", "-"),
            r["written_chunks"],
            r["request_hit_ratio"],
        )
        for r in results
    ]
    capacity = "capacity (tokens)" if l1 is None else f"L2 tokens (L1 {l1})"
    writes = "chunk writes" if l1 is None else "L2 chunk writes"
    headers = (*lead, "policy", capacity, "token hit ratio", "vs lru", writes, "request hit ratio")
    if args.out:
        out = Path(args.out)
        write_json(out / "trace.json", report)
        (out / "trace.md").write_text(f"# Trace replay: {args.trace}\n\nCeiling (infinite capacity): token hit ratio "
                                      f"{report['ceiling_token_hit_ratio']}\n\n" + markdown_table(headers, rows))
        x, label = ("capacity_bytes", "capacity (bytes)") if by_bytes else ("capacity_tokens", "capacity (tokens)")
        keys = list(dict.fromkeys((r["policy"], r.get("codec", "")) for r in results))

        def series(y: str) -> dict[str, tuple[list, list]]:
            return {" ".join(filter(None, k)): ([r[x] for r in results if (r["policy"], r.get("codec", "")) == k],
                                                [r[y] for r in results if (r["policy"], r.get("codec", "")) == k])
                    for k in keys}
        plot_lines(out / "trace.png", f"Hits and writes vs capacity ({Path(args.trace).name})", label,
                   "token hit ratio", series("token_hit_ratio"),
                   ("infinite capacity", report["ceiling_token_hit_ratio"]), beside=(writes, series("written_chunks")))
    if args.json:
        write_json(args.json, report)
    where = "one tier" if l1 is None else f"L1 of {l1} tokens over L2"
    _print_table(f"trace replay ({where}): {len(trace)} requests, ceiling {report['ceiling_token_hit_ratio']}",
                 headers, rows, 80)
    return 0


BELADY_ROW = "belady (offline)"   # `replay_belady`: reads the trace's future; the headroom every policy has


def cmd_bench_make_trace(args: argparse.Namespace) -> int:
    from tiercache.bench.conversation_trace import ConversationTraceSpec, write

    spec = ConversationTraceSpec(**{name: getattr(args, name) for name in ConversationTraceSpec.__dataclass_fields__
                                    if hasattr(args, name)})
    n = write(args.out, spec)
    print(f"wrote {n} requests to {args.out}")
    return 0


def _against_lru(results: list[dict]) -> None:
    """Give each row its token hit ratio over LRU's at the same capacity (and codec), where LRU was run."""
    lru = {(r["capacity_tokens"], r.get("codec")): r["token_hit_ratio"] for r in results if r["policy"] == "lru"}
    for r in results:
        base = lru.get((r["capacity_tokens"], r.get("codec")))
        if base:
            r["vs_lru"] = round(r["token_hit_ratio"] / base, 3)


def cmd_bench_codecs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from tqdm import tqdm

    from tiercache.bench.codecs import bench_codecs
    from tiercache.bench.codecs_report import codec_tables, write_codec_reports

    if args.chunk_tokens % 16:
        raise ConfigError("--chunk-tokens", args.chunk_tokens, "must be a multiple of the block size, 16")
    if args.model and not Path(args.model, "config.json").is_file():
        raise ConfigError("--model", args.model, "is not a Hugging Face checkpoint directory (no config.json)")
    if not (args.no_accuracy or args.model) and importlib.util.find_spec("transformers") is None:
        raise TierCacheError("bench codecs trains its accuracy model with transformers, which is not installed: "
                             "pip install 'tiercache[bench]' (or give --model DIR, or --no-accuracy)")
    args.disk_path = _directory(args.disk_path, "--disk-path")
    lossy = [n for n in args.codecs if n == "raw" or _lossy(n)]
    with tqdm(desc="bench codecs", file=sys.stderr, disable=args.quiet) as bar:
        report = bench_codecs(args.codecs, None if args.no_accuracy else lossy, args.shape, args.chunk_tokens,
                              args.reps, args.model, args.train_steps, args.requests, args.max_tokens,
                              args.disk_path, progress=lambda: bar.update(1))
    report["command"] = "tiercache " + " ".join(sys.argv[1:])
    if args.out:
        write_codec_reports(Path(args.out), report)
    _write_json(args.json, report)
    console = Console(width=max(120, Console().width))
    for table in codec_tables(report):
        console.print(table)
    return 0


def _lossy(name: str) -> bool:
    from tiercache.codecs import codecs
    return codecs.get(name).lossy


def _trace_points(args: argparse.Namespace) -> list[dict]:
    """The capacities to replay at: tokens as given, or — for ``--capacity-bytes`` — per codec, the tokens
    that chunks of ``--shape`` encoded by that codec fit in those bytes (headers included)."""
    if args.capacity_bytes is None:
        return [{"capacity_tokens": c} for c in args.capacity_tokens]
    from tiercache.bench.tiers import BLOCK_SIZE, SHAPES
    from tiercache.bench.trace import TRACE_BLOCK_TOKENS
    from tiercache.contracts.layout import ChunkLayout
    from tiercache.wire.chunk_format import ChunkFormat

    geo = SHAPES[args.shape]
    layout = ChunkLayout(geo.dtype, (geo.num_layers, 2, TRACE_BLOCK_TOKENS // BLOCK_SIZE, BLOCK_SIZE,
                                     geo.num_kv_heads, geo.head_dim))
    points = []
    for codec in args.codecs:
        chunk = ChunkFormat(codec).max_stored_len(layout)
        for capacity in args.capacity_bytes:
            points.append({"codec": codec, "capacity_bytes": capacity, "chunk_bytes": chunk,
                           "capacity_tokens": max(1, capacity // chunk) * TRACE_BLOCK_TOKENS})
    return points


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.preemption:
        return _bench_preemption(args)

    from tiercache.bench.engine import SETUPS, bench_engine
    from tiercache.bench.report import markdown_table, write_json
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
    report["command"] = "tiercache " + " ".join(sys.argv[1:])
    headers = ("workload", "setup", "TTFT p50 ms", "TTFT p99 ms", "tok/s", "token hits", "request hits",
               "tokens saved", "matches")
    rows = [(r["workload"], r["setup"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["throughput_tok_s"], r["token_hit_ratio"],
             r["request_hit_ratio"], r["prefill_tokens_saved"], r["outputs_match_baseline"]) for r in report["results"]]
    if args.out:
        out = Path(args.out)
        write_json(out / "engine.json", report)
        (out / "engine.md").write_text("# Engine benchmark\n\n" + markdown_table(headers, rows))
        _plot_engine(out / "engine.png", report["results"])
    if args.json:
        write_json(args.json, report)
    _print_table("engine benchmark (requests one after another)", headers, rows, 120)
    return 0 if all(r["outputs_match_baseline"] for r in report["results"]) else 1


def _plot_engine(path: Path, results: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    setups = list(dict.fromkeys(r["setup"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(setups)
    for i, setup in enumerate(setups):
        values = [next((r["ttft_ms_p50"] for r in results if r["workload"] == w and r["setup"] == setup), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=setup)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.set_title("Time to first token by tier setup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tier_reports(out: Path, report: dict) -> None:
    """tiers.json, tiers.md and tiers.png (tier and raw GB/s side by side) in ``out``."""
    from tiercache.bench.report import markdown_table, write_json

    write_json(out / "tiers.json", report)
    rows = []
    for r in report["runs"]:
        tier = "cpu" if "block_layout" in r else r.get("tier", "disk")
        variant = r.get("block_layout") or REMOTE_VARIANTS.get(tier) or ("fsync" if r.get("fsync") else "buffered")
        raw_put, raw_get = {"cpu": (r.get("raw_gbps"), r.get("raw_gbps")),
                            "disk": (r.get("raw_write_gbps"), r.get("raw_read_gbps"))}.get(
                                tier, (r.get("raw_put_gbps"), r.get("raw_get_gbps")))
        rows.append((tier, variant, r["put_gbps"], r["get_gbps"], raw_put, raw_get, r["put_ratio"], r["get_ratio"]))
    headers = ("tier", "variant", "put GB/s", "get GB/s", "raw put GB/s", "raw get GB/s", "put/raw", "get/raw")
    (out / "tiers.md").write_text(f"# Tier throughput\n\n`{report['command']}`\n\n" + markdown_table(headers, rows))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{t} {v}" for t, v, *_ in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, col) in enumerate((("put", 2), ("get", 3), ("raw put", 4), ("raw get", 5))):
        ax.bar([x + i * 0.2 for x in range(len(rows))], [row[col] for row in rows], 0.2, label=name)
    ax.set_xticks([x + 0.3 for x in range(len(rows))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Tier throughput beside the raw limit (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tiers.png", dpi=110)
    plt.close(fig)


def cmd_bench_route(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from tiercache.bench import route
    from tiercache.bench.report import markdown_table, write_json

    for module, extra in (("aiohttp", "fleet"), ("zmq", "fleet"), ("msgspec", "fleet"),
                          ("prometheus_client", "metrics")):
        if importlib.util.find_spec(module) is None:
            raise TierCacheError(f"bench route needs {module}, which is not installed: "
                                 f"pip install 'tiercache[{extra}]'")
    out = _directory(args.out, "--out")
    try:                        # a bad field or value is one line here, before any replica starts
        load_config(env={}, overrides=args.replica_set)
    except ConfigError as err:
        if err.field != "--set":
            raise
        raise ConfigError("--replica-set", err.value, err.reason) from None
    workload = route.RouteWorkload(conversations=args.conversations, max_turns=args.max_turns,
                                   system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                                   user_tokens=args.user_tokens, output_tokens=args.output_tokens, rate=args.rate,
                                   seed=args.seed)
    shared = {"no": [False], "yes": [True], "both": [False, True]}[args.shared]
    fleets = [(n, s) for n in args.replicas for s in shared]
    # Stopped with SIGTERM, the bench unwinds as on Ctrl-C, so the fleet it started (replicas, router, server:
    # processes of their own) is stopped by `run_one`'s `finally` rather than left running.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    requests = sum(len(c.questions) for c in route.conversations(workload))
    report = route.RouteReport(dataclasses.asdict(workload))
    with tqdm(total=requests * len(fleets) * len(args.policies), desc="bench route", file=sys.stderr,
              disable=args.quiet) as bar:
        for n, s in fleets:
            for policy in args.policies:
                bar.set_postfix_str(f"{n} replicas{' + serve' if s else ''}, {policy}")
                report.runs.append(route.run_one(n, policy, s, workload, progress=lambda: bar.update(1),
                                                 replica_set=tuple(args.replica_set)))
    if args.overhead_pairs > 0:
        report.overhead = route.router_overhead(args.overhead_pairs)
    data = {**report.as_dict(), "command": "tiercache " + " ".join(sys.argv[1:]), "machine": platform.node()}
    rows = route.rows(data)
    if out:
        write_json(Path(out) / "route.json", data)
        text = "# Routing benchmark\n\n" + markdown_table(route.HEADERS, rows)
        if report.overhead:
            text += "\nRouter overhead: " + json.dumps(report.overhead) + "\n"
        (Path(out) / "route.md").write_text(text)
        route.plot(Path(out) / "route.png", data)
    _write_json(args.json, data)
    if not args.quiet:
        table = Table(title="bench route")       # a column per run, a row per figure: readable in 80 columns
        table.add_column("")
        for row in rows:
            table.add_column(f"{row[0]} replicas{' + serve' if row[1] == 'yes' else ''}, {row[2]}")
        for i, header in enumerate(route.HEADERS[3:], start=3):
            table.add_row(header, *(str(row[i]) for row in rows))
        Console().print(table)
        if report.overhead:
            Console().print(f"router overhead: {report.overhead}")
    return 0
