"""Gather and scatter whole blocks between the paged pool and chunk buffers.

Worker side. The pool tensor is ``[L, 2, num_blocks, *block_shape]``; a chunk
buffer holds the same blocks as ``[L, 2, n, *block_shape]`` (layer-major, the
layout L0 has, so one layer of a chunk is one strided slice).

- Whole chunks in adjacent buffers move in one op: `index_select` /
  `index_copy_` over the pool viewed as rows ``(layer, k/v, block)``, with a
  row index built by one vectorized expression. When the blocks form one
  ascending run (a request's table in a fresh pool) a strided `copy_`
  replaces the index. `gather_blocks` / `scatter_blocks` serve a block
  sub-range of a single chunk (a load that skips blocks L0 already holds).
- Rows are reinterpreted as the widest element type that divides them
  (16-byte ``complex128`` for every real KV shape): torch's indexed-copy
  kernels cost per element, and ``index_copy_`` moves bf16 KV much faster as
  16-byte elements than as 2-byte ones.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

ALL_LAYERS = slice(None)
_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _row_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    for dtype in _WIDE:
        size = torch.empty((), dtype=dtype).element_size()
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def rows(pool: torch.Tensor) -> torch.Tensor:
    """``[L, 2, num_blocks, row_bytes]`` uint8 view of the pool."""
    return pool.view(torch.uint8).reshape(pool.shape[0], pool.shape[1], pool.shape[2], -1)


def chunk_view(pool: torch.Tensor, buffer: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a flat uint8 chunk buffer as ``[L, 2, num_blocks, row_bytes]``."""
    num_layers, kv, row = pool.shape[0], pool.shape[1], rows(pool).shape[-1]
    return buffer.view(torch.uint8)[: num_layers * kv * num_blocks * row].view(num_layers, kv, num_blocks, row)


def as_run(block_ids: Sequence[int]) -> slice | None:
    """The slice ``block_ids`` covers when it is one ascending run, else None."""
    first = block_ids[0]
    if block_ids[-1] - first != len(block_ids) - 1:
        return None
    for i, b in enumerate(block_ids):
        if b != first + i:
            return None
    return slice(first, first + len(block_ids))


