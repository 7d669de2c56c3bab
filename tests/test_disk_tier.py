"""L2 on real files: the scheduler's `DiskIndex` over ranks' `DiskTransport`s — crash-safe writes, restart,
capacity, corruption, full disks, killed writers and chunks that only some ranks hold."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.support.disk_chunks import FILE, NS, RAW, data, key, meta  # noqa: E402
from tiercache.contracts.plan import Failure
from tiercache.errors import ChecksumMismatchError, ChunkFormatError
from tiercache.tiers.disk import DiskIndex, DiskTransport
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat


class Disk:
    """One rank's files and the scheduler's index over them, with the delete step between them made explicit."""

    def __init__(self, root, capacity: int, ns: bytes = NS, fmt: ChunkFormat | None = None) -> None:
        self.files = DiskTransport(root, ns, fmt)
        self.index = DiskIndex(capacity, fmt)
        self.index.rebuild([self.files.scan()])
        self.settle()

    def settle(self) -> None:
        """Run the deletes the index asked for (what the workers do with a delete plan)."""
        self.files.delete_chunks(self.index.take_deletes())

    def store(self, ids) -> None:
        keys = [key(i) for i in ids]
        assert all(self.index.prepare_store(keys, [self.index.reserve_bytes(meta(0).layout)] * len(keys)))
        self.settle()
        assert self.files.write_chunks([(meta(i, self.files.storage), data(i)) for i in ids]) == ()
        self.index.complete_store(keys)

    def read(self, i: int) -> bytes:
        out = bytearray(RAW)
        n = self.files.read_chunk_into(key(i), memoryview(out))
        return bytes(out[:n])


def test_round_trip_and_invisible_until_complete(tmp_path):
    d = Disk(tmp_path, 10 * FILE)
    assert d.index.prepare_store([key(1)], [FILE]) == [True]
    d.files.write_chunk(meta(1), data(1))
    assert d.index.contains([key(1)]) == 0            # written but not yet published
    d.index.complete_store([key(1)])
    assert d.index.contains([key(1)]) == 1 and d.read(1) == data(1)
    assert d.index.used_bytes == FILE == os.path.getsize(d.files.path(key(1)))


@pytest.mark.parametrize("codec", ["raw", "lz4", "lz4-shuffle"])
def test_every_codec_reads_back(tmp_path, codec):
    d = Disk(tmp_path, 10 * tier_size(codec), fmt=ChunkFormat(codec))
    d.store([1, 2])
    assert d.read(1) == data(1) and d.read(2) == data(2)


@pytest.mark.parametrize("codec", ["int8", "fp8-e4m3"])
def test_a_quantized_chunk_reads_back_close_and_its_file_holds_a_byte_per_value(tmp_path, codec):
    d = Disk(tmp_path, 10 * tier_size(codec), fmt=ChunkFormat(codec))
    d.store([1])
    got = np.frombuffer(d.read(1), np.float16).astype(np.float32)
    want = np.frombuffer(data(1), np.float16).astype(np.float32)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    values = RAW // 2
    assert os.path.getsize(d.files.path(key(1))) == tier_size(codec) == HEADER_BYTES + values + values // 16 * 2


def tier_size(codec):
    return ChunkFormat(codec).max_stored_len(meta(0).layout)


def test_index_survives_a_restart_and_other_namespaces_are_left_alone(tmp_path):
    Disk(tmp_path, 10 * FILE).store([1, 2, 3])
    Disk(tmp_path, 10 * FILE, ns=b"o" * 16).store([9])

    again = Disk(tmp_path, 10 * FILE)
    assert again.index.contains([key(1), key(2), key(3)]) == 3 and again.index.used_bytes == 3 * FILE
    assert again.index.contains([key(9)]) == 0
    assert Disk(tmp_path, 10 * FILE, ns=b"o" * 16).index.contains([key(9)]) == 1
    assert again.read(2) == data(2)


def test_capacity_counts_headers_and_evicts_lru(tmp_path):
    d = Disk(tmp_path, 3 * FILE + 10)
    d.store([1, 2, 3])                             # one chain, published tail first: 3 is the oldest
    d.store([4])
    assert d.index.used_bytes <= d.index.capacity_bytes
    assert [d.index.contains([key(i)]) for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert not d.files.path(key(3)).exists()       # the evicted chunk's file went with the delete step
    d.index.prepare_load([key(2)])
    d.index.complete_load([key(2)])                # 2 is now the most recently used: 1 goes next
    d.store([5])
    assert [d.index.contains([key(i)]) for i in (1, 2, 4, 5)] == [0, 1, 1, 1]
    # A restart with a smaller capacity trims to fit, and deletes what it trimmed.
    smaller = Disk(tmp_path, 2 * FILE)
    assert smaller.index.num_chunks == 2 and smaller.index.used_bytes <= 2 * FILE
    assert len(list(tmp_path.rglob("*.chunk"))) == 2


def test_restart_deletes_temp_truncated_and_foreign_files(tmp_path):
    d = Disk(tmp_path, 10 * FILE)
    d.store([1, 2, 3])
    p1, p2 = d.files.path(key(1)), d.files.path(key(2))
    with open(p1, "r+b") as f:
        f.truncate(FILE - 7)                       # torn write
    p2.write_bytes(b"garbage" * 10)                # not a chunk at all
    (p1.parent / "deadbeef.chunk.tmp").write_bytes(b"partial")
    wrong = d.files.path(key(7))                   # right format, but holds key 3's chunk
    wrong.parent.mkdir(exist_ok=True)
    wrong.write_bytes(d.files.path(key(3)).read_bytes())

    scan = DiskTransport(tmp_path, NS).scan()
    assert [c.key for c in scan.found] == [key(3)] and scan.bad == 3 and scan.temp == 1
    assert not p1.exists() and not p2.exists() and not wrong.exists()
    assert not list(tmp_path.rglob("*.tmp"))
    again = DiskIndex(10 * FILE)
    again.rebuild([scan])
    assert again.contains([key(3)]) == 1 and again.num_chunks == 1 and again.counters.integrity_failures == 3
    assert again.counters.temp_removed == 1


def test_a_chunk_only_some_ranks_hold_is_dropped_and_deleted_on_the_others(tmp_path):
    """Rank 1 died before writing chunk 2: at the next start only chunks every rank holds count, and rank 0's
    copy of chunk 2 goes (a scheduler reading it would fail on rank 1 every time)."""
    ranks = [Disk(tmp_path, 10 * FILE, ns=bytes([r]) * 16) for r in (0, 1)]
    for d in ranks:
        d.store([1])
    ranks[0].store([2])
    index = DiskIndex(10 * FILE)
    assert index.rebuild([d.files.scan() for d in ranks]) == 1
    assert index.contains([key(1)]) == 1 and index.contains([key(2)]) == 0
    assert index.take_deletes() == [key(2)]


def test_corrupt_payload_is_detected_on_read_and_deleted(tmp_path):
    d = Disk(tmp_path, 10 * FILE)
    d.store([1])
    with open(d.files.path(key(1)), "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    d.index.prepare_load([key(1)])
    with pytest.raises(ChecksumMismatchError):
        d.read(1)
    assert d.files.read_chunks_into([(key(1), memoryview(bytearray(RAW)))]) == [Failure.CORRUPT]
    d.index.complete_load([key(1)], failed={key(1): Failure.CORRUPT})
    assert d.index.contains([key(1)]) == 0 and d.index.counters.integrity_failures == 1
    d.settle()
    assert not d.files.path(key(1)).exists()


def test_injected_enospc_and_eacces_fail_the_write_cleanly(tmp_path, monkeypatch):
    d = Disk(tmp_path, 10 * FILE)
    d.index.prepare_store([key(1), key(2)], [FILE, FILE])

    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    assert d.files.write_chunks([(meta(1), data(1))]) == ((key(1), Failure.IO),)
    monkeypatch.undo()

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    assert d.files.write_chunks([(meta(2), data(2))]) == ((key(2), Failure.IO),)
    monkeypatch.undo()
    d.index.complete_store([key(1), key(2)], failed={key(1): Failure.IO, key(2): Failure.IO})
    assert d.index.num_chunks == 0 and d.index.used_bytes == 0 and not list(tmp_path.rglob("*.tmp"))


def test_durable_writes_flush_behind_the_next_write_and_a_failed_flush_fails_its_chunk_alone(tmp_path, monkeypatch):
    """With ``fsync`` each file is flushed on the tier's flusher thread while the next one is written (the
    first flush waits until the second file is being written), renamed into place only after its own flush,
    and a flush that fails (EIO) fails that chunk alone: its temp file is deleted, the rest of the batch
    (more files than wait for a flush at once) reads back whole."""
    import threading

    files = DiskTransport(tmp_path, NS, fsync=True)
    ids = list(range(12))
    temp = {str(files.path(key(i))) + ".tmp": i for i in ids}
    real_fdatasync, flushes, overlapped = os.fdatasync, [], []

    def fdatasync(fd):
        i = temp[os.readlink(f"/proc/self/fd/{fd}")]
        flushes.append((i, threading.current_thread().name, files.path(key(i)).exists()))
        if i == 0:                                      # the next file is written while this one flushes
            second = str(files.path(key(1))) + ".tmp"
            deadline = time.monotonic() + 10
            while not os.path.exists(second) and time.monotonic() < deadline:
                time.sleep(0.005)
            overlapped.append(os.path.exists(second))
        if i == 3:
            raise OSError(errno.EIO, "Input/output error")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    failed = files.write_chunks([(meta(i), data(i)) for i in ids])
    monkeypatch.undo()
    files.close()
    assert overlapped == [True]
    assert [i for i, _, _ in flushes] == ids
    assert all(name.startswith("tiercache-flush-") and not visible for _, name, visible in flushes)
    assert failed == ((key(3), Failure.IO),)
    assert not files.path(key(3)).exists() and not list(tmp_path.rglob("*.tmp"))
    for i in ids[:3] + ids[4:]:
        out = bytearray(RAW)
        assert files.read_chunk_into(key(i), memoryview(out)) == RAW and bytes(out) == data(i)


def test_a_real_full_filesystem(tmp_path, caplog):
    """A 64 KiB tmpfs: writes past its end fail with ENOSPC, leave no partial file, and the tier goes on; the
    failures are logged once (rate-limited), not once per chunk."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        d = Disk(mnt, 1 << 30)        # configured far larger than the device
        written = failed = 0
        for i in range(100):
            assert d.index.prepare_store([key(i)], [FILE]) == [True]
            bad = dict(d.files.write_chunks([(meta(i), data(i))]))
            d.index.complete_store([key(i)], bad)
            d.settle()
            if bad:
                assert bad == {key(i): Failure.IO}
                failed += 1
            else:
                written += 1
        assert written > 0 and failed > 1
        assert len([r for r in caplog.records if "writing chunk" in r.getMessage()]) == 1
        assert not list(mnt.rglob("*.tmp"))
        again = Disk(mnt, 1 << 30)
        assert again.index.num_chunks == written and all(again.read(i) == data(i) for i in range(written))
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
        from tiercache.wire.chunk_format import ChunkMeta
        from tiercache.tiers.disk import DiskTransport
        files = DiskTransport({str(tmp_path)!r}, {NS!r})
        i = 0
        while True:
            files.write_chunk(ChunkMeta({NS!r}, key(i), 256, "float16", BIG_SHAPE), big(i))
            i += 1
            if i == 5:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    files = DiskTransport(tmp_path, NS)
    scan = files.scan()
    assert len(scan.found) >= 5
    out = bytearray(len(big(0)))
    for chunk in scan.found:
        n = files.read_chunk_into(chunk.key, memoryview(out))  # every chunk found verifies...
        assert bytes(out[:n]) == big(int.from_bytes(chunk.key, "big"))   # ...and holds what was written
    assert not list(tmp_path.rglob("*.tmp"))


def test_wrong_namespace_or_key_is_refused(tmp_path):
    d = Disk(tmp_path, 10 * FILE)
    d.store([1])
    d.files.path(key(2)).parent.mkdir(parents=True, exist_ok=True)
    os.rename(d.files.path(key(1)), d.files.path(key(2)))
    with pytest.raises(ChunkFormatError):
        d.read(2)
    foreign = DiskTransport(tmp_path, b"o" * 16)
    foreign.path(key(2)).parent.mkdir(parents=True, exist_ok=True)
    os.rename(d.files.path(key(2)), foreign.path(key(2)))
    assert foreign.read_chunks_into([(key(2), memoryview(bytearray(RAW)))]) == [Failure.CORRUPT]
