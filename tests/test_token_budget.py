"""Token-budget micro-batches (`learner.micro_batch_tokens`, stages/learner/token_budget.py, docs/design.md §3d):
the cut under a padded-token budget (hand-checked, and as a property), Karmarkar-Karp against an independent
reference of the largest differencing method and against brute force's optimum (its proven 4/3 - 1/(3k) bound),
the learner's plan (every row once, whole groups, each micro-batch within the budget, processes balanced by
tokens), one-line errors naming the field, and the optimizer step: loss and every gradient of the row-count and
the token-budget micro-batching (one process, and two emulated ones split by Karmarkar-Karp) agree in float64
within 1e-12 relative."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from stages.common.distributed import DistContext
from stages.learner.data import LearnerData, load_learner_data
from stages.learner.token_budget import budget_micro_batches, karmarkar_karp, padded_tokens
from tests.helpers import (
    PlainEngine,
    float64_policy,
    float64_token_scores,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    params_of,
)

REL = 1e-12  # float64: the partitions differ only in summation order


# ------------------------------------------------------------------------------------------ the cut
def test_padded_tokens():
    assert padded_tokens([5, 9, 7]) == 27 and padded_tokens([4]) == 4 and padded_tokens([]) == 0


def test_budget_cut_hand_checked():
    """Rows 10, 9, 9, 5, 5, 5, 2 under 20 padded tokens: 2 x 10, 2 x 9, then 3 x 5 (the 2 joins: 4 x 5 = 20)."""
    rows = [[10], [9], [9], [5], [5], [5], [2]]
    assert budget_micro_batches(rows, 20) == [[0, 1], [2, 3], [4, 5, 6]]
    assert budget_micro_batches(rows, 10) == [[0], [1], [2], [3, 4], [5, 6]]
    groups = [[8, 7], [6, 6], [5, 4, 3]]  # whole groups: 16, 12 and 15 padded tokens alone
    assert budget_micro_batches(groups, 16) == [[0], [1], [2]]
    assert budget_micro_batches(groups, 30) == [[0], [1, 2]]  # 4 x 8 = 32 > 30; then 5 x 6 = 30
    assert budget_micro_batches(groups, 40) == [[0, 1], [2]]
    assert budget_micro_batches([], 5) == []


def test_budget_cut_property():
    """Random lengths, longest first: every micro-batch within the budget, the items in order, each once; a
    micro-batch closes only when the next item would cross the budget."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        units = [sorted(rng.integers(1, 60, size=int(rng.integers(1, 5))).tolist(), reverse=True)
                 for _ in range(int(rng.integers(1, 15)))]
        units.sort(key=lambda u: -u[0])
        budget = max(padded_tokens(u) for u in units) + int(rng.integers(0, 200))
        cuts = budget_micro_batches(units, budget)
        assert [i for cut in cuts for i in cut] == list(range(len(units)))
        for a, b in itertools.pairwise(cuts):
            assert padded_tokens([n for i in a for n in units[i]]) <= budget
            assert padded_tokens([n for i in [*a, b[0]] for n in units[i]]) > budget
        assert padded_tokens([n for i in cuts[-1] for n in units[i]]) <= budget


def test_budget_below_one_unit_is_one_line():
    with pytest.raises(SmdInputError) as err:
        budget_micro_batches([[8, 7], [6, 6]], 12, "a GRPO group (learner.shared_prompt)")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("learner.micro_batch_tokens=12: a GRPO group")
    assert "16 padded tokens (2 rows x 8)" in msg and "at least 16" in msg
    with pytest.raises(SmdInputError, match=r"learner.micro_batch_tokens=0: .* must be >= 1"):
        budget_micro_batches([[3]], 0)


