"""`tiercache bench trace`: replay a Mooncake-format trace through the tiers' own index and policy code.

Metadata only — no KV bytes move. Each 512-token block of the trace (its
``hash_ids``, already prefix-chained) is one chunk. A request hits the leading
run of its chunks the cache holds (prefix semantics), capped at its input
length; then it touches what it hit and stores what it missed.

- `replay`: one tier with an eviction policy at a capacity (in tokens).
- `replay_belady`: the offline reference at a capacity — not a policy, it
  reads the trace's future: it evicts the chunk asked for furthest ahead and
  never keeps one nobody asks for again (Belady's MIN with bypass).
- `replay_hierarchy`: L1 (`CpuIndex`, with 1-byte slots) over L2
  (`MetadataIndex`) driven by the real `CacheManager` — promotions, spills and
  the admission policy (the engine's default, unless named) included — with
  every planned transfer completing at once.

The replays tell the policies each request's state as an engine's connector
does (`RequestState`; policies without ``retain`` ignore it): running when
admitted, and when it finishes (its chunks stored) "continues" for a request
of a conversation (a record with a ``conversation_id``: the client said
another turn may come) or "finished" for any other. Nothing is read from the
trace's future.

Each result counts the chunks written into the tier (L2's, for a hierarchy):
what a policy costs a disk.
"""
from __future__ import annotations

