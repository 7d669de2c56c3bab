"""Turns a scheduled step into one model forward, with the connector's worker hooks around it.

Worker side. Builds the flat batch (token ids, positions, the slot of every
new token, each sequence's block table), applies copy-on-write copies, starts
the step's loads, runs the model (waiting per layer for loaded KV), hands the
step's stores over, and samples.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from tiercache.arith import ceil_div
from tiercache.contracts.connector import ConnectorMetadata
from tiercache.engine.model import AttentionBatch, LlamaModel, SeqSlice
from tiercache.engine.sampler import sample
from tiercache.engine.scheduler import SchedulerOutput
from tiercache.pool.kv_cache import PagedKVCache


class StepWorker(Protocol):
    """The connector's worker side as the runner drives it (every rank at once: `RankGroup`)."""

    def bind_connector_meta(self, meta: ConnectorMetadata) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...

    def wait_for_save(self) -> None: ...


class _ConnectorHooks:
    def __init__(self, worker: StepWorker) -> None:
        self.worker = worker

    def before_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_layer(self, layer: int) -> None:
        self.worker.save_kv_layer(layer)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: PagedKVCache, worker: StepWorker | None = None,
                 record_logits: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.worker = worker
        self.hooks = _ConnectorHooks(worker) if worker is not None else None
        self.record_logits = record_logits

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns the sampled token of every sequence that produced one."""
        if out.copies:
            self.kv.copy_blocks([c.src for c in out.copies], [c.dst for c in out.copies])
        if self.worker is not None:
            if out.connector_meta is not None:
                self.worker.bind_connector_meta(out.connector_meta)
            self.worker.start_load_kv()
        sampled: dict[str, int] = {}
        if out.scheduled:
            sampled = self._forward(out)
        if self.worker is not None:
            self.worker.wait_for_save()
        return sampled

    def time_prefill(self, tokens: int, context: int) -> float:
        """Seconds one forward of ``tokens`` prompt tokens after ``context`` earlier ones takes on this model, with
        no connector, over the pool's first blocks (their KV is overwritten with noise: only for a pool that holds
        nothing yet, as a profile run before serving)."""
        bs = self.block_size
        end = context + tokens
        positions = torch.arange(context, end)
        table = torch.arange(ceil_div(end, bs), dtype=torch.int64)
        batch = AttentionBatch([SeqSlice(0, tokens, end, table)], positions)   # block i holds positions i·bs…
        ids = torch.randint(0, self.model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        self.model(ids, positions, batch, self.kv, None, torch.tensor([tokens - 1]))
        return time.perf_counter() - start

    def _forward(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        ids, pos, slots, seqs, rows, samplers = [], [], [], [], [], []
        row = 0
        for s in out.scheduled:
            end = s.start + s.num_tokens
            positions = torch.arange(s.start, end)
            table = torch.as_tensor(s.block_ids, dtype=torch.int64)
            ids.append(torch.as_tensor(s.seq.token_ids[s.start:end], dtype=torch.int64))
            pos.append(positions)
            slots.append(table[positions // bs] * bs + positions % bs)
            seqs.append(SeqSlice(row, row + s.num_tokens, end, table[:ceil_div(end, bs)]))
            row += s.num_tokens
            if s.samples:
                rows.append(row - 1)
                samplers.append(s)
        batch = AttentionBatch(seqs, torch.cat(slots))
        logits_rows = torch.as_tensor(rows, dtype=torch.int64)
        logits = self.model(torch.cat(ids), torch.cat(pos), batch, self.kv, self.hooks, logits_rows)
        if self.record_logits:
            for i, s in enumerate(samplers):
                s.seq.logits.append(logits[i].clone())
        tokens = sample(logits, [s.seq.params for s in samplers], [s.seq.num_output_tokens for s in samplers])
        return {s.seq.seq_id: t for s, t in zip(samplers, tokens)}
