"""Where the offline optimum's hits come from on a Mooncake trace, told by what an online policy can know.

    python benchmarks/trace_sessions.py [--trace PATH] [--capacity-tokens 1000000,3000000]

A session here is the requests whose chains start with the same chunk (a conversation's or an agent's context:
the trace's hashes are prefix-chained, so a shared first chunk is a shared origin). Prints, as Markdown:

1. how often a session sends another request after its k-th, and how long after, in tiers' worth of chunks
   requested (the clock a tier's contents age by);
2. how often a session comes back at all, by the length of its first request;
3. for every chunk a request asks for, by its class — how many requests its session had sent, this one included,
   and how many had asked for the chunk — how often it is asked for again within one tier's worth of chunks,
   and within three;
4. the chunks each policy (and Belady's MIN, `replay_belady`) served as hits, by the class the chunk had when it
   was last asked for before the hit: which kinds of chunk the optimum keeps that the policies give up.

The replays are the library's own (`tiercache.bench.trace.replay`, `replay_belady`), observed through their
``on_hit`` hook; nothing here is a policy.
"""
import argparse
import statistics
from collections import Counter
from pathlib import Path

from tiercache.bench.trace import TRACE_BLOCK_TOKENS, load_trace, replay, replay_belady

SHARED = Path(__file__).resolve().parents[2] / "shared"
POLICIES = ("lru", "lfu-da", "lfu-da+second-sighting")


def classes(trace) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int] | None]]]:
    """Per request, per chunk: its class now (session requests so far, chunk sightings so far; each capped at 3),
    and the class it had when last asked for (None: never before)."""
    sessions: Counter = Counter()
    sightings: Counter = Counter()
    last: dict = {}
    now, before = [], []
    for request in trace:
        sessions[request.keys[0]] += 1
        s = min(sessions[request.keys[0]], 3)
        row, prev = [], []
        for key in request.keys:
            sightings[key] += 1
            prev.append(last.get(key))
            last[key] = (s, min(sightings[key], 3))
            row.append(last[key])
        now.append(row)
        before.append(prev)
    return now, before


def session_table(trace, tier_chunks: int) -> None:
    clocks, clock = [], 0
    by_root: dict = {}
    for i, request in enumerate(trace):
        clocks.append(clock)
        clock += len(request.keys)
        by_root.setdefault(request.keys[0], []).append(i)
    asked: Counter = Counter()
    again: Counter = Counter()
    gaps: dict[int, list[float]] = {}
    for turns in by_root.values():
        for k, i in enumerate(turns, 1):
            asked[min(k, 5)] += 1
            if k < len(turns):
                again[min(k, 5)] += 1
                gaps.setdefault(min(k, 5), []).append((clocks[turns[k]] - clocks[i]) / tier_chunks)
    print(f"{len(by_root)} sessions over {len(trace)} requests; requests per session: "
          + ", ".join(f"{n}: {c}" for n, c in sorted(Counter(min(len(t), 10) for t in by_root.values()).items()))
          + " (10: ten or more)\n")
    print("| requests the session has sent | sessions | sends another | gap to it, median (tiers) | p90 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k in sorted(asked):
        g = gaps.get(k, [0.0])
        p90 = statistics.quantiles(g, n=10)[8] if len(g) > 1 else g[0]
        print(f"| {k}{'+' if k == 5 else ''} | {asked[k]} | {again[k] / asked[k]:.2f} | {statistics.median(g):.2f} "
              f"| {p90:.2f} |")
    first: Counter = Counter()
    back: Counter = Counter()
    for turns in by_root.values():
        n = len(trace[turns[0]].keys)
        bucket = 1 << (n.bit_length() - 1)
        first[bucket] += 1
        back[bucket] += len(turns) > 1
    print("\n| first request's chunks | sessions | comes back |")
    print("| --- | ---: | ---: |")
    for b in sorted(first):
        print(f"| {b}–{2 * b - 1} | {first[b]} | {back[b] / first[b]:.2f} |")


def reuse_table(trace, now, tier_chunks: int) -> None:
    clock = 0
    upcoming: dict = {}
    nxt: list[list[int | None]] = [[] for _ in trace]
    clocks = []
    for request in trace:
        clocks.append(clock)
        clock += len(request.keys)
    for i in range(len(trace) - 1, -1, -1):
        keys = trace[i].keys
        nxt[i] = [upcoming.get(k) for k in keys]
        for j, k in enumerate(keys):
            upcoming[k] = clocks[i] + j
    seen: Counter = Counter()
    one: Counter = Counter()
    three: Counter = Counter()
    for i, request in enumerate(trace):
        for j, cls in enumerate(now[i]):
            at, n = clocks[i] + j, nxt[i][j]
            seen[cls] += 1
            one[cls] += n is not None and n - at <= tier_chunks
            three[cls] += n is not None and n - at <= 3 * tier_chunks
    print("\n| session's requests, chunk's sightings (3: three or more) | chunks asked for "
          "| asked again within a tier | within three |")
    print("| --- | ---: | ---: | ---: |")
    for cls in sorted(seen):
        print(f"| {cls[0]}, {cls[1]} | {seen[cls]} | {one[cls] / seen[cls]:.2f} | {three[cls] / seen[cls]:.2f} |")


def hits_table(trace, before, capacity_tokens: int) -> None:
    rows: dict[str, Counter] = {}
    totals: dict[str, float] = {}

    def observer(counts: Counter):
        def on_hit(i: int, n: int) -> None:
            counts.update(before[i][:n])
        return on_hit

    for name in (*POLICIES, "belady"):
        counts = rows[name] = Counter()
        if name == "belady":
            totals[name] = replay_belady(trace, capacity_tokens, on_hit=observer(counts)).token_hit_ratio
        else:
            totals[name] = replay(trace, capacity_tokens, name, on_hit=observer(counts)).token_hit_ratio
    cells = sorted({c for counts in rows.values() for c in counts})
    print(f"\nChunks served as hits at {capacity_tokens // 1000}K tokens, by the class of the chunk's previous "
          "request (session's requests, chunk's sightings):\n")
    print("| policy | token hit ratio | " + " | ".join(f"{s}, {c}" for s, c in cells) + " | all |")
    print("| --- | ---: | " + " | ".join("---:" for _ in cells) + " | ---: |")
    for name, counts in rows.items():
        print(f"| {name} | {totals[name]:.4f} | " + " | ".join(str(counts[c]) for c in cells)
              + f" | {sum(counts.values())} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(SHARED / "data/mooncake_synthetic_trace.jsonl"))
    p.add_argument("--capacity-tokens", default="1000000,3000000")
    args = p.parse_args()
    trace = load_trace(args.trace)
    capacities = [int(c) for c in args.capacity_tokens.split(",")]
    now, before = classes(trace)
    tier = capacities[-1] // TRACE_BLOCK_TOKENS
    print(f"Tiers below are {capacities[-1] // 1000}K tokens ({tier} chunks).\n")
    session_table(trace, tier)
    reuse_table(trace, now, tier)
    for capacity in capacities:
        hits_table(trace, before, capacity)


if __name__ == "__main__":
    main()
