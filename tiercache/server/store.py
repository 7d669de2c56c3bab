"""The cache server's storage: chunks of every namespace in memory, spilling to disk when configured.

The server keeps chunks as they arrive — the received `Chunk` messages of a
gRPC ``Put`` (one, or a first piece and its continuations), or the one
buffer a data-channel ``PUT`` was received into — with their values (the
stored chunk format) header-checked on the way in, keyed by namespace digest
+ chunk key, so one namespace never sees another's chunks. A memory hit is
answered from the very bytes that were received: no copy, no re-encoding,
when it leaves the way it came. Memory and disk are two `IndexedTier`s (the
same index, lifecycle and eviction policies as an engine's tiers); the disk
side reuses the L2 file layout and its crash-safe writes, so chunk files
survive a restart of the server.

- Memory (``capacity``): each chunk as it came; when full, spare value
  buffers (`BufferPool`) go first, then the eviction policy's victim, which
  with a disk is written there first (write-back).
- Disk (``disk_capacity``): the values alone, as files
  ``<dir>/<namespace>/<key[:2]>/<key>.chunk`` in the L2 layout; a hit on
  disk is read, checked, served and promoted back into memory.
- Shared memory (``shm_path``, instead of in-process memory): the memory
  tier is chunk files in the same layout under a tmpfs directory, so clients
  on the same host read them directly and hand in new ones through
  ``Adopt`` (see `ShmChunks`); gRPC clients are served from the same files.

Thread safety: gRPC runs handlers on a thread pool; one lock guards both
indexes, and file I/O happens outside it — a key being written is invisible
(reserved, not ready), a key being read is pinned.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
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
Messages = list[bytes]    # one chunk's `Chunk` messages, as received over gRPC
Value = bytes | bytearray  # one chunk's value in one buffer: from the data channel or a file
Stored = Messages | Value  # what the memory tier keeps: whichever way the chunk came, uncopied

INCOMING = "incoming"     # <shm>/<namespace>/incoming/<name>.tmp: chunk files written by co-located clients
INSTANCE_FILE = ".instance"


@dataclass(frozen=True, slots=True)
class Spill:
    """A chunk leaving memory for disk: what memory kept of it, or a file set aside (`ShmChunks`)."""
    key: StoreKey
    nbytes: int
    value: Stored | None = None
    file: Path | None = None
    keep_file: bool = False    # flush copies; eviction moves


def value_pieces(stored: Stored) -> list[memoryview]:
    """A stored chunk's value (header + payload) as views of the buffers that hold it, in order."""
    if isinstance(stored, list):
        return [parse_chunk(m).value for m in stored]
    return [memoryview(stored)]


def value_size(stored: Stored) -> int:
    return sum(len(p) for p in value_pieces(stored))


def value_parts(stored: Stored) -> tuple[memoryview, memoryview]:
    """(header, payload) views of a stored chunk's value (joined into one buffer only when split)."""
    pieces = value_pieces(stored)
    if len(pieces) == 1:
        return pieces[0][:HEADER_BYTES], pieces[0][HEADER_BYTES:]
    return pieces[0][:HEADER_BYTES], memoryview(b"".join([pieces[0][HEADER_BYTES:], *pieces[1:]]))


def as_messages(namespace: bytes, key: bytes, stored: Stored) -> Messages:
    """The `Chunk` messages a gRPC ``Get`` answers with: as received, or cut from a one-buffer value."""
    if isinstance(stored, list):
        return stored
    view = memoryview(stored)
    return list(split_chunk(namespace, key, view[:HEADER_BYTES], view[HEADER_BYTES:]))


def store_key(namespace: bytes, key: bytes) -> StoreKey:
    return namespace + key


class PutOutcome(str, Enum):
    STORED = "stored"
    PRESENT = "present"
    REJECTED = "rejected"


