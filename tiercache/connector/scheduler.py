"""The tiered-offload connector's scheduler side: `OffloadScheduler` (one per engine).

Lookups, load and store planning through the `CacheManager`, per-request
bookkeeping (chunks stored so far, in-flight stores, swapped-out requests),
and applying finished jobs. It owns every index and every decision and
touches no bytes: its plans go down to every rank in `ConnectorMetadata`, and
each rank's `JobReport`s come back up; a job is applied once every rank has
reported it, as one `JobOutcome` (a key that failed on any rank failed, so
its chunk is a miss and the engine recomputes it).

The indexes need to know what the ranks have (their L1 slots, their block
size in bytes, their storage digests, what their disks hold), so they are
built in `attach`, from every rank's `WorkerHandshake`; until then every
lookup is a miss.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.arith import ceil_div
from tiercache.build import build_scheduler_side, check_config
from tiercache.config import TierCacheConfig
from tiercache.connector.api import SchedulerConnector
from tiercache.contracts.connector import (
    ConnectorMetadata,
    RequestState,
    RequestView,
    StepRequest,
    WorkerHandshake,
)
from tiercache.contracts.jobs import JobsByOwner
from tiercache.contracts.keys import BlockHash, chunk_keys
from tiercache.contracts.plan import Failure, JobId, JobOutcome, JobReport, TransferPlan
from tiercache.lookup import PrefixLookup
from tiercache.manager import CacheManager

IDLE_WAIT_S = 0.010   # a step with nothing to compute waits up to this long for a remote lookup's answer


@dataclass(frozen=True, slots=True)
class _Swapped:
    keys: tuple[BlockHash, ...]
    num_blocks: int
    num_tokens: int


@dataclass(slots=True)
class ConnectorCounters:
    lookups: int = 0
    ask_again: int = 0             # lookups answered "ask again" while chunks were promoted or looked up
    admitted_tokens: int = 0       # tokens of requests admitted (the denominator of the hit ratio)
    hit_requests: int = 0
    hit_tokens: int = 0            # tokens planned to load from the tiers (beyond L0)
    loaded_tokens: int = 0         # tokens loaded successfully on every rank (prefill tokens saved)
    failed_loads: int = 0          # load jobs that failed on some rank (their tokens were recomputed)
    stores_planned: int = 0
    stores_cancelled: int = 0
    tail_stores: int = 0           # finished requests whose partial last chunk was stored (keys.partial_chunks)
    delayed_frees: int = 0         # finished or preempted requests whose blocks waited for their stores
    swap_outs: int = 0
    swap_ins: int = 0


class JobTracker:
    """Each job's reports, until every rank has sent one; then the job's merged outcome. A rank's report of a
    job counts once, however often it is delivered."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._reports: dict[JobId, dict[int, JobReport]] = {}

    def add(self, reports: Sequence[JobReport]) -> list[JobOutcome]:
        done = []
        for report in reports:
            by_rank = self._reports.setdefault(report.job_id, {})
            by_rank[report.rank] = report
            if len(by_rank) == self.num_ranks:
                done.append(JobOutcome.merge(report.job_id, list(self._reports.pop(report.job_id).values())))
        return done

    @property
    def num_waiting(self) -> int:
        return len(self._reports)


