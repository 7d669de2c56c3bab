"""Namespaces, chained block hashes and chunk keys.

Runs anywhere (scheduler or worker side): pure functions over token ids.

A block's hash is ``h_i = H(h_{i-1} ‖ tokens_i ‖ extra_i)`` with ``h_{-1}``
the namespace digest, so two models, KV layouts or tenants never share a key.
Token ids are packed once into one little-endian uint32 buffer with numpy and
each block hashes a slice of it: the per-block Python work is one hash call.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import numpy as np

from tiercache.registry import Registry

BlockHash = NewType("BlockHash", bytes)
"""32-byte chained hash of a full block; also the key of the chunk it ends."""

HASH_BYTES = 32
NAMESPACE_DIGEST_BYTES = 16

HashFn = Callable[[bytes], bytes]
hash_functions: Registry[HashFn] = Registry("hash function")


@hash_functions.register("sha256")
def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@hash_functions.register("blake3")
def _blake3(data: bytes) -> bytes:
    import blake3
    return blake3.blake3(data).digest()


@hash_functions.register("xxh3_128")
def _xxh3_128(data: bytes) -> bytes:
    """Fast and non-cryptographic: collisions can be forged, so never use it across tenants."""
    import xxhash
    digest = xxhash.xxh3_128_digest(data)
    return digest + digest  # widen to HASH_BYTES so every key has one size


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of the KV cache one block holds, as the engine lays it out."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str          # torch dtype name without the prefix: "bfloat16", "float32"
    layout: str = "LKBTHD"  # layers, k/v, blocks, tokens, heads, head_dim

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVGeometry.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two KV caches incompatible."""
    model: str
    geometry: KVGeometry
    block_size: int
    revision: str = ""
    tenant_salt: str = ""

    def digest(self) -> bytes:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"tiercache-namespace-v1\0" + canonical).digest()[:NAMESPACE_DIGEST_BYTES]

    def storage_digest(self, chunk_tokens: int, shard: KVShard | None = None, lossy_codec: str = "") -> bytes:
        """What one rank's stored chunks are filed under (Redis key prefix, server namespace, L2 directory,
        chunk headers): the namespace, the chunk size, the rank's share of the KV and a lossy codec's name.
        A chunk's key is the hash of its last block, so a 512-token chunk and the second 256-token chunk of
        the same prompt share a key; rank 1 of a TP=2 deployment holds other bytes for a key than rank 0, or
        a TP=1 one; and a quantized chunk holds other values than a raw one. Deployments that differ in any
        of these must not read (and, failing to, delete) each other's chunks. (A lossless codec decodes to
        the same bytes, so it is not named: such chunks serve any reader.)"""
        label = (shard or KVShard()).label().encode()
        lossy = b";codec=" + lossy_codec.encode() if lossy_codec else b""
        return hashlib.sha256(b"tiercache-chunks-v2\0" + self.digest() + chunk_tokens.to_bytes(4, "little")
                              + label + lossy).digest()[:NAMESPACE_DIGEST_BYTES]


