"""Repeated warnings: the first is logged, then one per window, each saying how many were held back."""
import logging

from tiercache.log_limits import ThrottledLog


def test_one_line_per_kind_and_window_with_a_count_of_the_rest(caplog):
    now = [0.0]
    log = ThrottledLog(logging.getLogger("tiercache.test"), window_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tiercache.test"):
        assert log.warning("write disk", "writing chunk %d failed", 1)
        for i in range(2, 50):
            now[0] += 0.1
            assert not log.warning("write disk", "writing chunk %d failed", i)
        assert log.warning("read disk", "reading chunk %d failed", 7)     # another kind has its own window
        now[0] = 10.5
        assert log.warning("write disk", "writing chunk %d failed", 50)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["writing chunk 1 failed", "reading chunk 7 failed",
                        "writing chunk 50 failed (and 48 more like it in the last 10 s)"]
