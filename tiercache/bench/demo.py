"""`tiercache demo`: a workload on the reference engine, cold (no cache) against warm (L0 + tiers).

Requests are sent one after another, so time to first token is the request's
own prefill latency. Both runs use the same seeded model and prompts; every
request's greedy tokens are compared. Each warm request is put down to where
its prefix came from — nowhere (cold), the engine's own L0, L1, the disk, a
remote tier — by the slowest tier whose counters it moved, and the report gives,
per source, the requests it served, their time to first token and the hit
tokens, chunks and bytes they loaded; the tiers' own totals are
``chunks_loaded_by_tier``.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiercache.bench.report import percentile
from tiercache.bench.workloads import WORKLOADS, WorkloadSpec
from tiercache.config import TierCacheConfig
from tiercache.contracts.plan import DEVICE
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams
from tiercache.engine.config import ModelConfig
from tiercache.engine.sequence import Sequence

WARMUP_TOKEN = 7  # a control byte that no workload prompt contains
SOURCES = ("cold", "L0", "cpu", "disk", "redis", "grpc")   # where a request's prefix came from, slowest last
L1 = "cpu"    # every chunk a request loads into L0 comes from here, whichever tier it was promoted from


@dataclass(slots=True)
class RunRecord:
    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)     # per request: where its prefix came from
    chunks_into_l0: list[int] = field(default_factory=list)   # per request: chunks it loaded from L1 into L0
    prompt_tokens: int = 0
    l0_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    hit_requests: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)   # tier → tokens of requests it served
    stats: dict = field(default_factory=dict)


def _loaded(engine: LLMEngine) -> dict[str, int]:
    return {name: t["loaded"] for name, t in engine.stats().get("connector", {}).get("tiers", {}).items()}


def _source(before: dict[str, int], after: dict[str, int], seq: Sequence) -> str:
    """The slowest tier that served the request's prefix (its chunks were promoted from there), else L0 or cold."""
    served = [name for name in SOURCES[2:] if after.get(name, 0) > before.get(name, 0)]
    if served:
        return served[-1]
    return "L0" if seq.metrics.l0_hit_tokens else "cold"


def run_workload(spec: WorkloadSpec, engine_cfg: EngineConfig, offload: TierCacheConfig | None,
                 progress: Callable[[], None] | None = None, metrics_port: int | None = None,
                 engine: LLMEngine | None = None, drain: bool = False, model_cfg: ModelConfig | None = None
                 ) -> RunRecord:
    """Run ``spec`` on a new engine (or on ``engine``, which is closed afterwards); with ``drain``, the
    transfers still owed (write-through stores) run to their end before the stats are read."""
    record = RunRecord()
    params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
    with engine or LLMEngine(model_cfg=model_cfg, engine_cfg=engine_cfg, offload=offload,
                             metrics_port=metrics_port) as engine:
        # Warm-up on unrelated tokens: the first forwards after start-up (fresh allocator arenas,
        # just-faulted L1 pages) run slower than the rest and would otherwise land in one run only.
        engine.add_request([WARMUP_TOKEN] * 300, params)
        engine.run()

        def generate(prompt: list[int]) -> list[int]:
            before = _loaded(engine)
            seq: Sequence = engine.add_request(prompt, params)
            engine.run()
            m = seq.metrics
            after = _loaded(engine)
            source = _source(before, after, seq)
            record.sources.append(source)
            record.chunks_into_l0.append(after.get(L1, 0) - before.get(L1, 0))
            record.ttft_s.append(m.ttft or 0.0)
            record.prompt_tokens += seq.num_prompt_tokens
            record.l0_hit_tokens += m.l0_hit_tokens
            record.tier_hit_tokens += m.external_hit_tokens
            if m.external_hit_tokens:
                record.tier_hits[source] = record.tier_hits.get(source, 0) + m.external_hit_tokens
            record.hit_requests += bool(m.l0_hit_tokens or m.external_hit_tokens)
            record.output_tokens += seq.num_output_tokens
            if progress:
                progress()
            return seq.output_token_ids

        start = time.perf_counter()
        for _, out in WORKLOADS[spec.name](spec, generate):
            record.outputs.append(out)
        record.wall_s = time.perf_counter() - start
        if drain and engine.connector is not None:
            engine.connector.drain()
        record.stats = engine.stats()
    return record


def _load_gbps(transfers: dict[str, dict], tier: str) -> float | None:
    """GB/s while copying of ``tier``'s loads: its chunks going up to the tier above (L1 → L0, lower → L1),
    summed over links (and ranks)."""
    moved = seconds = 0.0
    for link in transfers.values():
        for route, r in link.get("routes", {}).items():
            src, dst = route.split("→")
            if src == tier and dst in (DEVICE, "cpu") and r["gbps"]:
                moved += r["bytes"]
                seconds += r["bytes"] / (r["gbps"] * 1e9)
    return round(moved / seconds / 1e9, 3) if seconds else None


