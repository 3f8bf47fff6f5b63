"""`learner.kl_teacher` (issue 22 item 5): whose dense forward is smd's teacher. The chunked scoring through a separate
teacher head against full-logit autograd (values and gradients, none into the teacher), the same head given twice
equal to the default bit for bit, the learner stage's KL against an independent float64 computation with a frozen
teacher, a teacher equal to the policy matching the paper's teacher, and one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.learner import KL_TEACHERS
from stages.common.model import load_policy
from stages.learner.data import build_micro_batch, load_learner_data
from stages.learner.ema import EMA_FILE, ema_update_
from stages.learner.logprobs import chunked_token_scores
from stages.learner.shadow_attention import response_logits
from stages.learner.train import run_learner
from tests.helpers import (
    float32_bound,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    model_chain,
    params_of,
    within_float32_bound,
)

T = 0.8


def _heads(seed: int, v: int = 13, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    policy, teacher = torch.nn.Linear(d, v), torch.nn.Linear(d, v)
    with torch.no_grad():
        for lin in (policy, teacher):
            lin.weight.copy_(torch.randn(v, d, generator=g))
            lin.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(3, 5, d, generator=g, requires_grad=True)
    teacher_hidden = torch.randn(3, 5, d, generator=g)
    targets = torch.randint(0, v, (3, 5), generator=g)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 3:] = False
    valid[2, 1:] = False
    coef = torch.randn(2, 3, 5, generator=g)  # d loss / d logp, d loss / d kl
    return policy, teacher, hidden, teacher_hidden, targets, valid, coef


def test_separate_teacher_head_matches_full_logit_autograd():
    """logp, KL(softmax(teacher logits / T) || softmax(policy logits / T)) and their gradients into the policy's hidden
    states and head, through a teacher head with other weights, equal plain autograd on full logits; the teacher
    head gets no gradient."""
    policy, teacher, hidden, teacher_hidden, targets, valid, coef = _heads(0)
    out = chunked_token_scores(hidden, policy, targets, valid, temperature=T, chunk_tokens=2,
                               teacher_hidden=teacher_hidden, teacher_head=teacher)
    (coef[0] * out["logp"] + coef[1] * out["kl"]).sum().backward()
    got = (out["logp"].detach(), out["kl"].detach(), hidden.grad.clone(), policy.weight.grad.clone(),
           policy.bias.grad.clone())
    assert teacher.weight.grad is None and teacher.bias.grad is None

    # reference: float64 autograd on the full [B, R, V] logits, the teacher's from its own head
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = policy.weight.detach().double().requires_grad_(True)
    b64 = policy.bias.detach().double().requires_grad_(True)
    log_q = torch.log_softmax((h64 @ w64.T + b64) / T, -1)
    log_p = torch.log_softmax((teacher_hidden.double() @ teacher.weight.detach().double().T
                               + teacher.bias.detach().double()) / T, -1)
    logp = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * valid
    kl = (log_p.exp() * (log_p - log_q)).sum(-1) * valid
    (coef[0].double() * logp + coef[1].double() * kl).sum().backward()
    want = (logp.detach(), kl.detach(), h64.grad, w64.grad, b64.grad)
    reduction = hidden.shape[-1] + 2 * policy.weight.shape[0] + hidden.shape[0] * hidden.shape[1]
    for name, g, w in zip(("logp", "kl", "d hidden", "d weight", "d bias"), got, want, strict=True):
        assert within_float32_bound(g.double(), w, reduction), name
    assert float(kl.detach().abs().max()) > 0.1  # the teacher is another distribution: the check has something to see


def test_teacher_head_equal_to_the_policy_head_is_the_default_bit_for_bit():
    policy, _, hidden, teacher_hidden, targets, valid, coef = _heads(1)
    same = torch.nn.Linear(policy.in_features, policy.out_features)
    with torch.no_grad():
        same.weight.copy_(policy.weight)
        same.bias.copy_(policy.bias)
    results = []
    for head in (None, same):
        hidden.grad, policy.weight.grad, policy.bias.grad = None, None, None
        out = chunked_token_scores(hidden, policy, targets, valid, temperature=T, chunk_tokens=3,
                                   teacher_hidden=teacher_hidden, teacher_head=head)
        (coef[0] * out["logp"] + coef[1] * out["kl"]).sum().backward()
        results.append([out[k].detach() for k in ("logp", "kl", "teacher_logp", "teacher_argmax")]
                       + [hidden.grad.clone(), policy.weight.grad.clone(), policy.bias.grad.clone()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_teacher_head_refusals():
    policy, _, hidden, teacher_hidden, targets, valid, _ = _heads(2)
    other_vocab = torch.nn.Linear(policy.in_features, policy.out_features + 1)
    with pytest.raises(SmdInputError, match="teacher_head: weight shape .* does not match"):
        chunked_token_scores(hidden, policy, targets, valid, teacher_hidden=teacher_hidden, teacher_head=other_vocab)
    with pytest.raises(SmdInputError, match="teacher_head: given without teacher_hidden"):
        chunked_token_scores(hidden, policy, targets, valid, teacher_head=policy)


# ------------------------------------------------------------------------------------------ the learner stage
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kl_teacher")
    model_dir = make_model_dir(root, "gqa")
    other = make_model_dir(root / "other", "gqa", seed=1)  # another policy of the same shape: the frozen teacher
    traj, masks = make_iteration(root, model_dir, make_prompts(root), make_params())
    return root, model_dir, other, traj, masks


def _kl64(policy_dir, teacher_dir, traj, masks) -> tuple[float, int]:
    """Token mean over every response token of KL(pi_teacher dense || pi_policy shadow-masked) at temperature T, both
    models in float64 (shadow attention replaying the compacted masks); and the longest sequence."""
    params = make_params()
    policy, teacher = load_policy(policy_dir).double(), load_policy(teacher_dir).double()
    data = load_learner_data(params.learner, traj, masks, policy.config.num_hidden_layers,
                             policy.config.num_key_value_heads, need_masks=True)
    mb = build_micro_batch(data, list(range(len(data))), masked=True)
    with torch.no_grad():
        q, _, valid = response_logits(policy, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens,
                                      **mb.forward_extra())
        p, _, _ = response_logits(teacher, mb.input_ids, None, mb.prompt_lens, mb.resp_lens)
    log_q, log_p = torch.log_softmax(q / params.rollout.temperature, -1), torch.log_softmax(
        p / params.rollout.temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return float(kl[valid].mean()), int(mb.input_ids.shape[1])


def _learn(tmp_path, model_dir, traj, masks, **over):
    out = run_learner(make_params(**{"learner.objective": "smd", **over}), 1, model_dir, traj, masks,
                      tmp_path / "policy")
    return out, json.loads(out["steps"].read_text())


def test_frozen_teacher_kl_is_the_float64_kl_to_the_reference_policy(tmp_path, setup):
    _, model_dir, other, traj, masks = setup
    out, steps = _learn(tmp_path, model_dir, traj, masks, **{"learner.kl_teacher": "reference",
                                                             "learner.reference_path": str(other)})
    assert len(steps) == 1  # one optimizer step over every row: its KL term is the token mean over all of them
    assert max_param_diff(params_of(model_dir), params_of(out["policy"])) > 1e-5  # it trained
    details = json.loads(out["details"].read_text())
    assert details["config"]["learner"]["kl_teacher"] == "reference"
    want, longest = _kl64(model_dir, other, traj, masks)
    config = load_policy(model_dir).config
    assert abs(steps[0]["loss/kl_dense"] - want) <= float32_bound(model_chain(config, longest), max(1.0, want))
    # the frozen teacher's log-probs are not the current dense policy's: no dense-vs-rollout mismatch logged
    assert not any(k.startswith("dense_mismatch/") for k in steps[0])
    # and the paper's teacher (the policy itself) gives another KL
    _, current = _learn(tmp_path / "current", model_dir, traj, masks)
    assert abs(current[0]["loss/kl_dense"] - want) > 100 * float32_bound(model_chain(config, longest), 1.0)
    assert "dense_mismatch/logprob_abs_diff_mean" in current[0]


@pytest.mark.parametrize("teacher", KL_TEACHERS)
def test_teacher_equal_to_the_policy_gives_the_papers_loss(tmp_path, setup, teacher):
    """At the first step the frozen reference equal to the starting policy is the paper's teacher: the same loss terms
    (a separate dense pass instead of the shared-prefix one: float32 rounding apart)."""
    _, model_dir, _, traj, masks = setup
    _, steps = _learn(tmp_path, model_dir, traj, masks, **{"learner.kl_teacher": teacher,
                                                           "learner.reference_path": str(model_dir)})
    _, paper = _learn(tmp_path / "paper", model_dir, traj, masks)
    config = load_policy(model_dir).config
    bound = float32_bound(model_chain(config, 64), 1.0)  # 64 tokens >= the longest sequence (45 + 7)
    for key in ("loss/kl_dense", "loss/pg", "loss/total"):
        assert abs(steps[0][key] - paper[0][key]) <= bound, key
    assert steps[0]["loss/kl_dense"] > 0


def test_teacher_of_another_shape_is_refused(tmp_path, setup):
    root, model_dir, _, traj, masks = setup
    other_shape = make_model_dir(root / "mha", "mha")
    with pytest.raises(SmdInputError, match=r"config.json: hidden_size 48 does not match the policy's 64"):
        _learn(tmp_path, model_dir, traj, masks, **{"learner.kl_teacher": "reference",
                                                    "learner.reference_path": str(other_shape)})
    assert not (tmp_path / "policy").exists()  # nothing written


def test_missing_teacher_is_refused(tmp_path, setup):
    _, model_dir, _, traj, masks = setup
    with pytest.raises(SmdInputError, match="no policy checkpoint"):
        _learn(tmp_path, model_dir, traj, masks, **{"learner.kl_teacher": "reference",
                                                    "learner.reference_path": str(tmp_path / "nowhere")})


def test_bad_kl_teacher_value_names_the_field():
    with pytest.raises(Exception, match="kl_teacher"):
        make_params(**{"learner.kl_teacher": "slow"})


def test_report_tells_the_teacher_arms_apart():
    from stages.tools.report import _series_label

    base = {"objective": "smd", "policy": "snapkv", "keep_ratio": 0.5, "kl_lambda": 0.1}
    assert _series_label(base) == _series_label({**base, "kl_teacher": "current"}) == "smd λ0.1 / snapkv @ 0.5"
    assert _series_label({**base, "kl_teacher": "reference"}) == "smd λ0.1 teacher:reference / snapkv @ 0.5"
    assert _series_label({**base, "kl_teacher": "ema"}) == "smd λ0.1 teacher:ema / snapkv @ 0.5"
    released = {**base, "objective": "smd_released"}
    assert _series_label(released) == _series_label({**released, "eviction_apply": True}) == \
        "smd_released λ0.1 / snapkv @ 0.5"
    assert _series_label({**released, "eviction_apply": False}) == "smd_released λ0.1 / snapkv simulated @ 0.5"


# ------------------------------------------------------------------------------------------ the EMA teacher
def test_ema_update_against_a_hand_computation():
    """ema <- d * ema + (1 - d) * policy, parameter by parameter, in float64 by hand; shared (tied) weights once."""
    torch.manual_seed(0)
    policy, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    before = {n: p.detach().double().clone() for n, p in ema.named_parameters()}
    ema_update_(ema, policy, 0.9)
    for name, p in ema.named_parameters():
        want = 0.9 * before[name] + 0.1 * dict(policy.named_parameters())[name].detach().double()
        assert torch.allclose(p.detach().double(), want, rtol=1e-6, atol=1e-7), name
    ema_update_(ema, policy, 0.0)  # decay 0: the policy itself
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), policy.parameters()))
    with pytest.raises(SmdInputError, match="ema_decay must be in"):
        ema_update_(ema, policy, 1.0)
    with pytest.raises(SmdInputError, match="do not match"):
        ema_update_(ema, torch.nn.Linear(4, 3, bias=False), 0.5)


def _ema_dir(policy_dir, ema_file, out):
    """A policy directory holding the saved EMA's weights (to score it as a model)."""
    from safetensors.torch import load_file

    model = load_policy(policy_dir)
    saved = load_file(str(ema_file))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[name])
    model.save_pretrained(out)
    return out