# ------------------------------------------------------------------------------------------ Karmarkar-Karp
def reference_ldm(weights: list[int], k: int) -> list[tuple[int, frozenset[int]]]:
    """The largest differencing method as its textbook statement reads (Karmarkar & Karp 1982; Wikipedia's "Largest
    differencing method", k-way): a list of k-tuples, each weight as (x, 0, ..., 0); repeatedly take the two tuples
    of largest max - min, join the largest of one with the smallest of the other (and so on), sort; no heap, no
    tie rule (inputs here have no ties). Returns the final (sum, indices) parts."""
    states = [sorted([(w, frozenset([i]))] + [(0, frozenset())] * (k - 1), key=lambda s: -s[0])
              for i, w in enumerate(weights)]
    while len(states) > 1:
        states.sort(key=lambda st: st[0][0] - st[-1][0], reverse=True)
        a, b = states[0], states[1]
        joined = [(a[j][0] + b[k - 1 - j][0], a[j][1] | b[k - 1 - j][1]) for j in range(k)]
        states = [sorted(joined, key=lambda s: -s[0])] + states[2:]
    return states[0]


def optimal_largest_part(weights: list[int], k: int) -> int:
    """Brute force: the smallest possible largest part sum over all k^n assignments."""
    best = sum(weights)
    for assign in itertools.product(range(k), repeat=len(weights)):
        sums = [0] * k
        for w, p in zip(weights, assign):
            sums[p] += w
        best = min(best, max(sums))
    return best


def test_karmarkar_karp_hand_checked():
    """{8, 7, 6, 5, 4} in two: 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2: parts 16 and 14 (the optimum is 15/15,
    Wikipedia's example of the method's gap)."""
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert [sum([8, 7, 6, 5, 4][i] for i in p) for p in parts] == [16, 14]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    assert karmarkar_karp([5], 3) == [[0], [], []]  # fewer weights than parts: empty parts
    assert karmarkar_karp([], 2) == [[], []]
    assert karmarkar_karp([3, 1, 2], 1) == [[0, 1, 2]]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_karmarkar_karp_equals_the_reference(k):
    """The same parts as the independent textbook implementation on random tie-free inputs (weights up to 1e9),
    every index once, parts in decreasing sum; the same call twice gives the same split."""
    rng = np.random.default_rng(k)
    for _ in range(60):
        weights = rng.integers(1, 10**9, size=int(rng.integers(1, 13))).tolist()
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
        sums = [sum(weights[i] for i in p) for p in parts]
        assert sums == sorted(sums, reverse=True)
        assert [(s, frozenset(p)) for s, p in zip(sums, parts)] == reference_ldm(weights, k)
        assert karmarkar_karp(weights, k) == parts


@pytest.mark.parametrize("k", [2, 3])
def test_karmarkar_karp_within_its_bound_of_brute_force(k):
    """Small inputs against brute force: the largest part is within the method's proven worst-case ratio to the
    optimum, 4/3 - 1/(3k) (7/6 for two parts: Fischetti & Martello 1987; k-way: Michiels et al. 2012), and equals
    it on most inputs."""
    rng = np.random.default_rng(10 + k)
    exact = 0
    for _ in range(120):
        weights = rng.integers(1, 50, size=int(rng.integers(k, 9))).tolist()
        got = max(sum(weights[i] for i in p) for p in karmarkar_karp(weights, k))
        best = optimal_largest_part(weights, k)
        assert best <= got <= (4 / 3 - 1 / (3 * k)) * best + 1e-9, (weights, got, best)
        exact += got == best
    assert exact >= 0.6 * 120


# ------------------------------------------------------------------------------------------ the learner's plan
def in_memory_data(prompt_lens: list[int], resp_lens: list[list[int]]) -> LearnerData:
    """A batch of groups (one prompt each, its responses of `resp_lens[g]` tokens) without files: the plan only
    reads lengths and groups."""
    prompts, responses, groups = [], [], []
    for g, (p, lens) in enumerate(zip(prompt_lens, resp_lens)):
        for n in lens:
            prompts.append([5] * p)
            responses.append([6] * n)
            groups.append(g)
    n_rows = len(prompts)
    return LearnerData(trajectories_path=Path("trajectories.arrow"), masks_path=None,
                       trajectory_ids=[f"t{i}" for i in range(n_rows)], prompt_ids=prompts, response_ids=responses,
                       rollout_logprobs=[np.zeros(len(r), dtype=np.float32) for r in responses],
                       rewards=np.zeros(n_rows), advantages=np.ones(n_rows), mask_rows=np.arange(n_rows),
                       groups=np.asarray(groups, dtype=np.int64))


