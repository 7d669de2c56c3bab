"""tiercache as a vLLM KV connector: ``TierCacheConnector`` (KVConnectorBase_V1, SupportsHMA).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu": {"capacity": "8GiB"}, "disk": {"enabled": true, "path": "/nvme/kv"}}}'

``kv_connector_extra_config`` holds tiercache config sections (as in a config
file), and optionally ``"config_file"``: a YAML/TOML file they override.
``keys.block_size`` is always vLLM's block size; ``keys.chunk_tokens`` must be
a multiple of it.

How it maps onto tiercache's connector API (`tiercache.connector.offload`):

- The worker side registers vLLM's per-layer KV tensors as L0
  (`LayerTensorsKV`: the geometry and layout are read from the tensors and
  ``kv_cache_config``, never assumed; blocks move as opaque rows) and builds
  the offload stack. The scheduler side, in the same process (vLLM runs the
  scheduler and a single worker in its engine-core process), finds that
  stack by the engine id. Tensor parallelism (workers in other processes) is
  refused with a clear error.
- Prefix keys are tiercache's own chained hashes of the request's tokens in
  the model's namespace (model, revision, layout, dtype, block size), so two
  vLLM processes — or replicas sharing a `tiercache serve` or Redis — agree
  on them; vLLM's own block hashes may be salted per process.
- `get_num_new_matched_tokens` never blocks on a slow tier: a hit below L1 is
  promoted in the background and the answer is "ask again" (``None``).
- Loads land layer by layer when ``transfer.layerwise`` is on and the copies
  run on transfer threads (a GPU pool; on a CPU pool they run inline on
  vLLM's thread unless ``transfer.inline_host_copies`` is ``off``):
  `start_load_kv` starts them and `wait_for_layer_load` — which vLLM calls
  before each attention layer — waits for that layer only, so layer l
  computes while l + 1 copies (`requires_piecewise_for_cudagraph` asks vLLM
  for piecewise CUDA graphs, between whose pieces those waits run).
  Otherwise every load completes in `start_load_kv`. A step's stores
  (L0 → L1) complete in `wait_for_save`, so vLLM may free or
  reuse blocks as soon as the step ends; copies to lower tiers run in the
  background from L1. A failed load reports its blocks through
  `get_block_ids_with_load_errors` (vLLM recomputes them) and cancels the
  request's stores, so KV computed over missing context is never offloaded.
- KV events (`take_events`): ``BlockStored`` for the chunks that reached a
  tier and ``BlockRemoved`` for those that left one (evicted, or deleted as
  corrupt), in the order they happened, with the tier's medium (CPU, DISK,
  REMOTE); the block hash is the chunk key. A shared server's or Redis's own
  evictions are not seen by a client, so REMOTE removals are only this
  process's deletes.
- Stats (`get_kv_connector_stats`, logged by vLLM with its other stats):
  counter deltas since the last call — lookups, "ask again" answers, hit and
  loaded tokens, failed loads, planned stores; `stats()` has everything.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache.build import OffloadStack, build_offload_stack
from tiercache.config import TierCacheConfig, load_config
from tiercache.connector.api import ConnectorMetadata, ConnectorOutput, RequestView, StepRequest
from tiercache.connector.offload import OffloadScheduler, OffloadWorker
from tiercache.errors import ConfigError
from tiercache.keys import BlockHash, BlockHasher, KVGeometry, Namespace
from tiercache.pool.layer_tensors import LayerTensorsKV
from tiercache.tiers.base import Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class TierCacheMetadata(KVConnectorMetadata):
    """Scheduler → worker for one step: tiercache's plans (plain data)."""
    inner: ConnectorMetadata = field(default_factory=ConnectorMetadata)


STAT_COUNTERS = ("lookups", "ask_again", "hit_tokens", "loaded_tokens", "failed_loads", "stores_planned")


@dataclass
class TierCacheStats(KVConnectorStats):
    """Counter deltas over an interval (plain ints, so the stats travel between vLLM processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierCacheStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in STAT_COUNTERS}
        out["tiercache_load_ratio"] = round(out["loaded_tokens"] / out["hit_tokens"], 4) if out["hit_tokens"] else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Shared:
    """One engine's offload stack and both halves of the connector, shared by the two connector objects."""
    stack: OffloadStack
    hasher: BlockHasher
    scheduler: OffloadScheduler
    worker: OffloadWorker
    outputs: list[ConnectorOutput] = field(default_factory=list)   # worker → scheduler, applied in order
    lock: threading.Lock = field(default_factory=threading.Lock)


