"""The gRPC channel to a `tiercache serve` that each side of a client opens (the scheduler's `GrpcIndex`, each
rank's `GrpcTransport`), with raw-bytes method handles, and how a refusal for room looks."""
from __future__ import annotations

import grpc

from tiercache.wire import tiercache_pb2 as pb
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
                 for n in ("Contains", "Delete", "Health", "Local", "Adopt", "Touch", "Purge", "Purges")}
        self.contains, self.delete, self._health = unary["Contains"], unary["Delete"], unary["Health"]
        self.local, self.adopt, self.touch = unary["Local"], unary["Adopt"], unary["Touch"]
        self.purge, self.purges = unary["Purge"], unary["Purges"]
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
