"""The Prometheus endpoint, scraped over HTTP on loopback while a cached engine runs."""
import re
import urllib.request

import pytest

from tests.support.engine_runs import offload, run_sequential, shared_prompts
from tiercache.engine import EngineConfig, LLMEngine


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


def test_metrics_endpoint_reports_tiers_links_blocks_and_connector():
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload(), metrics_port=0) as engine:
        port = engine.metrics_port
        run_sequential(engine, shared_prompts(n=4))
        m = scrape(port)
        assert m['tiercache_tier_hit_keys_total{tier="cpu"}'] == 9          # 3 chunks × 3 later requests
        assert m['tiercache_tier_stored_total{tier="cpu"}'] >= 3
        assert m['tiercache_tier_capacity_bytes{tier="cpu"}'] == 64 << 20
        assert m['tiercache_tier_available{tier="cpu"}'] == 1 and m['tiercache_tier_outages_total{tier="cpu"}'] == 0
        assert m['tiercache_connector_loaded_tokens_total'] == 3 * 192      # prefill tokens saved
        assert m['tiercache_link_bytes_total{link="device_host"}'] > 0
        assert m['tiercache_link_dropped_total{link="device_host"}'] == 0
        assert m['tiercache_blocks{state="used"}'] == 0
        assert m['tiercache_blocks{state="total"}'] == engine.engine_cfg.num_blocks
        assert 0 < m["tiercache_connector_token_hit_ratio"] < 1
    with pytest.raises(OSError):   # closed with the engine: the port no longer answers
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_two_engines_export_side_by_side():
    with LLMEngine(offload=offload(), metrics_port=0) as a, LLMEngine(offload=offload(), metrics_port=0) as b:
        run_sequential(a, shared_prompts(n=2))
        assert scrape(a.metrics_port)['tiercache_tier_stored_total{tier="cpu"}'] > 0
        assert scrape(b.metrics_port)['tiercache_tier_stored_total{tier="cpu"}'] == 0


def test_a_thread_s_cpu_seconds_are_exported_under_its_name_without_its_number():
    """`tiercache_thread_cpu_seconds{thread}`: a pool's numbered threads add up under one name, and the CPU a
    thread burns shows under it (the engine's thread beside its transfer threads is what it is for)."""
    import threading
    import time

    done = threading.Event()

    def burn() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            sum(range(1000))
        done.wait(30)
    burners = [threading.Thread(target=burn, name=f"test-burner-{i}", daemon=True) for i in range(2)]
    for t in burners:
        t.start()
    try:
        with LLMEngine(offload=offload(), metrics_port=0) as engine:
            def burned() -> float:
                return scrape(engine.metrics_port).get('tiercache_thread_cpu_seconds{thread="test-burner"}', 0.0)
            deadline = time.monotonic() + 60
            while burned() < 0.5:            # two threads' 0.3 s each, however busy the machine's cores are
                assert time.monotonic() < deadline, scrape(engine.metrics_port)
                time.sleep(0.05)
            names = [k for k in scrape(engine.metrics_port) if k.startswith("tiercache_thread_cpu_seconds")]
            assert not any(re.search(r"test-burner-\d", k) for k in names)
    finally:
        done.set()
        for t in burners:
            t.join(30)
