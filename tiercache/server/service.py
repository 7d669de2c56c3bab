"""The gRPC service of `tiercache serve`: the RPC surface, its slots, and the reading RPCs over a `ChunkStore`.

Beside it: who a call is and what it may ask (`tiercache.server.access`), ``Put`` streams
(`tiercache.server.put_streams`), purges (`tiercache.server.purge_calls`), and how any call is handled on
grpc.aio (`tiercache.server.rpc_calls`).

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
import functools
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Any

import grpc

from tiercache import __version__
from tiercache.audit import AuditTrail
from tiercache.errors import ChunkFormatError
from tiercache.log_limits import ThrottledLog
from tiercache.server.access import authorize, caller, check_names, parse, require
from tiercache.server.cpu_shares import CpuShares
from tiercache.server.fair import InflightBytes
from tiercache.server.limits import ServerLimits, StreamWatch
from tiercache.server.purge_calls import AfterEngines, PurgeCalls
from tiercache.server.purge_log import PurgeLog
from tiercache.server.put_streams import PutStreams
from tiercache.server.rpc_calls import Rejected, SlotRequest, TaskCall, forget_frames, identity, uncancelled
from tiercache.server.store import PutOutcome
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.grpc_messages import SERVICE, encode_chunk

log = logging.getLogger("tiercache.server")

STREAM_SILENT_S = 0.25   # a stream of a tenant over its share silent this long gives its slot to another tenant
REQUEST_SILENT_S = 0.1    # a call whose one request has not come for this long gives its slot to a newcomer
                          # (a client sends a unary call's request with its headers, in one write)
REQUEST_HEADROOM = 2     # request slots a tenant alone leaves free, for the first calls of a tenant that comes
STREAM_HEADROOM = 1      # stream slots a tenant alone leaves free
INCOMING_NAME = re.compile(r"[0-9a-f]{32}\.tmp")   # what clients name the chunk files they hand in (Adopt)


class CacheService:
    """Server: the gRPC methods, on grpc.aio's event loop, their work on the handler pool."""

    def __init__(self, tenancy: Tenancy, max_message_bytes: int, limits: ServerLimits,
                 inflight: InflightBytes, pool: Executor, cpu: CpuShares, audit: AuditTrail | None = None) -> None:
        self.tenancy = tenancy
        self.max_message_bytes = max_message_bytes
        self.limits = limits
        self.inflight = inflight
        self.cpu = cpu                      # each tenant's share of the server's CPU
        self.pool = pool                    # the handler threads: every call's work runs there
        shared = len(tenancy.tenants) > 1        # headroom is for another tenant: none on a server of one
        self.streams = StreamWatch(limits.max_streams, limits.read_timeout_s, share_silent_s=STREAM_SILENT_S,
                                   headroom=STREAM_HEADROOM if shared else 0)
        self.requests = StreamWatch(limits.max_requests, limits.read_timeout_s,
                                    headroom=REQUEST_HEADROOM if shared else 0, share_silent_s=REQUEST_SILENT_S,
                                    take_back_own=True)
        self.serving = True
        self.data_port = 0          # set by the server when its data channel listens
        self.purge_log = PurgeLog()
        self.audit = audit or AuditTrail()      # purges, per tenant (the server's, which closes it)
        self.counters: Counter[str] = Counter()
        self._waiting_for_slots: Counter[str] = Counter()    # per tenant: calls waiting for a request slot
        self._warn = ThrottledLog(log)      # load shed by the slots: one line per call and 10 s, with a count
        self.puts = PutStreams(tenancy, limits, inflight, cpu, self.counters, self._stream_slot)
        self.purges = PurgeCalls(tenancy, self.purge_log, self.audit, self.counters)

    # -- registration --------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        unary = {"Contains": self.contains, "Delete": self.delete, "Stats": self.stats, "Local": self.local,
                 "Adopt": self.adopt, "Touch": self.touch, "Purge": self.purges.purge, "Purges": self.purges.purges}
        rpc = {name: grpc.stream_unary_rpc_method_handler(self._guard_unary(fn), identity, identity)
               for name, fn in unary.items()}
        rpc["Health"] = grpc.stream_unary_rpc_method_handler(self._guard_unary(self.health, auth=False),
                                                             identity, identity)
        rpc["Get"] = grpc.stream_stream_rpc_method_handler(self._guard_get(), identity, identity)
        rpc["Put"] = grpc.stream_unary_rpc_method_handler(self._guard_put(), identity, identity)
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
                tenant = authorize(self.tenancy, context) if auth else caller(self.tenancy, context)
                if tenant is not None:
                    self.cpu.arrived(tenant.name)
                async with self._request_slot(context, tenant) as slot:
                    request = await slot.read()
                    work = (lambda: fn(request, context, tenant)) if auth else (lambda: fn(request, context))
                    if tenant is not None:         # its CPU counted and shared, before its work begins
                        self.cpu.moved(tenant.name, len(request))
                        await self.cpu.pace_async(tenant.name)
                        work = functools.partial(self.cpu.run, tenant.name, work)
                    reply = await asyncio.get_running_loop().run_in_executor(self.pool, work)
                if isinstance(reply, AfterEngines):      # outside its slot, holding no thread
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
                tenant = authorize(self.tenancy, context)
                self.cpu.arrived(tenant.name)
                async with self._request_slot(context, tenant) as slot:
                    request = await slot.read()
                    self.cpu.moved(tenant.name, len(request))
                    await self.cpu.pace_async(tenant.name)
                    namespace, keys = await loop.run_in_executor(self.pool, self.cpu.run, tenant.name,
                                                                 functools.partial(self._get_request, request))
                del request
                call = TaskCall(loop)
                with call.ended_as_rejection(), self._stream_slot(call, tenant) as (waiting, moved):
                    messages = self.get(namespace, keys, tenant)
                    next_message = functools.partial(next, messages, None)
                    while True:
                        await self.cpu.pace_async(tenant.name)     # between messages: no client waited on
                        message = await loop.run_in_executor(self.pool, self.cpu.run, tenant.name, next_message)
                        if message is None:
                            break
                        waiting()            # until the client has taken it (gRPC's flow control)
                        await uncancelled(context.write(message))
                        moved()
                        self.cpu.moved(tenant.name, len(message))
            except BaseException as err:
                self._end("get", context, err)
        return run

    def _guard_put(self):
        def run(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            self.counters["rpc_put"] += 1
            try:
                tenant = authorize(self.tenancy, context)
                self.cpu.arrived(tenant.name)
                return self.puts.receive(requests, context, tenant)
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
        call = TaskCall(asyncio.get_running_loop())
        name = tenant.name if tenant else ""
        if tenant is not None:          # a tenant past its share of the CPU waits before it asks for a slot
            await self.cpu.pace_async(name)
        sid = self.requests.admit(call, name, count=False)
        if sid is None:
            sid = await self._wait_for_request_slot(call, name)
        try:
            with call.ended_as_rejection():
                yield SlotRequest(context, lambda: self.requests.waiting(sid), lambda: self.requests.moved(sid))
        finally:
            self.requests.done(sid)

    async def _wait_for_request_slot(self, call: TaskCall, name: str) -> int:
        """A request slot for a call of tenant ``name`` refused one at first. A slot held by a request that has
        not come for REQUEST_SILENT_S is taken back for a newcomer, so it asks again while it waits, up to
        the server's admission wait — one of at most as many waiting calls of its tenant as there are slots:
        a client opening calls by the hundred is refused the rest at once, not polled for each of them."""
        refusal = Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"no request slot free for tenant {name!r} (its share of {self.requests.limit}); try again")
        if self._waiting_for_slots[name] >= self.requests.limit:
            self.requests.refused += 1
            raise refusal
        self._waiting_for_slots[name] += 1
        try:
            give_up = time.monotonic() + self.limits.admit_wait_s
            while time.monotonic() < give_up:
                await asyncio.sleep(REQUEST_SILENT_S / 5)
                if (sid := self.requests.admit(call, name, count=False)) is not None:
                    return sid
        finally:
            self._waiting_for_slots[name] -= 1
            if not self._waiting_for_slots[name]:
                del self._waiting_for_slots[name]
        self.requests.refused += 1
        raise refusal

    @contextlib.contextmanager
    def _stream_slot(self, context, tenant: Tenant):
        """One of the stream slots (the tenant's fair share: `StreamWatch`), for as long as the stream runs;
        yields the calls that say the handler now waits on its client, and that the client moved."""
        sid = self.streams.admit(context, tenant.name)
        if sid is None:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
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
        if isinstance(err, Rejected):
            self._reject(name, context, err)
        elif not isinstance(err, grpc.RpcError | grpc.aio.AbortError | GeneratorExit | asyncio.CancelledError):
            self.counters["handler_faults"] += 1
            log.error("%s from %s failed: %s: %s", name, context.peer(), type(err).__name__, err,
                      exc_info=err, extra={"event": "rpc_fault", "rpc": name, "peer": context.peer()})
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"{name} failed on the server: {type(err).__name__}")
        forget_frames(err)
        if not isinstance(err, Exception):       # KeyboardInterrupt, SystemExit, GeneratorExit: not ours to stop
            raise err

    def _reject(self, name: str, context: grpc.ServicerContext, err: Rejected) -> None:
        self.counters[f"rejected_{err.code.name.lower()}"] += 1
        args = ("rejected %s from %s: %s: %s", name, context.peer(), err.code.name, err.details)
        extra = {"event": "rpc_rejected", "rpc": name, "peer": context.peer(), "code": err.code.name}
        if err.code is grpc.StatusCode.RESOURCE_EXHAUSTED:     # a busy server, maybe a flood: counted, not each logged
            self._warn.warning(f"busy {name}", *args, extra=extra)
        else:
            log.warning(*args, extra=extra)
        context.set_code(err.code)        # not abort: see `_end`
        context.set_details(err.details)

    def close(self) -> None:
        self.streams.close()
        self.requests.close()

    # -- RPCs ----------------------------------------------------------------
    def contains(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = parse(pb.ContainsRequest, request)
        check_names(req.namespace, req.keys)
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
        req = parse(pb.GetRequest, request)
        check_names(req.namespace, req.keys)
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

    def delete(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        require(tenant, "delete")
        req = parse(pb.DeleteRequest, request)
        check_names(req.namespace, req.keys)
        deleted = self.tenancy.own(tenant).delete(req.namespace, list(req.keys))
        return pb.DeleteReply(deleted=deleted).SerializeToString()

    def stats(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        require(tenant, "stats")
        parse(pb.StatsRequest, request)
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
        parse(pb.HealthRequest, request)
        status = pb.HealthReply.SERVING if self.serving else pb.HealthReply.NOT_SERVING
        return pb.HealthReply(status=status, version=__version__, max_message_bytes=self.max_message_bytes,
                              data_port=self.data_port).SerializeToString()

    def local(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        parse(pb.LocalRequest, request)
        shm = self.tenancy.own(tenant).shm
        if shm is None:
            return pb.LocalReply().SerializeToString()
        return pb.LocalReply(directory=str(shm.root), instance=shm.instance).SerializeToString()

    def adopt(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        require(tenant, "write")
        req = parse(pb.AdoptRequest, request)
        check_names(req.namespace, req.keys)
        store = self.tenancy.own(tenant)
        if store.shm is None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "this server has no local data path (--shm-dir)")
        if len(req.files) != len(req.keys):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{len(req.files)} files for {len(req.keys)} keys")
        for name in req.files:
            if not INCOMING_NAME.fullmatch(name):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"incoming file name {name[:80]!r} is not "
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
        req = parse(pb.TouchRequest, request)
        check_names(req.namespace, req.keys)
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
        s["tenant_cpu_seconds"] = {name: round(cpu_s, 3) for name, cpu_s in self.cpu.used().items()}
        s["server"] = {**s["server"], **self.counters, "inflight_bytes": self.inflight.used,
                       "inflight_refused": self.inflight.refused, "inflight_taken_back": self.inflight.taken_back,
                       "streams_open": self.streams.open,
                       "streams_refused": self.streams.refused, "streams_taken_back": self.streams.taken_back,
                       "streams_stalled": self.streams.cancelled, "requests_refused": self.requests.refused,
                       "requests_taken_back": self.requests.taken_back, "cpu_waits": self.cpu.waits,
                       "cpu_waited_ms": round(self.cpu.waited_s * 1e3)}
        return s
