"""`smd_sdpa_gqa` (stages.learner.dense_attention): the learner's dense attention equals transformers' SDPA
attention in float64 (loss, hidden states and every gradient of the shared-prompt forward, whose suffix runs
under a mask), takes SDPA's own GQA on the CPU instead of repeating KV heads, and is what the learner runs."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from stages.common.model import attention_implementation
from stages.learner.dense_attention import SDPA_GQA_ATTENTION, use_sdpa_gqa
from tests.helpers import float64_policy, make_model_dir
from tests.test_shared_prompt import assert_close, grouped_rollout, loss_and_grads


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("dense_attn"), "gqa")


@pytest.mark.parametrize("mode", ["dense", "teacher"])
def test_grouped_sdpa_equals_transformers_sdpa_float64(model_dir, monkeypatch, mode):
    """The shared-prompt forward run by run (a cached prompt, then the suffix under transformers' mask) with `smd_sdpa_gqa`
    equals it with transformers' `sdpa` in float64 (1e-10 relative), and never repeats a KV head."""
    ids, evict_at, prompt_lens, resp_lens = grouped_rollout(model_dir, "snapkv")
    model = float64_policy(model_dir)
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


def test_only_sdpa_models_switch(model_dir):
    model = float64_policy(model_dir)
    use_sdpa_gqa(model, None)
    assert model.config._attn_implementation == SDPA_GQA_ATTENTION
    other = float64_policy(model_dir)
    other.config._attn_implementation = "eager"
    use_sdpa_gqa(other)
    assert other.config._attn_implementation == "eager"
