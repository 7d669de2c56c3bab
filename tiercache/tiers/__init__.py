"""Tiers below L0, chosen by name from `tier_types`; each imports lazily so optional backends stay optional."""
from tiercache.registry import Registry
from tiercache.tiers.base import Medium, Tier, TierCounters

tier_types: Registry[type[Tier]] = Registry("tier")
tier_types.register("cpu", "tiercache.tiers.cpu:CpuTier")

__all__ = ["Medium", "Tier", "TierCounters", "tier_types"]
