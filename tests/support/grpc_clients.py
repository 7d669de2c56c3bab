"""A rank's gRPC client tier for tests that talk to a real `tiercache serve`, raw calls, and a connection that
holds the server's in-flight budget."""
import contextlib
import socket
import threading

import pytest
import torch

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tiercache.contracts.keys import BlockHash  # noqa: E402
from tiercache.tiers.grpc_client import GrpcTransport  # noqa: E402
from tiercache.tiers.grpc_index import GrpcIndex  # noqa: E402
from tiercache.wire import data_frames as dw  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkMeta  # noqa: E402
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


class BudgetHolder:
    """A data-channel connection (of ``token``'s tenant) that declares a value the size of the server's whole
    in-flight budget and sends it a byte at a time, never silent — so its reservation is never taken back and
    no other value finds room until `release`."""

    def __init__(self, server, nbytes: int, token: str | None = None) -> None:
        from tiercache.bench.hostile import header_for
        port = pb.HealthReply.FromString(raw_call(server, "Health", b"")).data_port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(dw.hello(token))
        assert self.sock.recv(1)[0] == dw.HELLO_OK
        key = b"\xab" * 32
        head = header_for(key, nbytes - HEADER_BYTES, namespace=NS)
        self.sock.sendall(dw.REQUEST.pack(dw.OP_PUT, NS, 1) + dw.key_field(key) + dw.U64.pack(nbytes) + head)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        while not self._done.wait(0.05):
            with contextlib.suppress(OSError):
                self.sock.send(b"\0")

    def release(self) -> None:
        self._done.set()
        self._thread.join()
        self.sock.close()
