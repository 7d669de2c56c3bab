"""The cache server's storage: chunks of every namespace in memory, spilling to disk when configured.

`ChunkStore` owns the server's tiers (`tiers.py`) and the one lock over
them, and runs every operation of the RPCs and the data channel: lookups,
reads with promotion from disk, writes with write-back spills, adoption of
files handed in by co-located clients, deletes, the shutdown flush. Chunks
are kept as they arrive (`values.py`) — the received `Chunk` messages of a
gRPC ``Put``, or the one buffer a data-channel ``PUT`` was received into —
with their values (the stored chunk format) header-checked on the way in,
keyed by namespace digest + chunk key, so one namespace never sees
another's chunks. A memory hit is answered from the very bytes that were
received: no copy, no re-encoding, when it leaves the way it came. The disk
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
- Admission (``admission``): every key a client looks up is a sighting, and a
  chunk being stored goes in while the store has room or when the policy
  admits it (`StoreDoor`: what every replica asked for counts); one refused
  is answered as rejected, and counted as ``put_refused``.

Thread safety: gRPC runs handlers on a thread pool; one lock guards both
indexes, and file I/O happens outside it — a key being written is invisible
(reserved, not ready), a key being read is pinned.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum

from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.contracts.purge import PurgeOrder, PurgeReport
from tiercache.errors import ChunkFormatError
from tiercache.hot_chunks import HotChunks
from tiercache.index.indexed_tier import IndexedTier
from tiercache.log_limits import ThrottledLog
from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION
from tiercache.server.admission import StoreDoor
from tiercache.server.tiers import DiskChunks, MemoryChunks, ShmChunks
from tiercache.server.values import (
    BufferPool,
    Messages,
    Spill,
    Stored,
    StoreKey,
    as_messages,
    check_value,
    store_key,
    value_parts,
    value_pieces,
    value_size,
)
from tiercache.wire.chunk_files import write_chunk_file
from tiercache.wire.chunk_format import HEADER_BYTES, KEYED, check_payload, header_parent

log = logging.getLogger(__name__)


class StoreDirectoryError(OSError):
    """A tier's directory cannot be used; ``tier`` says which (``shm`` or ``disk``)."""

    def __init__(self, tier: str, path: str, reason: str) -> None:
        super().__init__(f"{tier} directory {path}: {reason}")
        self.tier, self.path, self.reason = tier, path, reason


class PutOutcome(str, Enum):
    STORED = "stored"
    PRESENT = "present"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    capacity: int
    eviction: str = DEFAULT_EVICTION
    disk_path: str = ""
    disk_capacity: int = 0
    shm_path: str = ""
    retention_s: float = 0.0       # seconds a chunk is kept after it came (0: no limit), memory and disk
    namespace_retention: Mapping[bytes, float] = field(default_factory=dict)   # a namespace's own (storage digest)
    admission: str = DEFAULT_ADMISSION    # which chunks a full store takes (`StoreDoor`)


