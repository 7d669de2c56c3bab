"""The gRPC service of `tiercache serve`: request checks, auth, and the RPCs over a `ChunkStore`.

Handlers are registered as generic handlers that receive raw bytes, so a
malformed request is parsed here and answered with ``INVALID_ARGUMENT`` and a
log line (protobuf deserialisers failing inside gRPC would give ``INTERNAL``
and no context), and a `Chunk` is parsed without copying its value.

Every call but ``Health`` runs as the tenant its token names
(`tiercache.server.tenants`): reads look in that tenant's store and the ones it
was granted, writes and deletes in its own only.

Error statuses, each with one log line naming the peer:
- ``UNAUTHENTICATED``: tokens are configured and the call has none of them;
- ``PERMISSION_DENIED``: the tenant may not do this (write, delete, stats);
- ``INVALID_ARGUMENT``: a malformed message, a namespace or key of the wrong
  size, a value whose header is damaged or names another namespace or key;
- ``RESOURCE_EXHAUSTED``: a message larger than ``max_message_bytes`` (gRPC
  itself refuses anything above twice that before it reaches a handler), a
  chunk declaring a value over the value limit, a chunk that finds no room in
  the in-flight budget in time, a stream when every stream slot is taken
  (`tiercache.server.limits`). A stream that stops moving is cancelled.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tiercache import __version__
from tiercache.wire.chunk_format import HEADER_BYTES
from tiercache.errors import ChunkFormatError
from tiercache.keys import NAMESPACE_DIGEST_BYTES
from tiercache.wire import tiercache_pb2 as pb
from tiercache.server.fair import Hold, InflightBytes
from tiercache.server.limits import ServerLimits, StreamWatch, end_call
from tiercache.server.store import PutOutcome
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.server.values import check_value
from tiercache.wire.grpc_messages import (
    AUTH_HEADER, MAX_KEY_BYTES, MAX_KEYS_PER_CALL, SERVICE, ChunkView, WireError, encode_chunk, read_chunk,
)

log = logging.getLogger("tiercache.server")

INCOMING_NAME = re.compile(r"[0-9a-f]{32}\.tmp")   # what clients name the chunk files they hand in (Adopt)


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _identity(data: bytes) -> bytes:
    return data


class CacheService:
    def __init__(self, tenancy: Tenancy, max_message_bytes: int, limits: ServerLimits,
                 inflight: InflightBytes) -> None:
        self.tenancy = tenancy
        self.max_message_bytes = max_message_bytes
        self.limits = limits
        self.inflight = inflight
        self.streams = StreamWatch(limits.max_streams, limits.read_timeout_s)
        self.serving = True
        self.data_port = 0          # set by the server when its data channel listens
        self.counters: Counter[str] = Counter()

    # -- registration --------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        rpc = {
            "Contains": grpc.unary_unary_rpc_method_handler(self._guard(self.contains), _identity, _identity),
            "Get": grpc.unary_stream_rpc_method_handler(self._guard_stream(self.get), _identity, _identity),
            "Put": grpc.stream_unary_rpc_method_handler(self._guard(self.put), _identity, _identity),
            "Delete": grpc.unary_unary_rpc_method_handler(self._guard(self.delete), _identity, _identity),
            "Stats": grpc.unary_unary_rpc_method_handler(self._guard(self.stats), _identity, _identity),
            "Health": grpc.unary_unary_rpc_method_handler(self._guard(self.health, auth=False), _identity, _identity),
            "Local": grpc.unary_unary_rpc_method_handler(self._guard(self.local), _identity, _identity),
            "Adopt": grpc.unary_unary_rpc_method_handler(self._guard(self.adopt), _identity, _identity),
            "Touch": grpc.unary_unary_rpc_method_handler(self._guard(self.touch), _identity, _identity),
        }
        return grpc.method_handlers_generic_handler(SERVICE, rpc)

    def _guard(self, fn, auth: bool = True):
        name = fn.__name__

        def run(request: Any, context: grpc.ServicerContext) -> bytes:
            self.counters[f"rpc_{name}"] += 1
            try:
                if not auth:
                    return fn(request, context)
                return fn(request, context, self._authorize(context))
            except _Rejected as err:
                self._reject(name, context, err)
                raise AssertionError("unreachable: context.abort raises")
        return run

    def _guard_stream(self, fn):
        name = fn.__name__

        def run(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.counters[f"rpc_{name}"] += 1
            try:
                tenant = self._authorize(context)
                with self._stream_slot(context, tenant) as (waiting, moved):
                    for message in fn(request, context, tenant):
                        waiting()            # until the client has taken it (gRPC's flow control)
                        yield message
                        moved()
            except _Rejected as err:
                self._reject(name, context, err)
        return run

    @contextlib.contextmanager
    def _stream_slot(self, context: grpc.ServicerContext, tenant: Tenant):
        """One of the stream slots (the tenant's fair share: `StreamWatch`), for as long as the stream runs;
        yields the calls that say the handler now waits on its client, and that the client moved."""
        sid = self.streams.admit(context, tenant.name)
        if sid is None:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"all {self.streams.limit} stream slots are busy; try again")
        try:
            yield (lambda: self.streams.waiting(sid)), (lambda: self.streams.moved(sid))
        finally:
            self.streams.done(sid)

    def _reject(self, name: str, context: grpc.ServicerContext, err: _Rejected) -> None:
        self.counters[f"rejected_{err.code.name.lower()}"] += 1
        log.warning("rejected %s from %s: %s: %s", name, context.peer(), err.code.name, err.details,
                    extra={"event": "rpc_rejected", "rpc": name, "peer": context.peer(), "code": err.code.name})
        context.abort(err.code, err.details)

    # -- checks --------------------------------------------------------------
    def _authorize(self, context: grpc.ServicerContext) -> Tenant:
        given = next((v for k, v in context.invocation_metadata() if k == AUTH_HEADER), "")
        given = given.decode(errors="replace") if isinstance(given, bytes) else given
        if given and not given.startswith("Bearer "):
            tenant = None                      # a token must come as `Bearer <token>` (none: an open server's)
        else:
            tenant = self.tenancy.who(given.removeprefix("Bearer "))
        if tenant is None:
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
        return tenant

    @staticmethod
    def _allowed(tenant: Tenant, right: str) -> None:
        if not getattr(tenant, right):
            raise _Rejected(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not {right}")

    def _sized(self, data: bytes) -> bytes:
        if len(data) > self.max_message_bytes:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"message of {len(data)} bytes exceeds the server's limit of {self.max_message_bytes}")
        return data

    def _parse(self, cls: type[Message], data: bytes) -> Any:
        msg = cls()
        try:
            msg.ParseFromString(self._sized(data))
        except DecodeError as err:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {err}") from None
        return msg

    @staticmethod
    def _names(namespace: bytes, keys) -> None:
        if len(namespace) != NAMESPACE_DIGEST_BYTES:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"namespace must be {NAMESPACE_DIGEST_BYTES} bytes, got {len(namespace)}")
        if len(keys) > MAX_KEYS_PER_CALL:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call, limit {MAX_KEYS_PER_CALL}")
        for key in keys:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"key of {len(key)} bytes (1..{MAX_KEY_BYTES})")

    # -- RPCs ----------------------------------------------------------------
    def contains(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = self._parse(pb.ContainsRequest, request)
        self._names(req.namespace, req.keys)
        return pb.ContainsReply(present=self._present(tenant, req.namespace, list(req.keys))).SerializeToString()

    def _present(self, tenant: Tenant, namespace: bytes, keys: list[bytes]) -> int:
        """How many leading keys some store the tenant reads holds (a shared prefix may lie in a granted
        store and the rest in its own)."""
        stores = self.tenancy.readable(tenant)
        n = stores[0].contains(namespace, keys)
        if len(stores) == 1:
            return n
        while n < len(keys) and any(s.contains(namespace, [keys[n]]) for s in stores):
            n += 1
        return n

    def get(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> Iterator[bytes]:
        req = self._parse(pb.GetRequest, request)
        self._names(req.namespace, req.keys)
        stores = self.tenancy.readable(tenant)
        for key in req.keys:
            messages = next((m for m in (s.get(req.namespace, key) for s in stores) if m is not None), None)
            if messages is None:
                yield encode_chunk(req.namespace, key)
                continue
            self.counters["bytes_out"] += sum(len(m) for m in messages)
            yield from messages

    def put(self, requests: Iterator[bytes], context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        self._allowed(tenant, "write")
        store = self.tenancy.own(tenant)
        reply = pb.PutReply()
        holds: list[Hold] = []            # the in-flight reservations of the chunk being received
        with self._stream_slot(context, tenant) as (waiting, moved):
            def messages() -> Iterator[bytes]:
                pending = iter(requests)
                while True:
                    waiting()
                    m = next(pending, None)
                    moved()
                    if m is None:
                        return
                    for hold in holds:       # its bytes are arriving: the reservation is in use
                        self.inflight.moved(hold)
                    yield self._sized(m)
            stream = messages()
            try:
                while (chunk := self._chunk(stream, tenant, context, holds)) is not None:
                    head, raw = chunk
                    try:
                        self.counters["bytes_in"] += head.total
                        outcome = store.put(head.namespace, head.key, raw)
                    finally:
                        self._release(holds)
                    if outcome is PutOutcome.STORED:
                        reply.stored += 1
                    elif outcome is PutOutcome.PRESENT:
                        reply.present += 1
                    else:
                        reply.rejected.append(head.key)
            except (grpc.RpcError, grpc.aio.AbortError):   # ended by the watchdog (stalled), or the client left
                self.counters["streams_cancelled"] += 1
                raise
        return reply.SerializeToString()

    def _admit(self, head: ChunkView, tenant: Tenant, context: grpc.ServicerContext) -> Hold:
        """A chunk's declared length, checked and reserved (for this stream of this tenant) before any more of
        it is received."""
        self._names(head.namespace, [head.key])
        if head.total < HEADER_BYTES:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a value of {head.total} bytes, shorter than a chunk header ({HEADER_BYTES})")
        if head.total > self.limits.max_value_bytes:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"a value of {head.total} bytes, over the server's value limit of "
                            f"{self.limits.max_value_bytes}")
        hold = self.inflight.reserve(head.total, self.limits.admit_wait_s, tenant.name, context,
                                     revoke=lambda: end_call(context, "silent past its tenant's share of the "
                                                                      "in-flight budget while others wait"))
        if hold is None:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no room for a {head.total}-byte value in the server's in-flight budget; try again")
        return hold

    def _chunk(self, messages, tenant: Tenant, context: grpc.ServicerContext, holds: list[Hold]):
        """The next chunk of a Put stream, checked, its bytes reserved in the in-flight budget (into ``holds``,
        which the caller releases): (first message parsed, its raw messages); None at the end."""
        try:
            got = read_chunk(messages, lambda head: holds.append(self._admit(head, tenant, context)))
        except WireError as err:
            self._release(holds)
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed Chunk: {err}") from None
        except BaseException:
            self._release(holds)
            raise
        if got is None:
            return None
        head, pieces, raw = got
        try:
            check_value(head.namespace, head.key, pieces[0][:HEADER_BYTES], head.total)
        except ChunkFormatError as err:
            self._release(holds)
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"chunk {head.key.hex()[:16]}… rejected: {type(err).__name__}: {err}") from None
        return head, raw

    def _release(self, holds: list[Hold]) -> None:
        for hold in holds:
            self.inflight.release(hold)
        holds.clear()

    def delete(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        self._allowed(tenant, "delete")
        req = self._parse(pb.DeleteRequest, request)
        self._names(req.namespace, req.keys)
        deleted = self.tenancy.own(tenant).delete(req.namespace, list(req.keys))
        return pb.DeleteReply(deleted=deleted).SerializeToString()

    def stats(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        self._allowed(tenant, "stats")
        self._parse(pb.StatsRequest, request)
        s = self.stats_dict() if tenant.admin else self.tenancy.own(tenant).stats()
        reply = pb.StatsReply(namespaces=s["namespaces"])
        for name, t in s["tiers"].items():
            counters = {k: int(v) for k, v in t.items() if isinstance(v, int) and not isinstance(v, bool)}
            reply.tiers.add(name=name, capacity_bytes=t["capacity_bytes"], used_bytes=t["used_bytes"],
                            chunks=t["chunks"], counters=counters)
        reply.counters.update({k: int(v) for k, v in s["server"].items()})
        for namespace, key, hits in s["hot_chunks"]:
            reply.hot_chunks.add(namespace=namespace, key=key, hits=hits)
        return reply.SerializeToString()

    def health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._parse(pb.HealthRequest, request)
        status = pb.HealthReply.SERVING if self.serving else pb.HealthReply.NOT_SERVING
        return pb.HealthReply(status=status, version=__version__, max_message_bytes=self.max_message_bytes,
                              data_port=self.data_port).SerializeToString()

    def local(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        self._parse(pb.LocalRequest, request)
        shm = self.tenancy.own(tenant).shm
        if shm is None:
            return pb.LocalReply().SerializeToString()
        return pb.LocalReply(directory=str(shm.root), instance=shm.instance).SerializeToString()

    def adopt(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        self._allowed(tenant, "write")
        req = self._parse(pb.AdoptRequest, request)
        self._names(req.namespace, req.keys)
        store = self.tenancy.own(tenant)
        if store.shm is None:
            raise _Rejected(grpc.StatusCode.FAILED_PRECONDITION, "this server has no local data path (--shm-dir)")
        if len(req.files) != len(req.keys):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{len(req.files)} files for {len(req.keys)} keys")
        for name in req.files:
            if not INCOMING_NAME.fullmatch(name):
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"incoming file name {name[:80]!r} is not "
                                f"32 hex digits + .tmp")
        reply = pb.PutReply()
        for key, name in zip(req.keys, req.files):
            try:
                outcome = store.adopt(req.namespace, key, name)
            except ChunkFormatError as err:
                self.counters["adopt_bad_files"] += 1
                log.warning("adopt from %s: chunk %s… rejected: %s", context.peer(), key.hex()[:16], err,
                            extra={"event": "adopt_rejected", "peer": context.peer()})
                outcome = PutOutcome.REJECTED
            if outcome is PutOutcome.STORED:
                reply.stored += 1
            elif outcome is PutOutcome.PRESENT:
                reply.present += 1
            else:
                reply.rejected.append(key)
        return reply.SerializeToString()

    def touch(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = self._parse(pb.TouchRequest, request)
        self._names(req.namespace, req.keys)
        touched = sum(s.touch(req.namespace, list(req.keys)) for s in self.tenancy.readable(tenant))
        return pb.TouchReply(touched=touched).SerializeToString()

    def stats_dict(self) -> dict[str, Any]:
        """The whole server: every tenant's store (its tiers named ``tenant/tier`` when there are several) and
        the server's own counters."""
        stores = self.tenancy.stores
        if len(stores) == 1:
            s = next(iter(stores.values())).stats()
        else:
            per = {name: store.stats() for name, store in stores.items()}
            merged: Counter[str] = Counter()
            for one in per.values():
                merged.update(one["server"])
            s = {"tiers": {f"{name}/{tier}": t for name, one in per.items() for tier, t in one["tiers"].items()},
                 "namespaces": sum(one["namespaces"] for one in per.values()), "server": dict(merged),
                 "hot_chunks": sorted((h for one in per.values() for h in one["hot_chunks"]),
                                      key=lambda h: -h[2])[:10],
                 "tenants": self.tenancy.usage()}
        s["server"] = {**s["server"], **self.counters, "inflight_bytes": self.inflight.used,
                       "inflight_refused": self.inflight.refused, "inflight_taken_back": self.inflight.taken_back,
                       "streams_refused": self.streams.refused, "streams_taken_back": self.streams.taken_back,
                       "streams_stalled": self.streams.cancelled}
        return s
