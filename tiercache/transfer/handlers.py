"""Byte movers: L0 (the paged pool) ↔ L1 (host slots), and L1 ↔ lower tiers.

Worker side: these run on transfer threads and touch only tensors — the
pool's KV tensor and the L1 slots named in the plan, which the manager pinned
(L0 blocks and L1 slots alike) before submitting, so nothing they read or
write can be reused until the result is applied.

Whole chunks in adjacent slots (the slab hands out lowest slots first, so a
batch is mostly adjacent) move as one group in one op; a chunk that is only
partly moved (a load skipping blocks L0 holds) moves on its own.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tiercache.errors import ChunkFormatError
from tiercache.kernels.cuda import make_copier
from tiercache.kernels import chunk_view, gather_blocks, gather_chunks, scatter_blocks, scatter_chunks
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.tiers.base import Medium
from tiercache.tiers.cpu import CpuTier
from tiercache.transfer.engine import LayerProgress, TransferEngine
from tiercache.transfer.plan import ChunkCopy, TransferPlan

log = logging.getLogger(__name__)


def group_adjacent(chunks: Sequence[ChunkCopy], full_blocks: int) -> list[list[ChunkCopy]]:
    """Split a plan's chunks into groups of whole chunks in adjacent slots (singletons otherwise)."""
    groups: list[list[ChunkCopy]] = []
    prev: ChunkCopy | None = None
    for c in chunks:
        if c.slot is None:
            raise ValueError(f"chunk {c.key.hex()[:16]}… has no L1 slot")
        whole = c.first_block == 0 and c.chunk_blocks == full_blocks == len(c.block_ids)
        if whole and prev is not None and c.slot == prev.slot + 1:  # type: ignore[operator]
            groups[-1].append(c)
        else:
            groups.append([c])
        prev = c if whole else None
    return groups


class DeviceCpuHandlers:
    """L0 → L1 stores (gather) and L1 → L0 loads (scatter)."""

    def __init__(self, kv: PagedKVCache, cpu: CpuTier, blocks_per_chunk: int) -> None:
        self.kv = kv
        self.cpu = cpu
        self.blocks_per_chunk = blocks_per_chunk
        self.cuda = make_copier(kv.kv)   # CUDA kernels when the pool is on a GPU and cupy is present

    def register(self, engine: TransferEngine) -> None:
        engine.register(Medium.DEVICE, Medium.CPU, self.store)
        engine.register(Medium.CPU, Medium.DEVICE, self.load)

    def _part(self, c: ChunkCopy) -> torch.Tensor:
        whole = chunk_view(self.kv.kv, self.cpu.slot_view(c.slot), c.chunk_blocks)  # type: ignore[arg-type]
        return whole[:, :, c.first_block:c.first_block + len(c.block_ids)]

    def _move(self, plan: TransferPlan, store: bool, layers: slice | None = None) -> None:
        pool = self.kv.kv
        for group in group_adjacent(plan.chunks, self.blocks_per_chunk):
            first = group[0]
            if len(group) == 1 and (first.first_block or len(first.block_ids) != first.chunk_blocks
                                    or first.chunk_blocks != self.blocks_per_chunk):
                part = self._part(first) if layers is None else self._part(first)[layers]
                (gather_blocks if store else scatter_blocks)(pool if layers is None else pool[layers],
                                                           first.block_ids, part)
                continue
            buffer = self.cpu.slot_run_view(first.slot, len(group))  # type: ignore[arg-type]
            ids = [c.block_ids for c in group]
            if self.cuda is not None and layers is None and self.cuda.supports(pool, buffer):
                (self.cuda.gather_chunks if store else self.cuda.scatter_chunks)(pool, ids, buffer)
                continue
            (gather_chunks if store else scatter_chunks)(pool, ids, buffer, layers)
        if pool.is_cuda:
            torch.cuda.current_stream(pool.device).synchronize()

    def store(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        self._move(plan, store=True)

    def load(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        """With ``progress``, layer by layer: each layer is marked as it lands, so attention over it can start."""
        if progress is None:
            self._move(plan, store=False)
            return
        for layer in range(self.kv.kv.shape[0]):
            self._move(plan, store=False, layers=slice(layer, layer + 1))
            progress.mark(layer)


class CpuLowerHandlers:
    """L1 ↔ a lower tier (disk): spills and copies down encode an L1 slot into the tier's chunk format;
    promotions read, verify and decode a chunk straight into its reserved L1 slot.

    A chunk that fails (a full disk, a corrupt file) fails alone: its key is
    returned, the plan's other chunks still move.
    """

    def __init__(self, cpu: CpuTier, lower, chunk_meta) -> None:
        self.cpu = cpu
        self.lower = lower
        self.chunk_meta = chunk_meta   # (key, chunk_blocks) -> ChunkMeta

    def register(self, engine: TransferEngine) -> None:
        engine.register(Medium.CPU, self.lower.medium, self.store)
        engine.register(self.lower.medium, Medium.CPU, self.load)

    def _slot(self, c: ChunkCopy) -> memoryview:
        return memoryview(self.cpu.slot_view(c.slot).numpy())  # type: ignore[arg-type]

    def store(self, plan: TransferPlan, progress: LayerProgress | None = None) -> list:
        failed = []
        for c in plan.chunks:
            meta = self.chunk_meta(c.key, c.chunk_blocks)
            try:
                self.lower.write_chunk(meta, self._slot(c)[:meta.raw_len])
            except OSError as err:
                log.warning("writing chunk %s… to %s failed: %s", c.key.hex()[:16], self.lower.name, err)
                failed.append(c.key)
        return failed

    def load(self, plan: TransferPlan, progress: LayerProgress | None = None) -> list:
        failed = []
        for c in plan.chunks:
            want = self.chunk_meta(c.key, c.chunk_blocks).raw_len
            try:
                got = self.lower.read_chunk_into(c.key, self._slot(c))
                if got != want:
                    raise ChunkFormatError(f"chunk holds {got} bytes, expected {want}")
            except (ChunkFormatError, OSError) as err:
                log.warning("reading chunk %s… from %s failed: %s", c.key.hex()[:16], self.lower.name, err)
                failed.append(c.key)
        return failed
