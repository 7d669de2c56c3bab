"""The cache server's door: which chunks a store takes, by what its clients asked of it.

Server side; `ChunkStore` calls it under its lock. The history of what was
asked for is the store's, not one engine's: every key of a ``Contains`` run,
from any replica, is a sighting for the store's admission policy (`record`:
`adaptive-sighting` by default, `second-sighting`, `frequency`; or `always`).
A chunk being stored goes in when the store has room for it without evicting
anything, or when the policy admits it and its chain's head is there (its
parent held, being written, or admitted itself: a tail without its head is
never hit). So a chunk one replica asked for and another stores is on its
second sighting.

The history is sized (`GuardedTier`) once, when the store first fills: by
then it holds as many chunks as it will, whatever their size. Before that
everything goes in, so the size it starts with only bounds its memory.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tiercache.errors import ConfigError
from tiercache.policies import (
    DEFAULT_ADMISSION,
    NOT_AN_ENTRY_GUARD,
    AdmissionPolicy,
    GuardedTier,
    admission_for,
    guards_entry,
)
from tiercache.registry import RegistryError

START_CHUNKS = 1 << 13     # the tier the history is sized for until the store first fills


def check_admission(name: str, flag: str = "--admission") -> None:
    """A `ConfigError` naming ``flag`` unless ``name`` is a policy a store can use: one that takes everything or
    counts requests (a policy counting L1's hits never admits a chunk being stored)."""
    try:
        if guards_entry(name):
            return
    except RegistryError as err:
        raise ConfigError(flag, name, str(err)) from None
    raise ConfigError(flag, name, NOT_AN_ENTRY_GUARD)


class StoreDoor:
    """One store's admission: its sighting history and the decision on each chunk stored."""

    def __init__(self, name: str = DEFAULT_ADMISSION) -> None:
        self.policy: AdmissionPolicy | None = (admission_for(name, 0, GuardedTier(START_CHUNKS))
                                               if name != "always" else None)
        self._record = getattr(self.policy, "record", None)
        self._sized = False

    def sight(self, keys: Sequence[bytes]) -> None:
        """A client asked for ``keys`` (store keys, namespace first), head first."""
        if self._record is not None:
            self._record(keys)

    def admits(self, key: bytes, parent: bytes | None, room: bool, chunks: int,
               held: Callable[[bytes], bool]) -> bool:
        """Whether chunk ``key`` (its ``parent``: the chunk before it, or None) goes in: ``room`` says the store
        takes it without evicting; ``chunks`` is how many it holds; ``held(k)``: whether ``k`` is there or on
        its way."""
        if room or self.policy is None:
            return True
        if not self._sized:
            size_for = getattr(self.policy, "size_for", None)
            if size_for is not None:
                size_for(GuardedTier(max(1, chunks)))
            self._sized = True
        return self.policy.admit(key, 0) and (parent is None or held(parent) or self.policy.admit(parent, 0))
