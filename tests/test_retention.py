"""Retention: a chunk older than its tier's limit is never served and is removed; its age keeps counting when it
moves between tiers, and a disk tier drops what expired while nothing ran. Clocks are the tiers' own
(`IndexedTier.clock`), moved by the tests: no test waits for time to pass."""
import json
import os
import time

import pytest
import redis

from tests.conftest import Stack
from tests.support.stack_ops import load, lookup, put
from tiercache.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _stack(tmp_path, clock: Clock | None = None, cpu=0.0, disk=0.0, **extra) -> Stack:
    s = Stack(num_blocks=64, cpu_chunks=4, cpu={"retention": cpu},
              disk={"enabled": True, "path": str(tmp_path), "write_mode": "write-through", "retention": disk},
              **extra)
    if clock is not None:
        for tier in s.manager.tiers:
            tier.clock = clock
    return s


def _files(tmp_path) -> list:
    return [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_a_chunk_past_its_retention_is_never_served_and_is_removed_and_audited(tmp_path):
    clock = Clock()
    audit = tmp_path.parent / f"{tmp_path.name}.audit"
    s = _stack(tmp_path, clock, cpu=200, disk=100, audit={"log_file": str(audit), "tenant": "acme"})
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        keys = list(s.manager.lookup(a).runs[0].keys)
        disk = s.lower("disk")
        assert s.cpu.contains(keys) == 2 and disk.contains(keys) == 2 and len(_files(tmp_path)) == 2
        clock.now += 150                                            # past the disk's retention, within L1's
        assert disk.contains(keys) == 0                             # never served, before any sweep
        got = load(s, a)                                            # L1 still may
        assert got is not None and bool((got == a_kv).all())
        s.offload.run(s.manager.take_background())                  # the sweep: the files are deleted
        s.offload.drain()
        assert disk.counters.expired == 2 and not disk.entries and _files(tmp_path) == []
        clock.now += 100                                            # past L1's too
        assert lookup(s, a).num_hit_blocks == 0 and load(s, a) is None
        s.offload.run(s.manager.take_background())
        assert s.cpu.counters.expired == 2 and not s.cpu.entries
        counts = s.offload.stats()["audit"]["acme"]["expired"]
    finally:
        s.close()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]     # one line per sweep that took some
    assert [(e["event"], e["tenant"], e["tier"], e["chunks"]) for e in lines] == [
        ("expired", "acme", "disk", 2), ("expired", "acme", "cpu", 2)]
    assert counts == {"events": 2, "chunks": 4, "bytes": 0}


def test_a_chunk_keeps_its_age_when_it_moves_between_tiers(tmp_path):
    """Promoted from disk into L1, a chunk's clock does not start again: retention bounds the age of the KV,
    wherever it is (so a chunk older than L1's retention cannot come back through L1)."""
    clock = Clock()
    s = _stack(tmp_path, clock, cpu=100, disk=1000)
    try:
        a, _ = put(s, "a", seed=1)
        s.offload.drain()
        keys = list(s.manager.lookup(a).runs[0].keys)
        born = s.lower("disk").stored_times(keys)
        assert born == s.cpu.stored_times(keys)                      # written through with L1's time
        s.cpu.delete(keys)
        clock.now += 60
        assert load(s, a) is not None                                # promoted from disk
        assert s.cpu.stored_times(keys) == born                      # its age, not the promotion's time
        clock.now += 50                                              # 110 s after it was stored
        assert s.cpu.contains(keys) == 0 and load(s, a) is None      # past L1's 100 s, wherever it comes from
    finally:
        s.close()


def test_a_disk_tier_drops_what_expired_while_it_was_down(tmp_path):
    s = _stack(tmp_path)
    try:
        a, _ = put(s, "a", seed=1)
        b, _ = put(s, "b", seed=2)
        s.offload.drain()
    finally:
        s.close()
    files = _files(tmp_path)
    assert len(files) == 4
    old = time.time() - 7200
    for f in files[:2]:
        os.utime(f, (old, old))                                      # two files written two hours ago
    s = _stack(tmp_path, disk=3600)
    try:
        s.offload.run(s.manager.take_background())                   # the deletes the restart planned
        s.offload.drain()
        disk = s.lower("disk")
        assert disk.counters.expired == 2 and len(disk.entries) == 2
        assert sorted(map(str, _files(tmp_path))) == sorted(map(str, files[2:]))
    finally:
        s.close()


