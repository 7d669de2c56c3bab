"""The cache server's storage: chunks of every namespace in memory, spilling to disk when configured.

The server keeps chunks as they arrive — the received `Chunk` messages (one,
or a first piece and its continuations), whose values (the stored chunk
format) had their headers checked on the way in — keyed by namespace digest
+ chunk key, so one namespace never sees another's chunks. A memory hit is
answered with the very bytes that were received: no copy, no re-encoding. Memory and disk
are two `IndexedTier`s (the same index, lifecycle and eviction policies as an
engine's tiers); the disk side reuses the L2 file layout and its crash-safe
writes, so chunk files survive a restart of the server.

- Memory (``capacity``): each chunk is the message ``bytes`` gRPC delivered;
  when full, the eviction policy's victim leaves, and with a disk it is
  written there first (write-back).
- Disk (``disk_capacity``): the values alone, as files
  ``<dir>/<namespace>/<key[:2]>/<key>.chunk`` in the L2 layout; a hit on
  disk is read, checked, served and promoted back into memory.

Thread safety: gRPC runs handlers on a thread pool; one lock guards both
indexes, and file I/O happens outside it — a key being written is invisible
(reserved, not ready), a key being read is pinned.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tiercache.chunk_format import HEADER_BYTES, check_header
from tiercache.errors import ChunkFormatError
from tiercache.keys import NAMESPACE_DIGEST_BYTES, BlockHash
from tiercache.server.wire import parse_chunk, split_chunk
from tiercache.tiers.base import Medium
from tiercache.tiers.disk import chunk_path, scan_chunk_files, write_chunk_file
from tiercache.policies import DEFAULT_EVICTION
from tiercache.tiers.index import Entry, IndexedTier

log = logging.getLogger(__name__)

StoreKey = bytes          # namespace digest + chunk key
Messages = list[bytes]    # one chunk's `Chunk` messages, as received


def store_key(namespace: bytes, key: bytes) -> StoreKey:
    return namespace + key


class PutOutcome(str, Enum):
    STORED = "stored"
    PRESENT = "present"
    REJECTED = "rejected"


class MemoryChunks(IndexedTier):
    """The server's memory tier: one chunk's messages per key, bounded by ``capacity_bytes``."""
    medium = Medium.CPU

    def __init__(self, capacity_bytes: int, eviction: str = DEFAULT_EVICTION, name: str = "memory") -> None:
        super().__init__(eviction)
        self.name = name
        self._capacity = capacity_bytes
        self.values: dict[StoreKey, Messages] = {}
        self.spill: list[tuple[StoreKey, Messages]] | None = None   # evicted chunks go here when a disk tier exists

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def add(self, key: StoreKey, messages: Messages) -> bool:
        if not self._reserve_bytes([key], [sum(len(m) for m in messages)], self._capacity)[0]:
            return False
        self.values[key] = messages
        self.publish([key])
        return True

    def get(self, key: StoreKey) -> Messages | None:
        if not self.has(key):
            return None
        self.touch([key])
        self.counters.loaded += 1
        return self.values[key]

    def _evict_one(self) -> bool:
        victim = self._pop_victim()
        if victim is None:
            return False
        key, entry = victim
        if self.spill is not None:
            self.spill.append((key, self.values[key]))
        self._drop(key, entry, in_policy=False)
        return True

    def _release(self, key: StoreKey, entry: Entry) -> None:
        del self.values[key]


class DiskChunks(IndexedTier):
    """The server's disk tier: one chunk file per key, the index rebuilt from the files at start."""
    medium = Medium.DISK

    def __init__(self, root: str | Path, capacity_bytes: int, eviction: str = DEFAULT_EVICTION, name: str = "disk") -> None:
        super().__init__(eviction)
        self.name = name
        self.root = Path(root)
        self._capacity = capacity_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        for ns_dir in sorted(self.root.iterdir()):
            try:
                namespace = bytes.fromhex(ns_dir.name)
            except ValueError:
                continue
            if not ns_dir.is_dir() or len(namespace) != NAMESPACE_DIGEST_BYTES:
                continue
            found, bad = scan_chunk_files(ns_dir, namespace)
            self.counters.integrity_failures += bad
            for _, key, size in found:
                self._reserve(store_key(namespace, key), Entry(size, ready=True))
                self.policy.insert(store_key(namespace, key))
        self._trim_to(self._capacity)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def path(self, key: StoreKey) -> Path:
        namespace, chunk = key[:NAMESPACE_DIGEST_BYTES], key[NAMESPACE_DIGEST_BYTES:]
        return chunk_path(self.root / namespace.hex(), chunk)

    def reserve(self, key: StoreKey, nbytes: int) -> bool:
        return self._reserve_bytes([key], [nbytes], self._capacity)[0]

    def _release(self, key: StoreKey, entry: Entry) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError:
            self.counters.errors += 1


@dataclass(frozen=True, slots=True)
class StoreConfig:
    capacity: int
    eviction: str = DEFAULT_EVICTION
    disk_path: str = ""
    disk_capacity: int = 0


