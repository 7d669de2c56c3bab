"""KV events from the reference engine and a router's index of them: the wire format, exact keys, and an index
that stays whole when batches are lost, repeated, or a replica restarts."""
import asyncio

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'tiercache[fleet]')")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'tiercache[fleet]')")

from support.engine_runs import offload  # noqa: E402

from tiercache.config import TierCacheConfig  # noqa: E402
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tiercache.fleet.descriptor import EventEndpoints, ReplicaDescriptor  # noqa: E402
from tiercache.fleet.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    decode,
    encode,
)
from tiercache.fleet.prefix_index import PromptKeys, ReplicaIndex, TierCacheKeys  # noqa: E402
from tiercache.fleet.subscriber import EventFollower  # noqa: E402


def _offload() -> TierCacheConfig:
    return offload()           # 16-token blocks, 64-token chunks, an L1


def _descriptor(engine: LLMEngine, chunk_tokens: int) -> ReplicaDescriptor:
    return ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=engine.hasher.block_size,
                             chunk_tokens=chunk_tokens, hash=engine.hasher.hash_name, seed=engine.hasher.seed.hex())


def test_the_wire_format_is_vllms():
    vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed")
    theirs = vllm_events.KVEventBatch(ts=1.5, events=[
        vllm_events.BlockStored(block_hashes=[b"a" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=16,
                                lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",)]),
        vllm_events.BlockRemoved(block_hashes=[b"a" * 32], medium="GPU"), vllm_events.AllBlocksCleared()])
    ours = decode(msgspec.msgpack.encode(theirs))
    assert [type(e).__name__ for e in ours.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert ours.events[0].block_hashes == [b"a" * 32] and ours.events[0].token_ids == [1, 2]
    assert ours.events[0].extra_keys == [["salt"]] and ours.ts == 1.5
    back = msgspec.msgpack.decode(encode(ours), type=vllm_events.KVEventBatch)
    assert back.events[1].block_hashes == [b"a" * 32] and back.events[1].medium == "GPU"


def test_the_engine_publishes_the_keys_a_router_computes_for_the_prompt():
    chunk_tokens = 64
    with LLMEngine(engine_cfg=EngineConfig(num_blocks=64), offload=_offload()) as engine:
        engine.watch_kv_events()
        prompt = list(range(1, 200))
        seq = engine.add_request(prompt, SamplingParams(max_tokens=1))
        engine.run()
        engine.connector.drain()             # write-through stores end after the request did
        events = engine.take_kv_events()
        stored = {e.medium.value: set() for e in events}
        for e in events:
            (stored[e.medium.value].update if e.stored else stored[e.medium.value].difference_update)(e.keys)
        keys = TierCacheKeys(_descriptor(engine, chunk_tokens)).keys(prompt, "")
        assert set(keys.block_hashes) <= stored["device"]
        assert keys.block_hashes == seq.block_hashes[:len(keys.block_hashes)]
        assert set(keys.chunk_keys) == stored["cpu"] and len(keys.chunk_keys) == len(prompt) // chunk_tokens
        held = {e.medium.value: set(e.keys) for e in engine.held_kv()}
        assert held["device"] == set(engine.pool.cached) and held["cpu"] == stored["cpu"]


def test_a_cache_salt_moves_every_key_and_the_router_follows_it():
    with LLMEngine(engine_cfg=EngineConfig(num_blocks=64), offload=_offload()) as engine:
        prompt = list(range(1, 100))
        plain = engine.add_request(prompt, SamplingParams(max_tokens=1))
        salted = engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
        other = engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-b")
        assert not set(plain.block_hashes) & set(salted.block_hashes)
        assert not set(salted.block_hashes) & set(other.block_hashes)
        scheme = TierCacheKeys(_descriptor(engine, 64))
        assert scheme.keys(prompt, "tenant-a").block_hashes == salted.block_hashes
        outs = engine.run()
        assert {s.seq_id for s in outs} == {plain.seq_id, salted.seq_id, other.seq_id}
        assert salted.metrics.l0_hit_tokens == 0 and other.metrics.l0_hit_tokens == 0   # nothing shared


def test_the_index_splits_a_prompt_between_the_pool_and_the_fastest_tier():
    scheme = TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                             chunk_tokens=64, seed=(b"s" * 32).hex()))
    keys = scheme.keys(list(range(300)), "")                 # 18 blocks, 4 chunks (256 tokens)
    index = ReplicaIndex()
    index.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=keys.block_hashes[:5], parent_block_hash=None, token_ids=[], block_size=16,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=keys.chunk_keys[:3], parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="DISK", lora_name=None),
        BlockStored(block_hashes=keys.chunk_keys[1:2], parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="CPU", lora_name=None)]))
    cached = index.cached(keys, scheme)
    assert cached.engine == 80                               # 5 blocks in the pool
    # chunk 0 (tokens 0-63) is all in the pool; chunk 1 (64-127) counts from the pool's end, at memory's rate;
    # chunk 2 (128-191) from disk; chunk 3 nowhere
    assert cached.tiers == {"CPU": 128 - 80, "DISK": 64}
    assert cached.total == 192
    index.apply(KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=keys.chunk_keys[1:2], medium="DISK")]))
    assert index.cached(keys, scheme).tiers == {"CPU": 48, "DISK": 64}   # still in memory
    index.apply(KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=keys.chunk_keys[1:2], medium="CPU")]))
    assert index.cached(keys, scheme).total == 80            # the chain breaks at chunk 1
    whole = PromptKeys(64, keys.block_hashes[:4], keys.chunk_keys[:1])
    assert index.cached(whole, scheme).total == 63           # never the last token: the engine computes one
    index.apply(KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert index.cached(keys, scheme).total == 0


def test_blocks_of_requests_still_in_flight_on_a_replica_count_as_in_its_pool_until_they_finish():
    scheme = TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                             chunk_tokens=64, seed=(b"s" * 32).hex()))
    first, second = scheme.keys(list(range(300)), ""), scheme.keys(list(range(200)) + [7] * 100, "")
    index = ReplicaIndex()
    index.apply(KVEventBatch(ts=0, events=_stored(first.block_hashes[:2])))
    assert index.cached(second, scheme).engine == 32
    index.hold(first.block_hashes)                          # two requests of that prompt sent, not finished
    index.hold(first.block_hashes)
    assert index.cached(second, scheme).engine == 192       # the 12 blocks the two prompts share
    index.release(first.block_hashes)
    assert index.cached(second, scheme).engine == 192       # one still computing them
    index.release(first.block_hashes)
    assert index.cached(second, scheme).engine == 32        # finished: only what the events said stays
    assert index.in_flight == {}


