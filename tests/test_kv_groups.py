"""KV-cache groups (`tiercache.contracts.groups`) and the pages that move them (`tiercache.pool.group_pages`):
what a chunk stores per group, which blocks a load writes for a resume, and bytes that go out and come back
exactly — told step by step on a tiny pool."""
import pytest
import torch

from tiercache.contracts.groups import NO_BLOCK, RESUME_POINT, GroupBlocks, KVGroup, KVGroups
from tiercache.pool.group_pages import GroupPagesKV, flat_bytes, page_view

BLOCK = 16
FULL = KVGroup("full-attention", num_layers=1, page_bytes=64)
WINDOW = KVGroup("sliding-window", num_layers=2, page_bytes=64, window_tokens=BLOCK + 2)   # 17 behind: 2 blocks


def gemma_like(bpc: int = 4) -> KVGroups:
    return KVGroups((WINDOW, FULL), BLOCK, bpc)


def test_a_chunk_stores_full_attention_and_its_resume_point_the_window_behind_its_end():
    groups = gemma_like()
    assert groups.chunk_groups == (1,) and groups.point_groups == (0,)
    assert groups.nbytes(4) == 4 * 64                     # the full-attention group's four blocks
    assert groups.nbytes(RESUME_POINT) == 2 * 2 * 64      # two window blocks of both sliding layers
    assert groups.slot_bytes == 4 * 64
    assert groups.has_resume_points and not groups.exact_points


def test_a_window_of_one_token_needs_one_block():
    one = KVGroup("sliding-window", 1, 64, window_tokens=1)
    assert KVGroups((one,), BLOCK, 4).resume_blocks(one) == 1


def test_a_recurrent_state_is_the_one_block_at_the_boundary_written_where_a_step_ended():
    state = KVGroup("state", 2, 256)
    groups = KVGroups((state, FULL), BLOCK, 4)
    assert groups.nbytes(RESUME_POINT) == 2 * 256 and groups.slot_bytes == 2 * 256
    assert groups.exact_points
    tables = ([NO_BLOCK, NO_BLOCK, NO_BLOCK, 9], list(range(20, 24)))
    assert groups.point_copy(tables, 4) == (GroupBlocks(0, (9,)),)
    assert groups.point_copy(tables, 3) is None           # no state kept at position 2


def test_full_attention_alone_resumes_anywhere():
    assert not KVGroups((FULL, FULL), BLOCK, 4).has_resume_points


def test_a_group_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown KV-cache group kind 'mamba'"):
        KVGroup("mamba", 1, 64)


def test_a_store_reads_every_full_block_and_its_resume_point_the_window_behind_its_end():
    groups = gemma_like()
    window_table = [NO_BLOCK, NO_BLOCK, 7, 8, 9, 10, 11, 12]
    full_table = [20, 21, 22, 23, 24, 25, 26, 27]
    tables = (window_table, full_table)
    assert groups.store_copy(tables, 4, 8) == (GroupBlocks(0, (24, 25, 26, 27)),)
    assert groups.point_copy(tables, 8) == (GroupBlocks(0, (11, 12)),)
    assert groups.point_copy(tables, 4) == (GroupBlocks(0, (7, 8)),)
    # once the engine let positions 2, 3 go, the resume point at 4 cannot be stored; the chunk still can
    slid = ([NO_BLOCK] * 4 + window_table[4:], full_table)
    assert groups.point_copy(slid, 4) is None
    assert groups.store_copy(slid, 0, 4) == (GroupBlocks(0, (20, 21, 22, 23)),)
    # a resume point at the request's first block holds what there is, at the end of its blocks
    assert groups.point_copy(([5] + [NO_BLOCK] * 7, full_table), 1) == (GroupBlocks(1, (5,)),)


def test_a_load_writes_the_chunks_full_blocks_and_the_window_behind_the_resume_point():
    groups = gemma_like()
    tables = ([NO_BLOCK] * 6 + [30, 31], list(range(40, 48)))
    assert groups.load_copy(tables, 0, 4, 0, 8) == (GroupBlocks(0, (40, 41, 42, 43)),)
    assert groups.load_copy(tables, 4, 8, 4, 8) == (GroupBlocks(0, (44, 45, 46, 47)),)
    assert groups.point_load(tables, 8, 0) == (GroupBlocks(0, (30, 31)),)


