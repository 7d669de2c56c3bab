"""Where prefixes live: one replica's blocks and chunks, per medium, kept from its KV events (router side).

A prompt is hashed the way the replica hashes it (`KeyScheme`, chosen by the
descriptor's ``key_scheme``): the block hashes of its pool and the chunk keys
of its tiers. `ReplicaIndex.cached` then says how many leading tokens each
medium can give: the pool (``GPU``) as the engine would find them, then the
tiers beyond what the pool holds, each chunk counted at the fastest medium
that has it — the split the cost model needs (a chunk in host memory loads
faster than one on disk, which loads faster than recomputing it).

Only the router's event task writes an index; routing reads it on the same
event loop, so it needs no lock.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tiercache.contracts.keys import BlockHasher, chunk_keys
from tiercache.fleet.descriptor import ReplicaDescriptor
from tiercache.fleet.kv_events import MEDIUM_ENGINE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tiercache.registry import Registry

TIER_MEDIA = ("CPU", "DISK", "REMOTE")      # fastest first: a chunk counts at the first that has it


@dataclass(frozen=True, slots=True)
class PromptKeys:
    num_tokens: int
    block_hashes: list[bytes]   # the pool's blocks
    chunk_keys: list[bytes]     # the tiers' chunks


class KeyScheme(ABC):
    """How one kind of replica names a prompt's blocks and chunks."""

    def __init__(self, descriptor: ReplicaDescriptor) -> None:
        self.block_size = descriptor.block_size
        self.chunk_tokens = descriptor.chunk_tokens
        # replicas with one signature name a prompt's blocks alike: the router hashes it once for all of them
        self.signature = (descriptor.key_scheme, descriptor.seed, descriptor.hash, descriptor.block_size,
                          descriptor.chunk_tokens)

    @abstractmethod
    def keys(self, tokens: list[int], cache_salt: str) -> PromptKeys:
        """The prompt's block hashes and chunk keys, as this kind of replica computes them."""


key_schemes: Registry[type[KeyScheme]] = Registry("key scheme")


@key_schemes.register("tiercache")
class TierCacheKeys(KeyScheme):
    """tiercache's chains (the reference engine, and tiercache's tiers under any engine): the replica's seed,
    moved by the request's ``cache_salt``, then one hash per block; a chunk's key is its last block's hash."""

    def __init__(self, descriptor: ReplicaDescriptor) -> None:
        super().__init__(descriptor)
        self.hasher = BlockHasher.from_seed(bytes.fromhex(descriptor.seed), descriptor.block_size, descriptor.hash)
        self.blocks_per_chunk = max(descriptor.chunk_tokens // descriptor.block_size, 1)

    def keys(self, tokens: list[int], cache_salt: str) -> PromptKeys:
        hashes = self.hasher.hash_blocks(tokens, parent=self.hasher.seed_for(cache_salt))
        chunks = chunk_keys(hashes, self.blocks_per_chunk) if self.chunk_tokens else []
        return PromptKeys(len(tokens), hashes, chunks)


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """How many leading prompt tokens a replica can take from where, without computing them."""
    engine: int                                          # in its own pool
    tiers: dict[str, int] = field(default_factory=dict)  # beyond the pool, per tier medium

    @property
    def total(self) -> int:
        return self.engine + sum(self.tiers.values())


class ReplicaIndex:
    """One replica's blocks (pool) and chunks (tiers), per medium, as its events say."""

    def __init__(self) -> None:
        self.media: dict[str, set[bytes]] = {}

    def clear(self) -> None:
        self.media.clear()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.media.setdefault(event.medium or MEDIUM_ENGINE, set()).update(map(_key, event.block_hashes))
            elif isinstance(event, BlockRemoved):
                held = self.media.get(event.medium or MEDIUM_ENGINE)
                if held:
                    held.difference_update(map(_key, event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self.media.clear()

    def num_keys(self) -> dict[str, int]:
        return {medium: len(keys) for medium, keys in self.media.items()}

    def cached(self, prompt: PromptKeys, scheme: KeyScheme, shared: Sequence[set[bytes]] = ()) -> CachedTokens:
        """What the replica would find for ``prompt``: at most all tokens but the last (an engine computes at
        least one). ``shared``: what the other replicas that read the same shared tiers (with the same chains)
        stored there — this replica loads those chunks too, at the remote rate."""
        limit = max(prompt.num_tokens - 1, 0)
        engine_blocks = _leading(prompt.block_hashes, self.media.get(MEDIUM_ENGINE, ()))
        engine = min(engine_blocks * scheme.block_size, limit)
        tiers: dict[str, int] = {}
        if scheme.chunk_tokens:
            sources = [(m, held) for m in TIER_MEDIA for held in (self.media.get(m),) if held]
            sources += [("REMOTE", held) for held in shared if held]
            covered = 0
            for key in prompt.chunk_keys:
                medium = next((m for m, held in sources if key in held), None)
                if medium is None:
                    break
                start, covered = covered, min(covered + scheme.chunk_tokens, limit)
                beyond = covered - max(start, engine)
                if beyond > 0:
                    tiers[medium] = tiers.get(medium, 0) + beyond
        return CachedTokens(engine, tiers)


def _key(value: object) -> bytes:
    return value if isinstance(value, bytes) else int(value).to_bytes(8, "big", signed=True)


def _leading(keys: Iterable[bytes], held) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
