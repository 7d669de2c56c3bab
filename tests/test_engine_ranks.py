"""The reference engine with two simulated tensor-parallel ranks: each holds half of the KV heads, with its own
L1 slab, chunk files and remote values, and passes the scheduler side nothing but plain data.

Told as a deployment would live it: outputs never change; each rank files its own share; a TP=2 and a TP=1
deployment on one disk path never read each other's chunks; a failure on one rank is a failure of the job
(the request recomputes); every tier together works; a swap copy stays in L1; replicated KV (MLA) is stored
once and read by both ranks.
"""
import torch

from tests.conftest import BLOCK, CHUNK, SMALL
from tests.support.engine_runs import assert_back_to_baseline, offload, run_sequential, shared_prompts
from tiercache.contracts.keys import chunk_keys
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams
from tiercache.wire.chunk_format import HEADER_BYTES


def reference(prompts):
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        return [s.output_token_ids for s in run_sequential(engine, prompts)]


def engine(tp: int, cfg, **engine_cfg) -> LLMEngine:
    return LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False, tensor_parallel_size=tp, **engine_cfg),
                     offload=cfg)


def with_disk(path, **extra):
    return offload(disk={"enabled": True, "path": str(path), "write_mode": "write-through"}, **extra)


def chunk_files(root):
    """Chunk files per storage-digest directory (one directory per rank and deployment)."""
    return {d.name: sorted(f.name for f in d.rglob("*.chunk")) for d in root.iterdir() if d.is_dir()}


def test_two_ranks_give_the_same_tokens_and_each_files_its_own_half(tmp_path):
    prompts = shared_prompts(n=4)
    expect = reference(prompts)
    with engine(2, with_disk(tmp_path)) as two:
        seqs = run_sequential(two, prompts)
        assert [s.output_token_ids for s in seqs] == expect
        assert [s.metrics.external_hit_tokens for s in seqs[1:]] == [192] * 3       # L1, on both ranks
        stats = two.stats()["connector"]
        assert stats["ranks"] == 2 and stats["tiers"]["cpu"]["loaded"] == 9          # counted per chunk, not per rank
        assert_back_to_baseline(two)
    files = chunk_files(tmp_path)
    assert len(files) == 2 and len({tuple(names) for names in files.values()}) == 1  # same chunks, one dir per rank
    sizes = {f.stat().st_size for f in tmp_path.rglob("*.chunk")}
    with engine(1, with_disk(tmp_path / "tp1")) as one:
        run_sequential(one, prompts[:1])
    (one_size,) = {f.stat().st_size for f in (tmp_path / "tp1").rglob("*.chunk")}
    # each rank holds half the heads
    assert len(sizes) == 1 and (one_size - HEADER_BYTES) == 2 * (sizes.pop() - HEADER_BYTES)


def test_deployments_of_two_tp_sizes_share_a_disk_path_and_never_read_each_others_chunks(tmp_path):
    prompts = shared_prompts(n=2)
    expect = reference(prompts)
    for tp in (2, 1):
        with engine(tp, with_disk(tmp_path)) as first:
            seqs = run_sequential(first, prompts[:1])
            assert seqs[0].output_token_ids == expect[0]
            assert seqs[0].metrics.external_hit_tokens == 0     # the other size's chunks are there, not ours
    assert len(chunk_files(tmp_path)) == 3                       # TP=2: two ranks' directories; TP=1: one
    for tp in (1, 2):
        with engine(tp, with_disk(tmp_path)) as again:           # a fresh process of each size
            seqs = run_sequential(again, prompts[1:])
            assert seqs[0].output_token_ids == expect[1]
            assert seqs[0].metrics.external_hit_tokens == 192   # its own chunks, from disk
            assert again.stats()["connector"]["tiers"]["disk"]["integrity_failures"] == 0


def test_a_load_that_fails_on_one_rank_fails_the_job_and_the_request_recomputes(monkeypatch):
    """Fault injected at rank 1's transfer boundary: its first L1 → L0 copy raises. Rank 0's copy succeeded,
    but the job failed as a whole: the request recomputes, and its stores of that step are cancelled on the
    rank that failed, so the chunks never become visible half-written."""
    prompts = shared_prompts(n=3)
    expect = reference(prompts)
    with engine(2, offload()) as two:
        run_sequential(two, prompts[:1])
        handlers = two.connector.workers[1].stack.engine._handlers
        real, calls = handlers[("cpu", "device")], []

        def flaky(plan, progress=None):
            calls.append(plan.job_id)
            if len(calls) == 1:
                raise OSError("injected: rank 1's load fails")
            return real(plan, progress)

        monkeypatch.setitem(handlers, ("cpu", "device"), flaky)
        seqs = run_sequential(two, prompts[1:])
        assert [s.output_token_ids for s in seqs] == expect[1:]
        stats = two.stats()["connector"]
        assert stats["failed_loads"] == 1 and stats["loaded_tokens"] == 2 * 192   # the retry and the third loaded
        assert_back_to_baseline(two)


