"""Rollout engine: parity with plain transformers, the shadow-mask invariant for every policy, budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.params.rollout import POLICIES, EvictionParams
from schemas.raw_masks import budget, visible_counts
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import load_policy
from stages.learner.objectives import token_logprobs
from stages.learner.shadow_attention import response_logits
from tests.helpers import make_model_dir, random_prompts, replay_batch

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {shape: load_policy(make_model_dir(root, shape)) for shape in ("gqa", "mha")}


def _learner_logprobs(model, ids, evict_at, prompt_lens, resp_lens, temperature: float = 1.0):
    """Response-token log-probs [B, R] and validity, as the learner computes them (shadow-masked with evict_at)."""
    with torch.no_grad():
        logits, targets, valid = response_logits(model, ids, evict_at, prompt_lens, resp_lens)
    return token_logprobs(logits, targets, temperature), valid


def _eviction(policy: str, **kw) -> EvictionParams:
    return EvictionParams(policy=policy, keep_ratio=kw.pop("keep_ratio", 0.5), sinks=2, window=4, **kw)


def test_dense_greedy_equals_generate(models):
    model = models["gqa"]
    for prompt in random_prompts([30, 17], seed=3):
        res, _ = generate_batch(model, [prompt], _eviction("dense"), 10, eos_token_id=None, temperature=0)
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert res[0].response_ids == ref[0, len(prompt):].tolist()


def test_dense_logprobs_equal_full_forward(models):
    model = models["gqa"]
    prompts = random_prompts([30, 17, 24], seed=4)
    res, _ = generate_batch(model, prompts, _eviction("dense"), 8, eos_token_id=None, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    ids, _, rec = replay_batch(prompts, res)
    lp, valid = _learner_logprobs(model, ids, None, [len(p) for p in prompts], [len(r.response_ids) for r in res])
    assert (lp - rec)[valid].abs().max().item() <= TOL


@pytest.mark.parametrize("shape", ["gqa", "mha"])
@pytest.mark.parametrize("policy", POLICIES)
def test_shadow_mask_reproduces_rollout_logprobs(models, shape, policy):
    """The invariant: a full forward with the recorded mask gives the rollout's log-probs (max |d| <= 1e-5)."""
    model = models[shape]
    prompts = random_prompts([40, 23, 31], seed=5)
    temperature = 0.8
    res, _ = generate_batch(model, prompts, _eviction(policy), 14, eos_token_id=None, temperature=temperature,
                            generator=torch.Generator().manual_seed(1))
    ids, evict_at, rec = replay_batch(prompts, res)
    pl, rl = [len(p) for p in prompts], [len(r.response_ids) for r in res]
    lp, valid = _learner_logprobs(model, ids, evict_at, pl, rl, temperature)
    lpd, _ = _learner_logprobs(model, ids, None, pl, rl, temperature)
    assert (lp - rec)[valid].abs().max().item() <= TOL
    if policy != "dense":  # the mask matters: the dense learner is off-policy
        assert (lpd - rec)[valid].abs().max().item() > 1e-3


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "dense"])
@pytest.mark.parametrize("kw", [{"keep_ratio": 0.5}, {"keep_ratio": 0.3}, {"keep_ratio": 1.0, "max_tokens": 12}])
def test_budget_respected_and_cache_shrinks(models, policy, kw):
    ev = _eviction(policy, **kw)
    prompts = random_prompts([60, 35], seed=6)
    res, stats = generate_batch(models["gqa"], prompts, ev, 12, eos_token_id=None,
                                generator=torch.Generator().manual_seed(2))
    evd = ev.model_dump()
    for r in res:
        T = r.evict_at.shape[0]
        assert (r.evict_at > np.arange(T)[:, None, None]).all()
        counts = visible_counts(r.evict_at)
        for q in range(r.prompt_len, T):
            assert counts[q].max() <= budget(q + 1, evd)
        assert r.kv_peak_tokens < r.kv_dense_tokens
    assert stats.cache_bytes < stats.dense_cache_bytes


def test_sampling_is_deterministic(models):
    prompts = random_prompts([33, 20], seed=7)
    runs = [generate_batch(models["gqa"], prompts, _eviction("random"), 10, eos_token_id=None,
                           generator=torch.Generator().manual_seed(9))[0] for _ in range(2)]
    for a, b in zip(*runs):
        assert a.response_ids == b.response_ids
        assert a.logprobs == b.logprobs
        assert np.array_equal(a.evict_at, b.evict_at)


def test_eviction_params_reject_bad_budget():
    with pytest.raises(ValueError, match="smaller than sinks"):
        EvictionParams(policy="recent", max_tokens=5, sinks=4, window=16)
    with pytest.raises(ValueError):
        EvictionParams(keep_ratio=0.0)
    with pytest.raises(ValueError):
        EvictionParams(keep_ratio=1.5)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "random"])
