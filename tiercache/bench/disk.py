"""`tiercache bench tiers --tiers disk`: L2 put/get beside raw file I/O of the same bytes, in one run.

*put* writes L1's chunks down through the tier (encode, header + payload in one
``writev``, temp file + rename, optional ``fdatasync`` behind the next write);
*get* promotes them back into L1 slots (read, verify the checksum, place). The
raw baseline writes and reads the same chunk bytes as plain files (``write`` /
``readinto``, and ``fdatasync`` behind the writes when the tier uses it). Reads
are timed cold — the page cache is dropped before each read pass — when the
process may write ``/proc/sys/vm/drop_caches``; otherwise they come from the
page cache and the report says so.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiercache.bench.filled import FilledStack, filled_stack
from tiercache.bench.formats import format_section
from tiercache.tiers.disk import WRITE_PIECE


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def time_file_writes(paths: list[Path], chunks: list[memoryview], fsync: bool) -> float:
    """Seconds to write ``chunks`` as plain files; with ``fsync`` each file's fdatasync runs on a thread
    behind the next file's writes, as the tier's flushes do (`ChunkFileBatch`)."""
    def flush(fd: int) -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(1) as flusher:
        t = time.perf_counter()
        flushed = []
        for path, data in zip(paths, chunks):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for offset in range(0, len(data), WRITE_PIECE):   # the same syscall size the tier uses
                    os.write(fd, data[offset:offset + WRITE_PIECE])
            except BaseException:
                os.close(fd)
                raise
            if fsync:
                flushed.append(flusher.submit(flush, fd))
            else:
                os.close(fd)
        for f in flushed:
            f.result()
        return time.perf_counter() - t


def time_file_reads(paths: list[Path], out: memoryview) -> float:
    t = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            f.readinto(out)
    return time.perf_counter() - t


@dataclass(frozen=True, slots=True)
class DiskBenchSpec:
    shape: str
    chunk_tokens: int
    total_bytes: int
    reps: int
    directory: str | None            # where the chunk files and the raw files go (None: $TMPDIR)
    fsync: bool = False
    codec: str = "raw"               # a codec, sealed for a "+aes" variant
    o_direct: bool = False
    transfer_cfg: dict | None = None  # threads and link limits as the run is configured


def bench_disk(spec: DiskBenchSpec, progress=None) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=spec.directory))
    try:
        filled = filled_stack(spec.shape, spec.chunk_tokens, spec.total_bytes, "bench-disk", _sections(spec, root))
        try:
            cold = drop_page_cache()
            times = _DiskPasses(filled, root / "raw", spec.fsync).run(spec.reps, progress)
        finally:
            filled.stack.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _report(spec, filled, times, cold)


def _sections(spec: DiskBenchSpec, root: Path) -> dict[str, dict]:
    """The config under L1: the disk tier in ``root``, bounded by the disk rather than by its capacity."""
    return {
        "format": format_section(spec.codec),
        "transfer": spec.transfer_cfg or {},
        "disk": {"enabled": True, "path": str(root / "l2"), "capacity": 1 << 40, "fsync": spec.fsync,
                 "o_direct": spec.o_direct},
    }


@dataclass(slots=True)
class _Times:
    """Seconds of each pass, kept repetitions only, and whether each sample ran first in its pair."""
    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {"raw_write": [], "put": [], "raw_read": [], "get": []})
    first: dict[str, list[bool]] = field(
        default_factory=lambda: {"raw_write": [], "put": [], "raw_read": [], "get": []})

    def clear(self) -> None:
        for samples in (*self.seconds.values(), *self.first.values()):
            samples.clear()


class _DiskPasses:
    """The four timed passes over the same chunks: the tier's put and get, and raw writes and reads of the same
    bytes as plain files."""

    def __init__(self, filled: FilledStack, raw_dir: Path, fsync: bool) -> None:
        manager = filled.stack.scheduler.manager
        self.filled, self.fsync = filled, fsync
        self.disk = manager.lower[0]
        cpu = manager.l1
        slab = filled.stack.workers[0].stack.slab
        raw_dir.mkdir()
        self.raw_paths = [raw_dir / f"{i}.bin" for i in range(len(filled.keys))]
        self.src = [slab.memory(cpu.entries[k].slot) for k in filled.keys]
        self.sink = memoryview(torch.empty(filled.chunk_bytes, dtype=torch.uint8).fill_(0).numpy())
        self.times = _Times()

    def put(self) -> None:
        self.times.seconds["put"].append(self.filled.write_down())

    def raw_write(self) -> None:
        self.times.seconds["raw_write"].append(time_file_writes(self.raw_paths, self.src, self.fsync))

    def get(self) -> None:
        self.times.seconds["get"].append(self.filled.promote_back(before=drop_page_cache))

    def raw_read(self) -> None:
        drop_page_cache()
        self.times.seconds["raw_read"].append(time_file_reads(self.raw_paths, self.sink))

    def run(self, reps: int, progress=None) -> _Times:
        """Repetition -1 warms up and is not kept; an even count balances the orders."""
        for rep in range(-1, reps + reps % 2):
            self._repetition(raw_first=rep % 2 == 0)
            if rep < 0:
                self.times.clear()
            elif progress:
                progress()
        return self.times

    def _repetition(self, raw_first: bool) -> None:
        """Raw and tier passes swap order every repetition, so background writeback and discards from one pass
        weigh on both alike."""
        for step in ((self.raw_write, self.put) if raw_first else (self.put, self.raw_write)):
            os.sync()   # each write pass starts with no dirty pages from the previous one
            step()
        for step in ((self.raw_read, self.get) if raw_first else (self.get, self.raw_read)):
            step()
        for name in self.times.first:
            self.times.first[name].append(raw_first == name.startswith("raw"))
        stack, manager = self.filled.stack, self.filled.stack.scheduler.manager
        self.disk.delete(self.filled.keys)
        stack.run(manager.take_background())   # the ranks delete the files
        for p in self.raw_paths:
            p.unlink()


def _ratio(times: _Times, tier: str, raw: str) -> float:
    """Tier vs raw compared position by position (both first in their pair, both second), then the geometric
    mean: on a disk whose second of two back-to-back large writes runs slower than the first, whichever writer it
    is, the order would otherwise decide the ratio."""
    parts = []
    for pos in (True, False):
        t = [x for x, f in zip(times.seconds[tier], times.first[tier]) if f == pos]
        r = [x for x, f in zip(times.seconds[raw], times.first[raw]) if f == pos]
        if t and r:
            parts.append(statistics.median(r) / statistics.median(t))
    return statistics.geometric_mean(parts)


def _report(spec: DiskBenchSpec, filled: FilledStack, times: _Times, cold: bool) -> dict[str, object]:
    num_chunks, samples = len(filled.keys), times.seconds

    def gbps(name: str) -> float:
        return round(filled.nbytes / statistics.median(samples[name]) / 1e9, 3)

    def tokens_per_s(name: str) -> int:
        return round(num_chunks * spec.chunk_tokens / statistics.median(samples[name]))

    return {
        "shape": spec.shape, "chunk_tokens": spec.chunk_tokens, "chunk_bytes": filled.chunk_bytes,
        "chunks": num_chunks, "bytes": filled.nbytes, "reps": spec.reps, "fsync": spec.fsync, "codec": spec.codec,
        "o_direct": spec.o_direct,
        "reads": "cold (page cache dropped)" if cold else "page cache (dropping it is not permitted here)",
        "put_gbps": gbps("put"), "get_gbps": gbps("get"),
        "put_tokens_per_s": tokens_per_s("put"), "get_tokens_per_s": tokens_per_s("get"),
        "raw_write_gbps": gbps("raw_write"), "raw_read_gbps": gbps("raw_read"),
        "put_ratio": round(_ratio(times, "put", "raw_write"), 3),
        "get_ratio": round(_ratio(times, "get", "raw_read"), 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in samples.items()},
    }
