"""The data channel of `tiercache serve`: chunk bytes over a plain TCP connection, next to gRPC.

Python gRPC hands every received message over as a fresh ``bytes`` on its
channel thread, which caps a streamed ``Get`` well below the socket's rate
even with no work of ours. The data channel carries only what is bulk — ``GET`` and
``PUT`` of chunk values — so the client can receive a value straight into
its L1 slot (``recv_into``) and send one straight out of it; lookups,
deletes, stats, health and the local path stay on gRPC. The server
advertises the channel's port in ``HealthReply.data_port``.

Frames (integers little-endian)::

    hello     client: MAGIC (8 bytes: b"TCDATA" + version u16) | u16 token length | token
              server: u8 status (HELLO_OK, or HELLO_BAD_VERSION / HELLO_UNAUTHENTICATED, then it closes;
              HELLO_BUSY, sent before the hello is read, when every connection slot is taken)
    request   client: u8 op | 16-byte namespace digest | u32 count, then per op:
      GET       count × (u8 key length | key)
                server: count × (u64 value length | value)        length 0: not present
      PUT       count × (u8 key length | key | u64 value length | value)
                server: count × u8 outcome (PUT_STORED, PUT_PRESENT, PUT_REJECTED, PUT_BUSY)
                value length 0: withdrawn (the client's codec refused that chunk): nothing stored, PUT_REJECTED
                PUT_BUSY (version 2): no room for the value in the server's in-flight budget in time — read past,
                not stored; the client may send it again (a version-1 client is answered PUT_REJECTED)

A value is one chunk in the stored chunk format (header + payload), as on
gRPC: the server checks each header it receives against namespace and key,
the client verifies each payload it reads. A malformed frame closes the
connection (after a log line); a bad value is one rejected chunk.
"""
from __future__ import annotations

import struct

from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES

MAGIC_PREFIX = b"TCDATA"
VERSION = 2
VERSIONS = (1, 2)            # what a server accepts: version 1 differs only in never hearing PUT_BUSY
MAGIC = MAGIC_PREFIX + VERSION.to_bytes(2, "little")
HELLO_OK, HELLO_BAD_VERSION, HELLO_UNAUTHENTICATED, HELLO_BUSY = 0, 1, 2, 3
OP_GET, OP_PUT = 1, 2
PUT_STORED, PUT_PRESENT, PUT_REJECTED, PUT_BUSY = 0, 1, 2, 3

REQUEST = struct.Struct(f"<B{NAMESPACE_DIGEST_BYTES}sI")      # op, namespace digest, count
U64 = struct.Struct("<Q")
U16 = struct.Struct("<H")
MAX_TOKEN_BYTES = 4096


def hello(token: str | None) -> bytes:
    raw = (token or "").encode()
    return MAGIC + U16.pack(len(raw)) + raw


def hello_version(magic: bytes) -> int | None:
    """The protocol version a hello's first ``len(MAGIC)`` bytes name, or None for one no server accepts."""
    if len(magic) != len(MAGIC) or magic[:len(MAGIC_PREFIX)] != MAGIC_PREFIX:
        return None
    version = int.from_bytes(magic[len(MAGIC_PREFIX):], "little")
    return version if version in VERSIONS else None


def key_field(key: bytes) -> bytes:
    return bytes([len(key)]) + key
