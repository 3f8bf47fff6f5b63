"""`smdctl probe-kl`: where the dense-teacher KL of smd lives, and what its gradient does to the dense policy
(issue 22, item 5).

For one iteration N of a run, on the policy that sampled it (`RunLayout.start_policy(N, warmstart)`), its
trajectories (rollout/trajectories.arrow) and compacted shadow masks (compact/masks.zarr), on up to `rows`
trajectory rows:

1. Per response token, the dense-teacher KL of the smd objective: KL(sg[pi_dense] || pi_masked) over the full
   vocabulary at the rollout temperature, computed by the learner's own path (the shadow-masked forward and the
   dense teacher sharing the prefix, `response_hidden_with_teacher`, scored through the lm head in token chunks,
   `chunked_token_scores`, which equals `objectives.dense_teacher_kl_per_token` on full logits).
2. Per response token, whether the fact it needs was evicted. The fact is found generally, by induction: the
   token's key is the prompt position k with prompt[k] == the token and prompt[k-1] == the token before it (for
   pointer_chasing's answer `ball deer ; deer bird ...`, the target `deer` after `ball` finds `ball deer .` in
   the prompt). Tokens with no such k, or with several, are class `no_fact` (separators, the hops' sources the
   answer copied from itself, wrong tokens, ambiguous matches). For a token with a key, the shadow mask gives
   the fraction of (layer, KV head) pairs that still see k at the query that predicts the token (q = its
   position - 1; visible iff evict_at[k, layer, head] > q): `kept` (all see it), `evicted` (none), `partial`.
3. Per class: tokens, mean KL per token (token mean; 95% interval by a bootstrap over rows), share of the
   total KL.
4. Gradients on the same weights, flattened over all parameters:
   g_kl          grad of the mean KL over all the rows' response tokens (through the masked policy only: the
                 teacher is detached, as in the objective);
   g_kl_<class>  the same mean restricted to the tokens of one class (g_kl = sum_c (n_c / n) g_kl_<class>);
   g_nll         grad of the dense policy's held-out reference NLL (`stages.common.model.reference_nll`: the
                 mean over `eval_rows` eval prompts of the reference answer's summed NLL, full context,
                 temperature 1), the figure evaluate reports as eval/dense/reference_nll.
   Reported: the norms, <g, g_nll> and cos(g, g_nll).
5. The step's gradient decomposition (`gradient_decomposition`): the update of smd at this iteration (its one
   optimizer step) is along g_smd = g_pg + kl_lambda * g_kl, with g_pg the GRPO surrogate's gradient at ratio 1
   and g_kl the mean KL's; reported |g_pg|, |g_kl|, kl_lambda |g_kl|, |g_smd| and cos(g_pg, g_kl) (0: the KL
   pushes perpendicular to GRPO; < 0: against it), the numbers of issue 34's audit.

Interpretation. A gradient step on the KL term moves the weights along -g_kl (times lr and kl_lambda). To first
order the held-out NLL changes by -lr * <g_kl, g_nll>: a positive cosine means the KL step also lowers the
dense policy's held-out NLL (it helps), a negative cosine means it raises it (the KL step degrades the dense
policy), about 0 means it is orthogonal noise for it. The per-class cosines tell which tokens carry the harm: a
KL on tokens whose fact was evicted asks the masked policy to produce an answer it cannot see, and the cheapest
way to match the teacher there may be to move shared weights away from the retrieval the dense policy uses.
(Adam rescales the step per coordinate; the cosine is the plain-SGD first-order picture.)

Output: a JSON (`write_probe`; fields in `probe_kl`'s docstring) and a small rich table (`render`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.layout import RunLayout
from schemas.params.learner import LearnerParams
from schemas.tables import read_table
from stages.common.model import load_policy, load_tokenizer, resolve_device, response_ids_after
from stages.learner.data import LearnerData, MicroBatch, build_micro_batch, load_learner_data
from stages.learner.kl_tokens import induction_keys
from stages.learner.logprobs import chunked_token_scores, lm_head_of
from stages.learner.shadow_attention import response_hidden_with_teacher

SCHEMA_VERSION = 1
KIND = "kl_probe"
CLASSES = ("no_fact", "kept", "partial", "evicted")
NO_FACT, KEPT, PARTIAL, EVICTED = range(len(CLASSES))
# Whose induction key classifies a token: the sampled token's (the brief's), or the fact the dense policy needs
# there: the sampled token's key, else the key of the dense teacher's most likely token (a wrong hop samples a
# token with no key, but the teacher's token has one: the fact the right answer needed).
KEY_KINDS = ("sampled", "needed")


# ------------------------------------------------------------------------------ the needed fact (induction key)
# `induction_keys` lives with the learner (stages/learner/kl_tokens.py), whose `learner.kl_tokens=keyed` applies
# the KL by the same rule as `classes_needed` here.
def key_visibility(keys: np.ndarray, evict_at: np.ndarray, prompt_len: int) -> np.ndarray:
    """Per response token with a key k (keys[t] >= 0), the fraction of (layer, KV head) pairs whose shadow mask
    still shows k to the query that predicts the token (q = prompt_len + t - 1; visible iff evict_at[k] > q);
    NaN where there is no key. `evict_at`: [T, L, H] of prompt + response."""
    frac = np.full(len(keys), np.nan)
    for t, k in enumerate(keys):
        if k >= 0:
            q = prompt_len + t - 1
            frac[t] = float((np.asarray(evict_at[k]) > q).mean())
    return frac


def classify(visible: np.ndarray) -> np.ndarray:
    """Visible fractions (NaN: no key) -> class indices into CLASSES (int64)."""
    out = np.full(len(visible), NO_FACT, dtype=np.int64)
    has = ~np.isnan(visible)
    out[has & (visible >= 1.0)] = KEPT
    out[has & (visible <= 0.0)] = EVICTED
    out[has & (visible > 0.0) & (visible < 1.0)] = PARTIAL
    return out


def token_classes(prompt: Sequence[int], response: Sequence[int], evict_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(class index [R], visible fraction [R], NaN without a key) of one trajectory's response tokens."""
    visible = key_visibility(induction_keys(prompt, response), np.asarray(evict_at), len(prompt))
    return classify(visible), visible


