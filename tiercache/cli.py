"""The ``tiercache`` command line.

Every subcommand reports bad input as one line naming the flag or config field
and exits with status 2; nothing here prints a traceback for a user's mistake.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
import typing
from pathlib import Path

from tiercache import __version__
from tiercache.bench import commands
from tiercache.config import PROMOTIONS, load_config, parse_size
from tiercache.errors import ConfigError, TierCacheError


def _size_mib(text: str) -> int:
    """A positive whole number of MiB, in bytes."""
    return _positive(text) << 20


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _port(text: str) -> int:
    """A TCP port: 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _finite(text: str, lowest: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < lowest:
        raise argparse.ArgumentTypeError(f"expected a finite number >= {lowest:g}, got {text!r}")
    return value


def _tier_list(text: str, known: frozenset[str] = frozenset({"cpu", "disk", "redis", "grpc"})) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown tier(s) {unknown or text!r}; known: {', '.join(sorted(known))}")
    return names


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML or TOML config file")
    p.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   help="override one config field (repeatable)")


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _size_list(flag: str, example: str):
    """An argparse type: comma-separated positive sizes (``1M``, ``64GiB``), named ``flag`` in errors."""
    def parse(text: str) -> list[int]:
        try:
            values = [parse_size(v.strip(), flag) for v in text.split(",") if v.strip()]
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive values such as {example}, got {text!r}")
        return values
    return parse


def _codec_list(text: str) -> list[str]:
    from tiercache.codecs import codecs
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in codecs]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown codec {unknown or text!r}; known: {', '.join(codecs.names())}")
    return names


