"""The tiered-offload connector's worker side: `OffloadWorker` (one per rank).

Owns the rank's bytes (through its `WorkerStack`: L1 slab, transports,
transfer engine) and makes no decisions: it runs the plans of each step's
`ConnectorMetadata` and reports, per job, which keys failed and why.

- Loads start in `start_load_kv`; with ``layerwise`` they land layer by
  layer and `wait_for_layer_load(l)` returns once layer ``l`` of every load
  of the step is in place, while later layers still copy.
- Stores are handed over in `wait_for_save`, after every load of the step
  has ended: a store owned by a request whose load failed on this rank is
  cancelled, so KV computed over missing context is never offloaded (other
  ranks may have stored theirs; the job fails as a whole).
- Copies between L0 and L1 either run inline on the engine's thread
  (``inline``: a CPU pool, where a copy is CPU work either way) and so
  complete within their step, or on transfer threads; then a store may
  outlive its step, a finished request's blocks are kept until this rank
  reports it in ``finished_sending`` (the scheduler names such requests in
  ``delayed``), and `handle_preemptions` waits for the stores of requests
  whose blocks the engine takes back.
- At a clean shutdown (`close`) the rank writes the chunks only its L1 holds
  to the write-back tier, as the `WriteBackOrder`s that came with its plans
  say (within ``cpu.shutdown_write_down`` seconds), so a restart finds them.
"""
from __future__ import annotations

import logging
import time

from tiercache.build import L1, WorkerStack, build_worker_side, check_config
from tiercache.config import TierCacheConfig
from tiercache.connector.api import WorkerConnector
from tiercache.contracts.connector import ConnectorMetadata, WorkerHandshake, WorkerReport
from tiercache.contracts.jobs import JobsByOwner, split_jobs
from tiercache.contracts.keys import BlockHash, KVShard, Namespace
from tiercache.contracts.plan import DEVICE, ChunkCopy, Failure, JobId, Priority, TransferPlan, TransferResult
from tiercache.pool.group_pages import GroupPagesKV
from tiercache.transfer.engine import LayerProgress

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.010   # a step with no forward waits up to this long for background results (no busy stepping)
WRITE_DOWN_JOB = JobId(0)   # the rank's shutdown write-down: job ids 0, -1, … (the scheduler's start at 1)


