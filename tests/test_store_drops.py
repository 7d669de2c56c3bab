"""Every store an engine gives up on is counted with its reason, and each tier's store counts add up.

Real stores made to fail at their door: a `tiercache serve` whose whole in-flight budget another connection
holds (every value it is sent is answered busy), a redis-server stopped with SIGSTOP (a store waits out its
deadline), and a link whose queue of stores is full. Each store planned for a tier ends stored, rejected,
dropped by its reason, or failed; once none is in flight, ``store_planned`` is their sum — in `stats()` and in
the engine's Prometheus metrics.
"""
import os
import signal

import pytest

from tests.conftest import CacheServerProcess, Stack
from tests.support.stack_ops import put
from tiercache.index.tier_index import DROP_REASONS


def dropped(tier: dict) -> int:
    return sum(tier[f"store_dropped_{reason}"] for reason in DROP_REASONS)


def assert_stores_add_up(tiers: dict[str, dict]) -> None:
    for name, t in tiers.items():
        assert t["store_planned"] == t["stored"] + t["store_rejected"] + dropped(t) + t["store_failed"], (name, t)


def test_an_engine_storing_through_a_busy_server_counts_every_store_as_dropped_busy(tmp_path):
    """The server's in-flight budget is held by a connection that keeps sending a byte at a time, so it is
    never taken back: every chunk the engine writes through is answered busy, sent again a few times, and
    given up. Those stores are counted — as busy drops, not errors — in the engine's stats and in its
    Prometheus endpoint, the tier stays up, and every tier's stores add up."""
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    from tests.support.engine_runs import offload, run_sequential, shared_prompts
    from tests.support.grpc_clients import BudgetHolder
    from tests.test_metrics import scrape
    from tiercache.engine import EngineConfig, LLMEngine

    server = CacheServerProcess(tmp_path, "--max-value", "4MiB", "--max-inflight", "4MiB", "--read-timeout", "30")
    holder = BudgetHolder(server, 4 << 20)
    cfg = offload(grpc={"enabled": True, "address": server.address, "timeout": 5.0})
    try:
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg, metrics_port=0) as engine:
            run_sequential(engine, shared_prompts(n=2))
            engine.connector.drain()
            tiers = engine.stats()["connector"]["tiers"]
            m = scrape(engine.metrics_port)
        remote = tiers["grpc"]
        assert remote["store_planned"] >= 3                          # the shared prefix's chunks at least
        assert remote["store_dropped_busy"] == remote["store_planned"] and remote["stored"] == 0
        assert remote["errors"] == 0 and remote["available"] == 1
        assert_stores_add_up(tiers)
        assert m['tiercache_tier_store_dropped_total{reason="busy",tier="grpc"}'] == remote["store_planned"]
        assert m['tiercache_tier_store_planned_total{tier="grpc"}'] == remote["store_planned"]
        assert m['tiercache_tier_store_failed_total{tier="grpc"}'] == 0
    finally:
        holder.release()
        server.stop()


def test_stores_past_their_deadline_or_over_a_full_queue_are_dropped_by_reason(redis_server):
    """Redis stops answering (SIGSTOP). Three requests' chunks are stored into L1 and their write-through
    copies offered to the network link at once; the link runs one store at a time and queues at most one
    byte of stores, so one or both of the later copies are dropped at the queue. The first waits out its
    deadline (the rank's tier goes down: a copy that reaches it after that fails as unavailable). A fourth
    store into L1 is cancelled (its request's load failed). Each is counted under its reason, and the counts
    add up."""
    s = Stack(num_blocks=64, cpu_chunks=8,
              redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2, "timeout": 0.5},
              transfer={"host_network_max_in_flight": 1, "host_network_max_queued_stores": 1})
    try:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        for i in range(3):
            put(s, f"r{i}", seed=i + 1)                 # two chunks each into L1; their copies wait to go down
        s.offload.drain()
        redis = s.lower("redis").stats()
        assert redis["store_planned"] == 6 and redis["stored"] == 0
        assert redis["store_dropped_deadline"] == 2                 # the first copy: past the deadline
        assert redis["store_dropped_queue"] in (2, 4)               # the second, the third, or both
        assert redis["store_failed"] == 4 - redis["store_dropped_queue"]
        assert redis["errors"] >= redis["store_failed"]             # a failed store is an error; so is a lookup
                                                                    # probe that timed out against the stopped server
        hashes = s.hasher.hash_blocks(list(range(5000, 5000 + 32)))
        s.blocks.allocate("c", 32)
        s.manager.cancel(s.manager.plan_store(hashes, s.blocks.block_ids("c")))
        s.blocks.free("c")
        cpu = s.cpu.stats()
        assert cpu["store_dropped_cancelled"] == 2 and cpu["stored"] == 6 and cpu["errors"] == 0
        assert_stores_add_up(s.manager.stats()["tiers"])
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        s.close()
