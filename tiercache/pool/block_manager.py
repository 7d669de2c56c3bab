"""Per-request block tables over a `BlockPool`: allocate, append, fork (copy-on-write), free.

Scheduler side. The manager owns every request's table; the pool owns the
blocks. Copy-on-write is returned as `BlockCopy` instructions that the KV
owner (`PagedKVCache.copy_blocks`) executes in one vectorized op.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tiercache.arith import ceil_div
from tiercache.contracts.keys import BlockHash
from tiercache.pool.block_pool import Block, BlockPool

RequestId = Hashable


@dataclass(frozen=True, slots=True)
class BlockCopy:
    src: int
    dst: int


class BlockManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[RequestId, list[Block]] = {}
        self.num_tokens: dict[RequestId, int] = {}

    # -- queries -------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def block_ids(self, req: RequestId) -> list[int]:
        return [b.block_id for b in self.tables[req]]

    def cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        return self.pool.cached_prefix_length(block_hashes)

    # -- lifecycle -----------------------------------------------------------
    def allocate(self, req: RequestId, num_tokens: int, block_hashes: Sequence[BlockHash] = ()) -> int:
        """Give ``req`` blocks for ``num_tokens`` tokens, reusing cached full blocks.

        Returns the number of leading tokens already computed (prefix hits).
        Never hits on the block holding the last token: it must be computed
        to produce logits.
        """
        if req in self.tables:
            raise KeyError(f"request {req!r} already has blocks")
        usable = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        num_hit = self.pool.cached_prefix_length(block_hashes[:usable])
        need = self.blocks_needed(num_tokens) - num_hit
        hits: list[Block] = [self.pool.cached[h] for h in block_hashes[:num_hit]]
        idle_hits = sum(1 for b in hits if b.ref_cnt == 0 and b.pin_cnt == 0)
        if need > self.pool.num_free - idle_hits:
            raise MemoryError(f"request {req!r} needs {need} new blocks, {self.pool.num_free - idle_hits} free")
        self.pool.touch(hits)
        self.tables[req] = hits + self.pool.allocate(need)
        self.num_tokens[req] = num_tokens
        return num_hit * self.block_size

    def append(self, req: RequestId, num_new_tokens: int = 1) -> list[BlockCopy]:
        """Make room for ``num_new_tokens`` more tokens; copies a shared partial last block first.

        All-or-nothing: raises MemoryError before changing anything when the
        pool cannot supply the blocks (including the copy-on-write one).
        """
        table = self.tables[req]
        old = self.num_tokens[req]
        new = old + num_new_tokens
        cow = bool(old % self.block_size) and table[-1].ref_cnt > 1
        extra = max(0, self.blocks_needed(new) - len(table))
        if cow + extra > self.pool.num_free:
            raise MemoryError(f"request {req!r} needs {cow + extra} more blocks, {self.pool.num_free} free")
        copies: list[BlockCopy] = []
        if cow:
            shared = table[-1]
            (private,) = self.pool.allocate(1)
            self.pool.free([shared])
            table[-1] = private
            copies.append(BlockCopy(shared.block_id, private.block_id))
        if extra:
            table.extend(self.pool.allocate(extra))
        self.num_tokens[req] = new
        return copies

    def ensure_tokens(self, req: RequestId, num_tokens: int) -> list[BlockCopy]:
        """Grow ``req``'s table to hold ``num_tokens`` tokens (no-op when it already does)."""
        have = self.num_tokens[req]
        return self.append(req, num_tokens - have) if num_tokens > have else []

    def hold(self, req: RequestId) -> list[Block]:
        """End ``req``'s table but keep its blocks pinned (an in-flight transfer reads them); see `BlockPool.unpin`."""
        blocks = self.tables[req]
        self.pool.pin(blocks)
        self.free(req)
        return blocks

    def fork(self, parent: RequestId, child: RequestId) -> None:
        """``child`` shares all of ``parent``'s blocks; writes copy on demand."""
        if child in self.tables:
            raise KeyError(f"request {child!r} already has blocks")
        table = list(self.tables[parent])
        self.pool.touch(table)
        self.tables[child] = table
        self.num_tokens[child] = self.num_tokens[parent]

    def cache_full_blocks(self, req: RequestId, block_hashes: Sequence[BlockHash]) -> None:
        """Record the hashes of ``req``'s full blocks so later requests hit them."""
        table = self.tables[req]
        full = min(len(block_hashes), self.num_tokens[req] // self.block_size, len(table))
        for block, h in zip(table[:full], block_hashes[:full]):
            if block.block_hash is None:
                self.pool.cache(block, h)

    def free(self, req: RequestId) -> None:
        self.pool.free(self.tables.pop(req))
        del self.num_tokens[req]
