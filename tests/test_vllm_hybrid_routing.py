"""A hybrid vLLM replica in the router's index (`tiercache.fleet.vllm_groups`): vLLM publishes each KV-cache
group's blocks with the group's kind, and the router predicts the hit vLLM's hybrid manager finds — full
attention's run, cut by what a sliding window needs behind the hit's end and by where a Mamba group kept a
state — told on events shaped as vLLM publishes them."""
import pytest

pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'tiercache[fleet]')")

from tiercache.fleet.descriptor import ReplicaDescriptor  # noqa: E402
from tiercache.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from tiercache.fleet.prefix_index import ReplicaIndex  # noqa: E402
from tiercache.fleet.vllm_groups import GroupBlocks, hybrid_hit  # noqa: E402
from tiercache.fleet.vllm_keys import VllmKeys  # noqa: E402

BLOCK = 16
TOKENS = list(range(1, 8 * BLOCK + 2))          # eight whole blocks and one token more


def _stored(hashes, first_block, count, group=0, kind="full_attention", window=None) -> BlockStored:
    """Blocks ``first_block`` .. ``first_block + count`` of TOKENS, as vLLM publishes them: every token of the
    range, the hashes of the blocks the group keeps (a sliding window's or Mamba group's are fewer)."""
    parent = None if first_block == 0 else 1000 + first_block - 1
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=TOKENS[first_block * BLOCK:(first_block + count) * BLOCK], block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def _replica():
    scheme = VllmKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="vllm", block_size=BLOCK,
                                        chunk_tokens=0))
    index = ReplicaIndex()
    index.rename(scheme)
    return scheme, index


def _apply(index, *events) -> None:
    index.apply(KVEventBatch(ts=0.0, events=list(events)))


def _cached(index, scheme, blocks=8) -> int:
    return index.cached(scheme.keys(TOKENS[:blocks * BLOCK + 1], ""), scheme).engine


def _full(blocks=8):
    return _stored([1000 + i for i in range(blocks)], 0, blocks)


def test_full_attention_alone_predicts_its_run():
    scheme, index = _replica()
    _apply(index, _full())
    assert _cached(index, scheme) == 8 * BLOCK


def test_a_sliding_window_needs_the_blocks_its_window_reads_behind_the_hit():
    """A 40-token window reads the 3 blocks (39 tokens) behind a hit's end. The group kept blocks 2–4 and 6–7:
    the hit ends after block 4 (its window 2, 3, 4 held), not at 8 (6–7 are two blocks only)."""
    scheme, index = _replica()
    _apply(index, _full(), _stored([1002, 1003, 1004, 1006, 1007], 0, 8, group=1, kind="sliding_window", window=40))
    assert _cached(index, scheme) == 5 * BLOCK
    _apply(index, _stored([1005], 5, 1, group=1, kind="sliding_window", window=40))      # block 5 back
    assert _cached(index, scheme) == 8 * BLOCK
    _apply(index, BlockRemoved(block_hashes=[1006], medium="GPU", group_idx=1))
    assert _cached(index, scheme) == 6 * BLOCK                                           # 3, 4, 5 behind 6


def test_a_mamba_group_resumes_only_where_it_kept_a_state():
    scheme, index = _replica()
    _apply(index, _full(), _stored([1003], 0, 8, group=1, kind="mamba"))
    assert _cached(index, scheme) == 4 * BLOCK
    assert _cached(index, scheme, blocks=3) == 0                   # a shorter prompt: no state at or before it
    _apply(index, _stored([1006], 4, 4, group=1, kind="mamba"))
    assert _cached(index, scheme) == 7 * BLOCK


def test_every_group_cuts_until_none_cuts_further():
    """A state at block 7 and one at block 3, a window held only behind block 4: the window cuts 8 to 5, the
    state then to 4, which the window also resumes from."""
    scheme, index = _replica()
    _apply(index, _full(),
           _stored([1002, 1003, 1004], 0, 8, group=1, kind="sliding_window", window=33),
           _stored([1003, 1007], 0, 8, group=2, kind="mamba"))
    assert _cached(index, scheme) == 4 * BLOCK


def test_a_block_the_full_group_dropped_stays_in_the_group_that_holds_it_and_a_reset_clears_every_group():
    scheme, index = _replica()
    _apply(index, _full(), _stored([1005], 0, 8, group=1, kind="mamba"))
    _apply(index, BlockRemoved(block_hashes=[1007], medium="GPU", group_idx=0))
    assert _cached(index, scheme) == 6 * BLOCK
    _apply(index, BlockRemoved(block_hashes=[1005], medium="GPU", group_idx=1))
    assert _cached(index, scheme) == 0
    _apply(index, _stored([1005], 0, 8, group=1, kind="mamba"), AllBlocksCleared())
    assert _cached(index, scheme) == 0 and not index.names.groups


def test_a_kind_the_router_does_not_know_cuts_nothing():
    assert hybrid_hit([b"a", b"b"], 2, [GroupBlocks("some_future_kind")], (), BLOCK) == 2


def test_full_attention_names_the_blocks_whichever_group_it_is_and_groups_published_before_it_wait_for_it():
    """Qwen3-Next's layout in vLLM: three Mamba groups, then full attention (group 3). vLLM publishes a step's
    groups in order, so the Mamba groups' states come before the blocks' names; they wait for them."""
    scheme, index = _replica()
    states = [_stored([1003], 0, 8, group=g, kind="mamba") for g in range(3)]
    _apply(index, *states, _stored([1000 + i for i in range(8)], 0, 8, group=3))
    assert index.names.naming_group == 3 and _cached(index, scheme) == 4 * BLOCK
    _apply(index, BlockRemoved(block_hashes=[1003], medium="GPU", group_idx=1))
    assert _cached(index, scheme) == 0
    assert _cached(index, scheme, blocks=3) == 0 and index.names.unnamed == 0


def test_events_without_kinds_are_named_from_group_0_as_before():
    scheme, index = _replica()
    event = _full()
    event.kv_cache_spec_kind = None
    _apply(index, event)
    assert index.names.naming_group == 0 and _cached(index, scheme) == 8 * BLOCK
