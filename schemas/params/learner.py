"""`learner:` section: objective, optimisation and DeepSpeed.

The objective fields are read by the objectives registered in `stages.learner.objectives` (each takes the
validated `LearnerParams`): their defaults live here only. The sampling temperature is not repeated here: the
learner must score tokens at `rollout.temperature`, the distribution that sampled them.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

Objective = Literal["smd", "shadow", "naive", "naive_bypass", "dense", "tis", "sparse_rl", "smd_released"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AdvantageScale = Literal["std", "none"]
RefKlKind = Literal["k1", "k2", "k3"]
TisLevel = Literal["token", "sequence"]
AttentionBackend = Literal["auto", "sdpa", "flex", "tiled"]
KlTokens = Literal["all", "keyed", "no_eos"]
KlTeacher = Literal["current", "reference", "ema"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)
REF_KL_KINDS: tuple[str, ...] = get_args(RefKlKind)
TIS_LEVELS: tuple[str, ...] = get_args(TisLevel)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
KL_TOKENS: tuple[str, ...] = get_args(KlTokens)
KL_TEACHERS: tuple[str, ...] = get_args(KlTeacher)


# The parity gate's default per model dtype (learner.parity_tol null). Measured max |learner - rollout log-prob| of
# the shadow-masked learner over real batches (the warm-started default policy, 128 trajectories of the default
# experiment's prompts per eviction policy; docs/design.md section 3): float32 <= 5.7e-6 (gate 1e-4, as before);
# bfloat16 0.060 (recent) to 0.118 (h2o) (gate 0.5: 4x the largest, while the dense learner's gap on the same
# batches, i.e. a mask that does not replay the rollout, is 7 to 13). float16 is not measured (CPU): it has 3 more
# mantissa bits than bfloat16, so bfloat16's gate is a loose bound for it.
PARITY_TOL_BY_DTYPE: dict[str, float] = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.5}

# What float32 rounding predicts for the rollout/learner gap (issue 31, docs/design.md section 3). Measured on
# SmolLM2-135M (30 layers, max |logit| 40.5): the relative error of every layer's hidden state against a float64
# replay stays at 3e-7..9e-7 (3-8 eps) from layer 0 to 29 -- rounding does not build up with depth -- and the
# log-prob error of each float32 computation (the engine's decode, the learner's masked forward) is at most
# 8.2 eps x max |logit| (3.9e-5): the lm head turns the final hidden state's relative error into an absolute logit
# error that scales with the logits. Two such computations differ by at most twice that.
FLOAT32_EPS = 1.1920928955078125e-07
PARITY_EPS_FACTOR = 16.0


def float32_parity_bound(max_abs_logit: float, temperature: float = 1.0) -> float:
    """The float32 rollout/learner log-prob gap that rounding explains: PARITY_EPS_FACTOR x eps x max |logit| /
    temperature (at least x 1: log-softmax over logits near 0 still rounds at eps scale). 7.7e-5 for SmolLM2-135M
    at temperature 1 (under the float32 gate of 1e-4); set `learner.parity_tol` from it for models with larger
    logits or a lower rollout temperature."""
    return PARITY_EPS_FACTOR * FLOAT32_EPS * max(1.0, max_abs_logit / temperature)


class LoraParams(BaseModel):
    """`learner.lora:` LoRA adapters trained in place of the full weights (Hu et al. 2021, "LoRA: Low-Rank
    Adaptation of Large Language Models"), through PEFT's `LoraConfig` (the fields are its `r`, `lora_alpha`,
    `target_modules` and `lora_dropout`; TRL's GRPOTrainer takes the same config as `peft_config`, verl the rank as
    `lora_rank`, OpenRLHF as `--lora_rank`). Defaults follow TRL's and verl's LoRA examples (r 16, alpha 32, every
    linear layer of the decoder). The base stays frozen; rollout and evaluation sample from the merged weights
    W + (alpha / rank) B A (`stages.common.lora`), the learner trains B and A in the adapter form
    (`stages.learner.lora`; docs/design.md, LoRA)."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(16, ge=1, description="The adapters' rank r (PEFT's `r`; verl's `lora_rank`).")
    alpha: float = Field(
        32.0, gt=0.0, description="PEFT's `lora_alpha`: the update B A is scaled by alpha / rank (TRL's and "
        "verl's examples use alpha = 2 x rank).",
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="PEFT's `target_modules`: module names (suffixes, e.g. [q_proj, v_proj]) or `all-linear` "
        "(every linear layer of the decoder, the lm head excluded: PEFT's rule, verl's default). The lm head and "
        "the embeddings cannot be adapted (the learner scores through the head's plain weight).",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="PEFT's `lora_dropout` on the adapters' input, active in the learner's forward with gradient "
        "only. 0 (the default) keeps smd strictly on-policy: with dropout > 0 the learner's forward is not the "
        "policy that sampled, so the parity gate refuses it for smd and shadow (one line); the dense objectives "
        "accept it.",
    )


class LearnerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    objective: Objective = Field(
        "smd",
        description=f"One of {OBJECTIVES} (docs/design.md, section 7): smd = shadow-masked GRPO + kl_lambda * "
        "KL(sg[pi_dense] || pi_masked); shadow = smd with kl_lambda 0 (no dense pass); naive = dense learner, old "
        "log-probs recomputed by the dense learner before the first update, the rollout/learner mismatch ignored "
        "(what a framework whose rollout engine compresses the cache does); naive_bypass = dense learner, old "
        "log-probs = the sparse rollout's (ratio pi_dense / pi_sparse from the first step; dual-clip); dense = the "
        "same rule as naive_bypass, named for dense rollouts (eviction policy dense), where rollout and dense "
        "learner log-probs coincide; tis = dense learner with truncated importance weights (verl's decoupled "
        "TIS); sparse_rl = dense learner with Sparse-RL's rejection and reweighting (official configuration); "
        "smd_released = the rule of the SMD authors' released code (huthvincent/RL-Post-Training-with-KV-Cache-"
        "Compression, SMD/src/shadow_distillation_loss.py): PPO-clip GRPO on the dense log-probs (old = recomputed) "
        "over the response tokens whose shadow-mask visibility is <= released_retention + released_margin, plus "
        "kl_lambda * mean(clamp(rollout_logp - dense_logp, min=0)), both per-sequence means over all valid tokens.",
    )
    kl_lambda: float = Field(
        0.1, ge=0.0, description="Weight of KL(sg[pi_dense] || pi_masked) in `smd`; of the one-sided distillation "
        "term mean(clamp(rollout_logp - dense_logp, min=0)) in `smd_released` (the released code's "
        "--shadow-distill-lambda, 0.1).",
    )
    released_retention: float | None = Field(
        None, gt=0.0, le=1.0,
        description="`smd_released`'s trusted-token filter: a response token counts when its shadow-mask "
        "visibility is <= released_retention + released_margin (the released code's --shadow-retention-ratio). "
        "null = the keep ratio the trajectory table records (rollout.eviction.keep_ratio of its producer).",
    )
    released_margin: float = Field(
        0.05, ge=0.0, description="`smd_released`: the margin of the trusted-token filter (the released code's "
        "hard-coded `retention_ratio + 0.05`).",
    )
    kl_tokens: KlTokens = Field(
        "all",
        description=f"Where `smd`'s dense-teacher KL applies, one of {KL_TOKENS} (the policy term is unchanged): "
        "all = every response token (the SMD paper); no_eos = every response token but EOS (the tokenizer's "
        "eos_token_id, the token the rollout stops at); keyed = only the response tokens with an induction key in "
        "the prompt (a position k with prompt[k] = the token and prompt[k-1] = the token before it) for the "
        "sampled token or for the dense teacher's most likely token there (`stages.learner.kl_tokens`; the "
        "`classes_needed` rule of `smdctl probe-kl`). The probe (stages/tools/kl_probe.py, issue 22 item 5) found "
        "on pointer_chasing that the KL on tokens without a key (EOS, separators, wrong hops) has a gradient "
        "anti-aligned with the dense policy's held-out reference NLL (cosine -0.2 to -0.6, growing over "
        "iterations), the keyed part's near-orthogonal. The KL is aggregated with `loss_agg` over the selected "
        "tokens only (token_mean: their mean, so each selected token weighs 1 / fraction more than under all), "
        "per micro-batch (0 when a micro-batch has none); `kl/token_fraction` logs the fraction selected.",
    )
    kl_teacher: KlTeacher = Field(
        "current",
        description=f"Whose dense forward is `smd`'s teacher, one of {KL_TEACHERS}: current = the policy being "
        "trained, run densely under no_grad (the SMD paper's sg[pi_dense]: the same weights); reference = the "
        "frozen policy at `reference_path` (the warm start by default), run densely under no_grad, so the "
        "teacher cannot drift with the student. smd's own option (issue 22 item 5): on pointer_chasing the "
        "paper's KL fell to ~0 (0.58 -> 0.004 at kl_lambda 0.8) while the dense policy lost the context it "
        "was meant to teach, because teacher and student share the weights the KL updates. The dense-vs-rollout "
        "mismatch metrics (`dense_mismatch/*`) describe the current policy and are not logged with `reference`; "
        "ema = an exponential moving average of the policy's weights (decay `ema_decay`), updated after every "
        "optimizer step and saved with the policy (trainer_state/ema_teacher.safetensors; initialised from the "
        "policy when absent): the mean teacher of BYOL (Grill et al. 2020), DINO (Caron et al. 2021) and Mean "
        "Teacher (Tarvainen & Valpola 2017), the remedy for a self-distillation target that collapses with the "
        "student. Both reference and ema run their own dense forward and hold a second copy of the weights.",
    )
    ema_decay: float = Field(
        0.99, ge=0.0, lt=1.0,
        description="`kl_teacher=ema`: after each optimizer step ema = ema_decay * ema + (1 - ema_decay) * policy "
        "(BYOL's tau, DINO's teacher momentum; both start at 0.99-0.996 over many thousands of steps). With one "
        "step per iteration, 0.99 gives the teacher a ~100-iteration memory: between the paper's current policy "
        "(0) and the frozen warm start (1).",
    )
    lr: float = Field(
        3e-5, gt=0, description="AdamW learning rate (after warm-up). 3e-5 on the tiny default model: 1e-4 and "
        "above let noise from one batch undo the previous steps (held-out reference NLL rises after a few "
        "iterations); see docs/design.md, RL defaults.",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over the first N optimizer steps of the run (counted "
        "across iterations through the resumed step counter; 0 = none), as verl's `lr_warmup_steps`.",
    )

    # GRPO
    advantage_scale: AdvantageScale = Field(
        "std",
        description=f"One of {ADVANTAGE_SCALES}: std = (r - group mean) / (group std + eps) (GRPO, DeepSeekMath; "
        "TRL's and verl's default, and the SMD paper's); none = r - group mean (Dr. GRPO, Liu et al. 2025). With "
        "`none` the advantages of a [0, 1] reward are ~0.2 and smd's dense-teacher KL (kl_lambda 0.1) dominates "
        "the update (measured: docs/results-rl.md).",
    )

    advantage_eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing.")
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, gt=0.0, description="PPO clip: ratio <= 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."
    )
    loss_agg: LossAgg = Field(
        "token_mean",
        description=f"One of {LOSS_AGGS} (verl names): token_mean = sum over valid tokens / their number; "
        "seq_mean_token_mean = mean over sequences of per-sequence token means; seq_mean_token_sum = mean over "
        "sequences of per-sequence token sums. Applies to every loss term.",
    )

    # Optional KL to a frozen reference policy
    ref_kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL to a reference policy (0 = off, no reference pass)."
    )
    ref_kl_kind: RefKlKind = Field(
        "k3",
        description=f"Estimator of KL(pi || pi_ref) on sampled tokens, one of {REF_KL_KINDS} (k3 = low variance).",
    )

    # Off-policy corrections of the dense baselines
    tis_level: TisLevel = Field(
        "token",
        description=f"`tis`: one of {TIS_LEVELS}: w = min(pi_dense / pi_rollout, tis_cap) per token, or of the "
        "product over the sequence.",
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="Truncation C of `tis`'s importance weights (verl's rollout_is_threshold), and of the "
        "truncated-weight mismatch metrics (mismatch/rollout_is_*).",
    )
    dual_clip_c: float | None = Field(
        3.0,
        gt=1.0,
        description="Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): for A < 0 the per-token loss is capped at "
        "-c * A, so a token whose ratio explodes cannot dominate the gradient. Applied to every objective as verl "
        "does (it binds only where the ratio exceeds c: naive_bypass / dense on sparse rollouts, or several "
        "updates per batch); null = off.",
    )
    # Sparse-RL (arXiv 2601.10079); defaults = the official configuration (lsjia/Sparse-RL, slime `mis`)
    sparse_rl_is_cap: float = Field(
        1.5, ge=1.0, description="`sparse_rl`: token importance weight min(pi_dense / pi_rollout, cap)."
    )
    sparse_rl_token_ratio_low: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="`sparse_rl`: tokens whose ratio pi_dense / pi_rollout is below this are masked out of the loss.",
    )
    sparse_rl_token_ratio_high: float = Field(
        1.5,
        ge=1.0,
        description="`sparse_rl`: tokens whose ratio pi_dense / pi_rollout is above this are masked out of the loss.",
    )
    sparse_rl_veto_threshold: float = Field(
        1e-4,
        ge=0.0,
        le=1.0,
        description="`sparse_rl`: a sequence holding any token with pi_dense / pi_rollout below this is vetoed "
        "(dropped whole; 0 = off).",
    )
    sparse_rl_batch_normalize: bool = Field(
        True,
        description="`sparse_rl`: divide the token weights by their mean over the kept tokens of the whole "
        "mini-batch (mean 1).",
    )
    sparse_rl_seq_ratio_max: float | None = Field(
        None,
        ge=1.0,
        description="`sparse_rl`, optional (not in the official configuration; verl's `geometric` rejection mode): "
        "also reject a sequence whose geometric-mean ratio exp(mean_t log(pi_dense / pi_rollout)) lies outside "
        "[1/c, c]. null = off.",
    )
    released_loss_agg: LossAgg | None = Field(
        "seq_mean_token_mean",
        description="`smd_released`'s loss aggregation: the released code reduces both terms with slime's "
        "sum_of_sample_mean (per sequence: the sum over its tokens / its valid response tokens, then the mean over "
        "sequences; no --calculate-per-token-loss in any released script). null = `loss_agg`.",
    )
    sparse_rl_loss_agg: LossAgg | None = Field(
        "seq_mean_token_mean",
        description="`sparse_rl`'s loss aggregation (the official per-sequence token mean); null = `loss_agg`.",
    )

    # Optimisation and DeepSpeed
    epochs: int = Field(1, ge=1, description="Passes over the iteration's batch (PPO epochs).")
    updates_per_epoch: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass: the batch is split into this many mini-batches (shuffled with "
        "the seed when > 1). 1 = one step on the whole batch, strictly on-policy.",
    )
    micro_batch_size: int = Field(
        8, ge=1, description="Sequences per forward/backward on each process (gradients accumulate across them)."
    )
    micro_batch_tokens: int | None = Field(
        None, ge=0,
        description="Micro-batches by a token budget instead of `micro_batch_size` rows (verl's use_dynamic_bsz with "
        "ppo_max_token_len_per_gpu; OpenRLHF's --train.dynamic_batch_enable; stages/learner/token_budget.py, "
        "docs/design.md §3d). Each process's rows, longest first, are cut into micro-batches whose padded tokens "
        "(rows x the longest row's prompt + response: what the learner's right-padded [B, T] tensors hold, evict_at "
        "[L, B, H, T] and the per-sample forward's activations among them) stay within the budget, so short "
        "responses fill a micro-batch with more rows and one long response no longer sets the rows of all. With "
        "`shared_prompt` a micro-batch holds whole GRPO groups (never part of one). Processes then take rows (or "
        "groups) balanced by tokens (Karmarkar-Karp's largest differencing, as verl's seqlen_balancing) instead of "
        "round-robin. `micro_batch_size` is then not read. The step is the same whatever the partition (float64 "
        "tests to 1e-12; with kl_tokens other than `all` the KL's mean is per micro-batch, as with row counts). A "
        "budget below one row's (with shared prompts one group's) padded tokens is refused. null or 0 = off "
        "(the default).",
    )
    grad_clip: float = Field(1.0, ge=0.0, description="Global gradient-norm clipping (0 = off).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, gt=0.0, lt=1.0, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    adam_fused: bool = Field(
        True, description="torch's fused AdamW kernel (`torch.optim.AdamW(fused=True)`, CPU and CUDA), the "
        "transformers Trainer's default optimizer (`adamw_torch_fused`): the same update as the multi-tensor "
        "(`foreach`) one to rounding, ~5x faster on one CPU thread for SmolLM2-135M (docs/design.md §3c). false: "
        "the foreach implementation.")
    zero_stage: Annotated[int, Field(ge=0, le=2)] | Literal["auto"] = Field(
        "auto",
        description="DeepSpeed ZeRO stage: 0 = plain data parallel, 1 = optimizer state partitioned across "
        "processes, 2 = optimizer state and gradients partitioned. auto = the stage a resumed trainer state was "
        "saved with (its resume stays bit for bit), else 0 on one process and 1 on several (`zero_stage_for`). "
        "One process by default (several through the `deepspeed` launcher); there stages 1 and 2 partition "
        "nothing but keep flat fp32 copies of the parameters and gradients (+1.36 GB peak on SmolLM2-135M), "
        "which 0 avoids (docs/design.md §3c).",
    )
    attention_backend: AttentionBackend = Field(
        "auto",
        description=f"Shadow attention backend, one of {ATTENTION_BACKENDS}: auto = flex on CUDA, sdpa on the CPU "
        "(the model's device, model.device; `backend_for`); sdpa = reference, an explicit "
        "[B, H, T, T] boolean mask per layer (short sequences); flex = FlexAttention with a block mask built "
        "from evict_at (no T x T mask; compiled on first use; for long contexts on CUDA); tiled = query tiles "
        "through PyTorch's fused CPU flash-attention kernel over the keys each head still sees (no T x T mask, "
        "no compilation; for long contexts on CPU).",
    )
    flex_block_size: int = Field(
        128, ge=16, description="FlexAttention block size (query and key tiles); sequences are padded to it."
    )
    logit_chunk_tokens: int = Field(
        256,
        ge=1,
        description="Response tokens whose logits exist at once: log-probs, entropy and the dense-teacher KL are "
        "computed from the final hidden states through the lm head this many tokens at a time, and the backward "
        "recomputes each chunk (stages/learner/logprobs.py), so the learner never holds [B, T, V] logits. Logit "
        "memory ~ 2 x chunk x vocabulary x 4 bytes (256 x 151,936: ~0.3 GiB); the tiny model's batches fit one "
        "chunk. Larger = fewer, larger lm-head matmuls.",
    )
    shared_prompt: bool = Field(
        True,
        description="Forward each GRPO group's prompt once per micro-batch (stages/learner/shared_prompt.py, "
        "docs/design.md §3c): micro-batches hold whole groups (or parts of one), the prompt runs once into a KV "
        "cache, and the group's responses run on top of it, each under its own shadow mask; the dense teacher "
        "shares the same prompt pass. The same loss and gradients as the per-sample forward (float64 tests to "
        "1e-10), with the prompt's tokens forwarded once instead of G times. false: every sample forwards its "
        "prompt (the per-sample reference). With gradient_checkpointing the per-sample forward runs.",
    )
    pack: bool = Field(
        False,
        description="Packed rows (stages/learner/packing.py, docs/design.md §3e): each micro-batch's rows are "
        "concatenated into one row of their real tokens (batch 1, no padding; position ids restart at 0 in every "
        "row), under the mask 'same row AND shadow-visible', itself a shadow mask (each row's evict_at shifted to "
        "its place and capped at the row's end), which every attention backend replays unchanged; the dense passes "
        "(dense objectives, smd's teacher) run the block-diagonal causal mask. The same loss and gradients as the "
        "padded learner (float64 tests to 1e-10); with `micro_batch_tokens` the budget counts the packed (real) "
        "tokens. Needs `shared_prompt: false` (a prompt key's mask differs per sample of its group: one packed row "
        "cannot hold a group's responses over one copy of the prompt). smd's dense teacher then runs the whole "
        "packed row (the padded path shares the rows before the first eviction with it). sdpa builds an explicit "
        "[N, N] mask per layer for the packed row: use tiled (CPU) or flex (CUDA) for long micro-batches. Anchors: "
        "verl's use_remove_padding, OpenRLHF's --ds.packing_samples, Hugging Face's DataCollatorWithFlattening. "
        "false = right-padded micro-batches (the default).",
    )
    sequence_parallel: int = Field(
        1, ge=1,
        description="Sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509; "
        "stages/learner/sequence_parallel.py, docs/design.md §6b): each micro-batch's sequence is split over this "
        "many consecutive processes, each forwarding T/N positions (T padded to a multiple of N) with their global "
        "position ids; DeepSpeed's DistributedAttention (`deepspeed.sequence.layer`) all-to-alls q/k/v so that each "
        "process attends over the whole sequence for H/N heads and replays the shadow mask of its own KV heads (a "
        "GQA group is never split: the model's KV heads must divide by N). Each process scores its positions, the "
        "loss's normalisers are the whole micro-batch's, and the group's gradients sum to the one-process gradient "
        "(2-process float64 tests: every gradient within 1e-15 relative but the chunked lm head's float32-accumulated "
        "one). The processes (the `deepspeed` launcher's) must divide by N; the batch "
        "is split over the W / N groups. Needs `shared_prompt: false` and `pack: false`. 1 = off (the default).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Activation checkpointing of every decoder layer (transformers' activation_checkpointing_enable, "
        "non-reentrant torch.utils.checkpoint): layer activations are recomputed in backward instead of kept, "
        "through the shadow attention too (same gradients). smd's teacher then runs as a separate dense pass "
        "instead of sharing the prefill rows (a checkpointed layer cannot write the shared KV cache).",
    )
    parity_tol: float | None = Field(
        None,
        gt=0.0,
        description="Parity gate: before the first optimizer step, smd/shadow refuse to train when "
        "max |learner log-prob - rollout log-prob| over the batch exceeds this (the shadow mask does not "
        "reproduce the rollout: off-policy). null = the default of model.dtype (PARITY_TOL_BY_DTYPE: float32 "
        "1e-4, bfloat16 and float16 0.5), set from measured gaps (docs/design.md, section 3).",
    )
    parity_from_training_forward: bool = Field(
        False,
        description="smd's own variant (off: the separate parity pass, as designed): when the parity pass's "
        "log-probs would serve only the parity gate and the mismatch metrics (smd and shadow, whose old "
        "log-probs are the rollout's, with one optimizer step per iteration and no reference KL), skip it and "
        "give the gate the training forward's own log-probs, checked after the backward and before the "
        "optimizer step: the same update bit for bit, one masked forward less (about 15% of an smd iteration "
        "on pointer_chasing); the parity figures then come from the training forward's kernels (the "
        "shared-prefix teacher path), which round differently at float32 eps. Every other case runs the "
        "separate pass regardless.",
    )
    resume_optimizer: bool = Field(
        True,
        description="Continue the optimizer state (AdamW moments, step counter, RNG) saved in the starting "
        "policy's `trainer_state/` when present (same number of processes and ZeRO stage).",
    )
    lora: LoraParams | None = Field(
        None,
        description="LoRA adapters instead of full fine-tuning (`LoraParams`: rank, alpha, target_modules, "
        "dropout); null = full fine-tuning (the default). Each iteration's policy is then the adapter in PEFT's "
        "format plus a record of its base (path and weights digest, `lora_base.json`): the first learn call adds "
        "a fresh adapter to the policy it starts from (B = 0: the same policy), the next ones continue the "
        "adapter of theirs and its AdamW state (the adapter's parameters only). The reference of `ref_kl_coef` "
        "and the teacher of `kl_teacher: reference` are the base with the adapter disabled (PEFT's "
        "`disable_adapter()`, as TRL computes its reference under PEFT: no second model; `reference_path` is not "
        "read); `kl_teacher: ema` is not supported with it. `smdctl merge-lora` writes the merged weights as a "
        "plain model.",
    )
    reference_path: str = Field(
        "artifacts/warmstart/policy",
        description="Reference policy for the KL of `ref_kl_coef` and the teacher of `kl_teacher=reference` (read "
        "only when ref_kl_coef > 0 or smd runs with that teacher).",
    )
    seed: int | None = Field(
        None, ge=0, description="Learner seed (mini-batch shuffling, RNG); None = derive from the global seed."
    )
    num_threads: int = Field(0, ge=0, description="torch CPU threads per process (0 = leave torch's default).")

    @model_validator(mode="after")
    def _pack_needs_per_sample_prompts(self) -> LearnerParams:
        if self.pack and self.shared_prompt:
            raise ValueError("learner.pack: true needs learner.shared_prompt: false (a prompt key's shadow mask "
                             "differs per sample of its group, so a group's responses cannot share one packed row)")
        return self

    @model_validator(mode="after")
    def _sequence_parallel_runs_per_sample_rows(self) -> LearnerParams:
        if self.sequence_parallel > 1 and (self.shared_prompt or getattr(self, "pack", False)):
            raise ValueError("learner.sequence_parallel > 1 needs learner.shared_prompt: false and learner.pack: "
                             "false (each process holds a contiguous chunk of every right-padded row)")
        return self

    def backend_for(self, device_type: str) -> str:
        """The shadow-attention backend that runs on a device of `device_type` ("cpu", "cuda"): `attention_backend`,
        or for `auto` flex on CUDA (FlexAttention's compiled forward and backward) and sdpa elsewhere (the reference;
        on the CPU PyTorch has no FlexAttention backward)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "flex" if device_type == "cuda" else "sdpa"

    def parity_tol_for(self, dtype: str) -> float:
        """The parity gate for a model of `dtype` (model.dtype): `parity_tol`, or the dtype's default."""
        return self.parity_tol if self.parity_tol is not None else PARITY_TOL_BY_DTYPE[dtype]