_ENGINES: dict[str, _Shared] = {}
_ENGINES_LOCK = threading.Lock()


def offload_config(extra_config: dict[str, Any] | None, block_size: int) -> TierCacheConfig:
    """The tiercache config from ``kv_connector_extra_config``, with vLLM's block size."""
    extra = dict(extra_config or {})
    path = extra.pop("config_file", None)
    try:
        cfg = load_config(path)
        keys = {**extra.pop("keys", {}), "block_size": block_size}
        chunk = int(keys.get("chunk_tokens", cfg.keys.chunk_tokens))
        if chunk % block_size:
            raise ConfigError("keys.chunk_tokens", chunk, f"must be a multiple of vLLM's block size {block_size}")
        return cfg.replace(keys=keys, **extra)
    except ConfigError as err:
        raise ConfigError(f"kv_connector_extra_config.{err.field}", err.value, err.reason) from None
    except TypeError as err:
        raise ConfigError("kv_connector_extra_config", extra, f"unknown section: {err}") from None


def _block_dim(shape: torch.Size, num_blocks: int) -> int:
    for dim in (0, 1):
        if shape[dim] == num_blocks:
            return dim
    raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {tuple(shape)}")


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.world_size > 1:
            raise ValueError("TierCacheConnector: tensor or pipeline parallelism is not supported yet "
                             "(scheduler and worker must share one process)")
        self.config = offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config,
                                     vllm_config.cache_config.block_size)
        self.block_size = vllm_config.cache_config.block_size
        self._engine_id = vllm_config.kv_transfer_config.engine_id
        self._requests: dict[str, Request] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._events: list[BlockStored] = []
        self._load_errors: set[int] = set()
        self._layer_index: dict[str, int] = {}
        self._reported: dict[str, int] = {}

    # -- shared state ----------------------------------------------------------
    @property
    def _shared(self) -> _Shared:
        shared = _ENGINES.get(self._engine_id)
        if shared is None:
            raise RuntimeError("TierCacheConnector: the worker has not registered KV caches in this process; "
                               "tiercache needs vLLM's scheduler and worker in one process")
        return shared

    # -- worker side -----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        if any(not isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("TierCacheConnector: KV caches must be one tensor per layer")
        self._layer_index = {n: i for i, n in enumerate(names)}
        model = self._vllm_config.model_config
        num_blocks = self._kv_cache_config.num_blocks
        dim = _block_dim(tensors[0].shape, num_blocks)
        layout_shape = [str(d) for i, d in enumerate(tensors[0].shape) if i != dim]
        geometry = KVGeometry(len(tensors), model.get_num_kv_heads(self._vllm_config.parallel_config),
                              model.get_head_size(), str(tensors[0].dtype).removeprefix("torch."),
                              layout=f"vllm:block-dim{dim}:{'x'.join(layout_shape)}")
        kv = LayerTensorsKV(tensors, num_blocks, self.block_size, geometry, dim)
        namespace = Namespace(model.model, geometry, self.block_size, revision=model.revision or "",
                              tenant_salt=self.config.keys.tenant_salt)
        stack = build_offload_stack(self.config, kv, namespace)
        for tier in stack.tiers:
            tier.watch_removals()      # drained into KV events every step (`take_events`)
        inline = self.config.transfer.inline_host_copies
        worker = OffloadWorker(stack, layerwise=self.config.transfer.layerwise,
                               inline=inline == "on" or (inline == "auto" and kv.device.type == "cpu"))
        shared = _Shared(stack, BlockHasher(namespace, self.config.keys.hash),
                         OffloadScheduler(stack, self.block_size, swap_salt=namespace.digest()), worker)
        with _ENGINES_LOCK:
            old = _ENGINES.pop(self._engine_id, None)
            _ENGINES[self._engine_id] = shared
        if old is not None:
            old.stack.close()
        log.info("tiercache: %d layers, %d blocks of %d tokens, chunks of %d tokens, tiers %s", len(tensors),
                 num_blocks, self.block_size, self.config.keys.chunk_tokens, [t.name for t in stack.tiers])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheMetadata)
        worker = self._shared.worker
        worker.bind_connector_meta(meta.inner)
        worker.start_load_kv()
        if not worker.layerwise:
            worker.wait_for_layer_load(0)   # whole-chunk loads land before the forward reads the cache

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by vLLM before each attention layer: wait until that layer of this step's loads landed
        (a layer tiercache does not know waits for all of them)."""
        worker = self._shared.worker
        if worker.layerwise:
            worker.wait_for_layer_load(self._layer_index.get(layer_name, len(self._layer_index) - 1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None   # stores are whole chunks across all layers, taken in wait_for_save

    def wait_for_save(self) -> None:
        worker = self._shared.worker
        worker.wait_for_save()
        worker.wait_for_stores()   # L0 → L1 done: vLLM may reuse the blocks after this step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Hand finished transfers to the scheduler side; called every step, with or without a forward
        (a step with nothing scheduled still completes promotions for requests told to ask again)."""
        shared = self._shared
        output = shared.worker.get_finished()
        self._load_errors |= set(output.failed_block_ids)
        with shared.lock:
            shared.outputs.append(output)
        return None, None   # loads and stores of a step complete within the step

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        with _ENGINES_LOCK:
            shared = _ENGINES.pop(self._engine_id, None)
        if shared is not None:
            shared.stack.close()

    # -- scheduler side ----------------------------------------------------------
    def _view(self, request: "Request") -> RequestView:
        rid = request.request_id
        hashes = self._hashes.setdefault(rid, [])
        tokens = request.all_token_ids
        full = len(tokens) // self.block_size
        if full > len(hashes):
            start = len(hashes) * self.block_size
            hashes += self._shared.hasher.hash_blocks(tokens[start:full * self.block_size],
                                                      parent=hashes[-1] if hashes else None)
        return RequestView(rid, request.num_tokens, hashes)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        self._apply_outputs()
        n = self._shared.scheduler.get_num_new_matched_tokens(self._view(request), num_computed_tokens)
        return (None, False) if n is None else (n, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0]
        self._shared.scheduler.update_state_after_alloc(self._view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._apply_outputs()
        steps = []
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or self._kv_cache_manager is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            steps.append(StepRequest(self._view(request), block_ids, request.num_computed_tokens + num_scheduled))
        return TierCacheMetadata(self._shared.scheduler.build_connector_meta(steps))

    def update_connector_output(self, connector_output: Any) -> None:
        self._apply_outputs()

    def _apply_outputs(self) -> None:
        """Apply the worker's finished transfers. vLLM calls `update_connector_output` only for steps
        whose output names a finished request, so lookups and step building apply them first too."""
        shared = self._shared
        with shared.lock:
            outputs, shared.outputs = shared.outputs, []
        for output in outputs:
            self._take_removals()      # what left a tier before these stores were published
            shared.scheduler.update_connector_output(output)
            for result in output.results:
                failed = set(result.failed_keys)
                stored = [bytes(k) for k in result.plan.keys if k not in failed]
                if result.plan.dst is not Medium.DEVICE and stored:
                    self._events.append(BlockStored(
                        block_hashes=stored, parent_block_hash=None, token_ids=[],
                        block_size=self.config.keys.chunk_tokens, lora_id=None,
                        medium=result.plan.dst.value.upper(), lora_name=None))

    def _take_removals(self) -> None:
        for tier in self._shared.stack.tiers:
            gone = tier.take_removed()
            if gone:
                self._events.append(BlockRemoved(block_hashes=[bytes(k) for k in gone],
                                                 medium=tier.medium.value.upper()))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._shared.scheduler.request_finished(self._view(request), block_ids)
        self._requests.pop(rid, None)
        self._hashes.pop(rid, None)
        return False, None   # the blocks were copied to L1 within the step that computed them

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def take_events(self):
        if self._engine_id in _ENGINES:
            self._apply_outputs()
            self._take_removals()
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, object]:
        shared = self._shared
        return {**shared.scheduler.stats(), "layerwise_loads": shared.worker.layerwise_loads}

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role != KVConnectorRole.SCHEDULER or self._engine_id not in _ENGINES:
            return None
        counters = self._shared.scheduler.counters
        now = {name: getattr(counters, name) for name in STAT_COUNTERS}
        delta = {name: value - self._reported.get(name, 0) for name, value in now.items()}
        self._reported = now
        return TierCacheStats(data=delta)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads wait inside the forward, which a whole-graph CUDA graph replay would skip."""
        transfer = offload_config(extra_config, 1).transfer
        return transfer.layerwise and transfer.inline_host_copies != "on"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierCacheStats(data=dict(data or {}))
