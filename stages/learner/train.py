"""`smdctl learn`: GRPO post-training of the policy on one iteration's rollouts under DeepSpeed (docs/design.md).

Flow of `run_learner(...)`, one named step each:
  1. `setup`: read and cross-check the inputs (trajectory table, compacted mask store for smd/shadow, policy),
     GRPO advantages over the whole batch grouped by prompt_id; join/create the process group, build the
     DeepSpeed engine (torch AdamW, ZeRO stage from params), resume the optimizer state saved beside the
     starting policy when present. Bad input: SmdInputError, nothing written.
  2. `parity_pass` (no gradient, before any optimizer step): learner log-probs of every response token --
     shadow-masked for smd/shadow, dense for the dense learners -- against the rollout's. smd/shadow refuse
     to train when max |delta| > learner.parity_tol (default per model.dtype) (the mask does not reproduce the sampler: training would
     be silently off-policy). The same numbers are the proximal `old_logp` of naive/tis/sparse_rl (the
     dense learner's log-probs before the first update: naive's ratio is exactly 1 at the first step), and
     they fix sparse_rl's rejection and its batch-normalisation constant per mini-batch. When the pass would
     serve only the gate and the metrics (smd/shadow, one optimizer step, no reference KL) and
     `learner.parity_from_training_forward` is on, it is skipped: the gate takes the training forward's own log-probs
     after the backward, before the optimizer step (`fused_parity`; the same update, one forward less).
  3. `train_step` x (epochs x updates_per_epoch): per micro-batch (`micro_step`) the shadow-masked forward
     with gradient (smd, shadow) or the dense one (naive, naive_bypass, dense, tis, sparse_rl); for smd with kl_lambda > 0 also the
     dense forward of the same weights under no_grad as teacher -- the rows before the first eviction (the
     prompt, prefilled densely) are the same for both and run once (`response_hidden_with_teacher`; log-probs, entropy and the teacher KL from the final hidden states in token chunks, `chunked_token_scores`);
     with learner.kl_teacher=reference the teacher is instead the frozen policy at learner.reference_path
     (`as_frozen_teacher`), its own dense forward under no_grad, then the masked forward of the policy; with
     learner.kl_teacher=ema the same with the EMA of the policy's weights (`stages.learner.ema`), updated after
     each optimizer step and saved in the new policy's trainer_state/;
     smd_released: the dense forward, its policy term over the trusted tokens (`stages.learner.released`, from
     the mask store, computed once per row in `setup`);
     smd's KL on the tokens of learner.kl_tokens (`stages.learner.kl_tokens`: all, no_eos, keyed; the mask built
     here per micro-batch, keyed from the teacher's argmax of the chunked scoring);
     `objective_loss` (the objective registered under learner.objective). Each micro-batch loss is weighted
     by its share of the mini-batch's aggregation denominator (valid kept tokens for token_mean, sequences for the seq_mean_* modes) so that the accumulated
     gradient over micro-batches and processes equals the gradient of the objective on the whole mini-batch.
     Per step: loss terms, clip fraction, approx KL, entropy, zero-advantage groups, grad norm, mismatch.
  4. `write_outputs`: atomically write `out_dir` (Hugging Face policy + tokenizer + trainer_state/) and
     `metrics_dir` (metrics.json headline, details.json, steps.json); on any failure the previous checkpoint
     and earlier outputs are untouched.

Sharding: every process reads the whole table; mini-batch rows go to processes round-robin (rows
[rank::world]), each process's rows are grouped by length into micro-batches, and processes with fewer
micro-batches run zero-weight ones so that all take part in every gradient reduction. With
`learner.shared_prompt` (the default) processes take whole GRPO groups round-robin instead, micro-batches hold
whole groups (or parts of one), and each run of rows with one prompt forwards it once
(`stages.learner.shared_prompt`; docs/design.md §3c). With `learner.micro_batch_tokens` micro-batches are cut by a
padded-token budget (whole groups with shared prompts) and processes take rows (or groups) balanced by tokens with
Karmarkar-Karp (`stages.learner.token_budget`; docs/design.md §3d). With `learner.pack` each micro-batch's rows run
as one packed row of their real tokens (`stages.learner.packing`; docs/design.md §3e).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import ValidationError

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.layout import STEPS
from schemas.metrics import write_metrics
from schemas.params import Params, format_validation_error
from schemas.params.learner import LearnerParams
from schemas.weights import write_weights_digest
from stages.common.distributed import agree, write_collectively
from stages.common.model import check_positions, load_policy, load_tokenizer, place_model
from stages.learner.data import LearnerData, MicroBatch, build_micro_batch, load_learner_data, read_evict_at
from stages.learner.deepspeed_runtime import (
    TRAINER_STATE,
    DistContext,
    init_distributed,
    load_trainer_state,
    make_engine,
    release_engine,
    save_trainer_state,
    saved_zero_stage,
    zero_stage_for,
)
from stages.learner.dense_attention import use_sdpa_gqa
from stages.learner.ema import ema_path, ema_teacher, ema_update_, save_ema
from stages.learner.kl_tokens import kl_token_mask
from stages.learner.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    accumulate_head_grad,
    chunked_token_scores,
    lm_head_of,
)
from stages.learner.lora import LoraPolicy, check_lora_params, load_lora_policy, refuse_adapter_without_lora
from stages.learner.mismatch import check_finite, mismatch_metrics
from stages.learner.objectives import (
    KL_TOKEN_FRACTION,
    LOSS_TERMS,
    TRUSTED_FRACTION,
    ObjectiveBatch,
    ObjectiveSpec,
    loss_agg_for,
    objective_loss,
    objective_spec,
    rejection_fractions,
    sparse_rl_rejection,
    sparse_rl_rules,
    sparse_rl_weight_sums,
    zero_advantage_group_fraction,
)
from stages.learner.packing import packed_hidden, packed_hidden_with_teacher
from stages.learner.released import released_trusted, released_visibility
from stages.learner.sequence_parallel import data_parallel, new_sequence_parallel, sequence_parallel_scores
from stages.learner.shadow_attention import (
    checkpointed_layers,
    enable_layer_checkpointing,
    response_hidden,
    response_hidden_with_teacher,
)
from stages.learner.shared_prompt import shared_prompt_hidden
from stages.learner.token_budget import budget_micro_batches, karmarkar_karp


# ------------------------------------------------------------------------------------------ validation
def validated(cfg: LearnerParams) -> LearnerParams:
    """The learner section re-validated by its pydantic model (a params object built in code, e.g. with
    `model_copy(update=...)`, skips validation); one line naming the key on failure."""
    try:
        return LearnerParams.model_validate(cfg.model_dump())
    except ValidationError as err:
        raise SmdInputError(format_validation_error(err, "learner params").replace(": ", ": learner.", 1)) from err


def lr_at(step: int, cfg: LearnerParams) -> float:
    """Learning rate of optimizer step `step` (0-based, counted over the whole run): linear warm-up from
    lr / lr_warmup_steps to lr over the first lr_warmup_steps steps, then constant (verl's
    `lr_warmup_steps` with a constant schedule)."""
    if cfg.lr_warmup_steps <= 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.lr_warmup_steps)


def runs_dense_teacher(cfg: LearnerParams) -> bool:
    """Whether the objective adds the dense-teacher KL (smd with kl_lambda > 0)."""
    return objective_spec(cfg.objective).dense_teacher and cfg.kl_lambda > 0


def as_frozen_teacher(reference, policy, path: str | Path):
    """The dense teacher of `learner.kl_teacher=reference`: the loaded policy of `path` (learner.reference_path),
    without gradients; one line when its vocabulary or hidden size differs from the trained `policy`'s (the KL
    compares the two distributions token by token over one vocabulary)."""
    for key in ("vocab_size", "hidden_size"):
        mine, theirs = getattr(policy.config, key, None), getattr(reference.config, key, None)
        if mine != theirs:
            raise SmdInputError(f"{Path(path) / 'config.json'}: {key} {theirs} does not match the policy's {mine} "
                                "(learner.reference_path, the teacher of learner.kl_teacher=reference)")
    return reference.requires_grad_(False)


def reference_policy(cfg: LearnerParams, lora: LoraPolicy | None, policy, dtype: str):
    """The frozen reference of `ref_kl_coef` and the teacher of `kl_teacher=reference`: the policy at
    `learner.reference_path` (`as_frozen_teacher`), or under `learner.lora` the adapter's base with the adapter
    disabled (`LoraPolicy.base_view`: PEFT's `disable_adapter()`, as TRL's reference under PEFT; no second model)."""
    if lora is not None:
        return lora.base_view()
    return as_frozen_teacher(load_policy(cfg.reference_path, dtype), policy, cfg.reference_path)


def released_retention(cfg: LearnerParams, data: LearnerData) -> float:
    """smd_released's retention: `learner.released_retention`, or the keep ratio the trajectory table records
    (rollout.eviction.keep_ratio of the rollout that produced it); one line when neither is there."""
    if cfg.released_retention is not None:
        return cfg.released_retention
    keep = data.rollout_config.get("rollout", {}).get("eviction", {}).get("keep_ratio")
    if keep is None:
        raise SmdInputError(f"{data.trajectories_path}: its config records no rollout.eviction.keep_ratio; set "
                            "learner.released_retention (the retention of smd_released's trusted-token filter)")
    return float(keep)


def trusted_rows(cfg: LearnerParams, data: LearnerData) -> dict[int, np.ndarray]:
    """Per row, smd_released's trusted response tokens (bool [R_row]): the released code's visibility of each
    token's query row under the row's shadow mask <= retention + released_margin (`stages.learner.released`)."""
    retention = released_retention(cfg, data)
    rows = list(range(len(data)))
    return {r: released_trusted(released_visibility(ev.numpy(), len(data.prompt_ids[r])), retention,
                                cfg.released_margin)
            for r, ev in zip(rows, read_evict_at(data, rows))}


# ------------------------------------------------------------------------------------------ scoring
def micro_batch_hidden(model, mb: MicroBatch, masked: bool, backend: str = "sdpa", shared: bool = False,
                       block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states at the response positions of `mb` (`response_hidden`), shadow-masked when `masked`,
    each group's prompt forwarded once when `shared` (`shared_prompt_hidden`), of the packed row when `mb.packed`
    (`packed_hidden`, learner.pack)."""
    evict_at = mb.evict_at if masked else None
    if mb.packed:
        return packed_hidden(model, mb.input_ids, evict_at, mb.prompt_lens, mb.resp_lens, backend, block_size,
                             **(mb.forward_extra() if masked else {}))
    if shared:
        hidden, _, targets, valid = shared_prompt_hidden(model, mb.input_ids, evict_at, mb.prompt_lens, mb.resp_lens,
                                                         backend, block_size)
        return hidden, targets, valid
    return response_hidden(model, mb.input_ids, evict_at, mb.prompt_lens, mb.resp_lens, backend,
                            **(mb.forward_extra() if masked else {}))


