"""Chunks encrypted at rest (AES-256-GCM) under per-tenant keys only their engines hold: round trips, another
tenant's key, a flipped bit, a relabeled header, key rotation; chunk files and Redis values are ciphertext."""
import os
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
import redis

from tests.conftest import Stack
from tests.support.stack_ops import load, put
from tiercache.contracts.keys import BlockHash
from tiercache.errors import ConfigError, SignatureError
from tiercache.wire import chunk_format as cf
from tiercache.wire.chunk_format import (
    HEADER_BYTES,
    SEALED,
    ChunkFormat,
    ChunkMeta,
    ChunkSealer,
    decode,
    read_header,
)

NS = b"n" * 16
OLD, NEW, OTHER = os.urandom(32), os.urandom(32), os.urandom(32)
TENANT = ChunkSealer({1: OLD}, 1)


def chunk(i: int = 1) -> tuple[ChunkMeta, bytes]:
    raw = np.random.default_rng(i).standard_normal(512).astype(np.float16).tobytes()
    return ChunkMeta(NS, BlockHash(bytes([i]) * 32), 16, "float16", (2, 16, 16)), raw


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8"])
def test_an_encrypted_chunk_opens_with_its_tenants_key_only(codec):
    meta, raw = chunk()
    blob = ChunkFormat(codec, signer=TENANT).encode(meta, raw)
    assert read_header(blob)[2] == SEALED and read_header(blob)[4] == 1         # the key id is in the header
    plain = ChunkFormat(codec).encode(meta, raw)
    assert plain[HEADER_BYTES:HEADER_BYTES + 64] not in blob                   # the payload is ciphertext
    assert len(decode(blob, NS, meta.key, TENANT).data) == len(raw)
    if codec != "int8":
        assert bytes(decode(blob, NS, meta.key, TENANT).data) == raw
    for keys in (None, ChunkSealer({1: OTHER}, 1)):                           # no key; another tenant's
        with pytest.raises(SignatureError):
            decode(blob, NS, meta.key, keys)
    for offset in (HEADER_BYTES + 3, len(blob) - 20, len(blob) - 1):           # nonce, ciphertext, tag
        damaged = bytearray(blob)
        damaged[offset] ^= 1
        with pytest.raises(SignatureError):
            decode(bytes(damaged), NS, meta.key, TENANT)


def test_a_plaintext_chunk_is_refused_where_chunks_must_be_encrypted():
    meta, raw = chunk()
    planted = ChunkFormat().encode(meta, bytes(len(raw)))           # right header, right checksum, no key
    with pytest.raises(SignatureError, match="not encrypted"):
        decode(planted, NS, meta.key, TENANT)


def test_the_header_is_authenticated_a_ciphertext_cannot_be_passed_off_as_another_chunk():
    meta, raw = chunk(1)
    sealed = ChunkFormat(signer=TENANT).encode(meta, raw)
    other = ChunkMeta(NS, BlockHash(bytes([2]) * 32), 16, "float16", (2, 16, 16))
    body = list(cf._BODY.unpack(sealed[:cf._BODY.size]))
    body[8] = other.key                                               # relabel, and mend the header's CRC
    packed = cf._BODY.pack(*body)
    forged = packed + struct.pack("<I", zlib.crc32(packed)) + sealed[HEADER_BYTES:]
    with pytest.raises(SignatureError):
        decode(forged, NS, other.key, TENANT)


def test_the_parent_is_authenticated_a_chunk_cannot_be_moved_into_another_chain():
    """A store that rewrote a sealed chunk's parent could hide it from a purge by prompt: refused."""
    meta, raw = chunk(1)
    sealed = ChunkFormat(signer=TENANT).encode(replace(meta, parent=BlockHash(bytes([7]) * 32)), raw)
    assert decode(sealed, NS, meta.key, TENANT).meta.parent == bytes([7]) * 32
    body = list(cf._BODY.unpack(sealed[:cf._BODY.size]))
    body[9] = bytes(32)                                               # "the first chunk of its request"
    packed = cf._BODY.pack(*body)
    forged = packed + struct.pack("<I", zlib.crc32(packed)) + sealed[HEADER_BYTES:]
    with pytest.raises(SignatureError):
        decode(forged, NS, meta.key, TENANT)


def test_a_rotation_reads_old_chunks_in_its_grace_writes_new_ones_under_the_new_key_then_retires_the_old():
    meta, raw = chunk()
    before = ChunkFormat(signer=ChunkSealer({1: OLD}, 1)).encode(meta, raw)
    rotated = ChunkSealer({1: OLD, 2: NEW}, 2)
    assert bytes(decode(before, NS, meta.key, rotated).data) == raw              # grace: the old key reads
    after = ChunkFormat(signer=rotated).encode(meta, raw)
    assert read_header(after)[4] == 2
    retired = ChunkSealer({2: NEW}, 2)
    assert bytes(decode(after, NS, meta.key, retired).data) == raw
    with pytest.raises(SignatureError, match="key 1, which is not here"):
        decode(before, NS, meta.key, retired)


def _keys_file(path, *lines: str):
    path.write_text("# id key [active]\n" + "\n".join(lines) + "\n")
    return str(path)


def _files(root) -> list[bytes]:
    return [p.read_bytes() for p in root.rglob("*") if p.is_file()]


