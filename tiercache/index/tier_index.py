"""What the scheduler side asks of every tier: `TierIndex`, its counters (`TierCounters`) and `Reach`.

A tier is two objects: an index on the scheduler side and a transport on each
worker (docs/architecture.md). `TierIndex` is the index (one thread, plain
data): which chunks the tier holds — a leading-run `contains`, capacity and
usage, the two-phase ``prepare_*`` / ``complete_*`` lifecycle, eviction,
counters. It never touches a tensor, a file or a socket on the scheduler's
thread: a remote tier's lookups run on a thread of their own and answer "ask
again" (None) meanwhile, and bytes that must go (evicted files, corrupt
values) are handed out by `take_deletes` as work for the workers.

It sits on a floor of its own, below both the client tiers (`tiercache.tiers`)
and the cache server's stores (`tiercache.server`), which build on it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash, first_held, tail_keys
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure
from tiercache.contracts.purge import PurgeOrder
from tiercache.policies.admission import GuardedTier

# A store given up on before it landed, by why (`Failure`): its reason in the counters (``store_dropped_<reason>``)
STORE_DROPS = {Failure.BUSY: "busy", Failure.TIMEOUT: "deadline", Failure.DROPPED: "queue",
               Failure.CANCELLED: "cancelled"}
DROP_REASONS = (*STORE_DROPS.values(), "purged")


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters, one count per chunk (not per rank); only the owning index increments them.

    Every store planned here ends as one of: stored, rejected, dropped (by reason) or failed, so once no
    store is in flight ``store_planned == stored + store_rejected + store_dropped_* + store_failed``."""
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys: int = 0
    store_planned: int = 0       # chunks offered to this tier that it did not hold (promotions into L1 too)
    stored: int = 0
    store_rejected: int = 0      # no room (everything pinned), or declined by the store's door
    store_dropped_busy: int = 0      # the server had no room for it in time (its in-flight budget, its slots)
    store_dropped_deadline: int = 0  # the server did not answer within the deadline
    store_dropped_queue: int = 0     # the link's queue of stores was full
    store_dropped_cancelled: int = 0  # cancelled (its request's load failed, or the workers were gone)
    store_dropped_purged: int = 0    # purged while it was being written
    store_failed: int = 0        # any other failure (the medium, the tier down, the source's read)
    loaded: int = 0
    load_misses: int = 0         # asked for, then gone when read (evicted, changed meanwhile, tier down)
    evicted: int = 0
    deleted: int = 0
    expired: int = 0             # past the tier's retention: never served, removed
    purged: int = 0              # taken out by a purge
    integrity_failures: int = 0
    tail_hits: int = 0           # lookups that ended on a shorter chunk from here (`TierIndex.reach`)
    temp_removed: int = 0        # half-written files (a writer died mid-chunk) deleted at start
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def count_lost(self, whys: Iterable[Failure]) -> int:
        """Count stores that did not land: one given up on under its reason (`STORE_DROPS`), any other as
        failed; returns how many failed (the caller's errors, where the failure is this tier's)."""
        failed = 0
        for why in whys:
            reason = STORE_DROPS.get(why)
            if reason is None:
                failed += 1
            else:
                name = f"store_dropped_{reason}"
                setattr(self, name, getattr(self, name) + 1)
        self.store_failed += failed
        return failed


@dataclass(frozen=True, slots=True)
class Reach:
    """What a tier holds of a request from a chunk position on: ``chunks`` whole chunks in a row, then, where
    that run ends inside the request, a shorter chunk of ``tail_blocks`` blocks some request stored when it
    ended there (0: none)."""
    chunks: int
    tail_blocks: int = 0


