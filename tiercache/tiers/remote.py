"""What the remote tiers (Redis, `tiercache serve`) share: no local index, availability, client-side counts.

The server owns the data, so a remote tier keeps no index and cannot pin: a
chunk evicted between lookup and read is a failed read, hence a miss.
Availability follows `Outage`: a failed call marks the tier down, and while
it is down every call answers "absent" without touching the network.
Chunks travel in the stored chunk format, so the reservation a chunk needs is
its header plus the codec's worst case.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tiercache.chunk_format import HEADER_BYTES, ChunkFormat
from tiercache.keys import BlockHash
from tiercache.tiers.base import LowerTier, Medium
from tiercache.tiers.outage import Outage


class RemoteTier(LowerTier):
    medium = Medium.REMOTE
    indexed = False

    def __init__(self, name: str, fmt: ChunkFormat | None, retry_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.name = name
        self.fmt = fmt or ChunkFormat()
        self._outage = Outage(name, retry_interval_s, clock=clock)

    # -- availability --------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._outage.available

    def _failed(self, what: str, err: Exception) -> None:
        self._outage.failed(what, err)
        self.counters.errors += 1

    # -- Tier ----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return 0   # bounded by the server (maxmemory, --capacity), not by this client

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def num_chunks(self) -> int:
        return 0

    def reserve_bytes(self, raw_len: int) -> int:
        return HEADER_BYTES + self.fmt.codec.max_encoded_len(raw_len)

    def complete_store(self, keys: Sequence[BlockHash], failed: Sequence[BlockHash] = ()) -> None:
        self.counters.stored += len(keys) - len(failed)
        self.counters.errors += len(failed)

    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        return None   # no pins on a server: a chunk gone meanwhile is a failed read, hence a miss

    def complete_load(self, keys: Sequence[BlockHash], corrupt: Sequence[BlockHash] = ()) -> None:
        self.counters.loaded += len(keys) - len(corrupt)
        if corrupt:
            self.counters.integrity_failures += len(corrupt)
            self.delete(list(corrupt))
