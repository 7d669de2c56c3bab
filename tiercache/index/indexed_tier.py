"""The chunk index every storing tier shares: entries, their two-phase lifecycle, pins and eviction order.

Scheduler side (one thread): L1 and the disk tier on the client, and the
cache server's memory and disk stores. A subclass decides what the room of an
entry is (an L1 slot, a file on every rank) by implementing `_release` — give
back the room of an entry that leaves — and its own ``prepare_store``
(reserving that room).

Lifecycle of a key: reserved (``ready=False``, invisible to `contains`) →
published by `publish` (ready, evictable) → pinned while a transfer reads it
(`pin` / `unpin`; never evicted while pinned) → evicted or deleted.

The eviction policy sees inserts (publish), uses (`touch`, on a hit) and
removals; pins are not its business: a pinned victim it proposes is set aside
and offered again after the eviction.

Retention (``retention_s``, 0: none; on the server a namespace may have its
own, ``retention_by_namespace``): an entry older than that since it was
stored is never served — `has`, `contains` and `pin` pass it by — and
`expire` removes it (its room given back as for any removal), soonest first
from a heap of deadlines (``Entry.expires_at``), so a sweep costs only what it
removes. Age is wall-clock time (a disk tier's chunks keep their file's time
across restarts).

Purges (`purge`): what a `PurgeOrder`'s selector picks leaves at once; a
pinned entry (being read) or a reservation (being written) is marked and
becomes unreadable at once, and goes when its last reader unpins it or when
it would have been published.
"""
from __future__ import annotations

import heapq
import math
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES, BlockHash
from tiercache.contracts.plan import Failure
from tiercache.index.tier_index import TierIndex
from tiercache.policies import eviction_policies


@dataclass(slots=True)
class Entry:
    nbytes: int
    slot: int = -1       # L1 only: where the bytes are
    ready: bool = False
    pins: int = 0
    hits: int = 0        # loads served from this tier
    private: bool = False  # L1 only: a preempted request's swap copy, never written to a lower tier
    stored_at: float = 0.0  # wall-clock seconds when it became readable (retention counts from it)
    expires_at: float = math.inf  # stored_at + its retention: not served, and removed, after this
    parent: bytes | None = None  # the chunk before it in its request (`link`), for purges by prompt
    purged: bool = False    # purged while pinned or reserved: unreadable, dropped when let go
    hint: RequestState | None = None  # the engine's word on its request, heard while it was being written
    chunk_blocks: int = -1  # L1 only: the blocks a chunk covers (`contracts.groups.RESUME_POINT` for a resume point)


