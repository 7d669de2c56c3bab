"""Gather/scatter (the CPU path and reference) against plain per-block indexing."""
import random

import pytest
import torch

from tiercache.kernels import chunk_view, gather_blocks, gather_chunks, scatter_blocks, scatter_chunks


def pool_of(dtype, layers=3, blocks=32, block_size=4, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, blocks, block_size, heads, dim, generator=g).to(dtype)


def reference_gather(pool, ids):
    return torch.stack([pool[:, :, b] for b in ids], dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 2, 30, 7], [5]])
def test_gather_then_scatter_matches_reference(dtype, ids):
    pool = pool_of(dtype)
    buf = torch.empty(pool[:, :, :len(ids)].numel() * pool.element_size(), dtype=torch.uint8)
    view = chunk_view(pool, buf, len(ids))
    gather_blocks(pool, ids, view)
    got = buf.view(dtype).view(pool.shape[0], 2, len(ids), *pool.shape[3:])
    assert torch.equal(got, reference_gather(pool, ids))

    target = torch.zeros_like(pool)
    scatter_blocks(target, ids, view)
    for i, b in enumerate(ids):
        assert torch.equal(target[:, :, b], pool[:, :, b])
    untouched = [b for b in range(pool.shape[2]) if b not in ids]
    assert not target[:, :, untouched].any()


def test_sub_range_of_a_chunk():
    """A load that skips the first blocks of a chunk writes only the rest."""
    pool = pool_of(torch.float32)
    buf = torch.empty(pool[:, :, :4].numel() * 4, dtype=torch.uint8)
    whole = chunk_view(pool, buf, 4)
    gather_blocks(pool, [10, 11, 12, 13], whole)
    target = torch.zeros_like(pool)
    scatter_blocks(target, [20, 3], whole[:, :, 2:4])
    assert torch.equal(target[:, :, 20], pool[:, :, 12]) and torch.equal(target[:, :, 3], pool[:, :, 13])


def test_odd_row_sizes_fall_back_to_narrower_elements():
    pool = pool_of(torch.float16, dim=3, heads=1, block_size=3)   # 18-byte rows: no 16- or 8-byte view
    ids = [4, 1, 7]
    buf = torch.empty(pool[:, :, :3].numel() * 2, dtype=torch.uint8)
    gather_blocks(pool, ids, chunk_view(pool, buf, 3))
    assert torch.equal(buf.view(torch.float16).view(pool.shape[0], 2, 3, *pool.shape[3:]), reference_gather(pool, ids))


@pytest.mark.parametrize("layout", ["run", "shuffled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adjacent_chunks_move_in_one_op(layout, dtype):
    pool = pool_of(dtype, blocks=40)
    nb, chunks = 4, 3
    ids = list(range(8, 8 + nb * chunks))
    if layout == "shuffled":
        random.Random(7).shuffle(ids)
    per_chunk = [ids[c * nb:(c + 1) * nb] for c in range(chunks)]
    chunk_bytes = pool[:, :, :nb].numel() * pool.element_size()
    buf = torch.empty(chunks * chunk_bytes, dtype=torch.uint8)
    gather_chunks(pool, per_chunk, buf)
    for c in range(chunks):
        one = buf[c * chunk_bytes:(c + 1) * chunk_bytes].view(dtype).view(pool.shape[0], 2, nb, *pool.shape[3:])
        assert torch.equal(one, reference_gather(pool, per_chunk[c]))
    target = torch.zeros_like(pool)
    dest = [[b + 1 for b in blocks] for blocks in per_chunk]
    scatter_chunks(target, dest, buf)
    for src_ids, dst_ids in zip(per_chunk, dest):
        assert torch.equal(target[:, :, dst_ids], pool[:, :, src_ids])


def test_random_round_trips():
    rng = random.Random(1)
    pool = pool_of(torch.float32, blocks=64)
    for _ in range(20):
        ids = rng.sample(range(64), rng.randint(1, 8))
        buf = torch.empty(pool[:, :, :len(ids)].numel() * 4, dtype=torch.uint8)
        gather_blocks(pool, ids, chunk_view(pool, buf, len(ids)))
        target = torch.zeros_like(pool)
        scatter_blocks(target, ids, chunk_view(pool, buf, len(ids)))
        assert torch.equal(target[:, :, ids], pool[:, :, ids])


@pytest.mark.parametrize("layout", ["run", "shuffled"])
def test_layer_by_layer_moves_equal_one_whole_move(layout):
    """Layerwise transfers copy one layer range at a time; together they equal the whole-chunk copy."""
    pool = pool_of(torch.float32, layers=4, blocks=40)
    nb, chunks = 4, 3
    ids = list(range(4, 4 + nb * chunks))
    if layout == "shuffled":
        random.Random(11).shuffle(ids)
    per_chunk = [ids[c * nb:(c + 1) * nb] for c in range(chunks)]
    chunk_bytes = pool[:, :, :nb].numel() * 4
    whole = torch.empty(chunks * chunk_bytes, dtype=torch.uint8)
    gather_chunks(pool, per_chunk, whole)
    layered = torch.zeros_like(whole)
    for layer in range(pool.shape[0]):
        gather_chunks(pool, per_chunk, layered, layers=slice(layer, layer + 1))
    assert torch.equal(whole, layered)
    target = torch.zeros_like(pool)
    for layer in range(pool.shape[0]):
        scatter_chunks(target, per_chunk, whole, layers=slice(layer, layer + 1))
        assert torch.equal(target[layer, :, ids], pool[layer, :, ids])           # this layer landed...
        assert not target[layer + 1:].any()                                       # ...later ones not yet
