"""Token hit ratio of eviction and admission policies on cuts of a Mooncake trace, each against LRU.

    python benchmarks/trace_cuts.py [--trace PATH] [--policy lfu-da,lfu-da+second-sighting]

Cuts: the whole trace, its first 1500 requests, its first and second halves — `tiercache bench trace` replays
one file; this replays the same code (`tiercache.bench.trace.replay`) over each cut, at 500K, 1M, 3M, 5M and
10M tokens, and prints a Markdown table (each cell: the policy's ratio to LRU at that cut and capacity); then
what `second-sighting` and `adaptive-sighting` cost the scheduler's thread per chunk (a history of 160K keys: a
tier of 20K chunks under an L1 of 5K)
and what `lfu-da` and `lfu-da-state` cost per chunk for an eviction, an insert, a use, and a request's hints
(running, then finished).
"""
import argparse
import hashlib
import timeit
from pathlib import Path

from tiercache.bench.trace import load_trace, replay
from tiercache.contracts.connector import RequestState
from tiercache.policies import GuardedTier, admission_policies, eviction_policies

SHARED = Path(__file__).resolve().parents[2] / "shared"
CAPACITIES = (500_000, 1_000_000, 3_000_000, 5_000_000, 10_000_000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(SHARED / "data/mooncake_synthetic_trace.jsonl"))
    p.add_argument("--policy", default="lfu-da,lru+second-sighting,lfu-da+second-sighting")
    args = p.parse_args()
    trace = load_trace(args.trace)
    half = len(trace) // 2
    cuts = {"whole": trace, "first 1500": trace[:1500], "first half": trace[:half], "second half": trace[half:]}
    policies = args.policy.split(",")
    print("| cut | capacity | LRU | " + " | ".join(policies) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in policies) + " |")
    for name, cut in cuts.items():
        for cap in CAPACITIES:
            lru = replay(cut, cap, "lru").token_hit_ratio
            cells = [f"{replay(cut, cap, pol).token_hit_ratio / lru:.3f}" for pol in policies]
            print(f"| {name} | {cap // 1000}K | {lru:.4f} | " + " | ".join(cells) + " |", flush=True)

    decision_cost()


def decision_cost(tier_chunks: int = 20_000, n: int = 200_000) -> None:
    keys = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(n)]
    requests = [keys[i:i + 20] for i in range(0, n, 20)]
    print()
    for name in ("second-sighting", "adaptive-sighting"):
        guard = admission_policies.get(name)(0)
        guard.size_for(GuardedTier(tier_chunks, tier_chunks // 4))
        record = min(timeit.repeat(lambda: [guard.record(r) for r in requests], number=1, repeat=3)) / n
        admit = min(timeit.repeat(lambda: [guard.admit(k, 0) for k in keys], number=1, repeat=3)) / n
        print(f"{name} per chunk: record {record * 1e6:.2f} us, admit {admit * 1e6:.2f} us "
              f"(history {guard.ghost_keys} keys)")

    def timed(name: str) -> tuple[float, float, float, float, float]:
        """Per chunk, a full tier: an eviction, an insert, a use, a request's hints (running, then finished), and
        telling a policy that learns from demand of the request (`record`). As a tier does it, a request's
        chunks at a time: the request recorded, its victims picked, then its chunks put in."""
        policy = eviction_policies.get(name)()
        record = getattr(policy, "record", None)
        for r in requests[:tier_chunks // 20]:
            if record is not None:
                record(r)
            for k in r:
                policy.insert(k)
        evict = insert = told = 0.0
        clock = timeit.default_timer
        for r in requests[tier_chunks // 20:]:
            if record is not None:
                started = clock()
                record(r)
                told += clock() - started
            started = clock()
            for _ in r:
                policy.pop_victim()
            between = clock()
            for k in r:
                policy.insert(k)
            evict, insert = evict + between - started, insert + clock() - between
        inserted = n - tier_chunks
        started = clock()
        for k in keys[-tier_chunks:]:
            policy.touch(k)
        touch = (clock() - started) / tier_chunks
        started = clock()
        retain = getattr(policy, "retain", None)
        for r in requests[-tier_chunks // 20:]:
            if retain is not None:
                retain(r, RequestState.RUNNING)
                retain(r, RequestState.FINISHED)
        hints = (clock() - started) / tier_chunks
        return evict / inserted, insert / inserted, touch, hints, told / inserted
    for name in ("lfu-da", "lfu-da-state", "reuse-model"):
        evict, insert, touch, hints, told = (min(t) for t in zip(*(timed(name) for _ in range(3))))
        policy = eviction_policies.get(name)
        said = f"{hints * 1e6:.2f} us" if hasattr(policy, "retain") else "ignored"
        heard = f"{told * 1e6:.2f} us" if hasattr(policy, "record") else "ignored"
        print(f"{name} per chunk: eviction {evict * 1e6:.2f} us, insert {insert * 1e6:.2f} us, "
              f"use {touch * 1e6:.2f} us, running + finished hints {said}, request recorded {heard}")


if __name__ == "__main__":
    main()
