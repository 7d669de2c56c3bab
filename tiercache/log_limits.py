"""Repeated warnings, rate-limited with a count.

A full disk fails every chunk write, a damaged Redis fails every read, a
hostile client is refused on every call: one line per event would bury the
log (and cost the hot path a formatted record each). `ThrottledLog` logs the
first warning of a kind, then at most one per ``window_s``; each logged line
says how many like it were held back since the last one. The counters
(`TierCounters`, the server's) count every event; the log only tells that
they happen.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_WINDOW_S = 10.0


class ThrottledLog:
    def __init__(self, logger: logging.Logger, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list[float]] = {}     # kind → [when last logged, held back since]

    def warning(self, kind: str, msg: str, *args: object, **kwargs: object) -> bool:
        """Log ``msg % args`` unless a warning of ``kind`` was logged within the window; True if logged."""
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is not None and now - state[0] < self.window_s:
                state[1] += 1
                return False
            held = int(state[1]) if state is not None else 0
            self._kinds[kind] = [now, 0]
        if held:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, held, now - state[0])
        self.logger.warning(msg, *args, **kwargs)
        return True
