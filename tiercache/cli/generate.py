"""`tiercache generate`: one prompt through the reference engine, with its flags."""
from __future__ import annotations

import argparse
import sys

from tiercache.cli.common import offload_config
from tiercache.cli.options import (
    add_block_size_flag,
    add_config_flags,
    add_model_flags,
    add_tier_flags,
    finite,
    positive,
)


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text with the reference engine")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=positive, default=32)
    g.add_argument("--temperature", type=finite, default=0.0, help="0: greedy")
    add_model_flags(g)
    add_tier_flags(g, [], tiers_help="tiers below L0: cpu, cpu,disk, cpu,grpc ... (default none)",
                   disk_help="L2 directory (default: disk.path, else ~/.cache/tiercache/l2)")
    add_block_size_flag(g)
    add_config_flags(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from tiercache.engine import LLM, EngineConfig, SamplingParams

    offload = offload_config(args)
    engine_cfg = EngineConfig(block_size=args.block_size)
    with LLM(engine_cfg=engine_cfg, offload=offload, model_path=args.model_path, tokenizer=args.tokenizer) as llm:
        (out,) = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    print(printable(out.text))
    seeded = "" if args.model_path else "; seeded weights, so the text is noise"
    print(f"[{len(out.token_ids)} tokens: {out.token_ids}; time to first token {out.ttft_s * 1e3:.1f} ms{seeded}]",
          file=sys.stderr)
    return 0


def printable(text: str) -> str:
    """``text`` as one clean terminal line: control characters (a seeded model's byte tokens are any byte) shown
    as escapes, so nothing the model wrote moves the cursor or runs into the summary line."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
