"""`tiercache bench tiers --tiers disk`: L2 put/get beside raw file I/O of the same bytes, in one run.

*put* writes L1's chunks down through the tier (encode, header + payload in one
``writev``, temp file + rename, optional ``fdatasync`` behind the next write);
*get* promotes them back into L1 slots (read, verify the checksum, place). The
raw baseline writes and reads the same chunk bytes as plain files (``write`` /
``readinto``, and ``fdatasync`` behind the writes when the tier uses it). Reads
are measured cold — the page cache is dropped before each read pass — when the
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
from pathlib import Path

import torch

from tiercache.bench.filled import filled_stack
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


def bench_disk(shape: str, chunk_tokens: int, total_bytes: int, reps: int, directory: str | None,
               fsync: bool = False, codec: str = "raw", o_direct: bool = False, progress=None,
               transfer_cfg: dict | None = None) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=directory))
    try:
        filled = filled_stack(
            shape,
            chunk_tokens,
            total_bytes,
            "bench-disk",
            {
                "format": format_section(codec),     # a codec, sealed for a "+aes" variant
                "transfer": transfer_cfg or {},  # threads and link limits as the run is configured
                "disk": {
                    "enabled": True,
                    "path": str(root / "l2"),
                    "capacity": 1 << 40,  # the disk, not the tier, is the bound
                    "fsync": fsync,
                    "o_direct": o_direct,
                },
            },
        )
        stack, keys = filled.stack, filled.keys
        chunk_bytes, nbytes, num_chunks = filled.chunk_bytes, filled.nbytes, len(filled.keys)
        manager = stack.scheduler.manager
        cpu, disk = manager.l1, manager.lower[0]
        slab = stack.workers[0].stack.slab
        raw_dir = root / "raw"
        raw_dir.mkdir()
        raw_paths = [raw_dir / f"{i}.bin" for i in range(num_chunks)]
        src = [slab.memory(cpu.entries[k].slot) for k in keys]
        sink = memoryview(torch.empty(chunk_bytes, dtype=torch.uint8).fill_(0).numpy())
        cold = drop_page_cache()
        times: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
        first: dict[str, list[bool]] = {k: [] for k in times}   # did the sample run first in its pair?
        try:
            for rep in range(-1, reps + reps % 2):   # rep -1 warms up, unkept; an even count balances orders
                # Raw and tier passes swap order every repetition, so background writeback and
                # discards from one pass weigh on both alike.
                def put() -> None:
                    times["put"].append(filled.write_down())

                def raw_write() -> None:
                    times["raw_write"].append(time_file_writes(raw_paths, src, fsync))

                def get() -> None:
                    times["get"].append(filled.promote_back(before=drop_page_cache))

                def raw_read() -> None:
                    drop_page_cache()
                    times["raw_read"].append(time_file_reads(raw_paths, sink))

                raw_first = rep % 2 == 0
                for step in ((raw_write, put) if raw_first else (put, raw_write)):
                    os.sync()   # each write pass starts with no dirty pages from the previous one
                    step()
                for step in ((raw_read, get) if raw_first else (get, raw_read)):
                    step()
                for name in times:
                    first[name].append(raw_first == name.startswith("raw"))
                disk.delete(keys)
                stack.run(manager.take_background())   # the ranks delete the files
                for p in raw_paths:
                    p.unlink()
                if rep < 0:
                    for name in times:
                        times[name].clear()
                        first[name].clear()
                elif progress:
                    progress()
        finally:
            stack.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    def ratio(tier: str, raw: str) -> float:
        """Tier vs raw compared position by position (both first in their pair, both second), then
        the geometric mean: on this disk the second of two back-to-back 512 MiB writes runs several
        times slower than the first, whichever writer it is."""
        parts = []
        for pos in (True, False):
            t = [x for x, f in zip(times[tier], first[tier]) if f == pos]
            r = [x for x, f in zip(times[raw], first[raw]) if f == pos]
            if t and r:
                parts.append(statistics.median(r) / statistics.median(t))
        return statistics.geometric_mean(parts)

    put, get, rw, rr = gbps("put"), gbps("get"), gbps("raw_write"), gbps("raw_read")
    return {
        "shape": shape, "chunk_tokens": chunk_tokens, "chunk_bytes": chunk_bytes, "chunks": num_chunks,
        "bytes": nbytes, "reps": reps, "fsync": fsync, "codec": codec, "o_direct": o_direct,
        "reads": "cold (page cache dropped)" if cold else "page cache (dropping it is not permitted here)",
        "put_gbps": round(put, 3), "get_gbps": round(get, 3),
        "put_tokens_per_s": round(num_chunks * chunk_tokens / statistics.median(times["put"])),
        "get_tokens_per_s": round(num_chunks * chunk_tokens / statistics.median(times["get"])),
        "raw_write_gbps": round(rw, 3), "raw_read_gbps": round(rr, 3),
        "put_ratio": round(ratio("put", "raw_write"), 3), "get_ratio": round(ratio("get", "raw_read"), 3),
        "samples_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
