"""A group's prompt, prefilled once in the rollout (docs/design.md §3c, issue 40): `generate_batch` with
`share_prompt` runs the model's prompt forward on the distinct prompts only and copies the policy's prefill
selection to each prompt's samples. For every eviction policy, with groups and left padding, it gives the
per-sample engine's tokens and shadow masks, log-probs within the float32 bound, and the learner's
shadow-masked replay of a shared rollout holds as it does for a per-sample one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.rollout import POLICIES, EvictionParams
from stages.common.kvcache.sampler import (
    _attend_grouped,
    attend_shared_prompt,
    distinct_prompts,
    generate_batch,
    prompt_groups,
)
from stages.common.model import load_policy
from stages.learner.objectives import token_logprobs
from stages.learner.shadow_attention import response_logits
from tests.helpers import make_model_dir, model_chain, random_prompts, replay_batch, within_float32_bound

TOL = 1e-5  # the replay tolerance of tests/test_rollout.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("shared-rollout"), "gqa"))


def grouped_prompts(seed: int = 3) -> list[list[int]]:
    """Three groups (3, 2 and 1 samples, adjacent as `group_jobs` makes them) of prompts of three lengths, so
    the batch is left-padded; the last prompt repeats the first group's after a different one."""
    a, b, c = random_prompts([30, 23, 17], seed=seed)
    return [a, a, a, b, b, c, a]


def _eviction(policy: str, **kw) -> EvictionParams:
    return EvictionParams(policy=policy, keep_ratio=kw.pop("keep_ratio", 0.5), sinks=2, window=4, **kw)


def _run(model, prompts, ev, share: bool, seed: int = 0, temperature: float = 1.0):
    return generate_batch(model, prompts, ev, 10, None, 0, temperature, torch.Generator().manual_seed(seed),
                          share_prompt=share)


def _logprobs(results) -> torch.Tensor:
    return torch.tensor([r.logprobs for r in results], dtype=torch.float32)


def test_distinct_prompts_maps_rows_to_first_occurrences():
    first, rows = distinct_prompts([[1, 2], [1, 2], [3], [1, 2], [3], [4]])
    assert first == [0, 2, 5]
    assert rows == [0, 0, 1, 0, 1, 2]
    assert distinct_prompts([[5], [6]]) == ([0, 1], [0, 1])


