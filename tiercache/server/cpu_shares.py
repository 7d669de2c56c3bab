"""The server's CPU, shared per tenant (server).

Every message a tenant sends or asks for costs the server CPU: reading it off the socket, checking it,
copying it, sending values back. Memory and slots are bounded per tenant elsewhere (`tiercache.server.fair`,
`tiercache.server.limits`); `CpuShares` bounds the CPU. The server may use ``cores`` of CPU in all (its
``--cpu-cores``); while more than one tenant is *active* (it asked for work within ``ACTIVE_S``) each may
use an equal share of them, and a tenant past its share waits before its next piece of work until it is
back within it. A tenant alone may use them all; a tenant that keeps within its share never waits.

How a tenant's CPU is counted:

- **Its threads' time.** Work done on a thread serving one tenant at a time — a data-channel connection's
  values, a call's work in the handler pool, a ``Put`` stream's messages — is charged with that thread's
  CPU time (`time.thread_time`: user and system, so the kernel's copies of a socket send count).
- **Its share of the rest.** What the process spends elsewhere — gRPC's transport and event loop receiving
  and sending messages, refusing calls — is read from the process's CPU time every ``TICK_S`` and divided
  among the tenants in proportion to the gRPC bytes they moved lately (a call counting ``CALL_BYTES`` from
  the moment it arrives, refused or not; bytes weigh less by half every ``WEIGHT_HALF_LIFE_S``). A tick's
  CPU is divided one tick late, by weights that count the next tick's bytes too: the transport's work comes
  before a handler counts the call or the bytes it was for — a burst of calls opened at once keeps the
  transport and the event loop busy for most of a tick before their handlers count one of them — so a
  tenant that moved little while a rival's burst began is not charged that burst.

Each tenant holds a credit of CPU seconds, refilled at its share and capped at ``BURST_S`` (a request's
worth of work never waits), spent by what is charged, and never owed beyond ``MAX_DEBT_S``. Waiting is
done where it costs no shared resource: a data-channel connection's own thread, a ``Put`` stream's, or the
event loop's timer for a unary call or a ``Get`` stream, so a paced tenant holds no handler thread.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

ACTIVE_S = 1.0        # a tenant that asked for work this recently counts for the shares
TICK_S = 0.05         # how often the process's CPU outside the tenants' threads is divided among them
BURST_S = 0.02        # CPU seconds a tenant may spend at once past its share (a request's work)
MAX_DEBT_S = 0.5      # the most CPU seconds a tenant is held to owe (a wait of at most this over its share)
CALL_BYTES = 64 << 10  # what one call weighs in gRPC's work, beside its bytes
STALE_TICK_S = 1.0    # a longer gap since the last tick is left undivided (the server's start, an idle spell)
WEIGHT_HALF_LIFE_S = 0.25  # how fast the bytes a tenant moved stop weighing in the division of the rest

T = TypeVar("T")


class CpuShares:
    """Per-tenant CPU credits over ``cores`` of CPU (module docstring). Its state is guarded by one lock;
    threads and the event loop call it."""

    def __init__(self, cores: float, active_s: float = ACTIVE_S, burst_s: float = BURST_S,
                 clock: Callable[[], float] = time.monotonic,
                 process_clock: Callable[[], float] = time.process_time) -> None:
        if cores <= 0:
            raise ValueError(f"cores must be positive, got {cores}")
        self.cores = cores
        self.active_s = active_s
        self.burst_s = burst_s
        self._clock = clock
        self._process_clock = process_clock
        self._lock = threading.Lock()
        self._credit: dict[str, float] = {}
        self._refilled_at: dict[str, float] = {}
        self._asked: dict[str, float] = {}
        self._used: Counter[str] = Counter()       # CPU seconds charged, per tenant (for the server's stats)
        self._moved: Counter[str] = Counter()      # gRPC bytes per tenant since the last tick
        self._weight: dict[str, float] = {}        # ... and lately, decayed (what divides the rest)
        self._charged_since_tick = 0.0
        self._undivided = 0.0                      # the last tick's CPU outside the tenants' threads
        self._tick_at = clock()
        self._process_at = process_clock()
        self.waits = 0
        self.waited_s = 0.0

    # -- the shares (under the lock) -------------------------------------------------------------------------
    def _share(self, now: float) -> tuple[float, int]:
        active = sum(1 for at in self._asked.values() if now - at <= self.active_s)
        return self.cores / max(1, active), active

    def _refill(self, tenant: str, now: float, share: float) -> float:
        credit = self._credit.get(tenant, self.burst_s)
        credit = min(self.burst_s, credit + (now - self._refilled_at.get(tenant, now)) * share)
        self._credit[tenant] = credit
        self._refilled_at[tenant] = now
        return credit

    def _charge(self, tenant: str, cpu_s: float) -> None:
        self._credit[tenant] = max(-MAX_DEBT_S, self._credit.get(tenant, self.burst_s) - cpu_s)
        self._refilled_at.setdefault(tenant, self._clock())
        self._used[tenant] += cpu_s

    def _tick(self, now: float) -> None:
        """Divide the process's CPU that no tenant's thread was charged in the tick before this one among the
        tenants, by the gRPC bytes each moved lately (this tick's included); keep this tick's for the next."""
        if now - self._tick_at < TICK_S:
            return
        process = self._process_clock()
        fresh = now - self._tick_at <= STALE_TICK_S      # not the server's start, nor idle time
        self._weigh(now - self._tick_at)
        weight = sum(self._weight.values())
        if fresh and self._undivided > 0 and weight:
            for tenant, lately in self._weight.items():
                self._charge(tenant, self._undivided * lately / weight)
        rest = process - self._process_at - self._charged_since_tick
        self._undivided = rest if fresh and rest > 0 else 0.0
        self._charged_since_tick = 0.0
        self._process_at, self._tick_at = process, now
        if len(self._asked) > 64:                       # bounded under tenants that come and go
            for t in [t for t, at in self._asked.items() if now - at > self.active_s]:
                for table in (self._asked, self._credit, self._refilled_at):
                    table.pop(t, None)

    def _weigh(self, elapsed_s: float) -> None:
        """Fold the bytes moved since the last tick into the decayed weights, and forget what weighs nothing."""
        decay = 0.5 ** (elapsed_s / WEIGHT_HALF_LIFE_S)
        weights = {t: w * decay for t, w in self._weight.items()}
        for tenant, moved in self._moved.items():
            weights[tenant] = weights.get(tenant, 0.0) + moved
        self._weight = {t: w for t, w in weights.items() if w >= 1.0}
        self._moved.clear()

    # -- the calls -------------------------------------------------------------------------------------------
    def delay(self, tenant: str) -> float:
        """Seconds ``tenant`` is to wait before its next piece of work (0: within its share, or alone); it
        counts as active from now."""
        with self._lock:
            now = self._clock()
            self._asked[tenant] = now
            self._tick(now)
            share, active = self._share(now)
            credit = self._refill(tenant, now, share)
            if active <= 1 or credit >= 0:
                return 0.0
            return -credit / share

    def charge(self, tenant: str, cpu_s: float) -> None:
        """``tenant``'s thread spent ``cpu_s`` of CPU on its work."""
        with self._lock:
            self._charge(tenant, cpu_s)
            self._charged_since_tick += cpu_s

    def moved(self, tenant: str, nbytes: int) -> None:
        """gRPC moved ``nbytes`` for ``tenant``: its weight in the transport's CPU."""
        with self._lock:
            self._moved[tenant] += nbytes

    def arrived(self, tenant: str) -> None:
        """A call of ``tenant`` arrived, to be served or refused: it weighs ``CALL_BYTES`` beside its bytes."""
        self.moved(tenant, CALL_BYTES)

    def pace(self, tenant: str) -> None:
        """Wait, on this thread, until ``tenant`` is within its share."""
        while (wait := self.delay(tenant)) > 0:
            self._waited(wait)
            time.sleep(wait)

    async def pace_async(self, tenant: str) -> None:
        """Wait, on the event loop's timer, until ``tenant`` is within its share."""
        while (wait := self.delay(tenant)) > 0:
            self._waited(wait)
            await asyncio.sleep(wait)

    def run(self, tenant: str, work: Callable[[], T]) -> T:
        """``work()`` on this thread, its CPU time charged to ``tenant``."""
        start = time.thread_time()
        try:
            return work()
        finally:
            self.charge(tenant, time.thread_time() - start)

    def meter(self, tenant: str) -> "ThreadMeter":
        return ThreadMeter(self, tenant)

    def used(self) -> dict[str, float]:
        """CPU seconds charged to each tenant so far."""
        with self._lock:
            return dict(self._used)

    def _waited(self, wait: float) -> None:
        with self._lock:
            self.waits += 1
            self.waited_s += wait


class ThreadMeter:
    """A thread that serves one tenant piece after piece (a data-channel connection, a ``Put`` stream):
    `step` charges the CPU the thread used since the last step and waits while the tenant is past its share."""

    def __init__(self, shares: CpuShares, tenant: str) -> None:
        self._shares = shares
        self._tenant = tenant
        self._at = time.thread_time()

    def step(self) -> None:
        now = time.thread_time()
        self._shares.charge(self._tenant, now - self._at)
        self._shares.pace(self._tenant)
        self._at = time.thread_time()
