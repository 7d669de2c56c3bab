"""Small chunks for the disk tier's tests: keys, metas and payloads by index."""
import numpy as np

from tiercache.contracts.keys import BlockHash
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkMeta

NS = b"n" * 16
SHAPE = (2, 2, 4, 4, 1, 16)       # a chunk of 4 blocks × 4 tokens, one 16-wide head, float16
RAW = 2 * 2 * 4 * 4 * 1 * 16 * 2
FILE = HEADER_BYTES + RAW


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def meta(i: int, ns: bytes = NS) -> ChunkMeta:
    return ChunkMeta(ns, key(i), 16, "float16", SHAPE)


def data(i: int) -> bytes:
    return np.random.default_rng(i).standard_normal(RAW // 2).astype(np.float16).tobytes()
