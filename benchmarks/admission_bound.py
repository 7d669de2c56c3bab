"""How far admission alone could take LRU on a Mooncake trace: an oracle that admits only what comes back.

    python benchmarks/admission_bound.py [--trace PATH]

One tier under LRU, replayed as `tiercache bench trace` replays it (a hit is a request's leading run of resident
chunks; its missing chunks are stored from the head of its chain until the admission refuses one). The admission
is an oracle: it admits a chunk only if a later request asks for it again within ``H`` times the tier's chunks of
requested chunks (``ever``: at all). Prints the token hit ratio of each against LRU's at 1M and 3M tokens, beside
Belady's (`replay_belady`) — how much of the gap to the offline optimum is an admission question at all — and,
after a slash, the same oracle that also evicts first the chunks it knows are not asked for again within ``H``
(what a perfect prediction of dead chunks is worth; the rest of Belady's gain is ordering the live ones). Then,
for every chunk a request asks for, how often it is asked for again within 400 requests, by how many requests had
asked for it before (what frequency-based policies go by).
"""
import argparse
from collections import Counter, OrderedDict
from pathlib import Path

from tiercache.bench.trace import TRACE_BLOCK_TOKENS, load_trace, replay, replay_belady

SHARED = Path(__file__).resolve().parents[2] / "shared"


def next_requests(trace) -> list[list[int | None]]:
    """Per request, per chunk: the index of the next request that asks for it, or None."""
    upcoming: dict = {}
    out: list[list[int | None]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        out[i] = [upcoming.get(k) for k in trace[i].keys]
        for k in trace[i].keys:
            upcoming[k] = i
    return out


def lru_with_oracle(trace, capacity_tokens: int, horizon: float | None, uses, clocks,
                    dead_first: bool = False) -> float:
    """``dead_first``: chunks not asked for again within the horizon, as of their latest request, are evicted
    before any other (oldest first)."""
    capacity = capacity_tokens // TRACE_BLOCK_TOKENS
    tier: OrderedDict = OrderedDict()                   # live chunks, least recently used first
    dead: OrderedDict = OrderedDict()                   # with ``dead_first``: the ones that will not be hit
    hit_tokens = input_tokens = 0

    def comes_back(use: int | None, now: int) -> bool:
        """Whether a chunk whose next request is ``use`` is asked for again within the horizon of ``now``."""
        return use is not None and (horizon is None or clocks[use] - now <= horizon * capacity)

    for request, next_use, now in zip(trace, uses, clocks):       # ``next_use``: request indexes
        keys = request.keys
        hit = 0
        while hit < len(keys) and (keys[hit] in tier or keys[hit] in dead):
            hit += 1
        input_tokens += request.input_length
        hit_tokens += min(hit * TRACE_BLOCK_TOKENS, request.input_length)
        for key, use in zip(reversed(keys[:hit]), reversed(next_use[:hit])):   # tail first, as tiers touch a chain
            tier.pop(key, None)
            dead.pop(key, None)
            (tier if not dead_first or comes_back(use, now) else dead)[key] = None
        for key, use in zip(keys[hit:], next_use[hit:]):
            if key in tier or key in dead:
                continue                                # held past the miss: not a hit, and not stored again
            if not comes_back(use, now):
                break                                   # refused: the rest of the chain is useless without it
            tier[key] = None
            if len(tier) + len(dead) > capacity:
                (dead if dead else tier).popitem(last=False)
    return hit_tokens / input_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(SHARED / "data/mooncake_synthetic_trace.jsonl"))
    args = p.parse_args()
    trace = load_trace(args.trace)
    uses = next_requests(trace)
    clocks = [0]                                    # chunks requested before each request
    for request in trace[:-1]:
        clocks.append(clocks[-1] + len(request.keys))
    horizons = (0.5, 1, 2, 4, None)
    print("| capacity | LRU | " + " | ".join(f"oracle admission, {h}× the tier" if h else "oracle admission, ever"
                                           for h in horizons) + " | Belady |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in horizons) + " | ---: |")
    for capacity in (1_000_000, 3_000_000):
        lru = replay(trace, capacity, "lru").token_hit_ratio
        cells = [f"{lru_with_oracle(trace, capacity, h, uses, clocks) / lru:.3f} / "
                 f"{lru_with_oracle(trace, capacity, h, uses, clocks, dead_first=True) / lru:.3f}" for h in horizons]
        belady = replay_belady(trace, capacity).token_hit_ratio / lru
        print(f"| {capacity // 1000}K | {lru:.4f} | " + " | ".join(cells) + f" | {belady:.3f} |")

    asked: Counter = Counter()
    back: Counter = Counter()
    total: Counter = Counter()
    for i, request in enumerate(trace):
        for key, j in zip(request.keys, uses[i]):
            asked[key] += 1
            n = min(asked[key], 5)
            total[n] += 1
            back[n] += j is not None and j - i <= 400
    print()
    print("| requests that had asked for the chunk, this one included | chunk sightings "
          "| asked again within 400 requests |")
    print("| ---: | ---: | ---: |")
    for n in sorted(total):
        print(f"| {n}{'+' if n == 5 else ''} | {total[n]} | {back[n] / total[n]:.2f} |")


if __name__ == "__main__":
    main()
