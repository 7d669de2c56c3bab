"""The reference engine with and without tiercache: same greedy tokens, matching logits, no leaks."""

import pytest
import torch

from tests.support.engine_runs import (  # noqa: E402
    assert_back_to_baseline,
    offload,
    run_sequential,
    shared_prompts,
)
from tiercache.bench.workloads import WorkloadSpec, multi_turn
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def reference_outputs():
    """Greedy tokens with every cache off: no tiers and no L0 prefix caching."""
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        return {
            tuple(p): s.output_token_ids for p, s in zip(shared_prompts(), run_sequential(engine, shared_prompts()))
        }


def test_shared_prefix_hits_in_l0_give_identical_tokens(reference_outputs):
    with LLMEngine(engine_cfg=EngineConfig(), offload=offload()) as engine:
        seqs = run_sequential(engine, shared_prompts())
        assert [s.output_token_ids for s in seqs] == [reference_outputs[tuple(p)] for p in shared_prompts()]
        assert sum(s.metrics.l0_hit_tokens for s in seqs[1:]) >= 15 * 192   # every later request hit the prefix
        assert engine.stats()["engine"]["load_seconds"] == 0                 # nothing loaded from a tier
        assert_back_to_baseline(engine)


@pytest.mark.parametrize("layerwise, inline", [(True, "off"), (False, "off"), (False, "on")])
def test_hits_from_l1_alone_give_identical_tokens(reference_outputs, layerwise, inline):
    """Layerwise loads on transfer threads, whole loads on transfer threads, and copies inline."""
    cfg = offload(transfer={"layerwise": layerwise, "inline_host_copies": inline})
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        seqs = run_sequential(engine, shared_prompts())
        assert [s.output_token_ids for s in seqs] == [reference_outputs[tuple(p)] for p in shared_prompts()]
        # The 201-token system prompt spans 3 whole 64-token chunks: every later request loads 192 tokens.
        assert [s.metrics.external_hit_tokens for s in seqs] == [0] + [192] * 15
        stats = engine.stats()["connector"]
        assert stats["loaded_tokens"] == 15 * 192 and stats["failed_loads"] == 0
        steps = engine.stats()["engine"]           # the steps' time loading (or waiting for loads): part of their time
        assert 0 < steps["load_seconds"] < steps["busy_seconds"]
        assert_back_to_baseline(engine)


def test_l1_serves_what_a_small_l0_evicted():
    """Two system prompts alternate through a pool too small for both: heads hit in L0, the rest in L1."""
    prompts = shared_prompts(n=16, prefix=240, suffix=16, seed=3, systems=2)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        expect = [s.output_token_ids for s in run_sequential(engine, prompts)]
    with LLMEngine(engine_cfg=EngineConfig(num_blocks=24), offload=offload()) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == expect
        assert sum(s.metrics.l0_hit_tokens for s in seqs) > 0
        assert sum(s.metrics.external_hit_tokens for s in seqs) > 0
        assert_back_to_baseline(engine)


def test_multi_turn_histories_give_identical_tokens():
    spec = WorkloadSpec("multi-turn", requests=16, prefix_tokens=96, suffix_tokens=20, output_tokens=6, turns=4)

    def collect(engine):
        def generate(prompt):
            (seq,) = run_sequential(engine, [prompt])
            return seq.output_token_ids
        return [out for _, out in multi_turn(spec, generate)]

    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        expect = collect(engine)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload()) as engine:
        got = collect(engine)
        assert got == expect and len(got) == 16
        assert engine.stats()["connector"]["hit_requests"] >= 12   # every turn after the first hits its history
        assert_back_to_baseline(engine)


@pytest.mark.parametrize("continues", [True, False])
def test_a_conversation_that_continues_keeps_its_turn_in_l1_past_one_off_requests(continues):
    """L1 of 8 chunks under ``lfu-da-state``; a conversation's first turn (4 chunks), then two one-off requests
    (4 each), then its second turn. Said to continue (`kv_transfer_params.continues` through the API), the
    first turn's chunks outrank the one-offs' and the second turn loads all of them; without the word, a
    finished turn's chunks were asked for once, like the one-offs', and go first."""
    import random

    rng = random.Random(5)

    def text(n):
        return [rng.randrange(32, 127) for _ in range(n)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    turn = [256, *text(255)]
    one_offs = [[256, *text(255)] for _ in range(2)]
    cfg = offload("1MiB").replace(cpu={"eviction": "lfu-da-state"})
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        assert engine.connector.scheduler.manager.l1.slots.num_slots == 8
        first = engine.add_request(turn, params, continues=continues)
        engine.run()
        for prompt in one_offs:
            engine.add_request(prompt, params)
            engine.run()
        second = engine.add_request(turn + first.output_token_ids + text(40), params, continues=continues)
        engine.run()
        assert (second.metrics.external_hit_tokens == 256) is continues
        assert_back_to_baseline(engine)


def test_logits_on_the_hit_path_match_a_full_recompute():
    prompts = shared_prompts(n=2, prefix=300, suffix=10, seed=5)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), record_logits=True) as engine:
        full = run_sequential(engine, prompts[1:])[0]
    with LLMEngine(
        engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload(), record_logits=True
    ) as engine:
        _, hit = run_sequential(engine, prompts)
    assert hit.metrics.external_hit_tokens == 256
    assert len(hit.logits) == len(full.logits) == 6
    for a, b in zip(hit.logits, full.logits):
        assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("inline", ["on", "off"])