class ChunkStore:
    def __init__(self, config: StoreConfig) -> None:
        self.memory = MemoryChunks(config.capacity, config.eviction)
        self.disk = DiskChunks(config.disk_path, config.disk_capacity, config.eviction) if config.disk_path else None
        if self.disk is not None:
            self.memory.spill = []
        self._lock = threading.Lock()
        self._namespaces: set[bytes] = {k[:NAMESPACE_DIGEST_BYTES] for k in self.disk.entries} if self.disk else set()
        self.counters: Counter[str] = Counter()

    @property
    def tiers(self) -> list[IndexedTier]:
        return [self.memory] + ([self.disk] if self.disk else [])

    # -- queries -------------------------------------------------------------
    def contains(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                k = store_key(namespace, key)
                if not (self.memory.has(k) or (self.disk is not None and self.disk.has(k))):
                    break
                n += 1
            self.counters["contains_keys"] += len(keys)
            self.counters["contains_hits"] += n
        return n

    def get(self, namespace: bytes, key: bytes) -> Messages | None:
        """The stored chunk's messages, or None; a chunk on disk is read, checked and promoted into memory."""
        k = store_key(namespace, key)
        with self._lock:
            value = self.memory.get(k)
            if value is not None:
                self.counters["get_hits"] += 1
                return value
            if self.disk is None or not self.disk.has(k):
                self.counters["get_misses"] += 1
                return None
            self.disk.pin([k])
        value = self._read_file(k, namespace, key)
        with self._lock:
            self.disk.unpin([k])
            if value is None:
                self.disk.counters.integrity_failures += 1
                self.disk.delete([k])
                self.counters["get_misses"] += 1
                return None
            self.disk.touch([k])
            self.disk.counters.loaded += 1
            self.counters["get_hits"] += 1
            self.memory.add(k, value)
            spills = self._take_spills()
        self._write_spills(spills)
        return value

    def _read_file(self, k: StoreKey, namespace: bytes, key: bytes) -> Messages | None:
        assert self.disk is not None
        try:
            value = memoryview(self.disk.path(k).read_bytes())
            check_value(namespace, key, value[:HEADER_BYTES], len(value))
            return list(split_chunk(namespace, key, value[:HEADER_BYTES], value[HEADER_BYTES:]))
        except (OSError, ChunkFormatError) as err:
            log.warning("chunk file for %s… failed: %s", key.hex()[:16], err)
            return None

    # -- updates -------------------------------------------------------------
    def put(self, namespace: bytes, key: bytes, messages: Messages) -> PutOutcome:
        """Store one chunk's messages, whose value the caller has checked (`check_value`)."""
        k = store_key(namespace, key)
        with self._lock:
            self._namespaces.add(namespace)
            if self.memory.has(k) or (self.disk is not None and self.disk.has(k)):
                self.counters["put_present"] += 1
                return PutOutcome.PRESENT
            if not self.memory.add(k, messages):
                self.counters["put_rejected"] += 1
                return PutOutcome.REJECTED
            self.counters["put_stored"] += 1
            spills = self._take_spills()
        self._write_spills(spills)
        return PutOutcome.STORED

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            ks = [store_key(namespace, key) for key in keys]
            return sum(t.delete(ks) for t in self.tiers)

    def flush(self) -> int:
        """Write every value only memory holds to disk (at shutdown); returns how many were written."""
        if self.disk is None:
            return 0
        with self._lock:
            spills = [(k, v) for k, v in self.memory.values.items() if not self.disk.has(k)]
            spills = self._reserve_on_disk(spills)
        self._write_spills(spills)
        return len(spills)

    # -- spills (write-back to disk) ------------------------------------------
    def _take_spills(self) -> list[tuple[StoreKey, Messages]]:
        """Under the lock: the values memory evicted since the last call, reserved on disk."""
        if self.memory.spill is None or not self.memory.spill:
            return []
        spills, self.memory.spill = self.memory.spill, []
        return self._reserve_on_disk(spills)

    def _reserve_on_disk(self, spills: list[tuple[StoreKey, Messages]]) -> list[tuple[StoreKey, Messages]]:
        assert self.disk is not None
        return [(k, m) for k, m in spills if self.disk.reserve(k, sum(len(x) for x in m))]

    def _write_spills(self, spills: list[tuple[StoreKey, Messages]]) -> None:
        if not spills:
            return
        assert self.disk is not None
        failed = []
        for k, messages in spills:
            pieces = [parse_chunk(m).value for m in messages]
            payload = pieces[0][HEADER_BYTES:] if len(pieces) == 1 else \
                memoryview(b"".join([pieces[0][HEADER_BYTES:], *pieces[1:]]))
            try:
                write_chunk_file(self.disk.path(k), pieces[0][:HEADER_BYTES], payload, fsync=False)
            except OSError as err:
                log.warning("spilling a chunk to %s failed: %s", self.disk.root, err)
                failed.append(k)
        with self._lock:
            self.disk.publish([k for k, _ in spills], failed)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "tiers": {t.name: t.stats() for t in self.tiers},
                "namespaces": len(self._namespaces),
                "server": dict(self.counters),
            }


def check_value(namespace: bytes, key: bytes, header: memoryview, total_len: int) -> None:
    """The checks a value (its header and whole length) passes before the server stores it; raises
    `ChunkFormatError`. The payload checksum is the readers' to verify, end to end."""
    parsed = check_header(header, namespace, BlockHash(key))
    if total_len != HEADER_BYTES + parsed[3]:
        raise ChunkFormatError(f"value is {total_len} bytes, its header says {HEADER_BYTES + parsed[3]}")
