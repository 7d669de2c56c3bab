"""Admission policies: which chunks leaving L1 are worth writing to the next tier down.

Scheduler side, metadata only. A policy sees a chunk's key and how many times
L1 served it to L0, and answers whether to demote it. A policy with a
``record(keys)`` method is also told the chunk keys of every request the
engine admits (once per admission, hit or miss, whichever tier would serve
it); one with ``size_for(tier_chunks)`` is told the size of the tier it
guards, once, before any request; one with ``retain(keys, state)`` takes the
engine's hints about a request's state (`RequestState`), as eviction
policies do.

Chunks are chains (a chunk's KV is usable only after its predecessors'), so
a caller that asks about a request's chunks in order stops at the first one
refused: a tail admitted without its head could never be hit
(`admitted_prefix`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tiercache.contracts.connector import RequestState
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


GHOST_FACTOR = 8               # keys remembered per chunk the guarded tier holds (4: 2 % less hit, 16: no more)
MAX_GHOST_KEYS = 1 << 22       # the history's bound whatever the tier's size (about 0.5 GiB at most)


@admission_policies.register("second-sighting")
class SecondSightingAdmit:
    """Admit a chunk the second time a request asks for it within a ghost history, or once L1 served it.

    Most of a conversation trace's chunks are asked for once (RESULTS.md, "Trace replay"): a tier that admits
    them evicts what comes back to keep what will not. The history is a table of recently requested keys
    (their 64-bit hashes: a collision admits a chunk early, never refuses one), in order of last request, with
    how many requests asked for each: ``GHOST_FACTOR`` times the guarded tier's chunks (`size_for`), never
    more than ``MAX_GHOST_KEYS`` — a key that falls off it starts over, so its memory is bounded by
    construction (RESULTS.md, "Admission on the second sighting"). ``min_hits``: L1 hits that admit a chunk
    without a second sighting (0: never). It guards hits, not writes: a tier with room takes a chunk unasked
    (``admits_into_room``), since refusing one that would evict nothing only loses its hit."""

    admits_into_room = True

    def __init__(self, min_hits: int = 1, ghost_keys: int = 1 << 16) -> None:
        self.min_hits = min_hits
        self.ghost_keys = ghost_keys
        self._seen: OrderedDict[int, int] = OrderedDict()   # hash(key) → requests that asked, last-asked last

    def size_for(self, tier_chunks: int) -> None:
        self.ghost_keys = max(1, min(MAX_GHOST_KEYS, GHOST_FACTOR * tier_chunks))
        while len(self._seen) > self.ghost_keys:
            self._seen.popitem(last=False)

    def record(self, keys: Sequence[BlockHash]) -> None:
        seen = self._seen
        for key in dict.fromkeys(keys):          # a request counts once per chunk
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


def admission_for(name: str, min_hits: int, tier_chunks: int) -> AdmissionPolicy:
    """Admission policy ``name`` guarding a tier of ``tier_chunks`` chunks (told its size if it asks)."""
    policy = admission_policies.get(name)(min_hits)
    size_for = getattr(policy, "size_for", None)
    if size_for is not None:
        size_for(max(1, tier_chunks))
    return policy


NOT_AN_ENTRY_GUARD = "counts L1's own hits, and a chunk being stored has none: use always, frequency or second-sighting"


def guards_entry(name: str) -> bool:
    """Whether admission policy ``name`` can guard the tier a request's chunks enter (L1): it takes everything or
    counts requests (``record``) — a policy counting the guarded tier's own hits never admits a chunk being
    stored, which has none. Raises `RegistryError` for an unknown name."""
    return name == "always" or hasattr(admission_policies.get(name), "record")


def admitted_prefix(policy: AdmissionPolicy | None, keys: Sequence[BlockHash], hits: int = 0, room: int = 0) -> int:
    """How many of a chain's ``keys``, from its head, ``policy`` admits: it stops at the first refused. For a
    policy that ``admits_into_room``, the first ``room`` go in unasked — the tier has room for them without
    evicting anything (other policies also save the tier's writes, and are asked about each)."""
    if policy is None:
        return len(keys)
    unasked = min(room, len(keys)) if getattr(policy, "admits_into_room", False) else 0
    for i in range(unasked, len(keys)):
        if not policy.admit(keys[i], hits):
            return i
    return len(keys)
