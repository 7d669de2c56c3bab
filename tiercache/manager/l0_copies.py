"""Plans between the engine's L0 and L1: loads of a hit into a request's blocks, stores of its computed chunks.

Scheduler side. Chunk ``i`` of a request covers its blocks ``[i * blocks_per_chunk, (i + 1) *
blocks_per_chunk)``; with KV-cache groups (`tiercache.contracts.groups`) a copy names each group's blocks,
and a chunk boundary may carry a resume point, stored and loaded as a chunk of its own.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from tiercache.contracts.groups import RESUME_POINT, ChunkSizes, GroupBlocks, KVGroups, resume_key
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import ChunkCopy, Failure, JobOutcome, Priority, TransferPlan
from tiercache.hot_chunks import HotChunks
from tiercache.lookup import PrefixFinder, PrefixLookup, TierRun
from tiercache.manager.jobs import InFlightJob, JobBook, JobKind
from tiercache.manager.write_back import WriteBack
from tiercache.policies import AdmissionPolicy, admitted_prefix
from tiercache.tiers.cpu import CpuIndex


class L0Copies:
    """Plans loads and stores between L0 and L1, and applies them when they end. ``l1_admission`` decides what
    the engine stores into L1 (None: everything)."""

    def __init__(self, l1: CpuIndex, finder: PrefixFinder, sizes: ChunkSizes, groups: KVGroups | None,
                 jobs: JobBook, hot: HotChunks, l1_admission: AdmissionPolicy | None,
                 write_back: WriteBack | None) -> None:
        self.l1 = l1
        self.finder = finder
        self.sizes = sizes
        self.groups = groups
        self.jobs = jobs
        self.hot = hot
        self.l1_admission = l1_admission
        self.write_back = write_back

    # -- loads ---------------------------------------------------------------
    def plan_load(self, lookup: PrefixLookup, block_ids: Sequence[int], upto_blocks: int | None = None,
                  group_tables: Sequence[Sequence[int]] = ()) -> list[TransferPlan]:
        """Plans that load blocks ``lookup.num_computed_blocks .. upto_blocks`` (default: the whole hit, all of
        it in L1) into the request's ``block_ids`` (with groups: ``group_tables``); the chunks involved stay
        pinned in L1 until the result is applied."""
        limit = lookup.num_hit_blocks if upto_blocks is None else min(upto_blocks, lookup.num_hit_blocks)
        tables = self.tables(block_ids, group_tables)
        if any(len(table) < limit for table in tables):
            raise ValueError(f"{[len(t) for t in tables]} block ids for a load of {limit} blocks")
        plans = []
        for run in lookup.runs:
            if run.tier != self.l1.name:
                raise ValueError(f"chunks in tier {run.tier!r} must be promoted to L1 before a load")
            chunks = self._load_run(lookup, run, block_ids, tables, limit)
            if not chunks:
                break
            plans.append(self.jobs.plan(JobKind.LOAD, self.l1, None, Priority.LOAD, chunks))
        if lookup.point is not None and plans:
            plans.append(self._plan_point_load(lookup, tables, limit))
        return plans

    def _load_run(self, lookup: PrefixLookup, run: TierRun, block_ids: Sequence[int],
                  tables: Sequence[Sequence[int]], limit: int) -> list[ChunkCopy]:
        """The copies of ``run``'s chunks that start before block ``limit``, their L1 slots pinned."""
        wanted = []
        for i, key in enumerate(run.keys):
            start, end = self.finder.chunk_bounds(run.first_chunk + i, lookup.num_blocks)
            if start >= limit:
                break
            wanted.append((key, start, end))
        if not wanted:
            return []
        slots = self.l1.prepare_load([key for key, _, _ in wanted])
        chunks = []
        for (key, start, end), slot in zip(wanted, slots):
            skip = max(0, lookup.num_computed_blocks - start)      # blocks L0 holds already
            if self.groups is None:
                chunks.append(ChunkCopy(key, slot, tuple(block_ids[start + skip:min(end, limit)]), end - start, skip))
                continue
            parts = self.groups.load_copy(tables, start, end, start + skip, limit)
            chunks.append(ChunkCopy(key, slot, (), end - start, skip, groups=parts,
                                    span=min(end, limit) - start - skip))
        return chunks

    def _plan_point_load(self, lookup: PrefixLookup, tables: Sequence[Sequence[int]], limit: int) -> TransferPlan:
        """The load of the resume point the hit ends at (in L1, as `in_l1` left it): the blocks behind it."""
        key = lookup.point.keys[0]
        slot, = self.l1.prepare_load([key])
        parts = self.groups.point_load(tables, limit, lookup.num_computed_blocks)
        return self.jobs.plan(JobKind.LOAD, self.l1, None, Priority.LOAD,
                              [ChunkCopy(key, slot, (), RESUME_POINT, groups=parts)])

    def loaded(self, job: InFlightJob, outcome: JobOutcome) -> None:
        """A load ended: its L1 chunks are unpinned, and counted as hot if every one arrived."""
        self.l1.complete_load(job.plan.keys)
        if outcome.ok:
            self.hot.add(job.plan.keys)

    # -- stores --------------------------------------------------------------
    def plan_store(self, keys: Sequence[BlockHash], block_ids: Sequence[int], num_blocks: int, first_chunk: int = 0,
                   private: bool = False, group_tables: Sequence[Sequence[int]] = (), points: Sequence[int] = ()
                   ) -> TransferPlan | None:
        """Plan storing chunks ``keys[first_chunk:]`` over the first ``num_blocks`` blocks that L1 lacks (and
        the resume points of the chunks listed in ``points``); ``private`` chunks (a swap copy) stay in L1. An
        L1 admission policy cuts the chain at its first refused chunk (a swap copy is not asked: its request is
        coming back). None when nothing is left to store."""
        end = len(keys)
        if self.l1_admission is not None and not private:
            end = first_chunk + admitted_prefix(self.l1_admission, keys[first_chunk:], room=self.l1.slots.num_free)
        if first_chunk >= end:
            return None
        wanted = self._wanted_stores(keys, first_chunk, end, num_blocks, self.tables(block_ids, group_tables), points)
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
        if not private and self.write_back is not None:
            self.write_back.entering_l1(chunks)
        return self.jobs.plan(JobKind.STORE, None, self.l1, Priority.STORE, chunks, private=private) if chunks else None

    def _wanted_stores(self, keys: Sequence[BlockHash], first_chunk: int, end: int, num_blocks: int,
                       tables: Sequence[Sequence[int]], points: Sequence[int]
                       ) -> list[tuple[BlockHash, int, int, BlockHash | None, tuple[GroupBlocks, ...]]]:
        """(key, first block, blocks, parent, groups) of each chunk ``first_chunk .. end - 1`` a store copies,
        and of the resume points in ``points`` (no blocks of their own)."""
        wanted = []
        for i in range(first_chunk, end):
            start, stop = self.finder.chunk_bounds(i, num_blocks)
            parts = () if self.groups is None else self.groups.store_copy(tables, start, stop)
            if parts is not None:
                wanted.append((keys[i], start, stop - start, keys[i - 1] if i else None, parts))
            point = self.groups.point_copy(tables, stop) if i in points else None
            if point is not None:
                wanted.append((resume_key(keys[i]), stop, RESUME_POINT, keys[i], point))
        return wanted

    def stored(self, job: InFlightJob, failed: Mapping[BlockHash, Failure]) -> None:
        """A store ended: L1 publishes what landed, linked into its chains."""
        self.l1.complete_store(job.plan.keys, failed)
        self.l1.link([(c.key, c.parent) for c in job.plan.chunks])

    def tables(self, block_ids: Sequence[int], group_tables: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """The request's block table per group (one group: ``block_ids``)."""
        if self.groups is None:
            return (block_ids,)
        if len(group_tables) != len(self.groups.groups):
            raise ValueError(f"{len(group_tables)} block tables for {len(self.groups.groups)} KV-cache groups")
        return group_tables
