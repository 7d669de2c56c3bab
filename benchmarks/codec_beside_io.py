"""INT8 encode rate alone and beside a thread writing files, with torch's thread team and kept to one core.

    python benchmarks/codec_beside_io.py [--chunks 8] [--repeats 5]

Why `tiercache.wire.codec_pipeline.CodecThreads` keep their torch ops to one core: a transport's codec
work runs while its I/O does (writes into the page cache or a tmpfs, socket sends: kernel copies on a
core of their own). Encodes run on a thread, as the codec threads do, over 32 MiB chunks of llama-8b KV
(bf16); the writer thread writes 16 MiB files to $TMPDIR (``/dev/shm`` when there) in 4 MiB calls, as the
disk tier does. Medians of ``--repeats``, each over ``--chunks`` chunks; the four cases take turns. Then
the same chunks through `CodecThreads` of one and of two threads, as a writer asks for them (one chunk in
flight per thread): how much a second one-core codec thread adds on this machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tiercache.contracts.layout import ChunkLayout
from tiercache.kv_quant import Int8Codec
from tiercache.machine import keep_torch_to_one_core

LAYOUT = ChunkLayout("bfloat16", (32, 2, 16, 16, 8, 128))


class Writer:
    """A thread writing 16 MiB files in 4 MiB calls until stopped."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        data = memoryview(bytearray(16 << 20))
        i = 0
        while not self._stop.is_set():
            fd = os.open(self.dir / f"w{i % 4}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for off in range(0, len(data), 4 << 20):
                    os.write(fd, data[off:off + (4 << 20)])
            finally:
                os.close(fd)
            i += 1

    def __enter__(self) -> "Writer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    codec = Int8Codec()
    chunks = [memoryview(torch.randn(LAYOUT.numel).to(torch.bfloat16).view(torch.uint8).numpy())
              for _ in range(args.chunks)]
    pools = {"torch's team": ThreadPoolExecutor(1),
             "one core": ThreadPoolExecutor(1, initializer=keep_torch_to_one_core)}

    def rate(pool: ThreadPoolExecutor) -> float:
        def encode_all() -> float:
            t = time.perf_counter()
            for raw in chunks:
                codec.encode(raw, LAYOUT)
            return len(chunks) * LAYOUT.raw_len / (time.perf_counter() - t) / 1e9
        return pool.submit(encode_all).result()

    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    samples: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for pool in pools.values():
            rate(pool)                                       # warm-up: scratch and payload buffers
        for _ in range(args.repeats):
            for name, pool in pools.items():
                samples.setdefault((name, False), []).append(rate(pool))
                with Writer(Path(tmp)):
                    samples.setdefault((name, True), []).append(rate(pool))
    print(f"torch threads: {torch.get_num_threads()}, cores: {os.cpu_count()}, writer into {root}")
    print("| encode thread | alone GB/s | beside a file writer GB/s |")
    print("| --- | ---: | ---: |")
    for name in pools:
        print(f"| {name} | {statistics.median(samples[(name, False)]):.2f} | "
              f"{statistics.median(samples[(name, True)]):.2f} |")
    for pool in pools.values():
        pool.shutdown()
    together: dict[int, list[float]] = {}
    for _ in range(args.repeats):
        for n in (1, 2):
            together.setdefault(n, []).append(through_codec_threads(codec, chunks, n))
    print("| one-core codec threads | encode GB/s together |")
    print("| ---: | ---: |")
    for n, rates in together.items():
        print(f"| {n} | {statistics.median(rates):.2f} |")


def through_codec_threads(codec: Int8Codec, chunks: list[memoryview], threads: int) -> float:
    """GB/s of raw chunks encoded by `CodecThreads(threads)`, one chunk in flight per thread, each payload
    dropped once done (as a writer does once it has sent it)."""
    from collections import deque

    from tiercache.wire.codec_pipeline import CodecThreads

    pool = CodecThreads(threads)
    try:
        for raw in chunks[:threads]:
            pool.submit(codec.encode, raw, LAYOUT).result()          # warm-up: this thread's scratch
        t = time.perf_counter()
        running: deque = deque()
        for raw in chunks:
            running.append(pool.submit(lambda raw=raw: len(codec.encode(raw, LAYOUT))))
            if len(running) >= threads:
                running.popleft().result()
        while running:
            running.popleft().result()
        return len(chunks) * LAYOUT.raw_len / (time.perf_counter() - t) / 1e9
    finally:
        pool.close()


if __name__ == "__main__":
    main()
