"""Pluggable cache policies (eviction now; admission and promotion join here)."""
from tiercache.policies.eviction import EvictionPolicy, eviction_policies

__all__ = ["EvictionPolicy", "eviction_policies"]
