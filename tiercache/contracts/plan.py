"""The plain data that crosses between the two sides: plans down, per-rank job reports up (docs/architecture.md).

A `TransferPlan` is made by the scheduler side (`tiercache.manager`) and run
by every rank's worker side (`tiercache.transfer.engine`). Plans name tiers,
not media: ``src`` and ``dst`` are tier names (`DEVICE` for the engine's L0),
so any set of tiers can be configured together; ``dst=None`` deletes the
chunks from ``src``. Each rank answers a plan with one `JobReport` naming,
for every key that did not move, why (`Failure`). The scheduler side merges
the reports of every rank into one `JobOutcome` before it touches an index:
a key that failed on any rank failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import NewType

from tiercache.contracts.groups import GroupBlocks
from tiercache.contracts.keys import BlockHash

JobId = NewType("JobId", int)

DEVICE = "device"   # the engine's L0 pool, as a plan's source or destination


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """One physical link's limits, set in the config and enforced by every rank's transfer engine."""
    rate: float = 0.0            # bytes per second; 0 = unlimited
    burst: int = 0               # bucket size in bytes; 0 = a tenth of a second at ``rate``
    max_in_flight: int = 0       # bytes running at once; 0 = unlimited
    max_queued_stores: int = 0   # store bytes waiting before new stores are dropped; 0 = never drop

    def __post_init__(self) -> None:
        for name in ("rate", "burst", "max_in_flight", "max_queued_stores"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinkLimits.{name} must be >= 0, got {getattr(self, name)}")


class Priority(IntEnum):
    """Lower runs first: loads are on the critical path, stores are best effort."""
    LOAD = 0
    PREFETCH = 1
    STORE = 2


class Failure(str, Enum):
    """Why one key of a job did not move on one rank; merged across ranks by `SEVERITY`."""
    CANCELLED = "cancelled"      # a store cancelled because its request's load failed in the same step
    DROPPED = "dropped"          # a store the link dropped under pressure
    BUSY = "busy"                # a store the server had no room for in time (its in-flight budget, its slots)
    MISS = "miss"                # not there when read: evicted, deleted, changed under a ranged read
    UNAVAILABLE = "unavailable"  # the tier is in an outage on this rank
    TIMEOUT = "timeout"          # past its deadline (a server too slow to answer)
    IO = "io"                    # the medium or the copy failed (ENOSPC, EIO, a refused write, a crash)
    CORRUPT = "corrupt"          # there, but failed its checks: the stored bytes are deleted


SEVERITY = {f: i for i, f in enumerate(Failure)}


def worst(a: Failure, b: Failure) -> Failure:
    return a if SEVERITY[a] >= SEVERITY[b] else b


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk's part of a plan.

    ``block_ids`` are L0 blocks for chunk blocks ``first_block .. first_block +
    len(block_ids)``: a load may skip leading blocks the engine already holds.
    ``slot`` addresses the chunk in L1 (the same slot on every rank), when L1
    is involved; ``chunk_blocks`` is how many blocks the stored chunk holds
    (fewer than a full chunk only for a partial trailing chunk).

    An engine whose KV has several groups (`tiercache.contracts.groups`)
    names its blocks per group in ``groups`` instead of ``block_ids``;
    ``first_block`` and ``span`` are then the table positions the copy
    covers.
    """
    key: BlockHash
    slot: int | None
    block_ids: tuple[int, ...]
    chunk_blocks: int
    first_block: int = 0
    parent: BlockHash | None = None   # the request's previous chunk (chain-aware eviction, purges by prompt)
    stored_at: float = 0.0            # when the chunk was first stored (what a lower tier's header says; 0: unknown)
    groups: tuple[GroupBlocks, ...] = ()
    span: int = 0                     # with ``groups``: table positions covered, from ``first_block``

    @property
    def num_blocks(self) -> int:
        """Table positions the copy covers (the engine's tokens it stores or loads, in blocks)."""
        return self.span if self.groups else len(self.block_ids)

    def engine_blocks(self) -> tuple[int, ...]:
        """Every engine block the copy reads or writes, across groups."""
        return tuple(b for g in self.groups for b in g.block_ids) if self.groups else self.block_ids


@dataclass(frozen=True, slots=True)
class TransferPlan:
    job_id: JobId
    src: str                # tier name (DEVICE for L0)
    dst: str | None         # tier name, or None: delete the chunks from ``src``
    link: str               # device_host | host_disk | host_network: whose rate limits and queue apply
    priority: Priority
    chunks: tuple[ChunkCopy, ...]
    nbytes: int             # per rank

    @property
    def keys(self) -> list[BlockHash]:
        return [c.key for c in self.chunks]

    def describe(self) -> str:
        return f"job {self.job_id} {self.src}→{self.dst or 'delete'} ({len(self.chunks)} chunks, {self.nbytes} B)"


KeyFailures = tuple[tuple[BlockHash, Failure], ...]


@dataclass(frozen=True, slots=True)
class WriteBackOrder:
    """Scheduler → every rank, with each step's plans: what a rank writes down at a clean shutdown, when no
    step follows to carry a plan (vLLM stops its workers before its scheduler). A chunk is written down if it
    reached this rank's L1 by a job of the step that named it in ``unwritten`` and has not left since."""
    tier: str                          # the write-back tier
    link: str
    unwritten: frozenset[BlockHash] = frozenset()   # chunks this step's stores and promotions bring to L1 that
                                                    # the write-back tier lacks
    freed_slots: tuple[int, ...] = ()  # L1 slots whose chunk left L1 since the last order, in order


@dataclass(frozen=True, slots=True)
class TransferResult:
    """One rank's result of one plan, on that rank (the worker keeps the plan; only a `JobReport` crosses)."""
    plan: TransferPlan
    seconds: float
    failed: KeyFailures = ()
    error: str | None = None

    @property
    def job_id(self) -> JobId:
        return self.plan.job_id

    @property
    def ok(self) -> bool:
        return not self.failed and self.error is None

    def report(self, rank: int) -> JobReport:
        return JobReport(self.plan.job_id, rank, self.failed, self.seconds, self.error)


@dataclass(frozen=True, slots=True)
class JobReport:
    """Worker → scheduler: how one job went on one rank."""
    job_id: JobId
    rank: int
    failed: KeyFailures = ()
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """A job over every rank: a key failed if it failed on any rank, for the worst of its reasons."""
    job_id: JobId
    failed: dict[BlockHash, Failure] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and self.error is None

    @classmethod
    def merge(cls, job_id: JobId, reports: list[JobReport]) -> JobOutcome:
        failed: dict[BlockHash, Failure] = {}
        for report in reports:
            for key, why in report.failed:
                failed[key] = worst(failed[key], why) if key in failed else why
        errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        return cls(job_id, failed, "; ".join(errors) or None)

    @classmethod
    def everything_failed(cls, plan: TransferPlan, why: Failure) -> JobOutcome:
        return cls(plan.job_id, {k: why for k in plan.keys}, why.value)
