"""Promotions: chunks a lookup found only below L1 are copied up into L1 slots, at prefetch priority, before
they are loaded into L0.

Scheduler side. `Promotions` owns the set of chunks on their way up, so a lookup repeated while they travel
neither promotes them twice nor waits for chunks L1 has no room for.
"""
from __future__ import annotations

from collections.abc import Mapping

from tiercache.contracts.groups import RESUME_POINT, ChunkSizes
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import ChunkCopy, Failure, Priority
from tiercache.index.tier_index import TierIndex
from tiercache.lookup import PrefixFinder, PrefixLookup, TierRun
from tiercache.manager.jobs import InFlightJob, JobBook, JobKind
from tiercache.manager.write_back import WriteBack
from tiercache.tiers.cpu import CpuIndex


class Promotions:
    """Plans the copies of a lookup's lower-tier chunks up into L1, and applies them when they land."""

    def __init__(self, l1: CpuIndex, by_name: Mapping[str, TierIndex], finder: PrefixFinder, sizes: ChunkSizes,
                 jobs: JobBook, write_back: WriteBack | None) -> None:
        self.l1 = l1
        self.by_name = by_name
        self.finder = finder
        self.sizes = sizes
        self.jobs = jobs
        self.write_back = write_back
        self._on_their_way: set[BlockHash] = set()

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
            pending = False
            for run in runs:
                if run.tier != self.l1.name:
                    pending |= self._promote_run(lookup, run, parent_of)
            return pending
        finally:
            self.l1.unpin(in_l1)

    def _promote_run(self, lookup: PrefixLookup, run: TierRun, parent_of: dict[BlockHash, BlockHash]) -> bool:
        """Plan promoting the chunks of ``run`` not on their way yet; True if any of the run is on its way."""
        lower = self.by_name[run.tier]
        todo = [k for k in run.keys if k not in self._on_their_way]
        already = len(todo) < len(run.keys)
        if not todo:
            return already
        wanted = []                 # (key, blocks): a chunk's blocks, or a resume point's (none)
        for i, key in enumerate(run.keys):
            if key in todo:
                start, end = self.finder.chunk_bounds(run.first_chunk + i, lookup.num_blocks)
                wanted.append((key, RESUME_POINT if run is lookup.point else end - start))
        slots = self.l1.prepare_store([k for k, _ in wanted], [self.sizes.nbytes(n) for _, n in wanted],
                                      chunk_blocks=[n for _, n in wanted])
        born = lower.stored_times([k for k, _ in wanted])      # unknown for a remote tier: 0
        chunks = [ChunkCopy(k, slot, (), n, parent=parent_of.get(k), stored_at=born.get(k, 0.0))
                  for (k, n), slot in zip(wanted, slots) if slot is not None]
        if not chunks:
            return already
        self.l1.link([(c.key, c.parent) for c in chunks])
        lower.prepare_load([c.key for c in chunks])
        if self.write_back is not None and lower is not self.write_back.tier:
            self.write_back.entering_l1(chunks)
        self.jobs.plan_background(JobKind.PROMOTE, lower, self.l1, Priority.PREFETCH, chunks, lower)
        self._on_their_way.update(c.key for c in chunks)
        return True

    def landed(self, job: InFlightJob, failed: Mapping[BlockHash, Failure]) -> None:
        """A promotion finished: L1 publishes what arrived (retention keeps counting from the first store), the
        lower tier unpins it, and a chunk moved up from the write-back tier leaves it."""
        keys, lower = job.plan.keys, job.lower
        self.l1.complete_promotion(keys, failed, lower.stored_times(keys))
        self.l1.link([(c.key, c.parent) for c in job.plan.chunks])
        lower.complete_load(keys, failed)
        self._on_their_way.difference_update(keys)
        if self.write_back is not None:
            self.write_back.promoted(lower, keys, failed)

