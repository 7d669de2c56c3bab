"""Admission policies: which chunks leaving L1 are worth writing to the next tier down.

Scheduler side, metadata only. Every policy is an `AdmissionPolicy`:

- ``admit(key, hits)``: whether to demote a chunk, by its key and how many
  times L1 served it to L0;
- ``size_for(tier)``: the shape of the tier it guards (`GuardedTier`: its
  size, and L1's above it), once, before any request;
- ``record(keys)``: the chunk keys of every request the engine admits (once
  per admission, hit or miss, whichever tier would serve it);
- ``retain(keys, state)``: the engine's hints about a request's state
  (`RequestState`), as eviction policies take them;
- ``admits_into_room``: whether a tier with room takes a chunk unasked;
  ``counts_requests``: whether ``record`` counts what requests ask for.

A policy with nothing to learn from one of these keeps the default, which
ignores it.

Chunks are chains (a chunk's KV is usable only after its predecessors'), so
a caller that asks about a request's chunks in order stops at the first one
refused: a tail admitted without its head could never be hit
(`admitted_prefix`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import xxhash

from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash
from tiercache.policies.eviction import LRUPolicy
from tiercache.policies.sketch import CountMinSketch
from tiercache.registry import Registry


@dataclass(frozen=True, slots=True)
class GuardedTier:
    """What an admission policy guards: a tier of ``chunks`` chunks below an L1 of ``l1_chunks`` (0: nothing above
    it — a request's missing chunks go straight in)."""

    chunks: int
    l1_chunks: int = 0


class AdmissionPolicy(ABC):
    """Which chunks a tier takes. Only `admit` must be written; the other calls default to ignoring what they
    are told."""

    admits_into_room: ClassVar[bool] = False
    """The policy guards hits, not writes: a tier with room takes a chunk unasked (refusing one that would
    evict nothing only loses its hit)."""
    counts_requests: ClassVar[bool] = False
    """`record` counts the requests that ask for a chunk, so the policy can judge a chunk no tier has served yet
    (it can guard the tier a request's chunks enter)."""

    @abstractmethod
    def admit(self, key: BlockHash, hits: int) -> bool:
        """Whether chunk ``key``, which L1 served to L0 ``hits`` times, goes into the guarded tier."""

    def size_for(self, tier: GuardedTier) -> None:
        """The policy guards ``tier``; told once, before any request. By default the size changes nothing."""

    def record(self, keys: Sequence[BlockHash]) -> None:
        """The engine admitted a request that wants chunks ``keys`` (head first). By default nothing is counted."""

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's hint on the request that wants chunks ``keys`` (head first). By default it is ignored."""


admission_policies: Registry[type[AdmissionPolicy]] = Registry("admission policy")

# What the tiers below L1 admit by default (disk, the server's store, `bench trace`'s hierarchy): it follows
# second-sighting where that keeps one-offs from evicting what comes back, and admits everything near a tier's
# ceiling, where second-sighting loses hits. L1's own door (`cpu.admission`) admits everything.
DEFAULT_ADMISSION = "adaptive-sighting"


@admission_policies.register("always")
class AlwaysAdmit(AdmissionPolicy):
    def __init__(self, min_hits: int = 0) -> None:
        """Takes ``min_hits`` only so that every admission policy is built the same way; ignores it."""

    def admit(self, key: BlockHash, hits: int) -> bool:
        return True


@admission_policies.register("min-hits")
class MinHitsAdmit(AdmissionPolicy):
    """Demote only chunks L1 served at least ``min_hits`` times: one-off prefixes stay off the disk."""

    def __init__(self, min_hits: int = 1) -> None:
        self.min_hits = min_hits

    def admit(self, key: BlockHash, hits: int) -> bool:
        return hits >= self.min_hits


@admission_policies.register("frequency")
class FrequencyAdmit(AdmissionPolicy):
    """Demote chunks that at least ``min_hits + 1`` admitted requests asked for (TinyLFU-style).

    Unlike ``min-hits``, which counts only the times L1 itself served a chunk,
    this counts every request that wanted it, including those that L0 served
    from the engine's own prefix cache, so a popular prefix is not mistaken
    for a one-off. Counts live in a `CountMinSketch` (fixed memory, saturating
    at 15, halved as it fills so old popularity fades), vectorized over a
    request's keys.
    """

    counts_requests = True

    def __init__(self, min_hits: int = 1) -> None:
        self.threshold = min_hits + 1
        self._sketch = CountMinSketch()

    def record(self, keys: Sequence[BlockHash]) -> None:
        self._sketch.add_many(list(dict.fromkeys(keys)))   # a request counts once per chunk

    def estimate(self, key: BlockHash) -> int:
        return self._sketch.estimate(key)

    def admit(self, key: BlockHash, hits: int) -> bool:
        return self.estimate(key) >= self.threshold


GHOST_FACTOR = 8               # keys remembered per chunk the guarded tier holds: fewer lose hits, more gain none
MAX_GHOST_KEYS = 1 << 22       # the history's bound whatever the tier's size (about 0.5 GiB at most)


@admission_policies.register("second-sighting")
class SecondSightingAdmit(AdmissionPolicy):
    """Admit a chunk the second time a request asks for it within a ghost history, or once L1 served it.

    Most of a conversation trace's chunks are asked for once: a tier that admits them evicts what comes back
    to keep what will not. The history is a table of recently requested keys
    (their 64-bit hashes: a collision admits a chunk early, never refuses one), in order of last request, with
    how many requests asked for each: ``GHOST_FACTOR`` times the guarded tier's chunks (`size_for`), never
    more than ``MAX_GHOST_KEYS`` — a key that falls off it starts over, so its memory is bounded by
    construction. ``min_hits``: L1 hits that admit a chunk
    without a second sighting (0: never). It guards hits, not writes: a tier with room takes a chunk unasked
    (``admits_into_room``), since refusing one that would evict nothing only loses its hit."""

    admits_into_room = True
    counts_requests = True

    def __init__(self, min_hits: int = 1, ghost_keys: int = 1 << 16) -> None:
        self.min_hits = min_hits
        self.ghost_keys = ghost_keys
        self._seen: OrderedDict[int, int] = OrderedDict()   # hash(key) → requests that asked, last-asked last

    def size_for(self, tier: GuardedTier) -> None:
        self.ghost_keys = max(1, min(MAX_GHOST_KEYS, GHOST_FACTOR * tier.chunks))
        while len(self._seen) > self.ghost_keys:
            self._seen.popitem(last=False)

    def record(self, keys: Sequence[BlockHash]) -> None:
        self._sight(dict.fromkeys(keys))         # a request counts once per chunk

    def _sight(self, unique: Iterable[BlockHash]) -> None:
        seen = self._seen
        for key in unique:
            h = hash(key)
            seen[h] = seen.pop(h, 0) + 1
        while len(seen) > self.ghost_keys:
            seen.popitem(last=False)

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """A request that comes back (preempted, or a conversation that continues) vouches for its chunks: they
        count as sighted twice — a conversation's new turn is always a first sighting, and refusing it would
        lose the next turn's hit."""
        if state in (RequestState.PREEMPTED, RequestState.CONTINUES):
            seen = self._seen
            for key in dict.fromkeys(keys):
                h = hash(key)
                seen[h] = max(seen.pop(h, 0), 2)
            while len(seen) > self.ghost_keys:
                seen.popitem(last=False)

    def sightings(self, key: BlockHash) -> int:
        return self._seen.get(hash(key), 0)

    def admit(self, key: BlockHash, hits: int) -> bool:
        return (self.min_hits > 0 and hits >= self.min_hits) or self.sightings(key) >= 2


SHADOW_SLOTS = 512             # a shadow tier's chunks at least (or the whole tier, when it is smaller) ...
SHADOW_SHARE = 4               # ... and at least this share of the tier's chunks (a smaller share tells too late)
MAX_SHADOW_SLOTS = 1 << 16     # ... and at most this many, whatever the tier's size
DUEL_BOUND = 256               # the miss difference the duel saturates at (lower: it leaves second-sighting too soon)
DUEL_SWITCH = 64               # ... and the one that switches the real tier's rule (near zero: noise switches it)


class _ShadowTier(LRUPolicy):
    """An LRU tier (`LRUPolicy`) of at most ``slots`` chunk keys: a scaled-down copy of a real tier in
    `AdaptiveSightingAdmit`'s duel. LRU whatever the real tier's policy: the duel only ranks two admission rules
    against each other, and LRU is the cheapest shadow per chunk that ranks them."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    @property
    def has_room(self) -> bool:
        return len(self._order) < self.slots

    def hit(self, key: bytes) -> bool:
        """A request asks for ``key``: whether the tier holds it (a use if it does)."""
        if key in self._order:
            self._order.move_to_end(key)
            return True
        return False

    def store(self, key: bytes) -> bytes | None:
        """Put ``key`` in; the key that leaves to make room, if any (``key`` itself for a tier of no slots)."""
        if not self.slots:
            return key
        self.insert(key)
        return self.pop_victim() if len(self._order) > self.slots else None


@admission_policies.register("adaptive-sighting")
class AdaptiveSightingAdmit(SecondSightingAdmit):
    """`second-sighting` while it pays, `always` while it does not, chosen by what two sampled shadow tiers miss.

    A second-sighting guard wins on a tier small against its working set (a one-off admitted evicts what comes
    back) and loses near the working set's size (a chunk refused at its first sighting is a hit lost where the
    tier could have kept it). Which regime a tier is in depends
    on the workload of the moment, so this guard measures it: the chunks whose key falls in a fixed sample of
    the key space (SHARDS-style spatial sampling, Waldspurger et al., FAST 2015) also go through a copy of the
    hierarchy scaled down by the same share, where two copies of the guarded tier take what a copy of L1
    spills, one everything, one on a second sighting; a saturating counter of the difference of their misses
    (set dueling, Qureshi et al., ISCA 2007) chooses the rule the real tier follows (the picky copy admits on
    sightings alone: ``min_hits``, L1's own hits, is left out of the model). It starts as `always`: without
    evidence it is the tier's own policy, and it switches only on a lead of ``DUEL_SWITCH`` misses.
    Memory: three shadows of a quarter of their tiers' chunks (at most ``MAX_SHADOW_SLOTS`` each), beside the
    history."""

    def __init__(self, min_hits: int = 1, ghost_keys: int = 1 << 16) -> None:
        super().__init__(min_hits, ghost_keys)
        self._shadow(GuardedTier(SHADOW_SLOTS))
        self.duel = 0                            # the picky shadow's misses less the other's, lately
        self.admits_all = True

    def size_for(self, tier: GuardedTier) -> None:
        super().size_for(tier)
        self._shadow(tier)

    def _shadow(self, tier: GuardedTier) -> None:
        """Scaled-down copies of L1 and of ``tier`` under it, and the share of keys they see."""
        slots = min(tier.chunks, MAX_SHADOW_SLOTS, max(SHADOW_SLOTS, tier.chunks // SHADOW_SHARE))
        self._sample_below = (1 << 64) * slots // tier.chunks    # keys hashing (64 bits) below this are sampled
        self._l1 = _ShadowTier(min(MAX_SHADOW_SLOTS, tier.l1_chunks * slots // tier.chunks))
        self._always, self._picky = _ShadowTier(slots), _ShadowTier(slots)

    def record(self, keys: Sequence[BlockHash]) -> None:
        unique = dict.fromkeys(keys)
        self._sight(unique)
        below, l1, always, picky = self._sample_below, self._l1, self._always, self._picky
        run_always = run_picky = True         # a hit is a leading run: a chunk held after a miss is no hit
        for key in unique:
            if xxhash.xxh3_64_intdigest(key) >= below or l1.hit(key):
                continue
            run_always = always.hit(key) and run_always
            run_picky = picky.hit(key) and run_picky
            duel = self.duel + run_always - run_picky
            self.duel = duel = max(-DUEL_BOUND, min(DUEL_BOUND, duel))
            if abs(duel) >= DUEL_SWITCH:
                self.admits_all = duel > 0
            spilled = l1.store(key)             # computed or promoted, it enters L1; what L1 gives up goes down
            if spilled is not None:
                if spilled not in always:
                    always.store(spilled)
                if spilled not in picky and (picky.has_room or self.sightings(spilled) >= 2):
                    picky.store(spilled)

    def admit(self, key: BlockHash, hits: int) -> bool:
        return self.admits_all or super().admit(key, hits)


def admission_for(name: str, min_hits: int, tier: GuardedTier) -> AdmissionPolicy:
    """Admission policy ``name`` guarding ``tier`` (told its shape)."""
    policy = admission_policies.get(name)(min_hits)
    policy.size_for(replace(tier, chunks=max(1, tier.chunks)))
    return policy


NOT_AN_ENTRY_GUARD = "counts L1's own hits, and a chunk being stored has none: use always, frequency or second-sighting"


def guards_entry(name: str) -> bool:
    """Whether admission policy ``name`` can guard the tier a request's chunks enter (L1): it takes everything or
    counts requests (``counts_requests``) — a policy counting the guarded tier's own hits never admits a chunk
    being stored, which has none. Raises `RegistryError` for an unknown name."""
    return name == "always" or admission_policies.get(name).counts_requests


def admitted_prefix(policy: AdmissionPolicy | None, keys: Sequence[BlockHash], hits: int = 0, room: int = 0) -> int:
    """How many of a chain's ``keys``, from its head, ``policy`` admits: it stops at the first refused. For a
    policy that ``admits_into_room``, the first ``room`` go in unasked — the tier has room for them without
    evicting anything (other policies also save the tier's writes, and are asked about each)."""
    if policy is None:
        return len(keys)
    unasked = min(room, len(keys)) if policy.admits_into_room else 0
    for i in range(unasked, len(keys)):
        if not policy.admit(keys[i], hits):
            return i
    return len(keys)
