"""The reference engine's attention by the size of its score tiles, alone and with the other core doing the same.

    python benchmarks/attention_tiles.py [--reps 9] [--pair]

`tiercache.engine.model._attend` scores query rows in tiles of at most ``ATTN_TILE_BYTES``; the engine sizes them
to a core's L2 (`tiercache.machine.core_cache_bytes`). Prints, per shape, the median milliseconds of ``_attend``
at each tile size (sizes alternated within each repetition, so a noisy stretch hits all of them), then the
reference engine end to end at 8 MiB tiles (the size before) and at the machine's: a cold 2,000-token prompt and a
330-token turn after it (its first 2,000 tokens an L0 hit). With ``--pair`` a second copy runs the same on the
other core at the same time, as a second replica's engine does on a two-core machine, and prints its own tables.
Torch runs on one thread, pinned to one core.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from tiercache.engine import EngineConfig, SamplingParams, model
from tiercache.engine.llm import LLM

SHAPES = {                      # (context, new rows): the embedded model's 8 query heads over 2 KV heads of 32
    "turn: 350 after 2,300": (2650, 350),
    "turn: 300 after 1,500": (1800, 300),
    "prefill: 1,500": (1500, 1500),
    "prefill: 2,048": (2048, 2048),
    "question: 350 after 6,000": (6350, 350),
}
TILES = (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
BEFORE = 8 << 20


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kernels(reps: int, tag: str) -> None:
    print(f"| {tag}shape | " + " | ".join(f"{t >> 10} KiB" for t in TILES) + " | best / 8 MiB |")
    print("| --- |" + " ---: |" * (len(TILES) + 1))
    g = torch.Generator().manual_seed(0)
    for name, (ctx, new) in SHAPES.items():
        q = torch.randn(new, 8, 32, generator=g)
        keys, values = torch.randn(2, ctx, 2, 32, generator=g)
        times: dict[int, list[float]] = {t: [] for t in TILES}
        for _ in range(reps + 1):
            for tile in TILES:
                model.ATTN_TILE_BYTES = tile
                times[tile].append(timed_ms(lambda: model._attend(q, keys, values)))
        medians = {t: statistics.median(v[1:]) for t, v in times.items()}        # the first round warms up
        print(f"| {name} | " + " | ".join(f"{medians[t]:.1f}" for t in TILES)
              + f" | {min(medians.values()) / medians[BEFORE]:.2f} |", flush=True)


def engine(reps: int, tag: str, tile: int) -> None:
    llm = LLM(engine_cfg=EngineConfig(num_blocks=2048))
    params = SamplingParams(max_tokens=1)
    rng = random.Random(0)
    sizes = {"8 MiB": BEFORE, f"{tile >> 10} KiB": tile}
    results = {label: {"cold": [], "turn": []} for label in sizes}
    llm.generate([[rng.randrange(1, 250) for _ in range(64)]], params)
    try:
        for _ in range(reps):
            for label, size in sizes.items():
                model.ATTN_TILE_BYTES = size
                history = [rng.randrange(1, 250) for _ in range(2000)]
                results[label]["cold"].append(timed_ms(lambda: llm.generate([history], params)))
                turn = history + [rng.randrange(1, 250) for _ in range(330)]
                results[label]["turn"].append(timed_ms(lambda: llm.generate([turn], params)))
    finally:
        model.ATTN_TILE_BYTES = tile
        llm.close()
    before, now = sizes
    print()
    print(f"| {tag}engine, one thread | {before} tiles, ms | {now} tiles, ms | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for what, label in (("cold", "cold prompt of 2,000 tokens"), ("turn", "330-token turn after it (L0 hit)")):
        b, n = (statistics.median(results[k][what]) for k in sizes)
        print(f"| {label} | {b:.1f} | {n:.1f} | {n / b:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--pair", action="store_true", help="run a second copy on the other core at the same time")
    p.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    other = None
    if args.pair:
        if len(cores) < 2:
            sys.exit("attention_tiles.py: --pair needs two cores")
        other = subprocess.Popen([sys.executable, __file__, "--reps", str(args.reps), "--core", str(cores[1])],
                                 stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(0, {cores[0] if other else args.core})
    torch.set_num_threads(1)
    tag = f"core {args.core}: " if args.core else ("core 0, beside core 1: " if other else "")
    tile = model.ATTN_TILE_BYTES
    kernels(args.reps, tag)
    engine(args.reps, tag, tile)
    if other is not None:
        print()
        print(other.communicate()[0], end="")
        sys.exit(other.returncode)


if __name__ == "__main__":
    main()
