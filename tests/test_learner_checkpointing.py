"""Activation checkpointing with the shadow attention (issue 16, item 4): the decoder layers recompute their
activations in backward (checked: the attention runs again during backward) and the gradients equal those without
checkpointing, for the SDPA and FlexAttention backends, and through `learn`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schemas.params.learner import LearnerParams
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.common.model import load_policy
from stages.learner.flex_backend import build_block_masks
from stages.learner.logprobs import chunked_token_scores, lm_head_of
from stages.learner.objectives import ObjectiveBatch, group_advantages, objective_loss
from stages.learner.shadow_attention import (
    checkpointed_layers,
    enable_layer_checkpointing,
    pad_evict_at,
    response_hidden,
    response_hidden_with_teacher,
)
from stages.learner.train import run_learner
from tests.helpers import (
    TOL,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    params_of,
    requires_cpu_flex,
)


def _batch():
    rng = np.random.default_rng(1)
    lengths, prompt = [70, 61, 55], 40
    ev = eviction_config("snapkv", 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at("snapkv", T, prompt, 2, 2, ev, rng).astype(np.int64)) for T in lengths]
    T = max(lengths)
    g = torch.Generator().manual_seed(1)
    return (torch.randint(4, 200, (3, T), generator=g), pad_evict_at(rows, T), [prompt] * 3,
            [n - prompt for n in lengths], -torch.rand(3, max(lengths) - prompt, generator=g))


def _smd_grads(model, batch, backend: str, checkpointing: bool):
    """Gradients of the learner's smd loss (masked policy with gradient, dense teacher) and the number of attention
    calls that ran during backward (the recomputation)."""
    ids, evict_at, prompts, resp, rollout = batch
    calls = {"backward": 0, "in_backward": False}

    def count(*_):
        calls["backward"] += calls["in_backward"]

    hooks = [layer.self_attn.register_forward_hook(count) for layer in model.model.layers]
    with checkpointed_layers(model) if checkpointing else torch.enable_grad():
        if backend == "flex":  # the teacher as a separate pass, the masked policy through FlexAttention
            with torch.no_grad():
                teacher, _, _ = response_hidden(model, ids, None, prompts, resp)
            hidden, targets, valid = response_hidden(model, ids, evict_at, prompts, resp, "flex",
                                                     smd_block_masks=build_block_masks(evict_at, 4, 16))
        else:
            hidden, teacher, targets, valid = response_hidden_with_teacher(model, ids, evict_at, prompts, resp, backend)
    scores = chunked_token_scores(hidden, lm_head_of(model), targets, valid, temperature=0.8, teacher_hidden=teacher)
    loss, _ = objective_loss(LearnerParams(), ObjectiveBatch(
        advantages=group_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=3), mask=valid, rollout_logp=rollout,
        masked_logp=scores["logp"], kl_per_token=scores["kl"]))
    model.zero_grad()
    calls["in_backward"] = True
    loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls["backward"]


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("flex", marks=requires_cpu_flex), "tiled"])
def test_checkpointed_layers_give_the_same_gradients(tmp_path, backend):
    model_dir = make_model_dir(tmp_path, "gqa")
    batch = _batch()
    ref, recomputed = _smd_grads(load_policy(model_dir), batch, backend, checkpointing=False)
    assert recomputed == 0
    model = load_policy(model_dir)
    enable_layer_checkpointing(model)
    model.eval()
    got, recomputed = _smd_grads(model, batch, backend, checkpointing=True)
    assert recomputed == len(model.model.layers)  # each layer's attention ran again in backward
    assert not any(m.training for m in model.modules())  # flags restored: the model stays in eval mode
    for name, g in ref.items():
        assert float((got[name] - g).abs().max()) <= TOL, name


@pytest.mark.slow
def test_learn_with_gradient_checkpointing_makes_the_same_update(tmp_path):
    model_dir = make_model_dir(tmp_path, "gqa")
    traj, masks = make_iteration(tmp_path, model_dir, make_prompts(tmp_path), make_params())
    # Recomputing a layer in the backward rounds its gradient differently; Adam's first step lr * g / (|g| + eps)
    # amplifies that by lr / eps where |g| ~ eps, so lr 1e-4 and adam_eps 1e-6 as in the other equal-update tests
    # (with lr 1e-3, eps 1e-8 the update differed by 1.2e-6 under ATEN_CPU_CAPABILITY=avx2 on an AMD EPYC)
    over = {"learner.lr": 1e-4, "learner.adam_eps": 1e-6}
    outs = {flag: run_learner(make_params(**over, **{"learner.gradient_checkpointing": flag}), 1, model_dir, traj, masks,
                        tmp_path / str(flag) / "policy") for flag in (False, True)}
    m = json.loads(outs[True]["details"].read_text())
    assert m["config"]["learner"]["gradient_checkpointing"] is True and m["loss/kl_dense"] > 0
    assert max_param_diff(params_of(outs[False]["policy"]), params_of(outs[True]["policy"])) <= 1e-6
    assert max_param_diff(params_of(model_dir), params_of(outs[True]["policy"])) > 1e-5  # it trained
