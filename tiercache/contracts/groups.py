"""KV-cache groups: what each kind of group needs to resume a request at a chunk boundary (DESIGN §9).

An engine's KV is one or more *groups*, each with its own block table over one pool of block ids and each
of one *kind*. A kind says how many blocks right behind a boundary a resume there needs:

- ``full-attention`` and ``mla``: all of them (a later token attends to every earlier one). These groups
  are stored in the *chunk*: every block it covers, so chunks laid end to end hold the whole prefix.
- ``sliding-window``: the blocks holding the window behind the boundary; ``state`` (linear attention, SSM:
  one block holds the recurrent state at its end): the one block ending there. These groups are stored in
  a *resume point* beside the chunk that ends there — its own object, keyed by `resume_key` of the chunk's
  key, with the chunk as its parent — and only where the engine holds them (a state exists only where the
  engine's step ended).

A hit is the longest prefix at which every group can resume: the whole chunks up to a boundary that has a
resume point, whose parts are loaded with them, so a state or window is never loaded at a boundary other
than that of the KV loaded with it. A layout with no resume-point groups resumes anywhere, as before.

A stored object is group-major: for each of its groups, ``[num_layers, blocks, page_bytes]`` — a chunk of
``n`` blocks holds ``n`` blocks of each chunk group; a resume point holds each of its groups' resume blocks
(positions before the request's start stay zero). `GroupBlocks` names, per group, which of those blocks a
plan moves and the engine blocks they move to or from. Plain data, shared by both sides.
"""
from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.layout import ChunkLayout
from tiercache.registry import Registry

NO_BLOCK = -1          # a table position the engine holds no block for (vLLM's null block: outside a window)
RESUME_POINT = 0       # a `ChunkCopy.chunk_blocks` that names a resume point, not a chunk


class GroupKind(ABC):
    """A kind of KV-cache group: how many blocks behind a boundary a resume there needs."""
    exact = False   # its blocks hold the group's state only where the engine's step ended, not at every boundary

    @abstractmethod
    def resume_blocks(self, group: KVGroup, block_size: int) -> int | None:
        """Blocks right behind a boundary that a resume there needs; None: every block before it."""


class AllBlocks(GroupKind):
    """Attention over the whole context (full attention, MLA's latent cache)."""

    def resume_blocks(self, group: KVGroup, block_size: int) -> int | None:
        return None


class SlidingWindow(GroupKind):
    """Attention over the last ``window_tokens`` tokens: the next token attends to itself and the
    ``window_tokens - 1`` before it, so a resume at a block boundary needs the blocks holding those."""

    def resume_blocks(self, group: KVGroup, block_size: int) -> int | None:
        if group.window_tokens < 1:
            raise ValueError(f"a sliding-window group needs its window, got {group.window_tokens} tokens")
        return max(1, math.ceil((group.window_tokens - 1) / block_size))


class RecurrentState(GroupKind):
    """A recurrent state (linear attention, SSM: conv and SSM state): the block at a position holds the state
    after its last token, written only when the engine's step ends there."""
    exact = True

    def resume_blocks(self, group: KVGroup, block_size: int) -> int | None:
        return 1


class BlockStates(RecurrentState):
    """A recurrent state kept at every block boundary (the reference engine's linear attention): a resume point
    can be stored at any chunk's end the engine still holds."""
    exact = False


group_kinds: Registry[GroupKind] = Registry("KV-cache group kind")
group_kinds.register("full-attention", AllBlocks())
group_kinds.register("mla", AllBlocks())
group_kinds.register("sliding-window", SlidingWindow())
group_kinds.register("state", RecurrentState())
group_kinds.register("block-state", BlockStates())


