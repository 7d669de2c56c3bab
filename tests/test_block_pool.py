"""L0 block bookkeeping: refcounts, copy-on-write, free-queue order, and a stateful property test."""
import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache.contracts.keys import BlockHash
from tiercache.pool import BlockManager, BlockPool, FreeBlockQueue
from tiercache.pool.block_pool import Block


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def test_free_queue_removes_from_the_middle_in_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2] and len(q) == 4
    with pytest.raises(IndexError):
        FreeBlockQueue().popleft()


def test_freed_blocks_stay_hits_until_reused_and_tails_go_first():
    pool = BlockPool(8)
    mgr = BlockManager(pool, block_size=4)
    hashes = [h(i) for i in range(3)]
    mgr.allocate("a", 13, hashes)                  # 4 blocks: 3 full + 1 partial
    mgr.cache_full_blocks("a", hashes)
    table = mgr.block_ids("a")
    mgr.free("a")
    assert pool.stats().evictable == 3
    # A new request with the same prefix hits all three cached blocks.
    assert mgr.allocate("b", 13, hashes) == 12
    assert mgr.block_ids("b")[:3] == table[:3]
    mgr.free("b")
    # Order of eviction: empty blocks first, then the chain tail before its head.
    order = [b.block_id for b in pool.free_queue]
    cached_order = [b for b in order if pool.blocks[b].block_hash is not None]
    assert cached_order == [table[2], table[1], table[0]]
    assert order.index(table[3]) < order.index(table[2])  # the hashless partial block before any cached one


def test_allocation_evicts_cached_blocks_lru_tail_first():
    pool = BlockPool(4)
    mgr = BlockManager(pool, block_size=4)
    hashes = [h(i) for i in range(4)]
    mgr.allocate("a", 16, hashes)
    mgr.cache_full_blocks("a", hashes)
    mgr.free("a")
    mgr.allocate("b", 4)              # takes one block: must be the tail of a's chain
    assert pool.cached_prefix_length(hashes) == 3
    assert pool.stats().evictable == 3


def test_last_block_is_never_a_hit():
    pool = BlockPool(4)
    mgr = BlockManager(pool, block_size=4)
    hashes = [h(0), h(1)]
    mgr.allocate("a", 8, hashes)
    mgr.cache_full_blocks("a", hashes)
    mgr.free("a")
    assert mgr.allocate("b", 8, hashes) == 4  # block 1 holds the last token: recomputed for its logits


def test_fork_shares_blocks_and_copies_on_write():
    pool = BlockPool(8)
    mgr = BlockManager(pool, block_size=4)
    mgr.allocate("parent", 6)
    mgr.fork("parent", "child")
    assert mgr.block_ids("parent") == mgr.block_ids("child")
    assert [pool.blocks[b].ref_cnt for b in mgr.block_ids("child")] == [2, 2]
    copies = mgr.append("child", 1)                  # writes into the shared partial block
    assert len(copies) == 1
    assert copies[0].src == mgr.block_ids("parent")[1]
    assert copies[0].dst == mgr.block_ids("child")[1] != copies[0].src
    assert pool.blocks[mgr.block_ids("parent")[0]].ref_cnt == 2  # the full block stays shared
    assert mgr.append("child", 1) == []              # now private: no more copies


def test_allocation_failure_changes_nothing():
    pool = BlockPool(4)
    mgr = BlockManager(pool, block_size=4)
    mgr.allocate("a", 8)
    before = pool.stats()
    with pytest.raises(MemoryError):
        mgr.allocate("b", 20)
    assert pool.stats() == before and "b" not in mgr.tables


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_pinned_blocks_are_not_reused():
    pool = BlockPool(2)
    mgr = BlockManager(pool, block_size=4)
    mgr.allocate("a", 8)
    blocks = list(mgr.tables["a"])
    pool.pin(blocks)
    mgr.free("a")
    assert pool.num_free == 0 and pool.stats().pinned == 2
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.unpin(blocks)
    assert pool.num_free == 2 and pool.stats().pinned == 0


class PoolMachine(RuleBasedStateMachine):
    """Any sequence of allocate / append / fork / cache / pin / free keeps the pool consistent."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(16)
        self.mgr = BlockManager(self.pool, block_size=2)
        self.next_id = 0
        self.pins: list[list[Block]] = []

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(num_tokens=st.integers(1, 12), prefix=st.integers(0, 3), data=st.data())
    def allocate(self, num_tokens, prefix, data):
        hashes = [h(prefix * 100 + i) for i in range(num_tokens // 2)]
        req = self._new_id()
        try:
            self.mgr.allocate(req, num_tokens, hashes)
        except MemoryError:
            return
        if data.draw(st.booleans()):
            self.mgr.cache_full_blocks(req, hashes)

    @precondition(lambda self: self.mgr.tables)
    @rule(data=st.data(), n=st.integers(1, 4))
    def append(self, data, n):
        req = data.draw(st.sampled_from(sorted(self.mgr.tables)))
        old = self.mgr.num_tokens[req]
        try:
            self.mgr.append(req, n)
        except MemoryError:
            return
        # Every block the new tokens land in is private to this request (copy-on-write held).
        table = self.mgr.tables[req]
        for i in range(old // 2, -(-(old + n) // 2)):
            assert table[i].ref_cnt == 1, f"append wrote into shared block {table[i]}"

    @precondition(lambda self: self.mgr.tables)
    @rule(data=st.data())
    def fork(self, data):
        self.mgr.fork(data.draw(st.sampled_from(sorted(self.mgr.tables))), self._new_id())

    @precondition(lambda self: self.mgr.tables)
    @rule(data=st.data())
    def pin(self, data):
        req = data.draw(st.sampled_from(sorted(self.mgr.tables)))
        blocks = list(self.mgr.tables[req])
        self.pool.pin(blocks)
        self.pins.append(blocks)

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        self.pool.unpin(self.pins.pop())

    @precondition(lambda self: self.mgr.tables)
    @rule(data=st.data())
    def free(self, data):
        self.mgr.free(data.draw(st.sampled_from(sorted(self.mgr.tables))))

    @invariant()
    def consistent(self):
        holders: dict[int, int] = {}
        for table in self.mgr.tables.values():
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free_ids = {b.block_id for b in self.pool.free_queue}
        for b in self.pool.blocks:
            assert b.ref_cnt >= 0 and b.pin_cnt >= 0
            assert b.ref_cnt == holders.get(b.block_id, 0)          # refcount = tables holding it
            assert (b.block_id in free_ids) == (b.ref_cnt == 0 and b.pin_cnt == 0)  # in use ⇒ never free
        for h_, b in self.pool.cached.items():
            assert b.block_hash == h_
        stats = self.pool.stats()
        assert stats.used + stats.evictable + stats.empty == self.pool.num_blocks
        assert stats.evictable == sum(1 for b in self.pool.free_queue if b.block_hash is not None)

    def teardown(self):
        while self.pins:
            self.pool.unpin(self.pins.pop())
        for req in list(self.mgr.tables):
            self.mgr.free(req)
        stats = self.pool.stats()
        assert stats.used == 0 and stats.pinned == 0 and self.pool.num_free == self.pool.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
