"""The server side of the data channel (`tiercache.wire.data_frames`): a thread per connection over the store.

Each connection says hello (protocol version, auth token), then sends
requests one after another. A ``GET`` sends each value from the buffers the
store holds it in (no copy of ours); a ``PUT`` reads each header, checks it
like a gRPC ``Put`` (namespace, key, length) and receives the value into a
buffer of its own (a recycled one when the store's `BufferPool` has one of
that size), which the store keeps as it is. Anything malformed — a bad hello, a wrong token, a key or count out of
range, a value over the size limit — gets one log line naming the peer and
closes that connection; the server and its other connections go on.

Bounds (`tiercache.server.limits`): a value's bytes are reserved from the
server's in-flight budget before any is received (a value that gets no room
in time is read past and answered ``PUT_BUSY``, which the client may send
again: a busy server, not a broken one); every read and write has the server's deadline — the
hello, each request once begun, each value at the minimum rate — and a
connection idle between requests longer than the idle timeout is closed.
Those timeouts are kept by the kernel (`kernel_timeouts`, `send_by`): a
value moves in one blocking receive or send while its peer keeps up, where
a Python socket timeout costs a ``poll`` and a wakeup per partial receive.
A connection that has not said its hello yet holds no thread: the accept thread
reads every hello, from all of them at once (`selectors`), and gives a
connection its thread only once its token names a tenant. Those waiting are
capped too (``max_connections``): past it the one waiting longest is closed (a
client says hello as it connects, so a flood of silent connections closes its
own), and one that has not said it within the hello timeout is dropped.
Connections past their hello are capped in all and per peer host; at a cap,
room is made by closing the oldest idle connection of the tenant that holds the
most — so a tenant that opens connections in a loop closes its own, never
another tenant's one idle connection. When none can go, the newcomer is told
``HELLO_BUSY`` (its client moves its bytes over gRPC streams instead).
"""
from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from tiercache.errors import ChunkFormatError
from tiercache.log_limits import ThrottledLog
from tiercache.server.cpu_shares import CpuShares, ThreadMeter
from tiercache.server.fair import InflightBytes
from tiercache.server.limits import ServerLimits
from tiercache.server.store import PutOutcome
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.server.values import check_value
from tiercache.wire import data_frames as dw
from tiercache.wire.chunk_format import HEADER_BYTES
from tiercache.wire.grpc_messages import MAX_KEY_BYTES, MAX_KEYS_PER_CALL
from tiercache.wire.streams import ProtocolError, StreamReader, kernel_timeouts, send_by

log = logging.getLogger("tiercache.server")

HELLO_TIMEOUT_S = 10.0     # a connection that does not say hello in time is dropped
ACCEPT_BATCH = 64          # connections accepted in a row before the hellos that came are read
_HELLO_HEAD = len(dw.MAGIC) + dw.U16.size
_OUTCOME = {PutOutcome.STORED: dw.PUT_STORED, PutOutcome.PRESENT: dw.PUT_PRESENT,
            PutOutcome.REJECTED: dw.PUT_REJECTED}


class _Refused(Exception):
    """A connection the server drops: the reason goes in the log line."""


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    host: str
    tenant: str
    idle_since: float | None = None      # waiting for its next request since (None: in a request)


@dataclass(slots=True)
class _Greeting:
    """A connection accepted whose hello is not all in yet; the accept thread reads it without blocking."""
    sock: socket.socket
    host: str
    peer: str
    opened: float
    received: bytearray

    def wanted(self) -> int:
        """Bytes of the hello still to come: the head, then the token its head announces."""
        if len(self.received) < _HELLO_HEAD:
            return _HELLO_HEAD - len(self.received)
        (n,) = dw.U16.unpack_from(self.received, len(dw.MAGIC))
        return _HELLO_HEAD + n - len(self.received)


def _make_room(crowd: list[_Connection]) -> _Connection | None:
    """The connection to close for a newcomer: the oldest idle one of the tenant holding the most
    connections; None when every one is busy in a request."""
    idle = [c for c in crowd if c.idle_since is not None]
    if not idle:
        return None
    held = Counter(c.tenant for c in crowd)
    return min(idle, key=lambda c: (-held[c.tenant], c.idle_since))


def _say(sock: socket.socket, status: int) -> None:
    """One status byte to a connection in the accept thread's hands (its send buffer is empty: no wait)."""
    with contextlib.suppress(OSError):
        sock.send(bytes([status]))


