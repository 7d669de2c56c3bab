"""Chunks encrypted at rest (AES-256-GCM) under per-tenant keys only their engines hold: round trips, another
tenant's key, a flipped bit, a relabeled header, key rotation; chunk files and Redis values are ciphertext."""
import json
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
    (("1 abcd active",), r"line \d.*32 bytes \(64 hex digits\) for AES-256, has 2"),
    ((f"0 {OLD.hex()} active",), "an id from 1 to 2"),
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


def test_a_keys_file_rotated_while_the_engine_runs_is_taken_and_audited(tmp_path, monkeypatch):
    """An operator edits the keys file of a running engine: a new active key (the old one kept for its grace),
    then the old one retired, then a typo. New chunks go under the new key at once, old ones are read until
    retired and are counted misses after; the typo keeps the keys in use. Each change is one audit line
    naming key ids only, and a counter per tenant."""
    from tiercache.metrics import registry_for

    monkeypatch.setattr(cf, "KEYS_CHECK_S", 0.0)              # every chunk and step looks at the file
    keys = tmp_path / "acme.keys"
    audit = tmp_path / "audit.jsonl"
    disk_dir = tmp_path / "disk"
    _keys_file(keys, f"1 {OLD.hex()} active")
    s = Stack(num_blocks=64, cpu_chunks=2, disk={"enabled": True, "path": str(disk_dir), "write_mode": "write-through"},
              format={"encryption_keys_file": str(keys)}, audit={"log_file": str(audit), "tenant": "acme"})

    def stored(hashes) -> set[int]:
        """The key ids the chunk files of a request's chunks name."""
        names = {k.hex() for k in s.manager.lookup(hashes).runs[0].keys}
        return {read_header(f.read_bytes())[4] for f in disk_dir.rglob("*.chunk") if f.stem in names}

    def from_disk(hashes):
        s.cpu.delete(list(s.manager.lookup(hashes).runs[0].keys))
        return load(s, hashes)

    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        assert stored(a) == {1}
        _keys_file(keys, f"1 {OLD.hex()}", f"2 {NEW.hex()} active")            # rotation, key 1 in its grace
        b, b_kv = put(s, "b", seed=2)
        s.offload.drain()
        assert stored(b) == {2}
        got = from_disk(a)
        assert got is not None and bool((got == a_kv).all())                    # old chunks still read
        _keys_file(keys, f"2 {NEW.hex()} active")                                # grace over: key 1 retired
        s.offload.drain()
        failures = s.lower("disk").counters.integrity_failures
        assert from_disk(a) is None and s.lower("disk").counters.integrity_failures > failures
        got = from_disk(b)
        assert got is not None and bool((got == b_kv).all())
        keys.write_text("2 not-a-key active\n")                                  # a typo: the keys in use stay
        c, c_kv = put(s, "c", seed=3)
        s.offload.drain()
        assert stored(c) == {2}
        got = from_disk(c)
        assert got is not None and bool((got == c_kv).all())
        scrape = {(x.name, tuple(sorted(x.labels.items()))): x.value
                  for m in registry_for(s.offload.stats).collect() for x in m.samples}
    finally:
        s.close()
    text = audit.read_text()
    assert OLD.hex() not in text and NEW.hex() not in text                       # ids, never keys
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(e["event"], e.get("active"), e.get("retired")) for e in lines] == [
        ("keys_loaded", 1, None), ("key_rotation", 2, []), ("key_rotation", 2, [1]), ("keys_reload_failed", 2, None)]
    assert {e["tenant"] for e in lines} == {"acme"} and "line 1" in lines[-1]["reason"]
    assert oct(audit.stat().st_mode & 0o777) == "0o600"
    assert scrape[("tiercache_audit_events_total", (("event", "key_rotation"), ("tenant", "acme")))] == 2