def forward_logp(model, mb: MicroBatch, masked: bool, backend: str, temperature: float,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, shared: bool = False,
                 block_size: int = 128, head_grad_in_place: bool = False) -> dict[str, torch.Tensor]:
    """Scores of the sampled response tokens (`chunked_token_scores`: logp [B, R] at `temperature` and entropy
    [B, R], 0 at padding), shadow-masked when `masked`, else dense; never [B, R, V] logits at once. `shared`:
    each run of rows with one prompt forwards it once (`shared_prompt_hidden`; `mb` then carries no block
    masks: they are built per run). `head_grad_in_place`: `chunked_token_scores(accumulate_head_grad=...)`."""
    hidden, targets, valid = micro_batch_hidden(model, mb, masked, backend, shared, block_size)
    return chunked_token_scores(hidden, lm_head_of(model), targets, valid, temperature=temperature,
                                chunk_tokens=chunk_tokens, accumulate_head_grad=head_grad_in_place)


def length_grouped(data: LearnerData, rows: list[int], size: int) -> list[list[int]]:
    """Micro-batches of `size` rows, longest first (less padding); deterministic."""
    ordered = sorted(rows, key=lambda r: (-data.length(r), r))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def groups_longest_first(data: LearnerData, rows: list[int]) -> list[list[int]]:
    """The GRPO groups of `rows`, each its rows longest first, the groups by their longest row first (ties by group
    id); deterministic."""
    members: dict[int, list[int]] = {}
    for r in rows:
        members.setdefault(int(data.groups[r]), []).append(r)
    groups = [sorted(m, key=lambda r: (-data.length(r), r)) for m in members.values()]
    return sorted(groups, key=lambda m: (-data.length(m[0]), int(data.groups[m[0]])))


def group_grouped(data: LearnerData, rows: list[int], size: int) -> list[list[int]]:
    """Micro-batches of `size` rows that hold whole GRPO groups, or parts of one (`learner.shared_prompt`): the
    groups longest first, each group's rows adjacent (longest first), then cut every `size` rows; deterministic."""
    ordered = [r for group in groups_longest_first(data, rows) for r in group]
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def scheduled_units(data: LearnerData, rows: list[int], shared: bool) -> list[list[int]]:
    """What the token budget schedules whole, longest first: each GRPO group with shared prompts, else each row."""
    if shared:
        return groups_longest_first(data, rows)
    return [[r] for r in sorted(rows, key=lambda r: (-data.length(r), r))]


def token_grouped(data: LearnerData, rows: list[int], budget: int, shared: bool,
                  pack: bool = False) -> list[list[int]]:
    """Micro-batches of at most `budget` padded tokens (`learner.micro_batch_tokens`; `budget_micro_batches`;
    `pack`: packed tokens, learner.pack) of whole rows, or with shared prompts whole GRPO groups, longest first;
    deterministic."""
    units = scheduled_units(data, rows, shared)
    cuts = budget_micro_batches([[data.length(r) for r in unit] for unit in units], budget,
                                "a GRPO group (learner.shared_prompt)" if shared else "a row", packed=pack)
    return [[r for i in cut for r in units[i]] for cut in cuts]


def micro_batches(data: LearnerData, rows: list[int], size: int, shared: bool, tokens: int | None = None,
                  pack: bool = False) -> list[list[int]]:
    """This process's micro-batches of `rows`: by a token budget when `tokens` (learner.micro_batch_tokens; of
    packed tokens with `pack`), else `size` rows; by group with shared prompts, else by length."""
    if tokens:
        return token_grouped(data, rows, tokens, shared, pack)
    return group_grouped(data, rows, size) if shared else length_grouped(data, rows, size)


