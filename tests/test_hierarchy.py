"""L1 over L2 on real files: spills, write-through, admission, promotion, and corrupt chunks as misses."""

import torch

from tests.conftest import BLOCK, CHUNK, Stack
from tests.support.stack_ops import load, put  # noqa: E402
from tiercache.contracts.keys import chunk_keys

BPC = CHUNK // BLOCK


def make(tmp_path, **disk) -> Stack:
    return Stack(num_blocks=64, cpu_chunks=2, disk={"enabled": True, "path": str(tmp_path), **disk})


def test_write_back_spills_what_l1_evicts_and_promotes_it_back(tmp_path):
    s = make(tmp_path)
    try:
        a, a_kv = put(s, "a", seed=1)
        assert s.lower("disk").num_chunks == 0          # write-back: nothing on disk yet
        b, b_kv = put(s, "b", seed=2)                      # L1 holds two chunks: a's are evicted...
        s.offload.drain()
        disk = s.lower("disk")
        assert disk.contains(s.manager.lookup(a).runs[0].keys) == 2   # ...and spilled, tail first
        assert [r.tier for r in s.manager.lookup(a).runs] == ["disk"]
        got = load(s, a)                                   # promoted to L1, then loaded to L0
        assert got is not None and torch.equal(got, a_kv)
        assert disk.counters.loaded == 2 and s.cpu.counters.evicted >= 2
    finally:
        s.close()


def test_write_through_copies_every_store_down_at_once(tmp_path):
    s = make(tmp_path, write_mode="write-through")
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        disk = s.lower("disk")
        assert disk.num_chunks == 2
        put(s, "b", seed=2)
        s.offload.drain()
        assert disk.num_chunks == 4 and all(e.pins == 0 for e in s.cpu.entries.values())
        assert torch.equal(load(s, a), a_kv)
    finally:
        s.close()


def test_min_hits_admission_keeps_one_off_chunks_off_the_disk(tmp_path):
    s = make(tmp_path, admission="min-hits", min_hits=1)
    try:
        a, a_kv = put(s, "a", seed=1)
        assert torch.equal(load(s, a), a_kv)               # a is reused once: admitted
        c, _ = put(s, "c", seed=3)                          # evicts a (hit) → spilled
        s.offload.drain()
        put(s, "d", seed=4)                                 # evicts c (never hit) → dropped
        s.offload.drain()
        disk = s.lower("disk")
        assert disk.contains(s.manager.lookup(a).runs[0].keys if s.manager.lookup(a).runs else []) == 2
        assert s.manager.lookup(c).num_hit_blocks == 0
    finally:
        s.close()


def test_a_corrupt_disk_chunk_is_a_miss_and_is_deleted(tmp_path):
    s = make(tmp_path)
    try:
        a, _ = put(s, "a", seed=1)
        put(s, "b", seed=2)
        s.offload.drain()
        disk = s.lower("disk")
        victim = s.transport("disk").path(s.manager.lookup(a).runs[0].keys[0])
        raw = bytearray(victim.read_bytes())
        raw[-3] ^= 0xFF
        victim.write_bytes(raw)
        assert load(s, a) is None                           # never served
        assert disk.counters.integrity_failures == 1 and not victim.exists()
        assert s.cpu.counters.errors == 0                   # the promotion failed at the disk, not in L1
        assert s.manager.lookup(a).num_hit_blocks == 0      # chunk 0 is gone, so nothing after it counts
        assert s.manager.num_in_flight == 0 and all(e.pins == 0 for e in s.cpu.entries.values())
    finally:
        s.close()


def test_close_flushes_l1_so_a_restart_finds_it(tmp_path):
    s = make(tmp_path)
    a, a_kv = put(s, "a", seed=1)
    s.close()                                               # write-back: L1's dirty chunks go down
    s2 = make(tmp_path)
    try:
        assert torch.equal(load(s2, a), a_kv)
    finally:
        s2.close()


def test_close_writes_down_exactly_what_l1_held_even_where_slots_were_reused(tmp_path, caplog):
    """Each rank writes down at close the chunks that entered its L1 and have not left: `a`'s chunks were
    evicted without a spill (never hit, so min-hits admission refused them) and their slots now hold `c`'s.
    A restart finds `c` bit-exact and not `a` — in particular, not `a`'s keys over `c`'s bytes."""
    import logging

    s = make(tmp_path, admission="min-hits", min_hits=1)
    a, _ = put(s, "a", seed=1)
    c, c_kv = put(s, "c", seed=3)                            # evicts a (never hit) → dropped, its slots reused
    with caplog.at_level(logging.INFO, logger="tiercache"):
        s.close()
    assert "wrote 2 chunks" in caplog.text and "at shutdown" in caplog.text
    assert len(list(tmp_path.rglob("*.chunk"))) == 2
    s2 = make(tmp_path)
    try:
        assert load(s2, a) is None
        assert torch.equal(load(s2, c), c_kv)
    finally:
        s2.close()


