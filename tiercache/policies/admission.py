"""Admission policies: which chunks leaving L1 are worth writing to the next tier down.

Scheduler side, metadata only. A policy sees a chunk's key and how many times
L1 served it to L0, and answers whether to demote it.
"""
from __future__ import annotations

from typing import Protocol

from tiercache.keys import BlockHash
from tiercache.registry import Registry


class AdmissionPolicy(Protocol):
    def admit(self, key: BlockHash, hits: int) -> bool: ...


admission_policies: Registry[type[AdmissionPolicy]] = Registry("admission policy")


@admission_policies.register("always")
class AlwaysAdmit:
    def __init__(self, min_hits: int = 0) -> None:
        """Takes ``min_hits`` only so that every admission policy is built the same way; ignores it."""

    def admit(self, key: BlockHash, hits: int) -> bool:
        return True


@admission_policies.register("min-hits")
class MinHitsAdmit:
    """Demote only chunks L1 served at least ``min_hits`` times: one-off prefixes stay off the disk."""

    def __init__(self, min_hits: int = 1) -> None:
        self.min_hits = min_hits

    def admit(self, key: BlockHash, hits: int) -> bool:
        return hits >= self.min_hits
