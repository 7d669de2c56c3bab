"""The engine-agnostic KV connector API, split like vLLM's KVConnectorBase_V1.

The **scheduler side** decides: how many tokens beyond the engine's own L0 hits
a request can load (`get_num_new_matched_tokens`), what to load once blocks
are allocated (`update_state_after_alloc`), what each step loads and stores
(`build_connector_meta`), whether a finished request's blocks must outlive it
(`request_finished`). It never blocks on slow I/O: it may answer "ask again"
(``None``).

The **worker side** executes: it registers the KV tensors, starts a step's
loads, waits for a layer's KV before attention reads it, saves after the
forward, and reports finished transfers and failed loads.

Engines (the reference engine, vLLM) talk only to these classes; the tiers
stay behind them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.keys import BlockHash
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.transfer.plan import JobId, TransferPlan, TransferResult


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a connector needs to know about a request."""
    request_id: str
    num_tokens: int                       # tokens the request holds (prompt + generated so far)
    block_hashes: Sequence[BlockHash]     # chained hashes of its full blocks


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request in a scheduled step: its table and how many tokens will be cached after the step."""
    request: RequestView
    block_ids: Sequence[int]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """Scheduler → worker, once per step: the plans to run and whom they serve."""
    loads: tuple[TransferPlan, ...] = ()
    stores: tuple[TransferPlan, ...] = ()
    background: tuple[TransferPlan, ...] = ()   # promotions, spills, copies down: no request waits on them
    owners: dict[JobId, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ConnectorOutput:
    """Worker → scheduler, once per step."""
    results: tuple[TransferResult, ...] = ()
    finished_sending: frozenset[str] = frozenset()    # requests whose stores all completed
    finished_recving: frozenset[str] = frozenset()    # requests whose loads all completed
    failed_loads: frozenset[str] = frozenset()        # requests with a load that failed
    failed_block_ids: frozenset[int] = frozenset()


class SchedulerConnector(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """Tokens after ``num_computed_tokens`` that the tiers can load; None means "ask again later"."""

    @abstractmethod
    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks are allocated: plan loading ``num_external_tokens`` tokens into them."""

    @abstractmethod
    def build_connector_meta(self, step: Sequence[StepRequest]) -> ConnectorMetadata:
        """The loads planned since the last step, and stores of chunks this step completes."""

    @abstractmethod
    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Apply the worker's finished transfers to the tier indexes."""

    @abstractmethod
    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        """The request ended; True if its blocks must stay allocated until `finished_sending` names it."""

    @abstractmethod
    def has_pending_stores(self, request_id: str) -> bool:
        """True while a planned or running store still reads the request's blocks."""

    def swap_out(self, request: RequestView, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        """Preemption by swap: keep the request's KV in a tier; False if this connector cannot."""
        return False

    def request_reset(self, request_id: str) -> None:
        """The engine discarded the request's KV (preempted for recompute, or a failed load)."""
        return None

    def stats(self) -> dict[str, object]:
        return {}


class WorkerConnector(ABC):
    @abstractmethod
    def register_kv_caches(self, kv: PagedKVCache) -> None: ...

    @abstractmethod
    def bind_connector_meta(self, meta: ConnectorMetadata) -> None: ...

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin this step's loads (non-blocking)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Return once ``layer``'s loaded KV is in place."""

    @abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """``layer``'s new KV has been written to the pool."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """The forward finished: hand this step's stores to the transfer engine."""

    @abstractmethod
    def get_finished(self) -> ConnectorOutput:
        """Transfers finished since the last call."""
