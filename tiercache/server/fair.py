"""The server's in-flight byte budget, divided fairly: per tenant, then per connection within a tenant (server).

Bytes a client has declared and not yet delivered are reserved from one budget (``--max-inflight``) before
any of them is received (`tiercache.server.limits`). A single budget would let one client hold all of it by
declaring values and sending none of their bytes. `InflightBytes` divides it:

- **Shares.** A *group* is a tenant, and within a tenant one connection (a data-channel socket, a gRPC
  stream). A group is *active* while it holds bytes, waits for some, or asked within ``ACTIVE_S``. The
  budget is shared equally among the active tenants, a tenant's share equally among its active
  connections. A reservation that keeps its tenant and its connection within their shares is granted as
  soon as the bytes are free; so is a group's first value, even one larger than its share.
- **Borrowing.** Beyond its share a group may take what the others leave idle — but only while no other
  group of the same level is active and wanting: a tenant borrows while no other tenant has asked lately,
  a connection while no other connection of its tenant has.
- **Taking back, by progress.** Borrowed bytes must come back when their owner's peers want their share.
  While a reservation waits, every holder of a group over its share that has received nothing for
  ``SILENT_S`` is taken back: its connection is ended (`Hold.revoke`), its bytes released. A holder whose
  bytes keep arriving is never taken back, however slow; one that stops is — it does not take a fixed
  clock, only a peer that needs the room and a holder that is not using it.
- **Probation.** A tenant one of whose holders was taken back loses the first-value exemption for
  ``PROBATION_S``: while its peers are active, each of its connections — new ones included — gets no more
  than its share. Without it a client that reconnects and declares a large value again would take the
  room back in every pause between a peer's values, and each of the peer's next values would wait out
  ``SILENT_S`` once more.

So one tenant, or one connection within a tenant, can exhaust only its own share: the others' shares come
back to them within ``SILENT_S`` plus the time the taken-back handler needs to let go — a value that waited
out its ``ADMIT_WAIT_S`` first is answered busy and sent again by its client — and stay theirs while they use
them.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

ACTIVE_S = 1.0       # a group that asked this recently still counts for the shares (demand between requests)
SILENT_S = 0.5       # a holder over its group's share with no bytes for this long is taken back when others wait:
                     # two of the receive steps after which a value's handler reports progress
PROBATION_S = 10.0   # a tenant whose holder was taken back borrows nothing beyond its shares for this long


@dataclass(eq=False, slots=True)
class Hold:
    """One reservation: whose it is, how many bytes, when its bytes last moved, how to end its connection."""
    tenant: str
    connection: Hashable
    nbytes: int
    moved_at: float
    revoke: Callable[[], None]
    revoked: bool = field(default=False)


class InflightBytes:
    """Bytes being received from clients and not yet stored: reserved before they arrive, from a fixed budget
    divided fairly (module docstring). Its state is guarded by one condition; handlers of any thread call it."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic,
                 silent_s: float = SILENT_S, active_s: float = ACTIVE_S, probation_s: float = PROBATION_S) -> None:
        self.limit = limit
        self.silent_s = silent_s
        self.active_s = active_s
        self.probation_s = probation_s
        self._clock = clock
        self._cond = threading.Condition()
        self._used = 0
        self._holds: set[Hold] = set()
        self._by_tenant: Counter[str] = Counter()                       # bytes held
        self._by_connection: Counter[tuple[str, Hashable]] = Counter()
        self._asked: dict[str, float] = {}                              # tenant → last reserve (start or wait)
        self._asked_conn: dict[tuple[str, Hashable], float] = {}
        self._taken_from: dict[str, float] = {}                         # tenant → its last holder taken back
        self.refused = 0
        self.taken_back = 0

    @property
    def used(self) -> int:
        return self._used

    # -- shares (under the condition) ------------------------------------------------------------------------
    def _active_tenants(self, now: float) -> set[str]:
        return {t for t, n in self._by_tenant.items() if n} | {t for t, at in self._asked.items()
                                                                 if now - at <= self.active_s}

    def _active_connections(self, tenant: str, now: float) -> set[Hashable]:
        held = {c for (t, c), n in self._by_connection.items() if t == tenant and n}
        return held | {c for (t, c), at in self._asked_conn.items() if t == tenant and now - at <= self.active_s}

    def _shares(self, hold: Hold, now: float) -> tuple[int, int, bool, bool]:
        """For ``hold``'s tenant and connection: (the tenant's share, the connection's share, whether another
        tenant is active, whether another connection of the tenant is). Alone, a group's share is all."""
        tenants = self._active_tenants(now) | {hold.tenant}
        tenant_share = self.limit // len(tenants)
        connections = self._active_connections(hold.tenant, now) | {hold.connection}
        return tenant_share, tenant_share // len(connections), len(tenants) > 1, len(connections) > 1

    def _on_probation(self, tenant: str, now: float) -> bool:
        taken = self._taken_from.get(tenant)
        return taken is not None and now - taken < self.probation_s

    def _fits(self, hold: Hold, now: float) -> bool:
        if self._used + hold.nbytes > self.limit:
            return False
        tenant_share, connection_share, other_tenants, other_connections = self._shares(hold, now)
        # past its share only while no peer wants room — or for a first value: a group holding nothing may
        # take one value, even one larger than its share (it is taken back if it goes silent), unless its
        # tenant is on probation
        strict = self._on_probation(hold.tenant, now)
        held = self._by_tenant[hold.tenant]
        if other_tenants and (held or strict) and held + hold.nbytes > tenant_share:
            return False
        held = self._by_connection[(hold.tenant, hold.connection)]
        if other_connections and (held or strict) and held + hold.nbytes > connection_share:
            return False
        return True

    def _over_share(self, now: float, waiting: Hold) -> list[Hold]:
        """Silent holders of the groups over their share that stand in ``waiting``'s way — taken back only for
        a waiter whose group would stay within its own share (or that holds nothing yet)."""
        tenant_share, connection_share, _, _ = self._shares(waiting, now)
        mine = self._by_tenant[waiting.tenant]
        for_tenant = not mine or mine + waiting.nbytes <= tenant_share
        mine = self._by_connection[(waiting.tenant, waiting.connection)]
        for_connection = not mine or mine + waiting.nbytes <= connection_share
        out = []
        for h in self._holds:
            if h.revoked or now - h.moved_at < self.silent_s:
                continue
            other_tenant = (for_tenant and h.tenant != waiting.tenant
                            and self._by_tenant[h.tenant] > tenant_share)
            other_connection = (for_connection and h.tenant == waiting.tenant and h.connection != waiting.connection
                                and self._by_connection[(h.tenant, h.connection)] > connection_share)
            if other_tenant or other_connection:
                out.append(h)
        return out

    # -- the calls -------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, wait_s: float, tenant: str, connection: Hashable,
                revoke: Callable[[], None]) -> Hold | None:
        """Take ``nbytes`` for ``connection`` of ``tenant``, waiting up to ``wait_s`` for room; None (and
        counted) when the value is larger than the whole budget or no room came in time. ``revoke`` ends the
        connection's read if the reservation is taken back (it then fails and the handler releases it)."""
        if nbytes > self.limit:
            with self._cond:
                self.refused += 1
            return None
        now = self._clock()
        hold = Hold(tenant, connection, nbytes, now, revoke)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                now = self._clock()
                self._asked[tenant] = now
                self._asked_conn[(tenant, connection)] = now
                if self._fits(hold, now):
                    break
                victims = self._over_share(now, hold)
                for victim in victims:
                    victim.revoked = True
                    self.taken_back += 1
                    self._taken_from[victim.tenant] = now
                left = deadline - time.monotonic()
                if victims:
                    self._cond.release()        # ending a connection is the victim's handler's business
                    try:
                        for victim in victims:
                            victim.revoke()
                    finally:
                        self._cond.acquire()
                    continue
                if left <= 0:
                    self.refused += 1
                    return None
                self._cond.wait(min(left, self.silent_s / 4))
            hold.moved_at = now
            self._holds.add(hold)
            self._used += nbytes
            self._by_tenant[tenant] += nbytes
            self._by_connection[(tenant, connection)] += nbytes
            self._forget_old(now)
            return hold

    def moved(self, hold: Hold) -> None:
        """Bytes of ``hold``'s value arrived: it is making progress."""
        hold.moved_at = self._clock()

    def release(self, hold: Hold) -> None:
        with self._cond:
            if hold not in self._holds:
                return
            self._holds.discard(hold)
            self._used -= hold.nbytes
            self._by_tenant[hold.tenant] -= hold.nbytes
            self._by_connection[(hold.tenant, hold.connection)] -= hold.nbytes
            if not self._by_connection[(hold.tenant, hold.connection)]:
                del self._by_connection[(hold.tenant, hold.connection)]
            self._cond.notify_all()

    def _forget_old(self, now: float) -> None:
        """Drop demand older than the active window (bounded memory under connection churn)."""
        if len(self._asked_conn) > 4 * (len(self._holds) + 64):
            self._asked_conn = {k: at for k, at in self._asked_conn.items() if now - at <= self.active_s}
            self._asked = {k: at for k, at in self._asked.items() if now - at <= self.active_s}
