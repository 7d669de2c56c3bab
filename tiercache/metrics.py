"""Prometheus exposition of tiercache's `stats()`.

A collector turns the nested stats of an engine (or any object with
``stats()``) into metric families at scrape time, so nothing is counted twice
and no global registry is touched: each exporter has its own registry, and two
caches in one process export side by side on their own ports.

Families (labels in braces):
- ``tiercache_tier_*{tier}``: capacity, used bytes, chunks, key hit ratio, and
  counters (lookups, hit keys, planned, stored, rejected and failed stores,
  loads, evictions, deletions, integrity failures, errors);
  ``tiercache_tier_store_dropped{tier,reason}``: stores given up on before
  they landed (a busy server, its deadline, a full link queue, cancelled,
  purged) — planned = stored + rejected + dropped + failed, once none is in
  flight;
- ``tiercache_link_*{link}``: bytes, jobs, failures, drops (counters), GB/s,
  queue depth, bytes in flight, configured rate;
- ``tiercache_blocks{state}``: L0 blocks by state (used, pinned, evictable,
  empty, held for transfers);
- ``tiercache_engine_*`` (the reference engine): steps that computed tokens
  and the seconds they took (counters: the rate of the second is its
  utilization; their ratio the time a step takes), the part of those
  seconds spent loading KV into the pool or waiting for it, requests
  running and waiting;
- ``tiercache_connector_*``: lookups, hit and loaded tokens (prefill tokens
  saved), failed loads, planned and cancelled stores, swaps, token hit ratio;
- ``tiercache_server_*`` (`tiercache serve`): calls per RPC, chunks stored,
  present and rejected, get hits and misses, bytes in and out, rejected calls
  per status code, purges and what they took; ``tiercache_server_namespaces``;
  with tenants, ``tiercache_server_tenant_*{tenant}``: bytes, namespaces,
  purges, the CPU seconds its calls were charged;
- ``tiercache_thread_cpu_seconds{thread}``: CPU seconds of the process's threads
  alive now, by name (a pool's numbered threads together; threads Python did
  not start by the kernel's name for them) — where a process's CPU goes (a
  gauge: a thread that ends takes its seconds with it); Linux only;
- ``tiercache_audit_events_total{tenant,event}`` and ``_chunks``, ``_bytes``:
  the audit trail's purges, expiries and key rotations (`tiercache.audit`).
"""
from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TIER_GAUGES = ("available", "capacity_bytes", "used_bytes", "chunks", "key_hit_ratio")
TIER_COUNTERS = ("lookups", "lookup_keys", "hit_keys", "store_planned", "stored", "store_rejected", "store_failed",
                 "loaded", "load_misses", "evicted", "deleted", "expired", "purged", "integrity_failures", "tail_hits",
                 "temp_removed", "errors", "outages")
STORE_DROPPED = "store_dropped_"   # a tier's stats key per reason a store was given up on: one family, by reason
LINK_GAUGES = ("gbps", "achieved_gbps", "queue_depth", "in_flight_bytes", "rate_limit_gbps")
LINK_COUNTERS = ("bytes", "jobs", "failed", "dropped", "dropped_bytes")
CONNECTOR_COUNTERS = ("lookups", "ask_again", "admitted_tokens", "hit_requests", "hit_tokens", "loaded_tokens",
                      "failed_loads", "stores_planned", "stores_cancelled", "tail_stores", "delayed_frees", "swap_outs",
                      "swap_ins")


def _audited(counts: dict[str, dict[str, dict[str, int]]]) -> Iterator:
    """The audit trail's counts: per tenant and event, events and the chunks and bytes they took."""
    for field in ("events", "chunks", "bytes"):
        metric = CounterMetricFamily(f"tiercache_audit_{field}", f"audited data-lifecycle {field} (purges, expiries, "
                                     "key rotations) per tenant", labels=["tenant", "event"])
        for tenant, events in counts.items():
            for event, values in events.items():
                metric.add_metric([tenant, event], float(values[field]))
        yield metric


def _dropped(tiers: dict[str, dict]) -> CounterMetricFamily:
    """Stores each tier gave up on before they landed, by reason (``store_dropped_<reason>`` in its stats)."""
    metric = CounterMetricFamily("tiercache_tier_store_dropped", "per-tier stores given up on, by reason (busy, "
                                 "deadline, queue, cancelled, purged)", labels=["tier", "reason"])
    for tier, values in tiers.items():
        for name, value in values.items():
            if name.startswith(STORE_DROPPED):
                metric.add_metric([tier, name.removeprefix(STORE_DROPPED)], float(value))
    return metric


def _labelled(label: str, items: dict[str, dict], gauges: tuple[str, ...], counters: tuple[str, ...]) -> Iterator:
    """One family per field, one sample per item (tier or link), labelled with the item's name."""
    for names, family in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
        for name in names:
            metric = family(f"tiercache_{label}_{name}", f"per-{label} {name.replace('_', ' ')}", labels=[label])
            for item, values in items.items():
                metric.add_metric([item], float(values.get(name, 0)))
            yield metric


