"""Plain data passed from the manager (planning) to the transfer engine (execution) and back."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

from tiercache.keys import BlockHash
from tiercache.tiers.base import Medium

JobId = NewType("JobId", int)


class Priority(IntEnum):
    """Lower runs first: loads are on the critical path, stores are best effort."""
    LOAD = 0
    PREFETCH = 1
    STORE = 2


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk's part of a plan.

    ``block_ids`` are L0 blocks for chunk blocks ``first_block .. first_block +
    len(block_ids)``: a load may skip leading blocks the engine already holds.
    ``slot`` addresses the chunk in a slot tier (L1), when one is involved;
    ``chunk_blocks`` is how many blocks the stored chunk holds (fewer than a
    full chunk only for a partial trailing chunk).
    """
    key: BlockHash
    slot: int | None
    block_ids: tuple[int, ...]
    chunk_blocks: int
    first_block: int = 0
    parent: BlockHash | None = None   # the request's previous chunk, for chain-aware eviction


@dataclass(frozen=True, slots=True)
class TransferPlan:
    job_id: JobId
    src: Medium
    dst: Medium
    priority: Priority
    chunks: tuple[ChunkCopy, ...]
    nbytes: int

    @property
    def link(self) -> tuple[Medium, Medium]:
        return (self.src, self.dst)

    @property
    def keys(self) -> list[BlockHash]:
        return [c.key for c in self.chunks]


@dataclass(frozen=True, slots=True)
class TransferResult:
    plan: TransferPlan
    ok: bool
    seconds: float
    error: str | None = None
    failed_keys: tuple[BlockHash, ...] = field(default=())

    @property
    def job_id(self) -> JobId:
        return self.plan.job_id
