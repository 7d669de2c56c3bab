"""L0 block bookkeeping: blocks, reference counts, the hash→block map and the free queue.

Runs wherever the engine schedules (scheduler side). It never touches KV
tensors; `PagedKVCache` owns the bytes.

Invariants (only this module changes `ref_cnt`, `pin_cnt`, `block_hash` and
the queue links):
- a block is in the free queue iff ``ref_cnt == 0 and pin_cnt == 0``;
- a free block keeps its hash and stays a cache hit until `allocate` pops it;
- the queue is ordered by eviction priority: hashless blocks first, then
  cached blocks in the order their requests released them, each request's
  chain tail-first, so heads of a shared prefix outlive its tails.
Every operation is O(1) per block.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiercache.contracts.keys import BlockHash


class Block:
    __slots__ = ("block_id", "ref_cnt", "pin_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.pin_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the intrusive free list; only FreeBlockQueue manipulates these.
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, pin={self.pin_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks; O(1) push, pop and removal from the middle."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        """Last to be evicted."""
        self._link(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: Block) -> None:
        """First to be evicted."""
        self._link(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail and node is not None:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        return self.num_free


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    num_blocks: int
    used: int        # held by at least one request or transfer
    pinned: int      # held by an in-flight transfer
    evictable: int   # free but still cached (a hit until reused)
    empty: int       # free and holding nothing


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.num_pinned = 0
        self.num_evictable = 0  # free blocks that still hold a hash
        self._changes: list[tuple[bool, BlockHash]] | None = None   # kept only while watched (KV events)

    def watch_changes(self) -> None:
        """Keep every hash that enters (True) or leaves (False) the cache from now on, in order, for
        `take_changes` (an API server turns them into KV events for a router)."""
        if self._changes is None:
            self._changes = []

    def take_changes(self) -> list[tuple[bool, BlockHash]]:
        if not self._changes:
            return []
        out, self._changes = self._changes, []
        return out

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def cached_prefix_length(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes have a block in the pool."""
        cached = self.cached
        for i, h in enumerate(block_hashes):
            if h not in cached:
                return i
        return len(block_hashes)

    def get_cached(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    def _take(self, block: Block) -> None:
        if block.ref_cnt == 0 and block.pin_cnt == 0:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self.num_evictable -= 1

    def touch(self, blocks: Iterable[Block]) -> None:
        """A request starts sharing these (cached) blocks."""
        for block in blocks:
            self._take(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` blocks for writing; evicts whatever they cached."""
        if n > self.free_queue.num_free:
            raise MemoryError(f"need {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_evictable -= 1
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _uncache(self, block: Block) -> None:
        h = block.block_hash
        if h is not None:
            block.block_hash = None
            if self.cached.get(h) is block:
                del self.cached[h]
                if self._changes is not None:
                    self._changes.append((False, h))

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Record that ``block`` holds the full block ``block_hash``. False if another block already does."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._changes is not None:
            self._changes.append((True, block_hash))
        return True

    def _release_if_free(self, block: Block) -> None:
        if block.ref_cnt == 0 and block.pin_cnt == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
                self.num_evictable += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference to each block; pass a request's table in chain order."""
        for block in reversed(blocks):  # tails enter the queue first, so they are evicted first
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            self._release_if_free(block)

    def pin(self, blocks: Iterable[Block]) -> None:
        """Keep blocks from reuse while a transfer reads or writes them."""
        for block in blocks:
            self._take(block)
            if block.pin_cnt == 0:
                self.num_pinned += 1
            block.pin_cnt += 1

    def unpin(self, blocks: Sequence[Block]) -> None:
        for block in reversed(blocks):
            if block.pin_cnt <= 0:
                raise RuntimeError(f"unpin of unpinned {block}")
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self.num_pinned -= 1
            self._release_if_free(block)

    def drop_cached(self, block: Block) -> None:
        """Forget a block's hash (its content turned out invalid, e.g. a failed load)."""
        if block.ref_cnt == 0 and block.pin_cnt == 0 and block.block_hash is not None:
            self.num_evictable -= 1
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        self._uncache(block)

    def stats(self) -> BlockPoolStats:
        num_free = self.free_queue.num_free
        evictable = self.num_evictable
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            used=self.num_blocks - num_free,
            pinned=self.num_pinned,
            evictable=evictable,
            empty=num_free - evictable,
        )
