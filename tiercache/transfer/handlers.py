"""Byte movers between L0 (the paged pool) and L1 (host slots).

Worker side: these run on transfer threads and touch only tensors — the
pool's KV tensor and the L1 slots named in the plan, which the manager pinned
(L0 blocks and L1 slots alike) before submitting, so nothing they read or
write can be reused until the result is applied.
"""
from __future__ import annotations

import torch

from tiercache.kernels import chunk_view, gather_blocks, scatter_blocks
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.tiers.base import Medium
from tiercache.tiers.cpu import CpuTier
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.plan import ChunkCopy, TransferPlan


class DeviceCpuHandlers:
    """L0 → L1 stores (gather) and L1 → L0 loads (scatter), one torch op per chunk."""

    def __init__(self, kv: PagedKVCache, cpu: CpuTier) -> None:
        self.kv = kv
        self.cpu = cpu

    def register(self, engine: TransferEngine) -> None:
        engine.register(Medium.DEVICE, Medium.CPU, self.store)
        engine.register(Medium.CPU, Medium.DEVICE, self.load)

    def _slot_blocks(self, plan: TransferPlan, c: ChunkCopy) -> torch.Tensor:
        if c.slot is None:
            raise ValueError(f"job {plan.job_id}: chunk {c.key.hex()[:16]}… has no L1 slot")
        whole = chunk_view(self.kv.kv, self.cpu.slot_view(c.slot), c.chunk_blocks)
        return whole[:, :, c.first_block:c.first_block + len(c.block_ids)]

    def store(self, plan: TransferPlan) -> None:
        pool = self.kv.kv
        for c in plan.chunks:
            gather_blocks(pool, c.block_ids, self._slot_blocks(plan, c))
        if pool.is_cuda:
            torch.cuda.current_stream(pool.device).synchronize()

    def load(self, plan: TransferPlan) -> None:
        pool = self.kv.kv
        for c in plan.chunks:
            scatter_blocks(pool, c.block_ids, self._slot_blocks(plan, c))
        if pool.is_cuda:
            torch.cuda.current_stream(pool.device).synchronize()
