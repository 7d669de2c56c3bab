"""The client tiers' contract below L1: `LowerIndex` (scheduler side) and `Transport` (worker side).

A tier is two objects (docs/architecture.md): an index on the scheduler side —
`tiercache.index.tier_index.TierIndex`, which `LowerIndex` extends for a tier
that stores whole chunks as bytes — and a transport on each worker.

`Transport` (worker side, one per rank): this rank's bytes of a lower tier —
batched writes, verified reads into L1 slots, deletes — each failed key
reported with its `Failure`, never raised.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from tiercache.codecs import Buffer
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.contracts.scan import ScanResult
from tiercache.index.tier_index import TierIndex
from tiercache.wire.chunk_format import ChunkMeta


class LowerIndex(TierIndex):
    """Scheduler side of a tier below L1 that stores whole chunks as bytes (disk, remote).

    Its lifecycle follows L1's; the bytes move between an L1 slot and the
    tier on every rank's transport.
    """
    # `indexed` (TierIndex): `has` reads a local index; False for a remote tier (no index, no pins)
    parallel_jobs = True  # split a batch across transfer workers (False: one job, e.g. one gRPC stream)

    @abstractmethod
    def reserve_bytes(self, layout: ChunkLayout) -> int:
        """Room one chunk of this layout may take, headers and codec overhead (or savings) included."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        """Reserve room per key; False where the key is present or no room can be made."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure],
                       stored_at: Mapping[BlockHash, float] | None = None) -> None:
        """Publish the written keys (``stored_at``: when L1 first stored them, so retention keeps counting)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        """Pin ready keys for reading; KeyError for a missing one."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure]) -> None:
        """Unpin ``keys``; a key that failed as `Failure.CORRUPT` is an integrity failure and its bytes are
        deleted, the other failures are counted for what they are."""

    def rebuild(self, per_rank: Sequence[ScanResult]) -> int:
        """Index what the writing ranks found at start (a persistent tier); how many chunks had to go."""
        return 0

    def attach(self, storage_digests: Sequence[bytes]) -> None:
        """The storage digests of the ranks that write this tier (a tier that asks a server needs them)."""


class Transport(ABC):
    """Worker side of a lower tier: one rank's bytes. Every method reports failures per key, never raises.

    A transport of a rank that only reads a tier shared by every rank
    (replicated KV, e.g. MLA: one copy serves all) has ``writer=False``:
    its writes and deletes are no-ops that succeed.
    """
    name: str
    medium: Medium
    writer: bool = True

    @abstractmethod
    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """Store each chunk (header + payload in the stored chunk format); the keys that failed, and why."""

    @abstractmethod
    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | Failure]:
        """Read and verify each chunk into its buffer: the raw length placed, or why not."""

    @abstractmethod
    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        """Remove this rank's bytes of ``keys`` (missing ones are fine)."""

    def scan(self) -> ScanResult | None:
        """What a persistent tier holds for this rank (read once at start); None for a tier without an index."""
        return None

    def close(self) -> None:
        """Release connections or handles."""
