"""The raw TCP baseline for `bench tiers --tiers grpc` (the data channel): a bare bytes store over sockets.

``python -m tiercache.bench.tcp_echo PORT`` runs in its own process, like
`tiercache serve`, and keeps values by index: ``P`` u32 index u64 length
value (answered with one byte), ``G`` u32 index (answered with u64 length +
value). No header, checksum, index or copy of ours:
received straight into a buffer kept per index (allocated on first use),
sent straight from it. `TcpEchoClient` moves a set of values on as many
connections as the tier has transfer workers, each its share, received into
buffers faulted in once — the transport's limit for what the data channel does.
"""
from __future__ import annotations

import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from tiercache.wire.streams import StreamReader

_INDEX = struct.Struct("<I")
_LEN = struct.Struct("<Q")


def _serve(conn: socket.socket, stored: dict[int, bytearray]) -> None:
    reader = StreamReader(conn)
    try:
        while True:
            op = reader.exactly(1)
            if op == b"P":
                (i,) = _INDEX.unpack(reader.exactly(4))
                (n,) = _LEN.unpack(reader.exactly(8))
                buf = stored.get(i)
                if buf is None or len(buf) != n:
                    buf = stored[i] = bytearray(n)
                reader.read_into(memoryview(buf))
                conn.sendall(b"k")
            elif op == b"G":
                (i,) = _INDEX.unpack(reader.exactly(4))
                buf = stored[i]
                conn.sendall(_LEN.pack(len(buf)))
                conn.sendall(buf)
            else:
                return
    except (ConnectionError, OSError):
        return
    finally:
        conn.close()


def main(port: int) -> None:
    stored: dict[int, bytearray] = {}
    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve, args=(conn, stored), daemon=True).start()


class TcpEchoClient:
    def __init__(self, address: tuple[str, int], connections: int) -> None:
        self._socks = [socket.create_connection(address, timeout=600) for _ in range(connections)]
        for sock in self._socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._readers = [StreamReader(s) for s in self._socks]
        self._pool = ThreadPoolExecutor(connections)
        self._bufs: list[memoryview] = []

    def _each(self, fn, n: int) -> list:
        k = len(self._socks)
        return list(self._pool.map(lambda c: fn(c, range(c, n, k)), range(k)))

    def put(self, values: list[bytes]) -> None:
        if not self._bufs:     # the warm-up repetition pays for these
            self._bufs = [memoryview(bytearray(len(v))) for v in values]
            for buf in self._bufs:
                buf[::4096] = b"\1" * len(buf[::4096])

        def send(c: int, indexes) -> None:
            for i in indexes:
                self._socks[c].sendall(b"P" + _INDEX.pack(i) + _LEN.pack(len(values[i])))
                self._socks[c].sendall(values[i])
            for _ in indexes:
                self._readers[c].exactly(1)
        self._each(send, len(values))

    def get(self) -> int:
        def receive(c: int, indexes) -> int:
            self._socks[c].sendall(b"".join(b"G" + _INDEX.pack(i) for i in indexes))
            total = 0
            for i in indexes:
                (n,) = _LEN.unpack(self._readers[c].exactly(8))
                self._readers[c].read_into(self._bufs[i][:n])
                total += n
            return total
        return sum(self._each(receive, len(self._bufs)))

    def clear(self) -> None:
        return None     # values are kept by index and overwritten by the next put

    def close(self) -> None:
        self._pool.shutdown()
        for sock in self._socks:
            sock.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
