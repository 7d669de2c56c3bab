"""The server side of the data channel (`tiercache.wire.data_frames`): a thread per connection over the store.

Each connection says hello (protocol version, auth token), then sends
requests one after another. A ``GET`` sends each value from the buffers the
store holds it in (no copy of ours); a ``PUT`` reads each header, checks it
like a gRPC ``Put`` (namespace, key, length) and receives the value into a
buffer of its own (a recycled one when the store's `BufferPool` has one of
that size), which the store keeps as it is. Anything malformed — a bad hello, a wrong token, a key or count out of
range, a value over the size limit — gets one log line naming the peer and
closes that connection; the server and its other connections go on.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
from collections import Counter

from tiercache.wire.chunk_format import HEADER_BYTES
from tiercache.errors import ChunkFormatError
from tiercache.wire import data_frames as dw
from tiercache.server.store import ChunkStore, PutOutcome
from tiercache.server.values import check_value
from tiercache.wire.grpc_messages import MAX_KEY_BYTES, MAX_KEYS_PER_CALL
from tiercache.wire.streams import ProtocolError, StreamReader

log = logging.getLogger("tiercache.server")

MAX_CONNECTIONS = 256
HELLO_TIMEOUT_S = 10.0     # a connection that does not say hello in time is dropped (after it, it may idle)
_OUTCOME = {PutOutcome.STORED: dw.PUT_STORED, PutOutcome.PRESENT: dw.PUT_PRESENT,
            PutOutcome.REJECTED: dw.PUT_REJECTED}


class _Refused(Exception):
    """A connection the server drops: the reason goes in the log line."""


class DataServer:
    def __init__(self, store: ChunkStore, host: str, port: int, auth_token: str | None, max_value_bytes: int,
                 counters: Counter[str], hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.store = store
        self.hello_timeout_s = hello_timeout_s
        self.max_value_bytes = max_value_bytes
        self.counters = counters
        self._token = (auth_token or "").encode()
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tiercache-data-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and end every connection (a client mid-request sees it closed: a run of misses)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):      # already closed by its peer
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return      # closed by stop()
            with self._lock:
                if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                    conn.close()
                    self.counters["data_refused_connections"] += 1
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="tiercache-data", daemon=True).start()

    # -- one connection --------------------------------------------------------
    def _serve(self, conn: socket.socket, peer: str) -> None:
        self.counters["data_connections"] += 1
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = StreamReader(conn)
        try:
            conn.settimeout(self.hello_timeout_s)
            self._hello(conn, reader)
            conn.settimeout(None)
            while True:
                try:
                    head = reader.exactly(dw.REQUEST.size)
                except ConnectionError:
                    return      # the client closed between requests
                op, namespace, count = dw.REQUEST.unpack(head)
                if count > MAX_KEYS_PER_CALL:
                    raise _Refused(f"{count} chunks in one request, limit {MAX_KEYS_PER_CALL}")
                if op == dw.OP_GET:
                    self._get(conn, reader, namespace, count)
                elif op == dw.OP_PUT:
                    self._put(conn, reader, namespace, count)
                else:
                    raise _Refused(f"unknown op {op}")
        except (_Refused, ProtocolError) as err:
            self.counters["data_rejected"] += 1
            log.warning("data channel: dropped %s: %s", peer, err,
                        extra={"event": "data_rejected", "peer": peer, "reason": str(err)})
        except TimeoutError:
            self.counters["data_rejected"] += 1
            log.warning("data channel: dropped %s: no hello within %.0f s", peer, self.hello_timeout_s,
                        extra={"event": "data_rejected", "peer": peer, "reason": "hello timeout"})
        except (ConnectionError, OSError) as err:
            log.info("data channel: %s went away: %s", peer, err, extra={"event": "data_disconnected", "peer": peer})
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket, reader: StreamReader) -> None:
        magic = reader.exactly(len(dw.MAGIC))
        if magic != dw.MAGIC:
            conn.sendall(bytes([dw.HELLO_BAD_VERSION]))
            raise _Refused(f"not a tiercache data channel hello (or another version): {magic!r}")
        (n,) = dw.U16.unpack(reader.exactly(dw.U16.size))
        if n > dw.MAX_TOKEN_BYTES:
            raise _Refused(f"a {n}-byte token")
        token = reader.exactly(n)
        if self._token and not hmac.compare_digest(token, self._token):
            conn.sendall(bytes([dw.HELLO_UNAUTHENTICATED]))
            raise _Refused("missing or wrong auth token")
        conn.sendall(bytes([dw.HELLO_OK]))

    def _key(self, reader: StreamReader) -> bytes:
        n = reader.exactly(1)[0]
        if not 0 < n <= MAX_KEY_BYTES:
            raise _Refused(f"key of {n} bytes (1..{MAX_KEY_BYTES})")
        return reader.exactly(n)

    def _get(self, conn: socket.socket, reader: StreamReader, namespace: bytes, count: int) -> None:
        keys = [self._key(reader) for _ in range(count)]
        for key in keys:
            pieces = self.store.get_value(namespace, key)
            if pieces is None:
                conn.sendall(dw.U64.pack(0))
                continue
            total = sum(len(p) for p in pieces)
            conn.sendall(dw.U64.pack(total))
            for piece in pieces:
                conn.sendall(piece)
            self.counters["data_get_chunks"] += 1
            self.counters["bytes_out"] += total

    def _put(self, conn: socket.socket, reader: StreamReader, namespace: bytes, count: int) -> None:
        outcomes = bytearray()
        for _ in range(count):
            key = self._key(reader)
            (size,) = dw.U64.unpack(reader.exactly(dw.U64.size))
            if not HEADER_BYTES <= size <= self.max_value_bytes:
                raise _Refused(f"a value of {size} bytes ({HEADER_BYTES}..{self.max_value_bytes})")
            header = reader.exactly(HEADER_BYTES)
            try:
                check_value(namespace, key, memoryview(header), size)
            except ChunkFormatError as err:
                reader.skip(size - HEADER_BYTES)
                self.counters["data_put_bad_values"] += 1
                log.warning("data channel: chunk %s… rejected: %s", key.hex()[:16], err,
                            extra={"event": "data_put_rejected", "reason": str(err)})
                outcomes.append(dw.PUT_REJECTED)
                continue
            value = self.store.pool.take(size)
            value[:HEADER_BYTES] = header
            reader.read_into(memoryview(value)[HEADER_BYTES:])
            outcome = self.store.put(namespace, key, value)
            if outcome is not PutOutcome.STORED:
                self.store.pool.give(value)
            outcomes.append(_OUTCOME[outcome])
            self.counters["data_put_chunks"] += 1
            self.counters["bytes_in"] += size
        conn.sendall(bytes(outcomes))