class OffloadWorker(WorkerConnector):
    """The worker side of the connector (one per rank): executes plans on this rank's bytes, reports per job."""

    def __init__(self, config: TierCacheConfig, namespace: Namespace, shard: KVShard) -> None:
        check_config(config)
        self.config = config
        self.namespace = namespace
        self.shard = shard
        self.stack: WorkerStack | None = None
        self.layerwise = False
        self.inline = False
        self.stores_in_step = False   # stores run on the engine's thread within their step
        self._progress: list[LayerProgress] = []
        self._meta = ConnectorMetadata()
        self._owners: dict[JobId, str] = {}
        self._stores_in_flight = JobsByOwner()   # per request: stores handed to the transfer threads, not ended
        self._delayed: set[str] = set()
        self._step_load_jobs: list[JobId] = []
        self._results: list[TransferResult] = []
        self._failed_this_step: set[str] = set()
        self._reported_links: dict[str, dict[str, float]] = {}
        self._reported_layerwise = 0
        self.layerwise_loads = 0   # load jobs that landed layer by layer (waited for per layer)
        self.load_seconds = 0.0    # the step's time spent loading into the pool (inline) or waiting for loads
        self._reports_sent = 0
        # the shutdown write-down (`WriteBackOrder`): where to, chunks named for it whose job has not ended on
        # this rank, and the L1 slots holding such a chunk on this rank
        self._write_back: tuple[str, str] | None = None
        self._write_down_candidates: set[BlockHash] = set()
        self._only_in_l1: dict[int, ChunkCopy] = {}

    @property
    def rank(self) -> int:
        return self.shard.rank

    def register_kv_caches(self, kv) -> WorkerHandshake:
        inline = self.config.transfer.inline_host_copies
        self.inline = inline == "on" or (inline == "auto" and kv.device.type == "cpu")
        self.layerwise = self.config.transfer.layerwise and not self.inline
        # the engine takes a window's blocks back as it slides, and moves a state on, at the next step
        self.stores_in_step = self.inline or (isinstance(kv, GroupPagesKV) and kv.groups.has_resume_points)
        if self.stack is not None:
            self.stack.close()
        self.stack = build_worker_side(self.config, kv, self.namespace, self.shard, copies_in_step=self.inline)
        return self.stack.handshake

    @property
    def _engine(self):
        assert self.stack is not None, "register_kv_caches first"
        return self.stack.engine

    def handle_preemptions(self, meta: ConnectorMetadata) -> None:
        """Before the step's forward: the engine took back the blocks of ``meta.preempted``; wait until no
        store of theirs still reads them on this rank."""
        running = [job for rid in meta.preempted for job in self._stores_in_flight.of(rid)]
        if running:
            self._results += self._engine.wait(running)
            for rid in meta.preempted:
                self._stores_in_flight.forget(rid)

    def bind_connector_meta(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        self._owners.update(meta.owners)
        self._delayed.update(meta.delayed)
        self._failed_this_step = set()
        order = meta.write_back
        if order is not None:
            self._write_back = (order.tier, order.link)
            for slot in order.freed_slots:              # before this step's jobs, which may reuse these slots
                self._only_in_l1.pop(slot, None)
            self._write_down_candidates |= order.unwritten

    def _note_l1_arrivals(self, results: list[TransferResult]) -> None:
        """Chunks named for the write-down that reached this rank's L1: their slots are written down at close."""
        if not self._write_down_candidates:
            return
        for r in results:
            if r.plan.dst != L1:
                continue
            failed = {key for key, _ in r.failed}
            for c in r.plan.chunks:
                if c.key in self._write_down_candidates:
                    self._write_down_candidates.discard(c.key)
                    if c.key not in failed:
                        self._only_in_l1[c.slot] = ChunkCopy(c.key, c.slot, (), c.chunk_blocks, parent=c.parent,
                                                             stored_at=c.stored_at)

    def start_load_kv(self) -> None:
        engine = self._engine
        self._step_load_jobs = []
        self._progress = []
        for plan in self._meta.background:
            engine.submit(plan)
        began = time.perf_counter()
        for plan in self._meta.loads:
            progress = LayerProgress() if self.layerwise else None
            if self.inline:
                engine.run_inline(plan)
            else:
                engine.submit(plan, progress)
            if progress is not None:
                self._progress.append(progress)
                self.layerwise_loads += 1
            self._step_load_jobs.append(plan.job_id)
        if self._meta.loads:
            self.load_seconds += time.perf_counter() - began

    def wait_for_layer_load(self, layer: int) -> None:
        if self._progress:
            began = time.perf_counter()
            for progress in self._progress:
                progress.wait(layer)
            self.load_seconds += time.perf_counter() - began
        elif layer == 0:
            self.settle_loads()   # whole-chunk loads complete before the first layer reads the cache

    def settle_loads(self) -> None:
        """Wait until this step's loads have landed, every layer, and collect their results; a request whose
        load failed has its stores cancelled. (An engine that moves blocks after the loads calls it too.)"""
        if not self._step_load_jobs:
            return
        began = time.perf_counter()
        results = self._engine.wait(self._step_load_jobs)
        self.load_seconds += time.perf_counter() - began
        for result in results:
            if not result.ok:
                self._failed_this_step.add(self._owners[result.job_id])
            self._results.append(result)
        self._step_load_jobs = []
        self._progress = []

    def save_kv_layer(self, layer: int) -> None:
        return None  # stores are whole chunks across all layers, handed over in wait_for_save

    def wait_for_save(self) -> None:
        self.settle_loads()  # every load ended (and failures are known) before any store is handed over
        engine = self._engine
        for plan in self._meta.stores:
            owner = self._owners[plan.job_id]
            if owner in self._failed_this_step:
                self._results.append(TransferResult(plan, 0.0, tuple((k, Failure.CANCELLED) for k in plan.keys),
                                                    "cancelled: the request's load failed"))
                continue
            if self.stores_in_step:
                engine.run_inline(plan)
            else:
                engine.submit(plan)
                self._stores_in_flight.add(owner, plan.job_id)
        self._meta = ConnectorMetadata()

    def get_finished(self, idle: bool = False) -> WorkerReport:
        """What finished on this rank since the last call. On an ``idle`` step (nothing computed) with
        background work still running, wait a moment for it rather than have the engine spin."""
        engine = self._engine
        if idle:   # nothing else to do this step: give running promotions a moment to land, so the request
            deadline = time.monotonic() + IDLE_WAIT_S           # that waits for them is served next step
            while engine.num_submitted and (left := deadline - time.monotonic()) > 0:
                engine.wait_any(left)
                self._results += engine.poll()
        results = self._results + engine.poll()
        self._results = []
        self._note_l1_arrivals(results)
        failed_loads: set[str] = set()
        failed_blocks: set[int] = set()
        for r in results:
            owner = self._owners.pop(r.job_id, None)
            if owner is None:
                continue
            if r.plan.dst == DEVICE:
                if not r.ok:
                    failed_loads.add(owner)
                    bad = {key for key, _ in r.failed}
                    failed_blocks.update(b for c in r.plan.chunks if c.key in bad for b in c.engine_blocks())
            else:
                self._stores_in_flight.finish(owner, r.job_id)
        sending = frozenset(rid for rid in self._delayed if rid not in self._stores_in_flight)
        self._delayed -= sending
        self._reports_sent += 1
        return WorkerReport(self.rank, tuple(r.report(self.rank) for r in results), sending,
                            frozenset(failed_loads), frozenset(failed_blocks), self._link_deltas(),
                            self._reports_sent)

    def _link_deltas(self) -> dict[str, int]:
        """Bytes, jobs and failures per link since the last report (summed over ranks by the engine)."""
        out: dict[str, int] = {}
        if self.layerwise_loads > self._reported_layerwise:
            out["layerwise_loads"] = self.layerwise_loads - self._reported_layerwise
            self._reported_layerwise = self.layerwise_loads
        for name, now in self._engine.stats().items():
            before = self._reported_links.get(name, {})
            for field in ("bytes", "jobs", "failed", "dropped"):
                delta = int(now[field] - before.get(field, 0))
                if delta:
                    out[f"link/{name}/{field}"] = delta
            self._reported_links[name] = now
        return out

    def stats(self) -> dict[str, object]:
        return {"rank": self.rank, "transfers": self._engine.stats(), "stores_in_flight": len(self._stores_in_flight),
                "load_seconds": self.load_seconds}

    def wait_until_idle(self, timeout: float = 60.0) -> None:
        """Block until every job handed to this rank's engine has finished (results stay for `get_finished`)."""
        engine = self._engine
        pending = engine.pending_jobs()
        if pending:
            self._results += engine.wait(pending, timeout)

    def close(self, write_down_s: float | None = None) -> None:
        """Write down what only this rank's L1 holds (see the module docstring) within ``write_down_s``
        seconds (default ``cpu.shutdown_write_down``), then stop every thread."""
        if self.stack is not None:
            try:
                self._write_down(self.config.cpu.shutdown_write_down if write_down_s is None else write_down_s)
            finally:
                self.stack.close()
                self.stack = None

    def _write_down(self, budget: float) -> None:
        stack = self.stack
        if self._write_back is None or budget <= 0 or not stack.handshake.writer:
            return
        deadline = time.monotonic() + budget
        try:
            self.wait_until_idle(budget)     # stores still running may bring more; their results count
        except TimeoutError:
            log.warning("tiercache rank %d: transfers still running at shutdown after %.1f s; writing down "
                        "what L1 holds so far", self.rank, budget)
        self._note_l1_arrivals(self._results)
        self._results = []
        chunks = sorted(self._only_in_l1.values(), key=lambda c: c.slot)
        if not chunks:
            return
        tier, link = self._write_back
        parts = split_jobs(chunks, self.config.transfer.workers)
        plans = [TransferPlan(JobId(WRITE_DOWN_JOB - i), L1, tier, link, Priority.STORE, tuple(part),
                              sum(stack.handshake.chunk_bytes(c.chunk_blocks) for c in part)) for i, part in
                 enumerate(parts)]
        start = time.monotonic()
        for plan in plans:
            stack.engine.submit(plan)
        try:
            results = stack.engine.wait([p.job_id for p in plans], max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("tiercache rank %d: the shutdown write-down of %d chunks to %s did not finish within "
                        "its %.1f s; a restart will not find some of them", self.rank,
                        len(chunks), tier, budget)
            return
        failed = sum(len(r.failed) for r in results)
        nbytes = sum(p.nbytes for p in plans)
        log.info("tiercache rank %d: wrote %d chunks (%.1f MiB) only L1 held to %s at shutdown in %.2f s%s",
                 self.rank, len(chunks) - failed, nbytes / (1 << 20), tier, time.monotonic() - start,
                 f"; {failed} failed" if failed else "")

