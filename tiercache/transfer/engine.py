"""The transfer engine: a priority queue of plans executed by worker threads.

Worker side. Handlers are registered per link ``(source medium, destination
medium)``; a handler moves the bytes of one plan and raises on failure. Any
exception becomes a failed `TransferResult` (logged with the plan's context),
never an exception in the caller. Results are collected by the one thread
that owns the tier indexes (`poll` / `wait`), so completions are applied in
one place.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tiercache.keys import BlockHash
from tiercache.tiers.base import Medium
from tiercache.transfer.plan import JobId, TransferPlan, TransferResult

log = logging.getLogger(__name__)

Handler = Callable[[TransferPlan], "Sequence[BlockHash] | None"]
"""Moves one plan's bytes; returns the keys that failed (None or empty: all moved) or raises (all failed)."""
Link = tuple[Medium, Medium]


@dataclass(slots=True)
class LinkStats:
    jobs: int = 0
    failed: int = 0
    bytes: int = 0
    busy_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        gbps = self.bytes / self.busy_seconds / 1e9 if self.busy_seconds else 0.0
        return {"jobs": self.jobs, "failed": self.failed, "bytes": self.bytes, "gbps": gbps}


class TransferEngine:
    def __init__(self, workers: int = 2, name: str = "tiercache-xfer") -> None:
        self._handlers: dict[Link, Handler] = {}
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._job_ids = itertools.count(1)
        self._stats_lock = threading.Lock()
        self._stats: dict[Link, LinkStats] = defaultdict(LinkStats)
        self._pending: dict[JobId, TransferResult] = {}
        self._submitted: set[JobId] = set()   # submitted, result not yet handed out
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def register(self, src: Medium, dst: Medium, handler: Handler) -> None:
        if (src, dst) in self._handlers:
            raise ValueError(f"a handler for {src.value}→{dst.value} is registered already")
        self._handlers[(src, dst)] = handler

    def has_handler(self, src: Medium, dst: Medium) -> bool:
        return (src, dst) in self._handlers

    def next_job_id(self) -> JobId:
        return JobId(next(self._job_ids))

    def submit(self, plan: TransferPlan) -> JobId:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if plan.link not in self._handlers:
            raise ValueError(f"no transfer handler for {plan.src.value}→{plan.dst.value}")
        self._submitted.add(plan.job_id)
        self._queue.put((plan.priority, next(self._seq), plan))
        return plan.job_id

    def is_submitted(self, job_id: JobId) -> bool:
        return job_id in self._submitted

    def _run(self) -> None:
        while True:
            _, _, plan = self._queue.get()
            if plan is None:
                return
            start = time.perf_counter()
            try:
                failed = tuple(self._handlers[plan.link](plan) or ())
                result = TransferResult(plan, ok=not failed, seconds=time.perf_counter() - start,
                                        error=f"{len(failed)} of {len(plan.chunks)} chunks failed" if failed else None,
                                        failed_keys=failed)
            except Exception as err:  # the boundary: a failed copy is a result, not a crash
                log.warning("transfer job %d %s→%s (%d chunks, %d B) failed: %r",
                            plan.job_id, plan.src.value, plan.dst.value, len(plan.chunks), plan.nbytes, err)
                result = TransferResult(plan, ok=False, seconds=time.perf_counter() - start,
                                        error=repr(err), failed_keys=tuple(plan.keys))
            with self._stats_lock:
                s = self._stats[plan.link]
                s.jobs += 1
                s.failed += not result.ok
                moved = len(plan.chunks) - len(result.failed_keys)
                s.bytes += plan.nbytes * moved // len(plan.chunks) if plan.chunks else 0
                s.busy_seconds += result.seconds
            self._done.put(result)

    def poll(self) -> list[TransferResult]:
        """Results finished since the last call (non-blocking), including any `wait` set aside."""
        out = list(self._pending.values())
        self._pending.clear()
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self._submitted.difference_update(r.job_id for r in out)
                return out

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> list[TransferResult]:
        """Block until every job in ``job_ids`` finished; returns their results and keeps others for `poll`."""
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        got = [self._pending.pop(j) for j in list(wanted) if j in self._pending]
        wanted -= {r.job_id for r in got}
        while wanted:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                result = self._done.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"transfer jobs {sorted(wanted)} did not finish in {timeout}s") from None
            if result.job_id in wanted:
                wanted.discard(result.job_id)
                got.append(result)
            else:
                self._pending[result.job_id] = result
        self._submitted.difference_update(r.job_id for r in got)
        return got

    def stats(self) -> dict[str, dict[str, float]]:
        with self._stats_lock:
            return {f"{s.value}->{d.value}": v.as_dict() for (s, d), v in self._stats.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put((99, next(self._seq), None))
        for t in self._threads:
            t.join()
