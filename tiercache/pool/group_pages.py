"""L0 owned by an engine whose KV has KV-cache groups (vLLM's hybrid allocator), addressed by block id.

Worker side, one per rank. Every layer of every group is seen as its pages: a ``[num_blocks, page_bytes]``
uint8 view of the memory the engine placed it in, whatever the tensor shapes the engine's attention or
state kernels read. Groups share one pool of block ids (a block belongs to one group at a time), so a
group's pages are moved by its own block ids, as opaque bytes.

A stored chunk or resume point is group-major (`tiercache.contracts.groups`): for each of its groups,
``[num_layers, blocks, page_bytes]``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.contracts.groups import GroupBlocks, KVGroups


def page_view(backing: torch.Tensor, num_blocks: int, page_bytes: int, block_stride: int, offset: int) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 view of one layer's pages: block ``b``'s page starts at
    ``offset + b * block_stride`` bytes into ``backing`` (a flat uint8 tensor over the engine's allocation)."""
    if page_bytes > block_stride or offset + (num_blocks - 1) * block_stride + page_bytes > backing.numel():
        raise ValueError(f"{num_blocks} pages of {page_bytes} B every {block_stride} B from byte {offset} do not "
                         f"fit an allocation of {backing.numel()} B")
    return backing.as_strided((num_blocks, page_bytes), (block_stride, 1), backing.storage_offset() + offset)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole allocation ``tensor`` views."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


class GroupPagesKV:
    """An engine's KV as each group's layers' pages."""

    def __init__(self, groups: KVGroups, pages: Sequence[Sequence[torch.Tensor]], num_blocks: int) -> None:
        if len(pages) != len(groups.groups):
            raise ValueError(f"pages for {len(pages)} groups, the KV has {len(groups.groups)}")
        for g, (group, layers) in enumerate(zip(groups.groups, pages)):
            if len(layers) != group.num_layers:
                raise ValueError(f"group {g}: {len(layers)} layers' pages, the group has {group.num_layers}")
            for layer in layers:
                if layer.dtype != torch.uint8 or tuple(layer.shape) != (num_blocks, group.page_bytes):
                    raise ValueError(f"group {g}: a layer's pages are {layer.dtype} {tuple(layer.shape)}, not "
                                     f"uint8 ({num_blocks}, {group.page_bytes})")
        self.groups = groups
        self.pages = [list(layers) for layers in pages]
        self.num_blocks = num_blocks
        self.block_size = groups.block_size
        self.device = pages[0][0].device

    def _segments(self, chunk: torch.Tensor, chunk_blocks: int) -> list[tuple[int, torch.Tensor]]:
        """Each part of a stored object (a flat uint8 buffer; a chunk, or a resume point) as its group and a
        ``[num_layers, blocks, page]`` view."""
        out, at = [], 0
        for g, n in self.groups.parts(chunk_blocks):
            group = self.groups.groups[g]
            size = group.num_layers * n * group.page_bytes
            out.append((g, chunk[at:at + size].view(group.num_layers, n, group.page_bytes)))
            at += size
        return out

    def gather(self, parts: Sequence[GroupBlocks], chunk: torch.Tensor, chunk_blocks: int) -> None:
        """Copy each part's named blocks from the engine's pages into a stored object."""
        self._move(parts, chunk, chunk_blocks, into_engine=False)

    def scatter(self, parts: Sequence[GroupBlocks], chunk: torch.Tensor, chunk_blocks: int) -> None:
        """Copy each part's named blocks from a stored object into the engine's pages."""
        self._move(parts, chunk, chunk_blocks, into_engine=True)

    def copy_blocks(self, group: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy blocks ``src`` of group ``group`` onto its blocks ``dst``, in every layer (one indexed copy
        each)."""
        if not src:
            return
        src_ids = torch.as_tensor(list(src), device=self.device)
        dst_ids = torch.as_tensor(list(dst), device=self.device)
        for pages in self.pages[group]:
            pages.index_copy_(0, dst_ids, pages.index_select(0, src_ids))

    def _move(self, parts: Sequence[GroupBlocks], chunk: torch.Tensor, chunk_blocks: int, into_engine: bool) -> None:
        """One indexed copy per layer and part: the part's blocks of the stored object ↔ its engine blocks."""
        for (g, segment), part in zip(self._segments(chunk, chunk_blocks), parts, strict=True):
            if not part.block_ids:
                continue
            ids = torch.as_tensor(part.block_ids, device=self.device)
            stored = segment[:, part.first:part.first + len(part.block_ids)]
            for layer, pages in enumerate(self.pages[g]):
                if into_engine:
                    pages.index_copy_(0, ids, stored[layer].to(self.device, non_blocking=True))
                else:
                    stored[layer].copy_(pages.index_select(0, ids))
