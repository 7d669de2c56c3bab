"""The dtype and shape of a chunk's raw bytes (`ChunkLayout`): what a codec knows of a chunk, and what a worker
tells the scheduler of one block's chunk (`WorkerHandshake.block_layout`)."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}
BLOCK_AXIS = 2   # chunks are [layers, planes, blocks, ...] in both L0 layouts (kv_cache, layer_tensors)


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """The dtype and shape of a chunk's raw bytes: what a codec knows of a chunk."""
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def raw_len(self) -> int:
        return self.numel * self.itemsize

    def blocks(self, n: int) -> "ChunkLayout":
        """The layout of a chunk of ``n`` blocks, given this one's."""
        return ChunkLayout(self.dtype, self.shape[:BLOCK_AXIS] + (n,) + self.shape[BLOCK_AXIS + 1:])
