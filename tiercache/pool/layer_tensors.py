"""L0 owned by an engine as one KV tensor per layer (vLLM), addressed by block id.

tiercache never assumes the engine's layout: each registered tensor is
described by where its block dimension is. Every layer is viewed as
``[planes, num_blocks, row]`` — ``planes`` are the dimensions before the
block dimension (1 for vLLM's CPU layout ``[num_blocks, heads, block_size,
2 * head_size]``, 2 for a ``[2, num_blocks, ...]`` K/V split), ``row`` the
bytes of one block in one plane — and blocks move as opaque rows.

A chunk of ``n`` blocks is stored layer-major, ``[num_layers, planes, n,
row]``, like tiercache's own pool, so one layer of a chunk is one contiguous
piece and loads can land layer by layer.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.contracts.keys import KVGeometry


class LayerTensorsKV:
    """Worker side, one per rank: the engine's registered KV tensors, addressed by block."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int, geometry: KVGeometry,
                 block_dim: int = 0) -> None:
        if not tensors:
            raise ValueError("no KV tensors were registered")
        self.layers: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            if t.shape[block_dim] != num_blocks:
                raise ValueError(
                    f"KV tensor {i} has shape {tuple(t.shape)}: dim {block_dim} is not {num_blocks} blocks"
                )
            if not t.is_contiguous():
                raise ValueError(f"KV tensor {i} is not contiguous; its blocks cannot be copied as rows")
            planes = 1
            for d in t.shape[:block_dim]:
                planes *= d
            self.layers.append(t.view(planes, num_blocks, -1))
        shapes = {tuple(v.shape) for v in self.layers}
        if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1:
            raise ValueError(f"KV tensors differ in shape or dtype: {sorted(shapes)}")
        self.planes, self.num_blocks, self.row_elems = self.layers[0].shape
        self.block_size = block_size
        self.geometry = geometry
        self.device = tensors[0].device
        self.dtype = tensors[0].dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes one block holds in one layer (all planes)."""
        return self.planes * self.row_elems * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds across all layers."""
        return self.num_layers * self.layer_block_bytes

    def chunk_shape(self, chunk_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, self.planes, chunk_blocks, self.row_elems)

    def pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as a one-layer pool ``[1, planes, num_blocks, row]`` for `kernels.torch_ops`."""
        return self.layers[layer].unsqueeze(0)
