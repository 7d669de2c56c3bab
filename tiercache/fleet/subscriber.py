"""Following one replica's KV events into its index, whole: gaps replayed, duplicates dropped, losses resynced.

Router side, one asyncio task per replica (`EventFollower.run`). Batches come
numbered; the follower applies each number once and in order:
- a number it has already applied (a replay overlapping the live stream, a
  duplicate) is dropped;
- a gap is asked again from the replica's replay socket;
- a number already applied but with other contents is a restart (the
  replica numbers from 0 again): the index is cleared and the new
  instance's batches replayed from 0;
- history the replica no longer keeps (it joined late, its replay buffer
  moved on, the replay went unanswered) clears the index and resyncs: the ``resync`` callback makes the
  replica publish everything it holds in one batch (tiercache replicas do,
  through ``POST /tiercache/kv/announce``) and the follower resumes at that
  batch; a replica that cannot (vLLM) is followed from the next batch on.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from tiercache.fleet.descriptor import EventEndpoints
from tiercache.fleet.kv_events import END_SEQ, decode
from tiercache.fleet.prefix_index import ReplicaIndex

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
SEEN_BATCHES = 4096      # how far back a repeated number is told from a restart's (by its payload)


@dataclass(slots=True)
class FollowerCounters:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    undecodable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class EventFollower:
    def __init__(self, name: str, endpoints: EventEndpoints, index: ReplicaIndex,
                 resync: Callable[[], Awaitable[int | None]] | None = None) -> None:
        self.name = name
        self.endpoints = endpoints
        self.index = index
        self.resync = resync         # returns the number of the batch that holds everything, or None
        self.last: int | None = None  # the last batch applied
        self.counters = FollowerCounters()
        self._seen: OrderedDict[int, int] = OrderedDict()   # recent numbers applied → their payload's hash
        self.synced = asyncio.Event()  # set once the index reflects the replica (after the first catch-up)

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
        sub.connect(self.endpoints.endpoint)
        try:
            await self._catch_up(0)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters.undecodable += 1
                    continue
                await self._receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close()

    async def _receive(self, seq: int, payload: bytes) -> None:
        last = self.last
        if last is not None and seq <= last:
            seen = self._seen.get(seq)
            older = bool(self._seen) and seq < next(iter(self._seen))
            if (seen is None and not older) or seen == hash(payload):
                # a replay overlapping the live stream, a batch sent twice, or one a resync went past
                self.counters.duplicates += 1
                return
            # a number applied with other contents, or older than any remembered: the replica restarted and
            # numbers from 0 again
            self.counters.restarts += 1
            self.index.clear()
            self.last = None
            await self._catch_up(0)
            return
        if last is not None and seq > last + 1:
            self.counters.gaps += 1
            await self._catch_up(last + 1)
            if self.last is not None and seq <= self.last:
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(decode(payload))
        except (ValueError, TypeError, OverflowError) as err:     # not a batch, or events of impossible shapes
            self.counters.undecodable += 1
            log.warning("kv events from %s: batch %d is not a KV event batch (%s); dropped", self.name, seq, err)
        else:
            self.counters.batches += 1
        self.last = seq
        self._seen[seq] = hash(payload)
        if len(self._seen) > SEEN_BATCHES:
            self._seen.popitem(last=False)

    async def _catch_up(self, first: int) -> None:
        """Apply the replica's kept batches from ``first`` on; resync if it no longer has ``first``."""
        kept = await self._replay(first)
        if kept is None or (kept and kept[0][0] > first):
            await self._resync()
            return
        if not kept:                              # nothing published since (a buffer is never emptied)
            if self.last is None:
                self.last = first - 1
            return
        for seq, payload in kept:
            if self.last is None or seq > self.last:
                self.counters.replayed += 1
                self._apply(seq, payload)

    async def _replay(self, first: int) -> list[tuple[int, bytes]] | None:
        """The kept batches from ``first`` on, or None when the replay socket does not answer in time."""
        import zmq
        import zmq.asyncio

        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoints.replay_endpoint)
        kept: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the reply
                # does, and a router being stopped then waits on this follower for ever
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return kept
                kept.append((int.from_bytes(frames[2], "big"), frames[3]))
        except asyncio.TimeoutError:
            log.warning("kv events from %s: replay from %d unanswered in %.0f s", self.name, first, REPLAY_TIMEOUT_S)
            return None
        finally:
            dealer.close()

    async def _resync(self) -> None:
        """Start the index again from what the replica holds now (or, if it cannot say, from now on)."""
        self.counters.resyncs += 1
        self.index.clear()
        seq = await self.resync() if self.resync is not None else None
        # the batch that holds everything comes next, live or (after a gap) replayed; without one, the next
        # batch is taken as it comes
        self.last = None if seq is None else seq - 1
