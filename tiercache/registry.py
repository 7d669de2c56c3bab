"""A name → class registry with lazy imports.

Tiers, eviction policies, codecs, checksums and hash functions are chosen by
name from configuration. Each kind has one `Registry`; entries are either the
object itself or a ``"module:attr"`` string imported on first use, so an
optional dependency (redis, grpc, cupy) is only imported when selected.
"""
from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from tiercache.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, entry: T | str | None = None):
        """Register ``entry`` under ``name``; usable as a decorator."""
        if entry is not None:
            self._add(name, entry)
            return entry

        def decorator(obj: T) -> T:
            self._add(name, obj)
            return obj

        return decorator

    def _add(self, name: str, entry: T | str) -> None:
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        try:
            entry = self._entries[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            ) from None
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
