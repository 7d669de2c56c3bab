"""Prometheus exposition of `tiercache route`: per replica load, index and events, and the router's accuracy.

Families (labels in braces):
- ``tiercache_route_replica_up{replica}``, ``..._in_flight{replica}``,
  ``..._pending_prefill_tokens{replica}``, ``..._prefill_tokens_per_second{replica}`` and
  ``..._prefill_attention_seconds_per_pair{replica}`` (the two parts of its prefill cost, as timed),
  ``..._running_request_seconds{replica}`` (what each request running there adds to a new one's wait, as
  learned), ``..._waiting_prefill_seconds{replica}`` (the prefill estimated still ahead of a request now),
  ``..._engine_requests{replica}`` (requests in its engine by its own /metrics; -1: none it reads) and
  ``..._foreign_requests{replica}`` (of those, the ones this router did not send);
- ``tiercache_route_requests_total{replica}``, ``..._prompt_tokens_total{replica}``,
  ``..._failures_total{replica}`` (a request it could not be reached for);
- ``tiercache_route_index_keys{replica,medium}``: blocks and chunks the router knows it holds;
- ``tiercache_route_unnamed_blocks_total{replica}``: a vLLM replica's stored blocks the router could not
  name (parent never seen, extra keys beyond a salt): left out of its predictions;
- ``tiercache_route_load_tokens_per_second{replica,medium}``: the load rates it weighs cached tokens by;
- ``tiercache_route_events_total{replica,kind}``: batches applied, duplicates, gaps, replayed, resyncs,
  restarts, undecodable;
- ``tiercache_route_predicted_cached_tokens_total{replica}``, ``..._reported_cached_tokens_total{replica}``,
  ``..._prediction_error_tokens_total{replica}`` (sum of |predicted - reported|): the index's accuracy;
- ``tiercache_route_failovers_total``, ``tiercache_route_unrouted_total``,
  ``tiercache_route_sticky_routed_total`` (requests sent first to their session's replica).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class RouterCollector(Collector):
    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        replicas = list(self.router.fleet.replicas.values())
        gauges = {
            "replica_up": ("1 while the replica takes requests", lambda r: float(r.up)),
            "in_flight": ("requests sent and not finished", lambda r: r.load.in_flight),
            "pending_prefill_tokens": ("prompt tokens to compute before first tokens",
                                       lambda r: r.load.pending_prefill),
            "prefill_tokens_per_second": ("measured prefill rate, its per-token part", lambda r: r.rates.prefill),
            "prefill_attention_seconds_per_pair": ("measured prefill cost per (computed, earlier) token pair",
                                                   lambda r: r.rates.attention_s),
            "running_request_seconds": ("what each request running there adds to a new one's wait, as learned",
                                        lambda r: r.rates.per_request_s),
            "waiting_prefill_seconds": ("prefill estimated still ahead of a request sent now",
                                        lambda r: r.load.waiting_prefill_s(time.monotonic())),
            "engine_requests": ("requests running and waiting in the replica's engine, by its /metrics at the "
                                "last health check (-1: it reports none the router reads)",
                                lambda r: r.load.engine_requests),
            "foreign_requests": ("of those, requests this router did not send", lambda r: r.load.foreign),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"tiercache_route_{name}", doc, labels=["replica"])
            for r in replicas:
                family.add_metric([r.name], value(r))
            yield family
        counters = {
            "requests": ("requests forwarded", lambda r: r.load.requests),
            "prompt_tokens": ("prompt tokens forwarded", lambda r: r.load.prompt_tokens),
            "failures": ("requests it could not be reached for", lambda r: r.load.failures),
            "predicted_cached_tokens": ("cached tokens the index predicted", lambda r: r.load.predicted_cached),
            "reported_cached_tokens": ("cached tokens the replica reported", lambda r: r.load.reported_cached),
            "prediction_error_tokens": ("sum of |predicted - reported| cached tokens",
                                        lambda r: r.load.prediction_error),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(f"tiercache_route_{name}", doc, labels=["replica"])
            for r in replicas:
                family.add_metric([r.name], value(r))
            yield family
        keys = GaugeMetricFamily("tiercache_route_index_keys", "blocks and chunks indexed",
                                 labels=["replica", "medium"])
        unnamed = CounterMetricFamily("tiercache_route_unnamed_blocks", "stored blocks the router could not name",
                                      labels=["replica"])
        loads = GaugeMetricFamily("tiercache_route_load_tokens_per_second", "load rate per tier medium",
                                  labels=["replica", "medium"])
        events = CounterMetricFamily("tiercache_route_events", "KV event batches by outcome",
                                     labels=["replica", "kind"])
        for r in replicas:
            for medium, n in r.index.num_keys().items():
                keys.add_metric([r.name, medium], n)
            if r.index.names is not None:
                unnamed.add_metric([r.name], r.index.names.unnamed)
            for medium, rate in r.rates.load.items():
                loads.add_metric([r.name, medium], rate)
            if r.follower is not None:
                for kind, n in r.follower.counters.as_dict().items():
                    events.add_metric([r.name, kind], n)
        yield keys
        yield unnamed
        yield loads
        yield events
        yield CounterMetricFamily("tiercache_route_failovers", "requests moved to another replica",
                                  value=self.router.failovers)
        yield CounterMetricFamily("tiercache_route_unrouted", "requests no replica could take",
                                  value=self.router.unrouted)
        yield CounterMetricFamily("tiercache_route_sticky_routed", "requests sent first to their session's replica",
                                  value=self.router.sticky_routed)


def registry_for(router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return registry
