"""`tiercache serve`'s data channel on a real server: what it advertises, and how it treats bad clients."""
import contextlib
import socket
import struct

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import TOKEN, CacheServerProcess, eventually  # noqa: E402
from tests.support.grpc_clients import NS, BudgetHolder, Client, chunks, healthy, raw_call  # noqa: E402
from tiercache.contracts.plan import Failure  # noqa: E402
from tiercache.wire import data_frames as dw  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat  # noqa: E402


def data_port(server) -> int:
    return pb.HealthReply.FromString(raw_call(server, "Health", b"")).data_port


def connect(server, token: str | None = None) -> tuple[socket.socket, int]:
    sock = socket.create_connection(("127.0.0.1", data_port(server)), timeout=5)
    sock.sendall(dw.hello(token))
    return sock, sock.recv(1)[0]


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_values_go_over_the_data_channel_and_bad_values_are_rejected_in_stream(cache_server):
    tier = Client(cache_server.address, NS)
    items = chunks(2)
    assert tier.write_chunks(items[:1]) == ()
    tier.index.check_health()
    assert tier.transport._known_paths.bulk is not None and tier.index.parallel_jobs   # jobs split across workers
    sock, status = connect(cache_server)
    assert status == dw.HELLO_OK
    meta, raw = items[1]
    header, payload = ChunkFormat().encode_parts(meta, raw)
    foreign = bytearray(header)
    foreign[20] ^= 0xFF                                   # damaged header (its CRC no longer matches)
    value = bytes(foreign) + payload
    sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 2) + dw.key_field(meta.key) + dw.U64.pack(len(value)) + value
                 + dw.key_field(meta.key) + dw.U64.pack(len(header) + len(payload)) + header + payload)
    assert sock.recv(2) == bytes([dw.PUT_REJECTED, dw.PUT_STORED])   # one bad chunk, the stream goes on
    sock.sendall(dw.REQUEST.pack(dw.OP_GET, NS, 2) + dw.key_field(meta.key) + dw.key_field(b"\xee" * 32))
    (n,) = dw.U64.unpack(sock.recv(8, socket.MSG_WAITALL))
    assert n == len(header) + len(payload)
    got = bytearray()
    while len(got) < n + 8:
        got += sock.recv(n + 8 - len(got))
    assert bytes(got[:n]) == header + payload and dw.U64.unpack(got[n:]) == (0,)   # then a miss
    sock.close()
    assert "data_put_rejected" in cache_server.log()
    tier.close()


@pytest.mark.parametrize("frame, reason", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a tiercache data channel hello"),
    (None, "0 bytes"),                                         # a key of length 0
    (b"huge", "a value of"),                                   # a value over the server's size limit
    (dw.REQUEST.pack(9, NS, 0), "unknown op 9"),
])
def test_malformed_frames_close_the_connection_with_a_log_line_and_the_server_stays_up(cache_server, frame,
                                                                                      reason):
    sock = socket.create_connection(("127.0.0.1", data_port(cache_server)), timeout=5)
    if frame is None:
        sock.sendall(dw.hello(None) + dw.REQUEST.pack(dw.OP_GET, NS, 1) + b"\0")
    elif frame == b"huge":
        sock.sendall(dw.hello(None) + dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(b"k" * 32)
                     + dw.U64.pack(1 << 40))
    elif frame.startswith(b"GET"):
        sock.sendall(frame)
    else:
        sock.sendall(dw.hello(None) + frame)
    sock.settimeout(5)
    data = b""
    while True:
        try:
            piece = sock.recv(64)
        except ConnectionResetError:
            break
        if not piece:
            break
        data += piece
    sock.close()
    assert reason in cache_server.log()
    assert healthy(cache_server)
    good, status = connect(cache_server)                       # the channel still takes new connections
    assert status == dw.HELLO_OK
    good.close()


def test_a_wrong_token_is_refused_on_the_data_channel_too(token_server):
    sock, status = connect(token_server, "wrong")
    assert status == dw.HELLO_UNAUTHENTICATED and closed(sock)
    assert "missing or wrong auth token" in token_server.log()
    good = Client(token_server.address, NS, auth_token=TOKEN)
    items = chunks(2)
    assert good.write_chunks(items) == ()
    bufs = [memoryview(bytearray(1 << 16)) for _ in items]
    assert good.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)]) == [1 << 16] * 2
    assert good.transport._known_paths.bulk is not None
    good.close()