class BufferPool:
    """Value buffers of chunks that left memory, kept for the next chunk of the same size.

    A fresh 32 MiB ``bytearray`` pays its page faults on first touch (1.5–5
    GB/s here): receiving into fresh ones ran at a third of the socket's
    rate, into reused ones at 0.9 of it. Only a buffer nobody else holds is
    taken back — a value being sent or spilled holds a reference (a
    memoryview, a `Spill`), and CPython's reference count says so — so a
    buffer is never written while someone reads it. The memory tier counts
    spare buffers against its capacity and drops them before it evicts a
    chunk (`MemoryChunks.add`).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes     # None: as much as the memory tier leaves room for; 0: keep none
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            free = self._free.get(size)
            if free:
                self._bytes -= size
                return free.pop()
        return bytearray(size)

    def give(self, buf: Stored) -> None:
        """Offer a buffer back; the caller drops its own reference right after."""
        # references: the caller's, this frame's, getrefcount's argument; any more is a reader's
        if not isinstance(buf, bytearray) or sys.getrefcount(buf) > 3:
            return
        with self._lock:
            if self.max_bytes is not None and self._bytes + len(buf) > self.max_bytes:
                return
            self._free.setdefault(len(buf), []).append(buf)
            self._bytes += len(buf)

    def shrink(self, max_bytes: int) -> None:
        """Let go of spare buffers, largest sizes first, until at most ``max_bytes`` remain."""
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self._bytes > max(0, max_bytes):
                    free.pop()
                    self._bytes -= size
                if not free:
                    del self._free[size]

    @property
    def spare_bytes(self) -> int:
        return self._bytes


class _SpillsOnEviction:
    """For a memory tier: with a disk below (``spill`` a list), each evicted chunk is set aside for it."""
    spill: list[Spill] | None

    def _evict_one(self) -> bool:
        victim = self._pop_victim()
        if victim is None:
            return False
        key, entry = victim
        if self.spill is not None and (spill := self._set_aside(key, entry)) is not None:
            self.spill.append(spill)
        self._drop(key, entry, in_policy=False)
        return True


class MemoryChunks(_SpillsOnEviction, IndexedTier):
    """The server's memory tier: each chunk as it came (gRPC messages, or one buffer), bounded by
    ``capacity_bytes``."""
    medium = Medium.CPU

    def __init__(self, capacity_bytes: int, eviction: str = DEFAULT_EVICTION, name: str = "memory",
                 pool: BufferPool | None = None) -> None:
        super().__init__(eviction)
        self.name = name
        self._capacity = capacity_bytes
        self.pool = pool or BufferPool()
        self.values: dict[StoreKey, Stored] = {}
        self.spill: list[Spill] | None = None   # evicted chunks go here when a disk tier exists

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def add(self, key: StoreKey, stored: Stored) -> bool:
        size = value_size(stored)
        self.pool.shrink(self._capacity - self._used - size)     # spare buffers make room before chunks do
        ok = self._reserve_bytes([key], [size], self._capacity)[0]
        self.pool.shrink(self._capacity - self._used)             # chunks + spares never exceed capacity
        if not ok:
            return False
        self.values[key] = stored
        self.publish([key])
        return True

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "spare_bytes": self.pool.spare_bytes}

    def get(self, key: StoreKey) -> Stored | None:
        if not self.has(key):
            return None
        self.touch([key])
        self.counters.loaded += 1
        return self.values[key]

    def _set_aside(self, key: StoreKey, entry: Entry) -> Spill:
        return Spill(key, entry.nbytes, value=self.values[key])

    def _release(self, key: StoreKey, entry: Entry) -> None:
        stored = self.values.pop(key)
        self.pool.give(stored)

    def unspilled(self, on_disk) -> list[Spill]:
        return [Spill(k, value_size(v), value=v) for k, v in self.values.items() if not on_disk(k)]


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


class ShmChunks(_SpillsOnEviction, DiskChunks):
    """The memory tier as chunk files under a tmpfs directory that clients on the same host read directly.

    Same layout, index and crash-safe writes as `DiskChunks`; the files live
    in RAM (``/dev/shm``), survive a restart of the server (not of the
    machine), and are shared: a co-located client opens
    ``<root>/<namespace>/<key[:2]>/<key>.chunk`` itself and verifies what it
    reads, so a chunk replaced or evicted under it is at worst a miss —
    files are only ever renamed into place or unlinked, and an open file
    keeps its bytes. New chunks from such clients arrive as files in
    ``<root>/<namespace>/incoming/`` that `ChunkStore.adopt` checks and
    renames into place. ``<root>/.instance`` holds a token fresh at every
    start, which clients compare with the ``Local`` reply to know they see
    this server's directory. An evicted chunk bound for the disk tier is
    renamed aside into ``<root>/.spill/`` and copied down outside the lock.
    """
    medium = Medium.CPU

    def __init__(self, root: str | Path, capacity_bytes: int, eviction: str = DEFAULT_EVICTION,
                 name: str = "memory") -> None:
        root = Path(root).resolve()
        self.spill: list[Spill] | None = None      # set before the index is rebuilt: that may evict
        self._aside = root / ".spill"
        shutil.rmtree(self._aside, ignore_errors=True)   # a previous run's half-spilled files
        self._aside.mkdir(parents=True)
        super().__init__(root, capacity_bytes, eviction, name)
        self.instance = secrets.token_hex(16)
        tmp = self.root / f"{INSTANCE_FILE}.tmp"
        tmp.write_text(self.instance)
        os.rename(tmp, self.root / INSTANCE_FILE)

    def incoming(self, namespace: bytes) -> Path:
        return self.root / namespace.hex() / INCOMING

    def _set_aside(self, key: StoreKey, entry: Entry) -> Spill | None:
        """Rename the file out of the index's way (instant, under the lock); it is copied down later."""
        aside = self._aside / f"{key.hex()}.chunk"
        try:
            os.rename(self.path(key), aside)
        except OSError:
            self.counters.errors += 1
            return None
        return Spill(key, entry.nbytes, file=aside)

    def unspilled(self, on_disk) -> list[Spill]:
        return [Spill(k, e.nbytes, file=self.path(k), keep_file=True)
                for k, e in self.entries.items() if e.ready and not on_disk(k)]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    capacity: int
    eviction: str = DEFAULT_EVICTION
    disk_path: str = ""
    disk_capacity: int = 0
    shm_path: str = ""


