"""Reading a byte stream off a socket: small fields through a buffer, bulk bytes straight into caller memory.

A chunk's bytes should be touched once on their way into an L1 slot: the
kernel's copy out of the socket, into the slot itself (then the checksum).
`StreamReader` buffers what is small — protocol lines, lengths, keys — and
hands large values to ``recv_into`` on the destination, after first giving
it whatever the buffer already holds. Used by the Redis reply parser
(`tiercache.tiers.resp`) and by `tiercache serve`'s data channel.
"""
from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable

LINE_BUFFER_BYTES = 64 << 10
_CRLF = b"\r\n"


def kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, with the kernel bounding each send and receive by ``timeout_s``.

    A Python socket timeout puts the socket in non-blocking mode and waits in
    ``poll`` before every ``recv``: two system calls and a wakeup per partial
    read of a large value. ``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` bound a blocking
    call the same way in one; a call that runs out raises `BlockingIOError`
    (an `OSError`, like `TimeoutError`).
    """
    whole = int(timeout_s)
    limit = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


class ProtocolError(Exception):
    """The stream is not what was asked for; the connection must be dropped."""


class StreamReader:
    """A socket read through a small buffer for lines and fixed fields, and straight into caller memory
    for bulk bytes."""

    def __init__(self, sock: socket.socket, line_buffer_bytes: int = LINE_BUFFER_BYTES) -> None:
        self._sock = sock
        self._buf = bytearray(line_buffer_bytes)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0      # received, not yet consumed: _buf[_lo:_hi]
        self._discard: memoryview | None = None
        # bulk reads wait for the whole destination in one call (one wakeup) on a blocking socket; a
        # non-blocking one returns what is there either way, and TLS sockets take no flags
        self._bulk_flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed: 0 once every reply asked for has been read."""
        return self._hi - self._lo

    def _compact(self) -> None:
        n = self._hi - self._lo
        self._buf[:n] = self._buf[self._lo:self._hi]
        self._lo, self._hi = 0, n

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            self._compact()
        got = self._sock.recv_into(self._view[self._hi:])
        if got == 0:
            raise ConnectionError("the peer closed the connection mid-reply")
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

    def read_into(self, dest: memoryview, deadline: float | None = None,
                  progress: Callable[[], None] | None = None) -> None:
        """Fill ``dest`` (a writable byte view) with the next ``len(dest)`` bytes of the stream; with a
        ``deadline`` (``time.monotonic()``), raise `TimeoutError` once it passes, however the bytes trickle
        in (the socket must have a timeout: each receive waits at most until the deadline). ``progress`` is
        called after each receive that brought bytes."""
        n = len(dest)
        have = min(n, self._hi - self._lo)
        dest[:have] = self._view[self._lo:self._lo + have]
        self._lo += have
        pos = have
        step_timeout = self._sock.gettimeout() if deadline is not None else None
        try:
            while pos < n:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{n - pos} of {n} bytes had not arrived by the deadline")
                    self._sock.settimeout(min(left, step_timeout or left))
                got = self._sock.recv_into(dest[pos:], 0, self._bulk_flags)
                if got == 0:
                    raise ConnectionError("the peer closed the connection mid-value")
                pos += got
                if progress is not None:
                    progress()
        finally:
            if deadline is not None:
                self._sock.settimeout(step_timeout)

    def exactly(self, n: int) -> bytes:
        """The next ``n`` bytes: a small field (a length, a key), taken through the buffer."""
        if n > len(self._buf):
            out = bytearray(n)
            self.read_into(memoryview(out))
            return bytes(out)
        while self._hi - self._lo < n:
            if self._hi == len(self._buf) and self._lo > 0:
                self._compact()
            self._fill()
        field = bytes(self._view[self._lo:self._lo + n])
        self._lo += n
        return field

    def skip(self, n: int, deadline: float | None = None) -> None:
        """Consume and drop ``n`` bytes (the rest of a value nobody wants)."""
        if self._discard is None:
            self._discard = memoryview(bytearray(64 << 10))
        while n:
            step = min(n, len(self._discard))
            self.read_into(self._discard[:step], deadline)
            n -= step