class StatsCollector(Collector):
    """Either process: turns one object's ``stats()`` into metric families at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        # The scrape runs on the exporter's thread while the engine keeps stepping; a dict that
        # changes size mid-read makes stats() raise, so take another snapshot rather than fail.
        for attempt in range(3):
            try:
                stats = self._stats()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        connector = stats.get("connector", stats)
        yield from _labelled("tier", connector.get("tiers", {}), TIER_GAUGES, TIER_COUNTERS)
        yield _dropped(connector.get("tiers", {}))
        yield from _labelled("link", connector.get("transfers", {}), LINK_GAUGES, LINK_COUNTERS)
        audit = connector.get("audit", stats.get("audit"))
        if audit is not None:
            yield from _audited(audit)
        engine = stats.get("engine")
        if engine:
            yield CounterMetricFamily("tiercache_engine_steps", "engine steps that computed tokens",
                                      value=float(engine["steps"]))
            yield CounterMetricFamily("tiercache_engine_busy_seconds", "seconds spent in steps that computed tokens "
                                      "(its rate is the engine's utilization)", value=float(engine["busy_seconds"]))
            yield CounterMetricFamily("tiercache_engine_load_seconds", "of the busy seconds, those spent loading KV "
                                      "into the pool or waiting for it to arrive", value=float(engine["load_seconds"]))
            for name in ("requests_running", "requests_waiting"):
                yield GaugeMetricFamily(f"tiercache_engine_{name}", f"engine {name.replace('_', ' ')}",
                                        value=float(engine[name]))
        blocks = stats.get("blocks")
        if blocks:
            g = GaugeMetricFamily("tiercache_blocks", "L0 blocks by state", labels=["state"])
            for state in ("total", "used", "pinned", "evictable", "empty", "held_for_transfers"):
                g.add_metric([state], float(blocks.get(state, 0)))
            yield g
        server = stats.get("server")
        if server is not None:
            for name, value in sorted(server.items()):
                yield CounterMetricFamily(f"tiercache_server_{name}", f"server {name.replace('_', ' ')}",
                                          value=float(value))
            yield GaugeMetricFamily("tiercache_server_namespaces", "namespaces with chunks on this server",
                                    value=float(stats.get("namespaces", 0)))
            tenants = stats.get("tenants")
            if tenants:     # a server with tenants: each one's chunks, in its own store or its part of the pool
                used = GaugeMetricFamily("tiercache_server_tenant_used_bytes", "bytes of a tenant's chunks",
                                         labels=["tenant"])
                spaces = GaugeMetricFamily("tiercache_server_tenant_namespaces", "namespaces a tenant holds "
                                           "chunks in", labels=["tenant"])
                purges = {field: CounterMetricFamily(f"tiercache_server_tenant_{field}", f"a tenant's "
                                                     f"{field.replace('_', ' ')}", labels=["tenant"])
                          for field in ("purges", "purged_chunks", "purged_bytes")}
                for name, one in sorted(tenants.items()):
                    used.add_metric([name], float(one["used_bytes"]))
                    spaces.add_metric([name], float(one["namespaces"]))
                    for field, family in purges.items():
                        family.add_metric([name], float(one.get(field, 0)))
                yield used
                yield spaces
                yield from purges.values()
            cpu = stats.get("tenant_cpu_seconds")
            if cpu:
                family = CounterMetricFamily("tiercache_server_tenant_cpu_seconds", "the server's CPU a tenant's "
                                             "calls were charged (its share of it: --cpu-cores)", labels=["tenant"])
                for name, seconds in sorted(cpu.items()):
                    family.add_metric([name], float(seconds))
                yield family
        if "lookups" in connector:
            for name in CONNECTOR_COUNTERS:
                yield CounterMetricFamily(f"tiercache_connector_{name}", f"connector {name.replace('_', ' ')}",
                                          value=float(connector.get(name, 0)))
            yield GaugeMetricFamily("tiercache_connector_token_hit_ratio", "tokens loaded from tiers / tokens admitted",
                                    value=float(connector.get("token_hit_ratio", 0.0)))
            yield GaugeMetricFamily("tiercache_in_flight_jobs", "transfer jobs planned and not yet applied",
                                    value=float(connector.get("in_flight_jobs", 0)))


def stat_cpu_seconds(stat: str) -> tuple[str, float]:
    """The name and CPU seconds (user and system) in the text of a /proc ``stat`` file (a process's or a
    thread's)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(task_dir: str = "/proc/self/task") -> dict[str, float]:
    """CPU seconds (user and system) of this process's live threads, summed by name: a Python thread by its
    name with a trailing number dropped (``tiercache-xfer-2`` → ``tiercache-xfer``), any other by the kernel's
    name for it. Empty where there is no /proc."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Counter[str] = Counter()
    for tid in tids:
        try:
            stat = Path(f"{task_dir}/{tid}/stat").read_text()
        except OSError:          # it ended meanwhile
            continue
        comm, seconds = stat_cpu_seconds(stat)
        out[re.sub(r"[-_ ]\d+$", "", names.get(int(tid), comm))] += seconds
    return dict(out)


class ThreadCpuCollector(Collector):
    """``tiercache_thread_cpu_seconds{thread}`` at scrape time (`thread_cpu_seconds`)."""

    def collect(self) -> Iterator:
        g = GaugeMetricFamily("tiercache_thread_cpu_seconds", "CPU seconds of this process's live threads, by name",
                              labels=["thread"])
        for name, seconds in sorted(thread_cpu_seconds().items()):
            g.add_metric([name], seconds)
        yield g


def registry_for(stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    registry.register(ThreadCpuCollector())
    return registry


def serve_metrics(stats: Callable[[], dict[str, Any]], port: int, addr: str = "127.0.0.1"):
    """Start a scrape endpoint in a daemon thread; returns (server, thread) so callers can shut it down."""
    return start_http_server(port, addr=addr, registry=registry_for(stats))
