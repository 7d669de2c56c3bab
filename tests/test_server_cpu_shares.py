"""The server's CPU shared per tenant (`tiercache.server.cpu_shares`): the rule on a fake clock, then on a real
`tiercache serve` whose rival tenant reads maximal chunks as fast as it can beside a tenant that asks now and
then."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tiercache.server.cpu_shares import BURST_S, MAX_DEBT_S, TICK_S, CpuShares


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0
        self.process = 10.0

    def wall(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.process


def shares(cores: float = 1.0) -> tuple[CpuShares, Clocks]:
    clocks = Clocks()
    return CpuShares(cores, clock=clocks.wall, process_clock=clocks.cpu), clocks


def test_a_tenant_alone_never_waits_whatever_it_spends():
    cpu, _ = shares()
    cpu.charge("rival", 5.0)
    assert cpu.delay("rival") == 0.0


def test_past_its_share_a_tenant_waits_until_its_share_has_paid_for_what_it_spent():
    cpu, clocks = shares(cores=1.0)
    assert cpu.delay("acme") == 0.0                     # acme is active: two tenants share one core
    cpu.charge("rival", 0.2)
    wait = cpu.delay("rival")
    assert wait == pytest.approx((0.2 - BURST_S) / 0.5)
    assert cpu.delay("acme") == 0.0                     # the other tenant, within its share, goes on
    clocks.now += wait / 2
    cpu.delay("acme")
    assert cpu.delay("rival") == pytest.approx(wait / 2)
    clocks.now += wait / 2
    cpu.delay("acme")
    assert cpu.delay("rival") == 0.0


def test_a_tenant_that_stopped_asking_no_longer_takes_a_share():
    cpu, clocks = shares(cores=1.0)
    cpu.delay("acme")
    cpu.charge("rival", 0.3)
    assert cpu.delay("rival") > 0
    clocks.now += 1.5                                   # acme asked nothing for longer than ACTIVE_S
    cpu.charge("rival", 0.3)
    assert cpu.delay("rival") == 0.0


def test_the_debt_is_bounded_so_one_long_piece_of_work_is_not_paid_for_forever():
    cpu, _ = shares(cores=1.0)
    cpu.delay("acme")
    cpu.charge("rival", 60.0)
    assert cpu.delay("rival") == pytest.approx(MAX_DEBT_S / 0.5)
    assert cpu.used()["rival"] == pytest.approx(60.0)


def test_the_process_cpu_no_thread_was_charged_is_divided_by_the_grpc_bytes_each_tenant_moved():
    cpu, clocks = shares(cores=4.0)
    cpu.delay("acme")
    cpu.delay("rival")
    cpu.moved("rival", 3 << 20)
    cpu.moved("acme", (1 << 20) - (64 << 10))
    cpu.arrived("acme")                                   # a call weighs 64 KiB beside its bytes
    cpu.charge("acme", 0.01)                              # a thread's own time is charged once, not divided
    clocks.now += 2 * TICK_S
    clocks.process += 0.11
    cpu.delay("acme")
    assert cpu.used()["acme"] == pytest.approx(0.01)      # a tick's CPU is divided at the next tick
    clocks.now += 2 * TICK_S
    cpu.delay("acme")
    used = cpu.used()
    assert used["rival"] == pytest.approx(0.075)
    assert used["acme"] == pytest.approx(0.01 + 0.025)


def test_a_rivals_burst_is_charged_to_the_rival_though_its_calls_are_counted_after_the_transport_worked():
    cpu, clocks = shares(cores=1.0)
    cpu.delay("acme")
    cpu.delay("rival")

    def tick(cpu_s: float, **moved: int) -> None:
        for tenant, nbytes in moved.items():
            cpu.moved(tenant, nbytes)
        clocks.now += 1.2 * TICK_S
        clocks.process += cpu_s
        cpu.delay("acme")

    tick(0.005, acme=100 << 10)
    tick(0.005, acme=100 << 10)
    tick(0.05, acme=100 << 10)          # 200 rival calls began: the transport's work, no handler ran yet
    tick(0.0, rival=200 * (64 << 10))   # ... and now they have, each call counted
    tick(0.0)
    used = cpu.used()
    assert used["rival"] > 0.045
    assert used["acme"] < 0.015         # its own 10 ms and a sliver of the burst
    assert cpu.delay("acme") == 0.0


def test_a_tenant_that_moved_nothing_lately_is_charged_nothing():
    cpu, clocks = shares(cores=1.0)
    cpu.delay("acme")
    cpu.moved("rival", 1 << 20)
    for _ in range(100):                    # 6 s of ticks: rival's bytes weigh nothing any more
        clocks.now += 1.2 * TICK_S
        cpu.delay("acme")
    cpu.moved("acme", 1 << 10)
    clocks.process += 0.02
    for _ in range(2):
        clocks.now += 1.2 * TICK_S
        cpu.delay("acme")
    used = cpu.used()
    assert used["acme"] == pytest.approx(0.02, rel=1e-3)
    assert used.get("rival", 0.0) == pytest.approx(0.0, abs=1e-6)


def test_cpu_the_process_spent_before_a_long_quiet_spell_is_not_divided():
    cpu, clocks = shares()
    cpu.delay("acme")
    cpu.moved("rival", 1 << 20)
    clocks.now += 30.0                                    # the server's start, or idle time
    clocks.process += 2.0
    cpu.delay("acme")
    assert "rival" not in cpu.used()
    cpu.moved("rival", 1 << 20)
    clocks.now += 0.06
    clocks.process += 0.05                                # a tick's CPU, left to divide at the next tick ...
    cpu.delay("acme")
    cpu.moved("acme", 1 << 10)
    clocks.now += 30.0                                    # ... which comes after a quiet spell: not divided
    cpu.delay("acme")
    assert "acme" not in cpu.used() and "rival" not in cpu.used()


def test_a_zero_or_negative_budget_is_refused():
    with pytest.raises(ValueError, match="cores must be positive"):
        CpuShares(0)


def test_a_paced_thread_and_a_paced_call_on_the_event_loop_wait_and_the_waits_are_counted():
    cpu = CpuShares(1.0)
    cpu.delay("acme")
    cpu.charge("rival", BURST_S + 0.02)              # past its share: about 0.04 s to wait at half a core
    cpu.pace("rival")
    assert cpu.delay("rival") == 0.0 and cpu.waits >= 1
    cpu.delay("acme")
    cpu.charge("rival", BURST_S + 0.02)
    asyncio.run(cpu.pace_async("rival"))
    assert cpu.delay("rival") == 0.0 and cpu.waits >= 2
    assert cpu.waited_s > 0


def test_work_run_through_the_shares_is_charged_with_its_threads_cpu_time():
    cpu = CpuShares(1.0)
    spin_until = time.thread_time() + 0.05

    def busy() -> int:
        while time.thread_time() < spin_until:
            pass
        return 7

    assert cpu.run("acme", busy) == 7
    assert cpu.used()["acme"] >= 0.04
    done = threading.Event()

    def one_thread() -> None:          # a connection's thread: its meter made on it, stepped per value
        meter = cpu.meter("beta")
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass
        meter.step()
        done.set()

    threading.Thread(target=one_thread).start()
    assert done.wait(10)
    assert cpu.used()["beta"] >= 0.02