def test_a_load_after_blocks_the_engine_has_skips_them_in_every_group():
    groups = gemma_like()
    tables = ([NO_BLOCK] * 6 + [30, 31], list(range(40, 48)))
    # the engine computed positions 0..7 itself but for the last: only block 7 of each group comes in
    assert groups.load_copy(tables, 4, 8, 7, 8) == (GroupBlocks(3, (47,)),)
    assert groups.point_load(tables, 8, 7) == (GroupBlocks(1, (31,)),)


def test_a_load_into_a_block_the_engine_does_not_hold_is_an_error():
    groups = gemma_like()
    with pytest.raises(ValueError, match="holds no block"):
        groups.point_load(([NO_BLOCK] * 8, list(range(8))), 8, 0)


def pool(num_blocks: int, groups: KVGroups, seed: int) -> tuple[torch.Tensor, GroupPagesKV]:
    """One allocation with every layer of every group at its own offset, pages 128 B apart (64 B used)."""
    torch.manual_seed(seed)
    layers = [g for g in groups.groups for _ in range(g.num_layers)]
    memory = torch.randint(0, 255, (len(layers) * num_blocks * 128,), dtype=torch.uint8)
    backing = flat_bytes(memory.view(torch.float32))      # found through a tensor of another dtype
    pages, at = [], 0
    for g in groups.groups:
        views = []
        for _ in range(g.num_layers):
            views.append(page_view(backing, num_blocks, g.page_bytes, 128, at))
            at += num_blocks * 128
        pages.append(views)
    return memory, GroupPagesKV(groups, pages, num_blocks)


