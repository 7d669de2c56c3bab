"""KV-cache groups (`tiercache.contracts.groups`) and the pages that move them (`tiercache.pool.group_pages`):
what a chunk stores per group, which blocks a load writes for a resume, and bytes that go out and come back
exactly — told step by step on a tiny pool."""
import pytest
import torch

from tiercache.contracts.groups import NO_BLOCK, GroupBlocks, KVGroup, KVGroups
from tiercache.pool.group_pages import GroupPagesKV, flat_bytes, page_view

BLOCK = 16
FULL = KVGroup("full-attention", num_layers=1, page_bytes=64)
WINDOW = KVGroup("sliding-window", num_layers=2, page_bytes=64, window_tokens=BLOCK + 2)   # 17 behind: 2 blocks


def gemma_like(bpc: int = 4) -> KVGroups:
    return KVGroups((WINDOW, FULL), BLOCK, bpc)


def test_a_chunk_stores_every_block_of_full_attention_and_the_window_behind_its_end():
    groups = gemma_like()
    assert groups.stored_blocks(FULL, 4) == 4
    assert groups.stored_blocks(WINDOW, 4) == 2       # tokens end-17 .. end-1: two blocks
    assert groups.stored_blocks(WINDOW, 1) == 1       # a one-block tail stores what it has
    assert groups.nbytes(4) == 2 * 2 * 64 + 4 * 64
    assert groups.offsets(4) == [0, 2 * 2 * 64]
    assert groups.whole_chunks_only


def test_a_window_of_one_token_needs_one_block():
    one = KVGroup("sliding-window", 1, 64, window_tokens=1)
    assert KVGroups((one,), BLOCK, 4).stored_blocks(one, 4) == 1


def test_chunk_sizes_are_found_back_from_bytes():
    groups = gemma_like()
    for n in range(1, 5):
        assert groups.blocks_of(groups.nbytes(n)) == n
    with pytest.raises(ValueError):
        groups.blocks_of(7)


def test_full_attention_alone_resumes_anywhere():
    assert not KVGroups((FULL, FULL), BLOCK, 4).whole_chunks_only


def test_a_group_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown KV-cache group kind 'mamba'"):
        KVGroup("mamba", 1, 64)


def test_a_store_reads_each_groups_blocks_and_skips_a_chunk_whose_window_slid_away():
    groups = gemma_like()
    window_table = [NO_BLOCK, NO_BLOCK, 7, 8, 9, 10, 11, 12]
    full_table = [20, 21, 22, 23, 24, 25, 26, 27]
    # chunk 1 (positions 4..8): the window's last two blocks, every full block
    assert groups.store_copy((window_table, full_table), 4, 8) == (GroupBlocks(0, (11, 12)),
                                                                   GroupBlocks(0, (24, 25, 26, 27)))
    # chunk 0 (positions 0..4): the window behind its end (positions 2, 3) is still held
    assert groups.store_copy((window_table, full_table), 0, 4) == (GroupBlocks(0, (7, 8)),
                                                                   GroupBlocks(0, (20, 21, 22, 23)))
    # once the engine let positions 2, 3 go, chunk 0 can no longer be stored whole
    assert groups.store_copy(([NO_BLOCK] * 4 + window_table[4:], full_table), 0, 4) is None


def test_a_load_writes_every_full_block_and_only_the_window_behind_the_resume_point():
    groups = gemma_like()
    window_table = [NO_BLOCK] * 6 + [30, 31]        # the engine holds blocks only for the window of position 8
    full_table = list(range(40, 48))
    # chunk 0 of a hit ending at position 8: full blocks 0..4, nothing of the window
    assert groups.load_copy((window_table, full_table), 0, 4, 0, 8) == (GroupBlocks(0, ()),
                                                                       GroupBlocks(0, (40, 41, 42, 43)))
    # chunk 1: the window's two stored blocks, every full block
    assert groups.load_copy((window_table, full_table), 4, 8, 4, 8) == (GroupBlocks(0, (30, 31)),
                                                                       GroupBlocks(0, (44, 45, 46, 47)))


def test_a_load_after_blocks_the_engine_has_skips_them_in_every_group():
    groups = gemma_like()
    tables = ([NO_BLOCK] * 6 + [30, 31], list(range(40, 48)))
    # the engine computed positions 4..6 itself: the full group loads 6..8 (stored blocks 2, 3)
    assert groups.load_copy(tables, 4, 8, 6, 8) == (GroupBlocks(0, (30, 31)), GroupBlocks(2, (46, 47)))


def test_a_load_into_a_block_the_engine_does_not_hold_is_an_error():
    groups = gemma_like()
    with pytest.raises(ValueError, match="holds no block"):
        groups.load_copy(([NO_BLOCK] * 8, list(range(8))), 4, 8, 4, 8)


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
    stored = (GroupBlocks(0, (5, 9)), GroupBlocks(0, (1, 2, 3, 4)))
    source.gather(stored, chunk, 4)
    loaded = (GroupBlocks(0, (12, 13)), GroupBlocks(2, (14, 15)))    # the engine has full positions 0, 1
    target.scatter(loaded, chunk, 4)
    for layer in range(2):
        assert torch.equal(target.pages[0][layer][[12, 13]], source.pages[0][layer][[5, 9]])
    assert torch.equal(target.pages[1][0][[14, 15]], source.pages[1][0][[3, 4]])
    changed = (target_memory != before).nonzero().flatten()
    written = {int(i) // 128 for i in changed}                        # which 128-byte page slots changed
    assert written <= {12, 13, 16 + 12, 16 + 13, 32 + 14, 32 + 15}   # nothing outside the named pages


def test_a_page_view_that_does_not_fit_its_allocation_is_refused():
    backing = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        page_view(backing, 10, 64, 128, 0)
    with pytest.raises(ValueError, match="do not fit"):
        page_view(backing, 2, 256, 128, 0)
