"""Client: the purges a shared store announced, fetched for the engine to apply to its own tiers (`PurgeWatch`).

A thread of its own asks the store every ``POLL_INTERVAL_S`` for the purges
after the last one the engine applied, and tells it which that was. The
scheduler takes them (`take`) at its next step, applies them to L1 and its
local tiers before anything else (`CacheManager.apply_purges`), and says so
(`applied`): the next poll tells the store, and the purge that waits for
the engines sees it. Each purge's time is moved from the store's clock to
this host's (the offset taken at each poll), so a purge applied late
takes only what was stored before it was made. A store that says this engine
fell behind its log (``lost``) gets everything stored until now purged.

Two feeds, one per kind of shared tier:
- `ServerPurges`: a `tiercache serve`'s ``Purges`` call (`tiercache.server.purge_log`); positions are the
  server's purge numbers, per tenant seen, numbered anew by a restarted server (a new ``instance``).
- `RedisPurges`: the stream ``tiercache-purges`` that `tiercache purge --redis` appends to; positions are
  stream ids, and the engine acknowledges in the hash ``tiercache-purges-applied`` (its id → "position
  time").
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiercache.contracts.purge import POLL_INTERVAL_S, PurgeOrder
from tiercache.wire import tiercache_pb2 as pb

log = logging.getLogger(__name__)

# beside the values (`tiercache:<digest>:<key>`), never matched by their pattern
REDIS_STREAM = b"tiercache-purges"
REDIS_APPLIED = b"tiercache-purges-applied"
REDIS_KEEP = 4096               # purges the stream keeps (about)
MAX_PER_POLL = 256


@dataclass(slots=True)
class Fetched:
    """One poll's answer: the purges after the positions asked, and per feed how far it is complete (a
    server numbers each tenant's purges apart; Redis has one feed, "")."""
    instance: str
    purges: list[tuple[str, object, PurgeOrder]] = field(default_factory=list)   # (feed, position, order)
    complete_to: dict[str, object] = field(default_factory=dict)
    lost: bool = False


class PurgeWatch(ABC):
    """Client (scheduler side): purges polled from one shared store, for the scheduler's thread to apply."""

    start: object = 0               # the position before any purge

    def __init__(self, name: str, interval_s: float = POLL_INTERVAL_S) -> None:
        self.watcher = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._instance = ""
        self._applied: dict[str, object] = {}     # per feed, the last purge applied (of `_instance`)
        self._received: dict[str, object] = {}    # per feed, the last purge fetched
        self._ready: list[PurgeOrder] = []
        self._taken: tuple[str, dict[str, object]] | None = None   # handed to the scheduler, not yet applied
        self.polls = self.errors = 0
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name=f"tiercache-purges-{name}", daemon=True)
        self._thread.start()

    @abstractmethod
    def _fetch(self, applied: dict[str, object], instance: str) -> Fetched:
        """Tell the store ``applied`` and ask for what came after it; raises while the store is away."""

    def _run(self) -> None:
        while True:                     # at once first: the store knows this engine from its start
            try:
                self.poll()
            except Exception as err:    # the store is away or busy: its lookups' outage says so; ask again later
                self.errors += 1
                log.debug("polling for purges failed: %s", err)
            if self._stop.wait(self._interval_s):
                return

    def poll(self) -> int:
        """Ask once (the watch thread does, every interval); returns how many new purges came."""
        with self._lock:
            applied, instance = dict(self._applied), self._instance
        got = self._fetch(applied, instance)
        self.polls += 1
        with self._lock:
            if got.instance != self._instance:     # a store started anew: its purges are numbered anew
                self._instance, self._applied, self._received = got.instance, {}, {}
            new = [PurgeOrder(everything=True, issued_at=time.time())] if got.lost else []
            new += [order for feed, position, order in got.purges
                    if position > self._received.get(feed, self.start)]
            self._ready += new
            for feed, position in got.complete_to.items():
                self._received[feed] = max(self._received.get(feed, self.start), position)
            if not self._ready and self._taken is None:    # nothing of it for this engine: applied, as it were
                self._applied = dict(self._received)
            return len(new)

    def take(self) -> list[PurgeOrder]:
        """The purges fetched since the last call, oldest first (scheduler's thread)."""
        if not self._ready:                        # the common case, without the lock
            return []
        with self._lock:
            ready, self._ready = self._ready, []
            self._taken = (self._instance, dict(self._received))
        return ready

    def applied(self) -> None:
        """Everything `take` returned is applied: the next poll says so."""
        with self._lock:
            if self._taken is not None and self._taken[0] == self._instance:
                for feed, position in self._taken[1].items():
                    self._applied[feed] = max(self._applied.get(feed, self.start), position)
            self._taken = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def order_of(spec: pb.PurgeSpec, issued_at: float, offset: float) -> PurgeOrder:
    """A logged purge as this host applies it (its times moved by ``offset``: this host's clock minus the
    store's)."""
    return PurgeOrder(tuple(spec.roots), spec.stored_before + offset if spec.stored_before else None,
                      spec.everything, tuple(spec.namespaces), issued_at + offset)


