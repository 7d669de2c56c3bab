"""L3 on a shared `tiercache serve`, worker side: `GrpcTransport`, one per rank, with a gRPC channel of its own.

The server owns the data and no side keeps an index; the scheduler's half is
`tiercache.tiers.grpc_index.GrpcIndex`. Each rank's values live under its own
storage digest (the server's namespace field).

- `GrpcTransport` (worker side, one per rank): chunk bytes (the stored chunk
  format: encoded here, header checked by the server, payload verified here
  on every read, in the L1 slot) take the best path the server offers, asked
  once and again after any outage (`_Paths`):

  1. Its shared-memory directory, for a client on its host (``--shm-dir``,
     ``grpc.local``): chunk files read straight into L1 slots, new ones
     written for ``Adopt``, reads reported with ``Touch`` (`SharedDirectory`);
     a file not there is asked for over the network, since the server may
     hold it on disk.
  2. Its data channel (``HealthReply.data_port``, ``grpc.bulk``): one plain
     TCP connection per transfer thread, each value received straight into
     its slot and sent straight out of it (`DataChannel`).
  3. gRPC streams: one ``Put`` per store job, one ``Get`` per promotion, each
     chunk split into pieces of a few MiB built and parsed by hand
     (`tiercache.wire.grpc_messages`); Python gRPC makes each received
     message a fresh ``bytes`` on its channel thread, about a third of what
     (2) moves.

Faults: every call has a deadline; a server that is gone, slow or refusing
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``UNAUTHENTICATED``, a closed data
connection, ...) turns into misses and failed stores, and that side's tier
goes quiet (`Outage`) while a background thread asks ``Health`` every
``retry_interval`` seconds and the gRPC channel reconnects (its reconnect
backoff is capped near ``retry_interval`` too, so a restarted server is
seen within seconds).
"""
from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from tiercache.codecs import Buffer
from tiercache.keys import BlockHash
from tiercache.tiers.remote import RemoteTransport
from tiercache.tiers.shared_dir import ABSENT, SharedDirectory
from tiercache.transfer.plan import Failure, KeyFailures
from tiercache.wire import data_frames as dw
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecThreads, ReadBatch
from tiercache.wire.data_channel import DataChannel, DataChannelBusy, DataChannelRefused, StaleConnection
from tiercache.wire.grpc_messages import PART_BYTES, ChunkPieces, ChunkView, WireError, read_chunk, split_chunk
from tiercache.wire.server_channel import ServerChannel, busy

log = logging.getLogger(__name__)

MIN_TRANSFER_RATE = 100e6   # bytes/s assumed when sizing a streaming call's deadline
BUSY_TRIES = 4              # a stream the server refuses for room is asked for again this many times in all,
BUSY_PAUSE_S = 0.05         # after pauses of about 0.05, 0.1, 0.2 s
T = TypeVar("T")
PATH_MODES = ("auto", "off")


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


@dataclass(frozen=True, slots=True)
class _Paths:
    """How this client moves bytes to its server besides gRPC streams; asked once (again after an outage)."""
    local: SharedDirectory | None = None    # the server's shared-memory directory, when this host sees it
    bulk: DataChannel | None = None     # the server's data channel


def _busy_if_failed(call: Callable[[DataChannel], list], bulk: DataChannel, stale_raises: bool = False) -> list:
    """``call(bulk)``, any failure of the data channel raised as `DataChannelBusy` (its chunks go over gRPC
    streams) but a refused hello, and — with ``stale_raises`` — a kept connection found closed."""
    try:
        return call(bulk)
    except (DataChannelRefused, DataChannelBusy):
        raise
    except StaleConnection as err:
        if stale_raises:
            raise
        raise DataChannelBusy(f"the data channel failed again on a fresh connection ({err})") from err
    except ConnectionError as err:
        raise DataChannelBusy(f"the data channel failed ({err})") from err


