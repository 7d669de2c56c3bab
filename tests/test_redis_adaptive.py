"""The Redis tier's default door, `adaptive-sighting`, with its state in Redis, against the Python rule.

`AdaptiveSightings` runs `AdaptiveSightingAdmit`'s rule in Redis's scripts: the same history, the same sampled
shadow tiers (sorted sets on a logical clock), the same saturating duel. Fed the same requests, the two take the
same decisions; what differs is only where the state lives — in Redis, where every replica's requests reach it.
"""
import inspect
import itertools
import random

import pytest

from tests.conftest import RedisServer
from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash
from tiercache.policies import DEFAULT_ADMISSION
from tiercache.policies.admission import AdaptiveSightingAdmit, GuardedTier
from tiercache.tiers.redis_sightings import (
    GENERATIONS,
    L1_SHADOW,
    SHADOWS,
    STATE,
    AdaptiveSightings,
    Sightings,
    shadow_shape,
)
from tiercache.wire.chunk_format import ChunkMeta

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'tiercache[redis]')")

NS = bytes(range(16))
TIER = GuardedTier(chunks=512, l1_chunks=64)      # shadows of the whole tier: every key is in the sample
GIB = 1 << 30


def _key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big") + bytes(24))   # distinct in the 8 bytes Redis names a key by


def _meta(key: BlockHash, parent: BlockHash | None = None, raw_bytes: int = GIB) -> ChunkMeta:
    return ChunkMeta(NS, key, 16, "float32", (raw_bytes // 4,), parent)


def _no_room(client) -> None:
    """A ``maxmemory`` with no room for a chunk of `_meta`'s default size: the door decides every chunk."""
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + (64 << 20)))


def _requests(seed: int = 1):
    """Two workloads in a row, each a request's chunk keys: first a working set larger than the tier — a hot set
    of 300 chunks it could hold, each request followed by three chunks never asked again, which evict it where
    they are admitted (second-sighting wins the duel) — then a fresh working set of 500 chunks that fits, asked
    at random (admitting everything wins: each first sighting refused is a miss)."""
    rng = random.Random(seed)
    for n in range(600):
        yield [_key(rng.randrange(300)) for _ in range(2)] + [_key(10**6 + 10 * n + j) for j in range(3)]
    for _ in range(1000):
        first = rng.randrange(500)
        yield [_key(2 * 10**6 + (first + j) % 500) for j in range(2)]


def _doors(url: str) -> tuple:
    client = redis.Redis.from_url(url)
    return client, AdaptiveSightings(client, TIER.l1_chunks, TIER.chunks)


def test_redis_is_the_default_door_and_its_shadows_are_the_python_rules():
    from tiercache.tiers.redis import RedisIndex, RedisTransport

    assert DEFAULT_ADMISSION == "adaptive-sighting"
    for tier in (RedisIndex, RedisTransport):
        assert inspect.signature(tier).parameters["admission"].default == DEFAULT_ADMISSION
    for tier in (TIER, GuardedTier(3), GuardedTier(10_000, 300), GuardedTier(10**8, 4096)):
        python = AdaptiveSightingAdmit()
        python.size_for(tier)
        shape = shadow_shape(tier)
        assert (shape.l1_slots, shape.slots, shape.sample_below) == \
            (python._l1.slots, python._always.slots, python._sample_below)
        assert python.ghost_keys // 2 <= shape.generation <= python.ghost_keys     # remembered: 1-2 generations


def test_the_redis_door_takes_the_python_rules_decisions(redis_server):
    """The same requests to the Python rule and to the door, one by one: after each, the same duel, the same
    rule; every 25 requests the same answer for each of a batch of chunks when Redis has no room. Exact, not
    just the same regime switches, since neither history drops a key here (1,700 keys asked, under both
    bounds) and no two keys share the 8 bytes the door names them by."""
    client, door = _doors(redis_server.url)
    python = AdaptiveSightingAdmit()
    python.size_for(TIER)
    _no_room(client)
    rules, asked = [], []
    for n, keys in enumerate(_requests()):
        python.record(keys)
        door.record(keys)
        assert (int(client.hget(STATE, "duel")), door.admits_all) == (python.duel, python.admits_all), n
        if not rules or rules[-1] != python.admits_all:
            rules.append(python.admits_all)
        asked.extend(keys)
        if n % 25 == 0:
            batch = [*dict.fromkeys(asked[-40:])] + [_key(3 * 10**6 + n)]      # recent, and never asked
            assert door.admitted([_meta(k) for k in batch]) == [python.admit(k, 0) for k in batch], n
    assert rules == [True, False, True]       # it starts open, the one-offs close it, the fitting set opens it
    assert len(set(asked)) < 2 * shadow_shape(TIER).generation


def test_a_request_that_comes_back_vouches_for_its_chunks(redis_server):
    client, door = _doors(redis_server.url)
    python = AdaptiveSightingAdmit()
    python.size_for(TIER)
    _no_room(client)
    client.hset(STATE, "picky", 1)                          # both duels have said second-sighting
    python.admits_all = False
    keys = [_key(i) for i in range(3)]
    for rule in (python, door):
        rule.record(keys)
        rule.retain(keys[:1], RequestState.RUNNING)         # running: no word on its future
        rule.retain(keys[1:], RequestState.CONTINUES)       # a conversation that goes on
    assert door.admitted([_meta(k) for k in keys]) == [python.admit(k, 0) for k in keys] == [False, True, True]