def unit_tokens(data: LearnerData, unit: list[int], shared: bool) -> int:
    """The tokens a scheduled unit forwards: with shared prompts a group's prompt once plus its responses, else
    each row's prompt + response (what `process_rows` balances across processes)."""
    if shared:
        return len(data.prompt_ids[unit[0]]) + sum(len(data.response_ids[r]) for r in unit)
    return sum(data.length(r) for r in unit)


def process_rows(data: LearnerData, rows: list[int], rank: int, world: int, shared: bool,
                 balance: bool = False) -> list[int]:
    """The rows of `rows` process `rank` of `world` takes: round-robin rows, or with shared prompts round-robin
    whole groups (in group order), so that a group's prompt is forwarded by one process. `balance`
    (learner.micro_batch_tokens): rows (or whole groups) split by their tokens (`unit_tokens`) with
    Karmarkar-Karp's largest differencing, as verl's seqlen_balancing; part `rank` of the parts in decreasing
    tokens (the same split on every process)."""
    if world == 1:
        return rows
    if balance:
        units = scheduled_units(data, rows, shared)
        parts = karmarkar_karp([unit_tokens(data, unit, shared) for unit in units], world)
        mine = {r for i in parts[rank] for r in units[i]}
        return [r for r in rows if r in mine]
    if not shared:
        return rows[rank::world]
    groups = sorted({int(data.groups[r]) for r in rows})
    mine = set(groups[rank::world])
    return [r for r in rows if int(data.groups[r]) in mine]


@torch.no_grad()
def score_rows(model, data: LearnerData, rows: list[int], *, masked: bool, temperature: float,
               micro_batch_size: int, backend: str = "sdpa", block_size: int = 128,
               device: torch.device | str = "cpu", chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               shared: bool = False, micro_batch_tokens: int | None = None,
               pack: bool = False, sp=None) -> dict[int, np.ndarray]:
    """Learner log-probs of every response token of `rows`, micro-batched and right-padded as in training
    (shadow-masked when `masked`, else dense; `shared`: a group's prompt forwarded once per micro-batch;
    `micro_batch_tokens`: micro-batches by that token budget instead of `micro_batch_size` rows; `pack`: each
    micro-batch's rows packed into one row, learner.pack; `sp`: this process's sequence-parallel group,
    learner.sequence_parallel). Returns {row: float32 [R_row]}."""
    num_q = model.config.num_attention_heads
    out: dict[int, np.ndarray] = {}
    for chunk in micro_batches(data, rows, micro_batch_size, shared, micro_batch_tokens, pack):
        mb = build_micro_batch(data, chunk, masked, "sdpa" if shared else backend, block_size, num_q, device=device,
                               pack=pack)
        if sp is not None:  # learner.sequence_parallel: this process's positions, the whole micro-batch's log-probs
            logp = sequence_parallel_scores(model, sp, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens,
                                            temperature=temperature, backend=backend, block_size=block_size,
                                            chunk_tokens=chunk_tokens)["logp"].float().cpu()
        else:
            logp = forward_logp(model, mb, masked, backend, temperature, chunk_tokens, shared,
                                block_size)["logp"].float().cpu()
        for b, r in enumerate(chunk):
            out[r] = logp[b, : mb.resp_lens[b]].numpy().copy()
    return out


def _padded(rows: list[int], values: dict[int, np.ndarray], data: LearnerData) -> tuple[torch.Tensor, ...]:
    R = max(max((len(data.response_ids[r]) for r in rows), default=1), 1)
    # host tensors: the mismatch metrics run on the host copies (one per batch), never on the model's device
    learner = torch.zeros(len(rows), R, dtype=torch.float64, device="cpu")
    rollout = torch.zeros(len(rows), R, dtype=torch.float64, device="cpu")
    mask = torch.zeros(len(rows), R, dtype=torch.bool, device="cpu")
    for i, r in enumerate(rows):
        n = len(data.response_ids[r])
        learner[i, :n] = torch.from_numpy(values[r].astype(np.float64))
        rollout[i, :n] = torch.from_numpy(data.rollout_logprobs[r].astype(np.float64))
        mask[i, :n] = True
    return learner, rollout, mask


def batch_mismatch(rows: list[int], values: dict[int, np.ndarray], data: LearnerData,
                   cap: float = 2.0) -> dict[str, float]:
    """`mismatch_metrics` of learner log-probs `values` against the rollout's over `rows` (`cap`: the
    truncation of the rollout_is_* metrics, learner.tis_cap)."""
    learner, rollout, mask = _padded(rows, values, data)
    return mismatch_metrics(learner, rollout, mask, cap)


# ------------------------------------------------------------------------------------------ plan
@dataclass
class Step:
    epoch: int
    rows: list[int]  # the whole mini-batch (all processes)
    micro: list[tuple[list[int], bool]]  # this process's micro-batches: (rows, real); real=False: zero weight


def make_plan(data: LearnerData, cfg: LearnerParams, ctx: DistContext, seed: int, iteration: int) -> tuple[list[Step], int]:
    """Optimizer steps of this learn call and the (uniform) gradient-accumulation count per step."""
    n = len(data)
    minis: list[tuple[int, list[int]]] = []
    for epoch in range(cfg.epochs):
        order = np.arange(n)
        if cfg.updates_per_epoch > 1:
            order = np.random.default_rng([seed, iteration, epoch]).permutation(n)
        for part in np.array_split(order, cfg.updates_per_epoch):
            if len(part):
                minis.append((epoch, sorted(int(r) for r in part)))
    shared, tokens = cfg.shared_prompt, cfg.micro_batch_tokens

    def scheduled(rows: list[int], rank: int) -> list[list[int]]:
        return micro_batches(data, process_rows(data, rows, rank, ctx.world, shared, balance=bool(tokens)),
                             cfg.micro_batch_size, shared, tokens, cfg.pack)

    # the most micro-batches any process has in any mini-batch (every process runs that many per step)
    grad_accum = max(len(scheduled(rows, rank)) for _, rows in minis for rank in range(ctx.world))
    grad_accum = max(grad_accum, 1)
    steps = []
    for epoch, rows in minis:
        mine = scheduled(rows, ctx.rank)
        # Fillers run a real forward/backward (of rows this process already has, weight 0): ZeRO-2 reduces
        # gradient buckets in autograd-hook order, which must be the same on every process.
        filler = mine[-1] if mine else rows[:1]
        micro = [(m, True) for m in mine] + [(filler, False)] * (grad_accum - len(mine))
        steps.append(Step(epoch, rows, micro))
    return steps, grad_accum


