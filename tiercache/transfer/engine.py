"""The transfer engine: per-link queues (rate limits, in-flight caps, priorities) served by worker threads.

Worker side, one per rank. Handlers are registered per pair of tiers
``(source tier, destination tier)`` — plans name tiers, not media, so any set
of tiers can be configured together — with ``None`` as the destination of a
delete. A handler moves one plan's bytes and returns the keys that failed,
each with its `Failure` (or raises: every key failed). Any exception becomes a
failed `TransferResult` (logged with the plan's context), never an exception
in the caller. A store the link drops under pressure comes back at once as a
failed result (`Failure.DROPPED`). Results are collected by the worker
connector's thread (`poll` / `wait`), which reports them up.

A load may carry a `LayerProgress`: its handler marks each layer as it lands,
so the engine can compute layer ``l`` while layer ``l + 1`` is still copying.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from tiercache.contracts.plan import Failure, JobId, KeyFailures, LinkLimits, TransferPlan, TransferResult
from tiercache.transfer.links import LinkSet

log = logging.getLogger(__name__)

Route = tuple[str, str | None]   # (source tier, destination tier or None for a delete)


class LayerProgress:
    """Layers of one load that have landed; waiters block until theirs has (or the job ended)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done = 0
        self._ended = False

    def mark(self, layer: int) -> None:
        with self._cond:
            self._done = max(self._done, layer + 1)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ended or self._done > layer, timeout)


Handler = Callable[[TransferPlan, LayerProgress | None], KeyFailures | None]
"""Moves one plan's bytes; returns the keys that failed and why (None or empty: all moved), or raises (all failed)."""


class TransferEngine:
    """Worker side, one per rank: runs plans on its transfer threads, per link."""

    def __init__(self, workers: int = 2, limits: Mapping[str, LinkLimits] | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "tiercache-xfer") -> None:
        self._handlers: dict[Route, Handler] = {}
        self._clock = clock
        self._cond = threading.Condition()
        self._links = LinkSet(dict(limits or {}), clock())
        self._progress: dict[JobId, LayerProgress] = {}
        self._done: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._pending: dict[JobId, TransferResult] = {}
        self._submitted: set[JobId] = set()   # submitted, result not yet handed out
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def num_workers(self) -> int:
        return len(self._threads)

    def register(self, src: str, dst: str | None, handler: Handler) -> None:
        if (src, dst) in self._handlers:
            raise ValueError(f"a handler for {src}→{dst or 'delete'} is registered already")
        self._handlers[(src, dst)] = handler

    def routes(self) -> list[Route]:
        return list(self._handlers)

    def submit(self, plan: TransferPlan, progress: LayerProgress | None = None) -> JobId:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        self._submitted.add(plan.job_id)
        if (plan.src, plan.dst) not in self._handlers:
            self._refuse(plan, progress)
            return plan.job_id
        with self._cond:
            accepted = self._links.offer(plan)
            if accepted:
                if progress is not None:
                    self._progress[plan.job_id] = progress
                self._cond.notify()
        if not accepted:
            if progress is not None:
                progress.end()
            self._done.put(TransferResult(plan, 0.0, tuple((k, Failure.DROPPED) for k in plan.keys), "dropped"))
        return plan.job_id

    def _refuse(self, plan: TransferPlan, progress: LayerProgress | None) -> None:
        """A plan this rank has no handler for (its tiers differ from the scheduler's): a failed result."""
        log.warning("transfer %s: no handler on this rank (tiers here: %s)", plan.describe(),
                    sorted({name for route in self._handlers for name in route if name}))
        if progress is not None:
            progress.end()
        self._done.put(TransferResult(plan, 0.0, tuple((k, Failure.IO) for k in plan.keys), "no handler"))

    def is_submitted(self, job_id: JobId) -> bool:
        return job_id in self._submitted

    def _next(self) -> tuple[TransferPlan, LayerProgress | None] | None:
        with self._cond:
            while True:
                if self._closed and not self._links.queued():
                    return None
                plan, wait = self._links.next_job(self._clock())
                if plan is not None:
                    return plan, self._progress.pop(plan.job_id, None)
                self._cond.wait(timeout=wait)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            plan, progress = job
            result = self._execute(plan, progress)
            with self._cond:
                self._links.link(plan.link).finish(plan, result.ok, self._moved(plan, result),
                                                   result.seconds, self._clock())
                self._cond.notify_all()
            self._done.put(result)

    @staticmethod
    def _moved(plan: TransferPlan, result: TransferResult) -> int:
        return plan.nbytes * (len(plan.chunks) - len(result.failed)) // max(1, len(plan.chunks))

    def _execute(self, plan: TransferPlan, progress: LayerProgress | None) -> TransferResult:
        start = time.perf_counter()
        try:
            failed = tuple(self._handlers[(plan.src, plan.dst)](plan, progress) or ())
            result = TransferResult(plan, time.perf_counter() - start, failed,
                                    f"{len(failed)} of {len(plan.chunks)} chunks failed" if failed else None)
        except Exception as err:  # the boundary: a failed copy is a result, not a crash
            log.warning("transfer %s failed: %r", plan.describe(), err)
            why = Failure.TIMEOUT if isinstance(err, TimeoutError) else Failure.IO
            result = TransferResult(plan, time.perf_counter() - start, tuple((k, why) for k in plan.keys), repr(err))
        if progress is not None:
            progress.end()
        return result

    def run_inline(self, plan: TransferPlan) -> JobId:
        """Run ``plan`` now, on the calling thread; its result is collected like any other.

        For host-memory copies on a machine without a GPU: there a copy is CPU
        work either way, and on a worker thread torch runs it in a second
        OpenMP team that spins on the cores the forward needs. Link limits do
        not apply (the caller decided to pay for the copy now); link stats do.
        """
        self._submitted.add(plan.job_id)
        if (plan.src, plan.dst) not in self._handlers:
            self._refuse(plan, None)
            return plan.job_id
        link = self._links.link(plan.link)
        with self._cond:
            link.in_flight_bytes += plan.nbytes
            link.in_flight_jobs += 1
            if link.stats.first_start is None:
                link.stats.first_start = self._clock()
        result = self._execute(plan, None)
        with self._cond:
            link.finish(plan, result.ok, self._moved(plan, result), result.seconds, self._clock())
        self._done.put(result)
        return plan.job_id

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

    def wait_any(self, timeout: float) -> None:
        """Block until some result is ready for `poll`, or ``timeout`` seconds passed."""
        if self._pending:
            return
        try:
            result = self._done.get(timeout=timeout)
        except queue.Empty:
            return
        self._pending[result.job_id] = result

    def pending_jobs(self) -> list[JobId]:
        """Jobs submitted whose results have not been handed out yet."""
        return list(self._submitted)

    @property
    def num_submitted(self) -> int:
        """Jobs submitted whose results have not been handed out yet."""
        return len(self._submitted)

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
        with self._cond:
            return {name: link.as_dict() for name, link in self._links.links.items()}

    def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
