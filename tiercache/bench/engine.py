"""`tiercache bench engine`: reference-engine workloads across tier setups, with reports.

For each workload, a baseline run with every cache off, then one run per tier
setup (``none`` = L0 prefix caching only, ``cpu``, ``cpu+disk``, and with a
remote tier: ``cpu+redis`` / ``cpu+disk+redis`` against ``redis.url``,
``cpu+grpc`` / ``cpu+disk+grpc`` against a `tiercache serve` the benchmark
starts), requests sent one after another. Every run starts empty: its own L2
directory, and its own namespace (a fresh tenant salt) on the shared servers.
Reported per run: TTFT p50/p99, throughput (prompt +
output tokens per second of wall time), request and token hit ratios, prefill
tokens saved, hits split by where they came from, and whether every request's
greedy tokens matched the baseline. The ``no-reuse`` workload measures what
storing costs when nothing can hit.
"""
from __future__ import annotations

import statistics
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from tiercache.bench.demo import RunRecord, run_workload
from tiercache.bench.report import percentile
from tiercache.bench.workloads import WorkloadSpec
from tiercache.config import TierCacheConfig
from tiercache.engine import EngineConfig

SETUPS = ("none", "cpu", "cpu+disk", "cpu+redis", "cpu+disk+redis", "cpu+grpc", "cpu+disk+grpc")


def _offload(setup: str, base: TierCacheConfig, disk_dir: str, grpc_address: str | None) -> TierCacheConfig | None:
    if setup == "none":
        return None
    tiers = setup.split("+")
    disk = {"enabled": "disk" in tiers}
    if "disk" in tiers:
        disk["path"] = disk_dir
    grpc = {"enabled": "grpc" in tiers}
    if grpc_address:
        grpc["address"] = grpc_address
    return base.replace(disk=disk, redis={"enabled": "redis" in tiers}, grpc=grpc,
                        keys={"tenant_salt": f"bench-{uuid.uuid4().hex}"})


def _row(spec: WorkloadSpec, setup: str, run: RunRecord, baseline: RunRecord) -> dict[str, object]:
    tiers = run.stats.get("connector", {}).get("tiers", {})
    hits = run.l0_hit_tokens + run.tier_hit_tokens
    tokens = run.prompt_tokens + run.output_tokens
    return {
        "workload": spec.name, "setup": setup, "requests": len(run.outputs),
        "ttft_ms_p50": round(statistics.median(run.ttft_s) * 1e3, 2),
        "ttft_ms_p99": round(percentile(run.ttft_s, 0.99) * 1e3, 2),
        "throughput_tok_s": round(tokens / run.wall_s, 1) if run.wall_s else 0.0,
        "token_hit_ratio": round(hits / run.prompt_tokens, 4) if run.prompt_tokens else 0.0,
        "request_hit_ratio": round(run.hit_requests / len(run.outputs), 4),
        "prefill_tokens_saved": hits,
        "hit_tokens": {"l0": run.l0_hit_tokens, "tiers": run.tier_hit_tokens},
        "chunks_loaded_by_tier": {name: t["loaded"] for name, t in tiers.items()},
        "outputs_match_baseline": run.outputs == baseline.outputs,
    }


def bench_engine(workloads: Sequence[WorkloadSpec], setups: Sequence[str], engine_cfg: EngineConfig,
                 base: TierCacheConfig, progress: Callable[[], None] | None = None) -> dict[str, object]:
    results = []
    server = None
    if any("grpc" in s.split("+") for s in setups):
        from tiercache.bench.remote import Subprocess
        server = Subprocess("tiercache.cli", "serve", "--capacity", "4GiB", "--log-format", "text")
    try:
        with tempfile.TemporaryDirectory(prefix="tiercache-bench-l2-") as disk_root:
            for spec in workloads:
                baseline = run_workload(spec, replace(engine_cfg, enable_prefix_caching=False), None, progress)
                results.append(_row(spec, "baseline (no cache)", baseline, baseline))
                for setup in setups:
                    disk_dir = str(Path(disk_root) / f"{spec.name}-{setup}")   # every run starts with an empty L2
                    offload = _offload(setup, base, disk_dir, server.address if server else None)
                    run = run_workload(spec, engine_cfg, offload, progress)
                    results.append(_row(spec, setup, run, baseline))
    finally:
        if server is not None:
            server.close()
    by_workload: dict[str, dict[str, dict]] = {}
    for r in results:
        by_workload.setdefault(r["workload"], {})[r["setup"]] = r
    overhead = None
    if "no-reuse" in by_workload:
        runs = by_workload["no-reuse"]
        base_ttft = runs["baseline (no cache)"]["ttft_ms_p50"]
        overhead = {s: round(runs[s]["ttft_ms_p50"] / base_ttft, 3) for s in setups if s in runs}
    return {"results": results, "store_overhead_ttft_ratio_no_reuse": overhead}
