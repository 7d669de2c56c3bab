"""Sighting admission below L1 by default, and on the shared tiers by what every replica asked for.

The server's store and Redis keep the history of what was asked of them (a ``Contains`` run, a lookup's
``EXISTS``), so a chunk one replica asked for and another then stores is on its second sighting. Each store
takes anything while it has room, keeps its history bounded, and takes a chain from its head.
"""
import inspect

import pytest
import torch

from tests.conftest import BLOCK, CHUNK, CacheServerProcess, Stack
from tests.support.stack_ops import load, lookup, put
from tiercache.config import TierCacheConfig
from tiercache.contracts.keys import BlockHash
from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION
from tiercache.policies.admission import GHOST_FACTOR
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta

NS = bytes(range(16))
RAW_BYTES = 4096
BIG_CHUNK = 1024              # tokens: 128 KiB chunks of the test geometry


def _chunk(tag: int, parent: BlockHash | None = None) -> tuple[BlockHash, bytes]:
    """A stored chunk's key and value (header + payload), its header naming ``parent``."""
    key = BlockHash(bytes([tag]) * 32)
    raw = torch.full((RAW_BYTES // 4,), float(tag)).numpy().tobytes()
    return key, ChunkFormat().encode(ChunkMeta(NS, key, 16, "float32", (RAW_BYTES // 4,), parent), raw)


def _store(chunks: int, admission: str = "second-sighting"):
    """A server store (memory only) with room for ``chunks`` of `_chunk`'s."""
    from tiercache.server.store import ChunkStore, StoreConfig

    return ChunkStore(StoreConfig(chunks * len(_chunk(0)[1]) + 100, admission=admission))


def _tokens(seed: int) -> list[int]:
    return [seed * 1000 + t for t in range(2 * CHUNK)]      # `stack_ops.put`'s two chunks of that seed


# -- the default -----------------------------------------------------------------

def test_sighting_admission_is_the_default_below_l1_and_l1_takes_everything():
    from tiercache.bench.trace import replay_hierarchy
    from tiercache.cli import build_parser
    from tiercache.server.app import ServeConfig
    from tiercache.server.store import StoreConfig

    config = TierCacheConfig()
    assert DEFAULT_ADMISSION == "adaptive-sighting" and DEFAULT_EVICTION == "lfu-da"
    assert config.disk.admission == ServeConfig().admission == StoreConfig(1).admission == DEFAULT_ADMISSION
    assert inspect.signature(replay_hierarchy).parameters["admission"].default == DEFAULT_ADMISSION
    assert config.redis.admission == DEFAULT_ADMISSION and config.cpu.admission == "always"
    args = build_parser().parse_args(["bench", "trace", "--trace", "t.jsonl"])
    assert f"{DEFAULT_EVICTION}+{DEFAULT_ADMISSION}" in args.policy and "lru" in args.policy


def test_the_default_admission_is_never_below_lru_on_the_shared_trace(shared_trace):
    """Where second-sighting falls under LRU — near the tier's ceiling (10M) — the default does not
    (benchmarks/RESULTS.md, "Sighting admission by default")."""
    from tiercache.bench.trace import replay
    default = f"{DEFAULT_EVICTION}+{DEFAULT_ADMISSION}"
    for capacity in (1_000_000, 3_000_000, 10_000_000):
        lru, ours = replay(shared_trace, capacity, "lru"), replay(shared_trace, capacity, default)
        assert ours.token_hit_ratio >= lru.token_hit_ratio, capacity
        assert ours.written_chunks <= lru.written_chunks, capacity
    lru, picky = (replay(shared_trace, 10_000_000, p) for p in ("lru", "lfu-da+second-sighting"))
    assert picky.token_hit_ratio < lru.token_hit_ratio


# -- the server's store ------------------------------------------------------------

def test_a_full_store_takes_what_its_clients_asked_for_twice_and_anything_while_it_has_room():
    store = _store(3)
    for tag in (1, 2, 3):                                      # never asked for: taken while there is room
        assert store.put(NS, *_chunk(tag)).name == "STORED"
    key, value = _chunk(4)
    assert store.contains(NS, [key]) == 0                      # one sighting
    assert store.put(NS, key, value).name == "REJECTED"        # full: it would evict a chunk for a one-off
    assert store.counters["put_refused"] == 1 and store.counters.get("put_rejected", 0) == 0
    assert store.contains(NS, [key]) == 0                      # asked again (by any client)
    assert store.put(NS, key, value).name == "STORED" and store.contains(NS, [key]) == 1


def test_the_stores_history_is_bounded_by_the_chunks_it_holds():
    store = _store(3)
    for tag in (1, 2, 3):
        store.put(NS, *_chunk(tag))
    assert store.put(NS, *_chunk(4)).name == "REJECTED"        # the first refusal sizes the history: 3 chunks held
    seen = store.door.policy._seen
    bound = GHOST_FACTOR * 3
    for i in range(5 * bound):                                 # many more keys asked for than it remembers
        store.contains(NS, [BlockHash(i.to_bytes(32, "big"))])
        assert len(seen) <= bound


def test_a_store_takes_a_chains_tail_only_behind_its_head():
    """A tail asked for twice, whose head was asked for once (another replica had the head itself), is refused:
    without its head it is never hit. Once the head is on its second sighting the tail goes in — even before
    the head does, as a chain split across a client's transfer threads arrives."""
    store = _store(3)
    for tag in (1, 2, 3):
        store.put(NS, *_chunk(tag))
    head, head_value = _chunk(10)
    tail, tail_value = _chunk(11, parent=head)
    store.contains(NS, [head, tail])
    store.contains(NS, [tail])
    assert store.put(NS, tail, tail_value).name == "REJECTED"
    assert store.put(NS, head, head_value).name == "REJECTED"
    store.contains(NS, [head, tail])
    assert store.put(NS, tail, tail_value).name == "STORED"
    assert store.put(NS, head, head_value).name == "STORED"
    assert store.contains(NS, [head, tail]) == 2


def test_a_default_store_takes_everything_until_its_duel_says_otherwise():
    """`adaptive-sighting` starts open: a fresh or lightly loaded deployment behaves as before admission."""
    store = _store(3, admission=DEFAULT_ADMISSION)
    for tag in range(1, 8):
        assert store.put(NS, *_chunk(tag)).name == "STORED"
    assert store.door.policy.admits_all and store.counters.get("put_refused", 0) == 0


def test_serve_checks_its_admission_flag():
    from tiercache.errors import ConfigError
    from tiercache.server.app import ServeConfig

    assert ServeConfig(admission="always").admission == "always"
    for name, words in (("sometimes", "unknown"), ("min-hits", "counts L1's own hits")):
        with pytest.raises(ConfigError, match=words):
            ServeConfig(admission=name)


def test_two_engines_over_one_server_count_each_others_sightings(tmp_path):
    """Replica A asks for a prefix and stores it: the full server refuses it (its first sighting). Replica B asks
    for the same prefix — its second sighting, though B never asked before — and its store goes in; any replica
    finds it there after."""
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    from tests.support.grpc_clients import NS as FILLER_NS
    from tests.support.grpc_clients import Client, chunks, raw_call
    from tiercache.wire import tiercache_pb2 as pb

    def refused() -> int:
        return pb.StatsReply.FromString(raw_call(server, "Stats", b"")).counters["put_refused"]

    fillers = chunks(4, seed=7)
    filler_bytes = len(ChunkFormat().encode(*fillers[0]))
    server = CacheServerProcess(tmp_path, "--capacity", str(4 * filler_bytes + 1000), "--admission",
                                "second-sighting")
    engines = []
    try:
        filler = Client(server.address, FILLER_NS)
        assert filler.write_chunks(fillers) == ()              # taken while there was room: now it is full
        filler.close()
        a, b, c = engines = [Stack(num_blocks=64, cpu_chunks=2, grpc={"enabled": True, "address": server.address,
                                                                      "retry_interval": 0.2, "timeout": 2.0})
                             for _ in range(3)]
        prompt = a.hasher.hash_blocks(_tokens(5))
        assert not lookup(a, prompt).runs                      # A asks the server: a first sighting
        put(a, "p", seed=5)
        a.offload.drain()
        remote_a = a.lower("grpc")
        assert remote_a.counters.store_rejected == 2 and remote_a.counters.errors == 0 and refused() == 2
        assert not lookup(b, prompt).runs                      # B asks: the second sighting, A's was the first
        _, kv = put(b, "p", seed=5)
        b.offload.drain()
        assert b.lower("grpc").counters.stored == 2 and refused() == 2
        keys = [k for run in lookup(a, prompt).runs for k in run.keys]     # A's own copy, in its L1
        assert remote_a.present(keys) == 2
        assert torch.equal(load(c, prompt), kv)               # a third replica loads it from the server
    finally:
        for engine in engines:
            engine.close()
        server.stop()


# -- Redis: the second-sighting door, which counts lookups (the adaptive one, counting requests, is tested against
# the Python rule in tests/test_redis_adaptive.py) --------------------------------------------------------------

def _meta(tag: int, parent: BlockHash | None = None) -> ChunkMeta:
    """A 1 MiB chunk's description (the door reads keys, parents and sizes only)."""
    return ChunkMeta(NS, BlockHash(bytes([tag]) * 32), 16, "float32", (1 << 18,), parent)


def _full(client) -> None:
    """Fill Redis with evictable keys past its ``maxmemory``: no room for a chunk of 128 KiB or more (what an
    eviction frees beyond the limit is less), and a chunk that is let in evicts some of them."""
    client.config_set("maxmemory-policy", "volatile-lru")
    client.config_set("maxmemory-eviction-tenacity", "100")     # a write evicts all it needs before it runs
    pipe = client.pipeline(transaction=False)
    for i in range(400):
        pipe.set(f"filler:{i}", b"x" * 4096, ex=3600)
    pipe.execute()
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) - 50_000))


def test_redis_takes_everything_while_it_has_room_then_chains_asked_for_twice(redis_server):
    import redis

    from tiercache.tiers.redis_sightings import Sightings

    client = redis.Redis.from_url(redis_server.url)
    sightings = Sightings(client)
    head, tail, other = _meta(1), _meta(2, parent=BlockHash(bytes([1]) * 32)), _meta(3)
    assert sightings.admitted([head, tail, other]) == [True] * 3        # no maxmemory: room for all, unasked
    sightings.sight([tail.key])
    sightings.sight([head.key, tail.key, head.key])                    # a lookup counts once per chunk
    _full(client)
    assert sightings.admitted([head, tail, other]) == [False, False, False]   # the tail's head: seen once
    sightings.sight([head.key])
    assert sightings.admitted([head, tail, other]) == [True, True, False]


def test_redis_history_is_bounded(redis_server):
    import redis

    from tiercache.tiers.redis_sightings import GENERATIONS, MIN_GENERATION, Sightings

    client = redis.Redis.from_url(redis_server.url)
    sightings = Sightings(client)
    first = BlockHash(b"\xff" * 32)
    sightings.sight([first])
    batch = 512
    for start in range(0, 3 * MIN_GENERATION, batch):    # Redis holds nearly nothing: a generation is the least
        sightings.sight([BlockHash(i.to_bytes(8, "big") * 4) for i in range(start, start + batch)])
        assert sum(client.hlen(g) for g in GENERATIONS) <= 2 * (MIN_GENERATION + batch)
    assert not any(client.hexists(g, first[:8]) for g in GENERATIONS)    # fell off: it starts over


def test_two_engines_over_one_redis_count_each_others_sightings(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    _full(client)
    engines = []
    tokens = 2 * BIG_CHUNK
    try:
        a, b, c = engines = [Stack(num_blocks=tokens // BLOCK, cpu_chunks=2, chunk_tokens=BIG_CHUNK,
                                   redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2,
                                          "timeout": 2.0, "admission": "second-sighting"})
                             for _ in range(3)]
        prompt = a.hasher.hash_blocks([5000 + t for t in range(tokens)])     # `put`'s tokens for seed 5
        assert not lookup(a, prompt).runs                      # A's lookup: a first sighting
        put(a, "p", seed=5, num_tokens=tokens)
        a.offload.drain()
        remote_a = a.lower("redis")
        assert remote_a.counters.store_rejected == 2 and remote_a.counters.errors == 0
        keys = [k for run in lookup(a, prompt).runs for k in run.keys]     # A's own copy, in its L1
        values = [a.transport("redis")._rkey(k) for k in keys]
        assert len(keys) == 2 and client.exists(*values) == 0  # never sent
        assert not lookup(b, prompt).runs                      # B's: the second
        _, kv = put(b, "p", seed=5, num_tokens=tokens)
        b.offload.drain()
        assert b.lower("redis").counters.stored == 2 and remote_a.present(keys) == 2
        assert torch.equal(load(c, prompt), kv)
    finally:
        for engine in engines:
            engine.close()
