"""Tenants of `tiercache serve`: who a token is, what it may do, and the store that holds its chunks.

``--auth-token-file`` holds either one token (every client that presents it
is the tenant ``default``, with every right) or a TOML table of tenants::

    [tenants.acme]
    token = "…"                    # or token_file = "/etc/tiercache/acme.token"
    memory = "4GiB"                # its share of --capacity (default: an equal share of what is left)
    disk = "40GiB"                 # its share of --disk-capacity (same default)
    reads_from = ["public"]        # other tenants whose chunks it may read, never write or delete
    delete = true                  # Delete (default true)
    stats = true                   # Stats of its own store (default true); admin = true: the whole server

    [tenants.public]               # e.g. a system prompt every tenant may read, written by one
    token = "…"

Each tenant's chunks live in a `ChunkStore` of its own — memory and disk,
bounded by its quota, with its own eviction — so no token can see, read,
overwrite, delete or evict another tenant's chunks: the namespace a client
names is looked up in its own store (and, for reads, in the stores it was
granted), nowhere else. A tenant reading another's namespace digest finds
nothing. Calls a tenant's rights do not allow get ``PERMISSION_DENIED``.
"""
from __future__ import annotations

import hmac
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.config import parse_size, read_secret
from tiercache.errors import ConfigError
from tiercache.server.store import ChunkStore, StoreConfig

FIELD = "--auth-token-file"
DEFAULT = "default"
_KEYS = {"token", "token_file", "memory", "disk", "reads_from", "delete", "stats", "admin", "write"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    token: str | None                    # None: the server asks for no token (one tenant, every right)
    memory: int = 0                      # bytes of --capacity; 0: an equal share of what quotas leave
    disk: int = 0
    reads_from: tuple[str, ...] = ()
    write: bool = True
    delete: bool = True
    stats: bool = True
    admin: bool = False                  # Stats of every store and the server's own counters


def load_tenants(path: str) -> list[Tenant]:
    """The tenants an ``--auth-token-file`` names (see the module doc); `ConfigError` naming the file and the
    entry for anything wrong."""
    if not path:
        return [Tenant(DEFAULT, None, admin=True)]
    text = read_secret(path, FIELD)
    if not text.lstrip().startswith("[tenants."):
        return [Tenant(DEFAULT, text, admin=True)]
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
    if "token" in entry and "token_file" in entry or not ("token" in entry or "token_file" in entry):
        raise ConfigError(FIELD, path, f"{where} needs one of token, token_file")
    token = str(entry["token"]).strip() if "token" in entry else read_secret(str(entry["token_file"]), FIELD)
    if len(token) < 16:
        raise ConfigError(FIELD, path, f"{where}: a token of {len(token)} characters is too short to be secret "
                                       "(16 or more)")
    reads = entry.get("reads_from", [])
    if not isinstance(reads, list) or not all(isinstance(r, str) for r in reads):
        raise ConfigError(FIELD, path, f"{where}: reads_from must be a list of tenant names")
    flags = {}
    for flag in ("write", "delete", "stats", "admin"):
        value = entry.get(flag, flag != "admin")
        if not isinstance(value, bool):
            raise ConfigError(FIELD, path, f"{where}: {flag} must be true or false")
        flags[flag] = value
    sizes = {}
    for field in ("memory", "disk"):
        sizes[field] = parse_size(entry.get(field, 0), f"{FIELD} {where} {field}")
        if sizes[field] < 0:
            raise ConfigError(FIELD, path, f"{where}: {field} must be >= 0")
    return Tenant(name, token, sizes["memory"], sizes["disk"], tuple(reads), **flags)


def _shares(tenants: Sequence[Tenant], total: int, attr: str, flag: str) -> dict[str, int]:
    """Each tenant's bytes of ``total``: its quota, or an equal part of what the quotas leave."""
    fixed = sum(getattr(t, attr) for t in tenants)
    if fixed > total:
        raise ConfigError(FIELD, fixed, f"the tenants' {attr} quotas add up to more than {flag} ({total} B)")
    rest = [t for t in tenants if not getattr(t, attr)]
    each = (total - fixed) // len(rest) if rest else 0
    out = {t.name: getattr(t, attr) or each for t in tenants}
    for name, share in out.items():
        if share <= 0:
            raise ConfigError(FIELD, name, f"tenant {name!r} is left no {attr} ({flag} is all taken by quotas)")
    return out


class Tenancy:
    """Every tenant and its store; who a presented token is."""

    def __init__(self, tenants: Sequence[Tenant], store: StoreConfig) -> None:
        self.tenants = {t.name: t for t in tenants}
        single = len(tenants) == 1
        if store.shm_path and not single:
            raise ConfigError("--shm-dir", store.shm_path, "serves one tenant only: its files are readable by "
                                                           "every client on the host")
        memory = _shares(tenants, store.capacity, "memory", "--capacity")
        disk = _shares(tenants, store.disk_capacity, "disk", "--disk-capacity") if store.disk_path else {}
        self.stores: dict[str, ChunkStore] = {}
        for t in tenants:
            # One tenant keeps the layout of a server without tenants (its directory is the --disk root).
            root = store.disk_path if single or not store.disk_path else str(Path(store.disk_path) / "tenants" / t.name)
            self.stores[t.name] = ChunkStore(StoreConfig(memory[t.name], store.eviction, root,
                                                         disk.get(t.name, 0), store.shm_path))
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

    def own(self, tenant: Tenant) -> ChunkStore:
        return self.stores[tenant.name]

    def readable(self, tenant: Tenant) -> list[ChunkStore]:
        """The stores a tenant reads: its own first, then those it was granted, in the order given."""
        return [self.stores[tenant.name], *(self.stores[n] for n in tenant.reads_from)]

    def flush(self) -> int:
        return sum(s.flush() for s in self.stores.values())