def _tier_format_list(text: str) -> list[str]:
    """Codecs, each optionally sealed (``NAME+aes``): the formats `bench tiers` runs in turn."""
    from tiercache.bench.formats import split_variant
    names = [n.strip() for n in text.split(",") if n.strip()]
    _codec_list(",".join(split_variant(n)[0] for n in names) or text)
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str, known: list[str], what: str) -> list[str]:
    """A comma-separated list of names, each one of ``known`` (a flag's type: a wrong one is one line)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; known: {', '.join(known)}")
    return names


def _routing_list(text: str) -> list[str]:
    from tiercache.fleet.routing import routing_policies
    return _names(text, routing_policies.names(), "routing policy")


def _preemption_list(text: str) -> list[str]:
    from tiercache.engine.preemption import preemption_policies
    return _names(text, preemption_policies.names(), "preemption mode")


def _pressure_list(text: str) -> list[str]:
    from tiercache.bench.preemption import PRESSURE_WORKLOADS
    return _names(text, list(PRESSURE_WORKLOADS), "pressure workload")


def _policy_list(text: str) -> list[str]:
    """Eviction policies, each optionally ``+ADMISSION`` (what the tier admits: ``lfu-da+second-sighting``) and,
    for a replay of L1 over L2, ``L1/L2`` (each tier's own: ``lfu-da/reuse-model``)."""
    from tiercache.policies import admission_policies, eviction_policies
    names = [n.strip() for n in text.split(",") if n.strip()]
    evictions = [e for n in names for e in n.partition("+")[0].split("/")]
    _names(",".join(evictions) or text, eviction_policies.names(), "policy")
    admitted = [n.partition("+")[2] for n in names if "+" in n]
    if admitted:
        _names(",".join(admitted), admission_policies.names(), "admission policy")
    return names


def user_cache_dir() -> Path:
    """Where tiercache keeps a user's files between runs: ``$XDG_CACHE_HOME/tiercache`` (``~/.cache/tiercache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tiercache"


def default_disk_path() -> str:
    return str(user_cache_dir() / "l2")


def _offload_config(args: argparse.Namespace, base: dict | None = None):
    """The config tree with the tiers the flags name; None when no tier is wanted. ``base`` holds the
    command's own defaults, below the config file, the environment and ``--set``."""
    cfg = load_config(args.config, overrides=args.set, base=base)
    if not args.tiers:
        return None
    if "cpu" not in args.tiers:
        raise ConfigError("--tiers", ",".join(args.tiers), "L1 (cpu) stages every lower tier; include cpu")
    disk = {"enabled": "disk" in args.tiers}
    if "disk" in args.tiers:
        disk["path"] = args.disk_path or cfg.disk.path or default_disk_path()
    redis = {"enabled": "redis" in args.tiers}
    if "redis" in args.tiers and getattr(args, "redis_url", None):
        redis["url"] = args.redis_url
    grpc = {"enabled": "grpc" in args.tiers}
    if "grpc" in args.tiers and getattr(args, "grpc_address", None):
        grpc["address"] = args.grpc_address
    return cfg.replace(disk=disk, redis=redis, grpc=grpc, keys={"block_size": args.block_size})


DEMO_DEFAULTS = {"cpu": {"capacity": "16MiB"}}   # L1 below the workload too, so chunks also come back from disk
DEMO_L0_BLOCKS = 160                               # the engine's own pool, below the docs workload too


def cmd_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tiercache.bench.demo import demo
    from tiercache.bench.demo_report import print_report, write_files
    from tiercache.bench.workloads import WorkloadSpec
    from tiercache.engine import EngineConfig
    from tiercache.engine.config import HYBRID_MODEL

    spec = WorkloadSpec(args.workload, requests=args.requests, prefix_tokens=args.prefix_tokens,
                        suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens)
    needed = -(-spec.max_tokens // args.block_size)
    if args.l0_blocks is not None and args.l0_blocks < needed:
        raise ConfigError("--l0-blocks", args.l0_blocks, f"the {spec.name} workload's longest request needs {needed} "
                                                         f"blocks of {args.block_size} tokens")
    engine_cfg = EngineConfig(block_size=args.block_size, num_blocks=args.l0_blocks or max(DEMO_L0_BLOCKS, needed),
                              enable_prefix_caching=not args.no_prefix_caching)
    offload = _offload_config(args, base=DEMO_DEFAULTS)
    total = 2 * (spec.requests if spec.name != "multi-turn" else max(1, spec.requests // spec.turns) * spec.turns)
    bar = None

    def started(metrics_port: int | None) -> None:    # the whole stack is built and checked: from here on it is the run
        nonlocal bar
        if offload is not None and offload.disk.enabled:
            print(f"tiercache: disk tier (L2) in {offload.disk.path}, up to {offload.disk.capacity / 2**30:.1f} GiB "
                  "(disk.capacity), kept across runs; `tiercache cache clear` empties it", file=sys.stderr)
        if metrics_port is not None:
            print(f"tiercache: Prometheus metrics of the cached run on http://127.0.0.1:{metrics_port}/metrics "
                  "(its counters start when it does, after the cold run; served until the demo exits)",
                  file=sys.stderr)
        bar = tqdm(total=total, desc=f"demo {spec.name} (cold, then warm)", file=sys.stderr, disable=args.quiet)

    try:
        with _named_by_flags({"metrics_port": "--metrics-port", "engine.num_blocks": "--l0-blocks"}):
            report = demo(spec, offload, engine_cfg, progress=lambda: bar.update(1), started=started,
                          metrics_port=args.metrics_port, model_cfg=HYBRID_MODEL if args.model == "hybrid" else None)
    finally:
        if bar is not None:
            bar.close()
    report["command"] = "tiercache " + " ".join(sys.argv[1:])
    _write_json(args.json, report)
    print_report(report, ",".join(args.tiers) or "none")
    if args.out:
        write_files(Path(args.out), report)
    return 0 if report["outputs_match"] else 1


@contextlib.contextmanager
def _named_by_flags(flags: dict[str, str]):
    """An engine setting the command line set by a flag is reported under the flag's name."""
    try:
        yield
    except ConfigError as err:
        if err.field not in flags:
            raise
        raise ConfigError(flags[err.field], err.value, err.reason) from None


def cmd_cache(args: argparse.Namespace) -> int:
    from tiercache import cache_dir

    cfg = load_config(args.config, overrides=args.set)
    root = Path(args.disk_path or cfg.disk.path or default_disk_path())
    if root.exists() and not root.is_dir():
        raise ConfigError("--disk-path", str(root), "is not a directory")
    if args.action == "info":
        u = cache_dir.usage(root)
        print(json.dumps({"path": u.path, "chunks": u.chunks, "bytes": u.bytes, "storage_digests": u.digests,
                          "temp_files": u.temp_files}, indent=2))
    else:
        u = cache_dir.clear(root)
        print(f"tiercache: removed {u.chunks} chunk files ({u.bytes / 2**20:.1f} MiB) and {u.temp_files} temp files "
              f"from {u.path}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tiercache.engine import LLM, EngineConfig, SamplingParams

    offload = _offload_config(args)
    engine_cfg = EngineConfig(block_size=args.block_size)
    with LLM(engine_cfg=engine_cfg, offload=offload, model_path=args.model_path, tokenizer=args.tokenizer) as llm:
        (out,) = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    print(out.text)
    print(f"[{len(out.token_ids)} tokens: {out.token_ids}; time to first token {out.ttft_s * 1e3:.1f} ms]",
          file=sys.stderr)
    return 0


def _check_listen(host: str, port: int, flag: str) -> None:
    """One line naming ``flag`` when this host cannot listen on ``host:port`` — before any work starts."""
    import socket
    try:
        socket.create_server((host, port)).close()
    except OSError as err:
        raise ConfigError(flag, port, f"cannot listen on {host}:{port} ({err.strerror or err})") from None


def cmd_api(args: argparse.Namespace) -> int:
    from tiercache.engine import EngineConfig, LLMEngine

    if importlib.util.find_spec("aiohttp") is None:
        raise TierCacheError("tiercache api serves HTTP with aiohttp, which is not installed: "
                             "pip install 'tiercache[api]'")
    from tiercache.engine.openai_api import serve

    offload = _offload_config(args)
    engine_cfg = EngineConfig(block_size=args.block_size, num_blocks=args.l0_blocks)
    _check_listen(args.host, args.port, "--port")
    kv_events = None
    if args.kv_events:
        for module in ("zmq", "msgspec"):
            if importlib.util.find_spec(module) is None:
                raise TierCacheError(f"--kv-events publishes with pyzmq and msgspec; {module} is not installed: "
                                     "pip install 'tiercache[fleet]'")
        from tiercache.engine.openai_api import KVEventsOptions
        for flag, port in (("--kv-events-port", args.kv_events_port),
                           ("--kv-events-replay-port", args.kv_events_replay_port)):
            if port:
                _check_listen(args.host, port, flag)
        kv_events = KVEventsOptions(args.host, args.kv_events_port, args.kv_events_replay_port)
    with LLMEngine(engine_cfg=engine_cfg, offload=offload, model_path=args.model_path,
                   tokenizer=args.tokenizer) as engine:
        serve(engine, args.host, args.port, args.served_model_name,
              ready=lambda port: print(f"tiercache api: {args.served_model_name} on http://{args.host}:{port}/v1",
                                       flush=True),
              kv_events=kv_events, tokenizer=str(Path(args.tokenizer).resolve()) if args.tokenizer else "bytes")
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    for module, extra in (("aiohttp", "api"), ("zmq", "fleet"), ("msgspec", "fleet"), ("prometheus_client", "metrics")):
        if importlib.util.find_spec(module) is None:
            raise TierCacheError(f"tiercache route needs {module}, which is not installed: "
                                 f"pip install 'tiercache[fleet]'")
    from tiercache.fleet.replicas import ReplicaEntry, check_url, load_replicas
    from tiercache.fleet.router import RouterConfig, serve
    from tiercache.fleet.routing import routing_policies
    from tiercache.fleet.tenants import Tenants

    if args.policy not in routing_policies:
        raise ConfigError("--policy", args.policy, f"known: {', '.join(routing_policies.names())}")
    entries = [ReplicaEntry(check_url(u, "--replica")) for u in args.replica]
    entries += load_replicas(args.replicas) if args.replicas else []
    urls = [e.url for e in entries]
    if len(set(urls)) != len(urls):
        raise ConfigError("--replica", ",".join(urls), "names a replica twice")
    tenants = Tenants.load(args.tenants) if args.tenants else Tenants()
    config = RouterConfig(policy=args.policy, health_interval_s=args.health_interval,
                          prefill_tokens_per_s=args.prefill_tokens_per_s, admin_key=args.admin_key or "",
                          sticky_sessions=args.sticky_sessions)
    _check_listen(args.host, args.port, "--port")
    serve(entries, args.host, args.port, config, tenants,
          ready=lambda port: print(f"tiercache route: {len(urls)} replicas behind http://{args.host}:{port}/v1 "
                                   f"({args.policy})", flush=True))
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line — what is wrong and where the help is — not a usage dump (subcommands too: they
    are made with the parser's own class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiercache", description="Tiered KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="offload benchmarks").add_subparsers(dest="bench", required=True)
    tiers = bench.add_parser("tiers", help="tier put/get throughput beside the raw machine limit")
    tiers.add_argument("--tiers", type=_bench_tier_list, default=["cpu"],
                       help="comma-separated tiers: cpu, disk, redis, grpc (bytes on the server's data channel), "
                            "grpc-stream (bytes on gRPC streams), grpc-shm (a serve with --shm-dir, its memory "
                            "tier read and written as files on this host)")
    tiers.add_argument("--disk-path", help="directory on the disk to measure (default: disk.path, else $TMPDIR)")
    tiers.add_argument("--fsync", action="store_true", help="disk: fdatasync every chunk (and every raw file)")
    tiers.add_argument("--redis-url", help="redis: the server to measure (default: redis.url when set, else a "
                                            "redis-server started for the run)")
    tiers.add_argument("--grpc-address", help="grpc: a `tiercache serve` to measure (default: start one for the run)")
    tiers.add_argument("--shape", choices=["llama-8b", "small"], default="llama-8b",
                       help="KV geometry: llama-8b (32 layers, 8 KV heads, dim 128, bf16) or small (4, 2, 64, fp32)")
    tiers.add_argument("--chunk-tokens", type=_positive, default=256, help="tokens per chunk (multiple of 16)")
    tiers.add_argument("--total-mib", type=_size_mib, default=1 << 30, help="bytes moved per repetition, in MiB")
    tiers.add_argument("--reps", type=_positive, default=5, help="repetitions (medians are reported)")
    tiers.add_argument("--layout", choices=["allocated", "scattered", "both"], default="both",
                       help="L0 block placement: as the pool allocates, shuffled, or both")
    tiers.add_argument("--codecs", type=_tier_format_list, default=None,
                       help="disk and remote tiers: run each with these chunk codecs in turn and report tokens/s "
                            "against the first, e.g. raw,int8; NAME+aes encrypts too (AES-256-GCM), e.g. "
                            "raw,raw+aes (default: format.codec)")
    tiers.add_argument("--json", metavar="PATH", help="write the report as JSON")
    tiers.add_argument("--out", metavar="DIR", help="write tiers.json, tiers.md and tiers.png here")
    tiers.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(tiers)
    tiers.set_defaults(func=commands.cmd_bench_tiers)

    t = bench.add_parser("trace", help="replay a Mooncake-format trace through the tiers' index and policies")
    t.add_argument("--trace", required=True,
                   help="Mooncake-format JSONL (timestamp, input_length, output_length, hash_ids; .gz read as is); "
                        "a source checkout ships one: tests/data/mooncake_synthetic_trace.jsonl.gz")
    t.add_argument("--capacity-tokens", type=_size_list("--capacity-tokens", "1M,3M"), default=[1_000_000, 3_000_000],
                   help="comma-separated capacities in tokens, e.g. 500K,1M,3M")
    t.add_argument("--capacity-bytes", type=_size_list("--capacity-bytes", "64GiB,128GiB"), default=None,
                   help="comma-separated capacities in bytes (e.g. 64GiB,128GiB) instead: each codec of --codecs "
                        "gets the tokens its chunks of --shape fit in them")
    t.add_argument("--codecs", type=_codec_list, default=["raw"], help="with --capacity-bytes, e.g. raw,int8")
    t.add_argument("--shape", choices=["llama-8b", "small"], default="llama-8b",
                   help="with --capacity-bytes: the KV geometry whose chunks fill the bytes")
    t.add_argument("--policy", type=_policy_list, default=["lru", "lfu-da", "s3-fifo", "lfu-da+adaptive-sighting"],
                   help="comma-separated eviction policies, each optionally with an admission policy "
                        "(lfu-da+second-sighting; with --l1-tokens it guards L2; none named: always) and, with "
                        "--l1-tokens, L1's and L2's apart (lfu-da/reuse-model) (default: lru,lfu-da,s3-fifo,"
                        "lfu-da+adaptive-sighting: the tiers' defaults last)")
    t.add_argument("--l1-tokens", type=_size_list("--l1-tokens", "1M"), default=None,
                   help="replay L1 of this many tokens over an L2 of each capacity through the real cache manager "
                        "(promotions, write-back spills; the policy in both tiers unless given as L1/L2) instead "
                        "of one tier")
    t.add_argument("--l1-admission", default="always", metavar="POLICY",
                   help="with --l1-tokens: which chunks the engine's stores put into L1 (always, frequency, "
                        "second-sighting; cpu.admission) (default: always)")
    t.add_argument("--promotion", default="copy", choices=PROMOTIONS,
                   help="with --l1-tokens: a chunk promoted from L2 stays there (copy) or leaves it (move; "
                        "disk.promotion) (default: copy)")
    t.add_argument("--out", metavar="DIR", help="write trace.json, trace.md and trace.png here")
    t.add_argument("--json", metavar="PATH")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=commands.cmd_bench_trace)

    mt = bench.add_parser("make-trace", help="write a conversation trace in the Mooncake format (with "
                                             "conversation_id): multi-turn chats among one-off requests")
    mt.add_argument("--out", required=True, metavar="FILE", help="the JSONL file to write")
    mt.add_argument("--conversations", type=_positive, default=2000)
    mt.add_argument("--conversation-rate", type=_positive_float, default=0.5, help="conversations started per second")
    mt.add_argument("--mean-turns", type=_positive_float, default=4.0)
    mt.add_argument("--think-s", type=_positive_float, default=90.0, help="mean pause before a next turn")
    mt.add_argument("--one-off-rate", type=float, default=0.5, help="one-off requests per second (0: none)")
    mt.add_argument("--system-prompts", type=_positive, default=12, help="system prompts, Zipf-popular")
    mt.add_argument("--system-tokens", type=_positive, default=2048)
    mt.add_argument("--question-tokens", type=_positive, default=350,
                    help="a question (each turn's, each one-off's), mean tokens")
    mt.add_argument("--answer-tokens", type=_positive, default=250, help="an answer, mean tokens")
    mt.add_argument("--document-tokens", type=_positive, default=4000, help="a one-off's document, mean tokens")
    mt.add_argument("--seed", type=int, default=0)
    mt.set_defaults(func=commands.cmd_bench_make_trace)

    c = bench.add_parser("codecs", help="chunk codecs: bytes, encode/decode GB/s beside the disk, KV error and "
                                        "the accuracy of a trained model served from quantized chunks")
    c.add_argument("--codecs", type=_codec_list, default=["raw", "lz4", "lz4-shuffle", "int8", "fp8-e4m3"],
                   help="comma-separated codecs (default: all)")
    c.add_argument("--shape", choices=["llama-8b", "small"], default="llama-8b",
                   help="KV geometry of the speed chunk (llama-8b: bf16, 32 layers, 8 KV heads, dim 128)")
    c.add_argument("--chunk-tokens", type=_positive, default=256, help="tokens per chunk (multiple of 16)")
    c.add_argument("--reps", type=_positive, default=5, help="repetitions (medians are reported)")
    c.add_argument("--model", metavar="DIR", help="a local Hugging Face Llama checkpoint for the accuracy runs "
                                                  "(default: the reference model trained on a synthetic corpus, "
                                                  "trained once and cached)")
    c.add_argument("--train-steps", type=_positive, default=None, help="steps for the trained default model")
    c.add_argument("--requests", type=_positive, default=16, help="accuracy requests (4 documents, questions)")
    c.add_argument("--max-tokens", type=_positive, default=16, help="greedy tokens generated per request")
    c.add_argument("--no-accuracy", action="store_true", help="bytes, speed and synthetic-KV error only")
    c.add_argument("--disk-path", help="directory for the disk measurements and chunks (default: $TMPDIR)")
    c.add_argument("--out", metavar="DIR", help="write codecs.json, codecs.md and codecs.png here")
    c.add_argument("--json", metavar="PATH")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=commands.cmd_bench_codecs)

    e = bench.add_parser("engine", help="reference-engine workloads across tier setups")
    e.add_argument("--workloads", default="shared-prefix,multi-turn,long-doc,no-reuse",
                   help="comma-separated: shared-prefix, multi-turn, long-doc, no-reuse")
    e.add_argument("--setups", default="none,cpu,cpu+disk",
                   help="comma-separated: none, cpu, cpu+disk, cpu+redis, cpu+disk+redis (against redis.url), "
                        "cpu+grpc, cpu+disk+grpc (a tiercache serve started for the run)")
    e.add_argument("--requests", type=_positive, default=8)
    e.add_argument("--prefix-tokens", type=_positive, default=1024)
    e.add_argument("--suffix-tokens", type=_positive, default=64)
    e.add_argument("--output-tokens", type=_positive, default=8)
    e.add_argument("--preemption", type=_preemption_list, metavar="MODES",
                   help="instead of the setups: these preemption modes (e.g. recompute,swap,auto) side by side "
                        "under memory pressure, on the --pressure workloads, each with an L1 to swap to")
    e.add_argument("--pressure", type=_pressure_list, default=["long-decode", "short", "shared-prefix"],
                   help="with --preemption: comma-separated, of long-decode, short, shared-prefix")
    e.add_argument("--reps", type=_positive, default=3, help="with --preemption: runs per mode (medians)")
    e.add_argument("--out", metavar="DIR", help="write engine.json, engine.md and engine.png here")
    e.add_argument("--json", metavar="PATH")
    e.add_argument("--quiet", action="store_true")
    _add_config_flags(e)
    e.set_defaults(func=commands.cmd_bench_engine)

    rb = bench.add_parser("route", help="a multi-replica chat workload through `tiercache route`, each policy in "
                                        "turn: TTFT, throughput, hit ratio, load imbalance, prediction error")
    rb.add_argument("--replicas", type=_int_list, default=[2, 4], help="fleet sizes, e.g. 2,4")
    rb.add_argument("--policies", type=_routing_list,
                    default=["round-robin", "least-loaded", "prefix-affinity", "expected-ttft"],
                    help="comma-separated routing policies")
    rb.add_argument("--shared", choices=["no", "yes", "both"], default="both",
                    help="replicas with a shared `tiercache serve` under their L1 (yes), without (no), or both")
    rb.add_argument("--conversations", type=_positive, default=120,
                    help="about 3.8 requests each; enough that a p99 is not the opening seconds' second slowest")
    rb.add_argument("--max-turns", type=_positive, default=8)
    rb.add_argument("--system-prompts", type=_positive, default=4)
    rb.add_argument("--system-tokens", type=_positive, default=1200)
    rb.add_argument("--user-tokens", type=_positive, default=300)
    rb.add_argument("--output-tokens", type=_positive, default=8)
    rb.add_argument("--rate", type=_positive_float, default=4.0,
                    help="conversations started per second (the default keeps two reference-engine replicas on a "
                         "2-core machine 65-90 %% busy, as fast as the machine runs that day; RESULTS.md has "
                         "runs from 1.6 to 4.0)")
    rb.add_argument("--seed", type=int, default=0)
    rb.add_argument("--replica-set", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                    help="a config field for every replica (repeatable), e.g. keys.chunk_tokens=64: what a "
                         "deployment's settings do to the routing comparison")
    rb.add_argument("--overhead-pairs", type=int, default=30,
                    help="requests alternated direct and through the router to measure its overhead (0: skip)")
    rb.add_argument("--out", metavar="DIR", help="write route.json, route.md and route.png here")
    rb.add_argument("--json", metavar="PATH")
    rb.add_argument("--quiet", action="store_true")
    rb.set_defaults(func=commands.cmd_bench_route)

    d = sub.add_parser("demo", help="a workload on the reference engine, cold vs cached")
    d.add_argument("--workload", choices=["docs", "shared-prefix", "multi-turn", "long-doc", "no-reuse"],
                   default="docs", help="docs (default): several documents, some asked about again soon, some long "
                                        "after; shared-prefix: one system prompt; ...")
    d.add_argument(
        "--tiers",
        type=_tier_list,
        default=["cpu", "disk"],
        help="tiers below L0 (default cpu,disk): cpu, cpu,disk, cpu,redis, cpu,grpc, cpu,disk,grpc ... or none",
    )
    d.add_argument(
        "--disk-path", help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2, kept across runs)"
    )
    d.add_argument("--redis-url", help="L3 Redis server for --tiers cpu,redis (default: redis.url)")
    d.add_argument("--grpc-address", help="L3 `tiercache serve` host:port for --tiers cpu,grpc (default: grpc.address)")
    d.add_argument("--requests", type=_positive, default=16)
    d.add_argument("--prefix-tokens", type=_positive, default=2048, help="shared prefix / history / document length")
    d.add_argument("--suffix-tokens", type=_positive, default=64, help="per-request question or user turn")
    d.add_argument("--output-tokens", type=_positive, default=8)
    d.add_argument("--block-size", type=_positive, default=16)
    d.add_argument("--l0-blocks", type=_positive, default=None,
                   help="blocks in the engine's own pool (default: 160, or what the workload's longest request "
                        "needs if more: less than the workload, as in production)")
    d.add_argument("--no-prefix-caching", action="store_true", help="no L0 hits: every hit comes from a tier")
    d.add_argument("--model", choices=["llama", "hybrid"], default="llama",
                   help="llama (default): full attention in every layer; hybrid: sliding-window, linear-attention "
                        "and full-attention layers, stored per KV-cache group")
    d.add_argument("--json", metavar="PATH")
    d.add_argument("--out", metavar="DIR", help="write demo.json, demo.md and demo.png here")
    d.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics of the cached run on this port")
    d.add_argument("--quiet", action="store_true")
    _add_config_flags(d)
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser("generate", help="generate text with the reference engine")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=_positive, default=32)
    g.add_argument("--temperature", type=_finite, default=0.0, help="0: greedy")
    g.add_argument("--model-path", help="local Hugging Face Llama directory (default: seeded weights)")
    g.add_argument("--tokenizer", help="tokenizer.json or its directory (default: bytes)")
    g.add_argument(
        "--tiers", type=_tier_list, default=[], help="tiers below L0: cpu, cpu,disk, cpu,grpc ... (default none)"
    )
    g.add_argument("--disk-path", help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2)")
    g.add_argument("--redis-url", help="L3 Redis server (default: redis.url)")
    g.add_argument("--grpc-address", help="L3 `tiercache serve` host:port (default: grpc.address)")
    g.add_argument("--block-size", type=_positive, default=16)
    _add_config_flags(g)
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("api", help="serve the reference engine over the OpenAI API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health)")
    a.add_argument("--host", default="127.0.0.1", help="address to listen on")
    a.add_argument("--port", type=_port, default=8000, help="port (0: any free port, printed at start)")
    a.add_argument("--served-model-name", default="tiercache-reference", help="the model name clients ask for")
    a.add_argument("--model-path", help="local Hugging Face Llama directory (default: seeded weights)")
    a.add_argument("--tokenizer", help="tokenizer.json or its directory (default: bytes)")
    a.add_argument("--tiers", type=_tier_list, default=[], help="tiers below L0: cpu, cpu,disk, cpu,grpc ... "
                                                               "(default none: the engine's own prefix cache only)")
    a.add_argument("--disk-path", help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2)")
    a.add_argument("--redis-url", help="L3 Redis server (default: redis.url)")
    a.add_argument("--grpc-address", help="L3 `tiercache serve` host:port (default: grpc.address)")
    a.add_argument("--block-size", type=_positive, default=16)
    a.add_argument("--l0-blocks", type=_positive, default=1024, help="blocks in the engine's own KV pool (L0)")
    a.add_argument("--kv-events", action="store_true",
                   help="publish the pool's and tiers' KV events (vLLM's ZeroMQ format) and describe this replica "
                        "at /tiercache/replica, for `tiercache route`")
    a.add_argument("--kv-events-port", type=_port, default=0, help="ZeroMQ PUB port of the events (0: any free)")
    a.add_argument("--kv-events-replay-port", type=_port, default=0,
                   help="ZeroMQ ROUTER port answering replays of missed events (0: any free)")
    _add_config_flags(a)
    a.set_defaults(func=cmd_api)

    r = sub.add_parser("route", help="route OpenAI API requests to the replica where their prefix is cheapest "
                                     "(expected time to first token)")
    r.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat; more can join at run time "
                        "through /admin/replicas)")
    r.add_argument("--replicas", metavar="FILE", help="replicas from a file (YAML or JSON), each with its "
                                                      "descriptor when it serves none itself (vllm serve): see "
                                                      "the README's Fleet section")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=_port, default=8080, help="port (0: any free port, printed at start)")
    r.add_argument("--policy", default="expected-ttft",
                   help="expected-ttft (default), prefix-affinity, least-loaded or round-robin")
    r.add_argument("--tenants", metavar="FILE", help="API keys → tenants (YAML or JSON); without it one "
                                                     "anonymous tenant, no key asked")
    r.add_argument("--health-interval", type=_positive_float, default=2.0,
                   help="seconds between health checks; a replica silent for one leaves the pool")
    r.add_argument("--prefill-tokens-per-s", type=_positive_float, default=20_000.0,
                   help="a replica's prefill rate until the router has measured it, for a replica whose "
                        "descriptor carries no profile of its own (tiercache api measures one before serving)")
    r.add_argument("--admin-key", help="key of /admin/replicas (without one those routes are off)")
    r.add_argument("--sticky-sessions", action="store_true",
                   help="a request with a session (vLLM's session_id field or X-Session-ID header) goes first to "
                        "the replica that served its session last, unless it is down or twice as slow as the best")
    r.set_defaults(func=cmd_route)

    v = sub.add_parser("serve", help="run the gRPC cache server that engine replicas share")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=_port, default=7070, help="port (0: any free port, printed at start)")
    v.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the data channel that carries chunk bytes beside gRPC (0: any free port, "
                        "advertised in Health; -1: none, bytes go over gRPC)")
    v.add_argument("--capacity", type=_size, default=8 << 30, help="memory for chunks, e.g. 8GiB")
    v.add_argument("--eviction", default=None, help="eviction policy of memory and disk (default: lfu-da)")
    v.add_argument("--admission", default=None,
                   help="which chunks a full store takes, by what every client asked for: adaptive-sighting "
                        "(default), second-sighting, frequency or always (anything while there is room)")
    v.add_argument("--retention", type=float, default=0.0, metavar="SECONDS",
                   help="keep a chunk at most this long after it came, in memory and on disk (0: no limit); "
                        "a tenant with its own store may set its own (retention in the tenants file)")
    v.add_argument("--namespace-retention", action="append", default=[], metavar="NAMESPACE_HEX=SECONDS",
                   help="keep one namespace's chunks (a storage digest) at most this long, in every tenant's "
                        "store (repeatable; a tenant's namespace_retention overrides it)")
    v.add_argument("--audit-log", metavar="FILE", default="",
                   help="also append the audit trail (purges and expiries per tenant, as JSON lines, which the "
                        "log has too) to this file, created mode 600")
    v.add_argument("--shm-dir", metavar="DIR", default="",
                   help="keep the memory tier as chunk files in this tmpfs directory (e.g. /dev/shm/tiercache), "
                        "which clients on this host read and write directly")
    v.add_argument(
        "--disk", metavar="DIR", default="", help="spill evicted chunks to files here (kept across restarts)"
    )
    v.add_argument("--disk-capacity", type=_size, default=None, help="bytes of chunk files, e.g. 100GiB (default "
                                                                     "100GiB; with --disk only)")
    v.add_argument("--auth-token-file", default="", help="require 'authorization: Bearer <token>' on every call")
    v.add_argument("--max-message", type=_size, default=128 << 20, help="largest chunk message accepted, e.g. 128MiB")
    v.add_argument("--workers", type=_positive, default=8, help="RPC handler threads (two are kept from streams, "
                                                               "for health and lookups)")
    v.add_argument("--read-timeout", type=lambda t: _finite(t, 0.001), default=10.0,
                   help="seconds a client may leave a request (or a gRPC stream) without progress before it is "
                        "dropped")
    v.add_argument("--idle-timeout", type=lambda t: _finite(t, 0.001), default=60.0,
                   help="seconds a data-channel connection may sit idle between requests")
    v.add_argument("--max-value", type=_size, default=0,
                   help="largest chunk value accepted (default: 256MiB, at most --capacity)")
    v.add_argument("--max-inflight", type=_size, default=0,
                   help="bytes being received from all clients at once, reserved before they arrive "
                        "(default: four of the largest values, at most --capacity); memory stays within "
                        "--capacity + this + a constant")
    v.add_argument("--grace", type=_finite, default=5.0, help="seconds running calls get at shutdown")
    v.add_argument("--metrics-port", type=_port, default=0, help="serve Prometheus metrics on this port")
    v.add_argument("--log-format", choices=["json", "text"], default="json")
    v.set_defaults(func=cmd_serve)

    ca = sub.add_parser("cache", help="the disk tier's directory: what it keeps (info), or empty it (clear)")
    ca.add_argument("action", choices=["info", "clear"])
    ca.add_argument("--disk-path", help="the disk tier's directory (default: disk.path, else ~/.cache/tiercache/l2, "
                                        "where `tiercache demo` keeps it)")
    _add_config_flags(ca)
    ca.set_defaults(func=cmd_cache)

    pu = sub.add_parser("purge", help="take KV out of a deployment: everything of a tenant or namespace, a "
                                      "prompt (and every chunk after it), or what is older than an age")
    what = pu.add_mutually_exclusive_group(required=True)
    what.add_argument("--everything", action="store_true", help="every chunk (of --namespace, when given)")
    what.add_argument("--older-than", type=lambda t: _finite(t, 0.0), metavar="SECONDS",
                      help="every chunk stored longer ago than this")
    what.add_argument("--prompt", help="a completion prompt's text (hashed as --replica does)")
    what.add_argument("--messages", metavar="FILE", help="a chat's messages, a JSON list (hashed as --replica does)")
    what.add_argument("--tokens", help="a prompt's token ids, comma separated")
    what.add_argument("--keys", help="chunk keys (hex), comma separated: each, and every chunk after it")
    pu.add_argument("--replica", help="for a prompt: how its engine names chunks — a running `tiercache api`'s URL "
                                      "or a replica descriptor file (a vLLM connector's `router_descriptor`)")
    pu.add_argument("--model", default="", help="the model the prompt was sent to (checked against --replica)")
    pu.add_argument("--tokenizer", default="", help="for a descriptor file without one: the model's directory")
    pu.add_argument("--chat-template", default="", choices=["", "tiercache", "hf"],
                    help="for a descriptor file without one: hf for a vLLM replica")
    pu.add_argument("--cache-salt", default="", help="the requests' cache_salt (the router's per-tenant salt)")
    pu.add_argument("--keep-first", type=int, default=0, metavar="TOKENS",
                    help="leading tokens of the prompt to keep (a shared system prompt): chunks wholly inside stay")
    pu.add_argument("--namespace", action="append", default=[], metavar="HEX",
                    help="only this namespace (a storage digest, as `tiercache stats` and disk directories show)")
    pu.add_argument("--server", metavar="HOST:PORT", help="a `tiercache serve` (and the engines under it)")
    pu.add_argument("--auth-token-file", default="", help="the server's auth token (a tenant with the purge right)")
    pu.add_argument("--tenant", default="", help="another tenant's chunks (an admin token's purge)")
    pu.add_argument("--wait", type=lambda t: _finite(t, 0.0), default=0.0, metavar="SECONDS",
                    help="longest wait for the engines under the server to apply it (default 5, at most 60)")
    pu.add_argument("--disk-path", action="append", default=[], help="a disk tier's directory (repeatable)")
    pu.add_argument("--redis", default="", metavar="URL", help="a Redis tier's URL (and the engines reading it)")
    pu.add_argument("--redis-cluster", action="store_true", help="--redis is a Redis Cluster")
    pu.set_defaults(func=cmd_purge)

    st = sub.add_parser("stats", help="a running `tiercache serve`: its tiers, counters and most read chunks (JSON)")
    st.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's gRPC address")
    st.add_argument("--auth-token-file", default="", help="the server's auth token, when it requires one")
    st.add_argument("--timeout", type=lambda t: _finite(t, 0.001), default=5.0, help="seconds to wait for the answer")
    st.set_defaults(func=cmd_stats)
    return parser


