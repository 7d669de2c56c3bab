"""The cache manager's jobs: the ids it hands out, every job planned until its outcome is applied, and the
background plans waiting to go to the workers.

Scheduler side, bookkeeping only. `JobBook` is the one owner of this state: the other parts of the manager
plan through it, and `CacheManager.apply` takes a finished job's record from it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum, auto

from tiercache.contracts.groups import ChunkSizes
from tiercache.contracts.jobs import split_jobs
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.medium import Medium, link_name
from tiercache.contracts.plan import DEVICE, ChunkCopy, JobId, Priority, TransferPlan
from tiercache.index.tier_index import TierIndex
from tiercache.tiers.base import LowerIndex


class JobKind(Enum):
    LOAD = auto()        # L1 → L0
    STORE = auto()       # L0 → L1
    PROMOTE = auto()     # lower → L1
    SPILL = auto()       # L1 (evicted) → lower
    COPY_DOWN = auto()   # L1 (still resident) → lower, write-through
    DELETE = auto()      # a lower tier's bytes of chunks that left its index


@dataclass(slots=True)
class InFlightJob:
    """A planned job whose outcome is not applied yet, and the lower tier it reserved (if any)."""
    plan: TransferPlan
    kind: JobKind
    lower: LowerIndex | None = None
    private: bool = False                # a swap copy's store: it never leaves L1
    purged: tuple[BlockHash, ...] = ()   # a copy to a remote tier purged while on its way: deleted once landed


class JobBook:
    """Every job the manager planned and has not applied, and the background plans not yet handed out."""

    def __init__(self, sizes: ChunkSizes, transfer_workers: int) -> None:
        self.sizes = sizes
        self.transfer_workers = transfer_workers   # each rank's transfer threads: a batch to a lower tier is split
        self._job_ids = itertools.count(1)
        self._in_flight: dict[JobId, InFlightJob] = {}
        self._background: list[TransferPlan] = []

    def plan(self, kind: JobKind, src: TierIndex | None, dst: TierIndex | None, priority: Priority,
             chunks: Sequence[ChunkCopy], lower: LowerIndex | None = None, private: bool = False) -> TransferPlan:
        """A plan between two tiers (None: L0) — or, for a delete, from ``src`` to nowhere — recorded as in
        flight. Its bytes are what crosses the link: a lower tier's stored bytes (its codec's, headers included),
        else the raw ones."""
        if lower is not None and kind is not JobKind.DELETE:
            nbytes = sum(lower.reserve_bytes(self.sizes.layout(c.chunk_blocks)) for c in chunks)
        else:
            nbytes = sum(self.sizes.nbytes(c.num_blocks or c.chunk_blocks) for c in chunks)
        src_medium = Medium.DEVICE if src is None else src.medium
        if kind is JobKind.DELETE:
            link, dst_name = link_name(src_medium, None), None
        else:
            link = link_name(src_medium, Medium.DEVICE if dst is None else dst.medium)
            dst_name = DEVICE if dst is None else dst.name
        plan = TransferPlan(JobId(next(self._job_ids)), DEVICE if src is None else src.name, dst_name, link,
                            priority, tuple(chunks), 0 if kind is JobKind.DELETE else nbytes)
        self._in_flight[plan.job_id] = InFlightJob(plan, kind, lower, private)
        return plan

    def plan_background(self, kind: JobKind, src: TierIndex, dst: TierIndex, priority: Priority,
                        chunks: Sequence[ChunkCopy], lower: LowerIndex) -> list[TransferPlan]:
        """Plans of ``chunks`` between L1 and ``lower``, queued for `take_background`: one per transfer worker,
        so the file I/O of one chunk overlaps the checksums and syncs of another — one in all for a tier that
        moves a batch best as one (`LowerIndex.parallel_jobs`: one gRPC stream)."""
        workers = self.transfer_workers if lower.parallel_jobs else 1
        plans = [self.plan(kind, src, dst, priority, part, lower) for part in split_jobs(chunks, workers)]
        self._background += plans
        return plans

    def take_background(self) -> list[TransferPlan]:
        """The background plans queued since the last call."""
        plans, self._background = self._background, []
        return plans

    def finish(self, job_id: JobId) -> InFlightJob | None:
        """The record of job ``job_id``, which leaves the book (None: not in flight, e.g. cancelled already)."""
        return self._in_flight.pop(job_id, None)

    def mark_purged(self, chosen: Callable[[BlockHash, float], bool]) -> None:
        """A purge was applied: copies on their way to a store that keeps no index here delete the keys it
        chooses once they land."""
        for job in self._in_flight.values():
            if job.kind in (JobKind.SPILL, JobKind.COPY_DOWN) and not job.lower.indexed:
                job.purged += tuple(k for k in job.plan.keys if chosen(k, 0.0))

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._in_flight

    def __len__(self) -> int:
        return len(self._in_flight)

    def __iter__(self) -> Iterator[InFlightJob]:
        """The jobs in flight (a snapshot: applying one while iterating is safe)."""
        return iter(list(self._in_flight.values()))