def test_without_a_data_channel_the_tier_streams_over_grpc(tmp_path):
    server = CacheServerProcess(tmp_path, "--data-port", "-1")
    try:
        assert data_port(server) == 0
        tier = Client(server.address, NS)
        items = chunks(2)
        assert tier.write_chunks(items) == ()
        bufs = [memoryview(bytearray(1 << 16)) for _ in items]
        assert tier.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)]) == [1 << 16] * 2
        tier.index.check_health()
        assert tier.transport._known_paths.bulk is None and not tier.index.parallel_jobs
        stats = pb.StatsReply.FromString(raw_call(server, "Stats", b""))
        assert stats.counters["data_put_chunks"] == 0
        tier.close()
    finally:
        server.stop()


def test_the_frames_are_the_documented_layout():
    assert dw.MAGIC == b"TCDATA\x02\x00" and dw.REQUEST.size == 21
    assert dw.hello_version(b"TCDATA\x01\x00") == 1 and dw.hello_version(b"TCDATA\x03\x00") is None
    assert dw.hello("ab") == dw.MAGIC + struct.pack("<H", 2) + b"ab"
    assert dw.key_field(b"xyz") == b"\x03xyz"


def test_spare_buffers_are_reused_never_while_read_and_never_beyond_capacity():
    from tiercache.server.tiers import MemoryChunks
    from tiercache.server.values import BufferPool
    pool = BufferPool()
    held = bytearray(1 << 20)
    view = memoryview(held)                                   # a send in progress
    pool.give(held)
    assert pool.spare_bytes == 0                              # someone still reads it: not taken back
    del view
    pool.give(held)
    assert pool.spare_bytes == 1 << 20 and pool.take(1 << 20) is held and pool.spare_bytes == 0
    memory = MemoryChunks(4 << 20, pool=pool)                 # room for four 1 MiB values
    for i in range(4):
        assert memory.add(bytes([i]) * 32, bytearray(1 << 20))
    memory.delete([bytes([0]) * 32, bytes([1]) * 32])         # their buffers become spares
    assert pool.spare_bytes == 2 << 20 and memory.used_bytes == 2 << 20
    assert memory.add(b"n" * 32, pool.take(1 << 20))          # reused; one spare left
    assert memory.add(b"m" * 32, bytearray(1 << 20))          # the spare gives way, no chunk is evicted
    assert pool.spare_bytes == 0 and memory.num_chunks == 4 and memory.counters.evicted == 0
    assert memory.add(b"o" * 32, bytearray(1 << 20))          # now a chunk goes, and its buffer is spare
    assert memory.counters.evicted == 1
    assert memory.used_bytes + pool.spare_bytes <= 4 << 20


def data_server(capacity: int = 1 << 20, limits: dict | None = None, **kwargs):
    """A data channel server of its own in this process, on a free port, started (``limits`` overrides
    fields of its `ServerLimits`)."""
    import collections

    from tiercache.server.cpu_shares import CpuShares
    from tiercache.server.data_server import DataServer
    from tiercache.server.fair import InflightBytes
    from tiercache.server.limits import ServerLimits
    from tiercache.server.store import StoreConfig
    from tiercache.server.tenants import Tenancy, load_tenants
    bounds = ServerLimits.for_server(capacity, workers=4, **(limits or {}))
    server = DataServer(Tenancy(load_tenants(""), StoreConfig(capacity)), "127.0.0.1", 0, bounds,
                        InflightBytes(bounds.max_inflight_bytes), CpuShares(1.0), collections.Counter(), **kwargs)
    server.start()
    return server


def _put_head(value_bytes: int, seed: int = 7) -> tuple[bytes, bytes]:
    """A one-chunk ``PUT``'s frames up to its payload (a real header), and the payload."""
    from tiercache.wire.chunk_format import ChunkMeta
    payload = bytes([seed]) * value_bytes
    meta = ChunkMeta(NS, bytes([seed]) * 32, 16, "uint8", (value_bytes,))
    fmt = ChunkFormat()
    header, _ = fmt.seal(meta, fmt.raw, payload)
    frames = dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(meta.key) + dw.U64.pack(len(header) + len(payload))
    return frames + header, payload