# ------------------------------------------------------------------------------ the KL and the gradients
def token_kl(model, input_ids: torch.Tensor, evict_at: torch.Tensor, prompt_lens: list[int], resp_lens: list[int],
             temperature: float, backend: str = "sdpa", chunk_tokens: int = 256) -> dict[str, torch.Tensor]:
    """The learner's per-token scores of a right-padded batch, as the smd objective gets them: `kl` [B, R] =
    KL(sg[pi_dense] || pi_masked) (gradient through the masked policy), `logp` [B, R] (the masked policy's
    log-probs of the sampled tokens), `valid` [B, R], `teacher_argmax` [B, R] (the dense teacher's most likely
    token; 0 at padding)."""
    hidden, teacher, targets, valid = response_hidden_with_teacher(model, input_ids, evict_at, prompt_lens,
                                                                   resp_lens, backend)
    head = lm_head_of(model)
    scores = chunked_token_scores(hidden, head, targets, valid, temperature=temperature,
                                  chunk_tokens=chunk_tokens, teacher_hidden=teacher)
    argmax = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
    with torch.no_grad():
        index = valid.reshape(-1).nonzero().squeeze(-1)
        flat = teacher.detach().reshape(-1, teacher.shape[-1]).index_select(0, index)
        best = torch.cat([head(flat[a: a + chunk_tokens]).argmax(-1) for a in range(0, len(flat), chunk_tokens)]
                         or [torch.zeros(0, dtype=torch.long, device=valid.device)])
        argmax.view(-1).index_copy_(0, index, best)
    return {"kl": scores["kl"], "logp": scores["logp"], "valid": valid, "teacher_argmax": argmax}


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# Parameter groups of a decoder LM by name (first match; the rest is "other"): where a gradient dot product sits.
PARAM_GROUPS = (("embed", ("embed", "lm_head", "wte", "wpe")),
                ("attn_qk", ("q_proj", "k_proj", "q_norm", "k_norm", "query", "key")),
                ("attn_vo", ("v_proj", "o_proj", "value", "dense")),
                ("mlp", ("mlp", "gate_proj", "up_proj", "down_proj", "fc")),
                ("norm", ("norm", "ln")))


def param_group(name: str) -> str:
    for group, needles in PARAM_GROUPS:
        if any(n in name for n in needles):
            return group
    return "other"


def group_slices(model) -> dict[str, list[tuple[int, int]]]:
    """Group -> the (start, stop) ranges of `flat_grad`'s vector over `trainable(model)` (parameter order)."""
    out: dict[str, list[tuple[int, int]]] = {}
    at = 0
    for name, p in model.named_parameters():  # the same order and deduplication as model.parameters()
        if p.requires_grad:
            out.setdefault(param_group(name), []).append((at, at + p.numel()))
            at += p.numel()
    return out


def group_dots(g: torch.Tensor, h: torch.Tensor, slices: dict[str, list[tuple[int, int]]]) -> dict[str, float]:
    """<g, h> split over the parameter groups (they sum to <g, h>)."""
    return {name: float(sum(float(g[a:b] @ h[a:b]) for a, b in ranges)) for name, ranges in slices.items()}


def flat_grad(loss: torch.Tensor, params: list[torch.nn.Parameter], retain_graph: bool = False) -> torch.Tensor:
    """d loss / d params, flattened into one float64 vector on the host (zeros for unused parameters)."""
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
                      for g, p in zip(grads, params)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) in float64; NaN when either is zero."""
    na, nb = float(a.double().norm()), float(b.double().norm())
    if na == 0.0 or nb == 0.0:
        return math.nan
    return float(a.double() @ b.double()) / (na * nb)


def reference_nll_sum(model, tokenizer, prompts: list[list[int]], references: list[str]) -> torch.Tensor:
    """The summed reference NLL of one batch, with gradient: `stages.common.model.reference_nll_batch` (dense,
    full context, temperature 1, the reference and EOS) without its no_grad."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = [(list(p), response_ids_after(tokenizer, p, r)) for p, r in zip(prompts, references, strict=True)]
    T = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    targets = torch.zeros(len(seqs), T, dtype=torch.long)
    pick = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (p, r) in enumerate(seqs):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, : len(p) + len(r)] = 1
        targets[b, len(p) - 1: len(p) + len(r) - 1] = torch.tensor(r)
        pick[b, len(p) - 1: len(p) + len(r) - 1] = True
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)
    return -(logp * pick.to(device)).sum()


