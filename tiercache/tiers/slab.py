"""L1's two halves: the slot numbers (scheduler side) and the slot bytes (worker side, one slab per rank).

`SlotHeap` hands out slot numbers lowest first, which keeps a batch of
chunks mostly contiguous; the scheduler's L1 index owns it, and every rank
uses the same slot for the same chunk. `HostSlab` is one rank's buffer of
those slots, allocated once (pinned when CUDA is present) and pre-faulted:
first-touch page faults cut copy throughput several-fold, so no allocation or
pinning happens on the hot path.
"""
from __future__ import annotations

import heapq

import torch

PAGE_BYTES = 4096


class SlotHeap:
    """Scheduler side: L1's free slot numbers, lowest first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


class HostSlab:
    """Worker side, one per rank: L1's bytes, one buffer carved into slots."""

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool = False, prefault: bool = True) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"need positive slots and slot size, got {num_slots} × {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        if prefault and not pin_memory:  # pinned pages are resident already
            self.buffer[::PAGE_BYTES].fill_(0)  # one write per page faults it in
        self.slots = self.buffer.view(num_slots, slot_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def run_view(self, first: int, count: int) -> torch.Tensor:
        """Flat view of ``count`` adjacent slots starting at ``first``."""
        return self.buffer[first * self.slot_bytes:(first + count) * self.slot_bytes]

    def view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        row = self.slots[slot]
        return row if nbytes is None else row[:nbytes]

    def memory(self, slot: int) -> memoryview:
        """The slot's bytes as a writable memoryview (for chunk I/O)."""
        return memoryview(self.slots[slot].numpy())