def _end_connection(conn: socket.socket) -> None:
    """End a connection from another thread (its reservation was taken back): its blocked read returns."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class DataServer:
    """Server: the data channel's listener, its accept thread and a thread per admitted connection."""

    def __init__(self, tenancy: Tenancy, host: str, port: int, limits: ServerLimits,
                 inflight: InflightBytes, cpu: CpuShares, counters: Counter[str],
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.tenancy = tenancy
        self.limits = limits
        self.inflight = inflight
        self.cpu = cpu                     # a connection's thread charges its CPU to its tenant, value by value
        self.hello_timeout_s = hello_timeout_s
        self.counters = counters
        self._warn = ThrottledLog(log)     # hostile or broken clients: one line per kind and 10 s
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=socket.SOMAXCONN)
        self.port = self._listener.getsockname()[1]
        self._connections: dict[socket.socket, _Connection] = {}    # past their hello, each with a thread
        self._greetings: dict[socket.socket, _Greeting] = {}       # the accept thread's own: waiting for hello
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
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)     # wakes the accept thread, which closes the rest
        for conn in connections:
            with contextlib.suppress(OSError):      # already closed by its peer
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._listener.close()                  # never started

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def _accept(self) -> None:
        """The accept thread: takes new connections and reads their hellos, until `stop`."""
        with selectors.DefaultSelector() as selector:
            self._listener.setblocking(False)
            selector.register(self._listener, selectors.EVENT_READ)
            try:
                while not self._closed:
                    for key, _ in selector.select(timeout=min(0.5, self.hello_timeout_s / 2)):
                        if key.fileobj is self._listener:
                            self._take_new(selector)
                        elif key.fileobj in self._greetings:
                            self._read_hello(selector, self._greetings[key.fileobj])
                    self._drop_late(selector)
            except OSError:
                if not self._closed:
                    raise
            finally:
                for greeting in self._greetings.values():
                    greeting.sock.close()
                self._greetings.clear()
                self._listener.close()

    def _take_new(self, selector: selectors.BaseSelector) -> None:
        """Accept what is waiting (up to `ACCEPT_BATCH`, so the hellos that came are read in between); past
        the cap on connections waiting for their hello, the one waiting longest is closed."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if self._closed:
                    raise                   # the listener, shut down by stop()
                # out of file descriptors, most likely: the one waiting longest for its hello gives its own
                self.counters["data_accept_errors"] += 1
                self._warn.warning("data accept", "data channel: accept failed: %s", err,
                                   extra={"event": "data_accept_failed", "reason": str(err)})
                if self._greetings:
                    self._forget(selector, next(iter(self._greetings.values())))
                else:
                    time.sleep(0.05)        # every descriptor is a served connection's: wait for one to go
                return
            conn.setblocking(False)
            self._greetings[conn] = _Greeting(conn, peer[0], f"{peer[0]}:{peer[1]}", time.monotonic(), bytearray())
            selector.register(conn, selectors.EVENT_READ)
            if len(self._greetings) > self.limits.max_connections:
                oldest = next(iter(self._greetings.values()))      # dicts keep their order: the first came first
                self.counters["data_hello_dropped"] += 1
                self._forget(selector, oldest)

    def _read_hello(self, selector: selectors.BaseSelector, greeting: _Greeting) -> None:
        """Take in what came of ``greeting``'s hello (never more than the hello: what follows is its
        thread's to read); a whole hello names its tenant, and the connection is admitted or told why not."""
        try:
            data = greeting.sock.recv(greeting.wanted())
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._forget(selector, greeting)            # it went away before its hello
            return
        greeting.received += data
        hello = greeting.received
        version = dw.hello_version(bytes(hello[:len(dw.MAGIC)])) if len(hello) >= len(dw.MAGIC) else None
        if len(hello) >= len(dw.MAGIC) and version is None:
            return self._turn_away(selector, greeting, dw.HELLO_BAD_VERSION,
                                   f"not a tiercache data channel hello (or another version): {bytes(hello[:8])!r}")
        if len(hello) >= _HELLO_HEAD and greeting.wanted() > dw.MAX_TOKEN_BYTES:
            return self._turn_away(selector, greeting, None, f"a {greeting.wanted()}-byte token")
        if greeting.wanted():
            return
        tenant = self.tenancy.who(bytes(hello[_HELLO_HEAD:]))
        if tenant is None:
            return self._turn_away(selector, greeting, dw.HELLO_UNAUTHENTICATED, "missing or wrong auth token")
        selector.unregister(greeting.sock)
        del self._greetings[greeting.sock]
        conn = greeting.sock
        conn.setblocking(True)
        if not self._admit(conn, greeting.host, tenant.name):
            return
        _say(conn, dw.HELLO_OK)
        busy = dw.PUT_BUSY if version is not None and version >= 2 else dw.PUT_REJECTED
        threading.Thread(target=self._serve, args=(conn, greeting.peer, tenant, busy),
                         name="tiercache-data", daemon=True).start()

    def _drop_late(self, selector: selectors.BaseSelector) -> None:
        """Close the connections that have not said their hello within the hello timeout."""
        late = time.monotonic() - self.hello_timeout_s
        while self._greetings:
            first = next(iter(self._greetings.values()))
            if first.opened > late:
                return
            self._turn_away(selector, first, None, f"no hello within {self.hello_timeout_s:.0f} s")

    def _turn_away(self, selector: selectors.BaseSelector, greeting: _Greeting, status: int | None,
                   reason: str) -> None:
        if status is not None:
            _say(greeting.sock, status)
        self.counters["data_rejected"] += 1
        self._warn.warning("data rejected", "data channel: dropped %s: %s", greeting.peer, reason,
                           extra={"event": "data_rejected", "peer": greeting.peer, "reason": reason})
        self._forget(selector, greeting)

    def _forget(self, selector: selectors.BaseSelector, greeting: _Greeting) -> None:
        selector.unregister(greeting.sock)
        del self._greetings[greeting.sock]
        greeting.sock.close()

    def _admit(self, conn: socket.socket, host: str, tenant: str) -> bool:
        """Room for a connection past its hello: under both caps, or by closing one (`_make_room`; of this
        host when it is the host's cap that is reached); otherwise it is told the server is busy."""
        with self._lock:
            if self._closed:
                conn.close()
                return False
            mine = [c for c in self._connections.values() if c.host == host]
            crowd = mine if len(mine) >= self.limits.max_connections_per_peer else \
                list(self._connections.values()) if len(self._connections) >= self.limits.max_connections else None
            victim = None
            if crowd is not None:
                victim = _make_room(crowd)
                if victim is None:
                    self.counters["data_refused_connections"] += 1
                    _say(conn, dw.HELLO_BUSY)
                    conn.close()
                    return False
                del self._connections[victim.sock]
            self._connections[conn] = _Connection(conn, host, tenant)
        if victim is not None:
            self.counters["data_idle_closed"] += 1
            with contextlib.suppress(OSError):
                victim.sock.shutdown(socket.SHUT_RDWR)
        return True

    # -- one connection --------------------------------------------------------
    def _serve(self, conn: socket.socket, peer: str, tenant: Tenant, busy: int) -> None:
        """Requests of one connection until it closes; ``busy`` is the outcome a value that got no room in
        time is answered (`PUT_BUSY`, or `PUT_REJECTED` for a version-1 client)."""
        self.counters["data_connections"] += 1
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = StreamReader(conn)
        state = self._connections.get(conn)
        meter = self.cpu.meter(tenant.name)
        try:
            while True:
                if state is not None:
                    state.idle_since = time.monotonic()
                kernel_timeouts(conn, self.limits.idle_timeout_s)
                try:
                    head = reader.exactly(dw.REQUEST.size)
                except TimeoutError:
                    self.counters["data_idle_closed"] += 1
                    return      # idle too long: the client opens a new connection when it needs one
                except (ConnectionError, OSError):
                    return      # the client closed between requests (or we closed it as the oldest idle)
                if state is not None:
                    state.idle_since = None
                kernel_timeouts(conn, self.limits.read_timeout_s)
                op, namespace, count = dw.REQUEST.unpack(head)
                if count > MAX_KEYS_PER_CALL:
                    raise _Refused(f"{count} chunks in one request, limit {MAX_KEYS_PER_CALL}")
                if op == dw.OP_GET:
                    self._get(conn, reader, tenant, namespace, count, meter)
                elif op == dw.OP_PUT:
                    self._put(conn, reader, tenant, namespace, count, busy, meter)
                else:
                    raise _Refused(f"unknown op {op}")
        except (_Refused, ProtocolError) as err:
            self.counters["data_rejected"] += 1
            self._warn.warning("data rejected", "data channel: dropped %s: %s", peer, err,
                            extra={"event": "data_rejected", "peer": peer, "reason": str(err)})
        except TimeoutError as err:
            self.counters["data_rejected"] += 1
            self._warn.warning("data timeout", "data channel: dropped %s: too slow (%s)", peer, err or "no progress",
                            extra={"event": "data_rejected", "peer": peer, "reason": "timeout"})
        except (ConnectionError, OSError) as err:
            log.info("data channel: %s went away: %s", peer, err, extra={"event": "data_disconnected", "peer": peer})
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _key(self, reader: StreamReader) -> bytes:
        n = reader.exactly(1)[0]
        if not 0 < n <= MAX_KEY_BYTES:
            raise _Refused(f"key of {n} bytes (1..{MAX_KEY_BYTES})")
        return reader.exactly(n)

    def _get(self, conn: socket.socket, reader: StreamReader, tenant: Tenant, namespace: bytes, count: int,
             meter: ThreadMeter) -> None:
        keys = [self._key(reader) for _ in range(count)]
        stores = self.tenancy.readable(tenant)
        for key in keys:
            meter.step()            # each value sent within the tenant's share of the CPU
            pieces = next((p for p in (s.get_value(namespace, key) for s in stores) if p is not None), None)
            if pieces is None:
                send_by(conn, [dw.U64.pack(0)], time.monotonic() + self.limits.read_timeout_s)
                continue
            total = sum(len(p) for p in pieces)
            send_by(conn, [dw.U64.pack(total), *pieces], time.monotonic() + self.limits.value_deadline_s(total))
            self.counters["data_get_chunks"] += 1
            self.counters["bytes_out"] += total

    def _put(self, conn: socket.socket, reader: StreamReader, tenant: Tenant, namespace: bytes, count: int,
             busy: int, meter: ThreadMeter) -> None:
        if not tenant.write:
            raise _Refused(f"tenant {tenant.name!r} may not write")
        store = self.tenancy.own(tenant)
        outcomes = bytearray()
        for _ in range(count):
            meter.step()            # each value received within the tenant's share of the CPU
            key = self._key(reader)
            (size,) = dw.U64.unpack(reader.exactly(dw.U64.size))
            if size == 0:             # withdrawn by the client
                outcomes.append(dw.PUT_REJECTED)
                continue
            if not HEADER_BYTES <= size <= self.limits.max_value_bytes:
                raise _Refused(f"a value of {size} bytes ({HEADER_BYTES}..{self.limits.max_value_bytes})")
            header = reader.exactly(HEADER_BYTES)
            deadline = time.monotonic() + self.limits.value_deadline_s(size)
            try:
                check_value(namespace, key, memoryview(header), size)
            except ChunkFormatError as err:
                reader.skip(size - HEADER_BYTES, deadline)
                self.counters["data_put_bad_values"] += 1
                self._warn.warning("data bad value", "data channel: chunk %s… rejected: %s", key.hex()[:16], err,
                                extra={"event": "data_put_rejected", "reason": str(err)})
                outcomes.append(dw.PUT_REJECTED)
                continue
            # Room for the bytes before any is received: a client declaring large values and going silent
            # holds at most the in-flight budget, never memory of its own choosing.
            hold = self.inflight.reserve(size, self.limits.admit_wait_s, tenant.name, conn,
                                         revoke=lambda: _end_connection(conn))
            if hold is None:
                reader.skip(size - HEADER_BYTES, deadline)     # read past it, into no memory of its own
                self.counters["data_put_busy"] += 1
                outcomes.append(busy)
                continue
            try:
                value = store.pool.take(size)
                value[:HEADER_BYTES] = header
                reader.read_into(memoryview(value)[HEADER_BYTES:], deadline,
                                 progress=lambda: self.inflight.moved(hold))
                outcome = store.put(namespace, key, value)
            finally:
                self.inflight.release(hold)
            if outcome is not PutOutcome.STORED:
                store.pool.give(value)
            outcomes.append(_OUTCOME[outcome])
            self.counters["data_put_chunks"] += 1
            self.counters["bytes_in"] += size
        send_by(conn, [bytes(outcomes)], time.monotonic() + self.limits.read_timeout_s)
