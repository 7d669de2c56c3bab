"""The server's in-flight budget divided fairly (`tiercache.server.fair.InflightBytes`), told step by step.

A budget of 8 units; tenants A and B; connections a1, a2 of A and b1 of B. The clock is the test's: a
holder is "silent" when the test has moved the clock past ``SILENT_S`` without calling `moved` for it.
Taking a reservation back calls its ``revoke`` (the server ends that connection) and the handler releases it.
"""
from __future__ import annotations

import threading
import time

from tiercache.server.fair import InflightBytes

UNIT = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budget(clock: Clock) -> InflightBytes:
    return InflightBytes(8 * UNIT, clock=clock, silent_s=1.0, active_s=1.0)


def ask(b: InflightBytes, tenant: str, conn: str, units: int, revoked: list, wait_s: float = 0.0):
    return b.reserve(units * UNIT, wait_s, tenant, conn, revoke=lambda: revoked.append((tenant, conn)))


def test_a_tenant_alone_borrows_the_whole_budget_and_a_second_one_stops_it_at_its_share():
    clock, revoked = Clock(), []
    b = budget(clock)
    holds = [ask(b, "A", "a1", 2, revoked) for _ in range(4)]
    assert all(holds) and b.used == 8 * UNIT               # alone: all of it
    assert ask(b, "B", "b1", 2, revoked) is None           # full, and A's holders are moving (not silent)
    for h in holds[:2]:
        b.release(h)
    # B asked a moment ago: A may not take back more than its share (4 of 8) while B wants room
    assert ask(b, "A", "a1", 2, revoked) is None
    assert ask(b, "B", "b1", 2, revoked) is not None
    assert revoked == []


def test_a_silent_borrower_is_taken_back_when_another_tenant_needs_its_share():
    clock, revoked = Clock(), []
    b = budget(clock)
    silent = [ask(b, "A", "a1", 2, revoked) for _ in range(4)]     # A holds everything and then sends nothing
    clock.now += 1.5

    def handler_lets_go():      # what the server's handler does once its connection is ended
        for h in silent:
            b.release(h)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ask(b, "B", "b1", 2, revoked, wait_s=5.0)))
    waiter.start()
    while not revoked:
        threading.Event().wait(0.01)
    handler_lets_go()
    waiter.join(5)
    assert got and got[0] is not None and b.taken_back == 4
    assert revoked and set(revoked) == {("A", "a1")}


def test_a_borrower_whose_bytes_keep_arriving_is_never_taken_back():
    clock, revoked = Clock(), []
    b = budget(clock)
    moving = [ask(b, "A", "a1", 2, revoked) for _ in range(4)]
    for _ in range(5):
        clock.now += 0.5
        for h in moving:
            b.moved(h)                                   # slow, but progressing
        assert ask(b, "B", "b1", 2, revoked) is None     # B waits for A's values to complete
    assert revoked == [] and b.taken_back == 0
    b.release(moving[0])
    assert ask(b, "B", "b1", 2, revoked) is not None


def test_within_a_tenant_a_silent_connection_is_taken_back_for_another_of_its_connections():
    clock, revoked = Clock(), []
    b = budget(clock)
    held = [ask(b, "A", "a1", 4, revoked), ask(b, "A", "a1", 4, revoked)]
    assert all(held)
    clock.now += 1.5                                     # a1 went silent

    def lets_go():
        while not revoked:
            threading.Event().wait(0.01)
        for h in held:
            b.release(h)
    t = threading.Thread(target=lets_go)
    t.start()
    assert ask(b, "A", "a2", 2, revoked, wait_s=5.0) is not None
    t.join(5)
    assert set(revoked) == {("A", "a1")}


def test_a_first_value_larger_than_the_share_is_admitted_and_a_value_over_the_budget_never():
    clock, revoked = Clock(), []
    b = budget(clock)
    assert ask(b, "B", "b1", 1, revoked) is not None     # B is active
    assert ask(b, "A", "a1", 6, revoked) is not None     # A's first value: above its share of 4, admitted
    assert ask(b, "A", "a1", 1, revoked) is None         # a second one past its share is not (B is active)
    assert ask(b, "C", "c1", 9, revoked) is None and b.refused >= 1


def test_a_released_hold_is_released_once():
    clock, revoked = Clock(), []
    b = budget(clock)
    h = ask(b, "A", "a1", 3, revoked)
    b.release(h)
    b.release(h)                                         # a handler's finally after a taken-back release
    assert b.used == 0


def test_a_tenant_over_its_own_share_takes_nothing_back_from_another():
    """A and B hold 4 of 8 each and go silent. A, already at its share, asking for more takes nothing back
    from B; C, arriving with nothing, takes back from both (each is over the share of three tenants)."""
    clock, revoked = Clock(), []
    b = budget(clock)
    a, bs = ask(b, "A", "a1", 4, revoked), ask(b, "B", "b1", 4, revoked)
    assert a is not None and bs is not None and b.used == 8 * UNIT
    assert ask(b, "C", "c1", 2, revoked) is None           # full, nobody silent yet: C waits its turn, active
    clock.now += 1.0                                       # A and B silent now; C still counts as active
    assert ask(b, "A", "a1", 2, revoked) is None and revoked == []   # B is over the share of 2, but so is A
    got = []
    t = threading.Thread(target=lambda: got.append(ask(b, "C", "c1", 2, revoked, wait_s=5.0)))
    t.start()
    deadline = time.monotonic() + 5
    while not revoked and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    b.release(a)
    b.release(bs)
    t.join(5)
    assert got and got[0] is not None and set(revoked) == {("A", "a1"), ("B", "b1")}


def test_a_tenant_taken_back_from_gets_no_more_than_its_share_until_its_probation_ends():
    """A's silent connection a1 holds all 8 units and is taken back for B. A reconnects (a2) and declares 6
    units again: while B is active, that first value over A's share of 4 is refused — A would otherwise take
    the room back in every pause between B's values. Once its probation is over, a first value larger than
    the share is admitted again."""
    clock, revoked = Clock(), []
    b = InflightBytes(8 * UNIT, clock=clock, silent_s=1.0, active_s=1.0, probation_s=10.0)
    silent = ask(b, "A", "a1", 8, revoked)
    clock.now += 1.5

    def lets_go():
        while not revoked:
            threading.Event().wait(0.01)
        b.release(silent)
    t = threading.Thread(target=lets_go)
    t.start()
    mine = ask(b, "B", "b1", 1, revoked, wait_s=5.0)
    t.join(5)
    assert mine is not None and revoked == [("A", "a1")]
    assert ask(b, "A", "a2", 6, revoked) is None           # on probation, B active: no more than its share
    within = ask(b, "A", "a2", 4, revoked)
    assert within is not None                              # within its share: granted at once
    b.release(within)
    clock.now += 10.0                                      # probation over; B still holds its unit, active
    assert ask(b, "A", "a3", 6, revoked) is not None       # a first value over the share, admitted again
