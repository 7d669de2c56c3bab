"""Pick the default block hash: time each registered hash on one 128K-token prompt.

    python benchmarks/hash_bench.py [--tokens 131072] [--block-size 16] [--reps 7]

Prints the median time per prompt and per block for each hash function,
side by side in one run (the machine is noisy; compare ratios, not absolutes).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace, hash_functions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    tokens = np.random.default_rng(0).integers(0, 128_000, size=args.tokens, dtype=np.int64)
    ns = Namespace("bench", KVGeometry(32, 8, 128, "bfloat16"), args.block_size)
    blocks = args.tokens // args.block_size
    times = {name: [] for name in hash_functions.names()}
    for _ in range(args.reps):
        for name in times:  # interleaved, so drift hits every function alike
            hasher = BlockHasher(ns, name)
            t = time.perf_counter()
            hasher.hash_blocks(tokens)
            times[name].append(time.perf_counter() - t)
    print(f"{args.tokens} tokens, {blocks} blocks of {args.block_size}, median of {args.reps}")
    print(f"{'hash':<10} {'ms/prompt':>10} {'us/block':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<10} {med * 1e3:>10.2f} {med / blocks * 1e6:>9.3f}")


if __name__ == "__main__":
    main()
