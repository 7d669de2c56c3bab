"""The chunks served most often: which prefixes (system prompts, shared documents) carry the cache.

A count per chunk key, kept in a `collections.Counter` (its ``update`` counts
in C) and pruned to the ``keep`` largest whenever it holds ``16 * keep``
keys, so memory stays bounded however many distinct chunks pass through. A
chunk that stays among the ``keep`` largest across prunes is counted
exactly; one pruned and served again starts over from one. Fed by the
manager with the chunks of every load that landed in L0; read through
`CacheManager.stats` (``hot_chunks``), never exported to Prometheus (one
series per key would be unbounded).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tiercache.contracts.keys import BlockHash


class HotChunks:
    """Scheduler side (and the server): the most read chunks, bounded."""

    def __init__(self, keep: int = 1024) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._counts: Counter[BlockHash] = Counter()

    def add(self, keys: Iterable[BlockHash]) -> None:
        """Count one serving of each key."""
        self._counts.update(keys)
        if len(self._counts) > 16 * self.keep:
            self._counts = Counter(dict(self._counts.most_common(self.keep)))

    def top(self, n: int = 10) -> list[tuple[BlockHash, int]]:
        """The ``n`` most served keys with their counts, most served first."""
        return self._counts.most_common(n)

    def forget(self, keys: Iterable[BlockHash]) -> None:
        """Drop the counts of keys that were purged (a key is a prompt's fingerprint)."""
        for key in keys:
            self._counts.pop(key, None)
