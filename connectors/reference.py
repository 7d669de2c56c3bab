"""tiercache's offload connector wired for the bundled reference engine.

The engine runs in one process, but the connector keeps the split every
other engine needs: one `OffloadScheduler` and one `OffloadWorker` per rank —
the engine's ``tensor_parallel_size`` simulated ranks, each holding its share
of the KV heads, its own L1 slab, its own chunk files and remote values —
that pass each other nothing but plain data: a `WorkerHandshake` per rank at
start, `ConnectorMetadata` down and a `WorkerReport` per rank up every step.
`RankGroup` runs the ranks in step and aggregates their reports as vLLM's
executor does (a request has finished sending once every rank says so; a
load failed if any rank's did).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tiercache.config import TierCacheConfig
from tiercache.connector.scheduler import OffloadScheduler
from tiercache.connector.worker import OffloadWorker
from tiercache.contracts.connector import ConnectorMetadata, ConnectorOutput, WorkerReport
from tiercache.contracts.keys import KVShard, Namespace
from tiercache.contracts.plan import JobOutcome, TransferPlan
from tiercache.pool.group_pages import GroupPagesKV
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.pool.layer_tensors import LayerTensorsKV

log = logging.getLogger(__name__)


class RankGroup:
    """Every rank's worker side, driven together by the engine's model runner."""

    def __init__(self, workers: Sequence[OffloadWorker]) -> None:
        self.workers = list(workers)
        self._sending: dict[str, set[int]] = {}   # request → ranks that reported it finished sending

    def bind_connector_meta(self, meta: ConnectorMetadata) -> None:
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_meta(meta)

    def start_load_kv(self) -> None:
        for w in self.workers:
            w.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        for w in self.workers:
            w.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for w in self.workers:
            w.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        for w in self.workers:
            w.wait_for_save()

    def get_finished(self, idle: bool = False) -> ConnectorOutput:
        return self.aggregate([w.get_finished(idle) for w in self.workers])

    def aggregate(self, reports: Sequence[WorkerReport]) -> ConnectorOutput:
        finished = set()
        for report in reports:
            for rid in report.finished_sending:
                ranks = self._sending.setdefault(rid, set())
                ranks.add(report.rank)
                if len(ranks) == len(self.workers):
                    del self._sending[rid]
                    finished.add(rid)
        return ConnectorOutput(
            jobs=tuple(job for r in reports for job in r.jobs),
            finished_sending=frozenset(finished),
            failed_loads=frozenset().union(*(r.failed_loads for r in reports)),
            failed_block_ids=frozenset().union(*(r.failed_block_ids for r in reports)),
        )


class ReferenceConnector:
    """Both sides over L0 ``kv``: the reference engine's pool (one rank per shard), or each rank's KV as given
    (an engine's per-layer tensors, or a hybrid model's KV-cache groups; ``replicated`` when every rank holds
    the same KV, as with MLA)."""

    def __init__(self, config: TierCacheConfig, namespace: Namespace,
                 kv: PagedKVCache | Sequence[PagedKVCache | LayerTensorsKV | GroupPagesKV],
                 replicated: bool = False) -> None:
        ranks = [kv.shard(i) for i in range(kv.num_shards)] if isinstance(kv, PagedKVCache) else list(kv)
        n = len(ranks)
        self.workers = [OffloadWorker(config, namespace, KVShard(tp_rank=i, tp_size=n, replicated=replicated))
                        for i in range(n)]
        self.scheduler = OffloadScheduler(config, ranks[0].block_size, swap_salt=namespace.digest())
        try:
            handshakes = [w.register_kv_caches(rank_kv) for w, rank_kv in zip(self.workers, ranks)]
            self.scheduler.attach(handshakes)
        except BaseException:
            self._close_sides()
            raise
        self.worker = RankGroup(self.workers)

    def stats(self) -> dict[str, object]:
        out = self.scheduler.stats()
        if len(self.workers) == 1:
            out["transfers"] = self.workers[0].stats()["transfers"]
        else:
            out["transfers"] = {f"{link}@rank{w.rank}": values for w in self.workers
                                for link, values in w.stats()["transfers"].items()}
        out["layerwise_loads"] = sum(w.layerwise_loads for w in self.workers)
        return out

    def run(self, plans: Sequence[TransferPlan | None], timeout: float = 60.0) -> list[JobOutcome]:
        """Run ``plans`` on every rank now, wait for every job handed to the ranks so far, and apply the
        outcomes (returned) — for tools and tests that drive the manager without an engine's steps."""
        deadline = time.monotonic() + timeout
        manager = self.scheduler.manager
        order = manager.take_write_back() if manager is not None else None
        self.worker.bind_connector_meta(ConnectorMetadata(background=tuple(p for p in plans if p is not None),
                                                          write_back=order))
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        for w in self.workers:
            w.wait_until_idle(max(0.0, deadline - time.monotonic()))
        return self.scheduler.update_connector_output(self.worker.get_finished().jobs)

    def drain(self, timeout: float = 60.0, flush: bool = False) -> None:
        """Run every job still owed (background work; with ``flush`` also write-back copies of what only L1
        holds) to the end on every rank, applying the outcomes."""
        manager = self.scheduler.manager
        if manager is None:
            return
        deadline = time.monotonic() + timeout
        plans = manager.take_background() + (manager.flush_down() if flush else [])
        while True:
            self.run(plans, max(0.0, deadline - time.monotonic()))
            plans = manager.take_background()
            if not plans:
                break
        if manager.num_in_flight:
            log.warning("offload stack closed with %d transfers never reported", manager.num_in_flight)
            manager.cancel_all()

    def close(self, timeout: float = 60.0) -> None:
        """Settle in-flight work, then stop every rank; each writes down what only its L1 holds (write-back),
        as a vLLM worker does when vLLM shuts down."""
        try:
            self.drain(timeout)
            manager = self.scheduler.manager
            if manager is not None:
                self.worker.bind_connector_meta(ConnectorMetadata(write_back=manager.take_write_back()))
        except TimeoutError:
            log.warning("offload stack closed with transfers still running")
        finally:
            self._close_sides()

    def _close_sides(self) -> None:
        for w in self.workers:
            w.close()
        self.scheduler.close()
