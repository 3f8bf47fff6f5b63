"""`learner.kl_tokens` (issue 22 item 5): where smd's dense-teacher KL applies. Hand-checked masks (all, no_eos,
keyed), `all` equal to the paper's objective exactly, `keyed` with every token keyed equal to `all`, the KL term
against an independent float64 computation over the selected tokens, the teacher's argmax from the chunked
scoring, and the learner stage for each option (it trains and logs kl/token_fraction)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.learner import KL_TOKENS, LearnerParams
from schemas.tables import read_table
from stages.common.model import load_policy, load_tokenizer
from stages.learner.data import build_micro_batch, load_learner_data
from stages.learner.kl_tokens import induction_keys, keyed_tokens, kl_token_mask
from stages.learner.logprobs import chunked_token_scores
from stages.learner.objectives import (
    KL_TOKEN_FRACTION,
    ObjectiveBatch,
    dense_teacher_kl_per_token,
    objective_loss,
    token_logprobs,
)
from stages.learner.shadow_attention import response_logits
from stages.learner.train import run_learner
from tests.helpers import INDUCTION_PROMPT as PROMPT
from tests.helpers import INDUCTION_RESPONSE as RESPONSE
from tests.helpers import (
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    params_of,
)

# PROMPT / RESPONSE (tests/helpers.py): sampled keys at t = 1 (k=2) and t = 4 (k=5); t = 7 is a wrong hop whose
# needed fact is at k=6.
EOS = 7


# ------------------------------------------------------------------------------------------ the masks
def test_masks_hand_checked():
    teacher = [10, 30, 3, 11, 12, 3, 12, 1]  # the teacher would go "12 1" at t = 7 (a key: k=6); 30 after 10: k=11
    assert keyed_tokens(PROMPT, RESPONSE, teacher).tolist() == [False, True, False, False, True, False, False, True]
    # the teacher agreeing with the sample adds nothing: the sampled keys only
    assert keyed_tokens(PROMPT, RESPONSE, RESPONSE).tolist() == (induction_keys(PROMPT, RESPONSE) >= 0).tolist()
    # ambiguous ("1 20" twice) is no key, for the sample and the teacher alike
    assert keyed_tokens([1, 20, 5, 1, 20, 7], [20], [20]).tolist() == [False]

    prompts = [PROMPT, [4, 5, 6]]
    responses = [RESPONSE, [5, 6, EOS]]  # right-padded to width 9
    argmax = torch.tensor([teacher + [0], [6, 9, 9, 0, 0, 0, 0, 0, 0]])  # row 2's teacher: no key anywhere
    keyed = kl_token_mask("keyed", prompts, responses, 9, teacher_argmax=argmax)
    assert keyed.tolist() == [[False, True, False, False, True, False, False, True, False],
                              # 5 after 6 (the prompt's last): no "6 5"; 6 after 5: k=2; EOS after 6: none
                              [False, True, False, False, False, False, False, False, False]]
    no_eos = kl_token_mask("no_eos", prompts, responses, 9, eos_token_id=EOS)
    assert no_eos.tolist() == [[True] * 8 + [False], [True, True, False] + [False] * 6]
    everything = kl_token_mask("all", prompts, responses, 9)
    assert everything.tolist() == [[True] * 8 + [False], [True] * 3 + [False] * 6]
    assert everything.dtype == torch.bool and everything.device.type == "cpu"


def test_masks_refuse_what_they_cannot_build():
    with pytest.raises(SmdInputError, match="unknown learner.kl_tokens 'eos'"):
        kl_token_mask("eos", [PROMPT], [RESPONSE], 8)
    with pytest.raises(SmdInputError, match="no_eos: the tokenizer has no eos_token_id"):
        kl_token_mask("no_eos", [PROMPT], [RESPONSE], 8)
    with pytest.raises(SmdInputError, match="keyed needs the dense teacher's argmax"):
        kl_token_mask("keyed", [PROMPT], [RESPONSE], 8)
    assert LearnerParams().kl_tokens == "all" and set(KL_TOKENS) == {"all", "keyed", "no_eos"}
    with pytest.raises(ValueError):
        LearnerParams(kl_tokens="eos")


# ------------------------------------------------------------------------------------------ the objective
def _batch(seed: int = 0, b: int = 3, t: int = 6, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    masked_logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    dense_logits = torch.randn(b, t, v, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    lens = [6, 4, 2]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, :n] = True
    rollout = token_logprobs(masked_logits.detach(), tokens, 0.8) + 0.05 * torch.randn(b, t, generator=g)
    return masked_logits, dense_logits, tokens, mask, rollout


def _smd(masked_logits, dense_logits, tokens, mask, rollout, kl_mask, loss_agg="token_mean", lam=0.3):
    params = LearnerParams(objective="smd", kl_lambda=lam, loss_agg=loss_agg)
    kl = dense_teacher_kl_per_token(masked_logits, dense_logits, 0.8)
    batch = ObjectiveBatch(advantages=torch.tensor([1.0, -0.5, 0.25]), mask=mask, rollout_logp=rollout,
                           masked_logp=token_logprobs(masked_logits, tokens, 0.8), kl_per_token=kl, kl_mask=kl_mask)
    masked_logits.grad = None
    total, terms = objective_loss(params, batch)
    total.backward()
    return total.detach(), terms, masked_logits.grad.clone()


def _kl64(masked_logits, dense_logits, selected: np.ndarray, loss_agg: str) -> float:
    """KL(p_dense || p_masked) at temperature 0.8 in float64 numpy, aggregated over the selected tokens."""
    def log_softmax(z):
        z = z / 0.8
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    log_q = log_softmax(masked_logits.detach().double().numpy())
    log_p = log_softmax(dense_logits.double().numpy())
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    if loss_agg == "token_mean":
        return float(kl[selected].sum() / max(selected.sum(), 1))
    rows = [kl[i][selected[i]] for i in range(len(kl)) if selected[i].any()]
    return float(np.mean([r.mean() for r in rows])) if rows else 0.0


def test_all_equals_the_papers_objective_exactly():
    """kl_mask = the valid tokens (what the learner passes for `all`) gives the objective without a mask, bit for bit."""
    masked_logits, dense_logits, tokens, mask, rollout = _batch()
    ref_total, ref_terms, ref_grad = _smd(masked_logits, dense_logits, tokens, mask, rollout, None)
    total, terms, grad = _smd(masked_logits, dense_logits, tokens, mask, rollout, mask.clone())
    assert torch.equal(total, ref_total) and terms == ref_terms and torch.equal(grad, ref_grad)


def test_keyed_with_every_token_keyed_equals_all():
    # every response token copies the next prompt bigram: "5 6", "6 7", "7 8", "8 9" (the prompt ends with 5)
    prompt, response = [5, 6, 7, 8, 9, 5], [6, 7, 8, 9]
    keyed = kl_token_mask("keyed", [prompt] * 3, [response, response[:2], response[:1]], 6,
                          teacher_argmax=torch.zeros(3, 6, dtype=torch.long))
    masked_logits, dense_logits, tokens, mask, rollout = _batch()
    mask = torch.zeros_like(mask)
    mask[0, :4], mask[1, :2], mask[2, :1] = True, True, True
    assert torch.equal(keyed, mask)
    ref = _smd(masked_logits, dense_logits, tokens, mask, rollout, kl_token_mask("all", [prompt] * 3,
               [response, response[:2], response[:1]], 6))
    got = _smd(masked_logits, dense_logits, tokens, mask, rollout, keyed)
    assert torch.equal(got[0], ref[0]) and got[1] == ref[1] and torch.equal(got[2], ref[2])


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_kl_term_is_the_float64_kl_over_the_selected_tokens(loss_agg):
    masked_logits, dense_logits, tokens, mask, rollout = _batch(seed=3)
    kl_mask = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    selected = (mask & kl_mask).numpy()  # [2, 2, 0] tokens: the padding position of row 2 is not selected
    assert selected.sum(1).tolist() == [4, 2, 0]
    total, terms, grad = _smd(masked_logits, dense_logits, tokens, mask, rollout, kl_mask, loss_agg)
    assert terms["loss/kl_dense"] == pytest.approx(_kl64(masked_logits, dense_logits, selected, loss_agg), rel=1e-6)
    assert terms["loss/total"] == pytest.approx(terms["loss/pg"] + 0.3 * terms["loss/kl_dense"], rel=1e-6)
    # the policy term is the paper's: the same as with the KL on every token
    assert terms["loss/pg"] == _smd(masked_logits, dense_logits, tokens, mask, rollout, None, loss_agg)[1]["loss/pg"]
    # no KL gradient where the KL does not apply (row 2 has no selected token; its gradient is the policy term's)
    _, _, grad_pg = _smd(masked_logits, dense_logits, tokens, mask, rollout, kl_mask, loss_agg, lam=0.0)
    assert torch.equal(grad[2], grad_pg[2]) and not torch.allclose(grad[0], grad_pg[0])


def test_no_selected_token_gives_a_zero_kl_term():
    masked_logits, dense_logits, tokens, mask, rollout = _batch(seed=4)
    total, terms, grad = _smd(masked_logits, dense_logits, tokens, mask, rollout, torch.zeros_like(mask))
    _, pg_terms, grad_pg = _smd(masked_logits, dense_logits, tokens, mask, rollout, None, lam=0.0)
    assert terms["loss/kl_dense"] == 0.0 and terms["loss/total"] == pg_terms["loss/total"]
    assert torch.equal(grad, grad_pg)


# ------------------------------------------------------------------------------------------ the teacher's argmax
def test_chunked_scoring_returns_the_teachers_argmax():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 29, bias=False)
    hidden, teacher = torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    valid = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    targets = torch.randint(0, 29, (2, 7), generator=g)
    out = chunked_token_scores(hidden, head, targets, valid, temperature=0.7, chunk_tokens=3, teacher_hidden=teacher)
    want = torch.where(valid, head(teacher).argmax(-1), torch.zeros((), dtype=torch.long))
    assert out["teacher_argmax"].dtype == torch.long and torch.equal(out["teacher_argmax"], want)
    assert "teacher_argmax" not in chunked_token_scores(hidden, head, targets, valid, chunk_tokens=3)


# ------------------------------------------------------------------------------------------ the learner stage
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kl_tokens")
    model_dir = make_model_dir(root, "gqa")
    traj, masks = make_iteration(root, model_dir, make_prompts(root), make_params())
    return root, model_dir, traj, masks


def _expected_fraction(kind: str, model_dir, traj, masks) -> float:
    """kl/token_fraction computed independently: EOS from the table's tokens; keyed from the dense model's full
    logits (the teacher) at every response position."""
    params = make_params()
    data = load_learner_data(params.learner, traj, masks, 2, 2, need_masks=False)
    rows = list(range(len(data)))
    n = sum(len(r) for r in data.response_ids)
    if kind == "all":
        return 1.0
    if kind == "no_eos":
        eos = load_tokenizer(model_dir).eos_token_id
        return sum(int(t != eos) for r in data.response_ids for t in r) / n
    model = load_policy(model_dir)
    mb = build_micro_batch(data, rows, masked=False)
    with torch.no_grad():
        logits, _, _ = response_logits(model, mb.input_ids, None, mb.prompt_lens, mb.resp_lens)
    argmax = logits.argmax(-1)
    return sum(int(keyed_tokens(data.prompt_ids[r], data.response_ids[r], argmax[b].tolist()).sum())
               for b, r in enumerate(rows)) / n


@pytest.mark.parametrize("kind", KL_TOKENS)
def test_learner_trains_and_logs_the_kl_token_fraction(tmp_path, setup, kind):
    _, model_dir, traj, masks = setup
    out = run_learner(make_params(**{"learner.kl_tokens": kind}), 1, model_dir, traj, masks, tmp_path / "policy")
    assert max_param_diff(params_of(model_dir), params_of(out["policy"])) > 1e-5  # it trained
    steps = json.loads(out["steps"].read_text())
    details = json.loads(out["details"].read_text())
    assert details["config"]["learner"]["kl_tokens"] == kind
    fraction = steps[0][KL_TOKEN_FRACTION]
    assert details[KL_TOKEN_FRACTION] == fraction
    assert fraction == pytest.approx(_expected_fraction(kind, model_dir, traj, masks), abs=1e-12)
    assert np.isfinite(steps[0]["loss/kl_dense"]) and steps[0]["loss/kl_dense"] >= 0
    if kind == "all":
        assert fraction == 1.0 and steps[0]["loss/kl_dense"] > 0


def test_no_eos_skips_the_tokenizers_eos_in_the_learner(tmp_path, setup):
    """The tiny random policy never samples EOS in 7 tokens: a copy of it whose tokenizer names a token the responses
    hold as EOS (the learner reads eos_token_id from the policy's tokenizer, as the rollout does; the log-probs do not
    depend on it, so the parity gate still passes) has the KL skip exactly those tokens."""
    _, model_dir, traj, masks = setup
    responses = read_table(traj, "trajectories").column("response_token_ids").to_pylist()
    counts = np.bincount([t for r in responses for t in r])
    eos = int(counts.argmax())
    policy = tmp_path / "eos-policy"
    shutil.copytree(model_dir, policy)
    tokenizer = load_tokenizer(policy)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.save_pretrained(policy)
    assert load_tokenizer(policy).eos_token_id == eos
    out = run_learner(make_params(**{"learner.kl_tokens": "no_eos"}), 1, policy, traj, masks, tmp_path / "policy")
    fraction = json.loads(out["steps"].read_text())[0][KL_TOKEN_FRACTION]
    n = sum(map(len, responses))
    assert fraction == pytest.approx((n - counts[eos]) / n, abs=1e-12) and fraction < 1.0
    # the KL is the mean over the other tokens only (not all's mean)
    every = run_learner(make_params(), 1, policy, traj, masks, tmp_path / "all" / "policy")
    kl_all = json.loads(every["steps"].read_text())[0]["loss/kl_dense"]
    kl_no_eos = json.loads(out["steps"].read_text())[0]["loss/kl_dense"]
    assert kl_no_eos != kl_all and kl_no_eos > 0


def test_learner_without_teacher_logs_no_kl_token_fraction(tmp_path, setup):
    _, model_dir, traj, masks = setup
    out = run_learner(make_params(**{"learner.objective": "shadow", "learner.kl_tokens": "keyed"}), 1, model_dir,
                      traj, masks, tmp_path / "policy")
    assert KL_TOKEN_FRACTION not in json.loads(out["steps"].read_text())[0]


def test_report_tells_the_kl_token_arms_apart():
    from stages.tools.report import _series_label

    base = {"objective": "smd", "policy": "snapkv", "keep_ratio": 0.5, "kl_lambda": 0.1}
    assert _series_label(base) == _series_label({**base, "kl_tokens": "all"}) == "smd λ0.1 / snapkv @ 0.5"
    assert _series_label({**base, "kl_tokens": "keyed"}) == "smd λ0.1 kl:keyed / snapkv @ 0.5"
    assert _series_label({**base, "kl_tokens": "no_eos"}) == "smd λ0.1 kl:no_eos / snapkv @ 0.5"