def resume_key(chunk_key: BlockHash) -> BlockHash:
    """The key of the resume point at the end of the chunk keyed ``chunk_key``."""
    return BlockHash(hashlib.sha256(b"tiercache-resume-point\0" + chunk_key).digest()[:len(chunk_key)])


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group as one rank holds it."""
    kind: str                 # a name in `group_kinds`
    num_layers: int           # this rank's layers in the group
    page_bytes: int           # bytes of one block of one layer
    window_tokens: int = 0    # sliding-window kinds: the window, with any extra tokens the engine retains

    def __post_init__(self) -> None:
        if self.kind not in group_kinds:
            raise ValueError(f"unknown KV-cache group kind {self.kind!r}; known: {', '.join(group_kinds.names())}")
        if self.num_layers < 1 or self.page_bytes < 1:
            raise ValueError(f"a KV-cache group needs layers and pages, got {self.num_layers} x {self.page_bytes} B")

    def describe(self) -> str:
        window = f"({self.window_tokens})" if self.window_tokens else ""
        return f"{self.kind}{window}:{self.num_layers}x{self.page_bytes}"


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One group's part of a copy: engine blocks ``block_ids`` ↔ the stored object's blocks ``first .. first +
    len(block_ids)`` of that group."""
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVGroups:
    """Every group of an engine's KV, with the chunking: what a chunk and a resume point hold, and their sizes."""
    groups: tuple[KVGroup, ...]
    block_size: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("an engine's KV has at least one group")

    def _kind(self, group: KVGroup) -> GroupKind:
        return group_kinds.get(group.kind)

    def resume_blocks(self, group: KVGroup) -> int | None:
        return self._kind(group).resume_blocks(group, self.block_size)

    @property
    def chunk_groups(self) -> tuple[int, ...]:
        """The groups a chunk stores (every block of it)."""
        return tuple(i for i, g in enumerate(self.groups) if self.resume_blocks(g) is None)

    @property
    def point_groups(self) -> tuple[int, ...]:
        """The groups a resume point stores (the blocks behind its boundary)."""
        return tuple(i for i, g in enumerate(self.groups) if self.resume_blocks(g) is not None)

    @property
    def has_resume_points(self) -> bool:
        """Whether a hit must end at a boundary with a resume point."""
        return bool(self.point_groups)

    @property
    def exact_points(self) -> bool:
        """Whether resume points exist only where the engine's step ended (a group holds a state)."""
        return any(self._kind(self.groups[i]).exact for i in self.point_groups)

    def parts(self, chunk_blocks: int) -> list[tuple[int, int]]:
        """(group, blocks) of each part of a stored object, in order: a chunk of ``chunk_blocks`` blocks, or a
        resume point (`RESUME_POINT`)."""
        if chunk_blocks == RESUME_POINT:
            return [(i, self.resume_blocks(self.groups[i])) for i in self.point_groups]
        return [(i, chunk_blocks) for i in self.chunk_groups]

    def nbytes(self, chunk_blocks: int) -> int:
        """Bytes of a stored chunk of ``chunk_blocks`` blocks, or of a resume point (`RESUME_POINT`)."""
        return sum(self.groups[g].num_layers * n * self.groups[g].page_bytes for g, n in self.parts(chunk_blocks))

    @property
    def slot_bytes(self) -> int:
        """Bytes an L1 slot needs: a whole chunk, or a resume point where that is bigger."""
        return max(self.nbytes(self.blocks_per_chunk), self.nbytes(RESUME_POINT))

    def layout(self, chunk_blocks: int) -> ChunkLayout:
        """A stored object as a codec sees it: opaque bytes (groups of several dtypes are stored raw)."""
        return ChunkLayout("uint8", (self.nbytes(chunk_blocks),))

    def describe(self) -> str:
        """The groups and their kinds, for the storage digest: chunks of one layout are never read by another."""
        return "groups=" + ",".join(g.describe() for g in self.groups)

    def store_copy(self, tables: Sequence[Sequence[int]], start: int, stop: int) -> tuple[GroupBlocks, ...] | None:
        """The blocks a store of table positions ``[start, stop)`` as one chunk reads, per chunk group; None
        when the engine no longer holds one of them."""
        out = []
        for g in self.chunk_groups:
            ids = tuple(tables[g][start:stop])
            if len(ids) != stop - start or NO_BLOCK in ids:
                return None
            out.append(GroupBlocks(0, ids))
        return tuple(out)

    def point_copy(self, tables: Sequence[Sequence[int]], end: int) -> tuple[GroupBlocks, ...] | None:
        """The blocks a store of the resume point at table position ``end`` reads, per resume-point group; None
        when the engine no longer holds one of them."""
        out = []
        for g in self.point_groups:
            need = self.resume_blocks(self.groups[g])
            lo = max(0, end - need)
            ids = tuple(tables[g][lo:end])
            if len(ids) != end - lo or NO_BLOCK in ids:
                return None
            out.append(GroupBlocks(lo - (end - need), ids))
        return tuple(out)

    def load_copy(self, tables: Sequence[Sequence[int]], start: int, stop: int, first: int,
                  resume_at: int) -> tuple[GroupBlocks, ...]:
        """The blocks a load of the chunk at table positions ``[start, stop)`` writes, per chunk group, when
        positions before ``first`` are the engine's already and the request resumes at ``resume_at``."""
        lo, hi = max(start, first), min(stop, resume_at)
        out = []
        for g in self.chunk_groups:
            ids = tuple(tables[g][lo:hi]) if hi > lo else ()
            out.append(GroupBlocks(lo - start, ids) if ids else GroupBlocks(0, ()))
        return tuple(out)

    def point_load(self, tables: Sequence[Sequence[int]], resume_at: int, first: int) -> tuple[GroupBlocks, ...]:
        """The blocks a load of the resume point at ``resume_at`` writes, per resume-point group: those behind
        it, from ``first`` (before it the engine's own)."""
        out = []
        for g in self.point_groups:
            need = self.resume_blocks(self.groups[g])
            lo = max(0, first, resume_at - need)
            ids = tuple(tables[g][lo:resume_at])
            if NO_BLOCK in ids:
                raise ValueError(f"the engine holds no block at a position a resume at {resume_at} needs")
            out.append(GroupBlocks(lo - (resume_at - need), ids) if ids else GroupBlocks(0, ()))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class UniformChunks:
    """Chunk sizes of an engine whose KV is one group of full attention: every block stores the same bytes."""
    block_layout: ChunkLayout
    blocks_per_chunk: int

    has_resume_points = False

    def nbytes(self, chunk_blocks: int) -> int:
        return chunk_blocks * self.block_layout.raw_len

    @property
    def slot_bytes(self) -> int:
        return self.nbytes(self.blocks_per_chunk)

    def layout(self, chunk_blocks: int) -> ChunkLayout:
        return self.block_layout.blocks(chunk_blocks)


ChunkSizes = KVGroups | UniformChunks
