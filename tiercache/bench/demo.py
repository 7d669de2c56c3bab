"""`tiercache demo`: a workload on the reference engine, cold (no cache) against warm (L0 + tiers).

Requests are sent one after another, so time to first token is the request's
own prefill latency. Both runs use the same seeded model and prompts; every
request's greedy tokens are compared.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiercache.bench.workloads import WORKLOADS, WorkloadSpec
from tiercache.config import TierCacheConfig
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams
from tiercache.engine.sequence import Sequence


WARMUP_TOKEN = 7  # a control byte that no workload prompt contains


@dataclass(slots=True)
class RunRecord:
    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    l0_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    hit_requests: int = 0
    stats: dict = field(default_factory=dict)


def run_workload(spec: WorkloadSpec, engine_cfg: EngineConfig, offload: TierCacheConfig | None,
                 progress: Callable[[], None] | None = None, metrics_port: int | None = None) -> RunRecord:
    record = RunRecord()
    params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
    with LLMEngine(engine_cfg=engine_cfg, offload=offload, metrics_port=metrics_port) as engine:
        # Warm-up on unrelated tokens: the first forwards after start-up (fresh allocator arenas,
        # just-faulted L1 pages) run up to 3x slower here and would otherwise land in one run only.
        engine.add_request([WARMUP_TOKEN] * 300, params)
        engine.run()

        def generate(prompt: list[int]) -> list[int]:
            seq: Sequence = engine.add_request(prompt, params)
            engine.run()
            m = seq.metrics
            record.ttft_s.append(m.ttft or 0.0)
            record.prompt_tokens += seq.num_prompt_tokens
            record.l0_hit_tokens += m.l0_hit_tokens
            record.tier_hit_tokens += m.external_hit_tokens
            record.hit_requests += bool(m.l0_hit_tokens or m.external_hit_tokens)
            record.output_tokens += seq.num_output_tokens
            if progress:
                progress()
            return seq.output_token_ids

        start = time.perf_counter()
        for _, out in WORKLOADS[spec.name](spec, generate):
            record.outputs.append(out)
        record.wall_s = time.perf_counter() - start
        record.stats = engine.stats()
    return record


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def demo(spec: WorkloadSpec, offload: TierCacheConfig | None, engine_cfg: EngineConfig,
         progress: Callable[[], None] | None = None, metrics_port: int | None = None) -> dict[str, object]:
    cold_cfg = EngineConfig(**{**{f: getattr(engine_cfg, f) for f in engine_cfg.__slots__},
                               "enable_prefix_caching": False})
    cold = run_workload(spec, cold_cfg, None, progress)
    warm = run_workload(spec, engine_cfg, offload, progress, metrics_port)
    hits = warm.l0_hit_tokens + warm.tier_hit_tokens
    cold_p50 = statistics.median(cold.ttft_s) * 1e3
    warm_p50 = statistics.median(warm.ttft_s) * 1e3
    return {
        "workload": spec.name,
        "requests": len(warm.outputs),
        "prompt_tokens": warm.prompt_tokens,
        "ttft_cold_ms_p50": round(cold_p50, 2),
        "ttft_warm_ms_p50": round(warm_p50, 2),
        "ttft_cold_ms_p99": round(_p(cold.ttft_s, 0.99) * 1e3, 2),
        "ttft_warm_ms_p99": round(_p(warm.ttft_s, 0.99) * 1e3, 2),
        "speedup_p50": round(cold_p50 / warm_p50, 2) if warm_p50 else None,
        "token_hit_ratio": round(hits / warm.prompt_tokens, 4),
        "request_hit_ratio": round(warm.hit_requests / len(warm.outputs), 4),
        "prefill_tokens_saved": hits,
        "hit_tokens_by_tier": {"l0": warm.l0_hit_tokens, "tiers": warm.tier_hit_tokens},
        "chunks_loaded_by_tier": {name: t["loaded"] for name, t in
                                  warm.stats.get("connector", {}).get("tiers", {}).items()},
        "outputs_match": cold.outputs == warm.outputs,
        "spec": {f: getattr(spec, f) for f in spec.__slots__},
        "engine": {f: getattr(engine_cfg, f) for f in engine_cfg.__slots__},
        "warm_stats": warm.stats,
    }
