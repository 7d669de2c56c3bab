"""`tiercache bench route`: a multi-replica chat workload replayed through `tiercache route`, each policy in turn.

The workload (`RouteWorkload`, seeded): conversations arrive as a Poisson
process; each picks one of a few long system prompts by a Zipf law (the
popular one is most of the traffic) and runs its turns — each turn resends
the whole history plus a new user message, and the next turn follows the
answer after a think time. Every request is streamed, so the client sees its
time to first token and the usage the replica reports, and carries its
conversation's ``session_id``, as chat clients send one (the replicas keep a
continuing request's chunks for its next turn, its partial last one
included: ``keys.partial_chunks``).

For each fleet (N replicas, with or without a shared `tiercache serve` under
them) and each policy, a fresh fleet is started (cold caches, the same
processes users run), the workload replayed against its router, and the
router's own metrics read: tokens per replica (load imbalance, max/mean: of
the prompt tokens sent, and of those computed — sent less the cached tokens
the replica reported) and
its predicted against the replicas' reported cached tokens (prediction
error: sum of |predicted - reported| over the reported); and each replica's
busy fraction over the run (its engine's seconds in steps that computed
tokens, from its /metrics, over the run's wall time — mean and max over the
replicas: how near its capacity the fleet ran; replicas that share a core
are busy for the time the core-mate takes, too) and the engines' busy
seconds per request (what a request cost the fleet: a policy that finds
more prefixes costs less per request, by as much as a hit saves on this
engine), split into steps per request and busy seconds per step (how
much the policy's queues batched, and what a step cost), and the part of them
spent loading KV into the pools; the CPU seconds per
request of the replicas' processes (engine and transfer threads), the router
and the shared server (all on this machine's cores: a load from the server
costs CPU at both ends) and of the replicas' threads by name (the engine's,
the transfer threads', the HTTP server's: those of half a millisecond a
request or more), and the chunks per request each tier loaded on the
replicas (from their `tiercache_tier_loaded`). The router's own
overhead is timed apart: the same 2K-token request (a pool hit) alternated
directly to a replica and through the router, medians compared.

TTFT percentiles are given over every request and over the later half of
them by send time: a fresh fleet starts with every cache empty, and its
first seconds — each replica computing each system prompt once, several
conversations opening at once on cold processes — set the whole-run p99 of
every policy; the later
half is the fleet at work. Each request's record (sent, TTFT, the replica
the router named in its answer's headers, what it expected there, the rule
that chose it) is in the JSON, with the run's moves: turns sent to another
replica than their conversation's previous one, each leaving its history
behind (how many, the slowest, and how many choices each rule made).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiercache.bench.processes import Launched, start_replica, start_router, start_server
from tiercache.bench.report import percentile

POOL_BLOCKS = 2048          # each replica's L0: 32K tokens, a few conversations' worth


@dataclass(frozen=True, slots=True)
class RouteWorkload:
    conversations: int = 120
    max_turns: int = 8               # a conversation has 1..max_turns turns (more often few)
    system_prompts: int = 4
    system_tokens: int = 1200
    user_tokens: int = 300
    output_tokens: int = 8
    rate: float = 4.0                # conversations started per second (Poisson)
    think_s: float = 0.3             # mean pause between an answer and the next turn
    zipf: float = 1.2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "max_turns", "system_prompts", "system_tokens", "user_tokens",
                     "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench route: {name} must be positive, got {getattr(self, name)}")
        if not self.rate > 0:
            raise ValueError(f"bench route: rate must be positive, got {self.rate}")


@dataclass(frozen=True, slots=True)
class Conversation:
    start_s: float
    system: str
    questions: tuple[str, ...]
    pauses: tuple[float, ...]


def conversations(w: RouteWorkload) -> list[Conversation]:
    rng = random.Random(w.seed)
    words = "cache tier block chunk prefix replica router load disk memory tenant token stream".split()

    def text(n_tokens: int, tag: str) -> str:          # byte tokenizer: one token per byte
        body = " ".join(rng.choice(words) for _ in range(n_tokens // 5 + 1))
        return (tag + " " + body)[:n_tokens]

    systems = [text(w.system_tokens, f"System prompt {i}:") for i in range(w.system_prompts)]
    weights = [1 / (i + 1) ** w.zipf for i in range(w.system_prompts)]
    out, t = [], 0.0
    for c in range(w.conversations):
        t += rng.expovariate(w.rate)
        turns = min(w.max_turns, 1 + int(rng.expovariate(1 / max(w.max_turns / 2 - 0.5, 0.5))))
        out.append(Conversation(t, rng.choices(systems, weights)[0],
                                tuple(text(w.user_tokens, f"[{c}.{k}]") for k in range(turns)),
                                tuple(rng.expovariate(1 / w.think_s) for _ in range(turns))))
    return out


@dataclass(slots=True)
class Request:
    conversation: int
    turn: int
    sent_s: float
    ttft_s: float
    end_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str = ""                 # where the router sent it, and what it expected there (its headers)
    expected_ttft_ms: float = 0.0
    predicted_cached_tokens: int = 0
    reason: str = ""                  # the rule that chose it (X-Tiercache-Route-Reason), where the policy names one


async def _ask(session, url: str, messages: list[dict], max_tokens: int, session_id: str
               ) -> tuple[float, float, str, dict, dict]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": session_id}
    start = time.perf_counter()
    first, text, usage = None, [], {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"bench route: the router answered {resp.status}: {(await resp.text())[:200]}")
        routed = {"replica": resp.headers.get("X-Tiercache-Replica", ""),
                  "expected_ttft_ms": float(resp.headers.get("X-Tiercache-Expected-TTFT-Ms", 0.0)),
                  "predicted_cached_tokens": int(resp.headers.get("X-Tiercache-Predicted-Cached-Tokens", 0)),
                  "reason": resp.headers.get("X-Tiercache-Route-Reason", "")}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if first is None:
                first = time.perf_counter()
            for choice in event.get("choices") or ():
                text.append(choice.get("delta", {}).get("content") or "")
            usage = event.get("usage") or usage
    return (first or time.perf_counter()) - start, time.perf_counter() - start, "".join(text), usage, routed


async def replay(url: str, w: RouteWorkload, progress: Callable[[], None] | None = None) -> list[Request]:
    import aiohttp

    records: list[Request] = []
    origin = time.perf_counter()

    async def run(i: int, conv: Conversation, session) -> None:
        await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - origin)))
        history = [{"role": "system", "content": conv.system}]
        for turn, (question, pause) in enumerate(zip(conv.questions, conv.pauses)):
            history.append({"role": "user", "content": question})
            sent = time.perf_counter() - origin
            ttft, total, answer, usage, routed = await _ask(session, url, history, w.output_tokens, f"conversation-{i}")
            details = usage.get("prompt_tokens_details") or {}
            records.append(Request(i, turn, sent, ttft, sent + total, usage.get("prompt_tokens", 0),
                                   details.get("cached_tokens", 0), **routed))
            if progress is not None:
                progress()
            history.append({"role": "assistant", "content": answer})
            await asyncio.sleep(pause)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(run(i, c, session) for i, c in enumerate(conversations(w))))
    return records


def _metric_families(url: str):
    """The metric families of ``url``/metrics (a replica's or the router's Prometheus exposition)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return list(text_string_to_metric_families(resp.read().decode()))


