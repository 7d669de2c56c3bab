"""L2: chunks as files on a local disk, in the stored chunk format, surviving restarts.

Two halves, sharing nothing but plain data:

- `DiskIndex` (scheduler side): which chunks every rank holds, the
  two-phase lifecycle, capacity and eviction. It never touches a file: an
  entry that leaves (evicted, found corrupt, half-written) is handed out by
  `take_deletes`, and the manager plans a delete that every rank runs. At
  start it is rebuilt from what the ranks found on disk (`rebuild`): a chunk
  counts only when every writing rank has it; the others are deleted.
- `DiskTransport` (worker side, one per rank): this rank's files under
  ``<root>/<storage digest>/`` (the digest names the rank's share of the KV,
  so ranks and deployments never read each other's files), written crash-safely
  (`tiercache.wire.chunk_files`) and read through the one verification path
  (`tiercache.wire.values.receive_value`).

Capacity is per rank (each rank's files of one chunk are the same size) and
counts whole files, headers included. A delete that makes room runs on the
same link as the write it made room for, at a higher priority, so it starts
first. A codec's work (``format.codec``) runs on the worker's codec threads
beside the file I/O (`tiercache.wire.codec_pipeline`). ``o_direct`` reads and
writes through a per-thread, page-aligned staging buffer (allocated once,
pre-faulted), bypassing the page cache — cold reads at device speed and no
cache pollution — at the cost of one memcpy each way.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiercache.arith import round_up
from tiercache.codecs import Buffer
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.layout import ChunkLayout
from tiercache.contracts.medium import Medium
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.errors import ChunkFormatError
from tiercache.index.indexed_tier import Entry, IndexedTier
from tiercache.log_limits import ThrottledLog
from tiercache.policies import DEFAULT_EVICTION
from tiercache.tiers.base import LowerIndex, Transport
from tiercache.wire.chunk_files import (
    ALIGN,
    WRITE_PIECE,
    ChunkFileBatch,
    ScanResult,
    chunk_path,
    scan_chunk_files,
    write_chunk_file,
)
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecPipeline, CodecThreads, Encoded, ReadBatch
from tiercache.wire.grpc_messages import ChunkPieces
from tiercache.wire.values import FileSource, receive_value

log = logging.getLogger(__name__)


class DiskIndex(IndexedTier, LowerIndex):
    """Scheduler side: the disk tier's index, rebuilt from every rank's scan at start."""

    medium = Medium.DISK

    def __init__(self, capacity_bytes: int, fmt: ChunkFormat | None = None, eviction: str = DEFAULT_EVICTION,
                 name: str = "disk", retention_s: float = 0.0) -> None:
        super().__init__(eviction, retention_s)
        if capacity_bytes <= HEADER_BYTES:
            raise ValueError(f"L2 capacity {capacity_bytes} B cannot hold a chunk")
        self.name = name
        self.fmt = fmt or ChunkFormat()
        self._capacity = capacity_bytes
        self._deletes: list[BlockHash] = []

    # -- restart -------------------------------------------------------------
    def rebuild(self, per_rank: Sequence[ScanResult]) -> int:
        """Index what every writing rank found on disk, oldest first, then trim to capacity. Chunks only some
        ranks hold (a rank died mid-store) are deleted; returns how many."""
        if not per_rank:
            return 0
        for scan in per_rank:
            self.counters.integrity_failures += scan.bad
            self.counters.temp_removed += scan.temp
        maps = [{c.key: c for c in scan.found} for scan in per_rank]
        common = set(maps[0]).intersection(*maps[1:])
        partial = set().union(*maps) - common
        self._deletes.extend(partial)
        written = {key: max(m[key].mtime_ns for m in maps) for key in common}
        for key in sorted(common, key=written.__getitem__):
            entry = Entry(max(m[key].nbytes for m in maps), ready=True, parent=maps[0][key].parent)
            self._reserve(key, entry)
            self._stamp(key, entry, at=written[key] / 1e9)      # its age runs from when it was written
            self.policy.insert(key)
        self.expire()               # what passed its retention while nothing ran: deleted, never served
        self._trim_to(self._capacity)
        return len(partial)

    # -- TierIndex -----------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def reserve_bytes(self, layout: ChunkLayout) -> int:
        return self.fmt.max_stored_len(layout)

    def take_deletes(self) -> list[BlockHash]:
        out, self._deletes = self._deletes, []
        return out

    # -- stores --------------------------------------------------------------
    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        """Reserve room for each key's file (header included); False where present or no room."""
        return self._reserve_bytes(keys, nbytes, self._capacity)

    def complete_store(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {},
                       stored_at: Mapping[BlockHash, float] | None = None) -> None:
        """Publish the written keys; a key that failed on some rank may be whole on others: delete it there."""
        self.publish(keys, failed, stored_at=stored_at)
        self._deletes.extend(k for k in keys if k in failed)

    # -- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[BlockHash]) -> None:
        self.pin(keys)

    def complete_load(self, keys: Sequence[BlockHash], failed: Mapping[BlockHash, Failure] = {}) -> None:
        """Unpin; a chunk whose file failed to read or verify on any rank is dropped (a miss from now on) and
        its files deleted. A pinned file cannot vanish under the reader, so every failure here is the file's."""
        self.unpin(keys)
        for key, why in failed.items():
            if why is Failure.CORRUPT or why is Failure.MISS or why is Failure.IO:
                self.counters.integrity_failures += why is Failure.CORRUPT
                self.counters.errors += why is not Failure.CORRUPT
                entry = self.entries.get(key)
                if entry is not None and entry.pins == 0:
                    self._drop(key, entry)
            else:
                self.counters.load_misses += 1
        good = [k for k in keys if k not in failed]
        self.touch(good)
        self.counters.loaded += len(good)

    def _release(self, key: BlockHash, entry: Entry) -> None:
        self._deletes.append(key)