def _by_tier(warm: RunRecord, chunk_bytes: int) -> dict[str, dict[str, object]]:
    """Per source, the requests whose prefix came from there: how many, their time to first token, and the hit
    tokens, chunks and bytes they loaded into L0 (a request served from the disk loads the chunks L1 still held
    too: all count in its row), beside the rate that tier loads at."""
    tiers = warm.stats.get("connector", {}).get("tiers", {})
    transfers = warm.stats.get("connector", {}).get("transfers", {})
    out = {}
    for source in SOURCES:
        ttfts = [t for t, s in zip(warm.ttft_s, warm.sources) if s == source]
        row: dict[str, object] = {"requests": len(ttfts),
                                  "ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 2) if ttfts else None}
        if source in tiers:
            loaded = sum(n for n, s in zip(warm.chunks_into_l0, warm.sources) if s == source)
            row.update({"hit_tokens": warm.tier_hits.get(source, 0), "chunks_loaded": loaded,
                        "load_gbps": _load_gbps(transfers, source)})
            if chunk_bytes:     # chunks of one size (a hybrid model's resume points are of another)
                row["bytes_loaded"] = loaded * chunk_bytes
        out[source] = row
    return out


def kv_groups_table(engine: LLMEngine) -> list[dict[str, object]]:
    """What the engine's connector stores per KV-cache group (a hybrid model's; empty for one group of full
    attention): its chunk groups' bytes per token, its resume-point groups' bytes per resume point."""
    manager = engine.connector.scheduler.manager if engine.connector is not None else None
    layout = manager.groups if manager is not None else None
    if layout is None:
        return []
    rows = []
    for group in layout.groups:
        need = layout.resume_blocks(group)
        row = {"kind": group.kind, "pages_per_block": group.num_layers, "window_tokens": group.window_tokens}
        if need is None:
            row["bytes_per_token"] = group.num_layers * group.page_bytes // layout.block_size
        else:
            row["bytes_per_resume_point"] = group.num_layers * need * group.page_bytes
        rows.append(row)
    return rows


def demo(spec: WorkloadSpec, offload: TierCacheConfig | None, engine_cfg: EngineConfig,
         progress: Callable[[], None] | None = None, metrics_port: int | None = None,
         started: Callable[[int | None], None] | None = None, model_cfg: ModelConfig | None = None
         ) -> dict[str, object]:
    """Cold, then warm; ``started`` is called once the cached engine and its whole offload stack are built —
    first, so a config that cannot work fails before any request runs — with the port its metrics are served
    on (None: not served)."""
    warm_engine = LLMEngine(model_cfg=model_cfg, engine_cfg=engine_cfg, offload=offload, metrics_port=metrics_port)
    try:
        if started is not None:
            started(warm_engine.metrics_port)
        cold_cfg = EngineConfig(**{**{f: getattr(engine_cfg, f) for f in engine_cfg.__slots__},
                                   "enable_prefix_caching": False})
        cold = run_workload(spec, cold_cfg, None, progress, model_cfg=model_cfg)
    except BaseException:
        warm_engine.close()
        raise
    groups = kv_groups_table(warm_engine)
    warm = run_workload(spec, engine_cfg, offload, progress, engine=warm_engine)
    hits = warm.l0_hit_tokens + warm.tier_hit_tokens
    cold_p50 = statistics.median(cold.ttft_s) * 1e3
    warm_p50 = statistics.median(warm.ttft_s) * 1e3
    chunk_tokens = offload.keys.chunk_tokens if offload else 0
    chunk_bytes = warm_engine.kv.block_bytes * (chunk_tokens // engine_cfg.block_size) if offload and not groups else 0
    return {
        "workload": spec.name,
        "requests": len(warm.outputs),
        "prompt_tokens": warm.prompt_tokens,
        "ttft_cold_ms_p50": round(cold_p50, 2),
        "ttft_warm_ms_p50": round(warm_p50, 2),
        "ttft_cold_ms_p99": round(percentile(cold.ttft_s, 0.99) * 1e3, 2),
        "ttft_warm_ms_p99": round(percentile(warm.ttft_s, 0.99) * 1e3, 2),
        "speedup_p50": round(cold_p50 / warm_p50, 2) if warm_p50 else None,
        "token_hit_ratio": round(hits / warm.prompt_tokens, 4),
        "request_hit_ratio": round(warm.hit_requests / len(warm.outputs), 4),
        "prefill_tokens_saved": hits,
        "hit_tokens_by_tier": {"l0": warm.l0_hit_tokens, "tiers": warm.tier_hit_tokens},
        "chunks_loaded_by_tier": {name: t["loaded"] for name, t in
                                  warm.stats.get("connector", {}).get("tiers", {}).items()},
        "by_source": _by_tier(warm, chunk_bytes),
        "request_sources": warm.sources,
        "links": {name: {"bytes": link["bytes"], "gbps": round(link["gbps"], 3)}
                  for name, link in warm.stats.get("connector", {}).get("transfers", {}).items()},
        "outputs_match": cold.outputs == warm.outputs,
        "kv_groups": groups,
        "spec": {f: getattr(spec, f) for f in spec.__slots__},
        "engine": {f: getattr(engine_cfg, f) for f in engine_cfg.__slots__},
        "warm_stats": warm.stats,
    }