def test_replicas_share_the_duel_and_the_sightings(redis_server):
    """Replica A's requests alone turn the duel to second-sighting; replica B's door, which recorded nothing,
    follows it. A chunk A asked for once and B asks for again is on its second sighting at either door."""
    _, a = _doors(redis_server.url)
    client, b = _doors(redis_server.url)
    _no_room(client)
    requests = _requests()
    while a.admits_all:
        a.record(next(requests))
    prefix = [_key(9 * 10**6), _key(9 * 10**6 + 1)]
    chain = [_meta(prefix[0]), _meta(prefix[1], parent=prefix[0])]
    assert b.admitted([_meta(_key(8 * 10**6))]) == [False]    # a first sighting, at B's door: the duel is shared
    a.record(prefix)
    assert b.admitted(chain) == [False, False]
    b.record(prefix)
    assert a.admitted(chain) == b.admitted(chain) == [True, True]


def test_the_doors_memory_is_bounded(redis_server):
    """Far more keys than the tier holds, through a door sized for a small tier: the history keeps at most two
    generations, each shadow its slots, and an engine's shadow L1 expires once the engine stops asking."""
    tier = GuardedTier(chunks=64, l1_chunks=16)
    client = redis.Redis.from_url(redis_server.url)
    door = AdaptiveSightings(client, tier.l1_chunks, tier.chunks)
    shape = shadow_shape(tier)
    first, batch = _key(10**9), 16
    door.record([first])
    for start in range(0, 20 * shape.generation, batch):
        door.record([_key(i) for i in range(start, start + batch)])
        assert sum(client.hlen(g) for g in GENERATIONS) <= 2 * (shape.generation + batch)
    assert not any(client.hexists(g, first[:8]) for g in GENERATIONS)      # fell off: it starts over
    l1 = next(iter(client.scan_iter(match=L1_SHADOW + b"*")))
    assert [client.zcard(s) for s in (l1, *SHADOWS)] == [shape.l1_slots, shape.slots, shape.slots]
    assert 0 < client.ttl(l1) <= 3600


def test_a_door_not_told_the_tiers_size_takes_it_from_maxmemory(redis_server):
    """Told nothing, the door runs no duel (a Redis without ``maxmemory`` has room); once a store filed the
    tier's size (``maxmemory`` over a chunk), it sizes its shadows by it, per writing rank."""
    client = redis.Redis.from_url(redis_server.url)
    door = AdaptiveSightings(client, l1_chunks=8)
    door.ranks = 2
    door.record([_key(1)])
    assert door.shape is None and not client.exists(*SHADOWS)
    client.config_set("maxmemory", str(1 << 30))
    door.admitted([_meta(_key(2), raw_bytes=1 << 20)])        # 1 GiB over 1 MiB values: 1,024, 512 a rank
    door.record([_key(1)])
    assert door.shape == shadow_shape(GuardedTier(512, 8))


def test_the_index_tells_the_door_the_requests_an_engine_admits(redis_server):
    """`RedisIndex.record` queues the request on the lookup thread; its lookups count nothing at this door."""
    from tiercache.tiers.redis import RedisIndex

    client = redis.Redis.from_url(redis_server.url)
    index = RedisIndex(redis_server.url)
    try:
        index.attach([b"d" * 16])
        index.size_for(TIER)
        keys = [_key(1), _key(2)]
        assert index.present(keys) == 0                        # a lookup: no sighting at this door
        assert not client.exists(GENERATIONS[0])
        index.record(keys)
        index.retain(keys[:1], RequestState.PREEMPTED)
        index._pool.submit(lambda: None).result(timeout=5)     # the lookup thread has run what was queued
        assert [int(client.hget(GENERATIONS[0], k[:8])) for k in keys] == [2, 1]
        assert [client.zcard(k) for k in client.scan_iter(match=L1_SHADOW + b"*")] == [2]   # in the shadow L1
    finally:
        index.close()


def test_a_redis_that_refuses_scripts_leaves_the_door_open(tmp_path, caplog):
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer(tmp_path, extra=("--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""))
    try:
        client = redis.Redis.from_url(server.url)
        _no_room(client)
        for door in (AdaptiveSightings(client, TIER.l1_chunks, TIER.chunks), Sightings(client)):
            door.record([_key(1)])
            door.sight([_key(1)])
            assert door.admitted([_meta(_key(1)), _meta(_key(2))]) == [True, True]
        assert "the door stays open" in caplog.text
    finally:
        server.stop()


def test_a_cluster_keeps_the_doors_state_in_one_slot(redis_cluster):
    """Every key the door writes carries one hash tag, so each script runs on the one node that owns it."""
    from tiercache.tiers.redis import fast_client

    client = fast_client(f"redis://127.0.0.1:{redis_cluster[0].port}/0", cluster=True)
    try:
        door = AdaptiveSightings(client, TIER.l1_chunks, TIER.chunks)
        for keys in itertools.islice(_requests(), 50):
            door.record(keys)
        client.hset(STATE, "picky", 1)
        assert door.admitted([_meta(_key(10**8)), _meta(_key(0))]) == [True, True]   # no maxmemory: room
        l1 = door._keys[3]
        assert len({client.keyslot(k) for k in (STATE, *GENERATIONS, l1, *SHADOWS)}) == 1
        assert client.exists(STATE, GENERATIONS[0], l1, *SHADOWS) == 5
    finally:
        client.close()
