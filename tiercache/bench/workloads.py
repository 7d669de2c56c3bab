"""Synthetic request streams for the engine benchmarks, deterministic by seed.

Prompts are token-id lists (byte tokens 0–255 after a BOS), so every run of a
workload sends identical prompts. Multi-turn conversations take the model's
own previous answers into the next prompt, so they are built turn by turn
through a callback.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

BOS = 256

Generate = Callable[[list[int]], list[int]]   # prompt → output tokens


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str = "shared-prefix"
    requests: int = 16
    prefix_tokens: int = 2048     # shared system prompt / document length
    suffix_tokens: int = 64       # question or user turn
    output_tokens: int = 8
    turns: int = 4                # multi-turn: turns per conversation
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; known: {', '.join(WORKLOADS)}")
        for field in ("requests", "prefix_tokens", "suffix_tokens", "output_tokens", "turns"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")

    def rng(self) -> random.Random:
        """This workload's own token stream: two workloads never share prompts (so one run's cache cannot
        inflate another's hit ratio), and a workload's prompts are the same in every process."""
        return random.Random(f"{self.name}:{self.seed}")

    @property
    def max_tokens(self) -> int:
        """At least as many tokens as the longest request holds once its output is generated (multi-turn
        counts a last turn's output once more)."""
        longest_prompt = {
            "multi-turn": self.prefix_tokens + self.turns * (self.suffix_tokens + self.output_tokens),
            "long-doc": 2 * self.prefix_tokens + self.suffix_tokens,
        }.get(self.name, self.prefix_tokens + self.suffix_tokens)
        return 1 + longest_prompt + self.output_tokens    # BOS first


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def shared_prefix(spec: WorkloadSpec, generate: Generate) -> Iterator[tuple[list[int], list[int]]]:
    """One system prompt, then a different question per request."""
    rng = spec.rng()
    system = [BOS, *_text(rng, spec.prefix_tokens)]
    for _ in range(spec.requests):
        prompt = system + _text(rng, spec.suffix_tokens)
        yield prompt, generate(prompt)


def multi_turn(spec: WorkloadSpec, generate: Generate) -> Iterator[tuple[list[int], list[int]]]:
    """Conversations of ``turns`` turns; each prompt is the whole history plus a new user turn."""
    rng = spec.rng()
    conversations = max(1, spec.requests // spec.turns)
    histories = [[BOS, *_text(rng, spec.prefix_tokens)] for _ in range(conversations)]
    for _ in range(spec.turns):
        for c in range(conversations):
            prompt = histories[c] + _text(rng, spec.suffix_tokens)
            out = generate(prompt)
            histories[c] = prompt + out
            yield prompt, out


def long_doc(spec: WorkloadSpec, generate: Generate) -> Iterator[tuple[list[int], list[int]]]:
    """A few long documents, several questions about each, documents interleaved."""
    rng = spec.rng()
    docs = [[BOS, *_text(rng, spec.prefix_tokens * 2)] for _ in range(max(1, spec.requests // 4))]
    for i in range(spec.requests):
        prompt = docs[i % len(docs)] + _text(rng, spec.suffix_tokens)
        yield prompt, generate(prompt)


def docs(spec: WorkloadSpec, generate: Generate) -> Iterator[tuple[list[int], list[int]]]:
    """Several documents (``prefix_tokens`` each) and a question at a time about one of them, in an order that
    comes back to some soon (while their KV is in a fast tier) and to the first ones only at the end (long
    after): 0, 1, 0, 2, 1, 3, 2, ... then 0, 1, 2, ...."""
    rng = spec.rng()
    near = max(2, (spec.requests + 1) * 2 // 3 // 2)        # documents opened in the first part
    order = [0] + [d for k in range(1, near) for d in (k, k - 1)]
    order += [i % near for i in range(spec.requests - len(order))]
    texts = [[BOS, *_text(rng, spec.prefix_tokens)] for _ in range(near)]
    for d in order[:spec.requests]:
        prompt = texts[d] + _text(rng, spec.suffix_tokens)
        yield prompt, generate(prompt)


def no_reuse(spec: WorkloadSpec, generate: Generate) -> Iterator[tuple[list[int], list[int]]]:
    """Every prompt is new: nothing can hit, so any difference from no cache is the cost of storing."""
    rng = spec.rng()
    for _ in range(spec.requests):
        prompt = [BOS, *_text(rng, spec.prefix_tokens + spec.suffix_tokens)]
        yield prompt, generate(prompt)


WORKLOADS = {"docs": docs, "shared-prefix": shared_prefix, "multi-turn": multi_turn, "long-doc": long_doc,
             "no-reuse": no_reuse}
