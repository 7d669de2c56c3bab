"""The write-back tier under L1: which of L1's victims it takes (spills), which chunks promoted from it move up,
and what each rank writes down to it when the engine stops.

Scheduler side. A chunk reaches the write-back tier when L1 evicts it (a *spill*) and the admission policy
accepts it. A chunk promoted from it stays there (``promotion="copy"``) or leaves it (``"move"``: L1 and it
hold more between them, and it is spilled again when L1 evicts it).

Shutdown: what only L1 holds is lost when the engine stops, unless it is written down first. While the
scheduler is alive, `WriteBack.flush` plans that; but vLLM stops its workers before its scheduler, so no step
follows to carry a plan. So every batch of plans the workers get comes with a `WriteBackOrder`
(`take_order`): which chunks entering L1 the write-back tier lacks, and which L1 slots were freed since, in
order. Each rank keeps the slots whose chunk it holds by that rule and writes them down when it closes — its
own bytes, where a failed store on another rank leaves a chunk only some ranks hold, which the restart scan
deletes.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tiercache.contracts.groups import ChunkSizes
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.medium import Medium, link_name
from tiercache.contracts.plan import ChunkCopy, Failure, WriteBackOrder
from tiercache.manager.copies_down import CopiesDown
from tiercache.manager.jobs import JobKind
from tiercache.policies import AdmissionPolicy
from tiercache.tiers.base import LowerIndex
from tiercache.tiers.cpu import CpuIndex

# L1 keeps 1/SPILL_RESERVE_SHARE of its slots free (or being spilled) for the next step's stores and promotions:
# a victim being spilled frees its slot only once its copy is out, so a full L1 would refuse the next stores
SPILL_RESERVE_SHARE = 16


class WriteBack:
    """The first write-back tier below L1 (``tier``), guarded by ``admission`` (None: it takes every victim)."""

    def __init__(self, l1: CpuIndex, tier: LowerIndex, admission: AdmissionPolicy | None, copies_down: CopiesDown,
                 sizes: ChunkSizes, blocks_per_chunk: int, moves_up: bool) -> None:
        self.l1 = l1
        self.tier = tier
        self.admission = admission
        self.copies_down = copies_down
        self.chunk_layout = sizes.layout(blocks_per_chunk)   # a whole chunk's, as the tier stores it
        self.moves_up = moves_up
        # none kept in an L1 of under SPILL_RESERVE_SHARE slots
        self.spill_reserve = l1.slots.num_slots // SPILL_RESERVE_SHARE
        self._unwritten: list[BlockHash] = []   # chunks planned into L1 that the tier lacks, since the last order
        self._freed_slots: list[int] = []       # L1 slots freed since the last order, in order
        l1.spill_filter = self.worth_spilling
        l1.on_slot_freed = self._freed_slots.append

    def worth_spilling(self, key: BlockHash, hits: int) -> bool:
        """Spill an L1 victim unless the tier has it (asked only of a tier with a local index) or admission
        refuses it. Private chunks never reach here (`CpuIndex` keeps them out)."""
        tier = self.tier
        if tier.indexed and tier.has(key):
            return False
        if self.admission is None or self.admission.admit(key, hits):
            return True
        # a policy that guards hits, not writes, lets a victim into room that evicts nothing
        return (self.admission.admits_into_room and tier.indexed
                and tier.used_bytes + tier.reserve_bytes(self.chunk_layout) <= tier.capacity_bytes)

    def entering_l1(self, chunks: Iterable[ChunkCopy]) -> None:
        """``chunks`` are planned into L1: those the tier lacks are named in the next order."""
        tier = self.tier
        self._unwritten += [c.key for c in chunks if not (tier.indexed and tier.has(c.key))]

    def promoted(self, lower: LowerIndex, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure]) -> None:
        """Chunks promoted from ``lower`` landed in L1. Moved up from this tier, they leave it (their bytes
        deleted with the next background step) and join what only L1 holds, written down at shutdown (one that
        another load pins there stays)."""
        if not self.moves_up or lower is not self.tier:
            return
        lower.delete([k for k in keys if k not in failed and self.l1.has(k)])
        self._unwritten += [k for k in keys if self.l1.has(k) and not lower.has(k)]

    def plan_spills(self) -> None:
        """Keep room free in L1 for the next step, and plan copying its victims down (the refused ones leave
        L1 uncopied)."""
        if self.spill_reserve:
            self.l1.keep_free(self.spill_reserve)
        spills = self.l1.take_spills()
        if spills:
            chunks = [ChunkCopy(s.key, s.slot, (), s.chunk_blocks, parent=s.parent, stored_at=s.stored_at)
                      for s in spills]
            refused = self.copies_down.plan(JobKind.SPILL, chunks, self.tier)
            self.l1.finish_spills([c.key for c in refused])

    def flush(self) -> None:
        """Plan copying every resident chunk that only L1 holds (and admission accepts) to the tier."""
        dirty = [(key, e) for key, e in self.l1.entries.items()
                 if e.ready and e.pins == 0 and not e.private and self.worth_spilling(key, e.hits)]
        self.copies_down.copy_resident([ChunkCopy(key, e.slot, (), e.chunk_blocks, parent=e.parent,
                                                  stored_at=e.stored_at) for key, e in dirty], self.tier)

    def take_order(self) -> WriteBackOrder | None:
        """The shutdown write-down order for the plans planned since the last call (None: nothing changed)."""
        if not (self._unwritten or self._freed_slots):
            return None
        order = WriteBackOrder(self.tier.name, link_name(Medium.CPU, self.tier.medium), frozenset(self._unwritten),
                               tuple(self._freed_slots))
        self._unwritten.clear()
        self._freed_slots.clear()
        return order
