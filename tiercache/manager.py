"""The cache manager: longest-prefix lookup across tiers, and load/store plans.

Scheduler side, bookkeeping only: it reads and updates tier indexes, builds
`TransferPlan`s (plain data) and hands them to the `TransferEngine`; it never
touches a tensor. One thread drives it; the results of finished transfers are
applied in `poll` / `wait` on that thread.

Contract with the engine (as in vLLM's connector API): the L0 blocks named in
a plan stay allocated to their request until the plan's result is reported —
the engine delays freeing a finished request whose store is in flight — so
the manager needs no per-block pins on the hot path.

Chunks: chunk ``i`` of a request covers its blocks ``[i*bpc, (i+1)*bpc)`` and
is keyed by the hash of its last block (DESIGN §2).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiercache.keys import BlockHash, chunk_keys
from tiercache.tiers.base import Medium
from tiercache.tiers.cpu import CpuTier
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.plan import ChunkCopy, JobId, Priority, TransferPlan, TransferResult


@dataclass(frozen=True, slots=True)
class TierRun:
    """Consecutive chunks ``first_chunk ..`` found in one tier."""
    tier: str
    first_chunk: int
    keys: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    num_computed_blocks: int          # leading blocks the engine holds in L0
    runs: tuple[TierRun, ...]         # chunks after those, tier by tier, in order
    num_hit_blocks: int               # leading blocks available in L0 or any tier
    block_size: int

    @property
    def num_loadable_tokens(self) -> int:
        return (self.num_hit_blocks - self.num_computed_blocks) * self.block_size

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class _InFlight:
    plan: TransferPlan
    tier: CpuTier


class CacheManager:
    def __init__(
        self,
        tiers: Sequence[CpuTier],
        engine: TransferEngine,
        block_size: int,
        blocks_per_chunk: int,
        block_bytes: int,
        store_partial_chunks: bool = False,
    ) -> None:
        for t in tiers:
            if not isinstance(t, CpuTier):  # slower tiers are staged through L1 by their own handlers
                raise TypeError(f"tier {t.name!r} ({t.medium.value}) cannot exchange chunks with L0 directly")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.by_name = {t.name: t for t in tiers}
        self.engine = engine
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        self.store_partial_chunks = store_partial_chunks
        self._in_flight: dict[JobId, _InFlight] = {}

    # -- lookup --------------------------------------------------------------
    def _chunk_bounds(self, index: int, num_blocks: int) -> tuple[int, int]:
        start = index * self.blocks_per_chunk
        return start, min(start + self.blocks_per_chunk, num_blocks)

    def lookup(self, block_hashes: Sequence[BlockHash], num_computed_blocks: int = 0) -> PrefixLookup:
        """Longest run of chunks, after the blocks already in L0, found in any tier.

        Greedy across tiers: at each position the fastest tier holding the
        next chunk serves as long a run as it has; one batched `contains` per
        tier per switch.
        """
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.store_partial_chunks)
        first = num_computed_blocks // self.blocks_per_chunk
        pos, runs = first, []
        while pos < len(keys):
            for tier in self.tiers:
                n = tier.contains(keys[pos:])
                if n:
                    runs.append(TierRun(tier.name, pos, tuple(keys[pos:pos + n])))
                    pos += n
                    break
            else:
                break
        hit_blocks = num_computed_blocks
        if pos > first:
            hit_blocks = max(hit_blocks, self._chunk_bounds(pos - 1, len(block_hashes))[1])
        return PrefixLookup(num_computed_blocks, tuple(runs), hit_blocks, self.block_size)

    # -- plans ---------------------------------------------------------------
    def _submit(self, tier: Tier, src: Medium, dst: Medium, priority: Priority, chunks: list[ChunkCopy]) -> JobId:
        nbytes = sum(len(c.block_ids) for c in chunks) * self.block_bytes
        plan = TransferPlan(self.engine.next_job_id(), src, dst, priority, tuple(chunks), nbytes)
        self._in_flight[plan.job_id] = _InFlight(plan, tier)
        self.engine.submit(plan)
        return plan.job_id

    def plan_load(self, lookup: PrefixLookup, block_ids: Sequence[int], num_blocks: int | None = None) -> list[JobId]:
        """Load every chunk of ``lookup`` into the request's blocks ``block_ids`` (its whole table).

        Blocks the engine already computed are skipped. ``num_blocks`` is the
        request's count of full, hashed blocks (bounds a partial last chunk).
        """
        total = num_blocks if num_blocks is not None else lookup.num_hit_blocks
        if len(block_ids) < lookup.num_hit_blocks:
            raise ValueError(f"{len(block_ids)} block ids for a hit of {lookup.num_hit_blocks} blocks")
        jobs = []
        for run in lookup.runs:
            tier = self.by_name[run.tier]
            slots = tier.prepare_load(run.keys)
            chunks = []
            for i, (key, slot) in enumerate(zip(run.keys, slots)):
                start, end = self._chunk_bounds(run.first_chunk + i, total)
                skip = max(0, lookup.num_computed_blocks - start)
                chunks.append(ChunkCopy(key, slot, tuple(block_ids[start + skip:end]), end - start, skip))
            jobs.append(self._submit(tier, Medium.CPU, Medium.DEVICE, Priority.LOAD, chunks))
        return jobs

    def plan_store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> JobId | None:
        """Store the request's chunks that the first (fastest) tier lacks; None when there is nothing to do.

        ``block_hashes`` are the hashes of the request's full blocks and
        ``block_ids`` its block table. Chunks already present or without room
        are skipped (stores are best effort).
        """
        if not self.tiers:
            return None
        tier = self.tiers[0]
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.store_partial_chunks)
        bounds = [self._chunk_bounds(i, len(block_hashes)) for i in range(len(keys))]
        sizes = [(end - start) * self.block_bytes for start, end in bounds]
        slots = tier.prepare_store(keys, sizes)
        chunks = [
            ChunkCopy(key, slot, tuple(block_ids[start:end]), end - start)
            for key, slot, (start, end) in zip(keys, slots, bounds)
            if slot is not None
        ]
        if not chunks:
            return None
        return self._submit(tier, Medium.DEVICE, Medium.CPU, Priority.STORE, chunks)

    # -- completions ---------------------------------------------------------
    def _apply(self, result: TransferResult) -> None:
        job = self._in_flight.pop(result.job_id)
        tier = job.tier
        if job.plan.dst is Medium.DEVICE:
            tier.complete_load(job.plan.keys)
        else:
            tier.complete_store(job.plan.keys, result.ok)

    def poll(self) -> list[TransferResult]:
        results = self.engine.poll()
        for r in results:
            self._apply(r)
        return results

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> list[TransferResult]:
        results = self.engine.wait(job_ids, timeout)
        for r in results:
            self._apply(r)
        return results

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def stats(self) -> dict[str, object]:
        return {
            "tiers": {t.name: t.stats() for t in self.tiers},
            "transfers": self.engine.stats(),
            "in_flight_jobs": len(self._in_flight),
        }
