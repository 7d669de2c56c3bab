"""Copies from L1 down to the lower tiers: write-through copies of what L1 stored, spills of what it evicts,
and flushes of what only it holds.

Scheduler side. A copy down reserves room in the lower tier and runs as background jobs at store priority
(`JobBook.plan_background`); what the tier refuses stays where it is. A resident chunk being copied is
pinned in L1 until its copy has landed, so its slot is not reused under it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from tiercache.contracts.groups import ChunkSizes
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import ChunkCopy, Failure, Priority
from tiercache.manager.jobs import InFlightJob, JobBook, JobKind
from tiercache.tiers.base import LowerIndex
from tiercache.tiers.cpu import CpuIndex


class CopiesDown:
    """Plans copies from L1 to a lower tier, and applies them when they land. ``write_through`` are the tiers
    that get a copy of every chunk stored in L1 at once."""

    def __init__(self, l1: CpuIndex, sizes: ChunkSizes, jobs: JobBook, write_through: Sequence[LowerIndex]) -> None:
        self.l1 = l1
        self.sizes = sizes
        self.jobs = jobs
        self.write_through = list(write_through)

    def plan(self, kind: JobKind, chunks: Sequence[ChunkCopy], lower: LowerIndex) -> list[ChunkCopy]:
        """Reserve ``lower`` for ``chunks`` (in their L1 slots) and plan the copy; returns the chunks refused."""
        sizes = [lower.reserve_bytes(self.sizes.layout(c.chunk_blocks)) for c in chunks]
        ok = lower.prepare_store([c.key for c in chunks], sizes)
        taken = [c for c, good in zip(chunks, ok) if good]
        lower.link([(c.key, c.parent) for c in taken])
        self.jobs.plan_background(kind, self.l1, lower, Priority.STORE, taken, lower)
        return [c for c, good in zip(chunks, ok) if not good]

    def copy_resident(self, chunks: Sequence[ChunkCopy], lower: LowerIndex) -> None:
        """Copy chunks that stay in L1 to ``lower``, pinned in L1 until their copy lands."""
        if not chunks:
            return
        slots = [entry.slot for entry in self.l1.pin([c.key for c in chunks])]
        pinned = [replace(c, slot=slot, block_ids=(), groups=(), span=0) for c, slot in zip(chunks, slots)]
        refused = self.plan(JobKind.COPY_DOWN, pinned, lower)
        self.l1.unpin([c.key for c in refused])

    def after_store(self, job: InFlightJob, failed: Mapping[BlockHash, Failure]) -> None:
        """A store into L1 landed: the write-through tiers get what landed and was not purged meanwhile (a swap
        copy stays in L1)."""
        if not self.write_through or job.private:
            return
        stored = [c for c in job.plan.chunks if c.key not in failed and self.l1.has(c.key)]
        for lower in self.write_through:
            self.copy_resident(stored, lower)

    def landed(self, job: InFlightJob, failed: Mapping[BlockHash, Failure]) -> None:
        """A spill or a copy down finished: the lower tier publishes what it got, with when L1 first stored it
        (retention keeps counting); L1 lets the spilled chunks' slots go, or unpins the copied ones."""
        keys = job.plan.keys
        if job.kind is JobKind.SPILL:
            job.lower.complete_store(keys, failed, self.l1.spilling_times(keys))
            job.lower.link([(c.key, c.parent) for c in job.plan.chunks])
            self.l1.finish_spills(keys)
        else:
            job.lower.complete_store(keys, failed, self.l1.stored_times(keys))
            job.lower.link([(c.key, c.parent) for c in job.plan.chunks])
            self.l1.unpin(keys)
