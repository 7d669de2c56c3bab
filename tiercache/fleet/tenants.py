"""Who sends a request: API keys mapped to tenants, each with the cache salt that keeps its prefixes its own.

Router side. With a tenants file every request must carry a known key
(``Authorization: Bearer <key>``); the router then sets the request's
``cache_salt`` to its tenant's — overriding any the client sent — so the
replicas' pools and tiercache's tiers never match one tenant's blocks for
another, and the router scores the request only against chains seeded by
that salt. Tenants that may share (a public system prompt, one company's
teams) name the same ``cache_group``: that is the grant. A group's salt is a keyed hash
of its name (`group_salt`), so knowing a group's name is not knowing its
salt. Without a file the router serves one anonymous tenant and passes a
client's own ``cache_salt`` through.

File (YAML or JSON)::

    salt_secret: a-long-random-string   # optional: keeps salts across API key rotations (default: the keys)
    tenants:
      - name: acme
        api_keys: [sk-acme-1, sk-acme-2]
      - name: globex
        api_keys: [sk-globex]
        cache_group: public      # shares cached prefixes with every tenant of the group
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from tiercache.config import read_listing
from tiercache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RoutedTenant:
    """A tenant as the router knows it: its name, and the cache group whose salt it sets on the tenant's requests
    (the server's tenants, with their quotas and rights, are `tiercache.server.tenants.Tenant`)."""
    name: str
    cache_group: str = ""          # "" (anonymous): no salt of the router's
    cache_salt: str = ""           # the group's: a keyed hash of its name, never the name itself


def group_salt(secret: bytes, group: str) -> str:
    """A group's salt: unguessable without the secret, so that a client that reached a replica directly
    could not name another group's salt and match its blocks."""
    return hmac.new(secret, b"tiercache-cache-group\0" + group.encode(), hashlib.sha256).hexdigest()


ANONYMOUS = RoutedTenant("anonymous")


class Unauthorized(Exception):
    """No key, or a key no tenant holds (answered 401)."""


class Tenants:
    def __init__(self, by_key: dict[str, RoutedTenant] | None = None) -> None:
        self._by_key = dict(by_key or {})

    @property
    def enforced(self) -> bool:
        return bool(self._by_key)

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read and check a tenants file; a `ConfigError` naming the file and the field otherwise."""
        source = str(path)
        data, entries = read_listing(path, "--tenants", "tenants")
        secret = data.get("salt_secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise ConfigError(f"{source}: salt_secret", "…", "must be a string of at least 16 characters")
        # without a secret of its own, the file's API keys are it: salts (and the cache behind them) then last
        # as long as the keys do
        keys_of_all = sorted(k for e in entries if isinstance(e, dict) for k in (e.get("api_keys") or [])
                             if isinstance(k, str))
        secret_bytes = (secret or "\0".join(keys_of_all)).encode()
        by_key: dict[str, RoutedTenant] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            where = f"{source}: tenants[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(where, entry, "must be a mapping with name and api_keys")
            name, keys = entry.get("name"), entry.get("api_keys")
            if not isinstance(name, str) or not name or name in names:
                raise ConfigError(f"{where}.name", name, "must be a non-empty string, unique")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise ConfigError(f"{where}.api_keys", keys, "must be a non-empty list of strings")
            group = entry.get("cache_group", name)
            if not isinstance(group, str) or not group:
                raise ConfigError(f"{where}.cache_group", group, "must be a non-empty string")
            names.add(name)
            for key in keys:
                if key in by_key:
                    raise ConfigError(f"{where}.api_keys", "…" + key[-4:], f"already held by {by_key[key].name}")
                by_key[key] = RoutedTenant(name, group, group_salt(secret_bytes, group))
        return cls(by_key)

    def authenticate(self, authorization: str | None) -> RoutedTenant:
        if not self._by_key:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("no API key: send Authorization: Bearer <key>")
        key = key.strip().encode()
        found = None
        for known, tenant in self._by_key.items():   # every key compared, each in constant time
            if hmac.compare_digest(known.encode(), key):
                found = tenant
        if found is None:
            raise Unauthorized("the API key is not valid")
        return found