def _bench_tier_list(text: str) -> list[str]:
    return _tier_list(text, frozenset({"cpu", "disk", "redis", "grpc", "grpc-stream", "grpc-shm"}))


def _size(text: str) -> int:
    try:
        return parse_size(text, "size")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION
    from tiercache.server.app import ServeConfig, run

    config = ServeConfig(host=args.host, port=args.port, data_port=args.data_port, capacity=args.capacity,
                         eviction=args.eviction or DEFAULT_EVICTION, admission=args.admission or DEFAULT_ADMISSION,
                         retention=args.retention,
                         namespace_retention=tuple(args.namespace_retention),
                         disk=args.disk, disk_capacity=_disk_capacity(args), shm_dir=args.shm_dir,
                         auth_token_file=args.auth_token_file,
                         max_message=args.max_message, workers=args.workers, grace=args.grace,
                         max_value=args.max_value, max_inflight=args.max_inflight,
                         read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                         metrics_port=args.metrics_port, audit_log=args.audit_log)
    return run(config, args.log_format)


def _disk_capacity(args: argparse.Namespace) -> int:
    if args.disk_capacity is None:
        return 100 << 30
    if not args.disk:
        raise ConfigError("--disk-capacity", args.disk_capacity, "has no disk to bound: give --disk DIR too")
    return args.disk_capacity


