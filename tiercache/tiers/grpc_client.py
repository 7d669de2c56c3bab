"""L3 on a shared `tiercache serve`, worker side: `GrpcTransport`, one per rank, with a gRPC channel of its own.

The server owns the data and no side keeps an index; the scheduler's half is
`tiercache.tiers.grpc_index.GrpcIndex`. Each rank's values live under its own
storage digest (the server's namespace field).

Chunk bytes (the stored chunk format: encoded here, header checked by the
server, payload verified here on every read, in the L1 slot) take the best
of the server's value channels (`tiercache.tiers.serve_channels`): its
shared-memory directory when this client is on its host, its data channel,
and gRPC streams, which every server has. Which ones it offers is asked
once (`_paths`), and again after any outage. Lookups, deletes, stats and
health stay on gRPC.

Faults: every call has a deadline; a server that is gone, slow or refusing
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``UNAUTHENTICATED``, a closed data
connection, ...) turns into misses and failed stores, and that side's tier
goes quiet (`Outage`) while a background thread asks ``Health`` every
``retry_interval`` seconds and the gRPC channel reconnects (its reconnect
backoff is capped near ``retry_interval`` too, so a restarted server is
seen within seconds). A call the server refused for room
(``RESOURCE_EXHAUSTED``) is no outage: those chunks fail as busy (`Failure.BUSY`), and a store past its
deadline as `Failure.TIMEOUT`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure
from tiercache.tiers.channels import ValueChannel
from tiercache.tiers.remote import RemoteTransport
from tiercache.tiers.serve_channels import DataChannelValues, SharedDirValues, StreamValues
from tiercache.tiers.shared_dir import SharedDirectory
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import ChunkFormat
from tiercache.wire.codec_pipeline import CodecThreads
from tiercache.wire.data_channel import DataChannel
from tiercache.wire.grpc_messages import PART_BYTES
from tiercache.wire.server_channel import ServerChannel, busy

log = logging.getLogger(__name__)

PATH_MODES = ("auto", "off")


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


@dataclass(frozen=True, slots=True)
class _Paths:
    """The value channels this client uses, best first, and the shared directory and data channel among them;
    asked once (again after an outage)."""
    channels: tuple[ValueChannel, ...]
    local: SharedDirectory | None = None    # the server's shared-memory directory, when this host sees it
    bulk: DataChannel | None = None         # the server's data channel


class GrpcTransport(RemoteTransport):
    """Worker side, one per rank: this rank's chunks on a `tiercache serve`, through its value channels."""

    transport_errors = (grpc.RpcError, ConnectionError)

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
            if reply.max_message_bytes and reply.max_message_bytes < self.max_message_bytes:
                self.max_message_bytes = reply.max_message_bytes
            self._paths()
        except grpc.RpcError as err:
            self._failed("health check", err)
            return None
        return reply

    def health(self, timeout_s: float | None = None) -> pb.HealthReply:
        return self._server.health(timeout_s)

    def _probe(self) -> None:
        self._server.probe(max(self.probe_timeout_s, self._server.retry_interval_s))

    def _failed(self, what: str, err: BaseException) -> None:
        if busy(err):
            # The server is there and refused this call for room (stream slots, in-flight bytes): these
            # chunks fail, the tier stays up.
            self._count("busy")
            self._warn.warning("busy", "grpc tier %s: %s refused by a busy server: %s", self.name, what,
                               err.details())
            return
        super()._failed(what, err)
        self._forget_paths()     # a restarted server may offer other paths, or none

    def _store_failure(self, err: BaseException) -> Failure:
        if busy(err):
            return Failure.BUSY
        if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Failure.TIMEOUT
        return super()._store_failure(err)

    @property
    def part_bytes(self) -> int:
        """Value bytes per message: `PART_BYTES`, or less when the server accepts only smaller messages."""
        return min(PART_BYTES, self.max_message_bytes - 1024)

    # -- paths: which value channels the server offers -------------------------
    def _channels(self) -> Sequence[ValueChannel]:
        return self._paths().channels

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
                self._known_paths = self._assemble(local, bulk)
            return self._known_paths

    def _assemble(self, local: SharedDirectory | None, bulk: DataChannel | None) -> _Paths:
        channels: list[ValueChannel] = []
        if local is not None:
            channels.append(SharedDirValues(local, self._server, self.storage, self.timeout_s, self._without_local))
        if bulk is not None:
            channels.append(DataChannelValues(bulk, self._renew_bulk, lambda: self._count("reconnects")))
        channels.append(StreamValues(self._server, self.storage, self.timeout_s, self.part_bytes, self._warn,
                                     lambda: self._count("errors"), self.name))
        return _Paths(tuple(channels), local, bulk)

    def _forget_paths(self) -> None:
        """Drop the known paths (the server is asked again on the next transfer) and close their data channel."""
        with self._paths_lock:
            paths, self._known_paths = self._known_paths, None
        if paths is not None and paths.bulk is not None:
            paths.bulk.close()

    def _renew_bulk(self, stale: DataChannel) -> DataChannel | None:
        """The data channel to use after ``stale`` failed: the same one while the server still listens on its
        port, else (a restarted server) the one the server offers now, or None. Drops the known paths only
        when their data channel is still ``stale`` (another thread may have asked the server again meanwhile,
        and that answer stays)."""
        if self._server.health().data_port == stale.address[1]:
            return stale
        with self._paths_lock:
            paths = self._known_paths
            if paths is not None and paths.bulk is stale:
                self._known_paths = None
            else:
                stale = None
        if stale is not None:
            stale.close()
        return self._paths().bulk

    def _without_local(self, local: SharedDirectory) -> None:
        """Stop writing chunk files to ``local`` (it failed) until the paths are asked for again."""
        with self._paths_lock:
            paths = self._known_paths
            if paths is not None and paths.local is local:
                self._known_paths = self._assemble(None, paths.bulk)

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

    # -- deletes -------------------------------------------------------------
    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        if not keys or not self.writer or not self.available:
            return
        try:
            self._server.delete(pb.DeleteRequest(namespace=self.storage, keys=keys).SerializeToString(),
                                timeout=self.timeout_s, metadata=self._server.metadata)
        except grpc.RpcError as err:
            self._failed("delete", err)
