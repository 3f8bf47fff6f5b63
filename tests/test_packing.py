"""Packed rows (`learner.pack`, stages/learner/packing.py, docs/design.md §3e): the packed evict_at is the mask
"same row AND shadow-visible" (against the block-diagonal mask built directly, every eviction policy), positions
restart per row, and the packed learner equals the padded one in float64 -- the forward's hidden states (policy
and dense teacher), a GRPO-shaped loss and every parameter's gradient within 1e-10 relative for every eviction
policy's real rollout masks on the sdpa and tiled backends (FlexAttention, float32 only on the CPU, within the
float32 bound), and the learner's own `train_step` (smd with the current and a frozen teacher, shadow, dense; a
token budget over packed tokens) -- and through `run_learner` and DeepSpeed the same update, with padded tokens
equal to the real ones; `learner.pack` with shared prompts is one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.rollout import POLICIES, EvictionParams
from schemas.raw_masks import visibility
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.common.distributed import DistContext
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import load_policy
from stages.learner.data import build_micro_batch, load_learner_data
from stages.learner.packing import (
    dense_packed_evict_at,
    pack_ids,
    packed_evict_at,
    packed_hidden,
    packed_hidden_with_teacher,
    packed_position_ids,
    packed_response_index,
    row_starts,
)
from stages.learner.shadow_attention import response_hidden, response_hidden_with_teacher
from stages.learner.token_budget import budget_micro_batches, packed_tokens
from tests.helpers import (
    PlainEngine,
    float64_policy,
    float64_token_scores,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    model_chain,
    params_of,
    random_prompts,
    replay_batch,
    requires_cpu_flex,
    within_float32_bound,
)

REL = 1e-10  # float64: packed and padded differ only in summation order
GAPS: dict[str, float] = {}  # the largest relative gap each test measured (printed with -s)


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, key: str) -> None:
    gap = relative_gap(got, want)
    GAPS[key] = max(GAPS.get(key, 0.0), gap)
    assert gap <= REL, f"{what}: relative gap {gap:.3g} > {REL:g}"


# ------------------------------------------------------------------------------------------ the mask
def block_diagonal_shadow_mask(rows: list[torch.Tensor], layer: int, head: int) -> torch.Tensor:
    """The packed row's [N, N] mask written out directly: query q and key k in one row b, and row b's own shadow
    mask (`visibility` of its evict_at) shows its key k - s_b to its query q - s_b."""
    lengths = [int(r.shape[0]) for r in rows]
    N = sum(lengths)
    out = torch.zeros(N, N, dtype=torch.bool)
    for s, n, r in zip(row_starts(lengths), lengths, rows):
        out[s : s + n, s : s + n] = visibility(r[:, layer, head].to(torch.int64))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_packed_evict_at_is_same_row_and_shadow_visible(policy):
    """Rows of 23, 1, 40 and 9 tokens (a one-token row among them) under each policy's schedule: the packed
    evict_at's visibility is the block-diagonal AND shadow-visible mask, for every layer and KV head; the dense
    pass's is the block-diagonal causal mask."""
    rng = np.random.default_rng(7)
    lengths, prompts = [23, 1, 40, 9], [15, 1, 12, 5]
    cfg = eviction_config(policy, 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at(policy, T, P, 3, 2, cfg, rng).astype(np.int64))
            for T, P in zip(lengths, prompts)]
    packed = packed_evict_at(rows)
    assert packed.shape == (3, 1, 2, sum(lengths)) and packed.dtype == torch.int64
    if policy != "dense":  # the schedule evicts: the mask is not the block-diagonal causal one
        assert any(bool((r < torch.tensor(lengths[b])).any()) for b, r in enumerate(rows))
    for layer in range(3):
        for head in range(2):
            assert torch.equal(visibility(packed[layer, 0, head]), block_diagonal_shadow_mask(rows, layer, head))
    dense = dense_packed_evict_at(lengths, 3, 2)
    full = [torch.full((n, 3, 2), n, dtype=torch.int64) for n in lengths]  # never evicted: the sentinel T_b
    for layer in range(3):
        assert torch.equal(visibility(dense[layer, 0, 1]), block_diagonal_shadow_mask(full, layer, 1))


