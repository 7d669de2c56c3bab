"""L1: chunks in one pre-faulted host buffer, carved into equal slots.

Scheduler side for the index (driven by the manager's thread only); the slot
bytes are read and written by transfer handlers on worker threads between a
``prepare_*`` and its ``complete_*``. Lifecycle of a key:

    prepare_store → (handler writes the slot) → complete_store(ok) → visible
    prepare_load  → pinned, not evictable → (handler reads) → complete_load

A key being written is invisible to `contains`; a pinned key is never evicted;
"no room" is returned as ``None``, never raised. Usage never exceeds capacity:
the buffer holds ``capacity // slot_bytes`` slots and nothing else.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.keys import BlockHash
from tiercache.policies import eviction_policies
from tiercache.tiers.base import Medium, Tier
from tiercache.tiers.slab import SlabAllocator


@dataclass(slots=True)
class _Entry:
    slot: int
    nbytes: int
    ready: bool = False
    pins: int = 0


class CpuTier(Tier):
    medium = Medium.CPU

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        eviction: str = "lru",
        pin_memory: bool = False,
        prefault: bool = True,
        name: str = "cpu",
    ) -> None:
        super().__init__()
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"L1 capacity {capacity_bytes} B holds no {slot_bytes}-byte chunk")
        self.name = name
        self.slab = SlabAllocator(num_slots, slot_bytes, pin_memory=pin_memory, prefault=prefault)
        self.policy = eviction_policies.get(eviction)()
        self.entries: dict[BlockHash, _Entry] = {}
        self._used_bytes = 0

    # -- Tier ----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.slab.num_slots * self.slab.slot_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_chunks(self) -> int:
        return len(self.entries)

    @property
    def slot_bytes(self) -> int:
        return self.slab.slot_bytes

    def contains(self, keys: Sequence[BlockHash]) -> int:
        entries = self.entries
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.ready:
                break
            n += 1
        return self._count_lookup(len(keys), n)

    def delete(self, keys: Sequence[BlockHash]) -> int:
        removed = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.ready and entry.pins == 0:
                self._drop(key, entry)
                removed += 1
        self.counters.deleted += removed
        return removed

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
            if slot is None and self._evict_one():
                slot = self.slab.allocate()
            if slot is None:
                self.counters.store_rejected += 1
                out.append(None)
                continue
            self.entries[key] = _Entry(slot, size)
            self._used_bytes += size
            out.append(slot)
        return out

    def complete_store(self, keys: Sequence[BlockHash], ok: bool) -> None:
        """Publish written keys (or release their slots when the write failed).

        Keys are published tail first so that, under LRU, a chain's head is the
        most recently used and outlives its tail.
        """
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is None or entry.ready:
                continue
            if ok:
                entry.ready = True
                self.policy.insert(key)
                self.counters.stored += 1
            else:
                self._drop(key, entry)
                self.counters.errors += 1

    # -- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[BlockHash]) -> list[int]:
        """Pin ready keys for reading and return their slots; raises KeyError for a missing key."""
        slots = []
        for i, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is None or not entry.ready:
                self.complete_load(keys[:i])
                raise KeyError(f"chunk {key.hex()[:16]}… is not readable in tier {self.name!r}")
            if entry.pins == 0:
                self.policy.remove(key)
            entry.pins += 1
            slots.append(entry.slot)
        return slots

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        for key in reversed(keys):  # tail first: the head ends up most recently used
            entry = self.entries[key]
            entry.pins -= 1
            if entry.pins == 0:
                self.policy.insert(key)
            self.counters.loaded += 1

    # -- bytes (for transfer handlers) ---------------------------------------
    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        return self.slab.view(slot, nbytes)

    def slot_run_view(self, first: int, count: int) -> torch.Tensor:
        return self.slab.run_view(first, count)

    def entry_nbytes(self, key: BlockHash) -> int:
        return self.entries[key].nbytes

    # -- internals -----------------------------------------------------------
    def _evict_one(self) -> bool:
        key = self.policy.pop_victim()
        if key is None:
            return False
        self._drop(key, self.entries[key], in_policy=False)
        self.counters.evicted += 1
        return True

    def _drop(self, key: BlockHash, entry: _Entry, in_policy: bool = True) -> None:
        if in_policy and entry.ready:
            self.policy.remove(key)
        del self.entries[key]
        self._used_bytes -= entry.nbytes
        self.slab.release(entry.slot)
