"""Kept sets of `snapkv` and `h2o` against independent implementations of their reference rules.

The references below re-derive each rule from its source, in numpy, per unpadded sequence and per head,
from the attention weights transformers' own eager attention returns (`output_attentions=True`), so
neither the engine's attention pass, its left padding, nor the shared `evict` is reused:
- SnapKV (FasterDecoding/SnapKV `snapkv_utils.py`; kvpress `SnapKVPress`): the last w queries' attention
  summed over the window for the keys before it, average-pooled (kernel 5, zero padding), averaged over a
  GQA group (kvpress), top (C - w) plus the window.
- H2O (FMInference/H2O `H2OKVCache_LayerWise`): attention accumulated over every query, summed over the
  group, top b // 2 heavy hitters among the keys older than the recent window, plus the b - b // 2 newest
  positions (the next query included).
Prompts are sampled from a float64 model so that no near-tie decides a kept set.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.params.rollout import EvictionParams
from schemas.raw_masks import budget, visible_counts
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import attention_implementation, load_policy
from tests.helpers import make_model_dir, random_prompts

LENGTHS = [57, 40, 64, 33]  # a left-padded batch of unequal prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("ref"), "gqa")).double()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=3)


def _eager_attention(model, prompt: list[int]) -> list[np.ndarray]:
    """Per layer [Hq, P, P] attention probabilities of one unpadded prompt, from transformers' eager path."""
    with attention_implementation(model, "eager"), torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), output_attentions=True)
    return [a[0].numpy() for a in out.attentions]


def _avg_pool_zero_padded(x: np.ndarray, kernel: int) -> np.ndarray:
    """F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2) (count_include_pad) along the last axis."""
    pad = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    return np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1).sum(-1) / kernel


def _top(scores: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-scores, kind="stable")[:k].tolist()) if k > 0 else set()