def _wide(pool_rows: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _row_dtype(pool_rows.shape[-1], pool_rows, chunk)
    return pool_rows.view(dtype), chunk.view(dtype)


def gather_blocks(pool: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """``out[:, :, i] = pool[:, :, block_ids[i]]``; ``out`` is a `chunk_view` (or a block sub-range of one)."""
    if not block_ids:
        return
    src, dst = _wide(rows(pool), out)
    run = as_run(block_ids)
    if run is not None:
        dst.copy_(src[:, :, run])
    elif dst.is_contiguous() and dst.device == src.device:
        torch.index_select(src, 2, torch.as_tensor(block_ids, device=pool.device), out=dst)
    else:
        dst.copy_(src.index_select(2, torch.as_tensor(block_ids, device=pool.device)))


def scatter_blocks(pool: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """``pool[:, :, block_ids[i]] = src[:, :, i]``; ``src`` is a `chunk_view` (or a block sub-range of one)."""
    if not block_ids:
        return
    dst, source = _wide(rows(pool), src)
    if source.device != dst.device:  # host chunk into a device pool: one bulk copy, then index
        source = source.to(dst.device, non_blocking=True)
    run = as_run(block_ids)
    if run is not None:
        dst[:, :, run].copy_(source)
    else:
        dst.index_copy_(2, torch.as_tensor(block_ids, device=pool.device), source)


def _tensor_run(ids: torch.Tensor) -> slice | None:
    flat = ids.reshape(-1)
    first = int(flat[0])
    if int(flat[-1]) - first != flat.numel() - 1 or not bool((flat.diff() == 1).all()):
        return None
    return slice(first, first + flat.numel())


def _flat_rows(pool: torch.Tensor) -> torch.Tensor:
    """``[L * 2 * num_blocks, row_bytes]`` uint8 view: row ``(l * 2 + kv) * num_blocks + b``."""
    return rows(pool).reshape(-1, rows(pool).shape[-1])


def _chunk_row_index(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pool row of every row of ``k`` adjacent chunk buffers, in buffer order ``[k, L, 2, n]``."""
    k, n = block_ids.shape
    planes = pool.shape[0] * pool.shape[1]
    offsets = torch.arange(planes, device=pool.device).mul_(pool.shape[2]).view(1, planes, 1)
    return (offsets + block_ids.to(pool.device).view(k, 1, n)).reshape(-1)


def _flat_pair(pool: torch.Tensor, buffer: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = _flat_rows(pool)
    row = flat.shape[-1]
    return _wide(flat, buffer.view(torch.uint8)[: num_rows * row].view(num_rows, row))


def _per_chunk(pool: torch.Tensor, block_ids: Sequence[Sequence[int]], buffer: torch.Tensor,
               layers: slice, op) -> None:
    """One layer range of ``k`` adjacent chunk buffers, chunk by chunk (a layer of adjacent chunks is strided)."""
    n = len(block_ids[0])
    chunk_bytes = rows(pool)[:, :, :n].numel()
    for c, ids in enumerate(block_ids):
        view = chunk_view(pool, buffer.view(torch.uint8)[c * chunk_bytes:(c + 1) * chunk_bytes], n)
        op(pool[layers], ids, view[layers])


def gather_chunks(pool: torch.Tensor, block_ids: Sequence[Sequence[int]], out: torch.Tensor,
                  layers: slice | None = None) -> None:
    """Copy ``k`` whole chunks (``block_ids[c]`` are chunk ``c``'s blocks) into the ``k`` adjacent
    chunk buffers that start at ``out``, in one op whatever the blocks' order in the pool.

    ``layers`` restricts the copy to those layers (layerwise transfers)."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    run = _tensor_run(ids)
    if run is not None:  # one ascending run: a strided bulk copy, no index at all
        region, chunks = _run_pair(pool, run, out, ids.shape)
        chunks[layers or ALL_LAYERS].copy_(region[layers or ALL_LAYERS])
        return
    if layers is not None:  # a layer range of adjacent chunks is strided: chunk by chunk
        _per_chunk(pool, block_ids, out, layers, gather_blocks)
        return
    index = _chunk_row_index(pool, ids)
    src, dst = _flat_pair(pool, out, index.numel())
    if dst.device == src.device:
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(src.index_select(0, index))


def scatter_chunks(pool: torch.Tensor, block_ids: Sequence[Sequence[int]], src: torch.Tensor,
                   layers: slice | None = None) -> None:
    """Inverse of `gather_chunks`."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    run = _tensor_run(ids)
    if run is not None:
        region, chunks = _run_pair(pool, run, src, ids.shape)
        region[layers or ALL_LAYERS].copy_(chunks[layers or ALL_LAYERS].to(region.device, non_blocking=True))
        return
    if layers is not None:
        _per_chunk(pool, block_ids, src, layers, scatter_blocks)
        return
    index = _chunk_row_index(pool, ids)
    dst, source = _flat_pair(pool, src, index.numel())
    if source.device != dst.device:
        source = source.to(dst.device, non_blocking=True)
    dst.index_copy_(0, index, source)


def _run_pair(pool: torch.Tensor, run: slice, buffer: torch.Tensor, shape: torch.Size):
    """(pool region, chunk buffers) as matching ``[L, 2, k, n, row]`` views for a run of blocks."""
    k, n = shape
    pool_rows = rows(pool)
    layers, kv, row = pool_rows.shape[0], pool_rows.shape[1], pool_rows.shape[-1]
    region = pool_rows[:, :, run].reshape(layers, kv, k, n, row)
    chunks = buffer.view(torch.uint8)[: k * layers * kv * n * row].view(k, layers, kv, n, row).permute(1, 2, 0, 3, 4)
    return _wide(region, chunks)
