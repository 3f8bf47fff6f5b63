"""The evicting KV cache shared by rollout and evaluate: the sampling engine and its eviction policies."""
