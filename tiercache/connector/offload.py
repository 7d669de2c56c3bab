"""The tiered-offload connector: `SchedulerConnector` and `WorkerConnector` over one `OffloadStack`.

Scheduler side (`OffloadScheduler`): lookups, load and store planning through
the `CacheManager`, per-request bookkeeping (chunks stored so far, in-flight
stores, swapped-out requests), and applying finished transfers.

Worker side (`OffloadWorker`): submits the step's plans to the transfer
engine, waits for loads before layer 0 reads the cache, submits stores after
the forward, and reports per-request completion and failed loads. A store
owned by a request whose load failed in the same step is cancelled, so KV
computed over missing context is never offloaded.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.build import OffloadStack
from tiercache.connector.api import (
    ConnectorMetadata, ConnectorOutput, RequestView, SchedulerConnector, StepRequest, WorkerConnector,
)
from tiercache.keys import BlockHash, chunk_keys
from tiercache.lookup import PrefixLookup
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.tiers.base import Medium
from tiercache.transfer.engine import LayerProgress
from tiercache.transfer.plan import JobId, TransferPlan, TransferResult


@dataclass(frozen=True, slots=True)
class _Swapped:
    keys: tuple[BlockHash, ...]
    num_blocks: int
    num_tokens: int


@dataclass(slots=True)
class ConnectorCounters:
    lookups: int = 0
    ask_again: int = 0             # lookups answered "ask again" while chunks were promoted
    admitted_tokens: int = 0       # tokens of requests admitted (the denominator of the hit ratio)
    hit_requests: int = 0
    hit_tokens: int = 0            # tokens planned to load from the tiers (beyond L0)
    loaded_tokens: int = 0         # tokens loaded successfully (prefill tokens saved)
    failed_loads: int = 0
    stores_planned: int = 0
    stores_cancelled: int = 0
    swap_outs: int = 0
    swap_ins: int = 0


class OffloadScheduler(SchedulerConnector):
    def __init__(self, stack: OffloadStack, block_size: int, swap_salt: bytes = b"") -> None:
        self.manager = stack.manager
        self.block_size = block_size
        self.bpc = stack.manager.blocks_per_chunk
        self.counters = ConnectorCounters()
        self._swap_salt = swap_salt
        self._lookups: dict[str, tuple[PrefixLookup, _Swapped | None]] = {}
        self._pending_loads: list[TransferPlan] = []
        self._pending_stores: list[TransferPlan] = []
        self._owners: dict[JobId, str] = {}
        self._stored_chunks: dict[str, int] = {}
        self._store_jobs: dict[str, set[JobId]] = defaultdict(set)
        self._swapped: dict[str, _Swapped] = {}
        self._swap_epoch = 0

    # -- lookups and loads ---------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        rid = request.request_id
        computed_blocks = num_computed_tokens // self.block_size
        swapped = self._swapped.get(rid)
        if swapped is not None:
            lookup = self.manager.lookup_chunks(swapped.keys, swapped.num_blocks, computed_blocks)
        else:
            lookup = self.manager.lookup(request.block_hashes, computed_blocks)
        if self.manager.promote(lookup):
            self.counters.ask_again += 1
            return None   # part of the hit is on its way up from a lower tier
        lookup = self.manager.in_l1(lookup)
        available = lookup.num_hit_tokens if swapped is None else min(lookup.num_hit_tokens, swapped.num_tokens)
        # At least one token is computed, so the request gets logits.
        num_new = max(0, min(available, request.num_tokens - 1) - num_computed_tokens)
        self.counters.lookups += 1
        if num_new:
            self._lookups[rid] = (lookup, swapped)
        else:
            self._lookups.pop(rid, None)
        return num_new

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        self.counters.admitted_tokens += request.num_tokens
        self.manager.record_request(chunk_keys(request.block_hashes, self.bpc, self.manager.store_partial_chunks))
        if not num_external_tokens or found is None:
            return
        lookup, swapped = found
        self.counters.hit_requests += 1
        self.counters.hit_tokens += num_external_tokens
        upto = -(-(lookup.num_computed_blocks * self.block_size + num_external_tokens) // self.block_size)
        for plan in self.manager.plan_load(lookup, block_ids, upto_blocks=upto):
            self._pending_loads.append(plan)
            self._owners[plan.job_id] = rid
        if swapped is not None:
            self.counters.swap_ins += 1

    # -- stores --------------------------------------------------------------
    def build_connector_meta(self, step: Sequence[StepRequest]) -> ConnectorMetadata:
        for s in step:
            rid = s.request.request_id
            full_chunks = min(s.num_computed_tokens // self.block_size, len(s.request.block_hashes)) // self.bpc
            done = self._stored_chunks.get(rid, 0)
            if full_chunks <= done:
                continue
            plan = self.manager.plan_store(s.request.block_hashes[:full_chunks * self.bpc], s.block_ids, first_chunk=done)
            self._stored_chunks[rid] = full_chunks
            if plan is not None:
                self._pending_stores.append(plan)
                self._owners[plan.job_id] = rid
                self._store_jobs[rid].add(plan.job_id)
                self.counters.stores_planned += 1
        meta = ConnectorMetadata(tuple(self._pending_loads), tuple(self._pending_stores),
                                 tuple(self.manager.take_background()),
                                 {p.job_id: self._owners[p.job_id] for p in (*self._pending_loads, *self._pending_stores)})
        self._pending_loads, self._pending_stores = [], []
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.manager.apply(output.results)
        for rid in output.finished_recving:   # every load of the request ended: its swap copy is spent
            swapped = self._swapped.pop(rid, None)
            if swapped is not None:
                self._drop_swap(swapped)
        for result in output.results:
            rid = self._owners.pop(result.job_id, None)
            if rid is None:
                continue
            if result.plan.dst is Medium.DEVICE:
                if result.ok:
                    self.counters.loaded_tokens += sum(len(c.block_ids) for c in result.plan.chunks) * self.block_size
                else:
                    self.counters.failed_loads += 1
            else:
                self._store_jobs[rid].discard(result.job_id)
                if not self._store_jobs[rid]:
                    del self._store_jobs[rid]
                if not result.ok and result.error == "cancelled":
                    self.counters.stores_cancelled += 1

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        rid = request.request_id
        self._stored_chunks.pop(rid, None)
        self._lookups.pop(rid, None)
        swapped = self._swapped.pop(rid, None)
        if swapped is not None:
            self._drop_swap(swapped)
        return self.has_pending_stores(rid)

    def request_reset(self, request_id: str) -> None:
        self._stored_chunks.pop(request_id, None)
        self._lookups.pop(request_id, None)

    def has_pending_stores(self, request_id: str) -> bool:
        return bool(self._store_jobs.get(request_id))

    # -- swap ----------------------------------------------------------------
    def _swap_keys(self, request_id: str, num_chunks: int) -> tuple[BlockHash, ...]:
        self._swap_epoch += 1
        base = hashlib.sha256(b"tiercache-swap\0" + self._swap_salt + request_id.encode() + b"\0"
                              + self._swap_epoch.to_bytes(8, "little")).digest()
        return tuple(BlockHash(hashlib.sha256(base + i.to_bytes(4, "little")).digest()) for i in range(num_chunks))

    def swap_out(self, request: RequestView, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        rid = request.request_id
        num_blocks = -(-num_computed_tokens // self.block_size)
        previous = self._swapped.pop(rid, None)
        if previous is not None:  # swapped before and resumed from L0: that copy is stale
            self._drop_swap(previous)
        keys = self._swap_keys(rid, -(-num_blocks // self.bpc))
        plan = self.manager.plan_store_chunks(keys, block_ids, num_blocks)
        if plan is None or len(plan.chunks) < len(keys):  # no room for all of it: recompute instead
            if plan is not None:
                self.manager.cancel(plan)
            return False
        self._swapped[rid] = _Swapped(keys, num_blocks, num_computed_tokens)
        self._stored_chunks.pop(rid, None)
        self._pending_stores.append(plan)
        self._owners[plan.job_id] = rid
        self._store_jobs[rid].add(plan.job_id)
        self.counters.swap_outs += 1
        return True

    def _drop_swap(self, swapped: _Swapped) -> None:
        for tier in self.manager.tiers:
            tier.delete(list(swapped.keys))

    def stats(self) -> dict[str, object]:
        c = self.counters
        return {
            **{k: getattr(c, k) for k in c.__slots__},
            "token_hit_ratio": c.hit_tokens / c.admitted_tokens if c.admitted_tokens else 0.0,
            **self.manager.stats(),
        }


class OffloadWorker(WorkerConnector):
    """Worker side. With ``layerwise`` loads land layer by layer: `wait_for_layer_load(l)` returns as
    soon as layer ``l`` of every load of the step is in place, while later layers are still copying."""

    def __init__(self, stack: OffloadStack, layerwise: bool = True, inline: bool = False) -> None:
        self.engine = stack.engine
        self.layerwise = layerwise and not inline
        self.inline = inline   # L0↔L1 copies on the calling thread (CPU-only machines; see TransferEngine.run_inline)
        self._progress: list[LayerProgress] = []
        self.kv: PagedKVCache | None = None
        self._meta = ConnectorMetadata()
        self._owners: dict[JobId, str] = {}
        self._loads_in_flight: dict[str, set[JobId]] = defaultdict(set)
        self._stores_in_flight: dict[str, set[JobId]] = defaultdict(set)
        self._step_load_jobs: list[JobId] = []
        self._results: list[TransferResult] = []
        self._failed_this_step: set[str] = set()
        self.layerwise_loads = 0   # load jobs that landed layer by layer (waited for per layer)

    def register_kv_caches(self, kv: PagedKVCache) -> None:
        self.kv = kv

    def bind_connector_meta(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        self._owners.update(meta.owners)
        self._failed_this_step = set()

    def start_load_kv(self) -> None:
        self._step_load_jobs = []
        self._progress = []
        for plan in self._meta.background:
            self.engine.submit(plan)
        for plan in self._meta.loads:
            progress = LayerProgress() if self.layerwise else None
            if self.inline:
                self.engine.run_inline(plan)
            else:
                self.engine.submit(plan, progress)
            if progress is not None:
                self._progress.append(progress)
                self.layerwise_loads += 1
            self._loads_in_flight[self._owners[plan.job_id]].add(plan.job_id)
            self._step_load_jobs.append(plan.job_id)

    def wait_for_layer_load(self, layer: int) -> None:
        if self._progress:
            for progress in self._progress:
                progress.wait(layer)
        elif layer == 0:
            self._settle_loads()   # whole-chunk loads complete before the first layer reads the cache

    def _settle_loads(self) -> None:
        """Collect this step's load results; a request whose load failed has its stores cancelled."""
        if not self._step_load_jobs:
            return
        for result in self.engine.wait(self._step_load_jobs):
            if not result.ok:
                self._failed_this_step.add(self._owners[result.job_id])
            self._results.append(result)
        self._step_load_jobs = []
        self._progress = []

    def save_kv_layer(self, layer: int) -> None:
        return None  # stores are whole chunks across all layers, handed over in wait_for_save

    def wait_for_save(self) -> None:
        self._settle_loads()  # every load ended (and failures are known) before any store is handed over
        for plan in self._meta.stores:
            owner = self._owners[plan.job_id]
            if owner in self._failed_this_step:
                self._results.append(TransferResult(plan, ok=False, seconds=0.0, error="cancelled",
                                                    failed_keys=tuple(plan.keys)))
                continue
            if self.inline:
                self.engine.run_inline(plan)
            else:
                self.engine.submit(plan)
            self._stores_in_flight[owner].add(plan.job_id)
        self._meta = ConnectorMetadata()

    def wait_for_stores(self) -> None:
        """Block until every store handed over so far has read its L0 blocks (results stay for `get_finished`).

        For engines that reuse a step's blocks as soon as the step ends (vLLM
        frees a preempted request's blocks at once).
        """
        running = [job for jobs in self._stores_in_flight.values() for job in jobs
                   if job not in {r.job_id for r in self._results}]
        if running:
            self._results += self.engine.wait(running)

    def get_finished(self) -> ConnectorOutput:
        results = self._results + self.engine.poll()
        self._results = []
        sending, recving, failed, failed_blocks = set(), set(), set(), set()
        for r in results:
            owner = self._owners.pop(r.job_id, None)
            if owner is None:
                continue
            if r.plan.dst is Medium.DEVICE:
                jobs, done = self._loads_in_flight, recving
                if not r.ok:
                    failed.add(owner)
                    failed_blocks.update(b for c in r.plan.chunks for b in c.block_ids)
            else:
                jobs, done = self._stores_in_flight, sending
            jobs[owner].discard(r.job_id)
            if not jobs[owner]:
                del jobs[owner]
                done.add(owner)
        return ConnectorOutput(tuple(results), frozenset(sending), frozenset(recving),
                               frozenset(failed), frozenset(failed_blocks))
