"""A request's partial last chunk (``keys.partial_chunks``): stored when it finishes (if it continues, by default),
found by the next request that runs past it — from L1, Redis, or a shared `tiercache serve` — and loaded bit-exact.

A conversation's next turn resends the history and the reply; the history ended inside a chunk, so without
these the turn's lookup stops at the last whole chunk and a replica that did not serve the previous turn
recomputes the rest of it (benchmarks/RESULTS.md, "What the engines spend with a shared server")."""
import pytest
import torch

from tests.conftest import BLOCK, CHUNK, Stack
from tests.support.stack_ops import lookup, put
from tiercache.contracts.keys import tail_keys

BPC = CHUNK // BLOCK                      # 4 blocks a chunk
HISTORY = CHUNK + 3 * BLOCK               # one whole chunk, then three blocks of the next


def test_tail_keys_are_the_shorter_chunks_at_a_position_longest_first():
    hashes = [bytes([i]) * 32 for i in range(11)]     # 2 whole chunks of 4 blocks, then 3 blocks
    assert tail_keys(hashes, 4, 0) == [hashes[2], hashes[1], hashes[0]]    # 3, 2, 1 blocks
    assert tail_keys(hashes, 4, 2) == [hashes[9], hashes[8]]               # the last chunk has 3: 2, 1
    assert tail_keys(hashes, 4, 3) == []


def _store_history(s: Stack, seed: int):
    """A finished turn: its history's whole chunk and its partial one stored to L1; (tokens, kv of them)."""
    _, kv = put(s, "turn", seed, num_tokens=HISTORY)
    return [seed * 1000 + t for t in range(HISTORY)], kv


def _next_turn(s: Stack, tokens: list[int]) -> list:
    """The next turn's block hashes: the history, then a reply and a question (two more whole chunks)."""
    return s.hasher.hash_blocks(tokens + [7] * (2 * CHUNK - 3 * BLOCK) + [9] * CHUNK)


def _load(s: Stack, hashes, found):
    s.blocks.allocate("next", len(hashes) * BLOCK)
    ids = s.blocks.block_ids("next")
    s.kv.kv[:, :, ids] = 0
    s.run(s.manager.plan_load(found, ids))
    got = s.kv.kv[:, :, ids[:found.num_hit_blocks]].clone()
    s.blocks.free("next")
    return got


def _partial(**cfg) -> Stack:
    return Stack(num_blocks=64, cpu_chunks=8, **cfg)      # keys.partial_chunks: "continuing", the default


def test_the_next_turn_finds_the_previous_turns_partial_chunk_in_l1_and_loads_it_bit_exact():
    s = _partial()
    try:
        tokens, kv = _store_history(s, seed=1)
        hashes = _next_turn(s, tokens)
        found = lookup(s, hashes)
        assert found.num_hit_blocks == HISTORY // BLOCK                  # the whole chunk and the three blocks
        assert [len(r.keys) for r in found.runs] == [2] and found.num_blocks == HISTORY // BLOCK
        assert torch.equal(_load(s, hashes, found), kv)
        assert s.cpu.counters.tail_hits == 1
    finally:
        s.close()


def test_with_partial_chunks_off_the_lookup_stops_at_the_last_whole_chunk():
    s = Stack(num_blocks=64, cpu_chunks=8, keys={"partial_chunks": "off"})
    try:
        tokens, _ = _store_history(s, seed=1)
        assert lookup(s, _next_turn(s, tokens)).num_hit_blocks == BPC
    finally:
        s.close()


def _from_remote_only(s: Stack, tier: str):
    """Store a history, drop it from L1: the next turn's whole chunk and its tail come from ``tier``."""
    tokens, kv = _store_history(s, seed=2)
    s.offload.drain()
    s.cpu.delete(s.cpu.held_keys())
    hashes = _next_turn(s, tokens)
    found = lookup(s, hashes)
    assert [(r.tier, r.first_chunk, len(r.keys)) for r in found.runs] == [(tier, 0, 2)]
    assert found.num_hit_blocks == HISTORY // BLOCK
    assert s.lower(tier).counters.tail_hits == 1
    assert s.manager.promote(found)                      # up into L1, the tail as a three-block chunk
    s.offload.drain()
    found = s.manager.in_l1(lookup(s, hashes))
    assert found.num_hit_blocks == HISTORY // BLOCK
    assert torch.equal(_load(s, hashes, found), kv)


