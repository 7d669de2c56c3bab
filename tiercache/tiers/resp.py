"""Read pipelined Redis replies off a socket straight into caller memory.

redis-py (with hiredis) turns every bulk reply into a fresh ``bytes``: for a
32 MiB chunk that is a 32 MiB allocation whose pages fault in on first touch
(1.5–5 GB/s here, MACHINE_NOTES), then the tier's copy into the L1 slot.
`ReplyReader` parses RESP itself: reply lines go through a small buffer, and
a bulk string's bytes are received with ``recv_into`` wherever the caller
says — the L1 slot itself for a raw chunk — so they are touched once by the
kernel's copy and once by the checksum.

It works on any connected socket (TCP, unix, TLS); `RedisTier` borrows one
from a redis-py connection pool, so URLs, AUTH, SELECT and TLS settings work
as for every other command. Replies of RESP2 and RESP3 alike: a bulk string
(``$``), a null (``$-1`` or ``_``) or an error (``-``).
"""
from __future__ import annotations

import socket


class ReplyError(Exception):
    """The server answered one command with an error; the stream stays usable."""


class ProtocolError(Exception):
    """The stream is not what was asked for; the connection must be dropped."""


LINE_BUFFER_BYTES = 64 << 10
_CRLF = b"\r\n"


class ReplyReader:
    def __init__(self, sock: socket.socket, line_buffer_bytes: int = LINE_BUFFER_BYTES) -> None:
        self._sock = sock
        self._buf = bytearray(line_buffer_bytes)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0      # received, not yet consumed: _buf[_lo:_hi]
        self._discard: memoryview | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed: 0 once every reply asked for has been read."""
        return self._hi - self._lo

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            n = self._hi - self._lo
            self._buf[:n] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, n
        got = self._sock.recv_into(self._view[self._hi:])
        if got == 0:
            raise ConnectionError("the server closed the connection mid-reply")
        self._hi += got

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(_CRLF, self._lo, self._hi)
            if end >= 0:
                line = bytes(self._view[self._lo:end])
                self._lo = end + 2
                return line
            if self._hi - self._lo >= len(self._buf) - 1:
                raise ProtocolError(f"a reply line longer than {len(self._buf)} bytes")
            self._fill()

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

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` (a writable byte view) with the next ``len(dest)`` bytes of the stream."""
        n = len(dest)
        have = min(n, self._hi - self._lo)
        dest[:have] = self._view[self._lo:self._lo + have]
        self._lo += have
        pos = have
        while pos < n:
            got = self._sock.recv_into(dest[pos:])
            if got == 0:
                raise ConnectionError("the server closed the connection mid-value")
            pos += got

    def skip(self, n: int) -> None:
        """Consume and drop ``n`` bytes (the rest of a value nobody wants)."""
        if self._discard is None:
            self._discard = memoryview(bytearray(1 << 20))
        while n:
            step = min(n, len(self._discard))
            self.read_into(self._discard[:step])
            n -= step

    def end_of_bulk(self) -> None:
        """Consume the CRLF that ends a bulk string."""
        tail = bytearray(2)
        self.read_into(memoryview(tail))
        if tail != _CRLF:
            raise ProtocolError("a bulk string did not end with CRLF")