def test_nothing_is_written_down_at_close_when_the_setting_is_zero_or_the_disk_has_it(tmp_path):
    s = Stack(num_blocks=64, cpu_chunks=2, disk={"enabled": True, "path": str(tmp_path)},
              cpu={"shutdown_write_down": 0})
    put(s, "a", seed=1)
    s.close()
    assert not list(tmp_path.rglob("*.chunk"))
    s = make(tmp_path)
    a, a_kv = put(s, "a", seed=1)
    s.close()
    files = {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.chunk")}
    s = make(tmp_path)
    assert torch.equal(load(s, a), a_kv)                     # promoted from the disk into L1 ...
    s.close()
    assert {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.chunk")} == files   # ... and not written again


def test_a_slot_reused_by_a_chunk_from_the_disk_is_not_written_down_under_the_old_key(tmp_path):
    """`a` enters L1 (named for the write-down), leaves it (deleted), and `d` is promoted from the disk into
    the same slots: the disk has `d`, so its chunks are not named. At close nothing of `a` may be written —
    `a`'s keys over `d`'s bytes would be wrong KV served as a hit after a restart."""
    s = make(tmp_path)
    d, d_kv = put(s, "d", seed=4)
    s.close()                                                # d is on the disk now
    s = make(tmp_path)
    a, _ = put(s, "a", seed=1)
    s.cpu.delete([k for run in s.manager.lookup(a).runs for k in run.keys])
    assert torch.equal(load(s, d), d_kv)                     # d promoted into the slots a had
    s.close()
    s = make(tmp_path)
    try:
        assert load(s, a) is None
        assert torch.equal(load(s, d), d_kv)
    finally:
        s.close()


def test_second_sighting_admission_fills_free_room_then_writes_only_what_two_requests_asked_for(tmp_path):
    probe = make(tmp_path / "probe")
    chunk_bytes = probe.lower("disk").reserve_bytes(probe.manager.block_layout.blocks(BPC))
    probe.close()
    s = make(tmp_path / "disk", admission="second-sighting", capacity=2 * chunk_bytes)    # room for one request
    try:
        disk = s.lower("disk")
        a, _ = put(s, "a", seed=1)
        b, _ = put(s, "b", seed=2)                          # evicts a: the disk has room, so it is written
        s.offload.drain()
        b_keys = chunk_keys(b, BPC)
        assert disk.num_chunks == 2 and disk.contains(chunk_keys(a, BPC)) == 2
        c, _ = put(s, "c", seed=3)                          # evicts b: the disk is full, b asked for once
        s.offload.drain()
        assert disk.contains(b_keys) == 0 and disk.contains(chunk_keys(a, BPC)) == 2
        c_keys = chunk_keys(c, BPC)
        s.manager.record_request(c_keys)                    # two requests asked for c
        s.manager.record_request(c_keys)
        put(s, "d", seed=4)                                 # evicts c: seen twice, written over a
        s.offload.drain()
        assert disk.contains(c_keys) == 2 and disk.num_chunks == 2
    finally:
        s.close()


def test_promoting_a_chains_tail_from_l2_never_evicts_its_head_from_l1():
    """L1 (3 chunks) holds the head ``a`` of a chain — the chunk its policy would give up first — and two
    chunks asked for often; L2 holds the rest of the chain. Making room for the tail's promotion takes the
    other two, never the head the same lookup found: the load after it finds every chunk it was promised."""
    import hashlib

    from tiercache.contracts.plan import JobOutcome
    from tiercache.manager import CacheManager
    from tiercache.tiers.cpu import CpuIndex
    from tiercache.tiers.metadata import MetadataIndex

    def complete(plans):
        manager.apply([JobOutcome(p.job_id) for p in plans])

    a, b, c, x, y = (hashlib.sha256(n.encode()).digest() for n in "abcxy")
    l1, l2 = CpuIndex(3, 1, eviction="lfu-da"), MetadataIndex(8, eviction="lfu-da", name="l2")
    manager = CacheManager(l1, block_size=1, blocks_per_chunk=1, block_bytes=1, lower=[l2])
    l2.prepare_store([b, c], [1, 1])
    l2.complete_store([b, c])
    l1.prepare_store([x, y, a], [1, 1, 1])
    l1.complete_store([x, y, a])
    for _ in range(3):
        l1.touch([x, y])                                     # x and y outrank a
    lookup = manager.lookup_chunks([a, b, c], 3)
    assert [(r.tier, len(r.keys)) for r in lookup.runs] == [("cpu", 1), ("l2", 2)]
    manager.promote(lookup)                                  # room is made: x and y are spilled, not a
    assert l1.has(a) and not l1.has(x) and not l1.has(y)
    complete(manager.take_background())                      # the spills land: their slots are free
    assert manager.promote(manager.lookup_chunks([a, b, c], 3))
    complete(manager.take_background())
    lookup = manager.in_l1(manager.lookup_chunks([a, b, c], 3))
    assert lookup.num_hit_blocks == 3
    complete(manager.plan_load(lookup, range(3)))
    assert manager.num_in_flight == 0


def test_a_moved_promotion_leaves_the_disk_and_is_written_again_when_l1_evicts_it(tmp_path):
    """``disk.promotion = move``: a's chunks, promoted back into L1, leave the disk (their files deleted); when
    another store pushes them out of L1 again they are spilled again, and still load bit-exact from the disk."""
    s = make(tmp_path, promotion="move")
    try:
        a, a_kv = put(s, "a", seed=1)
        put(s, "b", seed=2)                                # L1 holds two chunks: a's are spilled
        s.offload.drain()
        disk = s.lower("disk")
        keys = chunk_keys(a, BPC)
        assert disk.contains(keys) == 2
        assert torch.equal(load(s, a), a_kv)               # promoted (moved) into L1, then loaded
        s.offload.drain()
        assert disk.contains(keys) == 0 and disk.counters.deleted == 2
        assert not list(tmp_path.rglob(f"{keys[0].hex()}.chunk"))     # the file went with it
        put(s, "c", seed=3)                                # pushes a's chunks out of L1 again
        s.offload.drain()
        assert disk.contains(keys) == 2 and disk.counters.stored == 4
        assert torch.equal(load(s, a), a_kv)
    finally:
        s.close()