def test_simulated_eviction_samples_densely_and_records_the_compressed_decisions(models, policy):
    """rollout.eviction.apply false: the tokens and log-probs are the dense rollout's (same seed, bit for bit), the
    recorded mask is the compressed (prefill_only) rollout's decisions: the same prompt keys evicted at the same
    query, no response key evicted."""
    model = models["gqa"]
    prompts = random_prompts([30, 22, 27], seed=11)

    def run(ev):
        return generate_batch(model, prompts, ev, 10, eos_token_id=None, temperature=1.0,
                              generator=torch.Generator().manual_seed(5))[0]

    dense = run(_eviction("dense"))
    compressed = run(_eviction(policy, compress="prefill_only"))
    simulated = run(_eviction(policy, compress="prefill_only", apply=False))
    assert any(c.logprobs != d.logprobs for c, d in zip(compressed, dense))  # applied, eviction changes the policy
    for d, c, s in zip(dense, compressed, simulated):
        assert s.response_ids == d.response_ids and s.logprobs == d.logprobs
        P = s.prompt_len
        evicted_s, evicted_c = s.evict_at[:P] < len(s.evict_at), c.evict_at[:P] < len(c.evict_at)
        assert evicted_s.any() and np.array_equal(evicted_s, evicted_c)
        assert np.array_equal(s.evict_at[:P][evicted_s], c.evict_at[:P][evicted_c])
        assert (s.evict_at[P:] == len(s.evict_at)).all() and (c.evict_at[P:] == len(c.evict_at)).all()


def test_simulated_eviction_needs_prefill_only_and_evaluation_applies_it():
    from schemas.params import load_params
    from stages.evaluate.stage import eviction_for

    with pytest.raises(ValueError, match="apply false simulates the prefill's eviction decisions only"):
        _eviction("snapkv", apply=False)
    params = load_params(None, ["rollout.eviction.compress=prefill_only", "rollout.eviction.apply=false"])
    assert not params.rollout.eviction.apply
    assert eviction_for("compressed", params).apply and eviction_for("compressed", params).policy == "snapkv"


def test_inverse_cdf_equals_numpy_choice_rule():
    """sample_inverse_cdf against numpy's Generator.choice rule (float64 cumsum, normalised, searchsorted right)
    fed the same uniforms; zero-probability tokens (a -inf logit) are never drawn."""
    from stages.common.kvcache.sampler import sample_inverse_cdf

    probs = torch.softmax(torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3, dim=-1)
    probs[:, ::7] = 0.0  # the first and every 7th token impossible, the last one (index 49) too
    probs[:, 49] = 0.0
    tok = sample_inverse_cdf(probs, torch.Generator().manual_seed(11))
    u = torch.rand((64,), generator=torch.Generator().manual_seed(11), dtype=torch.float64).numpy()
    p = probs.double().numpy()
    for b in range(64):
        cdf = np.cumsum(p[b])
        cdf /= cdf[-1]
        assert tok[b].item() == int(cdf.searchsorted(u[b], side="right"))
        assert p[b, tok[b]] > 0


def test_inverse_cdf_index_hand_checked_boundaries():
    """probs [0, 0.25, 0, 0.75] (cdf 0, 0.25, 0.25, 1): u in [0, 0.25) -> 1, u in [0.25, 1) -> 3; u just below 1
    never reaches past the last positive token, here with zero-probability tokens after it, and a row's total
    needs not be 1."""
    from stages.common.kvcache.sampler import inverse_cdf_index

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]]).expand(5, 6)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9, 1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_index(probs, u).tolist() == [1, 1, 3, 3, 3]
    assert inverse_cdf_index(probs * 8, u).tolist() == [1, 1, 3, 3, 3]


def test_inverse_cdf_frequencies_match_the_softmax():
    """200k draws from a 5-token distribution: every frequency within 5 standard errors of its probability."""
    from stages.common.kvcache.sampler import sample_inverse_cdf

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    n = 200_000
    tok = sample_inverse_cdf(p.expand(n, 5).float(), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=5).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert freq[4] == 0
    assert ((freq - p).abs() <= 5 * se + 1e-12).all()


@pytest.mark.parametrize("policy", ["snapkv", "random"])
def test_inverse_cdf_rollout_keeps_the_invariant(models, policy):
    """rollout.sampler inverse_cdf: the recorded log-probs are the shadow-masked learner's (<= 1e-5), the draw is
    deterministic under a seed, and it is another stream than torch.multinomial's."""
    model = models["gqa"]
    prompts = random_prompts([40, 23, 31], seed=5)

    def run(sampler):
        return generate_batch(model, prompts, _eviction(policy), 14, eos_token_id=None, temperature=0.8,
                              generator=torch.Generator().manual_seed(1), sampler=sampler)[0]

    res = run("inverse_cdf")
    ids, evict_at, rec = replay_batch(prompts, res)
    lp, valid = _learner_logprobs(model, ids, evict_at, [len(p) for p in prompts],
                                  [len(r.response_ids) for r in res], 0.8)
    assert (lp - rec)[valid].abs().max().item() <= TOL
    assert [r.response_ids for r in run("inverse_cdf")] == [r.response_ids for r in res]
    assert [r.response_ids for r in run("multinomial")] != [r.response_ids for r in res]


def test_sampler_rejected_with_vllm_and_unknown_names():
    from pydantic import ValidationError

    from schemas.params.rollout import RolloutParams

    with pytest.raises(ValidationError, match="engine vllm draws with vLLM's own sampler"):
        RolloutParams(engine="vllm", eviction={"policy": "dense"}, sampler="inverse_cdf")
    with pytest.raises(ValidationError, match="sampler"):
        RolloutParams(sampler="gumbel")