@dataclass
class RowWeights:
    """Per row of the batch, fixed before the first update from the proximal (parity-pass) log-probs:
    `tokens` its valid tokens, `kept` those that stay in the loss (sparse_rl's rejection; = tokens for every
    other objective), `weight_sum` the sum of sparse_rl's truncated weights over the kept ones (0 otherwise),
    `denom` its share of `aggregate(loss_agg)`'s denominator (kept tokens, or 1 per sequence with any);
    for sparse_rl `keep` / `weights` the rejection itself per row (bool / float32 [R_row]), which the objective
    uses as it is (computed once, here)."""

    tokens: np.ndarray
    kept: np.ndarray
    weight_sum: np.ndarray
    denom: np.ndarray
    keep: dict[int, np.ndarray] | None = None
    weights: dict[int, np.ndarray] | None = None

    def rejection(self, rows: list[int] | np.ndarray) -> dict[str, float]:
        """sparse_rl's rejected fractions over `rows`: sequences with tokens but none kept, and tokens."""
        return rejection_fractions(self.tokens[rows], self.kept[rows])

    def rejection_of(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """sparse_rl's (keep, truncated weights) of the micro-batch's rows, padded as `mb`; None otherwise."""
        if self.keep is None or self.weights is None:
            return None
        return _rows_tensor(mb.rows, self.keep, mb, torch.bool), _rows_tensor(mb.rows, self.weights, mb)

    def weight_mean(self, rows: list[int] | np.ndarray) -> float | None:
        """The mean sparse_rl weight over the kept tokens of the mini-batch `rows` (None when none is kept)."""
        kept = float(self.kept[rows].sum())
        return float(self.weight_sum[rows].sum()) / kept if kept > 0 else None


def row_weights(data: LearnerData, cfg: LearnerParams, old: dict[int, np.ndarray]) -> RowWeights:
    """`RowWeights` of the batch; sparse_rl's rejection computed once, from the proximal log-probs, per row."""
    n_rows = len(data)
    tokens = np.array([len(data.response_ids[r]) for r in range(n_rows)], dtype=np.float64)
    kept, weight_sum = tokens.copy(), np.zeros(n_rows, dtype=np.float64)
    keep: dict[int, np.ndarray] | None = None
    weights: dict[int, np.ndarray] | None = None
    if objective_spec(cfg.objective).row_weights == "sparse_rl":
        rules = sparse_rl_rules(cfg)
        keep, weights = {}, {}
        for r in range(n_rows):
            n = int(tokens[r])
            keep[r], weights[r] = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.float32)
            if n:
                k, w, _ = sparse_rl_rejection(torch.from_numpy(old[r]).unsqueeze(0),
                                              torch.from_numpy(data.rollout_logprobs[r]).unsqueeze(0),
                                              torch.ones(1, n, dtype=torch.bool, device="cpu"), **rules)
                keep[r], weights[r] = k[0].numpy().copy(), w[0].numpy().copy()
                count, total = sparse_rl_weight_sums(k, w)
                kept[r], weight_sum[r] = float(count[0]), float(total[0])
    denom = kept if loss_agg_for(cfg) == "token_mean" else (kept > 0).astype(np.float64)
    return RowWeights(tokens=tokens, kept=kept, weight_sum=weight_sum, denom=denom, keep=keep, weights=weights)


# ------------------------------------------------------------------------------------------ collectives
def _gather(obj: Any, ctx: DistContext) -> list[Any]:
    if ctx.world == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def _gather_dict(local: dict[int, np.ndarray], ctx: DistContext) -> dict[int, np.ndarray]:
    merged: dict[int, np.ndarray] = {}
    for part in _gather(local, ctx):
        merged.update(part)
    return merged


class StepStats:
    """Per-step accumulation of loss terms (weighted by the micro-batch's share) and per-row log-probs."""

    SUMMED = (*LOSS_TERMS, "pg/clipfrac", "pg/dual_clipfrac", "pg/ratio_mean", "pg/approx_kl", "is_weight/mean",
              TRUSTED_FRACTION)

    def __init__(self) -> None:
        self.weighted: dict[str, float] = {}
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.logp: dict[int, np.ndarray] = {}
        self.dense_logp: dict[int, np.ndarray] = {}
        self.tokens = 0
        self.padded_tokens = 0  # the real micro-batches' rows x longest row (what learner.micro_batch_tokens caps)
        self.entropy_sum = 0.0
        self.response_tokens = 0
        self.kl_tokens: int | None = None  # valid tokens the teacher KL applied to (None: no teacher KL)

    def add(self, terms: dict[str, float], weight: float, mb: MicroBatch, logp: torch.Tensor,
            dense_logp: torch.Tensor | None, entropy: torch.Tensor) -> None:
        for key in self.SUMMED:
            if key in terms:
                self.weighted[key] = self.weighted.get(key, 0.0) + weight * terms[key]
        if weight > 0:
            self.ratio_min = min(self.ratio_min, terms["pg/ratio_min"])
            self.ratio_max = max(self.ratio_max, terms["pg/ratio_max"])
        lp = logp.detach().float().cpu()
        dl = dense_logp.detach().float().cpu() if dense_logp is not None else None
        for b, r in enumerate(mb.rows):
            n = mb.resp_lens[b]
            self.logp[r] = lp[b, :n].numpy().copy()
            if dl is not None:
                self.dense_logp[r] = dl[b, :n].numpy().copy()
        self.tokens += sum(mb.prompt_lens) + sum(mb.resp_lens)
        self.padded_tokens += mb.num_tokens
        self.entropy_sum += float(entropy[mb.valid].sum())
        self.response_tokens += int(mb.valid.sum())
        if mb.kl_mask is not None:
            self.kl_tokens = (self.kl_tokens or 0) + int((mb.kl_mask & mb.valid).sum())

    def reduce(self, ctx: DistContext, data: LearnerData, rows: list[int], cap: float) -> dict[str, float]:
        parts = _gather((self.weighted, self.ratio_min, self.ratio_max, self.logp, self.dense_logp, self.tokens,
                         self.entropy_sum, self.response_tokens, self.kl_tokens, self.padded_tokens), ctx)
        weighted: dict[str, float] = {}
        logp: dict[int, np.ndarray] = {}
        dense: dict[int, np.ndarray] = {}
        rmin, rmax, tokens, ent_sum, resp_tokens, padded = math.inf, -math.inf, 0, 0.0, 0, 0
        kl_tokens: int | None = None
        for w, lo, hi, lp, dl, tok, es, rt, kt, pt in parts:
            for k, v in w.items():
                weighted[k] = weighted.get(k, 0.0) + v
            rmin, rmax, tokens = min(rmin, lo), max(rmax, hi), tokens + tok
            ent_sum, resp_tokens, padded = ent_sum + es, resp_tokens + rt, padded + pt
            if kt is not None:
                kl_tokens = (kl_tokens or 0) + kt
            logp.update(lp)
            dense.update(dl)
        step_rewards = torch.from_numpy(data.rewards[rows])
        in_groups = np.isin(data.groups, data.groups[rows])
        out = {
            **{key: weighted.get(key, 0.0) for key in LOSS_TERMS},
            "pg/clipfrac": weighted.get("pg/clipfrac", 0.0),
            "pg/dual_clipfrac": weighted.get("pg/dual_clipfrac", 0.0),
            "pg/ratio_mean": weighted.get("pg/ratio_mean", 1.0),
            "pg/ratio_min": rmin if math.isfinite(rmin) else 1.0,
            "pg/ratio_max": rmax if math.isfinite(rmax) else 1.0,
            "pg/approx_kl": weighted.get("pg/approx_kl", 0.0),
            "tokens": float(tokens),
            "padded_tokens": float(padded),
            "policy/entropy": ent_sum / max(resp_tokens, 1),
            "reward/mean": float(step_rewards.mean()),
            "reward/std": float(step_rewards.std(unbiased=False)),
            # over the step's groups, judged on all their rows (a mini-batch may hold part of a group)
            "batch/zero_adv_group_frac": zero_advantage_group_fraction(
                torch.from_numpy(data.rewards[in_groups]), torch.from_numpy(data.groups[in_groups])),
        }
        for key in ("is_weight/mean", TRUSTED_FRACTION):
            if key in weighted:
                out[key] = weighted[key]
        if kl_tokens is not None:  # the fraction of the step's valid response tokens the teacher KL applied to
            out[KL_TOKEN_FRACTION] = kl_tokens / resp_tokens if resp_tokens else 0.0
        out.update(batch_mismatch(rows, logp, data, cap))
        if dense:
            d = batch_mismatch(rows, dense, data, cap)
            out["dense_mismatch/logprob_abs_diff_mean"] = d["mismatch/logprob_abs_diff_mean"]
            out["dense_mismatch/logprob_abs_diff_max"] = d["mismatch/logprob_abs_diff_max"]
        return out


