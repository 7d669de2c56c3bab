"""Manager (scheduler side) + a worker's transfer engine and L1 slab on CPU: lookup, store and load round
trips, told step by step."""
import random

import torch

from tests.conftest import BLOCK, CHUNK, Stack
from tiercache.contracts.plan import Failure, Priority

BPC = CHUNK // BLOCK


def run_request(s: Stack, req: str, tokens: list[int], seed: int) -> tuple[list, list[int]]:
    """Allocate blocks for a request, 'compute' its KV (random by seed), return (hashes, block ids)."""
    hashes = s.hasher.hash_blocks(tokens)
    s.blocks.allocate(req, len(tokens))
    ids = s.blocks.block_ids(req)
    s.fill(req, ids, seed)
    return hashes, ids


def test_store_then_load_is_bit_exact(stack):
    tokens = list(range(3 * CHUNK + 5))                 # 3 full chunks and a tail
    hashes, ids = run_request(stack, "a", tokens, seed=1)
    expect = stack.kv.kv[:, :, ids[:3 * BPC]].clone()

    # Store: every full chunk goes to L1, and the partial one of the tail's full block (keys.partial_chunks).
    (result,) = stack.run(stack.manager.plan_store(hashes, ids))
    assert result.ok and stack.cpu.num_chunks == 4
    stack.blocks.free("a")

    # Wipe L0 so only L1 can bring the bytes back.
    stack.kv.kv.zero_()
    lookup = stack.manager.lookup(hashes)
    assert lookup.num_hit_blocks == 3 * BPC + 1 and lookup.num_loadable_tokens == 3 * CHUNK + BLOCK
    assert [(r.tier, r.first_chunk, len(r.keys)) for r in lookup.runs] == [("cpu", 0, 4)]

    stack.blocks.allocate("b", len(tokens))
    new_ids = stack.blocks.block_ids("b")
    results = stack.run(stack.manager.plan_load(lookup, new_ids))
    assert results and all(r.ok for r in results)
    assert torch.equal(stack.kv.kv[:, :, new_ids[:3 * BPC]], expect)
    assert stack.manager.num_in_flight == 0


def test_scattered_blocks_round_trip():
    s = Stack(num_blocks=64)
    try:
        tokens = list(range(2 * CHUNK))
        hashes = s.hasher.hash_blocks(tokens)
        ids = random.Random(3).sample(range(64), 2 * BPC)
        s.fill("x", ids, seed=5)
        expect = s.kv.kv[:, :, ids].clone()
        s.run(s.manager.plan_store(hashes, ids))
        s.kv.kv.zero_()
        other = random.Random(4).sample(range(64), 2 * BPC)
        s.run(s.manager.plan_load(s.manager.lookup(hashes), other))
        assert torch.equal(s.kv.kv[:, :, other], expect)
    finally:
        s.close()


def test_load_skips_blocks_already_in_l0(stack):
    """L0 holds the first 6 blocks (mid-chunk 1): only blocks 6.. are loaded, into their own slots."""
    tokens = list(range(3 * CHUNK))
    hashes, ids = run_request(stack, "a", tokens, seed=2)
    expect = stack.kv.kv[:, :, ids].clone()
    stack.run(stack.manager.plan_store(hashes, ids))

    lookup = stack.manager.lookup(hashes, num_computed_blocks=6)
    assert lookup.num_computed_blocks == 6
    assert lookup.runs[0].first_chunk == 1 and lookup.num_hit_blocks == 3 * BPC
    assert lookup.num_loadable_tokens == (3 * BPC - 6) * BLOCK

    marker = torch.full_like(stack.kv.kv[:, :, 0], 7.0)
    stack.kv.kv[:, :, ids] = marker.unsqueeze(2)
    stack.run(stack.manager.plan_load(lookup, ids))
    assert torch.equal(stack.kv.kv[:, :, ids[:6]], marker.unsqueeze(2).expand_as(expect[:, :, :6]))
    assert torch.equal(stack.kv.kv[:, :, ids[6:]], expect[:, :, 6:])


def test_lookup_stops_at_the_first_missing_chunk(stack):
    tokens = list(range(3 * CHUNK))
    hashes, ids = run_request(stack, "a", tokens, seed=3)
    stack.run(stack.manager.plan_store(hashes, ids))
    stack.cpu.delete([hashes[2 * BPC - 1]])          # drop chunk 1
    lookup = stack.manager.lookup(hashes)
    assert lookup.num_hit_blocks == BPC and len(lookup.runs) == 1
    other = stack.hasher.hash_blocks([t + 1 for t in tokens])
    assert stack.manager.lookup(other).num_hit_blocks == 0


