"""What the remote tiers (Redis, `tiercache serve`) share on the worker side: `RemoteTransport`.

One rank's connections to a remote store. Its bytes move through the
store's value channels (`tiercache.tiers.channels`), tried in the order the
subclass gives (`_channels`): a channel that is busy hands the batch to the
next, and a chunk a channel cannot see is asked of the next. This class is
the one error path of every channel: a call that raises one of the
transport's ``transport_errors`` marks the tier down on this rank (`Outage`), and from
then on every call answers `Failure.UNAVAILABLE` at once, without touching
the network, while a background thread probes the server every
``retry_interval`` and brings it back on the first answer. The scheduler's
half (`tiercache.tiers.remote_index.RemoteIndex`) probes on its own.

Its chunks are encoded and decoded on the worker's codec threads beside the
socket I/O (`tiercache.wire.codec_pipeline`), and every value read is
verified by the one path (`tiercache.wire.values.receive_value`) before a
byte of it is served.
"""
from __future__ import annotations

import functools
import logging
import threading
from abc import abstractmethod
from collections.abc import Sequence

from tiercache.codecs import Buffer
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.errors import ChunkFormatError
from tiercache.log_limits import ThrottledLog
from tiercache.tiers.base import Transport
from tiercache.tiers.channels import ELSEWHERE, ChannelBusy, OutgoingBatch, ReadOutcome, Receive, ValueChannel
from tiercache.tiers.outage import Outage
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecPipeline, CodecThreads, ReadBatch
from tiercache.wire.values import ValueSource, receive_value

log = logging.getLogger(__name__)


class RemoteTransport(Transport):
    """Worker side, one per rank and remote tier."""

    medium = Medium.REMOTE
    # What a channel (or `_channels`) raises when the store is unreachable or broke the protocol: an outage.
    transport_errors: tuple[type[BaseException], ...] = (ConnectionError, OSError)

    def __init__(self, name: str, storage: bytes, fmt: ChunkFormat | None, retry_interval_s: float,
                 writer: bool = True, where: str = "", codec_threads: CodecThreads | None = None) -> None:
        self.name = name
        self.storage = storage
        self.fmt = fmt or ChunkFormat()
        self.writer = writer
        self._outage = Outage(name, retry_interval_s, probe=self._probe, tier=f"{name}@{where}")
        self._codec = CodecPipeline(self.fmt, codec_threads, name)
        self._warn = ThrottledLog(logging.getLogger(type(self).__module__))   # one line per kind and 10 s
        self._lock = threading.Lock()   # guards the counters, which every transfer thread of the rank bumps
        self.errors = 0                 # under `_lock`: calls that failed on a transport error

    @property
    def available(self) -> bool:
        return self._outage.available

    @abstractmethod
    def _channels(self) -> Sequence[ValueChannel]:
        """The channels to try, best first; the last one should not answer `ChannelBusy`. May raise one of
        ``transport_errors`` (asking the server which paths it offers)."""

    @abstractmethod
    def _probe(self) -> None:
        """One cheap round trip to the server (on the outage's prober thread); raises while it is away."""

    def _failed(self, what: str, err: BaseException) -> None:
        """The one error path: a call failed on a transport error; the tier is down on this rank."""
        self._outage.failed(what, err)
        self._count("errors")

    def _count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of this transport's counters, under the lock every transfer thread takes for them."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def _after_read(self, keys: Sequence[BlockHash]) -> None:
        """Hook: ``keys`` were read whole and verified (Redis gives them a full TTL again)."""

    def close(self) -> None:
        self._outage.close()

    # -- the one path of every store and load --------------------------------
    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """Each chunk stored by the first channel that takes the batch; the keys not stored, and why."""
        if not items or not self.writer:
            return ()
        batch = OutgoingBatch(items, self._codec)
        if not self.available:
            return batch.all_failed(Failure.UNAVAILABLE)
        try:
            for channel in self._channels():
                try:
                    failed = channel.put(batch)
                except ChannelBusy as err:
                    self._moving_on(channel, err)
                    continue
                self._outage.succeeded()
                return failed
        except self.transport_errors as err:
            self._failed("store", err)
            return batch.all_failed(self._store_failure(err))
        return batch.all_failed(Failure.BUSY)      # every channel was busy: these chunks fail, the tier stays up

    def _store_failure(self, err: BaseException) -> Failure:
        """Why a store that raised ``err`` failed: past its deadline (`Failure.TIMEOUT`), else the tier down."""
        return Failure.TIMEOUT if isinstance(err, TimeoutError) else Failure.UNAVAILABLE

    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | Failure]:
        """Each chunk verified and decoded into its buffer, asked of each channel in turn until one has it
        (a chunk none has is a miss); with the chunks read whole, `_after_read`."""
        if not items:
            return []
        if not self.available:
            return [Failure.UNAVAILABLE] * len(items)
        out: list[int | Failure] = [Failure.MISS] * len(items)
        with self._codec.reads() as reads:
            self._read(items, functools.partial(self.receive, reads), out)
        out = reads.settled(items, out, self._corrupt)
        hits = [key for (key, _), got in zip(items, out) if not isinstance(got, Failure)]
        if hits:
            self._after_read(hits)
        return out

    def _read(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive, out: list[int | Failure]) -> None:
        """Fill ``out`` channel by channel: each is asked for the items no channel before it settled; on a
        transport error those still pending are `Failure.UNAVAILABLE` (what was read stands)."""
        pending = list(range(len(items)))
        try:
            for channel in self._channels():
                try:
                    got: list[ReadOutcome] = channel.get([items[i] for i in pending], receive)
                except ChannelBusy as err:
                    self._moving_on(channel, err)
                    continue
                self._outage.succeeded()
                elsewhere = []
                for i, answer in zip(pending, got):
                    if answer is ELSEWHERE:
                        elsewhere.append(i)
                    else:
                        out[i] = answer       # type: ignore[assignment]
                pending = elsewhere
                if not pending:
                    return
        except self.transport_errors as err:
            self._failed("load", err)
            for i in pending:
                out[i] = Failure.UNAVAILABLE

    def _moving_on(self, channel: ValueChannel, err: ChannelBusy) -> None:
        self._warn.warning(f"busy {channel.name}", "%s tier: %s; moving these chunks by the next path", self.name,
                           err)

    # -- taking one value in ---------------------------------------------------
    def receive(self, reads: ReadBatch, source: ValueSource, n: int, key: BlockHash,
                buf: memoryview) -> int | Failure:
        """One value from ``source`` into ``buf``, verified (`receive_value`, its decode in ``reads``): its raw
        length, or `Failure.CORRUPT` for a value that is there but must not be served. Transport errors
        propagate."""
        try:
            return receive_value(source, n, self.storage, key, buf, reads, self.fmt.signer)
        except ChunkFormatError as err:
            return self._corrupt(key, err)

    def _corrupt(self, key: BlockHash, err: ChunkFormatError) -> Failure:
        self._warn.warning("corrupt", "%s tier: chunk %s… failed verification: %s", self.name, key.hex()[:16], err)
        return Failure.CORRUPT