# ------------------------------------------------------------------------------------------ the stage
def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


@dataclass
class LearnerRun:
    """Everything one learn call sets up once and its named steps share."""

    params: Params
    cfg: LearnerParams
    iteration: int
    policy_path: Path
    ctx: DistContext
    engine: Any
    tokenizer: Any
    data: LearnerData
    steps: list[Step]
    resumed: dict[str, Any] | None
    global_step: int
    temperature: float  # the sampler's (rollout.temperature): the learner scores that distribution
    ref_model: Any = None
    teacher_model: Any = None  # learner.kl_teacher=reference / ema: the dense teacher model (None: the policy itself)
    trusted: dict[int, np.ndarray] | None = None  # smd_released: the trusted response tokens per row
    lora: LoraPolicy | None = None  # learner.lora: the adapter model (`module` is its transformers model)
    sp: Any = None  # learner.sequence_parallel > 1: this process's `SequenceParallel` (its group, heads, attention)
    say: Callable[[str], None] = lambda msg: None

    @property
    def spec(self) -> ObjectiveSpec:
        return objective_spec(self.cfg.objective)

    @property
    def masked(self) -> bool:
        return self.spec.masked_forward

    @property
    def teacher(self) -> bool:
        return runs_dense_teacher(self.cfg)

    @property
    def module(self):
        return self.engine.module

    @property
    def head_grad_in_place(self) -> bool:
        """Whether the chunked scoring adds a tied lm head's gradient into `.grad` during the backward
        (`logprobs.accumulate_head_grad`: no [V, D] buffer held across the backward)."""
        return accumulate_head_grad(self.module, self.engine.zero_optimization_stage())

    @property
    def ema(self) -> bool:
        """Whether the teacher is the EMA of the policy (`learner.kl_teacher=ema` with the teacher on)."""
        return self.teacher and self.cfg.kl_teacher == "ema"


def setup(params: Params, iteration: int, policy_path: Path, trajectories_path: str | Path,
          masks_path: str | Path | None, log: Callable[[str], None] | None) -> LearnerRun:
    """Read and cross-check the inputs, join the process group, build the DeepSpeed engine, resume its state."""
    cfg = validated(params.learner)
    spec = objective_spec(cfg.objective)
    seed = cfg.seed if cfg.seed is not None else params.seed
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    tokenizer = load_tokenizer(policy_path)
    if cfg.kl_tokens == "no_eos" and tokenizer.eos_token_id is None:
        raise SmdInputError(f"learner.kl_tokens=no_eos: the tokenizer of {policy_path} has no eos_token (the "
                            "token the KL would skip)")
    check_lora_params(cfg, spec.masked_forward)  # LoRA dropout under the parity gate: one line, before any load
    if cfg.lora is None:
        refuse_adapter_without_lora(policy_path)
    lora = load_lora_policy(policy_path, cfg, params.model.dtype, seed) if cfg.lora is not None else None
    model = lora.model if lora is not None else load_policy(policy_path, params.model.dtype)
    mcfg = model.config
    num_kv = getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads
    data = load_learner_data(cfg, trajectories_path, masks_path, mcfg.num_hidden_layers, num_kv,
                             need_masks=spec.needs_masks)
    trusted = trusted_rows(cfg, data) if spec.token_filter == "visibility" else None
    longest = max(data.length(r) for r in range(len(data)))
    check_positions(model.config, longest, f"{data.trajectories_path}: a trajectory of {longest} tokens")
    frozen_teacher = runs_dense_teacher(cfg) and cfg.kl_teacher == "reference"
    # one copy of the reference policy serves both the reference KL and the frozen teacher
    reference = (reference_policy(cfg, lora, model, params.model.dtype)
                 if cfg.ref_kl_coef > 0 or frozen_teacher else None)
    teacher_model = reference if frozen_teacher else None
    if runs_dense_teacher(cfg) and cfg.kl_teacher == "ema":  # a copy of the policy, then the saved average's weights
        teacher_model = ema_teacher(model, policy_path, TRAINER_STATE, params.model.dtype)
    ref_model = reference if cfg.ref_kl_coef > 0 else None
    use_sdpa_gqa(model, reference, teacher_model)  # dense passes without repeat_kv on the CPU (dense_attention)

    ctx = init_distributed(device=params.model.device)  # model.device for this local rank; gloo on CPU, NCCL on CUDA
    # under learner.lora only a continued adapter's trainer state is its own (a full policy's is the full model's)
    resume = cfg.resume_optimizer and (lora is None or lora.continued)
    # `auto` resolved for the device it runs on (flex on CUDA, sdpa on the CPU) and for the process count and the
    # trainer state resumed (ZeRO stage); the record names what ran
    cfg = cfg.model_copy(update={
        "attention_backend": cfg.backend_for(ctx.device.type),
        "zero_stage": zero_stage_for(cfg.zero_stage, ctx.world, saved_zero_stage(policy_path) if resume else None)})
    torch.manual_seed(seed * 1_000_003 + iteration)
    np.random.seed((seed * 1_000_003 + iteration) % (1 << 32))
    random.seed(seed * 1_000_003 + iteration)  # every RNG the trainer state saves: reruns are byte-identical
    place_model(model, ctx.device)  # TF32 off for a float32 model on CUDA (the parity invariant)
    model.eval()  # no dropout: the learner scores with the policy that sampled (gradients still flow)
    if teacher_model is not None:
        place_model(teacher_model, ctx.device)
    if cfg.gradient_checkpointing:
        enable_layer_checkpointing(model)
    # learner.sequence_parallel: the groups of consecutive processes (collective); the batch splits over the groups
    sp = new_sequence_parallel(cfg.sequence_parallel, mcfg.num_attention_heads, num_kv)
    steps, grad_accum = make_plan(data, cfg, data_parallel(ctx, cfg.sequence_parallel), seed, iteration)
    engine = make_engine(model, cfg, ctx, grad_accum, resume_from=policy_path if resume else None)
    resumed = load_trainer_state(engine, policy_path, cfg, ctx) if resume else None
    say = (log or (lambda msg: None)) if ctx.is_main else (lambda msg: None)  # progress lines from rank 0 only
    return LearnerRun(params=params, cfg=cfg, iteration=iteration, policy_path=policy_path, ctx=ctx, engine=engine,
                      tokenizer=tokenizer, data=data, steps=steps, resumed=resumed,
                      global_step=int(resumed["global_step"]) if resumed else 0,
                      temperature=params.rollout.temperature, ref_model=ref_model, teacher_model=teacher_model,
                      trusted=trusted, say=say, lora=lora, sp=sp)


