"""The client side of `tiercache serve`'s data channel (`tiercache.wire.data_frames`).

One TCP connection per transfer thread, opened on first use and kept; a
``GET`` receives each value through `RemoteTransport.receive` (a raw chunk
straight into its L1 slot, verified there), a ``PUT`` sends each chunk's
header and payload straight from where they are. Any transport or protocol
error closes that thread's connection and propagates as `ConnectionError`
(`StaleConnection` when the connection had served requests before: the server
may have restarted, on another port, and the caller asks again once);
the tier turns it into misses and an outage, and the next call reconnects.

A connection is made within `HANDSHAKE_TIMEOUT_S` (connect, hello and its
answer) or not at all: a data port that does not answer that fast — its
server busy, or flooded with connections — raises `DataChannelBusy`, and for
`BUSY_BACKOFF_S` after it every call does so at once, so the tier's chunks go
over its gRPC streams meanwhile instead of each waiting for a port that may
not answer.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure
from tiercache.wire import data_frames as dw
from tiercache.wire.codec_pipeline import Encoded
from tiercache.wire.streams import ProtocolError, StreamReader, kernel_timeouts

Receive = Callable[[StreamReader, int, BlockHash, memoryview], "int | Failure"]
T = TypeVar("T")

HANDSHAKE_TIMEOUT_S = 1.0   # connect, hello and its answer (a server answers at once: it reads hellos apart)
BUSY_BACKOFF_S = 1.0        # after the data channel was busy, calls go to gRPC streams for this long


class DataChannelRefused(ConnectionError):
    """The server refused the hello: another protocol version, or a wrong token."""


class DataChannelBusy(ConnectionError):
    """No new connection could be made: the server's connection slots are all busy (``HELLO_BUSY``), or the
    data port does not answer. The caller moves these bytes over gRPC streams instead."""


class StaleConnection(ConnectionError):
    """A kept connection failed: worth one retry on a fresh one."""


class DataChannel:
    """Worker side (the client of `tiercache serve`'s data channel): one connection per transfer thread."""

    def __init__(self, host: str, port: int, namespace: bytes, token: str | None, timeout_s: float) -> None:
        self.address = (host, port)
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._hello = dw.hello(token)
        self._thread = threading.local()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._busy_until = 0.0      # monotonic, under _lock: until then, a new connection is not tried

    def close(self) -> None:
        """Close every thread's connection; a closed channel opens no new ones (the tier asks for another)."""
        with self._lock:
            self._closed = True
            socks, self._open = list(self._open), set()
        for sock in socks:
            sock.close()

    def _connection(self) -> tuple[socket.socket, StreamReader]:
        conn = getattr(self._thread, "conn", None)
        if conn is not None:
            return conn
        where = f"{self.address[0]}:{self.address[1]}"
        if time.monotonic() < self._busy_until:
            raise DataChannelBusy(f"the data channel at {where} was busy less than {BUSY_BACKOFF_S:g} s ago")
        try:
            return self._connect(where)
        except DataChannelBusy:
            with self._lock:            # the transfer threads share it: the latest busy answer wins
                self._busy_until = time.monotonic() + BUSY_BACKOFF_S
            raise

    def _connect(self, where: str) -> tuple[socket.socket, StreamReader]:
        try:
            sock = socket.create_connection(self.address, timeout=min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
        except OSError as err:
            raise DataChannelBusy(f"the data channel at {where} does not answer: {err}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.sendall(self._hello)
                reader = StreamReader(sock)
                status = reader.exactly(1)[0]
            except OSError as err:     # closed, reset or silent before a status: a server at its cap, or swamped
                raise DataChannelBusy(f"the data channel at {where} did not take the hello: {err}") from None
            if status == dw.HELLO_BUSY:
                raise DataChannelBusy(f"the data channel at {where} has no free connection slot")
            if status != dw.HELLO_OK:
                reason = "a wrong or missing auth token" if status == dw.HELLO_UNAUTHENTICATED else \
                    "another protocol version"
                raise DataChannelRefused(f"the data channel at {where} refused this client: {reason}")
            kernel_timeouts(sock, self.timeout_s)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise ConnectionError("the data channel was closed (the server is asked for it again)")
            self._open.add(sock)
        self._thread.conn = (sock, reader)
        self._thread.served = 0
        return sock, reader

    def _failed(self, what: str, err: Exception) -> ConnectionError:
        stale = getattr(self._thread, "conn", None) is not None and self._thread.served > 0
        self._drop()
        return (StaleConnection if stale else ConnectionError)(f"data channel {what}: {err}")

    def _drop(self) -> None:
        conn = getattr(self._thread, "conn", None)
        self._thread.conn = None
        if conn is not None:
            with self._lock:
                self._open.discard(conn[0])
            conn[0].close()

    def _request(self, op: int, count: int) -> bytes:
        return dw.REQUEST.pack(op, self.namespace, count)

    def _exchange(self, what: str, body: Callable[[socket.socket, StreamReader], T]) -> T:
        """Run one request on this thread's connection; on any failure the connection is dropped (a stream
        left mid-reply is never reused) and transport or protocol errors become `ConnectionError`."""
        sock, reader = self._connection()      # DataChannelBusy, DataChannelRefused: for the caller
        try:
            result = body(sock, reader)
            if reader.buffered:
                raise ProtocolError(f"{reader.buffered} bytes beyond the reply to {what}")
        except (OSError, ProtocolError) as err:
            raise self._failed(what, err) from err
        except BaseException:
            self._drop()
            raise
        self._thread.served += 1
        return result

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[int | Failure]:
        """One ``GET``; ``receive(reader, n, key, buf)`` takes each present value in. Raises ConnectionError."""
        def body(sock: socket.socket, reader: StreamReader) -> list[int | Failure]:
            sock.sendall(b"".join([self._request(dw.OP_GET, len(items)), *(dw.key_field(k) for k, _ in items)]))
            out: list[int | Failure] = []
            for key, buf in items:
                (n,) = dw.U64.unpack(reader.exactly(dw.U64.size))
                out.append(receive(reader, n, key, buf) if n else Failure.MISS)
            return out
        return self._exchange("GET", body)

    def put(self, count: int, chunks: Iterable[Encoded]) -> list[int]:
        """One ``PUT`` of ``count`` chunks, each header and payload sent from where they lie; a chunk the codec
        refused is withdrawn (length 0: the server stores nothing). The server's outcome per chunk. Raises
        ConnectionError."""
        def body(sock: socket.socket, reader: StreamReader) -> list[int]:
            sock.sendall(self._request(dw.OP_PUT, count))
            for chunk in chunks:
                size = 0 if chunk.refused else len(chunk.header) + len(chunk.payload)
                sock.sendall(b"".join([dw.key_field(chunk.meta.key), dw.U64.pack(size), chunk.header]))
                if size:
                    sock.sendall(chunk.payload)
            return list(reader.exactly(count))
        return self._exchange("PUT", body)