class ServerPurges(PurgeWatch):
    """The purges of a `tiercache serve`, by its ``Purges`` call."""

    def __init__(self, call: Callable[..., bytes], metadata, namespaces: Sequence[bytes], name: str,
                 timeout_s: float = 1.0, interval_s: float = POLL_INTERVAL_S) -> None:
        self._call = call
        self._metadata = metadata
        self._namespaces = list(namespaces)
        self._timeout_s = timeout_s
        super().__init__(name, interval_s)

    def _fetch(self, applied: dict[str, object], instance: str) -> Fetched:
        request = pb.PurgesRequest(watcher=self.watcher, namespaces=self._namespaces, applied=applied,
                                   instance=instance)
        reply = pb.PurgesReply.FromString(self._call(request.SerializeToString(), timeout=self._timeout_s,
                                                     metadata=self._metadata))
        offset = time.time() - reply.now
        return Fetched(reply.instance, [(p.tenant, p.seq, order_of(p.spec, p.issued_at, offset))
                                        for p in reply.purges], dict(reply.complete_to), reply.lost)


def stream_id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


def redis_now(client) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


class RedisPurges(PurgeWatch):
    """The purges `tiercache purge --redis` announced in the Redis stream ``tiercache-purges``."""

    start = (0, 0)

    def __init__(self, client, namespaces: Sequence[bytes], name: str, interval_s: float = POLL_INTERVAL_S) -> None:
        self._client = client
        self._namespaces = set(namespaces)
        super().__init__(name, interval_s)

    def _fetch(self, applied: dict[str, object], instance: str) -> Fetched:
        now = redis_now(self._client)
        offset = time.time() - now
        ms, seq = applied.get("", self.start)
        self._client.hset(REDIS_APPLIED, self.watcher, f"{ms}-{seq} {now:.3f}")
        entries = self._client.xrange(REDIS_STREAM, min=f"({ms}-{seq}", max="+", count=MAX_PER_POLL)
        lost = False
        if (ms, seq) != self.start and self._client.exists(REDIS_STREAM):   # trimmed past what this engine has?
            deleted = self._client.xinfo_stream(REDIS_STREAM).get("max-deleted-entry-id")
            lost = deleted is not None and stream_id(deleted) > (ms, seq)
        purges = []
        for raw_id, fields in entries:
            spec = pb.PurgeSpec.FromString(fields[b"spec"])
            if spec.namespaces and self._namespaces.isdisjoint(spec.namespaces):
                continue
            purges.append(("", stream_id(raw_id), order_of(spec, float(fields[b"at"]), offset)))
        return Fetched("", purges, {"": stream_id(entries[-1][0])} if entries else {}, lost)
