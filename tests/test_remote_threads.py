"""The gRPC client tier's shared state under several transfer threads: one data channel at a time and none
leaked, while the server restarts under them (connect, fail, reconnect); and counters that lose no count."""
import sys
import threading

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import CacheServerProcess, eventually  # noqa: E402
from tests.support.grpc_clients import NS, Client, chunks  # noqa: E402
from tiercache.contracts.plan import Failure  # noqa: E402
from tiercache.tiers import grpc_client, serve_channels  # noqa: E402

THREADS = 6


class _Recorded(grpc_client.DataChannel):
    """The real data channel, each one kept in a list when made (so a dropped one is still seen)."""
    made: list["_Recorded"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Recorded.made.append(self)


def _open_channels() -> list[_Recorded]:
    return [c for c in _Recorded.made if not c._closed or c._open]


def test_transfer_threads_share_one_data_channel_and_leak_none_across_a_server_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(grpc_client, "DataChannel", _Recorded)
    _Recorded.made = []
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB")
    tier = Client(server.address, NS, timeout_s=2.0, retry_interval_s=0.2)
    start = threading.Barrier(THREADS)
    stop = threading.Event()
    problems: list[BaseException] = []

    def transfers(seed: int) -> None:
        try:
            items = chunks(2, seed=seed)
            bufs = [memoryview(bytearray(1 << 16)) for _ in items]
            start.wait()
            while not stop.is_set():
                tier.write_chunks(items)
                got = tier.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)])
                for n, buf, (_, raw) in zip(got, bufs, items):   # whatever came back is the stored value
                    assert isinstance(n, Failure) or bytes(buf[:n]) == raw
        except BaseException as err:   # noqa: BLE001 - reported by the test's own thread
            problems.append(err)

    threads = [threading.Thread(target=transfers, args=(10 + i,)) for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        eventually(lambda: len(_Recorded.made) >= 1, 20, "a first data channel")
        assert len(_Recorded.made) == 1                  # the threads asked for the paths together: one channel
        server.stop()                                    # every thread's calls fail; the tier goes down
        eventually(lambda: not tier.transport.available, 20, "the outage")
        server.start()                                   # same gRPC port; a data port of its own
        eventually(lambda: tier.transport.available and len(_Recorded.made) >= 2, 30, "the reconnect")
        stop.set()
        for t in threads:
            t.join(60)
        assert not problems, problems
        assert len(_open_channels()) == 1                # the one the tier knows; every earlier one was closed
        assert _open_channels()[0] is tier.transport._known_paths.bulk
    finally:
        stop.set()
        tier.close()
        server.stop()
    assert _open_channels() == []


class _Refused(grpc.RpcError):
    """A server at its tenant's share answering a call: RESOURCE_EXHAUSTED (injected at the gRPC boundary)."""

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "injected: no room for this tenant"


def test_counters_bumped_by_every_transfer_thread_lose_no_count(tmp_path, monkeypatch):
    """Several transfer threads fail calls side by side, each failure counted by the thread that saw it: every
    store refused for room is one `busy` (its retries are not counted again), every broken Get stream one
    `errors` — neither is an outage, so every call counts, exactly once. Threads switch as often as CPython
    lets them; under its GIL an unguarded ``+=`` still seldom loses a count (this run did not catch one
    without the lock), so what guarantees the totals is `RemoteTransport._count`'s lock, and what this
    checks is that every failure reaches it once."""
    monkeypatch.setattr(serve_channels, "BUSY_PAUSE_S", 0.0)
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB")
    tier = Client(server.address, NS, bulk="off", local="off")        # gRPC streams: the one channel
    calls, seen = 300, []

    def refused(*args, **kwargs):
        raise _Refused()

    def broken(*args, **kwargs):
        return iter([b"\xff" * 8])              # not a Chunk message: a malformed Get stream

    def transfers(seed: int) -> None:
        items = chunks(1, seed=seed)
        buf = memoryview(bytearray(1 << 16))
        for _ in range(calls):
            stored = tier.write_chunks(items)
            got = tier.read_chunks_into([(items[0][0].key, buf)])
            seen.append((stored, got))

    try:
        assert tier.transport.check_health() is not None
        monkeypatch.setattr(tier.transport._server, "put", refused)
        monkeypatch.setattr(tier.transport._server, "get", broken)
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=transfers, args=(20 + i,)) for i in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            sys.setswitchinterval(old)
        assert len(seen) == THREADS * calls
        assert all(stored[0][1] is Failure.BUSY and got == [Failure.MISS] for stored, got in seen)
        assert tier.transport.available
        assert (tier.transport.busy, tier.transport.errors) == (THREADS * calls, THREADS * calls)
    finally:
        tier.close()
        server.stop()
