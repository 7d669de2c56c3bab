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
from collections.abc import Callable, Sequence

from tiercache.codecs import Buffer

LINE_BUFFER_BYTES = 64 << 10
PROGRESS_STEP_S = 0.25    # a receive under a deadline waits at most this long, so progress is seen that often
_CRLF = b"\r\n"
_TIMEVAL = struct.Struct("ll")


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return _TIMEVAL.pack(whole, max(1 if not whole else 0, int((seconds - whole) * 1e6)))


def kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, with the kernel bounding each send and receive by ``timeout_s``.

    A Python socket timeout puts the socket in non-blocking mode and waits in
    ``poll`` before every ``recv``: two system calls and a wakeup per partial
    read of a large value. ``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` bound a blocking
    call the same way in one; a call that runs out raises `BlockingIOError`
    (`StreamReader` raises `TimeoutError` for it, as for a Python timeout).
    """
    limit = _timeval(timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def send_by(sock: socket.socket, pieces: Sequence[Buffer], deadline: float) -> None:
    """Send ``pieces`` in order on a blocking socket with kernel-kept timeouts (`kernel_timeouts`), all of
    them by ``deadline`` (``time.monotonic()``) however slowly the peer reads, else `TimeoutError`. While the
    peer keeps up, each piece is one ``send``."""
    kept = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _TIMEVAL.size)
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            pos = 0
            while pos < len(view):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(view) - pos} of {len(view)} bytes not taken by the deadline")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(min(left, PROGRESS_STEP_S)))
                try:
                    pos += sock.send(view[pos:])
                except BlockingIOError:     # nothing taken in this step: the deadline decides
                    continue
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, kept)


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
        try:
            got = self._sock.recv_into(self._view[self._hi:])
        except BlockingIOError:        # a kernel-kept timeout (SO_RCVTIMEO) ran out with nothing received
            raise TimeoutError("no bytes within the socket's timeout") from None
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
        """Fill ``dest`` (a writable byte view) with the next ``len(dest)`` bytes of the stream. With a
        ``deadline`` (``time.monotonic()``), raise `TimeoutError` once it passes, however the bytes trickle
        in: the socket must be blocking, its timeouts kept by the kernel (`kernel_timeouts`), and each receive
        then waits at most `PROGRESS_STEP_S` (or until the deadline). ``progress`` is called after each
        receive that brought bytes — at least that often while they keep coming."""
        n = len(dest)
        have = min(n, self._hi - self._lo)
        dest[:have] = self._view[self._lo:self._lo + have]
        self._lo += have
        if deadline is None:
            pos = have
            while pos < n:
                pos += self._recv_into(dest[pos:])
                if progress is not None:
                    progress()
            return
        kept = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.size)
        try:
            self._read_by(dest, have, deadline, progress)
        finally:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, kept)

    def _read_by(self, dest: memoryview, pos: int, deadline: float, progress: Callable[[], None] | None) -> None:
        n = len(dest)
        while pos < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - pos} of {n} bytes had not arrived by the deadline")
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(left, PROGRESS_STEP_S)))
            try:
                pos += self._recv_into(dest[pos:])
            except TimeoutError:
                continue          # nothing in this step: the deadline decides
            if progress is not None:
                progress()

    def _recv_into(self, dest: memoryview) -> int:
        """One receive into ``dest``, waiting for all of it on a blocking socket (until its timeout, which
        raises `TimeoutError` when nothing came)."""
        try:
            got = self._sock.recv_into(dest, 0, self._bulk_flags)
        except BlockingIOError:        # a kernel-kept timeout (SO_RCVTIMEO) ran out with nothing received
            raise TimeoutError("no bytes within the socket's timeout") from None
        if got == 0:
            raise ConnectionError("the peer closed the connection mid-value")
        return got

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