def test_what_another_replica_stored_in_a_shared_tier_counts_at_the_remote_rate():
    scheme = TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                             chunk_tokens=64, seed=(b"s" * 32).hex()))
    keys = scheme.keys(list(range(200)), "")                 # 3 whole chunks
    stored_by_other, own = ReplicaIndex(), ReplicaIndex()
    stored_by_other.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=keys.chunk_keys, parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="REMOTE", lora_name=None)]))
    own.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=keys.chunk_keys[:1], parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="CPU", lora_name=None)]))
    assert own.cached(keys, scheme).tiers == {"CPU": 64}
    assert own.cached(keys, scheme, [stored_by_other.media["REMOTE"]]).tiers == {"CPU": 64, "REMOTE": 128}


def test_a_partial_chunk_another_replica_stored_counts_where_the_whole_chunks_end_when_lookups_take_them():
    def scheme(partial):
        return TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                               chunk_tokens=64, seed=(b"s" * 32).hex(), partial_chunks=partial))
    history = list(range(120))                                # a previous turn: a whole chunk, then 3 blocks
    tail_key = scheme(True).keys(history, "").block_hashes[6]       # its partial chunk's key: its 7th block
    other = ReplicaIndex()
    other.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=[*scheme(True).keys(history, "").chunk_keys[:1], tail_key], parent_block_hash=None,
                    token_ids=[], block_size=64, lora_id=None, medium="REMOTE", lora_name=None)]))
    turn = history + [7] * 200                                # the next turn runs past it
    for partial, expect in ((True, 112), (False, 64)):
        s = scheme(partial)
        assert ReplicaIndex().cached(s.keys(turn, ""), s, [other.media["REMOTE"]]).tiers == {"REMOTE": expect}


class FaultyPublisher(EventPublisher):
    """Fault injection at the socket: batches numbered in ``drop`` are kept for replay but never sent live;
    those in ``twice`` are sent twice."""

    def __init__(self, *args, drop=(), twice=(), **kwargs) -> None:
        self.drop, self.twice = set(drop), set(twice)
        super().__init__(*args, **kwargs)

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.drop:
            super()._send(seq, payload)
            if seq in self.twice:
                super()._send(seq, payload)


def _stored(keys: list[bytes], medium: str = "GPU") -> list:
    return [BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium=medium, lora_name=None)]


