"""A tier that is only an index: the real lifecycle, capacity and eviction, no bytes anywhere.

Used to replay request traces through the hierarchy's own code (`tiercache
bench trace`). Capacity is counted in chunks: every chunk takes one unit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure
from tiercache.index.indexed_tier import Entry, IndexedTier
from tiercache.policies import DEFAULT_EVICTION
from tiercache.tiers.base import LowerIndex


class MetadataIndex(IndexedTier, LowerIndex):
    """Scheduler side only, with no worker: the index a trace replay runs through."""

    def __init__(self, capacity_chunks: int, eviction: str = DEFAULT_EVICTION, name: str = "meta",
                 medium: Medium = Medium.DISK) -> None:
        super().__init__(eviction)
        if capacity_chunks < 1:
            raise ValueError(f"capacity must be at least one chunk, got {capacity_chunks}")
        self.name = name
        self.medium = medium
        self._capacity = capacity_chunks

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def reserve_bytes(self, layout: ChunkLayout) -> int:
        return 1

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        return self._reserve_bytes(keys, [1] * len(keys), self._capacity)   # one unit per chunk

    def complete_store(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {},
                       stored_at: Mapping[BlockHash, float] | None = None) -> None:
        self.publish(keys, failed, stored_at=stored_at)

    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        self.pin(keys)

    def complete_load(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {}) -> None:
        self.unpin(keys)
        self.touch(keys)
        self.counters.loaded += len(keys)

    def _release(self, key: BlockHash, entry: Entry) -> None:
        """Nothing to give back: there are no bytes."""
