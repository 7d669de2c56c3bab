"""`tiercache bench trace` (replay a trace through the tiers' index and policies) and `tiercache bench
make-trace` (write a conversation trace), with their flags."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tiercache.cli.common import command_line
from tiercache.cli.options import (
    add_report_flags,
    add_shape_flag,
    codec_list,
    policy_list,
    positive,
    positive_float,
    size_list,
)
from tiercache.config import PROMOTIONS
from tiercache.errors import ConfigError


def register(bench: argparse._SubParsersAction) -> None:
    _register_trace(bench)
    _register_make_trace(bench)


def _register_trace(bench: argparse._SubParsersAction) -> None:
    t = bench.add_parser("trace", help="replay a Mooncake-format trace through the tiers' index and policies")
    t.add_argument("--trace", required=True,
                   help="Mooncake-format JSONL (timestamp, input_length, output_length, hash_ids; .gz read as is); "
                        "a source checkout ships one: tests/data/mooncake_synthetic_trace.jsonl.gz")
    t.add_argument("--capacity-tokens", type=size_list("--capacity-tokens", "1M,3M"), default=[1_000_000, 3_000_000],
                   help="comma-separated capacities in tokens, e.g. 500K,1M,3M")
    t.add_argument("--capacity-bytes", type=size_list("--capacity-bytes", "64GiB,128GiB"), default=None,
                   help="comma-separated capacities in bytes (e.g. 64GiB,128GiB) instead: each codec of --codecs "
                        "gets the tokens its chunks of --shape fit in them")
    t.add_argument("--codecs", type=codec_list, default=["raw"], help="with --capacity-bytes, e.g. raw,int8")
    add_shape_flag(t, "with --capacity-bytes: the KV geometry whose chunks fill the bytes")
    t.add_argument("--policy", type=policy_list, default=["lru", "lfu-da", "s3-fifo", "lfu-da+adaptive-sighting"],
                   help="comma-separated eviction policies, each optionally with an admission policy "
                        "(lfu-da+second-sighting; with --l1-tokens it guards L2; none named: always) and, with "
                        "--l1-tokens, L1's and L2's apart (lfu-da/reuse-model) (default: lru,lfu-da,s3-fifo,"
                        "lfu-da+adaptive-sighting: the tiers' defaults last)")
    t.add_argument("--l1-tokens", type=size_list("--l1-tokens", "1M"), default=None,
                   help="replay L1 of this many tokens over an L2 of each capacity through the real cache manager "
                        "(promotions, write-back spills; the policy in both tiers unless given as L1/L2) instead "
                        "of one tier")
    t.add_argument("--l1-admission", default="always", metavar="POLICY",
                   help="with --l1-tokens: which chunks the engine's stores put into L1 (always, frequency, "
                        "second-sighting; cpu.admission) (default: always)")
    t.add_argument("--promotion", default="copy", choices=PROMOTIONS,
                   help="with --l1-tokens: a chunk promoted from L2 stays there (copy) or leaves it (move; "
                        "disk.promotion) (default: copy)")
    add_report_flags(t, "trace.json, trace.md and trace.png")
    t.set_defaults(func=cmd_bench_trace)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from tiercache.bench.report import print_table, write_json
    from tiercache.bench.trace import TRACE_BLOCK_TOKENS, load_trace, replay, unique_chunks
    from tiercache.bench.trace_report import against_lru, headers, rows, write_trace_reports

    l1 = args.l1_tokens[0] if args.l1_tokens else None
    _check_hierarchy_flags(args, l1)
    trace = load_trace(args.trace)
    ceiling = replay(trace, unique_chunks(trace) * TRACE_BLOCK_TOKENS, "lru")
    results = _replay_all(args, _replays(args, trace, l1), _trace_points(args))
    against_lru(results)
    report = {"trace": str(args.trace), "requests": len(trace), "unique_chunks": unique_chunks(trace),
              "block_tokens": TRACE_BLOCK_TOKENS, "ceiling_token_hit_ratio": round(ceiling.token_hit_ratio, 4),
              "ceiling_request_hit_ratio": round(ceiling.request_hit_ratio, 4), "l1_tokens": l1,
              "l1_admission": args.l1_admission if l1 else None, "promotion": args.promotion if l1 else None,
              "results": results, "command": command_line()}
    by_bytes = args.capacity_bytes is not None
    if args.out:
        write_trace_reports(Path(args.out), report, by_bytes)
    if args.json:
        write_json(args.json, report)
    where = "one tier" if l1 is None else f"L1 of {l1} tokens over L2"
    print_table(f"trace replay ({where}): {len(trace)} requests, ceiling {report['ceiling_token_hit_ratio']}",
                headers(by_bytes, l1), rows(results, by_bytes), 80)
    return 0


def _check_hierarchy_flags(args: argparse.Namespace, l1: int | None) -> None:
    """The flags that shape a replay of L1 over L2 need ``--l1-tokens``; ``--l1-admission`` must guard L1."""
    from tiercache.policies import NOT_AN_ENTRY_GUARD, guards_entry
    from tiercache.registry import RegistryError

    if l1 is None and any("/" in p for p in args.policy):
        raise ConfigError("--policy", ",".join(args.policy), "L1/L2 names each tier's policy: it needs --l1-tokens")
    if args.promotion != "copy" and l1 is None:
        raise ConfigError("--promotion", args.promotion, "moves chunks from L2 up into L1: it needs --l1-tokens")
    if args.l1_admission == "always":
        return
    if l1 is None:
        raise ConfigError("--l1-admission", args.l1_admission, "guards L1 of a hierarchy: it needs --l1-tokens")
    try:
        entry = guards_entry(args.l1_admission)
    except RegistryError as err:
        raise ConfigError("--l1-admission", args.l1_admission, str(err)) from None
    if not entry:
        raise ConfigError("--l1-admission", args.l1_admission, NOT_AN_ENTRY_GUARD)


def _replays(args: argparse.Namespace, trace: list, l1: int | None) -> list[tuple[str, Callable]]:
    """(row name, replay at a capacity) for each policy, and last the offline optimum — one tier, or L1 over an
    L2 of each capacity (the optimum then holds L1's and L2's room as one)."""
    from tiercache.bench.trace import replay, replay_belady, replay_hierarchy, split_policy
    from tiercache.bench.trace_report import BELADY_ROW

    if l1 is None:
        runs = [(policy, lambda cap, policy=policy: replay(trace, cap, policy)) for policy in args.policy]
        return [*runs, (BELADY_ROW, lambda cap: replay_belady(trace, cap))]
    runs = [(policy, lambda cap, parts=split_policy(policy): replay_hierarchy(
                trace, l1, cap, eviction=parts[0], admission=parts[1], l1_admission=args.l1_admission,
                promotion=args.promotion))
            for policy in args.policy]
    return [*runs, (BELADY_ROW, lambda cap: replay_belady(trace, l1 + cap))]


def _replay_all(args: argparse.Namespace, runs: list[tuple[str, Callable]], points: list[dict]) -> list[dict]:
    """Each replay at each capacity point, under one progress bar: a result row each."""
    from tqdm import tqdm

    results = []
    with tqdm(total=len(points) * len(runs), desc="bench trace", file=sys.stderr, disable=args.quiet) as bar:
        for policy, run in runs:
            for point in points:
                r = run(point["capacity_tokens"])
                results.append({"policy": policy, **point, "token_hit_ratio": round(r.token_hit_ratio, 4),
                                "request_hit_ratio": round(r.request_hit_ratio, 4),
                                "written_chunks": r.written_chunks})
                bar.update(1)
    return results


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


def _register_make_trace(bench: argparse._SubParsersAction) -> None:
    mt = bench.add_parser("make-trace", help="write a conversation trace in the Mooncake format (with "
                                             "conversation_id): multi-turn chats among one-off requests")
    mt.add_argument("--out", required=True, metavar="FILE", help="the JSONL file to write")
    mt.add_argument("--conversations", type=positive, default=2000)
    mt.add_argument("--conversation-rate", type=positive_float, default=0.5, help="conversations started per second")
    mt.add_argument("--mean-turns", type=positive_float, default=4.0)
    mt.add_argument("--think-s", type=positive_float, default=90.0, help="mean pause before a next turn")
    mt.add_argument("--one-off-rate", type=float, default=0.5, help="one-off requests per second (0: none)")
    mt.add_argument("--system-prompts", type=positive, default=12, help="system prompts, Zipf-popular")
    mt.add_argument("--system-tokens", type=positive, default=2048)
    mt.add_argument("--question-tokens", type=positive, default=350,
                    help="a question (each turn's, each one-off's), mean tokens")
    mt.add_argument("--answer-tokens", type=positive, default=250, help="an answer, mean tokens")
    mt.add_argument("--document-tokens", type=positive, default=4000, help="a one-off's document, mean tokens")
    mt.add_argument("--seed", type=int, default=0)
    mt.set_defaults(func=cmd_bench_make_trace)


def cmd_bench_make_trace(args: argparse.Namespace) -> int:
    from tiercache.bench.conversation_trace import ConversationTraceSpec, write

    spec = ConversationTraceSpec(**{name: getattr(args, name) for name in ConversationTraceSpec.__dataclass_fields__
                                    if hasattr(args, name)})
    n = write(args.out, spec)
    print(f"wrote {n} requests to {args.out}")
    return 0
