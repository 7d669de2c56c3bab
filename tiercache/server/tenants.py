"""Tenants of `tiercache serve`: who a token is, what it may do, and the store that holds its chunks.

``--auth-token-file`` holds either one token (every client that presents it
is the tenant ``default``, with every right) or a TOML table of tenants::

    [tenants.acme]
    token = "…"                    # or token_file = "/etc/tiercache/acme.token"
    memory = "4GiB"                # a store of its own, this much of --capacity (default: the shared pool)
    disk = "40GiB"                 # and this much of --disk-capacity (none given: no disk of its own)
    reads_from = ["public"]        # other tenants whose chunks it may read, never write or delete
    delete = true                  # Delete (default true)
    stats = true                   # Stats of its own store (default true); admin = true: the whole server
    purge = true                   # Purge its own chunks (default false); with admin = true: any tenant's
    retention = 86400              # seconds its chunks are kept (its own store; default: --retention)
    namespace_retention = { "0f3a…(32 hex digits)" = 3600 }   # one namespace's own (storage digest)

    [tenants.public]               # e.g. a system prompt every tenant may read, written by one
    token = "…"

Quotas are the operator's choice, per tenant: a tenant with a ``memory``
quota has a `ChunkStore` of its own — memory and disk bounded by its quota,
its own eviction — so no other tenant's churn evicts its chunks; the tenants
without one share one pool, the capacity the quotas leave, evicted as one.
Either way no token can see, read, overwrite or delete another tenant's
chunks: in the pool every namespace is scoped by its tenant (`ScopedStore`:
the namespace a client names is stored under a digest of tenant name and
namespace), and the namespace a client names is looked up only among its own
chunks and, for reads, the chunks of the tenants it was granted. A tenant
reading another's namespace digest finds nothing. Calls a tenant's rights do
not allow get ``PERMISSION_DENIED``.
"""
from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tiercache.config import parse_size, read_secret, read_token
from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.contracts.purge import PurgeOrder, PurgeReport
from tiercache.errors import ConfigError
from tiercache.server.store import ChunkStore, PutOutcome, StoreConfig
from tiercache.server.values import Messages, Stored

FIELD = "--auth-token-file"
DEFAULT = "default"
_KEYS = {"token", "token_file", "memory", "disk", "reads_from", "delete", "stats", "admin", "write", "retention",
         "purge", "namespace_retention"}
_OFF_BY_DEFAULT = ("admin", "purge")


@dataclass(frozen=True, slots=True)
class Tenant:
    """Server: one tenant's name, rights and read grants."""

    name: str
    token: str | None                    # None: the server asks for no token (one tenant, every right)
    memory: int = 0                      # bytes of --capacity; 0: an equal share of what quotas leave
    disk: int = 0
    reads_from: tuple[str, ...] = ()
    write: bool = True
    delete: bool = True
    stats: bool = True
    admin: bool = False                  # Stats of every store and the server's own counters
    purge: bool = False                  # Purge its own chunks (with admin: any tenant's)
    retention: float | None = None       # seconds its chunks are kept (its own store only); None: --retention
    namespace_retention: dict[bytes, float] = field(default_factory=dict)   # a namespace's own, over the above


def load_tenants(path: str) -> list[Tenant]:
    """The tenants an ``--auth-token-file`` names (see the module doc); `ConfigError` naming the file and the
    entry for anything wrong."""
    if not path:
        return [Tenant(DEFAULT, None, admin=True, purge=True)]
    text = read_secret(path, FIELD)
    if not text.lstrip().startswith("[tenants."):
        return [Tenant(DEFAULT, read_token(path, FIELD), admin=True, purge=True)]
    try:
        table = tomllib.loads(text).get("tenants", {})
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(FIELD, path, f"not valid TOML: {err}") from None
    tenants = [_tenant(path, name, entry) for name, entry in table.items()]
    if not tenants:
        raise ConfigError(FIELD, path, "names no tenant")
    names = {t.name for t in tenants}
    tokens = [t.token for t in tenants]
    if len(set(tokens)) != len(tokens):
        raise ConfigError(FIELD, path, "two tenants have the same token")
    for t in tenants:
        for other in t.reads_from:
            if other not in names or other == t.name:
                raise ConfigError(FIELD, path, f"tenant {t.name!r} reads_from {other!r}, which is not another "
                                               "tenant here")
    return tenants


