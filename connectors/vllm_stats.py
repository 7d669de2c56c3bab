"""tiercache's counters in vLLM's stats: the interval deltas vLLM sums over ranks and logs (`TierCacheStats`),
and the same counters in vLLM's Prometheus endpoint (`TierCachePromMetrics`).

Runs wherever vLLM collects stats: the deltas come from the scheduler side (its counters, per tier) and
from every worker (its links' bytes), travel as plain ints and are summed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tiercache.index.tier_index import DROP_REASONS

SCHEDULER_COUNTERS = ("lookups", "ask_again", "hit_tokens", "loaded_tokens", "failed_loads", "stores_planned",
                      "stores_cancelled", "tail_stores", "delayed_frees")
WORKER_COUNTERS = ("layerwise_loads",)
STORE_DROPS = tuple(f"store_dropped_{reason}" for reason in DROP_REASONS)
TIER_COUNTERS = ("store_planned", "stored", "store_rejected", "store_failed", *STORE_DROPS, "loaded", "load_misses",
                 "evicted", "expired", "purged", "integrity_failures", "tail_hits", "errors")


@dataclass
class TierCacheStats(KVConnectorStats):
    """Counter deltas over an interval (plain ints, summed over ranks): the scheduler's counters, per-tier
    counters as ``tier/<name>/<counter>``, per-rank link counters as ``link/<name>/<counter>`` and the audit
    trail's events as ``audit/<tenant>/<event>``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierCacheStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in SCHEDULER_COUNTERS}
        out["tiercache_load_ratio"] = round(out["loaded_tokens"] / out["hit_tokens"], 4) if out["hit_tokens"] else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TierCachePromMetrics(KVConnectorPromMetrics):
    """tiercache's counters in vLLM's Prometheus endpoint: ``vllm:tiercache_<counter>``, per tier
    (``vllm:tiercache_tier_<counter>{tier=}``; the stores given up on as
    ``vllm:tiercache_tier_store_dropped{tier=,reason=}``), per link (``vllm:tiercache_link_<counter>{link=}``, summed
    over ranks) and the audit trail's events (``vllm:tiercache_audit_events{tenant=,event=}``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain = {name: self._counter_cls(name=f"vllm:tiercache_{name}", documentation=f"tiercache {name}",
                                               labelnames=labelnames) for name in SCHEDULER_COUNTERS + WORKER_COUNTERS}
        self._tier = {name: self._counter_cls(name=f"vllm:tiercache_tier_{name}",
                                              documentation=f"tiercache chunks {name} per tier",
                                              labelnames=[*labelnames, "tier"])
                      for name in TIER_COUNTERS if name not in STORE_DROPS}
        self._dropped = self._counter_cls(name="vllm:tiercache_tier_store_dropped",
                                          documentation="tiercache stores given up on per tier, by reason",
                                          labelnames=[*labelnames, "tier", "reason"])
        self._audit = self._counter_cls(name="vllm:tiercache_audit_events",
                                        documentation="audited purges, expiries and key rotations per tenant",
                                        labelnames=[*labelnames, "tenant", "event"])
        self._link = self._counter_cls(
            name="vllm:tiercache_link_bytes",
            documentation="bytes moved per link, all ranks",
            labelnames=[*labelnames, "link"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, value in transfer_stats_data.items():
            if not value:
                continue
            parts = name.split("/")
            if len(parts) == 1 and name in self._plain:
                self._plain[name].labels(*labels).inc(value)
            elif len(parts) == 3 and parts[0] == "tier" and parts[2] in self._tier:
                self._tier[parts[2]].labels(*labels, parts[1]).inc(value)
            elif len(parts) == 3 and parts[0] == "tier" and parts[2] in STORE_DROPS:
                self._dropped.labels(*labels, parts[1], parts[2].removeprefix("store_dropped_")).inc(value)
            elif len(parts) == 3 and parts[0] == "audit":
                self._audit.labels(*labels, parts[1], parts[2]).inc(value)
            elif len(parts) == 3 and parts[0] == "link" and parts[2] == "bytes":
                self._link.labels(*labels, parts[1]).inc(value)
