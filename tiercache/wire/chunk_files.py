"""The chunk-file layout, shared by the L2 disk tier and the cache server's disk and shared-memory tiers.

Worker side (and the server). One file per chunk, in the stored chunk format,
at ``<directory>/<key[:2]>/<key>.chunk``, where a directory holds one storage
digest's chunks. A chunk is written to ``<name>.tmp`` and renamed into place,
so a reader sees a whole file or none (`ChunkFileBatch` flushes a batch's
durable files behind its writes); `scan_chunk_files` finds what a directory
holds after a restart, deleting leftovers and damaged files.
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Executor, Future
from pathlib import Path

from tiercache.arith import round_up
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.scan import ScanResult, StoredChunk
from tiercache.errors import ChunkFormatError
from tiercache.wire.chunk_format import HEADER_BYTES, check_header

SUFFIX = ".chunk"
TEMP_SUFFIX = ".tmp"     # a chunk file being written, renamed into place once whole
ALIGN = 4096
WRITE_PIECE = 4 << 20   # page-cache writes in one 32 MiB syscall ran at about half the rate of 4 MiB ones here


def chunk_path(directory: Path, key: bytes) -> Path:
    h = key.hex()
    return directory / h[:2] / f"{h}{SUFFIX}"


def write_all(fd: int, header: memoryview, payload: memoryview) -> None:
    """Header and payload in ``WRITE_PIECE`` syscalls (the first one gathers the header), retrying short writes."""
    first = payload[:WRITE_PIECE - len(header)]
    done = os.writev(fd, [header, first])
    if done < len(header):
        os.write(fd, header[done:])
        done = len(header)
    offset = done - len(header)
    while offset < len(payload):
        offset += os.write(fd, payload[offset:offset + WRITE_PIECE])


def _write_direct(fd: int, staging: memoryview, header: memoryview, payload: memoryview) -> None:
    """O_DIRECT: header and payload copied into aligned staging, written padded, then truncated to size."""
    from tiercache.codecs import copy_into

    size = len(header) + len(payload)
    padded = round_up(size, ALIGN)
    staging[:len(header)] = header
    copy_into(staging, payload, len(header))
    staging[size:padded] = bytes(padded - size)
    offset = 0
    while offset < padded:
        offset += os.pwritev(fd, [staging[offset:min(padded, offset + WRITE_PIECE)]], offset)
    os.ftruncate(fd, size)


def write_chunk_file(final: Path, header: memoryview, payload: memoryview, fsync: bool,
                     staging: memoryview | None = None) -> None:
    """Write header + payload to ``final`` crash-safely (a temp file renamed into place).

    With ``staging`` (a page-aligned buffer at least as large as the file)
    the file is written with O_DIRECT. Raises OSError on failure, leaving no
    temp file behind.
    """
    fd, tmp = _write_temp(final, header, payload, staging)
    _publish(fd, tmp, final, fsync)


def _write_temp(final: Path, header: memoryview, payload: memoryview, staging: memoryview | None) -> tuple[int, Path]:
    """``final``'s temp file, written and still open; nothing is left behind when this raises."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + TEMP_SUFFIX)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if staging is not None else 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        if staging is not None:
            _write_direct(fd, staging, header, payload)
        else:
            write_all(fd, header, payload)
    except BaseException:
        _discard(fd, tmp)
        raise
    return fd, tmp


def _publish(fd: int, tmp: Path, final: Path, fsync: bool) -> None:
    """Flush (when asked), close and rename a written temp file into place; on failure it is deleted."""
    try:
        if fsync:
            os.fdatasync(fd)
    except BaseException:
        _discard(fd, tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _discard(fd: int, tmp: Path) -> None:
    os.close(fd)
    tmp.unlink(missing_ok=True)


class ChunkFileBatch:
    """A batch of chunk files, written crash-safely, the durable ones flushed behind the writes.

    Without a ``flusher`` each `write` is `write_chunk_file` (no flush). With
    one, a written temp file is handed to the flusher thread, which fdatasyncs
    it and only then renames it into place — a chunk becomes visible once it
    is durable, as with ``fsync=True`` — while this thread writes the next
    file: the device's flush of one file overlaps the copy of the next into
    the page cache, which is faster than flushing after each write. At most
    ``window`` files wait for their flush (open descriptors, dirty pages).
    `finish` waits for every flush and returns the keys whose flush failed,
    with the error (their temp files deleted); a write that fails raises from
    `write` at once, as without a flusher.
    """

    def __init__(self, flusher: Executor | None, window: int = 8) -> None:
        self._flusher = flusher
        self._window = window
        self._pending: deque[tuple[BlockHash, Future]] = deque()
        self._failed: list[tuple[BlockHash, OSError]] = []

    def write(self, key: BlockHash, final: Path, header: memoryview, payload: memoryview,
              staging: memoryview | None = None) -> None:
        if self._flusher is None:
            write_chunk_file(final, header, payload, False, staging)
            return
        fd, tmp = _write_temp(final, header, payload, staging)
        self._pending.append((key, self._flusher.submit(_publish, fd, tmp, final, True)))
        while len(self._pending) > self._window:
            self._settle_oldest()

    def finish(self) -> list[tuple[BlockHash, OSError]]:
        while self._pending:
            self._settle_oldest()
        return self._failed

    def _settle_oldest(self) -> None:
        key, flushed = self._pending.popleft()
        try:
            flushed.result()
        except OSError as err:
            self._failed.append((key, err))


def scan_chunk_files(directory: Path, namespace: bytes) -> ScanResult:
    """The chunk files of one directory whose header and size check out, oldest first; leftover temp
    files and foreign, damaged or wrong-sized files are deleted and counted."""
    found, bad, temp = [], 0, 0
    for path in directory.glob("*/*"):
        if path.name.endswith(TEMP_SUFFIX):     # a writer died mid-chunk
            path.unlink(missing_ok=True)
            temp += 1
            continue
        if not path.name.endswith(SUFFIX):
            continue
        try:
            key = BlockHash(bytes.fromhex(path.name[:-len(SUFFIX)]))
            st = path.stat()
            with open(path, "rb") as f:
                parsed = check_header(f.read(HEADER_BYTES), namespace, key)
            if st.st_size != HEADER_BYTES + parsed[3]:
                raise ChunkFormatError(f"{path.name} is {st.st_size} bytes, header says {HEADER_BYTES + parsed[3]}")
        except (ValueError, ChunkFormatError, OSError):
            bad += 1
            path.unlink(missing_ok=True)
            continue
        found.append(StoredChunk(key, st.st_size, st.st_mtime_ns, parsed[0].parent))
    found.sort(key=lambda c: c.mtime_ns)
    return ScanResult(tuple(found), bad, temp)
