"""The gRPC service of `tiercache serve`: request checks, auth, and the RPCs over a `ChunkStore`.

Handlers are registered as generic handlers that receive raw bytes, so a
malformed request is parsed here and answered with ``INVALID_ARGUMENT`` and a
log line (protobuf deserialisers failing inside gRPC would give ``INTERNAL``
and no context), and a `Chunk` is parsed without copying its value.

Error statuses, each with one log line naming the peer:
- ``UNAUTHENTICATED``: a token is configured and the call lacks it;
- ``INVALID_ARGUMENT``: a malformed message, a namespace or key of the wrong
  size, a value whose header is damaged or names another namespace or key;
- ``RESOURCE_EXHAUSTED``: a message larger than ``max_message_bytes`` (gRPC
  itself refuses anything above twice that before it reaches a handler).
"""
from __future__ import annotations

import hmac
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
from tiercache.server.store import ChunkStore, PutOutcome
from tiercache.server.values import check_value
from tiercache.wire.grpc_messages import (
    AUTH_HEADER, MAX_KEY_BYTES, MAX_KEYS_PER_CALL, SERVICE, WireError, encode_chunk, read_chunk,
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
    def __init__(self, store: ChunkStore, max_message_bytes: int, auth_token: str | None = None) -> None:
        self.store = store
        self.max_message_bytes = max_message_bytes
        self._auth = f"Bearer {auth_token}".encode() if auth_token else None
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
                if auth:
                    self._authorize(context)
                return fn(request, context)
            except _Rejected as err:
                self._reject(name, context, err)
                raise AssertionError("unreachable: context.abort raises")
        return run

    def _guard_stream(self, fn):
        name = fn.__name__

        def run(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.counters[f"rpc_{name}"] += 1
            try:
                self._authorize(context)
                yield from fn(request, context)
            except _Rejected as err:
                self._reject(name, context, err)
        return run

    def _reject(self, name: str, context: grpc.ServicerContext, err: _Rejected) -> None:
        self.counters[f"rejected_{err.code.name.lower()}"] += 1
        log.warning("rejected %s from %s: %s: %s", name, context.peer(), err.code.name, err.details,
                    extra={"event": "rpc_rejected", "rpc": name, "peer": context.peer(), "code": err.code.name})
        context.abort(err.code, err.details)

    # -- checks --------------------------------------------------------------
    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self._auth is None:
            return
        given = next((v for k, v in context.invocation_metadata() if k == AUTH_HEADER), "")
        if not hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._auth):
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

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
    def contains(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        req = self._parse(pb.ContainsRequest, request)
        self._names(req.namespace, req.keys)
        return pb.ContainsReply(present=self.store.contains(req.namespace, list(req.keys))).SerializeToString()

    def get(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._parse(pb.GetRequest, request)
        self._names(req.namespace, req.keys)
        for key in req.keys:
            messages = self.store.get(req.namespace, key)
            if messages is None:
                yield encode_chunk(req.namespace, key)
                continue
            self.counters["bytes_out"] += sum(len(m) for m in messages)
            yield from messages

    def put(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        reply = pb.PutReply()
        messages = (self._sized(m) for m in requests)
        while (chunk := self._chunk(messages)) is not None:
            head, raw = chunk
            self.counters["bytes_in"] += head.total
            outcome = self.store.put(head.namespace, head.key, raw)
            if outcome is PutOutcome.STORED:
                reply.stored += 1
            elif outcome is PutOutcome.PRESENT:
                reply.present += 1
            else:
                reply.rejected.append(head.key)
        return reply.SerializeToString()

    def _chunk(self, messages):
        """The next chunk of a Put stream, checked: (first message parsed, its raw messages); None at the end."""
        try:
            got = read_chunk(messages)
        except WireError as err:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed Chunk: {err}") from None
        if got is None:
            return None
        head, pieces, raw = got
        self._names(head.namespace, [head.key])
        try:
            check_value(head.namespace, head.key, pieces[0][:HEADER_BYTES], head.total)
        except ChunkFormatError as err:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"chunk {head.key.hex()[:16]}… rejected: {type(err).__name__}: {err}") from None
        return head, raw

    def delete(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        req = self._parse(pb.DeleteRequest, request)
        self._names(req.namespace, req.keys)
        return pb.DeleteReply(deleted=self.store.delete(req.namespace, list(req.keys))).SerializeToString()

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._parse(pb.StatsRequest, request)
        s = self.stats_dict()
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

    def local(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._parse(pb.LocalRequest, request)
        shm = self.store.shm
        if shm is None:
            return pb.LocalReply().SerializeToString()
        return pb.LocalReply(directory=str(shm.root), instance=shm.instance).SerializeToString()

    def adopt(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        req = self._parse(pb.AdoptRequest, request)
        self._names(req.namespace, req.keys)
        if self.store.shm is None:
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
                outcome = self.store.adopt(req.namespace, key, name)
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

    def touch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        req = self._parse(pb.TouchRequest, request)
        self._names(req.namespace, req.keys)
        return pb.TouchReply(touched=self.store.touch(req.namespace, list(req.keys))).SerializeToString()

    def stats_dict(self) -> dict[str, Any]:
        s = self.store.stats()
        s["server"] = {**s["server"], **self.counters}
        return s
