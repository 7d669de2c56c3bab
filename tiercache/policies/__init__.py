"""Pluggable cache policies, each chosen by name from a registry."""
from tiercache.policies.admission import AdmissionPolicy, admission_policies
from tiercache.policies.eviction import EvictionPolicy, eviction_policies

__all__ = ["AdmissionPolicy", "EvictionPolicy", "admission_policies", "eviction_policies"]
