"""bf16 end to end (issue 16, item 3): rollout and learner in bfloat16 on CPU with DeepSpeed's bf16 mode; the
parity gate's default follows model.dtype; the CUDA paths (FlexAttention's compiled backward, bf16 kernels) run
the same checks when a GPU is present (item 6)."""

from __future__ import annotations

import json

import pytest
import torch

from schemas.params.learner import PARITY_TOL_BY_DTYPE, LearnerParams
from stages.learner.deepspeed_runtime import ds_config
from stages.learner.train import run_learner
from tests.helpers import make_iteration, make_model_dir, make_params, make_prompts, max_param_diff, params_of


def test_parity_gate_default_per_dtype():
    cfg = LearnerParams()
    assert cfg.parity_tol is None
    assert [cfg.parity_tol_for(d) for d in ("float32", "bfloat16", "float16")] == [1e-4, 0.5, 0.5]
    assert LearnerParams(parity_tol=1e-3).parity_tol_for("bfloat16") == 1e-3  # an explicit value wins
    assert set(PARITY_TOL_BY_DTYPE) == {"float32", "bfloat16", "float16"}


def test_deepspeed_bf16_mode_follows_the_model_dtype():
    cfg = LearnerParams()
    assert ds_config(cfg, 1, 1, torch.bfloat16, cuda=False)["bf16"]["enabled"] is True
    assert ds_config(cfg, 1, 1, torch.float32, cuda=False)["bf16"]["enabled"] is False
    assert ds_config(cfg, 1, 1, torch.float16, cuda=False)["fp16"]["enabled"] is False  # fp16 only on CUDA


@pytest.mark.slow
def test_rollout_and_learn_in_bf16(tmp_path):
    """Rollout (bf16 model, evicting engine) -> compaction -> smd learn in bf16 under DeepSpeed's bf16 mode: the
    shadow mask passes the bf16 gate, the dense teacher's gap stays far larger, the policy trains and stays bf16."""
    model_dir = make_model_dir(tmp_path, "gqa")
    over = {"model.dtype": "bfloat16"}
    traj, masks = make_iteration(tmp_path, model_dir, make_prompts(tmp_path), make_params(**over))
    out = run_learner(make_params(**over), 1, model_dir, traj, masks, tmp_path / "policy")
    m = json.loads(out["details"].read_text())
    assert m["learner/parity_tol"] == 0.5
    gap = m["mismatch/logprob_abs_diff_max"]
    assert 0 < gap <= 0.5  # bf16: not exact, within the gate
    steps = json.loads(out["steps"].read_text())
    assert steps[0]["dense_mismatch/logprob_abs_diff_max"] > 5 * gap  # the mask still matters in bf16
    after = params_of(out["policy"])
    assert all(t.dtype == torch.bfloat16 for t in after.values())
    assert max_param_diff({k: v.float() for k, v in params_of(model_dir).items()},
                          {k: v.float() for k, v in after.items()}) > 0  # it trained


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_flex_cuda_forward_backward_equal_sdpa(dtype, tol):
    """On CUDA FlexAttention runs its own compiled backward: outputs and gradients equal the SDPA reference."""
    import numpy as np
    import torch.nn.functional as F

    from schemas.raw_masks import visibility
    from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
    from stages.learner.flex_backend import build_block_masks, flex_shadow_attention
    from stages.learner.shadow_attention import pad_evict_at

    rng = np.random.default_rng(0)
    ev_cfg = eviction_config("snapkv", 0.5, sinks=4, window=16)
    lengths, B, Hq, H, D = [300, 260, 100], 3, 8, 4, 64
    rows = [torch.from_numpy(synthetic_evict_at("snapkv", T, T * 3 // 4, 1, H, ev_cfg, rng).astype(np.int64))
            for T in lengths]
    T = max(lengths)
    evict_at = pad_evict_at(rows, T).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g, device="cuda", dtype=dtype, requires_grad=True)
               for h in (Hq, H, H))
    out = flex_shadow_attention(q, k, v, evict_at[0], D**-0.5, build_block_masks(evict_at, Hq, 128), 0)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    mask = visibility(evict_at[0]).repeat_interleave(Hq // H, 1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    scale = float(ref.abs().max())
    assert float((out - ref).abs().max()) <= tol * max(1.0, scale)
    for a, b in zip(grads, ref_grads):
        assert float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.abs().max()))


@cuda
def test_chunked_scores_cuda_bf16_equal_full_logits():
    from stages.learner.logprobs import chunked_token_scores
    from stages.learner.objectives import dense_teacher_kl_per_token, token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    B, R, Dm, V = 2, 300, 64, 151_936
    head = torch.nn.Linear(Dm, V, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(B, R, Dm, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(B, R, Dm, generator=g, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, V, (B, R), generator=g, device="cuda")
    valid = torch.ones(B, R, dtype=torch.bool, device="cuda")
    logits = head(hidden)
    with torch.no_grad():
        t_logits = head(teacher)
    ref = (token_logprobs(logits, targets) + dense_teacher_kl_per_token(logits, t_logits)).sum()
    ref_g = torch.autograd.grad(ref, (hidden, head.weight))
    out = chunked_token_scores(hidden, head, targets, valid, chunk_tokens=128, teacher_hidden=teacher)
    got = (out["logp"] + out["kl"]).sum()
    got_g = torch.autograd.grad(got, (hidden, head.weight))
    assert abs(float(got) - float(ref)) <= 1e-4 * max(1.0, abs(float(ref)))
    for a, b in zip(got_g, ref_g):  # bf16 gradients: ours accumulate the weight's in float32
        assert float((a.float() - b.float()).abs().max()) <= 2e-2 * max(1.0, float(b.float().abs().max()))
