"""Taking one stored chunk in: the one verification path of every L2 and L3 read.

Worker side. A value — a chunk file, a Redis reply, a data-channel value,
gRPC message pieces, a file in a co-located server's directory — is read
from a `ValueSource` by `receive_value`: the header into a scratch and
checked against the namespace and key, then a raw payload straight into its
destination (an L1 slot), hashed piece by piece as it lands (while each piece is
still in cache, where a separate pass over the whole value would read it all
from memory again), or an
encoded payload into one of its batch's landing buffers, verified and decoded
into place (`tiercache.wire.codec_pipeline`: on a codec thread, while the next
value comes in). A value that fails any check raises a
`ChunkFormatError` after all of its bytes were consumed, so a stream stays in
step; transport errors propagate as they are.
"""
from __future__ import annotations

import os
from typing import Protocol

from tiercache.contracts.keys import BlockHash
from tiercache.errors import ChecksumMismatchError, ChunkFormatError, SignatureError, TruncatedChunkError
from tiercache.wire.chunk_format import (
    HEADER_BYTES,
    SIGNED,
    ChunkKeys,
    check_header,
    payload_sum,
)
from tiercache.wire.codec_pipeline import ReadBatch

VERIFY_PIECE = 4 << 20    # a raw payload is hashed in pieces of this size as each lands (still in cache)


class ValueSource(Protocol):
    """Where a value's bytes come from, in order."""

    def exactly(self, n: int) -> bytes: ...

    def read_into(self, dest: memoryview) -> None: ...

    def skip(self, n: int) -> None: ...


class FileSource:
    """A chunk file read as a `ValueSource`; a file shorter than its size said raises `ConnectionError`
    (it changed under the reader)."""

    def __init__(self, f) -> None:
        self._f = f

    def exactly(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ConnectionError("chunk file ended early")
        return data

    def read_into(self, dest: memoryview) -> None:
        done = 0
        while done < len(dest):
            n = self._f.readinto(dest[done:])
            if not n:
                raise ConnectionError("chunk file ended early")
            done += n

    def skip(self, n: int) -> None:
        self._f.seek(n, os.SEEK_CUR)


def receive_value(source: ValueSource, n: int, namespace: bytes, key: BlockHash, buf: memoryview,
                  reads: ReadBatch, signer: ChunkKeys | None = None) -> int:
    """Take the next ``n`` bytes of ``source`` — one stored chunk — into ``buf``, verified; returns the raw
    length. Raises `ChunkFormatError` for a value that is damaged, foreign or too large (all ``n`` bytes
    consumed first); an encoded payload is verified and decoded by ``reads`` (on its codec thread, if it
    has one: a failure there lands in ``reads.failed``). Transport errors propagate."""
    if n < HEADER_BYTES:
        source.skip(n)
        raise TruncatedChunkError(f"value of {n} B is shorter than a chunk header")
    try:
        parsed = check_header(source.exactly(HEADER_BYTES), namespace, key)
        meta, codec, checksum_code, payload_len, expected = parsed
        if n != HEADER_BYTES + payload_len:
            raise TruncatedChunkError(f"value of {n} B, its header says {HEADER_BYTES + payload_len}")
        if meta.raw_len > len(buf):
            raise ChunkFormatError(f"chunk of {meta.raw_len} B does not fit a {len(buf)}-byte buffer")
        # a signature or encryption where one is required, and the key to check it (None: sealed, opened as
        # it is decoded)
        running = payload_sum(parsed, signer)
    except ChunkFormatError:
        source.skip(n - HEADER_BYTES)
        raise
    if running is not None and codec == 0 and payload_len == meta.raw_len:
        # raw and not sealed: into place, hashed piece by piece as it lands
        for offset in range(0, payload_len, VERIFY_PIECE):
            piece = buf[offset:min(offset + VERIFY_PIECE, payload_len)]
            source.read_into(piece)
            running.update(piece)
        if running.intdigest() != expected:
            if checksum_code == SIGNED:
                raise SignatureError(f"payload signature mismatch for chunk {key.hex()[:16]}…")
            raise ChecksumMismatchError(f"payload checksum mismatch for chunk {key.hex()[:16]}…")
        return meta.raw_len
    landing = reads.landing(payload_len)
    source.read_into(landing)
    reads.decode(key, parsed, landing, buf, signer)
    return meta.raw_len
