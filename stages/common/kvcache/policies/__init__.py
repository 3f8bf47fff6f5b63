"""Eviction policies: one file each, registered by name in POLICY_REGISTRY (one per name in POLICIES)."""

from schemas.params.rollout import POLICIES
from stages.common.kvcache.policies import dense, h2o, random_evict, recent, snapkv  # noqa: F401 (registration)
from stages.common.kvcache.policies.base import (
    POLICY_REGISTRY,
    EvictionPolicy,
    LayerSlots,
    evict,
    make_policy,
)

if set(POLICY_REGISTRY) != set(POLICIES):
    raise ImportError(f"eviction policies without a class: {sorted(set(POLICIES) - set(POLICY_REGISTRY))}")

__all__ = ["POLICY_REGISTRY", "EvictionPolicy", "LayerSlots", "evict", "make_policy"]
