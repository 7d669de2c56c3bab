"""L1: chunks in one pre-faulted host buffer, carved into equal slots.

Scheduler side for the index (driven by the manager's thread only); the slot
bytes are read and written by transfer handlers on worker threads between a
``prepare_*`` and its ``complete_*``. Lifecycle of a key:

    prepare_store → (handler writes the slot) → complete_store(ok) → visible
    prepare_load  → pinned, not evictable → (handler reads) → complete_load

A key being written is invisible to `contains`; a pinned key is never evicted;
"no room" is returned as ``None``, never raised. Usage never exceeds capacity:
the buffer holds ``capacity // slot_bytes`` slots and nothing else.

Spilling (write-back to a slower tier): when ``spill_filter`` says a victim is
worth keeping, eviction hides the key at once but holds its slot until the
manager has copied it out (`take_spills` → write → `finish_spills`). The
filter answers no for a chunk the slower tier already holds.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tiercache.keys import BlockHash
from tiercache.tiers.base import Medium
from tiercache.policies import DEFAULT_EVICTION
from tiercache.tiers.index import Entry, IndexedTier
from tiercache.tiers.slab import SlabAllocator


@dataclass(frozen=True, slots=True)
class Spill:
    key: BlockHash
    slot: int
    nbytes: int
    hits: int


MAX_EVICTIONS_PER_SLOT = 8   # spilled victims free no slot at once; give up on a store after this many


class CpuTier(IndexedTier):
    medium = Medium.CPU

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        eviction: str = DEFAULT_EVICTION,
        pin_memory: bool = False,
        prefault: bool = True,
        name: str = "cpu",
    ) -> None:
        super().__init__(eviction)
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"L1 capacity {capacity_bytes} B holds no {slot_bytes}-byte chunk")
        self.name = name
        self.slab = SlabAllocator(num_slots, slot_bytes, pin_memory=pin_memory, prefault=prefault)
        self.spill_filter: Callable[[BlockHash, int], bool] | None = None   # set by the manager
        self._spilling: dict[BlockHash, Entry] = {}
        self._spill_queue: list[Spill] = []

    # -- Tier ----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.slab.num_slots * self.slab.slot_bytes

    @property
    def slot_bytes(self) -> int:
        return self.slab.slot_bytes

    # -- stores --------------------------------------------------------------
    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[int | None]:
        """Reserve a slot per key; ``None`` where the key is present already or no room can be made."""
        out: list[int | None] = []
        for key, size in zip(keys, nbytes, strict=True):
            if size > self.slab.slot_bytes:
                raise ValueError(f"chunk of {size} B does not fit a {self.slab.slot_bytes}-byte L1 slot")
            if key in self.entries:
                out.append(None)
                continue
            slot = self.slab.allocate()
            tries = 0
            while slot is None and tries < MAX_EVICTIONS_PER_SLOT:
                freed = self._evict_one()
                if freed is None:
                    break
                tries += 1
                if freed:
                    slot = self.slab.allocate()
            if slot is None:
                self.counters.store_rejected += 1
                out.append(None)
                continue
            self._reserve(key, Entry(size, slot=slot))
            out.append(slot)
        return out

    def complete_store(self, keys: Sequence[BlockHash], failed: Sequence[BlockHash] = ()) -> None:
        self.publish(keys, failed)

    # -- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[BlockHash]) -> list[int]:
        """Pin keys for a load into L0 (or a copy down) and return their slots."""
        return [entry.slot for entry in self.pin(keys)]

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        self.unpin(keys)
        self.touch(keys)
        self.counters.loaded += len(keys)

    # -- spills --------------------------------------------------------------
    def take_spills(self) -> list[Spill]:
        spills, self._spill_queue = self._spill_queue, []
        return spills

    def finish_spills(self, keys: Sequence[BlockHash]) -> None:
        """The spilled bytes were copied out (or given up): free their slots."""
        for key in keys:
            entry = self._spilling.pop(key)
            self._used -= entry.nbytes
            self.slab.release(entry.slot)

    # -- bytes (for transfer handlers) ---------------------------------------
    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        return self.slab.view(slot, nbytes)

    def slot_run_view(self, first: int, count: int) -> torch.Tensor:
        return self.slab.run_view(first, count)

    # -- internals -----------------------------------------------------------
    def _evict_one(self) -> bool | None:
        """Evict the policy's victim: True if its slot is free now, False if it is being spilled, None if no victim."""
        victim = self._pop_victim()
        if victim is None:
            return None
        key, entry = victim
        if self.spill_filter is not None and key not in self._spilling and self.spill_filter(key, entry.hits):
            del self.entries[key]   # hidden at once; bytes and slot stay counted until finish_spills
            self._spilling[key] = entry
            self._spill_queue.append(Spill(key, entry.slot, entry.nbytes, entry.hits))
            return False
        self._drop(key, entry, in_policy=False)
        return True

    def _release(self, key: BlockHash, entry: Entry) -> None:
        self.slab.release(entry.slot)
