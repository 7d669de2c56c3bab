"""Longest-prefix lookups across tiers, and their result: plain data from the manager to a connector.

Scheduler side, bookkeeping only: `PrefixFinder` asks the tier indexes
(fastest first) which chunks they hold; it moves nothing and never waits: a
remote index whose answer is still on its way makes the lookup ``pending``
(the connector answers "ask again"), with the runs found so far kept, so
their promotions can start at once. Where the KV layout has resume points
(`tiercache.contracts.groups`), `ResumePoints` cuts a hit to the last chunk
boundary at which every group can resume.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tiercache.contracts.groups import ChunkSizes, resume_key
from tiercache.contracts.keys import BlockHash, chunk_keys
from tiercache.index.tier_index import Reach, TierIndex


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
    pending: bool = False             # a tier's answer for the chunks after ``runs`` is still on its way
    point: TierRun | None = None      # the resume point the hit ends at (`contracts.groups`), where it lies:
                                      # ``first_chunk`` the chunk it ends, ``keys`` its one key
    found_blocks: int = 0             # with resume points: leading blocks whose chunks the tiers hold, before
                                      # the hit was cut to the last resume point among them

    @property
    def num_loadable_tokens(self) -> int:
        return (self.num_hit_blocks - self.num_computed_blocks) * self.block_size

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.block_size


class PrefixFinder:
    """Finds the longest prefix of a request's chunks across tiers. Chunk ``i`` covers the request's blocks
    ``[i * blocks_per_chunk, (i + 1) * blocks_per_chunk)`` and is keyed by its last block's hash."""

    def __init__(self, tiers: Sequence[TierIndex], block_size: int, blocks_per_chunk: int,
                 partial_chunks: bool = False) -> None:
        self.tiers = list(tiers)
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.partial_chunks = partial_chunks

    def chunk_bounds(self, index: int, num_blocks: int) -> tuple[int, int]:
        start = index * self.blocks_per_chunk
        return start, min(start + self.blocks_per_chunk, num_blocks)

    def lookup(self, block_hashes: Sequence[BlockHash], num_computed_blocks: int = 0) -> PrefixLookup:
        keys = chunk_keys(block_hashes, self.blocks_per_chunk, self.partial_chunks)
        return self.lookup_chunks(keys, len(block_hashes), num_computed_blocks,
                                  block_hashes if self.partial_chunks else None)

    def lookup_chunks(self, keys: Sequence[BlockHash], num_blocks: int, num_computed_blocks: int = 0,
                      block_hashes: Sequence[BlockHash] | None = None) -> PrefixLookup:
        """Greedy across tiers: at each position the fastest tier holding the next chunk serves as long a
        run as it has; one batched `contains` per tier per switch. A tier whose answer is on its way ends
        the walk (pending) after starting the lookups of the remote tiers behind it, so a miss in all of
        them costs one wait, not one per tier.

        With the request's ``block_hashes`` (where requests store their partial last chunks), the walk ends
        on the longest shorter chunk any tier holds where the whole ones stop — a conversation's previous
        turn, which ended inside that chunk (`TierIndex.reach`, asked in the same query) — and the lookup's
        ``num_blocks`` is cut to its end, which bounds it as the last chunk."""
        blocks_per_chunk = self.blocks_per_chunk
        pos, runs, pending = num_computed_blocks // blocks_per_chunk, [], False
        tail: tuple[TierIndex, int] | None = None   # the longest shorter chunk where the walk is: tier, blocks
        while pos < len(keys) and not pending:
            tail = None
            for i, tier in enumerate(self.tiers):
                found = self._ask(tier, keys, pos, block_hashes, num_blocks)
                if found is None:
                    pending = True
                    for later in self.tiers[i + 1:]:     # start the slower tiers' lookups now, side by side
                        if not later.indexed:
                            self._ask(later, keys, pos, block_hashes, num_blocks)
                    break
                n, tail_blocks = found.chunks, found.tail_blocks
                if n:
                    runs.append(TierRun(tier.name, pos, tuple(keys[pos:pos + n])))
                    pos += n
                    break
                if tail_blocks > (tail[1] if tail else 0):
                    tail = (tier, tail_blocks)
            else:
                break
        if tail is not None and not pending and pos * blocks_per_chunk + tail[1] > num_computed_blocks:
            tier, num_blocks = tail[0].name, pos * blocks_per_chunk + tail[1]
            key = block_hashes[num_blocks - 1]
            if runs and runs[-1].tier == tier:
                runs[-1] = TierRun(tier, runs[-1].first_chunk, (*runs[-1].keys, key))
            else:
                runs.append(TierRun(tier, pos, (key,)))
            tail[0].counters.tail_hits += 1
        return self._result(num_computed_blocks, runs, num_blocks, pending)

    def _ask(self, tier: TierIndex, keys: Sequence[BlockHash], pos: int, block_hashes: Sequence[BlockHash] | None,
             num_blocks: int) -> Reach | None:
        if block_hashes is None:
            n = tier.contains(keys[pos:])
            return None if n is None else Reach(n)
        blocks_per_chunk = self.blocks_per_chunk
        return tier.reach(keys[pos:], block_hashes[pos * blocks_per_chunk:num_blocks], blocks_per_chunk)

    def cut(self, lookup: PrefixLookup, tier: str) -> PrefixLookup:
        """``lookup`` cut to its leading runs in ``tier``."""
        runs = []
        for run in lookup.runs:
            if run.tier != tier:
                break
            runs.append(run)
        return self._result(lookup.num_computed_blocks, runs, lookup.num_blocks)

    def _result(self, computed: int, runs: list[TierRun], num_blocks: int, pending: bool = False) -> PrefixLookup:
        hit = computed
        if runs:
            last = runs[-1]
            hit = max(hit, self.chunk_bounds(last.first_chunk + len(last.keys) - 1, num_blocks)[1])
        return PrefixLookup(computed, tuple(runs), hit, self.block_size, num_blocks, pending)