class OffloadScheduler(SchedulerConnector):
    """The scheduler side of the connector (one per engine: vLLM's engine core): indexes and plans, no bytes."""

    def __init__(self, config: TierCacheConfig, block_size: int, swap_salt: bytes = b"") -> None:
        check_config(config)
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.keys.blocks_per_chunk
        self.counters = ConnectorCounters()
        self.manager: CacheManager | None = None
        self.copies_in_step = False
        self._tracker = JobTracker(1)
        self._swap_salt = swap_salt
        self._lookups: dict[str, tuple[PrefixLookup, _Swapped | None]] = {}
        self._asking: dict[str, tuple[RequestView, int]] = {}   # told "ask again", not admitted since
        self._pending_loads: list[TransferPlan] = []
        self._pending_stores: list[TransferPlan] = []
        self._owners: dict[JobId, str] = {}
        self._load_tokens: dict[JobId, int] = {}
        self._stored_chunks: dict[str, int] = {}
        self._partial_chunk_stores = config.keys.partial_chunks    # which finished requests store their partial
                                                                   # last chunk: "all", "continuing" or "off"
        self._chunks: dict[str, tuple[BlockHash, ...]] = {}    # admitted requests' chunk keys, for hints
        self._junctions: dict[str, int] = {}   # chunks the tiers held of a request when it looked up
        self._store_jobs = JobsByOwner()
        self._delayed: list[str] = []
        self._swapped: dict[str, _Swapped] = {}
        self._swap_epoch = 0

    def attach(self, handshakes: Sequence[WorkerHandshake]) -> None:
        """Every rank has registered its KV: build the indexes over what they have."""
        if self.manager is not None:
            self.close()
        self.manager = build_scheduler_side(self.config, handshakes)
        self._tracker = JobTracker(len(handshakes))
        self.copies_in_step = all(h.copies_in_step for h in handshakes)

    @property
    def num_ranks(self) -> int:
        return self._tracker.num_ranks

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()

    # -- lookups and loads ---------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        manager = self.manager
        if manager is None:
            return 0
        rid = request.request_id
        lookup, swapped = self._lookup(request, num_computed_tokens)
        if manager.promote(lookup) or lookup.pending:
            self.counters.ask_again += 1
            self._asking[rid] = (request, num_computed_tokens)
            return None   # part of the hit is on its way up from a lower tier, or still being looked up
        self._asking.pop(rid, None)
        self._junctions[rid] = max(lookup.found_blocks, lookup.num_hit_blocks) // self.blocks_per_chunk
        lookup = manager.in_l1(lookup)
        available = lookup.num_hit_tokens if swapped is None else min(lookup.num_hit_tokens, swapped.num_tokens)
        # At least one token is computed, so the request gets logits.
        num_new = max(0, min(available, request.num_tokens - 1) - num_computed_tokens)
        self.counters.lookups += 1
        if num_new:
            self._lookups[rid] = (lookup, swapped)
        else:
            self._lookups.pop(rid, None)
        return num_new

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        manager = self.manager
        if manager is None:
            return
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        self.counters.admitted_tokens += request.num_tokens
        keys = self._chunks[rid] = self._chunk_keys(request)
        manager.record_request(keys)
        manager.request_state(keys, RequestState.RUNNING)
        if not num_external_tokens or found is None:
            return
        lookup, swapped = found
        self.counters.hit_requests += 1
        self.counters.hit_tokens += num_external_tokens
        upto = ceil_div(lookup.num_computed_blocks * self.block_size + num_external_tokens, self.block_size)
        for plan in manager.plan_load(lookup, block_ids, upto_blocks=upto, group_tables=group_block_ids):
            self._pending_loads.append(plan)
            self._owners[plan.job_id] = rid
            self._load_tokens[plan.job_id] = sum(c.num_blocks for c in plan.chunks) * self.block_size
        if swapped is not None:
            self.counters.swap_ins += 1

    # -- stores --------------------------------------------------------------
    def build_connector_meta(self, step: Sequence[StepRequest], preempted: Sequence[str] = ()) -> ConnectorMetadata:
        manager = self.manager
        if manager is None:
            return ConnectorMetadata(preempted=tuple(preempted))
        if not step and self._asking:
            self._ask_again_now()
        for rid in preempted:                  # an engine that names its preemptions here (vLLM)
            self._hint(rid, RequestState.PREEMPTED)
        for s in step:
            self._store_new_chunks(s)
        owners = {p.job_id: self._owners[p.job_id] for p in (*self._pending_loads, *self._pending_stores)}
        meta = ConnectorMetadata(tuple(self._pending_loads), tuple(self._pending_stores),
                                 tuple(manager.take_background()), owners, tuple(self._delayed), tuple(preempted),
                                 manager.take_write_back())
        self._pending_loads, self._pending_stores, self._delayed = [], [], []
        return meta

    def _store_new_chunks(self, s: StepRequest) -> None:
        """Plan storing the whole chunks a request computed this step (those not stored before)."""
        rid = s.request.request_id
        blocks_per_chunk = self.blocks_per_chunk
        full_chunks = min(s.num_computed_tokens // self.block_size, len(s.request.block_hashes)) // blocks_per_chunk
        done = self._stored_chunks.get(rid, 0)
        if full_chunks <= done:
            return
        end_blocks = full_chunks * blocks_per_chunk
        plan = self.manager.plan_store(s.request.block_hashes[:end_blocks], s.block_ids, first_chunk=done,
                                       group_tables=s.group_block_ids,
                                       points=self._resume_points(rid, done, full_chunks, end_blocks,
                                                                  s.num_computed_tokens))
        self._stored_chunks[rid] = full_chunks
        if plan is not None:
            self._add_store(rid, plan)

    def _ask_again_now(self) -> None:
        """Nothing is computed this step and requests wait for a lookup: rather than have the engine come
        straight back (and, in one process, spin on the GIL the lookup threads need), wait up to
        ``IDLE_WAIT_S`` for an answer, then start the promotions it allows — in this step, so that the
        request is served one step sooner."""
        manager = self.manager
        for tier in manager.tiers:
            tier.wait_for_answer(IDLE_WAIT_S)
        for request, num_computed_tokens in list(self._asking.values()):
            manager.promote(self._lookup(request, num_computed_tokens)[0])

    def _lookup(self, request: RequestView, num_computed_tokens: int) -> tuple[PrefixLookup, _Swapped | None]:
        """The request's chunks after the blocks it has, found in any tier (a swapped-out request's swap copy).
        A hit that must end at a resume point is looked up short of the last token, which is computed."""
        computed_blocks = num_computed_tokens // self.block_size
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            return self.manager.lookup_chunks(swapped.keys, swapped.num_blocks, computed_blocks), swapped
        hashes = request.block_hashes
        if self.manager.sizes.has_resume_points:
            hashes = hashes[:(request.num_tokens - 1) // self.block_size]
        return self.manager.lookup(hashes, computed_blocks), None

    def _resume_points(self, request_id: str, first_chunk: int, end_chunk: int, end_blocks: int,
                       state_at: int) -> tuple[int, ...]:
        """Which of chunks ``first_chunk .. end_chunk - 1`` (the last ending at block ``end_blocks``) get their
        resume point stored too, the engine's recurrent state standing after ``state_at`` tokens
        (``keys.resume_points``): a state only where it stands; a window at every chunk's end, or at the last
        one's and where the request parted from the prefix the tiers held (``junctions``)."""
        sizes = self.manager.sizes
        if not sizes.has_resume_points or end_chunk <= first_chunk:
            return ()
        if sizes.exact_points:
            return (end_chunk - 1,) if end_blocks * self.block_size == state_at else ()
        if self.config.keys.resume_points == "every-chunk":
            return tuple(range(first_chunk, end_chunk))
        junction = self._junctions.get(request_id, 0) - 1
        return (junction, end_chunk - 1) if first_chunk <= junction < end_chunk - 1 else (end_chunk - 1,)

    def _add_store(self, rid: str, plan: TransferPlan) -> None:
        self._pending_stores.append(plan)
        self._owners[plan.job_id] = rid
        self._store_jobs.add(rid, plan.job_id)
        self.counters.stores_planned += 1

    def update_connector_output(self, jobs: Sequence[JobReport]) -> list[JobOutcome]:
        """Collect the ranks' reports; jobs every rank has reported are applied, and returned."""
        manager = self.manager
        if manager is None:
            return []
        outcomes = self._tracker.add([job for job in jobs if manager.in_flight(job.job_id)])   # not: replayed
        manager.apply(outcomes)
        for outcome in outcomes:
            rid = self._owners.pop(outcome.job_id, None)
            if rid is None:
                continue
            tokens = self._load_tokens.pop(outcome.job_id, None)
            if tokens is not None:   # a load into L0
                if outcome.ok:
                    self.counters.loaded_tokens += tokens
                else:
                    self.counters.failed_loads += 1
                    self._stored_chunks.pop(rid, None)   # what it computed over missing context was not stored
                swapped = self._swapped.pop(rid, None)   # a swap copy is spent once loaded (or not)
                if swapped is not None:
                    self._drop_swap(swapped)
            else:
                self._store_jobs.finish(rid, outcome.job_id)
                if Failure.CANCELLED in outcome.failed.values():
                    self.counters.stores_cancelled += 1
        return outcomes

    def request_finished(self, request: RequestView, block_ids: Sequence[int],
                         group_block_ids: Sequence[Sequence[int]] = ()) -> bool:
        rid = request.request_id
        if self.manager is not None and rid in self._chunks:
            self._store_tail(request, block_ids, group_block_ids)
            self._chunks[rid] = self._chunk_keys(request)         # its generated tokens' chunks too
            self._hint(rid, RequestState.CONTINUES if request.continues else RequestState.FINISHED)
        self._chunks.pop(rid, None)
        self._stored_chunks.pop(rid, None)
        self._lookups.pop(rid, None)
        self._asking.pop(rid, None)
        self._junctions.pop(rid, None)
        swapped = self._swapped.pop(rid, None)
        if swapped is not None:
            self._drop_swap(swapped)
        return self._keep_blocks(rid)

    def _store_tail(self, request: RequestView, block_ids: Sequence[int],
                    group_block_ids: Sequence[Sequence[int]]) -> None:
        """Store what a finished request computed past its last whole chunk (``keys.partial_chunks``: every
        request's, or only those that continue — a session's, or said to) — the next turn of a conversation,
        sent to any replica that reads the same tiers, finds it there (`PrefixFinder.lookup_chunks`) rather
        than computing it again. Only blocks the engine has computed: the last sampled token never was, and
        an aborted prefill stopped short."""
        if not self._stores_tail(request):
            return
        rid = request.request_id
        computed = min(request.num_computed_tokens, request.num_tokens - 1)
        blocks = min(computed // self.block_size, len(request.block_hashes),
                     *(len(table) for table in (group_block_ids or (block_ids,))))
        done = self._stored_chunks.get(rid, 0)
        if blocks <= done * self.blocks_per_chunk:
            return
        points = self._resume_points(rid, done, ceil_div(blocks, self.blocks_per_chunk), blocks,
                                     request.num_computed_tokens)
        plan = self.manager.plan_store(request.block_hashes[:blocks], block_ids, first_chunk=done,
                                       group_tables=group_block_ids, points=points)
        if plan is not None:
            self._add_store(rid, plan)
            self.counters.tail_stores += 1

    def _stores_tail(self, request: RequestView) -> bool:
        which = self._partial_chunk_stores
        return which == "all" or (which == "continuing" and request.continues)

    def request_preempted(self, request_id: str) -> bool:
        self._hint(request_id, RequestState.PREEMPTED)
        return self._keep_blocks(request_id)

    def _chunk_keys(self, request: RequestView) -> tuple[BlockHash, ...]:
        return tuple(chunk_keys(request.block_hashes, self.blocks_per_chunk, self.manager.partial_chunks))

    def _hint(self, request_id: str, state: RequestState) -> None:
        """Tell the policies where an admitted request stands (`RequestState`), by its chunk keys."""
        keys = self._chunks.get(request_id)
        if keys and self.manager is not None:
            self.manager.request_state(keys, state)

    def _keep_blocks(self, request_id: str) -> bool:
        """Whether the engine must keep the request's blocks for its stores; if so, the workers are told
        (``delayed``) to say when theirs are done."""
        delay = self.has_pending_stores(request_id)
        if delay:
            self._delayed.append(request_id)
            self.counters.delayed_frees += 1
        return delay

    def stored_tokens(self, request_id: str) -> int:
        return self._stored_chunks.get(request_id, 0) * self.blocks_per_chunk * self.block_size

    def request_reset(self, request_id: str) -> None:
        self._junctions.pop(request_id, None)
        self._stored_chunks.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self._asking.pop(request_id, None)

    def has_pending_stores(self, request_id: str) -> bool:
        """True while a store planned for the request may still read its blocks on some rank: one not yet
        handed to the workers (a swap-out planned at preemption runs at the end of this step), or one handed
        over that may outlive its step — when every rank copies L0 ↔ L1 within the step
        (`WorkerHandshake.copies_in_step`), none does."""
        jobs = self._store_jobs.of(request_id)
        if not jobs:
            return False
        return not self.copies_in_step or any(p.job_id in jobs for p in self._pending_stores)

    # -- swap ----------------------------------------------------------------
    def _swap_keys(self, request_id: str, num_chunks: int) -> tuple[BlockHash, ...]:
        self._swap_epoch += 1
        base = hashlib.sha256(b"tiercache-swap\0" + self._swap_salt + request_id.encode() + b"\0"
                              + self._swap_epoch.to_bytes(8, "little")).digest()
        return tuple(BlockHash(hashlib.sha256(base + i.to_bytes(4, "little")).digest()) for i in range(num_chunks))

    def swap_out(self, request: RequestView, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        manager = self.manager
        if manager is None:
            return False
        rid = request.request_id
        num_blocks = ceil_div(num_computed_tokens, self.block_size)
        previous = self._swapped.pop(rid, None)
        if previous is not None:  # swapped before and resumed from L0: that copy is stale
            self._drop_swap(previous)
        keys = self._swap_keys(rid, ceil_div(num_blocks, self.blocks_per_chunk))
        plan = manager.plan_store_chunks(keys, block_ids, num_blocks, private=True)
        if plan is None or len(plan.chunks) < len(keys):  # no room for all of it: recompute instead
            if plan is not None:
                manager.cancel(plan)
            return False
        self._swapped[rid] = _Swapped(keys, num_blocks, num_computed_tokens)
        self._stored_chunks.pop(rid, None)
        self._add_store(rid, plan)
        self.counters.swap_outs += 1
        return True

    def _drop_swap(self, swapped: _Swapped) -> None:
        if self.manager is not None:
            self.manager.l1.delete(list(swapped.keys))   # a swap copy lives in L1 only

    def stats(self) -> dict[str, object]:
        c = self.counters
        out: dict[str, object] = {
            **{k: getattr(c, k) for k in c.__slots__},
            "token_hit_ratio": c.hit_tokens / c.admitted_tokens if c.admitted_tokens else 0.0,
            "ranks": self.num_ranks,
            "jobs_waiting_for_ranks": self._tracker.num_waiting,
        }
        if self.manager is not None:
            out.update(self.manager.stats())
        return out
