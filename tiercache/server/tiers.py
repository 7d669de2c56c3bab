"""The cache server's tiers: memory (in-process, or chunk files in shared memory) and disk.

Each is an `IndexedTier` (the index, two-phase lifecycle, pins and eviction
policies of an engine's tiers) keyed by namespace digest + chunk key; this
module decides where the bytes live. `ChunkStore` (store.py) owns them and
their lock; nothing here locks.

- `MemoryChunks`: each chunk as it came (`values.Stored`); spare value
  buffers (`BufferPool`) count against its capacity and go before chunks do.
- `DiskChunks`: one file per chunk in the L2 layout, the index rebuilt from
  the files at start.
- `ShmChunks`: the memory tier as chunk files under a tmpfs directory that
  clients on the same host read directly.

A memory tier with a disk below sets each evicted chunk aside (``spill``)
for the store to write down outside its lock.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
from tiercache.contracts.medium import Medium
from tiercache.index.indexed_tier import Entry, IndexedTier
from tiercache.policies import DEFAULT_EVICTION
from tiercache.server.values import BufferPool, Spill, Stored, StoreKey, store_key, value_size
from tiercache.wire.chunk_files import chunk_path, scan_chunk_files

INCOMING = "incoming"     # <shm>/<namespace>/incoming/<name>.tmp: chunk files written by co-located clients
INSTANCE_FILE = ".instance"


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
                 pool: BufferPool | None = None, retention_s: float = 0.0,
                 retention_by_namespace: Mapping[bytes, float] | None = None) -> None:
        super().__init__(eviction, retention_s, retention_by_namespace)
        self.name = name
        self._capacity = capacity_bytes
        self.pool = pool or BufferPool()
        self.values: dict[StoreKey, Stored] = {}
        self.spill: list[Spill] | None = None   # evicted chunks go here when a disk tier exists

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def add(self, key: StoreKey, stored: Stored, stored_at: float | None = None) -> bool:
        size = value_size(stored)
        self.pool.shrink(self._capacity - self._used - size)     # spare buffers make room before chunks do
        ok = self._reserve_bytes([key], [size], self._capacity)[0]
        self.pool.shrink(self._capacity - self._used)             # chunks + spares never exceed capacity
        if not ok:
            return False
        self.values[key] = stored
        self.publish([key], stored_at=None if stored_at is None else {key: stored_at})
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
        return Spill(key, entry.nbytes, value=self.values[key], stored_at=entry.stored_at, parent=entry.parent)

    def _release(self, key: StoreKey, entry: Entry) -> None:
        stored = self.values.pop(key)
        self.pool.give(stored)

    def unspilled(self, on_disk) -> list[Spill]:
        return [Spill(k, value_size(v), value=v, parent=self.entries[k].parent)
                for k, v in self.values.items() if not on_disk(k)]


MANIFEST = ".namespace"     # in a tenant-scoped directory: the namespace its chunks' headers name


class DiskChunks(IndexedTier):
    """The server's disk tier: one chunk file per key, the index rebuilt from the files at start."""
    medium = Medium.DISK

    def __init__(
        self, root: str | Path, capacity_bytes: int, eviction: str = DEFAULT_EVICTION, name: str = "disk",
        retention_s: float = 0.0, retention_by_namespace: Mapping[bytes, float] | None = None,
    ) -> None:
        super().__init__(eviction, retention_s, retention_by_namespace)
        self.name = name
        self.root = Path(root)
        self._capacity = capacity_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=self.root).close()   # writable: fail at start, not on every spill
        self.header_namespaces: dict[bytes, bytes] = {}    # a scoped directory's name → what its headers name
        for ns_dir in sorted(self.root.iterdir()):
            try:
                namespace = bytes.fromhex(ns_dir.name)
            except ValueError:
                continue
            if not ns_dir.is_dir() or len(namespace) != NAMESPACE_DIGEST_BYTES:
                continue
            header_ns = self._manifest(ns_dir) or namespace
            if header_ns != namespace:
                self.header_namespaces[namespace] = header_ns
            scan = scan_chunk_files(ns_dir, header_ns)
            self.counters.integrity_failures += scan.bad
            self.counters.temp_removed += scan.temp
            for chunk in scan.found:
                k = store_key(namespace, chunk.key)
                entry = Entry(chunk.nbytes, ready=True, parent=chunk.parent)   # entries' parents: chunk keys
                self._reserve(k, entry)
                self._stamp(k, entry, at=chunk.mtime_ns / 1e9)     # a file's time is when its chunk came
                self.policy.insert(k)
        self.expire()           # what passed its retention while the server was down: deleted, never served
        self._trim_to(self._capacity)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def _manifest(ns_dir: Path) -> bytes | None:
        try:
            named = bytes.fromhex((ns_dir / MANIFEST).read_text().strip())
        except (OSError, ValueError):
            return None
        return named if len(named) == NAMESPACE_DIGEST_BYTES else None

    def name_scope(self, storage_ns: bytes, header_ns: bytes) -> None:
        """Record that the chunks under ``storage_ns`` (a tenant-scoped digest) carry ``header_ns`` in their
        headers, so a restart checks them against it."""
        ns_dir = self.root / storage_ns.hex()
        ns_dir.mkdir(parents=True, exist_ok=True)
        (ns_dir / MANIFEST).write_text(header_ns.hex() + "\n")
        self.header_namespaces[storage_ns] = header_ns

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
                 name: str = "memory", retention_s: float = 0.0,
                 retention_by_namespace: Mapping[bytes, float] | None = None) -> None:
        root = Path(root).resolve()
        self.spill: list[Spill] | None = None      # set before the index is rebuilt: that may evict
        self._aside = root / ".spill"
        shutil.rmtree(self._aside, ignore_errors=True)   # a previous run's half-spilled files
        self._aside.mkdir(parents=True)
        super().__init__(root, capacity_bytes, eviction, name, retention_s, retention_by_namespace)
        os.chmod(self.root, 0o700)      # KV of every tenant lies here: the server's user (and its clients) only
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
        return Spill(key, entry.nbytes, file=aside, stored_at=entry.stored_at, parent=entry.parent)

    def unspilled(self, on_disk) -> list[Spill]:
        return [Spill(k, e.nbytes, file=self.path(k), keep_file=True, parent=e.parent)
                for k, e in self.entries.items() if e.ready and not on_disk(k)]
