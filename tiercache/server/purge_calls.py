"""``Purge`` and ``Purges`` of `tiercache serve`: a tenant's chunks taken out of its stores by prompt, age,
namespace or all, audited and logged for the engines that poll for purges (server)."""
from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, replace

import grpc

from tiercache.audit import AuditTrail
from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.contracts.purge import DEFAULT_WAIT_S, POLL_INTERVAL_S, PurgeOrder, order_selectors
from tiercache.server.access import parse, require
from tiercache.server.purge_log import MAX_WATCHER_ID, PurgeLog
from tiercache.server.rpc_calls import Rejected
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.grpc_messages import MAX_KEYS_PER_CALL

MAX_PURGE_WAIT_S = 60.0
MAX_PURGES_PER_REPLY = 256    # a client far behind catches up over several polls


@dataclass(slots=True)
class AfterEngines:
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


class PurgeCalls:
    """Server: the purge RPCs over the tenants' stores, the purge log the engines poll, and the audit trail."""

    def __init__(self, tenancy: Tenancy, purge_log: PurgeLog, audit: AuditTrail, counters: Counter[str]) -> None:
        self.tenancy = tenancy
        self.purge_log = purge_log
        self.audit = audit
        self.counters = counters

    def purge(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> AfterEngines:
        require(tenant, "purge")
        req = parse(pb.PurgeRequest, request)
        whose = tenant
        if req.tenant and req.tenant != tenant.name:
            if not tenant.admin:
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not purge another "
                                                                   "tenant's chunks (that takes admin)")
            whose = self.tenancy.tenants.get(req.tenant)
            if whose is None:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: there is no tenant {req.tenant!r}")
        if not 0 <= req.wait_s <= MAX_PURGE_WAIT_S:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
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
        return AfterEngines(reply, whose.name, seq, req.wait_s or DEFAULT_WAIT_S)

    def _purge_order(self, spec: pb.PurgeSpec) -> PurgeOrder:
        if len(spec.roots) > MAX_KEYS_PER_CALL or len(spec.namespaces) > MAX_KEYS_PER_CALL:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: more than {MAX_KEYS_PER_CALL} keys or "
                                                              "namespaces in one call")
        if not math.isfinite(spec.stored_before) or spec.stored_before < 0:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: stored_before {spec.stored_before} is not a "
                                                              "time")
        try:
            return PurgeOrder(tuple(spec.roots), spec.stored_before or None, spec.everything,
                              tuple(dict.fromkeys(spec.namespaces)))
        except ValueError as err:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purge: {err}") from None

    def purges(self, request: bytes, context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        req = parse(pb.PurgesRequest, request)
        if not 0 < len(req.watcher) <= MAX_WATCHER_ID:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purges: watcher must be 1..{MAX_WATCHER_ID} "
                                                              "characters")
        if len(req.namespaces) > MAX_KEYS_PER_CALL or any(len(n) != NAMESPACE_DIGEST_BYTES for n in req.namespaces):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"Purges: namespaces must be {NAMESPACE_DIGEST_BYTES}-"
                                                              f"byte digests, at most {MAX_KEYS_PER_CALL}")
        if len(req.applied) > 1 + len(tenant.reads_from):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "Purges: applied names more tenants than the caller sees")
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
