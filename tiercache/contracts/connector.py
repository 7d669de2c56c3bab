"""What crosses between the connector's two sides, as plain data in the engine's own channels: a
`WorkerHandshake` per rank once at start, `ConnectorMetadata` down every step, a `WorkerReport` per rank up
every step (aggregated into a `ConnectorOutput`), and the `RequestView` / `StepRequest` an engine hands
the scheduler side."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from tiercache.contracts.groups import KVGroups
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.plan import JobId, JobReport, TransferPlan, WriteBackOrder
from tiercache.contracts.scan import ScanResult


class RequestState(Enum):
    """Where a request stands, as the engine tells the connector; the policies keep or give up its chunks by it
    (`tiercache.policies`: ``retain``)."""
    RUNNING = "running"          # admitted: its chunks are being read or computed
    PREEMPTED = "preempted"      # its blocks were taken back; it resumes soon and wants its chunks again
    FINISHED = "finished"        # done, and nothing says it comes back: what only it wanted goes first
    CONTINUES = "continues"      # done, and a later request resends its tokens (a conversation's next turn)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a connector needs to know about a request."""
    request_id: str
    num_tokens: int                       # tokens the request holds (prompt + generated so far)
    block_hashes: Sequence[BlockHash]     # chained hashes of its full blocks
    continues: bool = False               # a later request resends its tokens (a session's, or the client said so)
    num_computed_tokens: int = 0          # tokens whose KV the engine has computed, its latest scheduled step's too


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request in a scheduled step: its table and how many tokens will be cached after the step. An engine
    whose KV has several groups gives its table per group in ``group_block_ids`` (`NO_BLOCK` where it holds
    none) and its first group's in ``block_ids``."""
    request: RequestView
    block_ids: Sequence[int]
    num_computed_tokens: int
    group_block_ids: Sequence[Sequence[int]] = ()


@dataclass(frozen=True, slots=True)
class WorkerHandshake:
    """Worker → scheduler, once per rank after its KV is registered: what the scheduler's indexes must know."""
    rank: int
    num_ranks: int
    block_bytes: int                      # this rank's bytes of one block, all its layers
    num_slots: int                        # L1 slots this rank allocated (its share of cpu.capacity)
    storage: bytes                        # the digest this rank's stored chunks are filed under
    writer: bool                          # writes lower tiers (False: replicated KV another rank writes)
    stored: Mapping[str, ScanResult] = field(default_factory=dict)   # what persistent tiers hold, per tier
    copies_in_step: bool = False          # L0 ↔ L1 copies complete within the step that asked for them
    block_layout: ChunkLayout | None = None   # dtype and shape of a one-block chunk (sizes quantized chunks)
    groups: KVGroups | None = None        # the KV-cache groups, when the engine's KV has them (`contracts.groups`)

    def chunk_bytes(self, chunk_blocks: int) -> int:
        """This rank's bytes of a stored chunk of ``chunk_blocks`` blocks (a resume point: `RESUME_POINT`)."""
        return self.groups.nbytes(chunk_blocks) if self.groups is not None else chunk_blocks * self.block_bytes

    def slot_bytes(self, blocks_per_chunk: int) -> int:
        """This rank's bytes of an L1 slot: its largest stored object."""
        return self.groups.slot_bytes if self.groups is not None else blocks_per_chunk * self.block_bytes


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """Scheduler → every worker, once per step: the plans to run and whom they serve."""
    loads: tuple[TransferPlan, ...] = ()
    stores: tuple[TransferPlan, ...] = ()
    background: tuple[TransferPlan, ...] = ()   # promotions, spills, copies down, deletes: no request waits
    owners: dict[JobId, str] = field(default_factory=dict)
    delayed: tuple[str, ...] = ()        # finished requests whose blocks the engine keeps until their stores end
    preempted: tuple[str, ...] = ()      # requests whose blocks the engine took back this step
    write_back: WriteBackOrder | None = None   # what to write down at a clean shutdown (write-back tiers only)


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker → scheduler, once per step. ``(rank, seq)`` names a report: an engine that delivers one twice
    (vLLM 0.33 replays failed workers' outputs) has it applied once."""
    rank: int
    jobs: tuple[JobReport, ...] = ()
    finished_sending: frozenset[str] = frozenset()   # delayed requests with no store left on this rank
    failed_loads: frozenset[str] = frozenset()       # requests with a load that failed on this rank
    failed_block_ids: frozenset[int] = frozenset()
    stats: Mapping[str, int] = field(default_factory=dict)   # this rank's counter deltas since the last report
    seq: int = 0                                     # this rank's reports so far, this one included


@dataclass(frozen=True, slots=True)
class ConnectorOutput:
    """What every rank reported for one step, aggregated for the engine: a request finished sending when
    every rank says so, a load failed when any rank's did."""
    jobs: tuple[JobReport, ...] = ()
    finished_sending: frozenset[str] = frozenset()
    failed_loads: frozenset[str] = frozenset()
    failed_block_ids: frozenset[int] = frozenset()
