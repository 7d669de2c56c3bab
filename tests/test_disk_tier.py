"""L2 on real files: crash-safe writes, restart, capacity, corruption, full disks and killed writers."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tiercache.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta
from tiercache.errors import ChecksumMismatchError, ChunkFormatError
from tiercache.keys import BlockHash
from tiercache.tiers.disk import DiskTier

NS = b"n" * 16
SHAPE = (2, 2, 4, 4, 2, 8)        # a chunk of 4 blocks × 4 tokens, float16
RAW = 2 * 2 * 4 * 4 * 2 * 8 * 2
FILE = HEADER_BYTES + RAW


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def meta(i: int, ns: bytes = NS) -> ChunkMeta:
    return ChunkMeta(ns, key(i), 16, "float16", SHAPE)


def data(i: int) -> bytes:
    return np.random.default_rng(i).standard_normal(RAW // 2).astype(np.float16).tobytes()


def store(tier: DiskTier, ids) -> None:
    keys = [key(i) for i in ids]
    assert all(tier.prepare_store(keys, [tier.reserve_bytes(RAW)] * len(keys)))
    for i in ids:
        tier.write_chunk(meta(i), data(i))
    tier.complete_store(keys)


def read(tier: DiskTier, i: int) -> bytes:
    out = bytearray(RAW)
    n = tier.read_chunk_into(key(i), memoryview(out))
    return bytes(out[:n])


def test_round_trip_and_invisible_until_complete(tmp_path):
    tier = DiskTier(tmp_path, 10 * FILE, NS)
    assert tier.prepare_store([key(1)], [FILE]) == [True]
    tier.write_chunk(meta(1), data(1))
    assert tier.contains([key(1)]) == 0            # written but not yet published
    tier.complete_store([key(1)])
    assert tier.contains([key(1)]) == 1 and read(tier, 1) == data(1)
    assert tier.used_bytes == FILE == os.path.getsize(tier.path(key(1)))


@pytest.mark.parametrize("codec", ["raw", "lz4", "lz4-shuffle"])
def test_every_codec_reads_back(tmp_path, codec):
    tier = DiskTier(tmp_path, 10 * tier_size(codec), NS, ChunkFormat(codec))
    store(tier, [1, 2])
    assert read(tier, 1) == data(1) and read(tier, 2) == data(2)


def tier_size(codec):
    return HEADER_BYTES + ChunkFormat(codec).codec.max_encoded_len(RAW)


def test_index_survives_a_restart_and_other_namespaces_are_left_alone(tmp_path):
    store(DiskTier(tmp_path, 10 * FILE, NS), [1, 2, 3])
    other = DiskTier(tmp_path, 10 * FILE, b"o" * 16)
    other.prepare_store([key(9)], [FILE])
    other.write_chunk(meta(9, b"o" * 16), data(9))
    other.complete_store([key(9)])

    again = DiskTier(tmp_path, 10 * FILE, NS)
    assert again.contains([key(1), key(2), key(3)]) == 3 and again.used_bytes == 3 * FILE
    assert again.contains([key(9)]) == 0
    assert DiskTier(tmp_path, 10 * FILE, b"o" * 16).contains([key(9)]) == 1
    assert read(again, 2) == data(2)


def test_capacity_counts_headers_and_evicts_lru(tmp_path):
    tier = DiskTier(tmp_path, 3 * FILE + 10, NS)
    store(tier, [1, 2, 3])                         # one chain, published tail first: 3 is the oldest
    store(tier, [4])
    assert tier.used_bytes <= tier.capacity_bytes
    assert [tier.contains([key(i)]) for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert not tier.path(key(3)).exists()
    tier.prepare_load([key(2)])
    tier.complete_load([key(2)])                  # 2 is now the most recently used: 1 goes next
    store(tier, [5])
    assert [tier.contains([key(i)]) for i in (1, 2, 4, 5)] == [0, 1, 1, 1]
    # A restart with a smaller capacity trims to fit.
    smaller = DiskTier(tmp_path, 2 * FILE, NS)
    assert smaller.num_chunks == 2 and smaller.used_bytes <= 2 * FILE


def test_restart_deletes_temp_truncated_and_foreign_files(tmp_path):
    tier = DiskTier(tmp_path, 10 * FILE, NS)
    store(tier, [1, 2, 3])
    p1, p2 = tier.path(key(1)), tier.path(key(2))
    with open(p1, "r+b") as f:
        f.truncate(FILE - 7)                       # torn write
    p2.write_bytes(b"garbage" * 10)                # not a chunk at all
    (p1.parent / "deadbeef.chunk.tmp").write_bytes(b"partial")
    wrong = tier.path(key(7))                      # right format, but holds key 3's chunk
    wrong.parent.mkdir(exist_ok=True)
    wrong.write_bytes(tier.path(key(3)).read_bytes())

    again = DiskTier(tmp_path, 10 * FILE, NS)
    assert again.contains([key(3)]) == 1
    assert again.num_chunks == 1 and again.counters.integrity_failures == 3
    assert not p1.exists() and not p2.exists() and not wrong.exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_corrupt_payload_is_detected_on_read_and_deleted(tmp_path):
    tier = DiskTier(tmp_path, 10 * FILE, NS)
    store(tier, [1])
    with open(tier.path(key(1)), "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    tier.prepare_load([key(1)])
    with pytest.raises(ChecksumMismatchError):
        read(tier, 1)
    tier.complete_load([key(1)], failed=[key(1)])
    assert tier.contains([key(1)]) == 0 and not tier.path(key(1)).exists()
    assert tier.counters.integrity_failures == 1


def test_injected_enospc_and_eacces_fail_the_write_cleanly(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 10 * FILE, NS)
    tier.prepare_store([key(1), key(2)], [FILE, FILE])

    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError) as err:
        tier.write_chunk(meta(1), data(1))
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PermissionError):
        tier.write_chunk(meta(2), data(2))
    monkeypatch.undo()
    tier.complete_store([key(1), key(2)], failed=[key(1), key(2)])
    assert tier.num_chunks == 0 and tier.used_bytes == 0 and not list(tmp_path.rglob("*.tmp"))


def test_a_real_full_filesystem(tmp_path):
    """A 64 KiB tmpfs: writes past its end fail with ENOSPC, leave no partial file, and the tier goes on."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        tier = DiskTier(mnt, 1 << 30, NS)        # configured far larger than the device
        written = failed = 0
        for i in range(100):
            assert tier.prepare_store([key(i)], [FILE]) == [True]
            try:
                tier.write_chunk(meta(i), data(i))
                tier.complete_store([key(i)])
                written += 1
            except OSError as err:
                assert err.errno == errno.ENOSPC
                tier.complete_store([key(i)], failed=[key(i)])
                failed += 1
        assert written > 0 and failed > 0
        assert not list(mnt.rglob("*.tmp"))
        again = DiskTier(mnt, 1 << 30, NS)
        assert again.num_chunks == written and all(read(again, i) == data(i) for i in range(written))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


