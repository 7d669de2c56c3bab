"""L3 on Redis (or Valkey): one value per chunk and rank in the stored chunk format, shared by every replica.

Redis owns the data, so no side keeps an index. Values are keyed
``tiercache:<storage digest>:<key>``: the digest names the namespace, the
chunk size and the rank's share of the KV, so models, layouts, tenants and
tensor-parallel sizes never meet; an optional TTL ends a chunk nobody has
read for that long (every load gives the chunks it read a full TTL again),
and Redis's own ``maxmemory`` policy bounds their size.

- `RedisIndex` (scheduler side): lookups — one pipelined ``EXISTS`` batch
  over every writing rank's key of each chunk — on the index's lookup thread,
  over connections of their own with a short ``lookup_timeout`` (a lookup
  past it is a miss; a few in a row take the tier down,
  `tiercache.tiers.remote_index`); and the
  purges announced in ``tiercache-purges`` (`RedisPurges`), for the engine's
  own tiers.
- `RedisTransport` (worker side, one per rank): pipelined stores and loads
  on transfer threads, through one value channel: a raw socket borrowed from
  redis-py's pool for a standalone server, redis-py's cluster pipeline for a
  cluster (`tiercache.tiers.redis_channels`).
- Its door (`tiercache.tiers.redis_sightings`), its state kept in Redis so
  that every replica's demand counts: with ``admission="adaptive-sighting"``
  (the default) the requests each engine admits are counted there and drive
  `AdaptiveSightingAdmit`'s shadow duel, and a store takes a chunk while
  Redis has room, while the duel says everything, or once requests — any
  replica's — asked for it twice; with ``"second-sighting"`` the lookups'
  runs are counted and a store takes what has room or was asked for twice.

A Redis that does not answer turns into misses, never into errors in the
engine (`tiercache.tiers.remote`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from tiercache.codecs import Buffer
from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.contracts.purge import PurgeOrder
from tiercache.policies.admission import GuardedTier
from tiercache.tiers.channels import ValueChannel
from tiercache.tiers.purge_watch import RedisPurges
from tiercache.tiers.redis_channels import PipelinedValues, RawSocketValues
from tiercache.tiers.redis_sightings import AdaptiveSightings, Sightings
from tiercache.tiers.remote import RemoteTransport
from tiercache.tiers.remote_index import RemoteIndex
from tiercache.tiers.resp import ProtocolError
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecThreads

log = logging.getLogger(__name__)


def _python_packed(base):
    from redis.connection import PythonRespSerializer

    class PythonPackedConnection(base):  # type: ignore[valid-type, misc]
        def _construct_command_packer(self, packer):
            return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return PythonPackedConnection


def fast_client(url: str, cluster: bool = False, **kwargs):
    """A redis-py client (a cluster client with ``cluster``) packing commands with redis-py's Python serializer.

    With hiredis installed redis-py packs commands through hiredis, which
    copies every value, where the Python packer sends large values as they
    are. Replies are still parsed by hiredis.
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


DOORS = {"adaptive-sighting": AdaptiveSightings, "second-sighting": Sightings}   # `redis.admission`; always: none


def door_for(admission: str, client) -> Sightings | None:
    """The door ``admission`` names over ``client`` (None for ``always``)."""
    door = DOORS.get(admission)
    return door(client) if door is not None else None


def transport_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
            OSError, ProtocolError)