def test_ema_teacher_chain_hand_computed_resumed_bit_for_bit_and_teaching(tmp_path, setup):
    """Iteration 1 starts the average from the policy (its KL is the paper's at the first step) and saves
    d * theta_0 + (1 - d) * theta_1 with the new policy; iteration 2 loads it: its KL is the float64 KL of that
    saved average (dense) to the policy (masked), its new average d * ema_1 + (1 - d) * theta_2; running iteration
    2 again from the same checkpoint gives the same bytes (the chain resumes exactly)."""
    from safetensors.torch import load_file

    root, model_dir, _, traj, masks = setup
    d = 0.8
    over = {"learner.objective": "smd", "learner.kl_teacher": "ema", "learner.ema_decay": d}
    params = make_params(**over)
    out1 = run_learner(params, 1, model_dir, traj, masks, tmp_path / "p1")
    ema1 = out1["policy"] / "trainer_state" / EMA_FILE
    theta0, theta1, e1 = params_of(model_dir), params_of(out1["policy"]), load_file(str(ema1))
    assert max_param_diff(theta0, theta1) > 1e-5
    for name, value in e1.items():  # every trainable parameter (tied head: one entry)
        want = d * theta0[name].double() + (1 - d) * theta1[name].double()
        assert torch.allclose(value.double(), want, rtol=0, atol=1e-7), name
    _, paper = _learn(tmp_path / "paper", model_dir, traj, masks)
    steps1 = json.loads(out1["steps"].read_text())
    config = load_policy(model_dir).config
    assert steps1[0]["loss/kl_dense"] == pytest.approx(paper[0]["loss/kl_dense"],
                                                       abs=float32_bound(model_chain(config, 64), 1.0))

    traj2, masks2 = make_iteration(root, out1["policy"], make_prompts(root / "p2", seed=2), params, name="ema-it2")
    runs = [run_learner(params, 2, out1["policy"], traj2, masks2, tmp_path / f"p2-{i}") for i in range(2)]
    steps2 = json.loads(runs[0]["steps"].read_text())
    want, longest = _kl64(out1["policy"], _ema_dir(model_dir, ema1, tmp_path / "ema1"), traj2, masks2)
    bound = float32_bound(model_chain(config, longest), max(1.0, want))
    assert abs(steps2[0]["loss/kl_dense"] - want) <= bound
    # power: the KL to the policy itself (the paper's teacher at iteration 2) is another number
    assert abs(_kl64(out1["policy"], out1["policy"], traj2, masks2)[0] - want) > bound
    theta2, e2 = params_of(runs[0]["policy"]), load_file(str(runs[0]["policy"] / "trainer_state" / EMA_FILE))
    for name, value in e2.items():
        want2 = d * e1[name].double() + (1 - d) * theta2[name].double()
        assert torch.allclose(value.double(), want2, rtol=0, atol=1e-7), name
    again = runs[1]["policy"] / "trainer_state" / EMA_FILE
    assert again.read_bytes() == (runs[0]["policy"] / "trainer_state" / EMA_FILE).read_bytes()
    assert (runs[1]["policy"] / "model.safetensors").read_bytes() == \
        (runs[0]["policy"] / "model.safetensors").read_bytes()


def test_ema_teacher_refusals(tmp_path, setup):
    _, model_dir, _, traj, masks = setup
    with pytest.raises(SmdInputError, match="kl_teacher=ema: model.dtype bfloat16"):
        run_learner(make_params(**{"learner.objective": "smd", "learner.kl_teacher": "ema",
                                   "model.dtype": "bfloat16"}), 1, model_dir, traj, masks, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    with pytest.raises(Exception, match="ema_decay"):
        make_params(**{"learner.ema_decay": 1.0})
