"""The index base the client tiers and the cache server's stores share, on a floor of its own below both.

`tier_index`: `TierIndex`, what the scheduler side asks of every tier, with its counters. `indexed_tier`:
`IndexedTier`, the chunk index every storing tier keeps (entries, their two-phase lifecycle, pins, eviction
order, retention, purges): L1 and the disk tier on the client, the memory and disk stores in the server.
"""