def test_prompt_groups_table():
    groups, index = prompt_groups([0, 0, 0, 1, 1, 2, 0], 3)
    assert groups == [[0, 1, 2, 6], [3, 4, 3, 3], [5, 5, 5, 5]]
    assert index == [0, 1, 2, 4, 5, 8, 3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_over_a_shared_prompt_equals_one_cache_per_row(dtype):
    """Two key sets (a distinct prompt's slots stored once, each row's own) with per-row visibility give the
    attention of each row's own cache holding both (float64: to rounding; float32: within the float32 bound)."""
    g = torch.Generator().manual_seed(0)
    B, U, H, groups, D, Cp, Cd = 7, 3, 2, 3, 8, 5, 4
    rows = [0, 0, 0, 1, 1, 2, 0]
    group_rows, group_index = (torch.tensor(x) for x in prompt_groups(rows, U))
    query = torch.randn(B, H * groups, 1, D, generator=g, dtype=dtype)
    pk, pv = (torch.randn(U, H, Cp, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, H, Cd, D, generator=g, dtype=dtype) for _ in range(2))
    mask = torch.rand(B, H, 1, Cp + Cd, generator=g) > 0.3
    mask[..., -1] = True  # the row's newest key: every row sees at least one
    out, probs = attend_shared_prompt(query, pk, pv, k, v, mask, D ** -0.5, group_rows, group_index)
    r = torch.tensor(rows)
    full_k = torch.cat([pk.index_select(0, r), k], dim=2)
    full_v = torch.cat([pv.index_select(0, r), v], dim=2)
    want_out, want_probs = _attend_grouped(query, full_k, full_v, mask, D ** -0.5, H)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert (out - want_out).abs().max() <= tol and (probs - want_probs).abs().max() <= tol


def test_prefill_forward_runs_on_the_distinct_prompts_only(model):
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        prompts = grouped_prompts()
        _run(model, prompts, _eviction("snapkv"), share=True)
        shared = seen[0]
        seen.clear()
        _run(model, prompts, _eviction("snapkv"), share=False)
    finally:
        hook.remove()
    assert shared == 3 and seen[0] == len(prompts)


@pytest.mark.parametrize("compress", ["every_step", "prefill_only"])
@pytest.mark.parametrize("policy", POLICIES)
def test_shared_prefill_equals_per_sample(model, policy, compress):
    """Same seeds: the same tokens and shadow masks per sample, log-probs within the float32 bound of a forward
    over the longest sequence (measured: equal bit for bit on the CPU)."""
    prompts = grouped_prompts()
    ev = _eviction(policy, compress=compress)
    shared, stats_s = _run(model, prompts, ev, share=True)
    own, stats_o = _run(model, prompts, ev, share=False)
    for s, o in zip(shared, own, strict=True):
        assert s.response_ids == o.response_ids
        assert np.array_equal(s.evict_at, o.evict_at)
        assert (s.prompt_len, s.finish_reason, s.kv_peak_tokens) == (o.prompt_len, o.finish_reason, o.kv_peak_tokens)
    T = max(len(p) for p in prompts) + 10
    assert within_float32_bound(_logprobs(shared), _logprobs(own), model_chain(model.config, T))
    assert stats_s.generated_tokens == stats_o.generated_tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_a_groups_prompt_is_stored_once(model, policy):
    """The cache holds a distinct prompt's kept slots once and each sample's own decoding slots: fewer bytes than
    one cache per sample, for every policy."""
    a, b = random_prompts([60, 52], seed=4)
    prompts = [a] * 6 + [b] * 6
    ev = _eviction(policy)
    shared, stats_s = _run(model, prompts, ev, share=True)
    own, stats_o = _run(model, prompts, ev, share=False)
    assert stats_s.cache_bytes < 0.75 * stats_o.cache_bytes
    for s, o in zip(shared, own, strict=True):
        assert s.response_ids == o.response_ids and np.array_equal(s.evict_at, o.evict_at)


def test_random_eviction_draws_per_sample_under_sharing(model):
    """A group's samples share the prompt but not random eviction's draws: their prompt masks differ."""
    prompts = grouped_prompts()
    shared, _ = _run(model, prompts, _eviction("random", compress="prefill_only"), share=True)
    P = shared[0].prompt_len
    assert not np.array_equal(shared[0].evict_at[:P], shared[1].evict_at[:P])


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent"])
def test_prompt_only_policies_select_alike_within_a_group(model, policy):
    """The prefill selection depends on the prompt alone: one group's samples evict the same prompt keys at
    prefill (compress prefill_only: the prompt's only decisions)."""
    prompts = grouped_prompts()
    shared, _ = _run(model, prompts, _eviction(policy, compress="prefill_only"), share=True)
    P = shared[0].prompt_len
    for r in (shared[1], shared[2], shared[6]):
        assert np.array_equal(shared[0].evict_at[:P], r.evict_at[:P])


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_holds_on_a_shared_rollout(model, policy):
    """The independent check: the learner's shadow-masked forward on the recorded masks gives a shared
    rollout's log-probs (as tests/test_rollout.py checks the per-sample engine's)."""
    prompts = grouped_prompts(seed=5)
    temperature = 0.8
    res, _ = _run(model, prompts, _eviction(policy), share=True, seed=1, temperature=temperature)
    ids, evict_at, rec = replay_batch(prompts, res)
    with torch.no_grad():
        logits, targets, valid = response_logits(model, ids, evict_at, [len(p) for p in prompts],
                                                 [len(r.response_ids) for r in res])
    lp = token_logprobs(logits, targets, temperature)
    assert (lp - rec)[valid].abs().max().item() <= TOL


@pytest.mark.parametrize("policy", ["snapkv", "random"])
def test_simulated_eviction_shares_the_prefill(model, policy):
    """rollout.eviction.apply false records the prefill's decisions of a shared prefill as of a per-sample one."""
    prompts = grouped_prompts()
    ev = _eviction(policy, compress="prefill_only", apply=False)
    shared, _ = _run(model, prompts, ev, share=True)
    own, _ = _run(model, prompts, ev, share=False)
    for s, o in zip(shared, own, strict=True):
        assert s.response_ids == o.response_ids and np.array_equal(s.evict_at, o.evict_at)


def test_paged_kv_tokens_of_a_group():
    """vLLM's blocks per group: with prefix caching the prompt's full blocks once, the rest per sample."""
    from stages.bench.rollout import grouped_kv_tokens, unshared_kv_tokens

    assert grouped_kv_tokens(140, 16, 8, 1) == 140 + 8 * 16
    assert unshared_kv_tokens(140, 16, 8, 1) == 8 * 156
    assert grouped_kv_tokens(140, 16, 8, 16) == 128 + 8 * 32  # 12 prompt tokens + 16 new: two blocks each
    assert unshared_kv_tokens(140, 16, 8, 16) == 8 * 160
    assert grouped_kv_tokens(100, 10, 4, 128) == unshared_kv_tokens(100, 10, 4, 128) == 4 * 128


def test_bench_rollout_groups_without_vllm(tmp_path):
    """`bench rollout --model DIR --group-size G` (vLLM left out: tests/test_vllm_engine.py covers the engine):
    every smd row makes P x G x new tokens; sharing stores the prompt once per group, so fewer bytes per group."""
    from stages.bench.rollout import bench_rollout_groups, group_prompts

    prompts = group_prompts(5, 40, 100, seed=1)
    assert all(37 <= len(p) <= 42 for p in prompts) and len({len(p) for p in prompts}) > 1
    lines: list[str] = []
    rows = bench_rollout_groups(make_model_dir(tmp_path, "gqa"), 3, [24], num_prompts=2, new_tokens=3, batch_size=4,
                                repeats=1, engines=["smd-snapkv-shared", "smd-snapkv-per-sample", "smd-dense-shared"],
                                profile=True, print_fn=lines.append)
    by = {r["engine"]: r for r in rows}
    assert all(r["made"] == 2 * 3 * 3 for r in rows)
    assert by["smd-snapkv-shared"]["kv_bytes_per_group"] < by["smd-snapkv-per-sample"]["kv_bytes_per_group"]
    assert "torch threads" in lines[0] and "float32" in lines[0]
    # --profile: after the table, each engine's untimed run under torch.profiler, its operators ranked
    heads = [i for i, line in enumerate(lines) if line.startswith("# profile, ")]
    assert [lines[i].split(",")[1].split()[0] for i in heads] == list(by)
    assert lines[heads[0] + 1] == "| operator | self CPU s | calls |"
    for r in rows:
        ops = r["profile_ops"]
        seconds = [t for _, t, _ in ops]
        assert any(name.startswith("aten::") for name, _, _ in ops) and all(calls >= 1 for _, _, calls in ops)
        assert seconds == sorted(seconds, reverse=True) and seconds[0] > 0


def test_bench_rollout_groups_engine_at_a_batch_size(tmp_path):
    """`--engines smd-snapkv-shared@B`: the engine decodes B sequences together; its row says so, makes the same
    tokens, and its ratio to today's per-sample engine (at --batch-size) is its rate over that engine's."""
    from stages.bench.rollout import bench_rollout_groups, group_engine_spec

    assert group_engine_spec("smd-snapkv-shared@64", 16) == ("smd-snapkv-shared", 64)
    assert group_engine_spec("vllm-prefix-cache", 16) == ("vllm-prefix-cache", 16)
    for bad, said in [("smd-snapkv-shared@0", "whole number >= 1"), ("smd-snapkv-shared@x", "whole number >= 1"),
                      ("smd-fast@8", "choose from")]:
        with pytest.raises(SmdInputError, match=said):
            group_engine_spec(bad, 16)
    lines: list[str] = []
    rows = bench_rollout_groups(make_model_dir(tmp_path, "gqa"), 3, [24], num_prompts=2, new_tokens=3, batch_size=2,
                                repeats=1, engines=["smd-snapkv-per-sample", "smd-snapkv-shared@6"],
                                print_fn=lines.append)
    today, shared = rows
    assert (today["label"], today["batch_size"]) == ("smd-snapkv-per-sample", 2)
    assert (shared["label"], shared["engine"], shared["batch_size"]) == ("smd-snapkv-shared@6", "smd-snapkv-shared", 6)
    assert today["made"] == shared["made"] == 2 * 3 * 3
    assert today["vs_per_sample"] == 1.0
    assert shared["vs_per_sample"] == pytest.approx(shared["tokens_per_s"] / today["tokens_per_s"], rel=1e-12)
    assert shared["batch_kv_bytes"] == pytest.approx(shared["kv_bytes_per_group"] * 6 / 3, rel=1e-12)
    assert any(line.split()[1:3] == ["smd-snapkv-shared@6", "6"] for line in lines)


@pytest.mark.slow
def test_compiled_decoding_step_on_a_shared_rollout(model):
    """rollout.compile: the compiled decoding step over the two key sets gives the eager run's tokens and masks."""
    prompts = grouped_prompts()
    ev = _eviction("snapkv")
    compiled, _ = generate_batch(model, prompts, ev, 10, None, 0, 1.0, torch.Generator().manual_seed(0), compile=True)
    eager, _ = _run(model, prompts, ev, share=True)
    for c, e in zip(compiled, eager, strict=True):
        assert c.response_ids == e.response_ids and np.array_equal(c.evict_at, e.evict_at)
    assert within_float32_bound(_logprobs(compiled), _logprobs(eager), model_chain(model.config, 40))


@pytest.mark.parametrize("policy", ["snapkv", "random"])
def test_shared_rollout_names_every_tensors_device(model, policy):
    """With torch's default device `meta` (the model on the CPU), a tensor the shared path made without naming a
    device would fail; the results equal a normal run's (as tests/test_engine_device.py checks the engine)."""
    prompts = grouped_prompts()
    ev = _eviction(policy)
    want, _ = _run(model, prompts, ev, share=True)
    torch.set_default_device("meta")
    try:
        got, _ = _run(model, prompts, ev, share=True)
    finally:
        torch.set_default_device(None)
    for g, w in zip(got, want, strict=True):
        assert g.response_ids == w.response_ids and g.logprobs == w.logprobs and np.array_equal(g.evict_at, w.evict_at)