def test_packed_layout_hand_checked():
    """Rows (prompt 3, response 2), (prompt 2, response 0), (prompt 1, response 3): starts 0, 5, 7; positions
    restart per row; the positions predicting each response token and the tokens they predict; a key's evict_at
    is shifted to its row and capped at the row's end."""
    assert row_starts([5, 2, 4]) == [0, 5, 7]
    assert packed_position_ids([5, 2, 4]).tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    idx, valid = packed_response_index([3, 2, 1], [2, 0, 3])
    assert idx.tolist() == [[2, 3, 0], [0, 0, 0], [7, 8, 9]]
    assert valid.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    ids = pack_ids([[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33]])
    assert ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 30, 31, 32, 33]]
    assert ids[0, (idx + 1)[valid]].tolist() == [13, 14, 31, 32, 33]  # the responses, in order
    ev = [torch.tensor([5, 4, 5, 5, 5]).view(5, 1, 1), torch.tensor([2, 2]).view(2, 1, 1),
          torch.tensor([4, 9, 4, 4]).view(4, 1, 1)]  # row 2's key 1 past its row (9 > 4): capped at its end
    assert packed_evict_at(ev)[0, 0, 0].tolist() == [5, 4, 5, 5, 5, 7, 7, 11, 11, 11, 11]
    assert dense_packed_evict_at([5, 2, 4], 1, 1)[0, 0, 0].tolist() == [5] * 5 + [7] * 2 + [11] * 4


def test_packed_token_budget():
    """With learner.pack a budget counts the micro-batch's real tokens (their sum), not rows x the longest."""
    assert packed_tokens([10, 3, 7]) == 20
    rows = [[10], [9], [9], [5], [5], [5], [2]]
    assert budget_micro_batches(rows, 20, packed=True) == [[0, 1], [2, 3, 4], [5, 6]]
    assert budget_micro_batches(rows, 20) == [[0, 1], [2, 3], [4, 5, 6]]  # padded: 9 + 9 + 5 pads to 27
    with pytest.raises(SmdInputError, match=r"^learner.micro_batch_tokens=9: a row needs 10 tokens \(packed\); "
                                            r"set it to at least 10$"):
        budget_micro_batches(rows, 9, packed=True)


def test_pack_with_shared_prompts_is_one_line():
    with pytest.raises(SmdInputError) as err:
        make_params(**{"learner.pack": "true", "learner.shared_prompt": "true"})
    msg = str(err.value)
    assert "\n" not in msg and "learner.pack: true needs learner.shared_prompt: false" in msg
    assert make_params(**{"learner.pack": "true", "learner.shared_prompt": "false"}).learner.pack
    assert not make_params().learner.pack  # off by default


# ------------------------------------------------------------------------------------------ the forward, float64
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("packing"), "gqa")


@pytest.fixture(scope="module")
def rollouts(model_dir):
    """Per eviction policy, four rows sampled by the evicting engine: prompts of 30, 23, 17 and 41 tokens, the
    first two with 12 new tokens, the last two with 4 (padded, the batch holds 4 x 45 = 180 slots for 143 tokens).
    (prompts, results) each."""
    model = load_policy(model_dir)
    prompts = random_prompts([30, 23, 17, 41], seed=3)
    out = {}
    for i, policy in enumerate(POLICIES):
        eviction = EvictionParams(policy=policy, keep_ratio=0.5, window=4, sinks=2)
        long, _ = generate_batch(model, prompts[:2], eviction, 12, None, 0, 1.0, torch.Generator().manual_seed(i))
        short, _ = generate_batch(model, prompts[2:], eviction, 4, None, 0, 1.0, torch.Generator().manual_seed(9 + i))
        out[policy] = (prompts, long + short)
    return out


