"""Which replica takes a request: routing policies by name, the default one an expected time to first token.

Router side, pure: a policy ranks `Candidate` views (what each replica holds
for this prompt, what it is already doing, how fast it computes and loads)
and never touches sockets. The router and the scoring service
(``POST /v1/score``) call the same `Policy.rank`, so a gateway that asks for
a ranking gets the one the router would route by.

Policies (`routing_policies`):
- ``round-robin``: in turn, blind to caches and load;
- ``least-loaded``: the replica with the fewest prompt tokens waiting for
  their first token (then the fewest requests);
- ``prefix-affinity``: the most cached tokens, anywhere in the replica's
  hierarchy (ties: least loaded) — the hit-ratio maximiser that makes
  hotspots;
- ``expected-ttft`` (default): queue (this router's requests there, and those
  the replica reports that it did not send) + prefill of what no tier holds for it +
  loads of the rest at each medium's rate, lowest first, with a hotspot guard
  (a replica whose queue is far above the other replicas' goes last); near
  ties go to the replica sent the fewest tokens lately, and so does a request
  whose best replica has been sent over its share when another can take it
  for an extra prefill bounded by that excess (a share guard: a prefix held
  by one replica spreads to a second one instead of pulling in every
  conversation that starts with it).

With sticky sessions (`prefer_session_replica`), whatever the policy, a session's next
request goes first to the replica that served its last one, unless that
replica is down or has fallen far behind the best.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tiercache.fleet.prefix_index import CachedTokens
from tiercache.registry import Registry


@dataclass(frozen=True, slots=True)
class ReplicaRates:
    """How fast a replica works: its prefill (learned by the router from its first tokens, `replicas.PrefillFit`),
    its loads per medium (the replica's own, from its descriptor, or configured) and what a running request adds.

    Computing ``n`` prompt tokens after ``c`` cached ones takes ``n / prefill + n·(c + n/2) · attention_s``
    seconds: a part per token (the layers' weights) and a part per pair of a computed token and one it attends
    to. The same tokens take longer after a long history than after a short one, so one rate misjudges one
    kind of request or the other: a short turn after a long history, or a long history recomputed from nothing
    elsewhere."""
    prefill: float                  # prompt tokens per second, the per-token part
    load: dict[str, float] = field(default_factory=dict)   # per tier medium: CPU, DISK, REMOTE
    per_request_s: float = 0.0      # what each request already running adds to a new one's wait
    attention_s: float = 0.0        # seconds per (computed token, earlier token) pair

    def prefill_s(self, tokens: int, context: int) -> float:
        """Seconds to compute ``tokens`` prompt tokens after ``context`` cached ones."""
        return tokens / self.prefill + tokens * (context + tokens / 2) * self.attention_s


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    prompt_tokens: int
    cached: CachedTokens
    in_flight: int             # requests sent to it and not finished
    pending_prefill: int       # prompt tokens it has yet to compute for requests not past their first token
    pending_prefill_s: float   # what is left of their prefill: each one's estimate when routed
                               # (`ReplicaRates.prefill_s`) less the time the replica has worked on them since
                               # (`ReplicaLoad`)
    rates: ReplicaRates
    recent_tokens: float = 0   # prompt tokens sent to it lately, each fading with age (`replicas.DecayingSum`):
                               # its share of the traffic, what a tie and the share guard go by
    foreign: int = 0           # requests it reported that this router did not send (`engine_queue`)
    foreign_prefill_s: float = 0.0   # the prefill of those not yet started there, at this router's mean estimate


@dataclass(frozen=True, slots=True)
class Ranked:
    name: str
    expected_ttft_s: float
    queue_s: float
    prefill_s: float
    load_s: float
    cached_tokens: int
    engine_tokens: int
    tier_tokens: dict[str, int]
    reason: str = ""           # why it is first, where a policy says: expected-ttft's rule that put it there

    def as_dict(self) -> dict:
        return {"replica": self.name, "reason": self.reason,
                "expected_ttft_ms": round(self.expected_ttft_s * 1e3, 3),
                "queue_ms": round(self.queue_s * 1e3, 3), "prefill_ms": round(self.prefill_s * 1e3, 3),
                "load_ms": round(self.load_s * 1e3, 3), "cached_tokens": self.cached_tokens,
                "engine_cached_tokens": self.engine_tokens, "tier_cached_tokens": dict(self.tier_tokens)}


def estimate(c: Candidate) -> Ranked:
    """Expected time to first token on ``c``: wait for what is ahead, compute what nobody holds, load the rest."""
    queue_s = c.pending_prefill_s + c.foreign_prefill_s + (c.in_flight + c.foreign) * c.rates.per_request_s
    prefill_s = c.rates.prefill_s(max(c.prompt_tokens - c.cached.total, 1), c.cached.total)
    load_s = sum(n / c.rates.load.get(medium, c.rates.prefill) for medium, n in c.cached.tiers.items())
    return Ranked(c.name, queue_s + prefill_s + load_s, queue_s, prefill_s, load_s, c.cached.total,
                  c.cached.engine, dict(c.cached.tiers))


class Policy(ABC):
    """Ranks candidates for one request, best first (each with its estimate, whatever the order's reason)."""

    @abstractmethod
    def rank(self, candidates: list[Candidate]) -> list[Ranked]: ...


routing_policies: Registry[type[Policy]] = Registry("routing policy")


@routing_policies.register("round-robin")
class RoundRobin(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, candidates: list[Candidate]) -> list[Ranked]:
        if not candidates:
            return []
        start = next(self._turn) % len(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        return [estimate(c) for c in ordered[start:] + ordered[:start]]


@routing_policies.register("least-loaded")
class LeastLoaded(Policy):
    def rank(self, candidates: list[Candidate]) -> list[Ranked]:
        return [estimate(c) for c in sorted(candidates, key=lambda c: (c.pending_prefill, c.in_flight, c.name))]


@routing_policies.register("prefix-affinity")
class PrefixAffinity(Policy):
    def rank(self, candidates: list[Candidate]) -> list[Ranked]:
        return [estimate(c) for c in sorted(
            candidates, key=lambda c: (-c.cached.total, c.pending_prefill, c.in_flight, c.name))]


@routing_policies.register("expected-ttft")
class ExpectedTTFT(Policy):
    """Lowest expected time to first token; a replica whose queue exceeds ``hotspot_factor`` times the mean
    queue of the *other* replicas, plus this request's mean compute over the replicas (so an idle fleet
    never trips it), is ranked after the others, so that a popular prefix spreads over replicas instead of
    piling onto one.

    The guard compares with the *others'* queues and the *mean* compute, not the whole fleet's mean queue and
    the largest compute: against those, a replica winning on expected time (``q_a + c_a < q_b + c_b``) could
    never be over it — ``q_a > 2·mean + max c`` needs a negative queue somewhere. This way it trips in a
    window: a hot replica whose hit saves less than its queue has grown.

    Replicas whose estimates are within ``tie_ratio`` of the best are a tie, and the one sent the fewest
    prompt tokens lately goes first: a new conversation (its system prompt everywhere, every replica idle)
    would otherwise always go to the same replica by name, and every later turn follows its history there.
    The estimates' rates are learned from noisy timings, so a difference that small is noise, not a reason.

    Share guard: when the first replica has been sent more than ``1 + share_slack`` times the mean of the
    prompt tokens sent to the ranked replicas, the request goes to the replica sent the fewest among those
    (not hot) that can take it for at most ``rebalance_share`` of that excess (the first replica's tokens
    over the mean) in extra prefill, at the first's rate. A prefix that only one replica holds — a rarely
    used system prompt — otherwise draws every conversation that starts with it, and each conversation's
    later turns follow; queues stay short between turns, so the hotspot guard never sees it. The bound
    scales with the imbalance it mends: a small excess moves nothing, a new conversation moves once the
    excess is ten times its shared prefix (it recomputes that prefix once, and it then lives on two
    replicas), a long conversation stays where its history is unless the imbalance is ten times that.

    "Sent" is recent traffic (``Candidate.recent_tokens``, each token fading over `replicas.SHARE_WINDOW_S`),
    not a count since the router started: with counts since the start, an excess of the same share would grow
    with the run's length, and so would the bound — late in a run, conversations whose whole history is on one
    replica would be moved to recompute it; and a replica added at run time would draw every request it could
    take until it had caught up with replicas that had served for hours. A window a few conversations long
    keeps the bound to the load now and just ahead."""

    def __init__(self, hotspot_factor: float = 2.0, tie_ratio: float = 0.15, share_slack: float = 0.2,
                 rebalance_share: float = 0.1) -> None:
        self.hotspot_factor = hotspot_factor
        self.tie_ratio = tie_ratio
        self.share_slack = share_slack
        self.rebalance_share = rebalance_share

    def rank(self, candidates: list[Candidate]) -> list[Ranked]:
        ranked = [estimate(c) for c in candidates]
        if len(ranked) < 2:
            return [replace(r, reason="fastest") for r in ranked]
        n = len(ranked)        # not len(ranked) inside the sort's key: list.sort empties the list while it sorts
        total_queue = sum(r.queue_s for r in ranked)
        slack = sum(r.prefill_s + r.load_s for r in ranked) / n

        def hot(r: Ranked) -> bool:
            return r.queue_s > self.hotspot_factor * (total_queue - r.queue_s) / (n - 1) + slack
        fastest = min(ranked, key=lambda r: (r.expected_ttft_s, r.name))
        ranked.sort(key=lambda r: (hot(r), r.expected_ttft_s, r.name))
        best = ranked[0]
        tied = [r for r in ranked if hot(r) == hot(best)
                and r.expected_ttft_s <= best.expected_ttft_s * (1 + self.tie_ratio)]
        routed = {c.name: c.recent_tokens for c in candidates}
        tied.sort(key=lambda r: (routed[r.name], r.expected_ttft_s, r.name))
        ranked = tied + ranked[len(tied):]
        shared = self._share(ranked, routed, {c.name: c.rates.prefill for c in candidates}, hot)
        first = shared[0]
        reason = ("fastest" if first is fastest else "share" if first is not ranked[0]
                  else "tie" if first is not best else "hotspot")
        return [replace(first, reason=reason), *shared[1:]]

    def _share(self, ranked: list[Ranked], routed: dict[str, float], prefill_rate: dict[str, float],
               hot: Callable[[Ranked], bool]) -> list[Ranked]:
        """``ranked`` with the share guard applied (see the class)."""
        first = ranked[0]
        mean = sum(routed.values()) / len(routed)
        if not mean or routed[first.name] <= (1 + self.share_slack) * mean:
            return ranked
        budget_s = self.rebalance_share * (routed[first.name] - mean) / prefill_rate[first.name]
        able = [r for r in ranked if not hot(r) and r.expected_ttft_s <= first.expected_ttft_s + budget_s]
        if not able:
            return ranked
        lightest = min(able, key=lambda r: (routed[r.name], r.expected_ttft_s, r.name))
        return ranked if lightest is first else [lightest, *(r for r in ranked if r is not lightest)]


STICKY_SLACK = 2.0     # a session leaves its replica once that replica's expected time is over twice the best's


def prefer_session_replica(ranking: list[Ranked], replica: str | None, slack: float = STICKY_SLACK) -> list[Ranked]:
    """``ranking`` with a session's ``replica`` (the one that served its last request) first — its history is
    there, in the replica's own pool too — unless it is not ranked (down, or serving another model) or its
    expected time to first token is over ``slack`` times the best's (it has fallen behind: the session moves)."""
    for i, r in enumerate(ranking):
        if r.name == replica:
            if i and r.expected_ttft_s <= slack * ranking[0].expected_ttft_s:
                return [replace(r, reason="sticky"), *ranking[:i], *ranking[i + 1:]]
            break
    return ranking
