"""The engine on any device: every tensor on the model's device, the budget schedule on the host, a decode loop
whose results do not depend on how often it checks for the stop (docs/design.md, Devices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.params.rollout import POLICIES, EvictionParams
from schemas.raw_masks import budget
from stages.common.kvcache.sampler import generate_batch, stop_check_interval
from stages.common.kvcache.schedule import budget_array, budget_schedule
from stages.common.model import load_policy
from tests.helpers import make_model_dir, random_prompts

PROMPTS = random_prompts([37, 50, 23, 50], seed=5)  # left-padded in a batch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("dev"), "gqa"))


def _rows(results):
    return [(r.response_ids, r.logprobs, r.finish_reason, r.evict_at.tolist(), r.kv_peak_tokens, r.kv_dense_tokens)
            for r in results]


def _generate(model, policy, eos=None, **kwargs):
    ev = EvictionParams(policy=policy, keep_ratio=0.5, window=4, **kwargs.pop("eviction", {}))
    generator = torch.Generator(device="cpu").manual_seed(3)
    return generate_batch(model, PROMPTS, ev, 12, eos, 0, 1.0, generator=generator, **kwargs)


@pytest.mark.parametrize("eviction", [
    {"policy": "snapkv", "keep_ratio": 0.5, "window": 4},
    {"policy": "h2o", "keep_ratio": 0.3, "window": 8, "sinks": 2},
    {"policy": "recent", "keep_ratio": 0.7, "window": 4, "max_tokens": 40},
    {"policy": "random", "keep_ratio": 0.5, "window": 4, "compress": "prefill_only"},
    {"policy": "dense"},
])
def test_budget_array_equals_the_scalar_rule(eviction):
    ev = EvictionParams(**eviction).model_dump()
    n = np.arange(1, 3000)
    for prompt_len in (1, 17, 500):
        got = budget_array(n, ev, np.full_like(n, prompt_len))
        want = [budget(int(k), ev, prompt_len) for k in n]
        assert got.tolist() == want


def test_schedule_by_hand():
    # snapkv keep 0.5, window 4, no sinks: budget(n) = max(4, ceil(n / 2)) capped by n; prompts of 6 and 9 tokens.
    ev = EvictionParams(policy="snapkv", keep_ratio=0.5, window=4).model_dump()
    s = budget_schedule(np.array([6, 9]), 4, ev, evicts=True, evicts_while_decoding=True)
    assert s.prefill_keep.tolist() == [3, 4]  # keep_after(P) = budget(P + 1) - 1: ceil(7/2) - 1, ceil(10/2) - 1
    assert s.step_keep.tolist() == [[3, 5], [4, 5], [4, 6]]  # budget(P + s + 2) - 1
    # after prefill 3 and 4 cached; each step adds one: 4 > 3 and 5 = 5, then 4 = 4 and 6 > 5, then 5 > 4, 6 = 6
    assert s.step_excess == [1, 1, 1]
    assert s.capacity == 7  # budget(9 + 4) = ceil(13 / 2)


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_creates_no_tensor_off_the_model_device(model, policy):
    """With torch's default device `meta` and the model on the CPU, any tensor the engine made without naming a
    device would land on meta and fail when it meets a real one; the results equal those of a normal run."""
    eos = _generate(model, policy)[0][0].response_ids[3]
    want = _rows(_generate(model, policy, eos)[0])
    torch.set_default_device("meta")
    try:
        got = _rows(_generate(model, policy, eos)[0])
    finally:
        torch.set_default_device(None)
    assert got == want


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "random"])
def test_results_do_not_depend_on_the_stop_check_interval(model, policy):
    # EOS = the 4th token the first row samples without one: that row stops after 4 tokens, others run on
    eos = _generate(model, policy)[0][0].response_ids[3]
    results = [_rows(_generate(model, policy, eos, stop_check_every=k)[0]) for k in (1, 3, 8, 64)]
    assert any(r[2] == "stop" for r in results[0]) and any(r[2] == "length" for r in results[0])
    assert all(r == results[0] for r in results[1:])


def test_stop_check_interval_defaults():
    assert stop_check_interval(torch.device("cpu")) == 1
    assert stop_check_interval(torch.device("cuda", 0)) == 8
    assert stop_check_interval(torch.device("cpu"), 5) == 5


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_trajectories(model):
    """rollout.compile: the decoding step through torch.compile (Inductor on the CPU) samples the same tokens and
    records the same shadow masks as eager; log-probs differ by float rounding only (fused kernels reorder the
    float32 sums), bounded by eps x the longest reduction (hidden size, vocabulary) x the log-prob's size."""
    eager = _generate(model, "snapkv")[0]
    compiled = _generate(model, "snapkv", compile=True)[0]
    cfg = model.config
    for a, b in zip(eager, compiled, strict=True):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert np.array_equal(a.evict_at, b.evict_at)
        bound = torch.finfo(torch.float32).eps * max(cfg.hidden_size, cfg.vocab_size) * max(map(abs, a.logprobs))
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= bound


@pytest.mark.parametrize("policy,interval,share", [
    ("snapkv", 1, True), ("snapkv", 8, True), ("snapkv", 8, False), ("h2o", 1, True), ("h2o", 4, False),
    ("recent", 1, True), ("random", 1, True), ("random", 4, False), ("dense", 1, True),
])
def test_the_decoding_step_and_its_eviction_are_one_captured_graph(model, monkeypatch, policy, interval, share):
    """rollout.compile captures the whole decoding step, the eviction included, for every policy, every-step and
    amortized (issue 54, item 4): TorchDynamo with `fullgraph=True` raises at any graph break. The `eager` backend
    runs the captured graph op by op (no Inductor kernels), so tokens, log-probs and shadow masks equal eager's
    exactly; Inductor's own float rounding is `test_compiled_decode_step_gives_the_eager_trajectories`'s. At most
    one graph per shape the step takes: no eviction, an every-step eviction, an interval's sorting eviction."""
    from torch._dynamo.utils import counters

    from stages.common.kvcache import sampler

    torch._dynamo.reset()
    counters.clear()
    captured = torch.compile(sampler._decode_step, backend="eager", fullgraph=True)
    monkeypatch.setattr(sampler, "compiled_decode_step", lambda _model: captured)
    prompts = PROMPTS + PROMPTS[:2]  # two GRPO-like groups share a prompt
    runs = []
    for compile in (True, False):
        ev = EvictionParams(policy=policy, keep_ratio=0.5, window=4, interval=interval)
        generator = torch.Generator(device="cpu").manual_seed(3)
        runs.append(generate_batch(model, prompts, ev, 24, None, 0, 1.0, generator=generator, compile=compile,
                                   share_prompt=share)[0])
    assert _rows(runs[0]) == _rows(runs[1])
    assert 1 <= counters["stats"]["unique_graphs"] <= 3
    torch._dynamo.reset()
