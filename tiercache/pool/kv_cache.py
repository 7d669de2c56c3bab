"""The L0 KV tensors: preallocated for all layers, addressed by block id.

Worker side: this module owns the bytes of L0; `BlockPool` owns which block
holds what. Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`` (geometry layout ``LKBTHD``): a layer's K or V of one block is
contiguous, so gathering a chunk moves ``2 * num_layers`` runs per block and a
layer can be loaded on its own for layerwise pipelining.

With ``num_shards > 1`` the KV heads are split across that many tensors, one
per simulated tensor-parallel rank (`shard` gives rank ``i``'s part as a cache
of its own), the way each rank of a TP deployment holds its heads: the
reference engine's attention reads all of them, each rank's connector worker
moves only its own.

A hybrid model's linear-attention layers keep no KV: each keeps a recurrent
state per block instead (``states``: ``[state layers, num_blocks,
state_size]`` float32, row ``b`` the state after block ``b``'s last computed
token), so a block that holds a prefix holds the state at its end too.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tiercache.contracts.keys import KVGeometry


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
    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: str = "auto",
                 num_shards: int = 1, parts: Sequence[torch.Tensor] | None = None,
                 state_layers: Sequence[int] = (), state_size: int = 0) -> None:
        if num_shards < 1 or geometry.num_kv_heads % num_shards:
            raise ValueError(f"{geometry.num_kv_heads} KV heads cannot be split across {num_shards} ranks")
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_shards = num_shards
        self.dtype = torch_dtype(geometry.dtype)
        g = geometry
        if parts is None:
            self.device = resolve_device(device)
            shape = (g.num_layers, 2, num_blocks, block_size, g.num_kv_heads // num_shards, g.head_dim)
            parts = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_shards)]
        else:
            self.device = parts[0].device
        self.parts = list(parts)
        self.state_layers = {layer: i for i, layer in enumerate(state_layers)}   # layer → its row in ``states``
        self.states = torch.zeros((len(state_layers), num_blocks, state_size), dtype=torch.float32,
                                  device=self.device) if state_layers else None

    @property
    def kv(self) -> torch.Tensor:
        """The one KV tensor of an unsharded cache."""
        if self.num_shards != 1:
            raise ValueError(f"this cache is split across {self.num_shards} ranks: use shard(i)")
        return self.parts[0]

    def shard(self, i: int) -> PagedKVCache:
        """Rank ``i``'s heads, as a cache of their own (sharing the tensor)."""
        geometry = replace(self.geometry, num_kv_heads=self.geometry.num_kv_heads // self.num_shards)
        return PagedKVCache(geometry, self.num_blocks, self.block_size, parts=[self.parts[i]])

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds across all layers, K and V (of every shard)."""
        return sum(p[:, :, 0].numel() * p.element_size() for p in self.parts)

    def chunk_shape(self, chunk_blocks: int) -> tuple[int, ...]:
        """Shape of a chunk of ``chunk_blocks`` blocks as stored (the layout of `kernels.torch_ops.chunk_view`)."""
        g = self.geometry
        return (g.num_layers, 2, chunk_blocks, self.block_size, g.num_kv_heads // self.num_shards, g.head_dim)

    def layer(self, layer: int) -> torch.Tensor:
        """``[2, num_blocks, block_size, heads, head_dim]`` view of one layer (unsharded caches)."""
        return self.kv[layer]

    def layer_parts(self, layer: int) -> list[torch.Tensor]:
        """One layer of every shard, in head order."""
        return [p[layer] for p in self.parts]

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks ``src[i] → dst[i]`` (copy-on-write) in one indexed op per shard."""
        if not src:
            return
        src_t = torch.as_tensor(src, device=self.device)
        dst_t = torch.as_tensor(dst, device=self.device)
        for part in self.parts:
            part.index_copy_(2, dst_t, part.index_select(2, src_t))
        if self.states is not None:
            self.states.index_copy_(1, dst_t, self.states.index_select(1, src_t))

    def state(self, layer: int) -> torch.Tensor:
        """``[num_blocks, state_size]``: linear-attention layer ``layer``'s state after each block."""
        return self.states[self.state_layers[layer]]