def snapkv_reference(attn: np.ndarray, capacity: int, window: int, kvh: int, kernel: int = 5,
                     tail: int = 0) -> list[set[int]]:
    """`tail` > 0: the observation window ends `tail` tokens before the prompt's end (window_anchor user_end); the
    tail keys are kept with the window."""
    Hq, P, _ = attn.shape
    end = P - tail
    per_q = attn[:, end - window: end, : end - window].sum(axis=1)  # [Hq, end - w]
    pooled = _avg_pool_zero_padded(per_q, kernel)
    grouped = pooled.reshape(kvh, Hq // kvh, -1).mean(axis=1)
    window_keys = set(range(end - window, P))
    return [_top(grouped[h], capacity - window - tail) | window_keys for h in range(kvh)]


def h2o_reference(attn: np.ndarray, capacity: int, kvh: int) -> list[set[int]]:
    Hq, P, _ = attn.shape
    acc = attn.sum(axis=1).reshape(kvh, Hq // kvh, P).sum(axis=1)  # [H, P] over all queries and the group
    b = capacity + 1  # keys the first decoded query sees
    recent = b - b // 2 - 1  # the newest cached keys (the query itself is the last of the recent window)
    older = P - recent
    return [_top(acc[h, :older], b // 2) | set(range(older, P)) for h in range(kvh)]


def _kept_after_prefill(result, P: int, layer: int, head: int) -> set[int]:
    # Keys evicted right after prefill carry evict_at = P (the first decoded query's position).
    return {k for k in range(P) if int(result.evict_at[k, layer, head]) > P}


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_prefill_kept_sets_match_reference(model, prompts, policy):
    ev = EvictionParams(policy=policy, keep_ratio=0.4, window=8)
    assert ev.sinks == 0 and ev.pooling == "avg" and ev.pooling_kernel == 5  # the papers' defaults
    results, _ = generate_batch(model, prompts, ev, max_new_tokens=3, eos_token_id=None,
                                generator=torch.Generator().manual_seed(0))
    cfg = model.config
    kvh = cfg.num_key_value_heads
    compared = 0
    for prompt, res in zip(prompts, results, strict=True):
        P = len(prompt)
        capacity = budget(P + 1, ev.model_dump()) - 1
        attn = _eager_attention(model, prompt)
        for layer in range(cfg.num_hidden_layers):
            ref = (snapkv_reference(attn[layer], capacity, ev.window, kvh) if policy == "snapkv"
                   else h2o_reference(attn[layer], capacity, kvh))
            for head in range(kvh):
                assert _kept_after_prefill(res, P, layer, head) == ref[head], (P, layer, head)
                compared += 1
    assert compared == len(prompts) * cfg.num_hidden_layers * kvh


def test_snapkv_v0_options_reproduce_the_first_rule(model, prompts):
    """smd v0 (max-pool 7 over every key, window included; 4 sinks; window - 1 newest kept) stays available."""
    ev = EvictionParams(policy="snapkv", keep_ratio=0.4, window=8, sinks=4, pooling="max", pooling_kernel=7,
                        snapkv_pool_scope="all_keys")
    results, _ = generate_batch(model, prompts, ev, max_new_tokens=2, eos_token_id=None,
                                generator=torch.Generator().manual_seed(0))
    kvh = model.config.num_key_value_heads
    for prompt, res in zip(prompts, results, strict=True):
        P = len(prompt)
        capacity = budget(P + 1, ev.model_dump()) - 1
        attn = _eager_attention(model, prompt)
        for layer, a in enumerate(attn):
            Hq = a.shape[0]
            summed = a[:, P - ev.window:, :].sum(axis=1).reshape(kvh, Hq // kvh, P).sum(axis=1)
            padded = np.pad(summed, [(0, 0), (3, 3)], constant_values=-np.inf)
            pooled = np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1).max(-1)
            protected = set(range(4)) | set(range(P - ev.window + 1, P))
            for head in range(kvh):
                free = np.array([k for k in range(P) if k not in protected])
                order = np.lexsort((-free, -pooled[head, free]))  # max-pool ties: the oldest goes first
                top = free[order[: capacity - len(protected)]]
                assert _kept_after_prefill(res, P, layer, head) == protected | set(top.tolist()), (P, layer, head)


def test_h2o_v0_keeps_sinks_and_a_fixed_window(model, prompts):
    ev = EvictionParams(policy="h2o", keep_ratio=0.4, window=8, sinks=4, h2o_recent="window")
    results, _ = generate_batch(model, prompts, ev, max_new_tokens=2, eos_token_id=None,
                                generator=torch.Generator().manual_seed(0))
    for prompt, res in zip(prompts, results, strict=True):
        P = len(prompt)
        kept = _kept_after_prefill(res, P, 0, 0)
        assert set(range(4)) | set(range(P - 7, P)) <= kept


def test_snapkv_and_h2o_keep_the_budget_while_decoding(model, prompts):
    """compress=every_step (default): every decoded query sees at most budget(q + 1) keys; the recent window
    (h2o: half the budget) is never evicted."""
    for policy in ("snapkv", "h2o"):
        ev = EvictionParams(policy=policy, keep_ratio=0.4, window=8)
        results, _ = generate_batch(model, prompts, ev, max_new_tokens=12, eos_token_id=None,
                                    generator=torch.Generator().manual_seed(1))
        evd = ev.model_dump()
        for res in results:
            counts = visible_counts(res.evict_at)
            P, T = res.prompt_len, res.evict_at.shape[0]
            for q in range(P, T):
                assert counts[q].max() <= budget(q + 1, evd)
                b = budget(q + 1, evd)
                newest = b - b // 2 if policy == "h2o" else ev.window + 1
                # keys in the recent window of query q are still visible to it
                lo = max(0, q - newest + 1)
                assert (res.evict_at[lo : q + 1] > q).all(), (policy, q)


def test_prefill_only_compresses_once(model, prompts):
    """compress=prefill_only (SnapKV's paper): evictions happen only right after prefill; every generated key
    stays, so query q sees exactly budget(P) + (q + 1 - P) keys."""
    ev = EvictionParams(policy="snapkv", keep_ratio=0.4, window=8, compress="prefill_only")
    evd = ev.model_dump()
    results, _ = generate_batch(model, prompts, ev, max_new_tokens=10, eos_token_id=None,
                                generator=torch.Generator().manual_seed(2))
    for res in results:
        P, T = res.prompt_len, res.evict_at.shape[0]
        evicted = res.evict_at[res.evict_at < T]
        assert (evicted == P).all() and evicted.size > 0
        counts = visible_counts(res.evict_at)
        for q in range(P, T):
            assert counts[q].max() == budget(q + 1, evd, P) == budget(P, evd, P) + (q + 1 - P)
    with pytest.raises(ValueError, match="prompt length"):
        budget(10, evd)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_snapkv_window_anchored_before_a_tail_matches_reference(model, prompts, share_prompt):
    """window_anchor user_end: the window's queries are the `window` tokens before the last `tail` (a chat
    template's closing tokens), the keys before them are scored, the tail is kept with the window; with shared
    prompts too (two samples of each prompt)."""
    tail = 5
    ev = EvictionParams(policy="snapkv", keep_ratio=0.4, window=8, window_anchor="user_end")
    batch = [p for p in prompts for _ in range(2)] if share_prompt else prompts
    results, _ = generate_batch(model, batch, ev, max_new_tokens=3, eos_token_id=None, share_prompt=share_prompt,
                                generator=torch.Generator().manual_seed(0), window_tail=tail)
    moved = 0
    kvh = model.config.num_key_value_heads
    for prompt, res in zip(batch, results, strict=True):
        P = len(prompt)
        capacity = budget(P + 1, ev.model_dump()) - 1
        attn = _eager_attention(model, prompt)
        for layer in range(model.config.num_hidden_layers):
            ref = snapkv_reference(attn[layer], capacity, ev.window, kvh, tail=tail)
            at_end = snapkv_reference(attn[layer], capacity, ev.window, kvh)
            for head in range(kvh):
                assert _kept_after_prefill(res, P, layer, head) == ref[head], (P, layer, head)
                moved += ref[head] != at_end[head]
    assert moved > 0  # the anchor changes what is kept: the test would catch it being ignored


def test_snapkv_anchor_with_no_tail_is_the_papers_window(model, prompts):
    at_end = EvictionParams(policy="snapkv", keep_ratio=0.4, window=8)
    anchored = at_end.model_copy(update={"window_anchor": "user_end"})
    runs = [generate_batch(model, prompts, ev, max_new_tokens=3, eos_token_id=None, window_tail=tail,
                           generator=torch.Generator().manual_seed(0))[0]
            for ev, tail in ((at_end, 5), (anchored, 0))]  # prompt_end ignores the tail; user_end with none
    reference = generate_batch(model, prompts, at_end, max_new_tokens=3, eos_token_id=None,
                               generator=torch.Generator().manual_seed(0))[0]
    for results in runs:
        for res, ref in zip(results, reference, strict=True):
            assert np.array_equal(res.evict_at, ref.evict_at) and res.response_ids == ref.response_ids
