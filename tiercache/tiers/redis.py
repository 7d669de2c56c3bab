"""L3 on Redis (or Valkey): one value per chunk and rank in the stored chunk format, shared by every replica.

Redis owns the data, so no side keeps an index. Values are keyed
``tiercache:<storage digest>:<key>``: the digest names the namespace, the
chunk size and the rank's share of the KV, so models, layouts, tenants and
tensor-parallel sizes never meet; an optional TTL ends a chunk nobody has
read for that long (every load gives the chunks it read a full TTL again),
and Redis's own ``maxmemory`` policy bounds their size.

- `RedisIndex` (scheduler side): lookups — one pipelined ``EXISTS`` batch
  over every writing rank's key of each chunk — on the index's lookup thread,
  over connections of their own with a short ``lookup_timeout``.
- `RedisTransport` (worker side, one per rank): pipelined stores and loads
  on transfer threads. With a standalone server both run on a raw socket
  borrowed from redis-py's pool (`tiercache.tiers.resp`): a ``SET ... NX``
  sends header and payload from where they lie (a chunk already there is
  kept, never rewritten under a reader); a load asks each value's length
  (``STRLEN``), then reads it in ``GETRANGE`` pieces straight into its L1
  slot, verified as it lands (a whole-value ``GET`` makes redis-server build
  the reply in fresh memory first, at a third of the rate). A cluster's go
  through redis-py's cluster pipeline.

A Redis that does not answer turns into misses, never into errors in the
engine (`tiercache.tiers.remote`).
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

from tiercache.codecs import Buffer, copy_into
from tiercache.keys import BlockHash
from tiercache.tiers.remote import RemoteIndex, RemoteTransport
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
from tiercache.transfer.plan import Failure, KeyFailures
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecThreads, ReadBatch
from tiercache.wire.grpc_messages import ChunkPieces

log = logging.getLogger(__name__)

PIPELINE_BYTES = 256 << 20   # values staged per pipelined batch (each batch reuses the thread's buffers)


def _python_packed(base):
    from redis.connection import PythonRespSerializer

    class PythonPackedConnection(base):  # type: ignore[valid-type, misc]
        def _construct_command_packer(self, packer):
            return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return PythonPackedConnection


def fast_client(url: str, cluster: bool = False, **kwargs):
    """A redis-py client (a cluster client with ``cluster``) packing commands with redis-py's Python serializer.

    With hiredis installed redis-py packs commands through hiredis, which
    copies every value: several times slower for large values than the Python
    packer (benchmarks/RESULTS.md, the Redis rows). Replies are
    still parsed by hiredis.
    """
    import redis
    from redis.connection import Connection

    if cluster:
        return redis.RedisCluster.from_url(url, connection_class=_python_packed(Connection), **kwargs)
    pool = redis.ConnectionPool.from_url(url, **kwargs)
    pool.connection_class = _python_packed(pool.connection_class)
    return redis.Redis(connection_pool=pool)


def redis_key(storage: bytes, key: BlockHash) -> bytes:
    return b"tiercache:%s:%s" % (storage.hex().encode(), key.hex().encode())


def transport_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
            OSError, ProtocolError)


class RedisIndex(RemoteIndex):
    def __init__(self, url: str, fmt: ChunkFormat | None = None, lookup_timeout_s: float = 0.25,
                 retry_interval_s: float = 1.0, cluster: bool = False, name: str = "redis") -> None:
        super().__init__(name, fmt, retry_interval_s, where=url)
        # lookups hold the request they serve for at most lookup_timeout_s (then the tier is down)
        self._client = fast_client(url, cluster, socket_timeout=lookup_timeout_s,
                                   socket_connect_timeout=lookup_timeout_s)
        self.parallel_jobs = cluster   # one redis-server is one thread; a cluster's nodes work side by side

    def close(self) -> None:
        super().close()
        self._client.close()

    def _probe(self) -> None:
        self._client.ping()

    def _present(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> int:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            for digest in storage:
                pipe.exists(redis_key(digest, key))
        present = pipe.execute()
        per_key = len(storage)
        n = 0
        while n < len(keys) and all(present[n * per_key:(n + 1) * per_key]):
            n += 1
        return n


class RedisTransport(RemoteTransport):
    def __init__(self, url: str, storage: bytes, fmt: ChunkFormat | None = None, ttl_s: int = 0,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, cluster: bool = False,
                 name: str = "redis", writer: bool = True, codec_threads: CodecThreads | None = None) -> None:
        super().__init__(name, storage, fmt, retry_interval_s, writer, where=url, codec_threads=codec_threads)
        self.ttl_s = ttl_s
        self._errors = transport_errors()
        self._client = fast_client(url, cluster, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._local = threading.local()
        self._direct = not cluster      # raw-socket pipelines (tiers/resp.py); a cluster's go through redis-py

    def close(self) -> None:
        super().close()
        self._client.close()

    def _probe(self) -> None:
        self._client.ping()

    def check_health(self) -> bool:
        """At start: connect (a ``PING``); a server away now is an outage, probed in the background."""
        try:
            self._probe()
        except self._errors as err:
            self._failed("connect", err)
            return False
        return True

    def _rkey(self, key: BlockHash) -> bytes:
        return redis_key(self.storage, key)

    # -- stores --------------------------------------------------------------
    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """Pipelined ``SET NX`` batches of at most ``PIPELINE_BYTES``; the keys that failed."""
        if not self.writer:
            return ()
        failed: list[tuple[BlockHash, Failure]] = []
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and (end == start or size + len(memoryview(items[end][1])) <= PIPELINE_BYTES):
                size += len(memoryview(items[end][1]))
                end += 1
            failed += self._write_batch(items[start:end])
            start = end
        return tuple(failed)

    def _write_batch(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[tuple[BlockHash, Failure]]:
        if not self.available:
            return [(meta.key, Failure.UNAVAILABLE) for meta, _ in items]
        if self._direct:
            return self._write_direct(items)
        refused: list[tuple[BlockHash, Failure]] = []
        sent: list[ChunkMeta] = []
        try:
            pipe = self._client.pipeline(transaction=False)
            for chunk in self._codec.encoded(items, refused):
                if chunk.refused:
                    continue
                value = self._staging(len(sent), len(chunk.header) + len(chunk.payload))
                value[:len(chunk.header)] = chunk.header
                copy_into(value, chunk.payload, len(chunk.header))
                pipe.set(self._rkey(chunk.meta.key), value, ex=self.ttl_s or None, nx=True)
                sent.append(chunk.meta)
            results = pipe.execute(raise_on_error=False)
        except self._errors as err:
            self._failed("store", err)
            return [(meta.key, Failure.UNAVAILABLE) for meta, _ in items]
        self._outage.succeeded()
        # True: stored; None: NX found the chunk there already (kept); an exception: refused
        return refused + [(meta.key, Failure.IO) for meta, r in zip(sent, results) if isinstance(r, Exception)]

    def _staging(self, index: int, nbytes: int) -> memoryview:
        """Reusable per-thread buffer ``index`` of at least ``nbytes`` (cluster path: a value is header +
        payload in one piece, and joining them into fresh memory each time halved SET throughput)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = []
        while len(bufs) <= index:
            bufs.append(bytearray())
        if len(bufs[index]) < nbytes:
            bufs[index] = bytearray(nbytes)
        return memoryview(bufs[index])[:nbytes]

    def _write_direct(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[tuple[BlockHash, Failure]]:
        """Pipelined ``SET ... NX``s, each value sent as header + payload from where they lie. A chunk already
        there is kept: its key names the tokens whose KV it holds, so any replica's copy serves, and a rewrite
        could tear a ranged read running on another replica."""
        def run(sock: socket.socket, reader: ReplyReader) -> list[tuple[BlockHash, Failure]]:
            failed: list[tuple[BlockHash, Failure]] = []
            sent: list[ChunkMeta] = []
            for chunk in self._codec.encoded(items, failed):
                if chunk.refused:
                    continue
                before, after = set_command(self._rkey(chunk.meta.key), len(chunk.header) + len(chunk.payload),
                                            self.ttl_s, only_new=True)
                sock.sendall(before + chunk.header)
                sock.sendall(chunk.payload)
                sock.sendall(after)
                sent.append(chunk.meta)
            for meta in sent:
                try:
                    reader.set_reply()     # False: the chunk was there already, and is kept
                except ReplyError as err:      # e.g. OOM under maxmemory noeviction: this chunk only
                    self._warn.warning("set", "redis tier %s: SET refused: %s", self.name, err)
                    failed.append((meta.key, Failure.IO))
            return failed
        return self._on_connection("store", run, [(meta.key, Failure.UNAVAILABLE) for meta, _ in items])

    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        if not keys or not self.writer or not self.available:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self._rkey(key))    # one command per key: keys may live on other nodes
            pipe.execute()
        except self._errors as err:
            self._failed("delete", err)

    # -- loads ---------------------------------------------------------------
    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | Failure]:
        """One pipelined batch of reads; each value is verified and decoded into its buffer, and with a TTL
        the chunks read get a full one again."""
        if not self.available:
            return [Failure.UNAVAILABLE] * len(items)
        with self._codec.reads() as reads:
            out = self._read_direct(items, reads) if self._direct else self._read_pipelined(items, reads)
        out = reads.settled(items, out, self._corrupt)
        hits = [key for (key, _), got in zip(items, out) if not isinstance(got, Failure)]
        if self.ttl_s and hits:
            self._refresh_ttl(hits)
        return out

    def _read_pipelined(self, items: Sequence[tuple[BlockHash, memoryview]], reads: ReadBatch) -> list[int | Failure]:
        """redis-py's pipelined ``GET``s (a cluster's client routes each to its node)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, _ in items:
                pipe.get(self._rkey(key))
            values = pipe.execute()
        except self._errors as err:
            self._failed("load", err)
            return [Failure.UNAVAILABLE] * len(items)
        self._outage.succeeded()
        return [Failure.MISS if value is None else
                self.receive(reads, ChunkPieces([memoryview(value)]), len(value), key, buf)
                for (key, buf), value in zip(items, values)]

    def _refresh_ttl(self, keys: Sequence[BlockHash]) -> None:
        """Give chunks just read a full TTL again, so the TTL ends a chunk nobody reads, not a hot one."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.expire(self._rkey(key), self.ttl_s)
            pipe.execute(raise_on_error=False)
        except self._errors as err:
            self._failed("ttl refresh", err)

    def _on_connection(self, what: str, run: Callable[[socket.socket, ReplyReader], list], failed: list) -> list:
        """``run`` a pipeline on a connection borrowed from redis-py's pool (so URL, TLS, AUTH and SELECT
        apply), reading the replies itself. The connection goes back to the pool only when every reply was
        read whole; after any error it is dropped, and a transport or protocol error returns ``failed``."""
        pool = self._client.connection_pool
        conn = None
        try:
            conn = pool.get_connection()
            reader = ReplyReader(conn._sock)
            out = run(conn._sock, reader)
            if reader.buffered:
                raise ProtocolError(f"{reader.buffered} bytes beyond the replies asked for")
        except self._errors as err:
            if conn is not None:
                conn.disconnect()
            self._failed(what, err)
            return failed
        except BaseException:
            if conn is not None:
                conn.disconnect()
            raise
        finally:
            if conn is not None:
                pool.release(conn)
        self._outage.succeeded()
        return out

    def _read_direct(self, items: Sequence[tuple[BlockHash, memoryview]], reads: ReadBatch) -> list[int | Failure]:
        """Pipelined ``STRLEN``s, then each present value read in ``GETRANGE`` pieces (`RangedReads`)
        into its buffer, verified as it lands."""
        def run(sock: socket.socket, reader: ReplyReader) -> list[int | Failure]:
            sock.sendall(b"".join(command(b"STRLEN", self._rkey(key)) for key, _ in items))
            lengths = [self._strlen(reader, key) for key, _ in items]
            present = [(self._rkey(key), n) for (key, _), n in zip(items, lengths) if isinstance(n, int) and n]
            ranges = RangedReads(sock, reader, present)
            return [self._receive(reads, ranges.value(), n, key, buf) if isinstance(n, int) and n else
                    (Failure.MISS if n == 0 else n) for (key, buf), n in zip(items, lengths)]
        return self._on_connection("load", run, [Failure.UNAVAILABLE] * len(items))

    def _strlen(self, reader: ReplyReader, key: BlockHash) -> int | Failure:
        """One ``STRLEN`` reply: 0 for a missing key; someone else's value under it (WRONGTYPE) is corrupt."""
        try:
            return reader.integer()
        except ReplyError as err:
            self._warn.warning("foreign", "redis tier %s: chunk %s… is not a value of ours: %s", self.name,
                          key.hex()[:16], err)
            return Failure.CORRUPT

    def _receive(self, reads: ReadBatch, value: RangedValue, n: int, key: BlockHash, buf: memoryview) -> int | Failure:
        """Read one value into ``buf``; a value that changed while it was read (replaced or deleted by another
        client between its ranges) is a miss."""
        try:
            got = self.receive(reads, value, n, key, buf)
        except ValueChanged as err:
            log.info("redis tier %s: chunk %s… changed while it was read: %s", self.name, key.hex()[:16], err)
            got = Failure.MISS
        value.drain()      # the last piece's CRLF, or whatever a change left unread
        return got