class TierIndex(ABC):
    """Scheduler side of a tier."""
    name: str
    medium: Medium
    indexed = True        # answers lookups from a local index (False: asks a server, on a thread of its own)

    def __init__(self) -> None:
        self.counters = TierCounters()
        self._removals: list[BlockHash] | None = None   # kept only while watched (`watch_removals`)

    def watch_removals(self) -> None:
        """Keep the keys that leave this tier from now on — evicted, or deleted — for `take_removed`
        (a connector turns them into KV events, so that a router's view of the tier stays true)."""
        if self._removals is None:
            self._removals = []

    def take_removed(self) -> list[BlockHash]:
        """The keys removed since the last call, in order (empty when not watched)."""
        if not self._removals:
            return []
        out, self._removals = self._removals, []
        return out

    def _removed(self, keys: Sequence[BlockHash]) -> None:
        if self._removals is not None:
            self._removals.extend(keys)

    def stored_times(self, keys: Sequence[BlockHash]) -> dict[BlockHash, float]:
        """When each of ``keys`` held here was first stored (what retention counts from; none: unknown here)."""
        return {}

    def expire(self) -> list[BlockHash]:
        """Remove what is past the tier's retention; returns the keys (none: a tier without retention here)."""
        return []

    @abstractmethod
    def contains(self, keys: Sequence[BlockHash]) -> int | None:
        """How many leading ``keys`` are present and readable; None while the answer is on its way."""

    @abstractmethod
    def has(self, key: BlockHash) -> bool:
        """Whether ``key`` is stored and readable, without counting a lookup (local indexes only)."""

    def reach(self, keys: Sequence[BlockHash], block_hashes: Sequence[BlockHash], blocks_per_chunk: int
              ) -> Reach | None:
        """Like `contains`, and past the run's end the longest shorter chunk held there (`tail_keys`);
        ``block_hashes`` are the blocks ``keys`` cover (``keys[0]`` ends the first chunk of them). None while
        the answer is on its way."""
        n = self.contains(keys)
        if n is None:
            return None
        return Reach(n, first_held(tail_keys(block_hashes, blocks_per_chunk, n), self.has) if n < len(keys) else 0)

    def present_each(self, keys: Sequence[BlockHash]) -> list[bool] | None:
        """Whether each of ``keys`` is present and readable (not a run: each on its own); None while the
        answer is on its way."""
        return [self.has(key) for key in keys]

    def held_keys(self) -> list[BlockHash]:
        """The keys this index holds, readable, when it keeps them itself (empty for a remote tier, whose
        index is its server's)."""
        return []

    @abstractmethod
    def delete(self, keys: Sequence[BlockHash]) -> int:
        """Forget keys that are present and not in use (their bytes go by `take_deletes`); how many went."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def num_chunks(self) -> int: ...

    def take_deletes(self) -> list[BlockHash]:
        """Keys whose stored bytes every rank must delete (evicted, corrupt, half-written), since the last call."""
        return []

    def wait_for_answer(self, timeout: float) -> None:
        """Block until a lookup in flight is answered, or ``timeout`` passed (for an engine with nothing else
        to do this step); an index that answers at once returns at once."""

    def close(self) -> None:
        """Stop lookup threads and release connections (the index is not used afterwards)."""

    def link(self, pairs: Sequence[tuple[BlockHash, BlockHash | None]]) -> None:
        """Each stored chunk's parent, for a chain-aware eviction policy; tiers without an index ignore it."""

    def record(self, keys: Sequence[BlockHash]) -> None:
        """A request asks for chunks ``keys`` (head first), whichever tier serves them: for an eviction policy
        that learns from demand; tiers whose eviction is not this engine's ignore it."""

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's word on the request that wanted ``keys`` (`RequestState`), for an eviction policy that
        takes hints; tiers whose eviction is not this engine's (a remote tier's is its server's) ignore it."""

    def size_for(self, tier: GuardedTier) -> None:
        """The shape of the hierarchy above it (``tier.l1_chunks``: this engine's L1), for an admission door
        the tier keeps itself (Redis's); other tiers ignore it."""

    def take_purges(self) -> list[PurgeOrder]:
        """Purges this tier's store made since the last call, for the engine to apply to its own tiers (a
        shared store tells every engine under it); then `purges_applied`."""
        return []

    def purges_applied(self) -> None:
        """What `take_purges` returned is applied to every tier of this engine."""

    @property
    def available(self) -> bool:
        """Whether the tier answers at all (a remote tier in an outage answers misses without asking)."""
        return True

    def stats(self) -> dict[str, object]:
        c = self.counters
        return {
            "name": self.name,
            "medium": self.medium.value,
            "available": int(self.available),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "chunks": self.num_chunks,
            "key_hit_ratio": c.hit_keys / c.lookup_keys if c.lookup_keys else 0.0,
            **c.as_dict(),
        }

    def count_lookup(self, asked: int, hit: int) -> int:
        """Count one lookup of ``asked`` keys of which ``hit`` were found (by whoever looked in this tier)."""
        self.counters.lookups += 1
        self.counters.lookup_keys += asked
        self.counters.hit_keys += hit
        return hit
