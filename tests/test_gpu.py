"""The GPU's correctness checks (`pytest -m gpu`; part "correctness" of scripts/gpu_check.sh). Every test skips
cleanly without CUDA; on a GPU they check (docs/design.md "Devices"):

- the device rule on CUDA: `model.device: auto` is cuda:<local rank>; a float32 policy runs with TF32 off;
- rollout -> compaction -> learn on CUDA for every eviction policy: float32, TF32 off, the shadow-masked learner's
  log-probs equal the rollout's within 1e-5 (the invariant); bfloat16 within its gate (PARITY_TOL_BY_DTYPE) and
  still far from the dense learner's gap; the learner runs under DeepSpeed on one GPU with the flex backend
  (`learner.attention_backend: auto`) and trains;
- flex against the SDPA reference through the model, in values and gradients (float32 and bf16).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schemas.params.learner import PARITY_TOL_BY_DTYPE
from schemas.params.rollout import POLICIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 1e-5  # the invariant in float32 (docs/design.md section 3)
F32_EPS = torch.finfo(torch.float32).eps


def _cuda_params(**over):
    from tests.helpers import make_params

    return make_params(**{"model.device": "cuda", **over})


def test_device_rule_on_cuda(tmp_path):
    from stages.common.model import load_policy, resolve_device
    from tests.helpers import make_model_dir

    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    model = load_policy(make_model_dir(tmp_path), "float32", device=resolve_device("auto", 0))
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert torch.backends.cuda.matmul.allow_tf32 is False  # float32 parity: TF32 off


@pytest.fixture(scope="module")
def gpu_root(tmp_path_factory):
    from tests.helpers import make_model_dir, make_prompts

    root = tmp_path_factory.mktemp("gpu")
    return root, make_model_dir(root, "gqa"), make_prompts(root, lengths=(41, 23, 34, 29), seed=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
def test_rollout_compact_learn_parity_on_cuda(gpu_root, tmp_path, policy, dtype):
    """The stages as `dvc repro` runs them, with model.device cuda: rollout on the GPU, compaction, then learn
    (DeepSpeed, one GPU, flex): the parity pass before the first step is the invariant."""
    from stages.learner.train import run_learner
    from tests.helpers import make_iteration

    root, model_dir, prompts = gpu_root
    over = {"rollout.eviction.policy": policy, "rollout.prompts_per_iteration": 4, "rollout.max_new_tokens": 12,
            "model.dtype": dtype}
    traj, masks = make_iteration(tmp_path, model_dir, prompts, _cuda_params(**over))
    out = run_learner(_cuda_params(**over), 1, model_dir, traj, masks, tmp_path / "policy")
    m = json.loads(out["details"].read_text())
    gap = m["mismatch/logprob_abs_diff_max"]
    assert m["attention_backend"] == "flex" and m["learner/peak_device_mb"] > 0
    if dtype == "float32":
        assert gap <= TOL, f"{policy}: float32 parity {gap:.3g} > {TOL}"
    else:
        assert gap <= PARITY_TOL_BY_DTYPE["bfloat16"], f"{policy}: bf16 parity {gap:.3g}"
    steps = json.loads(out["steps"].read_text())
    if policy != "dense":  # the mask matters: the dense teacher is far off
        assert steps[0]["dense_mismatch/logprob_abs_diff_max"] > 5 * max(gap, TOL)


def test_learner_under_deepspeed_on_one_gpu_trains(gpu_root, tmp_path):
    from stages.learner.train import run_learner
    from tests.helpers import make_iteration, max_param_diff, params_of

    root, model_dir, prompts = gpu_root
    params = _cuda_params()
    traj, masks = make_iteration(tmp_path, model_dir, prompts, params)
    out = run_learner(params, 1, model_dir, traj, masks, tmp_path / "policy")
    m = json.loads(out["details"].read_text())
    assert m["learner/world_size"] == 1 and m["learner/steps"] == 1 and m["learner/peak_device_mb"] > 0
    assert m["mismatch/logprob_abs_diff_max"] <= TOL
    assert max_param_diff(params_of(model_dir), params_of(out["policy"])) > 0  # it trained
    assert (out["trainer_state"] / "trainer_state.json").is_file()


def _model_batch(tmp_path, dtype: torch.dtype):
    """Tiny GQA model on the GPU and a 3-row right-padded batch with synthetic H2O masks."""
    from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
    from stages.common.model import load_policy
    from stages.learner.shadow_attention import pad_evict_at
    from tests.helpers import make_model_dir

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    model = load_policy(make_model_dir(tmp_path, "gqa"), name, device="cuda")
    lengths, prompts = [300, 177, 251], [200, 140, 170]
    rng = np.random.default_rng(3)
    ev_cfg = eviction_config("h2o", 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at("h2o", T, P, 2, 2, ev_cfg, rng).astype(np.int64))
            for T, P in zip(lengths, prompts)]
    T = max(lengths)
    ids = torch.randint(4, 200, (3, T), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    return model, ids.cuda(), pad_evict_at(rows, T).cuda(), prompts, [t - p for t, p in zip(lengths, prompts)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_equals_sdpa_through_the_model_on_cuda(tmp_path, dtype):
    """The learner's forward and backward on the flex backend (FlexAttention's compiled CUDA kernels, block masks
    from evict_at) against the SDPA reference (explicit boolean mask): log-probs and every parameter gradient."""
    from stages.learner.flex_backend import build_block_masks
    from stages.learner.shadow_attention import response_logits

    model, ids, evict_at, prompts, resp = _model_batch(tmp_path, dtype)
    results = {}
    for backend in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        extra = {"smd_block_masks": build_block_masks(evict_at, 4, 128)} if backend == "flex" else {}
        sel, targets, valid = response_logits(model, ids, evict_at, prompts, resp, backend, **extra)
        logp = torch.log_softmax(sel.float(), -1).gather(-1, targets.unsqueeze(-1))[..., 0]
        logp[valid].sum().backward()
        results[backend] = (logp.detach()[valid], {n: p.grad.float().clone() for n, p in model.named_parameters()})
    if dtype == torch.float32:
        # attention sums over <= T keys per row: a few hundred float32 roundings, bounded by T * eps (relative)
        T = ids.shape[1]
        assert float((results["flex"][0] - results["sdpa"][0]).abs().max()) <= TOL
        grad_tol = 4 * T * F32_EPS
    else:  # bf16 (8 mantissa bits): the CPU bf16 gate's relative 3e-2 for values and gradients
        assert float((results["flex"][0] - results["sdpa"][0]).abs().max()) <= PARITY_TOL_BY_DTYPE["bfloat16"]
        grad_tol = 3e-2
    for name, g in results["sdpa"][1].items():
        diff = float((results["flex"][1][name] - g).abs().max())
        assert diff <= grad_tol * max(1.0, float(g.abs().max())), f"{name}: {diff:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_attention_takes_a_fused_kernel_on_cuda(dtype):
    """The rollout engine's SDPA calls (decoding over the slot cache's validity mask, the padded and the unpadded
    prefill, GQA with 4 query heads per KV head) run with SDPA restricted to flash / memory-efficient (issue 32:
    `enable_gqa` with a mask, or in float32, falls to the math kernel), and equal the enable_gqa path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.common.kvcache.sampler import sdpa_gqa, sdpa_layout

    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, G, D, C, P = 2, 2, 4, 128, 200, 96

    def qkv(Q, S):
        return [torch.randn(*shape, generator=g).to("cuda", dtype)
                for shape in ((B, H * G, Q, D), (B, H, S, D), (B, H, S, D))]

    valid = torch.rand(B, H, 1, C, generator=g) < 0.7
    valid[..., 0] = True
    i, pad = torch.arange(P), torch.tensor([0, 5])
    padded = ((i[None, :] <= i[:, None])[None] & (i[None, None, :] >= pad[:, None, None])) | torch.eye(P).bool()
    calls = [("decode", qkv(1, C), {"mask": valid.cuda()}), ("padded prefill", qkv(P, P), {"mask": padded[:, None].cuda()}),
             ("unpadded prefill", qkv(P, P), {"causal": True})]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, (q, k, v), kw in calls:
        ref = sdpa_gqa(q, k, v, D**-0.5, layout="gqa", **kw)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            out = sdpa_gqa(q, k, v, D**-0.5, **kw)  # raises "No available kernel" if only math would take it
        layout = sdpa_layout(q, k, "mask" in kw)
        assert float((out.float() - ref.float()).abs().max()) <= tol, f"{name} ({layout})"