def test_a_value_that_trickles_in_is_cut_off_at_its_deadline_however_its_bytes_keep_coming():
    """Each value has a deadline (the read timeout plus its size at the minimum rate), kept by the kernel in
    steps: a client that keeps sending a byte at a time, never silent for a whole step, still runs out of
    it, and the server closes the connection."""
    import time

    server = data_server(limits={"read_timeout_s": 0.5, "min_rate_bytes_s": float(1 << 30)})
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        sock.sendall(dw.hello(None))
        assert sock.recv(1)[0] == dw.HELLO_OK
        head, payload = _put_head(64 << 10)
        sock.sendall(head)
        t0, sent = time.monotonic(), 0
        with contextlib.suppress(OSError):      # until the server closes it mid-value
            while time.monotonic() - t0 < 30:   # (the whole value would take 80 s at this pace)
                sock.sendall(payload[sent:sent + 16])
                sent += 16
                time.sleep(0.02)
        eventually(lambda: closed(sock), 30, "the connection closed")
        assert time.monotonic() - t0 > 0.4 and sent < len(payload)     # cut at its deadline, not before
        assert server.counters["data_rejected"] == 1 and server.counters["data_put_chunks"] == 0
    finally:
        sock.close()
        server.stop()


def test_a_get_nobody_reads_is_given_up_at_its_deadline_and_its_thread_freed():
    """A value sent to a client that stops reading is bounded the same way (`send_by`): the server's thread
    gives up at the value's deadline and closes the connection, while the rest of the server serves on."""

    server = data_server(capacity=64 << 20, limits={"read_timeout_s": 0.5, "min_rate_bytes_s": float(1 << 30)})
    value = 16 << 20                                   # more than loopback's socket buffers hold
    writer = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    reader = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        for sock in (writer, reader):
            sock.sendall(dw.hello(None))
            assert sock.recv(1)[0] == dw.HELLO_OK
        head, payload = _put_head(value)
        writer.sendall(head + payload)
        assert writer.recv(1)[0] == dw.PUT_STORED
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        reader.sendall(dw.REQUEST.pack(dw.OP_GET, NS, 1) + dw.key_field(bytes([7]) * 32))
        eventually(lambda: server.counters["data_rejected"] == 1, 30, "the stalled GET given up")
        writer.sendall(dw.REQUEST.pack(dw.OP_GET, NS, 1) + dw.key_field(bytes([7]) * 32))   # others go on
        length = b""
        while len(length) < dw.U64.size:
            length += writer.recv(dw.U64.size - len(length))
        assert dw.U64.unpack(length)[0] == HEADER_BYTES + value
    finally:
        writer.close()
        reader.close()
        server.stop()