def _tenant(path: str, name: str, entry: object) -> Tenant:
    where = f"tenant {name!r}"
    if not isinstance(entry, dict):
        raise ConfigError(FIELD, path, f"{where} must be a table")
    unknown = set(entry) - _KEYS
    if unknown:
        raise ConfigError(FIELD, path, f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                                       f"known: {', '.join(sorted(_KEYS))}")
    if ("token" in entry) == ("token_file" in entry):          # neither, or both
        raise ConfigError(FIELD, path, f"{where} needs one of token, token_file")
    token = str(entry["token"]).strip() if "token" in entry else read_token(str(entry["token_file"]), FIELD)
    if len(token) < 16:
        raise ConfigError(FIELD, path, f"{where}: a token of {len(token)} characters is too short to be secret "
                                       "(16 or more)")
    reads = entry.get("reads_from", [])
    if not isinstance(reads, list) or not all(isinstance(r, str) for r in reads):
        raise ConfigError(FIELD, path, f"{where}: reads_from must be a list of tenant names")
    flags = {}
    for flag in ("write", "delete", "stats", "admin", "purge"):
        value = entry.get(flag, flag not in _OFF_BY_DEFAULT)
        if not isinstance(value, bool):
            raise ConfigError(FIELD, path, f"{where}: {flag} must be true or false")
        flags[flag] = value
    sizes = {}
    for quota in ("memory", "disk"):
        sizes[quota] = parse_size(entry.get(quota, 0), f"{FIELD} {where} {quota}")
        if sizes[quota] < 0:
            raise ConfigError(FIELD, path, f"{where}: {quota} must be >= 0")
    retention = entry.get("retention")
    if retention is not None:
        if isinstance(retention, bool) or not isinstance(retention, (int, float)) or retention < 0:
            raise ConfigError(FIELD, path, f"{where}: retention must be seconds (0: no limit)")
        if not sizes["memory"]:
            raise ConfigError(FIELD, path, f"{where}: retention needs the tenant's own store (a memory quota): "
                                           "tenants in the shared pool keep --retention")
    return Tenant(name, token, sizes["memory"], sizes["disk"], tuple(reads), **flags,
                  retention=None if retention is None else float(retention),
                  namespace_retention=namespace_retentions(entry.get("namespace_retention", {}),
                                                           f"{FIELD} {where} namespace_retention"))


def namespace_retentions(given: object, field_name: str) -> dict[bytes, float]:
    """``{"<namespace hex>": seconds}`` checked: a `ConfigError` naming ``field_name`` otherwise."""
    if not isinstance(given, dict):
        raise ConfigError(field_name, given, "must map namespaces (32 hex digits) to seconds")
    out = {}
    for hex_ns, seconds in given.items():
        try:
            ns = bytes.fromhex(hex_ns)
        except (ValueError, TypeError):
            ns = b""
        if len(ns) != NAMESPACE_DIGEST_BYTES:
            raise ConfigError(field_name, hex_ns, f"is not a namespace ({2 * NAMESPACE_DIGEST_BYTES} hex digits)")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ConfigError(field_name, seconds, f"the retention of {hex_ns} must be seconds (0: no limit)")
        out[ns] = float(seconds)
    return out


def scoped_namespace(tenant: str, namespace: bytes) -> bytes:
    """Where a tenant's namespace is kept in the shared pool (see `ScopedStore`)."""
    return hashlib.blake2b(tenant.encode() + b"\0" + namespace, digest_size=NAMESPACE_DIGEST_BYTES).digest()


