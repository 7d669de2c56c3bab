"""The gRPC service of `tiercache serve`: request checks, auth, and the RPCs over a `ChunkStore`.

Handlers are registered as generic handlers that receive raw bytes, so a
malformed request is parsed here and answered with ``INVALID_ARGUMENT`` and a
log line (protobuf deserialisers failing inside gRPC would give ``INTERNAL``
and no context), and a `Chunk` is parsed without copying its value.

Every call but ``Health`` runs as the tenant its token names
(`tiercache.server.tenants`): reads look in that tenant's store and the ones it
was granted, writes and deletes in its own only. The token is checked from the
call's headers, before any of its messages is received.

No message is received before its call holds a slot (`tiercache.server.limits`):
every method is registered as one whose handler reads its requests itself. A
unary call's request (and ``Get``'s) is read on the event loop under one of the
*request slots*, held until the call's work in the handler pool is done; a
``Put`` stream's messages are read in its handler thread under a *stream slot*.
Until then a call holds gRPC's initial receive window (64 KiB) and its state.

Error statuses, each with one log line naming the peer:
- ``UNAUTHENTICATED``: tokens are configured and the call has none of them;
- ``PERMISSION_DENIED``: the tenant may not do this (write, delete, stats);
- ``INVALID_ARGUMENT``: a malformed message, a namespace or key of the wrong
  size, a value whose header is damaged or names another namespace or key;
- ``RESOURCE_EXHAUSTED``: a message larger than ``max_message_bytes`` (gRPC
  itself refuses it from its length prefix, before any handler), a chunk
  declaring a value over the value limit, a chunk that finds no room in the
  in-flight budget in time, a call whose tenant's share of the request or
  stream slots is taken. A stream that stops moving is cancelled, and so is a
  call whose request does not come.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tiercache import __version__
from tiercache.audit import AuditTrail
from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.contracts.purge import DEFAULT_WAIT_S, POLL_INTERVAL_S, PurgeOrder, order_selectors
from tiercache.errors import ChunkFormatError
from tiercache.server.fair import Hold, InflightBytes
from tiercache.server.limits import ServerLimits, StreamWatch, end_call
from tiercache.server.purge_log import MAX_WATCHER_ID, PurgeLog
from tiercache.server.store import PutOutcome
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.server.values import check_value
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import HEADER_BYTES
from tiercache.wire.grpc_messages import (
    AUTH_HEADER,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    SERVICE,
    ChunkView,
    WireError,
    encode_chunk,
    read_chunk,
)

log = logging.getLogger("tiercache.server")

STREAM_SILENT_S = 0.25   # a stream of a tenant over its share silent this long gives its slot to another tenant
REQUEST_SILENT_S = 0.1    # a call whose one request has not come for this long gives its slot to a newcomer
                          # (a client sends a unary call's request with its headers, in one write)
MAX_PURGE_WAIT_S = 60.0
MAX_PURGES_PER_REPLY = 256    # a client far behind catches up over several polls
INCOMING_NAME = re.compile(r"[0-9a-f]{32}\.tmp")   # what clients name the chunk files they hand in (Adopt)


def _forget_frames(err: BaseException) -> None:
    """Drop the tracebacks of ``err`` and of the exceptions it was raised from or during."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _TaskCall:
    """An asyncio handler's call as the watchdogs (`StreamWatch`) see it: `abort`, from any thread, cancels
    the handler's task, and `ended_as_rejection` turns that cancellation into the status it was ended with."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task = asyncio.current_task()
        self._ended: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._ended = (code, details)
        self._loop.call_soon_threadsafe(self._task.cancel)

    @contextlib.contextmanager
    def ended_as_rejection(self):
        try:
            yield
        except asyncio.CancelledError:
            if self._ended is None:          # cancelled by gRPC: the client left, or the server stops
                raise
            self._task.uncancel()
            raise _Rejected(*self._ended) from None


@dataclass(slots=True)
class _AfterEngines:
    """A purge made: its reply goes once the engines polling for purges applied it, or its wait is over."""
    reply: pb.PurgeReply
    tenant: str
    seq: int
    wait_s: float

    async def settle(self, purges: PurgeLog) -> bytes:
        give_up = time.monotonic() + self.wait_s
        while True:
            applied, pending = purges.pending(self.tenant, self.seq)
            if not pending or time.monotonic() >= give_up:
                break
            await asyncio.sleep(POLL_INTERVAL_S / 5)
        self.reply.engines_applied, self.reply.engines_pending = applied, pending
        return self.reply.SerializeToString()


class _Request:
    """Reads a call's one request under its slot, telling the watchdog while the handler waits for it."""

    def __init__(self, context: grpc.aio.ServicerContext, waiting, moved) -> None:
        self._context = context
        self._waiting = waiting
        self._moved = moved

    async def read(self) -> bytes:
        self._waiting()
        message = await _uncancelled(self._context.read())
        self._moved()
        if message is grpc.aio.EOF:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the call ended before its request came")
        return message


