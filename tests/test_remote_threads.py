"""The gRPC client tier's shared state under several transfer threads: one data channel at a time and none
leaked, while the server restarts under them (connect, fail, reconnect)."""
import threading

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import CacheServerProcess, eventually  # noqa: E402
from tests.support.grpc_clients import NS, Client, chunks  # noqa: E402
from tiercache.tiers import grpc_client  # noqa: E402
from tiercache.transfer.plan import Failure  # noqa: E402

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
