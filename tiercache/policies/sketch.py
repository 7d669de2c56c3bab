"""A count-min sketch: approximate access counts of many keys in fixed memory.

``DEPTH`` rows of 4-bit-range counters (uint8 saturating at ``SATURATE``);
a key's counter in each row is picked by multiplying its 64-bit xxh3 digest
by a per-row odd constant and keeping the top bits, so any key of bytes works
and runs are reproducible across processes (unlike ``hash()``). The estimate
is the smallest of the key's counters: never below the true count, above it
only on collisions. Every counter is halved after ``10 * width`` additions so
old popularity fades (TinyLFU's reset). Single keys go through plain Python
integer math on memoryviews of the rows, the four rows written out (a loop
over them cost twice as much: the eviction policies count on the scheduler's
thread); batches through numpy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_M0, _M1, _M2, _M3 = _MULTIPLIERS
_MASK64 = (1 << 64) - 1
_digest = xxhash.xxh3_64_intdigest


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

    def add(self, key: bytes) -> int:
        """Count one access of ``key``; returns its new estimate."""
        d = _digest(key if key.__class__ is bytes else _as_bytes(key))
        shift, (r0, r1, r2, r3), top = self._shift, self._rows, self.SATURATE
        i0, i1 = ((d * _M0) & _MASK64) >> shift, ((d * _M1) & _MASK64) >> shift
        i2, i3 = ((d * _M2) & _MASK64) >> shift, ((d * _M3) & _MASK64) >> shift
        v0, v1, v2, v3 = r0[i0] + 1, r1[i1] + 1, r2[i2] + 1, r3[i3] + 1
        r0[i0] = v0 if v0 < top else top
        r1[i1] = v1 if v1 < top else top
        r2[i2] = v2 if v2 < top else top
        r3[i3] = v3 if v3 < top else top
        self._added(1)
        estimate = min(v0, v1, v2, v3)
        return estimate if estimate < top else top

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
        d = _digest(key if key.__class__ is bytes else _as_bytes(key))
        shift, (r0, r1, r2, r3) = self._shift, self._rows
        return min(r0[((d * _M0) & _MASK64) >> shift], r1[((d * _M1) & _MASK64) >> shift],
                   r2[((d * _M2) & _MASK64) >> shift], r3[((d * _M3) & _MASK64) >> shift])

    def _added(self, n: int) -> None:
        self._additions += n
        if self._additions >= self.halve_every:
            self._table >>= 1
            self._additions = 0
