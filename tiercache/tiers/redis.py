"""L3 on Redis (or Valkey): one value per chunk in the stored chunk format, shared by every replica.

Redis owns the data, so this tier keeps no index: `contains` asks Redis (one
pipelined ``EXISTS`` batch), stores and loads are pipelined batches on
transfer threads. With a standalone server both run on a raw socket
borrowed from redis-py's pool (`tiercache.tiers.resp`): a ``SET ... NX`` sends
header and payload from where they lie (a chunk already there is kept, never
rewritten under a reader); a load asks each value's length
(``STRLEN``), then reads it in ``GETRANGE`` pieces straight into its L1
slot, verified as it lands (a whole-value ``GET`` makes redis-server build
the reply in fresh memory first, at a third of the rate). A cluster's go
through redis-py's cluster pipeline. Values are keyed
``tiercache:<namespace>:<key>``, so models, layouts and tenants never meet;
an optional TTL ends a chunk nobody has read for that long (every load
gives the chunks it read a full TTL again), and Redis's own ``maxmemory``
policy bounds their size.

A Redis that does not answer turns into misses, never into errors in the
engine: a failure marks the tier down (`Outage`), during which every call
answers "absent" without touching the network, while a background thread
sends ``PING`` every ``retry_interval`` seconds (redis-py reconnects); the
first answer brings the tier back, without restarting anything.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

from tiercache.chunk_format import ChunkFormat, ChunkMeta
from tiercache.codecs import Buffer, copy_into
from tiercache.keys import BlockHash
from tiercache.server.wire import ChunkPieces
from tiercache.tiers.remote import RemoteTier
from tiercache.tiers.resp import (ProtocolError, RangedReads, RangedValue, ReplyError, ReplyReader, ValueChanged,
                                  command, set_command)

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
    copies every value: a 2 MiB SET ran at 0.69 GB/s that way and 2.74 GB/s
    with the Python packer on these machines (MACHINE_NOTES). Replies are
    still parsed by hiredis.
    """
    import redis
    from redis.connection import Connection

    if cluster:
        return redis.RedisCluster.from_url(url, connection_class=_python_packed(Connection), **kwargs)
    pool = redis.ConnectionPool.from_url(url, **kwargs)
    pool.connection_class = _python_packed(pool.connection_class)
    return redis.Redis(connection_pool=pool)


