"""A rank's gRPC client tier for tests that talk to a real `tiercache serve`, and raw calls."""
import pytest
import torch

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tiercache.contracts.keys import BlockHash  # noqa: E402
from tiercache.tiers.grpc_client import GrpcTransport  # noqa: E402
from tiercache.tiers.grpc_index import GrpcIndex  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import ChunkMeta  # noqa: E402
from tiercache.wire.grpc_messages import method  # noqa: E402

NS = bytes(range(16))


class Client:
    """What a deployment of one rank does with a server, for tests that talk to it directly: `contains` is the
    scheduler's index asking (the query its lookup thread runs), the rest is the rank's transport; a completed
    load's deletes are run by the rank, as a delete plan would."""

    def __init__(self, address: str, namespace: bytes, auth_token: str | None = None, timeout_s: float = 2.0,
                 lookup_timeout_s: float = 0.25, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 local: str = "auto", bulk: str = "auto") -> None:
        self.index = GrpcIndex(address, auth_token=auth_token, lookup_timeout_s=lookup_timeout_s,
                               retry_interval_s=retry_interval_s, max_message_bytes=max_message_bytes)
        self.index.attach([namespace])
        self.transport = GrpcTransport(address, namespace, auth_token=auth_token, timeout_s=timeout_s,
                                       retry_interval_s=retry_interval_s, max_message_bytes=max_message_bytes,
                                       local=local, bulk=bulk, probe_timeout_s=lookup_timeout_s)
        self.write_chunks = self.transport.write_chunks
        self.read_chunks_into = self.transport.read_chunks_into
        self.health = self.transport.health

    def contains(self, keys) -> int:
        return self.index.present(keys)

    def delete(self, keys) -> None:
        self.transport.delete_chunks(keys)

    def complete_load(self, keys, failed) -> None:
        self.index.complete_load(keys, failed)
        self.transport.delete_chunks(self.index.take_deletes())

    @property
    def counters(self):
        return self.index.counters

    @property
    def available(self) -> bool:
        return self.transport.available

    def close(self) -> None:
        self.index.close()
        self.transport.close()


def chunks(n: int, nbytes: int = 1 << 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        key = BlockHash(bytes([seed, i]) * 16)
        raw = torch.randn(nbytes // 4, generator=g).numpy().tobytes()
        out.append((ChunkMeta(NS, key, 16, "float32", (nbytes // 4,)), raw))
    return out


def _ident(b: bytes) -> bytes:
    return b


def raw_call(server, name: str, request: bytes | list[bytes], metadata=()):
    """One call with raw bytes, as a foreign or broken client would make it."""
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        if name == "Put":
            return channel.stream_unary(method(name), _ident, _ident)(iter(request), timeout=5, metadata=metadata)
        if name == "Get":
            return list(channel.unary_stream(method(name), _ident, _ident)(request, timeout=5, metadata=metadata))
        return channel.unary_unary(method(name), _ident, _ident)(request, timeout=5, metadata=metadata)
    finally:
        channel.close()


def healthy(server) -> bool:
    reply = pb.HealthReply.FromString(raw_call(server, "Health", b""))
    return reply.status == pb.HealthReply.SERVING
