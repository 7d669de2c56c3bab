"""Stored chunk format: round trips per codec, and every corruption is a typed error."""
import numpy as np
import pytest

from tiercache.codecs import checksums, codecs
from tiercache.errors import (
    ChecksumMismatchError,
    ChunkFormatError,
    CodecError,
    CorruptHeaderError,
    KeyMismatchError,
    NamespaceMismatchError,
    TruncatedChunkError,
)
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta, decode

NS = b"N" * 16
KEY = b"K" * 32


def meta(dtype="bfloat16", shape=(2, 2, 4, 16, 1, 16)):
    return ChunkMeta(NS, KEY, 64, dtype, shape)


def payload(m: ChunkMeta) -> bytes:
    rng = np.random.default_rng(0)
    return rng.standard_normal(m.raw_len // 2).astype(np.float16).tobytes()


@pytest.mark.parametrize("codec", [n for n in codecs.names() if not codecs.get(n).lossy])
@pytest.mark.parametrize("checksum", checksums.names())
def test_round_trip(codec, checksum):
    m = meta()
    raw = payload(m)
    blob = ChunkFormat(codec, checksum).encode(m, raw)
    got = decode(blob, NS, KEY)
    assert bytes(got.data) == raw
    assert got.meta == m


def test_shuffle_helps_on_low_entropy_16_bit_data():
    m = meta()
    raw = np.repeat(np.float16([0.5, -0.25, 1.0, 2.0]), m.raw_len // 8).tobytes()
    assert len(ChunkFormat("lz4-shuffle").encode(m, raw)) < len(raw) // 4


def test_wrong_length_data_is_refused_at_encode():
    with pytest.raises(ValueError, match="bytes"):
        ChunkFormat().encode(meta(), b"x" * 10)


@pytest.fixture(params=codecs.names())
def blob(request):
    m = meta()
    return bytearray(ChunkFormat(request.param).encode(m, payload(m)))


def test_corrupt_header_byte(blob):
    blob[10] ^= 0xFF
    with pytest.raises(CorruptHeaderError):
        decode(blob, NS, KEY)


def test_bad_magic_with_a_valid_header_crc():
    import struct
    import zlib
    m = meta()
    blob = bytearray(ChunkFormat().encode(m, payload(m)))
    blob[:4] = b"NOPE"
    struct.pack_into("<I", blob, HEADER_BYTES - 4, zlib.crc32(bytes(blob[:HEADER_BYTES - 4])))
    with pytest.raises(CorruptHeaderError, match="magic"):
        decode(blob, NS, KEY)


def test_foreign_namespace(blob):
    with pytest.raises(NamespaceMismatchError):
        decode(blob, b"O" * 16, KEY)


def test_wrong_key(blob):
    with pytest.raises(KeyMismatchError):
        decode(blob, NS, b"X" * 32)


def test_truncated_payload(blob):
    with pytest.raises(TruncatedChunkError):
        decode(blob[:-1], NS, KEY)


def test_truncated_header(blob):
    with pytest.raises(TruncatedChunkError):
        decode(blob[: HEADER_BYTES - 1], NS, KEY)


def test_extra_trailing_bytes(blob):
    with pytest.raises(TruncatedChunkError):
        decode(blob + b"\0", NS, KEY)


def test_payload_bit_flip(blob):
    blob[HEADER_BYTES + 5] ^= 0x01
    with pytest.raises(ChecksumMismatchError):
        decode(blob, NS, KEY)


def test_lz4_garbage_with_matching_checksums_is_a_codec_error():
    """A payload that passes every checksum but does not decompress is still refused."""
    import zlib

    import xxhash

    from tiercache.wire.chunk_format import _BODY, _CRC
    m = meta()
    blob = bytearray(ChunkFormat("lz4").encode(m, payload(m)))
    garbage = b"\xff" * (len(blob) - HEADER_BYTES)
    fields = list(_BODY.unpack(bytes(blob[:_BODY.size])))
    fields[14] = xxhash.xxh3_64_intdigest(garbage)   # payload checksum of the garbage
    body = _BODY.pack(*fields)
    forged = body + _CRC.pack(zlib.crc32(body)) + garbage
    with pytest.raises(CodecError):
        decode(forged, NS, KEY)


def test_every_failure_is_a_chunk_format_error():
    for cls in (CorruptHeaderError, NamespaceMismatchError, KeyMismatchError, TruncatedChunkError,
                ChecksumMismatchError, CodecError):
        assert issubclass(cls, ChunkFormatError)


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="cannot be stored"):
        ChunkMeta(NS, KEY, 1, "complex64", (1,))


def test_every_checksum_fed_piece_by_piece_equals_the_one_pass_value():
    import os

    from tiercache.codecs import checksums
    data = memoryview(os.urandom((3 << 20) + 12345))
    for name in checksums.names():
        checksum = checksums.get(name)()
        running = checksum.running()
        for offset in range(0, len(data), 1 << 20):
            running.update(data[offset:offset + (1 << 20)])
        assert running.intdigest() == checksum(data), name
