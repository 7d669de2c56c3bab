"""What a worker found of a persistent tier's chunks at start (`ScanResult`), reported to the scheduler's index."""
from __future__ import annotations

from dataclasses import dataclass

from tiercache.contracts.keys import BlockHash


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk file found on disk (plain data: a worker reports these to the scheduler's index)."""
    key: BlockHash
    nbytes: int        # file size, header included
    mtime_ns: int
    parent: BlockHash | None = None   # from its header: the chunk before it in its request


@dataclass(frozen=True, slots=True)
class ScanResult:
    found: tuple[StoredChunk, ...]   # oldest first
    bad: int                         # damaged, foreign or wrong-sized files deleted
    temp: int                        # leftover temp files of writers that died mid-chunk, deleted
