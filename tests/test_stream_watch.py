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
    """The gRPC call's context as the watchdog sees it: ending it is all the watchdog may do (on its own
    thread: `admit` runs on gRPC's event loop, which a context's ``abort`` may need)."""

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


def test_a_tenant_over_its_share_of_slots_gives_a_silent_stream_to_another_tenant():
    """Four slots, all held by tenant A (borrowed while nobody else streamed): B's first stream gets the slot
    of A's stream that has waited on its silent client longest; a second tenant-B stream, B now at its
    share of two only with A's streams moving, is refused; A's moving streams are never cut for B."""
    clock = Clock()
    watch = StreamWatch(limit=4, stall_s=3600.0, clock=clock, share_silent_s=1.0)
    try:
        calls = [Call() for _ in range(4)]
        ids = [watch.admit(c, "A") for c in calls]
        assert all(i is not None for i in ids)
        watch.waiting(ids[0])                 # silent since t=0
        clock.now = 0.5
        watch.waiting(ids[1])                 # silent since t=0.5
        clock.now = 2.0                       # ids[2], ids[3] keep moving (never waiting)
        b1 = watch.admit(Call(), "B")
        assert b1 is not None and calls[0].ended.wait(5) and not calls[1].ended.is_set()
        assert watch.taken_back == 1
        b2 = watch.admit(Call(), "B")         # A still over its share of 2, and ids[1] silent for 1.5 s
        assert b2 is not None and calls[1].ended.wait(5)
        assert watch.admit(Call(), "B") is None          # B at its share; A's two are moving
        assert not calls[2].ended.is_set() and not calls[3].ended.is_set() and watch.refused == 1
        assert watch.admit(Call(), "A") is None          # full, and A has nothing to take back from
    finally:
        watch.close()


def test_a_tenant_at_its_share_is_refused_free_slots_while_another_tenant_is_active():
    """Eight slots, tenant B asked a moment ago: A may take its share of four, not the free rest — they are
    B's while B is active. Once B has been quiet for ``active_s``, A may borrow them."""
    clock = Clock()
    watch = StreamWatch(limit=8, stall_s=3600.0, clock=clock, active_s=1.0)
    try:
        b = watch.admit(Call(), "B")
        watch.done(b)                                        # B asked, and holds nothing now
        assert all(watch.admit(Call(), "A") is not None for _ in range(4))
        assert watch.admit(Call(), "A") is None and watch.refused == 1
        clock.now = 1.5                                      # B quiet past active_s: A is alone
        assert watch.admit(Call(), "A") is not None
    finally:
        watch.close()


def test_a_tenant_alone_leaves_the_headroom_free_so_a_tenant_that_comes_never_waits_for_a_slot():
    """Eight slots and a headroom of two: tenant A alone, its calls all moving (none to take back), holds six;
    tenant B's first calls find the two left, and A, no longer alone, takes none while over its share."""
    clock = Clock()
    watch = StreamWatch(limit=8, stall_s=3600.0, clock=clock, headroom=2)
    try:
        assert all(watch.admit(Call(), "A") is not None for _ in range(6))
        assert watch.admit(Call(), "A") is None
        assert watch.admit(Call(), "B") is not None and watch.admit(Call(), "B") is not None
        assert watch.admit(Call(), "A") is None
    finally:
        watch.close()


def test_request_slots_go_from_a_silent_request_to_a_newcomer_of_the_same_tenant():
    """The request slots (``take_back_own``): a unary call's request comes with its headers, so a slot whose
    request has not come for ``share_silent_s`` is ended for a newcomer even of the same tenant — silent
    calls from one client cannot lock its own tenant out. A newcomer finds nothing to take while the
    holders are fresh or moving."""
    clock = Clock()
    watch = StreamWatch(limit=2, stall_s=3600.0, clock=clock, share_silent_s=0.1, take_back_own=True)
    try:
        silent, working = Call(), Call()
        s, _w = watch.admit(silent, "A"), watch.admit(working, "A")
        watch.waiting(s)                                     # its request never comes
        assert watch.admit(Call(), "A") is None              # silent for 0 s: not yet
        clock.now = 0.2
        assert watch.admit(Call(), "A") is not None and silent.ended.wait(5)
        assert not working.ended.is_set() and watch.taken_back == 1
        assert watch.admit(Call(), "A") is None              # the working one (not waiting) is never taken
    finally:
        watch.close()


def test_without_take_back_own_a_tenant_never_ends_its_own_streams():
    clock = Clock()
    watch = StreamWatch(limit=1, stall_s=3600.0, clock=clock, share_silent_s=0.1)
    try:
        silent = Call()
        watch.waiting(watch.admit(silent, "A"))
        clock.now = 5.0
        assert watch.admit(Call(), "A") is None and not silent.ended.is_set()
    finally:
        watch.close()
