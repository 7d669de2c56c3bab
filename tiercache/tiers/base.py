"""What every tier below L0 shares: its medium, a leading-run `contains`, delete, capacity and counters.

Tier indexes are bookkeeping only and are driven from one thread (the
manager's); the bytes they describe are moved by transfer handlers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum

from tiercache.keys import BlockHash


class Medium(str, Enum):
    DEVICE = "device"   # L0: the engine's paged pool
    CPU = "cpu"         # L1: (pinned) host memory
    DISK = "disk"       # L2: local NVMe
    REMOTE = "remote"   # L3: Redis or a tiercache server


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters; only the owning tier increments them."""
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys: int = 0
    stored: int = 0
    store_rejected: int = 0      # no room (everything pinned) or already present
    loaded: int = 0
    load_misses: int = 0         # asked for, then gone when read (evicted, changed meanwhile, tier down)
    evicted: int = 0
    deleted: int = 0
    integrity_failures: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Tier(ABC):
    name: str
    medium: Medium

    def __init__(self) -> None:
        self.counters = TierCounters()
        self._removals: list[BlockHash] | None = None   # kept only while watched (`watch_removals`)

    def watch_removals(self) -> None:
        """Keep the keys that leave this tier from now on — evicted, or deleted — for `take_removed`
        (a connector turns them into KV events, so that a router's view of the tier stays true)."""
        if self._removals is None:
            self._removals = []

    def take_removed(self) -> list[BlockHash]:
        """The keys removed since the last call, in order (empty when not watched)."""
        if not self._removals:
            return []
        out, self._removals = self._removals, []
        return out

    def _removed(self, keys: Sequence[BlockHash]) -> None:
        if self._removals is not None:
            self._removals.extend(keys)

    @abstractmethod
    def contains(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` are present and readable."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockHash]) -> int:
        """Remove keys that are present and not in use; returns how many were removed."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def num_chunks(self) -> int: ...

    def close(self) -> None:
        """Release connections or handles (the tier is not used afterwards)."""

    def link(self, pairs: Sequence[tuple[BlockHash, BlockHash | None]]) -> None:
        """Each stored chunk's parent, for a chain-aware eviction policy; tiers without an index ignore it."""

    @property
    def available(self) -> bool:
        """Whether the tier answers at all (a remote tier in an outage answers misses without asking)."""
        return True

    def stats(self) -> dict[str, object]:
        c = self.counters
        return {
            "name": self.name,
            "medium": self.medium.value,
            "available": int(self.available),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "chunks": self.num_chunks,
            "key_hit_ratio": c.hit_keys / c.lookup_keys if c.lookup_keys else 0.0,
            **c.as_dict(),
        }

    def _count_lookup(self, asked: int, hit: int) -> int:
        self.counters.lookups += 1
        self.counters.lookup_keys += asked
        self.counters.hit_keys += hit
        return hit


class LowerTier(Tier):
    """A tier below L1 that stores whole chunks as bytes (disk, remote).

    Its index follows the same two-phase lifecycle as L1; the bytes move
    between an L1 slot and the tier in transfer handlers.
    """
    indexed = True       # `has` reads a local index; False for a remote tier, where it is a network round trip
    parallel_jobs = True  # split a batch across transfer workers (False: one job, e.g. one gRPC stream)

    @abstractmethod
    def reserve_bytes(self, raw_len: int) -> int:
        """Room one chunk of ``raw_len`` raw bytes may take, headers and codec overhead included."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        """Reserve room per key; False where the key is present or no room can be made."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockHash], failed: Sequence[BlockHash] = ()) -> None: ...

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        """Pin ready keys for reading; KeyError for a missing one."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockHash], failed: Sequence[BlockHash] = ()) -> None:
        """Unpin ``keys``; ``failed`` are those whose read did not place a chunk (the tier knows why: only
        a value that failed verification is an integrity failure, and deleted)."""

    @abstractmethod
    def has(self, key: BlockHash) -> bool:
        """Whether ``key`` is stored and readable, without counting a lookup."""
