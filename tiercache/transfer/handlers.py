"""Byte movers of one rank: L0 (the paged pool) ↔ L1 (host slots), L1 ↔ lower tiers, and deletes.

Worker side: these run on transfer threads (or inline on the engine's) and
touch only this rank's bytes — its KV tensors, its L1 slab, its transports —
at the places the plan names, which the scheduler side reserved (L0 blocks
and L1 slots alike) before planning, so nothing they read or write can be
reused until every rank has reported the job. Each is registered under the
pair of tier names it moves between.

Whole chunks in adjacent slots (the slab hands out lowest slots first, so a
batch is mostly adjacent) move as one group in one op; a chunk that is only
partly moved (a load skipping blocks L0 holds) moves on its own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tiercache.contracts.plan import DEVICE, ChunkCopy, Failure, KeyFailures, TransferPlan
from tiercache.kernels import chunk_view, gather_blocks, gather_chunks, scatter_blocks, scatter_chunks
from tiercache.kernels.cuda import make_copier
from tiercache.pool.group_pages import GroupPagesKV
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.pool.layer_tensors import LayerTensorsKV
from tiercache.tiers.base import Transport
from tiercache.tiers.slab import HostSlab
from tiercache.transfer.engine import LayerProgress, TransferEngine
from tiercache.wire.chunk_format import ChunkMeta


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

    def __init__(self, kv: PagedKVCache, slab: HostSlab, blocks_per_chunk: int, l1: str = "cpu") -> None:
        self.kv = kv
        self.slab = slab
        self.l1 = l1
        self.blocks_per_chunk = blocks_per_chunk
        self.cuda = make_copier(kv.kv)   # CUDA kernels when the pool is on a GPU and cupy is present

    def register(self, engine: TransferEngine) -> None:
        engine.register(DEVICE, self.l1, self.store)
        engine.register(self.l1, DEVICE, self.load)

    def _part(self, c: ChunkCopy) -> torch.Tensor:
        whole = chunk_view(self.kv.kv, self.slab.view(c.slot), c.chunk_blocks)  # type: ignore[arg-type]
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
            buffer = self.slab.run_view(first.slot, len(group))  # type: ignore[arg-type]
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


class LayerTensorsHandlers:
    """L0 ↔ L1 for an engine's per-layer KV tensors (`LayerTensorsKV`): one gather or scatter per layer
    per chunk, each moving all of the chunk's blocks in that layer as opaque rows."""

    def __init__(self, kv: LayerTensorsKV, slab: HostSlab, blocks_per_chunk: int, l1: str = "cpu") -> None:
        self.kv = kv
        self.slab = slab
        self.l1 = l1
        self.blocks_per_chunk = blocks_per_chunk

    def register(self, engine: TransferEngine) -> None:
        engine.register(DEVICE, self.l1, self.store)
        engine.register(self.l1, DEVICE, self.load)

    def _move(self, plan: TransferPlan, store: bool, layers: range) -> None:
        kv = self.kv
        per_layer = kv.layer_block_bytes
        for c in plan.chunks:
            if not c.block_ids:
                continue
            slot = self.slab.view(c.slot)  # type: ignore[arg-type]
            span = slice(c.first_block, c.first_block + len(c.block_ids))
            for layer in layers:
                piece = slot[layer * c.chunk_blocks * per_layer:(layer + 1) * c.chunk_blocks * per_layer]
                pool = kv.pool(layer)
                part = chunk_view(pool, piece, c.chunk_blocks)[:, :, span]
                (gather_blocks if store else scatter_blocks)(pool, c.block_ids, part)
        if kv.device.type == "cuda":
            torch.cuda.current_stream(kv.device).synchronize()

    def store(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        self._move(plan, store=True, layers=range(self.kv.num_layers))

    def load(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        if progress is None:
            self._move(plan, store=False, layers=range(self.kv.num_layers))
            return
        for layer in range(self.kv.num_layers):
            self._move(plan, store=False, layers=range(layer, layer + 1))
            progress.mark(layer)


class GroupPagesHandlers:
    """L0 ↔ L1 for an engine whose KV has KV-cache groups (`GroupPagesKV`): each chunk's groups' pages, whole
    (a load marks every layer at once: its groups' layers are not in one order)."""

    def __init__(self, kv: GroupPagesKV, slab: HostSlab, blocks_per_chunk: int, l1: str = "cpu") -> None:
        self.kv = kv
        self.slab = slab
        self.l1 = l1

    def register(self, engine: TransferEngine) -> None:
        engine.register(DEVICE, self.l1, self.store)
        engine.register(self.l1, DEVICE, self.load)

    def _move(self, plan: TransferPlan, store: bool) -> None:
        for c in plan.chunks:
            slot = self.slab.view(c.slot)  # type: ignore[arg-type]
            (self.kv.gather if store else self.kv.scatter)(c.groups, slot, c.chunk_blocks)
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()

    def store(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        self._move(plan, store=True)

    def load(self, plan: TransferPlan, progress: LayerProgress | None = None) -> None:
        self._move(plan, store=False)
        if progress is not None:
            progress.end()


class CpuLowerHandlers:
    """L1 ↔ a lower tier's transport: spills and copies down hand L1 slots to the transport's batched writer;
    promotions read, verify and decode chunks straight into their reserved L1 slots; deletes remove this
    rank's bytes.

    A chunk that fails (a full disk, a corrupt value, an unreachable server)
    fails alone: its key is returned with the reason, the plan's other chunks
    still move.
    """

    def __init__(self, slab: HostSlab, lower: Transport, chunk_meta: Callable[..., ChunkMeta],
                 l1: str = "cpu") -> None:
        self.slab = slab
        self.lower = lower
        self.chunk_meta = chunk_meta
        self.l1 = l1

    def register(self, engine: TransferEngine) -> None:
        engine.register(self.l1, self.lower.name, self.store)
        engine.register(self.lower.name, self.l1, self.load)
        engine.register(self.lower.name, None, self.delete)

    def store(self, plan: TransferPlan, progress: LayerProgress | None = None) -> KeyFailures:
        items = []
        for c in plan.chunks:
            meta = self.chunk_meta(c.key, c.chunk_blocks, c.parent, c.stored_at)   # both go into the header
            items.append((meta, self.slab.memory(c.slot)[:meta.raw_len]))  # type: ignore[arg-type]
        return self.lower.write_chunks(items)

    def load(self, plan: TransferPlan, progress: LayerProgress | None = None) -> KeyFailures:
        got = self.lower.read_chunks_into([(c.key, self.slab.memory(c.slot)) for c in plan.chunks])  # type: ignore[arg-type]
        failed = []
        for c, n in zip(plan.chunks, got):
            if isinstance(n, Failure):
                failed.append((c.key, n))
            elif n != self.chunk_meta(c.key, c.chunk_blocks).raw_len:   # verified, but not the chunk we want
                failed.append((c.key, Failure.CORRUPT))
        return tuple(failed)

    def delete(self, plan: TransferPlan, progress: LayerProgress | None = None) -> KeyFailures:
        self.lower.delete_chunks(plan.keys)
        return ()
