"""An engine's per-layer KV tensors (vLLM's layouts) as L0: blocks round-trip through L1 and a lower tier."""
import pytest
import torch

from tiercache.config import TierCacheConfig
from tiercache.connectors.reference import ReferenceConnector
from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace
from tiercache.pool.layer_tensors import LayerTensorsKV

BLOCK, NUM_BLOCKS, LAYERS, HEADS, HEAD = 32, 16, 3, 2, 8


def layers(shape_of_layer, block_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape_of_layer, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    geo = KVGeometry(LAYERS, HEADS, HEAD, "bfloat16", layout=f"test-{block_dim}")
    return tensors, LayerTensorsKV(tensors, NUM_BLOCKS, BLOCK, geo, block_dim)


@pytest.mark.parametrize("shape,block_dim", [
    ((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD), 0),      # vLLM's CPU backend: a block holds K then V
    ((2, NUM_BLOCKS, BLOCK, HEADS, HEAD), 1),       # a K/V-split backend
])
def test_blocks_round_trip_through_l1_and_disk(tmp_path, shape, block_dim):
    tensors, kv = layers(shape, block_dim)
    cfg = TierCacheConfig().replace(keys={"block_size": BLOCK, "chunk_tokens": 2 * BLOCK},
                                    cpu={"capacity": 4 * 2 * kv.block_bytes, "prefault": False},
                                    disk={"enabled": True, "path": str(tmp_path)})
    ns = Namespace("m", kv.geometry, BLOCK)
    stack = ReferenceConnector(cfg, ns, [kv])
    m = stack.scheduler.manager
    try:
        hashes = BlockHasher(ns).hash_blocks(list(range(4 * BLOCK)))
        src = [5, 2, 9, 11]
        stack.run([m.plan_store(hashes, src)])
        expect = [t.select(block_dim, 0).clone() for t in tensors]  # untouched block 0 stays as it was
        stored = [torch.stack([t.select(block_dim, b) for b in src]).clone() for t in tensors]
        stack.drain(flush=True)
        m.l1.delete(list(m.l1.entries))                                # only the disk has them now
        lookup = m.lookup(hashes)
        assert m.promote(lookup)
        stack.drain()
        dst = [12, 3, 4, 7]
        stack.run(m.plan_load(m.in_l1(m.lookup(hashes)), dst))
        for t, want, zero in zip(tensors, stored, expect):
            assert torch.equal(torch.stack([t.select(block_dim, b) for b in dst]), want)
            assert torch.equal(t.select(block_dim, 0), zero)
    finally:
        stack.close()


def test_tensors_that_do_not_match_are_refused():
    tensors, _ = layers((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD), 0)
    geo = KVGeometry(LAYERS, HEADS, HEAD, "bfloat16")
    with pytest.raises(ValueError, match="not 17 blocks"):
        LayerTensorsKV(tensors, NUM_BLOCKS + 1, BLOCK, geo)
    with pytest.raises(ValueError, match="differ"):
        LayerTensorsKV([tensors[0], tensors[1][:, :1].contiguous()], NUM_BLOCKS, BLOCK, geo)