def bootstrap_ratio(sums: np.ndarray, counts: np.ndarray, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of sum(sums) / sum(counts) under resampling rows with replacement (the rows'
    tokens are not independent); [nan, nan] without tokens."""
    if counts.sum() == 0:
        return [math.nan, math.nan]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(sums), size=(resamples, len(sums)))
    s, c = sums[idx].sum(1), counts[idx].sum(1)
    ratio = s[c > 0] / c[c > 0]
    return [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]


# ------------------------------------------------------------------------------ the probe
def latest_iteration(layout: RunLayout) -> int:
    """The last iteration whose rollout trajectories and compacted masks both exist."""
    done = [n for n in layout.iterations() if layout.iteration(n).trajectories.exists()
            and (layout.iteration(n).masks / "zarr.json").exists()]
    if not done:
        raise SmdInputError(f"{layout.artifacts}: no iteration with rollout/{layout.iteration(1).trajectories.name} "
                            "and compact/masks.zarr")
    return done[-1]


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise SmdInputError(f"{path}: missing ({what})")
    return path


def _pick_rows(n: int, rows: int, seed: int) -> list[int]:
    if rows >= n:
        return list(range(n))
    return sorted(np.random.default_rng(seed).choice(n, size=rows, replace=False).tolist())


@dataclass(frozen=True)
class ProbeSettings:
    """How `probe_kl` probes an iteration (the defaults are the CLI's).

    warmstart         the policy of iteration 1 (None: <run>/warmstart/policy); the probed policy is the one that
                      sampled the iteration, `RunLayout.start_policy(iteration, warmstart)`
    eval_prompts      the held-out prompts of g_nll (None: the run's data/eval.arrow)
    rows              trajectory rows to probe (a seeded sample; all of them when the table has fewer)
    eval_rows         eval prompts of g_nll and of the measured steps (the first ones of the table)
    temperature       the KL's temperature (None: the rollout's, from the trajectory table's config)
    micro_batch_size  rows per forward, for the trajectories and the eval prompts alike
    seed              seed of the row sample and of the bootstrap intervals
    device, dtype     where and in what precision the policy is loaded (`resolve_device`, `load_policy`)
    backend           the shadow-masked attention's backend (`response_hidden_with_teacher`)
    kl_lambda         the smd weight of the KL: g_smd = g_pg + kl_lambda * g_kl
    step_lr           the size of the measured Adam-like sign steps, -step_lr * sign(g)
    """

    warmstart: str | Path | None = None
    eval_prompts: str | Path | None = None
    rows: int = 64
    eval_rows: int = 64
    temperature: float | None = None
    micro_batch_size: int = 8
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    backend: str = "sdpa"
    kl_lambda: float = 0.1
    step_lr: float = 3e-5

    def check(self) -> None:
        """Raise SmdInputError unless rows, eval_rows and micro_batch_size are all >= 1."""
        if self.rows < 1 or self.eval_rows < 1 or self.micro_batch_size < 1:
            raise SmdInputError(f"rows, eval_rows, micro_batch_size: must be >= 1 (got {self.rows}, "
                                f"{self.eval_rows}, {self.micro_batch_size})")


@dataclass(frozen=True)
class ProbeInputs:
    """The resolved inputs of one probe: the run's layout, the iteration, and the paths it reads (all exist)."""

    layout: RunLayout
    iteration: int
    policy: Path
    trajectories: Path
    masks: Path
    eval_prompts: Path


@dataclass
class ProbeModel:
    """The probed policy (its tokenizer, device and trainable weights), the iteration's learner data, the KL's
    temperature and the trajectory rows probed."""

    model: Any
    tokenizer: Any
    device: torch.device
    data: LearnerData
    temperature: float
    rows: list[int]
    params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def size(self) -> int:
        """The number of trainable weights (the length of every flat gradient)."""
        return sum(p.numel() for p in self.params)

    @property
    def n_pairs(self) -> int:
        """The (layer, KV head) pairs of the policy: the denominator of a key's visible fraction."""
        cfg = self.model.config
        return int(cfg.num_hidden_layers * _num_kv_heads(cfg))


@dataclass
class TokenScores:
    """What the probed rows' forwards give, per row (trajectory-table index): `kl` (the response tokens' KL,
    float64), per key kind (KEY_KINDS) `classes` (indices into CLASSES) and `visible` (the key's visible
    fraction, NaN without a key); `positive` (advantage > 0); `grad_sums`, flat gradients of sums of per-token
    terms over all the rows (`<kind>:<class>`, `adv_pos`, `adv_nonpos`: the KL; `pg`: the GRPO surrogate),
    divided by their token counts at the end; `parity`, max |masked log-prob - rollout log-prob|; `tokens`,
    the number of response tokens."""

    rows: list[int]
    positive: dict[int, bool]
    tokens: int
    kl: dict[int, np.ndarray] = field(default_factory=dict)
    classes: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: {kind: {} for kind in KEY_KINDS})
    visible: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: {kind: {} for kind in KEY_KINDS})
    grad_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    parity: float = 0.0

    def add_grad(self, name: str, loss: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        """Add d loss / d params to the gradient sum `name` (the graph is kept for the next term)."""
        g = flat_grad(loss, params, retain_graph=True)
        self.grad_sums[name] = self.grad_sums[name] + g if name in self.grad_sums else g

    def class_tokens(self, kind: str, c: int) -> int:
        """Tokens of class index `c` under key kind `kind`, over all the rows."""
        return int(sum(int((self.classes[kind][r] == c).sum()) for r in self.rows))

    def side_rows(self, positive: bool) -> list[int]:
        """The rows whose advantage is > 0 (positive) or <= 0 (not positive)."""
        return [r for r in self.rows if self.positive[r] == positive]


def _num_kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def probe_kl(artifacts: str | Path, iteration: int | None, settings: ProbeSettings | None = None,
             **options: Any) -> dict[str, Any]:
    """Measure the dense-teacher KL of iteration `iteration` (None: the latest with rollout + compact) of the run
    under `artifacts`, as `settings` says (`options`: ProbeSettings fields that override it, e.g. rows=32).
    Returns the record `write_probe` writes:

      kind, schema_version          "kl_probe", 1
      artifacts, iteration, policy, trajectories, masks, eval_prompts   the inputs (paths as strings)
      temperature                   the KL's temperature (the rollout's, from the trajectory table's config)
      rows                          the trajectory-table rows probed (a seeded sample of `rows` rows)
      eval_rows                     how many eval prompts g_nll uses (the first ones of eval.arrow)
      parity_logprob_abs_diff_max   max |masked learner log-prob - rollout log-prob| (the mask reproduces the
                                    sampler when this is ~0; a large value means the probe's masked policy is
                                    not the one that sampled)
      tokens, kl_mean, kl_ci95      all response tokens: count, mean KL per token (nats), bootstrap interval
      classes                       per class (no_fact, kept, partial, evicted): tokens, rows (with such a
                                    token), kl_mean, kl_ci95, kl_share (of the total KL), visible_mean (mean
                                    fraction of (layer, head) pairs that see the key; null for no_fact); the
                                    key is the sampled token's induction key
      classes_needed                the same with the key of the fact the dense policy needs there: the sampled
                                    token's key, else that of the dense teacher's most likely token (a wrong hop
                                    has no key of its own; the teacher's right token has one)
      reference_nll                 the dense policy's mean reference NLL on the eval prompts (nats / answer)
      by_visible                    fact tokens by how many (layer, KV head) pairs see the key: {"i/n": {tokens,
                                    kl_mean}} (SnapKV selects per head, so most facts are partial);
                                    by_visible_needed: the same for classes_needed
      by_advantage                  rows by the sign of their GRPO advantage (pos: A > 0, nonpos: A <= 0): rows,
                                    tokens, kl_mean; their gradients are kl_adv_pos / kl_adv_nonpos
      kl_lambda, step_lr            the smd weight of the KL, and the step size of the measured steps
      gradients                     per gradient: kl, kl_<class>, kl_needed_<class>, kl_adv_pos, kl_adv_nonpos
                                    (each the mean KL over its tokens), pg (the GRPO surrogate's gradient at ratio 1:
                                    grad of -sum A * log pi_masked / tokens, the row's advantage A over the whole
                                    iteration batch; clipping is inactive at the first step), smd (pg +
                                    kl_lambda * kl), nll: norm; for all but nll also
                                    dot_with_nll = <g, g_nll>, cosine_with_nll = cos(g, g_nll),
                                    sign_cosine_with_nll = cos(sign(g), g_nll) (Adam's first step from a fresh
                                    state is lr * sign(g): its first-order effect), dot_by_group (<g, g_nll>
                                    split over the parameter groups embed / attn_qk / attn_vo / mlp / norm)
                                    (null where a class has no token)
      decomposition                 the step's gradient split (`gradient_decomposition`): pg_norm |g_pg|, kl_norm
                                    |g_kl|, weighted_kl_norm kl_lambda |g_kl|, smd_norm |g_pg + kl_lambda g_kl|,
                                    cosine_pg_kl cos(g_pg, g_kl) (null when either is zero)
      steps                         for kl, pg, smd: the held-out NLL after one sign step -step_lr * sign(g)
                                    (Adam's first step), measured (nll_after - reference_nll) and predicted to
                                    first order (-step_lr * <sign(g), g_nll>)
      seconds                       wall time of the probe
    """
    t0 = time.perf_counter()
    settings = replace(settings if settings is not None else ProbeSettings(), **options)
    inputs = resolve_inputs(artifacts, iteration, settings)
    settings.check()
    pm = load_probe_model(inputs, settings)
    scores = score_rows(pm, settings)
    eval_table = load_eval_prompts(inputs.eval_prompts, settings.eval_rows)
    nll, g_nll = held_out_nll_and_grad(pm, eval_table, settings.micro_batch_size)
    directions = update_directions(scores, pm.size, settings.kl_lambda)
    steps = sign_steps(pm, eval_table, directions, g_nll, nll, settings)
    gradients = gradient_entries(scores, directions, g_nll, group_slices(pm.model))
    gradients_split = gradient_decomposition(directions["pg"], directions["kl"], settings.kl_lambda)
    stats = token_statistics(scores, pm.n_pairs, settings.seed)
    return probe_record(inputs, pm, settings, scores.parity, len(eval_table), stats, nll, gradients, steps, t0,
                        gradients_split)


# ------------------------------------------------------------------------------ the probe's steps
def resolve_inputs(artifacts: str | Path, iteration: int | None, settings: ProbeSettings) -> ProbeInputs:
    """The iteration to probe and its input paths; SmdInputError for a missing one."""
    layout = RunLayout(artifacts)
    n = latest_iteration(layout) if iteration is None else int(iteration)
    it = layout.iteration(n)
    policy = _need(layout.start_policy(n, settings.warmstart), f"the policy that sampled iteration {n}")
    traj = _need(it.trajectories, f"iteration {n}'s rollout trajectories")
    masks = _need(it.masks, f"iteration {n}'s compacted masks")
    evals = _need(Path(settings.eval_prompts) if settings.eval_prompts is not None else layout.eval_prompts,
                  "the eval prompts")
    return ProbeInputs(layout, n, policy, traj, masks, evals)


def load_probe_model(inputs: ProbeInputs, settings: ProbeSettings) -> ProbeModel:
    """Load the policy and tokenizer, the iteration's trajectories with their shadow masks, the KL's temperature
    and the seeded sample of rows."""
    dev = resolve_device(settings.device)
    model = load_policy(inputs.policy, settings.dtype, device=dev)
    tokenizer = load_tokenizer(inputs.policy)
    cfg = model.config
    data = load_learner_data(LearnerParams(), inputs.trajectories, inputs.masks, cfg.num_hidden_layers,
                             _num_kv_heads(cfg), need_masks=True)
    temperature = settings.temperature
    if temperature is None:
        temperature = float(data.rollout_config.get("rollout", {}).get("temperature", 1.0))
    picked = _pick_rows(len(data), settings.rows, settings.seed)
    return ProbeModel(model, tokenizer, dev, data, temperature, picked, trainable(model))


def score_rows(pm: ProbeModel, settings: ProbeSettings) -> TokenScores:
    """The per-token KL and classes of the probed rows and their gradient sums, one micro-batch at a time."""
    data = pm.data
    scores = TokenScores(rows=pm.rows, positive={r: bool(data.advantages[r] > 0) for r in pm.rows},
                         tokens=int(sum(len(data.response_ids[r]) for r in pm.rows)))
    for start in range(0, len(pm.rows), settings.micro_batch_size):
        batch = pm.rows[start: start + settings.micro_batch_size]
        mb = build_micro_batch(data, batch, masked=True, device=pm.device)
        out = token_kl(pm.model, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens, pm.temperature,
                       settings.backend)
        gap = (out["logp"].detach() - mb.rollout_logp).abs()[out["valid"]]
        scores.parity = max(scores.parity, float(gap.max()) if gap.numel() else 0.0)
        cls = classify_batch(data, batch, out, mb.evict_at.cpu(), scores)
        add_batch_gradients(mb, batch, out, cls, pm.params, scores)
    return scores


def row_keys(prompt: Sequence[int], response: Sequence[int], teacher_argmax: Sequence[int]) -> dict[str, np.ndarray]:
    """Per key kind (KEY_KINDS) the induction key of each response token: `sampled`, the sampled token's;
    `needed`, the sampled token's where it has one, else the dense teacher's most likely token's."""
    sampled = induction_keys(prompt, response)
    needed = np.where(sampled >= 0, sampled, induction_keys(prompt, response, teacher_argmax))
    return {"sampled": sampled, "needed": needed}


def classify_batch(data: LearnerData, batch: list[int], out: dict[str, torch.Tensor], evict_at: torch.Tensor,
                   scores: TokenScores) -> dict[str, torch.Tensor]:
    """Record each row's per-token KL, classes and visible fractions in `scores`; per key kind the classes as
    a [B, R] tensor of the batch (-1 at padding). `evict_at`: the micro-batch's [L, B, H, T] on the host."""
    kl = out["kl"]
    argmax = out["teacher_argmax"].cpu().numpy()
    cls = {kind: torch.full(kl.shape, -1, dtype=torch.long) for kind in KEY_KINDS}
    for b, r in enumerate(batch):
        prompt, response = data.prompt_ids[r], data.response_ids[r]
        ev = evict_at[:, b].permute(2, 0, 1)[: data.length(r)].numpy()  # [T, L, H]
        scores.kl[r] = kl.detach()[b, : len(response)].double().cpu().numpy()
        for kind, keys in row_keys(prompt, response, argmax[b, : len(response)]).items():
            scores.visible[kind][r] = key_visibility(keys, ev, len(prompt))
            scores.classes[kind][r] = classify(scores.visible[kind][r])
            cls[kind][b, : len(response)] = torch.from_numpy(scores.classes[kind][r])
    return cls


def add_batch_gradients(mb: MicroBatch, batch: list[int], out: dict[str, torch.Tensor],
                        cls: dict[str, torch.Tensor], params: list[torch.nn.Parameter], scores: TokenScores) -> None:
    """Add one micro-batch's gradients of the summed KL per (key kind, class) and per advantage side, and of the
    GRPO surrogate -sum A * log pi_masked, to `scores.grad_sums`."""
    kl, valid = out["kl"], out["valid"]
    for kind in KEY_KINDS:
        on = cls[kind].to(kl.device)
        for c in range(len(CLASSES)):
            sel = (on == c) & valid
            if bool(sel.any()):
                scores.add_grad(f"{kind}:{c}", (kl * sel).sum(), params)
    side = torch.tensor([scores.positive[r] for r in batch], device=kl.device).unsqueeze(1)
    for name, sel in (("adv_pos", valid & side), ("adv_nonpos", valid & ~side)):
        if bool(sel.any()):
            scores.add_grad(name, (kl * sel).sum(), params)
    scores.add_grad("pg", -(mb.advantages.unsqueeze(1) * out["logp"] * valid).sum(), params)


def load_eval_prompts(path: Path, eval_rows: int) -> list[dict[str, Any]]:
    """The first `eval_rows` rows of the eval prompts table; SmdInputError when there is none."""
    eval_table = read_table(path, "prompts").to_pylist()[:eval_rows]
    if not eval_table:
        raise SmdInputError(f"{path}: no eval prompts (g_nll needs at least one)")
    return eval_table


def held_out_nll(pm: ProbeModel, eval_table: list[dict[str, Any]], micro_batch_size: int,
                 g_nll: torch.Tensor | None = None) -> float:
    """The dense policy's mean reference NLL on `eval_table` (nats / answer); with `g_nll`, its gradient
    (flat, float64) is added into it."""
    total = 0.0
    for start in range(0, len(eval_table), micro_batch_size):
        part = eval_table[start: start + micro_batch_size]
        with torch.enable_grad() if g_nll is not None else torch.no_grad():
            loss = reference_nll_sum(pm.model, pm.tokenizer, [p["prompt_token_ids"] for p in part],
                                     [p["reference"] for p in part]) / len(eval_table)
        total += float(loss.detach())
        if g_nll is not None:
            g_nll.add_(flat_grad(loss, pm.params))
    return total


def held_out_nll_and_grad(pm: ProbeModel, eval_table: list[dict[str, Any]],
                          micro_batch_size: int) -> tuple[float, torch.Tensor]:
    """(the held-out reference NLL, its gradient g_nll)."""
    g_nll = torch.zeros(pm.size, dtype=torch.float64)
    return held_out_nll(pm, eval_table, micro_batch_size, g_nll), g_nll


def update_directions(scores: TokenScores, size: int, kl_lambda: float) -> dict[str, torch.Tensor]:
    """The mean-over-tokens gradients a step would follow: kl (the KL over all tokens), pg (the GRPO
    surrogate) and smd (pg + kl_lambda * kl)."""
    zero = torch.zeros(size, dtype=torch.float64)
    n_tok = max(scores.tokens, 1)
    g_all = sum((scores.grad_sums.get(f"sampled:{c}", zero) for c in range(len(CLASSES))), zero) / n_tok
    g_pg = scores.grad_sums["pg"] / n_tok
    return {"kl": g_all, "pg": g_pg, "smd": g_pg + kl_lambda * g_all}


def gradient_decomposition(g_pg: torch.Tensor, g_kl: torch.Tensor, kl_lambda: float) -> dict[str, float | None]:
    """The smd step's gradient split: |g_pg|, |g_kl|, kl_lambda |g_kl|, |g_pg + kl_lambda g_kl| and cos(g_pg, g_kl)
    (float64; the cosine null when either gradient is zero)."""
    g_pg, g_kl = g_pg.double(), g_kl.double()
    return {"pg_norm": float(g_pg.norm()), "kl_norm": float(g_kl.norm()),
            "weighted_kl_norm": float(kl_lambda * g_kl.norm()),
            "smd_norm": float((g_pg + kl_lambda * g_kl).norm()), "cosine_pg_kl": _num(cosine(g_pg, g_kl))}


def sign_steps(pm: ProbeModel, eval_table: list[dict[str, Any]], directions: dict[str, torch.Tensor],
               g_nll: torch.Tensor, nll: float, settings: ProbeSettings) -> dict[str, dict[str, float]]:
    """Per direction g, the held-out NLL after the sign step -step_lr * sign(g) (the weights are restored after
    each): nll_after, measured_change (from `nll`) and predicted_change (first order)."""
    steps = {}
    for name, g in directions.items():
        step = torch.sign(g) * settings.step_lr
        with torch.no_grad():
            saved = [p.detach().clone() for p in pm.params]
            at = 0
            for p in pm.params:
                p.sub_(step[at: at + p.numel()].view_as(p).to(p.dtype).to(p.device))
                at += p.numel()
            after = held_out_nll(pm, eval_table, settings.micro_batch_size)
            for p, v in zip(pm.params, saved):
                p.copy_(v)
        steps[name] = {"nll_after": after, "measured_change": after - nll,
                       "predicted_change": -settings.step_lr * float(torch.sign(g) @ g_nll)}
    return steps


def grad_entry(g: torch.Tensor | None, g_nll: torch.Tensor, slices: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
    """A gradient's record entry: its norm, <g, g_nll>, cos(g, g_nll), cos(sign g, g_nll) and <g, g_nll> by
    parameter group; all null for None (a class without tokens)."""
    if g is None:
        return {"norm": None, "dot_with_nll": None, "cosine_with_nll": None, "sign_cosine_with_nll": None,
                "dot_by_group": None}
    return {"norm": float(g.norm()), "dot_with_nll": float(g @ g_nll), "cosine_with_nll": _num(cosine(g, g_nll)),
            "sign_cosine_with_nll": _num(cosine(torch.sign(g), g_nll)), "dot_by_group": group_dots(g, g_nll, slices)}


def gradient_entries(scores: TokenScores, directions: dict[str, torch.Tensor], g_nll: torch.Tensor,
                     slices: dict[str, list[tuple[int, int]]]) -> dict[str, dict[str, Any]]:
    """The record's `gradients`: kl, pg, smd, nll, kl_<class>, kl_needed_<class>, kl_adv_pos, kl_adv_nonpos
    (each gradient sum divided by its token count)."""
    zero = torch.zeros_like(g_nll)

    def mean_grad(name: str, count: int) -> torch.Tensor | None:
        return scores.grad_sums.get(name, zero) / count if count else None

    gradients = {name: grad_entry(g, g_nll, slices) for name, g in directions.items()}
    gradients["nll"] = {"norm": float(g_nll.norm())}
    for kind in KEY_KINDS:
        for c, name in enumerate(CLASSES):
            key = f"kl_{name}" if kind == "sampled" else f"kl_{kind}_{name}"
            gradients[key] = grad_entry(mean_grad(f"{kind}:{c}", scores.class_tokens(kind, c)), g_nll, slices)
    for side, positive in (("pos", True), ("nonpos", False)):
        tok = int(sum(len(scores.kl[r]) for r in scores.side_rows(positive)))
        gradients[f"kl_adv_{side}"] = grad_entry(mean_grad(f"adv_{side}", tok), g_nll, slices)
    return gradients


# ------------------------------------------------------------------------------ the per-class statistics
def class_statistics(scores: TokenScores, kind: str, seed: int, total_kl: float) -> dict[str, dict[str, Any]]:
    """Per class under key kind `kind`: tokens, rows, kl_mean, kl_ci95 (bootstrap over rows), kl_share (of
    `total_kl`), visible_mean (null for no_fact and for a class without tokens)."""
    rows, kl, cls, visible = scores.rows, scores.kl, scores.classes[kind], scores.visible[kind]
    sums = np.array([[kl[r][cls[r] == c].sum() for c in range(len(CLASSES))] for r in rows])
    counts = np.array([[int((cls[r] == c).sum()) for c in range(len(CLASSES))] for r in rows])
    table: dict[str, dict[str, Any]] = {}
    for c, name in enumerate(CLASSES):
        tok = int(counts[:, c].sum())
        vis = np.concatenate([visible[r][cls[r] == c] for r in rows]) if tok else np.zeros(0)
        table[name] = {
            "tokens": tok,
            "rows": int((counts[:, c] > 0).sum()),
            "kl_mean": _num(float(sums[:, c].sum()) / tok) if tok else None,
            "kl_ci95": [_num(x) for x in bootstrap_ratio(sums[:, c], counts[:, c], seed=seed)] if tok else None,
            "kl_share": _num(float(sums[:, c].sum()) / total_kl) if total_kl > 0 else None,
            "visible_mean": (_num(float(np.mean(vis))) if c != NO_FACT else None) if tok else None,
        }
    return table


def visibility_statistics(scores: TokenScores, kind: str, n_pairs: int) -> dict[str, dict[str, Any]]:
    """Fact tokens (a key under `kind`) by how many of the `n_pairs` (layer, KV head) pairs see the key:
    {"i/n_pairs": {tokens, kl_mean}}, for the counts i that occur."""
    cls, visible = scores.classes[kind], scores.visible[kind]
    out: dict[str, dict[str, Any]] = {}
    for i in range(n_pairs + 1):
        vals = np.concatenate([scores.kl[r][(cls[r] != NO_FACT) & (np.round(visible[r] * n_pairs) == i)]
                               for r in scores.rows])
        if len(vals):
            out[f"{i}/{n_pairs}"] = {"tokens": int(len(vals)), "kl_mean": float(vals.mean())}
    return out


def advantage_statistics(scores: TokenScores) -> dict[str, dict[str, Any]]:
    """Rows by the sign of their advantage (pos: A > 0, nonpos: A <= 0): rows, tokens, kl_mean."""
    out = {}
    for side, positive in (("pos", True), ("nonpos", False)):
        mine = scores.side_rows(positive)
        tok = int(sum(len(scores.kl[r]) for r in mine))
        out[side] = {"rows": len(mine), "tokens": tok,
                     "kl_mean": float(sum(scores.kl[r].sum() for r in mine)) / tok if tok else None}
    return out


def token_statistics(scores: TokenScores, n_pairs: int, seed: int) -> dict[str, Any]:
    """The record's KL statistics: tokens, kl_mean, kl_ci95 (all tokens), classes, classes_needed, by_visible,
    by_visible_needed, by_advantage."""
    rows = scores.rows
    total_kl = float(sum(scores.kl[r].sum() for r in rows))
    n_tok = scores.tokens
    all_sums = np.array([scores.kl[r].sum() for r in rows])
    all_counts = np.array([len(scores.kl[r]) for r in rows])
    return {
        "tokens": n_tok, "kl_mean": _num(total_kl / n_tok) if n_tok else None,
        "kl_ci95": [_num(x) for x in bootstrap_ratio(all_sums, all_counts, seed=seed)],
        "classes": class_statistics(scores, "sampled", seed, total_kl),
        "classes_needed": class_statistics(scores, "needed", seed, total_kl),
        "by_visible": visibility_statistics(scores, "sampled", n_pairs),
        "by_visible_needed": visibility_statistics(scores, "needed", n_pairs),
        "by_advantage": advantage_statistics(scores),
    }


# ------------------------------------------------------------------------------ the record
def probe_record(inputs: ProbeInputs, pm: ProbeModel, settings: ProbeSettings, parity: float, eval_rows: int,
                 stats: dict[str, Any], nll: float, gradients: dict[str, dict[str, Any]],
                 steps: dict[str, dict[str, float]], t0: float,
                 decomposition: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The record `probe_kl` returns (fields in its docstring, in that order); `seconds` since `t0`."""
    return {
        "kind": KIND, "schema_version": SCHEMA_VERSION,
        "artifacts": str(inputs.layout.artifacts), "iteration": inputs.iteration, "policy": str(inputs.policy),
        "trajectories": str(inputs.trajectories), "masks": str(inputs.masks),
        "eval_prompts": str(inputs.eval_prompts), "temperature": pm.temperature, "rows": pm.rows,
        "eval_rows": eval_rows, "parity_logprob_abs_diff_max": parity,
        **stats,
        "reference_nll": nll, "kl_lambda": settings.kl_lambda, "step_lr": settings.step_lr,
        "gradients": gradients, "decomposition": decomposition, "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def write_probe(record: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return out


def render(record: dict[str, Any], console) -> None:
    """A small table: per class tokens, mean KL [95% CI], share of the KL, mean visibility of the key, and
    cos(g, g_nll), cos(sign g, g_nll), |g| of the class's KL; then pg and smd's gradients, the measured sign
    steps and where <g_kl, g_nll> sits in the weights."""
    from rich.table import Table

    def f(x, spec=".3g"):
        return "-" if x is None else format(x, spec)

    table = Table(title=f"dense-teacher KL, iteration {record['iteration']} ({len(record['rows'])} rows, "
                        f"T={record['temperature']:g}; parity {record['parity_logprob_abs_diff_max']:.2g})")
    for col in ("term", "tokens", "KL/token", "95% CI", "share", "visible", "cos(g,g_nll)", "cos(sgn g,g_nll)",
                "|g|"):
        table.add_column(col, justify="left" if col == "term" else "right")
    grads = record["gradients"]

    def cosines(g):
        return f(g["cosine_with_nll"], "+.3f"), f(g["sign_cosine_with_nll"], "+.3f"), f(g["norm"])

    for kind, label, key in (("classes", "kl", "kl_"), ("classes_needed", "kl needed", "kl_needed_")):
        for name in CLASSES:
            c = record[kind][name]
            ci = "-" if c["kl_ci95"] is None else f"[{f(c['kl_ci95'][0])}, {f(c['kl_ci95'][1])}]"
            table.add_row(f"{label} {name}", str(c["tokens"]), f(c["kl_mean"]), ci, f(c["kl_share"], ".1%"),
                          f(c["visible_mean"], ".2f"), *cosines(grads[f"{key}{name}"]))
    lo, hi = record["kl_ci95"]
    table.add_row("kl (all)", str(record["tokens"]), f(record["kl_mean"]), f"[{f(lo)}, {f(hi)}]", "100%", "",
                  *cosines(grads["kl"]))
    for side in ("pos", "nonpos"):
        a = record["by_advantage"][side]
        table.add_row(f"kl rows A{'>' if side == 'pos' else '<='}0", str(a["tokens"]), f(a["kl_mean"]), "", "", "",
                      *cosines(grads[f"kl_adv_{side}"]))
    table.add_row("pg", "", "", "", "", "", *cosines(grads["pg"]))
    table.add_row(f"smd = pg + {record['kl_lambda']:g} kl", "", "", "", "", "", *cosines(grads["smd"]))
    console.print(table)
    steps = ", ".join(f"{k} {v['measured_change']:+.3g} (predicted {v['predicted_change']:+.3g})"
                      for k, v in record["steps"].items())
    groups = grads["kl"]["dot_by_group"] or {}
    dot = grads["kl"]["dot_with_nll"]
    split = ", ".join(f"{k} {v / dot:.0%}" for k, v in groups.items()) if dot else "-"
    console.print(f"held-out dense reference NLL {record['reference_nll']:.4g} nats/answer ({record['eval_rows']} "
                  f"eval prompts), |g_nll| {grads['nll']['norm']:.3g}. A step moves along -g: a negative cosine "
                  f"raises the held-out NLL to first order.\nNLL change after one Adam-like step -{record['step_lr']:g}"
                  f" * sign(g): {steps}.\n<g_kl, g_nll> by parameter group: {split}.")
    dec = record.get("decomposition")
    if dec:
        console.print(f"the step's gradient: |g_pg| {dec['pg_norm']:.3g}, |g_kl| {dec['kl_norm']:.3g} (x kl_lambda "
                      f"{dec['weighted_kl_norm']:.3g}), |g_smd| {dec['smd_norm']:.3g}, cos(g_pg, g_kl) "
                      f"{f(dec['cosine_pg_kl'], '+.3f')}")
    vis = ", ".join(f"{k}: {v['tokens']} tok KL {v['kl_mean']:.3g}" for k, v in record["by_visible"].items())
    console.print(f"fact tokens by (layer, KV head) pairs that see the key: {vis or '-'}")
    vis = ", ".join(f"{k}: {v['tokens']} tok KL {v['kl_mean']:.3g}" for k, v in record["by_visible_needed"].items())
    console.print(f"needed-fact tokens by (layer, KV head) pairs that see the key: {vis or '-'}")


def default_out(iteration: int) -> Path:
    return Path("reports") / f"probe-kl-iter-{iteration:03d}.json"


def run_probe_kl(artifacts: str | Path, iteration: int | None, out: str | Path | None = None,
                 **options: Any) -> tuple[dict[str, Any], Path]:
    """`probe_kl`, then its JSON written to `out` (default reports/probe-kl-iter-NNN.json): (record, path)."""
    record = probe_kl(artifacts, iteration, **options)
    return record, write_probe(record, out if out is not None else default_out(record["iteration"]))
