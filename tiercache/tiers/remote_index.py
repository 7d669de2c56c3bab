"""What the remote tiers (Redis, `tiercache serve`) share on the scheduler side: `RemoteIndex`.

The server owns the data, so a remote tier keeps no index and cannot pin: a
chunk evicted between lookup and read is a failed read, hence a miss.

`RemoteIndex` answers lookups from a thread of its own:
`contains` hands a query to that thread and answers None ("ask again") until
the reply is in, so the scheduler's thread never waits on the network; a
query that takes longer than ``lookup_timeout`` is a miss, and
``SLOW_LOOKUPS_DOWN`` of them in a row (a hung server, not a loaded one) mark
the tier down, as any other failure of a query does at once. A reply
serves the same lookup for ``ANSWER_TTL_S``; a chunk that went meanwhile is a
failed promotion, hence a miss — and then *absent*: a chunk whose load failed
on any rank (corrupt, gone, unreachable), or that was deleted, is a negative
entry for ``ABSENT_TTL_S`` or until it is stored again, and every answer is
cut at the first such key, cached replies included. So one bad value costs
one failed load, not a promotion re-planned every step while a cached
"present" lasts (a retry storm any writer to the store could set off). A chunk
is present only when every writing rank's value is (each rank stores its own
share of the KV under its own storage digest). Deletes of values found
corrupt are background work: `take_deletes` hands them to the workers.
"""
from __future__ import annotations

import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from tiercache.contracts.keys import BlockHash, first_held, tail_keys
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure
from tiercache.index.tier_index import Reach
from tiercache.tiers.base import LowerIndex
from tiercache.tiers.outage import Outage
from tiercache.wire.chunk_format import ChunkFormat

MAX_ANSWERS = 1024        # lookups answered or in flight (oldest dropped first)
ANSWER_TTL_S = 1.0        # an answer serves the same lookup for this long, then it is asked again
ABSENT_TTL_S = 10.0       # a chunk that failed to load, or was deleted, is absent this long (or until stored)
SLOW_LOOKUPS_DOWN = 3     # lookups in a row past the lookup timeout before the tier counts as down
MAX_ABSENT = 65536        # negative entries kept (oldest dropped first): a few MiB