def _identity(data: bytes) -> bytes:
    return data


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()             # an outcome nobody awaits any more is not an error to report


async def _uncancelled(operation) -> Any:
    """Await one of gRPC's reads or writes so that cancelling the handler does not cancel the operation.

    grpc.aio frees what an operation holds in C — a received message's buffer, a sent one's — only when its
    awaiter sees it complete; an awaiter cancelled first drops it, and that memory is never given back
    (grpc/grpc#43360). Calls are cancelled all the time here (a client's deadline, a slot taken back), and
    each could lose a message of up to ``max_message`` bytes, without bound under a hostile tenant's rounds
    of maximal calls. Shielded, the operation runs to its end — the call's end completes it — and its
    awaiter frees it, while the handler is cancelled at once."""
    task = asyncio.ensure_future(operation)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


class CacheService:
    """Server: the gRPC methods, on grpc.aio's event loop, their work on the handler pool."""

    def __init__(self, tenancy: Tenancy, max_message_bytes: int, limits: ServerLimits,
                 inflight: InflightBytes, pool: Executor, audit: AuditTrail | None = None) -> None:
        self.tenancy = tenancy
        self.max_message_bytes = max_message_bytes
        self.limits = limits
        self.inflight = inflight
        self.pool = pool                    # the handler threads: every call's work runs there
        self.streams = StreamWatch(limits.max_streams, limits.read_timeout_s, share_silent_s=STREAM_SILENT_S)
        self.requests = StreamWatch(limits.max_requests, limits.read_timeout_s,
                                    share_silent_s=REQUEST_SILENT_S, take_back_own=True)
        self.serving = True
        self.data_port = 0          # set by the server when its data channel listens
        self.purge_log = PurgeLog()
        self.audit = audit or AuditTrail()      # purges, per tenant (the server's, which closes it)
        self.counters: Counter[str] = Counter()

    # -- registration --------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        unary = {"Contains": self.contains, "Delete": self.delete, "Stats": self.stats, "Local": self.local,
                 "Adopt": self.adopt, "Touch": self.touch, "Purge": self.purge, "Purges": self.purges}
        rpc = {name: grpc.stream_unary_rpc_method_handler(self._guard_unary(fn), _identity, _identity)
               for name, fn in unary.items()}
        rpc["Health"] = grpc.stream_unary_rpc_method_handler(self._guard_unary(self.health, auth=False),
                                                             _identity, _identity)
        rpc["Get"] = grpc.stream_stream_rpc_method_handler(self._guard_get(), _identity, _identity)
        rpc["Put"] = grpc.stream_unary_rpc_method_handler(self._guard_put(), _identity, _identity)
        return grpc.method_handlers_generic_handler(SERVICE, rpc)

    # Every call is registered as one whose requests the handler reads itself, so that no message is received
    # before the call holds a slot for it (see the module docstring). A unary call's request is read on the
    # event loop, holding no thread, and the call's work runs in the handler pool.
    def _guard_unary(self, fn, auth: bool = True):
        name = fn.__name__

        async def run(requests, context: grpc.aio.ServicerContext) -> bytes:
            self.counters[f"rpc_{name}"] += 1
            try:
                # Health asks for no token, but one that names a tenant counts its call in that tenant's share
                tenant = self._authorize(context) if auth else self._caller(context)
                async with self._request_slot(context, tenant) as slot:
                    request = await slot.read()
                    work = (lambda: fn(request, context, tenant)) if auth else (lambda: fn(request, context))
                    reply = await asyncio.get_running_loop().run_in_executor(self.pool, work)
                if isinstance(reply, _AfterEngines):      # outside its slot, holding no thread
                    reply = await reply.settle(self.purge_log)
                return reply
            except BaseException as err:
                self._end(name, context, err)
                return b""
        return run

    def _guard_get(self):
        async def run(requests, context: grpc.aio.ServicerContext) -> None:
            self.counters["rpc_get"] += 1
            loop = asyncio.get_running_loop()
            try:
                tenant = self._authorize(context)
                async with self._request_slot(context, tenant) as slot:
                    request = await slot.read()
                    namespace, keys = await loop.run_in_executor(self.pool, self._get_request, request)
                del request
                call = _TaskCall(loop)
                with call.ended_as_rejection(), self._stream_slot(call, tenant) as (waiting, moved):
                    messages = self.get(namespace, keys, tenant)
                    while (message := await loop.run_in_executor(self.pool, next, messages, None)) is not None:
                        waiting()            # until the client has taken it (gRPC's flow control)
                        await _uncancelled(context.write(message))
                        moved()
            except BaseException as err:
                self._end("get", context, err)
        return run

    def _guard_put(self):
        def run(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            self.counters["rpc_put"] += 1
            try:
                return self.put(requests, context, self._authorize(context))
            except BaseException as err:
                self._end("put", context, err)
                return b""
            finally:
                # gRPC's request iterator, left suspended, holds the last message it gave (up to max_message
                # bytes): closed now, not whenever the collector reaches what is left of the call
                close = getattr(requests, "close", None)
                if close is not None:
                    close()
        return run

    @contextlib.asynccontextmanager
    async def _request_slot(self, context: grpc.aio.ServicerContext, tenant: Tenant | None):
        """One of the request slots (`requests`: the tenant's fair share, and ended by the watchdog when the
        client does not send its request within the read timeout) from before its request is read until the
        call's work is done; yields the `_Request` to read it with."""
        call = _TaskCall(asyncio.get_running_loop())
        name = tenant.name if tenant else ""
        give_up = time.monotonic() + self.limits.admit_wait_s
        # a slot held by a request that has not come for REQUEST_SILENT_S is taken back for a newcomer, so a
        # newcomer refused at first may find one a little later: it asks again while it waits
        while (sid := self.requests.admit(call, name, count=False)) is None and time.monotonic() < give_up:
            await asyncio.sleep(REQUEST_SILENT_S / 5)
        if sid is None:
            self.requests.refused += 1
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no request slot free for tenant {name!r} (its share of {self.requests.limit}); "
                            f"try again")
        try:
            with call.ended_as_rejection():
                yield _Request(context, lambda: self.requests.waiting(sid), lambda: self.requests.moved(sid))
        finally:
            self.requests.done(sid)

    @contextlib.contextmanager
    def _stream_slot(self, context, tenant: Tenant):
        """One of the stream slots (the tenant's fair share: `StreamWatch`), for as long as the stream runs;
        yields the calls that say the handler now waits on its client, and that the client moved."""
        sid = self.streams.admit(context, tenant.name)
        if sid is None:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no stream slot free for tenant {tenant.name!r} (its share of {self.streams.limit}); "
                            f"try again")
        try:
            yield (lambda: self.streams.waiting(sid)), (lambda: self.streams.moved(sid))
        finally:
            self.streams.done(sid)

    def _end(self, name: str, context: grpc.ServicerContext, err: BaseException) -> None:
        """A handler that did not finish: answer a refusal with its status; let a call ended elsewhere (the
        watchdog, a reservation taken back, the client gone) end; log anything else as a server fault.

        No exception leaves a handler, and none keeps its frames: gRPC holds the exception that ends a call
        in the call's state, its traceback holds the handler's frames, and they hold the call — a cycle that
        keeps every message the handler read (a refused Put, a malformed request) until the garbage collector
        happens to run."""
        if isinstance(err, _Rejected):
            self._reject(name, context, err)
        elif not isinstance(err, grpc.RpcError | grpc.aio.AbortError | GeneratorExit | asyncio.CancelledError):
            self.counters["handler_faults"] += 1
            log.error("%s from %s failed: %s: %s", name, context.peer(), type(err).__name__, err,
                      exc_info=err, extra={"event": "rpc_fault", "rpc": name, "peer": context.peer()})
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"{name} failed on the server: {type(err).__name__}")
        _forget_frames(err)
        if not isinstance(err, Exception):       # KeyboardInterrupt, SystemExit, GeneratorExit: not ours to stop
            raise err

    def _reject(self, name: str, context: grpc.ServicerContext, err: _Rejected) -> None:
        self.counters[f"rejected_{err.code.name.lower()}"] += 1
        log.warning("rejected %s from %s: %s: %s", name, context.peer(), err.code.name, err.details,
                    extra={"event": "rpc_rejected", "rpc": name, "peer": context.peer(), "code": err.code.name})
        context.set_code(err.code)        # not abort: see `_end`
        context.set_details(err.details)

    def close(self) -> None:
        self.streams.close()
        self.requests.close()

    # -- checks --------------------------------------------------------------
    def _caller(self, context: grpc.ServicerContext) -> Tenant | None:
        """The tenant the call's token names (an open server's when it has none), or None."""
        given = next((v for k, v in context.invocation_metadata() if k == AUTH_HEADER), "")
        given = given.decode(errors="replace") if isinstance(given, bytes) else given
        if given and not given.startswith("Bearer "):
            return None                        # a token must come as `Bearer <token>`
        return self.tenancy.who(given.removeprefix("Bearer "))

    def _authorize(self, context: grpc.ServicerContext) -> Tenant:
        tenant = self._caller(context)
        if tenant is None:
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
        return tenant

    @staticmethod
    def _allowed(tenant: Tenant, right: str) -> None:
        if not getattr(tenant, right):
            raise _Rejected(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not {right}")

    def _parse(self, cls: type[Message], data: bytes) -> Any:
        msg = cls()
        try:
            msg.ParseFromString(data)
        except DecodeError as err:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {err}") from None
        return msg

    @staticmethod
    def _names(namespace: bytes, keys) -> None:
        if len(namespace) != NAMESPACE_DIGEST_BYTES:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"namespace must be {NAMESPACE_DIGEST_BYTES} bytes, got {len(namespace)}")
        if len(keys) > MAX_KEYS_PER_CALL:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call, limit {MAX_KEYS_PER_CALL}"
            )
        for key in keys:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"key of {len(key)} bytes (1..{MAX_KEY_BYTES})")

    # -- RPCs ----------------------------------------------------------------
    def contains(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = self._parse(pb.ContainsRequest, request)
        self._names(req.namespace, req.keys)
        keys = list(req.keys)
        if req.each:
            each = self._present_each(tenant, req.namespace, keys)
            return pb.ContainsReply(present=each.index(0) if 0 in each else len(each),
                                    present_each=each).SerializeToString()
        return pb.ContainsReply(present=self._present(tenant, req.namespace, keys)).SerializeToString()

    def _present_each(self, tenant: Tenant, namespace: bytes, keys: list[bytes]) -> bytes:
        """One byte per key: 1 where some store the tenant reads holds it."""
        each = bytearray(len(keys))
        for store in self.tenancy.readable(tenant):
            for i, there in enumerate(store.present_each(namespace, keys)):
                each[i] |= there
        return bytes(each)

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

    def _get_request(self, request: bytes) -> tuple[bytes, list[bytes]]:
        req = self._parse(pb.GetRequest, request)
        self._names(req.namespace, req.keys)
        return req.namespace, list(req.keys)

    def get(self, namespace: bytes, keys: list[bytes], tenant: Tenant) -> Iterator[bytes]:
        stores = self.tenancy.readable(tenant)
        for key in keys:
            messages = next((m for m in (s.get(namespace, key) for s in stores) if m is not None), None)
            if messages is None:
                yield encode_chunk(namespace, key)
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
                    yield m
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
            finally:
                stream.close()              # and with it the message it holds
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

    def purge(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> _AfterEngines:
        self._allowed(tenant, "purge")
        req = self._parse(pb.PurgeRequest, request)
        whose = tenant
        if req.tenant and req.tenant != tenant.name:
            if not tenant.admin:
                raise _Rejected(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not purge another "
                                                                   "tenant's chunks (that takes admin)")
            whose = self.tenancy.tenants.get(req.tenant)
            if whose is None:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: there is no tenant {req.tenant!r}")
        if not 0 <= req.wait_s <= MAX_PURGE_WAIT_S:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"Purge: wait_s {req.wait_s} is not 0..{MAX_PURGE_WAIT_S}")
        order = replace(self._purge_order(req.spec), issued_at=time.time())
        started = time.perf_counter()
        report = self.tenancy.purge(whose, order)
        seq = self.purge_log.append(whose.name, order)
        took = time.perf_counter() - started
        self.counters.update(purges=1, purged_chunks=report.chunks, purged_bytes=report.nbytes)
        self.audit.record("purge", f"purge {seq} of tenant {whose.name} by {tenant.name}: {report.chunks} chunks, "
                                   f"{report.nbytes} bytes", tenant=whose.name, chunks=report.chunks,
                          nbytes=report.nbytes, seq=seq, by=tenant.name, peer=context.peer(),
                          selectors=order_selectors(order), tiers=report.tiers, seconds=round(took, 6))
        reply = pb.PurgeReply(seq=seq)
        for name, (chunks, nbytes) in report.tiers.items():
            reply.tiers.add(name=name, chunks=chunks, bytes=nbytes)
        return _AfterEngines(reply, whose.name, seq, req.wait_s or DEFAULT_WAIT_S)

    def _purge_order(self, spec: pb.PurgeSpec) -> PurgeOrder:
        if len(spec.roots) > MAX_KEYS_PER_CALL or len(spec.namespaces) > MAX_KEYS_PER_CALL:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: more than {MAX_KEYS_PER_CALL} keys or "
                                                              "namespaces in one call")
        if not math.isfinite(spec.stored_before) or spec.stored_before < 0:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: stored_before {spec.stored_before} is not a "
                                                              "time")
        try:
            return PurgeOrder(tuple(spec.roots), spec.stored_before or None, spec.everything,
                              tuple(dict.fromkeys(spec.namespaces)))
        except ValueError as err:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: {err}") from None

    def purges(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = self._parse(pb.PurgesRequest, request)
        if not 0 < len(req.watcher) <= MAX_WATCHER_ID:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purges: watcher must be 1..{MAX_WATCHER_ID} "
                                                              "characters")
        if len(req.namespaces) > MAX_KEYS_PER_CALL or any(len(n) != NAMESPACE_DIGEST_BYTES for n in req.namespaces):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purges: namespaces must be {NAMESPACE_DIGEST_BYTES}-"
                                                              f"byte digests, at most {MAX_KEYS_PER_CALL}")
        if len(req.applied) > 1 + len(tenant.reads_from):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "Purges: applied names more tenants than the caller sees")
        found, lost, latest = self.purge_log.poll(tenant.name, req.watcher, (tenant.name, *tenant.reads_from),
                                                  req.namespaces, dict(req.applied), req.instance)
        if len(found) > MAX_PURGES_PER_REPLY:      # a client far behind: the rest at its next polls
            found = found[:MAX_PURGES_PER_REPLY]
            latest = {t: max((p.seq for p in found if p.tenant == t), default=req.applied.get(t, 0))
                      for t in latest}
        reply = pb.PurgesReply(instance=self.purge_log.instance, lost=lost, now=time.time(), complete_to=latest)
        for p in found:
            o = p.order
            reply.purges.add(seq=p.seq, tenant=p.tenant, issued_at=o.issued_at, spec=pb.PurgeSpec(
                namespaces=o.namespaces, roots=o.roots, stored_before=o.stored_before or 0.0,
                everything=o.everything))
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
            for name, events in self.audit.counts().items():
                purges = events.get("purge")
                if purges and name in s["tenants"]:
                    s["tenants"][name].update(purges=purges["events"], purged_chunks=purges["chunks"],
                                              purged_bytes=purges["bytes"])
        s["audit"] = self.audit.counts()
        s["server"] = {**s["server"], **self.counters, "inflight_bytes": self.inflight.used,
                       "inflight_refused": self.inflight.refused, "inflight_taken_back": self.inflight.taken_back,
                       "streams_open": self.streams.open,
                       "streams_refused": self.streams.refused, "streams_taken_back": self.streams.taken_back,
                       "streams_stalled": self.streams.cancelled, "requests_refused": self.requests.refused,
                       "requests_taken_back": self.requests.taken_back}
        return s
