"""The server's purge log: the purges it made, for the engines under it to apply to their own tiers.

An engine's L1 and local disk hold copies of what it read from or wrote to
the server; only the engine can take those out. So every purge is logged
here (`PurgeLog.append`), numbered, and every client tier polls for the
purges after the last one it applied (``Purges``, `PurgeLog.poll`): an engine
thereby learns of a purge within one poll interval, applies it to its tiers
at its next scheduler step, and says so with its next poll. The ``Purge``
call waits (`PurgeLog.pending`) until every engine that polled within the
last ``WATCHER_TTL_S`` and sees the purge has applied it, up to its wait.

Scope: an engine sees the purges of its own tenant and of the tenants it
reads from (their chunks may be in its L1), never any other's; purges are
numbered per tenant, so no tenant learns from the numbers how many purges
another made. The log keeps the last ``keep`` purges of each tenant; an
engine that fell further behind (down across many purges) is told so
(``lost``) and purges everything it holds. Watchers are kept per tenant (one
tenant's ids never touch another's), the ``max_watchers`` most recently seen
of each. All of it is
in memory: a server restart starts a new ``instance`` whose purges are
numbered from 1, and an engine that sees a new instance asks from its start.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tiercache.contracts.purge import WATCHER_TTL_S, PurgeOrder

MAX_WATCHER_ID = 64


@dataclass(frozen=True, slots=True)
class LoggedPurge:
    seq: int
    tenant: str
    order: PurgeOrder         # its issued_at is the server's clock when it was made


@dataclass(slots=True)
class _Watcher:
    tenants: frozenset[str]   # whose purges it sees: its tenant and the tenants it reads from
    namespaces: frozenset[bytes]
    applied: dict[str, int]   # per tenant, the last purge it applied
    seen: float               # monotonic


class PurgeLog:
    """Server: recent purges, numbered per tenant, and the engines that poll for them (thread safe)."""

    def __init__(self, keep: int = 4096, max_watchers: int = 1024) -> None:
        self.instance = secrets.token_hex(8)
        self._max_kept = keep
        self._max_watchers = max_watchers
        self._logs: dict[str, deque[LoggedPurge]] = {}
        self._seq: dict[str, int] = {}
        self._dropped: dict[str, int] = {}         # per tenant, the newest purge no longer kept
        self._watchers: dict[str, OrderedDict[str, _Watcher]] = {}     # by tenant, then the engine's id
        self._lock = threading.Lock()

    def append(self, tenant: str, order: PurgeOrder) -> int:
        with self._lock:
            seq = self._seq[tenant] = self._seq.get(tenant, 0) + 1
            log = self._logs.setdefault(tenant, deque())
            log.append(LoggedPurge(seq, tenant, order))
            if len(log) > self._max_kept:
                self._dropped[tenant] = log.popleft().seq
            return seq

    def poll(self, tenant: str, watcher: str, tenants: Collection[str], namespaces: Collection[bytes],
             applied: Mapping[str, int], instance: str) -> tuple[list[LoggedPurge], bool, dict[str, int]]:
        """The purges after ``applied`` (per tenant) that a watcher of ``tenant`` sees — those of ``tenants``;
        all of this instance's when ``instance`` is another — whether some it should have seen are no longer
        kept, and per tenant the newest purge's number; records the watcher."""
        with self._lock:
            applied = {t: n for t, n in applied.items() if instance == self.instance and n <= self._seq.get(t, 0)}
            mine = self._watchers.setdefault(tenant, OrderedDict())
            w = mine[watcher] = _Watcher(frozenset(tenants), frozenset(namespaces), applied, time.monotonic())
            mine.move_to_end(watcher)
            while len(mine) > self._max_watchers:
                mine.popitem(last=False)
            lost = any(self._dropped.get(t, 0) > applied.get(t, 0) for t in w.tenants)
            found = [p for t in w.tenants for p in self._logs.get(t, ()) if p.seq > applied.get(t, 0)
                     and self._sees(w, p)]
            latest = {t: self._seq[t] for t in w.tenants if t in self._seq}
        return found, lost, latest

    @staticmethod
    def _sees(w: _Watcher, p: LoggedPurge) -> bool:
        return p.tenant in w.tenants and (not p.order.namespaces or not w.namespaces.isdisjoint(p.order.namespaces))

    def pending(self, tenant: str, seq: int) -> tuple[int, int]:
        """(applied, pending): the engines that polled within ``WATCHER_TTL_S`` and see ``tenant``'s purge
        ``seq``, by whether they have applied it."""
        now = time.monotonic()
        with self._lock:
            purge = next((p for p in self._logs.get(tenant, ()) if p.seq == seq), None)
            if purge is None:
                return 0, 0
            live = [w for mine in self._watchers.values() for w in mine.values()
                    if now - w.seen < WATCHER_TTL_S and self._sees(w, purge)]
        done = sum(w.applied.get(tenant, 0) >= seq for w in live)
        return done, len(live) - done