class RemoteIndex(LowerIndex):
    """Scheduler side: a remote tier's lookups, negative entries and counters (the store keeps the data)."""

    medium = Medium.REMOTE
    indexed = False

    def __init__(self, name: str, fmt: ChunkFormat | None, retry_interval_s: float, where: str = "") -> None:
        super().__init__()
        self.name = name
        self.fmt = fmt or ChunkFormat()
        # one outage line per tier and server between this and the transports' guards of the same process
        self._outage = Outage(f"{name} (lookups)", retry_interval_s, probe=self._probe, tier=f"{name}@{where}")
        self._storage: tuple[bytes, ...] = ()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"tiercache-lookup-{name}")
        # a query (its keys; a reach's keys after a marker) → its answer on the way or in, and when it was asked
        self._answers: OrderedDict[tuple, tuple[Future, float]] = OrderedDict()
        self._absent: OrderedDict[BlockHash, float] = OrderedDict()   # negative entries: key → until (monotonic)
        self._deletes: list[BlockHash] = []
        self.lookup_errors = 0      # written by the lookup thread only; `stats` adds it to the errors
        self.lookups_busy = 0       # lookups a busy server refused: misses, not errors
        self.lookups_slow = 0       # lookups past the lookup timeout: misses; `SLOW_LOOKUPS_DOWN` in a row, down
        self._slow_in_row = 0

    def attach(self, storage_digests: Sequence[bytes]) -> None:
        self._storage = tuple(dict.fromkeys(storage_digests))
        self._pool.submit(self._warm_up)    # connect now, on the lookup thread, not on the first lookup

    def _warm_up(self) -> None:
        try:
            self._probe()
        except Exception as err:   # down at start: an outage, probed in the background (and counted,
            self.lookup_errors += 1    # whether this or a first lookup is what finds the server away)
            self._outage.failed("connect", err)

    # -- availability --------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._outage.available

    def stats(self) -> dict[str, object]:
        out = super().stats()
        out["errors"] = self.counters.errors + self.lookup_errors
        out["outages"] = self._outage.outages
        out["lookups_busy"] = self.lookups_busy
        out["lookups_slow"] = self.lookups_slow
        return out

    def _busy(self, err: Exception) -> bool:
        """Whether ``err`` is the server refusing one call for room (it is there, and answering)."""
        return False

    def _slow(self, err: Exception) -> bool:
        """Whether ``err`` is a lookup that outlasted its timeout (a loaded server may answer the next)."""
        return False

    @abstractmethod
    def _probe(self) -> None:
        """One cheap round trip to the server (on the outage's prober thread); raises while it is away."""

    @abstractmethod
    def _present(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a value under every digest in ``storage``; raises on a transport
        error. Runs on the lookup thread."""

    @abstractmethod
    def _present_each(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` has a value under every digest in ``storage``; raises on a transport
        error. Runs on the lookup thread."""

    def close(self) -> None:
        self._outage.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- lookups -------------------------------------------------------------
    def _query(self, keys: Sequence[BlockHash]) -> int:
        """One query (on the lookup thread); a failure marks the tier down and counts as a miss."""
        return self._guarded(self._present, keys, 0)

    def _query_reach(self, keys: tuple[BlockHash, ...], block_hashes: tuple[BlockHash, ...],
                     blocks_per_chunk: int, num_keys: int) -> tuple[int, frozenset[BlockHash]]:
        """`_query`, then — where the run ends before ``num_keys`` — which shorter chunks are there (one more
        round trip, on the lookup thread still: the scheduler waits for one answer, not two): the run and the
        keys of the shorter chunks found."""
        n = self._query(keys) if keys else 0
        if n >= num_keys or not self.available:
            return n, frozenset()
        candidates = tail_keys(block_hashes, blocks_per_chunk, n)
        present = self._guarded(self._present_each, candidates, []) if candidates else []
        return n, frozenset(key for key, there in zip(candidates, present) if there)

    def _guarded(self, ask, keys: Sequence[BlockHash], miss):
        try:
            answer = ask(keys, self._storage)
        except Exception as err:   # whatever the client raises while the server is away or slow
            if self._busy(err):    # there, and refused this one for room: a miss, the tier stays up
                self.lookups_busy += 1
                return miss
            if self._slow(err):    # a miss; the tier is down only when lookups keep timing out (a hung server)
                self.lookups_slow += 1
                self._slow_in_row += 1
                if self._slow_in_row < SLOW_LOOKUPS_DOWN:
                    return miss
            self._slow_in_row = 0
            self.lookup_errors += 1
            self._outage.failed("lookup", err)
            return miss
        self._slow_in_row = 0
        self._outage.succeeded()
        return answer

    def present(self, keys: Sequence[BlockHash]) -> int:
        """One query, now, on the calling thread (what the lookup thread does); 0 while the tier is down."""
        keys = keys[:self._before_absent(keys)]
        if not keys or not self._storage or not self.available:
            return 0
        return self._query(keys)

    def contains(self, keys: Sequence[BlockHash]) -> int | None:
        usable = self._before_absent(keys)
        if not usable or not self._storage or not self.available:
            return self.count_lookup(len(keys), 0)
        query = tuple(keys[:usable])
        n = self._answer(query, self._query, lambda: (query,))
        return None if n is None else self.count_lookup(len(keys), n)

    def reach(self, keys: Sequence[BlockHash], block_hashes: Sequence[BlockHash], blocks_per_chunk: int
              ) -> Reach | None:
        """`contains`, and the shorter chunks past the run asked in the same answer (`_query_reach`). The answer
        is filed under all of ``keys`` — the last one chains every block before it (a request's keys end with
        its partial last chunk's), so two requests that share the keys asked share the blocks probed — and
        under how many lead up to the first known absent, as `contains` cuts its queries there."""
        usable = self._before_absent(keys)
        if not self._storage or not self.available:
            return Reach(self.count_lookup(len(keys), 0))
        query = tuple(keys[:usable])
        # the lookup thread gets its own copy of the request's blocks (the engine appends to the list), taken
        # only when the question is put: while its answer is on the way, or filed, no copy is made
        answer = self._answer(("reach", usable, *keys), self._query_reach,
                              lambda: (query, tuple(block_hashes), blocks_per_chunk, len(keys)))
        if answer is None:
            return None
        n, found = answer
        n = self.count_lookup(len(keys), n)
        if n >= len(keys) or not found:
            return Reach(n)
        # the answer names the keys it found, so it holds whatever this call's candidates are
        candidates = tail_keys(block_hashes, blocks_per_chunk, n)
        return Reach(n, first_held(candidates, lambda k: k in found and not self._is_absent(k)))

    def present_each(self, keys: Sequence[BlockHash]) -> list[bool] | None:
        """Whether each of ``keys`` is there, asked on the lookup thread in one round trip (None meanwhile);
        a key known absent is not asked."""
        if not keys or not self._storage or not self.available:
            return [False] * len(keys)
        query = tuple(keys)
        answer = self._answer(("each", *query), self._query_each, lambda: (query,))
        if answer is None:
            return None
        return [there and not self._is_absent(key) for key, there in zip(keys, answer)]

    def _query_each(self, keys: tuple[BlockHash, ...]) -> list[bool]:
        """`_present_each` on the lookup thread; a failure marks the tier down and answers every key absent."""
        return self._guarded(self._present_each, keys, [False] * len(keys))

    def _answer(self, query: tuple, ask, args_of: Callable[[], tuple]):
        """The answer to ``query`` (asked as ``ask(*args_of())`` on the lookup thread, ``args_of`` called here,
        when the question is put), or None while on its way; an answer older than ``ANSWER_TTL_S`` is asked
        again."""
        asked = self._answers.get(query)
        now = time.monotonic()
        if asked is not None and asked[0].done() and now - asked[1] > ANSWER_TTL_S:
            del self._answers[query]
            asked = None
        if asked is None:
            self._answers[query] = (self._pool.submit(ask, *args_of()), now)
            while len(self._answers) > MAX_ANSWERS:
                self._answers.popitem(last=False)
            return None
        future = asked[0]
        return future.result() if future.done() else None

    # -- negative entries (scheduler thread) ------------------------------------
    def _before_absent(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` are not known absent (expired entries are dropped on the way)."""
        if not self._absent:
            return len(keys)
        now = time.monotonic()
        for i, key in enumerate(keys):
            until = self._absent.get(key)
            if until is not None:
                if until > now:
                    return i
                del self._absent[key]
        return len(keys)

    def _is_absent(self, key: BlockHash) -> bool:
        return self._before_absent((key,)) == 0

    def _mark_absent(self, keys: Sequence[BlockHash]) -> None:
        until = time.monotonic() + ABSENT_TTL_S
        for key in keys:
            self._absent[key] = until
            self._absent.move_to_end(key)
        while len(self._absent) > MAX_ABSENT:
            self._absent.popitem(last=False)

    def wait_for_answer(self, timeout: float) -> None:
        running = [future for future, _ in self._answers.values() if not future.done()]
        if running:
            wait(running, timeout, return_when=FIRST_COMPLETED)

    def has(self, key: BlockHash) -> bool:
        return False   # no local index; asking would be a network round trip on the scheduler's thread

    def delete(self, keys: Sequence[BlockHash]) -> int:
        """Forget ``keys``; every writing rank deletes its value in the background (`take_deletes`)."""
        self._mark_absent(keys)
        self._deletes.extend(keys)
        self.counters.deleted += len(keys)
        self._removed(keys)
        return len(keys)

    def take_deletes(self) -> list[BlockHash]:
        out, self._deletes = self._deletes, []
        return out

    # -- lifecycle (no index: counts only) -----------------------------------
    @property
    def capacity_bytes(self) -> int:
        return 0   # bounded by the server (maxmemory, --capacity), not by this client

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def num_chunks(self) -> int:
        return 0

    def reserve_bytes(self, layout: ChunkLayout) -> int:
        return self.fmt.max_stored_len(layout)

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        self.counters.store_planned += len(keys)
        ok = self.available
        if not ok:
            self.counters.store_rejected += len(keys)
        return [ok] * len(keys)

    def complete_store(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {},
                       stored_at: Mapping[BlockHash, float] | None = None) -> None:
        """A write the store declined (`Failure.IO`: its admission refused it, or it had no room) is a rejected
        store, one given up on (a busy server, its deadline, a full queue) a dropped one by its reason: neither
        is an error."""
        declined = sum(why is Failure.IO for why in failed.values())
        self.counters.stored += len(keys) - len(failed)
        self.counters.store_rejected += declined
        self.counters.errors += self.counters.count_lost(why for why in failed.values() if why is not Failure.IO)
        if self._absent:
            for key in keys:
                if key not in failed:
                    self._absent.pop(key, None)       # stored whole again on every rank: present

    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        return None   # no pins on a server: a chunk gone meanwhile is a failed read, hence a miss

    def complete_load(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {}) -> None:
        """Only values that failed their own checks are integrity failures, and deleted; the rest were plain
        misses — evicted or deleted between lookup and read, changed under a ranged read, or the server
        unreachable — and what is there now is left be."""
        bad = [key for key, why in failed.items() if why is Failure.CORRUPT]
        self.counters.loaded += len(keys) - len(failed)
        self.counters.load_misses += len(failed) - len(bad)
        self._mark_absent(list(failed))        # whatever the reason, not worth asking again at once
        if bad:
            self.counters.integrity_failures += len(bad)
            self.delete(bad)