def test_stores_skip_present_chunks(stack):
    tokens = list(range(2 * CHUNK))
    hashes, ids = run_request(stack, "a", tokens, seed=4)
    plan = stack.manager.plan_store(hashes, ids)
    assert stack.manager.num_in_flight == 1
    assert stack.manager.lookup(hashes).num_hit_blocks == 0   # invisible until every rank reports the write
    stack.run(plan)
    assert stack.manager.plan_store(hashes, ids) is None      # nothing new to store
    longer = stack.hasher.hash_blocks(tokens + list(range(CHUNK)))
    stack.blocks.allocate("b", 3 * CHUNK)
    plan = stack.manager.plan_store(longer, stack.blocks.block_ids("b"))
    assert len(plan.chunks) == 1
    stack.run(plan)
    assert stack.cpu.num_chunks == 3


def test_a_failing_handler_becomes_a_failed_result(stack, monkeypatch):
    """Fault injected at the transfer boundary: the store fails, its slots are released, nothing raises."""
    tokens = list(range(2 * CHUNK))
    hashes, ids = run_request(stack, "a", tokens, seed=5)

    def broken(plan, progress=None):
        raise OSError("injected copy failure")

    engine = stack.offload.workers[0].stack.engine
    monkeypatch.setitem(engine._handlers, ("device", "cpu"), broken)
    (result,) = stack.run(stack.manager.plan_store(hashes, ids))
    assert not result.ok and "injected" in result.error and len(result.failed) == 2
    assert set(result.failed.values()) == {Failure.IO}
    assert stack.cpu.num_chunks == 0 and stack.cpu.used_bytes == 0 and stack.cpu.counters.errors == 2
    assert engine.stats()["device_host"]["failed"] == 1


def test_l1_capacity_bounds_stores_and_evicts_tails_first():
    s = Stack(num_blocks=64, cpu_chunks=2)
    try:
        # Four chunks into room for two: the head chunks get the slots, the rest are dropped.
        tokens = list(range(4 * CHUNK))
        hashes = s.hasher.hash_blocks(tokens)
        s.blocks.allocate("a", len(tokens))
        s.run(s.manager.plan_store(hashes, s.blocks.block_ids("a")))
        assert s.cpu.num_chunks == 2 and s.cpu.used_bytes <= s.cpu.capacity_bytes
        assert s.cpu.counters.store_rejected == 2
        assert s.manager.lookup(hashes).num_hit_blocks == 2 * BPC

        # One chunk of another prompt evicts a's tail chunk, not its head.
        other = s.hasher.hash_blocks([t + 10_000 for t in range(CHUNK)])
        s.blocks.allocate("b", CHUNK)
        s.run(s.manager.plan_store(other, s.blocks.block_ids("b")))
        assert s.cpu.counters.evicted == 1
        assert s.manager.lookup(hashes).num_hit_blocks == BPC
        assert s.manager.lookup(other).num_hit_blocks == BPC
    finally:
        s.close()


def test_priorities_loads_before_stores():
    import threading

    from tiercache.contracts.plan import JobId, TransferPlan
    from tiercache.transfer.engine import TransferEngine

    engine = TransferEngine(workers=1)
    gate = threading.Event()
    order = []
    running = threading.Event()

    def handler(plan, progress=None):
        running.set()
        gate.wait()
        order.append(plan.priority)

    engine.register("device", "cpu", handler)
    try:
        first = TransferPlan(JobId(1), "device", "cpu", "device_host", Priority.STORE, (), 0)
        engine.submit(first)        # occupies the single worker
        assert running.wait(10)
        plans = [TransferPlan(JobId(2 + i), "device", "cpu", "device_host", p, (), 0)
                 for i, p in enumerate((Priority.STORE, Priority.PREFETCH, Priority.LOAD))]
        for p in plans:
            engine.submit(p)
        gate.set()
        engine.wait([p.job_id for p in plans] + [first.job_id], timeout=5)
        assert order == [Priority.STORE, Priority.LOAD, Priority.PREFETCH, Priority.STORE]
    finally:
        engine.close()


def test_the_most_served_chunks_are_reported_with_their_load_counts(stack):
    from tests.support.stack_ops import load, put
    a, _ = put(stack, "a", seed=1)
    b, _ = put(stack, "b", seed=2, chunks=1)
    for hashes, times in ((a, 3), (b, 1)):
        for _ in range(times):
            assert load(stack, hashes) is not None
    hot = stack.manager.stats()["hot_chunks"]
    a_keys = {k.hex() for k in stack.manager.lookup(a).runs[0].keys}
    assert {h["key"] for h in hot[:2]} == a_keys and [h["loads"] for h in hot] == [3, 3, 1]


def test_hot_chunk_counts_stay_bounded_and_exact_for_the_hot_ones():
    from tiercache.hot_chunks import HotChunks
    hot = HotChunks(keep=4)
    for i in range(1000):
        hot.add([b"system-prompt", b"doc-%d" % (i % 3), b"one-off-%d" % i])
    assert len(hot._counts) <= 16 * 4
    assert hot.top(4)[0] == (b"system-prompt", 1000)
    assert sorted(n for _, n in hot.top(4)[1:]) == [333, 333, 334]
