"""L0: the paged KV pool (bookkeeping in `block_pool`/`block_manager`, bytes in `kv_cache`)."""
from tiercache.pool.block_manager import BlockCopy, BlockManager
from tiercache.pool.block_pool import Block, BlockPool, BlockPoolStats, FreeBlockQueue
from tiercache.pool.kv_cache import PagedKVCache

__all__ = ["Block", "BlockCopy", "BlockManager", "BlockPool", "BlockPoolStats", "FreeBlockQueue", "PagedKVCache"]
