"""`learner:` section: objective, optimisation and DeepSpeed.

The objective fields map one to one onto the keyword arguments of
`stages.learner.objectives.objective_loss` (see `objective_kwargs` there). The sampling temperature is not
repeated here: the learner must score tokens at `rollout.temperature`, the distribution that sampled them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

OBJECTIVES = ("smd", "shadow", "dense", "tis", "sparse_rl")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
ADVANTAGE_SCALES = ("std", "none")
REF_KL_KINDS = ("k1", "k2", "k3")
TIS_LEVELS = ("token", "sequence")


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {field} {value!r}; choose one of {', '.join(choices)}")


class LearnerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    objective: str = Field(
        "smd",
        description=f"One of {OBJECTIVES}: smd = shadow-masked GRPO + kl_lambda * KL(sg[pi_dense] || pi_masked); "
        "shadow = smd with kl_lambda 0 (no dense pass); dense = naive dense learner, ratio against the sparse "
        "rollout's log-probs; tis = dense learner with truncated importance weights; sparse_rl = dense learner "
        "with sparsity-aware rejection sampling + token reweighting.",
    )
    kl_lambda: float = Field(0.1, ge=0.0, description="Weight of KL(sg[pi_dense] || pi_masked) in `smd`.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")

    # GRPO
    advantage_scale: str = Field(
        "std",
        description=f"One of {ADVANTAGE_SCALES}: std = (r - group mean) / (group std + eps) (GRPO); "
        "none = r - group mean (Dr. GRPO).",
    )
    advantage_eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing.")
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, gt=0.0, description="PPO clip: ratio <= 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."
    )
    loss_agg: str = Field(
        "token_mean",
        description=f"One of {LOSS_AGGS} (verl names): token_mean = sum over valid tokens / their number; "
        "seq_mean_token_mean = mean over sequences of per-sequence token means; seq_mean_token_sum = mean over "
        "sequences of per-sequence token sums. Applies to every loss term.",
    )

    # Optional KL to a frozen reference policy
    ref_kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL to a reference policy (0 = off, no reference pass)."
    )
    ref_kl_kind: str = Field(
        "k3",
        description=f"Estimator of KL(pi || pi_ref) on sampled tokens, one of {REF_KL_KINDS} (k3 = low variance).",
    )

    # Off-policy corrections of the dense baselines
    tis_level: str = Field(
        "token",
        description=f"`tis`: one of {TIS_LEVELS}: w = min(pi_dense / pi_rollout, tis_cap) per token, or of the "
        "product over the sequence.",
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="Truncation C of importance weights (`tis`, and Sparse-RL's token reweighting).",
    )
    sparse_rl_seq_ratio_max: float = Field(
        2.0,
        ge=1.0,
        description="`sparse_rl`: reject a sequence whose geometric-mean ratio exp(mean_t log(pi_dense / "
        "pi_rollout)) lies outside [1/c, c].",
    )
    sparse_rl_token_ratio_min: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="`sparse_rl`: also reject a sequence holding any token with pi_dense / pi_rollout below this "
        "(a token the sparse sampler made up; 0 = off).",
    )

    @model_validator(mode="after")
    def _check(self) -> LearnerParams:
        _choice("objective", self.objective, OBJECTIVES)
        _choice("advantage_scale", self.advantage_scale, ADVANTAGE_SCALES)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("ref_kl_kind", self.ref_kl_kind, REF_KL_KINDS)
        _choice("tis_level", self.tis_level, TIS_LEVELS)
        return self