BIG_SHAPE = (32, 2, 16, 16, 8, 8)   # 4 MiB of float16: each write takes milliseconds


def big(i: int) -> bytes:
    return np.full(int(np.prod(BIG_SHAPE)), i % 251, dtype=np.float16).tobytes()


def test_a_writer_killed_mid_write_never_leaves_a_servable_corrupt_chunk(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_disk_tier import key, big, BIG_SHAPE
        from tiercache.chunk_format import ChunkMeta
        from tiercache.tiers.disk import DiskTier
        tier = DiskTier({str(tmp_path)!r}, 1 << 34, {NS!r})
        i = 0
        while True:
            tier.prepare_store([key(i)], [tier.reserve_bytes(len(big(i)))])
            tier.write_chunk(ChunkMeta({NS!r}, key(i), 256, "float16", BIG_SHAPE), big(i))
            tier.complete_store([key(i)])
            i += 1
            if i == 5:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = DiskTier(tmp_path, 1 << 34, NS)
    assert tier.num_chunks >= 5
    out = bytearray(len(big(0)))
    for k in list(tier.entries):
        n = tier.read_chunk_into(k, memoryview(out))  # every indexed chunk verifies...
        assert bytes(out[:n]) == big(int.from_bytes(k, "big"))   # ...and holds what was written
    assert not list(tmp_path.rglob("*.tmp"))


def test_wrong_namespace_or_key_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 10 * FILE, NS)
    store(tier, [1])
    os.rename(tier.path(key(1)), tier.path(key(2)).parent / (key(2).hex() + ".chunk"))
    tier.entries[key(2)] = tier.entries.pop(key(1))
    with pytest.raises(ChunkFormatError):
        read(tier, 2)