class GrpcTransport(RemoteTransport):
    def __init__(self, address: str, storage: bytes, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", local: str = "auto", bulk: str = "auto", writer: bool = True,
                 probe_timeout_s: float = 0.25, codec_threads: CodecThreads | None = None) -> None:
        super().__init__(name, storage, fmt, retry_interval_s, writer, where=address, codec_threads=codec_threads)
        for what, mode in (("local", local), ("bulk", bulk)):
            if mode not in PATH_MODES:
                raise ValueError(f"grpc tier {what} must be auto or off, got {mode!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.probe_timeout_s = min(probe_timeout_s, timeout_s)
        self.max_message_bytes = max_message_bytes
        self._token = auth_token
        self._server = ServerChannel(address, auth_token, timeout_s, retry_interval_s, max_message_bytes)
        self._use_local, self._use_bulk = local == "auto", bulk == "auto"
        # The transfer threads share the paths: `_paths_lock` guards `_known_paths` (None: not asked yet), so
        # that one thread asks the server and opens the one data channel the others then use.
        self._paths_lock = threading.Lock()
        self._known_paths: _Paths | None = None
        self.busy = 0           # under `_lock`: calls a busy server refused (RESOURCE_EXHAUSTED), not an outage
        self.reconnects = 0     # under `_lock`: kept data connections found closed and opened again

    def close(self) -> None:
        super().close()
        self._forget_paths()
        self._server.close()

    def check_health(self) -> pb.HealthReply | None:
        """At start: the server's health, or None — and this rank's tier down, probed until it answers — when it
        is away; a server that takes only smaller messages gets smaller pieces, and the paths it offers are
        learnt now rather than on the first transfer."""
        try:
            reply = self._server.health()
            self._paths()
        except grpc.RpcError as err:
            self._failed("health check", err)
            return None
        if reply.max_message_bytes and reply.max_message_bytes < self.max_message_bytes:
            self.max_message_bytes = reply.max_message_bytes
        return reply

    def health(self, timeout_s: float | None = None) -> pb.HealthReply:
        return self._server.health(timeout_s)

    def _probe(self) -> None:
        self._server.probe(max(self.probe_timeout_s, self._server.retry_interval_s))

    @staticmethod
    def _when_room(call: Callable[[], T]) -> T:
        """``call()``; when the server refuses it for room (its slots or in-flight bytes, for this tenant's
        share), asked again after a short pause that doubles, jittered so that refused clients spread out —
        `BUSY_TRIES` times in all, within a fraction of a second. Raises the last refusal, or any other error."""
        for attempt in range(BUSY_TRIES):
            try:
                return call()
            except grpc.RpcError as err:
                if not busy(err) or attempt == BUSY_TRIES - 1:
                    raise
            time.sleep(BUSY_PAUSE_S * (2 ** attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable: the last try returns or raises")

    def _failed(self, what: str, err: Exception) -> None:
        if busy(err):
            # The server is there and refused this call for room (stream slots, in-flight bytes): these
            # chunks fail, the tier stays up.
            self._count("busy")
            self._warn.warning("busy", "grpc tier %s: %s refused by a busy server: %s", self.name, what,
                               err.details())
            return
        super()._failed(what, err)
        self._forget_paths()     # a restarted server may offer other paths, or none

    def _forget_paths(self) -> None:
        """Drop the known paths (the server is asked again on the next transfer) and close their data channel."""
        with self._paths_lock:
            paths, self._known_paths = self._known_paths, None
        if paths is not None and paths.bulk is not None:
            paths.bulk.close()

    def _forget_bulk(self, stale: DataChannel) -> None:
        """Drop the known paths when their data channel is still ``stale`` (another thread may have asked the
        server again meanwhile, and that answer stays)."""
        with self._paths_lock:
            paths = self._known_paths
            if paths is None or paths.bulk is not stale:
                return
            self._known_paths = None
        stale.close()

    def _paths(self) -> _Paths:
        """Ask the server, once, for its data channel and its shared-memory directory, and keep what this
        client can use; threads that ask meanwhile wait for that answer. Raises grpc.RpcError when the server
        cannot be reached."""
        with self._paths_lock:
            if self._known_paths is None:
                local = self._local_dir() if self._use_local else None
                port = self._server.health().data_port if self._use_bulk else 0
                bulk = DataChannel(_host(self.address), port, self.storage, self._token, self.timeout_s) \
                    if port else None
                self._known_paths = _Paths(local, bulk)
            return self._known_paths

    def _without_local(self, local: SharedDirectory) -> None:
        """Stop writing chunk files to ``local`` (it failed) until the paths are asked for again."""
        with self._paths_lock:
            paths = self._known_paths
            if paths is not None and paths.local is local:
                self._known_paths = _Paths(None, paths.bulk)

    def _local_dir(self) -> SharedDirectory | None:
        """The server's shared-memory directory when this host sees it: None for a server without
        ``--shm-dir`` (or without the RPC), or a directory that is not this host's."""
        reply = pb.LocalReply()
        try:
            reply.ParseFromString(self._server.local(pb.LocalRequest().SerializeToString(), timeout=self.timeout_s,
                                                     metadata=self._server.metadata))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        return SharedDirectory.open(reply.directory, reply.instance, self.storage) if reply.directory else None

    @property
    def part_bytes(self) -> int:
        """Value bytes per message: `PART_BYTES`, or less when the server accepts only smaller messages."""
        return min(PART_BYTES, self.max_message_bytes - 1024)

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / MIN_TRANSFER_RATE

    # -- deletes -------------------------------------------------------------
    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        if not keys or not self.writer or not self.available:
            return
        try:
            self._server.delete(pb.DeleteRequest(namespace=self.storage, keys=keys).SerializeToString(),
                                timeout=self.timeout_s, metadata=self._server.metadata)
        except grpc.RpcError as err:
            self._failed("delete", err)

    # -- stores --------------------------------------------------------------
    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """Each chunk stored by the best path; returns the keys that were not stored, and why."""
        if not items or not self.writer:
            return ()
        down = tuple((meta.key, Failure.UNAVAILABLE) for meta, _ in items)
        if not self.available:
            return down
        try:
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("store", err)
            return down
        if paths.local is not None:
            failed = self._write_local(paths.local, items)
            if failed is not None:
                return failed
        if paths.bulk is not None:
            try:
                return self._write_bulk(paths.bulk, items)
            except DataChannelBusy as err:
                self._warn.warning("bulk busy", "grpc tier %s: %s; moving these chunks over gRPC streams",
                                   self.name, err)
        return self._write_streams(items)

    def _write_streams(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """One streamed gRPC ``Put``."""
        refused: list[tuple[BlockHash, Failure]] = []

        def messages() -> Iterator[bytes]:
            for chunk in self._codec.encoded(items, refused):
                if not chunk.refused:
                    yield from split_chunk(self.storage, chunk.meta.key, chunk.header, chunk.payload, self.part_bytes)

        nbytes = sum(len(memoryview(raw).cast("B")) for _, raw in items)

        def put() -> bytes:
            refused.clear()
            return self._server.put(messages(), timeout=self._deadline(nbytes), metadata=self._server.metadata)
        try:
            reply = pb.PutReply()
            reply.ParseFromString(self._when_room(put))
        except grpc.RpcError as err:
            self._failed("store", err)
            return tuple((meta.key, Failure.UNAVAILABLE) for meta, _ in items)
        self._outage.succeeded()
        return tuple(refused) + tuple((BlockHash(k), Failure.IO) for k in reply.rejected)

    def _write_local(self, local: SharedDirectory, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures | None:
        """Write the chunks as files for the server and ``Adopt`` them; returns the keys not stored, or None
        when the files could not be written (the caller sends them over the network)."""
        refused: list[tuple[BlockHash, Failure]] = []
        kept: list[BlockHash] = []

        def files() -> Iterator[tuple[bytes, memoryview]]:
            for chunk in self._codec.encoded(items, refused):
                if not chunk.refused:
                    kept.append(chunk.meta.key)
                    yield chunk.header, chunk.payload
        try:
            names = local.write(files())
        except OSError as err:     # no permission, tmpfs full, directory gone: the network until the next outage
            log.warning("grpc tier %s: writing chunk files to %s failed (%s); moving chunks over the network",
                        self.name, local.incoming, err)
            self._without_local(local)
            return None
        request = pb.AdoptRequest(namespace=self.storage, keys=kept, files=names)
        reply = pb.PutReply()
        try:
            reply.ParseFromString(self._server.adopt(request.SerializeToString(), timeout=self.timeout_s,
                                                     metadata=self._server.metadata))
        except grpc.RpcError as err:
            local.discard(names)
            self._failed("store", err)
            return tuple((meta.key, Failure.UNAVAILABLE) for meta, _ in items)
        self._outage.succeeded()
        return tuple(refused) + tuple((BlockHash(k), Failure.IO) for k in reply.rejected)

    def _on_bulk(self, bulk: DataChannel, call: Callable[[DataChannel], list]) -> list:
        """``call`` on the data channel. A kept connection that failed — closed by the server's idle policy or
        to make room, or a server that restarted — is no outage: the call is made once more, quietly, on a
        fresh connection, after asking the server for its data port (a restarted one may listen on another,
        or on none). Any other failure of the data channel, or of that second try, raises `DataChannelBusy`:
        the data channel only speeds up what gRPC streams carry, and the caller moves these chunks there
        (a server that is away fails there too, and that is the outage). Raises grpc.RpcError from the
        server's Health, and `DataChannelRefused`."""
        try:
            return _busy_if_failed(call, bulk, stale_raises=True)
        except StaleConnection:
            self._count("reconnects")
        if self._server.health().data_port != bulk.address[1]:
            self._forget_bulk(bulk)
            bulk = self._paths().bulk
            if bulk is None:
                raise DataChannelBusy("the server no longer has a data channel")
        return _busy_if_failed(call, bulk)

    def _write_bulk(self, bulk: DataChannel, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """One ``PUT`` on the data channel: each chunk's header and payload sent as they are (a chunk the codec
        refused is withdrawn); raises `DataChannelBusy` when no connection could be had."""
        refused: list[tuple[BlockHash, Failure]] = []

        def put(channel: DataChannel) -> list[int]:       # a fresh encoding for each try
            refused.clear()
            return channel.put(len(items), self._codec.encoded(items, refused))
        try:
            outcomes = self._on_bulk(bulk, put)
        except DataChannelBusy:
            raise                  # the caller moves them over gRPC streams
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("store", err)
            return tuple((meta.key, Failure.UNAVAILABLE) for meta, _ in items)
        self._outage.succeeded()
        withdrawn = {key for key, _ in refused}
        return tuple(refused) + tuple((meta.key, Failure.IO) for (meta, _), outcome in zip(items, outcomes)
                                      if outcome == dw.PUT_REJECTED and meta.key not in withdrawn)

    # -- loads ---------------------------------------------------------------
    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | Failure]:
        """Each chunk verified and decoded into its buffer: read from the server's files when co-located,
        else (and for files not there) from one ``GET`` on the data channel, or one streamed ``Get``."""
        if not items:
            return []
        if not self.available:
            return [Failure.UNAVAILABLE] * len(items)
        try:
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("load", err)
            return [Failure.UNAVAILABLE] * len(items)
        with self._codec.reads() as reads:
            out = self._read_batch(paths, items, reads)
        return reads.settled(items, out, self._corrupt)

    def _read_batch(self, paths: _Paths, items: Sequence[tuple[BlockHash, memoryview]],
                    reads: ReadBatch) -> list[int | Failure]:
        if paths.local is None:
            return self._read_network(paths, items, reads)
        receive = functools.partial(self.receive, reads)
        out: list[int | Failure] = [Failure.MISS] * len(items)
        remote, read = [], []
        for i, (key, buf) in enumerate(items):
            got = paths.local.read(key, buf, receive)
            if got is ABSENT:
                remote.append(i)
            else:
                out[i] = got    # type: ignore[assignment]
                if not isinstance(got, Failure):
                    read.append(key)
        if read:
            try:
                self._server.touch(pb.TouchRequest(namespace=self.storage, keys=read).SerializeToString(),
                                   timeout=self.timeout_s, metadata=self._server.metadata)
            except grpc.RpcError as err:   # the bytes are here and verified; only the server's bookkeeping missed
                log.debug("grpc tier %s: Touch failed: %s", self.name, err)
        if remote:
            for i, got in zip(remote, self._read_network(paths, [items[i] for i in remote], reads)):
                out[i] = got
        return out

    def _read_network(self, paths: _Paths, items: Sequence[tuple[BlockHash, memoryview]],
                      reads: ReadBatch) -> list[int | Failure]:
        if paths.bulk is None:
            return self._read_remote(items, reads)
        receive = functools.partial(self.receive, reads)
        try:
            out = self._on_bulk(paths.bulk, lambda channel: channel.get(items, receive))
        except DataChannelBusy as err:
            self._warn.warning("bulk busy", "grpc tier %s: %s; moving these chunks over gRPC streams", self.name,
                               err)
            return self._read_remote(items, reads)
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("load", err)
            return [Failure.UNAVAILABLE] * len(items)
        self._outage.succeeded()
        return out

    def _read_remote(self, items: Sequence[tuple[BlockHash, memoryview]], reads: ReadBatch) -> list[int | Failure]:
        """One streamed gRPC ``Get``."""
        out: list[int | Failure] = [Failure.MISS] * len(items)
        request = pb.GetRequest(namespace=self.storage, keys=[k for k, _ in items]).SerializeToString()
        nbytes = sum(len(buf) for _, buf in items)

        def first() -> tuple[Iterator[bytes], tuple | None]:      # a refusal for room comes before any chunk
            stream = iter(self._server.get(request, timeout=self._deadline(nbytes), metadata=self._server.metadata))
            return stream, read_chunk(stream)
        try:
            stream, got = self._when_room(first)
            for i, item in enumerate(items):
                if got is None:
                    break
                out[i] = self._place(reads, item, got[0], got[1])
                if i + 1 < len(items):
                    got = read_chunk(stream)
        except grpc.RpcError as err:
            self._failed("load", err)
            return [Failure.UNAVAILABLE] * len(items)
        except WireError as err:   # a broken stream: what was placed stands, the rest are misses
            self._warn.warning("malformed", "grpc tier %s: malformed Get stream: %s", self.name, err)
            self._count("errors")
        self._outage.succeeded()
        return out

    def _place(self, reads: ReadBatch, item: tuple[BlockHash, memoryview], head: ChunkView,
               pieces: list[memoryview]) -> int | Failure:
        """Verify one chunk received as message pieces into the item's buffer."""
        key, buf = item
        if not head.value:
            return Failure.MISS
        if head.namespace != self.storage or head.key != key:
            self._warn.warning("foreign", "grpc tier %s: the server answered for another namespace or key",
                          self.name)
            return Failure.CORRUPT
        return self.receive(reads, ChunkPieces(pieces), head.total, key, buf)
