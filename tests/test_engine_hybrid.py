"""The reference engine's hybrid model (`HYBRID_MODEL`: sliding-window, linear-attention and full-attention
layers) with and without tiercache: same greedy tokens with hits from L0, L1, disk, Redis and the cache server,
where every hit loads each group's part — the full layer's blocks, the window behind the boundary, the
recurrent state at it."""
import pytest
import torch

from tests.support.engine_runs import assert_back_to_baseline, offload, run_sequential, shared_prompts
from tiercache.engine import EngineConfig, LLMEngine
from tiercache.engine.config import HYBRID_MODEL
from tiercache.engine.model import _attend, _recurrence
from tiercache.errors import ConfigError


@pytest.fixture(scope="module")
def hybrid_outputs():
    """Greedy tokens with every cache off."""
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        return [s.output_token_ids for s in run_sequential(engine, shared_prompts(n=6))]


def test_hits_from_l0_and_l1_give_identical_tokens(hybrid_outputs):
    """The 201-token prefix's three whole 64-token chunks come from L1, each with the sliding layers' window
    and the linear layer's state at the third chunk's end; and from the engine's own pool."""
    prompts = shared_prompts(n=6)
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(enable_prefix_caching=False),
                   offload=offload()) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == hybrid_outputs
        assert [s.metrics.external_hit_tokens for s in seqs] == [0] + [192] * 5
        tiers = engine.stats()["connector"]["tiers"]
        assert tiers["cpu"]["stored"] == 3 + 1            # three chunks and the resume point at the third's end
        assert_back_to_baseline(engine)
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(), offload=offload()) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == hybrid_outputs
        assert all(s.metrics.l0_hit_tokens == 192 for s in seqs[1:])


def test_hits_from_disk_redis_and_the_cache_server_give_identical_tokens(tmp_path, redis_server, cache_server,
                                                                         hybrid_outputs):
    """A first engine writes through to every tier; a fresh engine for each finds the prefix in it alone."""
    import redis

    prompts = shared_prompts(n=6)

    def cfg(disk_path, **tiers):
        return offload(disk={"enabled": True, "path": str(disk_path), "write_mode": "write-through"}, **tiers)

    shared = {"redis": {"enabled": True, "url": redis_server.url},
              "grpc": {"enabled": True, "address": cache_server.address}}
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(enable_prefix_caching=False),
                   offload=cfg(tmp_path / "a", **shared)) as first:
        assert [s.output_token_ids for s in run_sequential(first, prompts[:1])] == hybrid_outputs[:1]
    for i, (disk_path, source) in enumerate(((tmp_path / "a", "disk"), (tmp_path / "b", "redis"),
                                             (tmp_path / "c", "grpc")), start=1):
        if source == "grpc":
            redis.Redis.from_url(redis_server.url).flushall()
        with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(enable_prefix_caching=False),
                       offload=cfg(disk_path, **shared)) as again:
            seqs = run_sequential(again, prompts[i:i + 1])
            assert seqs[0].output_token_ids == hybrid_outputs[i] and seqs[0].metrics.external_hit_tokens == 192
            tiers = again.stats()["connector"]["tiers"]
            assert {t for t in ("disk", "redis", "grpc") if tiers[t]["loaded"]} == {source}


def test_a_hybrid_model_refuses_what_it_cannot_do_with_a_connector():
    with pytest.raises(ConfigError, match="engine.preemption"):
        LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(preemption="swap"), offload=offload())
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size"):
        LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=EngineConfig(tensor_parallel_size=2))


@pytest.mark.parametrize("ctx, new, window", [(40, 40, 8), (100, 1, 16), (70, 30, 64), (10, 10, 48)])
def test_sliding_window_attention_is_a_softmax_over_the_window(ctx, new, window):
    torch.manual_seed(ctx + new + window)
    q, k, v = torch.randn(new, 4, 8), torch.randn(ctx, 2, 8), torch.randn(ctx, 2, 8)
    out = _attend(q, k, v, window)
    for i in range(new):
        pos = ctx - new + i
        lo = max(0, pos - window + 1)
        for h in range(4):
            scores = (k[lo:pos + 1, h // 2] @ q[i, h]) * 8 ** -0.5
            expect = torch.softmax(scores, 0) @ v[lo:pos + 1, h // 2]
            assert torch.allclose(out[i, h], expect, atol=1e-5)


def test_the_recurrence_matches_its_definition_step_by_step():
    torch.manual_seed(0)
    z, u, h = torch.randn(16, 5) * 4, torch.randn(16, 5), torch.randn(5)
    got = _recurrence(h, z, u)
    for t in range(16):
        g = torch.sigmoid(z[t])
        h = g * h + (1 - g) * u[t]
        assert torch.allclose(got[t], h, atol=1e-5)