def test_preemption_preserves_outputs(mode, inline):
    """Eight requests decode together in a pool that cannot hold them all at full length."""
    prompts = shared_prompts(n=8, prefix=40, suffix=30, seed=7, systems=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run()
        expect = [s.output_token_ids for s in seqs]
    cfg = EngineConfig(num_blocks=30, preemption=mode)
    with LLMEngine(engine_cfg=cfg, offload=offload(transfer={"inline_host_copies": inline})) as engine:
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run()
        assert [s.output_token_ids for s in seqs] == expect
        assert engine.scheduler.num_preemptions > 0
        stats = engine.stats()["connector"]
        if mode == "swap":
            assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
        elif mode == "recompute":
            assert stats["swap_outs"] == 0
        else:                                                       # each preemption decided by its cost
            policy = engine.scheduler.preemption
            assert policy.swapped + policy.recomputed == engine.scheduler.num_preemptions
            assert stats["swap_outs"] <= policy.swapped             # a swap L1 has no room for is recomputed
        assert not engine.connector.scheduler._swapped              # every swap copy was dropped once spent
        assert_back_to_baseline(engine)


def test_recompute_preemption_without_tiers():
    prompts = shared_prompts(n=6, prefix=40, suffix=30, seed=8, systems=6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLMEngine(engine_cfg=EngineConfig()) as engine:
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run()
        expect = [s.output_token_ids for s in seqs]
    with LLMEngine(engine_cfg=EngineConfig(num_blocks=24)) as engine:
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run()
        assert [s.output_token_ids for s in seqs] == expect and engine.scheduler.num_preemptions > 0
        assert_back_to_baseline(engine)


@pytest.mark.parametrize("inline", ["on", "off"])
def test_a_failed_load_is_recomputed_not_served(monkeypatch, reference_outputs, inline):
    """Fault injected at the transfer boundary: the load fails, the request recomputes, output unchanged."""
    cfg = offload(transfer={"inline_host_copies": inline})
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        prompts = shared_prompts()
        run_sequential(engine, prompts[:1])
        handlers = engine.connector.workers[0].stack.engine._handlers
        real = handlers[("cpu", "device")]
        calls = []

        def flaky(plan, progress=None):
            calls.append(plan.job_id)
            if len(calls) == 1:
                raise OSError("injected load failure")
            real(plan, progress)

        monkeypatch.setitem(handlers, ("cpu", "device"), flaky)
        (seq,) = run_sequential(engine, prompts[1:2])
        assert seq.output_token_ids == reference_outputs[tuple(prompts[1])]
        stats = engine.stats()["connector"]
        assert stats["failed_loads"] == 1 and stats["loaded_tokens"] == 192   # the retry loaded it
        assert_back_to_baseline(engine)


def test_bad_requests_are_refused_clearly():
    with LLMEngine() as engine:
        with pytest.raises(ValueError, match="empty prompt"):
            engine.add_request([])
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request([1, 2, 100_000])
        with pytest.raises(ValueError, match="blocks"):
            engine.add_request([1] * 20_000, SamplingParams(max_tokens=1))
    from tiercache.errors import ConfigError
    with pytest.raises(ConfigError, match="keys.block_size"):
        LLMEngine(engine_cfg=EngineConfig(block_size=32), offload=offload())


def test_chunked_prefill_under_a_small_token_budget(reference_outputs):
    """A 48-token budget splits a 225-token prompt into five prefill steps; tokens do not change.

    Later requests are admitted while earlier ones are still prefilling and load whatever chunks have
    reached L1 by then (chunks are stored as they complete)."""
    prompts = shared_prompts()[:4]
    cfg = EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=48)
    with LLMEngine(engine_cfg=cfg, offload=offload()) as engine:
        seqs = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        assert [s.output_token_ids for s in seqs] == [reference_outputs[tuple(p)] for p in prompts]
        assert steps >= -(-225 // 48) + 5            # the first prompt alone takes five prefill steps
        hits = [s.metrics.external_hit_tokens for s in seqs]
        assert hits[0] == 0 and all(h % 64 == 0 and h > 0 for h in hits[1:]) and hits[-1] == 192
        assert_back_to_baseline(engine)


def test_bfloat16_kv_round_trips_through_l1():
    from tiercache.engine import ModelConfig
    cfg = ModelConfig(dtype="bfloat16")
    prompts = shared_prompts(n=3, prefix=150, suffix=10, seed=9)
    with LLMEngine(model_cfg=cfg, engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        expect = [s.output_token_ids for s in run_sequential(engine, prompts)]
    with LLMEngine(model_cfg=cfg, engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload()) as engine:
        seqs = run_sequential(engine, prompts)
        assert engine.kv.kv.dtype == torch.bfloat16
        assert [s.output_token_ids for s in seqs] == expect
        assert seqs[2].metrics.external_hit_tokens == 128


@pytest.mark.parametrize("ctx,new,kv_heads,heads,tile_bytes", [
    (300, 300, 2, 8, 8 << 20),       # a fresh prefill
    (700, 130, 2, 8, 8 << 20),       # a turn after a cached history
    (700, 130, 2, 8, 40_000),        # ... in tiles of a few rows
    (513, 1, 4, 4, 8 << 20),         # a decode step, one query head per KV head
])
def test_attention_matches_a_softmax_over_repeated_keys(monkeypatch, ctx, new, kv_heads, heads, tile_bytes):
    from tiercache.engine import model
    monkeypatch.setattr(model, "ATTN_TILE_BYTES", tile_bytes)
    g = torch.Generator().manual_seed(ctx + new)
    q = torch.randn(new, heads, 32, generator=g)
    keys, values = torch.randn(2, ctx, kv_heads, 32, generator=g)
    out = model._attend(q, keys, values)
    group = heads // kv_heads
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)          # [heads, ctx, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / 32 ** 0.5        # [heads, new, ctx]
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - new, ctx)[:, None]
    expect = (torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v).transpose(0, 1)
    assert torch.allclose(out.double(), expect, atol=1e-5), (out.double() - expect).abs().max()
