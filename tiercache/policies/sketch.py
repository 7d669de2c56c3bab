"""A count-min sketch: approximate access counts of many keys in fixed memory.

``DEPTH`` counters per key (uint8 saturating at ``SATURATE``), all in one
64-byte block of the table — one cache line, as Caffeine's TinyLFU lays it
out: the block is picked by the top bits of the key's 64-bit xxh3 digest,
and counter ``j`` is one of the 16 in the block's quarter ``j``, picked by
four low bits of the digest. The table is tens of MiB for a large tier, so
a row per counter would cost a cache miss each; a block costs one, and the
per-key path in Python reads four bytes of one memoryview. (Smaller blocks
would be faster still, but their counters collide together and inflate the
false positives; a 64-byte block keeps a key's counters nearly as
independent as separate rows.) Any key of bytes works and runs are
reproducible across processes (unlike ``hash()``). The estimate is the
smallest of the key's counters: never below the true count, above it only
on collisions. Every counter is halved after ``10 * width`` additions so old
popularity fades (TinyLFU's reset). Single keys are estimated in plain
Python integer math; batches are added and raised through numpy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_digest = xxhash.xxh3_64_intdigest


def _as_bytes(key: object) -> bytes:
    """Chunk keys are bytes; any other key (tests, tools) is counted by its repr."""
    return key if isinstance(key, bytes) else repr(key).encode()


class CountMinSketch:
    DEPTH = 4            # counters per key: one in each quarter of its block
    BLOCK = 64           # counters per block (a 64-byte cache line): DEPTH quarters of 16
    SATURATE = 15

    def __init__(self, width_bits: int = 16, halve_every: int | None = None) -> None:
        """``width_bits``: log2 of the counters each of the ``DEPTH`` rows has (16 of them in each block; at
        least two blocks, so the block index takes at least one bit of the digest)."""
        if not 5 <= width_bits <= 30:
            raise ValueError(f"count-min sketch width_bits must be in [5, 30], got {width_bits}")
        self._table = np.zeros(((1 << width_bits) // 16, self.BLOCK), dtype=np.uint8)
        self._set_width(width_bits)
        self.halve_every = 10 * self.width if halve_every is None else halve_every
        self._additions = 0

    def _set_width(self, width_bits: int) -> None:
        self.width_bits = width_bits
        self.width = 1 << width_bits
        self._shift = 64 - (width_bits - 4)     # the digest's top bits pick one of width / 16 blocks
        self._flat = memoryview(self._table.reshape(-1))

    def resize(self, halve_every: int) -> None:
        """Count over windows of ``halve_every`` additions, widening the table to at least twice that.

        Widening keeps every estimate: a key's block in a table twice as wide
        is its old block followed by one more bit of its hash, so each old
        block is copied into the two that replace it. Never narrows.
        """
        self.halve_every = halve_every
        bits = self.width_bits
        while (1 << bits) < 2 * halve_every and bits < 30:
            bits += 1
        if bits > self.width_bits:
            self._table = np.repeat(self._table, 1 << (bits - self.width_bits), axis=0)
            self._set_width(bits)

    def _slots(self, keys: Sequence[bytes]) -> np.ndarray:
        """Each key's ``DEPTH`` counters, as indexes into the flat table: shape (DEPTH, len(keys))."""
        digests = np.fromiter(map(_digest, map(_as_bytes, keys)), dtype=np.uint64, count=len(keys))
        base = (digests >> np.uint64(self._shift)).astype(np.int64) << 6
        quarter = np.arange(self.DEPTH, dtype=np.int64)[:, None]
        within = ((digests[None, :] >> (4 * quarter).astype(np.uint64)) & np.uint64(15)).astype(np.int64)
        return base[None, :] + 16 * quarter + within

    def add_many(self, keys: Sequence[bytes]) -> None:
        """Count one access of each key (a key listed twice counts once: pass distinct keys)."""
        if not keys:
            return
        flat, slots = self._table.reshape(-1), self._slots(keys)
        flat[slots] = np.minimum(flat[slots] + 1, self.SATURATE)
        self._added(len(keys))

    def raise_many(self, keys: Sequence[bytes], counts: Sequence[int]) -> None:
        """Each key's counters to at least its count (capped at ``SATURATE``): what a tier that counted a key's
        uses exactly while it held it leaves behind when the key goes."""
        if not keys:
            return
        slots = self._slots(keys)
        counts = np.minimum(np.asarray(counts, dtype=np.int64), self.SATURATE).astype(np.uint8)
        np.maximum.at(self._table.reshape(-1), slots, np.broadcast_to(counts, slots.shape))
        self._added(len(keys))

    def estimate(self, key: bytes) -> int:
        d = _digest(key if key.__class__ is bytes else _as_bytes(key))
        flat, base = self._flat, (d >> self._shift) << 6
        return min(flat[base | (d & 15)], flat[base | 16 | (d >> 4 & 15)], flat[base | 32 | (d >> 8 & 15)],
                   flat[base | 48 | (d >> 12 & 15)])

    def _added(self, n: int) -> None:
        self._additions += n
        if self._additions >= self.halve_every:
            self._table >>= 1
            self._additions = 0
