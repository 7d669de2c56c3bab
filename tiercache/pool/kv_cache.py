"""The L0 KV tensor: one preallocated tensor for all layers, addressed by block id.

Worker side: this module owns the bytes of L0; `BlockPool` owns which block
holds what. Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`` (geometry layout ``LKBTHD``): a layer's K or V of one block is
contiguous, so gathering a chunk moves ``2 * num_layers`` runs per block and a
layer can be loaded on its own for layerwise pipelining.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.keys import KVGeometry


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


class PagedKVCache:
    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: str = "auto") -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = resolve_device(device)
        self.dtype = torch_dtype(geometry.dtype)
        g = geometry
        self.kv = torch.zeros(
            (g.num_layers, 2, num_blocks, block_size, g.num_kv_heads, g.head_dim),
            dtype=self.dtype, device=self.device,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds across all layers, K and V."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def chunk_shape(self, chunk_blocks: int) -> tuple[int, ...]:
        """Shape of a chunk of ``chunk_blocks`` blocks as stored (the layout of `kernels.torch_ops.chunk_view`)."""
        g = self.geometry
        return (g.num_layers, 2, chunk_blocks, self.block_size, g.num_kv_heads, g.head_dim)

    def layer(self, layer: int) -> torch.Tensor:
        """``[2, num_blocks, block_size, heads, head_dim]`` view of one layer."""
        return self.kv[layer]

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks ``src[i] → dst[i]`` (copy-on-write) in one indexed op."""
        if not src:
            return
        src_t = torch.as_tensor(src, device=self.device)
        dst_t = torch.as_tensor(dst, device=self.device)
        self.kv.index_copy_(2, dst_t, self.kv.index_select(2, src_t))
