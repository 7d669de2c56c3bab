"""The cache server's wire: method paths, and the `Chunk` message built and parsed by hand.

A `Chunk` carries one stored chunk (tens of MiB for a large model), split
into pieces of `PART_BYTES` (`split_chunk`): gRPC Python wants each message
as one fresh ``bytes``, and a large one costs first-touch page faults every
time where pieces of a few MiB reuse warm heap memory. Building a message with
protobuf would copy the value once more; here each piece is one ``join``
(memcpy speed), and parsing gives
zero-copy views of the received bytes. The bytes are exactly the
protobuf encoding of ``tiercache.v1.Chunk`` (tests check both directions
against the generated class), so any protobuf client can talk to the server.

Every other message is small and goes through the generated classes in
``tiercache_pb2`` (generated from ``proto/tiercache.proto``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiercache.codecs import Buffer, copy_into
from tiercache.errors import TierCacheError

SERVICE = "tiercache.v1.CacheServer"
AUTH_HEADER = "authorization"
MAX_KEY_BYTES = 64
MAX_KEYS_PER_CALL = 1 << 16


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


class WireError(TierCacheError, ValueError):
    """A message that is not a well-formed `Chunk`."""


_NAMESPACE, _KEY, _VALUE, _VALUE_LEN = 1, 2, 3, 4
_LEN = 2   # protobuf wire type of length-delimited fields
PART_BYTES = 4 << 20   # value bytes per message when a chunk is split


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, length: int) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(length)


def encode_chunk(namespace: bytes, key: bytes, header: Buffer = b"", payload: Buffer = b"",
                 value_len: int = 0) -> bytes:
    """The encoding of ``Chunk(namespace, key, value=header + payload, value_len)``, payload copied once."""
    body = memoryview(payload).cast("B")
    size = len(header) + len(body)
    prefix = _field(_NAMESPACE, len(namespace)) + namespace + _field(_KEY, len(key)) + key
    if value_len:
        prefix += _varint(_VALUE_LEN << 3) + _varint(value_len)
    if not size:
        return prefix
    return b"".join((prefix, _field(_VALUE, size), header, body))


def encode_piece(piece: Buffer) -> bytes:
    """A continuation message: ``Chunk(value=piece)``."""
    body = memoryview(piece).cast("B")
    return b"".join((_field(_VALUE, len(body)), body))


def split_chunk(namespace: bytes, key: bytes, header: Buffer, payload: Buffer,
                part_bytes: int = PART_BYTES) -> Iterator[bytes]:
    """The messages of one chunk: whole when it fits ``part_bytes``, else a first piece and continuations."""
    body = memoryview(payload).cast("B")
    total = len(header) + len(body)
    if total <= part_bytes:
        yield encode_chunk(namespace, key, header, body)
        return
    first = max(0, part_bytes - len(header))
    yield encode_chunk(namespace, key, header, body[:first], value_len=total)
    for off in range(first, len(body), part_bytes):
        yield encode_piece(body[off:off + part_bytes])


@dataclass(frozen=True, slots=True)
class ChunkView:
    namespace: bytes
    key: bytes
    value: memoryview   # a view into the received message; empty for "not present"
    value_len: int = 0  # the whole value's length when this is the first piece of a split chunk

    @property
    def total(self) -> int:
        """Bytes of the whole value this message starts."""
        return self.value_len or len(self.value)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7


def parse_chunk(message: Buffer) -> ChunkView:
    """Parse a `Chunk`; unknown fields are skipped, as protobuf does. Raises `WireError` when malformed."""
    data = memoryview(message).cast("B")
    fields: dict[int, memoryview] = {}
    value_len = 0
    pos = 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LEN:
            length, pos = _read_varint(data, pos)
            if pos + length > len(data):
                raise WireError(f"field {number} claims {length} bytes, {len(data) - pos} remain")
            fields[number] = data[pos:pos + length]
            pos += length
        elif wire_type == 0:
            n, pos = _read_varint(data, pos)
            if number == _VALUE_LEN:
                value_len = n
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise WireError(f"field {number} has unsupported wire type {wire_type}")
    if pos != len(data):
        raise WireError("message ends inside a fixed-width field")
    value = fields.get(_VALUE, memoryview(b""))
    if value_len and value_len < len(value):
        raise WireError(f"value_len {value_len} is shorter than the {len(value)} bytes of value present")
    return ChunkView(bytes(fields.get(_NAMESPACE, b"")), bytes(fields.get(_KEY, b"")), value, value_len)


def read_chunk(messages: Iterator[bytes], admit: Callable[[ChunkView], None] | None = None,
               ) -> tuple[ChunkView, list[memoryview], list[bytes]] | None:
    """Take one chunk's messages from a stream: (its first message parsed, the value's pieces, the raw
    messages). None at the end of the stream; `WireError` for a piece that names a chunk or a short stream.
    ``admit`` sees the first message before any other piece is read (a server checks and reserves the
    declared length there, and raises to refuse it)."""
    first = next(messages, None)
    if first is None:
        return None
    head = parse_chunk(first)
    if admit is not None:
        admit(head)
    pieces, raw, got = [head.value], [first], len(head.value)
    while got < head.total:
        message = next(messages, None)
        if message is None:
            raise WireError(f"stream ended {head.total - got} bytes into a split chunk")
        piece = parse_chunk(message)
        if piece.namespace or piece.key or piece.value_len:
            raise WireError("a new chunk started before the previous one's value was complete")
        pieces.append(piece.value)
        raw.append(message)
        got += len(piece.value)
    if got != head.total:
        raise WireError(f"pieces add up to {got} bytes, value_len says {head.total}")
    return head, pieces, raw


class ChunkPieces:
    """A value that arrived as gRPC message pieces, read in order as a `ValueSource` (copies go through
    `copy_into`, which releases the GIL)."""

    def __init__(self, pieces: list[memoryview]) -> None:
        self._pieces = pieces
        self._index = 0     # current piece
        self._offset = 0    # consumed of it

    def _advance(self, n: int, dest: memoryview | None) -> None:
        done = 0
        while done < n:
            if self._index >= len(self._pieces):
                raise WireError("the value ended before its length")
            piece = self._pieces[self._index][self._offset:]
            step = min(len(piece), n - done)
            if dest is not None:
                copy_into(dest, piece[:step], done)
            done += step
            self._offset += step
            if self._offset == len(self._pieces[self._index]):
                self._index, self._offset = self._index + 1, 0

    def read_into(self, dest: memoryview) -> None:
        self._advance(len(dest), dest)

    def exactly(self, n: int) -> bytes:
        out = bytearray(n)
        self._advance(n, memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        self._advance(n, None)
