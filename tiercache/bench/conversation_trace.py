"""Conversation traces in the Mooncake format, generated: many multi-turn chats among one-off requests.

The repository's Mooncake trace has no conversation ids, and the real
conversation traces that have them are not ours to ship. This writes traces
of the same shape as the demo's multi-turn workload, at a fleet's scale:

- conversations start as a Poisson process; each opens with one of a few
  system prompts (Zipf-popular), has 1 + a geometric number of turns, and
  every turn resends the whole history (system prompt, every earlier
  question and answer) plus a new question, after a think time;
- one-off requests (a document and a question, no conversation) arrive as a
  Poisson process of their own, some behind a system prompt.

Every record is a Mooncake record — ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one per 512-token block of the input; a
block's id names its content, so a turn's blocks are the previous turn's
plus new ones, and a partial last block is its own) — plus
``conversation_id`` for the requests of a conversation (absent on one-offs).
Deterministic by seed.
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class ConversationTraceSpec:
    conversations: int = 2000
    conversation_rate: float = 0.5     # conversations started per second
    mean_turns: float = 4.0            # 1 + geometric: mean turns per conversation
    max_turns: int = 24
    think_s: float = 90.0              # mean pause between an answer and the next question
    system_prompts: int = 12
    system_tokens: int = 2048
    zipf: float = 1.1
    question_tokens: int = 350         # means of log-normal lengths (sigma 0.8)
    answer_tokens: int = 250
    one_off_rate: float = 0.5          # one-off requests per second
    document_tokens: int = 4000
    one_off_system_share: float = 0.5  # one-offs behind a system prompt
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "max_turns", "system_prompts", "system_tokens", "question_tokens",
                     "answer_tokens", "document_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"conversation trace: {name} must be positive, got {getattr(self, name)}")
        for name in ("conversation_rate", "think_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"conversation trace: {name} must be positive, got {getattr(self, name)}")
        if self.mean_turns < 1:
            raise ValueError(f"conversation trace: mean_turns must be at least 1, got {self.mean_turns}")
        if self.one_off_rate < 0 or not 0 <= self.one_off_system_share <= 1:
            raise ValueError("conversation trace: one_off_rate must be ≥ 0 and one_off_system_share in [0, 1]")


class _Blocks:
    """Block ids by content: a full block of a token stream is one id wherever it appears; a partial last
    block is an id of its own (the next turn fills it with other tokens)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self._next = itertools.count()

    def id(self, content: tuple) -> int:
        found = self._ids.get(content)
        if found is None:
            found = self._ids[content] = next(self._next)
        return found

    def fresh(self) -> int:
        return next(self._next)

    def of(self, stream: tuple, length: int, full: list[int]) -> list[int]:
        """Ids of the first ``length`` tokens of ``stream`` (a name), reusing ``full``: the ids of its full
        blocks found so far (extended in place)."""
        while len(full) < length // BLOCK_TOKENS:
            full.append(self.id((*stream, len(full))))
        return full[:length // BLOCK_TOKENS] + ([self.fresh()] if length % BLOCK_TOKENS else [])


@dataclass(slots=True)
class _Conversation:
    system: int                 # which system prompt it opens with
    turns: int                  # how many requests it sends
    length: int                 # tokens of its history so far
    turn: int = 0
    full: list[int] = field(default_factory=list)   # ids of its history's full blocks found so far


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def generate(spec: ConversationTraceSpec) -> Iterator[dict]:
    """The trace's records, in timestamp order."""
    rng = random.Random(spec.seed)
    weights = [1 / (i + 1) ** spec.zipf for i in range(spec.system_prompts)]
    blocks = _Blocks()
    system_full: dict[int, list[int]] = {}
    events: list[tuple[float, int, int]] = []        # (time s, tie-break, conversation or -1 for a one-off)
    tie = itertools.count()
    state: dict[int, _Conversation] = {}
    t = 0.0
    for c in range(spec.conversations):
        t += rng.expovariate(spec.conversation_rate)
        stop = 1 - 1 / spec.mean_turns
        turns = 1
        while turns < spec.max_turns and rng.random() < stop:
            turns += 1
        system = rng.choices(range(spec.system_prompts), weights)[0]
        state[c] = _Conversation(system, turns, spec.system_tokens)
        heapq.heappush(events, (t, next(tie), c))
    horizon = t
    if spec.one_off_rate > 0:
        t = rng.expovariate(spec.one_off_rate)
        while t < horizon:
            heapq.heappush(events, (t, next(tie), -1))
            t += rng.expovariate(spec.one_off_rate)
    one_offs = itertools.count()
    while events:
        t, _, c = heapq.heappop(events)
        output = _lognormal(rng, spec.answer_tokens)
        if c < 0:
            n = next(one_offs)
            behind = rng.random() < spec.one_off_system_share
            system = rng.choices(range(spec.system_prompts), weights)[0] if behind else None
            length = (spec.system_tokens if behind else 0) + _lognormal(rng, spec.document_tokens) \
                + _lognormal(rng, spec.question_tokens)
            ids = blocks.of(("one-off", n), length, [])
            if behind:
                head = _system_ids(blocks, system_full, system, spec)
                ids = head + ids[len(head):]
            yield {"timestamp": round(t * 1000), "input_length": length, "output_length": output, "hash_ids": ids}
            continue
        conversation = state[c]
        conversation.length += _lognormal(rng, spec.question_tokens)
        head = _system_ids(blocks, system_full, conversation.system, spec)
        ids = head + blocks.of(("conversation", c), conversation.length, conversation.full)[len(head):]
        yield {"timestamp": round(t * 1000), "input_length": conversation.length, "output_length": output,
               "hash_ids": ids, "conversation_id": f"c{c}"}
        conversation.length += output
        conversation.turn += 1
        if conversation.turn < conversation.turns:
            heapq.heappush(events, (t + rng.expovariate(1 / spec.think_s), next(tie), c))
        else:
            del state[c]


def _system_ids(blocks: _Blocks, system_full: dict[int, list[int]], system: int,
                spec: ConversationTraceSpec) -> list[int]:
    """The full blocks of system prompt ``system`` (a partial last block belongs to what follows it)."""
    full = system_full.setdefault(system, [])
    return blocks.of(("system", system), spec.system_tokens - spec.system_tokens % BLOCK_TOKENS, full)


def write(path: str | Path, spec: ConversationTraceSpec) -> int:
    """Write the trace as JSON lines; returns how many requests."""
    n = 0
    with open(path, "w") as f:
        for record in generate(spec):
            f.write(json.dumps(record) + "\n")
            n += 1
    return n