def test_a_chunk_corrupt_on_one_rank_is_a_miss_for_every_rank(tmp_path):
    prompts = shared_prompts(n=2)
    expect = reference(prompts)
    with engine(2, with_disk(tmp_path)) as first:
        run_sequential(first, prompts[:1])
    rank_dirs = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    victim = sorted(rank_dirs[1].rglob("*.chunk"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x40
    victim.write_bytes(bytes(raw))
    with engine(2, with_disk(tmp_path)) as second:
        seqs = run_sequential(second, prompts[1:])
        assert seqs[0].output_token_ids == expect[1]
        disk = second.stats()["connector"]["tiers"]["disk"]
        assert disk["integrity_failures"] == 1
        assert seqs[0].metrics.external_hit_tokens < 192          # the prefix broke at the corrupt chunk
        assert_back_to_baseline(second)
    assert victim.read_bytes() != bytes(raw)                      # deleted, then written anew by the recompute


def test_every_tier_together_in_the_reference_engine(tmp_path, redis_server, cache_server):
    """cpu, disk, redis and grpc configured at once, at TP=2: a fresh engine hits from disk; with the disk
    path changed, from Redis; with Redis emptied too, from the server."""
    import redis

    prompts = shared_prompts(n=4)
    expect = reference(prompts)

    def cfg(disk_path):
        return with_disk(disk_path, redis={"enabled": True, "url": redis_server.url},
                         grpc={"enabled": True, "address": cache_server.address})

    with engine(2, cfg(tmp_path / "a")) as first:
        assert [s.output_token_ids for s in run_sequential(first, prompts[:1])] == expect[:1]
    for i, (disk_path, source) in enumerate(((tmp_path / "a", "disk"), (tmp_path / "b", "redis"),
                                             (tmp_path / "c", "grpc")), start=1):
        if source == "grpc":
            redis.Redis.from_url(redis_server.url).flushall()
        with engine(2, cfg(disk_path)) as again:
            seqs = run_sequential(again, prompts[i:i + 1])
            assert seqs[0].output_token_ids == expect[i] and seqs[0].metrics.external_hit_tokens == 192
            tiers = again.stats()["connector"]["tiers"]
            assert {t for t in ("disk", "redis", "grpc") if tiers[t]["loaded"]} == {source}


def test_a_swap_copy_stays_in_l1_and_never_reaches_a_shared_tier(tmp_path):
    prompts = shared_prompts(n=8, prefix=40, suffix=30, seed=7, systems=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as plain:
        seqs = [plain.add_request(p, params) for p in prompts]
        plain.run()
        expect = [s.output_token_ids for s in seqs]
    with engine(2, with_disk(tmp_path), num_blocks=30, preemption="swap") as two:
        seqs = [two.add_request(p, params) for p in prompts]
        two.run()
        assert [s.output_token_ids for s in seqs] == expect
        stats = two.stats()["connector"]
        assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
        real = {k for s in seqs for k in chunk_keys(s.block_hashes, 64 // 16)}
        on_disk = {bytes.fromhex(f.stem) for f in tmp_path.rglob("*.chunk")}
        assert on_disk and on_disk <= real                       # only chunks of real prefixes, never a swap copy
        assert_back_to_baseline(two)


def test_replicated_kv_is_stored_once_and_read_by_every_rank(tmp_path):
    """MLA-style KV, the same on every rank: only rank 0 writes the lower tiers, into one directory, and both
    ranks read that one copy back."""
    from tiercache.config import TierCacheConfig
    from tiercache.connectors.reference import ReferenceConnector
    from tiercache.contracts.keys import BlockHasher, Namespace
    from tiercache.pool import PagedKVCache

    kvs = [PagedKVCache(SMALL, 64, BLOCK, "cpu") for _ in range(2)]
    config = TierCacheConfig().replace(keys={"block_size": BLOCK, "chunk_tokens": CHUNK},
                                       cpu={"capacity": 8 * (CHUNK // BLOCK) * kvs[0].block_bytes, "prefault": False},
                                       disk={"enabled": True, "path": str(tmp_path), "write_mode": "write-through"})
    namespace = Namespace("mla-like", SMALL, BLOCK)
    both = ReferenceConnector(config, namespace, kvs, replicated=True)
    try:
        m = both.scheduler.manager
        hashes = BlockHasher(namespace).hash_blocks(list(range(2 * CHUNK)))
        ids = list(range(8))
        g = torch.Generator().manual_seed(3)
        same = torch.randn(kvs[0].kv[:, :, ids].shape, generator=g)
        for kv in kvs:
            kv.kv[:, :, ids] = same
        both.run([m.plan_store(hashes, ids)])
        both.drain()
        assert len(chunk_files(tmp_path)) == 1 and len(list(tmp_path.rglob("*.chunk"))) == 2   # one copy
        m.l1.delete(list(m.l1.entries))
        for kv in kvs:
            kv.kv.zero_()
        assert m.promote(m.lookup(hashes))
        both.drain()
        both.run(m.plan_load(m.in_l1(m.lookup(hashes)), ids))
        assert all(torch.equal(kv.kv[:, :, ids], same) for kv in kvs)                     # both ranks read it
    finally:
        both.close()
