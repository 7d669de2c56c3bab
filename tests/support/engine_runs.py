"""Reference-engine runs shared by the engine tests: configs, prompts, and the baseline check."""
import random

from tiercache.config import TierCacheConfig
from tiercache.engine import LLMEngine, SamplingParams

BLOCK = 16


def offload(capacity="64MiB", **extra) -> TierCacheConfig:
    return TierCacheConfig().replace(keys={"block_size": BLOCK, "chunk_tokens": 64},
                                     cpu={"capacity": capacity, "prefault": False}, **extra)


def shared_prompts(n=16, prefix=200, suffix=24, seed=0, systems=1):
    rng = random.Random(seed)
    heads = [[256] + [rng.randrange(32, 127) for _ in range(prefix)] for _ in range(systems)]
    return [heads[i % systems] + [rng.randrange(32, 127) for _ in range(suffix)] for i in range(n)]


def run_sequential(engine: LLMEngine, prompts, max_tokens=6):
    """One request at a time: each later request can hit what earlier ones cached."""
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        engine.run()
    return seqs


def assert_back_to_baseline(engine: LLMEngine):
    stats = engine.pool.stats()
    assert stats.used == 0 and stats.pinned == 0, stats
    assert not engine.scheduler.held and not engine.blocks.tables
    if engine.connector is not None:
        manager = engine.connector.scheduler.manager
        assert manager.num_in_flight == 0
        for tier in manager.tiers:
            if tier.indexed:                  # a remote tier keeps no pins (its server does the counting)
                assert all(e.pins == 0 and e.ready for e in tier.entries.values())
