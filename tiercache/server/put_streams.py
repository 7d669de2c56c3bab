"""gRPC ``Put`` streams of `tiercache serve`: each chunk's declared length checked and reserved in the in-flight
budget before the rest of it is received, its header checked, the chunk stored (server).

A stream holds one of its tenant's stream slots while it runs (`tiercache.server.limits.StreamWatch`); its
messages are read in its handler thread, the watchdog told while the handler waits on the client.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import grpc

from tiercache.errors import ChunkFormatError
from tiercache.server.access import check_names, require
from tiercache.server.cpu_shares import CpuShares
from tiercache.server.fair import Hold, InflightBytes
from tiercache.server.limits import ServerLimits, end_call
from tiercache.server.rpc_calls import Rejected
from tiercache.server.store import PutOutcome
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.server.values import check_value
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import HEADER_BYTES
from tiercache.wire.grpc_messages import ChunkView, WireError, read_chunk


class PutStreams:
    """Server: receives ``Put`` streams into the tenants' stores. ``stream_slot(context, tenant)`` is the
    service's context manager for a stream slot (yielding the watchdog's ``waiting`` and ``moved``)."""

    def __init__(self, tenancy: Tenancy, limits: ServerLimits, inflight: InflightBytes, cpu: CpuShares,
                 counters: Counter[str], stream_slot: Callable) -> None:
        self.tenancy = tenancy
        self.limits = limits
        self.inflight = inflight
        self.cpu = cpu
        self.counters = counters
        self.stream_slot = stream_slot

    def receive(self, requests: Iterator[bytes], context: grpc.ServicerContext, tenant: Tenant) -> bytes:
        require(tenant, "write")
        store = self.tenancy.own(tenant)
        reply = pb.PutReply()
        holds: list[Hold] = []            # the in-flight reservations of the chunk being received
        meter = self.cpu.meter(tenant.name)
        with self.stream_slot(context, tenant) as (waiting, moved):
            def messages() -> Iterator[bytes]:
                pending = iter(requests)
                while True:
                    meter.step()             # the CPU of the last message charged; within its share, the next
                    waiting()
                    m = next(pending, None)
                    moved()
                    if m is None:
                        return
                    self.cpu.moved(tenant.name, len(m))
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
        check_names(head.namespace, [head.key])
        if head.total < HEADER_BYTES:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a value of {head.total} bytes, shorter than a chunk header ({HEADER_BYTES})")
        if head.total > self.limits.max_value_bytes:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"a value of {head.total} bytes, over the server's value limit of "
                            f"{self.limits.max_value_bytes}")
        hold = self.inflight.reserve(head.total, self.limits.admit_wait_s, tenant.name, context,
                                     revoke=lambda: end_call(context, "silent past its tenant's share of the "
                                                                      "in-flight budget while others wait"))
        if hold is None:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no room for a {head.total}-byte value in the server's in-flight budget; try again")
        return hold

    def _chunk(self, messages, tenant: Tenant, context: grpc.ServicerContext, holds: list[Hold]):
        """The next chunk of a Put stream, checked, its bytes reserved in the in-flight budget (into ``holds``,
        which the caller releases): (first message parsed, its raw messages); None at the end."""
        try:
            got = read_chunk(messages, lambda head: holds.append(self._admit(head, tenant, context)))
        except WireError as err:
            self._release(holds)
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed Chunk: {err}") from None
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
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"chunk {head.key.hex()[:16]}… rejected: {type(err).__name__}: {err}") from None
        return head, raw

    def _release(self, holds: list[Hold]) -> None:
        for hold in holds:
            self.inflight.release(hold)
        holds.clear()