class DiskTransport(Transport):
    """Worker side, one per rank: this rank's chunk files."""

    medium = Medium.DISK

    def __init__(self, root: str | os.PathLike[str], storage: bytes, fmt: ChunkFormat | None = None,
                 fsync: bool = False, o_direct: bool = False, name: str = "disk", writer: bool = True,
                 codec_threads: CodecThreads | None = None) -> None:
        self.name = name
        self.storage = storage
        self.fmt = fmt or ChunkFormat()
        self.fsync = fsync
        self.o_direct = o_direct
        self.writer = writer
        self.dir = Path(root) / storage.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._staging = threading.local()
        self._codec = CodecPipeline(self.fmt, codec_threads, name)
        # durable writes: one thread flushes each written file while the transfer thread writes the next
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix=f"tiercache-flush-{name}") if fsync else None
        self._warn = ThrottledLog(log)     # a full or failing disk: one line per kind and 10 s, with a count
        if o_direct:
            self._probe_o_direct()

    def path(self, key: BlockHash) -> Path:
        return chunk_path(self.dir, key)

    def scan(self) -> ScanResult:
        result = scan_chunk_files(self.dir, self.storage)
        if result.bad or result.temp:
            log.warning("disk tier %s: deleted %d damaged and %d half-written chunk files in %s",
                        self.name, result.bad, result.temp, self.dir)
        return result

    # -- writes --------------------------------------------------------------
    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> KeyFailures:
        if not self.writer:
            return ()
        failed: list[tuple[BlockHash, Failure]] = []
        files = ChunkFileBatch(self._flusher)
        for chunk in self._codec.encoded(items, failed):
            key = chunk.meta.key
            if chunk.refused:
                continue
            try:
                files.write(key, self.path(key), memoryview(chunk.header), chunk.payload, self._staging_for(chunk))
            except OSError as err:
                self._write_failed(key, err, failed)
        for key, err in files.finish():
            self._write_failed(key, err, failed)
        return tuple(failed)

    def _write_failed(self, key: BlockHash, err: OSError, failed: list[tuple[BlockHash, Failure]]) -> None:
        self._warn.warning("write", "writing chunk %s… to %s failed: %s", key.hex()[:16], self.name, err)
        failed.append((key, Failure.IO))

    def write_chunk(self, meta: ChunkMeta, raw: Buffer) -> None:
        """Encode and write one chunk crash-safely; raises OSError (ENOSPC, EACCES, ...) on failure, and
        `NonFiniteKVError` for KV its codec refuses."""
        header, payload = self.fmt.encode_parts(meta, raw)
        chunk = Encoded(meta, header, memoryview(payload).cast("B"))
        write_chunk_file(self.path(meta.key), memoryview(header), chunk.payload, self.fsync, self._staging_for(chunk))

    def _staging_for(self, chunk: Encoded) -> memoryview | None:
        return self._aligned(len(chunk.header) + len(chunk.payload)) if self.o_direct else None

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)

    def delete_chunks(self, keys: Sequence[BlockHash]) -> None:
        if not self.writer:
            return
        for key in keys:
            try:
                self.path(key).unlink(missing_ok=True)
            except OSError as err:   # a stray file is re-verified (and counted) at the next start
                self._warn.warning("delete", "deleting chunk %s… from %s failed: %s", key.hex()[:16], self.name,
                              err)

    # -- reads ---------------------------------------------------------------
    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | Failure]:
        out: list[int | Failure] = []
        with self._codec.reads() as reads:
            for key, buf in items:
                try:
                    out.append(self._read_into(key, buf, reads))
                except FileNotFoundError:
                    self._warn.warning("missing", "chunk %s… is missing from %s", key.hex()[:16], self.dir)
                    out.append(Failure.MISS)
                except ChunkFormatError as err:
                    out.append(self._corrupt(key, err))
                except (OSError, ConnectionError) as err:
                    self._warn.warning("read", "reading chunk %s… from %s failed: %s", key.hex()[:16], self.name,
                                       err)
                    out.append(Failure.IO)
        return reads.settled(items, out, self._corrupt)

    def _corrupt(self, key: BlockHash, err: ChunkFormatError) -> Failure:
        self._warn.warning("corrupt", "chunk %s… in %s failed verification: %s", key.hex()[:16], self.name, err)
        return Failure.CORRUPT

    def read_chunk_into(self, key: BlockHash, out: memoryview) -> int:
        """Read and verify one chunk, leaving its raw bytes at the start of ``out``; returns their length.
        Raises `ChunkFormatError` for a corrupt, truncated or foreign file and OSError when it cannot be read."""
        with self._codec.reads() as reads:
            n = self._read_into(key, out, reads)
        if key in reads.failed:
            raise reads.failed[key]
        return n

    def _read_into(self, key: BlockHash, out: memoryview, reads: ReadBatch) -> int:
        if self.o_direct:
            return self._read_direct(key, out, reads)
        with open(self.path(key), "rb", buffering=0) as f:
            return receive_value(FileSource(f), os.fstat(f.fileno()).st_size, self.storage, key, out, reads,
                                 self.fmt.signer)

    def _read_direct(self, key: BlockHash, out: memoryview, reads: ReadBatch) -> int:
        fd = os.open(self.path(key), os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            buf = self._aligned(size)
            padded = round_up(size, ALIGN)
            got = 0
            while got < size:
                n = os.preadv(fd, [buf[got:min(padded, got + WRITE_PIECE)]], got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        return receive_value(ChunkPieces([buf[:got]]), got, self.storage, key, out, reads, self.fmt.signer)

    # -- O_DIRECT staging ----------------------------------------------------
    def _probe_o_direct(self) -> None:
        probe = self.dir / ".o_direct_probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            os.close(fd)
        except OSError as err:
            raise OSError(err.errno, f"O_DIRECT is not supported in {self.dir}: {err.strerror}") from None
        finally:
            probe.unlink(missing_ok=True)

    def _aligned(self, nbytes: int) -> memoryview:
        """This thread's page-aligned staging buffer, grown (and pre-faulted) when too small."""
        buf = getattr(self._staging, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, round_up(nbytes, ALIGN))
            buf.write(bytes(len(buf)))   # fault every page in now, not on the first copy
            self._staging.buf = buf
        return memoryview(buf)