class RedisTier(RemoteTier):
    def __init__(self, url: str, namespace: bytes, fmt: ChunkFormat | None = None, ttl_s: int = 0,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, cluster: bool = False,
                 name: str = "redis", lookup_timeout_s: float = 0.25) -> None:
        import redis

        super().__init__(name, fmt, retry_interval_s)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ClusterError, OSError, ProtocolError)
        self._client = fast_client(url, cluster, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # lookups (and the rare deletes) run on the engine's scheduling path: their own connections, with a
        # short timeout, so a hung server holds the scheduler for lookup_timeout_s once (then the tier is
        # down), not timeout_s
        lookup_timeout_s = min(lookup_timeout_s, timeout_s)
        self._lookups = fast_client(url, cluster, socket_timeout=lookup_timeout_s,
                                    socket_connect_timeout=lookup_timeout_s)
        self._prefix = f"tiercache:{namespace.hex()}:".encode()
        self._local = threading.local()
        self._direct = not cluster      # raw-socket pipelines (tiers/resp.py); a cluster's go through redis-py
        # One redis-server is one thread: a batch split over two connections only splits its time (loads
        # moved 3.5 GB/s as two jobs, 4.7 as one, benchmarks/RESULTS.md); a cluster's nodes work side by side.
        self.parallel_jobs = cluster

    def close(self) -> None:
        super().close()
        self._client.close()
        self._lookups.close()

    def _probe(self) -> None:
        self._lookups.ping()      # the short timeout: a hung server does not hold the prober for long

    def _rkey(self, key: BlockHash) -> bytes:
        return self._prefix + key.hex().encode()

    def contains(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return self._count_lookup(len(keys), 0)
        try:
            pipe = self._lookups.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._rkey(key))
            present = pipe.execute()
        except self._errors as err:
            self._failed("lookup", err)
            return self._count_lookup(len(keys), 0)
        self._outage.succeeded()
        n = 0
        for hit in present:
            if not hit:
                break
            n += 1
        return self._count_lookup(len(keys), n)

    def has(self, key: BlockHash) -> bool:
        if not self.available:
            return False
        try:
            return bool(self._lookups.exists(self._rkey(key)))
        except self._errors as err:
            self._failed("lookup", err)
            return False

    def delete(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return 0
        try:
            gone = [k for k in keys if self._lookups.delete(self._rkey(k))]   # keys may live on other nodes
        except self._errors as err:
            self._failed("delete", err)
            return 0
        self.counters.deleted += len(gone)
        self._removed(gone)
        return len(gone)

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        ok = self.available
        if not ok:
            self.counters.store_rejected += len(keys)
        return [ok] * len(keys)

    # -- I/O (worker side) ---------------------------------------------------
    def _staging(self, index: int, nbytes: int) -> memoryview:
        """Reusable per-thread buffer ``index`` of at least ``nbytes``: a value is header + payload in one
        piece, and joining them into fresh memory each time (first-touch page faults) halved SET throughput."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = []
        while len(bufs) <= index:
            bufs.append(bytearray())
        if len(bufs[index]) < nbytes:
            bufs[index] = bytearray(nbytes)
        return memoryview(bufs[index])[:nbytes]

    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """Pipelined ``SET`` batches of at most ``PIPELINE_BYTES``; returns the keys that failed."""
        failed: list[BlockHash] = []
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and (end == start or size + len(memoryview(items[end][1])) <= PIPELINE_BYTES):
                size += len(memoryview(items[end][1]))
                end += 1
            failed += self._write_batch(items[start:end])
            start = end
        return failed

    def _write_batch(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        if not self.available:
            return [meta.key for meta, _ in items]
        if self._direct:
            return self._write_direct(items)
        try:
            pipe = self._client.pipeline(transaction=False)
            for i, (meta, raw) in enumerate(items):
                header, payload = self.fmt.encode_parts(meta, raw)
                body = memoryview(payload).cast("B")
                value = self._staging(i, len(header) + len(body))
                value[:len(header)] = header
                copy_into(value, body, len(header))
                pipe.set(self._rkey(meta.key), value, ex=self.ttl_s or None, nx=True)
            results = pipe.execute(raise_on_error=False)
        except self._errors as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        # True: stored; None: NX found the chunk there already (kept); an exception: refused
        return [meta.key for (meta, _), r in zip(items, results) if isinstance(r, Exception)]

    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """One pipelined batch of reads; each value is verified and decoded into its buffer
        (`receive_value`), and with a TTL the chunks read get a full one again.

        Returns the raw length placed per item, or None for a miss, a corrupt
        or foreign value, or an unreachable server.
        """
        if not self.available:
            return [None] * len(items)
        out = self._read_direct(items) if self._direct else self._read_pipelined(items)
        hits = [key for (key, _), got in zip(items, out) if got is not None]
        if self.ttl_s and hits:
            self._refresh_ttl(hits)
        return out

    def _read_pipelined(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """redis-py's pipelined ``GET``s (a cluster's client routes each to its node)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, _ in items:
                pipe.get(self._rkey(key))
            values = pipe.execute()
        except self._errors as err:
            self._failed("load", err)
            return [None] * len(items)
        self._outage.succeeded()
        return [None if value is None else
                self.receive_value(ChunkPieces([memoryview(value)]), len(value), self.namespace, key, buf)
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

    def _read_direct(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """Pipelined ``STRLEN``s, then each present value read in ``GETRANGE`` pieces (`RangedReads`)
        into its buffer, verified as it lands (`receive_value`)."""
        def run(sock: socket.socket, reader: ReplyReader) -> list[int | None]:
            sock.sendall(b"".join(command(b"STRLEN", self._rkey(key)) for key, _ in items))
            lengths = [self._strlen(reader, key) for key, _ in items]
            ranges = RangedReads(sock, reader, [(self._rkey(key), n) for (key, _), n in zip(items, lengths) if n])
            return [self._receive(ranges.value(), n, key, buf) if n else None
                    for (key, buf), n in zip(items, lengths)]
        return self._on_connection("load", run, [None] * len(items))

    def _write_direct(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """Pipelined ``SET ... NX``s, each value sent as header + payload from where they lie; returns failed
        keys. A chunk already there is kept: its key names the tokens whose KV it holds, so any replica's
        copy serves, and a rewrite could tear a ranged read running on another replica."""
        def run(sock: socket.socket, reader: ReplyReader) -> list[BlockHash]:
            for meta, raw in items:
                header, payload = self.fmt.encode_parts(meta, raw)
                body = memoryview(payload).cast("B")
                before, after = set_command(self._rkey(meta.key), len(header) + len(body), self.ttl_s, only_new=True)
                sock.sendall(before + header)
                sock.sendall(body)
                sock.sendall(after)
            failed = []
            for meta, _ in items:
                try:
                    reader.set_reply()     # False: the chunk was there already, and is kept
                except ReplyError as err:      # e.g. OOM under maxmemory noeviction: this chunk only
                    log.warning("redis tier %s: SET refused: %s", self.name, err)
                    failed.append(meta.key)
            return failed
        return self._on_connection("store", run, [meta.key for meta, _ in items])

    def _strlen(self, reader: ReplyReader, key: BlockHash) -> int:
        """One ``STRLEN`` reply: 0 for a missing key, or for someone else's value under it (WRONGTYPE)."""
        try:
            return reader.integer()
        except ReplyError as err:
            self._rejected(key, err)
            return 0

    def _receive(self, value: RangedValue, n: int, key: BlockHash, buf: memoryview) -> int | None:
        """Read one value into ``buf`` (`receive_value`); None for a bad value or one that changed
        while it was read (replaced or deleted by another client between its ranges)."""
        try:
            got = self.receive_value(value, n, self.namespace, key, buf)
        except ValueChanged as err:
            log.info("redis tier %s: chunk %s… changed while it was read: %s", self.name, key.hex()[:16], err)
            got = None
        value.drain()      # the last piece's CRLF, or whatever a change left unread
        return got
