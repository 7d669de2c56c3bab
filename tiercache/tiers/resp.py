"""Pipelined Redis commands on a raw socket: values sent from, and replies read into, caller memory.

redis-py (with hiredis) turns every bulk reply into a fresh ``bytes``: for a
chunk that is an allocation of its whole size whose pages fault in on first
touch (slower than a copy into warm memory), then the tier's copy into the L1 slot.
`ReplyReader` parses RESP itself on a `StreamReader`: reply lines go through
a small buffer, and a bulk string's bytes are received with ``recv_into``
wherever the caller says — the L1 slot itself for a raw chunk — so they are
touched once by the kernel's copy and once by the checksum.

A large value is read as a run of ``GETRANGE`` pieces (`RangedReads`),
never with one ``GET``: redis-server builds a reply whole in its output
buffer before sending it, so a ``GET`` of a large value costs the server as
much fresh page-faulted memory and a copy into it on every read. Asked for
in pieces (`RANGE_PIECE`) with a few in flight (`RANGE_WINDOW`), its reply
buffers stay small, reused and in cache.

Writes go the same way: ``SET``'s framing around a value sent with
``sendall`` from where it lies (`set_command`), with no join into a staging
buffer. It works on any connected socket (TCP, unix, TLS); `RedisTransport` borrows one
from a redis-py connection pool, so URLs, AUTH, SELECT and TLS settings work
as for every other command. Replies of RESP2 and RESP3 alike: a bulk string
(``$``), a null (``$-1`` or ``_``) or an error (``-``).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from tiercache.arith import ceil_div
from tiercache.wire.streams import ProtocolError, StreamReader

__all__ = ["ProtocolError", "RangedReads", "RangedValue", "ReplyError", "ReplyReader", "ValueChanged"]

_CRLF = b"\r\n"


RANGE_PIECE = 256 << 10   # bytes per GETRANGE
RANGE_WINDOW = 2          # GETRANGEs in flight


class ReplyError(Exception):
    """The server answered one command with an error; the stream stays usable."""


class ValueChanged(Exception):
    """A value read in ranges changed under the reader (deleted, rewritten or shortened between ranges)."""


def command(*args: bytes) -> bytes:
    """One RESP command of small arguments (keys, options)."""
    return b"".join([b"*%d\r\n" % len(args), *(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)])


def set_command(key: bytes, value_len: int, ttl_s: int = 0, only_new: bool = False) -> tuple[bytes, bytes]:
    """``SET key <value> [NX] [EX ttl]`` around a value sent separately: (what goes before it, what after).
    With ``only_new`` (``NX``) an existing value is kept and the reply is a null (`ReplyReader.set_reply`)."""
    tail = ([b"NX"] if only_new else []) + ([b"EX", str(ttl_s).encode()] if ttl_s else [])
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

    def set_reply(self) -> bool:
        """A ``SET`` reply: True for ``+OK``, False for the null of ``NX`` finding the key there already;
        `ReplyError` for an error reply."""
        line = self._line()
        if line[:1] == b"+":
            return True
        if line in (b"$-1", b"_"):
            return False
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected a SET reply, got {line[:32]!r}")

    def integer(self) -> int:
        """An integer reply (``:n``); `ReplyError` for an error reply."""
        line = self._line()
        if line[:1] == b":":
            try:
                return int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad integer reply {line[:32]!r}") from None
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected an integer reply, got {line[:32]!r}")

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


class RangedReads:
    """Whole values of known lengths read as pipelined ``GETRANGE`` pieces, at most ``window`` in flight.

    `value` hands out one `RangedValue` per value, in the order given; each
    is read, then drained (`RangedValue.drain`), before the next. The
    pieces are asked for as the reading goes, so the server never holds more
    than ``window`` pieces of replies. Lengths come from a ``STRLEN`` just
    before: a piece shorter than asked for means the value changed in
    between, and reads as `ValueChanged` (a checksum catches a value
    rewritten with other bytes of the same length).
    """

    def __init__(self, sock, reader: ReplyReader, values: Sequence[tuple[bytes, int]],
                 piece: int = RANGE_PIECE, window: int = RANGE_WINDOW) -> None:
        self._sock, self._reader = sock, reader
        self._pieces = [(key, start, min(piece, n - start)) for key, n in values for start in range(0, n, piece)]
        self._values = [(ceil_div(n, piece), n) for _, n in values]       # (pieces, bytes) per value
        self._window = window
        self._sent = self._opened = self._next_value = 0

    def value(self) -> RangedValue:
        pieces, nbytes = self._values[self._next_value]
        self._next_value += 1
        return RangedValue(self, self._reader, pieces, nbytes)

    def forget(self, pieces: int) -> int:
        """The value being read needs none of its next ``pieces`` pieces: drop those not asked for yet
        (the server never sends them); returns how many were dropped. The ones in flight are still read."""
        first_unsent = max(self._sent, self._opened)
        end = self._opened + pieces
        del self._pieces[first_unsent:end]
        return max(0, end - first_unsent)

    def open_piece(self) -> int:
        """Read the next piece's length line (asking for more pieces first); `ValueChanged` if it is not
        the length asked for, after consuming that reply."""
        if self._sent - self._opened <= self._window // 2 and self._sent < len(self._pieces):
            end = min(len(self._pieces), self._opened + self._window)
            self._sock.sendall(b"".join(command(b"GETRANGE", key, b"%d" % start, b"%d" % (start + n - 1))
                                        for key, start, n in self._pieces[self._sent:end]))
            self._sent = end
        want = self._pieces[self._opened][2]
        self._opened += 1
        try:
            got = self._reader.bulk_length()
        except ReplyError as err:             # e.g. WRONGTYPE: the key now holds something else
            raise ValueChanged(str(err)) from None
        if got != want:
            if got:
                self._reader.skip(got)
            if got is not None:
                self._reader.end_of_bulk()
            raise ValueChanged(f"a range of {want} B came back with {got} B")
        return want


class RangedValue:
    """One value's bytes across its ``GETRANGE`` replies, read like a stream (`tiercache.wire.values.ValueSource`)."""

    def __init__(self, ranges: RangedReads, reader: ReplyReader, pieces: int, nbytes: int) -> None:
        self._ranges, self._reader = ranges, reader
        self._unopened = pieces
        self._unread = nbytes    # bytes of the value not yet read or skipped
        self._piece_unread = 0           # bytes of the open piece not yet read
        self._open = False

    def _close_piece(self) -> None:
        if self._piece_unread:
            self._reader.skip(self._piece_unread)
            self._piece_unread = 0
        if self._open:
            self._reader.end_of_bulk()
            self._open = False

    def _next_piece(self) -> None:
        self._close_piece()
        if not self._unopened:
            raise ValueChanged("read past the value's length")
        self._unopened -= 1
        self._piece_unread = self._ranges.open_piece()
        self._open = True

    def _spans(self, n: int) -> Iterator[int]:
        """The next ``n`` bytes cut along piece boundaries, pieces opened as they are reached."""
        while n:
            if not self._piece_unread:
                self._next_piece()
            take = min(self._piece_unread, n)
            self._piece_unread -= take
            self._unread -= take
            n -= take
            yield take

    def read_into(self, dest: memoryview) -> None:
        pos = 0
        for take in self._spans(len(dest)):
            self._reader.read_into(dest[pos:pos + take])
            pos += take

    def exactly(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes. Dropping the rest of the value (one that failed its header check)
        reads only the pieces already asked for; the others are never asked for."""
        if n and n == self._unread:
            self._unopened -= self._ranges.forget(self._unopened)
            self._unread = 0
            return          # `drain` consumes the open piece and those in flight
        for take in self._spans(n):
            self._reader.skip(take)

    def drain(self) -> None:
        """Consume whatever of this value's replies is still unread, so the stream stays in step."""
        self._close_piece()
        while self._unopened:
            try:
                self._next_piece()
            except ValueChanged:
                pass               # that reply is consumed already
            self._close_piece()
