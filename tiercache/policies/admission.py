"""Admission policies: which chunks leaving L1 are worth writing to the next tier down.

Scheduler side, metadata only. A policy sees a chunk's key and how many times
L1 served it to L0, and answers whether to demote it. A policy with a
``record(keys)`` method is also told the chunk keys of every request the
engine admits (once per admission, hit or miss, whichever tier would serve
it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tiercache.contracts.keys import BlockHash
from tiercache.policies.sketch import CountMinSketch
from tiercache.registry import Registry


class AdmissionPolicy(Protocol):
    def admit(self, key: BlockHash, hits: int) -> bool: ...


admission_policies: Registry[type[AdmissionPolicy]] = Registry("admission policy")


@admission_policies.register("always")
class AlwaysAdmit:
    def __init__(self, min_hits: int = 0) -> None:
        """Takes ``min_hits`` only so that every admission policy is built the same way; ignores it."""

    def admit(self, key: BlockHash, hits: int) -> bool:
        return True


@admission_policies.register("min-hits")
class MinHitsAdmit:
    """Demote only chunks L1 served at least ``min_hits`` times: one-off prefixes stay off the disk."""

    def __init__(self, min_hits: int = 1) -> None:
        self.min_hits = min_hits

    def admit(self, key: BlockHash, hits: int) -> bool:
        return hits >= self.min_hits


@admission_policies.register("frequency")
class FrequencyAdmit:
    """Demote chunks that at least ``min_hits + 1`` admitted requests asked for (TinyLFU-style).

    Unlike ``min-hits``, which counts only the times L1 itself served a chunk,
    this counts every request that wanted it, including those that L0 served
    from the engine's own prefix cache, so a popular prefix is not mistaken
    for a one-off. Counts live in a `CountMinSketch` (fixed memory, saturating
    at 15, halved as it fills so old popularity fades), vectorized over a
    request's keys.
    """

    def __init__(self, min_hits: int = 1) -> None:
        self.threshold = min_hits + 1
        self._sketch = CountMinSketch()

    def record(self, keys: Sequence[BlockHash]) -> None:
        self._sketch.add_many(list(dict.fromkeys(keys)))   # a request counts once per chunk

    def estimate(self, key: BlockHash) -> int:
        return self._sketch.estimate(key)

    def admit(self, key: BlockHash, hits: int) -> bool:
        return self.estimate(key) >= self.threshold
