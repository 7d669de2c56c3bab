"""L2 with O_DIRECT: same files, same verification, page cache bypassed."""
import os

import pytest

from tests.support.disk_chunks import FILE, NS, RAW, data, key, meta
from tiercache.errors import ChecksumMismatchError
from tiercache.tiers.disk import DiskTransport
from tiercache.wire.chunk_format import HEADER_BYTES


@pytest.fixture
def direct_tier(tmp_path):
    try:
        return DiskTransport(tmp_path, NS, o_direct=True)
    except OSError as err:
        pytest.skip(f"O_DIRECT is not supported on {tmp_path}: {err}")


def test_direct_round_trip_has_the_exact_file_size(direct_tier):
    for i in (1, 2):
        direct_tier.write_chunk(meta(i), data(i))
    assert os.path.getsize(direct_tier.path(key(1))) == FILE      # padding truncated away
    out = bytearray(RAW)
    assert direct_tier.read_chunk_into(key(2), memoryview(out)) == RAW and bytes(out) == data(2)


def test_direct_and_buffered_tiers_read_each_others_files(direct_tier, tmp_path):
    direct_tier.write_chunk(meta(1), data(1))
    buffered = DiskTransport(tmp_path, NS)
    out = bytearray(RAW)
    buffered.read_chunk_into(key(1), memoryview(out))
    assert bytes(out) == data(1)
    buffered.write_chunk(meta(2), data(2))
    again = DiskTransport(tmp_path, NS, o_direct=True)
    again.read_chunk_into(key(2), memoryview(out))
    assert bytes(out) == data(2)


def test_direct_reads_verify_checksums(direct_tier):
    direct_tier.write_chunk(meta(1), data(1))
    with open(direct_tier.path(key(1)), "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        b = f.read(1)
        f.seek(HEADER_BYTES + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError):
        direct_tier.read_chunk_into(key(1), memoryview(bytearray(RAW)))


def test_o_direct_refused_by_the_file_system_is_a_config_error(tmp_path, monkeypatch):
    """Fault injected at open(2): a file system without O_DIRECT stops the tier at start, naming the field."""
    import errno

    from tests.conftest import Stack
    from tiercache.errors import ConfigError

    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(OSError, match="O_DIRECT"):
        DiskTransport(tmp_path, NS, o_direct=True)
    with pytest.raises(ConfigError, match="disk.o_direct"):
        Stack(disk={"enabled": True, "path": str(tmp_path), "o_direct": True})
