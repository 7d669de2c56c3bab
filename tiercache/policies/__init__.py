"""Pluggable cache policies, each chosen by name from a registry."""
from tiercache.policies.admission import (
    DEFAULT_ADMISSION,
    NOT_AN_ENTRY_GUARD,
    AdmissionPolicy,
    GuardedTier,
    admission_for,
    admission_policies,
    admitted_prefix,
    guards_entry,
)
from tiercache.policies.eviction import DEFAULT_EVICTION, EvictionPolicy, eviction_policies

__all__ = ["DEFAULT_ADMISSION", "DEFAULT_EVICTION", "NOT_AN_ENTRY_GUARD", "AdmissionPolicy", "EvictionPolicy",
           "GuardedTier", "admission_for", "admission_policies", "admitted_prefix", "eviction_policies", "guards_entry"]
