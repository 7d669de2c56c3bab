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
