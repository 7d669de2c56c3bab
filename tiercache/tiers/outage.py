"""Availability of a remote tier: a failure marks it down, and it answers misses until the next retry.

Shared by the Redis and gRPC tiers. The first failure logs one warning and
keeps the tier down for ``retry_interval_s``; each further failure in a row
doubles the wait, up to ``max_retry_interval_s``, so a server that stays away
costs one probe every few seconds, not one timeout per engine step. The first
success after an outage logs the recovery and resets the wait.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Outage:
    def __init__(self, name: str, retry_interval_s: float = 1.0, max_retry_interval_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max(max_retry_interval_s, retry_interval_s)
        self._clock = clock
        self._down_until = 0.0
        self._failures = 0      # in a row
        self.outages = 0        # times the tier went down

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    @property
    def down(self) -> bool:
        """Down, or failed last time and not yet proven back."""
        return self._failures > 0

    def failed(self, what: str, err: BaseException) -> None:
        wait = min(self.retry_interval_s * 2 ** self._failures, self.max_retry_interval_s)
        if self._failures == 0:
            self.outages += 1
            log.warning("tier %s: %s failed (%s); answering misses, retrying in %.1fs", self.name, what,
                        _short(err), wait)
        self._failures += 1
        self._down_until = self._clock() + wait

    def succeeded(self) -> None:
        if self._failures:
            log.warning("tier %s: back after %d failed attempt(s)", self.name, self._failures)
            self._failures = 0
            self._down_until = 0.0


def _short(err: BaseException) -> str:
    details = getattr(err, "details", None)
    code = getattr(err, "code", None)
    if callable(details) and callable(code):   # grpc.RpcError
        return f"{code().name}: {details()}"
    return repr(err)
