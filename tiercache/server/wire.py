"""The cache server's wire: method paths, and the `Chunk` message built and parsed by hand.

A `Chunk` carries one stored chunk (tens of MiB for a large model). Building
it with protobuf copies the value at ~1 GB/s on these machines and parsing
copies it again; here a chunk is encoded with one ``join`` (memcpy speed) and
parsed into zero-copy views of the received bytes. The bytes are exactly the
protobuf encoding of ``tiercache.v1.Chunk`` (tests check both directions
against the generated class), so any protobuf client can talk to the server.

Every other message is small and goes through the generated classes in
``tiercache_pb2`` (generated from ``proto/tiercache.proto``).
"""
from __future__ import annotations

from dataclasses import dataclass

from tiercache.codecs import Buffer
from tiercache.errors import TierCacheError

SERVICE = "tiercache.v1.CacheServer"
AUTH_HEADER = "authorization"


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


class WireError(TierCacheError, ValueError):
    """A message that is not a well-formed `Chunk`."""


_NAMESPACE, _KEY, _VALUE = 1, 2, 3
_LEN = 2   # protobuf wire type of length-delimited fields


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, length: int) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(length)


def encode_chunk(namespace: bytes, key: bytes, header: Buffer = b"", payload: Buffer = b"") -> bytes:
    """The encoding of ``Chunk(namespace, key, value=header + payload)``, payload copied once."""
    body = memoryview(payload).cast("B")
    size = len(header) + len(body)
    prefix = _field(_NAMESPACE, len(namespace)) + namespace + _field(_KEY, len(key)) + key
    if not size:
        return prefix
    return b"".join((prefix, _field(_VALUE, size), header, body))


@dataclass(frozen=True, slots=True)
class ChunkView:
    namespace: bytes
    key: bytes
    value: memoryview   # a view into the received message; empty for "not present"


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
            _, pos = _read_varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise WireError(f"field {number} has unsupported wire type {wire_type}")
    if pos != len(data):
        raise WireError("message ends inside a fixed-width field")
    empty = memoryview(b"")
    return ChunkView(bytes(fields.get(_NAMESPACE, b"")), bytes(fields.get(_KEY, b"")), fields.get(_VALUE, empty))
