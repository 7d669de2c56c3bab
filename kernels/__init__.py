"""Block gather/scatter between the paged L0 pool and contiguous chunk buffers.

Imported as ``tiercache.kernels``. The torch implementation (`torch_ops`) is
the CPU path and the reference every accelerated kernel is tested against.
"""
from tiercache.kernels.torch_ops import (
    chunk_view,
    gather_blocks,
    gather_chunks,
    scatter_blocks,
    scatter_chunks,
)

__all__ = ["chunk_view", "gather_blocks", "gather_chunks", "scatter_blocks", "scatter_chunks"]