def parity_pass(run: LearnerRun) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None, dict[str, float]]:
    """Before the first optimizer step: learner log-probs of every response token (shadow-masked for smd/shadow,
    dense otherwise) and their mismatch against the rollout's; the reference policy's log-probs when a reference
    KL is on. smd/shadow refuse to train when the mask does not reproduce the sampler (the parity gate).
    Returns (old log-probs per row, reference log-probs per row or None, parity metrics)."""
    cfg, data, ctx = run.cfg, run.data, run.ctx
    t0 = time.perf_counter()
    score = dict(masked=run.masked, temperature=run.temperature, micro_batch_size=cfg.micro_batch_size,
                 backend=cfg.attention_backend, block_size=cfg.flex_block_size, device=ctx.device,
                 chunk_tokens=cfg.logit_chunk_tokens, shared=cfg.shared_prompt,
                 micro_batch_tokens=cfg.micro_batch_tokens, pack=cfg.pack, sp=run.sp)
    all_rows = list(range(len(data)))
    dp = data_parallel(ctx, cfg.sequence_parallel)  # a sequence-parallel group scores its rows together
    my_rows = process_rows(data, all_rows, dp.rank, dp.world, cfg.shared_prompt,
                           balance=bool(cfg.micro_batch_tokens))
    old = _gather_dict(score_rows(run.module, data, my_rows, **score), ctx)
    ref = None
    if run.ref_model is not None:
        place_model(run.ref_model, ctx.device)
        ref = _gather_dict(score_rows(run.ref_model, data, my_rows, **score), ctx)
        run.ref_model = None
    return old, ref, parity_gate(run, old, t0)


def fused_parity(run: LearnerRun) -> bool:
    """Whether the parity gate takes the training forward's log-probs (`learner.parity_from_training_forward`): only
    when the separate pass would serve nothing else (old log-probs from the rollout, no row weights or
    reference from it) and every row is scored once, before the one optimizer step of this learn call."""
    return (run.cfg.parity_from_training_forward and run.masked and run.spec.old_logp == "rollout"
            and run.spec.row_weights == "none" and run.ref_model is None and len(run.steps) == 1
            and sorted(run.steps[0].rows) == list(range(len(run.data))))


def parity_gate(run: LearnerRun, logp: dict[int, np.ndarray], t0: float) -> dict[str, float]:
    """The parity metrics of learner log-probs `logp` (every row, before any optimizer step) against the
    rollout's; smd/shadow refuse to train when the mask does not reproduce the sampler (SmdInputError)."""
    cfg, data = run.cfg, run.data
    all_rows = list(range(len(data)))
    for r in all_rows:
        check_finite(f"learner log-probs of trajectory {data.trajectory_ids[r]}", torch.from_numpy(logp[r]))
    parity = batch_mismatch(all_rows, logp, data, cfg.tis_cap)
    parity["learner/parity_seconds"] = time.perf_counter() - t0
    gap = parity["mismatch/logprob_abs_diff_max"]
    run.say(f"parity: mismatch/logprob_abs_diff_max={gap:.3g} ({'masked' if run.masked else 'dense'} learner, "
            f"{len(data)} trajectories, {parity['learner/parity_seconds']:.1f}s)")
    tol = cfg.parity_tol_for(run.params.model.dtype)
    parity["learner/parity_tol"] = tol
    if run.masked and not gap <= tol:
        raise SmdInputError(
            f"parity gate: mismatch/logprob_abs_diff_max={gap:.3g} > tol {tol:g} ({run.params.model.dtype}) between the shadow-masked "
            f"learner ({run.policy_path}) and the rollout ({data.trajectories_path}, masks {data.masks_path}); "
            "refusing to train off-policy"
        )
    return parity


