"""Where a sliding-window model stores its resume points (``keys.resume_points``) — hit ratio and bytes per
stored token, replayed on a request trace.

    python benchmarks/resume_points.py [--trace TRACE.jsonl] [--window 1024] [--capacity 1M,3M,10M]

A trace in the Mooncake format (``hash_ids``: each 512-token chunk's key, already prefix-chained) runs
through one LRU tier whose capacity is counted in tokens of the whole model's KV, so every row gets the same
memory. The model is Gemma-3-shaped: one full-attention layer to every five sliding-window layers. A chunk
holds the full-attention layers' KV of its 512 tokens; a resume point holds the sliding layers' window (in
16-token blocks) behind its chunk's end. A request hits the whole chunks it shares with what the tier holds,
up to the last one with a resume point (one token is always computed). ``whole context`` is the same model
stored as one group of full attention (every layer of every chunk), which resumes at any chunk. The rules:
``every-chunk`` (a resume point at every chunk's end), ``spaced`` (every window's worth of chunks, and the
last), ``trailing`` (the last chunk a request stores), ``junctions`` (the last, and the end of the prefix the
tier held when the request looked up: where it parted from an earlier prompt).
"""
from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from pathlib import Path

from tiercache.bench.trace import TRACE_BLOCK_TOKENS as CHUNK
from tiercache.bench.trace import TraceRequest, load_trace

BLOCK = 16
FULL_SHARE = 1 / 6    # Gemma 3: one full-attention layer in six


def parse_tokens(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


class Tier:
    """LRU over objects of known sizes, in token-equivalents of the whole model's KV."""

    def __init__(self, capacity: float) -> None:
        self.capacity, self.used, self.items = capacity, 0.0, OrderedDict()
        self.written = 0.0

    def has(self, key) -> bool:
        return key in self.items

    def touch(self, key) -> None:
        self.items.move_to_end(key)

    def put(self, key, size: float) -> None:
        if key in self.items or size > self.capacity:
            return
        while self.used + size > self.capacity:
            _, gone = self.items.popitem(last=False)
            self.used -= gone
        self.items[key] = size
        self.used += size
        self.written += size


def points_of(rule: str, num_chunks: int, spacing: int, found: int) -> list[int]:
    """The chunks (by index) of a request of ``num_chunks`` whole chunks that get a resume point; ``found``
    is how many leading chunks the tier held when it looked up (the junction with an earlier prompt)."""
    last = num_chunks - 1
    if rule == "every-chunk":
        return list(range(num_chunks))
    if rule == "spaced":
        return [i for i in range(num_chunks) if (i + 1) % spacing == 0 or i == last]
    if rule == "junctions" and 0 < found < num_chunks:
        return [found - 1, last]
    return [last] if num_chunks else []


def replay(requests: list[TraceRequest], capacity: float, rule: str, window: int) -> dict[str, float]:
    """One rule over the trace: hit ratio and stored bytes per stored token (as a share of the whole context)."""
    whole = rule == "whole context"
    chunk_size = CHUNK if whole else CHUNK * FULL_SHARE
    point_size = 0.0 if whole else (1 - FULL_SHARE) * BLOCK * math.ceil((window - 1) / BLOCK)
    tier = Tier(capacity)
    spacing = math.ceil(window / CHUNK)     # "spaced": a window's worth of chunks between resume points
    hit_tokens = input_tokens = stored_tokens = 0
    for r in requests:
        keys, n = r.keys, r.input_length
        usable = min(len(keys), (n - 1) // CHUNK)
        run = 0
        while run < usable and tier.has(("c", keys[run])):
            run += 1
        end = run
        while not whole and end and not tier.has(("p", keys[end - 1])):
            end -= 1
        for i in range(end):
            tier.touch(("c", keys[i]))
        if end and not whole:
            tier.touch(("p", keys[end - 1]))
        hit_tokens += end * CHUNK
        input_tokens += n
        whole_chunks = n // CHUNK
        for i in range(whole_chunks):
            if not tier.has(("c", keys[i])):
                stored_tokens += CHUNK
            tier.put(("c", keys[i]), chunk_size)
        for i in () if whole else points_of(rule, whole_chunks, spacing, run):
            tier.put(("p", keys[i]), point_size)
    return {"hit_ratio": hit_tokens / input_tokens, "stored_share": tier.written / max(stored_tokens, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[1] / "tests" / "data"
                                            / "mooncake_synthetic_trace.jsonl.gz"))
    ap.add_argument("--window", type=int, default=1024, help="the sliding window, in tokens (Gemma 3: 1024)")
    ap.add_argument("--capacity", default="1M,3M,10M", help="tier sizes in tokens of the whole model's KV")
    args = ap.parse_args()
    requests = load_trace(args.trace)
    print(f"{len(requests)} requests, window {args.window} tokens, chunks of {CHUNK}")
    print("| capacity | rule | hit ratio | stored bytes per stored token (share of the whole context) |")
    print("|---|---|---|---|")
    for text in args.capacity.split(","):
        for rule in ("whole context", "every-chunk", "spaced", "trailing", "junctions"):
            got = replay(requests, parse_tokens(text), rule, args.window)
            print(f"| {text} | {rule} | {got['hit_ratio']:.4f} | {got['stored_share']:.3f} |")


if __name__ == "__main__":
    main()
