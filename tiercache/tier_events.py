"""What reached and what left each tier, in the order it happened: the source of KV events (scheduler side).

The manager records an arrival when a job that put chunks into a tier completes on every rank; the tier
indexes keep the keys that leave them (evicted, or deleted) once watched. `EventJournal` interleaves the
two in order — a tier's removals are taken in before each arrival is recorded — so a router that follows
the events never sees a chunk leave before it arrived.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.medium import Medium
from tiercache.index.tier_index import TierIndex


@dataclass(frozen=True, slots=True)
class TierEvent:
    stored: bool                 # True: the chunks reached the tier; False: they left it
    tier: str
    medium: Medium
    keys: tuple[BlockHash, ...]


class EventJournal:
    """Scheduler side: arrivals and removals of every tier, in order."""

    def __init__(self, tiers: Sequence[TierIndex]) -> None:
        self.tiers = list(tiers)
        self._events: list[TierEvent] = []
        for tier in self.tiers:
            tier.watch_removals()

    def take_removals(self) -> None:
        """Take in what left each tier since the last call (before the next arrival is recorded)."""
        for tier in self.tiers:
            gone = tier.take_removed()
            if gone:
                self._events.append(TierEvent(False, tier.name, tier.medium, tuple(gone)))

    def arrived(self, tier: TierIndex, keys: Sequence[BlockHash]) -> None:
        if keys:
            self._events.append(TierEvent(True, tier.name, tier.medium, tuple(keys)))

    def take(self) -> list[TierEvent]:
        self.take_removals()
        events, self._events = self._events, []
        return events
