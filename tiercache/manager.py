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
    num_blocks: int                   # blocks the looked-up chunks cover (bounds a partial last chunk)

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
        """Longest run of chunks of a request, after the blocks already in L0, found in any tier."""
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.store_partial_chunks)
        return self.lookup_chunks(keys, len(block_hashes), num_computed_blocks)

    def lookup_chunks(self, keys: Sequence[BlockHash], num_blocks: int, num_computed_blocks: int = 0) -> PrefixLookup:
        """Like `lookup`, for explicit chunk keys covering ``num_blocks`` blocks (e.g. a swapped-out request).

        Greedy across tiers: at each position the fastest tier holding the
        next chunk serves as long a run as it has; one batched `contains` per
        tier per switch.
        """
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
            hit_blocks = max(hit_blocks, self._chunk_bounds(pos - 1, num_blocks)[1])
        return PrefixLookup(num_computed_blocks, tuple(runs), hit_blocks, self.block_size, num_blocks)

    # -- plans ---------------------------------------------------------------
    def _plan(self, tier: CpuTier, src: Medium, dst: Medium, priority: Priority, chunks: list[ChunkCopy]) -> TransferPlan:
        nbytes = sum(len(c.block_ids) for c in chunks) * self.block_bytes
        plan = TransferPlan(self.engine.next_job_id(), src, dst, priority, tuple(chunks), nbytes)
        self._in_flight[plan.job_id] = _InFlight(plan, tier)
        return plan

    def plan_load(self, lookup: PrefixLookup, block_ids: Sequence[int], upto_blocks: int | None = None) -> list[TransferPlan]:
        """Plans that load ``lookup``'s hit into the request's table ``block_ids``, one per tier run.

        Loads blocks ``lookup.num_computed_blocks .. upto_blocks`` (default:
        the whole hit); the chunks involved are pinned in their tier until the
        result is applied.
        """
        limit = lookup.num_hit_blocks if upto_blocks is None else min(upto_blocks, lookup.num_hit_blocks)
        if len(block_ids) < limit:
            raise ValueError(f"{len(block_ids)} block ids for a load of {limit} blocks")
        plans = []
        for run in lookup.runs:
            wanted = []
            for i, key in enumerate(run.keys):
                start, end = self._chunk_bounds(run.first_chunk + i, lookup.num_blocks)
                if start >= limit:
                    break
                wanted.append((key, start, end))
            if not wanted:
                break
            tier = self.by_name[run.tier]
            slots = tier.prepare_load([key for key, _, _ in wanted])
            chunks = []
            for (key, start, end), slot in zip(wanted, slots):
                skip = max(0, lookup.num_computed_blocks - start)
                ids = tuple(block_ids[start + skip:min(end, limit)])
                chunks.append(ChunkCopy(key, slot, ids, end - start, skip))
            plans.append(self._plan(tier, Medium.CPU, Medium.DEVICE, Priority.LOAD, chunks))
        return plans

    def plan_store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], first_chunk: int = 0) -> TransferPlan | None:
        """Plan storing a request's chunks (from ``first_chunk`` on) that the fastest tier lacks.

        ``block_hashes`` are the hashes of the request's full blocks and
        ``block_ids`` its block table. Chunks already present or without room
        are skipped (stores are best effort); None when nothing is left.
        """
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.store_partial_chunks)
        return self.plan_store_chunks(keys, block_ids, len(block_hashes), first_chunk)

    def plan_store_chunks(self, keys: Sequence[BlockHash], block_ids: Sequence[int], num_blocks: int,
                          first_chunk: int = 0, priority: Priority = Priority.STORE) -> TransferPlan | None:
        """Like `plan_store`, for explicit keys of chunks over the first ``num_blocks`` blocks."""
        if not self.tiers or first_chunk >= len(keys):
            return None
        tier = self.tiers[0]
        bounds = [self._chunk_bounds(i, num_blocks) for i in range(first_chunk, len(keys))]
        sizes = [(end - start) * self.block_bytes for start, end in bounds]
        slots = tier.prepare_store(keys[first_chunk:], sizes)
        chunks = [
            ChunkCopy(key, slot, tuple(block_ids[start:end]), end - start)
            for key, slot, (start, end) in zip(keys[first_chunk:], slots, bounds)
            if slot is not None
        ]
        return self._plan(tier, Medium.DEVICE, Medium.CPU, priority, chunks) if chunks else None

    # -- execution and completions -------------------------------------------
    def submit(self, plans: Iterable[TransferPlan | None]) -> list[JobId]:
        return [self.engine.submit(p) for p in plans if p is not None]

    def apply(self, results: Iterable[TransferResult]) -> None:
        """Publish or release what finished transfers reserved; call on the manager's thread."""
        for result in results:
            job = self._in_flight.pop(result.job_id)
            if job.plan.dst is Medium.DEVICE:
                job.tier.complete_load(job.plan.keys)
            else:
                job.tier.complete_store(job.plan.keys, result.ok)

    def cancel(self, plan: TransferPlan) -> TransferResult:
        """A planned transfer that will not run: release its reservations now."""
        result = TransferResult(plan, ok=False, seconds=0.0, error="cancelled", failed_keys=tuple(plan.keys))
        self.apply([result])
        return result

    def poll(self) -> list[TransferResult]:
        results = self.engine.poll()
        self.apply(results)
        return results

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> list[TransferResult]:
        results = self.engine.wait(job_ids, timeout)
        self.apply(results)
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
