"""L3 on a shared `tiercache serve`, scheduler side: `GrpcIndex` (over the `ServerChannel` both halves open).

`GrpcIndex` asks ``Contains`` — one call per writing rank's digest, all in
flight at once — on the index's lookup thread, with ``lookup_timeout``, and
``Health`` while the server is away. It keeps no index: the server owns the
data. The worker side is `tiercache.tiers.grpc_client.GrpcTransport`.
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.purge import PurgeOrder
from tiercache.tiers.purge_watch import ServerPurges
from tiercache.tiers.remote_index import RemoteIndex
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import ChunkFormat
from tiercache.wire.server_channel import ServerChannel, busy


class GrpcIndex(RemoteIndex):
    """Scheduler side: lookups on a `tiercache serve`, off the scheduler's thread."""

    def __init__(self, address: str, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 lookup_timeout_s: float = 0.25, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", local: str = "auto", bulk: str = "auto") -> None:
        super().__init__(name, fmt, retry_interval_s, where=address)
        self.lookup_timeout_s = lookup_timeout_s
        self._server = ServerChannel(address, auth_token, lookup_timeout_s, retry_interval_s, max_message_bytes)
        self._local_or_bulk = local == "auto" or bulk == "auto"
        self.parallel_jobs = False
        self._purges: ServerPurges | None = None

    def attach(self, storage_digests: Sequence[bytes]) -> None:
        super().attach(storage_digests)
        if self._purges is None:           # the purges the server makes reach this engine's own tiers too
            self._purges = ServerPurges(self._server.purges, self._server.metadata, self._storage, self.name,
                                      timeout_s=max(1.0, self.lookup_timeout_s))

    def take_purges(self) -> list[PurgeOrder]:
        return self._purges.take() if self._purges is not None else []

    def purges_applied(self) -> None:
        if self._purges is not None:
            self._purges.applied()

    def check_health(self) -> pb.HealthReply | None:
        """The server's health at start, or None — and the tier down, probed until it answers — when it is away.

        A server with a data channel or a shared-memory directory moves bytes with the GIL released, so its
        jobs are split across transfer workers (each reads files on its own); one gRPC stream at a time
        otherwise (streams in parallel contend for the GIL and move less than one).
        """
        try:
            reply = self._server.health()
        except grpc.RpcError as err:
            if not busy(err):
                self._outage.failed("health check", err)
            return None
        self.parallel_jobs = self._local_or_bulk and bool(reply.data_port)
        return reply

    def close(self) -> None:
        if self._purges is not None:
            self._purges.close()
        super().close()
        self._server.close()

    def _probe(self) -> None:
        self._server.probe(max(self.lookup_timeout_s, self._server.retry_interval_s))

    def _busy(self, err: Exception) -> bool:
        return busy(err)

    def _slow(self, err: Exception) -> bool:
        return isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def _present(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> int:
        """One ``Contains`` per rank's digest, all in flight at once."""
        return min((reply.present for reply in self._contains(keys, storage, each=False)), default=len(keys))

    def _present_each(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> list[bool]:
        """``Contains`` with ``each``, one per rank's digest, all in flight at once. A server from before
        ``each`` answers the leading run alone: the keys in it are there, the others count as absent."""
        present = [True] * len(keys)
        for reply in self._contains(keys, storage, each=True):
            flags = reply.present_each if len(reply.present_each) == len(keys) else \
                bytes(i < reply.present for i in range(len(keys)))
            present = [p and bool(f) for p, f in zip(present, flags)]
        return present

    def _contains(self, keys: Sequence[BlockHash], storage: Sequence[bytes], each: bool) -> list[pb.ContainsReply]:
        calls = [self._server.contains.future(
                     pb.ContainsRequest(namespace=digest, keys=keys, each=each).SerializeToString(),
                     timeout=self.lookup_timeout_s, metadata=self._server.metadata)
                 for digest in storage]
        replies = []
        for call in calls:
            reply = pb.ContainsReply()
            reply.ParseFromString(call.result())
            replies.append(reply)
        return replies