def test_pages_go_out_and_come_back_exactly_into_other_blocks():
    groups = gemma_like()
    _, source = pool(16, groups, seed=1)
    target_memory, target = pool(16, groups, seed=2)
    before = target_memory.clone()
    chunk = torch.zeros(groups.nbytes(4), dtype=torch.uint8)
    point = torch.zeros(groups.nbytes(RESUME_POINT), dtype=torch.uint8)
    source.gather((GroupBlocks(0, (1, 2, 3, 4)),), chunk, 4)
    source.gather((GroupBlocks(0, (5, 9)),), point, RESUME_POINT)
    target.scatter((GroupBlocks(2, (14, 15)),), chunk, 4)            # the engine has full positions 0, 1
    target.scatter((GroupBlocks(0, (12, 13)),), point, RESUME_POINT)
    for layer in range(2):
        assert torch.equal(target.pages[0][layer][[12, 13]], source.pages[0][layer][[5, 9]])
    assert torch.equal(target.pages[1][0][[14, 15]], source.pages[1][0][[3, 4]])
    changed = (target_memory != before).nonzero().flatten()
    written = {int(i) // 128 for i in changed}                        # which 128-byte page slots changed
    assert written <= {12, 13, 16 + 12, 16 + 13, 32 + 14, 32 + 15}   # nothing outside the named pages


def test_a_groups_blocks_are_copied_onto_others_in_every_layer_and_nothing_else_changes():
    """What the vLLM connector does after a load wrote a state: that group's block onto the block the step
    runs in, every layer; other groups and blocks untouched."""
    groups = gemma_like()
    memory, kv = pool(16, groups, seed=3)
    before = memory.clone()
    expected = [kv.pages[0][layer][[5, 9]].clone() for layer in range(2)]
    kv.copy_blocks(0, (5, 9), (6, 11))
    for layer in range(2):
        assert torch.equal(kv.pages[0][layer][[6, 11]], expected[layer])
    written = {int(i) // 128 for i in (memory != before).nonzero().flatten()}
    assert written <= {6, 11, 16 + 6, 16 + 11}


def test_a_page_view_that_does_not_fit_its_allocation_is_refused():
    backing = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        page_view(backing, 10, 64, 128, 0)
    with pytest.raises(ValueError, match="do not fit"):
        page_view(backing, 2, 256, 128, 0)


def block_hashes(num_tokens: int) -> list:
    from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace

    return BlockHasher(Namespace("m", KVGeometry(2, 1, 8, "float32"), BLOCK)).hash_blocks(list(range(num_tokens)))


def manager_over(groups: KVGroups):
    from tiercache.manager import CacheManager
    from tiercache.tiers.cpu import CpuIndex

    return CacheManager(CpuIndex(32, groups.slot_bytes), BLOCK, groups.blocks_per_chunk, 64, groups=groups)


def store(manager, hashes, tables, points) -> None:
    from tiercache.contracts.plan import JobOutcome

    plan = manager.plan_store(hashes, tables[-1], group_tables=tables, points=points)
    manager.apply([JobOutcome(plan.job_id)])


def test_a_hit_ends_at_the_last_boundary_every_group_can_resume_from():
    """Three chunks stored, a resume point only at the second one's end: the hit is two chunks, never three
    (the third chunk's attention KV is there, but not the window a resume after it needs) — and with no
    resume point at all there is no hit."""
    groups = gemma_like(bpc=2)
    manager = manager_over(groups)
    hashes = block_hashes(6 * BLOCK + 1)
    tables = (list(range(100, 106)), list(range(200, 206)))
    store(manager, hashes, tables, points=(1,))
    lookup = manager.in_l1(manager.lookup(hashes))
    assert lookup.num_hit_blocks == 4 and lookup.point is not None and lookup.point.first_chunk == 1
    plans = manager.plan_load(lookup, [0] * 6, group_tables=([NO_BLOCK] * 2 + [300, 301, 302, 303], list(range(6))))
    point_copy, = [c for p in plans for c in p.chunks if c.chunk_blocks == RESUME_POINT]
    assert point_copy.groups == (GroupBlocks(0, (300, 301)),)      # the window behind position 4: 2, 3
    for p in plans:
        manager.cancel(p)

    other = manager_over(groups)
    store(other, hashes, tables, points=())
    assert other.lookup(hashes).num_hit_blocks == 0


def test_a_resume_point_that_left_l1_takes_the_hit_back_to_the_one_before():
    from tiercache.contracts.groups import resume_key
    from tiercache.contracts.keys import chunk_keys

    groups = gemma_like(bpc=2)
    manager = manager_over(groups)
    hashes = block_hashes(6 * BLOCK)
    store(manager, hashes, (list(range(100, 106)), list(range(200, 206))), points=(0, 1, 2))
    assert manager.lookup(hashes).num_hit_blocks == 6
    manager.l1.delete([resume_key(chunk_keys(hashes, 2)[2])])
    assert manager.lookup(hashes).num_hit_blocks == 4


def test_a_model_with_groups_is_stored_raw_a_lossy_codec_is_refused_in_one_line(tmp_path):
    """Groups of several dtypes (a recurrent state beside attention KV) are opaque bytes to a codec: a lossy
    codec is refused when the worker is built, naming the field; a lossless one stores the same bytes."""
    from tiercache.build import build_worker_side
    from tiercache.config import TierCacheConfig
    from tiercache.contracts.keys import KVGeometry, KVShard, Namespace
    from tiercache.errors import ConfigError

    groups = gemma_like()
    _, kv = pool(16, groups, seed=3)
    namespace = Namespace("m", KVGeometry(3, 1, 8, "float32"), BLOCK)
    for codec, refused in (("int8", True), ("lz4", False)):
        config = TierCacheConfig().replace(keys={"block_size": BLOCK, "chunk_tokens": 4 * BLOCK},
                                           cpu={"capacity": 1 << 20, "prefault": False},
                                           disk={"enabled": True, "path": str(tmp_path / codec)},
                                           format={"codec": codec})
        if refused:
            with pytest.raises(ConfigError, match="format.codec"):
                build_worker_side(config, kv, namespace, KVShard(), copies_in_step=True)
        else:
            build_worker_side(config, kv, namespace, KVShard(), copies_in_step=True).close()


def test_a_purge_of_a_prompt_takes_its_resume_points_with_its_chunks():
    """A resume point's parent is the chunk it ends: purging a prompt by its first chunk takes every chunk of
    the chain and every resume point beside them."""
    from tiercache.contracts.groups import resume_key
    from tiercache.contracts.keys import chunk_keys
    from tiercache.contracts.purge import PurgeOrder

    groups = gemma_like(bpc=2)
    manager = manager_over(groups)
    hashes = block_hashes(6 * BLOCK)
    store(manager, hashes, (list(range(100, 106)), list(range(200, 206))), points=(0, 1, 2))
    keys = chunk_keys(hashes, 2)
    assert all(manager.l1.has(resume_key(k)) for k in keys)
    manager.purge(PurgeOrder(roots=(keys[0],)))
    assert not any(manager.l1.has(k) or manager.l1.has(resume_key(k)) for k in keys)
    assert manager.lookup(hashes).num_hit_blocks == 0
