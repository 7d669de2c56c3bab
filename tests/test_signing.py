"""Signed chunks: whoever can write to a store without the tenant's key cannot make a chunk its engines use."""
import numpy as np
import pytest
import redis

from tests.conftest import Stack
from tests.support.stack_ops import load, put
from tiercache.contracts.keys import BlockHash
from tiercache.errors import ChecksumMismatchError, SignatureError
from tiercache.wire.chunk_format import HEADER_BYTES, SIGNED, ChunkFormat, ChunkMeta, ChunkSigner, decode, read_header

NS = b"n" * 16
KEY = ChunkSigner(b"tenant-secret-0123456789")


def chunk(i: int = 1) -> tuple[ChunkMeta, bytes]:
    raw = np.random.default_rng(i).standard_normal(512).astype(np.float16).tobytes()
    return ChunkMeta(NS, BlockHash(bytes([i]) * 32), 16, "float16", (2, 16, 16)), raw


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_a_signed_chunk_verifies_with_its_key_only(codec):
    meta, raw = chunk()
    blob = ChunkFormat(codec, signer=KEY).encode(meta, raw)
    assert read_header(blob)[2] == SIGNED
    assert bytes(decode(blob, NS, meta.key, KEY).data) == raw
    with pytest.raises(SignatureError):
        decode(blob, NS, meta.key)                                   # no key: cannot be trusted
    with pytest.raises(SignatureError):
        decode(blob, NS, meta.key, ChunkSigner(b"another-tenants-secret"))
    damaged = bytearray(blob)
    damaged[-1] ^= 1
    with pytest.raises(SignatureError):
        decode(bytes(damaged), NS, meta.key, KEY)


def test_an_unsigned_chunk_with_a_valid_checksum_is_refused_where_chunks_must_be_signed():
    meta, raw = chunk()
    forged = ChunkFormat().encode(meta, bytes(len(raw)))             # correct header, correct xxh3
    assert bytes(decode(forged, NS, meta.key).data) == bytes(len(raw))
    with pytest.raises(SignatureError):
        decode(forged, NS, meta.key, KEY)


def test_a_signed_payload_cannot_be_passed_off_as_another_chunk():
    """The MAC covers what the header says: the same payload and sum under another key (or shape) fails, even
    with the header's own CRC recomputed."""
    meta, raw = chunk(1)
    signed = ChunkFormat(signer=KEY).encode(meta, raw)
    other = ChunkMeta(NS, BlockHash(bytes([2]) * 32), 16, "float16", (2, 16, 16))
    relabeled = bytearray(ChunkFormat(signer=KEY).encode(other, raw))
    relabeled[HEADER_BYTES:] = signed[HEADER_BYTES:]
    # copy the original's sum into the relabeled header, then fix the header CRC as an attacker would
    import struct
    import zlib

    from tiercache.wire import chunk_format as cf
    body = list(cf._BODY.unpack(bytes(relabeled[:cf._BODY.size])))
    body[14] = cf._BODY.unpack(signed[:cf._BODY.size])[14]
    packed = cf._BODY.pack(*body)
    forged = packed + struct.pack("<I", zlib.crc32(packed)) + bytes(relabeled[HEADER_BYTES:])
    with pytest.raises(SignatureError):
        decode(forged, NS, other.key, KEY)
    with pytest.raises((SignatureError, ChecksumMismatchError)):
        decode(forged, NS, other.key)


def test_chunks_planted_straight_into_redis_are_counted_misses_and_never_served(redis_server, tmp_path):
    key_file = tmp_path / "signing.key"
    key_file.write_text("tenant-secret-0123456789\n")
    s = Stack(num_blocks=64, cpu_chunks=2, redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2,
                                                  "timeout": 0.5},
              format={"signing_key_file": str(key_file)})
    client = redis.Redis.from_url(redis_server.url)
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        keys = s.manager.lookup(a).runs[0].keys
        transport = s.transport("redis")
        value = client.get(transport._rkey(keys[0]))
        assert read_header(value)[2] == SIGNED
        # A peer with write access to Redis (no key) replaces the chunk: right header, right checksum.
        parsed = read_header(value)
        forged = ChunkFormat().encode(parsed[0], bytes(parsed[0].raw_len))
        client.set(transport._rkey(keys[0]), forged)
        s.cpu.delete(list(keys))
        remote = s.lower("redis")
        assert load(s, a) is None                                    # never served
        assert remote.counters.integrity_failures >= 1
        assert not client.exists(transport._rkey(keys[0]))           # and deleted
    finally:
        s.close()


def test_a_bad_signing_key_file_is_one_config_error(tmp_path):
    from tiercache.build import chunk_format
    from tiercache.config import TierCacheConfig
    from tiercache.errors import ConfigError

    (tmp_path / "short").write_text("tiny")
    for path in (str(tmp_path / "short"), str(tmp_path / "missing")):
        with pytest.raises(ConfigError) as err:
            chunk_format(TierCacheConfig().replace(format={"signing_key_file": path}))
        assert "format.signing_key_file" in str(err.value)
