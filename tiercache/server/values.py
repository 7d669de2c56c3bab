"""What the cache server stores for a chunk, and the buffers it recycles.

A chunk is kept the way it arrived, uncopied: the `Chunk` messages of a gRPC
``Put`` (``Messages``), or one buffer (``Value``) — what a data-channel
``PUT`` was received into, or a chunk file's bytes. The helpers here give any
of them as the views a sender needs, as a file writer needs, or as gRPC
messages. `check_value` is the check every value passes on the way in.
`BufferPool` keeps the buffers of chunks that left memory for the next ones.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tiercache.contracts.keys import BlockHash
from tiercache.errors import ChunkFormatError
from tiercache.wire.chunk_format import HEADER_BYTES, ParsedHeader, check_header
from tiercache.wire.grpc_messages import parse_chunk, split_chunk

StoreKey = bytes          # namespace digest + chunk key
Messages = list[bytes]    # one chunk's `Chunk` messages, as received over gRPC
Value = bytes | bytearray  # one chunk's value in one buffer: from the data channel or a file
Stored = Messages | Value  # what the memory tier keeps: whichever way the chunk came, uncopied


@dataclass(frozen=True, slots=True)
class Spill:
    """A chunk leaving memory for disk: what memory kept of it, or a file set aside (`ShmChunks`)."""
    key: StoreKey
    nbytes: int
    value: Stored | None = None
    file: Path | None = None
    keep_file: bool = False    # flush copies; eviction moves
    stored_at: float = 0.0     # when the chunk first came (0: now): its age keeps counting on disk
    parent: bytes | None = None  # the chunk key before it in its request (from its header)


def value_pieces(stored: Stored) -> list[memoryview]:
    """A stored chunk's value (header + payload) as views of the buffers that hold it, in order."""
    if isinstance(stored, list):
        return [parse_chunk(m).value for m in stored]
    return [memoryview(stored)]


def value_size(stored: Stored) -> int:
    return sum(len(p) for p in value_pieces(stored))


def value_parts(stored: Stored) -> tuple[memoryview, memoryview]:
    """(header, payload) views of a stored chunk's value (joined into one buffer only when split)."""
    pieces = value_pieces(stored)
    if len(pieces) == 1:
        return pieces[0][:HEADER_BYTES], pieces[0][HEADER_BYTES:]
    return pieces[0][:HEADER_BYTES], memoryview(b"".join([pieces[0][HEADER_BYTES:], *pieces[1:]]))


def as_messages(namespace: bytes, key: bytes, stored: Stored) -> Messages:
    """The `Chunk` messages a gRPC ``Get`` answers with: as received, or cut from a one-buffer value."""
    if isinstance(stored, list):
        return stored
    view = memoryview(stored)
    return list(split_chunk(namespace, key, view[:HEADER_BYTES], view[HEADER_BYTES:]))


def store_key(namespace: bytes, key: bytes) -> StoreKey:
    return namespace + key


def check_value(namespace: bytes, key: bytes, header: memoryview, total_len: int) -> ParsedHeader:
    """The checks a value (its header and whole length) passes before the server stores it; raises
    `ChunkFormatError`. The payload checksum of what a client sends is the readers' to verify, end to end."""
    parsed = check_header(header, namespace, BlockHash(key))
    if total_len != HEADER_BYTES + parsed[3]:
        raise ChunkFormatError(f"value is {total_len} bytes, its header says {HEADER_BYTES + parsed[3]}")
    return parsed


class BufferPool:
    """Value buffers of chunks that left memory, kept for the next chunk of the same size.

    A fresh ``bytearray`` pays its page faults on first touch, so receiving
    into fresh ones runs well below the socket's rate and into reused ones
    close to it. Only a buffer nobody else holds is
    taken back — a value being sent or spilled holds a reference (a
    memoryview, a `Spill`), and CPython's reference count says so — so a
    buffer is never written while someone reads it. The memory tier counts
    spare buffers against its capacity and drops them before it evicts a
    chunk (`MemoryChunks.add`).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes     # None: as much as the memory tier leaves room for; 0: keep none
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            free = self._free.get(size)
            if free:
                self._bytes -= size
                return free.pop()
        return bytearray(size)

    def give(self, buf: Stored) -> None:
        """Offer a buffer back; the caller drops its own reference right after."""
        # references: the caller's, this frame's, getrefcount's argument; any more is a reader's
        if not isinstance(buf, bytearray) or sys.getrefcount(buf) > 3:
            return
        with self._lock:
            if self.max_bytes is not None and self._bytes + len(buf) > self.max_bytes:
                return
            self._free.setdefault(len(buf), []).append(buf)
            self._bytes += len(buf)

    def shrink(self, max_bytes: int) -> None:
        """Let go of spare buffers, largest sizes first, until at most ``max_bytes`` remain."""
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self._bytes > max(0, max_bytes):
                    free.pop()
                    self._bytes -= size
                if not free:
                    del self._free[size]

    @property
    def spare_bytes(self) -> int:
        return self._bytes
