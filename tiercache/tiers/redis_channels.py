"""The Redis tier's two value channels (worker side): a raw socket for a standalone server, redis-py for a cluster.

Both keep the `tiercache.tiers.channels` contract; `RedisTransport` holds
one of them and is their one error path.

- `RawSocketValues` (a standalone server): pipelines on a socket borrowed
  from redis-py's pool (so URLs, TLS, AUTH and SELECT apply), speaking RESP
  itself (`tiercache.tiers.resp`). A ``SET ... NX`` sends header and payload
  from where they lie (a chunk already there is kept, never rewritten under
  a reader); a load asks each value's length (``STRLEN``), then reads it in
  ``GETRANGE`` pieces straight into its L1 slot, verified as it lands (a
  whole-value ``GET`` makes redis-server build the reply in fresh memory
  first).
- `PipelinedValues` (a cluster): redis-py's cluster pipeline, which routes
  each command to its node; values are staged in reusable per-thread buffers.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from tiercache.codecs import copy_into
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.log_limits import ThrottledLog
from tiercache.tiers.channels import OutgoingBatch, ReadOutcome, Receive, ValueChannel
from tiercache.tiers.resp import (
    ProtocolError,
    RangedReads,
    RangedValue,
    ReplyError,
    ReplyReader,
    ValueChanged,
    command,
    set_command,
)
from tiercache.wire.chunk_format import ChunkMeta
from tiercache.wire.grpc_messages import ChunkPieces

log = logging.getLogger(__name__)
T = TypeVar("T")

PIPELINE_BYTES = 256 << 20   # cluster path: values staged per pipelined batch (each batch reuses the buffers)


class RawSocketValues(ValueChannel):
    """Worker side: a standalone Redis's values over a raw socket borrowed from redis-py's pool."""

    name = "raw socket"

    def __init__(self, client, rkey: Callable[[BlockHash], bytes], ttl_s: int, warn: ThrottledLog,
                 tier: str) -> None:
        self._client = client
        self._rkey = rkey
        self._ttl_s = ttl_s
        self._warn = warn
        self._tier = tier

    def _on_connection(self, run: Callable[[socket.socket, ReplyReader], T]) -> T:
        """``run`` a pipeline on a connection borrowed from redis-py's pool, reading the replies itself. The
        connection goes back to the pool only when every reply was read whole; after any error it is dropped
        and the error propagates (the transport's error path)."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            reader = ReplyReader(conn._sock)
            out = run(conn._sock, reader)
            if reader.buffered:
                raise ProtocolError(f"{reader.buffered} bytes beyond the replies asked for")
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return out

    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """Pipelined ``SET ... NX``s, each value sent as header + payload from where they lie. A chunk already
        there is kept: its key names the tokens whose KV it holds, so any replica's copy serves, and a rewrite
        could tear a ranged read running on another replica."""
        def run(sock: socket.socket, reader: ReplyReader) -> KeyFailures:
            sent: list[ChunkMeta] = []
            for chunk in batch.sent():
                before, after = set_command(self._rkey(chunk.meta.key), len(chunk.header) + len(chunk.payload),
                                            self._ttl_s, only_new=True)
                sock.sendall(before + chunk.header)
                sock.sendall(chunk.payload)
                sock.sendall(after)
                sent.append(chunk.meta)
            rejected = []
            for meta in sent:
                try:
                    reader.set_reply()     # False: the chunk was there already, and is kept
                except ReplyError as err:      # e.g. OOM under maxmemory noeviction: this chunk only
                    self._warn.warning("set", "redis tier %s: SET refused: %s", self._tier, err)
                    rejected.append(meta.key)
            return batch.failures(rejected)
        return self._on_connection(run)

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """Pipelined ``STRLEN``s, then each present value read in ``GETRANGE`` pieces (`RangedReads`) into
        its buffer, verified as it lands."""
        def run(sock: socket.socket, reader: ReplyReader) -> list[ReadOutcome]:
            sock.sendall(b"".join(command(b"STRLEN", self._rkey(key)) for key, _ in items))
            lengths = [self._strlen(reader, key) for key, _ in items]
            present = [(self._rkey(key), n) for (key, _), n in zip(items, lengths) if isinstance(n, int) and n]
            ranges = RangedReads(sock, reader, present)
            return [self._receive(receive, ranges.value(), n, key, buf) if isinstance(n, int) and n else
                    (Failure.MISS if n == 0 else n) for (key, buf), n in zip(items, lengths)]
        return self._on_connection(run)

    def _strlen(self, reader: ReplyReader, key: BlockHash) -> int | Failure:
        """One ``STRLEN`` reply: 0 for a missing key; someone else's value under it (WRONGTYPE) is corrupt."""
        try:
            return reader.integer()
        except ReplyError as err:
            self._warn.warning("foreign", "redis tier %s: chunk %s… is not a value of ours: %s", self._tier,
                               key.hex()[:16], err)
            return Failure.CORRUPT

    def _receive(self, receive: Receive, value: RangedValue, n: int, key: BlockHash, buf: memoryview) -> ReadOutcome:
        """Read one value into ``buf``; a value that changed while it was read (replaced or deleted by another
        client between its ranges) is a miss."""
        try:
            got = receive(value, n, key, buf)
        except ValueChanged as err:
            log.info("redis tier %s: chunk %s… changed while it was read: %s", self._tier, key.hex()[:16], err)
            got = Failure.MISS
        value.drain()      # the last piece's CRLF, or whatever a change left unread
        return got


class PipelinedValues(ValueChannel):
    """Worker side: a Redis Cluster's values through redis-py's cluster pipeline."""

    name = "redis-py pipeline"

    def __init__(self, client, rkey: Callable[[BlockHash], bytes], ttl_s: int) -> None:
        self._client = client
        self._rkey = rkey
        self._ttl_s = ttl_s
        self._local = threading.local()

    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """Pipelined ``SET NX`` batches of at most `PIPELINE_BYTES` of staged values."""
        sent: list[ChunkMeta] = []
        results: list[object] = []
        staged = 0
        pipe = self._client.pipeline(transaction=False)
        for chunk in batch.sent():
            size = len(chunk.header) + len(chunk.payload)
            if staged and staged + size > PIPELINE_BYTES:
                results += pipe.execute(raise_on_error=False)
                staged = 0
            value = self._staging(len(sent) - len(results), size)
            value[:len(chunk.header)] = chunk.header
            copy_into(value, chunk.payload, len(chunk.header))
            pipe.set(self._rkey(chunk.meta.key), value, ex=self._ttl_s or None, nx=True)
            sent.append(chunk.meta)
            staged += size
        results += pipe.execute(raise_on_error=False)
        # True: stored; None: NX found the chunk there already (kept); an exception: refused
        return batch.failures([meta.key for meta, r in zip(sent, results) if isinstance(r, Exception)])

    def _staging(self, index: int, nbytes: int) -> memoryview:
        """Reusable per-thread buffer ``index`` of at least ``nbytes`` (a value is header + payload in one
        piece, and joining them into fresh memory each time halved SET throughput)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = []
        while len(bufs) <= index:
            bufs.append(bytearray())
        if len(bufs[index]) < nbytes:
            bufs[index] = bytearray(nbytes)
        return memoryview(bufs[index])[:nbytes]

    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """redis-py's pipelined ``GET``s (a cluster's client routes each to its node)."""
        pipe = self._client.pipeline(transaction=False)
        for key, _ in items:
            pipe.get(self._rkey(key))
        values = pipe.execute()
        return [Failure.MISS if value is None else receive(ChunkPieces([memoryview(value)]), len(value), key, buf)
                for (key, buf), value in zip(items, values)]
