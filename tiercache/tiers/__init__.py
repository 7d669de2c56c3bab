"""Tiers below L0. Each is two objects: an index on the scheduler side (`tiercache.index.tier_index`) and a
transport on each worker (`tiercache.tiers.base`); `tiercache.build.lower_tiers` builds them by name, importing
each lazily so optional backends stay optional."""
