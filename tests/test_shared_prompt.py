"""A group's prompt, computed once (docs/design.md §3c): the learner's shared-prompt forward equals the per-sample
forward (float64: hidden states, the dense teacher's, the loss and every parameter's gradient to 1e-10 relative)
for every eviction policy, backend and forward mode, with padding and groups split across micro-batches; through
the whole learner (float32) the shared and per-sample runs agree within float32 rounding and the parity gate
holds. The learner's dense attention (`smd_sdpa_gqa`) equals transformers' SDPA on the shared prompt's cache in
float64 without repeating KV heads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from schemas.params.rollout import POLICIES, EvictionParams
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import attention_implementation, load_policy
from stages.learner.data import load_learner_data
from stages.learner.dense_attention import SDPA_GQA_ATTENTION, use_sdpa_gqa
from stages.learner.shadow_attention import response_hidden, response_hidden_with_teacher
from stages.learner.shared_prompt import (
    prompt_runs,
    shared_prefix_rows,
    shared_prompt_hidden,
    suffix_evict_at,
)
from stages.learner.train import group_grouped, process_rows, run_learner
from tests.helpers import (
    float64_policy,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    model_chain,
    params_of,
    random_prompts,
    replay_batch,
    requires_cpu_flex,
    within_float32_bound,
)

REL = 1e-10  # float64: the two computations differ only in summation order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("shared"), "gqa")


def grouped_rollout(model_dir, policy: str, seed: int = 0):
    """Rows of three groups (3, 2 and 1 samples) with prompts of three lengths (right padding in the learner's
    batch), sampled by the evicting engine: (ids [B, T], evict_at [L, B, H, T], prompt_lens, resp_lens)."""
    model = load_policy(model_dir)
    a, b, c = random_prompts([30, 23, 17], seed=seed + 3)
    prompts = [a, a, a, b, b, c]
    eviction = EvictionParams(policy=policy, keep_ratio=0.5, window=4, sinks=2)
    results, _ = generate_batch(model, prompts, eviction, 10, None, 0, 1.0, torch.Generator().manual_seed(seed))
    ids, evict_at, _ = replay_batch(prompts, results)
    return ids, evict_at, [len(p) for p in prompts], [len(r.response_ids) for r in results]


def float64_model(model_dir):
    """The policy computed in float64 throughout (`tests.helpers.float64_policy`: RMSNorm and RoPE's cos/sin too,
    which transformers computes in float32 whatever the model's dtype)."""
    return float64_policy(model_dir)


def float64_scores(model, hidden, teacher, targets, valid, temperature: float = 0.8):
    """Per token log-prob and teacher KL in float64 from the lm head (the learner's chunked scoring rounds its
    logits to float32; the exactness of the shared forward is checked here in float64)."""
    head = model.get_output_embeddings()
    logq = torch.log_softmax(head(hidden) / temperature, dim=-1)
    logp = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * valid
    kl = None
    if teacher is not None:
        logt = torch.log_softmax(head(teacher.detach()) / temperature, dim=-1)
        kl = (logt.exp() * (logt - logq)).sum(-1) * valid
    return logp, kl


def loss_and_grads(model, forward, ids, evict_at, prompt_lens, resp_lens, weights, mode: str, backend: str,
                   batch_runs: bool = True):
    """A GRPO-shaped loss (weighted log-probs, plus the weighted teacher KL in the teacher modes) of one forward
    and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    ev = None if mode == "dense" else evict_at
    if forward == "shared":
        hidden, teacher, targets, valid = shared_prompt_hidden(model, ids, ev, prompt_lens, resp_lens, backend, 16,
                                                               teacher=mode == "teacher", batch_runs=batch_runs)
    elif mode == "teacher":
        hidden, teacher, targets, valid = response_hidden_with_teacher(model, ids, ev, prompt_lens, resp_lens,
                                                                       backend, 16)
    else:
        hidden, targets, valid = response_hidden(model, ids, ev, prompt_lens, resp_lens, backend)
        teacher = None
    logp, kl = float64_scores(model, hidden, teacher, targets, valid)
    loss = (logp * weights[:, : logp.shape[1]]).sum()
    if kl is not None:
        loss = loss + 0.1 * kl.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), hidden.detach(), None if teacher is None else teacher.detach(), grads


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = max(float(want.abs().max()), 1e-30)
    err = float((got - want).abs().max())
    assert err <= REL * scale, f"{what}: max |diff| {err:.3g} > {REL:g} x {scale:.3g}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["masked", "teacher", "dense"])
def test_shared_forward_equals_per_sample_float64(model_dir, policy, mode):
    """Loss, hidden states (policy and dense teacher) and every parameter's gradient of the shared-prompt forward
    equal the per-sample forward's in float64, for every eviction policy's real rollout masks, with right padding
    (three prompt lengths) and groups of 3, 2 and 1 rows."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, policy)
    if policy != "dense":
        assert bool((evict_at[:, :, :, :17] < 30 + 10).any())  # the masks evict prompt keys
    model = float64_model(model_dir)
    weights = torch.randn(len(prompt_lens), 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = loss_and_grads(model, "per_sample", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa")
    got = loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa")
    assert_close(got[0], want[0], "loss")
    assert_close(got[1], want[1], "policy hidden")
    if mode == "teacher":
        assert_close(got[2], want[2], "teacher hidden")
    assert want[3].keys() == got[3].keys()
    for name in want[3]:
        assert_close(got[3][name], want[3][name], f"grad {name}")


@pytest.mark.parametrize("batch_runs", [True, False], ids=["runs-batched", "run-by-run"])
@pytest.mark.parametrize("mode", ["masked", "teacher", "dense"])
def test_shared_forward_tiled_float64(model_dir, mode, batch_runs):
    """The tiled backend replays the mask on the shared prompt's cache as the sdpa reference does on the
    per-sample forward (float64), with the micro-batch's three runs in one prompt call and one suffix call, and a
    run at a time; the dense passes (the teacher's, the dense objective's) run on it too."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "h2o", seed=2)
    model = float64_model(model_dir)
    weights = torch.randn(len(prompt_lens), 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = loss_and_grads(model, "per_sample", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa")
    got = loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "tiled", batch_runs)
    assert_close(got[0], want[0], "loss")
    for name in want[3]:
        assert_close(got[3][name], want[3][name], f"grad {name}")


@requires_cpu_flex
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["masked", "teacher"])
def test_shared_forward_flex_float32(model_dir, mode):
    """FlexAttention (float32 only on the CPU) on the shared prompt's cache, shared up to a block boundary (16
    here: the rest of the prompt runs per sample), against the per-sample sdpa reference in float32: the loss and
    every gradient within the float32 bound of the model's reduction chain."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "h2o", seed=2)
    model = load_policy(model_dir)
    weights = torch.randn(len(prompt_lens), 16, generator=torch.Generator().manual_seed(2))
    want = loss_and_grads(model, "per_sample", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa")
    got = loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "flex")
    chain = model_chain(model.config, ids.shape[1]) + ids.numel()
    assert within_float32_bound(got[0], want[0], chain)
    for name in want[3]:
        assert within_float32_bound(got[3][name], want[3][name], chain), name


def test_batched_runs_take_two_decoder_calls(model_dir, monkeypatch):
    """A micro-batch of three groups runs its prompts in one decoder call and its suffixes in another (and the
    dense teacher's suffixes in a third), not a prompt and a suffix call per group."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "snapkv")
    model = load_policy(model_dir)
    decoder = model.model
    calls = []
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    with torch.no_grad():
        shared_prompt_hidden(model, ids, evict_at, prompt_lens, resp_lens, "sdpa", 16, teacher=True)
    assert [c[0] for c in calls] == [3, 6, 6]  # 3 prompts; 6 rows densely (teacher), then masked
    calls.clear()
    with torch.no_grad():
        shared_prompt_hidden(model, ids, evict_at, prompt_lens, resp_lens, "sdpa", 16, teacher=True,
                             batch_runs=False)
    assert [c[0] for c in calls] == [1, 3, 3, 1, 2, 2, 1, 1, 1]


def test_suffix_evict_at_moves_the_mask_with_the_frame():
    """Hand-checked: two rows whose shared prefixes end at 2 and 3 in a frame of 3, suffixes of width 3. Row 0's
    token t >= 2 moves to t + 1; the frame's padding column 2 of row 0 and the columns past the batch's 5 tokens
    see only themselves (c + 1); a dense pass sees every real key."""
    ev = torch.tensor([[9, 9, 4, 5, 6], [9, 9, 9, 4, 5]]).view(1, 2, 1, 5)  # [L, B, H, T]
    got = suffix_evict_at(ev, [2, 3], 3, 3, 1, 1)
    assert got[0, 0, 0].tolist() == [10, 10, 3, 5, 6, 7]  # tokens 0, 1 | pad | tokens 2, 3, 4 (+1)
    assert got[0, 1, 0].tolist() == [9, 9, 9, 4, 5, 6]  # tokens 0-2 | tokens 3, 4 | past the batch (5 + 1)
    dense = suffix_evict_at(None, [2, 3], 3, 3, 1, 1)
    assert dense[0, 0, 0, 2] == 3 and bool((dense[0, 0, 0, [0, 1, 3, 4, 5]] > 6).all())


def test_prompt_runs_and_prefix_rows():
    """Runs are maximal stretches of adjacent rows with equal prompt tokens (padding and responses ignored); the
    shared rows stop at the prompt's last token, at the first eviction, and at a block boundary."""
    ids = torch.tensor([[5, 6, 7, 1, 0], [5, 6, 7, 2, 3], [5, 6, 8, 1, 0], [5, 6, 7, 4, 0], [5, 6, 7, 9, 9]])
    assert prompt_runs(ids, [3, 3, 3, 3, 3]) == [(0, 2), (2, 3), (3, 5)]
    assert prompt_runs(ids, [3, 3, 3, 2, 2]) == [(0, 2), (2, 3), (3, 5)]
    assert prompt_runs(ids[:1], [3]) == [(0, 1)]
    ev = torch.full((2, 3, 1, 12), 12)
    assert shared_prefix_rows(10, ev) == 9
    ev[1, 2, 0, 4] = 6  # evicted while the prompt is still running: rows from 6 on differ per sample
    assert shared_prefix_rows(10, ev) == 6
    assert shared_prefix_rows(10, ev, align=4) == 4
    assert shared_prefix_rows(10, None, align=4) == 8
    assert shared_prefix_rows(1, None) == 0


# ------------------------------------------------------------------------------------------ through the learner
@pytest.fixture(scope="module")
def iteration(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("shared-learner")
    prompts = make_prompts(root, lengths=(30, 45, 38))
    params = make_params(**{"rollout.group_size": 4, "rollout.batch_size": 12, "rollout.max_new_tokens": 8,
                            "learner.micro_batch_size": 3})
    traj, masks = make_iteration(root, model_dir, prompts, params)
    return root, params, traj, masks


def test_micro_batches_hold_groups(iteration):
    """With shared prompts a micro-batch holds whole groups or parts of one, each group's rows adjacent; processes
    take whole groups; every row is scheduled once."""
    _, params, traj, masks = iteration
    data = load_learner_data(params.learner, traj, masks, 2, 2, need_masks=True)
    rows = list(range(len(data)))
    micro = group_grouped(data, rows, 3)
    assert sorted(r for m in micro for r in m) == rows
    order = [int(data.groups[r]) for m in micro for r in m]
    assert order == sorted(order, key=order.index)  # groups contiguous in the schedule
    assert any(len({int(data.groups[r]) for r in m}) == 2 for m in micro)  # a group split across micro-batches
    parts = [process_rows(data, rows, rank, 2, True) for rank in range(2)]
    assert sorted(parts[0] + parts[1]) == rows
    assert not {int(data.groups[r]) for r in parts[0]} & {int(data.groups[r]) for r in parts[1]}


@pytest.mark.parametrize("objective", ["smd", "naive", "sparse_rl"])
def test_learner_shared_equals_per_sample(tmp_path, model_dir, iteration, objective):
    """One learn call with shared prompts and one without (groups of 4 split by micro-batches of 3): the same
    parity (within the gate), the same loss terms and the same new weights within float32 rounding."""
    _, params, traj, masks = iteration
    out = {}
    for shared in (True, False):
        p = params.model_copy(deep=True)
        p.learner = p.learner.model_copy(update={"objective": objective, "shared_prompt": shared})
        res = run_learner(p, 1, model_dir, traj, masks, tmp_path / f"policy-{shared}")
        out[shared] = (json.loads(res["details"].read_text()), params_of(res["policy"]))
    (m_shared, w_shared), (m_per, w_per) = out[True], out[False]
    if objective == "smd":  # the shadow-masked learner reproduces the sampler (the dense ones do not, by design)
        assert m_shared["mismatch/logprob_abs_diff_max"] <= 1e-5
    for key in ("loss/total", "loss/pg", "policy/entropy", "mismatch/logprob_abs_diff_max"):
        if key in m_per:
            assert abs(m_shared[key] - m_per[key]) <= 1e-5 * max(1.0, abs(m_per[key])), key
    # Adam's first step is ~lr x sign(g): where |g| is near Adam's eps a float32 rounding of g moves a weight by a
    # visible part of lr, so the runs are compared by the norm of the whole update, not weight by weight
    base = params_of(model_dir)
    moved = sum(float((w_per[k] - base[k]).double().pow(2).sum()) for k in base) ** 0.5
    diff = sum(float((w_shared[k] - w_per[k]).double().pow(2).sum()) for k in base) ** 0.5
    assert moved > 1e-3  # the step moved the weights (lr 1e-3) ...
    assert diff <= 1e-3 * moved, (diff, moved)  # ... and both runs moved them the same way


# ------------------------------------------------ the learner's dense attention (stages.learner.dense_attention)
@pytest.mark.parametrize("mode", ["dense", "teacher"])
def test_grouped_sdpa_equals_transformers_sdpa_float64(model_dir, monkeypatch, mode):
    """The shared-prompt forward run by run (a cached prompt, then the suffix under transformers' mask) with `smd_sdpa_gqa`
    equals it with transformers' `sdpa` in float64 (1e-10 relative), and never repeats a KV head."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "snapkv")
    model = float64_model(model_dir)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # a GQA model
    weights = torch.randn(len(prompt_lens), 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa",
                          batch_runs=False)
    repeats = []
    real_repeat = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: repeats.append(1) or real_repeat(*a))
    with attention_implementation(model, SDPA_GQA_ATTENTION):
        got = loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa",
                          batch_runs=False)
    assert not repeats
    assert_close(got[0], want[0], "loss")
    assert_close(got[1], want[1], "hidden")
    for name in want[3]:
        assert_close(got[3][name], want[3][name], f"grad {name}")
    # transformers' own SDPA repeats the KV heads here (the mask is why): the copies this function removes
    loss_and_grads(model, "shared", ids, evict_at, prompt_lens, resp_lens, weights, mode, "sdpa",
                          batch_runs=False)
    assert repeats


def test_only_sdpa_models_switch_to_grouped_sdpa(model_dir):
    model = float64_model(model_dir)
    use_sdpa_gqa(model, None)
    assert model.config._attn_implementation == SDPA_GQA_ATTENTION
    other = float64_model(model_dir)
    other.config._attn_implementation = "eager"
    use_sdpa_gqa(other)
    assert other.config._attn_implementation == "eager"


def test_read_only_prefix_cache_reads_the_prefix_and_keeps_nothing(model_dir):
    """The dense teacher's cache over the policy's prefix (`read_only_prefix_cache`): a forward of the suffix on it
    gives exactly the hidden states transformers' `DynamicCache` over the same prefix gives (float64; the same
    operations), and afterwards it holds the prefix alone -- the `DynamicCache` holds every layer's whole sequence
    -- so the teacher's pass frees each layer's appended keys and values as it leaves the layer."""
    from transformers import DynamicCache

    from stages.learner.shadow_attention import decoder_of, read_only_prefix_cache

    model = float64_policy(model_dir)
    ids = torch.tensor([random_prompts([29], seed=5)[0]])
    s, T = 17, ids.shape[1]
    positions = torch.arange(T).unsqueeze(0)
    decoder = decoder_of(model)
    with torch.no_grad():
        prefix = DynamicCache(config=model.config)
        decoder(input_ids=ids[:, :s], position_ids=positions[:, :s], past_key_values=prefix, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in prefix.layers]
        read_only = read_only_prefix_cache(kv, model.config)
        kept = DynamicCache(kv, config=model.config)
        got = decoder(input_ids=ids[:, s:], position_ids=positions[:, s:], past_key_values=read_only,
                      use_cache=True).last_hidden_state
        want = decoder(input_ids=ids[:, s:], position_ids=positions[:, s:], past_key_values=kept,
                       use_cache=True).last_hidden_state
        whole = decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[:, s:]
    assert torch.equal(got, want)
    assert torch.allclose(got, whole, rtol=REL, atol=REL)  # the prefix cache is the whole sequence's first rows
    assert read_only.get_seq_length() == s and kept.get_seq_length() == T
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(read_only.layers, kv))
    new_k = torch.ones(1, kv[0][0].shape[1], 2, kv[0][0].shape[3], dtype=torch.float64)
    new_v = -new_k
    k, v = read_only.layers[0].update(new_k, new_v)
    assert torch.equal(k, torch.cat([kv[0][0], new_k], dim=-2)) and torch.equal(v, torch.cat([kv[0][1], new_v], dim=-2))
    assert read_only.get_seq_length() == s


@pytest.mark.parametrize("batch_runs", [True, False], ids=["runs-batched", "run-by-run"])
def test_tiled_rows_keep_one_copy_of_their_prompt_keys(model_dir, batch_runs):
    """On the tiled backend a group's rows read their prompt's keys and values in place: what autograd keeps for
    the backward holds no per-row copy of a prompt cache (no [rows, H, >= prompt rows, D] tensor), where the sdpa
    backend's concatenation keeps one per layer (the check can fail)."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "snapkv", seed=1)
    model = load_policy(model_dir)
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    rows_before = min(prompt_lens) - 1  # every run shares at least this many prompt rows
    widest = max(resp_lens) + max(prompt_lens) - min(prompt_lens) + 1  # no suffix of a row reaches it

    def per_row_prompt_copies(backend: str) -> int:
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden, _, _, _ = shared_prompt_hidden(model, ids, evict_at, prompt_lens, resp_lens, backend, 16,
                                                   teacher=True, batch_runs=batch_runs)
        hidden.sum().backward()
        return sum(1 for s in shapes if len(s) == 4 and s[0] in suffix_rows and s[1] == H and s[3] == D
                   and s[2] >= max(rows_before, widest))

    # the suffix passes' batch sizes: all rows at once, or each run of several rows (the prompt passes hold one
    # row per run)
    runs = prompt_runs(ids, prompt_lens)
    suffix_rows = {len(prompt_lens)} if batch_runs else {e - a for a, e in runs if e - a > 1}
    assert len(runs) == 3 and not suffix_rows & ({len(runs)} if batch_runs else {1})

    assert per_row_prompt_copies("sdpa") >= cfg.num_hidden_layers
    assert per_row_prompt_copies("tiled") == 0