import gzip
import heapq
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import JobOutcome, TransferPlan
from tiercache.manager import CacheManager
from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, GuardedTier, admission_for, admitted_prefix
from tiercache.tiers.cpu import CpuIndex
from tiercache.tiers.metadata import MetadataIndex

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    keys: tuple[BlockHash, ...]
    conversation: str | None = None     # ``conversation_id``: the request is a turn of a conversation

    @classmethod
    def from_record(cls, row: dict) -> TraceRequest:
        """One Mooncake record (a dict); raises KeyError, TypeError or ValueError for a malformed one."""
        conversation = row.get("conversation_id")
        return cls(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                   tuple(BlockHash(int(h).to_bytes(32, "big")) for h in row["hash_ids"]),
                   None if conversation is None else str(conversation))

    @property
    def finished_state(self) -> RequestState:
        """What an engine tells the policies when this request finishes."""
        return RequestState.FINISHED if self.conversation is None else RequestState.CONTINUES


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (gzip-compressed when the name ends in .gz); a malformed line
    raises ValueError naming the line."""
    requests = []
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(TraceRequest.from_record(json.loads(line)))
            except (ValueError, KeyError, TypeError, OverflowError) as err:
                raise ValueError(f"{path}:{n}: not a Mooncake trace record ({err!r})") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


@dataclass(slots=True)
class ReplayResult:
    requests: int = 0
    hit_requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    written_chunks: int = 0     # chunks written into the (lowest) tier: what a disk pays for a policy

    def add(self, request: TraceRequest, hit_chunks: int) -> None:
        hit = min(hit_chunks * TRACE_BLOCK_TOKENS, request.input_length)
        self.requests += 1
        self.input_tokens += request.input_length
        self.hit_tokens += hit
        self.hit_requests += hit > 0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def request_hit_ratio(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0


def unique_chunks(trace: Iterable[TraceRequest]) -> int:
    return len({k for r in trace for k in r.keys})


def split_policy(name: str) -> tuple[str, str]:
    """A row's policy name: ``EVICTION`` or ``EVICTION+ADMISSION`` (admission ``always`` when not named, so that
    a row of ``lru`` is the baseline whatever the default)."""
    eviction, _, admission = name.partition("+")
    return eviction, admission or "always"


def split_tiers(eviction: str) -> tuple[str, str]:
    """``L1/L2``: each tier's eviction policy in a hierarchy replay; one name is both tiers'."""
    l1, _, l2 = eviction.partition("/")
    return l1, l2 or l1


def replay(trace: Sequence[TraceRequest], capacity_tokens: int, policy: str = "lru",
           on_hit: Callable[[int, int], None] | None = None) -> ReplayResult:
    """One tier of ``capacity_tokens`` under ``policy`` (``EVICTION[+ADMISSION]``): each request's chunks after
    its hit are stored — as it finishes — from the head of its chain up to the first the admission refuses.
    ``on_hit(i, n)``: request ``i`` hit its first ``n`` chunks (for analyses of which chunks a policy keeps)."""
    eviction, admission = split_policy(policy)
    tier = MetadataIndex(max(1, capacity_tokens // TRACE_BLOCK_TOKENS), eviction=eviction)
    guard = admission_for(admission, 0, GuardedTier(tier.capacity_bytes)) if admission != "always" else None
    record = getattr(guard, "record", None)
    vouch = getattr(guard, "retain", None)
    result = ReplayResult()
    for i, request in enumerate(trace):
        keys = request.keys
        tier.record(keys)
        if record is not None:
            record(keys)
        hit = tier.contains(keys)
        result.add(request, hit)
        if on_hit is not None:
            on_hit(i, hit)
        if hit:
            tier.prepare_load(keys[:hit])
            tier.complete_load(keys[:hit])
        tier.retain(keys, RequestState.RUNNING)
        if vouch is not None:
            vouch(keys, request.finished_state)
        missing = list(keys[hit:])
        room = tier.capacity_bytes - tier.used_bytes              # chunks: a metadata tier counts one per chunk
        missing = missing[:admitted_prefix(guard, missing, room=room)]
        reserved = [k for k, ok in zip(missing, tier.prepare_store(missing, [1] * len(missing))) if ok]
        tier.complete_store(reserved)
        tier.link([(k, keys[i - 1] if i else None) for i, k in enumerate(keys) if i >= hit])
        tier.retain(keys, request.finished_state)
    result.written_chunks = tier.counters.stored
    return result


def _next_uses(trace: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request, each of its chunks' next request (its index; ``len(trace)`` for never)."""
    never = len(trace)
    upcoming: dict[BlockHash, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        keys = trace[i].keys
        out[i] = [upcoming.get(k, never) for k in keys]
        for k in keys:
            upcoming[k] = i
    return out


def replay_belady(trace: Sequence[TraceRequest], capacity_tokens: int,
                  on_hit: Callable[[int, int], None] | None = None) -> ReplayResult:
    """The offline reference row of `bench trace`: requests hit their leading run of resident chunks, as in
    `replay`; then every chunk of the request is kept when it comes back sooner than some resident chunk (that
    one, asked for furthest ahead, makes room) and never when nobody asks for it again. O(log n) a chunk."""
    capacity = max(1, capacity_tokens // TRACE_BLOCK_TOKENS)
    never = len(trace)
    resident: dict[BlockHash, int] = {}        # chunk → the request that next asks for it
    furthest: list[tuple[int, BlockHash]] = []  # (-next use, chunk); entries whose use has moved on are stale
    result = ReplayResult()
    for i, (request, next_uses) in enumerate(zip(trace, _next_uses(trace))):
        keys = request.keys
        hit = 0
        while hit < len(keys) and keys[hit] in resident:
            hit += 1
        result.add(request, hit)
        if on_hit is not None:
            on_hit(i, hit)
        for key, next_use in zip(keys, next_uses):
            if key not in resident:
                if next_use == never:
                    continue
                if len(resident) >= capacity:
                    while resident.get(furthest[0][1]) != -furthest[0][0]:
                        heapq.heappop(furthest)           # stale: that chunk was asked for since
                    if -furthest[0][0] <= next_use:
                        continue                          # every resident chunk comes back sooner: bypass
                    del resident[heapq.heappop(furthest)[1]]
            elif next_use == never:
                del resident[key]                         # its last use: the room is free now
                continue
            result.written_chunks += key not in resident
            resident[key] = next_use
            heapq.heappush(furthest, (-next_use, key))
    return result


@dataclass(slots=True)
class HierarchyResult(ReplayResult):
    l2_hit_chunks: int = 0

    @property
    def l2_written_chunks(self) -> int:
        return self.written_chunks


def _complete(manager: CacheManager, plans: Iterable[TransferPlan | None]) -> None:
    manager.apply([JobOutcome(p.job_id) for p in plans if p is not None])


def replay_hierarchy(trace: Sequence[TraceRequest], l1_tokens: int, l2_tokens: int, admission: str = DEFAULT_ADMISSION,
                     min_hits: int = 1, write_mode: str = "write-back",
                     eviction: str = DEFAULT_EVICTION, l1_admission: str = "always",
                     promotion: str = "copy") -> HierarchyResult:
    """L1 over L2 through the real cache manager; ``eviction``: both tiers' policy, or ``L1/L2``; ``admission``
    guards what L1 spills into L2, ``l1_admission`` what the engine's stores put into L1, ``promotion`` whether a
    chunk promoted from L2 stays there (``copy``) or leaves (``move``); the manager hears each
    request (`CacheManager.record_request`) and its state (`CacheManager.request_state`) as the connector tells
    it."""
    l1_eviction, l2_eviction = split_tiers(eviction)
    l1 = CpuIndex(max(1, l1_tokens // TRACE_BLOCK_TOKENS), 1, eviction=l1_eviction)
    l2 = MetadataIndex(max(1, l2_tokens // TRACE_BLOCK_TOKENS), eviction=l2_eviction, name="l2")
    guard = admission_for(admission, min_hits, GuardedTier(l2.capacity_bytes, l1.capacity_bytes))
    entry_guard = (admission_for(l1_admission, min_hits, GuardedTier(l1.capacity_bytes))
                   if l1_admission != "always" else None)
    manager = CacheManager(l1, block_size=TRACE_BLOCK_TOKENS, blocks_per_chunk=1, block_bytes=1,
                           lower=[l2], write_mode=write_mode, admission=guard, l1_admission=entry_guard,
                           promotion=promotion)
    result = HierarchyResult()
    for request in trace:
        keys = request.keys
        manager.record_request(keys)
        lookup = manager.lookup_chunks(keys, len(keys))
        while manager.promote(lookup):             # as the connector does: ask again while chunks are on their way
            result.l2_hit_chunks += sum(len(r.keys) for r in lookup.runs if r.tier == "l2")
            _complete(manager, manager.take_background())
            lookup = manager.lookup_chunks(keys, len(keys))
        lookup = manager.in_l1(lookup)
        hit = lookup.num_hit_blocks
        result.add(request, hit)
        manager.request_state(keys, RequestState.RUNNING)
        if hit:
            _complete(manager, manager.plan_load(lookup, range(len(keys))))
        _complete(manager, [manager.plan_store_chunks(keys, range(len(keys)), len(keys), first_chunk=hit)])
        manager.request_state(keys, request.finished_state)
        _complete(manager, manager.take_background())
    result.written_chunks = l2.counters.stored
    return result
