"""Eviction policies: which resident, unpinned key a tier gives up next.

Used by tier indexes (scheduler or server side); metadata only. A policy sees
keys enter (`insert`), get used (`touch`), leave (`remove`) and picks a
victim (`pop_victim`). Every operation is O(1).

Tiers touch a request's chunks in reverse chain order (tail first), so with
LRU the head of a prefix is the most recently used and outlives its tail.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

from tiercache.registry import Registry

Key = Hashable


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def pop_victim(self) -> Key | None: ...

    def __len__(self) -> int: ...


eviction_policies: Registry[type[EvictionPolicy]] = Registry("eviction policy")


@eviction_policies.register("lru")
class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Key | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)


@eviction_policies.register("fifo")
class FIFOPolicy(LRUPolicy):
    """Insertion order only; use ignores recency. A baseline for the trace benchmark."""

    def touch(self, key: Key) -> None:
        return None