def plans(data: LearnerData, world: int, **over):
    from stages.learner.train import make_plan, validated

    cfg = validated(make_params(**{f"learner.{k}": v for k, v in over.items()}).learner)
    out = []
    for rank in range(world):
        ctx = DistContext(rank=rank, world=world, local_rank=0, device=torch.device("cpu"))
        out.append(make_plan(data, cfg, ctx, seed=0, iteration=1))
    return out


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_under_a_token_budget(shared, world):
    """Every row once over the processes' real micro-batches, each within the budget; with shared prompts a group
    in one micro-batch; every process runs the same number of micro-batches; the processes' rows are
    Karmarkar-Karp's split of the units' tokens (a group's prompt once with shared prompts)."""
    from stages.learner.train import process_rows, scheduled_units, unit_tokens

    rng = np.random.default_rng(world)
    data = in_memory_data([30, 45, 38, 12, 60, 25, 33], [rng.integers(2, 40, size=4).tolist() for _ in range(7)])
    budget = 420  # the longest group: 4 x 99 = 396
    result = plans(data, world, shared_prompt=shared, micro_batch_tokens=budget, updates_per_epoch=2)
    assert len({accum for _, accum in result}) == 1
    accum = result[0][1]
    for s in range(2):  # two mini-batches
        rows = result[0][0][s].rows
        seen: list[int] = []
        for rank, (steps, _) in enumerate(result):
            step = steps[s]
            assert len(step.micro) == accum
            real = [m for m, ok in step.micro if ok]
            for m in real:
                assert padded_tokens([data.length(r) for r in m]) <= budget
            if shared:
                for m in real:  # whole groups: each group of the micro-batch with all its rows of the mini-batch
                    for g in {int(data.groups[r]) for r in m}:
                        assert {r for r in rows if data.groups[r] == g} <= set(m)
            mine = [r for m in real for r in m]
            assert sorted(mine) == process_rows(data, rows, rank, world, shared, balance=True)
            seen += mine
        assert sorted(seen) == rows
        units = scheduled_units(data, rows, shared)
        tokens = [unit_tokens(data, u, shared) for u in units]
        parts = karmarkar_karp(tokens, world)
        for rank, (steps, _) in enumerate(result):
            mine = {r for m, ok in steps[s].micro if ok for r in m}
            assert mine == {r for i in parts[rank] for r in units[i]}


def test_no_budget_keeps_the_row_count_plan():
    """null and 0 are the row-count micro-batches of before (round-robin processes)."""
    data = in_memory_data([30, 45, 38], [[3, 9, 4, 7], [5, 5, 2, 8], [1, 6, 6, 3]])
    for shared in (True, False):
        for world in (1, 2):
            base = plans(data, world, shared_prompt=shared, micro_batch_size=3)
            for off in (0, None):
                got = plans(data, world, shared_prompt=shared, micro_batch_size=3,
                            micro_batch_tokens="null" if off is None else off)
                assert [([s.micro for s in steps], a) for steps, a in got] == \
                       [([s.micro for s in steps], a) for steps, a in base]


def test_plan_budget_below_a_group_is_one_line():
    data = in_memory_data([30, 45], [[3, 9, 4, 7], [5, 5, 2, 8]])  # the 45-token group: 4 x 53 = 212
    with pytest.raises(SmdInputError) as err:
        plans(data, 1, shared_prompt=True, micro_batch_tokens=200)
    assert str(err.value) == ("learner.micro_batch_tokens=200: a GRPO group (learner.shared_prompt) needs 212 "
                              "padded tokens (4 rows x 53); set it to at least 212")
    plans(data, 1, shared_prompt=False, micro_batch_tokens=60)  # per row: 53 fits
    with pytest.raises(SmdInputError, match=r"^learner.micro_batch_tokens=50: a row needs 53 padded tokens"):
        plans(data, 1, shared_prompt=False, micro_batch_tokens=50)


