"""CUDA gather/scatter between the paged device pool and pinned host chunk buffers (cupy, compiled at run time).

Worker side, used only when the pool lives on a CUDA device and cupy is
installed (``pip install tiercache[cuda]``); `tiercache.kernels.torch_ops` is
the fallback and the reference `benchmarks/gpu_check.py` compares against.

The pool is viewed as rows ``(layer, k/v, block)`` of ``row_bytes`` each, as
in the torch path. One kernel launch moves every row of a plan: thread ``i``
copies 16-byte vector ``i`` (``int4`` loads and stores), reading the device
pool and writing the pinned host buffer directly through unified virtual
addressing (or the reverse), so there is no device staging buffer and no
second copy. Launches go on a dedicated stream per direction; the caller
synchronizes that stream before the host reads the buffer or the pool's
blocks are reused, and the row index tensor is kept referenced until then.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.arith import ceil_div

_SOURCE = r"""
extern "C" __global__
void gather_rows(const int4* __restrict__ pool, int4* __restrict__ out,
                 const long long* __restrict__ rows, long long vecs_per_row, long long n_rows) {
    long long total = n_rows * vecs_per_row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / vecs_per_row;
        long long v = i - r * vecs_per_row;
        out[i] = pool[rows[r] * vecs_per_row + v];
    }
}

extern "C" __global__
void scatter_rows(int4* __restrict__ pool, const int4* __restrict__ src,
                  const long long* __restrict__ rows, long long vecs_per_row, long long n_rows) {
    long long total = n_rows * vecs_per_row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / vecs_per_row;
        long long v = i - r * vecs_per_row;
        pool[rows[r] * vecs_per_row + v] = src[i];
    }
}
"""

THREADS = 256
MAX_BLOCKS = 65535


class CudaBlockCopier:
    """Compiled kernels plus one stream per direction for one device."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self.device = device
        with cupy.cuda.Device(device.index or 0):
            module = cupy.RawModule(code=_SOURCE)
            self._gather = module.get_function("gather_rows")
            self._scatter = module.get_function("scatter_rows")
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    @staticmethod
    def supports(pool: torch.Tensor, buffer: torch.Tensor) -> bool:
        row_bytes = pool[0, 0, 0].numel() * pool.element_size()
        return (pool.is_cuda and buffer.is_pinned() and row_bytes % 16 == 0
                and pool.data_ptr() % 16 == 0 and buffer.data_ptr() % 16 == 0)

    def _rows(self, pool: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.int64).to(pool.device, non_blocking=True)
        k, n = ids.shape
        planes = pool.shape[0] * pool.shape[1]
        offsets = torch.arange(planes, device=pool.device).mul_(pool.shape[2]).view(1, planes, 1)
        return (offsets + ids.view(k, 1, n)).reshape(-1)

    def _launch(self, fn, stream: torch.cuda.Stream, pool: torch.Tensor, buffer: torch.Tensor,
                rows: torch.Tensor) -> None:
        cupy = self._cupy
        vecs = pool[0, 0, 0].numel() * pool.element_size() // 16
        total = rows.numel() * vecs
        blocks = max(1, min(MAX_BLOCKS, ceil_div(total, THREADS)))
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            fn((blocks,), (THREADS,), (cupy.uint64(pool.data_ptr()), cupy.uint64(buffer.data_ptr()),
                                       cupy.uint64(rows.data_ptr()), cupy.int64(vecs), cupy.int64(rows.numel())))

    def gather_chunks(self, pool: torch.Tensor, block_ids: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        """Device pool → adjacent pinned chunk buffers at ``out``; returns once the bytes are on the host."""
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_stream(torch.cuda.current_stream(pool.device))  # the forward wrote these blocks
            rows = self._rows(pool, block_ids)
            self._launch(self._gather, self.d2h, pool, out, rows)
        self.d2h.synchronize()   # rows and out stay referenced until here

    def scatter_chunks(self, pool: torch.Tensor, block_ids: Sequence[Sequence[int]], src: torch.Tensor) -> None:
        """Adjacent pinned chunk buffers at ``src`` → device pool; returns once the pool holds them."""
        with torch.cuda.stream(self.h2d):
            rows = self._rows(pool, block_ids)
            self._launch(self._scatter, self.h2d, pool, src, rows)
        self.h2d.synchronize()


def make_copier(pool: torch.Tensor) -> CudaBlockCopier | None:
    """A copier for ``pool``'s device, or None when the torch path must be used (no CUDA pool, no cupy)."""
    if not pool.is_cuda:
        return None
    try:
        import cupy  # noqa: F401
    except ImportError:
        return None
    return CudaBlockCopier(pool.device)