def cmd_purge(args: argparse.Namespace) -> int:
    from tiercache.config import is_host_port, read_token
    from tiercache.contracts.keys import HASH_BYTES, NAMESPACE_DIGEST_BYTES
    from tiercache.contracts.purge import PurgeOrder
    from tiercache.purging import PromptSource, PurgeRefused, parse_hex_list, prompt_keys, purge

    if not args.server and not args.disk_path and not args.redis:
        raise ConfigError("--server", "", "names nowhere to purge: give --server, --redis and/or --disk-path")
    if args.server and not is_host_port(args.server):
        raise ConfigError("--server", args.server, "expected host:port")
    for path in args.disk_path:
        if not Path(path).is_dir():
            raise ConfigError("--disk-path", path, "is not a directory")
    if args.wait > 60:
        raise ConfigError("--wait", args.wait, "is at most 60 seconds")
    if args.keep_first < 0:
        raise ConfigError("--keep-first", args.keep_first, "must be >= 0")
    prompt = args.prompt is not None or args.messages or args.tokens
    if prompt and not args.replica:
        raise ConfigError("--replica", "", "a prompt is hashed as its engine does: give the replica it was sent to")
    namespaces = parse_hex_list(",".join(args.namespace), "--namespace", NAMESPACE_DIGEST_BYTES) \
        if args.namespace else ()
    roots: tuple[bytes, ...] = ()
    if args.keys:
        roots = parse_hex_list(args.keys, "--keys", HASH_BYTES)
    elif prompt:
        tokens = None
        if args.tokens:
            try:
                tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
            except ValueError:
                raise ConfigError("--tokens", args.tokens, "must be integers, comma separated") from None
        roots = prompt_keys(PromptSource(args.replica, args.prompt, args.messages, tokens, args.model,
                                         args.tokenizer, args.chat_template, args.cache_salt, args.keep_first))
    stored_before = time.time() - args.older_than if args.older_than is not None else None
    order = PurgeOrder(roots, stored_before, args.everything, namespaces)
    token = read_token(args.auth_token_file, "--auth-token-file") if args.auth_token_file else None
    try:
        result = purge(order, args.server or "", token, args.tenant, args.wait, tuple(args.disk_path), args.redis,
                       args.redis_cluster)
    except PurgeRefused as err:
        print(f"tiercache: error: purge refused by {err}", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict(), indent=2))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    import grpc

    from tiercache.config import is_host_port, read_token
    from tiercache.wire import tiercache_pb2 as pb
    from tiercache.wire.grpc_messages import AUTH_HEADER, method

    if not is_host_port(args.server):
        raise ConfigError("--server", args.server, "expected host:port")
    token = read_token(args.auth_token_file, "--auth-token-file") if args.auth_token_file else None
    with grpc.insecure_channel(args.server) as channel:
        call = channel.unary_unary(method("Stats"), lambda b: b, lambda b: b)
        try:
            raw = call(pb.StatsRequest().SerializeToString(), timeout=args.timeout,
                       metadata=((AUTH_HEADER, f"Bearer {token}"),) if token else ())
        except grpc.RpcError as err:
            print(f"tiercache: error: {args.server}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    reply = pb.StatsReply.FromString(raw)
    print(json.dumps({
        "namespaces": reply.namespaces,
        "counters": dict(sorted(reply.counters.items())),
        "tiers": [{"name": t.name, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                   "chunks": t.chunks, "counters": dict(sorted(t.counters.items()))} for t in reply.tiers],
        "hot_chunks": [{"namespace": h.namespace.hex(), "key": h.key.hex(), "hits": h.hits} for h in reply.hot_chunks],
    }, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "chunk_tokens", 16) % 16:
        parser.error(f"--chunk-tokens must be a multiple of the block size 16, got {args.chunk_tokens}")
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"tiercache: error: {err}", file=sys.stderr)
        return 2
    except TierCacheError as err:
        print(f"tiercache: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an unreadable input file
        print(f"tiercache: error: {err.filename or ''}: {err.strerror}", file=sys.stderr)
        return 2
    except ValueError as err:  # bad request input (empty prompt, too long, bad workload sizes, bad trace)
        print(f"tiercache: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
