"""Engine edge cases through `generate_batch` (issue 13): a row reaching EOS while the others keep decoding and
evicting, rows cut at max_new_tokens, one-token prompts, a budget equal to the prompt length, GRPO groups of
two; each checked against the budget and, where it applies, the learner's shadow-mask replay (parity 1e-5)."""

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
def model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("edges"), "gqa"))


def _eviction(policy: str = "snapkv", **kw) -> EvictionParams:
    return EvictionParams(policy=policy, keep_ratio=kw.pop("keep_ratio", 0.5), sinks=2, window=4, **kw)


def _generate(model, prompts, ev, max_new_tokens, eos=None, seed=1, temperature=1.0):
    return generate_batch(model, prompts, ev, max_new_tokens, eos_token_id=eos, temperature=temperature,
                          generator=torch.Generator().manual_seed(seed))[0]


def _check_budget(results, ev: EvictionParams) -> None:
    evd = ev.model_dump()
    for r in results:
        T = r.evict_at.shape[0]
        assert T == r.prompt_len + len(r.response_ids) == r.kv_dense_tokens
        assert (r.evict_at > np.arange(T)[:, None, None]).all() and (r.evict_at <= T).all()
        counts = visible_counts(r.evict_at)
        for q in range(r.prompt_len, T):
            assert counts[q].max() <= budget(q + 1, evd), (q, counts[q].max())
        assert r.kv_peak_tokens == int(counts[r.prompt_len:].max())


def _check_parity(model, prompts, results, temperature: float = 1.0) -> None:
    """The learner's shadow-masked forward gives the rollout's log-probs, row by row."""
    ids, evict_at, rec = replay_batch(prompts, results)
    pl, rl = [len(p) for p in prompts], [len(r.response_ids) for r in results]
    with torch.no_grad():
        logits, targets, valid = response_logits(model, ids, evict_at, pl, rl)
    lp = token_logprobs(logits, targets, temperature)
    assert valid.sum().item() == sum(rl)
    assert (lp - rec)[valid].abs().max().item() <= TOL


def _eos_mid_batch(model, prompts, ev, max_new_tokens):
    """Find a seed and an EOS token such that row 0 ends early (step k <= 3) while row 1 never samples it: the
    run with that EOS is the EOS-free run with row 0 cut (rows are independent under the same random draws)."""
    for seed in range(20):
        free = _generate(model, prompts, ev, max_new_tokens, seed=seed)
        r0, r1 = free[0].response_ids, free[1].response_ids
        for k in range(4):
            tok = r0[k]
            if tok not in r0[:k] and tok not in r1:
                return seed, tok, k, free
    raise AssertionError("no seed gives an early EOS in row 0 only")


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent", "random"])
def test_eos_mid_batch_others_keep_decoding_and_evicting(model, policy):
    ev = _eviction(policy)
    prompts = random_prompts([30, 26, 34], seed=11)
    max_new = 14
    seed, eos, k, free = _eos_mid_batch(model, prompts, ev, max_new)
    res = _generate(model, prompts, ev, max_new, eos=eos, seed=seed)

    stop = res[0]
    assert stop.finish_reason == "stop" and stop.response_ids == free[0].response_ids[: k + 1]
    assert stop.response_ids[-1] == eos and stop.logprobs == free[0].logprobs[: k + 1]
    T0 = stop.evict_at.shape[0]
    # the row's mask is the EOS-free row's, cut at its end (later evictions become "never evicted")
    assert np.array_equal(stop.evict_at, np.minimum(free[0].evict_at[:T0], T0))

    other = res[1]
    assert other.finish_reason == "length" and len(other.response_ids) == max_new
    assert other.response_ids == free[1].response_ids and other.logprobs == free[1].logprobs
    assert np.array_equal(other.evict_at, free[1].evict_at)
    # evictions go on for row 1 after row 0 stopped: keys evicted by queries past row 0's last step
    P1, T1 = other.prompt_len, other.evict_at.shape[0]
    evicted_at_step = other.evict_at[other.evict_at < T1] - P1  # the decode step whose query no longer sees it
    assert (evicted_at_step > k).any()
    for i in (1, 2):
        if res[i].finish_reason == "stop":
            assert res[i].response_ids[-1] == eos and eos not in res[i].response_ids[:-1]
        else:
            assert len(res[i].response_ids) == max_new and eos not in res[i].response_ids
    _check_budget(res, ev)
    _check_parity(model, prompts, res)


