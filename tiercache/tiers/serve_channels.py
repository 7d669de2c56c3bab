"""The value channels of a `tiercache serve` (worker side), best first; `GrpcTransport` asks which the server offers.

Each keeps the `tiercache.tiers.channels` contract; the transport is their
one error path (``grpc.RpcError`` and ``ConnectionError``: the tier down on
this rank, unless the server refused a call for room).

1. `SharedDirValues`: the server's shared-memory directory, for a client on
   its host (``--shm-dir``, ``grpc.local``): chunk files read straight into
   L1 slots, new ones written for ``Adopt``, reads reported with ``Touch``.
   A file not there is `ELSEWHERE` (the server may hold it on its disk); a
   directory this client cannot write is `ChannelBusy`, and left alone until
   the server is asked for its paths again.
2. `DataChannelValues`: the server's data channel (``HealthReply.data_port``,
   ``grpc.bulk``): one plain TCP connection per transfer thread, each value
   received straight into its slot and sent straight out of it. A data port
   at its connection cap, or not answering, is `ChannelBusy`.
3. `StreamValues`: gRPC streams, one ``Put`` per store job and one ``Get`` per
   promotion, each chunk split into pieces of a few MiB built and parsed by
   hand (`tiercache.wire.grpc_messages`); Python gRPC makes each received
   message a fresh ``bytes`` on its channel thread, about a third of what (2)
   moves. A call refused for room is asked again after short, jittered,
   doubling pauses (`when_room`).
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.log_limits import ThrottledLog
from tiercache.tiers.channels import ChannelBusy, OutgoingBatch, ReadOutcome, Receive, ValueChannel
from tiercache.tiers.shared_dir import SharedDirectory
from tiercache.wire import data_frames as dw
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.data_channel import DataChannel, DataChannelBusy, DataChannelRefused, StaleConnection
from tiercache.wire.grpc_messages import ChunkPieces, ChunkView, WireError, read_chunk, split_chunk
from tiercache.wire.server_channel import ServerChannel, busy

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_TRANSFER_RATE = 100e6   # bytes/s assumed when sizing a streaming call's deadline
BUSY_TRIES = 4              # a stream the server refuses for room is asked for again this many times in all,
BUSY_PAUSE_S = 0.05         # after pauses of about 0.05, 0.1, 0.2 s


def busy_pause(attempt: int) -> None:
    """The pause after the ``attempt``-th refusal for room: short, doubling, jittered so that refused clients
    spread out."""
    time.sleep(BUSY_PAUSE_S * (2 ** attempt) * (0.5 + random.random()))


def when_room(call: Callable[[], T]) -> T:
    """``call()``; when the server refuses it for room (its slots or in-flight bytes, for this tenant's share),
    asked again after a `busy_pause` — `BUSY_TRIES` times in all, within a fraction of a second beyond the
    server's own waits. Raises the last refusal, or any other error."""
    for attempt in range(BUSY_TRIES):
        try:
            return call()
        except grpc.RpcError as err:
            if not busy(err) or attempt == BUSY_TRIES - 1:
                raise
        busy_pause(attempt)
    raise AssertionError("unreachable: the last try returns or raises")


class SharedDirValues(ValueChannel):
    """Worker side: chunks as files in a co-located server's shared-memory directory."""

    name = "the shared directory"

    def __init__(self, directory: SharedDirectory, server: ServerChannel, storage: bytes, timeout_s: float,
                 unusable: Callable[[SharedDirectory], None]) -> None:
        self.directory = directory
        self._server = server
        self._storage = storage
        self._timeout_s = timeout_s
        self._unusable = unusable      # the transport stops using the directory (until it asks the server again)

    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """Write the chunks as files for the server and ``Adopt`` them."""
        kept: list[BlockHash] = []

        def files() -> Iterator[tuple[bytes, memoryview]]:
            for chunk in batch.sent():
                kept.append(chunk.meta.key)
                yield chunk.header, chunk.payload
        try:
            names = self.directory.write(files())
        except OSError as err:     # no permission, tmpfs full, directory gone: the network until the next outage
            self._unusable(self.directory)
            raise ChannelBusy(f"writing chunk files to {self.directory.incoming} failed ({err})") from err
        request = pb.AdoptRequest(namespace=self._storage, keys=kept, files=names)
        reply = pb.PutReply()
        try:
            reply.ParseFromString(self._server.adopt(request.SerializeToString(), timeout=self._timeout_s,
                                                     metadata=self._server.metadata))
        except grpc.RpcError:
            self.directory.discard(names)
            raise
        return batch.failures([BlockHash(k) for k in reply.rejected])

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """Each chunk's file read into its buffer, `ELSEWHERE` when there is none; the reads reported with
        ``Touch``, so the server's eviction sees them."""
        out = [self.directory.read(key, buf, receive) for key, buf in items]
        read = [key for (key, _), got in zip(items, out) if isinstance(got, int)]
        if read:
            try:
                self._server.touch(pb.TouchRequest(namespace=self._storage, keys=read).SerializeToString(),
                                   timeout=self._timeout_s, metadata=self._server.metadata)
            except grpc.RpcError as err:   # the bytes are here and verified; only the server's bookkeeping missed
                log.debug("shared directory %s: Touch failed: %s", self.directory.root, err)
        return out


class DataChannelValues(ValueChannel):
    """Worker side: chunk values over the server's data channel."""

    name = "the data channel"

    def __init__(self, bulk: DataChannel, renew: Callable[[DataChannel], DataChannel | None],
                 reconnected: Callable[[], None]) -> None:
        self.bulk = bulk
        self._renew = renew                # the server's data channel now (another port, or none), given a stale one
        self._reconnected = reconnected    # counts a kept connection found closed and opened again

    def _call(self, call: Callable[[DataChannel], T]) -> T:
        """``call`` on the data channel. A kept connection that failed — closed by the server's idle policy or
        to make room, or a server that restarted — is no outage: the call is made once more, quietly, on a
        fresh connection, to the port the server gives now (a restarted one may listen on another, or on
        none). Any other failure of the data channel, or of that second try, is `ChannelBusy`: the data
        channel only speeds up what gRPC streams carry (a server that is away fails there too, and that is
        the outage). A refused hello (`DataChannelRefused`) and the server's Health errors propagate."""
        try:
            return _busy_if_failed(call, self.bulk, stale_raises=True)
        except StaleConnection:
            self._reconnected()
        bulk = self._renew(self.bulk)
        if bulk is None:
            raise ChannelBusy("the server no longer has a data channel")
        return _busy_if_failed(call, bulk)

    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """One ``PUT``: each chunk's header and payload sent as they are (a chunk the codec refused is
        withdrawn). The chunks the server had no room for in time (``PUT_BUSY``) are sent again, alone, after
        a `busy_pause` — `BUSY_TRIES` times in all, as `when_room` asks for a stream again; those still refused
        then fail (`Failure.BUSY`: a busy server, the tier stays up)."""
        failed: list[tuple[BlockHash, Failure]] = []
        for attempt in range(BUSY_TRIES):
            sent = batch
            outcomes = self._call(lambda channel: channel.put(len(sent.items), sent.encoded()))
            failed += sent.failures([meta.key for (meta, _), outcome in zip(sent.items, outcomes)
                                     if outcome == dw.PUT_REJECTED])
            refused = [item for item, outcome in zip(sent.items, outcomes) if outcome == dw.PUT_BUSY]
            if not refused:
                return tuple(failed)
            if attempt < BUSY_TRIES - 1:
                busy_pause(attempt)
                batch = OutgoingBatch(refused, batch.codec)
        return (*failed, *((meta.key, Failure.BUSY) for meta, _ in refused))

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """One ``GET``."""
        return self._call(lambda channel: channel.get(items, receive))


def _busy_if_failed(call: Callable[[DataChannel], T], bulk: DataChannel, stale_raises: bool = False) -> T:
    """``call(bulk)``, any failure of the data channel raised as `ChannelBusy` but a refused hello, and — with
    ``stale_raises`` — a kept connection found closed."""
    try:
        return call(bulk)
    except DataChannelRefused:
        raise
    except DataChannelBusy as err:
        raise ChannelBusy(str(err)) from err
    except StaleConnection as err:
        if stale_raises:
            raise
        raise ChannelBusy(f"the data channel failed again on a fresh connection ({err})") from err
    except ConnectionError as err:
        raise ChannelBusy(f"the data channel failed ({err})") from err


class StreamValues(ValueChannel):
    """Worker side: chunk values over gRPC ``Put`` and ``Get`` streams."""

    name = "gRPC streams"

    def __init__(self, server: ServerChannel, storage: bytes, timeout_s: float, part_bytes: int,
                 warn: ThrottledLog, malformed: Callable[[], None], tier: str) -> None:
        self._server = server
        self._storage = storage
        self._timeout_s = timeout_s
        self._part_bytes = part_bytes
        self._warn = warn
        self._malformed = malformed        # counts a broken Get stream (an error, not an outage)
        self._tier = tier

    def _deadline(self, nbytes: int) -> float:
        return self._timeout_s + nbytes / MIN_TRANSFER_RATE

    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """One streamed ``Put``."""
        def messages() -> Iterator[bytes]:
            for chunk in batch.sent():
                yield from split_chunk(self._storage, chunk.meta.key, chunk.header, chunk.payload, self._part_bytes)

        deadline = self._deadline(batch.nbytes)
        reply = pb.PutReply()
        reply.ParseFromString(when_room(lambda: self._server.put(messages(), timeout=deadline,
                                                                 metadata=self._server.metadata)))
        return batch.failures([BlockHash(k) for k in reply.rejected])

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """One streamed ``Get``; a broken stream keeps what was placed, the rest are misses."""
        out: list[ReadOutcome] = [Failure.MISS] * len(items)
        request = pb.GetRequest(namespace=self._storage, keys=[k for k, _ in items]).SerializeToString()
        deadline = self._deadline(sum(len(buf) for _, buf in items))

        def first() -> tuple[Iterator[bytes], tuple | None]:      # a refusal for room comes before any chunk
            stream = iter(self._server.get(request, timeout=deadline, metadata=self._server.metadata))
            return stream, read_chunk(stream)
        try:
            stream, got = when_room(first)
            for i, item in enumerate(items):
                if got is None:
                    break
                out[i] = self._place(receive, item, got[0], got[1])
                if i + 1 < len(items):
                    got = read_chunk(stream)
        except WireError as err:
            self._warn.warning("malformed", "grpc tier %s: malformed Get stream: %s", self._tier, err)
            self._malformed()
        return out

    def _place(self, receive: Receive, item: tuple[BlockHash, memoryview], head: ChunkView,
               pieces: list[memoryview]) -> int | Failure:
        """Verify one chunk received as message pieces into the item's buffer."""
        key, buf = item
        if not head.value:
            return Failure.MISS
        if head.namespace != self._storage or head.key != key:
            self._warn.warning("foreign", "grpc tier %s: the server answered for another namespace or key",
                               self._tier)
            return Failure.CORRUPT
        return receive(ChunkPieces(pieces), head.total, key, buf)