@dataclass(frozen=True, slots=True)
class KVShard:
    """The share of a deployment's KV one rank holds: its tensor-parallel rank, its pipeline stage, and the
    layout of its tensors. With ``replicated`` KV (MLA: every TP rank holds the same latent cache) one copy
    serves every rank, whatever the TP size, and only TP rank 0 writes it."""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    replicated: bool = False
    layout: str = ""

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size} is out of range")

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def num_ranks(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def writer(self) -> bool:
        """Whether this rank writes the lower tiers (every rank, unless its KV is another rank's copy)."""
        return not self.replicated or self.tp_rank == 0

    def label(self) -> str:
        tp = "tp*" if self.replicated else f"tp{self.tp_rank}/{self.tp_size}"
        return f"{tp};pp{self.pp_rank}/{self.pp_size};{self.layout}"


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


class BlockHasher:
    """Hashes full blocks of token ids into a chain seeded by a namespace."""

    def __init__(self, namespace: Namespace, hash_name: str = "sha256") -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.hash_name = hash_name
        self._hash = hash_functions.get(hash_name)
        self.seed = BlockHash(namespace.digest().ljust(HASH_BYTES, b"\0"))

    @classmethod
    def from_seed(cls, seed: bytes, block_size: int, hash_name: str = "sha256") -> BlockHasher:
        """A hasher that chains exactly as an engine whose namespace seed is ``seed`` (a router's: it knows a
        replica's seed from its descriptor, not its namespace)."""
        hasher = cls.__new__(cls)
        hasher.namespace = None
        hasher.block_size = block_size
        hasher.hash_name = hash_name
        hasher._hash = hash_functions.get(hash_name)
        if len(seed) != HASH_BYTES:
            raise ValueError(f"a chain seed has {HASH_BYTES} bytes, got {len(seed)}")
        hasher.seed = BlockHash(bytes(seed))
        return hasher

    def seed_for(self, cache_salt: str = "", lora: str = "") -> BlockHash:
        """Where a request's chain starts: the namespace's seed, moved by the request's ``cache_salt`` (a
        tenant's, as vLLM takes it per request) and its LoRA adapter, so that two tenants, or two adapters,
        never share a block — in the engine's pool or in any tier — however equal their prompts."""
        if not cache_salt and not lora:
            return self.seed
        parts = json.dumps([cache_salt, lora], separators=(",", ":")).encode()
        return BlockHash(self._hash(b"tiercache-seed-v1\0" + self.seed + parts))

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        parent: BlockHash | None = None,
        extra_keys: Sequence[bytes] | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``, continuing the chain at ``parent``.

        ``extra_keys[i]``, when given, is mixed into block i (LoRA id,
        multimodal input hash...). A trailing partial block is not hashed.
        """
        buf = tokens_to_bytes(token_ids)
        step = self.block_size * 4
        num_blocks = len(buf) // step
        if extra_keys is not None and len(extra_keys) < num_blocks:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_blocks} blocks")
        h = self._hash
        prev = self.seed if parent is None else parent
        out: list[BlockHash] = []
        append = out.append
        if extra_keys is None:
            for off in range(0, num_blocks * step, step):
                prev = h(prev + buf[off:off + step])
                append(prev)
        else:
            for i, off in enumerate(range(0, num_blocks * step, step)):
                prev = h(prev + buf[off:off + step] + extra_keys[i])
                append(prev)
        return out  # type: ignore[return-value]


def chunk_keys(
    block_hashes: Sequence[BlockHash], blocks_per_chunk: int, include_partial: bool = False
) -> list[BlockHash]:
    """Key of each chunk: the hash of its last block."""
    n = len(block_hashes)
    keys = [block_hashes[i] for i in range(blocks_per_chunk - 1, n, blocks_per_chunk)]
    if include_partial and n % blocks_per_chunk:
        keys.append(block_hashes[-1])
    return keys


def tail_keys(block_hashes: Sequence[BlockHash], blocks_per_chunk: int, chunk: int) -> list[BlockHash]:
    """Keys of the chunks shorter than chunk ``chunk`` of a request that could have been stored at its
    position, longest first: the ``j``-block one is keyed by its ``j``-th block's hash (another request that
    ended there stored it: a conversation's previous turn, whose last chunk was partial). Entry ``i`` covers
    ``len(result) - i`` blocks."""
    start = chunk * blocks_per_chunk
    longest = min(blocks_per_chunk, len(block_hashes) - start) - 1
    return [block_hashes[start + j - 1] for j in range(longest, 0, -1)]


def first_held(candidates: Sequence[BlockHash], held: Callable[[BlockHash], object]) -> int:
    """Blocks of the longest of ``candidates`` (`tail_keys`, longest first) that ``held(key)`` says is there."""
    for i, key in enumerate(candidates):
        if held(key):
            return len(candidates) - i
    return 0
