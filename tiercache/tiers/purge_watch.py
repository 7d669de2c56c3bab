"""Client: the purges a `tiercache serve` made, fetched for the engine to apply to its own tiers (`PurgeWatch`).

A thread of its own asks the server every ``POLL_INTERVAL_S`` for the
purges after the last one the engine applied (``Purges``; see
`tiercache.server.purge_log`). The scheduler takes them (`take`) at its next
step, applies them to L1 and its local tiers before anything else
(`CacheManager.apply_purges`), and says so (`applied`): the next poll tells
the server, whose ``Purge`` call waits for it. Each purge's time is moved
from the server's clock to this host's (the offset measured at each poll),
so a purge applied late takes only what was stored before it was made. A
server that says this engine fell behind its log (``lost``) gets everything
stored until now purged; a restarted server numbers its purges anew.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from tiercache.contracts.purge import POLL_INTERVAL_S, PurgeOrder
from tiercache.wire import tiercache_pb2 as pb

log = logging.getLogger(__name__)


class PurgeWatch:
    """Client (scheduler side): purges polled from one server, for the scheduler's thread to apply."""

    def __init__(self, call: Callable[..., bytes], metadata, namespaces: Sequence[bytes], name: str,
                 timeout_s: float = 1.0, interval_s: float = POLL_INTERVAL_S) -> None:
        self._call = call
        self._metadata = metadata
        self._namespaces = list(namespaces)
        self._timeout_s = timeout_s
        self.watcher = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._instance = ""
        self._applied = 0                     # the last purge applied, of `_instance`
        self._received = 0                    # the last purge fetched, of `_instance`
        self._ready: list[PurgeOrder] = []
        self._taken: tuple[str, int] | None = None   # handed to the scheduler, not yet applied: up to which
        self.polls = self.errors = 0
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name=f"tiercache-purges-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:                     # at once first: the server knows this engine from its start
            try:
                self.poll()
            except grpc.RpcError:       # the server is away or busy: its lookups' outage says so; ask again later
                self.errors += 1
            if self._stop.wait(self._interval_s):
                return

    def poll(self) -> int:
        """Ask once (the watch thread does, every interval); returns how many new purges came."""
        with self._lock:
            request = pb.PurgesRequest(watcher=self.watcher, namespaces=self._namespaces, applied=self._applied,
                                       instance=self._instance)
        reply = pb.PurgesReply()
        reply.ParseFromString(self._call(request.SerializeToString(), timeout=self._timeout_s,
                                         metadata=self._metadata))
        offset = time.time() - reply.now           # this host's clock minus the server's
        self.polls += 1
        with self._lock:
            if reply.instance != self._instance:   # a server started anew: its purges are numbered from 1
                self._instance, self._applied, self._received = reply.instance, 0, 0
            new = []
            if reply.lost:
                new.append(PurgeOrder(everything=True, issued_at=time.time()))
            for p in reply.purges:
                if p.seq <= self._received:
                    continue
                spec = p.spec
                new.append(PurgeOrder(tuple(spec.roots), spec.stored_before + offset if spec.stored_before else None,
                                      spec.everything, tuple(spec.namespaces), p.issued_at + offset))
            self._ready += new
            self._received = max(self._received, reply.complete_to)
            if not self._ready and self._taken is None:    # nothing of it for this engine: applied, as it were
                self._applied = self._received
            return len(new)

    def take(self) -> list[PurgeOrder]:
        """The purges fetched since the last call, oldest first (scheduler's thread)."""
        if not self._ready:                        # the common case, without the lock
            return []
        with self._lock:
            ready, self._ready = self._ready, []
            self._taken = (self._instance, self._received)
        return ready

    def applied(self) -> None:
        """Everything `take` returned is applied: the next poll says so."""
        with self._lock:
            if self._taken is not None and self._taken[0] == self._instance:
                self._applied = max(self._applied, self._taken[1])
            self._taken = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._timeout_s + self._interval_s)
