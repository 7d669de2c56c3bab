"""What the remote tiers (Redis, `tiercache serve`) share: no local index, availability, client-side counts.

The server owns the data, so a remote tier keeps no index and cannot pin: a
chunk evicted between lookup and read is a failed read, hence a miss.
Availability follows `Outage`: a failed call marks the tier down, and while
it is down every call answers "absent" without touching the network, until
a background probe (`_probe`) finds the server back.
Chunks travel in the stored chunk format, so the reservation a chunk needs is
its header plus the codec's worst case.

`receive_value` is how every remote read path takes one value in — a Redis
reply, a data-channel value, gRPC message pieces, a chunk file of a
co-located server: header into a scratch and checked, then a raw payload
straight into the L1 slot, hashed piece by piece as it lands (on the data
channel, verifying cost 13% of the rate as a separate pass over 32 MiB and
about 8% in 4 MiB pieces; 256 KiB pieces were slower still), or a
compressed one into a per-thread staging buffer, verified and decoded into
the slot.
"""
from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Sequence
from typing import Protocol

from tiercache.chunk_format import HEADER_BYTES, ChunkFormat, check_header, verify_payload
from tiercache.codecs import checksum_by_code, copy_into
from tiercache.errors import ChecksumMismatchError, ChunkFormatError, TruncatedChunkError
from tiercache.keys import BlockHash
from tiercache.tiers.base import LowerTier, Medium
from tiercache.tiers.outage import Outage

log = logging.getLogger(__name__)

VERIFY_PIECE = 4 << 20    # a raw payload is hashed in pieces of this size as each lands (still in cache)


class ValueSource(Protocol):
    """Where a value's bytes come from, in order (`tiercache.streams.StreamReader`, a chunk file)."""

    def exactly(self, n: int) -> bytes: ...

    def read_into(self, dest: memoryview) -> None: ...

    def skip(self, n: int) -> None: ...


class RemoteTier(LowerTier):
    medium = Medium.REMOTE
    indexed = False

    def __init__(self, name: str, fmt: ChunkFormat | None, retry_interval_s: float) -> None:
        super().__init__()
        self.name = name
        self.fmt = fmt or ChunkFormat()
        self._outage = Outage(name, retry_interval_s, probe=self._probe)
        self._thread = threading.local()
        self._unverified: set[BlockHash] = set()    # failed verification on a worker, not yet completed
        self._unverified_lock = threading.Lock()

    # -- availability --------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._outage.available

    def _failed(self, what: str, err: Exception) -> None:
        self._outage.failed(what, err)
        self.counters.errors += 1

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "outages": self._outage.outages}

    @abstractmethod
    def _probe(self) -> None:
        """One cheap round trip to the server (on the outage's prober thread); raises while it is away."""

    def close(self) -> None:
        self._outage.close()

    # -- reading one value (worker side) ----------------------------------------
    def receive_value(self, source: ValueSource, n: int, namespace: bytes, key: BlockHash,
                      buf: memoryview) -> int | None:
        """Take the next ``n`` bytes of ``source`` — one value — into ``buf``, verified; returns the raw
        length, or None for a value that is damaged, foreign or too large (all ``n`` bytes consumed either
        way, so a stream stays in step). Transport errors propagate."""
        if n < HEADER_BYTES:
            source.skip(n)
            self._rejected(key, TruncatedChunkError(f"value of {n} B is shorter than a chunk header"))
            return None
        try:
            parsed = check_header(source.exactly(HEADER_BYTES), namespace, key)
            meta, codec, checksum_code, payload_len, payload_sum = parsed
            if n != HEADER_BYTES + payload_len:
                raise TruncatedChunkError(f"value of {n} B, its header says {HEADER_BYTES + payload_len}")
            if meta.raw_len > len(buf):
                raise ChunkFormatError(f"chunk of {meta.raw_len} B does not fit a {len(buf)}-byte buffer")
        except ChunkFormatError as err:
            source.skip(n - HEADER_BYTES)
            self._rejected(key, err)
            return None
        if codec == 0 and payload_len == meta.raw_len:   # raw: into the slot, hashed piece by piece as it lands
            running = checksum_by_code(checksum_code)().running()
            for offset in range(0, payload_len, VERIFY_PIECE):
                piece = buf[offset:min(offset + VERIFY_PIECE, payload_len)]
                source.read_into(piece)
                running.update(piece)
            if running.intdigest() != payload_sum:
                self._rejected(key, ChecksumMismatchError(f"payload checksum mismatch for chunk {key.hex()[:16]}…"))
                return None
            return meta.raw_len
        landing = self._payload_staging(payload_len)
        source.read_into(landing)
        try:
            copy_into(buf, verify_payload(parsed, landing))
        except ChunkFormatError as err:
            self._rejected(key, err)
            return None
        return meta.raw_len

    def _payload_staging(self, nbytes: int) -> memoryview:
        """A reusable per-thread buffer for compressed payloads (fresh memory per chunk pays page faults)."""
        buf = getattr(self._thread, "payload", None)
        if buf is None or len(buf) < nbytes:
            buf = self._thread.payload = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _rejected(self, key: BlockHash, err: Exception) -> None:
        """A value that is there but must not be served: damaged, foreign, or too large. `complete_load`
        counts it as an integrity failure and deletes it."""
        log.warning("%s tier: chunk %s… failed verification: %s", self.name, key.hex()[:16], err)
        with self._unverified_lock:
            self._unverified.add(key)

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

    def complete_load(self, keys: Sequence[BlockHash], failed: Sequence[BlockHash] = ()) -> None:
        """Of the ``failed`` reads only those that found a bad value (`_rejected`) are integrity failures,
        and those values are deleted; the rest were plain misses — evicted or deleted between lookup and
        read, changed under a ranged read, or the server unreachable — and what is there now is left be."""
        with self._unverified_lock:
            bad = [key for key in failed if key in self._unverified]
            self._unverified.difference_update(failed)
        self.counters.loaded += len(keys) - len(failed)
        self.counters.load_misses += len(failed) - len(bad)
        if bad:
            self.counters.integrity_failures += len(bad)
            self.delete(bad)
