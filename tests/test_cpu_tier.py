"""L1's index (scheduler side): two-phase lifecycle, capacity bound, eviction order and pins."""
import pytest

from tiercache.contracts.keys import BlockHash
from tiercache.tiers.cpu import CpuIndex


def k(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def stored(tier: CpuIndex, keys) -> None:
    slots = tier.prepare_store(keys, [tier.slot_bytes] * len(keys))
    assert all(s is not None for s in slots)
    tier.complete_store(keys)


def test_write_is_invisible_until_complete():
    tier = CpuIndex(4, 1024)
    slots = tier.prepare_store([k(1)], [1024])
    assert slots == [0]
    assert tier.contains([k(1)]) == 0          # being written
    tier.complete_store([k(1)])
    assert tier.contains([k(1)]) == 1
    assert tier.prepare_store([k(1)], [1024]) == [None]   # already present


def test_failed_write_releases_its_slot():
    tier = CpuIndex(1, 1024)
    tier.prepare_store([k(1)], [1024])
    tier.complete_store([k(1)], failed=[k(1)])
    assert tier.contains([k(1)]) == 0 and tier.used_bytes == 0 and tier.slots.num_free == 1


def test_contains_counts_the_leading_run():
    tier = CpuIndex(8, 1024)
    stored(tier, [k(1), k(2), k(4)])
    assert tier.contains([k(1), k(2), k(3), k(4)]) == 2
    assert tier.contains([k(3), k(1)]) == 0


def test_capacity_is_never_exceeded_and_lru_evicts_oldest_tail_first():
    tier = CpuIndex(3, 1024)   # room for 3 slots only
    assert tier.capacity_bytes == 3 * 1024
    stored(tier, [k(1), k(2), k(3)])                       # one chain: head k1 ... tail k3
    stored(tier, [k(9)])                                   # must evict: the chain's tail goes first
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.contains([k(1), k(2)]) == 2 and tier.contains([k(3)]) == 0
    tier.complete_load(tier.prepare_load([k(1)]) and [k(1)])   # touch k1: now most recent
    stored(tier, [k(10)])
    assert tier.contains([k(2)]) == 0 and tier.contains([k(1)]) == 1
    assert tier.counters.evicted == 2


def test_pinned_chunks_are_never_evicted_and_no_room_is_a_value():
    tier = CpuIndex(2, 1024)
    stored(tier, [k(1), k(2)])
    tier.prepare_load([k(1), k(2)])                        # both pinned by in-flight loads
    assert tier.prepare_store([k(3)], [1024]) == [None]    # no room, not an exception
    assert tier.counters.store_rejected == 1
    assert tier.delete([k(1)]) == 0                        # pinned: not deleted either
    tier.complete_load([k(1), k(2)])
    assert tier.prepare_store([k(3)], [1024]) != [None]


def test_prepare_load_of_a_missing_key_unpins_what_it_took():
    tier = CpuIndex(2, 1024)
    stored(tier, [k(1)])
    with pytest.raises(KeyError):
        tier.prepare_load([k(1), k(2)])
    assert tier.entries[k(1)].pins == 0
    assert tier.delete([k(1)]) == 1 and tier.used_bytes == 0


def test_oversized_chunk_is_rejected_loudly():
    tier = CpuIndex(2, 1024)
    with pytest.raises(ValueError, match="does not fit"):
        tier.prepare_store([k(1)], [2048])


def test_the_index_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        CpuIndex(0, 1024)


def test_a_watched_tier_reports_what_left_it_in_order_and_only_what_was_there():
    tier = CpuIndex(2, 1024)
    stored(tier, [k(1)])
    assert tier.take_removed() == []                       # not watched: nothing kept
    tier.watch_removals()
    stored(tier, [k(2)])
    tier.prepare_store([k(3)], [1024])                     # evicts k1 (the oldest) ...
    tier.complete_store([k(3)], failed=[k(3)])             # ... and a write that failed was never there
    tier.delete([k(2)])
    assert tier.take_removed() == [k(1), k(2)]
    assert tier.take_removed() == []


def test_l1_admission_takes_free_room_then_stores_only_chains_two_requests_asked_for():
    """``cpu.admission = second-sighting``: the engine's stores fill L1 while it has room; once it is full, a
    chain asked for once is not stored (nothing of it: it would evict a chain that came back), and one asked for
    twice is, evicting what only one request wanted."""
    from tests.conftest import BLOCK, CHUNK, Stack
    from tests.support.stack_ops import load, put
    from tiercache.contracts.keys import chunk_keys

    s = Stack(num_blocks=64, cpu_chunks=4, cpu={"admission": "second-sighting"})
    try:
        a, _ = put(s, "a", seed=1)
        b, _ = put(s, "b", seed=2)                            # L1 full: four chunks, both chains
        assert s.cpu.used_bytes == s.cpu.capacity_bytes
        c, _ = put(s, "c", seed=3)                            # first sighting: refused, a and b stay
        assert load(s, c) is None and load(s, a) is not None and load(s, b) is not None
        c_keys = chunk_keys(c, CHUNK // BLOCK)
        s.manager.record_request(c_keys)                      # two requests asked for c
        s.manager.record_request(c_keys)
        put(s, "c", seed=3)
        assert load(s, c) is not None and s.cpu.counters.evicted == 2
    finally:
        s.close()


def _spilling_l1(slots: int, promotion: str = "copy") -> tuple:
    """L1 of ``slots`` under a write-back L2 through the real cache manager: every L1 victim is spilled."""
    from tiercache.manager import CacheManager
    from tiercache.tiers.metadata import MetadataIndex
    l1 = CpuIndex(slots, 1, eviction="lru")
    l2 = MetadataIndex(1000, name="l2")
    return CacheManager(l1, block_size=1, blocks_per_chunk=1, block_bytes=1, lower=[l2], write_mode="write-back",
                        promotion=promotion), l1


def _run(manager, plans) -> None:
    from tiercache.contracts.plan import JobOutcome
    manager.apply([JobOutcome(p.job_id) for p in plans if p is not None])


def test_a_full_l1_over_a_write_back_tier_keeps_room_for_the_next_steps_stores():
    """A victim being spilled holds its slot until its copy is out: a store into a full L1 whose victims all go
    down would find no slot and be refused. Once L1 has filled, each background step makes room ahead (1/16 of
    L1, spilled), so the next step's stores all find slots — and nothing is lost: what made room is in L2."""
    manager, l1 = _spilling_l1(64)
    first = [k(i) for i in range(64)]
    _run(manager, [manager.plan_store_chunks(first, range(64), 64)])
    first.append(k(64))                                      # one more than fits: L1 has had to evict
    _run(manager, [manager.plan_store_chunks(first[-1:], range(1), 1)])
    _run(manager, manager.take_background())                 # the spills are copied out, their slots freed
    assert l1.slots.num_free + len(l1._spilling) >= manager.spill_reserve == 4
    _run(manager, manager.take_background())                 # and the room made ahead is kept
    refused = l1.counters.store_rejected                     # the 65th chunk: its victims were all spilling
    nxt = [k(100 + i) for i in range(4)]
    plan = manager.plan_store_chunks(nxt, range(4), 4)
    assert plan is not None and len(plan.chunks) == 4 and l1.counters.store_rejected == refused
    _run(manager, [plan])
    l2 = manager.lower[0]
    assert all(l1.has(key) or l2.has(key) for key in first[:64] + nxt)


def test_an_l1_that_never_filled_keeps_everything_and_a_tiny_one_keeps_no_room():
    manager, l1 = _spilling_l1(64)
    keys = [k(i) for i in range(64)]                         # exactly full, nothing evicted to get there
    _run(manager, [manager.plan_store_chunks(keys, range(64), 64)])
    _run(manager, manager.take_background())
    assert l1.num_chunks == 64 and l1.counters.evicted == 0
    manager, l1 = _spilling_l1(8)                            # under 16 slots: no room kept
    _run(manager, [manager.plan_store_chunks([k(i) for i in range(8)], range(8), 8)])
    _run(manager, [manager.plan_store_chunks([k(8)], range(1), 1)])
    _run(manager, manager.take_background())
    evicted = l1.counters.evicted
    _run(manager, manager.take_background())
    assert manager.spill_reserve == 0 and l1.counters.evicted == evicted


@pytest.mark.parametrize("promotion", ["copy", "move"])
def test_a_chunk_promoted_from_the_write_back_tier_stays_there_or_moves_up(promotion):
    """``disk.promotion``: with ``copy`` the chunk stays in L2 as well; with ``move`` it leaves L2 (its bytes
    deleted in the next background step), L1 counts it among what only it holds (written down at shutdown),
    and when L1 evicts it again it is spilled again."""
    manager, l1 = _spilling_l1(4, promotion)
    l2 = manager.lower[0]
    first = [k(1), k(2)]
    _run(manager, [manager.plan_store_chunks(first, range(2), 2)])
    for i in range(3, 7):                                   # four other chunks push the first two down
        _run(manager, [manager.plan_store_chunks([k(i)], range(1), 1)])
        _run(manager, manager.take_background())
    assert not l1.has(k(1)) and l2.has(k(1)) and l2.has(k(2))
    manager.take_write_back()
    lookup = manager.lookup_chunks(first, 2)
    while manager.promote(lookup):
        _run(manager, manager.take_background())
        lookup = manager.lookup_chunks(first, 2)
    assert l1.has(k(1)) and l1.has(k(2))
    order = manager.take_write_back()
    if promotion == "copy":
        assert l2.has(k(1)) and l2.has(k(2)) and l2.counters.deleted == 0
        assert order is None or not {k(1), k(2)} & order.unwritten
    else:
        assert not l2.has(k(1)) and not l2.has(k(2)) and l2.counters.deleted == 2
        assert {k(1), k(2)} <= order.unwritten
    written = l2.counters.stored
    for i in range(7, 11):                                  # pushed down again
        _run(manager, [manager.plan_store_chunks([k(i)], range(1), 1)])
        _run(manager, manager.take_background())
    assert l2.has(k(1)) and l2.has(k(2))
    if promotion == "move":                                 # spilled again: written a second time
        assert l2.counters.stored - written >= 2
