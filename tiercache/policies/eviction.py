"""Eviction policies: which resident, unpinned key a tier gives up next.

Used by tier indexes (scheduler or server side); metadata only. A policy sees
keys enter (`insert`), get used (`touch`), leave (`remove`) and picks a
victim (`pop_victim`). Every operation is O(1), or O(log n) for ``lfu-da``.

Tiers touch a request's chunks in reverse chain order (tail first), so with
LRU the head of a prefix is the most recently used and outlives its tail.

A policy may also take hints from the engine about the request that wanted
a chain of chunks (`retain(keys, state)`, keys head first, those the tier
holds): a running or preempted request and a finished one whose
conversation continues want theirs again; a finished one that nothing says
comes back leaves behind what only it asked for. Policies without
``retain`` ignore the hints.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from tiercache.contracts.connector import RequestState
from tiercache.policies.reuse_model import ReuseModel
from tiercache.policies.sketch import CountMinSketch
from tiercache.registry import Registry

Key = Hashable


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def pop_victim(self) -> Key | None: ...

    def __len__(self) -> int: ...


eviction_policies: Registry[type[EvictionPolicy]] = Registry("eviction policy")

# LFU with dynamic aging: a prefix many requests share outranks one a burst of one-offs touched last, and aging
# lets yesterday's popular prefix leave; `bench trace` compares it with the other policies.
DEFAULT_EVICTION = "lfu-da"


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


@eviction_policies.register("s3-fifo")
class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO and a ghost list of keys.

    New keys enter the small queue; one that was hit while there moves to the
    main queue when it reaches the end, the rest leave (remembered as ghosts).
    A ghost that comes back goes straight to the main queue. The main queue is
    a CLOCK-like FIFO: a key hit since its last pass goes around again with its
    count lowered. One-hit wonders — the tail chunks of one-off prompts — leave
    quickly without pushing out reused prefixes. Sizes are relative to how many
    keys the tier holds, so the policy needs no capacity. O(1) amortized.
    """

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def insert(self, key: Key) -> None:
        self.remove(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def touch(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self.MAX_FREQ, self._freq[key] + 1)

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is not None or key in self._small or key in self._main:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def pop_victim(self) -> Key | None:
        while self._small or self._main:
            if self._small and (len(self._small) >= self.SMALL_FRACTION * len(self) or not self._main):
                key, _ = self._small.popitem(last=False)
                if self._freq[key] > 0:          # reused while on probation: promote
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                del self._freq[key]
                self._ghost[key] = None
                while len(self._ghost) > max(1, len(self._main)):
                    self._ghost.popitem(last=False)
                return key
            key, _ = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = None           # around again
                continue
            del self._freq[key]
            return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


@eviction_policies.register("arc")
class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

    T1 holds keys seen once, T2 keys seen again; ghost lists B1/B2 remember
    keys recently evicted from each. A ghost hit in B1 says "recency is
    winning" and grows T1's target share ``p``; a ghost hit in B2 shrinks it.
    The cache size ``c`` is taken as the number of resident keys, which equals
    the capacity whenever the tier is full — the only time it evicts.
    """

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0

    def insert(self, key: Key) -> None:
        self.remove(key)
        c = max(1, len(self))
        if key in self._b1:
            self._p = min(c, self._p + max(len(self._b2) / max(1, len(self._b1)), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / max(1, len(self._b2)), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def pop_victim(self) -> Key | None:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            key, _ = self._t1.popitem(last=False)
            self._b1[key] = None
        elif self._t2:
            key, _ = self._t2.popitem(last=False)
            self._b2[key] = None
        else:
            return None
        c = max(1, len(self))
        while len(self._b1) + len(self._b2) > c:
            (self._b1 if len(self._b1) > len(self._b2) else self._b2).popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


@eviction_policies.register("prefix-lru")
class PrefixLRUPolicy(LRUPolicy):
    """LRU that knows chains: a chunk whose parent has left goes first, and otherwise the least recently
    used chunk that no resident chunk extends (a chain's tail before its head).

    A hit is a leading run of chunks, so a child whose parent is gone can
    never be part of one until the parent comes back; holding it only takes
    room. Callers that know a chunk's parent say so with `link` (the tiers
    forward it from `IndexedTier.link`); chunks never linked behave as under
    LRU. At most ``SCAN`` of the oldest chunks are looked at for a leaf, so a
    victim is found in bounded time.
    """

    SCAN = 64

    def __init__(self) -> None:
        super().__init__()
        self._parent: dict[Key, Key] = {}
        self._children: dict[Key, set[Key]] = {}
        self._orphans: OrderedDict[Key, None] = OrderedDict()

    def link(self, child: Key, parent: Key) -> None:
        if child not in self._order or self._parent.get(child) == parent:
            return
        self._unlink(child)
        self._parent[child] = parent
        self._children.setdefault(parent, set()).add(child)
        if parent not in self._order:
            self._orphans[child] = None

    def insert(self, key: Key) -> None:
        super().insert(key)
        for child in self._children.get(key, ()):   # back: its children are useful again
            self._orphans.pop(child, None)

    def remove(self, key: Key) -> None:
        if key in self._order:
            super().remove(key)
            self._forget(key)

    def pop_victim(self) -> Key | None:
        if self._orphans:
            key, _ = self._orphans.popitem(last=False)
        else:
            key = None
            for i, candidate in enumerate(self._order):
                if i >= self.SCAN:
                    break
                if not self._children.get(candidate):
                    key = candidate
                    break
            if key is None:
                key = next(iter(self._order), None)
                if key is None:
                    return None
        del self._order[key]
        self._forget(key)
        return key

    def _forget(self, key: Key) -> None:
        """``key`` left: it is nobody's child any more, and its children are orphans."""
        self._unlink(key)
        self._orphans.pop(key, None)
        for child in self._children.get(key, ()):
            if child in self._order:
                self._orphans[child] = None

    def _unlink(self, child: Key) -> None:
        parent = self._parent.pop(child, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(child)
                if not siblings:
                    del self._children[parent]


@eviction_policies.register("lfu-da")
class LFUDAPolicy:
    """LFU with dynamic aging (Arlitt et al., 2000): evict the lowest ``age + count``.

    ``count`` is how often the tier has seen the key — stored or hit. While
    the tier holds a key it is counted exactly (up to the sketch's 15); when
    the key leaves, its count goes into a `CountMinSketch`, so it outlives the
    key's stay: a chunk that comes back after an eviction returns with its
    history and is not taken for a one-off. ``age`` is the priority of the
    last victim; a key's priority is fixed when it is stored or hit, so a
    popular key that stops being asked for is overtaken by newer ones and
    leaves in time. Ties go to the least recently used. Keys must be bytes
    (chunk keys).

    Why this is the default: on a prefix cache most chunks are the tails of
    one-off prompts (58% of the Mooncake trace's blocks are asked for once)
    while a chunk asked for twice is likely asked for again; LRU keeps every
    new tail ahead of a reused prefix, this keeps the reused prefix. Tails are
    touched after heads (tiers touch a request's chunks tail first), so among
    equal counts a chain's tail still goes first.

    Cost, on the scheduler's thread: a use is a dict update and a heap push;
    an insert adds one estimate from the sketch (one cache line); the counts
    of keys that left are written into the sketch ``FLUSH`` at a time,
    vectorized (a key that comes back before that finds its count among
    them). The sketch counts over a window of ``HISTORY`` times as many
    departures as the tier holds keys (halving all counts after each window),
    widened as the tier fills so collisions stay rare: a sketch too narrow
    for the keys it sees over-counts one-off chunks and loses most of the
    gain. A heap with lazy deletion: a hit pushes a new entry, stale ones are
    skipped when popped, and the heap is rebuilt once stale entries outnumber
    live ones three to one.
    """

    HISTORY = 128
    FLUSH = 1024

    def __init__(self) -> None:
        self._counts = CountMinSketch()
        self._counts.resize(self.HISTORY * 512)
        self._entries: dict[Key, tuple[float, int, int]] = {}   # resident key → (priority, clock, count)
        self._heap: list[tuple[float, int, Key]] = []
        self._unflushed_counts: dict[Key, int] = {}           # keys gone since the last flush → count
        self._age = 0
        self._clock = 0

    def _value(self, key: Key, count: int) -> float:
        """What keeping ``key`` (seen ``count`` times) is worth, above the age: its count."""
        return count

    def _push(self, key: Key, count: int, bonus: int = 0) -> None:
        self._clock += 1
        priority = self._age + self._value(key, count) + bonus
        self._entries[key] = (priority, self._clock, count)
        if len(self._heap) >= 4 * len(self._entries) + 64:     # mostly stale: rebuild from the live entries
            self._heap = [(e[0], e[1], k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)
        else:
            heapq.heappush(self._heap, (priority, self._clock, key))

    def _count(self, key: Key) -> int:
        """How often the tier has seen ``key`` (0 for a key it never held, or whose count has faded)."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry[2]
        count = self._unflushed_counts.get(key)
        return count if count is not None else self._counts.estimate(key)

    def insert(self, key: Key) -> None:
        count = self._count(key) + 1
        self._unflushed_counts.pop(key, None)
        self._push(key, count if count < CountMinSketch.SATURATE else CountMinSketch.SATURATE)
        if len(self._entries) * self.HISTORY > self._counts.halve_every:
            self._counts.resize(2 * len(self._entries) * self.HISTORY)

    def touch(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            count = entry[2] + 1
            self._push(key, count if count < CountMinSketch.SATURATE else CountMinSketch.SATURATE)

    def _leave(self, key: Key, count: int) -> None:
        unflushed = self._unflushed_counts
        unflushed[key] = count
        if len(unflushed) >= self.FLUSH:
            self._flush()

    def _flush(self) -> None:
        unflushed = self._unflushed_counts
        self._counts.raise_many(list(unflushed), list(unflushed.values()))
        unflushed.clear()

    def remove(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._leave(key, entry[2])

    def pop_victim(self) -> Key | None:
        heap, entries, unflushed = self._heap, self._entries, self._unflushed_counts
        while heap:
            priority, clock, key = heapq.heappop(heap)
            entry = entries.get(key)
            if entry is not None and entry[1] == clock:        # the key's live entry (each push has its own clock)
                del entries[key]
                self._age = priority
                unflushed[key] = entry[2]                       # `_leave`, written out: this is the hot path
                if len(unflushed) >= self.FLUSH:
                    self._flush()
                return key
        return None

    def __len__(self) -> int:
        return len(self._entries)


@eviction_policies.register("lfu-da-state")
class StateLFUDAPolicy(LFUDAPolicy):
    """LFU-DA that takes the engine's word on each request (`retain`).

    Running: a use. Preempted or continuing (a conversation's next turn will
    resend the request): ranked ``RETAIN_BONUS`` uses above their count, tail
    first (the head outlives its tail). Finished with nothing to say it comes
    back: the chunks only this request asked for (counted once) go before any
    other — tail first, the oldest finished request's first — and leave the
    age as it is; a use or a later hint takes one back.

    Why it is not the default: on one tier its finished one-offs leave first,
    which is what the offline optimum does with most of them; with L1 over
    L2 through the real manager, what L1 gives up first is spilled into L2 at
    once and pushes out what L2 would have kept.
    """

    # what a hint is worth, in uses: a small lead, enough to order hinted chunks above their peers
    RETAIN_BONUS = {RequestState.PREEMPTED: 4, RequestState.CONTINUES: 2}

    def __init__(self) -> None:
        super().__init__()
        self._first: OrderedDict[Key, None] = OrderedDict()   # left behind by finished requests: go first

    def _push(self, key: Key, count: int, bonus: int = 0) -> None:
        self._first.pop(key, None)
        super()._push(key, count, bonus)

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._first.pop(key, None)

    def retain(self, keys: Sequence[Key], state: RequestState) -> None:
        if state is RequestState.RUNNING:
            for key in reversed(keys):
                self.touch(key)
            return
        bonus = self.RETAIN_BONUS.get(state)
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            if bonus is not None:
                self._push(key, entry[2], bonus)
            elif entry[2] <= 1:
                self._first[key] = None

    def pop_victim(self) -> Key | None:
        if self._first:
            key, _ = self._first.popitem(last=False)
            self._leave(key, self._entries.pop(key)[2])
            return key
        return super().pop_victim()


@eviction_policies.register("reuse-model")
class ReuseModelPolicy(LFUDAPolicy):
    """LFU-DA whose counts are weighted by a learned estimate of reuse: evict the lowest ``age + count × w``.

    ``w`` (`ReuseModel.weight`) is how much likelier than the average chunk
    this one is to be asked for again within ``HORIZON`` times the tier's
    chunks, learned online from every request the tier is told of
    (`record`) and grouped by what a prefix cache knows of a chunk: how
    often it was seen, how long its request is, how far it lies past what
    the tier already holds. A chunk counted twice in a kind of request that
    rarely comes back ranks below one seen once in a kind that usually does;
    until the model has settled observations, and for a chunk with none in
    the horizon, ``w`` is 1 and this is LFU-DA.

    Cost, on the scheduler's thread: a request's chunks are each an
    observation (`record`: a dict update and, a horizon later, a counter
    added), and each insert or use looks its weight up in a table. Memory:
    the observations of one horizon (a ring and a key → tick table, about
    three times the tier's own entry table), never more than
    ``MAX_HORIZON`` whatever the tier's size.
    """

    HORIZON = 3          # in tier sizes: shorter forgets a reuse the tier could keep, longer blurs the recent past
    MIN_HORIZON = 1024
    MAX_HORIZON = 1 << 22     # sightings: a tier of over 1.4M chunks looks no further ahead (as second-sighting)

    def __init__(self) -> None:
        super().__init__()
        self.model = ReuseModel(self.MIN_HORIZON)

    def record(self, keys: Sequence[Key]) -> None:
        """A request asks for ``keys`` (head first), whichever tier serves them."""
        self.model.horizon = min(self.MAX_HORIZON, max(self.MIN_HORIZON, self.HORIZON * len(self._entries)))
        self.model.observe(keys, self._entries)

    def _value(self, key: Key, count: int) -> float:
        return count * self.model.weight(key, count)
