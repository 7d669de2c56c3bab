"""`tiercache bench engine --preemption`: swap, recompute and auto under memory pressure, side by side.

Each workload is a batch of requests sent at once to a reference engine whose pool holds only part of them
at full length, so the scheduler preempts; one fresh engine (with an L1 to swap to) per mode, the modes of
a workload run back to back, every workload repeated ``reps`` times. Reported per workload and mode: the
medians over the repetitions of TTFT p50/p99 and throughput (prompt + output tokens per second of wall
time), the preemptions and how many were swapped, and whether every run's greedy tokens equal the first
mode's first run.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from tiercache.bench.report import percentile
from tiercache.config import TierCacheConfig
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams


@dataclass(frozen=True, slots=True)
class PressureWorkload:
    name: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int     # leading tokens every prompt shares
    num_blocks: int               # the pool: too small for every request at full length

    def prompts(self, vocab: int, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        prefix = [rng.randrange(3, vocab) for _ in range(self.shared_prefix_tokens)]
        return [prefix + [rng.randrange(3, vocab) for _ in range(self.prompt_tokens - len(prefix))]
                for _ in range(self.requests)]


PRESSURE_WORKLOADS = {
    "long-decode": PressureWorkload("long-decode", 12, 512, 256, 0, 260),
    "short": PressureWorkload("short", 16, 48, 48, 0, 40),
    "shared-prefix": PressureWorkload("shared-prefix", 12, 768, 96, 640, 220),
}


def run_pressure(workload: PressureWorkload, mode: str, offload: TierCacheConfig) -> dict[str, object]:
    cfg = EngineConfig(num_blocks=workload.num_blocks, preemption=mode)
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    with LLMEngine(engine_cfg=cfg, offload=offload) as engine:
        engine.add_request([5] * 64, SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
        engine.run()
        prompts = workload.prompts(engine.model_cfg.vocab_size)
        start = time.perf_counter()
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run()
        wall = time.perf_counter() - start
        stats = engine.stats()["connector"]
        ttft = [s.metrics.ttft or 0.0 for s in seqs]
        tokens = sum(len(p) for p in prompts) + sum(s.num_output_tokens for s in seqs)
        return {"ttft_ms_p50": statistics.median(ttft) * 1e3, "ttft_ms_p99": percentile(ttft, 0.99) * 1e3,
                "throughput_tok_s": tokens / wall, "preemptions": engine.scheduler.num_preemptions,
                "swap_outs": stats["swap_outs"], "outputs": [s.output_token_ids for s in seqs]}


def bench_preemption(workloads: Sequence[PressureWorkload], modes: Sequence[str], offload: TierCacheConfig,
                     reps: int = 3, progress: Callable[[], None] | None = None) -> dict[str, object]:
    results = []
    for workload in workloads:
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(reps):
            for mode in modes:                      # side by side: the machine's load moves all of them
                runs[mode].append(run_pressure(workload, mode, offload))
                if progress:
                    progress()
        reference = runs[modes[0]][0]["outputs"]
        for mode in modes:
            rows = runs[mode]
            results.append({
                "workload": workload.name, "mode": mode,
                **{k: round(statistics.median(r[k] for r in rows), 1)
                   for k in ("ttft_ms_p50", "ttft_ms_p99", "throughput_tok_s")},
                "preemptions": round(statistics.median(r["preemptions"] for r in rows)),
                "swap_outs": round(statistics.median(r["swap_outs"] for r in rows)),
                "outputs_match": all(r["outputs"] == reference for r in rows),
            })
    return {"reps": reps, "workloads": {w.name: asdict(w) for w in workloads}, "results": results}