def _quotas(tenants: Sequence[Tenant], total: int, attr: str, flag: str) -> int:
    """What the quotas leave of ``total`` for the shared pool (`ConfigError` when they take more than all)."""
    fixed = sum(getattr(t, attr) for t in tenants)
    if fixed > total:
        raise ConfigError(FIELD, fixed, f"the tenants' {attr} quotas add up to more than {flag} ({total} B)")
    if fixed == total and any(not getattr(t, attr) for t in tenants):
        raise ConfigError(FIELD, fixed, f"the tenants without a {attr} quota are left nothing of {flag}")
    return total - fixed


class ScopedStore:
    """One tenant's view of the shared pool: every namespace it names is stored under a digest of its tenant
    name and that namespace, so tenants in one pool never meet; headers keep the client's namespace."""

    def __init__(self, pool: ChunkStore, tenant: str) -> None:
        self._pool = pool
        self._tenant = tenant

    def _ns(self, namespace: bytes) -> bytes:
        return scoped_namespace(self._tenant, namespace)

    @property
    def pool(self):
        return self._pool.pool

    @property
    def shm(self):
        return None

    def contains(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return self._pool.contains(self._ns(namespace), keys)

    def present_each(self, namespace: bytes, keys: Sequence[bytes]) -> list[bool]:
        return self._pool.present_each(self._ns(namespace), keys)

    def get(self, namespace: bytes, key: bytes) -> Messages | None:
        return self._pool.get(self._ns(namespace), key, header_ns=namespace)

    def get_value(self, namespace: bytes, key: bytes) -> list[memoryview] | None:
        return self._pool.get_value(self._ns(namespace), key)

    def put(self, namespace: bytes, key: bytes, stored: Stored) -> PutOutcome:
        scoped = self._ns(namespace)
        self._pool.scope(scoped, namespace)
        return self._pool.put(scoped, key, stored)

    def _mine(self) -> set[bytes]:
        """This tenant's scoped namespaces (after a restart too: each names its header namespace, and only
        this tenant's name digests to it)."""
        return {s for s, h in self._pool.scoped_namespaces().items() if self._ns(h) == s}

    def touch(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return self._pool.touch(self._ns(namespace), keys)

    def count_own(self, storage_keys: Sequence[bytes]) -> int:
        """How many of the pool's ``storage_keys`` (namespace first) are this tenant's."""
        mine = self._mine()
        return sum(k[:NAMESPACE_DIGEST_BYTES] in mine for k in storage_keys)

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return self._pool.delete(self._ns(namespace), keys)

    def flush(self) -> int:
        return 0          # the pool is flushed once, by its owner

    def purge(self, order: PurgeOrder) -> PurgeReport:
        """Purge among this tenant's namespaces of the pool (those of ``order``, when it names some)."""
        mine = self._mine()
        if order.namespaces:
            mine &= {self._ns(n) for n in order.namespaces}
        return self._pool.purge(replace(order, namespaces=()), mine)

    def stats(self) -> dict[str, object]:
        """This tenant's part of the pool: per tier its chunks and bytes (the capacity is the pool's), its hot
        chunks and namespaces; the pool's own counters are everyone's, and left out."""
        mine = self._mine()
        s = self._pool.stats()
        usage = self._pool.usage(mine)
        tiers = {name: {"name": name, "capacity_bytes": t["capacity_bytes"], "used_bytes": usage[name][1],
                        "chunks": usage[name][0]} for name, t in s["tiers"].items()}
        hot = [(ns, key, n) for ns, key, n in s["hot_chunks"] if ns in mine]
        return {"tiers": tiers, "hot_chunks": hot, "namespaces": len(mine), "server": {}}


class Tenancy:
    """Every tenant and its store; who a presented token is."""

    def __init__(self, tenants: Sequence[Tenant], store: StoreConfig) -> None:
        self.tenants = {t.name: t for t in tenants}
        named = any(t.token for t in tenants) and not (len(tenants) == 1 and tenants[0].name == DEFAULT)
        if store.shm_path and named:
            raise ConfigError("--shm-dir", store.shm_path, "serves one tenant only: its files are readable by "
                                                           "every client on the host")
        pool_memory = _quotas(tenants, store.capacity, "memory", "--capacity")
        pool_disk = _quotas(tenants, store.disk_capacity, "disk", "--disk-capacity") if store.disk_path else 0
        self.stores: dict[str, ChunkStore] = {}       # every store, by owner ("pool": the shared one)
        self._views: dict[str, ChunkStore | ScopedStore] = {}
        pooled = [t for t in tenants if not t.memory]

        def kept(t: Tenant) -> dict[bytes, float]:        # the server's per-namespace retentions, then the tenant's
            return {**store.namespace_retention, **t.namespace_retention}
        if pooled:
            pool_kept = {scoped_namespace(t.name, ns) if named else ns: secs
                         for t in pooled for ns, secs in kept(t).items()}
            self.stores["pool"] = ChunkStore(StoreConfig(pool_memory, store.eviction, store.disk_path, pool_disk,
                                                         store.shm_path, store.retention_s, pool_kept,
                                                         store.admission))
        for t in tenants:
            if t.memory:
                root = str(Path(store.disk_path) / "tenants" / t.name) if store.disk_path and t.disk else ""
                retention = store.retention_s if t.retention is None else t.retention
                self.stores[t.name] = ChunkStore(StoreConfig(t.memory, store.eviction, root, t.disk,
                                                             retention_s=retention, namespace_retention=kept(t),
                                                             admission=store.admission))
                self._views[t.name] = self.stores[t.name]
            else:   # a server without named tenants keeps the unscoped layout of before
                self._views[t.name] = ScopedStore(self.stores["pool"], t.name) if named else self.stores["pool"]
        self.open = not any(t.token for t in tenants)       # no token asked of anyone

    def who(self, token: bytes | str | None) -> Tenant | None:
        """The tenant whose token this is (compared in constant time), None for none."""
        if self.open:
            return next(iter(self.tenants.values()))
        given = token.encode() if isinstance(token, str) else (token or b"")
        found = None
        for t in self.tenants.values():
            if hmac.compare_digest(given, t.token.encode()):   # every one compared: no early exit
                found = t
        return found

    def own(self, tenant: Tenant) -> ChunkStore | ScopedStore:
        return self._views[tenant.name]

    def readable(self, tenant: Tenant) -> list[ChunkStore | ScopedStore]:
        """The stores a tenant reads: its own first, then those it was granted, in the order given."""
        return [self._views[tenant.name], *(self._views[n] for n in tenant.reads_from)]

    def flush(self) -> int:
        return sum(s.flush() for s in self.stores.values())

    def purge(self, tenant: Tenant, order: PurgeOrder) -> PurgeReport:
        """Take what ``order`` selects out of ``tenant``'s chunks, in every tier of its store."""
        return self._views[tenant.name].purge(order)

    def expire(self) -> dict[str, int]:
        """Remove what is past retention in every store; per tenant, the chunks of its that went (a shared
        pool's told apart by each tenant's namespaces)."""
        out: dict[str, int] = {}
        for owner, store in self.stores.items():
            gone = store.expire()
            if not gone:
                continue
            for name, view in self._views.items():
                if view is store:                  # its own store, or the one unscoped pool of an open server
                    n = len(gone)
                elif owner == "pool" and isinstance(view, ScopedStore):
                    n = view.count_own(gone)
                else:
                    continue
                if n:
                    out[name] = out.get(name, 0) + n
        return out

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tenant: the namespaces it holds chunks in and their bytes, over every tier of its store (or its
        part of the pool)."""
        out = {}
        for name, view in self._views.items():
            s = view.stats()
            out[name] = {"namespaces": s["namespaces"], "used_bytes": sum(t["used_bytes"] for t in s["tiers"].values())}
        return out