def test_disk_files_are_ciphertext_and_another_tenants_engine_finds_only_misses(tmp_path):
    keys = _keys_file(tmp_path / "acme.keys", f"1 {OLD.hex()} active")
    disk = {"enabled": True, "path": str(tmp_path / "disk"), "write_mode": "write-through"}
    s = Stack(num_blocks=64, cpu_chunks=2, disk=disk, format={"codec": "lz4", "encryption_keys_file": keys})
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        plain = a_kv.numpy().tobytes()
        files = _files(tmp_path / "disk")
        assert files and not any(plain[i:i + 64] in f for f in files for i in (0, 4096, len(plain) - 64))
        s.cpu.delete(list(s.manager.lookup(a).runs[0].keys))
        got = load(s, a)
        assert got is not None and bool((got == a_kv).all())
    finally:
        s.close()
    rotated = _keys_file(tmp_path / "acme-rotated.keys", f"1 {OLD.hex()}", f"2 {NEW.hex()} active")
    other = _keys_file(tmp_path / "initech.keys", f"1 {OTHER.hex()} active")
    for keys_file, served in ((rotated, True), (other, False)):
        s = Stack(num_blocks=64, cpu_chunks=2, disk=disk, format={"codec": "lz4", "encryption_keys_file": keys_file})
        try:
            got = load(s, a)
            assert (got is not None and bool((got == a_kv).all())) if served else got is None
            if not served:
                assert s.lower("disk").counters.integrity_failures >= 1          # a counted miss, not an error
        finally:
            s.close()


def test_redis_values_are_ciphertext_and_load_back(redis_server, tmp_path):
    keys = _keys_file(tmp_path / "acme.keys", f"7 {NEW.hex()} active")
    s = Stack(num_blocks=64, cpu_chunks=2, redis={"enabled": True, "url": redis_server.url},
              format={"encryption_keys_file": keys})
    client = redis.Redis.from_url(redis_server.url)
    try:
        a, a_kv = put(s, "a", seed=2)
        s.offload.drain()
        chunk_keys = list(s.manager.lookup(a).runs[0].keys)
        value = client.get(s.transport("redis")._rkey(chunk_keys[0]))
        assert read_header(value)[2] == SEALED and read_header(value)[4] == 7
        plain = a_kv.numpy().tobytes()
        assert plain[:64] not in value and plain[-64:] not in value
        s.cpu.delete(chunk_keys)
        got = load(s, a)
        assert got is not None and bool((got == a_kv).all())
    finally:
        s.close()


@pytest.mark.parametrize("lines,why", [
    ((f"1 {OLD.hex()}",), "exactly one key 'active'"),
    ((f"1 {OLD.hex()} active", f"2 {NEW.hex()} active"), "exactly one key 'active'"),
    (("1 abcd active",), "AES-256 takes 32"),
    (("1 zz active",), "not hexadecimal"),
    ((f"x {OLD.hex()} active",), "must be 'ID HEX64'"),
    ((f"1 {OLD.hex()} active", f"1 {NEW.hex()}"), "listed twice"),
])
def test_a_bad_keys_file_is_one_config_error_naming_the_field(tmp_path, lines, why):
    from tiercache.build import chunk_format
    from tiercache.config import TierCacheConfig

    path = _keys_file(tmp_path / "keys", *lines)
    with pytest.raises(ConfigError, match=why) as err:
        chunk_format(TierCacheConfig().replace(format={"encryption_keys_file": path}))
    assert "format.encryption_keys_file" in str(err.value)
    assert OLD.hex() not in str(err.value) and NEW.hex() not in str(err.value)     # never a key in a message


def test_signing_and_encryption_together_are_refused(tmp_path):
    from tiercache.build import chunk_format
    from tiercache.config import TierCacheConfig

    (tmp_path / "sign").write_text("tenant-secret-0123456789")
    keys = _keys_file(tmp_path / "keys", f"1 {OLD.hex()} active")
    with pytest.raises(ConfigError, match="not both"):
        chunk_format(TierCacheConfig().replace(format={"encryption_keys_file": keys,
                                                       "signing_key_file": str(tmp_path / "sign")}))


def test_engines_of_one_tenant_share_encrypted_chunks_through_tiercache_serve_and_another_tenant_cannot(
        tmp_path):
    """Two reference engines with one tenant's keys share a prefix through `tiercache serve`, whose memory
    holds only ciphertext; an engine with another tenant's keys finds misses and computes the same tokens."""
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    from tests.conftest import CacheServerProcess
    from tests.support.engine_runs import offload, run_sequential, shared_prompts
    from tiercache.engine import EngineConfig, LLMEngine

    # its memory tier as chunk files (--shm-dir), so the test can read what the server holds
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB", "--shm-dir", str(tmp_path / "serve-memory"))
    acme = _keys_file(tmp_path / "acme.keys", f"1 {OLD.hex()} active")
    initech = _keys_file(tmp_path / "initech.keys", f"1 {OTHER.hex()} active")

    def config(keys: str):
        return offload(grpc={"enabled": True, "address": server.address}, format={"encryption_keys_file": keys})

    prompts = shared_prompts(n=3)
    try:
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as plain:
            expect = [s.output_token_ids for s in run_sequential(plain, prompts)]
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=config(acme)) as one:
            assert [s.output_token_ids for s in run_sequential(one, prompts[:1])] == expect[:1]
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=config(acme)) as two:
            seq = run_sequential(two, prompts[1:2])[0]
            assert seq.output_token_ids == expect[1] and seq.metrics.external_hit_tokens == 192
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=config(initech)) as other:
            seq = run_sequential(other, prompts[2:3])[0]
            assert seq.output_token_ids == expect[2] and seq.metrics.external_hit_tokens == 0
        held = [f for f in _files(tmp_path / "serve-memory") if f[:4] == b"TCKV"]
        assert held and all(read_header(f)[2] == SEALED for f in held)
    finally:
        server.stop()
