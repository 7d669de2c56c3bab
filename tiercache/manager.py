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
  the admission policy accepts it; a chunk promoted from it stays there
  (``promotion="copy"``) or leaves it (``"move"``: spilled again when L1
  evicts it).

Plans other than the ones a caller asked for (promotions, spills, copies
down, deletes of bytes that left a lower tier) collect in a background list
that the caller drains (`take_background`) and hands to the workers. A
preempted request's swap copy (``private``) stays in L1: it is never copied
down, spilled or flushed to a shared tier.

Shutdown: with a write-back tier, what only L1 holds is lost when the engine
stops, unless it is written down first. While the scheduler is alive,
`flush_down` plans that; but vLLM stops its workers before its scheduler, so
no step follows to carry a plan. So every plan the workers get comes with a
`WriteBackOrder` (`take_write_back`): which chunks entering L1 the
write-back tier lacks, and which L1 slots were freed since, in order. Each
rank keeps the slots whose chunk it holds by that rule and writes them down
when it closes — its own bytes, where a failed store on another rank leaves
a chunk only some ranks hold, which the restart scan deletes.

Contract with the engine (as in vLLM's connector API): the L0 blocks named in
a plan stay allocated to their request until the plan's result is reported —
the engine delays freeing a finished request whose store is in flight — so
the manager needs no per-block pins on the hot path.

Chunks: chunk ``i`` of a request covers its blocks ``[i*bpc, (i+1)*bpc)`` and
is keyed by the hash of its last block (`tiercache.contracts.keys`).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum, auto

from tiercache.audit import AuditTrail
from tiercache.config import PROMOTIONS
from tiercache.contracts.connector import RequestState
from tiercache.contracts.groups import RESUME_POINT, KVGroups, UniformChunks, resume_key
from tiercache.contracts.keys import BlockHash, chunk_keys
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.medium import Medium, link_name
from tiercache.contracts.plan import (
    DEVICE,
    ChunkCopy,
    Failure,
    JobId,
    JobOutcome,
    Priority,
    TransferPlan,
    WriteBackOrder,
)
from tiercache.contracts.purge import PurgeOrder, PurgeReport, order_selectors
from tiercache.hot_chunks import HotChunks
from tiercache.index.indexed_tier import IndexedTier
from tiercache.index.tier_index import TierIndex
from tiercache.lookup import PrefixFinder, PrefixLookup, TierRun
from tiercache.policies import AdmissionPolicy, admitted_prefix
from tiercache.tier_events import EventJournal, TierEvent
from tiercache.tiers.base import LowerIndex
from tiercache.tiers.cpu import CpuIndex

log = logging.getLogger(__name__)


SPILL_RESERVE_SHARE = 16     # 1/16 of L1 (RESULTS.md, "Room for the next step's stores")


class JobKind(Enum):
    LOAD = auto()        # L1 → L0
    STORE = auto()       # L0 → L1
    PROMOTE = auto()     # lower → L1
    SPILL = auto()       # L1 (evicted) → lower
    COPY_DOWN = auto()   # L1 (still resident) → lower, write-through
    DELETE = auto()      # a lower tier's bytes of chunks that left its index


@dataclass(slots=True)
class _InFlight:
    plan: TransferPlan
    kind: JobKind
    lower: LowerIndex | None = None
    private: bool = False
    purged: tuple[BlockHash, ...] = ()   # a copy to a remote tier purged while on its way: deleted once landed


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
        if len(modes) != len(lower) or any(m not in ("write-back", "write-through") for m in modes):
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
        self.finder = PrefixFinder(self.tiers, block_size, blocks_per_chunk, partial_chunks)
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
        self._spill_to = next((t for t, m in zip(self.lower, modes) if m == "write-back"), None)
        self._through = [t for t, m in zip(self.lower, modes) if m == "write-through"]
        self.admission = admission             # what L1 writes down to its write-back tier
        self.l1_admission = l1_admission       # what the engine stores into L1 (None: everything)
        self.audit = audit or AuditTrail()     # purges applied and expiries, per tenant (the engine's)
        self._chores = list(chores)            # run at each background step: the keys file's watch
        self.transfer_workers = transfer_workers   # each rank's transfer threads: a batch to a lower tier is split
        self._job_ids = itertools.count(1)
        self._in_flight: dict[JobId, _InFlight] = {}
        self._background: list[TransferPlan] = []
        self._promoting: dict[BlockHash, JobId] = {}
        self._keep: list[BlockHash] = []    # chunks planned into L1 that the write-back tier lacks
        self._left: list[int] = []          # L1 slots freed since the last `take_write_back`, in order
        self.hot = HotChunks()
        self.events: EventJournal | None = None   # kept once a connector turns them into KV events
        # L1 slots kept free (or being spilled) for the next step's stores and promotions: a victim being
        # spilled frees its slot only once its copy is out (none in an L1 of under SPILL_RESERVE_SHARE slots)
        self.spill_reserve = l1.slots.num_slots // SPILL_RESERVE_SHARE
        # a chunk promoted from the write-back tier leaves it ("move": L1 and it hold more between them, and
        # what L1 evicts is written again) or stays there too ("copy")
        self.moves_up = promotion == "move"
        if self._spill_to is not None:
            l1.spill_filter = self._worth_spilling
            l1.on_slot_freed = self._left.append

    def _admit(self, key: BlockHash, hits: int) -> bool:
        return self.admission is None or self.admission.admit(key, hits)

    def _worth_spilling(self, key: BlockHash, hits: int) -> bool:
        """Spill an L1 victim unless the write-back tier has it (asked only of a tier with a local index).
        Private chunks never reach here (`CpuIndex` keeps them out)."""
        target = self._spill_to
        if target is None or (target.indexed and target.has(key)):
            return False
        if self._admit(key, hits):
            return True
        # a policy that guards hits, not writes, lets a victim into room that evicts nothing
        return bool(getattr(self.admission, "admits_into_room", False) and target.indexed and target.used_bytes
                    + target.reserve_bytes(self.sizes.layout(self.blocks_per_chunk)) <= target.capacity_bytes)

    # -- lookup (PrefixFinder) -------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash], num_computed_blocks: int = 0) -> PrefixLookup:
        """Longest run of chunks of a request, after the blocks already in L0, found in any tier (with resume
        points: cut to the last boundary that has one)."""
        self.apply_purges()
        return self._to_resume_point(self.finder.lookup(block_hashes, num_computed_blocks))

    def lookup_chunks(self, keys: Sequence[BlockHash], num_blocks: int, num_computed_blocks: int = 0) -> PrefixLookup:
        """Like `lookup`, for explicit chunk keys covering ``num_blocks`` blocks (e.g. a swapped-out request)."""
        self.apply_purges()
        return self._to_resume_point(self.finder.lookup_chunks(keys, num_blocks, num_computed_blocks))

    def _to_resume_point(self, lookup: PrefixLookup) -> PrefixLookup:
        """A hit of a layout with resume points ends at the last chunk boundary whose resume point some tier
        holds (asked of every tier at once, fastest first); none: no hit. While a tier's answer is on its way
        the lookup is pending, its chunk runs kept so their promotions can start."""
        if not self.sizes.has_resume_points or lookup.num_hit_blocks <= lookup.num_computed_blocks:
            return lookup
        ends = [(run.first_chunk + i, key) for run in lookup.runs for i, key in enumerate(run.keys)]
        ends.reverse()                                         # the longest hit first
        points = [resume_key(key) for _, key in ends]
        answers = []
        for tier in self.tiers:
            held = tier.present_each(points)
            if held is None:
                return replace(lookup, pending=True)
            answers.append(held)
        for j, (chunk, _) in enumerate(ends):
            tier = next((t for t, held in zip(self.tiers, answers) if held[j]), None)
            if tier is not None:
                return self._cut_to(lookup, chunk, TierRun(tier.name, chunk, (points[j],)))
        return self._cut_to(lookup, -1, None)

    def _cut_to(self, lookup: PrefixLookup, last_chunk: int, point: TierRun | None) -> PrefixLookup:
        """``lookup`` with its runs cut after chunk ``last_chunk`` (-1: none), ending at ``point``."""
        runs = []
        for run in lookup.runs:
            keep = last_chunk + 1 - run.first_chunk
            if keep <= 0:
                break
            runs.append(run if keep >= len(run.keys) else TierRun(run.tier, run.first_chunk, run.keys[:keep]))
        hit = self.finder.chunk_bounds(last_chunk, lookup.num_blocks)[1] if point else lookup.num_computed_blocks
        return replace(lookup, runs=tuple(runs), num_hit_blocks=max(hit, lookup.num_computed_blocks), point=point,
                       found_blocks=max(lookup.found_blocks, lookup.num_hit_blocks))

    def in_l1(self, lookup: PrefixLookup) -> PrefixLookup:
        """``lookup`` cut to its leading runs in L1: the part `plan_load` can serve now (with resume points:
        all of it, its resume point included, or nothing)."""
        cut = self.finder.cut(lookup, self.l1.name)
        if not self.sizes.has_resume_points:
            return cut
        point = lookup.point
        if point is None or point.tier != self.l1.name or cut.num_hit_blocks < lookup.num_hit_blocks:
            return self._cut_to(lookup, -1, None)
        return replace(cut, point=point)

    def record_request(self, keys: Sequence[BlockHash]) -> None:
        """The engine admitted a request wanting chunks ``keys``: tell the eviction and admission policies that
        learn from demand."""
        for tier in self.tiers:
            tier.record(keys)
        for admission in (self.admission, self.l1_admission):
            record = getattr(admission, "record", None)
            if record is not None:
                record(keys)

    def request_state(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's word on the request that wanted chunks ``keys`` (head first): every tier's eviction
        policy and the admission policy that take hints keep or give up its chunks by it."""
        for tier in self.tiers:
            tier.retain(keys, state)
        for admission in (self.admission, self.l1_admission):
            retain = getattr(admission, "retain", None)
            if retain is not None:
                retain(keys, state)

    def promote(self, lookup: PrefixLookup) -> bool:
        """Start copying the lookup's lower-tier chunks (and its resume point) up into L1; True while any of
        them is on its way.

        Chunks L1 has no room for are not promoted, so a caller that waits
        for True to turn False never waits forever.
        """
        chain = [k for run in lookup.runs for k in run.keys]   # runs are consecutive: one chain
        runs = [*lookup.runs, lookup.point] if lookup.point is not None else list(lookup.runs)
        in_l1 = [k for run in runs if run.tier == self.l1.name for k in run.keys if self.l1.has(k)]
        self.l1.pin(in_l1)          # room made for the chain's tail never evicts its head
        try:
            parent_of = dict(zip(chain[1:], chain))
            if lookup.point is not None:
                parent_of[lookup.point.keys[0]] = chain[lookup.point.first_chunk - lookup.runs[0].first_chunk]
            return self._promote(lookup, parent_of)
        finally:
            self.l1.unpin(in_l1)

    def _promote(self, lookup: PrefixLookup, parent_of: dict[BlockHash, BlockHash]) -> bool:
        pending = False
        for run in (*lookup.runs, *((lookup.point,) if lookup.point is not None else ())):
            if run.tier == self.l1.name:
                continue
            lower = self.by_name[run.tier]
            todo = [k for k in run.keys if k not in self._promoting]
            pending |= len(todo) < len(run.keys)
            if not todo:
                continue
            sizes = []
            for i, key in enumerate(run.keys):
                if key in todo:
                    start, end = self.finder.chunk_bounds(run.first_chunk + i, lookup.num_blocks)
                    sizes.append((key, RESUME_POINT if run is lookup.point else end - start))
            slots = self.l1.prepare_store([k for k, _ in sizes], [self.sizes.nbytes(n) for _, n in sizes],
                                          chunk_blocks=[n for _, n in sizes])
            born = lower.stored_times([k for k, _ in sizes])      # unknown for a remote tier: 0
            chunks = [ChunkCopy(k, slot, (), n, parent=parent_of.get(k), stored_at=born.get(k, 0.0))
                      for (k, n), slot in zip(sizes, slots) if slot is not None]
            if not chunks:
                continue
            self.l1.link([(c.key, c.parent) for c in chunks])
            lower.prepare_load([c.key for c in chunks])
            if lower is not self._spill_to:
                self._keep_on_close(chunks)
            for part in self._split(chunks, lower):
                plan = self._plan(JobKind.PROMOTE, lower, self.l1, Priority.PREFETCH, part, lower)
                self._background.append(plan)
                for c in part:
                    self._promoting[c.key] = plan.job_id
            pending = True
        return pending

    # -- plans ---------------------------------------------------------------
    def _plan(self, kind: JobKind, src: TierIndex | None, dst: TierIndex | None, priority: Priority,
              chunks: list[ChunkCopy], lower: LowerIndex | None = None, private: bool = False) -> TransferPlan:
        """A plan between two tiers (None: L0) — or, for a delete, from ``src`` to nowhere. Its bytes are what
        crosses the link: a lower tier's stored bytes (its codec's, headers included), else the raw ones."""
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
        self._in_flight[plan.job_id] = _InFlight(plan, kind, lower, private)
        return plan

    def plan_load(
        self, lookup: PrefixLookup, block_ids: Sequence[int], upto_blocks: int | None = None,
        group_tables: Sequence[Sequence[int]] = (),
    ) -> list[TransferPlan]:
        """Plans that load ``lookup``'s hit (all of it in L1: see `in_l1`) into the request's table ``block_ids``
        (with KV-cache groups: its table per group, ``group_tables``).

        Loads blocks ``lookup.num_computed_blocks .. upto_blocks`` (default:
        the whole hit); the chunks involved are pinned in L1 until the result
        is applied.
        """
        limit = lookup.num_hit_blocks if upto_blocks is None else min(upto_blocks, lookup.num_hit_blocks)
        tables = self._tables(block_ids, group_tables)
        if any(len(table) < limit for table in tables):
            raise ValueError(f"{[len(t) for t in tables]} block ids for a load of {limit} blocks")
        plans = []
        for run in lookup.runs:
            if run.tier != self.l1.name:
                raise ValueError(f"chunks in tier {run.tier!r} must be promoted to L1 before a load")
            wanted = []
            for i, key in enumerate(run.keys):
                start, end = self.finder.chunk_bounds(run.first_chunk + i, lookup.num_blocks)
                if start >= limit:
                    break
                wanted.append((key, start, end))
            if not wanted:
                break
            slots = self.l1.prepare_load([key for key, _, _ in wanted])
            chunks = []
            for (key, start, end), slot in zip(wanted, slots):
                skip = max(0, lookup.num_computed_blocks - start)
                if self.groups is None:
                    chunks.append(ChunkCopy(key, slot, tuple(block_ids[start + skip:min(end, limit)]), end - start,
                                            skip))
                    continue
                parts = self.groups.load_copy(tables, start, end, start + skip, limit)
                chunks.append(ChunkCopy(key, slot, (), end - start, skip, groups=parts,
                                        span=min(end, limit) - start - skip))
            plans.append(self._plan(JobKind.LOAD, self.l1, None, Priority.LOAD, chunks))
        if lookup.point is not None and plans:
            plans.append(self._plan_point_load(lookup, tables, limit))
        return plans

    def _plan_point_load(self, lookup: PrefixLookup, tables: Sequence[Sequence[int]], limit: int) -> TransferPlan:
        """The load of the resume point the hit ends at (in L1, as `in_l1` left it): the blocks behind it."""
        key = lookup.point.keys[0]
        slot, = self.l1.prepare_load([key])
        parts = self.groups.point_load(tables, limit, lookup.num_computed_blocks)
        return self._plan(JobKind.LOAD, self.l1, None, Priority.LOAD,
                          [ChunkCopy(key, slot, (), RESUME_POINT, groups=parts)])

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

    def _tables(self, block_ids: Sequence[int], group_tables: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """The request's block table per group (one group: ``block_ids``)."""
        if self.groups is None:
            return (block_ids,)
        if len(group_tables) != len(self.groups.groups):
            raise ValueError(f"{len(group_tables)} block tables for {len(self.groups.groups)} KV-cache groups")
        return group_tables

    def plan_store_chunks(self, keys: Sequence[BlockHash], block_ids: Sequence[int], num_blocks: int,
                          first_chunk: int = 0, private: bool = False,
                          group_tables: Sequence[Sequence[int]] = (), points: Sequence[int] = ()
                          ) -> TransferPlan | None:
        """Like `plan_store`, for explicit keys of chunks over the first ``num_blocks`` blocks; ``private``
        chunks (a swap copy) stay in L1. An L1 admission policy cuts the chain at its first refused chunk (a
        swap copy is not asked: its request is coming back)."""
        end = len(keys)
        if self.l1_admission is not None and not private:
            end = first_chunk + admitted_prefix(self.l1_admission, keys[first_chunk:], room=self.l1.slots.num_free)
        if first_chunk >= end:
            return None
        tables = self._tables(block_ids, group_tables)
        wanted = []    # (key, first block, blocks, parent, groups): chunks, and resume points (no blocks)
        for i in range(first_chunk, end):
            start, stop = self.finder.chunk_bounds(i, num_blocks)
            parts = () if self.groups is None else self.groups.store_copy(tables, start, stop)
            if parts is not None:
                wanted.append((keys[i], start, stop - start, keys[i - 1] if i else None, parts))
            point = self.groups.point_copy(tables, stop) if i in points else None
            if point is not None:
                wanted.append((resume_key(keys[i]), stop, RESUME_POINT, keys[i], point))
        slots = self.l1.prepare_store([w[0] for w in wanted], [self.sizes.nbytes(w[2]) for w in wanted],
                                      private=private, chunk_blocks=[w[2] for w in wanted])
        now = time.time()                     # what the chunks' headers below L1 will say they were stored at
        chunks = [
            ChunkCopy(key, slot, () if parts else tuple(block_ids[start:start + n]), n, parent=parent,
                      stored_at=now, groups=parts, span=n if parts else 0)
            for (key, start, n, parent, parts), slot in zip(wanted, slots)
            if slot is not None
        ]
        self.l1.link([(c.key, c.parent) for c in chunks])     # a purge meanwhile finds them by their chain
        if not private:
            self._keep_on_close(chunks)
        return self._plan(JobKind.STORE, None, self.l1, Priority.STORE, chunks, private=private) if chunks else None

    def _plan_down(self, kind: JobKind, chunks: list[ChunkCopy], lower: LowerIndex) -> list[ChunkCopy]:
        """Reserve ``lower`` for ``chunks`` (L1 slots) and plan the copy; returns the chunks refused."""
        sizes = [lower.reserve_bytes(self.sizes.layout(c.chunk_blocks)) for c in chunks]
        ok = lower.prepare_store([c.key for c in chunks], sizes)
        taken = [c for c, good in zip(chunks, ok) if good]
        lower.link([(c.key, c.parent) for c in taken])
        for part in self._split(taken, lower):
            self._background.append(self._plan(kind, self.l1, lower, Priority.STORE, part, lower))
        return [c for c, good in zip(chunks, ok) if not good]

    def _split(self, chunks: list[ChunkCopy], lower: LowerIndex) -> list[list[ChunkCopy]]:
        """One job per transfer worker, so file I/O of one chunk overlaps checksums and syncs of another
        (one job for a tier that says it moves a batch best as one, like one gRPC stream)."""
        n = min(self.transfer_workers if lower.parallel_jobs else 1, len(chunks))
        return [chunks[i::n] for i in range(n)] if n else []

    # -- purges ----------------------------------------------------------------
    def purge(self, order: PurgeOrder) -> PurgeReport:
        """Take what ``order`` selects out of L1 and every tier with an index here (a chain is followed across
        them: it may run from L1 into the disk); the lower tiers' bytes go with the next deletes. A chunk being
        read or written goes when its transfer ends, and is not served meanwhile."""
        report = PurgeReport()
        tiers = [t for t in self.tiers if isinstance(t, IndexedTier)]    # a remote tier's store purges itself
        chosen = order.selector([pair for t in tiers for pair in t.links()] if order.roots else ())
        for tier in tiers:
            keys, nbytes = tier.purge(chosen)
            report.add(tier.name, len(keys), nbytes)
            self.hot.forget(keys)
        for job in self._in_flight.values():   # copies on their way to a store that keeps no index here
            if job.kind in (JobKind.SPILL, JobKind.COPY_DOWN) and not job.lower.indexed:
                job.purged += tuple(k for k in job.plan.keys if chosen(k, 0.0))
        return report

    def apply_purges(self) -> None:
        """Apply the purges the shared tiers' stores made (they reach this engine's own tiers this way), before
        this step looks anything up or stores anything."""
        for tier in self.lower:
            orders = tier.take_purges()
            if not orders:
                continue
            for order in orders:
                report = self.purge(order)
                self.audit.record("purge_applied", f"applied a purge from {tier.name}: {report.chunks} chunks, "
                                                   f"{report.nbytes} bytes", chunks=report.chunks,
                                  nbytes=report.nbytes, source=tier.name, selectors=order_selectors(order),
                                  tiers=report.tiers)
            tier.purges_applied()

    def take_background(self) -> list[TransferPlan]:
        """Deletes, promotions, spills and write-through copies planned since the last call, to be run. A
        delete goes first: on its tier's link it also runs first (prefetch priority), before the writes
        that the room it frees was given to."""
        for chore in self._chores:
            chore()
        self.apply_purges()
        for tier in self.tiers:                  # past retention: never served again, their room given back
            gone = tier.expire()
            if gone:
                self.audit.record("expired", f"tier {tier.name}: {len(gone)} chunks past retention removed",
                                  chunks=len(gone), tier=tier.name)
        deletes = self._plan_deletes()
        if self._spill_to is not None and self.spill_reserve:
            self.l1.keep_free(self.spill_reserve)
        spills = self.l1.take_spills()
        if spills and self._spill_to is not None:
            chunks = [ChunkCopy(s.key, s.slot, (), s.chunk_blocks, parent=s.parent,
                                stored_at=s.stored_at) for s in spills]
            refused = self._plan_down(JobKind.SPILL, chunks, self._spill_to)
            self.l1.finish_spills([c.key for c in refused])
        deletes += self._plan_deletes()   # the spills may have evicted from the tier they went to
        plans, self._background = deletes + self._background, []
        return plans

    def _plan_deletes(self) -> list[TransferPlan]:
        """One delete per lower tier of the bytes that left its index (evicted, corrupt, half-written)."""
        plans = []
        for lower in self.lower:
            gone = lower.take_deletes()
            if gone:
                chunks = [ChunkCopy(key, None, (), 0) for key in dict.fromkeys(gone)]
                plans.append(self._plan(JobKind.DELETE, lower, None, Priority.PREFETCH, chunks, lower))
        return plans

    # -- events ----------------------------------------------------------------
    def watch_events(self) -> None:
        """Journal what reaches and leaves each tier from now on, in order, for `take_events`."""
        if self.events is None:
            self.events = EventJournal(self.tiers)

    def _journal_arrival(self, job: _InFlight, failed: dict) -> None:
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
            job = self._in_flight.pop(outcome.job_id, None)
            if job is None:               # cancelled already (its workers were given up on): nothing reserved
                continue
            keys, failed = job.plan.keys, outcome.failed
            self._journal_arrival(job, failed)
            if job.kind is JobKind.LOAD:
                self.l1.complete_load(keys)
                if outcome.ok:
                    self.hot.add(keys)
            elif job.kind is JobKind.STORE:
                self.l1.complete_store(keys, failed)
                self.l1.link([(c.key, c.parent) for c in job.plan.chunks])
                if self._through and not job.private:         # what landed and was not purged meanwhile
                    stored = [c for c in job.plan.chunks if c.key not in failed and self.l1.has(c.key)]
                    for lower in self._through:
                        self._copy_down(stored, lower)
            elif job.kind is JobKind.PROMOTE:      # retention keeps counting from the first store
                self.l1.complete_promotion(keys, failed, job.lower.stored_times(keys))
                self.l1.link([(c.key, c.parent) for c in job.plan.chunks])
                job.lower.complete_load(keys, failed)
                for key in keys:
                    self._promoting.pop(key, None)
                if self.moves_up and job.lower is self._spill_to:
                    # moved up: it leaves the write-back tier (its bytes deleted with the next background step)
                    # and joins what only L1 holds, written down at shutdown (one another load pins there stays)
                    job.lower.delete([k for k in keys if k not in failed and self.l1.has(k)])
                    self._keep += [k for k in keys if self.l1.has(k) and not job.lower.has(k)]
            elif job.kind is JobKind.SPILL:
                job.lower.complete_store(keys, failed, self.l1.spilling_times(keys))
                job.lower.link([(c.key, c.parent) for c in job.plan.chunks])
                self.l1.finish_spills(keys)
            elif job.kind is JobKind.COPY_DOWN:
                job.lower.complete_store(keys, failed, self.l1.stored_times(keys))
                job.lower.link([(c.key, c.parent) for c in job.plan.chunks])
                self.l1.unpin(keys)
            if job.purged:                 # landed after the purge was applied here: taken out again
                job.lower.delete(job.purged)
            # DELETE: nothing was reserved; a delete that failed leaves a stray file or value, which a restart
            # re-verifies (disk) or the server evicts (remote)

    def _copy_down(self, chunks: list[ChunkCopy], lower: LowerIndex) -> None:
        if not chunks:
            return
        slots = [entry.slot for entry in self.l1.pin([c.key for c in chunks])]
        pinned = [replace(c, slot=slot, block_ids=(), groups=(), span=0) for c, slot in zip(chunks, slots)]
        refused = self._plan_down(JobKind.COPY_DOWN, pinned, lower)
        self.l1.unpin([c.key for c in refused])

    def _keep_on_close(self, chunks: Sequence[ChunkCopy]) -> None:
        target = self._spill_to
        if target is not None:
            self._keep += [c.key for c in chunks if not (target.indexed and target.has(c.key))]

    def take_write_back(self) -> WriteBackOrder | None:
        """The shutdown write-down order to send with the plans planned since the last call (None without a
        write-back tier, or when nothing changed). Call it after planning, for every batch of plans handed to
        the workers."""
        target = self._spill_to
        if target is None or not (self._keep or self._left):
            return None
        order = WriteBackOrder(target.name, link_name(Medium.CPU, target.medium), frozenset(self._keep),
                               tuple(self._left))
        self._keep.clear()
        self._left.clear()
        return order

    def flush_down(self) -> list[TransferPlan]:
        """Plan copying every resident chunk that only L1 holds (and admission accepts) to the write-back tier.

        For a caller whose scheduler outlives its workers' last step (a benchmark filling a tier); at
        shutdown each rank writes down what its `WriteBackOrder`s left it (see the module docstring).
        """
        if self._spill_to is None:
            return []
        dirty = [(key, e) for key, e in self.l1.entries.items()
                 if e.ready and e.pins == 0 and not e.private and self._worth_spilling(key, e.hits)]
        self._copy_down([ChunkCopy(key, e.slot, (), e.chunk_blocks, parent=e.parent,
                                   stored_at=e.stored_at) for key, e in dirty], self._spill_to)
        return self.take_background()

    def cancel(self, plan: TransferPlan) -> JobOutcome:
        """A planned transfer that will not run: release its reservations now."""
        outcome = JobOutcome.everything_failed(plan, Failure.CANCELLED)
        self.apply([outcome])
        return outcome

    def cancel_all(self) -> None:
        """Release every reservation of plans whose outcome will never come (the workers are gone)."""
        for job in list(self._in_flight.values()):
            self.cancel(job.plan)

    def in_flight(self, job_id: JobId) -> bool:
        return job_id in self._in_flight

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.audit.close()

    def stats(self) -> dict[str, object]:
        return {
            "tiers": {t.name: t.stats() for t in self.tiers},
            "in_flight_jobs": len(self._in_flight),
            "hot_chunks": [{"key": key.hex(), "loads": n} for key, n in self.hot.top()],
            "audit": self.audit.counts(),
        }
