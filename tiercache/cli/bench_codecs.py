"""`tiercache bench codecs`: each chunk codec's bytes, speed, KV error and accuracy, with its flags."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from tiercache.cli.common import command_line, ready_directory, write_json
from tiercache.cli.options import (
    add_chunk_tokens_flag,
    add_report_flags,
    add_reps_flag,
    add_shape_flag,
    codec_list,
    config_check,
    positive,
)
from tiercache.errors import ConfigError, TierCacheError


def register(bench: argparse._SubParsersAction) -> None:
    c = bench.add_parser("codecs", help="chunk codecs: bytes, encode/decode GB/s beside the disk, KV error and "
                                        "the accuracy of a trained model served from quantized chunks")
    c.add_argument("--codecs", type=codec_list, default=["raw", "lz4", "lz4-shuffle", "int8", "fp8-e4m3"],
                   help="comma-separated codecs (default: all)")
    add_shape_flag(c, "KV geometry of the speed chunk (llama-8b: bf16, 32 layers, 8 KV heads, dim 128)")
    add_chunk_tokens_flag(c)
    add_reps_flag(c, 5)
    c.add_argument("--model", metavar="DIR", help="a local Hugging Face Llama checkpoint for the accuracy runs "
                                                  "(default: the reference model trained on a synthetic corpus, "
                                                  "trained once and cached)")
    c.add_argument("--train-steps", type=positive, default=None, help="steps for the trained default model")
    c.add_argument("--requests", type=positive, default=16, help="accuracy requests (4 documents, questions)")
    c.add_argument("--max-tokens", type=positive, default=16, help="greedy tokens generated per request")
    c.add_argument("--no-accuracy", action="store_true", help="bytes, speed and synthetic-KV error only")
    c.add_argument("--disk-path", help="directory for the disk measurements and chunks (default: $TMPDIR)")
    add_report_flags(c, "codecs.json, codecs.md and codecs.png")
    c.set_defaults(func=cmd_bench_codecs)


def cmd_bench_codecs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from tqdm import tqdm

    from tiercache.bench.codecs import bench_codecs
    from tiercache.bench.codecs_report import codec_tables, write_codec_reports

    config_check("--chunk-tokens", "keys", "chunk_tokens", args.chunk_tokens)
    if args.model and not Path(args.model, "config.json").is_file():
        raise ConfigError("--model", args.model, "is not a Hugging Face checkpoint directory (no config.json)")
    if not (args.no_accuracy or args.model) and importlib.util.find_spec("transformers") is None:
        raise TierCacheError("bench codecs trains its accuracy model with transformers, which is not installed: "
                             "pip install 'tiercache[bench]' (or give --model DIR, or --no-accuracy)")
    args.disk_path = ready_directory(args.disk_path, "--disk-path")
    lossy = [n for n in args.codecs if n == "raw" or _lossy(n)]
    with tqdm(desc="bench codecs", file=sys.stderr, disable=args.quiet) as bar:
        report = bench_codecs(args.codecs, None if args.no_accuracy else lossy, args.shape, args.chunk_tokens,
                              args.reps, args.model, args.train_steps, args.requests, args.max_tokens,
                              args.disk_path, progress=lambda: bar.update(1))
    report["command"] = command_line()
    if args.out:
        write_codec_reports(Path(args.out), report)
    write_json(args.json, report)
    console = Console(width=max(120, Console().width))
    for table in codec_tables(report):
        console.print(table)
    return 0


def _lossy(name: str) -> bool:
    from tiercache.codecs import codecs
    return codecs.get(name).lossy
