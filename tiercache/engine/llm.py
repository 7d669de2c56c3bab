"""The engine facade: `LLMEngine` (add requests, step) and `LLM` (generate a batch of prompts).

Owns one of each: model, L0 pool, scheduler, runner, and optionally the
tiercache connector. With ``offload=None`` the engine runs without tiers.
"""
from __future__ import annotations

import hashlib
import itertools
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tiercache.arith import ceil_div
from tiercache.config import TierCacheConfig
from tiercache.contracts.groups import KVGroup, KVGroups
from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import DEVICE
from tiercache.engine.config import EngineConfig, ModelConfig
from tiercache.engine.runner import ModelRunner
from tiercache.engine.scheduler import Scheduler
from tiercache.engine.sequence import SamplingParams, Sequence
from tiercache.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tiercache.engine.weights import config_from_hf, load_hf_model, seeded_model
from tiercache.errors import ConfigError
from tiercache.machine import physical_memory
from tiercache.pool import BlockManager, BlockPool, PagedKVCache
from tiercache.pool.group_pages import GroupPagesKV
from tiercache.tier_events import TierEvent


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    ttft_s: float
    l0_hit_tokens: int
    external_hit_tokens: int
    preemptions: int
    logits: list[torch.Tensor]


def hybrid_pages(kv: PagedKVCache, cfg: ModelConfig, blocks_per_chunk: int) -> GroupPagesKV:
    """A hybrid model's pool as KV-cache groups for the connector: its full-attention layers, its sliding-window
    layers (each layer's K and V planes as pages of their own) and its linear-attention layers' states."""
    def planes(kind: str) -> list[torch.Tensor]:
        layers = [i for i in range(cfg.num_layers) if cfg.layer_type(i) == kind]
        return [kv.kv[i, plane].reshape(kv.num_blocks, -1).view(torch.uint8) for i in layers for plane in (0, 1)]

    pages = [planes("full_attention"), planes("sliding_attention"),
             [kv.state(i).view(torch.uint8) for i in kv.state_layers]]
    kinds = [("full-attention", 0), ("sliding-window", cfg.sliding_window), ("block-state", 0)]
    groups = [(KVGroup(kind, len(p), p[0].shape[1], window), p) for (kind, window), p in zip(kinds, pages) if p]
    layout = KVGroups(tuple(g for g, _ in groups), kv.block_size, blocks_per_chunk)
    return GroupPagesKV(layout, [p for _, p in groups], kv.num_blocks)


def _namespace(model_cfg: ModelConfig, engine_cfg: EngineConfig, model_path: str | None, salt: str) -> Namespace:
    geometry = KVGeometry(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, model_cfg.dtype)
    if model_path is None:
        model_id, revision = "tiercache-reference", f"seed-{engine_cfg.seed}-{model_cfg!r}"
    else:
        path = Path(model_path)
        digest = hashlib.sha256((path / "config.json").read_bytes())
        for f in sorted(path.glob("*.safetensors")):
            digest.update(f"{f.name}:{f.stat().st_size}".encode())
        model_id, revision = path.name, digest.hexdigest()[:16]
    return Namespace(model_id, geometry, engine_cfg.block_size, revision, salt)


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """What computing prompt tokens costs this engine: ``n`` tokens after ``c`` cached ones take
    ``n / tokens_per_s + n·(c + n/2)·attention_s_per_pair`` seconds (a router's estimate,
    `tiercache.fleet.routing.Rates.prefill_s`)."""
    tokens_per_s: float
    attention_s_per_pair: float


PROFILE_FRESH_TOKENS = 512      # measure_prefill's shapes: a prompt with nothing cached ...
PROFILE_TURN_TOKENS = 64        # ... and a short turn after a long context, attention most of its time
PROFILE_CONTEXT_TOKENS = 2048


COPY_RATES_EVERY = 32      # steps between readings of the connector's copy rates (a stats call)