def test_the_tail_comes_from_redis_in_the_same_answer_as_the_whole_chunks(redis_server):
    s = _partial(redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2, "timeout": 0.5})
    try:
        _from_remote_only(s, "redis")
    finally:
        s.close()


def test_the_tail_comes_from_a_shared_server_and_contains_answers_each_key(cache_server):
    s = _partial(grpc={"enabled": True, "address": cache_server.address, "retry_interval": 0.2, "timeout": 1.0})
    try:
        _from_remote_only(s, "grpc")
        index = s.lower("grpc")
        keys = lookup(s, _next_turn(s, list(range(2000, 2000 + HISTORY)))).runs[0].keys
        absent = bytes(32)
        assert index._present_each([absent, *keys, absent], index._storage) == [False, True, True, False]
    finally:
        s.close()


def _turns(cfg, continues: bool):
    """Engine one serves a conversation's first turn; engine two, sharing only the server, its second. The
    second's sequence, and the tokens an engine without tiers produces for it."""
    from tiercache.engine import EngineConfig, LLMEngine, SamplingParams

    history = [256] + [32 + (i * 7) % 90 for i in range(100)]        # 101 tokens: one 64-token chunk and 37
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as plain:
        first = plain.add_request(history, params)
        plain.run()
        turn = history + first.output_token_ids + [40 + i % 50 for i in range(40)]
        expect = plain.add_request(turn, params)
        plain.run()
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as one:
        seq = one.add_request(history, params, continues=continues)
        one.run()
        assert seq.output_token_ids == first.output_token_ids
        tail_stores = one.connector.scheduler.counters.tail_stores
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as two:
        seq = two.add_request(turn, params)
        two.run()
        assert seq.output_token_ids == expect.output_token_ids
    return seq, tail_stores


def _shared(cache_server, partial_chunks="continuing"):
    """Engines on the shared server; each setting's chunks under a namespace of its own (a fresh server)."""
    from tests.support.engine_runs import offload

    cfg = offload(grpc={"enabled": True, "address": cache_server.address, "retry_interval": 0.2, "timeout": 1.0})
    return cfg.replace(keys={"block_size": 16, "chunk_tokens": 64, "partial_chunks": partial_chunks,
                             "tenant_salt": partial_chunks})


def test_a_finished_request_that_continues_stores_its_partial_chunk_and_another_engine_loads_it(cache_server):
    seq, tail_stores = _turns(_shared(cache_server), continues=True)
    assert tail_stores == 1
    # history + 11 of its 12 output tokens were computed by engine one: 112 tokens, 7 whole blocks
    assert seq.metrics.external_hit_tokens == 112


def test_one_that_does_not_continue_stores_its_partial_chunk_only_when_every_request_does(cache_server):
    seq, tail_stores = _turns(_shared(cache_server), continues=False)
    assert tail_stores == 0 and seq.metrics.external_hit_tokens == 64      # the whole chunk only
    seq, tail_stores = _turns(_shared(cache_server, "all"), continues=False)
    assert tail_stores == 1 and seq.metrics.external_hit_tokens == 112


def test_a_bad_partial_chunks_value_names_the_field():
    from tiercache.config import TierCacheConfig
    from tiercache.errors import ConfigError

    with pytest.raises(ConfigError, match="partial_chunks"):
        TierCacheConfig().replace(keys={"partial_chunks": "sometimes"})


def test_a_server_from_before_each_is_read_as_its_leading_run_and_nothing_more(cache_server, monkeypatch):
    """An older `tiercache serve` ignores ``each`` and answers the leading count alone (injected at the RPC
    boundary): the keys in that run are there, the rest count as absent — a tail missed, never one invented."""
    from tiercache.tiers.grpc_index import GrpcIndex
    from tiercache.wire import tiercache_pb2 as pb

    index = GrpcIndex(cache_server.address)
    try:
        monkeypatch.setattr(index, "_contains", lambda keys, storage, each: [pb.ContainsReply(present=2)])
        assert index._present_each([bytes([i]) * 32 for i in range(4)], [b"n" * 16]) == [True, True, False, False]
    finally:
        index.close()