def test_redis_values_expire_at_the_retention_and_reads_do_not_renew_them(redis_server):
    s = Stack(num_blocks=64, cpu_chunks=2, redis={"enabled": True, "url": redis_server.url, "ttl": 1000,
                                                  "retention": 30})
    client = redis.Redis.from_url(redis_server.url)
    try:
        a, a_kv = put(s, "a", seed=3)
        s.offload.drain()
        keys = list(s.manager.lookup(a).runs[0].keys)
        rkeys = [s.transport("redis")._rkey(k) for k in keys]
        assert all(0 < client.ttl(k) <= 30 for k in rkeys)           # the retention, not the longer ttl
        s.cpu.delete(keys)
        got = load(s, a)
        assert got is not None and bool((got == a_kv).all())
        assert all(0 < client.ttl(k) <= 30 for k in rkeys)           # a read did not give it the ttl again
    finally:
        s.close()


@pytest.mark.parametrize("section", ["cpu", "disk", "redis"])
def test_a_negative_retention_is_one_config_error(section):
    from tiercache.config import TierCacheConfig

    with pytest.raises(ConfigError, match=f"{section}.retention"):
        TierCacheConfig().replace(**{section: {"retention": -1}})


def _store(tmp_path, clock: Clock | None, retention: float, capacity: int = 1 << 20):
    from tiercache.server.store import ChunkStore, StoreConfig

    store = ChunkStore(StoreConfig(capacity, disk_path=str(tmp_path / "serve-disk"), disk_capacity=64 << 20,
                                   retention_s=retention))
    if clock is not None:
        for tier in store.tiers:
            tier.clock = clock
    return store


def _value(i: int) -> bytes:
    from tests.support.grpc_clients import NS, chunks
    from tiercache.wire.chunk_format import ChunkFormat

    meta, raw = chunks(i + 1)[i]
    assert meta.namespace == NS
    return meta.key, ChunkFormat().encode(meta, raw)


def test_the_servers_chunks_expire_in_memory_and_on_disk_and_keep_their_age_when_spilled(tmp_path):
    from tests.support.grpc_clients import NS

    clock = Clock()
    key, value = _value(0)
    store = _store(tmp_path, clock, retention=100, capacity=len(value) + 16)    # room for one chunk
    assert store.put(NS, key, value).name == "STORED"
    born = store.memory.stored_times(list(store.memory.entries))
    clock.now += 60
    key2, value2 = _value(1)
    assert store.put(NS, key2, value2).name == "STORED"                 # the first spills to disk
    assert store.disk.stored_times(list(store.disk.entries)) == born           # with its age
    spilled = store.disk.path(next(iter(store.disk.entries)))
    assert abs(spilled.stat().st_mtime - next(iter(born.values()))) < 1        # the file's time too
    clock.now += 50                                                             # 110 s after the first came
    assert store.get_value(NS, key) is None and store.get_value(NS, key2) is not None
    assert len(store.expire()) == 1 and not store.disk.entries and not spilled.exists()
    clock.now += 100
    assert store.contains(NS, [key2]) == 0 and len(store.expire()) == 1 and not store.memory.entries


def test_a_restarted_server_drops_what_expired_while_it_was_down(tmp_path):
    from tests.support.grpc_clients import NS

    store = _store(tmp_path, None, retention=0)
    key, value = _value(0)
    store.put(NS, key, value)
    assert store.flush() >= 1                                                   # memory written down
    files = [p for p in (tmp_path / "serve-disk").rglob("*.chunk")]
    old = time.time() - 7200
    for f in files:
        os.utime(f, (old, old))
    again = _store(tmp_path, None, retention=3600)
    assert again.disk.counters.expired == len(files) == 1 and not again.disk.entries
    assert again.get_value(NS, key) is None and not any(f.exists() for f in files)