def forward_loss(model, packed: bool, ids, evict_at, prompt_lens, resp_lens, weights, mode: str, backend: str):
    """A GRPO-shaped loss (weighted log-probs, plus the weighted teacher KL in the teacher mode) of one padded or
    packed forward in float64, with (loss, hidden at the valid positions, teacher's or None, every gradient)."""
    model.zero_grad(set_to_none=True)
    ev = None if mode == "dense" else evict_at
    teacher = None
    if mode == "teacher":
        forward = packed_hidden_with_teacher if packed else response_hidden_with_teacher
        hidden, teacher, targets, valid = forward(model, ids, ev, prompt_lens, resp_lens, backend, 16)
    elif packed:
        hidden, targets, valid = packed_hidden(model, ids, ev, prompt_lens, resp_lens, backend, 16)
    else:
        hidden, targets, valid = response_hidden(model, ids, ev, prompt_lens, resp_lens, backend)
    scores = float64_token_scores(hidden, model.get_output_embeddings(), targets, valid, temperature=0.8,
                                  teacher_hidden=teacher)
    loss = (scores["logp"] * weights[:, : valid.shape[1]]).sum()
    if teacher is not None:
        loss = loss + 0.1 * scores["kl"].sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (loss.detach(), hidden.detach()[valid], None if teacher is None else teacher.detach()[valid], grads,
            targets[valid])


def padded_and_packed(prompts, results):
    """The rows as the padded learner holds them (ids [B, T], evict_at [L, B, H, T]) and packed ([1, N],
    [L, 1, H, N]), with their prompt and response lengths."""
    ids, evict_at, _ = replay_batch(prompts, results)
    pids = pack_ids([p + r.response_ids for p, r in zip(prompts, results)])
    pev = packed_evict_at([torch.from_numpy(r.evict_at) for r in results])
    return ids, evict_at, pids, pev, [len(p) for p in prompts], [len(r.response_ids) for r in results]


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
@pytest.mark.parametrize("mode", ["masked", "teacher", "dense"])
@pytest.mark.parametrize("policy", POLICIES)
def test_packed_forward_equals_padded_float64(model_dir, rollouts, policy, mode, backend):
    """Loss, hidden states (policy and dense teacher) at every response position and every parameter's gradient of
    the packed forward equal the padded forward's (same backend) in float64, for every eviction policy's real
    rollout masks, rows of four lengths."""
    ids, evict_at, pids, pev, prompt_lens, resp_lens = padded_and_packed(*rollouts[policy])
    assert pids.shape[1] == sum(prompt_lens) + sum(resp_lens) < ids.numel()
    model = float64_policy(model_dir)
    weights = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = forward_loss(model, False, ids, evict_at, prompt_lens, resp_lens, weights, mode, backend)
    got = forward_loss(model, True, pids, pev, prompt_lens, resp_lens, weights, mode, backend)
    key = f"forward {backend}"
    assert torch.equal(got[4], want[4])  # the same target tokens
    assert_close(got[0], want[0], "loss", key)
    assert_close(got[1], want[1], "policy hidden", key)
    if mode == "teacher":
        assert_close(got[2], want[2], "teacher hidden", key)
        if policy != "dense":  # the mask matters: the teacher is not the masked policy
            assert relative_gap(got[1], got[2]) > 1e-3
    assert want[3].keys() == got[3].keys() and len(want[3]) > 0
    for name in want[3]:
        assert_close(got[3][name], want[3][name], f"grad {name}", key)
    print(f"\n{policy} {mode} {backend}: max relative gap so far {GAPS[key]:.2e}")


