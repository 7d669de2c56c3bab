"""The result of a longest-prefix lookup across tiers: plain data from the manager to a connector."""
from __future__ import annotations

from dataclasses import dataclass

from tiercache.keys import BlockHash


@dataclass(frozen=True, slots=True)
class TierRun:
    """Consecutive chunks ``first_chunk ..`` found in one tier."""
    tier: str
    first_chunk: int
    keys: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    num_computed_blocks: int          # leading blocks the engine holds in L0
    runs: tuple[TierRun, ...]         # chunks after those, tier by tier, in order
    num_hit_blocks: int               # leading blocks available in L0 or any tier
    block_size: int
    num_blocks: int                   # blocks the looked-up chunks cover (bounds a partial last chunk)

    @property
    def num_loadable_tokens(self) -> int:
        return (self.num_hit_blocks - self.num_computed_blocks) * self.block_size

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.block_size