class ResumePoints:
    """Cuts lookups to resume points: a hit of a layout with resume points ends at the last chunk boundary whose
    resume point some tier holds, and is loaded with it (a state is never loaded at another boundary than the
    KV loaded with it). A layout without resume points leaves every lookup as it is."""

    def __init__(self, finder: PrefixFinder, sizes: ChunkSizes) -> None:
        self.finder = finder
        self.sizes = sizes

    def cut(self, lookup: PrefixLookup) -> PrefixLookup:
        """``lookup`` cut to its last resume point (asked of every tier at once, fastest first); none: no hit.
        While a tier's answer is on its way the lookup is pending, its chunk runs kept so their promotions can
        start."""
        if not self.sizes.has_resume_points or lookup.num_hit_blocks <= lookup.num_computed_blocks:
            return lookup
        ends = [(run.first_chunk + i, key) for run in lookup.runs for i, key in enumerate(run.keys)]
        ends.reverse()                                         # the longest hit first
        points = [resume_key(key) for _, key in ends]
        answers = []
        for tier in self.finder.tiers:
            held = tier.present_each(points)
            if held is None:
                return replace(lookup, pending=True)
            answers.append(held)
        for j, (chunk, _) in enumerate(ends):
            tier = next((t for t, held in zip(self.finder.tiers, answers) if held[j]), None)
            if tier is not None:
                return self._cut_after(lookup, chunk, TierRun(tier.name, chunk, (points[j],)))
        return self._cut_after(lookup, -1, None)

    def in_tier(self, lookup: PrefixLookup, tier: str) -> PrefixLookup:
        """``lookup`` cut to its leading runs in ``tier``; with resume points, all of it (its resume point
        included) or nothing."""
        cut = self.finder.cut(lookup, tier)
        if not self.sizes.has_resume_points:
            return cut
        point = lookup.point
        if point is None or point.tier != tier or cut.num_hit_blocks < lookup.num_hit_blocks:
            return self._cut_after(lookup, -1, None)
        return replace(cut, point=point)

    def _cut_after(self, lookup: PrefixLookup, last_chunk: int, point: TierRun | None) -> PrefixLookup:
        """``lookup`` with its runs cut after chunk ``last_chunk`` (-1: none), ending at ``point``."""
        runs = []
        for run in lookup.runs:
            kept = last_chunk + 1 - run.first_chunk
            if kept <= 0:
                break
            runs.append(run if kept >= len(run.keys) else TierRun(run.tier, run.first_chunk, run.keys[:kept]))
        hit = self.finder.chunk_bounds(last_chunk, lookup.num_blocks)[1] if point else lookup.num_computed_blocks
        return replace(lookup, runs=tuple(runs), num_hit_blocks=max(hit, lookup.num_computed_blocks), point=point,
                       found_blocks=max(lookup.found_blocks, lookup.num_hit_blocks))