def test_a_connection_that_never_says_hello_is_dropped(caplog):
    import logging
    import time

    server = data_server(hello_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.server"):
            silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            t0 = time.monotonic()
            assert closed(silent) and time.monotonic() - t0 < 3
            silent.close()
        assert "no hello within" in caplog.text and server.counters["data_rejected"] == 1
    finally:
        server.stop()


def test_connections_that_never_say_hello_hold_no_thread_and_do_not_keep_a_client_out():
    """The accept thread reads every hello itself: a flood of silent connections, more than the server
    takes at once, gets no thread each, and closes its own oldest, while a client saying its hello is
    admitted at once."""
    import threading

    server = data_server()
    flood = []
    try:
        before = sum(t.name == "tiercache-data" for t in threading.enumerate())
        for _ in range(server.limits.max_connections + 40):
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        client.sendall(dw.hello(None))
        assert client.recv(1)[0] == dw.HELLO_OK
        eventually(lambda: server.counters["data_hello_dropped"] >= 40, 10, "the oldest silent ones closed")
        assert sum(t.name == "tiercache-data" for t in threading.enumerate()) <= before + 1   # the client's
        assert server.num_connections == 1
        client.close()
    finally:
        for sock in flood:
            sock.close()
        server.stop()


def test_a_data_port_that_does_not_answer_the_hello_sends_the_next_calls_to_grpc_at_once():
    """A port that accepts and never answers (a swamped server) costs one `HANDSHAKE_TIMEOUT_S`; for
    `BUSY_BACKOFF_S` after it the channel says busy without trying, and the tier moves its chunks over
    gRPC streams meanwhile."""
    from tiercache.wire import data_channel
    from tiercache.wire.data_channel import DataChannel, DataChannelBusy

    listener = socket.create_server(("127.0.0.1", 0))
    channel = DataChannel("127.0.0.1", listener.getsockname()[1], NS, None, timeout_s=30.0)
    try:
        with pytest.raises(DataChannelBusy, match="did not take the hello"):
            channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0)
        silent, _ = listener.accept()                       # the one connection it made
        listener.settimeout(0.2)
        with pytest.raises(DataChannelBusy, match="busy less than"):
            channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0)
        with pytest.raises(TimeoutError):
            listener.accept()                               # and no second one
        channel._busy_until = 0.0                           # the backoff over (its length is not under test)
        with pytest.raises(DataChannelBusy, match="did not take the hello"):
            channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0)
        assert data_channel.HANDSHAKE_TIMEOUT_S < channel.timeout_s
        silent.close()
    finally:
        channel.close()
        listener.close()


def test_stop_ends_the_accept_thread_and_every_connection_at_once():
    """A thread blocked in accept() is not woken by closing the listener: stop() shuts it down first, so a
    server's shutdown does not wait out the join's timeout (it used to take 5 s)."""
    server = data_server()
    client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    client.sendall(dw.hello(None))
    assert client.recv(1)[0] == dw.HELLO_OK
    server.stop()
    assert not server._thread.is_alive()      # joined because it ended, not because the join timed out
    assert closed(client)
    client.close()


def test_a_closed_channel_opens_no_new_connections(cache_server):
    from tiercache.wire.data_channel import DataChannel
    channel = DataChannel("127.0.0.1", data_port(cache_server), NS, None, timeout_s=2.0)
    assert channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0) == [Failure.MISS]   # a miss, connected
    channel.close()
    with pytest.raises(ConnectionError):
        channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0)
    with pytest.raises(ConnectionError, match="closed"):      # and no new connection either
        channel.get([(b"\xee" * 32, memoryview(bytearray(8)))], lambda *a: 0)


def test_a_server_that_stalls_mid_value_times_the_request_out():
    """The client's sockets block with kernel-kept timeouts (`kernel_timeouts`): a server that accepts,
    says hello and then stops sending halfway through a value fails the request within about the timeout
    (the tier turns that into misses), instead of hanging a transfer thread."""
    import threading
    import time

    from tiercache.wire.data_channel import DataChannel
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def stall() -> None:
        conn, _ = listener.accept()
        conn.recv(1 << 16)                                  # the hello
        conn.sendall(bytes([dw.HELLO_OK]))
        conn.recv(1 << 16)                                  # the GET
        conn.sendall(dw.U64.pack(1 << 20) + b"x" * 1000)    # a value begun, never finished
        release.wait(10)
        conn.close()

    server = threading.Thread(target=stall)
    server.start()
    channel = DataChannel("127.0.0.1", listener.getsockname()[1], NS, None, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            channel.get([(b"\xee" * 32, memoryview(bytearray(1 << 20)))],
                        lambda reader, n, key, buf: reader.read_into(buf[:n]))
        assert 0.4 < time.monotonic() - t0 < 3
    finally:
        release.set()
        server.join()
        channel.close()
        listener.close()


def server_stats(server, token: str | None = None) -> dict:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    reply = pb.StatsReply.FromString(raw_call(server, "Stats", b"", metadata))
    return dict(reply.counters)


def test_a_connection_closed_by_the_servers_idle_policy_is_reopened_quietly(tmp_path):
    """The server closes a data connection idle past ``--idle-timeout``; the client's next load finds its
    kept connection closed and makes the call again on a fresh one — no outage, no failed chunk."""
    server = CacheServerProcess(tmp_path, "--idle-timeout", "0.3")
    tier = Client(server.address, NS)
    try:
        items = chunks(2, seed=5)
        assert tier.write_chunks(items) == ()
        eventually(lambda: server_stats(server).get("data_idle_closed", 0) >= 1, 10, "the idle connection closed")
        bufs = [memoryview(bytearray(1 << 16)) for _ in items]
        assert tier.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)]) == [1 << 16] * 2
        assert all(bytes(b) == raw for b, (_, raw) in zip(bufs, items))
        assert tier.transport.reconnects == 1 and tier.available and tier.transport._outage.outages == 0
    finally:
        tier.close()
        server.stop()


