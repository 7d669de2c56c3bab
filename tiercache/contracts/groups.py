"""KV-cache groups: what each kind of group needs to resume a request at a chunk boundary (DESIGN §9).

An engine's KV is one or more *groups*, each with its own block table over one pool of block ids and each
of one *kind*. A chunk's key stays its prefix chain; its value is what every group needs to resume a request
at the chunk's end:

- ``full-attention`` and ``mla``: every block of the chunk (a later token attends to all of them);
- ``sliding-window``: only the blocks that hold the window behind the chunk's end, since no later token
  attends further back. Those are a suffix of the chunk, and the window behind any later boundary reaches no
  further into this chunk than the window behind its own end, so chunks stored this way serve a resume at
  any later chunk boundary.

A group of a kind the registry does not know cannot be resumed: the connector refuses the model at start.
Hits of a layout with window groups end on chunk boundaries (`KVGroups.whole_chunks_only`): the window
stored with a chunk is the one behind its end, not behind a token inside it.

A stored chunk is group-major: for each group in order, its layers' pages of the chunk's stored blocks,
``[num_layers, stored_blocks, page_bytes]``. `GroupBlocks` names, per group, which of those stored blocks a
plan moves and the engine blocks they move to or from. Plain data, shared by both sides.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.contracts.layout import ChunkLayout
from tiercache.registry import Registry

NO_BLOCK = -1   # a table position the engine holds no block for (vLLM's null block: outside a window)


class GroupKind:
    """A kind of KV-cache group: how many blocks behind a boundary a resume there needs."""
    name = ""

    def resume_blocks(self, group: KVGroup, block_size: int) -> int | None:
        """Blocks right behind a boundary that a resume there needs; None: every block before it."""
        raise NotImplementedError


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


group_kinds: Registry[GroupKind] = Registry("KV-cache group kind")
group_kinds.register("full-attention", AllBlocks())
group_kinds.register("mla", AllBlocks())
group_kinds.register("sliding-window", SlidingWindow())


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
    """One group's part of a chunk copy: engine blocks ``block_ids`` ↔ the chunk's stored blocks ``first ..
    first + len(block_ids)`` of that group."""
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVGroups:
    """Every group of an engine's KV, with the chunking: how big a stored chunk is and which blocks it holds."""
    groups: tuple[KVGroup, ...]
    block_size: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("an engine's KV has at least one group")

    def _resume(self, group: KVGroup) -> int | None:
        return group_kinds.get(group.kind).resume_blocks(group, self.block_size)

    def stored_blocks(self, group: KVGroup, chunk_blocks: int) -> int:
        """How many of a ``chunk_blocks``-block chunk's last blocks it stores for ``group``."""
        need = self._resume(group)
        return chunk_blocks if need is None else min(chunk_blocks, need)

    @property
    def whole_chunks_only(self) -> bool:
        """Whether a hit must end on a chunk boundary (some group stores only what a resume there needs)."""
        return any(self._resume(g) is not None for g in self.groups)

    def nbytes(self, chunk_blocks: int) -> int:
        """Bytes of a stored chunk of ``chunk_blocks`` blocks."""
        return sum(g.num_layers * self.stored_blocks(g, chunk_blocks) * g.page_bytes for g in self.groups)

    def layout(self, chunk_blocks: int) -> ChunkLayout:
        """A stored chunk as a codec sees it: opaque bytes (groups of several dtypes are stored raw)."""
        return ChunkLayout("uint8", (self.nbytes(chunk_blocks),))

    def blocks_of(self, nbytes: int) -> int:
        """The chunk size, in blocks, whose stored bytes are ``nbytes`` (the largest, where sizes tie)."""
        for n in range(self.blocks_per_chunk, 0, -1):
            if self.nbytes(n) == nbytes:
                return n
        raise ValueError(f"no chunk of up to {self.blocks_per_chunk} blocks stores {nbytes} bytes")

    def offsets(self, chunk_blocks: int) -> list[int]:
        """Where each group's part starts in a stored chunk of ``chunk_blocks`` blocks."""
        out, at = [], 0
        for g in self.groups:
            out.append(at)
            at += g.num_layers * self.stored_blocks(g, chunk_blocks) * g.page_bytes
        return out

    def describe(self) -> str:
        """The groups and their kinds, for the storage digest: chunks of one layout are never read by another."""
        return "groups=" + ",".join(g.describe() for g in self.groups)

    def store_copy(self, tables: Sequence[Sequence[int]], start: int, stop: int) -> tuple[GroupBlocks, ...] | None:
        """The blocks a store of table positions ``[start, stop)`` as one chunk reads, per group; None when the
        engine no longer holds one of them (a window that slid past it)."""
        out = []
        for group, table in zip(self.groups, tables, strict=True):
            first = stop - self.stored_blocks(group, stop - start)
            ids = tuple(table[first:stop])
            if len(ids) != stop - first or NO_BLOCK in ids:
                return None
            out.append(GroupBlocks(0, ids))
        return tuple(out)

    def load_copy(self, tables: Sequence[Sequence[int]], start: int, stop: int, first: int,
                  resume_at: int) -> tuple[GroupBlocks, ...]:
        """The blocks a load of the chunk at table positions ``[start, stop)`` writes, per group, when positions
        before ``first`` are the engine's already and the request resumes at position ``resume_at``: for each
        group, its stored blocks that a resume there needs."""
        out = []
        for group, table in zip(self.groups, tables, strict=True):
            stored_from = stop - self.stored_blocks(group, stop - start)
            need = self._resume(group)
            lo = max(first, stored_from, 0 if need is None else resume_at - need)
            hi = min(stop, resume_at)
            ids = tuple(table[lo:hi]) if hi > lo else ()
            if NO_BLOCK in ids:
                raise ValueError(f"the engine holds no block at a position a resume at {resume_at} needs")
            out.append(GroupBlocks(lo - stored_from, ids) if ids else GroupBlocks(0, ()))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class UniformChunks:
    """Chunk sizes of an engine whose KV is one group of full attention: every block stores the same bytes."""
    block_layout: ChunkLayout
    blocks_per_chunk: int

    @property
    def whole_chunks_only(self) -> bool:
        return False

    def nbytes(self, chunk_blocks: int) -> int:
        return chunk_blocks * self.block_layout.raw_len

    def layout(self, chunk_blocks: int) -> ChunkLayout:
        return self.block_layout.blocks(chunk_blocks)

    def blocks_of(self, nbytes: int) -> int:
        return nbytes // self.block_layout.raw_len


ChunkSizes = KVGroups | UniformChunks
