"""`tiercache api`: the reference engine behind the OpenAI API, with its flags."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from tiercache.cli.common import check_listen, offload_config
from tiercache.cli.options import (
    add_block_size_flag,
    add_config_flags,
    add_listen_flags,
    add_model_flags,
    add_tier_flags,
    port,
    positive,
)
from tiercache.errors import TierCacheError


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("api", help="serve the reference engine over the OpenAI API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health)")
    add_listen_flags(a, 8000)
    a.add_argument("--served-model-name", default="tiercache-reference", help="the model name clients ask for")
    add_model_flags(a)
    add_tier_flags(a, [], tiers_help="tiers below L0: cpu, cpu,disk, cpu,grpc ... (default none: the engine's own "
                                     "prefix cache only)",
                   disk_help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2)")
    add_block_size_flag(a)
    a.add_argument("--l0-blocks", type=positive, default=1024, help="blocks in the engine's own KV pool (L0)")
    a.add_argument("--kv-events", action="store_true",
                   help="publish the pool's and tiers' KV events (vLLM's ZeroMQ format) and describe this replica "
                        "at /tiercache/replica, for `tiercache route`")
    a.add_argument("--kv-events-port", type=port, default=0, help="ZeroMQ PUB port of the events (0: any free)")
    a.add_argument("--kv-events-replay-port", type=port, default=0,
                   help="ZeroMQ ROUTER port answering replays of missed events (0: any free)")
    add_config_flags(a)
    a.set_defaults(func=cmd_api)


def cmd_api(args: argparse.Namespace) -> int:
    from tiercache.engine import EngineConfig, LLMEngine

    if importlib.util.find_spec("aiohttp") is None:
        raise TierCacheError("tiercache api serves HTTP with aiohttp, which is not installed: "
                             "pip install 'tiercache[api]'")
    from tiercache.engine.openai_api import serve

    offload = offload_config(args)
    engine_cfg = EngineConfig(block_size=args.block_size, num_blocks=args.l0_blocks)
    check_listen(args.host, args.port, "--port")
    kv_events = _kv_events(args) if args.kv_events else None
    with LLMEngine(engine_cfg=engine_cfg, offload=offload, model_path=args.model_path,
                   tokenizer=args.tokenizer) as engine:
        serve(engine, args.host, args.port, args.served_model_name,
              ready=lambda port: print(f"tiercache api: {args.served_model_name} on http://{args.host}:{port}/v1",
                                       flush=True),
              kv_events=kv_events, tokenizer=str(Path(args.tokenizer).resolve()) if args.tokenizer else "bytes")
    return 0


def _kv_events(args: argparse.Namespace):
    """Where `--kv-events` publishes, its ports checked before the engine starts."""
    for module in ("zmq", "msgspec"):
        if importlib.util.find_spec(module) is None:
            raise TierCacheError(f"--kv-events publishes with pyzmq and msgspec; {module} is not installed: "
                                 "pip install 'tiercache[fleet]'")
    from tiercache.engine.openai_api import KVEventsOptions

    for flag, chosen in (("--kv-events-port", args.kv_events_port),
                         ("--kv-events-replay-port", args.kv_events_replay_port)):
        if chosen:
            check_listen(args.host, chosen, flag)
    return KVEventsOptions(args.host, args.kv_events_port, args.kv_events_replay_port)