class ChunkStore:
    """Server: one store's tiers (memory, disk) and the one lock over them."""

    def __init__(self, config: StoreConfig) -> None:
        self._warn = ThrottledLog(log)     # failing files, hostile clients: one line per kind and 10 s
        self.pool = BufferPool(0 if config.shm_path else None)   # files keep no buffers to recycle
        try:
            self.memory: MemoryChunks | ShmChunks = (
                ShmChunks(config.shm_path, config.capacity, config.eviction, retention_s=config.retention_s,
                          retention_by_namespace=config.namespace_retention)
                if config.shm_path
                else MemoryChunks(config.capacity, config.eviction, pool=self.pool, retention_s=config.retention_s,
                                  retention_by_namespace=config.namespace_retention))
        except OSError as err:
            raise StoreDirectoryError("shm", config.shm_path, err.strerror or str(err)) from None
        try:
            self.disk = DiskChunks(config.disk_path, config.disk_capacity, config.eviction,
                                   retention_s=config.retention_s, retention_by_namespace=config.namespace_retention
                                   ) if config.disk_path else None
        except OSError as err:
            raise StoreDirectoryError("disk", config.disk_path, err.strerror or str(err)) from None
        if self.disk is not None:
            self.memory.spill = []
        self._lock = threading.Lock()
        self.door = StoreDoor(config.admission)     # under the lock
        self._namespaces: set[bytes] = {k[:NAMESPACE_DIGEST_BYTES] for t in self._file_tiers for k in t.entries}
        self.counters: Counter[str] = Counter()
        self.hot = HotChunks()      # store keys (namespace + key) by reads served
        self._expired: list[bytes] = []     # storage keys retention removed, until `expire` hands them on
        # storage namespace → the namespace its chunks' headers name, for tenant-scoped namespaces
        self._header_ns: dict[bytes, bytes] = dict(self.disk.header_namespaces) if self.disk else {}

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
        """How many leading keys memory or disk holds; each tier counts the keys asked of it and found."""
        n = in_memory = 0
        stored = [store_key(namespace, key) for key in keys]
        with self._lock:
            self.door.sight(stored)
            for k in stored:
                if self.memory.has(k):
                    in_memory += 1
                elif self.disk is None or not self.disk.has(k):
                    break
                n += 1
            asked = min(n + 1, len(keys))            # the keys looked at: the hits, and the miss that ended it
            self.memory.count_lookup(asked, in_memory)
            if self.disk is not None:
                self.disk.count_lookup(asked - in_memory, n - in_memory)
            self.counters["contains_keys"] += len(keys)
            self.counters["contains_hits"] += n
        return n

    def present_each(self, namespace: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether memory or disk holds each key; one lookup for each tier, as `contains` counts them."""
        stored = [store_key(namespace, key) for key in keys]
        with self._lock:
            in_memory = [self.memory.has(k) for k in stored]
            each = [m or (self.disk is not None and self.disk.has(k)) for k, m in zip(stored, in_memory)]
            hits, memory_hits = sum(each), sum(in_memory)
            self.memory.count_lookup(len(keys), memory_hits)
            if self.disk is not None:
                self.disk.count_lookup(len(keys) - memory_hits, hits - memory_hits)
            self.counters["contains_keys"] += len(keys)
            self.counters["contains_hits"] += hits
        return each

    def scoped_namespaces(self) -> dict[bytes, bytes]:
        """Every scoped storage namespace and the namespace its chunks' headers name."""
        with self._lock:
            return dict(self._header_ns)

    def usage(self, namespaces: set[bytes]) -> dict[str, tuple[int, int]]:
        """Per tier: (chunks, bytes) held under ``namespaces`` (one tenant's share of a shared pool)."""
        with self._lock:
            return {t.name: (len(mine := [e.nbytes for k, e in t.entries.items()
                                          if e.ready and k[:NAMESPACE_DIGEST_BYTES] in namespaces]), sum(mine))
                    for t in self.tiers}

    def scope(self, storage_ns: bytes, header_ns: bytes) -> None:
        """Chunks stored under ``storage_ns`` (a tenant's scoped digest) name ``header_ns`` in their headers."""
        if self._header_ns.get(storage_ns) == header_ns:
            return
        with self._lock:
            self._header_ns[storage_ns] = header_ns
            if self.disk is not None:
                self.disk.name_scope(storage_ns, header_ns)

    def get(self, namespace: bytes, key: bytes, header_ns: bytes | None = None) -> Messages | None:
        """The stored chunk as the `Chunk` messages of a gRPC ``Get`` (naming ``header_ns``, the client's
        namespace, when ``namespace`` is a scoped one), or None."""
        stored = self._fetch(namespace, key)
        return None if stored is None else as_messages(header_ns or namespace, key, stored)

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
                self.hot.add((k,))
                return stored
            tier = next((t for t in self._file_tiers if t.has(k)), None)
            if tier is None:
                self.counters["get_misses"] += 1
                return None
            tier.pin([k])
        value = self._read_file(tier, k, namespace, key)
        with self._lock:
            purged = tier.entries[k].purged
            tier.unpin([k])
            if purged:                       # purged while it was read: neither served nor promoted
                self.counters["get_misses"] += 1
                return None
            if value is None:
                tier.counters.integrity_failures += 1
                tier.delete([k])
                self.counters["get_misses"] += 1
                return None
            tier.touch([k])
            tier.counters.loaded += 1
            self.counters["get_hits"] += 1
            self.hot.add((k,))
            if tier is self.memory:
                return value
            born = tier.stored_times([k]).get(k)           # promoted: its age keeps counting in memory
            parent = tier.entries[k].parent if k in tier.entries else None
            reserved = self._reserve_in_memory(k, value, born)
            if reserved:
                self.memory.link([(k, parent)])
            spills = self._take_spills()
        self._finish_memory_write(k, value, reserved, born)
        self._write_spills(spills)
        return value

    def _read_file(self, tier: DiskChunks, k: StoreKey, namespace: bytes, key: bytes) -> bytes | None:
        """The file's value if it passes every check, payload checksum included: what the server read from
        its own files is verified before it is served or kept in memory (a damaged file would otherwise be
        served to every replica until one of them deleted it)."""
        try:
            value = tier.path(k).read_bytes()
            view = memoryview(value)
            parsed = check_value(self._header_ns.get(namespace, namespace), key, view[:HEADER_BYTES], len(value))
            if parsed[2] not in KEYED:  # a signed or sealed chunk's key is its tenant's clients' alone: they check it
                check_payload(parsed, view[HEADER_BYTES:])
            return value
        except (OSError, ChunkFormatError) as err:
            self._warn.warning("read", "chunk file for %s… failed: %s", key.hex()[:16], err)
            return None

    # -- updates -------------------------------------------------------------
    def put(self, namespace: bytes, key: bytes, stored: Stored) -> PutOutcome:
        """Store one chunk — its gRPC messages, or its value in one buffer that nobody writes to again —
        whose value the caller has checked (`check_value`)."""
        k = store_key(namespace, key)
        with self._lock:
            self._expire_locked()           # a chunk past retention is stored again, not kept as present
            self._namespaces.add(namespace)
            if self.memory.has(k) or k in self.memory.entries or (self.disk is not None and self.disk.has(k)):
                self.counters["put_present"] += 1
                return PutOutcome.PRESENT
            parent = header_parent(value_pieces(stored)[0][:HEADER_BYTES])
            if not self._admits(namespace, k, parent, value_size(stored)):
                return PutOutcome.REJECTED
            reserved = self._reserve_in_memory(k, stored)
            if not reserved:
                self.counters["put_rejected"] += 1
                return PutOutcome.REJECTED
            self.memory.link([(k, parent)])
            spills = self._take_spills()
        ok = self._finish_memory_write(k, stored, reserved)
        self._write_spills(spills)
        with self._lock:
            self.counters["put_stored" if ok else "put_rejected"] += 1
        return PutOutcome.STORED if ok else PutOutcome.REJECTED

    def _admits(self, namespace: bytes, k: StoreKey, parent: bytes | None, nbytes: int) -> bool:
        """Under the lock: whether the door takes chunk ``k`` of ``nbytes`` — with room in memory, or on the disk
        its victim would spill to, it evicts nothing (`StoreDoor`); a refusal is counted."""
        tiers = self.tiers
        room = any(t.capacity_bytes - t.used_bytes >= nbytes for t in tiers)
        taken = self.door.admits(k, None if parent is None else store_key(namespace, parent), room,
                                 sum(t.num_chunks for t in tiers), lambda p: any(p in t.entries for t in tiers))
        if not taken:
            self.counters["put_refused"] += 1
        return taken

    def _reserve_in_memory(self, k: StoreKey, stored: Stored, stored_at: float | None = None) -> bool:
        """Under the lock: room in memory (taken at once in process memory; reserved for
        `_finish_memory_write` when memory is files). ``stored_at``: a promoted chunk's age."""
        if isinstance(self.memory, MemoryChunks):
            return self.memory.add(k, stored, stored_at)
        return self.memory.reserve(k, value_size(stored))

    def _finish_memory_write(self, k: StoreKey, stored: Stored, reserved: bool,
                             stored_at: float | None = None) -> bool:
        """Outside the lock: write a reserved chunk's file when memory is files; False if that failed."""
        if not reserved or isinstance(self.memory, MemoryChunks):
            return reserved
        try:
            write_chunk_file(self.memory.path(k), *value_parts(stored), fsync=False)
            failed = []
        except OSError as err:
            self._warn.warning("write shm", "writing a chunk to %s failed: %s", self.memory.root, err)
            failed = [k]
        with self._lock:
            self.memory.publish([k], failed, stored_at=None if stored_at is None else {k: stored_at})
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
            self._expire_locked()
            self._namespaces.add(namespace)
            if shm.has(k) or k in shm.entries or (self.disk is not None and self.disk.has(k)):
                src.unlink(missing_ok=True)
                self.counters["put_present"] += 1
                return PutOutcome.PRESENT
            if not self._admits(namespace, k, header_parent(header), size):
                src.unlink(missing_ok=True)
                return PutOutcome.REJECTED
            if not shm.reserve(k, size):
                src.unlink(missing_ok=True)
                self.counters["put_rejected"] += 1
                return PutOutcome.REJECTED
            shm.link([(k, header_parent(header))])
            final = shm.path(k)
            try:
                final.parent.mkdir(exist_ok=True)
                os.rename(src, final)
                failed = []
            except OSError as err:
                self._warn.warning("adopt", "adopting %s failed: %s", src, err)
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
            self.hot.add(ks)
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
        return len(spills) - len(self._write_spills(spills))

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
                self.disk.link([(spill.key, spill.parent)])
                kept.append(spill)
            elif spill.file is not None and not spill.keep_file:
                spill.file.unlink(missing_ok=True)
        return kept

    def _write_spills(self, spills: list[Spill]) -> list[bytes]:
        """Write reserved spills to disk; returns the keys that failed."""
        if not spills:
            return []
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
                self._warn.warning("spill", "spilling a chunk to %s failed: %s", self.disk.root, err)
                failed.append(spill.key)
            finally:
                if spill.file is not None and not spill.keep_file:
                    spill.file.unlink(missing_ok=True)
        for spill in spills:
            if spill.stored_at and spill.key not in failed:     # the file's time is its chunk's age at a restart
                with contextlib.suppress(OSError):       # a file without it ages from the spill: no worse
                    os.utime(self.disk.path(spill.key), (spill.stored_at, spill.stored_at))
        with self._lock:
            self.disk.publish([s.key for s in spills], failed,
                              stored_at={s.key: s.stored_at for s in spills if s.stored_at})
        return failed

    def purge(self, order: PurgeOrder, namespaces: Set[bytes] | None = None) -> PurgeReport:
        """Take what ``order`` selects out of memory and disk, among the chunks of ``namespaces`` (None: all of
        this store's). A chain is followed across both tiers and across namespaces (a TP deployment files
        each rank's share of a chunk under a namespace of its own, with one key)."""
        if order.namespaces:
            wanted = set(order.namespaces)
            namespaces = wanted if namespaces is None else set(namespaces) & wanted
        report = PurgeReport()
        with self._lock:
            def mine(k: bytes) -> bool:
                return namespaces is None or k[:NAMESPACE_DIGEST_BYTES] in namespaces

            links = [(k[NAMESPACE_DIGEST_BYTES:], e.parent) for t in self.tiers for k, e in t.entries.items()
                     if e.parent is not None and mine(k)] if order.roots else []
            selected = order.selector(links)
            for tier in self.tiers:
                keys, nbytes = tier.purge(lambda k, at: mine(k) and selected(k[NAMESPACE_DIGEST_BYTES:], at))
                report.add(tier.name, len(keys), nbytes)
                self.hot.forget(keys)
        return report

    def expire(self) -> list[bytes]:
        """Remove what is past retention from memory and disk (the server's sweep, every second); returns the
        storage keys (namespace first) of every chunk retention removed since the last call, those a store
        found expired on its way included."""
        with self._lock:
            self._expire_locked()
            gone, self._expired = self._expired, []
            return gone

    def _expire_locked(self) -> None:
        for tier in self.tiers:
            self._expired += tier.expire()

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "tiers": {t.name: t.stats() for t in self.tiers},
                "namespaces": len(self._namespaces),
                "server": dict(self.counters),
                "hot_chunks": [(k[:NAMESPACE_DIGEST_BYTES], k[NAMESPACE_DIGEST_BYTES:], n) for k, n in self.hot.top()],
            }