def test_a_tenant_opening_connections_in_a_loop_closes_its_own_not_another_tenants(tmp_path):
    """Tenant B's engine keeps one idle data connection. Tenant A opens 150 connections one after another
    from the same host — past the per-host cap of 64 — and leaves each idle: room is made from A's own
    connections (the tenant holding the most), never by closing B's, the oldest idle one there is."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\ntoken = "token-of-tenant-a"\n[tenants.b]\ntoken = "token-of-tenant-b"\n')
    server = CacheServerProcess(tmp_path, "--auth-token-file", str(tenants))
    b = Client(server.address, NS, auth_token="token-of-tenant-b")
    held = []
    try:
        items = chunks(2, seed=6)
        assert b.write_chunks(items) == ()                  # B's connection: open, and idle from now on
        for _ in range(150):
            sock, status = connect(server, "token-of-tenant-a")
            assert status == dw.HELLO_OK
            held.append(sock)
        assert sum(closed(s) for s in held[:-1][:80]) >= 80 - 1   # A's oldest went for room
        bufs = [memoryview(bytearray(1 << 16)) for _ in items]
        assert b.read_chunks_into([(m.key, buf) for (m, _), buf in zip(items, bufs)]) == [1 << 16] * 2
        assert b.transport.reconnects == 0                  # B's kept connection was never closed
    finally:
        for sock in held:
            sock.close()
        b.close()
        server.stop()


def put_busy(server) -> int:
    return dict(pb.StatsReply.FromString(raw_call(server, "Stats", b"")).counters).get("data_put_busy", 0)


def test_a_value_with_no_room_in_time_is_busy_and_sent_again_until_it_lands(tmp_path):
    """A value the in-flight budget has no room for within the server's wait is answered PUT_BUSY (PUT_REJECTED
    to a version-1 client, which knows no other answer); the tier sends it again after short pauses, so a
    budget freed meanwhile takes it, and one never freed fails it as busy with the tier still up."""
    import concurrent.futures

    server = CacheServerProcess(tmp_path, "--max-value", "1MiB", "--max-inflight", "1MiB", "--read-timeout", "30")
    holder = BudgetHolder(server, 1 << 20)
    tier = Client(server.address, NS)
    try:
        (meta, raw), = chunks(1)
        header, payload = ChunkFormat().encode_parts(meta, raw)
        value = dw.key_field(meta.key) + dw.U64.pack(len(header) + len(payload)) + header + payload
        for magic, answer in ((dw.MAGIC, dw.PUT_BUSY), (b"TCDATA\x01\x00", dw.PUT_REJECTED)):
            sock = socket.create_connection(("127.0.0.1", data_port(server)), timeout=10)
            sock.sendall(magic + struct.pack("<H", 0))
            assert sock.recv(1) == bytes([dw.HELLO_OK])
            sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 1) + value)
            assert sock.recv(1) == bytes([answer])
            sock.close()

        assert tier.write_chunks(chunks(1, seed=1)) == ((chunks(1, seed=1)[0][0].key, Failure.BUSY),)
        assert tier.transport.available                    # a busy server, not an outage
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy_before = put_busy(server)
            stored = pool.submit(tier.write_chunks, chunks(1))
            eventually(lambda: put_busy(server) > busy_before, what="the first try refused for room")
            holder.release()
            assert stored.result(timeout=30) == ()
        buf = memoryview(bytearray(len(raw)))
        assert tier.read_chunks_into([(meta.key, buf)]) == [len(raw)] and bytes(buf) == bytes(raw)
    finally:
        holder.release()
        tier.close()
        server.stop()
