"""A count-min sketch: approximate access counts of many keys in fixed memory.

``DEPTH`` rows of 4-bit-range counters (uint8 saturating at ``SATURATE``);
a key's counter in each row is picked by multiplying its 64-bit xxh3 digest
by a per-row odd constant and keeping the top bits, so any key of bytes works
and runs are reproducible across processes (unlike ``hash()``). The estimate
is the smallest of the key's counters: never below the true count, above it
only on collisions. Every counter is halved after ``10 * width`` additions so
old popularity fades (TinyLFU's reset). Single keys go through plain Python
integer math on memoryviews of the rows; batches through numpy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1


def _as_bytes(key: object) -> bytes:
    """Chunk keys are bytes; any other key (tests, tools) is counted by its repr."""
    return key if isinstance(key, bytes) else repr(key).encode()


class CountMinSketch:
    DEPTH = len(_MULTIPLIERS)
    SATURATE = 15

    def __init__(self, width_bits: int = 16, halve_every: int | None = None) -> None:
        if not 4 <= width_bits <= 30:
            raise ValueError(f"count-min sketch width_bits must be in [4, 30], got {width_bits}")
        self.width_bits = width_bits
        self.width = 1 << width_bits
        self._shift = 64 - width_bits
        self._table = np.zeros((self.DEPTH, self.width), dtype=np.uint8)
        self._rows = [memoryview(self._table[r]) for r in range(self.DEPTH)]
        self._multipliers = np.array(_MULTIPLIERS, dtype=np.uint64)[:, None]
        self.halve_every = 10 * self.width if halve_every is None else halve_every
        self._additions = 0

    def resize(self, halve_every: int) -> None:
        """Count over windows of ``halve_every`` additions, widening the table to at least twice that.

        Widening keeps every estimate: a key's slot in a table twice as wide
        is its old slot followed by one more bit of its hash, so each old
        counter is copied into the two that replace it. Never narrows.
        """
        self.halve_every = halve_every
        bits = self.width_bits
        while (1 << bits) < 2 * halve_every and bits < 30:
            bits += 1
        if bits > self.width_bits:
            self._table = np.repeat(self._table, 1 << (bits - self.width_bits), axis=1)
            self._rows = [memoryview(self._table[r]) for r in range(self.DEPTH)]
            self.width_bits, self.width, self._shift = bits, 1 << bits, 64 - bits

    def _slots(self, key: bytes) -> list[int]:
        digest = xxhash.xxh3_64_intdigest(_as_bytes(key))
        return [((digest * m) & _MASK64) >> self._shift for m in _MULTIPLIERS]

    def add(self, key: bytes) -> int:
        """Count one access of ``key``; returns its new estimate."""
        estimate = self.SATURATE
        for row, slot in zip(self._rows, self._slots(key)):
            value = min(row[slot] + 1, self.SATURATE)
            row[slot] = value
            estimate = min(estimate, value)
        self._added(1)
        return estimate

    def add_many(self, keys: Sequence[bytes]) -> None:
        """Count one access of each key (a key listed twice counts once: pass distinct keys)."""
        if not keys:
            return
        digests = np.fromiter((xxhash.xxh3_64_intdigest(_as_bytes(k)) for k in keys), dtype=np.uint64, count=len(keys))
        with np.errstate(over="ignore"):
            slots = (digests[None, :] * self._multipliers) >> np.uint64(self._shift)
        rows = np.arange(self.DEPTH)[:, None]
        self._table[rows, slots] = np.minimum(self._table[rows, slots] + 1, self.SATURATE)
        self._added(len(keys))

    def estimate(self, key: bytes) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key)))

    def _added(self, n: int) -> None:
        self._additions += n
        if self._additions >= self.halve_every:
            self._table >>= 1
            self._additions = 0
