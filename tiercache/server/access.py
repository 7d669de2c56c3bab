"""Who a call of `tiercache serve` is and what it may ask for: its tenant from its token, its rights, and the
shape of its request (server). Each check raises `Rejected` with the status the call is answered with."""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.server.rpc_calls import Rejected
from tiercache.server.tenants import Tenancy, Tenant
from tiercache.wire.grpc_messages import AUTH_HEADER, MAX_KEY_BYTES, MAX_KEYS_PER_CALL


def caller(tenancy: Tenancy, context: grpc.ServicerContext) -> Tenant | None:
    """The tenant the call's token names (an open server's when it has none), or None."""
    given = next((v for k, v in context.invocation_metadata() if k == AUTH_HEADER), "")
    given = given.decode(errors="replace") if isinstance(given, bytes) else given
    if given and not given.startswith("Bearer "):
        return None                        # a token must come as `Bearer <token>`
    return tenancy.who(given.removeprefix("Bearer "))


def authorize(tenancy: Tenancy, context: grpc.ServicerContext) -> Tenant:
    tenant = caller(tenancy, context)
    if tenant is None:
        raise Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
    return tenant


def require(tenant: Tenant, right: str) -> None:
    """``tenant`` holds ``right`` (write, delete, stats, purge), or the call is refused."""
    if not getattr(tenant, right):
        raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not {right}")


def parse(cls: type[Message], data: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as err:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {err}") from None
    return msg


def check_names(namespace: bytes, keys) -> None:
    """A namespace digest of the right size and at most a call's worth of keys, each of a key's size."""
    if len(namespace) != NAMESPACE_DIGEST_BYTES:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"namespace must be {NAMESPACE_DIGEST_BYTES} bytes, got {len(namespace)}")
    if len(keys) > MAX_KEYS_PER_CALL:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call, limit {MAX_KEYS_PER_CALL}")
    for key in keys:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"key of {len(key)} bytes (1..{MAX_KEY_BYTES})")