def micro_step(run: LearnerRun, rows: list[int], weight: float, old: dict[int, np.ndarray],
               ref: dict[int, np.ndarray] | None, weights: RowWeights, weight_mean: float | None = None,
               ) -> tuple[dict[str, float], MicroBatch, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Forward (masked and/or dense as the objective needs), objective, backward (the caller then calls
    `engine.step()`, which updates at the last micro-batch of the step) of one micro-batch scaled by
    `weight` (its share of the mini-batch's aggregation denominator; `weights`: the rows' fixed rejection,
    `weight_mean`: sparse_rl's normalisation constant over the whole mini-batch). Returns (loss terms,
    micro-batch, policy log-probs, dense-teacher log-probs or None, per-token entropy)."""
    cfg, masked, temperature, module = run.cfg, run.masked, run.temperature, run.module
    backend = cfg.attention_backend
    # (with the teacher or shared prompts, block masks are built for the prefix split inside the forward)
    shared_teacher = run.teacher and run.teacher_model is None
    shared = cfg.shared_prompt
    in_place = run.head_grad_in_place  # engine.backward below accumulates into .grad
    mb = build_micro_batch(run.data, rows, masked, "sdpa" if shared_teacher or shared or run.sp else backend,
                           cfg.flex_block_size, module.config.num_attention_heads, device=run.ctx.device,
                           pack=cfg.pack)
    with checkpointed_layers(module) if cfg.gradient_checkpointing else contextlib.nullcontext():
        if run.sp is not None:  # learner.sequence_parallel: this process's positions, the whole micro-batch's scores
            scores = sequence_parallel_scores(
                module, run.sp, mb.input_ids, mb.evict_at if masked else None, mb.prompt_lens, mb.resp_lens,
                temperature=temperature, backend=backend, block_size=cfg.flex_block_size,
                chunk_tokens=cfg.logit_chunk_tokens, teacher=run.teacher, teacher_model=run.teacher_model,
                head_grad_in_place=in_place)
        elif run.teacher and not shared_teacher:  # a frozen teacher model: its own dense pass, then the masked policy
            with torch.no_grad():
                teacher_hidden, _, _ = micro_batch_hidden(run.teacher_model, mb, False,
                                                          backend if mb.packed else "sdpa", shared,
                                                          cfg.flex_block_size)
            hidden, targets, valid = micro_batch_hidden(module, mb, True, backend, shared, cfg.flex_block_size)
            scores = chunked_token_scores(hidden, lm_head_of(module), targets, valid, temperature=temperature,
                                          chunk_tokens=cfg.logit_chunk_tokens, teacher_hidden=teacher_hidden,
                                          teacher_head=lm_head_of(run.teacher_model), accumulate_head_grad=in_place)
        elif run.teacher:  # masked policy + dense teacher sharing the rows before the first eviction
            forward = (shared_prompt_hidden if shared else
                       packed_hidden_with_teacher if mb.packed else response_hidden_with_teacher)
            kwargs = {"teacher": True} if shared else {}
            hidden, teacher_hidden, targets, valid = forward(
                module, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens, backend, cfg.flex_block_size,
                **kwargs)
            scores = chunked_token_scores(hidden, lm_head_of(module), targets, valid, temperature=temperature,
                                          chunk_tokens=cfg.logit_chunk_tokens, teacher_hidden=teacher_hidden,
                                          accumulate_head_grad=in_place)
        else:
            scores = forward_logp(module, mb, masked, backend, temperature, cfg.logit_chunk_tokens, shared,
                                  cfg.flex_block_size, head_grad_in_place=in_place)
    # the teacher's log-probs are the current dense policy's only when it is the teacher (dense_mismatch/* metrics)
    logp, dense_logp = scores["logp"], scores.get("teacher_logp") if shared_teacher else None
    if run.teacher:  # the tokens the teacher KL applies to (learner.kl_tokens; every valid one for `all`)
        mb.kl_mask = mb.valid if cfg.kl_tokens == "all" else kl_token_mask(
            cfg.kl_tokens, [run.data.prompt_ids[r] for r in rows], [run.data.response_ids[r] for r in rows],
            mb.valid.shape[1], eos_token_id=run.tokenizer.eos_token_id,
            teacher_argmax=scores["teacher_argmax"] if cfg.kl_tokens == "keyed" else None,
        ).to(mb.valid.device)
    batch = ObjectiveBatch(
        advantages=mb.advantages, mask=mb.valid, rollout_logp=mb.rollout_logp,
        masked_logp=logp if masked else None, dense_logp=None if masked else logp, kl_per_token=scores.get("kl"),
        kl_mask=mb.kl_mask,
        old_logp=_rows_tensor(rows, old, mb) if run.spec.old_logp == "recomputed" else None,
        ref_logp=_rows_tensor(rows, ref, mb) if ref is not None else None,
        sparse_rl_rejection=weights.rejection_of(mb), sparse_rl_weight_mean=weight_mean,
        trusted_mask=_rows_tensor(rows, run.trusted, mb, torch.bool) if run.trusted is not None else None,
    )
    loss, terms = objective_loss(cfg, batch)
    run.engine.backward(loss * (weight * run.ctx.world), scale_wrt_gas=False)
    return terms, mb, logp, dense_logp, scores["entropy"]


class NonFiniteError(SmdInputError):
    """A non-finite loss or gradient (on a GPU usually a bf16 overflow): the learner stops with one line naming the
    iteration, the step and the micro-batch, before anything is written (the CLI's one-line error, exit 1)."""

    exit_code = 1


def _few(rows: list[int], n: int = 8) -> str:
    return ", ".join(map(str, rows[:n])) + (f", ... ({len(rows)} rows)" if len(rows) > n else "")


def stop_if_nonfinite(run: LearnerRun, value: float | None, what: str) -> None:
    """Collective (every process calls it at the same point): raise NonFiniteError naming `what` on every process
    when `value` is NaN or infinite on any of them (None: not measured, passes)."""
    error = None
    if value is not None and not math.isfinite(value):
        error = NonFiniteError(f"learn iteration {run.iteration}: non-finite {what} ({value}); nothing written "
                               "(in bf16 on a GPU usually an overflow: try model.dtype float32 or a lower learner.lr)")
    agree(run.ctx, None, error)


def own_grad_norm(engine) -> bool:
    """Whether the learner measures the gradient norm itself: DeepSpeed reports it (`get_global_grad_norm`) from
    its ZeRO and bf16/fp16 optimizers only; under ZeRO stage 0 with float32 weights it steps the torch AdamW
    directly (clipping with torch's `clip_grad_norm_`) and reports None."""
    return not (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def gradient_norm(module: torch.nn.Module) -> float:
    """The global L2 norm of the trainable parameters' gradients (already averaged across processes at the
    accumulation boundary), before clipping: what DeepSpeed's ZeRO optimizers report as the global grad norm."""
    grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0


def train_step(run: LearnerRun, step: Step, weights: RowWeights, old: dict[int, np.ndarray],
               ref: dict[int, np.ndarray] | None, parity: dict[str, float] | None = None) -> dict[str, Any] | None:
    """One optimizer step over a mini-batch (its micro-batches accumulate); the step's record, or None when the
    mini-batch has no valid token left. `parity` (a dict to fill; `fused_parity`): the parity gate and metrics
    on the step's own log-probs, after the last backward and before the optimizer step."""
    t_step = time.perf_counter()
    denom = weights.denom
    total = float(denom[step.rows].sum())
    if total == 0:
        run.say(f"step skipped (epoch {step.epoch}): no valid token left in the mini-batch")
        return None
    lr = lr_at(run.global_step, run.cfg)
    for group in run.engine.optimizer.param_groups:
        group["lr"] = lr
    stats = StepStats()
    pre_clip_norm = None
    weight_mean = weights.weight_mean(step.rows) if run.spec.row_weights == "sparse_rl" else None
    for i, (rows, real) in enumerate(step.micro):
        weight = float(denom[rows].sum()) / total if real else 0.0
        terms, mb, logp, dense_logp, entropy = micro_step(run, rows, weight, old, ref, weights, weight_mean)
        stop_if_nonfinite(run, terms.get("loss/total"), f"loss at step {run.global_step + 1}, micro-batch {i + 1} of "
                          f"{len(step.micro)} (rows {_few(rows)})")
        if real and (run.sp is None or run.sp.rank == 0):  # a sequence-parallel group's micro-batch counts once
            stats.add(terms, weight, mb, logp, dense_logp, entropy)
        if parity is not None and i == len(step.micro) - 1:  # before the update: the gate may still refuse
            parity.update(parity_gate(run, _gather_dict(stats.logp, run.ctx), time.perf_counter()))
        if i == len(step.micro) - 1 and own_grad_norm(run.engine):  # the gradients before the step clips them
            pre_clip_norm = gradient_norm(run.module)
        run.engine.step()
    run.global_step += 1
    if run.ema:  # the optimizer step is done: the average moves toward the new weights
        ema_update_(run.teacher_model, run.module, run.cfg.ema_decay)
    grad_norm = pre_clip_norm if pre_clip_norm is not None else run.engine.get_global_grad_norm()
    stop_if_nonfinite(run, None if grad_norm is None else float(grad_norm),
                      f"gradient norm at step {run.global_step} (micro-batches 1-{len(step.micro)}, rows {_few(step.rows)})")
    record = stats.reduce(run.ctx, run.data, step.rows, run.cfg.tis_cap)
    record.update(weights.rejection(step.rows))
    seconds = time.perf_counter() - t_step
    record.update({"step": run.global_step, "epoch": step.epoch, "seconds": seconds, "lr": lr,
                   "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")})
    run.say(f"step {run.global_step}: loss/total={record['loss/total']:.4g} grad_norm={record['grad_norm']:.3g} "
            f"policy/entropy={record['policy/entropy']:.3g} pg/clipfrac={record['pg/clipfrac']:.3g} ({seconds:.1f}s)")
    return record


def write_outputs(run: LearnerRun, out_dir: Path, metrics_dir: Path, metrics: dict[str, Any],
                  series: list[dict[str, Any]]) -> None:
    """Atomically write the new policy (+ trainer state, collectively) and, on rank 0, metrics and steps."""
    ctx = run.ctx
    meta = {"world_size": ctx.world, "zero_stage": run.cfg.zero_stage, "global_step": run.global_step,
            "iteration": run.iteration, "objective": run.cfg.objective}

    def save_policy(tmp: Path, _: list[None]) -> None:  # rank 0, once every rank saved its trainer state
        if run.lora is not None:  # the adapter in PEFT's format + the record of its base (path, weights digest)
            run.lora.save(tmp)
        else:
            run.module.save_pretrained(tmp)
        run.tokenizer.save_pretrained(tmp)
        write_weights_digest(tmp)
        if run.ema:  # the average continues from the checkpoint it is saved with
            save_ema(run.teacher_model, ema_path(tmp, TRAINER_STATE))

    # DeepSpeed's checkpoint save is collective (every rank writes its optimizer shards), the Hugging Face
    # weights are rank 0's; write_collectively agrees on failures after each part, so a rank that fails
    # leaves no process waiting in a barrier and no directory behind.
    write_collectively(out_dir, ctx, lambda tmp: save_trainer_state(run.engine, tmp / TRAINER_STATE, meta, ctx),
                       save_policy)
    if ctx.is_main:
        with atomic_path(metrics_dir) as tmp:
            tmp.mkdir(parents=True)
            write_metrics(tmp / "metrics.json", metrics, HEADLINE)
            (tmp / STEPS).write_text(json.dumps(series, indent=1, sort_keys=True) + "\n")
    if ctx.world > 1:
        dist.barrier()


def run_learner(
    params: Params,
    iteration: int,
    policy_path: str | Path,
    trajectories_path: str | Path,
    masks_path: str | Path | None,
    out_dir: str | Path,
    metrics_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Train the policy on one iteration's rollouts; write the new policy (+ trainer state) and metrics.

    Returns {"policy", "trainer_state", "metrics", "details", "steps"} paths. `metrics_dir` defaults to
    `<out_dir>/../learn`. Raises SmdInputError (nothing written) on bad input or a failed parity gate.
    """
    t_start = time.perf_counter()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # learner/peak_device_mb is this run's peak, not the process's (`smdctl chain` runs the rollout before it)
        torch.cuda.reset_peak_memory_stats()
    out_dir = Path(out_dir)
    metrics_dir = Path(metrics_dir) if metrics_dir is not None else out_dir.parent / "learn"
    run = setup(params, iteration, Path(policy_path), trajectories_path, masks_path, log)
    try:
        fused = fused_parity(run)
        old, ref, parity = ({}, None, {}) if fused else parity_pass(run)
        weights = row_weights(run.data, run.cfg, old)
        series = [r for r in (train_step(run, step, weights, old, ref, parity if fused else None)
                              for step in run.steps) if r is not None]
        if fused and not parity:  # the one step was skipped (no valid token): nothing trained, the pass scores
            parity = parity_pass(run)[2]
        parity["learner/parity_fused"] = float(fused)
        metrics = _summary(run, parity, series, weights, time.perf_counter() - t_start)
        write_outputs(run, out_dir, metrics_dir, metrics, series)
    finally:  # a process that learns again (`smdctl chain`) must not keep this engine, finished or failed
        release_engine(run.engine)
        del run
    return {
        "policy": out_dir,
        "trainer_state": out_dir / TRAINER_STATE,
        "metrics": metrics_dir / "metrics.json",
        "details": metrics_dir / "details.json",
        "steps": metrics_dir / STEPS,
    }


def _rows_tensor(rows: list[int], values: dict[int, np.ndarray], mb: MicroBatch,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    # padded as the micro-batch (dtype: rollout_logp's by default); built on the host, one copy to its device
    out = torch.zeros(mb.rollout_logp.shape, dtype=dtype or mb.rollout_logp.dtype, device="cpu")
    for b, r in enumerate(rows):
        out[b, : mb.resp_lens[b]] = torch.from_numpy(values[r]).to(out.dtype)
    return out.to(mb.rollout_logp.device)


# Headline of metrics.json (the stage's headline file, read by progress and report); details.json beside it holds the whole record.
HEADLINE = ("mismatch/logprob_abs_diff_max", "mismatch/kl", "mismatch/rollout_is_eff_sample_size",
            "rejection/seq_fraction", "rejection/token_fraction", "policy/entropy", "pg/clipfrac",
            "batch/zero_adv_group_frac", "learner/seconds_per_step", "learner/peak_rss_mb")


def _summary(run: LearnerRun, parity: dict[str, float], series: list[dict], weights: RowWeights,
             seconds: float) -> dict[str, Any]:
    """The learn record: parity (before any step) under mismatch/*, step means under loss/*, pg/*, policy/*,
    timing and memory under learner/*, the config it ran with."""
    cfg, data, ctx = run.cfg, run.data, run.ctx
    train_seconds = sum(s["seconds"] for s in series)
    out: dict[str, Any] = {
        "iteration": run.iteration,
        "objective": cfg.objective,
        "attention_backend": cfg.attention_backend,
        "trajectories": len(data),
        "response_tokens": data.num_response_tokens,
        "reward/mean": float(np.mean(data.rewards)),
        "reward/std": float(np.std(data.rewards)),
        **parity,
        # sparse_rl's rejection over the whole batch, before the first update; 0 for every other objective
        **weights.rejection(np.arange(len(data))),
        "learner/steps": len(series),
        "learner/global_step": run.global_step,
        "learner/resumed_optimizer": run.resumed is not None,
        "learner/world_size": ctx.world,
        "learner/tokens_per_s": sum(s.get("tokens", 0.0) for s in series) / train_seconds if train_seconds > 0 else 0.0,
        # the steps' padded tokens (rows x longest row per micro-batch) / their real prompt + response tokens
        "learner/padded_token_ratio": (sum(s["padded_tokens"] for s in series)
                                       / max(sum(s["tokens"] for s in series), 1.0)),
        "learner/seconds_per_step": train_seconds / len(series) if series else 0.0,
        "learner/seconds": seconds,
        "learner/peak_rss_mb": _peak_rss_mb(),
        # the config it ran with; `rollout` is the producing config recorded in the trajectory table
        # (eviction policy and keep ratio of the rollouts it learned from: what `smdctl report` labels by)
        "config": {"learner": cfg.model_dump(), "rollout.temperature": run.temperature, "seed": run.params.seed,
                   "policy": str(run.policy_path), "trajectories": str(data.trajectories_path),
                   "rollout": data.rollout_config.get("rollout", {})},
    }
    if ctx.device.type == "cuda":
        out["learner/peak_device_mb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    keys = (*LOSS_TERMS, "pg/clipfrac", "pg/dual_clipfrac", "pg/ratio_mean", "pg/approx_kl", "grad_norm",
            "is_weight/mean", "policy/entropy", "batch/zero_adv_group_frac", KL_TOKEN_FRACTION, TRUSTED_FRACTION)
    for key in keys:
        values = [s[key] for s in series if key in s and math.isfinite(s[key])]
        if values:
            out[key] = float(np.mean(values))
    if series:
        out["grad_norm_max"] = float(max(s["grad_norm"] for s in series))
        for key in ("mismatch/logprob_abs_diff_max", "mismatch/kl"):
            out[f"final/{key}"] = series[-1][key]
    return out


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
