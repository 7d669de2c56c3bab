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

import numpy as np

from tiercache.keys import BlockHash
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
    for a one-off. Counts live in a count-min sketch (``DEPTH`` rows of
    ``WIDTH`` counters saturating at 15, each row indexed by a multiplicative
    hash of the key's 64-bit words folded together), halved every ``10 *
    WIDTH`` additions so old popularity fades. O(1) memory; vectorized over a
    request's keys.
    """

    WIDTH_BITS = 16
    WIDTH = 1 << WIDTH_BITS
    DEPTH = 4
    SATURATE = 15
    _MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                            dtype=np.uint64)[:, None]

    def __init__(self, min_hits: int = 1) -> None:
        self.threshold = min_hits + 1
        self._table = np.zeros((self.DEPTH, self.WIDTH), dtype=np.uint8)
        self._additions = 0

    def _index(self, keys: Sequence[bytes]) -> np.ndarray:
        """``[DEPTH, n]`` counter indexes of ``keys``."""
        words = np.frombuffer(b"".join(bytes(k).ljust(32, b"\0")[:32] for k in keys), dtype="<u8").reshape(-1, 4)
        folded = words[:, 0] ^ words[:, 1] ^ words[:, 2] ^ words[:, 3]
        with np.errstate(over="ignore"):
            return (folded[None, :] * self._MULTIPLIERS) >> np.uint64(64 - self.WIDTH_BITS)

    def record(self, keys: Sequence[BlockHash]) -> None:
        keys = list(dict.fromkeys(keys))   # a request counts once per chunk
        if not keys:
            return
        idx = self._index(keys)
        rows = np.arange(self.DEPTH)[:, None]
        current = self._table[rows, idx]
        self._table[rows, idx] = np.minimum(current + 1, self.SATURATE)
        self._additions += len(keys)
        if self._additions >= 10 * self.WIDTH:
            self._table >>= 1
            self._additions = 0

    def estimate(self, key: BlockHash) -> int:
        idx = self._index([key])
        return int(self._table[np.arange(self.DEPTH), idx[:, 0]].min())

    def admit(self, key: BlockHash, hits: int) -> bool:
        return self.estimate(key) >= self.threshold
