"""L3 on a shared `tiercache serve`, scheduler side: `GrpcIndex`, and the channel both halves open (`ServerChannel`).

`GrpcIndex` asks ``Contains`` — one call per writing rank's digest, all in
flight at once — on the index's lookup thread, with ``lookup_timeout``, and
``Health`` while the server is away. It keeps no index: the server owns the
data. The worker side is `tiercache.tiers.grpc_client.GrpcTransport`.
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from tiercache.keys import BlockHash
from tiercache.tiers.remote import RemoteIndex
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import ChunkFormat
from tiercache.wire.grpc_messages import AUTH_HEADER, method


def _identity(data: bytes) -> bytes:
    return data


def busy(err: BaseException) -> bool:
    """A call the server refused for room (request or stream slots, in-flight bytes): it is there."""
    return isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class ServerChannel:
    """One gRPC channel to a server and its raw-bytes method handles (each side opens its own)."""

    def __init__(self, address: str, auth_token: str | None, timeout_s: float, retry_interval_s: float,
                 max_message_bytes: int) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()
        # A channel whose server went away reconnects on its own, every half probe interval (gRPC adds its
        # jitter): by the time a probe asks, the channel has tried again, so a server that is back is seen
        # within ``retry_interval_s`` of its return (gRPC's own backoff grows to minutes).
        self.retry_interval_s = retry_interval_s
        backoff_ms = max(50, int(retry_interval_s * 500))
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes * 2),
            ("grpc.max_receive_message_length", max_message_bytes * 2),
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ("grpc.enable_retries", 0),
        ])
        unary = {n: self.channel.unary_unary(method(n), _identity, _identity)
                 for n in ("Contains", "Delete", "Health", "Local", "Adopt", "Touch")}
        self.contains, self.delete, self._health = unary["Contains"], unary["Delete"], unary["Health"]
        self.local, self.adopt, self.touch = unary["Local"], unary["Adopt"], unary["Touch"]
        self.get = self.channel.unary_stream(method("Get"), _identity, _identity)
        self.put = self.channel.stream_unary(method("Put"), _identity, _identity)

    def health(self, timeout_s: float | None = None) -> pb.HealthReply:
        """The server's health (raises grpc.RpcError when it cannot be reached)."""
        reply = pb.HealthReply()
        reply.ParseFromString(self._health(pb.HealthRequest().SerializeToString(),
                                           timeout=timeout_s or self.timeout_s, metadata=self.metadata))
        return reply

    def probe(self, timeout_s: float) -> None:
        """Ask for health, waiting up to ``timeout_s`` for the channel to connect (a probe that finds it
        between reconnection attempts waits for the next rather than failing at once)."""
        reply = pb.HealthReply()
        try:
            reply.ParseFromString(self._health(pb.HealthRequest().SerializeToString(), timeout=timeout_s,
                                               metadata=self.metadata, wait_for_ready=True))
        except grpc.RpcError as err:
            if busy(err):
                return                 # it answered: there, only out of room for this call
            raise
        if reply.status != pb.HealthReply.SERVING:
            raise ConnectionError(f"tiercache server {self.address} is not serving (shutting down)")

    def close(self) -> None:
        self.channel.close()


class GrpcIndex(RemoteIndex):
    def __init__(self, address: str, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 lookup_timeout_s: float = 0.25, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", local: str = "auto", bulk: str = "auto") -> None:
        super().__init__(name, fmt, retry_interval_s, where=address)
        self.lookup_timeout_s = lookup_timeout_s
        self._server = ServerChannel(address, auth_token, lookup_timeout_s, retry_interval_s, max_message_bytes)
        self._local_or_bulk = local == "auto" or bulk == "auto"
        self.parallel_jobs = False

    def check_health(self) -> pb.HealthReply | None:
        """The server's health at start, or None — and the tier down, probed until it answers — when it is away.

        A server with a data channel or a shared-memory directory moves bytes with the GIL released, so its
        jobs are split across transfer workers (two read 10 GB/s from files where one reads 5.6); one gRPC
        stream at a time otherwise (two contend for the GIL: 2.4 GB/s for one, 1.45 for two here).
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
        calls = [self._server.contains.future(pb.ContainsRequest(namespace=digest, keys=keys).SerializeToString(),
                                              timeout=self.lookup_timeout_s, metadata=self._server.metadata)
                 for digest in storage]
        n = len(keys)
        for call in calls:
            reply = pb.ContainsReply()
            reply.ParseFromString(call.result())
            n = min(n, reply.present)
        return n