class RedisIndex(RemoteIndex):
    """Scheduler side: lookups on Redis, off the scheduler's thread."""

    def __init__(self, url: str, fmt: ChunkFormat | None = None, lookup_timeout_s: float = 0.25,
                 retry_interval_s: float = 1.0, cluster: bool = False, name: str = "redis",
                 admission: str = "adaptive-sighting") -> None:
        super().__init__(name, fmt, retry_interval_s, where=url)
        # lookups hold the request they serve for at most lookup_timeout_s (then it is a miss)
        self._client = fast_client(url, cluster, socket_timeout=lookup_timeout_s,
                                   socket_connect_timeout=lookup_timeout_s)
        self.parallel_jobs = cluster   # one redis-server is one thread; a cluster's nodes work side by side
        self._purges: RedisPurges | None = None
        self._sightings = door_for(admission, self._client)

    def size_for(self, tier: GuardedTier) -> None:
        """The door's shadows model ``tier`` (`Sightings.size_for`): ``l1_chunks``, this engine's L1; ``chunks``,
        Redis's (0: as Redis's ``maxmemory`` over a chunk's values names it)."""
        if self._sightings is not None:
            self._sightings.size_for(tier)

    def attach(self, storage_digests: Sequence[bytes]) -> None:
        super().attach(storage_digests)
        if self._sightings is not None:
            self._sightings.ranks = len(self._storage)      # a chunk is one value per writing rank
        if self._purges is None:           # what `tiercache purge --redis` takes out reaches this engine too
            self._purges = RedisPurges(self._client, self._storage, self.name)

    def take_purges(self) -> list[PurgeOrder]:
        return self._purges.take() if self._purges is not None else []

    def purges_applied(self) -> None:
        if self._purges is not None:
            self._purges.applied()

    def close(self) -> None:
        if self._purges is not None:
            self._purges.close()
        super().close()
        self._client.close()

    def record(self, keys: Sequence[BlockHash]) -> None:
        """A request this engine admitted wants ``keys``: told to a door that counts requests, on the lookup
        thread (queued behind the lookups asked before it; the scheduler does not wait)."""
        if self._sightings is not None and self._sightings.counts_requests and self._storage and self.available:
            self._pool.submit(self._guarded, lambda k, _: self._sightings.record(k), list(keys), None)

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """A request that comes back vouches for its chunks at a door that counts requests (as `record`)."""
        if self._sightings is not None and self._sightings.counts_requests and self._storage and self.available:
            self._pool.submit(self._guarded, lambda k, _: self._sightings.retain(k, state), list(keys), None)

    def _probe(self) -> None:
        self._client.ping()

    def _slow(self, err: Exception) -> bool:
        import redis

        return isinstance(err, redis.exceptions.TimeoutError)

    def _present(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> int:
        """The run, and one sighting of each key asked where the door counts lookups (`Sightings.sight`): before
        the answer, so a store that follows it finds the lookup counted."""
        each = self._present_each(keys, storage)
        if self._sightings is not None:
            self._sightings.sight(keys)
        return each.index(False) if False in each else len(each)

    def _present_each(self, keys: Sequence[BlockHash], storage: Sequence[bytes]) -> list[bool]:
        """One pipelined ``EXISTS`` per key and digest."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            for digest in storage:
                pipe.exists(redis_key(digest, key))
        present = pipe.execute()
        per_key = len(storage)
        return [all(present[i * per_key:(i + 1) * per_key]) for i in range(len(keys))]


class RedisTransport(RemoteTransport):
    """Worker side, one per rank: its values through one channel — a raw socket to a standalone server, redis-py's
    cluster pipeline to a cluster (`tiercache.tiers.redis_channels`)."""

    def __init__(self, url: str, storage: bytes, fmt: ChunkFormat | None = None, ttl_s: int = 0,
                 renew_on_read: bool = True, timeout_s: float = 2.0, retry_interval_s: float = 1.0,
                 cluster: bool = False, name: str = "redis", writer: bool = True,
                 codec_threads: CodecThreads | None = None, admission: str = "adaptive-sighting") -> None:
        super().__init__(name, storage, fmt, retry_interval_s, writer, where=url, codec_threads=codec_threads)
        self.ttl_s = ttl_s
        self.renew_on_read = renew_on_read      # False under a retention: a read must not extend a chunk's life
        self.transport_errors = transport_errors()
        self._client = fast_client(url, cluster, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        channel = PipelinedValues(self._client, self._rkey, ttl_s) if cluster else \
            RawSocketValues(self._client, self._rkey, ttl_s, self._warn, name)
        self._values: tuple[ValueChannel, ...] = (channel,)
        self._door = door_for(admission, self._client)

    def _channels(self) -> Sequence[ValueChannel]:
        return self._values

    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        """Each chunk Redis's door takes (`Sightings.admitted`) stored; those it refuses are not sent, and fail
        as refused writes (`Failure.IO`: the tier declined them)."""
        if self._door is None or not items or not self.writer or not self.available:
            return super().write_chunks(items)
        chunks = [meta for meta, _ in items]
        try:
            taken = self._door.admitted(chunks)
        except self.transport_errors as err:
            self._failed("store", err)
            return tuple((c.key, self._store_failure(err)) for c in chunks)
        refused = tuple((c.key, Failure.IO) for c, ok in zip(chunks, taken) if not ok)
        return tuple(super().write_chunks([item for item, ok in zip(items, taken) if ok])) + refused

    def close(self) -> None:
        super().close()
        self._client.close()

    def _store_failure(self, err: BaseException) -> Failure:
        import redis

        return Failure.TIMEOUT if isinstance(err, redis.exceptions.TimeoutError) else super()._store_failure(err)

    def _probe(self) -> None:
        self._client.ping()

    def check_health(self) -> bool:
        """At start: connect (a ``PING``); a server away now is an outage, probed in the background."""
        try:
            self._probe()
        except self.transport_errors as err:
            self._failed("connect", err)
            return False
        return True

    def _rkey(self, key: BlockHash) -> bytes:
        return redis_key(self.storage, key)

    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        if not keys or not self.writer or not self.available:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self._rkey(key))    # one command per key: keys may live on other nodes
            pipe.execute()
        except self.transport_errors as err:
            self._failed("delete", err)

    def _after_read(self, keys: Sequence[BlockHash]) -> None:
        """With a TTL, give chunks just read a full one again, so the TTL ends a chunk nobody reads, not a hot
        one."""
        if not self.ttl_s or not self.renew_on_read:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.expire(self._rkey(key), self.ttl_s)
            pipe.execute(raise_on_error=False)
        except self.transport_errors as err:
            self._failed("ttl refresh", err)
