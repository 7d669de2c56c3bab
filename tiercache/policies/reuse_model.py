"""An online estimate of whether a tier's chunk is asked for again within the tier's horizon.

LRB's question (Song et al., NSDI 2020: "is this object reused before the
Belady boundary?") answered with counts instead of a trained model. Every
chunk a request asks for is an observation in a *cell*: how often the tier
has seen the chunk, how long the request is (chunks, in powers of two), and
how far past the part this tier already holds the chunk lies. An
observation is positive when a request asks for the same chunk again within
``horizon`` chunk sightings, negative when the horizon passes first. The
estimate for a cell is its share of positives, counted only once an
observation is settled — counting a reuse when it happens but a non-reuse
only when the horizon ends would favour whatever cell was seen last.

All state is bounded: the observations not yet settled are at most the
sightings of one horizon, the counts a fixed table of ``CELLS`` cells halved
every ``HALVE_EVERY`` sightings so the estimate follows the workload.

Used by the ``reuse-model`` eviction policy (`eviction.ReuseModelPolicy`),
which weighs each chunk's LFU-DA count by the estimate for its cell.
"""
from __future__ import annotations

from collections.abc import Container, Sequence

COUNT_BUCKETS = 4        # seen 1, 2, 3, 4+ times
LENGTH_BUCKETS = 9       # request of 1, 2-3, 4-7, ... 256+ chunks
OFFSET_BUCKETS = 6       # held here already; then 0, 1, 2-3, 4-7, 8+ chunks past what the tier holds
CONTEXTS = LENGTH_BUCKETS * OFFSET_BUCKETS
CELLS = COUNT_BUCKETS * CONTEXTS
_PAST_HELD = [1 + min(OFFSET_BUCKETS - 2, i.bit_length()) for i in range(8)]   # offset buckets under 8
_COUNT_STEP = [(min(max(count, 1), COUNT_BUCKETS) - 1) * CONTEXTS for count in range(16)]


def _length_base(request_chunks: int) -> int:
    """The first cell of a request of ``request_chunks`` chunks, seen once: its offset bucket (0 inside the
    leading run this tier holds, then `_PAST_HELD`, then the last) and its count's step (`_COUNT_STEP`) are
    added to it."""
    return min(LENGTH_BUCKETS - 1, request_chunks.bit_length() - 1) * OFFSET_BUCKETS


