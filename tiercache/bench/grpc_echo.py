"""The raw gRPC baseline for `bench tiers --tiers grpc`: a bare bytes store with no protocol of its own.

``python -m tiercache.bench.grpc_echo PORT`` serves ``Put`` (a client stream
of byte strings, kept as they arrive), ``Get`` (streams them all back) and
``Clear`` on raw-bytes handlers in a separate process, like `tiercache serve`,
so both pay the same transport, process hop and Python per-message cost; the
difference is what tiercache adds (headers, checks, index, eviction).
"""
from __future__ import annotations

import sys
from concurrent import futures

import grpc

SERVICE = "tiercache.bench.Echo"
LIMIT = 1 << 30


def _ident(b: bytes) -> bytes:
    return b


class EchoClient:
    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", LIMIT),
                                                                ("grpc.max_receive_message_length", LIMIT)])
        grpc.channel_ready_future(self._channel).result(timeout=20)
        self._put = self._channel.stream_unary(f"/{SERVICE}/Put", _ident, _ident)
        self._get = self._channel.unary_stream(f"/{SERVICE}/Get", _ident, _ident)
        self._clear = self._channel.unary_unary(f"/{SERVICE}/Clear", _ident, _ident)

    def put(self, values: list[bytes]) -> None:
        self._put(iter(values), timeout=600)

    def get(self) -> int:
        return sum(len(v) for v in self._get(b"", timeout=600))

    def clear(self) -> None:
        self._clear(b"", timeout=60)

    def close(self) -> None:
        self._channel.close()


def main(port: int) -> None:
    stored: list[bytes] = []

    def put(requests, context) -> bytes:
        stored.extend(requests)
        return b""

    def get(request, context):
        yield from stored

    def clear(request, context) -> bytes:
        stored.clear()
        return b""

    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(put, _ident, _ident),
        "Get": grpc.unary_stream_rpc_method_handler(get, _ident, _ident),
        "Clear": grpc.unary_unary_rpc_method_handler(clear, _ident, _ident),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
                         options=[("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main(int(sys.argv[1]))
