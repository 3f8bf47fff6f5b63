"""Shared code several stages use: model loading and devices, the vocabulary, process groups, the evicting
KV-cache sampler and its policies, the vLLM sampler. Imports `schemas` only (tests/test_layout.py)."""