@requires_cpu_flex
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["masked", "teacher", "dense"])
def test_packed_forward_flex_float32(model_dir, rollouts, mode):
    """FlexAttention (float32 only on the CPU) on the packed row, its block mask built from the packed evict_at,
    against the padded sdpa reference in float32: the loss and every gradient within the float32 bound of the
    model's reduction chain."""
    ids, evict_at, pids, pev, prompt_lens, resp_lens = padded_and_packed(*rollouts["h2o"])
    model = load_policy(model_dir)
    weights = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    want = forward_loss(model, False, ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa")
    got = forward_loss(model, True, pids, pev, prompt_lens, resp_lens, weights, mode, "flex")
    chain = model_chain(model.config, pids.shape[1]) + ids.numel()
    assert within_float32_bound(got[0], want[0], chain)
    for name in want[3]:
        assert within_float32_bound(got[3][name], want[3][name], chain), name


# ------------------------------------------------------------------------------------------ the learner's step, float64
@pytest.fixture(scope="module")
def iterations(tmp_path_factory):
    """Per eviction policy, a rollout of 5 prompts (22 to 51 tokens) x 4 samples and its compacted masks."""
    root = tmp_path_factory.mktemp("packing-learn")
    model_dir = make_model_dir(root, "gqa")
    prompts = make_prompts(root, lengths=(30, 45, 38, 22, 51))
    out = {}
    for policy in POLICIES:
        params = make_params(**{"rollout.prompts_per_iteration": 5, "rollout.group_size": 4,
                                "rollout.batch_size": 20, "rollout.max_new_tokens": 8,
                                "rollout.eviction.policy": policy})
        out[policy] = make_iteration(root / policy, model_dir, prompts, params)
    return model_dir, out


def learner_step(model, traj, masks, teacher_model=None, **over) -> tuple[float, dict[str, torch.Tensor], dict]:
    """One optimizer step through the learner's own `train_step` / `micro_step` on one process (float64 scoring,
    the engine a plain module): (loss, every parameter's gradient, the step's record)."""
    from stages.learner import train

    params = make_params(**{"learner.shared_prompt": "false", **{f"learner.{k}": v for k, v in over.items()}})
    cfg = train.validated(params.learner).model_copy(update={"zero_stage": 0})
    data = load_learner_data(cfg, traj, masks, 2, 2, need_masks=True)
    weights = train.row_weights(data, cfg, {})
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    steps, _ = train.make_plan(data, cfg, ctx, seed=0, iteration=1)
    assert len(steps) == 1
    run = train.LearnerRun(params=params, cfg=cfg, iteration=1, policy_path=Path("policy"), ctx=ctx,
                           engine=PlainEngine(model), tokenizer=None, data=data, steps=steps, resumed=None,
                           global_step=0, temperature=params.rollout.temperature, teacher_model=teacher_model)
    if cfg.gradient_checkpointing:
        train.enable_layer_checkpointing(model)
    model.zero_grad(set_to_none=True)
    record = train.train_step(run, steps[0], weights, {}, None)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return record["loss/total"], grads, record


ARMS = {  # name: (learner overrides, a frozen teacher model)
    "smd": ({"objective": "smd"}, False),
    "smd reference teacher": ({"objective": "smd", "kl_teacher": "reference"}, True),
    "shadow": ({"objective": "shadow"}, False),
    "dense": ({"objective": "dense"}, False),
    "smd checkpointed": ({"objective": "smd", "gradient_checkpointing": "true"}, False),
}


# smd on every policy, the other arms on snapkv (the forward test above covers every policy in every mode), each
# on sdpa and tiled
STEP_CASES = [(policy, arm, backend) for backend in ("sdpa", "tiled") for policy in POLICIES for arm in ARMS
              if arm == "smd" or policy == "snapkv"]


@pytest.mark.parametrize("policy,arm,backend", STEP_CASES)
def test_learner_step_packed_equals_padded_float64(iterations, monkeypatch, policy, arm, backend):
    """The learner's step on micro-batches of 3 rows, packed and padded (and packed under a token budget of packed
    tokens: other micro-batches, the same step): the loss and every gradient within 1e-10 relative in float64 (the
    loss relative to max(|loss|, 1): without the teacher's KL it is a sum of token terms of size ~1 that cancel to
    ~1e-8); the packed step's padded tokens are its real tokens."""
    from stages.learner import train

    model_dir, its = iterations
    traj, masks = its[policy]
    monkeypatch.setattr(train, "chunked_token_scores", float64_token_scores)
    over, frozen = ARMS[arm]
    over = {**over, "micro_batch_size": 3, "attention_backend": backend}
    model = float64_policy(model_dir).eval()
    teacher = float64_policy(model_dir).eval().requires_grad_(False) if frozen else None
    want_loss, want, padded = learner_step(model, traj, masks, teacher, **over)
    key = f"learner {backend}"
    for extra in ({"pack": "true"}, {"pack": "true", "micro_batch_tokens": 170}):
        got_loss, got, packed = learner_step(model, traj, masks, teacher, **over, **extra)
        assert packed["tokens"] == padded["tokens"] == packed["padded_tokens"] < padded["padded_tokens"]
        # relative to the loss, or to 1 where the policy term of zero-mean advantages cancels below it (~1e-8)
        loss_gap = abs(got_loss - want_loss) / max(abs(want_loss), 1.0)
        GAPS[key] = max(GAPS.get(key, 0.0), loss_gap)
        assert loss_gap <= REL
        assert want.keys() == got.keys() and len(want) > 0
        for name in want:
            assert_close(got[name], want[name], f"grad {name}", key)
    print(f"\n{policy} {arm} {backend}: max relative gap so far {GAPS[key]:.2e}")


def test_packed_micro_batch_holds_real_tokens(iterations):
    """A packed micro-batch: ids [1, N] of the rows one after another and evict_at [L, 1, H, N], N their real
    tokens; the per-token tensors stay [B, R_max] as padded."""
    _, its = iterations
    traj, masks = its["h2o"]
    data = load_learner_data(make_params().learner, traj, masks, 2, 2, need_masks=True)
    rows = [3, 0, 7]
    padded = build_micro_batch(data, rows, True)
    packed = build_micro_batch(data, rows, True, pack=True)
    n = sum(data.length(r) for r in rows)
    assert packed.packed and packed.input_ids.shape == (1, n) and packed.evict_at.shape == (2, 1, 2, n)
    assert packed.num_tokens == n < padded.num_tokens
    real = torch.cat([padded.input_ids[b, : data.length(r)] for b, r in enumerate(rows)])
    assert torch.equal(packed.input_ids[0], real)
    for name in ("rollout_logp", "valid", "advantages"):
        assert torch.equal(getattr(packed, name), getattr(padded, name))


# ------------------------------------------------------------------------------------------ through DeepSpeed
def test_learn_packed(tmp_path, iterations):
    """`run_learner` (DeepSpeed, float32) packed against padded, per-sample prompts: the same update within float32
    rounding (adam_eps 1e-6: see test_learner.py's test_micro_batching_does_not_change_the_update), the parity gate
    passed on the packed rows, padded tokens = real tokens in the record."""
    from stages.learner.train import run_learner

    model_dir, its = iterations
    traj, masks = its["snapkv"]
    over = {"learner.grad_clip": 0, "learner.lr": 1e-4, "learner.adam_eps": 1e-6, "learner.micro_batch_size": 3,
            "learner.shared_prompt": "false"}
    outs = [run_learner(make_params(**over, **extra), 1, model_dir, traj, masks, tmp_path / name / "policy")
            for name, extra in (("padded", {}), ("packed", {"learner.pack": "true"}))]
    before, padded, packed = params_of(model_dir), params_of(outs[0]["policy"]), params_of(outs[1]["policy"])
    assert max_param_diff(before, padded) > 5e-5
    assert max_param_diff(padded, packed) <= 1e-6
    details = [json.loads(out["details"].read_text()) for out in outs]
    steps = [json.loads(out["steps"].read_text())[0] for out in outs]
    assert details[1]["config"]["learner"]["pack"] is True
    assert details[1]["mismatch/logprob_abs_diff_max"] <= 1e-4  # the parity gate on the packed rows
    assert steps[1]["padded_tokens"] == steps[1]["tokens"] == steps[0]["tokens"] < steps[0]["padded_tokens"]
    assert details[1]["learner/padded_token_ratio"] == 1.0


@pytest.mark.slow
def test_bench_learner_packed_arm(iterations):
    """~40 s (two learner processes): `bench learner --model DIR --group-size G` runs the packed arm beside the
    padded per-sample one, the same rows a micro-batch; the packed arm's padded / real tokens is 1, the padded
    arm's above it."""
    from stages.bench.learner_grpo import bench_learner_grpo

    model_dir = iterations[0]
    lines: list[str] = []
    rows = bench_learner_grpo(model_dir, group_size=2, prompts=3, prompt_tokens=24, response_tokens=8,
                              micro_batch_size=2, repeats=1, threads=1, arms=["smd per-sample", "smd packed"],
                              min_response_tokens=2, log=lines.append)
    assert "responses 2-8" in lines[0]  # a 4x spread of response lengths
    assert [(r["arm"], r["micro_batch_size"]) for r in rows] == [("smd per-sample", 2), ("smd packed", 2)]
    assert rows[1]["padded_ratio"] == 1.0 < rows[0]["padded_ratio"]
    assert all(r["step_s"] > 0 for r in rows)