async def _until(predicate, publisher: EventPublisher, timeout: float = 20.0) -> None:
    """Wait for ``predicate``, publishing empty batches meanwhile (what an idle replica's heartbeat does)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "the follower did not catch up"
        publisher.publish([])
        await asyncio.sleep(0.05)


def _follow(publisher: EventPublisher, index: ReplicaIndex, resync=None) -> EventFollower:
    return EventFollower("replica", EventEndpoints(publisher.endpoint, publisher.replay_endpoint), index, resync)


def test_lost_and_repeated_batches_are_replayed_and_dropped():
    async def scenario():
        publisher = FaultyPublisher()
        index = ReplicaIndex()
        for i in range(3):                                  # before the router joined: replayed from 0
            publisher.publish(_stored([bytes([i]) * 32]))
        follower = _follow(publisher, index)
        task = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(follower.synced.wait(), 10)
            await _until(lambda: follower.counters.batches > follower.counters.replayed, publisher)  # live now
            base = follower.last + 1
            publisher.drop = {base + 1, base + 2, base + 5}      # two gaps
            publisher.twice = {base + 3, base + 6}               # two duplicates
            for i in range(3, 10):
                publisher.publish(_stored([bytes([i]) * 32]))
            publisher.publish([BlockRemoved(block_hashes=[bytes([4]) * 32], medium="GPU")])
            await _until(lambda: follower.last is not None and follower.last >= base + 7, publisher)
            assert index.media["GPU"] == {bytes([i]) * 32 for i in range(10)} - {bytes([4]) * 32}
            # the first gap's replay brings everything kept after it; the live copies then count as duplicates
            assert follower.counters.gaps >= 1 and follower.counters.duplicates >= 2
            assert follower.counters.resyncs == 0
        finally:
            task.cancel()
            publisher.close()

    asyncio.run(scenario())


def test_history_the_replica_no_longer_keeps_is_resynced_from_what_it_holds():
    async def scenario():
        publisher = FaultyPublisher(buffer_batches=2, drop={2, 3, 4, 5})
        index = ReplicaIndex()
        holds = {bytes([i]) * 32 for i in range(8)}
        calls = []

        async def announce():
            calls.append(1)
            return publisher.publish([AllBlocksCleared(), *_stored(sorted(holds))])

        follower = _follow(publisher, index, announce)
        task = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(follower.synced.wait(), 10)
            for i in range(8):                               # seq 0..7: 2..5 lost, and the buffer keeps only 2
                publisher.publish(_stored([bytes([i]) * 32]))
            await _until(lambda: calls and follower.last is not None and follower.last >= 8, publisher)
            assert index.media["GPU"] == holds
            assert follower.counters.resyncs == 1
        finally:
            task.cancel()
            publisher.close()

    asyncio.run(scenario())


def test_a_restarted_replica_starts_its_index_again():
    async def scenario():
        first = EventPublisher()
        port, replay_port = (int(e.rsplit(":", 1)[1]) for e in (first.endpoint, first.replay_endpoint))
        index = ReplicaIndex()
        follower = _follow(first, index)
        task = asyncio.create_task(follower.run())
        second = None
        try:
            await asyncio.wait_for(follower.synced.wait(), 10)
            for i in range(5):
                first.publish(_stored([bytes([i]) * 32]))
            await _until(lambda: follower.last is not None and follower.last >= 4, first)
            first.close()
            second = EventPublisher(port=port, replay_port=replay_port)   # numbering starts at 0 again
            second.publish(_stored([b"n" * 32]))
            await _until(lambda: follower.counters.restarts == 1 and b"n" * 32 in index.media.get("GPU", ()),
                         second)
            assert index.media["GPU"] == {b"n" * 32}
        finally:
            task.cancel()
            (second or first).close()

    asyncio.run(scenario())


def test_a_replica_measures_its_load_rates_per_medium_and_a_router_takes_them():
    """Loads from L1 (and a disk under it) into the pool are timed per route; the descriptor carries tokens/s
    per medium, and the router's replica weighs cached tokens by them instead of the set defaults."""
    from support.engine_runs import run_sequential, shared_prompts

    from tiercache.engine.openai_api import measured_load_rates
    from tiercache.fleet.load_rates import load_tokens_per_s
    from tiercache.fleet.replicas import Replica
    from tiercache.fleet.routing import ReplicaRates

    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=_offload()) as engine:
        assert measured_load_rates(engine) == {}                     # nothing loaded yet: nothing claimed
        run_sequential(engine, shared_prompts(n=6))                  # later requests load the prefix from L1
        rates = measured_load_rates(engine)
    assert rates.keys() == {"CPU"} and rates["CPU"] > 0
    # a lower tier's loads add its promotion to L1 to the copy into the pool
    transfers = {"device_host": {"routes": {"cpu→device": {"seconds": 1.0, "blocks": 1000}}},
                 "host_disk": {"routes": {"disk→cpu": {"seconds": 3.0, "blocks": 1000},
                                          "redis→cpu": {"seconds": 1.0, "blocks": 8}}}}    # too few to tell
    assert load_tokens_per_s(transfers, "cpu", {"disk": "DISK", "redis": "REMOTE"}, 16) == {
        "CPU": 16_000.0, "DISK": 4_000.0}
    replica = Replica("r", "http://r", ReplicaRates(20_000.0, {"CPU": 400_000.0, "DISK": 150_000.0}))
    replica.learn_rates(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                          chunk_tokens=64, load_tokens_per_s={"DISK": 4_000.0, "GPU": -1}))
    assert replica.rates.load == {"CPU": 400_000.0, "DISK": 4_000.0}


