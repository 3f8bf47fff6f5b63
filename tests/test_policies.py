"""Eviction policies against hand-derived schedules, and the shared `evict` rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.params.rollout import POLICIES, EvictionParams
from stages.common.kvcache.policies import POLICY_REGISTRY, LayerSlots, evict
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import load_policy
from tests.helpers import make_model_dir, random_prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("pol"), "gqa"))


def test_registry_has_every_policy():
    assert set(POLICY_REGISTRY) == set(POLICIES)


def test_evict_rule_by_hand():
    # one sequence, one head, 6 slots holding positions 0..5; current query position 5
    slots = LayerSlots(slot_pos=torch.tensor([[[0, 1, 2, 3, 4, 5]]]))
    scores = torch.tensor([[[9.0, 1.0, 5.0, 1.0, 0.0, 0.0]]])
    evict_at = torch.full((1, 1, 8), -1, dtype=torch.int32)
    # keep 3: sink 0 and the window-1 = 1 newest (5) are protected; then highest score (2) survives;
    # 1 and 3 tie at 1.0 -> both evicted with 4 (score 0): all of 1, 3, 4 go.
    n = evict(slots, scores, torch.tensor([3]), torch.tensor([5]), sinks=1, window=2, evict_at=evict_at)
    assert int(n) == 3
    assert slots.slot_pos.tolist() == [[[0, -1, 2, -1, -1, 5]]]
    assert evict_at[0, 0].tolist() == [-1, 6, -1, 6, 6, -1, -1, -1]


def test_evict_tie_break_evicts_oldest():
    slots = LayerSlots(slot_pos=torch.tensor([[[0, 1, 2, 3, 4]]]))
    evict_at = torch.full((1, 1, 5), -1, dtype=torch.int32)
    evict(slots, torch.zeros(1, 1, 5), torch.tensor([3]), torch.tensor([4]), sinks=0, window=1, evict_at=evict_at)
    assert slots.slot_pos.tolist() == [[[-1, -1, 2, 3, 4]]]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_single_victim_path_matches_the_sorting_rule(data):
    """`evict(at_most_one=True)` (decode fast path) == the general two-sort rule, ties included."""
    B, H, S = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(2, 12))
    sinks, window = data.draw(st.integers(0, 2)), data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    cur = torch.tensor([int(S + rng.integers(0, 4)) for _ in range(B)])
    pos = torch.full((B, H, S), -1, dtype=torch.long)
    for b in range(B):
        n_valid = int(rng.integers(1, S + 1))  # same count in every head, as in the engine
        for h in range(H):
            chosen = np.sort(rng.choice(int(cur[b]) + 1, size=n_valid, replace=False))
            chosen[-1] = int(cur[b])  # the key just inserted is always cached
            pos[b, h, rng.permutation(S)[:n_valid]] = torch.from_numpy(np.unique(chosen))[:n_valid]
    counts = (pos >= 0).sum(-1)[:, 0]
    keep = torch.clamp(counts - torch.from_numpy(rng.integers(0, 2, size=B)), min=sinks + window)
    scores = torch.from_numpy(rng.integers(0, 3, size=(B, H, S)).astype(np.float64))  # many ties
    runs = []
    for fast in (False, True):
        slots, evict_at = LayerSlots(slot_pos=pos.clone()), torch.full((B, H, 32), -1, dtype=torch.int32)
        n = evict(slots, scores, keep, cur, sinks, window, evict_at, at_most_one=fast)
        runs.append((int(n), slots.slot_pos.tolist(), evict_at.tolist()))
    assert runs[0] == runs[1]


def test_recent_matches_streaming_schedule(model):
    """recent with a fixed budget M keeps sinks + the newest M-1-s keys: evict_at[k] = max(P, k + M - s)."""
    M, s, w = 12, 2, 4
    ev = EvictionParams(policy="recent", keep_ratio=1.0, max_tokens=M, sinks=s, window=w)
    prompt = random_prompts([30], seed=11)[0]
    res, _ = generate_batch(model, [prompt], ev, 10, eos_token_id=None, generator=torch.Generator().manual_seed(0))
    e = res[0].evict_at
    T, P = e.shape[0], len(prompt)
    expected = np.array([T if k < s else min(T, max(P, k + M - s)) for k in range(T)])
    for layer in range(e.shape[1]):
        for head in range(e.shape[2]):
            assert e[:, layer, head].tolist() == expected.tolist()


def test_h2o_keeps_heavy_hitters_and_heads_differ(model):
    ev = EvictionParams(policy="h2o", keep_ratio=0.4, sinks=1, window=3)
    res, _ = generate_batch(model, random_prompts([40], seed=12), ev, 6, eos_token_id=None,
                            generator=torch.Generator().manual_seed(0))
    e = res[0].evict_at
    # per-head scores differ, so at least two (layer, head) columns keep different key sets
    cols = {tuple(e[:, layer, h]) for layer in range(e.shape[1]) for h in range(e.shape[2])}
    assert len(cols) > 1


def test_random_policy_depends_on_seed(model):
    prompts = random_prompts([40], seed=13)
    runs = [generate_batch(model, prompts, EvictionParams(policy="random", seed=s, sinks=1, window=3), 4,
                           eos_token_id=None, temperature=0)[0][0].evict_at for s in (0, 0, 1)]
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_snapkv_ring_is_float32_and_its_scores_are_the_float64_window_sums():
    """Every-step SnapKV scores a slot by the attention of the last `window` decoded queries (the prefill's
    pooled score counting as the first, until the ring wraps). The ring stores the float32 probabilities (half a
    float64 ring's bytes) and its scores equal a float64 reference sum of the same entries exactly."""
    w, B, H, P = 4, 2, 3, 7
    policy = POLICY_REGISTRY["snapkv"](EvictionParams(policy="snapkv", window=w, pooling_kernel=1), num_layers=1)
    slots = LayerSlots(slot_pos=torch.arange(P).expand(B, H, P).clone())
    gen = torch.Generator().manual_seed(0)
    policy.observe_prefill(0, slots, torch.rand(B, H, w, P, generator=gen, dtype=torch.float64))
    entries = [slots.extra["prefill_score"].clone()]  # the reference ring, float64, newest last
    assert slots.extra["ring"].dtype == torch.float32
    for _ in range(2 * w + 1):
        probs = torch.softmax(torch.randn(B, H, 1, P, generator=gen), dim=-1)
        policy.observe_decode(0, slots, probs)
        entries = (entries + [probs[:, :, 0].to(torch.float64)])[-w:]
        reference = torch.zeros(B, H, P, dtype=torch.float64)
        for e in entries:
            reference += e
        torch.testing.assert_close(policy.scores(0, slots), reference, rtol=1e-15, atol=0)
