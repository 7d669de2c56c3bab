"""The engine-agnostic KV connector API, split like vLLM's KVConnectorBase_V1 (docs/architecture.md).

The **scheduler side** (one per engine) decides: how many tokens beyond the
engine's own L0 hits a request can load (`get_num_new_matched_tokens`), what
to load once blocks are allocated (`update_state_after_alloc`), what each step
loads and stores (`build_connector_meta`), whether a finished request's
blocks must outlive it (`request_finished`). It never blocks on slow I/O: it
may answer "ask again" (``None``).

The **worker side** (one per rank) executes: it registers the rank's KV
tensors (answering with a `WorkerHandshake`), starts a step's loads, waits for
a layer's KV before attention reads it, hands stores over after the forward,
and reports what finished (`WorkerReport`).

Only plain data (`tiercache.contracts.connector`) crosses between the sides, in the engine's own
channels: a `WorkerHandshake` per rank once at start, `ConnectorMetadata`
down every step, a `WorkerReport` per rank up every step. Engines (the
reference engine, vLLM) talk only to these classes; the tiers stay behind
them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tiercache.contracts.connector import ConnectorMetadata, RequestView, StepRequest, WorkerHandshake, WorkerReport
from tiercache.contracts.plan import JobOutcome, JobReport


class SchedulerConnector(ABC):
    """What an engine's scheduler side calls (one per engine)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """Tokens after ``num_computed_tokens`` that the tiers can load; None means "ask again later"."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Blocks are allocated: plan loading ``num_external_tokens`` tokens into them (an engine whose KV has
        several groups gives each group's table in ``group_block_ids``, `NO_BLOCK` where it holds none)."""

    @abstractmethod
    def build_connector_meta(self, step: Sequence[StepRequest], preempted: Sequence[str] = ()) -> ConnectorMetadata:
        """The loads planned since the last step, and stores of chunks this step completes."""

    @abstractmethod
    def update_connector_output(self, jobs: Sequence[JobReport]) -> list[JobOutcome]:
        """Apply the job reports of every rank (a job is complete once every rank has reported it); returns
        the outcomes of the jobs that completed."""

    @abstractmethod
    def request_finished(self, request: RequestView, block_ids: Sequence[int],
                         group_block_ids: Sequence[Sequence[int]] = ()) -> bool:
        """The request ended; True if its blocks must stay allocated until every rank reports it in
        `WorkerReport.finished_sending`."""

    @abstractmethod
    def request_preempted(self, request_id: str) -> bool:
        """The engine takes the request's blocks back (it will recompute or reload it later); True if they
        must stay allocated until every rank reports it in `WorkerReport.finished_sending`."""

    @abstractmethod
    def has_pending_stores(self, request_id: str) -> bool:
        """True while a planned or running store still reads the request's blocks."""

    def swap_out(self, request: RequestView, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        """Preemption by swap: keep the request's KV in a tier; False if this connector cannot."""
        return False

    def stored_tokens(self, request_id: str) -> int:
        """Of the request's computed tokens, how many the tiers hold or are storing in whole chunks (what a
        recompute would load rather than compute); 0 for a connector that does not know."""
        return 0

    def request_reset(self, request_id: str) -> None:
        """The engine discarded the request's KV (preempted for recompute, or a failed load)."""
        return None

    def stats(self) -> dict[str, object]:
        return {}


class WorkerConnector(ABC):
    """What each of an engine's workers calls (one per rank)."""

    @abstractmethod
    def register_kv_caches(self, kv) -> WorkerHandshake:
        """This rank's L0 (a `PagedKVCache` or `LayerTensorsKV`): build the rank's transports and report."""

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
    def get_finished(self) -> WorkerReport:
        """What finished on this rank since the last call."""