class IndexedTier(TierIndex):
    """The index base the client tiers (scheduler side) and the server's stores share."""

    def __init__(self, eviction: str, retention_s: float = 0.0,
                 retention_by_namespace: Mapping[bytes, float] | None = None) -> None:
        super().__init__()
        self.policy = eviction_policies.get(eviction)()
        self.entries: dict[BlockHash, Entry] = {}
        self._used = 0
        self.retention_s = retention_s
        # the server's keys begin with their namespace: one may keep its chunks for a time of its own
        self.retention_by_namespace = dict(retention_by_namespace or {})
        self._ages = retention_s > 0 or any(r > 0 for r in self.retention_by_namespace.values())
        self.clock: Callable[[], float] = time.time      # wall clock: a file's time carries across restarts
        self._deadlines: list[tuple[float, BlockHash]] = []   # heap of (expires_at, key), kept only with retention

    def _now(self) -> float:
        """What entries' deadlines are compared with (-inf without any retention: nothing expires)."""
        return self.clock() if self._ages else -math.inf

    def _retention(self, key: BlockHash) -> float:
        if self.retention_by_namespace:
            own = self.retention_by_namespace.get(key[:NAMESPACE_DIGEST_BYTES])
            if own is not None:
                return own
        return self.retention_s

    def _readable(self, entry: Entry | None, now: float) -> bool:
        return entry is not None and entry.ready and entry.expires_at >= now and not entry.purged

    def _stamp(self, key: BlockHash, entry: Entry, at: float | None = None) -> None:
        entry.stored_at = self.clock() if at is None else at
        keep = self._retention(key) if self._ages else 0.0
        entry.expires_at = entry.stored_at + keep if keep > 0 else math.inf
        if keep > 0:
            heapq.heappush(self._deadlines, (entry.expires_at, key))   # a chunk copied in may be older than others

    def stored_times(self, keys: Sequence[BlockHash]) -> dict[BlockHash, float]:
        return {key: entry.stored_at for key in keys if (entry := self.entries.get(key)) is not None and entry.ready}

    def expire(self) -> list[BlockHash]:
        """Remove the entries past retention (pinned ones at a later sweep); returns their keys."""
        if not self._deadlines:
            return []
        now = self._now()
        gone: list[BlockHash] = []
        busy: list[tuple[float, BlockHash]] = []
        while self._deadlines and self._deadlines[0][0] < now:
            at, key = heapq.heappop(self._deadlines)
            entry = self.entries.get(key)
            if entry is None or not entry.ready or entry.expires_at != at:
                continue                          # gone already, or stored again since
            if entry.pins:
                busy.append((at, key))
                continue
            self._drop(key, entry)
            gone.append(key)
        for item in busy:
            heapq.heappush(self._deadlines, item)
        self.counters.expired += len(gone)
        return gone

    @abstractmethod
    def _release(self, key: BlockHash, entry: Entry) -> None:
        """Give back the room ``entry`` held (it has left the index)."""

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_chunks(self) -> int:
        return len(self.entries)

    def has(self, key: BlockHash) -> bool:
        return self._readable(self.entries.get(key), self._now())

    def contains(self, keys: Sequence[BlockHash]) -> int:
        entries = self.entries
        now = self._now()
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.ready or entry.expires_at < now or entry.purged:
                break
            n += 1
        return self.count_lookup(len(keys), n)

    def held_keys(self) -> list[BlockHash]:
        now = self._now()
        return [key for key, entry in self.entries.items() if entry.ready and not entry.private
                and entry.expires_at >= now and not entry.purged]

    def links(self) -> list[tuple[bytes, bytes | None]]:
        """(key, parent) of every entry whose parent is known: the chains a purge by prompt follows."""
        return [(key, entry.parent) for key, entry in self.entries.items() if entry.parent is not None]

    def purge(self, chosen: Callable[[bytes, float], bool]) -> tuple[list[bytes], int]:
        """Take out every entry ``chosen(key, stored_at)`` picks: (their keys, their bytes). A pinned one or a
        reservation is unreadable from now on and goes when let go (`unpin`, `publish`)."""
        gone = [(key, entry) for key, entry in self.entries.items()
                if not entry.purged and chosen(key, entry.stored_at)]
        for key, entry in gone:
            if entry.pins or not entry.ready:
                entry.purged = True
            else:
                self._drop(key, entry)
        self.counters.purged += len(gone)
        return [key for key, _ in gone], sum(entry.nbytes for _, entry in gone)

    def delete(self, keys: Sequence[BlockHash]) -> int:
        removed = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.ready and entry.pins == 0:
                self._drop(key, entry)
                removed += 1
        self.counters.deleted += removed
        return removed

    def _reserve(self, key: BlockHash, entry: Entry) -> None:
        self.entries[key] = entry
        self._used += entry.nbytes

    def publish(self, keys: Sequence[BlockHash],
                failed: Mapping[BlockHash, Failure] | Sequence[BlockHash] = (), own_errors: bool = True,
                stored_at: Mapping[BlockHash, float] | None = None) -> None:
        """Make written keys visible and drop the ``failed`` ones (each with why, or a plain list: failed
        writes): a store given up on is counted as dropped under its reason, any other failure as failed and
        as this tier's error unless ``own_errors`` is False (the copy failed at its source, which counts it).
        ``stored_at``: when the chunks copied here from another tier were first stored (their retention keeps
        running; default now).

        Keys are published tail first so that, under LRU, a chain's head is the
        most recently used and outlives its tail.
        """
        whys = failed if isinstance(failed, Mapping) else dict.fromkeys(failed, Failure.IO)
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is None or entry.ready:
                continue
            if entry.purged:
                self._drop(key, entry)
                self.counters.store_dropped_purged += 1
            elif key in whys:
                self._drop(key, entry)
                lost = self.counters.count_lost((whys[key],))
                self.counters.errors += lost if own_errors else 0
            else:
                entry.ready = True
                self._stamp(key, entry, None if stored_at is None else stored_at.get(key))
                self.policy.insert(key)
                self.counters.stored += 1
                if entry.hint is not None:
                    self.retain([key], entry.hint)
                    entry.hint = None

    def link(self, pairs: Sequence[tuple[BlockHash, BlockHash | None]]) -> None:
        """Record each chunk's parent (the chunk before it in its request), for purges by prompt — from its
        reservation on, so a purge finds a chunk still being written — and, once it is resident, for a
        chain-aware eviction policy."""
        link = getattr(self.policy, "link", None)
        for child, parent in pairs:
            entry = self.entries.get(child)
            if parent is not None and entry is not None:
                entry.parent = parent
                if link is not None and entry.ready:
                    link(child, parent)

    def record(self, keys: Sequence[BlockHash]) -> None:
        """A request asks for chunks ``keys`` (head first): forwarded to a policy that learns from demand."""
        record = getattr(self.policy, "record", None)
        if record is not None:
            record(keys)

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's word on the request that wanted ``keys`` (a chain, head first): forwarded to a policy
        that takes hints (``retain``), for the keys this tier holds; a key still being written takes it when it
        is published (a request finishes before its last stores land)."""
        retain = getattr(self.policy, "retain", None)
        if retain is None:
            return
        held = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                if entry.ready:
                    held.append(key)
                else:
                    entry.hint = state
        if held:
            retain(held, state)

    def pin(self, keys: Sequence[BlockHash]) -> list[Entry]:
        """Pin ready keys (not evictable) and return their entries; raises KeyError for a missing key."""
        pinned = []
        now = self._now()
        for i, key in enumerate(keys):
            entry = self.entries.get(key)
            if not self._readable(entry, now):
                self.unpin(keys[:i])
                raise KeyError(f"chunk {key.hex()[:16]}… is not readable in tier {self.name!r}")
            entry.pins += 1
            pinned.append(entry)
        return pinned

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            entry = self.entries[key]
            entry.pins -= 1
            if entry.purged and entry.pins == 0 and entry.ready:
                self._drop(key, entry)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """The keys served a hit: tell the policy, tail first, so under LRU the chain's head is the newest."""
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is not None and entry.ready:
                entry.hits += 1
                self.policy.touch(key)

    def _evict_one(self) -> bool:
        """Evict the policy's first unpinned proposal; False when nothing can go."""
        victim = self._pop_victim()
        if victim is None:
            return False
        self._drop(*victim, in_policy=False)
        return True

    def _reserve_bytes(self, keys: Sequence[BlockHash], nbytes: Sequence[int], capacity: int) -> list[bool]:
        """Reserve ``nbytes[i]`` for each new key, evicting to make room; False where present or no room."""
        self.expire()            # a chunk past retention is stored again, not kept as present
        out = []
        for key, size in zip(keys, nbytes, strict=True):
            if key in self.entries:
                out.append(False)
                continue
            self.counters.store_planned += 1
            if size > capacity:
                self.counters.store_rejected += 1
                out.append(False)
                continue
            while self._used + size > capacity:
                if not self._evict_one():
                    break
            if self._used + size > capacity:
                self.counters.store_rejected += 1
                out.append(False)
                continue
            self._reserve(key, Entry(size))
            out.append(True)
        return out

    def _trim_to(self, capacity: int) -> None:
        while self._used > capacity:
            if not self._evict_one():
                break

    def _pop_victim(self) -> tuple[BlockHash, Entry] | None:
        """The policy's first proposal that is not pinned (pinned proposals go back to the policy)."""
        busy = []
        victim = None
        while (key := self.policy.pop_victim()) is not None:
            entry = self.entries[key]
            if entry.pins == 0:
                victim = (key, entry)
                break
            busy.append(key)
        for key in reversed(busy):
            self.policy.insert(key)
        if victim is not None:
            self.counters.evicted += 1
        return victim

    def _drop(self, key: BlockHash, entry: Entry, in_policy: bool = True) -> None:
        if entry.ready:
            if in_policy:
                self.policy.remove(key)
            self._removed((key,))     # a reservation that never became ready was never announced
        del self.entries[key]
        self._used -= entry.nbytes
        self._release(key, entry)