def test_a_running_server_sweeps_expired_chunks_without_being_asked(tmp_path):
    """`tiercache serve --retention 1`: a second after a chunk came it is gone from the server's memory, though
    nobody asked for it again (the sweep runs every second)."""
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    from tests.conftest import CacheServerProcess
    from tests.support.grpc_clients import NS, Client, chunks, raw_call
    from tiercache.wire import tiercache_pb2 as pb

    server = CacheServerProcess(tmp_path, "--capacity", "64MiB", "--retention", "1")
    try:
        tier = Client(server.address, NS)
        items = chunks(2)
        assert tier.write_chunks(items) == ()
        deadline = time.monotonic() + 60
        while pb.StatsReply.FromString(raw_call(server, "Stats", b"")).tiers[0].chunks:
            assert time.monotonic() < deadline, "the server never swept its expired chunks"
            time.sleep(0.2)
        assert tier.contains([m.key for m, _ in items]) == 0
    finally:
        server.stop()
    events = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    expired = [e for e in events if e.get("event") == "expired"]
    assert sum(e["chunks"] for e in expired) == 2 and {e["tenant"] for e in expired} == {"default"}   # audited


def test_bad_retentions_are_one_clear_line(tmp_path):
    from tiercache.server.tenants import load_tenants

    tokens = tmp_path / "tenants.toml"
    tokens.write_text('[tenants.acme]\ntoken = "acme-token-0123456789"\nretention = 60\n')
    with pytest.raises(ConfigError, match="retention needs the tenant's own store"):
        load_tenants(str(tokens))
    tokens.write_text('[tenants.acme]\ntoken = "acme-token-0123456789"\nmemory = "1MiB"\nretention = "soon"\n')
    with pytest.raises(ConfigError, match="retention must be seconds"):
        load_tenants(str(tokens))
    tokens.write_text('[tenants.acme]\ntoken = "acme-token-0123456789"\nmemory = "1MiB"\nretention = 60\n')
    assert load_tenants(str(tokens))[0].retention == 60.0


def test_a_namespace_keeps_its_chunks_for_a_time_of_its_own_on_the_server(tmp_path):
    """``--namespace-retention`` / a tenant's ``namespace_retention``: one namespace's chunks go sooner (or
    later) than the store's; in the shared pool the tenant's namespace is found under its scoped digest."""
    from tests.support.grpc_clients import NS
    from tiercache.server.store import StoreConfig
    from tiercache.server.tenants import Tenancy, load_tenants

    other = bytes(reversed(NS))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\ntoken = "acme-token-0123456789"\n'
                       f'namespace_retention = {{ "{NS.hex()}" = 10 }}\n'
                       '[tenants.initech]\ntoken = "initech-token-0123456789"\n')
    tenancy = Tenancy(load_tenants(str(tenants)), StoreConfig(1 << 20, disk_path=str(tmp_path / "d"),
                                                              disk_capacity=1 << 20, retention_s=100))
    clock = Clock()
    for tier in tenancy.stores["pool"].tiers:
        tier.clock = clock
    acme, initech = (tenancy.own(t) for t in tenancy.tenants.values())    # both in the shared pool
    (k0, v0), (k1, v1) = _value(0), _value(1)
    assert acme.put(NS, k0, v0).name == "STORED" and initech.put(NS, k1, v1).name == "STORED"
    clock.now += 11                                     # past acme's namespace retention, within the server's
    assert acme.contains(NS, [k0]) == 0 and initech.contains(NS, [k1]) == 1
    assert tenancy.expire() == {"acme": 1}             # told apart by tenant in the shared pool
    clock.now += 90                                     # past the server's
    assert initech.contains(NS, [k1]) == 0
    assert tenancy.expire() == {"initech": 1} and tenancy.expire() == {}
    assert other not in tenancy.stores["pool"].memory.retention_by_namespace


def test_bad_namespace_retentions_are_one_clear_line(tmp_path):
    from tiercache.server.app import ServeConfig
    from tiercache.server.tenants import load_tenants

    with pytest.raises(ConfigError, match="expected NAMESPACE_HEX=SECONDS"):
        ServeConfig(namespace_retention=("00" * 16,))
    with pytest.raises(ConfigError, match="is not a namespace"):
        ServeConfig(namespace_retention=("abc=5",))
    tokens = tmp_path / "tenants.toml"
    tokens.write_text('[tenants.acme]\ntoken = "acme-token-0123456789"\nnamespace_retention = { "nope" = 5 }\n')
    with pytest.raises(ConfigError, match="namespace_retention: is not a namespace"):
        load_tenants(str(tokens))
