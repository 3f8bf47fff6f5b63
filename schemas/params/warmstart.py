"""`warmstart:` section: supervised training so RL starts above zero reward."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WarmstartParams(BaseModel):
    """Supervised next-token training on the train split (loss on response tokens only), then a greedy eval."""

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(
        2000, ge=0, description="Optimizer steps (0 = copy the initial policy and only evaluate)."
    )
    batch_size: int = Field(16, ge=1, description="Sequences per optimizer step.")
    lr: float = Field(3e-4, gt=0, le=1.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup steps before the cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final learning rate as a fraction of `lr`.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta2: float = Field(0.98, gt=0.0, lt=1.0, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    curriculum_start: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="Sequence-length curriculum: fraction of the train split, shortest sequences first, that "
        "batches are drawn from at the start (1.0 = no curriculum).",
    )
    curriculum_hold: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Fraction of `steps` spent on the `curriculum_start` shortest sequences.",
    )
    curriculum_end: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="Fraction of `steps` at which the whole split is admitted (linear growth after the hold).",
    )
    max_minutes: float = Field(
        30.0,
        ge=0.0,
        description="Wall-clock safety cap on training in minutes (0 = none): training stops early when it is "
        "reached (the run is then no longer bit-reproducible; the metrics record the steps done). The stop that "
        "matters is `target_exact_match`, a step count that does not depend on the machine's speed; the cap is "
        "far above it (the default experiment reaches its target in ~4.5 min on 2 idle cores) so that a slower "
        "or busy machine gets the same warm start, not a half-trained one (a 5-minute cap stopped it at step 500 "
        "of 1075, EM 0, on 2 cores shared with other work).",
    )
    target_exact_match: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Stop training once greedy exact match on the held-out check rows reaches this, so RL "
        "starts above zero reward but below saturation (0 = always train `steps` steps).",
    )
    check_every: int = Field(
        25,
        ge=1,
        description="Steps between exact-match checks (when target_exact_match > 0). Accuracy on retrieval "
        "rises within ~100 steps once it starts, so checks are kept close to stop inside the band.",
    )
    check_rows: int = Field(
        64,
        ge=1,
        description="Train prompts held out of training for the checks: the longest ones (closest to the eval "
        "split's full context length).",
    )
    eval_batch_size: int = Field(32, ge=1, description="Prompts decoded together in the final greedy eval.")
    eval_max_new_tokens: int = Field(
        0, ge=0, description="Greedy response limit in the eval (0 = longest eval reference + 4 tokens)."
    )
    num_threads: int = Field(
        1,
        ge=0,
        description="torch CPU threads (0 = torch's default). One thread suits the tiny model on a shared CPU "
        "and, with a fixed count, keeps the run bit-reproducible.",
    )
    log_every: int = Field(25, ge=1, description="Steps between progress lines on stderr.")
