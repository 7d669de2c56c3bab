"""Who sends a request: API keys mapped to tenants, each with the cache salt that keeps its prefixes its own.

Router side. With a tenants file every request must carry a known key
(``Authorization: Bearer <key>``); the router then sets the request's
``cache_salt`` to its tenant's — overriding any the client sent — so the
replicas' pools and tiercache's tiers never match one tenant's blocks for
another, and the router scores the request only against chains seeded by
that salt. Tenants that may share (a public system prompt, one company's
teams) name the same ``cache_group``: that is the grant. Without a file the
router serves one anonymous tenant and passes a client's own ``cache_salt``
through.

File (YAML or JSON)::

    tenants:
      - name: acme
        api_keys: [sk-acme-1, sk-acme-2]
      - name: globex
        api_keys: [sk-globex]
        cache_group: public      # shares cached prefixes with every tenant of the group
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml

from tiercache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_group: str = ""          # "" (anonymous): no salt of the router's

    @property
    def cache_salt(self) -> str:
        return f"tiercache-group:{self.cache_group}" if self.cache_group else ""


ANONYMOUS = Tenant("anonymous")


class Unauthorized(Exception):
    """No key, or a key no tenant holds (answered 401)."""


class Tenants:
    def __init__(self, by_key: dict[str, Tenant] | None = None) -> None:
        self._by_key = dict(by_key or {})

    @property
    def enforced(self) -> bool:
        return bool(self._by_key)

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read and check a tenants file; a `ConfigError` naming the file and the field otherwise."""
        source = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise ConfigError("--tenants", source, f"cannot read: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError("--tenants", source, f"not YAML or JSON ({str(err).splitlines()[0]})") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{source}: tenants", entries, "must be a non-empty list")
        by_key: dict[str, Tenant] = {}
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
                by_key[key] = Tenant(name, group)
        return cls(by_key)

    def authenticate(self, authorization: str | None) -> Tenant:
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
