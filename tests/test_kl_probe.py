"""The KL probe (stages/tools/kl_probe.py, `smdctl probe-kl`): the needed-fact classification, the per-token
dense-teacher KL against an independent float64 computation, a dense mask, the gradient split and cosine, and
the CLI's one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from stages.common.model import load_policy
from stages.learner.shadow_attention import pad_evict_at, response_logits
from stages.tools.kl_probe import (
    CLASSES,
    EVICTED,
    KEPT,
    NO_FACT,
    PARTIAL,
    cosine,
    flat_grad,
    induction_keys,
    probe_kl,
    token_classes,
    token_kl,
    trainable,
)
from tests.helpers import (
    INDUCTION_PROMPT,
    INDUCTION_RESPONSE,
    flex_model_batch,
    float32_bound,
    make_iteration,
    make_model_dir,
    make_params,
    model_chain,
    write_prompt_splits,
)

# A pointer-chasing-like prompt: facts "a b ." as token pairs, then the query; tokens are small ints.
PROMPT = INDUCTION_PROMPT
# response: "10 11 ; 11 12 ; 12 13": 10 after 99 (no "99 10"), 11 after 10 (two "10 .." pairs: 10 11 at k=2 and
# 10 30 at k=11 -> key of 11 is k=2, unique), ";" (=3) never in the prompt, 11 after ";" no, 12 after 11 -> k=5,
# ";", 12 after ";" no, 13 after 12: "12 13" absent (a wrong hop) -> no key.
RESPONSE = INDUCTION_RESPONSE


def test_induction_keys_hand_checked():
    assert induction_keys(PROMPT, RESPONSE).tolist() == [-1, 2, -1, -1, 5, -1, -1, -1]
    # ambiguous: "1 20" occurs twice -> no key; the first response token's predecessor is the prompt's last token
    assert induction_keys([1, 20, 5, 1, 20, 7], [20]).tolist() == [-1]
    assert induction_keys([1, 20, 5, 7, 1], [20, 5]).tolist() == [1, 2]
    # other tokens at each position (the dense teacher's), looked up after the *response's* previous token:
    # 30 after 10 -> k=11, 12 after 11 -> k=5, 1 after 12 -> k=6 (where the sampled 13 had no key)
    assert induction_keys(PROMPT, RESPONSE, [10, 30, 3, 11, 12, 3, 12, 1]).tolist() == [-1, 11, -1, -1, 5, -1, -1, 6]


def test_classes_from_evict_at_hand_checked():
    P, T = len(PROMPT), len(PROMPT) + len(RESPONSE)
    L, H = 2, 2
    ev = np.full((T, L, H), T, dtype=np.int64)  # nothing evicted
    cls, vis = token_classes(PROMPT, RESPONSE, ev)
    assert cls.tolist() == [NO_FACT, KEPT, NO_FACT, NO_FACT, KEPT, NO_FACT, NO_FACT, NO_FACT]
    # token t=1 (11, key k=2) is predicted by query q = P + 0: evicted everywhere at q -> "evicted"
    ev[2] = P
    # token t=4 (12, key k=5) is predicted by q = P + 3: evicted in layer 0 only from q on; in layer 1 at q+1
    # (still visible at q) -> half the pairs see it: "partial"
    ev[5, 0, :] = P + 3
    ev[5, 1, :] = P + 4
    cls, vis = token_classes(PROMPT, RESPONSE, ev)
    assert cls.tolist() == [NO_FACT, EVICTED, NO_FACT, NO_FACT, PARTIAL, NO_FACT, NO_FACT, NO_FACT]
    assert vis[1] == 0.0 and vis[4] == 0.5 and np.isnan(vis[0])
    # evicted only after the query that needs it: still "kept"
    ev[2] = P + 1
    assert token_classes(PROMPT, RESPONSE, ev)[0][1] == KEPT


def _kl64(model, ids, evict_at, prompts, resp, temperature):
    """KL(p_dense || q_masked) per response token from the full float64 logits of both forwards."""
    m64 = model.double()
    with torch.no_grad():
        masked, _, valid = response_logits(m64, ids, evict_at, prompts, resp)
        dense, _, _ = response_logits(m64, ids, None, prompts, resp)
    log_q = torch.log_softmax(masked / temperature, -1)
    log_p = torch.log_softmax(dense / temperature, -1)
    model.float()
    return (log_p.exp() * (log_p - log_q)).sum(-1), valid


def test_token_kl_equals_float64_full_logits(tmp_path):
    model, ids, evict_at, prompts, resp = flex_model_batch(tmp_path, "snapkv", seed=3, ids_seed=4)
    got = token_kl(model, ids, evict_at, prompts, resp, temperature=0.8, chunk_tokens=17)
    want, valid = _kl64(model, ids, evict_at, prompts, resp, 0.8)
    assert torch.equal(got["valid"], valid)
    diff = float((got["kl"].detach().double() - want)[valid].abs().max())
    bound = float32_bound(model_chain(model.config, ids.shape[1]), max(1.0, float(want[valid].abs().max())))
    assert float(want[valid].max()) > 1e-4  # the mask changes the policy: a real KL is being compared
    assert diff <= bound, (diff, bound)


def test_dense_mask_kl_zero_and_facts_kept(tmp_path):
    model = load_policy(make_model_dir(tmp_path, "gqa"))
    prompts = [PROMPT, PROMPT[:-1] + [12]]
    responses = [RESPONSE, [13, 1, 20, 21]]
    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    cfg = model.config
    rows = [torch.full((len(s), cfg.num_hidden_layers, cfg.num_key_value_heads), len(s), dtype=torch.long)
            for s in seqs]
    out = token_kl(model, ids, pad_evict_at(rows, T), [len(p) for p in prompts], [len(r) for r in responses], 1.0)
    kl = out["kl"].detach()[out["valid"]]
    assert float(kl.abs().max()) <= float32_bound(model_chain(cfg, T), 1.0)
    for p, r, ev in zip(prompts, responses, rows):
        cls, _ = token_classes(p, r, ev.numpy())
        assert set(cls.tolist()) <= {NO_FACT, KEPT} and KEPT in cls.tolist()


def test_gradient_cosine_and_class_split(tmp_path):
    model, ids, evict_at, prompts, resp = flex_model_batch(tmp_path, "snapkv", seed=5, ids_seed=6)
    params = trainable(model)
    out = token_kl(model, ids, evict_at, prompts, resp, temperature=1.0)
    kl, valid = out["kl"], out["valid"]
    g = flat_grad(kl[valid].mean(), params, retain_graph=True)
    assert cosine(g, g) == pytest.approx(1.0, abs=1e-12)
    assert cosine(g, -g) == pytest.approx(-1.0, abs=1e-12)
    # the probe's split: g_kl = sum_c (n_c / n) g_c, with g_c the mean over the tokens of one class
    first = torch.zeros_like(valid)
    first[:, : resp[0] // 2] = True
    parts = [first & valid, ~first & valid]
    n = int(valid.sum())
    split = sum(int(s.sum()) / n * flat_grad((kl * s).sum() / int(s.sum()), params, retain_graph=True) for s in parts)
    assert float((split - g).abs().max()) <= 1e-6 * max(1.0, float(g.abs().max()))


@pytest.mark.parametrize("policy", ["dense", "snapkv"])
def test_probe_end_to_end(tmp_path, policy):
    """The probe on a tiny model's rollout: with a dense rollout (nothing evicted) the KL is 0 and no fact is
    evicted; with SnapKV the KL is positive and the record's splits add up (classes, advantage sides,
    parameter groups, smd = pg + kl_lambda * kl)."""
    model_dir = make_model_dir(tmp_path, "gqa")
    data = write_prompt_splits(tmp_path / "data")
    params = make_params(**{"rollout.eviction.policy": policy})
    art = tmp_path / "artifacts"
    make_iteration(art, model_dir, data / "train.arrow", params, name="iter-001")
    record = probe_kl(art, None, warmstart=model_dir, eval_prompts=data / "eval.arrow", rows=4, eval_rows=2,
                      micro_batch_size=3)
    assert record["iteration"] == 1 and len(record["rows"]) == 4 and record["eval_rows"] == 2
    assert record["temperature"] == pytest.approx(0.8)  # the rollout's, from the trajectory table
    assert record["parity_logprob_abs_diff_max"] < 1e-4
    assert sum(record["classes"][c]["tokens"] for c in CLASSES) == record["tokens"]
    assert sum(record["classes_needed"][c]["tokens"] for c in CLASSES) == record["tokens"]
    assert record["classes_needed"]["no_fact"]["tokens"] <= record["classes"]["no_fact"]["tokens"]
    grads = record["gradients"]
    assert grads["nll"]["norm"] > 0
    json.dumps(record, allow_nan=False)
    if policy == "dense":
        assert abs(record["kl_mean"]) < 1e-5
        assert record["classes"]["evicted"]["tokens"] == 0 and record["classes"]["partial"]["tokens"] == 0
        return
    assert record["kl_mean"] > 1e-4
    for name in ("kl", "pg", "smd"):
        assert sum(grads[name]["dot_by_group"].values()) == pytest.approx(grads[name]["dot_with_nll"], rel=1e-9)
        assert set(record["steps"][name]) == {"nll_after", "measured_change", "predicted_change"}
    assert grads["smd"]["dot_with_nll"] == pytest.approx(
        grads["pg"]["dot_with_nll"] + record["kl_lambda"] * grads["kl"]["dot_with_nll"], rel=1e-9)
    sides = record["by_advantage"]
    assert sides["pos"]["tokens"] + sides["nonpos"]["tokens"] == record["tokens"]
    parts = [grads[f"kl_adv_{s}"]["dot_with_nll"] * sides[s]["tokens"] / record["tokens"]
             for s in sides if sides[s]["tokens"]]
    assert sum(parts) == pytest.approx(grads["kl"]["dot_with_nll"], rel=1e-5)
    assert sum(v["tokens"] for v in record["by_visible"].values()) == \
        record["tokens"] - record["classes"]["no_fact"]["tokens"]
    # the step's gradient decomposition against float64 autograd on full logits (an independent path: no chunked
    # scoring, no shared prefix): g_pg = grad of -sum A log pi_masked / n, g_kl = grad of the mean full-vocabulary KL
    dec = record["decomposition"]
    want = _decomposition64(model_dir, art / "iter-001", record["rows"], record["temperature"], record["kl_lambda"])
    for key in ("pg_norm", "kl_norm", "weighted_kl_norm", "smd_norm"):
        assert dec[key] == pytest.approx(want[key], rel=1e-4), key
    assert dec["cosine_pg_kl"] == pytest.approx(want["cosine_pg_kl"], abs=1e-4)
    assert want["pg_norm"] > 0 and want["kl_norm"] > 0
    import io

    from rich.console import Console

    from stages.tools.kl_probe import render

    buf = io.StringIO()
    render(record, Console(file=buf, width=200))
    assert f"cos(g_pg, g_kl) {dec['cosine_pg_kl']:+.3f}" in buf.getvalue()


def _decomposition64(model_dir, iteration_dir, rows, temperature, kl_lambda):
    from schemas.params.learner import LearnerParams
    from stages.learner.data import build_micro_batch, load_learner_data

    model = load_policy(model_dir).double()
    cfg = model.config
    data = load_learner_data(LearnerParams(), iteration_dir / "rollout" / "trajectories.arrow",
                             iteration_dir / "compact" / "masks.zarr", cfg.num_hidden_layers,
                             cfg.num_key_value_heads, need_masks=True)
    mb = build_micro_batch(data, list(rows), masked=True)
    masked, targets, valid = response_logits(model, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens)
    with torch.no_grad():
        dense, _, _ = response_logits(model, mb.input_ids, None, mb.prompt_lens, mb.resp_lens)
    log_q = torch.log_softmax(masked / temperature, -1)
    log_p = torch.log_softmax(dense / temperature, -1)
    n = int(valid.sum())
    logp = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    adv = torch.tensor([data.advantages[r] for r in rows], dtype=torch.float64).unsqueeze(1)
    pg = -(adv * logp * valid).sum() / n
    kl = ((log_p.exp() * (log_p - log_q)).sum(-1) * valid).sum() / n
    params = [p for p in model.parameters() if p.requires_grad]
    g_pg = torch.cat([g.reshape(-1) for g in torch.autograd.grad(pg, params, retain_graph=True)])
    g_kl = torch.cat([g.reshape(-1) for g in torch.autograd.grad(kl, params)])
    return {"pg_norm": float(g_pg.norm()), "kl_norm": float(g_kl.norm()),
            "weighted_kl_norm": kl_lambda * float(g_kl.norm()), "smd_norm": float((g_pg + kl_lambda * g_kl).norm()),
            "cosine_pg_kl": float(g_pg @ g_kl) / float(g_pg.norm() * g_kl.norm())}


def test_cli_missing_artifact(tmp_path):
    from cli.main import app

    res = CliRunner().invoke(app, ["probe-kl", "--run", str(tmp_path / "nope"), "--iteration", "2",
                                   "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "iter-001/policy" in lines[0] and "missing" in lines[0], res.output
    assert not (tmp_path / "o.json").exists()
