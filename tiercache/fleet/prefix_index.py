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

from tiercache.contracts.groups import resume_key
from tiercache.contracts.keys import BlockHash, BlockHasher, chunk_keys, first_held, tail_keys
from tiercache.fleet.descriptor import ReplicaDescriptor
from tiercache.fleet.kv_events import MEDIUM_ENGINE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tiercache.registry import Registry

TIER_MEDIA = ("CPU", "DISK", "REMOTE")      # fastest first: a chunk counts at the first that has it


@dataclass(frozen=True, slots=True)
class PromptKeys:
    num_tokens: int
    block_hashes: list[bytes]   # the pool's blocks
    chunk_keys: list[bytes]     # the tiers' chunks
    tier_blocks: list[bytes] = field(default_factory=list)   # the tiers' chains, where they are not the pool's


class KeyScheme(ABC):
    """How one kind of replica names a prompt's blocks and chunks."""

    translated_media: frozenset[str] = frozenset()   # media whose event hashes the router renames (`block_names`)

    def __init__(self, descriptor: ReplicaDescriptor) -> None:
        self.block_size = descriptor.block_size
        self.chunk_tokens = descriptor.chunk_tokens
        self.blocks_per_chunk = max(descriptor.chunk_tokens // descriptor.block_size, 1)
        self.partial_chunks = descriptor.partial_chunks and bool(descriptor.chunk_tokens)
        self.resume_points = descriptor.resume_points and bool(descriptor.chunk_tokens)
        # replicas with one signature name a prompt's blocks alike: the router hashes it once for all of them
        self.signature = (descriptor.key_scheme, descriptor.seed, descriptor.hash, descriptor.block_size,
                          descriptor.chunk_tokens, self.partial_chunks, self.resume_points)

    @abstractmethod
    def keys(self, tokens: list[int], cache_salt: str) -> PromptKeys:
        """The prompt's block hashes and chunk keys, as this kind of replica computes them."""

    def engine_tokens(self, blocks: int, num_tokens: int) -> int:
        """Tokens the engine takes from its pool when the prompt's first ``blocks`` blocks are there (it
        computes at least the last token)."""
        return min(blocks * self.block_size, max(num_tokens - 1, 0))

    def block_names(self):
        """The router's names for a replica's event hashes of `translated_media`, one per replica (None: the
        hashes are the names)."""
        return None


key_schemes: Registry[type[KeyScheme]] = Registry("key scheme")


@key_schemes.register("tiercache")
class TierCacheKeys(KeyScheme):
    """tiercache's chains (the reference engine, and tiercache's tiers under any engine): the replica's seed,
    moved by the request's ``cache_salt``, then one hash per block; a chunk's key is its last block's hash."""

    def __init__(self, descriptor: ReplicaDescriptor) -> None:
        super().__init__(descriptor)
        self.hasher = BlockHasher.from_seed(bytes.fromhex(descriptor.seed), descriptor.block_size, descriptor.hash)

    def keys(self, tokens: list[int], cache_salt: str) -> PromptKeys:
        hashes = self.hasher.hash_blocks(tokens, parent=self.hasher.seed_for(cache_salt))
        chunks = chunk_keys(hashes, self.blocks_per_chunk, self.partial_chunks) if self.chunk_tokens else []
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
    """One replica's blocks (pool) and chunks (tiers), per medium, as its events say; and the pool blocks of
    the requests the router has sent it and not seen finish (`hold`, `release`): the replica is computing
    them, and a request that shares them and arrives meanwhile finds them in its pool — the replica takes
    its requests in order — before any event has said so. Without them, a conversation's next request sent
    while the first is still in its prefill was predicted a miss and could be sent elsewhere to compute the
    same prefix again."""

    def __init__(self) -> None:
        self.media: dict[str, set[bytes]] = {}
        self.names = None                       # the scheme's `block_names`, when its hashes are renamed
        self.renamed: frozenset[str] = frozenset()
        self.in_flight: dict[bytes, int] = {}   # pool block → requests sent here, not finished, that hold it

    def hold(self, blocks: Sequence[bytes]) -> None:
        in_flight = self.in_flight
        for block in blocks:
            in_flight[block] = in_flight.get(block, 0) + 1

    def release(self, blocks: Sequence[bytes]) -> None:
        in_flight = self.in_flight
        for block in blocks:
            n = in_flight[block] - 1
            if n:
                in_flight[block] = n
            else:
                del in_flight[block]

    def rename(self, scheme: KeyScheme) -> None:
        self.names, self.renamed = scheme.block_names(), scheme.translated_media

    def clear(self, media: frozenset[str] | None = None) -> None:
        """Forget ``media`` (all when None) and the names kept for them."""
        if media is None:
            self.media.clear()
        else:
            for medium in media:
                self.media.pop(medium, None)
        if self.names is not None:
            self.names.clear()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                # from a replica whose pool the router renames (vLLM) it is that pool's: its tiercache tiers
                # keep their chunks; from a tiercache replica it is everything (an announce follows)
                self.clear(self.renamed or None)
                continue
            if not isinstance(event, (BlockStored, BlockRemoved)):
                continue
            medium = event.medium or MEDIUM_ENGINE
            renamed = self.names is not None and medium in self.renamed
            if isinstance(event, BlockStored):
                keys = self.names.stored(event) if renamed else map(event_key, event.block_hashes)
                self.media.setdefault(medium, set()).update(keys)
            else:
                keys = self.names.removed(event) if renamed else map(event_key, event.block_hashes)
                held = self.media.get(medium)
                if held:
                    held.difference_update(keys)

    def num_keys(self) -> dict[str, int]:
        return {medium: len(keys) for medium, keys in self.media.items()}

    def cached(self, prompt: PromptKeys, scheme: KeyScheme, shared: Sequence[set[bytes]] = ()) -> CachedTokens:
        """What the replica would find for ``prompt``: at most all tokens but the last (an engine computes at
        least one). ``shared``: what the other replicas that read the same shared tiers (with the same chains)
        stored there — this replica loads those chunks too, at the remote rate. Where its lookups take shorter
        chunks (``partial_chunks``), the run of whole chunks ends on the longest one any medium holds. Where its
        hits end at a resume point (``resume_points``), the run is cut to the last chunk, short of the last
        token, whose resume point some medium holds."""
        limit = max(prompt.num_tokens - 1, 0)
        engine_blocks = _leading(prompt.block_hashes, self.media.get(MEDIUM_ENGINE, ()), self.in_flight)
        if self.names is not None:                          # a hybrid vLLM: every group's rule cuts it
            engine_blocks = self.names.resumable(prompt.block_hashes, engine_blocks, self.in_flight)
        engine = scheme.engine_tokens(engine_blocks, prompt.num_tokens)
        tiers: dict[str, int] = {}
        if not scheme.chunk_tokens:
            return CachedTokens(engine, tiers)
        sources = [(m, held) for m in TIER_MEDIA for held in (self.media.get(m),) if held]
        sources += [("REMOTE", held) for held in shared if held]
        chain = prompt.tier_blocks or prompt.block_hashes
        blocks_per_chunk, block_size = scheme.blocks_per_chunk, scheme.block_size
        found = []                                          # (medium, blocks it covers to, chunk key)
        for i, key in enumerate(prompt.chunk_keys):
            medium = _fastest(sources, key)
            if medium is None:
                if scheme.partial_chunks:
                    found += _longest_tail(sources, tail_keys(chain, blocks_per_chunk, i), i * blocks_per_chunk)
                break
            found.append((medium, min((i + 1) * blocks_per_chunk, len(chain)), key))
        if scheme.resume_points:
            found = _to_resume_point(sources, found, limit // block_size)
        covered = 0
        for medium, blocks, _ in found:
            start, covered = covered, min(blocks * block_size, limit)
            beyond = covered - max(start, engine)
            if beyond > 0:
                tiers[medium] = tiers.get(medium, 0) + beyond
        return CachedTokens(engine, tiers)


def _fastest(sources: Sequence[tuple[str, set[bytes]]], key: bytes) -> str | None:
    return next((m for m, held in sources if key in held), None)


def _longest_tail(sources, candidates: Sequence[bytes], start_block: int) -> list[tuple[str, int, bytes]]:
    """[(medium, blocks covered to, key)] for the longest of ``candidates`` (`tail_keys`) some source holds."""
    n = first_held(candidates, lambda key: _fastest(sources, key))
    key = candidates[len(candidates) - n] if n else b""
    return [(_fastest(sources, key), start_block + n, key)] if n else []


def _to_resume_point(sources, found: list[tuple[str, int, bytes]], max_blocks: int) -> list[tuple[str, int, bytes]]:
    """``found`` cut to its last chunk within ``max_blocks`` whose resume point some source holds (none: [])."""
    for end in range(len(found), 0, -1):
        if found[end - 1][1] <= max_blocks and _fastest(sources, resume_key(BlockHash(found[end - 1][2]))):
            return found[:end]
    return []


def event_key(value: object) -> bytes:
    """A hash from an event as the index keeps it: bytes as they are; vLLM's 64-bit ints (signed or not, by
    version) as their 8 bytes."""
    if isinstance(value, bytes):
        return value
    value = int(value)
    if -(1 << 63) <= value < (1 << 64):
        return (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    return value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)


def _leading(keys: Iterable[bytes], held, also=()) -> int:
    """How many of ``keys``, from the first, are in ``held`` or in ``also``."""
    n = 0
    for key in keys:
        if key not in held and key not in also:
            break
        n += 1
    return n
