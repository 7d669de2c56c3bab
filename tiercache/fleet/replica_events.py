"""A replica's side of KV events: its engine's pool and tiers, published in vLLM's format.

`ReplicaEvents` turns the engine's `TierEvent` records into `BlockStored` /
`BlockRemoved` (medium ``GPU`` for the pool, the tier's medium otherwise; the
block size of the pool or the chunk size of the tiers) and publishes them.
The keys are the replica's own block hashes and chunk keys: a router that
reads the replica's descriptor computes them from a prompt, so the events do
not repeat the tokens (``token_ids`` is empty).
"""
from __future__ import annotations

from tiercache.contracts.medium import Medium
from tiercache.fleet.kv_events import (
    MEDIUM_ENGINE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVCacheEvent,
)
from tiercache.tier_events import TierEvent


def medium_name(medium: Medium) -> str:
    return MEDIUM_ENGINE if medium is Medium.DEVICE else medium.value.upper()


class ReplicaEvents:
    """Engine thread: `publish_changes` after each step, `publish_held` when a subscriber starts again."""

    def __init__(self, publisher: EventPublisher, block_size: int, chunk_tokens: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens

    def _wire(self, event: TierEvent) -> KVCacheEvent:
        keys = list(event.keys)
        medium = medium_name(event.medium)
        if not event.stored:
            return BlockRemoved(block_hashes=keys, medium=medium)
        size = self.block_size if event.medium is Medium.DEVICE else self.chunk_tokens
        return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=size, lora_id=None,
                           medium=medium, lora_name=None)

    def publish_changes(self, events: list[TierEvent]) -> int:
        return self.publisher.publish([self._wire(e) for e in events])

    def publish_held(self, held: list[TierEvent]) -> int:
        return self.publisher.publish([AllBlocksCleared(), *(self._wire(e) for e in held)])

    def close(self) -> None:
        self.publisher.close()