ENGINE_COUNTERS = ("tiercache_engine_busy_seconds", "tiercache_engine_steps", "tiercache_engine_load_seconds")


def _engine_counters(families, url: str) -> tuple[float, float, float]:
    """A replica's engine so far, from its /metrics' ``families``: seconds in steps that computed tokens, those
    steps, and the part of those seconds spent loading KV."""
    found = {f.name: f.samples[0].value for f in families if f.name in ENGINE_COUNTERS}
    missing = [name for name in ENGINE_COUNTERS if name not in found]
    if missing:
        raise RuntimeError(f"bench route: {url}/metrics lacks {', '.join(missing)}")
    busy, steps, load = (found[name] for name in ENGINE_COUNTERS)
    return busy, steps, load


def _by_label(families, name: str, label: str) -> dict[str, float]:
    """Family ``name``'s values by their ``label`` (a counter's totals, a gauge's values)."""
    return {sample.labels[label]: sample.value for family in families if family.name == name
            for sample in family.samples if not sample.name.endswith("_created")}


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far."""
    from tiercache.metrics import stat_cpu_seconds
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())[1]


def _readings(fleet: "Fleet") -> dict:
    """What the fleet's processes have done so far: each replica's engine counters, chunks loaded by tier and CPU
    seconds by thread (one scrape of its /metrics), and the CPU seconds of the replicas, the router and the
    shared server."""
    scraped = [(r.url, _metric_families(r.url)) for r in fleet.replicas]
    return {"engine": [_engine_counters(families, url) for url, families in scraped],
            "loads": [_by_label(families, "tiercache_tier_loaded", "tier") for _, families in scraped],
            "threads": [_by_label(families, "tiercache_thread_cpu_seconds", "thread") for _, families in scraped],
            "cpu": {"replicas": sum(_cpu_seconds(r.proc.pid) for r in fleet.replicas),
                    "router": _cpu_seconds(fleet.router.proc.pid),
                    **({"server": _cpu_seconds(fleet.server.proc.pid)} if fleet.server else {})}}


def _router_metrics(url: str) -> dict[str, dict[str, float]]:
    """Per replica: prompt tokens, predicted / reported / error cached tokens (from the router's /metrics)."""
    wanted = {"tiercache_route_prompt_tokens": "prompt_tokens",
              "tiercache_route_predicted_cached_tokens": "predicted",
              "tiercache_route_reported_cached_tokens": "reported",
              "tiercache_route_prediction_error_tokens": "error"}
    out: dict[str, dict[str, float]] = {}
    for family in _metric_families(url):
        key = wanted.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.setdefault(sample.labels["replica"], {})[key] = sample.value
    return out


@dataclass
class Fleet:
    replicas: list[Launched]
    router: Launched
    server: Launched | None = None

    def stop(self) -> None:
        for process in [self.router, *self.replicas, *([self.server] if self.server else [])]:
            process.stop()


def _warm(url: str) -> None:
    """One short request straight to a fresh replica, so that no policy's first request pays the process's
    first forward pass (its prompt shares nothing with the workload's)."""
    import urllib.request

    body = json.dumps({"prompt": "warm-up", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def start_fleet(n: int, policy: str, shared: bool, replica_set: tuple[str, ...] = ()) -> Fleet:
    """``replica_set``: config fields (``section.field=value``) every replica is started with."""
    server = start_server() if shared else None
    replicas: list[Launched] = []
    sets = [arg for pair in replica_set for arg in ("--set", pair)]
    try:
        for i in range(n):
            if server is None:
                replicas.append(start_replica(i, 0, "cpu", "256MiB", POOL_BLOCKS, *sets))
            else:
                replicas.append(start_replica(i, 0, "cpu,grpc", "256MiB", POOL_BLOCKS, "--grpc-address", server.url,
                                              *sets))
        for replica in replicas:
            _warm(replica.url)
        router = start_router([r.url for r in replicas], "--policy", policy)
    except BaseException:
        for process in [*replicas, *([server] if server else [])]:
            process.stop()
        raise
    return Fleet(replicas, router, server)


def moved(records: list[Request]) -> list[Request]:
    """Requests sent to another replica than their conversation's previous turn (``records`` in send order):
    each recomputes or reloads the history it left behind — where a routing policy's tail comes from."""
    last: dict[int, str] = {}
    out = []
    for r in records:
        if last.get(r.conversation, r.replica) != r.replica:
            out.append(r)
        last[r.conversation] = r.replica
    return out


def run_one(n: int, policy: str, shared: bool, w: RouteWorkload,
            progress: Callable[[], None] | None = None, replica_set: tuple[str, ...] = ()) -> dict:
    fleet = start_fleet(n, policy, shared, replica_set)
    try:
        first = _readings(fleet)
        started = time.perf_counter()
        records = asyncio.run(replay(fleet.router.url, w, progress))
        elapsed = time.perf_counter() - started
        last = _readings(fleet)
        before, after = first["engine"], last["engine"]
        busy = [a[0] - b[0] for a, b in zip(after, before)]
        steps = sum(a[1] - b[1] for a, b in zip(after, before))
        loading = sum(a[2] - b[2] for a, b in zip(after, before))
        per_replica = _router_metrics(fleet.router.url)
    finally:
        fleet.stop()
    per = max(1, len(records))           # per request
    loaded: Counter[str] = Counter()
    for a, b in zip(last["loads"], first["loads"]):
        loaded.update({tier: a[tier] - b.get(tier, 0.0) for tier in a})
    threads: Counter[str] = Counter()
    for a, b in zip(last["threads"], first["threads"]):
        threads.update({name: a[name] - b.get(name, 0.0) for name in a})
    ttfts = [r.ttft_s * 1e3 for r in records]
    by_time = sorted(records, key=lambda r: r.sent_s)
    later = [r.ttft_s * 1e3 for r in by_time[len(by_time) // 2:]]   # a fleet past its cold start: see below
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    moves = moved(by_time)
    loads = [v.get("prompt_tokens", 0.0) for v in per_replica.values()] or [0.0]
    computed = [v.get("prompt_tokens", 0.0) - v.get("reported", 0.0) for v in per_replica.values()] or [0.0]
    reported = sum(v.get("reported", 0.0) for v in per_replica.values())
    error = sum(v.get("error", 0.0) for v in per_replica.values())
    return {"replicas": n, "shared_server": shared, "policy": policy, "replica_set": list(replica_set),
            "requests": len(records),
            "ttft_ms_p50": round(percentile(ttfts, 0.5), 2), "ttft_ms_p99": round(percentile(ttfts, 0.99), 2),
            "later_half_ttft_ms_p50": round(percentile(later, 0.5), 2) if later else 0.0,
            "later_half_ttft_ms_p99": round(percentile(later, 0.99), 2) if later else 0.0,
            "throughput_req_s": round(len(records) / elapsed, 3),
            "busy_mean": round(statistics.mean(busy) / elapsed, 3), "busy_max": round(max(busy) / elapsed, 3),
            "engine_ms_per_request": round(sum(busy) / len(records) * 1e3, 2) if records else 0.0,
            "engine_steps_per_request": round(steps / len(records), 2) if records else 0.0,
            "engine_ms_per_step": round(sum(busy) / steps * 1e3, 2) if steps else 0.0,
            "engine_load_ms_per_request": round(loading / per * 1e3, 2),
            "cpu_ms_per_request": {who: round((last["cpu"][who] - first["cpu"][who]) / per * 1e3, 2)
                                   for who in last["cpu"]},
            "replica_threads_cpu_ms_per_request": {name: round(v / per * 1e3, 2) for name, v in threads.most_common()
                                                   if v / per * 1e3 >= 0.5},
            "loaded_chunks_per_request": {tier: round(v / per, 3) for tier, v in sorted(loaded.items())},
            "prefix_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "load_imbalance": round(max(loads) / statistics.mean(loads), 3) if statistics.mean(loads) else 0.0,
            "compute_imbalance": (round(max(computed) / statistics.mean(computed), 3)
                                  if statistics.mean(computed) > 0 else 0.0),
            "prediction_error": round(error / reported, 4) if reported else 0.0,
            "moved": len(moves),
            "moved_ttft_ms_max": round(max((r.ttft_s for r in moves), default=0.0) * 1e3, 2),
            "reasons": dict(Counter(r.reason for r in records if r.reason)),
            "per_replica": per_replica,
            "records": [asdict(r) for r in by_time]}


def router_overhead(n_pairs: int = 30, prompt_tokens: int = 2048) -> dict:
    """The router's own cost for one request: the same request (a pool hit, one output token) alternated
    directly to a replica and through the router; medians and their difference, and /v1/score alone."""
    import urllib.request

    replica = start_replica(0)
    router = start_router([replica.url], "--policy", "expected-ttft")
    body = json.dumps({"prompt": "o" * (prompt_tokens - 1), "max_tokens": 1, "temperature": 0}).encode()

    def timed(url: str) -> float:
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
        return time.perf_counter() - start

    try:
        timed(f"{replica.url}/v1/completions")                    # the prompt is in the pool from here on
        direct, routed, score = [], [], []
        for _ in range(n_pairs):
            direct.append(timed(f"{replica.url}/v1/completions"))
            routed.append(timed(f"{router.url}/v1/completions"))
            score.append(timed(f"{router.url}/v1/score"))
    finally:
        router.stop()
        replica.stop()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)          # noqa: E731
    return {"prompt_tokens": prompt_tokens, "pairs": n_pairs, "direct_ms_p50": ms(direct),
            "routed_ms_p50": ms(routed), "overhead_ms_p50": round(ms(routed) - ms(direct), 3),
            "score_ms_p50": ms(score)}


@dataclass
class RouteReport:
    workload: dict
    runs: list[dict] = field(default_factory=list)
    overhead: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


HEADERS = ("replicas", "shared serve", "policy", "requests", "TTFT p50 ms", "TTFT p99 ms",
           "later half p50 ms", "later half p99 ms", "req/s", "busy", "engine ms / request (steps × ms)",
           "loading ms / request",
           "CPU ms / request", "replicas' CPU ms / request by thread", "chunks loaded / request", "prefix hits",
           "imbalance", "compute imbalance",
           "prediction error", "moved", "slowest moved ms")


def _per(values: dict | None) -> str:
    """``{"a": 1.5, "b": 2}`` as ``a 1.5, b 2`` (a column of named figures); ``-`` for none."""
    return ", ".join(f"{k} {v}" for k, v in values.items()) if values else "-"


def rows(report: dict) -> list[tuple]:
    return [(r["replicas"], "yes" if r["shared_server"] else "no", r["policy"], r["requests"], r["ttft_ms_p50"],
             r["ttft_ms_p99"], r.get("later_half_ttft_ms_p50", "-"), r.get("later_half_ttft_ms_p99", "-"),
             r["throughput_req_s"], f"{r['busy_mean']:.2f} (max {r['busy_max']:.2f})" if "busy_mean" in r else "-",
             f"{r['engine_ms_per_request']} ({r['engine_steps_per_request']} × {r['engine_ms_per_step']})"
             if "engine_steps_per_request" in r else r.get("engine_ms_per_request", "-"),
             r.get("engine_load_ms_per_request", "-"),
             _per(r.get("cpu_ms_per_request")),
             _per(dict(list(r.get("replica_threads_cpu_ms_per_request", {}).items())[:4])),
             _per(r.get("loaded_chunks_per_request")),
             r["prefix_hit_ratio"], r["load_imbalance"], r.get("compute_imbalance", "-"),
             r["prediction_error"], r.get("moved", "-"), r.get("moved_ttft_ms_max", "-")) for r in report["runs"]]


def plot(path, report: dict) -> bool:
    """TTFT p50 and p99 per policy, one group of bars per fleet; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = report["runs"]
    fleets = sorted({(r["replicas"], r["shared_server"]) for r in runs})
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig, axes = plt.subplots(1, len(fleets), figsize=(5 * len(fleets), 4), squeeze=False)
    for ax, (n, shared) in zip(axes[0], fleets):
        chosen = {r["policy"]: r for r in runs if r["replicas"] == n and r["shared_server"] == shared}
        xs = range(len(policies))
        ax.bar([x - 0.2 for x in xs], [chosen[p]["ttft_ms_p50"] for p in policies], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [chosen[p]["ttft_ms_p99"] for p in policies], 0.4, label="p99")
        ax.set_xticks(list(xs), policies, rotation=20)
        ax.set_title(f"{n} replicas" + (", shared serve" if shared else ""))
        ax.set_ylabel("time to first token, ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