def test_a_replica_times_its_prefill_before_serving_and_a_router_takes_it_until_it_has_timed_its_own():
    """`LLMEngine.measure_prefill` runs the model over the empty pool (nothing cached, nothing left allocated, the
    outputs after it those of an engine that never ran it); the descriptor carries both parts, the router's
    replica starts from them instead of its configured guess, and its own first measurement replaces them."""
    from support.engine_runs import shared_prompts

    from tiercache.errors import ConfigError
    from tiercache.fleet.replicas import Replica
    from tiercache.fleet.routing import ReplicaRates

    prompts = shared_prompts(n=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = []
    for profiled in (False, True):
        with LLMEngine(engine_cfg=EngineConfig(num_blocks=256)) as engine:
            if profiled:
                cost = engine.measure_prefill()
                assert cost is not None and cost.tokens_per_s > 0 and cost.attention_s_per_pair >= 0
                assert engine.pool.num_free == 256 and not engine.pool.cached
            seqs = [engine.add_request(p, params) for p in prompts]
            engine.run()
            outputs.append([s.output_token_ids for s in seqs])
            assert engine.measure_prefill() is None      # its pool holds the prompts' blocks now: not timed again
    assert outputs[0] == outputs[1]

    descriptor = ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16, chunk_tokens=64,
                                   prefill_tokens_per_s=2_500.0, prefill_attention_s_per_pair=1e-8)
    assert ReplicaDescriptor.from_dict(descriptor.as_dict(), "r") == descriptor
    with pytest.raises(ConfigError, match="r.prefill_tokens_per_s"):
        ReplicaDescriptor.from_dict({**descriptor.as_dict(), "prefill_tokens_per_s": -1}, "r")
    replica = Replica("r", "http://r", ReplicaRates(20_000.0))
    replica.learn_rates(descriptor)
    assert (replica.rates.prefill, replica.rates.attention_s) == (2_500.0, 1e-8)
    replica.learn_prefill(300, 2000, 0.2)                   # the router's own first token: 1,500 tokens/s
    replica.learn_rates(descriptor)                          # the next health check does not undo it
    assert (replica.rates.prefill, replica.rates.attention_s) == (1_500.0, 0.0)


def test_a_hybrid_replicas_hit_ends_at_its_last_resume_point_short_of_the_last_token():
    """A replica whose model has sliding windows or states (``resume_points``) resumes at a chunk whose resume
    point it holds: the router predicts the same cut, and never counts the chunk that holds the last token."""
    from tiercache.contracts.groups import resume_key

    scheme = TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                             chunk_tokens=64, seed=(b"s" * 32).hex(), resume_points=True))
    keys = scheme.keys(list(range(300)), "")                 # four whole chunks (256 tokens)
    index = ReplicaIndex()
    index.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=keys.chunk_keys[:4] + [resume_key(keys.chunk_keys[1])], parent_block_hash=None,
                    token_ids=[], block_size=64, lora_id=None, medium="DISK", lora_name=None)]))
    assert index.cached(keys, scheme).tiers == {"DISK": 128}      # chunks 0 and 1: chunk 1 has a resume point
    index.apply(KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=[resume_key(keys.chunk_keys[3])], parent_block_hash=None, token_ids=[],
                    block_size=64, lora_id=None, medium="CPU", lora_name=None)]))
    assert index.cached(keys, scheme).total == 256
    whole = PromptKeys(256, keys.block_hashes[:16], keys.chunk_keys[:4])
    assert index.cached(whole, scheme).total == 128          # chunk 3 would hold the last token: cut to chunk 1
    plain = TierCacheKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="tiercache", block_size=16,
                                            chunk_tokens=64, seed=(b"s" * 32).hex()))
    assert index.cached(keys, plain).total == 256             # without resume points every chunk counts
