"""Cyclic garbage collection on a clock, for `tiercache serve`.

A finished gRPC call's memory — its received message among it, up to
``max_message`` bytes — is given back only once the objects around the call are
collected, and some of them are found only by the cyclic garbage collector.
The collector's own thresholds count new container objects, which a server
that mostly moves bytes makes few of, so the older generations are rarely
examined and that memory piles up under a tenant's rounds of concurrent
maximal calls, past any bound; with a full collection on a clock it levels off
under the server's memory bound (`tiercache.server.limits.memory_bound`).
`freeze`, for a process that is
only the server (`tiercache serve`), takes what exists once it has started
(modules, the store's first contents) out of the collections, so each one
examines only what came since.
"""
from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Sequence

COLLECT_EVERY_S = 1.0

log = logging.getLogger(__name__)


class Collector:
    """Collects on a clock; ``chores`` run on the same clock first (the stores' retention sweeps)."""

    def __init__(self, every_s: float = COLLECT_EVERY_S, chores: Sequence[Callable[[], object]] = ()) -> None:
        self.every_s = every_s
        self.chores = tuple(chores)
        self.collections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-gc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @staticmethod
    def freeze() -> None:
        gc.collect()
        gc.freeze()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for chore in self.chores:
                try:
                    chore()
                except OSError as err:        # a file a sweep could not delete: tried again at the next
                    log.warning("tiercache serve: a periodic sweep failed: %s", err)
            gc.collect()
            self.collections += 1
