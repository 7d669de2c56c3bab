"""L3 on a shared `tiercache serve`: the client tier (scheduler side for lookups, workers for bytes).

The server owns the data and this tier keeps no index: ``Contains``,
``Delete`` and ``Health`` are gRPC calls. Chunk bytes (the stored chunk
format: encoded here, header checked by the server, payload verified here on
every read, in the L1 slot) take the best path the server offers, asked once
and again after any outage (`_Paths`):

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
   (`tiercache.server.wire`); Python gRPC makes each received message a
   fresh ``bytes`` on its channel thread, about a third of what (2) moves.

Faults: every call has a deadline; a server that is gone, slow or refusing
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``UNAUTHENTICATED``, a closed data
connection, ...) turns into misses and failed stores, and the tier goes
quiet (`Outage`) while a background thread asks ``Health`` every
``retry_interval`` seconds and the gRPC channel reconnects (its reconnect
backoff is capped near ``retry_interval`` too, so a restarted server is
seen within seconds).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from tiercache.chunk_format import ChunkFormat, ChunkMeta
from tiercache.codecs import Buffer
from tiercache.errors import ChunkFormatError
from tiercache.keys import BlockHash
from tiercache.server import tiercache_pb2 as pb
from tiercache.server import data_wire as dw
from tiercache.server.wire import (
    AUTH_HEADER, PART_BYTES, ChunkPieces, ChunkView, WireError, method, read_chunk, split_chunk,
)
from tiercache.tiers.data_client import DataChannel, StaleConnection
from tiercache.tiers.remote import RemoteTier
from tiercache.tiers.shared_dir import ABSENT, SharedDirectory

log = logging.getLogger(__name__)

MIN_TRANSFER_RATE = 100e6   # bytes/s assumed when sizing a streaming call's deadline


def _identity(data: bytes) -> bytes:
    return data


PATH_MODES = ("auto", "off")


@dataclass(frozen=True, slots=True)
class _Paths:
    """How this client moves bytes to its server besides gRPC streams; asked once (again after an outage)."""
    local: SharedDirectory | None = None    # the server's shared-memory directory, when this host sees it
    bulk: DataChannel | None = None     # the server's data channel


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


class GrpcTier(RemoteTier):
    @property
    def parallel_jobs(self) -> bool:
        """One gRPC stream at a time (two contend for the GIL: 2.4 GB/s for one, 1.45 for two here), but file
        and socket I/O on the local path and the data channel release it: two workers read 10 GB/s from
        files where one reads 5.6."""
        paths = self._known_paths
        return paths is not None and (paths.local is not None or paths.bulk is not None)

    def __init__(self, address: str, namespace: bytes, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", local: str = "auto", bulk: str = "auto", lookup_timeout_s: float = 0.25) -> None:
        super().__init__(name, fmt, retry_interval_s)
        for what, mode in (("local", local), ("bulk", bulk)):
            if mode not in PATH_MODES:
                raise ValueError(f"grpc tier {what} must be auto or off, got {mode!r}")
        self.address = address
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.lookup_timeout_s = min(lookup_timeout_s, timeout_s)   # Contains and Delete: the scheduling path
        self.max_message_bytes = max_message_bytes
        self._token = auth_token
        self._metadata = ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()
        backoff_ms = max(100, int(retry_interval_s * 1000))
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes * 2),
            ("grpc.max_receive_message_length", max_message_bytes * 2),
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms * 4),
            ("grpc.enable_retries", 0),
        ])
        unary = {n: self._channel.unary_unary(method(n), _identity, _identity)
                 for n in ("Contains", "Delete", "Health", "Local", "Adopt", "Touch")}
        self._contains, self._delete, self._health = unary["Contains"], unary["Delete"], unary["Health"]
        self._local_rpc, self._adopt, self._touch = unary["Local"], unary["Adopt"], unary["Touch"]
        self._use_local, self._use_bulk = local == "auto", bulk == "auto"
        self._known_paths: _Paths | None = None     # None: not asked yet
        self._get = self._channel.unary_stream(method("Get"), _identity, _identity)
        self._put = self._channel.stream_unary(method("Put"), _identity, _identity)

    def close(self) -> None:
        super().close()
        self._forget_paths()
        self._channel.close()

    def check_health(self) -> pb.HealthReply | None:
        """`health`, or None — and the tier down, probed until it answers — when the server is away."""
        try:
            return self.health()
        except grpc.RpcError as err:
            self._failed("health check", err)
            return None

    def _probe(self) -> None:
        if self.health(self.lookup_timeout_s).status != pb.HealthReply.SERVING:
            raise ConnectionError(f"tiercache server {self.address} is not serving (shutting down)")

    def health(self, timeout_s: float | None = None) -> pb.HealthReply:
        """The server's health (raises grpc.RpcError when it cannot be reached)."""
        reply = pb.HealthReply()
        reply.ParseFromString(self._health(pb.HealthRequest().SerializeToString(),
                                           timeout=timeout_s or self.timeout_s, metadata=self._metadata))
        return reply

    def _failed(self, what: str, err: Exception) -> None:
        super()._failed(what, err)
        self._forget_paths()     # a restarted server may offer other paths, or none

    def _forget_paths(self) -> None:
        paths, self._known_paths = self._known_paths, None
        if paths is not None and paths.bulk is not None:
            paths.bulk.close()

    def _paths(self) -> _Paths:
        """Ask the server, once, for its data channel and its shared-memory directory, and keep what this
        client can use. Raises grpc.RpcError when the server cannot be reached."""
        if self._known_paths is not None:
            return self._known_paths
        bulk = None
        if self._use_bulk:
            port = self.health().data_port
            if port:
                bulk = DataChannel(_host(self.address), port, self.namespace, self._token, self.timeout_s)
        paths = _Paths(self._local_dir() if self._use_local else None, bulk)
        self._known_paths = paths
        return paths

    def _local_dir(self) -> SharedDirectory | None:
        """The server's shared-memory directory when this host sees it: None for a server without
        ``--shm-dir`` (or without the RPC), or a directory that is not this host's."""
        reply = pb.LocalReply()
        try:
            reply.ParseFromString(self._local_rpc(pb.LocalRequest().SerializeToString(), timeout=self.timeout_s,
                                                  metadata=self._metadata))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        return SharedDirectory.open(reply.directory, reply.instance, self.namespace) if reply.directory else None

    def _present(self, keys: Sequence[BlockHash]) -> int:
        request = pb.ContainsRequest(namespace=self.namespace, keys=keys).SerializeToString()
        reply = pb.ContainsReply()
        reply.ParseFromString(self._contains(request, timeout=self.lookup_timeout_s, metadata=self._metadata))
        return min(reply.present, len(keys))

    def contains(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return self._count_lookup(len(keys), 0)
        try:
            n = self._present(keys)
        except grpc.RpcError as err:
            self._failed("lookup", err)
            return self._count_lookup(len(keys), 0)
        self._outage.succeeded()
        return self._count_lookup(len(keys), n)

    def has(self, key: BlockHash) -> bool:
        if not self.available:
            return False
        try:
            return self._present([key]) == 1
        except grpc.RpcError as err:
            self._failed("lookup", err)
            return False

    def delete(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return 0
        try:
            reply = pb.DeleteReply()
            reply.ParseFromString(self._delete(pb.DeleteRequest(namespace=self.namespace, keys=keys).SerializeToString(),
                                               timeout=self.lookup_timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            self._failed("delete", err)
            return 0
        self.counters.deleted += reply.deleted
        if reply.deleted:
            self._removed(keys)     # the reply counts them; a key that was gone already is removed all the same
        return reply.deleted

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        ok = self.available
        if not ok:
            self.counters.store_rejected += len(keys)
        return [ok] * len(keys)

    @property
    def part_bytes(self) -> int:
        """Value bytes per message: `PART_BYTES`, or less when the server accepts only smaller messages."""
        return min(PART_BYTES, self.max_message_bytes - 1024)

    # -- I/O (worker side) ---------------------------------------------------
    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / MIN_TRANSFER_RATE

    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """One streamed ``Put`` of every chunk; returns the keys that were not stored."""
        if not items:
            return []
        if not self.available:
            return [meta.key for meta, _ in items]

        try:
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        if paths.local is not None:
            failed = self._write_local(paths.local, items)
            if failed is not None:
                return failed
        if paths.bulk is not None:
            return self._write_bulk(paths.bulk, items)

        def messages() -> Iterator[bytes]:
            for meta, raw in items:
                header, payload = self.fmt.encode_parts(meta, raw)
                yield from split_chunk(self.namespace, meta.key, header, payload, self.part_bytes)

        nbytes = sum(len(memoryview(raw).cast("B")) for _, raw in items)
        try:
            reply = pb.PutReply()
            reply.ParseFromString(self._put(messages(), timeout=self._deadline(nbytes), metadata=self._metadata))
        except grpc.RpcError as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [BlockHash(k) for k in reply.rejected]

    def _write_local(self, local: SharedDirectory, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash] | None:
        """Write the chunks as files for the server and ``Adopt`` them; returns the keys not stored, or None
        when the files could not be written (the caller sends them over the network)."""
        try:
            names = local.write([self.fmt.encode_parts(meta, raw) for meta, raw in items])
        except OSError as err:     # no permission, tmpfs full, directory gone: the network until the next outage
            log.warning("grpc tier %s: writing chunk files to %s failed (%s); moving chunks over the network",
                        self.name, local.incoming, err)
            paths = self._known_paths
            if paths is not None:
                self._known_paths = _Paths(None, paths.bulk)
            return None
        request = pb.AdoptRequest(namespace=self.namespace, keys=[m.key for m, _ in items], files=names)
        reply = pb.PutReply()
        try:
            reply.ParseFromString(self._adopt(request.SerializeToString(), timeout=self.timeout_s,
                                              metadata=self._metadata))
        except grpc.RpcError as err:
            local.discard(names)
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [BlockHash(k) for k in reply.rejected]

    def _on_bulk(self, bulk: DataChannel, call: Callable[[DataChannel], list]) -> list:
        """``call`` on the data channel; a kept connection that failed (the server may have restarted, on
        another port) is given one more try after asking the server again. Raises ConnectionError or
        grpc.RpcError."""
        try:
            return call(bulk)
        except StaleConnection:
            self._forget_paths()
            bulk = self._paths().bulk
            if bulk is None:
                raise ConnectionError("the server no longer has a data channel") from None
            return call(bulk)

    def _write_bulk(self, bulk: DataChannel, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """One ``PUT`` on the data channel: each chunk's header and payload sent as they are."""
        chunks = [(meta.key, *self.fmt.encode_parts(meta, raw)) for meta, raw in items]
        try:
            outcomes = self._on_bulk(bulk, lambda channel: channel.put(chunks))
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [meta.key for (meta, _), outcome in zip(items, outcomes) if outcome == dw.PUT_REJECTED]

    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """Each chunk verified and decoded into its buffer: read from the server's files when co-located,
        else (and for files not there) from one ``GET`` on the data channel, or one streamed ``Get``.

        Returns the raw length placed per item, or None for a miss, a corrupt
        or foreign chunk, or an unreachable server.
        """
        out: list[int | None] = [None] * len(items)
        if not items or not self.available:
            return out
        try:
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("load", err)
            return out
        if paths.local is None:
            return self._read_network(paths, items)
        remote, read = [], []
        for i, (key, buf) in enumerate(items):
            got = paths.local.read(key, buf, self._receive)
            if got is ABSENT:
                remote.append(i)
            else:
                out[i] = got    # type: ignore[assignment]
                if got is not None:
                    read.append(key)
        if read:
            try:
                self._touch(pb.TouchRequest(namespace=self.namespace, keys=read).SerializeToString(),
                            timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:   # the bytes are here and verified; only the server's bookkeeping missed
                log.debug("grpc tier %s: Touch failed: %s", self.name, err)
        if remote:
            for i, got in zip(remote, self._read_network(paths, [items[i] for i in remote])):
                out[i] = got
        return out

    def _receive(self, source, n: int, key: BlockHash, buf: memoryview) -> int | None:
        return self.receive_value(source, n, self.namespace, key, buf)

    def _read_network(self, paths: _Paths, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        if paths.bulk is None:
            return self._read_remote(items)
        try:
            out = self._on_bulk(paths.bulk, lambda channel: channel.get(items, self._receive))
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("load", err)
            return [None] * len(items)
        self._outage.succeeded()
        return out

    def _read_remote(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """One streamed gRPC ``Get``."""
        out: list[int | None] = [None] * len(items)
        request = pb.GetRequest(namespace=self.namespace, keys=[k for k, _ in items]).SerializeToString()
        nbytes = sum(len(buf) for _, buf in items)
        try:
            stream = iter(self._get(request, timeout=self._deadline(nbytes), metadata=self._metadata))
            for i, item in enumerate(items):
                got = read_chunk(stream)
                if got is None:
                    break
                out[i] = self._place(item, got[0], got[1])
        except grpc.RpcError as err:
            self._failed("load", err)
            return [None] * len(items)
        except WireError as err:   # a broken stream: what was placed stands, the rest are misses
            log.warning("grpc tier %s: malformed Get stream: %s", self.name, err)
            self.counters.errors += 1
        self._outage.succeeded()
        return out

    def _place(self, item: tuple[BlockHash, memoryview], head: ChunkView, pieces: list[memoryview]) -> int | None:
        """Verify one chunk received as message pieces into the item's buffer; None for a miss."""
        key, buf = item
        if not head.value:
            return None
        if head.namespace != self.namespace or head.key != key:
            self._rejected(key, ChunkFormatError("the server answered for another namespace or key"))
            return None
        return self.receive_value(ChunkPieces(pieces), head.total, self.namespace, key, buf)
