"""Availability of a remote tier: a failure marks it down, and a background probe brings it back.

Shared by the Redis and gRPC tiers. The first failed call logs one warning
and marks the tier down: from then on every call answers misses at once,
without touching the network, so a dead or hanging server costs the engine
at most the one call that found it so. A daemon thread probes the server
(``PING``, ``Health``) every ``retry_interval_s`` — never on the engine's
threads — and the first probe that succeeds logs the recovery and marks the
tier up again. ``close`` stops the probing.

One tier has two guards in a process that holds both sides (the scheduler's
lookups and a worker's transfers, as in the reference engine): they share a
``tier`` key (the tier's name and server), and only the first to go down and
the last to come back log, so an outage reads as one warning line and one
recovery line.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MIN_PROBE_INTERVAL_S = 0.05

_down_lock = threading.Lock()
_down_guards: dict[str, int] = {}     # tier → guards of it that are down in this process


def _mark(tier: str, down: bool) -> bool:
    """Count one guard of ``tier`` down or up again; True for the first down and the last up."""
    with _down_lock:
        before = _down_guards.get(tier, 0)
        _down_guards[tier] = before + 1 if down else before - 1
        return before == 0 if down else before == 1


class Outage:
    """Either side: one guard of one tier's availability, with its prober thread."""

    def __init__(self, name: str, retry_interval_s: float, probe: Callable[[], object], tier: str = "") -> None:
        self.name = name
        self.tier = tier or name        # guards of one tier log one outage between them
        self.retry_interval_s = max(retry_interval_s, MIN_PROBE_INTERVAL_S)
        self._probe = probe             # raises while the server is away
        self._lock = threading.Lock()
        self._down = False
        self._counted = False           # this guard is one of its tier's guards counted down
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        self.outages = 0                # times the tier went down
        self.probes = 0                 # probes sent while down, over every outage
        self._probes_at_down = 0

    @property
    def available(self) -> bool:
        return not self._down

    def failed(self, what: str, err: BaseException) -> None:
        """A call failed: mark the tier down (once) and make sure a prober is at work."""
        with self._lock:
            if self._down or self._closed.is_set():
                return
            self._down = True
            self.outages += 1
            self._probes_at_down = self.probes
            self._counted = True
            level = logging.WARNING if _mark(self.tier, down=True) else logging.DEBUG
            log.log(level, "tier %s: %s failed (%s); answering misses, probing every %.2gs", self.name, what,
                    _short(err), self.retry_interval_s)
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_until_back, name=f"tiercache-probe-{self.name}",
                                                daemon=True)
                self._prober.start()

    def succeeded(self) -> None:
        """A call or a probe went through: the tier is up."""
        with self._lock:
            if self._down:
                last = self._uncount()
                level = logging.WARNING if last else logging.DEBUG
                log.log(level, "tier %s: back after %d probe(s)", self.name, self.probes - self._probes_at_down)
                self._down = False

    def _uncount(self) -> bool:
        """Take this guard off its tier's down count (once); True if it was the last one down."""
        if not self._counted:
            return False
        self._counted = False
        return _mark(self.tier, down=False)

    def close(self) -> None:
        with self._lock:
            self._uncount()
            self._closed.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=1.0)

    def _probe_until_back(self) -> None:
        while not self._closed.wait(self.retry_interval_s):
            if not self._down:
                return        # a call that was already in flight proved it back
            self.probes += 1
            try:
                self._probe()
            except Exception as err:  # whatever the client raises while the server is away
                log.debug("tier %s: probe failed: %s", self.name, _short(err))
                continue
            self.succeeded()
            return


def _short(err: BaseException) -> str:
    details = getattr(err, "details", None)
    code = getattr(err, "code", None)
    if callable(details) and callable(code):   # grpc.RpcError
        return f"{code().name}: {details()}"
    return repr(err)