class LLMEngine:
    def __init__(
        self,
        model_cfg: ModelConfig | None = None,
        engine_cfg: EngineConfig | None = None,
        offload: TierCacheConfig | None = None,
        model_path: str | None = None,
        tokenizer: Tokenizer | str | None = None,
        record_logits: bool = False,
        metrics_port: int | None = None,
    ) -> None:
        self.engine_cfg = engine_cfg = engine_cfg or EngineConfig()
        if model_path is not None:
            model_cfg = config_from_hf(Path(model_path), (model_cfg or ModelConfig()).dtype)
            self.model = load_hf_model(model_path, model_cfg.dtype)
        else:
            model_cfg = model_cfg or ModelConfig()
            self.model = seeded_model(model_cfg, engine_cfg.seed)
        self.model_cfg = model_cfg
        self.tokenizer: Tokenizer = (
            HFTokenizer(tokenizer) if isinstance(tokenizer, str) else (tokenizer or ByteTokenizer())
        )
        if offload is not None and offload.keys.block_size != engine_cfg.block_size:
            raise ConfigError("keys.block_size", offload.keys.block_size,
                              f"must equal the engine's block size ({engine_cfg.block_size})")
        if model_cfg.num_kv_heads % engine_cfg.tensor_parallel_size:
            raise ConfigError("engine.tensor_parallel_size", engine_cfg.tensor_parallel_size,
                              f"must divide the model's {model_cfg.num_kv_heads} KV heads")
        kv_bytes = (engine_cfg.num_blocks * engine_cfg.block_size * model_cfg.num_layers * 2 * model_cfg.num_kv_heads
                    * model_cfg.head_dim * torch.empty((), dtype=getattr(torch, model_cfg.dtype)).element_size())
        if kv_bytes > physical_memory():
            raise ConfigError("engine.num_blocks", engine_cfg.num_blocks,
                              f"the pool would take {kv_bytes} B, more than this machine's memory")
        self.namespace = _namespace(model_cfg, engine_cfg, model_path, offload.keys.tenant_salt if offload else "")
        if model_cfg.hybrid and engine_cfg.tensor_parallel_size > 1:
            raise ConfigError("engine.tensor_parallel_size", engine_cfg.tensor_parallel_size,
                              "a hybrid model (model.layer_types) runs on one rank")
        if model_cfg.hybrid and offload is not None and engine_cfg.preemption != "recompute":
            raise ConfigError("engine.preemption", engine_cfg.preemption,
                              "a hybrid model with a connector preempts by recompute (its swap copies are whole "
                              "chunks of one group)")
        state_layers = [i for i in range(model_cfg.num_layers) if model_cfg.layer_type(i) == "linear_attention"]
        self.kv = PagedKVCache(self.namespace.geometry, engine_cfg.num_blocks, engine_cfg.block_size, engine_cfg.device,
                               num_shards=engine_cfg.tensor_parallel_size, state_layers=state_layers,
                               state_size=model_cfg.hidden_size)
        self.pool = BlockPool(engine_cfg.num_blocks)
        self.blocks = BlockManager(self.pool, engine_cfg.block_size)
        self.hasher = BlockHasher(self.namespace, offload.keys.hash if offload else "sha256")
        self.connector = None
        if offload is not None:
            from tiercache.connectors.reference import ReferenceConnector
            ranks = [hybrid_pages(self.kv, model_cfg, offload.keys.blocks_per_chunk)] if model_cfg.hybrid else self.kv
            self.connector = ReferenceConnector(offload, self.namespace, ranks)
        self.scheduler = Scheduler(engine_cfg, self.blocks, self.hasher,
                                   self.connector.scheduler if self.connector else None,
                                   eos_token_id=self.tokenizer.eos_token_id,
                                   kv_bytes_per_token=kv_bytes // (engine_cfg.num_blocks * engine_cfg.block_size
                                                                   * engine_cfg.tensor_parallel_size),
                                   kv_groups=len(ranks[0].groups.groups) if self.connector and model_cfg.hybrid else 0)
        self._steps = 0
        self._busy_s = 0.0          # seconds spent in steps that computed tokens: busy / elapsed is utilization
        self._busy_steps = 0        # those steps (a step that only waits for transfers is neither)
        self.runner = ModelRunner(self.model, self.kv, self.connector.worker if self.connector else None,
                                  record_logits=record_logits)
        self._ids = itertools.count()
        self._metrics = None
        if metrics_port is not None:
            from tiercache.metrics import serve_metrics
            try:
                self._metrics = serve_metrics(self.stats, metrics_port)
            except (OSError, OverflowError) as err:
                self.close()
                raise ConfigError(
                    "metrics_port", metrics_port, f"cannot listen: {getattr(err, 'strerror', err)}"
                ) from None

    def measure_prefill(self, reps: int = 3) -> PrefillCost | None:
        """This engine's prefill cost, timed on its own model before it serves anything (vLLM, too, runs dummy
        forward passes before it serves): a fresh prompt, and a short turn after a long context, medians
        of ``reps`` forwards each, solved for the two parts of `PrefillCost` (one rate per token when they
        cannot be told apart). None once the pool is in use or too small for the shapes."""
        bs, capacity = self.engine_cfg.block_size, self.engine_cfg.num_blocks * self.engine_cfg.block_size
        if self.pool.num_free < self.pool.num_blocks or self.pool.cached or capacity < 2 * PROFILE_TURN_TOKENS:
            return None
        context = min(PROFILE_CONTEXT_TOKENS, capacity) - PROFILE_TURN_TOKENS
        fresh, turn = min(PROFILE_FRESH_TOKENS, capacity), PROFILE_TURN_TOKENS
        self.runner.time_prefill(bs, 0)                  # the first forward pays for lazy setup
        t_fresh = statistics.median(self.runner.time_prefill(fresh, 0) for _ in range(reps))
        t_turn = statistics.median(self.runner.time_prefill(turn, context) for _ in range(reps))
        # fresh·x + fresh·(fresh/2)·y = t_fresh and turn·x + turn·(context + turn/2)·y = t_turn, x = 1 / tokens_per_s
        a, b, c, d = fresh, fresh * fresh / 2, turn, turn * (context + turn / 2)
        det = a * d - b * c
        per_token, per_pair = (d * t_fresh - b * t_turn) / det, (a * t_turn - c * t_fresh) / det
        if per_token > 0 and per_pair > 0:
            return PrefillCost(1 / per_token, per_pair)
        return PrefillCost((fresh + turn) / (t_fresh + t_turn), 0.0)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str = "", continues: bool = False) -> Sequence:
        """Queue a request; ``cache_salt`` (a tenant's) keeps its blocks apart from every other salt's;
        ``continues``: a later request will resend its tokens (a conversation's next turn), so the tiers keep
        its chunks when it finishes (`RequestState.CONTINUES`)."""
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(t < 0 or t >= self.model_cfg.vocab_size for t in tokens):
            raise ValueError(f"prompt has token ids outside the vocabulary (0..{self.model_cfg.vocab_size - 1})")
        params = params or SamplingParams()
        if len(tokens) + params.max_tokens > self.model_cfg.max_position:
            raise ValueError(f"prompt of {len(tokens)} + {params.max_tokens} tokens exceeds max_position "
                             f"{self.model_cfg.max_position}")
        need = ceil_div(len(tokens) + params.max_tokens, self.engine_cfg.block_size)
        if need > self.engine_cfg.num_blocks:
            raise ValueError(f"request needs {need} blocks; the pool has {self.engine_cfg.num_blocks}")
        seq = Sequence(request_id or f"req-{next(self._ids)}", tokens, params, cache_salt, continues)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Its client is gone: the sequence ends at its next token, through the way every sequence ends (its
        blocks freed or held for their stores, the connector told), rather than decoding to its max_tokens for
        nobody."""
        seq.aborted = True

    def step(self) -> list[Sequence]:
        began = time.perf_counter()
        out = self.scheduler.schedule()
        started = time.perf_counter()
        sampled = self.runner.execute(out)
        self.scheduler.rates.observe_step(sum(s.num_tokens for s in out.scheduled), time.perf_counter() - started)
        self._steps += 1
        if self.connector is not None and self._steps % COPY_RATES_EVERY == 0:
            self._observe_copies()
        # with nothing scheduled only transfers are running (promotions, held stores): wait for them a moment
        conn_out = self.connector.worker.get_finished(idle=not out.scheduled) if self.connector else None
        finished = self.scheduler.update(out, sampled, conn_out, time.perf_counter())
        if out.scheduled:
            self._busy_s += time.perf_counter() - began
            self._busy_steps += 1
        return finished

    def _observe_copies(self) -> None:
        """Rank 0's copy times between the pool and L1 (every rank copies its share at once), for the
        preemption policy's rates."""
        manager = self.connector.scheduler.manager
        if manager is None:
            return
        routes: dict[str, tuple[float, int]] = {}
        for link in self.connector.workers[0].stats()["transfers"].values():
            for name, r in link.get("routes", {}).items():
                seconds, blocks = routes.get(name, (0.0, 0))
                routes[name] = (seconds + r["seconds"], blocks + r["blocks"])
        l1 = manager.l1.name
        self.scheduler.rates.observe_copies(routes, self.engine_cfg.block_size, f"{DEVICE}→{l1}", f"{l1}→{DEVICE}")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def run(self) -> list[Sequence]:
        finished = []
        while self.has_unfinished():
            finished += self.step()
        return finished

    @property
    def metrics_port(self) -> int | None:
        """The Prometheus endpoint's port (useful when started with port 0), or None."""
        return None if self._metrics is None else self._metrics[0].server_port

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
            self.tokenizer.decode(seq.output_token_ids), seq.metrics.ttft or 0.0,
            seq.metrics.l0_hit_tokens, seq.metrics.external_hit_tokens, seq.metrics.preemptions, seq.logits,
        )

    # -- KV events: what reached and left the engine's pool and each tier, for a router ---------------
    def watch_kv_events(self) -> None:
        """Record, from now on, every block that enters or leaves the pool and every chunk that reaches or
        leaves a tier, for `take_kv_events`."""
        self.pool.watch_changes()
        if self._manager is not None:
            self._manager.watch_events()

    def take_kv_events(self) -> list[TierEvent]:
        """What changed since the last call, in order per medium: the pool's blocks (`Medium.DEVICE`, keys of
        ``block_size`` tokens) and the tiers' chunks (keys of ``keys.chunk_tokens``)."""
        events = [TierEvent(stored, "L0", Medium.DEVICE, tuple(h for _, h in run))
                  for stored, run in itertools.groupby(self.pool.take_changes(), key=lambda change: change[0])]
        if self._manager is not None:
            events += self._manager.take_events()
        return events

    def apply_purges(self) -> None:
        """Apply the purges the shared tiers announced (each step does; an idle engine's loop calls this)."""
        if self._manager is not None:
            self._manager.apply_purges()

    def held_kv(self) -> list[TierEvent]:
        """Everything held now, as arrivals: the pool's cached blocks and every local tier's chunks (a remote
        tier's index is its server's; it is not listed). A router that lost events starts again from it."""
        held = [TierEvent(True, "L0", Medium.DEVICE, tuple(self.pool.cached))]
        if self._manager is not None:
            held += [TierEvent(True, t.name, t.medium, tuple(keys)) for t in self._manager.tiers
                     if (keys := t.held_keys())]
        return held

    @property
    def _manager(self):
        return self.connector.scheduler.manager if self.connector is not None else None

    def stats(self) -> dict[str, object]:
        pool = self.pool.stats()
        out: dict[str, object] = {
            "blocks": {"total": pool.num_blocks, "used": pool.used, "pinned": pool.pinned,
                       "evictable": pool.evictable, "empty": pool.empty,
                       "held_for_transfers": sum(len(b) for lists in self.scheduler.held.values() for b in lists)},
            "preemptions": self.scheduler.num_preemptions,
            "engine": {"steps": self._busy_steps, "busy_seconds": self._busy_s,
                       # of those seconds, loading into the pool or waiting for loads (rank 0: ranks load at once)
                       "load_seconds": self.connector.workers[0].load_seconds if self.connector is not None else 0.0,
                       "requests_running": len(self.scheduler.running),
                       "requests_waiting": len(self.scheduler.waiting)},
        }
        if self.connector is not None:
            out["connector"] = self.connector.stats()
        return out

    def close(self) -> None:
        if self._metrics is not None:
            server, thread = self._metrics
            server.shutdown()
            thread.join()
            self._metrics = None
        if self.connector is not None:
            self.connector.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LLM(LLMEngine):
    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run all prompts to completion together (continuous batching); outputs in prompt order."""
        seqs = [self.add_request(p, params) for p in prompts]
        self.run()
        return [self.output(s) for s in seqs]
