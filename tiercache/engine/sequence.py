"""A request as the engine sees it: its tokens, its progress, its chained block hashes.

Scheduler side. A `Sequence` owns its tokens and hashes; its block table is
owned by the `BlockManager` under the sequence's id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from tiercache.contracts.connector import RequestView
from tiercache.contracts.keys import BlockHash, BlockHasher


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0      # 0 = greedy
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(slots=True)
class SeqMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    l0_hit_tokens: int = 0          # prompt tokens found in the engine's own pool
    external_hit_tokens: int = 0    # prompt tokens loaded from the tiers
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class Sequence:
    def __init__(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str = "", continues: bool = False) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id!r} has an empty prompt")
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt   # a tenant's: its blocks chain from a seed of their own
        self.continues = continues     # a later request resends its tokens (the tiers keep its chunks)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0   # tokens whose KV is in L0
        self.block_hashes: list[BlockHash] = []
        self.metrics = SeqMetrics()
        self.logits: list = []         # kept only when the engine records logits (tests)
        self.aborted = False           # its client left: it ends at its next token (`LLMEngine.abort`)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def update_hashes(self, hasher: BlockHasher) -> None:
        """Hash the blocks that became full since the last call (chained on the last hash)."""
        bs = hasher.block_size
        done = len(self.block_hashes)
        full = len(self.token_ids) // bs
        if full > done:
            parent = self.block_hashes[-1] if done else hasher.seed_for(self.cache_salt)
            self.block_hashes.extend(hasher.hash_blocks(self.token_ids[done * bs:full * bs], parent=parent))

    def view(self) -> RequestView:
        return RequestView(self.seq_id, len(self.token_ids), self.block_hashes, self.continues,
                           self.num_computed_tokens)
