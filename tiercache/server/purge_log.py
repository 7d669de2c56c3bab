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
reads from (their chunks may be in its L1), never any other's. The log keeps
the last ``keep`` purges; an engine that fell further behind (down across many
purges) is told so (``lost``) and purges everything it holds. Watchers are
kept per tenant (one tenant's ids never touch another's), the
``max_watchers`` most recently seen of each. All of it is
in memory: a server restart starts a new ``instance`` whose purges are
numbered from 1, and an engine that sees a new instance asks from its start.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection
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
    applied: int
    seen: float               # monotonic


class PurgeLog:
    """Server: recent purges and the engines that poll for them (thread safe)."""

    def __init__(self, keep: int = 4096, max_watchers: int = 1024) -> None:
        self.instance = secrets.token_hex(8)
        self._keep = keep
        self._max_watchers = max_watchers
        self._log: deque[LoggedPurge] = deque(maxlen=keep)
        self._seq = 0
        self._watchers: dict[str, OrderedDict[str, _Watcher]] = {}     # by tenant, then the engine's id
        self._lock = threading.Lock()

    def append(self, tenant: str, order: PurgeOrder) -> int:
        with self._lock:
            self._seq += 1
            self._log.append(LoggedPurge(self._seq, tenant, order))
            return self._seq

    def poll(self, tenant: str, watcher: str, tenants: Collection[str], namespaces: Collection[bytes],
             applied: int, instance: str) -> tuple[list[LoggedPurge], bool, int]:
        """The purges after ``applied`` that a watcher of ``tenant`` sees (those of ``tenants``; all of this
        instance's when ``instance`` is another), whether some it should have seen are no longer kept, and the
        latest purge's number; records the watcher."""
        if instance != self.instance:
            applied = 0
        with self._lock:
            if applied > self._seq:                    # numbers of no purge made here: start over
                applied = 0
            mine = self._watchers.setdefault(tenant, OrderedDict())
            w = mine[watcher] = _Watcher(frozenset(tenants), frozenset(namespaces), applied, time.monotonic())
            mine.move_to_end(watcher)
            while len(mine) > self._max_watchers:
                mine.popitem(last=False)
            oldest = self._log[0].seq if self._log else self._seq + 1
            lost = applied + 1 < oldest
            found = [p for p in self._log if p.seq > applied and self._sees(w, p)]
            latest = self._seq
        return found, lost, latest

    @staticmethod
    def _sees(w: _Watcher, p: LoggedPurge) -> bool:
        return p.tenant in w.tenants and (not p.order.namespaces or not w.namespaces.isdisjoint(p.order.namespaces))

    def pending(self, seq: int) -> tuple[int, int]:
        """(applied, pending): the engines that polled within ``WATCHER_TTL_S`` and see purge ``seq``, by whether
        they have applied it."""
        now = time.monotonic()
        with self._lock:
            purge = next((p for p in self._log if p.seq == seq), None)
            if purge is None:
                return 0, 0
            live = [w for mine in self._watchers.values() for w in mine.values()
                     if now - w.seen < WATCHER_TTL_S and self._sees(w, purge)]
        done = sum(w.applied >= seq for w in live)
        return done, len(live) - done