class ChunkStore:
    def __init__(self, config: StoreConfig) -> None:
        self.pool = BufferPool(0 if config.shm_path else None)   # files keep no buffers to recycle
        self.memory: MemoryChunks | ShmChunks = (
            ShmChunks(config.shm_path, config.capacity, config.eviction) if config.shm_path
            else MemoryChunks(config.capacity, config.eviction, pool=self.pool))
        self.disk = DiskChunks(config.disk_path, config.disk_capacity, config.eviction) if config.disk_path else None
        if self.disk is not None:
            self.memory.spill = []
        self._lock = threading.Lock()
        self._namespaces: set[bytes] = {k[:NAMESPACE_DIGEST_BYTES] for t in self._file_tiers for k in t.entries}
        self.counters: Counter[str] = Counter()

    @property
    def tiers(self) -> list[IndexedTier]:
        return [self.memory] + ([self.disk] if self.disk else [])

    @property
    def shm(self) -> ShmChunks | None:
        return self.memory if isinstance(self.memory, ShmChunks) else None

    @property
    def _file_tiers(self) -> list[DiskChunks]:
        return [t for t in self.tiers if isinstance(t, DiskChunks)]

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
        """The stored chunk as the `Chunk` messages of a gRPC ``Get``, or None."""
        stored = self._fetch(namespace, key)
        return None if stored is None else as_messages(namespace, key, stored)

    def get_value(self, namespace: bytes, key: bytes) -> list[memoryview] | None:
        """The stored chunk's value (header + payload) as views of the buffers that hold it, or None."""
        stored = self._fetch(namespace, key)
        return None if stored is None else value_pieces(stored)

    def _fetch(self, namespace: bytes, key: bytes) -> Stored | None:
        """What is stored for the key, or None; a chunk in a file is read, checked, and (from disk)
        promoted into memory. What is returned is never written to again: stored values are replaced,
        not changed."""
        k = store_key(namespace, key)
        with self._lock:
            if isinstance(self.memory, MemoryChunks) and (stored := self.memory.get(k)) is not None:
                self.counters["get_hits"] += 1
                return stored
            tier = next((t for t in self._file_tiers if t.has(k)), None)
            if tier is None:
                self.counters["get_misses"] += 1
                return None
            tier.pin([k])
        value = self._read_file(tier, k, namespace, key)
        with self._lock:
            tier.unpin([k])
            if value is None:
                tier.counters.integrity_failures += 1
                tier.delete([k])
                self.counters["get_misses"] += 1
                return None
            tier.touch([k])
            tier.counters.loaded += 1
            self.counters["get_hits"] += 1
            if tier is self.memory:
                return value
            reserved = self._reserve_in_memory(k, value)
            spills = self._take_spills()
        self._finish_memory_write(k, value, reserved)
        self._write_spills(spills)
        return value

    @staticmethod
    def _read_file(tier: DiskChunks, k: StoreKey, namespace: bytes, key: bytes) -> bytes | None:
        try:
            value = tier.path(k).read_bytes()
            check_value(namespace, key, memoryview(value)[:HEADER_BYTES], len(value))
            return value
        except (OSError, ChunkFormatError) as err:
            log.warning("chunk file for %s… failed: %s", key.hex()[:16], err)
            return None

    # -- updates -------------------------------------------------------------
    def put(self, namespace: bytes, key: bytes, stored: Stored) -> PutOutcome:
        """Store one chunk — its gRPC messages, or its value in one buffer that nobody writes to again —
        whose value the caller has checked (`check_value`)."""
        k = store_key(namespace, key)
        with self._lock:
            self._namespaces.add(namespace)
            if self.memory.has(k) or k in self.memory.entries or (self.disk is not None and self.disk.has(k)):
                self.counters["put_present"] += 1
                return PutOutcome.PRESENT
            reserved = self._reserve_in_memory(k, stored)
            if not reserved:
                self.counters["put_rejected"] += 1
                return PutOutcome.REJECTED
            spills = self._take_spills()
        ok = self._finish_memory_write(k, stored, reserved)
        self._write_spills(spills)
        with self._lock:
            self.counters["put_stored" if ok else "put_rejected"] += 1
        return PutOutcome.STORED if ok else PutOutcome.REJECTED

    def _reserve_in_memory(self, k: StoreKey, stored: Stored) -> bool:
        """Under the lock: room in memory (taken at once in process memory; reserved for
        `_finish_memory_write` when memory is files)."""
        if isinstance(self.memory, MemoryChunks):
            return self.memory.add(k, stored)
        return self.memory.reserve(k, value_size(stored))

    def _finish_memory_write(self, k: StoreKey, stored: Stored, reserved: bool) -> bool:
        """Outside the lock: write a reserved chunk's file when memory is files; False if that failed."""
        if not reserved or isinstance(self.memory, MemoryChunks):
            return reserved
        try:
            write_chunk_file(self.memory.path(k), *value_parts(stored), fsync=False)
            failed = []
        except OSError as err:
            log.warning("writing a chunk to %s failed: %s", self.memory.root, err)
            failed = [k]
        with self._lock:
            self.memory.publish([k], failed)
        return not failed

    def adopt(self, namespace: bytes, key: bytes, name: str) -> PutOutcome:
        """Take the chunk file a co-located client wrote as ``<shm>/<namespace>/incoming/<name>`` into memory.

        Its header and size are checked like a ``Put``'s value; a bad or
        unwanted file is deleted. Raises `ChunkFormatError` for a bad file.
        """
        shm = self.shm
        assert shm is not None
        src = shm.incoming(namespace) / name
        k = store_key(namespace, key)
        try:
            with open(src, "rb") as f:
                header = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
            check_value(namespace, key, memoryview(header), size)
        except (OSError, ChunkFormatError) as err:
            src.unlink(missing_ok=True)
            raise ChunkFormatError(f"incoming file {name}: {err}") from None
        with self._lock:
            self._namespaces.add(namespace)
            if shm.has(k) or k in shm.entries or (self.disk is not None and self.disk.has(k)):
                src.unlink(missing_ok=True)
                self.counters["put_present"] += 1
                return PutOutcome.PRESENT
            if not shm.reserve(k, size):
                src.unlink(missing_ok=True)
                self.counters["put_rejected"] += 1
                return PutOutcome.REJECTED
            final = shm.path(k)
            try:
                final.parent.mkdir(exist_ok=True)
                os.rename(src, final)
                failed = []
            except OSError as err:
                log.warning("adopting %s failed: %s", src, err)
                src.unlink(missing_ok=True)
                failed = [k]
            shm.publish([k], failed)
            self.counters["put_rejected" if failed else "put_stored"] += 1
            spills = self._take_spills()
        self._write_spills(spills)
        return PutOutcome.REJECTED if failed else PutOutcome.STORED

    def touch(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Co-located clients read these chunks' files themselves: count them as hits and tell the policy."""
        with self._lock:
            ks = [k for k in (store_key(namespace, key) for key in keys) if self.memory.has(k)]
            self.memory.touch(ks)
            self.memory.counters.loaded += len(ks)
            self.counters["get_hits"] += len(ks)
            self.counters["local_get_hits"] += len(ks)
        return len(ks)

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            ks = [store_key(namespace, key) for key in keys]
            return sum(t.delete(ks) for t in self.tiers)

    def flush(self) -> int:
        """Write every value only memory holds to disk (at shutdown); returns how many were written."""
        if self.disk is None:
            return 0
        with self._lock:
            spills = self._reserve_on_disk(self.memory.unspilled(self.disk.has))
        self._write_spills(spills)
        return len(spills)

    # -- spills (write-back to disk) ------------------------------------------
    def _take_spills(self) -> list[Spill]:
        """Under the lock: the values memory evicted since the last call, reserved on disk."""
        if not self.memory.spill:
            return []
        spills, self.memory.spill = self.memory.spill, []
        return self._reserve_on_disk(spills)

    def _reserve_on_disk(self, spills: list[Spill]) -> list[Spill]:
        assert self.disk is not None
        kept = []
        for spill in spills:
            if self.disk.reserve(spill.key, spill.nbytes):
                kept.append(spill)
            elif spill.file is not None and not spill.keep_file:
                spill.file.unlink(missing_ok=True)
        return kept

    def _write_spills(self, spills: list[Spill]) -> None:
        if not spills:
            return
        assert self.disk is not None
        failed = []
        for spill in spills:
            try:
                if spill.value is not None:
                    write_chunk_file(self.disk.path(spill.key), *value_parts(spill.value), fsync=False)
                else:
                    value = memoryview(spill.file.read_bytes())
                    write_chunk_file(self.disk.path(spill.key), value[:HEADER_BYTES], value[HEADER_BYTES:],
                                     fsync=False)
            except OSError as err:
                log.warning("spilling a chunk to %s failed: %s", self.disk.root, err)
                failed.append(spill.key)
            finally:
                if spill.file is not None and not spill.keep_file:
                    spill.file.unlink(missing_ok=True)
        with self._lock:
            self.disk.publish([s.key for s in spills], failed)

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
