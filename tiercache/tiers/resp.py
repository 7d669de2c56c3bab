"""Pipelined Redis commands on a raw socket: values sent from, and replies read into, caller memory.

redis-py (with hiredis) turns every bulk reply into a fresh ``bytes``: for a
32 MiB chunk that is a 32 MiB allocation whose pages fault in on first touch
(1.5–5 GB/s here, MACHINE_NOTES), then the tier's copy into the L1 slot.
`ReplyReader` parses RESP itself on a `StreamReader`: reply lines go through
a small buffer, and a bulk string's bytes are received with ``recv_into``
wherever the caller says — the L1 slot itself for a raw chunk — so they are
touched once by the kernel's copy and once by the checksum.

Writes go the same way: ``SET``'s framing around a value sent with
``sendall`` from where it lies (`set_command`), with no join into a staging
buffer. It works on any connected socket (TCP, unix, TLS); `RedisTier` borrows one
from a redis-py connection pool, so URLs, AUTH, SELECT and TLS settings work
as for every other command. Replies of RESP2 and RESP3 alike: a bulk string
(``$``), a null (``$-1`` or ``_``) or an error (``-``).
"""
from __future__ import annotations

from tiercache.streams import ProtocolError, StreamReader

__all__ = ["ProtocolError", "ReplyError", "ReplyReader"]

_CRLF = b"\r\n"


class ReplyError(Exception):
    """The server answered one command with an error; the stream stays usable."""


def command(*args: bytes) -> bytes:
    """One RESP command of small arguments (keys, options)."""
    return b"".join([b"*%d\r\n" % len(args), *(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)])


def set_command(key: bytes, value_len: int, ttl_s: int = 0) -> tuple[bytes, bytes]:
    """``SET key <value> [EX ttl]`` around a value sent separately: (what goes before it, what after)."""
    tail = [b"EX", str(ttl_s).encode()] if ttl_s else []
    before = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(tail), len(key), key, value_len)
    after = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in tail)
    return before, after


class ReplyReader(StreamReader):
    """RESP replies: status lines, and bulk strings whose bytes go where the caller says."""

    def status(self) -> None:
        """Consume a ``+OK``-style reply; `ReplyError` for an error reply."""
        line = self._line()
        if line[:1] == b"+":
            return
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected a status reply, got {line[:32]!r}")

    def bulk_length(self) -> int | None:
        """The next reply's length if it is a bulk string, None for a null; `ReplyError` for an error."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                n = int(rest)
            except ValueError:
                raise ProtocolError(f"bad bulk length {line[:32]!r}") from None
            return None if n < 0 else n
        if kind == b"_":
            return None
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        raise ProtocolError(f"expected a bulk string, got {line[:32]!r}")

    def end_of_bulk(self) -> None:
        """Consume the CRLF that ends a bulk string."""
        if self.exactly(2) != _CRLF:
            raise ProtocolError("a bulk string did not end with CRLF")
