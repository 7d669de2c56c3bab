"""Continuous batching with chunked prefill, prefix hits from L0 and the tiers, and preemption.

Scheduler side. The scheduler owns the waiting and running queues, the
`BlockManager` (and through it every block table), and the blocks held for
transfers of requests that no longer own them. Each step it schedules running
requests first (decodes and prefill chunks), preempting the newest when the
pool runs dry, then admits waiting requests within the token budget: L0 hits
first, then whatever the connector can load from the tiers.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tiercache.connector.api import SchedulerConnector
from tiercache.contracts.connector import ConnectorMetadata, ConnectorOutput, StepRequest
from tiercache.contracts.keys import BlockHasher
from tiercache.engine.config import EngineConfig
from tiercache.engine.preemption import Rates, Victim, preemption_policies
from tiercache.engine.sequence import Sequence, SequenceStatus
from tiercache.pool.block_manager import BlockCopy, BlockManager
from tiercache.pool.block_pool import Block


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int            # first token computed this step (== seq.num_computed_tokens when scheduled)
    num_tokens: int       # tokens computed this step
    block_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last token, so it yields a new token."""
        return self.start + self.num_tokens == len(self.seq)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[BlockCopy] = field(default_factory=list)
    connector_meta: ConnectorMetadata | None = None


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, hasher: BlockHasher,
                 connector: SchedulerConnector | None = None, eos_token_id: int | None = None,
                 kv_bytes_per_token: int = 0, kv_groups: int = 0) -> None:
        self.cfg = cfg
        self.kv_groups = kv_groups    # the connector's KV-cache groups (0: none): each reads the one block table
        self.blocks = blocks
        self.hasher = hasher
        self.connector = connector
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, list[list[Block]]] = defaultdict(list)
        self._admitted: set[str] = set()
        self.num_preemptions = 0
        self.preemption = preemption_policies.get(cfg.preemption)()
        self.rates = Rates(kv_bytes_per_token)     # observed by the engine as it runs: what `auto` weighs

    def add(self, seq: Sequence) -> None:
        seq.update_hashes(self.hasher)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[BlockCopy] = []
        queue = list(self.running)
        kept: list[Sequence] = []
        preempted = False
        while queue:
            seq = queue.pop(0)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while True:
                try:
                    copies += self.blocks.ensure_tokens(seq.seq_id, seq.num_computed_tokens + n)
                    break
                except MemoryError:
                    preempted = True
                    victim = queue.pop() if queue else seq
                    self._preempt(victim)
                    if victim is seq:
                        break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append(self._scheduled(seq, n))
                kept.append(seq)
                budget -= n
        self.running = kept
        if not preempted:
            self._admit(scheduled, budget)
        meta = None
        if self.connector is not None:
            meta = self.connector.build_connector_meta([
                StepRequest(s.seq.view(), s.block_ids, s.start + s.num_tokens, self._tables(s.block_ids))
                for s in scheduled
            ])
        return SchedulerOutput(scheduled, copies, meta)

    def _tables(self, block_ids) -> tuple:
        """The block table per KV-cache group: one table serves every group (the pool keeps every block)."""
        return (block_ids,) * self.kv_groups

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, seq.num_computed_tokens, n, tuple(self.blocks.block_ids(seq.seq_id)))

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        bs = self.cfg.block_size
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            hashes = seq.block_hashes if self.cfg.enable_prefix_caching else []
            num_local = self.blocks.cached_prefix_blocks(hashes[:(len(seq) - 1) // bs]) * bs
            num_external = 0
            if self.connector is not None:
                answer = self.connector.get_num_new_matched_tokens(seq.view(), num_local)
                if answer is None:
                    break  # a slow tier is still looking: keep arrival order, ask again next step
                num_external = answer
            try:
                got = self.blocks.allocate(seq.seq_id, len(seq), hashes)
            except MemoryError:
                break
            assert got == num_local, (got, num_local)
            if self.connector is not None:
                ids = self.blocks.block_ids(seq.seq_id)
                self.connector.update_state_after_alloc(seq.view(), ids, num_external, self._tables(ids))
            if seq.seq_id not in self._admitted:
                self._admitted.add(seq.seq_id)
                seq.metrics.l0_hit_tokens = num_local
                seq.metrics.external_hit_tokens = num_external
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_local + num_external
            n = min(len(seq) - seq.num_computed_tokens, budget)
            scheduled.append(self._scheduled(seq, n))
            self.running.append(seq)
            budget -= n

    # -- preemption and release ----------------------------------------------
    def _preempt(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Take ``seq``'s blocks away: swap its KV to a tier when the preemption policy says so and L1 has room,
        else recompute later.

        ``keep_kv=False`` when its KV is invalid (a failed load): never swapped, always recomputed.
        """
        self.num_preemptions += keep_kv
        seq.metrics.preemptions += keep_kv
        swapped = False
        if keep_kv and self.connector is not None:
            rid = seq.seq_id
            others = len(self.waiting) + len(self.running) - (seq in self.running)
            victim = Victim(seq.num_computed_tokens, self.connector.stored_tokens(rid), others)
            if self.preemption.swap(victim, self.rates):
                swapped = self.connector.swap_out(seq.view(), self.blocks.block_ids(rid), seq.num_computed_tokens)
        if not swapped and self.connector is not None:
            self.connector.request_reset(seq.seq_id)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if seq in self.running:
            self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free a preempted ``seq``'s blocks, or hold them while a store still reads them."""
        if self.connector is not None and self.connector.request_preempted(seq.seq_id):
            self.held[seq.seq_id].append(self.blocks.hold(seq.seq_id))
        else:
            self.blocks.free(seq.seq_id)

    # -- after a step --------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Mapping[str, int], conn_out: ConnectorOutput | None,
               now: float) -> list[Sequence]:
        """Advance every scheduled sequence; returns the ones that finished."""
        failed = conn_out.failed_loads if conn_out is not None else frozenset()
        if conn_out is not None and self.connector is not None:
            self.connector.update_connector_output(conn_out.jobs)
        finished = []
        for s in out.scheduled:
            seq = s.seq
            if seq.seq_id in failed:  # its context never arrived: everything this step computed is void
                self._preempt(seq, keep_kv=False)
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            produced = s.samples   # decided before the new token changes the sequence's length
            if produced:
                token = sampled[seq.seq_id]
                seq.token_ids.append(token)
                if seq.metrics.first_token is None:
                    seq.metrics.first_token = now
                seq.update_hashes(self.hasher)
            if self.cfg.enable_prefix_caching:
                full = seq.num_computed_tokens // self.cfg.block_size
                self.blocks.cache_full_blocks(seq.seq_id, seq.block_hashes[:full])
            if produced and self._stopped(seq):
                seq.status = SequenceStatus.FINISHED
                seq.metrics.finished = now
                self.running.remove(seq)
                delay = False
                if self.connector is not None:
                    ids = self.blocks.block_ids(seq.seq_id)
                    delay = self.connector.request_finished(seq.view(), ids, self._tables(ids))
                if delay:
                    self.held[seq.seq_id].append(self.blocks.hold(seq.seq_id))
                else:
                    self.blocks.free(seq.seq_id)
                finished.append(seq)
        if conn_out is not None:
            for rid in conn_out.finished_sending:
                for blocks in self.held.pop(rid, []):
                    self.blocks.pool.unpin(blocks)
        return finished

    def _stopped(self, seq: Sequence) -> bool:
        if seq.aborted or seq.num_output_tokens >= seq.params.max_tokens:
            return True
        return not seq.params.ignore_eos and seq.token_ids[-1] == self.eos_token_id
