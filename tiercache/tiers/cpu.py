"""L1's index: which chunk is in which host-memory slot — the same slot on every rank (scheduler side).

The bytes are each rank's `HostSlab`, written and read by transfer handlers
between a ``prepare_*`` and its ``complete_*``. Lifecycle of a key:

    prepare_store → (every rank writes the slot) → complete_store(ok) → visible
    prepare_load  → pinned, not evictable → (every rank reads) → complete_load

A key being written is invisible to `contains`; a pinned key is never evicted;
"no room" is returned as ``None``, never raised. Usage never exceeds capacity:
there are ``num_slots`` slots and nothing else.

Spilling (write-back to a slower tier): when ``spill_filter`` says a victim is
worth keeping, eviction hides the key at once but holds its slot until the
manager has copied it out (`take_spills` → write → `finish_spills`). The
filter answers no for a chunk the slower tier already holds, and private
chunks (a preempted request's swap copy) are never spilled.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure
from tiercache.index.indexed_tier import Entry, IndexedTier
from tiercache.policies import DEFAULT_EVICTION
from tiercache.tiers.slab import SlotHeap


@dataclass(frozen=True, slots=True)
class Spill:
    key: BlockHash
    slot: int
    nbytes: int
    hits: int
    parent: BlockHash | None = None
    stored_at: float = 0.0
    chunk_blocks: int = -1


MAX_EVICTIONS_PER_SLOT = 8   # spilled victims free no slot at once; give up on a store after this many


class CpuIndex(IndexedTier):
    """Scheduler side: L1's index and slot numbers (the bytes are each rank's `HostSlab`)."""

    medium = Medium.CPU

    def __init__(self, num_slots: int, slot_bytes: int, eviction: str = DEFAULT_EVICTION, name: str = "cpu",
                 retention_s: float = 0.0) -> None:
        super().__init__(eviction, retention_s)
        if slot_bytes <= 0:
            raise ValueError(f"L1 slots must hold at least one byte, got {slot_bytes}")
        self.name = name
        self.slot_bytes = slot_bytes        # per rank: the largest chunk any rank stores
        self.slots = SlotHeap(num_slots)
        self.spill_filter: Callable[[BlockHash, int], bool] | None = None   # set by the manager
        self.on_slot_freed: Callable[[int], None] | None = None             # set by the manager
        self._spilling: dict[BlockHash, Entry] = {}
        self._spill_queue: list[Spill] = []
        self._filled = False                # a store has had to evict to make room

    # -- TierIndex -----------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.slots.num_slots * self.slot_bytes

    # -- stores --------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[BlockHash], nbytes: Sequence[int], private: bool = False,
        chunk_blocks: Sequence[int] | None = None,
    ) -> list[int | None]:
        """Reserve a slot per key; ``None`` where the key is present already or no room can be made. The
        blocks each chunk covers are kept with it (spills and write-downs size its header by them)."""
        self.expire()            # a chunk past retention is stored again, not kept as present
        out: list[int | None] = []
        blocks = chunk_blocks if chunk_blocks is not None else [-1] * len(keys)
        for key, size, n in zip(keys, nbytes, blocks, strict=True):
            if size > self.slot_bytes:
                raise ValueError(f"chunk of {size} B does not fit a {self.slot_bytes}-byte L1 slot")
            if key in self.entries:
                out.append(None)
                continue
            self.counters.store_planned += 1
            slot = self.slots.allocate()
            tries = 0
            while slot is None and tries < MAX_EVICTIONS_PER_SLOT:
                freed = self._evict_one()
                if freed is None:
                    break
                tries += 1
                self._filled = True
                if freed:
                    slot = self.slots.allocate()
            if slot is None:
                self.counters.store_rejected += 1
                out.append(None)
                continue
            self._reserve(key, Entry(size, slot=slot, private=private, chunk_blocks=n))
            out.append(slot)
        return out

    def complete_store(
        self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] | Sequence[BlockHash] = ()
    ) -> None:
        self.publish(keys, failed)

    def complete_promotion(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure],
                           stored_at: Mapping[BlockHash, float] | None = None) -> None:
        """Chunks read up from a lower tier into reserved slots: a failed one is dropped, and counted by the
        tier it came from (a read or its checks failed there, not here). ``stored_at``: when that tier has them
        first stored, so their retention keeps running here."""
        self.publish(keys, failed, own_errors=False, stored_at=stored_at)

    def is_private(self, key: BlockHash) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.private

    # -- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[BlockHash]) -> list[int]:
        """Pin keys for a load into L0 (or a copy down) and return their slots."""
        return [entry.slot for entry in self.pin(keys)]

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        self.unpin(keys)
        self.touch(keys)
        self.counters.loaded += len(keys)

    # -- spills --------------------------------------------------------------
    def keep_free(self, slots: int) -> None:
        """Evict ahead of need until ``slots`` slots are free or on their way to being free (spilling), once
        a store has had to make room. A victim being spilled holds its slot until its copy is out, so a store
        into a full L1 whose victims all go down would find no slot free and be refused, however many victims
        it sent down; with room made a step ahead it finds one. An L1 that never filled keeps everything."""
        if not self._filled:
            return
        while self.slots.num_free + len(self._spilling) < slots:
            if self._evict_one() is None:
                break

    def take_spills(self) -> list[Spill]:
        spills, self._spill_queue = self._spill_queue, []
        return spills

    def spilling_times(self, keys: Sequence[BlockHash]) -> dict[BlockHash, float]:
        """When the chunks being spilled were first stored."""
        return {key: self._spilling[key].stored_at for key in keys if key in self._spilling}

    def finish_spills(self, keys: Sequence[BlockHash]) -> None:
        """The spilled bytes were copied out (or given up): free their slots."""
        for key in keys:
            entry = self._spilling.pop(key)
            self._used -= entry.nbytes
            self._release(key, entry)

    # -- internals -----------------------------------------------------------
    def _evict_one(self) -> bool | None:
        """Evict the policy's victim: True if its slot is free now, False if it is being spilled, None if no victim."""
        victim = self._pop_victim()
        if victim is None:
            return None
        key, entry = victim
        if (self.spill_filter is not None and not entry.private and key not in self._spilling
                and self.spill_filter(key, entry.hits)):
            del self.entries[key]   # hidden at once; bytes and slot stay counted until finish_spills
            self._removed((key,))
            self._spilling[key] = entry
            self._spill_queue.append(Spill(key, entry.slot, entry.nbytes, entry.hits, entry.parent, entry.stored_at,
                                           entry.chunk_blocks))
            return False
        self._drop(key, entry, in_policy=False)
        return True

    def _release(self, key: BlockHash, entry: Entry) -> None:
        self.slots.release(entry.slot)
        if self.on_slot_freed is not None:
            self.on_slot_freed(entry.slot)
