"""`Outage`: a failed call marks a remote tier down; only a background probe brings it back."""
import threading

from tests.conftest import eventually
from tiercache.tiers.outage import Outage


def test_down_until_a_probe_answers_and_probes_never_run_on_the_callers_thread():
    answers = iter([False, False, True])
    callers = []

    def probe() -> None:
        callers.append(threading.current_thread().name)
        if not next(answers):
            raise ConnectionError("still away")

    outage = Outage("remote", retry_interval_s=0.01, probe=probe)
    try:
        assert outage.available
        outage.failed("lookup", ConnectionError("refused"))
        outage.failed("load", ConnectionError("refused"))        # already down: one outage, one prober
        assert not outage.available and outage.outages == 1
        eventually(lambda: outage.available, 5, "recovery")
        assert callers == ["tiercache-probe-remote"] * 3 and outage.probes == 3
        outage.failed("store", TimeoutError())                    # a second outage starts a new prober
        assert not outage.available and outage.outages == 2
    finally:
        outage.close()


def test_a_closed_outage_stops_probing():
    outage = Outage("remote", retry_interval_s=0.01, probe=lambda: 1 / 0)
    outage.failed("lookup", ConnectionError("refused"))
    eventually(lambda: outage.probes >= 2, 5, "probes")
    outage.close()                                                # joins the prober
    prober = outage._prober
    assert prober is not None and not prober.is_alive()
    outage.succeeded()
    outage.failed("lookup", ConnectionError("refused"))          # closed: no new outage, no new prober
    assert outage.available and outage.outages == 1 and outage._prober is prober


def test_the_guards_of_one_tier_log_one_outage_between_them(caplog):
    """The scheduler's lookups and a worker's transfers in one process (the reference engine) each guard the
    tier: the outage is one warning line and the recovery one line."""
    up = threading.Event()

    def probe() -> None:
        if not up.is_set():
            raise ConnectionError("still away")

    lookups = Outage("redis (lookups)", retry_interval_s=0.01, probe=probe, tier="redis")
    transfers = Outage("redis", retry_interval_s=0.01, probe=probe)
    try:
        with caplog.at_level("WARNING", logger="tiercache.tiers.outage"):
            lookups.failed("lookup", ConnectionError("refused"))
            transfers.failed("load", ConnectionError("refused"))
            assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
                "tier redis (lookups): lookup failed (ConnectionError('refused')); answering misses, probing every "
                "0.05s"]
            up.set()
            eventually(lambda: lookups.available and transfers.available, 5, "recovery")
        assert len([r for r in caplog.records if "back after" in r.getMessage()]) == 1
    finally:
        lookups.close()
        transfers.close()