# ------------------------------------------------------------------------------------------ the same step in float64
@pytest.fixture(scope="module")
def iteration(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-budget")
    model_dir = make_model_dir(root, "gqa")
    prompts = make_prompts(root, lengths=(30, 45, 38, 22, 51))
    params = make_params(**{"rollout.prompts_per_iteration": 5, "rollout.group_size": 4, "rollout.batch_size": 20,
                            "rollout.max_new_tokens": 8})
    traj, masks = make_iteration(root, model_dir, prompts, params)
    return model_dir, traj, masks


def budget_of(data: LearnerData, shared: bool) -> int:
    """A budget that cuts `data` otherwise than 3 rows do. Shared: room for the largest group and for the two
    smallest together; per row: 4 of the longest rows, more of the shorter."""
    from stages.learner.train import scheduled_units

    units = scheduled_units(data, list(range(len(data))), shared)
    costs = [padded_tokens([data.length(r) for r in u]) for u in units]
    if not shared:
        return 4 * max(costs)
    return max(max(costs), padded_tokens([data.length(r) for u in units[-2:] for r in u]))


def float64_step(model, traj, masks, world: int, **over) -> tuple[float, dict[str, torch.Tensor], list]:
    """One optimizer step's loss and every parameter's gradient, through the learner's own `micro_step` and its
    weights (`train_step` on one process; on `world` emulated processes each rank's plan in turn, every backward
    scaled by the world as the learner does and the sum averaged as DeepSpeed's all-reduce does). Returns (loss,
    gradients, the real micro-batches)."""
    from stages.learner import train

    params = make_params(**{f"learner.{k}": v for k, v in over.items()})
    cfg = train.validated(params.learner).model_copy(update={"attention_backend": "sdpa", "zero_stage": 0})
    data = load_learner_data(cfg, traj, masks, 2, 2, need_masks=True)
    weights = train.row_weights(data, cfg, {})
    model.zero_grad(set_to_none=True)
    loss, micro = 0.0, []
    for rank in range(world):
        ctx = DistContext(rank=rank, world=world, local_rank=0, device=torch.device("cpu"))
        steps, _ = train.make_plan(data, cfg, ctx, seed=0, iteration=1)
        assert len(steps) == 1
        run = train.LearnerRun(params=params, cfg=cfg, iteration=1, policy_path=Path("policy"), ctx=ctx,
                               engine=PlainEngine(model), tokenizer=None, data=data, steps=steps, resumed=None,
                               global_step=0, temperature=params.rollout.temperature)
        micro += [m for m, real in steps[0].micro if real]
        if world == 1:
            loss = train.train_step(run, steps[0], weights, {}, None)["loss/total"]
            continue
        total = float(weights.denom[steps[0].rows].sum())
        for rows, real in steps[0].micro:
            weight = float(weights.denom[rows].sum()) / total if real else 0.0
            terms = train.micro_step(run, rows, weight, {}, None, weights)[0]
            loss += weight * terms["loss/total"]
    grads = {n: p.grad.detach().clone() / world for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, micro


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


@pytest.mark.parametrize("objective,shared,loss_agg,world", [
    ("smd", True, "token_mean", 1),
    ("smd", False, "token_mean", 1),
    ("smd", True, "seq_mean_token_mean", 2),
    ("dense", False, "seq_mean_token_sum", 2),
])
def test_token_budget_takes_the_same_step_float64(iteration, monkeypatch, objective, shared, loss_agg, world):
    """The row-count micro-batching (3 rows: groups of 4 split) on one process against token-budget micro-batches
    (whole groups with shared prompts) on `world` processes split by Karmarkar-Karp: the same loss and every
    gradient within 1e-12 relative in float64."""
    from stages.learner import train

    model_dir, traj, masks = iteration
    monkeypatch.setattr(train, "chunked_token_scores", float64_token_scores)
    model = float64_policy(model_dir).eval()
    common = {"objective": objective, "shared_prompt": shared, "loss_agg": loss_agg, "micro_batch_size": 3}
    data = load_learner_data(make_params().learner, traj, masks, 2, 2, need_masks=True)
    budget = budget_of(data, shared)
    want_loss, want, rows_plan = float64_step(model, traj, masks, 1, **common)
    got_loss, got, budget_plan = float64_step(model, traj, masks, world, **common, micro_batch_tokens=budget)
    assert sorted(map(sorted, rows_plan)) != sorted(map(sorted, budget_plan))  # another partition
    assert any(len(m) > 4 for m in budget_plan)  # several groups (shared) / more than 3 rows in one
    assert all(padded_tokens([data.length(r) for r in m]) <= budget for m in budget_plan)
    assert want.keys() == got.keys() and len(want) > 0
    gaps = {name: relative_gap(got[name], want[name]) for name in want}
    loss_gap = abs(got_loss - want_loss) / abs(want_loss)
    print(f"\n{objective} shared={shared} {loss_agg} world={world}: budget {budget}, "
          f"{len(rows_plan)} -> {len(budget_plan)} micro-batches; loss rel gap {loss_gap:.2e}, "
          f"max gradient rel gap {max(gaps.values()):.2e} ({max(gaps, key=gaps.get)})")
    assert loss_gap <= REL
    assert max(gaps.values()) <= REL, gaps


def test_learn_with_a_token_budget(tmp_path, iteration):
    """Through `run_learner` and DeepSpeed (float32, shared prompts): the token-budget step equals the row-count
    one within float32 rounding (adam_eps 1e-6: see test_learner.py's test_micro_batching_does_not_change_the_update),
    and the record gives each step's padded tokens and the learn call's padded / real ratio."""
    from stages.learner.train import run_learner

    model_dir, traj, masks = iteration
    data = load_learner_data(make_params().learner, traj, masks, 2, 2, need_masks=True)
    over = {"learner.grad_clip": 0, "learner.lr": 1e-4, "learner.adam_eps": 1e-6, "learner.micro_batch_size": 3}
    budget = budget_of(data, True)
    outs = [run_learner(make_params(**over, **extra), 1, model_dir, traj, masks, tmp_path / name / "policy")
            for name, extra in (("rows", {}), ("tokens", {"learner.micro_batch_tokens": budget}))]
    before, rows, tokens = params_of(model_dir), params_of(outs[0]["policy"]), params_of(outs[1]["policy"])
    assert max_param_diff(before, rows) > 5e-5
    assert max_param_diff(rows, tokens) <= 1e-6
    details = [json.loads(out["details"].read_text()) for out in outs]
    steps = [json.loads(out["steps"].read_text())[0] for out in outs]
    assert details[1]["config"]["learner"]["micro_batch_tokens"] == budget
    assert steps[0]["tokens"] == steps[1]["tokens"] == sum(data.length(r) for r in range(len(data)))
    for d, s in zip(details, steps):
        assert s["padded_tokens"] >= s["tokens"]
        assert d["learner/padded_token_ratio"] == pytest.approx(s["padded_tokens"] / s["tokens"])


@pytest.mark.slow
def test_bench_learner_token_budget_arm(iteration):
    """~40 s (two learner processes): `bench learner --model DIR --group-size G` runs the token-budget arm beside the
    row-count one and prints each arm's padded / real tokens."""
    from stages.bench.learner_grpo import bench_learner_grpo

    model_dir = iteration[0]
    lines: list[str] = []
    rows = bench_learner_grpo(model_dir, group_size=2, prompts=3, prompt_tokens=24, response_tokens=8,
                              micro_batch_size=2, repeats=1, threads=1, arms=["smd shared", "smd token budget"],
                              log=lines.append)
    assert [(r["arm"], r["micro_batch_tokens"]) for r in rows] == [("smd shared", None), ("smd token budget", 64)]
    assert all(r["padded_ratio"] >= 1 and r["step_s"] > 0 for r in rows)
    assert any("token budget 64" in line for line in lines)
    assert "padded/real" in next(line for line in lines if line.startswith("| arm"))
