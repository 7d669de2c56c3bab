"""The server's stream watchdog (`StreamWatch`) cuts a stream by its client's progress, not by its age.

Told with a clock the test moves: time the server spends on a stream itself (storing a chunk, waiting for
in-flight room, reading a value to send — what a loaded host stretches) never counts toward a stall; only
time spent waiting on the client does.
"""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import eventually  # noqa: E402
from tiercache.server.limits import StreamWatch  # noqa: E402


class Call:
    """The gRPC call's context as the watchdog sees it: ending it is all the watchdog may do."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def abort(self, code, details) -> None:
        self.ended.set()
        raise RuntimeError(details)    # as grpc's abort does; the watchdog swallows it


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch_ticked(watch: StreamWatch, ticks: int = 3) -> None:
    """Let the watchdog look at least ``ticks`` more times (it wakes every stall_s / 4 of real time)."""
    done = threading.Event()
    original = watch._clock
    seen = [0]

    def counting() -> float:
        seen[0] += 1
        if seen[0] >= ticks:
            done.set()
        return original()
    watch._clock = counting
    assert done.wait(10), "the watchdog did not run"
    watch._clock = original


def test_server_work_of_any_length_is_no_stall_and_waiting_on_a_silent_client_is():
    clock = Clock()
    watch = StreamWatch(limit=4, stall_s=0.2, clock=clock)
    try:
        busy, silent = Call(), Call()
        busy_id, silent_id = watch.admit(busy), watch.admit(silent)
        watch.waiting(busy_id)
        watch.moved(busy_id)        # its message came; the server now stores it, for an hour of the test's clock
        watch.waiting(silent_id)    # asks its client for the next message, which never comes
        clock.now = 3600.0
        eventually(silent.ended.is_set, 10, "the silent stream cut")
        watch_ticked(watch)
        assert not busy.ended.is_set() and watch.cancelled == 1
        watch.waiting(busy_id)      # the server is done and waits on that client now: its clock starts here
        clock.now += 0.1
        watch_ticked(watch)
        assert not busy.ended.is_set()
        clock.now += 0.2
        eventually(busy.ended.is_set, 10, "the stream cut once its client was silent past the stall time")
        assert watch.cancelled == 2
    finally:
        watch.close()


def test_a_slot_freed_by_a_cut_stream_admits_the_next():
    clock = Clock()
    watch = StreamWatch(limit=1, stall_s=0.2, clock=clock)
    try:
        first = Call()
        sid = watch.admit(first)
        assert watch.admit(Call()) is None and watch.refused == 1
        watch.waiting(sid)
        clock.now = 1.0
        eventually(first.ended.is_set, 10, "the silent stream cut")
        assert watch.admit(Call()) is not None
    finally:
        watch.close()
