"""Shared fixtures: small KV geometries and a ready offload stack on CPU."""
from __future__ import annotations

import pytest
import torch

from tiercache.build import build_offload_stack
from tiercache.config import TierCacheConfig
from tiercache.keys import BlockHasher, KVGeometry, Namespace
from tiercache.pool import BlockManager, BlockPool, PagedKVCache

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCK = 4
CHUNK = 16  # 4 blocks a chunk


class Stack:
    """A paged pool, its block manager and an offload stack over it."""

    def __init__(self, num_blocks: int = 64, cpu_chunks: int = 8, geometry: KVGeometry = SMALL, **cfg) -> None:
        self.geometry = geometry
        self.kv = PagedKVCache(geometry, num_blocks, BLOCK, "cpu")
        self.pool = BlockPool(num_blocks)
        self.blocks = BlockManager(self.pool, BLOCK)
        chunk_bytes = (CHUNK // BLOCK) * self.kv.block_bytes
        config = TierCacheConfig().replace(
            keys={"block_size": BLOCK, "chunk_tokens": CHUNK},
            cpu={"capacity": cpu_chunks * chunk_bytes, "prefault": False},
            **cfg,
        )
        self.config = config
        self.namespace = Namespace("test-model", geometry, BLOCK)
        self.offload = build_offload_stack(config, self.kv, self.namespace)
        self.manager = self.offload.manager
        self.cpu = self.offload.tiers[0]
        self.hasher = BlockHasher(self.namespace)

    def fill(self, req: str, block_ids: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in block_ids:
            self.kv.kv[:, :, b].copy_(torch.randn(self.kv.kv[:, :, b].shape, generator=g))

    def close(self) -> None:
        self.offload.close()


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()