def test_rows_cut_at_max_new_tokens(model):
    ev = _eviction("snapkv")
    prompts = random_prompts([28, 19, 33], seed=12)
    free = _generate(model, prompts, ev, 9)
    unseen = next(t for t in range(4, 200) if all(t not in r.response_ids for r in free))
    res = _generate(model, prompts, ev, 9, eos=unseen)
    assert [r.finish_reason for r in res] == ["length"] * 3
    assert [len(r.response_ids) for r in res] == [9] * 3
    assert [r.response_ids for r in res] == [r.response_ids for r in free]
    _check_budget(res, ev)
    _check_parity(model, prompts, res)
    one = _generate(model, prompts, ev, 1, eos=unseen)  # a single new token: cut right after the prefill
    assert [(len(r.response_ids), r.finish_reason) for r in one] == [(1, "length")] * 3
    _check_budget(one, ev)
    _check_parity(model, prompts, one)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_token_prompts(model, policy):
    ev = _eviction(policy)
    for lengths in ([1, 1], [1, 23, 9]):
        prompts = random_prompts(lengths, seed=13)
        res = _generate(model, prompts, ev, 12)
        assert all(len(r.response_ids) == 12 for r in res)
        assert res[0].prompt_len == 1
        _check_budget(res, ev)
        _check_parity(model, prompts, res)
        if policy != "dense":  # the budget (sinks + window = 6) is reached during decoding: something was evicted
            assert (res[0].evict_at < res[0].evict_at.shape[0]).any()


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent"])
def test_budget_equal_to_prompt_length(model, policy):
    """max_tokens = the prompt length: the prefill keeps the whole prompt, the first decode query sees all but one
    prompt key (one key per head evicted for its own), and from then on every query sees exactly the budget."""
    P = 24
    ev = _eviction(policy, keep_ratio=1.0, max_tokens=P)
    prompts = random_prompts([P, P - 10], seed=14)  # the shorter row stays under the cap for 10 steps
    res = _generate(model, prompts, ev, 12)
    _check_budget(res, ev)
    _check_parity(model, prompts, res)
    full, short = res
    counts = visible_counts(full.evict_at)
    assert (counts[P - 1] == P).all()  # the last prompt query saw the whole prompt: the prefill evicted nothing
    assert (counts[P:] == P).all()  # every decode query sees exactly P keys (the cap), itself included
    assert ((full.evict_at == P).sum(axis=0) == 1).all()  # one key per head gone for the first decode query
    queries = np.arange(short.prompt_len, short.evict_at.shape[0])
    assert (visible_counts(short.evict_at)[queries].max(axis=(1, 2)) == np.minimum(queries + 1, P)).all()


@pytest.mark.parametrize("policy", ["snapkv", "random"])
def test_group_size_two(model, policy):
    """A GRPO group of two: the same prompt twice in a batch gives two independent samples (SnapKV: with the same
    prefill eviction, which depends on the prompt only)."""
    ev = _eviction(policy)
    p, q = random_prompts([27, 35], seed=15)
    prompts = [p, p, q, q]
    res = _generate(model, prompts, ev, 10)
    _check_budget(res, ev)
    _check_parity(model, prompts, res)
    for a, b in ((res[0], res[1]), (res[2], res[3])):
        P = a.prompt_len
        assert a.response_ids != b.response_ids  # sampled independently
        if policy == "snapkv":  # prefill scores depend on the prompt only
            assert np.array_equal(a.evict_at[:P] == P, b.evict_at[:P] == P)
