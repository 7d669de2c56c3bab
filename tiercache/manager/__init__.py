"""The cache manager: longest-prefix lookup across tiers, and every transfer plan.

Scheduler side, bookkeeping only: it reads and updates tier indexes, builds
`TransferPlan`s (plain data) that every rank's worker runs, and applies their
merged outcomes (`JobOutcome`: a key that failed on any rank failed); it never
touches a tensor, a file or a socket. One thread drives it.

The hierarchy is L1 (`CpuIndex`, the only tier that exchanges chunks with L0)
over lower tiers (`LowerIndex`: disk, remote):

- a lookup spans every tier; chunks found only below L1 are *promoted*
  (copied up into L1 slots, at prefetch priority) before they are loaded;
- stores go to L1; below it, each lower tier has a write mode:
  ``write-through`` tiers get a copy of every stored chunk at once (the
  default for shared remote tiers, so peers see it), and the first
  ``write-back`` tier gets a chunk only when L1 evicts it (a *spill*) and
  the admission policy accepts it.

Plans other than the ones a caller asked for (promotions, spills, copies
down, deletes of bytes that left a lower tier) collect in a background list
that the caller drains (`take_background`) and hands to the workers, with the
shutdown write-down order (`take_write_back`). A preempted request's swap
copy (``private``) stays in L1: it is never copied down, spilled or flushed
to a shared tier.

Contract with the engine (as in vLLM's connector API): the L0 blocks named in
a plan stay allocated to their request until the plan's result is reported —
the engine delays freeing a finished request whose store is in flight — so
the manager needs no per-block pins on the hot path.

`CacheManager` is the one entry point; each concern is a part with its own state:

- `tiercache.lookup`: lookups, cut to resume points (`ResumePoints`);
- `jobs`: job ids, the jobs in flight and the background queue (`JobBook`);
- `l0_copies`: loads into L0 and stores from it (`L0Copies`);
- `promotions`: copies up from a lower tier (`Promotions`);
- `copies_down`: write-through copies, spills and flushes (`CopiesDown`);
- `write_back`: the write-back tier's spills and shutdown order (`WriteBack`);
- `purges`: purges and retention (`Purges`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tiercache.audit import AuditTrail
from tiercache.config import PROMOTIONS
from tiercache.contracts.connector import RequestState
from tiercache.contracts.groups import KVGroups, UniformChunks
from tiercache.contracts.keys import BlockHash, chunk_keys
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.plan import ChunkCopy, Failure, JobId, JobOutcome, Priority, TransferPlan, WriteBackOrder
from tiercache.contracts.purge import PurgeOrder, PurgeReport
from tiercache.hot_chunks import HotChunks
from tiercache.index.tier_index import TierIndex
from tiercache.lookup import PrefixFinder, PrefixLookup, ResumePoints
from tiercache.manager.copies_down import CopiesDown
from tiercache.manager.jobs import InFlightJob, JobBook, JobKind
from tiercache.manager.l0_copies import L0Copies
from tiercache.manager.promotions import Promotions
from tiercache.manager.purges import Purges
from tiercache.manager.write_back import SPILL_RESERVE_SHARE, WriteBack
from tiercache.policies import AdmissionPolicy
from tiercache.tier_events import EventJournal, TierEvent
from tiercache.tiers.base import LowerIndex
from tiercache.tiers.cpu import CpuIndex

__all__ = ["SPILL_RESERVE_SHARE", "CacheManager", "JobKind"]

WRITE_MODES = ("write-back", "write-through")


class CacheManager:
    """Scheduler side: every tier index, every decision; its plans go to the workers as plain data."""

    def __init__(
        self,
        l1: CpuIndex,
        block_size: int,
        blocks_per_chunk: int,
        block_bytes: int,
        lower: Sequence[LowerIndex] = (),
        partial_chunks: bool = False,
        write_mode: str | Sequence[str] = "write-back",
        admission: AdmissionPolicy | None = None,
        l1_admission: AdmissionPolicy | None = None,
        transfer_workers: int = 2,
        block_layout: ChunkLayout | None = None,
        audit: AuditTrail | None = None,
        chores: Sequence[Callable[[], None]] = (),
        promotion: str = "copy",
        groups: KVGroups | None = None,
    ) -> None:
        modes = [write_mode] * len(lower) if isinstance(write_mode, str) else list(write_mode)
        if len(modes) != len(lower) or any(m not in WRITE_MODES for m in modes):
            raise ValueError(f"one write mode (write-back or write-through) per lower tier, got {write_mode!r}")
        if promotion not in PROMOTIONS:
            raise ValueError(f"promotion must be one of {', '.join(PROMOTIONS)}, got {promotion!r}")
        self.l1 = l1
        self.lower = list(lower)
        self.tiers: list[TierIndex] = [l1, *self.lower]
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.by_name = {t.name: t for t in self.tiers}
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        # dtype and shape of a one-block chunk: what a lower tier's codec makes of a chunk's bytes
        self.block_layout = block_layout or ChunkLayout("uint8", (1, 1, 1, block_bytes))
        # an engine's KV-cache groups, when it has several (or one that is not full attention): what a chunk
        # stores per group, and so its size; else every block of a chunk stores ``block_bytes``
        self.groups = groups
        self.sizes = groups or UniformChunks(self.block_layout, blocks_per_chunk)
        self.partial_chunks = partial_chunks     # a request's last chunk may be partial; lookups end on one
        self.write_modes = dict(zip(names[1:], modes))
        self.audit = audit or AuditTrail()     # purges applied and expiries, per tenant (the engine's)
        self._chores = list(chores)            # run at each background step: the keys file's watch
        self._admissions = [a for a in (admission, l1_admission) if a is not None]   # told of every request
        self.hot = HotChunks()
        self.events: EventJournal | None = None   # kept once a connector turns them into KV events
        self._build_parts(modes, admission, l1_admission, transfer_workers, promotion)

    def _build_parts(self, modes: Sequence[str], admission: AdmissionPolicy | None,
                     l1_admission: AdmissionPolicy | None, transfer_workers: int, promotion: str) -> None:
        """The parts of the manager, each the one owner of its state, wired to the parts they plan through."""
        self.finder = PrefixFinder(self.tiers, self.block_size, self.blocks_per_chunk, self.partial_chunks)
        self.resume_points = ResumePoints(self.finder, self.sizes)
        self.jobs = JobBook(self.sizes, transfer_workers)
        self.copies_down = CopiesDown(self.l1, self.sizes, self.jobs,
                                      [t for t, m in zip(self.lower, modes) if m == "write-through"])
        spill_to = next((t for t, m in zip(self.lower, modes) if m == "write-back"), None)
        self.write_back = None if spill_to is None else WriteBack(
            self.l1, spill_to, admission, self.copies_down, self.sizes, self.blocks_per_chunk,
            moves_up=promotion == "move")
        self.l0_copies = L0Copies(self.l1, self.finder, self.sizes, self.groups, self.jobs, self.hot, l1_admission,
                                  self.write_back)
        self.promotions = Promotions(self.l1, self.by_name, self.finder, self.sizes, self.jobs, self.write_back)
        self.purges = Purges(self.tiers, self.lower, self.jobs, self.hot, self.audit)

    @property
    def transfer_workers(self) -> int:
        return self.jobs.transfer_workers

    @property
    def spill_reserve(self) -> int:
        """L1 slots kept free (or being spilled) for the next step's stores and promotions."""
        return self.write_back.spill_reserve if self.write_back is not None else 0

    # -- lookups ---------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash], num_computed_blocks: int = 0) -> PrefixLookup:
        """Longest run of chunks of a request, after the blocks already in L0, found in any tier (with resume
        points: cut to the last boundary that has one)."""
        self.apply_purges()
        return self.resume_points.cut(self.finder.lookup(block_hashes, num_computed_blocks))

    def lookup_chunks(self, keys: Sequence[BlockHash], num_blocks: int, num_computed_blocks: int = 0) -> PrefixLookup:
        """Like `lookup`, for explicit chunk keys covering ``num_blocks`` blocks (e.g. a swapped-out request)."""
        self.apply_purges()
        return self.resume_points.cut(self.finder.lookup_chunks(keys, num_blocks, num_computed_blocks))

    def in_l1(self, lookup: PrefixLookup) -> PrefixLookup:
        """``lookup`` cut to its leading runs in L1: the part `plan_load` can serve now (with resume points:
        all of it, its resume point included, or nothing)."""
        return self.resume_points.in_tier(lookup, self.l1.name)

    def promote(self, lookup: PrefixLookup) -> bool:
        """Start copying the lookup's lower-tier chunks up into L1; True while any of them is on its way (see
        `Promotions.promote`)."""
        return self.promotions.promote(lookup)

    def record_request(self, keys: Sequence[BlockHash]) -> None:
        """The engine admitted a request wanting chunks ``keys``: tell the eviction and admission policies that
        learn from demand."""
        for tier in self.tiers:
            tier.record(keys)
        for admission in self._admissions:
            admission.record(keys)

    def request_state(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's word on the request that wanted chunks ``keys`` (head first): every tier's eviction
        policy and the admission policies that take hints keep or give up its chunks by it."""
        for tier in self.tiers:
            tier.retain(keys, state)
        for admission in self._admissions:
            admission.retain(keys, state)

    # -- loads and stores (L0 ↔ L1) ----------------------------------------------
    def plan_load(
        self, lookup: PrefixLookup, block_ids: Sequence[int], upto_blocks: int | None = None,
        group_tables: Sequence[Sequence[int]] = (),
    ) -> list[TransferPlan]:
        """Plans that load ``lookup``'s hit (all of it in L1: see `in_l1`) into the request's table ``block_ids``
        (with KV-cache groups: its table per group, ``group_tables``), up to ``upto_blocks`` (`L0Copies`)."""
        return self.l0_copies.plan_load(lookup, block_ids, upto_blocks, group_tables)

    def plan_store(
        self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], first_chunk: int = 0,
        group_tables: Sequence[Sequence[int]] = (), points: Sequence[int] = (),
    ) -> TransferPlan | None:
        """Plan storing a request's chunks (from ``first_chunk`` on) that L1 lacks.

        ``block_hashes`` are the hashes of the request's full blocks and
        ``block_ids`` its block table (with KV-cache groups: its table per
        group, ``group_tables``). Chunks already present, without room, or
        whose blocks the engine no longer holds are skipped (stores are best
        effort); None when nothing is left. With resume points, ``points``
        are the chunks (by index) whose resume point is stored too.
        """
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.partial_chunks)
        return self.plan_store_chunks(keys, block_ids, len(block_hashes), first_chunk, group_tables=group_tables,
                                      points=points)

    def plan_store_chunks(self, keys: Sequence[BlockHash], block_ids: Sequence[int], num_blocks: int,
                          first_chunk: int = 0, private: bool = False,
                          group_tables: Sequence[Sequence[int]] = (), points: Sequence[int] = ()
                          ) -> TransferPlan | None:
        """Like `plan_store`, for explicit keys of chunks over the first ``num_blocks`` blocks; ``private``
        chunks (a swap copy) stay in L1 (`L0Copies.plan_store`)."""
        return self.l0_copies.plan_store(keys, block_ids, num_blocks, first_chunk, private, group_tables, points)

    # -- purges ----------------------------------------------------------------
    def purge(self, order: PurgeOrder) -> PurgeReport:
        """Take what ``order`` selects out of L1 and every tier with an index here (see `Purges`)."""
        return self.purges.purge(order)

    def apply_purges(self) -> None:
        """Apply the purges the shared tiers' stores made, before this step looks anything up or stores
        anything."""
        self.purges.apply_passed_on()

    # -- background work ----------------------------------------------------------
    def take_background(self) -> list[TransferPlan]:
        """Deletes, promotions, spills and write-through copies planned since the last call, to be run. A
        delete goes first: on its tier's link it also runs first (prefetch priority), before the writes
        that the room it frees was given to."""
        for chore in self._chores:
            chore()
        self.purges.apply_passed_on()
        self.purges.expire()
        deletes = self._plan_deletes()
        if self.write_back is not None:
            self.write_back.plan_spills()
        deletes += self._plan_deletes()   # the spills may have evicted from the tier they went to
        return deletes + self.jobs.take_background()

    def _plan_deletes(self) -> list[TransferPlan]:
        """One delete per lower tier of the bytes that left its index (evicted, corrupt, half-written)."""
        plans = []
        for lower in self.lower:
            gone = lower.take_deletes()
            if gone:
                chunks = [ChunkCopy(key, None, (), 0) for key in dict.fromkeys(gone)]
                plans.append(self.jobs.plan(JobKind.DELETE, lower, None, Priority.PREFETCH, chunks, lower))
        return plans

    def take_write_back(self) -> WriteBackOrder | None:
        """The shutdown write-down order to send with the plans planned since the last call (None without a
        write-back tier, or when nothing changed). Call it after planning, for every batch of plans handed to
        the workers."""
        return self.write_back.take_order() if self.write_back is not None else None

    def flush_down(self) -> list[TransferPlan]:
        """Plan copying every resident chunk that only L1 holds (and admission accepts) to the write-back tier.

        For a caller whose scheduler outlives its workers' last step (a benchmark filling a tier); at
        shutdown each rank writes down what its `WriteBackOrder`s left it (`tiercache.manager.write_back`).
        """
        if self.write_back is None:
            return []
        self.write_back.flush()
        return self.take_background()

    # -- events ----------------------------------------------------------------
    def watch_events(self) -> None:
        """Journal what reaches and leaves each tier from now on, in order, for `take_events`."""
        if self.events is None:
            self.events = EventJournal(self.tiers)

    def _journal_arrival(self, job: InFlightJob, failed: dict) -> None:
        if self.events is None or job.kind in (JobKind.LOAD, JobKind.DELETE) or job.private:
            return
        tier = self.l1 if job.kind in (JobKind.STORE, JobKind.PROMOTE) else job.lower
        self.events.arrived(tier, [k for k in job.plan.keys if k not in failed])

    def take_events(self) -> list[TierEvent]:
        return self.events.take() if self.events is not None else []

    # -- completions -----------------------------------------------------------
    def apply(self, outcomes: Iterable[JobOutcome]) -> None:
        """Publish or release what finished jobs reserved (each outcome merged over every rank)."""
        for outcome in outcomes:
            if self.events is not None:
                self.events.take_removals()      # what left a tier before these chunks arrived
            job = self.jobs.finish(outcome.job_id)
            if job is None:               # cancelled already (its workers were given up on): nothing reserved
                continue
            self._journal_arrival(job, outcome.failed)
            self._complete(job, outcome)
            if job.purged:                 # landed after the purge was applied here: taken out again
                job.lower.delete(job.purged)

    def _complete(self, job: InFlightJob, outcome: JobOutcome) -> None:
        """Apply one finished job by its kind. A delete reserved nothing: one that failed leaves a stray file
        or value, which a restart re-verifies (disk) or the server evicts (remote)."""
        failed = outcome.failed
        if job.kind is JobKind.LOAD:
            self.l0_copies.loaded(job, outcome)
        elif job.kind is JobKind.STORE:
            self.l0_copies.stored(job, failed)
            self.copies_down.after_store(job, failed)
        elif job.kind is JobKind.PROMOTE:
            self.promotions.landed(job, failed)
        elif job.kind in (JobKind.SPILL, JobKind.COPY_DOWN):
            self.copies_down.landed(job, failed)

    def cancel(self, plan: TransferPlan) -> JobOutcome:
        """A planned transfer that will not run: release its reservations now."""
        outcome = JobOutcome.everything_failed(plan, Failure.CANCELLED)
        self.apply([outcome])
        return outcome

    def cancel_all(self) -> None:
        """Release every reservation of plans whose outcome will never come (the workers are gone)."""
        for job in self.jobs:
            self.cancel(job.plan)

    def in_flight(self, job_id: JobId) -> bool:
        return job_id in self.jobs

    @property
    def num_in_flight(self) -> int:
        return len(self.jobs)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.audit.close()

    def stats(self) -> dict[str, object]:
        return {
            "tiers": {t.name: t.stats() for t in self.tiers},
            "in_flight_jobs": len(self.jobs),
            "hot_chunks": [{"key": key.hex(), "loads": n} for key, n in self.hot.top()],
            "audit": self.audit.counts(),
        }