class ReuseModel:
    """P(asked for again within ``horizon`` sightings | cell), as a ratio to the average over all cells.

    The observations of the last horizon lie in a ring indexed by their tick (their cell, whether a reuse
    came, their key); a key's last observation is found by its tick (`_latest`). No object per
    observation: a scheduler that sees tens of thousands of chunks a second would otherwise hand the
    garbage collector as many to scan.
    """

    HALVE_EVERY = 1 << 16        # sightings between halvings of the counts
    MIN_RATIO, MAX_RATIO = 0.25, 4.0

    def __init__(self, horizon: int = 4096) -> None:
        self.horizon = horizon
        self._tick = 0                               # sightings so far
        self._settled_to = 0                         # every observation at a tick up to this one is counted
        self._latest: dict[object, int] = {}         # key → tick of its last observation, while unsettled
        self._size = 0
        self._cells: list[int] = []                  # ring by tick: the observation's cell
        self._keys: list[object] = []                # ... its key
        self._reused = bytearray()                   # ... 1 once a reuse came within the horizon
        self._grow(2 * horizon)
        self._positive = [0.0] * CELLS
        self._observed = [0.0] * CELLS
        self._all_positive = self._all_observed = 0.0
        self._since_halving = 0
        self._rate = [0.5] * CELLS                   # each cell's share of positives, kept as its counts change
        self._per_average = 2.0                      # 1 / the share of positives over all cells

    def _grow(self, size: int) -> None:
        """A ring of ``size`` ticks, the unsettled observations moved into it."""
        cells, keys, reused = [0] * size, [None] * size, bytearray(size)
        for tick in range(self._settled_to + 1, self._tick + 1):
            old, new = tick % self._size, tick % size
            cells[new], keys[new], reused[new] = self._cells[old], self._keys[old], self._reused[old]
        self._size, self._cells, self._keys, self._reused = size, cells, keys, reused

    def observe(self, keys: Sequence[object], held: Container[object]) -> None:
        """A request asks for chunks ``keys`` (a chain, head first); ``held``: the keys the tier holds now."""
        if self._tick + len(keys) - self._settled_to >= self._size or self._size < 2 * self.horizon:
            self._grow(max(2 * self._size, 2 * self.horizon, 2 * len(keys)))
        leading = 0
        for key in keys:
            if key not in held:
                break
            leading += 1
        latest, horizon, size = self._latest, self.horizon, self._size
        cells, ring_keys, reused = self._cells, self._keys, self._reused
        tick = self._tick
        base = _length_base(len(keys))                # the request's cells: base + offset bucket
        for i, key in enumerate(keys):
            tick += 1
            before = latest.get(key)
            if before is not None and tick - before <= horizon:
                reused[before % size] = 1
            past = i - leading
            at = tick % size
            cells[at] = base if past < 0 else base + (_PAST_HELD[past] if past < 8 else OFFSET_BUCKETS - 1)
            ring_keys[at] = key
            reused[at] = 0
            latest[key] = tick
        self._tick = tick
        self._settle(tick - horizon)
        self._since_halving += len(keys)
        if self._since_halving >= self.HALVE_EVERY:
            self._halve()

    def _settle(self, upto: int) -> None:
        """Count the observations made at ticks up to ``upto``: their horizon has passed."""
        if upto <= self._settled_to:
            return
        latest, size, cells, ring_keys, reused = self._latest, self._size, self._cells, self._keys, self._reused
        positive, observed, rate = self._positive, self._observed, self._rate
        came = 0
        for tick in range(self._settled_to + 1, upto + 1):
            at = tick % size
            key, cell = ring_keys[at], cells[at]
            ring_keys[at] = None
            if latest.get(key) == tick:
                del latest[key]
            observed[cell] += 1.0
            if reused[at]:
                positive[cell] += 1.0
                came += 1
            rate[cell] = (positive[cell] + 0.5) / (observed[cell] + 1.0)
        self._all_observed += upto - self._settled_to
        self._all_positive += came
        self._per_average = (self._all_observed + 2.0) / (self._all_positive + 1.0)
        self._settled_to = upto

    def _halve(self) -> None:
        self._since_halving = 0
        self._positive = [x * 0.5 for x in self._positive]
        self._observed = [x * 0.5 for x in self._observed]
        self._all_positive *= 0.5
        self._all_observed *= 0.5
        self._rate = [(p + 0.5) / (n + 1.0) for p, n in zip(self._positive, self._observed)]
        self._per_average = (self._all_observed + 2.0) / (self._all_positive + 1.0)

    def weight(self, key: object, count: int) -> float:
        """How much likelier than the average chunk ``key`` (seen ``count`` times) is to come back within the
        horizon, by its last observation's cell; 1.0 for a key with none in the horizon (nothing to go by).
        Its observation takes the count's cell, so what it settles into is what it was ranked by."""
        tick = self._latest.get(key)
        if tick is None:
            return 1.0
        at = tick % self._size
        self._cells[at] = cell = self._cells[at] % CONTEXTS + _COUNT_STEP[count]
        ratio = self._rate[cell] * self._per_average
        return self.MIN_RATIO if ratio < self.MIN_RATIO else self.MAX_RATIO if ratio > self.MAX_RATIO else ratio

    def __len__(self) -> int:
        """Observations not yet settled (at most a horizon's sightings and one request's)."""
        return self._tick - self._settled_to
