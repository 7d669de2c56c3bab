"""Per-link admission of transfer jobs: token-bucket rate limits, in-flight caps, priorities, store drops.

Worker side, inside the `TransferEngine`. A link is a physical path — device↔host
(PCIe), host↔disk, host↔network — shared by both directions. Time comes from
an injected clock, so the scheduling is tested on simulated time.

- Rate: a token bucket of ``burst`` bytes refilled at ``rate`` bytes/s. A job
  may start while the bucket is not in debt; starting takes its size, which
  may push the bucket into debt that later jobs wait out. Over any long
  window the link therefore moves ``rate`` bytes/s plus at most one burst.
- In flight: at most ``max_in_flight`` bytes run at once (a lone job larger
  than the cap still runs, alone).
- Priority: among the jobs a link could start, loads go before prefetches
  before stores; equal priorities keep submission order.
- Pressure: a store offered while the link already has ``max_queued_stores``
  bytes of stores waiting is dropped (and counted); loads and prefetches are
  never dropped.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tiercache.contracts.plan import LinkLimits, Priority, TransferPlan


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst or max(1, int(rate / 10)))
        self.tokens = self.burst
        self.last = now

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now

    def wait_time(self, now: float) -> float:
        """Seconds until a job may start (0 when the bucket is not in debt)."""
        if not self.rate:
            return 0.0
        self._refill(now)
        return 0.0 if self.tokens >= -0.5 else -self.tokens / self.rate   # half a byte absorbs float rounding

    def take(self, nbytes: int, now: float) -> None:
        if self.rate:
            self._refill(now)
            self.tokens -= nbytes


@dataclass(slots=True)
class LinkStats:
    jobs: int = 0
    failed: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    bytes: int = 0
    busy_seconds: float = 0.0
    first_start: float | None = None
    last_finish: float | None = None
    # "src→dst" → [bytes, busy seconds, blocks]: each direction's rate, in bytes and in KV blocks
    routes: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class Link:
    name: str
    limits: LinkLimits
    bucket: TokenBucket
    queue: list = field(default_factory=list)            # heap of (priority, seq, plan)
    in_flight_bytes: int = 0
    in_flight_jobs: int = 0
    queued_store_bytes: int = 0
    stats: LinkStats = field(default_factory=LinkStats)

    def offer(self, plan: TransferPlan, seq: int) -> bool:
        """Queue ``plan``; False when it is a store dropped under pressure."""
        cap = self.limits.max_queued_stores
        if plan.priority is Priority.STORE and cap and self.queued_store_bytes + plan.nbytes > cap \
                and self.queued_store_bytes > 0:
            self.stats.dropped += 1
            self.stats.dropped_bytes += plan.nbytes
            return False
        if plan.priority is Priority.STORE:
            self.queued_store_bytes += plan.nbytes
        heapq.heappush(self.queue, (plan.priority, seq, plan))
        return True

    def ready(self, now: float) -> tuple[tuple | None, float | None]:
        """The head job if it may start now, else how long until it might (None: nothing queued or at cap)."""
        if not self.queue:
            return None, None
        head = self.queue[0]
        cap = self.limits.max_in_flight
        if cap and self.in_flight_jobs and self.in_flight_bytes + head[2].nbytes > cap:
            return None, None  # wait for a running job to finish; finish() wakes the dispatcher
        wait = self.bucket.wait_time(now)
        return (head, 0.0) if wait <= 0 else (None, wait)

    def start(self, now: float) -> TransferPlan:
        _, _, plan = heapq.heappop(self.queue)
        if plan.priority is Priority.STORE:
            self.queued_store_bytes -= plan.nbytes
        self.bucket.take(plan.nbytes, now)
        self.in_flight_bytes += plan.nbytes
        self.in_flight_jobs += 1
        if self.stats.first_start is None:
            self.stats.first_start = now
        return plan

    def finish(self, plan: TransferPlan, ok: bool, moved_bytes: int, seconds: float, now: float) -> None:
        self.in_flight_bytes -= plan.nbytes
        self.in_flight_jobs -= 1
        self.stats.jobs += 1
        self.stats.failed += not ok
        self.stats.bytes += moved_bytes
        self.stats.busy_seconds += seconds
        self.stats.last_finish = now
        if plan.dst is not None:
            route = self.stats.routes.setdefault(f"{plan.src}→{plan.dst}", [0, 0.0, 0])
            route[0] += moved_bytes
            route[1] += seconds
            blocks = sum(len(c.block_ids) or c.chunk_blocks for c in plan.chunks)
            route[2] += blocks * moved_bytes // plan.nbytes if plan.nbytes else 0

    def as_dict(self) -> dict[str, float]:
        s = self.stats
        span = (s.last_finish - s.first_start) if s.first_start is not None and s.last_finish else 0.0
        return {
            "jobs": s.jobs, "failed": s.failed, "dropped": s.dropped, "dropped_bytes": s.dropped_bytes,
            "bytes": s.bytes,
            "gbps": s.bytes / s.busy_seconds / 1e9 if s.busy_seconds else 0.0,          # while copying
            "achieved_gbps": s.bytes / span / 1e9 if span else 0.0,                     # first start → last finish
            "queue_depth": len(self.queue), "in_flight_bytes": self.in_flight_bytes,
            "rate_limit_gbps": self.limits.rate / 1e9,
            # Each direction on its own (a link is shared by loads and stores): bytes and GB/s while copying.
            "routes": {name: {"bytes": int(b), "gbps": b / t / 1e9 if t else 0.0, "blocks": int(n),
                              "seconds": t}
                       for name, (b, t, n) in s.routes.items()},
        }


class LinkSet:
    """Every link of one engine; picks the next job across links by priority."""

    def __init__(self, limits: dict[str, LinkLimits], now: float) -> None:
        self._limits = limits
        self._now = now
        self.links: dict[str, Link] = {}
        self._seq = itertools.count()

    def link(self, name: str) -> Link:
        link = self.links.get(name)
        if link is None:
            limits = self._limits.get(name, LinkLimits())
            link = self.links[name] = Link(name, limits, TokenBucket(limits.rate, limits.burst, self._now))
        return link

    def offer(self, plan: TransferPlan) -> bool:
        return self.link(plan.link).offer(plan, next(self._seq))

    def next_job(self, now: float) -> tuple[TransferPlan | None, float | None]:
        """The best job any link may start now, else the shortest wait (None: wait for a finish or a submit)."""
        best, best_link, wait = None, None, None
        for link in self.links.values():
            head, w = link.ready(now)
            if head is not None and (best is None or head[:2] < best[:2]):
                best, best_link = head, link
            elif head is None and w is not None:
                wait = w if wait is None else min(wait, w)
        if best_link is not None:
            return best_link.start(now), 0.0
        return None, wait

    def queued(self) -> int:
        return sum(len(link.queue) for link in self.links.values())
