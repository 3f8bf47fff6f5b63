"""Eviction policies: one file each, registered by name in POLICY_REGISTRY."""

from stages.kvcache.policies import dense, h2o, random_evict, recent, snapkv  # noqa: F401 (registration)
from stages.kvcache.policies.base import POLICY_REGISTRY, EvictionPolicy, LayerSlots, evict, make_policy

__all__ = ["POLICY_REGISTRY", "EvictionPolicy", "LayerSlots", "evict", "make_policy"]
