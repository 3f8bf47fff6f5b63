"""LoRA in the learner (issue 43, `learner.lora`): the parity gate between a merged-weight rollout and the
adapter-form learner for every eviction policy, dropout refused by the gate, the base with the adapter disabled as
reference, the checkpoint (PEFT's format + the record of its base) and a changed base, resume bit for bit, the
optimizer state of the adapter alone, and a learner run end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.params.learner import LoraParams, float32_parity_bound
from schemas.params.rollout import POLICIES
from schemas.weights import write_weights_digest
from stages.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD, is_adapter_checkpoint
from stages.common.model import load_policy, load_tokenizer
from stages.learner.data import load_learner_data
from stages.learner.deepspeed_runtime import STATE_TAG, TRAINER_STATE
from stages.learner.lora import BaseView, load_lora_policy
from stages.learner.train import run_learner, score_rows
from tests.helpers import make_iteration, make_model_dir, make_params, make_prompts

peft = pytest.importorskip("peft")

LORA = "{rank: 4, alpha: 8}"


def saved_adam(state: Path) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """AdamW's (exp_avg, exp_avg_sq, step) tensors in a DeepSpeed checkpoint directory, under either layout: ZeRO
    1/2 keep them flat in *optim_states.pt; ZeRO 0 (`learner.zero_stage: auto` on one process) keeps torch's
    per-parameter state_dict under "optimizer" in the model states."""
    zero = sorted(state.glob("*optim_states.pt"))
    if zero:
        per_param = [torch.load(zero[0], weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]]
    else:
        opt = torch.load(state / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
        per_param = [opt["state"][i] for i in sorted(opt["state"])]
    return tuple([torch.as_tensor(p[key]) for p in per_param] for key in ("exp_avg", "exp_avg_sq", "step"))


def lora_params(**over):
    return make_params(**{"learner.lora": LORA, **over})


def write_adapter(root: Path, base: Path, seed: int = 3, scale: float = 0.2) -> Path:
    """A LoRA checkpoint on `base` whose B is not 0 (a policy away from the base), written as the learner does."""
    params = lora_params()
    lora = load_lora_policy(base, params.learner, "float32", seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    out = root / "adapter"
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        lora.save(tmp)
        load_tokenizer(base).save_pretrained(tmp)
        write_weights_digest(tmp)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_model_dir(root, "gqa")
    adapter = write_adapter(root, base)
    prompts = make_prompts(root)
    return root, base, adapter, prompts


def adapter_weights(policy: Path) -> dict[str, torch.Tensor]:
    return load_file(str(policy / ADAPTER_WEIGHTS))


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("policy", POLICIES)
def test_parity_merged_rollout_vs_adapter_learner(tmp_path, setup, policy):
    """The rollout samples from the merged weights W + s B A, the learner scores in the adapter form
    W x + s B (A x): the shadow-masked log-probs agree within the float32 bound, while the base's (the adapter
    disabled) do not: the adapter is a policy of its own."""
    _, base, adapter, _ = setup
    prompts = make_prompts(tmp_path, lengths=(41, 23, 34, 29), seed=5)
    params = lora_params(**{"rollout.eviction.policy": policy, "rollout.prompts_per_iteration": 4,
                            "rollout.max_new_tokens": 12})
    traj, masks = make_iteration(tmp_path, adapter, prompts, params)
    lora = load_lora_policy(adapter, params.learner, "float32", 0)
    assert lora.continued and lora.base == base
    model = lora.model
    data = load_learner_data(params.learner, traj, masks, 2, 2, need_masks=True)
    rows = list(range(len(data)))
    kw = dict(temperature=0.8, micro_batch_size=3)
    shadow = score_rows(model, data, rows, masked=True, **kw)
    gap = max(float(np.abs(shadow[r] - data.rollout_logprobs[r]).max()) for r in rows)
    with torch.no_grad():
        logits = load_policy(adapter)(input_ids=torch.tensor([data.prompt_ids[0]])).logits
    bound = float32_parity_bound(float(logits.abs().max()), temperature=0.8)
    print(f"LoRA parity {policy}: max |adapter learner - merged rollout| = {gap:.3g} (float32 bound {bound:.3g})")
    assert gap <= bound
    base_scores = score_rows(BaseView(lora.peft_model), data, rows, masked=True, **kw)
    assert max(float(np.abs(base_scores[r] - data.rollout_logprobs[r]).max()) for r in rows) > 1e-3


# ------------------------------------------------------------------------------------------ gate and teachers
def test_dropout_refused_by_the_parity_gate(tmp_path, setup):
    root, base, _, prompts = setup
    out = tmp_path / "policy"
    params = make_params(**{"learner.lora": "{rank: 4, dropout: 0.1}"})
    with pytest.raises(SmdInputError, match=r"parity gate: learner\.lora\.dropout=0\.1") as err:
        run_learner(params, 1, base, tmp_path / "none.arrow", None, out)
    assert "\n" not in str(err.value) and not out.exists()


def test_reference_is_the_base_with_the_adapter_disabled(setup, tmp_path):
    """The base view of the adapter model (PEFT's disable_adapter, no second model) scores exactly as the base
    model loaded on its own, and the adapter is back on afterwards."""
    _, base, adapter, prompts = setup
    params = lora_params()
    traj, masks = make_iteration(tmp_path, base, prompts, params)
    data = load_learner_data(params.learner, traj, masks, 2, 2, need_masks=True)
    rows = list(range(len(data)))
    lora = load_lora_policy(adapter, params.learner, "float32", 0)
    kw = dict(masked=False, temperature=0.8, micro_batch_size=3)
    view = score_rows(BaseView(lora.peft_model), data, rows, **kw)
    plain = score_rows(load_policy(base), data, rows, **kw)
    assert max(float(np.abs(view[r] - plain[r]).max()) for r in rows) <= 1e-6
    policy = score_rows(lora.model, data, rows, **kw)
    assert max(float(np.abs(policy[r] - plain[r]).max()) for r in rows) > 1e-3  # adapter on again
    assert all(p.requires_grad for n, p in lora.peft_model.named_parameters() if "lora_" in n)
    assert sum(p.numel() for p in lora.peft_model.parameters()) == sum(p.numel() for p in lora.model.parameters())


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_is_peft_format_plus_base_record(setup):
    """`PeftModel.from_pretrained(base, DIR)` loads the checkpoint; smd's loader gives its merged weights."""
    from transformers import AutoModelForCausalLM

    _, base, adapter, _ = setup
    assert is_adapter_checkpoint(adapter) and (adapter / ADAPTER_WEIGHTS).is_file()
    record = json.loads((adapter / BASE_RECORD).read_text())
    assert record["path"] == str(base) and set(record["weights_digest"]) == {"model.safetensors"}
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))
        want = theirs.eval()(input_ids=ids).logits
        got = load_policy(adapter)(input_ids=ids).logits
        plain = load_policy(base)(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5 < float((plain - want).abs().max())


def test_merge_lora_command_writes_a_plain_model(setup, tmp_path):
    from cli.main import app

    _, _, adapter, _ = setup
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["merge-lora", str(adapter), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and not is_adapter_checkpoint(out)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        assert torch.equal(load_policy(out)(input_ids=ids).logits, load_policy(adapter)(input_ids=ids).logits)
    bad = CliRunner().invoke(app, ["merge-lora", str(out), "--out", str(tmp_path / "again")])
    assert bad.exit_code == 2 and "not a LoRA checkpoint" in bad.output and not (tmp_path / "again").exists()


def test_changed_base_refused(tmp_path):
    """A base whose weights changed since the adapter was trained on it (its own digest rewritten to match, so
    only the adapter's record can tell) is refused in one line."""
    base = make_model_dir(tmp_path, "gqa")
    adapter = write_adapter(tmp_path, base)
    weights = load_file(str(base / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    write_weights_digest(base)
    with pytest.raises(SmdInputError, match="changed since this adapter was trained") as err:
        load_policy(adapter)
    assert "\n" not in str(err.value)
    shutil.rmtree(base)
    with pytest.raises(SmdInputError, match="not a model directory"):
        load_policy(adapter)


# ------------------------------------------------------------------------------------------ the learner
def test_learner_end_to_end_resume_and_adapter_only_state(tmp_path, setup):
    """learn with LoRA from the base (a fresh adapter: the parity gate holds as for full fine-tuning), rollout from
    its merged weights, learn again from the adapter: the checkpoint holds the adapter and its base's record, the
    optimizer state and the DeepSpeed module state only the adapter's parameters, the base is untouched, and
    resuming continues adapter and optimizer state exactly as one uninterrupted run."""
    root, base, _, prompts = setup
    traj, masks = make_iteration(tmp_path, base, prompts, make_params())
    params = lora_params()
    before = load_file(str(base / "model.safetensors"))
    b1 = run_learner(params, 1, base, traj, masks, tmp_path / "b1" / "policy")
    pol = b1["policy"]
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD}.issubset(p.name for p in pol.iterdir())
    assert not (pol / "model.safetensors").exists()
    m = json.loads(b1["details"].read_text())
    assert m["mismatch/logprob_abs_diff_max"] <= m["learner/parity_tol"] and m["config"]["learner"]["lora"]["rank"] == 4
    after = load_file(str(base / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    trained = adapter_weights(pol)
    assert any(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)  # B moved off 0
    n_adapter = sum(v.numel() for v in trained.values())
    state = pol / TRAINER_STATE / STATE_TAG
    assert sum(t.numel() for t in saved_adam(state)[0]) == n_adapter  # AdamW holds the adapter only
    module = torch.load(state / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    lora_keys = [k for k in module if "lora_" in k]
    assert sum(module[k].numel() for k in lora_keys) == n_adapter
    # (DeepSpeed's exclude_frozen_parameters keeps a tied head: named_parameters() lists it under the embedding)
    assert set(module) - set(lora_keys) <= {"lm_head.weight"}

    # resume: one more step from the checkpoint == two steps in one run (same batch; the dense objective, whose
    # second step is off-policy by design, as tests/test_learner.py's resume test)
    dense = {"learner.objective": "dense"}
    d1 = run_learner(lora_params(**dense), 1, base, traj, masks, tmp_path / "d1" / "policy")
    d2 = run_learner(lora_params(**dense), 2, d1["policy"], traj, masks, tmp_path / "d2" / "policy")
    a = run_learner(lora_params(**dense, **{"learner.epochs": 2}), 1, base, traj, masks, tmp_path / "a" / "policy")
    m2 = json.loads(d2["details"].read_text())
    assert m2["learner/resumed_optimizer"] and m2["learner/global_step"] == 2
    wa, wb = adapter_weights(a["policy"]), adapter_weights(d2["policy"])
    assert wa.keys() == wb.keys() and max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
    assert json.loads((d2["policy"] / BASE_RECORD).read_text()) == json.loads((pol / BASE_RECORD).read_text())

    # the next iteration's rollout samples from the merged weights; the learner's gate holds on it
    traj2, masks2 = make_iteration(tmp_path, pol, prompts, make_params(), "it2")
    c = run_learner(params, 2, pol, traj2, masks2, tmp_path / "c" / "policy")
    m3 = json.loads(c["details"].read_text())
    assert 0 < m3["mismatch/logprob_abs_diff_max"] <= m3["learner/parity_tol"]


def test_resume_restores_adapter_and_optimizer_state_bit_for_bit(tmp_path, setup):
    """setup() from a LoRA checkpoint holds exactly the saved adapter and AdamW moments."""
    from stages.learner.deepspeed_runtime import release_engine, save_trainer_state
    from stages.learner.train import setup as learner_setup

    _, base, _, prompts = setup
    traj, masks = make_iteration(tmp_path, base, prompts, make_params())
    params = lora_params()
    first = run_learner(params, 1, base, traj, masks, tmp_path / "p1" / "policy")["policy"]
    run = learner_setup(params, 2, first, traj, masks, None)
    try:
        assert run.resumed is not None and run.lora.continued
        saved = adapter_weights(first)
        now = {k: v.detach() for k, v in run.lora.peft_model.named_parameters() if "lora_" in k}
        assert len(saved) == len(now)
        for name, value in now.items():
            key = name.replace(".default", "")
            assert torch.equal(saved[key], value), name
        save_trainer_state(run.engine, tmp_path / "again", {"world_size": 1, "zero_stage": run.cfg.zero_stage},
                           run.ctx)
    finally:
        release_engine(run.engine)
    old, new = saved_adam(first / TRAINER_STATE / STATE_TAG), saved_adam(tmp_path / "again" / STATE_TAG)
    assert len(old[0]) > 0
    for o, n in zip(old, new, strict=True):  # exp_avg, exp_avg_sq, step: each tensor equal
        assert len(o) == len(n) and all(torch.equal(x, y) for x, y in zip(o, n, strict=True))


def test_reference_teacher_and_reference_kl_run_on_the_base(tmp_path, setup):
    """kl_teacher=reference and ref_kl_coef > 0 under LoRA: the base with the adapter disabled (reference_path is
    not read: it points nowhere here)."""
    _, base, adapter, prompts = setup
    traj, masks = make_iteration(tmp_path, adapter, prompts, make_params())
    params = lora_params(**{"learner.kl_teacher": "reference", "learner.ref_kl_coef": 0.05,
                            "learner.reference_path": str(tmp_path / "missing")})
    out = run_learner(params, 2, adapter, traj, masks, tmp_path / "policy")
    m = json.loads(out["details"].read_text())
    assert m["mismatch/logprob_abs_diff_max"] <= m["learner/parity_tol"] and m["loss/kl_ref"] > 0


def test_lora_settings_and_full_finetuning_from_an_adapter_refused(tmp_path, setup):
    _, _, adapter, _ = setup
    with pytest.raises(SmdInputError, match="a LoRA checkpoint but learner.lora is null"):
        run_learner(make_params(), 2, adapter, tmp_path / "none.arrow", None, tmp_path / "p")
    with pytest.raises(SmdInputError, match=r"rank 4 but learner\.lora\.rank is 8"):
        load_lora_policy(adapter, make_params(**{"learner.lora": "{rank: 8, alpha: 8}"}).learner, "float32", 0)
    with pytest.raises(SmdInputError, match="kl_teacher=ema"):
        run_learner(lora_params(**{"learner.kl_teacher": "ema"}), 2, adapter, tmp_path / "none.arrow", None,
                    tmp_path / "p")
    assert LoraParams().dropout == 0 and make_params().learner.lora is None


# ------------------------------------------------------------------------------------------ chain and dvc repro
CHAIN_SETS = ["rollout.prompts_per_iteration=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
              "rollout.batch_size=4", "rollout.eviction.window=4", "rollout.eviction.sinks=2",
              "learner.micro_batch_size=4", "evaluate.max_new_tokens=4", "evaluate.batch_size=4",
              f"learner.lora={LORA}"]


def test_chain_runs_with_lora(tmp_path):
    """`smdctl chain` with learner.lora: every iteration's policy is an adapter on the warm start, rollout and
    evaluation of iteration 2 sample from iteration 1's merged weights, and the adapter continues."""
    from cli.main import app
    from tests.helpers import empty_params, write_prompt_splits

    model_dir = make_model_dir(tmp_path, "gqa")
    data = write_prompt_splits(tmp_path / "data")
    run = tmp_path / "run"
    args = ["chain", "--run-dir", str(run), "--params", str(empty_params(tmp_path)), "--warmstart", str(model_dir),
            "--data", str(data), "--iterations", "2", *[x for s in CHAIN_SETS for x in ("-S", s)]]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    art = run / "artifacts"
    for n in (1, 2):
        policy = art / f"iter-{n:03d}" / "policy"
        assert is_adapter_checkpoint(policy) and json.loads((policy / BASE_RECORD).read_text())["path"] == str(model_dir)
        m = json.loads((art / f"iter-{n:03d}" / "learn" / "details.json").read_text())
        assert m["mismatch/logprob_abs_diff_max"] <= m["learner/parity_tol"]
        assert (art / f"iter-{n:03d}" / "evaluate" / "metrics.json").exists()
    assert json.loads((art / "iter-002" / "learn" / "details.json").read_text())["learner/resumed_optimizer"]


@pytest.mark.slow
def test_dvc_repro_runs_with_lora(tmp_path):
    """`dvc repro` of the micro project with learner.lora: each iteration's policy is an adapter on the warm start,
    the next rollout and evaluation sample from its merged weights, the gate holds, a second repro reruns nothing
    but the reward-files record."""
    import re

    from tests.helpers import make_project, run_ok

    proj = make_project(tmp_path, {"learner": {"lora": {"rank": 4, "alpha": 8}}})
    run_ok(["dvc", "repro"], proj)
    art = proj / "artifacts"
    for it in ("001", "002"):
        policy = art / f"iter-{it}" / "policy"
        assert is_adapter_checkpoint(policy)
        assert json.loads((policy / BASE_RECORD).read_text())["path"] == "artifacts/warmstart/policy"
        learn = json.loads((art / f"iter-{it}" / "learn" / "metrics.json").read_text())
        assert learn["mismatch/logprob_abs_diff_max"] <= 1e-5
        assert (art / f"iter-{it}" / "evaluate" / "predictions.arrow").exists()
    out = run_ok(["dvc", "repro"], proj)
    assert re.findall(r"Running stage '([^']+)'", out) == ["reward-files"], out[-2000:]


def test_bench_lora_step_holds_adapter_state_only():
    """`smdctl bench learner --lora-rank`'s measurement: the LoRA learner's AdamW state is its adapters' alone."""
    from stages.bench.learner import _child_lora

    full = _child_lora("smd_sdpa", 64, 128, 1, "tiny", None, 1)
    lora = _child_lora("smd_sdpa", 64, 128, 1, "tiny", 4, 1)
    assert lora["trainable"] < full["trainable"] / 10
    assert lora["optimizer_mb"] == pytest.approx(2 * lora["trainable_mb"], rel=0.01)  # moments (+ step counters)
    assert lora["weights_mb"] > full["weights_mb"]  # the adapters on top of the frozen weights


def test_gradient_checkpointing_trains_the_adapter_alike(tmp_path, setup):
    """learner.gradient_checkpointing with LoRA (non-reentrant checkpoints; the frozen embeddings need no input
    gradients): the same adapter update as without."""
    _, base, _, prompts = setup
    traj, masks = make_iteration(tmp_path, base, prompts, make_params())
    outs = [run_learner(lora_params(**{"learner.gradient_checkpointing": flag}), 1, base, traj, masks,
                        tmp_path / str(flag) / "policy")["policy"] for flag in (False, True)]
    a, b = adapter_weights(outs[0]), adapter_weights(outs[1])
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in b.items() if "lora_B" in k)


def test_bench_gradient_checkpointing_reaches_the_child_model():
    """`bench learner --lora-rank --gradient-checkpointing`: the learner's model has every decoder layer
    checkpointed (the learner stage's `enable_layer_checkpointing`), the step still trains the adapters, and the
    layers' activations are no longer kept for backward (nor anything inside the adapter branches)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from stages.bench.learner import _child_lora, _LoraLearner, _saved_for_backward
    from stages.learner.shadow_attention import layer_checkpointing_enabled

    learner = _LoraLearner(64, 128, 1, "tiny", 4, gradient_checkpointing=True)
    layers = [m for m in learner.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert learner.model.is_gradient_checkpointing is True
    assert len(layers) == learner.model.config.num_hidden_layers and all(m.gradient_checkpointing for m in layers)
    assert layer_checkpointing_enabled(learner.model) is True
    b = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_B" in n}
    learner.step("smd_sdpa")
    assert any(not torch.equal(p, b[n]) for n, p in learner.model.named_parameters() if "lora_B" in n)
    assert _LoraLearner(64, 128, 1, "tiny", 4).model.is_gradient_checkpointing is False

    plain = _child_lora("smd_sdpa", 64, 128, 1, "tiny", 4, 1)
    ckpt = _child_lora("smd_sdpa", 64, 128, 1, "tiny", 4, 1, gradient_checkpointing=True)
    assert plain["checkpointing"] is False and ckpt["checkpointing"] is True
    assert plain["adapter_saved_mb"] > 0 and ckpt["adapter_saved_mb"] == 0
    assert ckpt["saved_mb"] < plain["saved_mb"]
    assert ckpt["trainable"] == plain["trainable"]
    # the count's hooks are gone afterwards: a forward with gradient outside it saves as before
    assert _saved_for_backward(learner.model, lambda: learner.step("smd_sdpa")) == (ckpt["saved_mb"], 0.0)


def test_bench_lora_gradient_checkpointing_rows_labelled():
    """The CLI's --gradient-checkpointing goes through run_lora_bench to each learner's process: the rows say +ckpt,
    the header says so, and each child's model had its layers checkpointed; without the option neither."""
    from typer.testing import CliRunner

    from cli.main import app

    base = ["bench", "learner", "--shape", "tiny", "--lora-rank", "4", "--lengths", "64", "--rounds", "1",
            "--device", "cpu"]
    res = CliRunner().invoke(app, [*base, "--gradient-checkpointing"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "both with gradient checkpointing of every decoder layer" in lines[0]
    rows = [ln for ln in lines if ln.startswith("   64  ")]
    assert rows[0].startswith("   64  full +ckpt      ") and rows[1].startswith("   64  lora r4 +ckpt   ")
    trainable = [int(rows[0].split()[3].replace(",", "")), int(rows[1].split()[4].replace(",", ""))]
    assert 0 < trainable[1] < trainable[0] / 10
    assert "full fine-tuning +ckpt: worst" in res.output

    from stages.bench.learner import run_lora_bench

    printed: list[str] = []
    out = run_lora_bench("tiny", 4, [64], rounds=1, print_fn=printed.append, gradient_checkpointing=True)
    assert [(r["learner"], r["checkpointing"]) for r in out] == [("full +ckpt", True), ("lora r4 +ckpt", True)]
    assert all(r["adapter_saved_mb"] == 0 for r in out)
    out = run_lora_bench("tiny", 4, [64], rounds=1, print_fn=printed.append)
    assert [(r["learner"], r["checkpointing"]) for r in out] == [("full", False), ("lora r4", False)]
    assert out[1]["adapter_saved_mb"] > 0 and out[0]["adapter_saved_mb"] == 0
    refused = CliRunner().invoke(app, ["bench", "learner", "--shape", "tiny", "--gradient-checkpointing"])
    assert refused.exit_code == 2 and "only with --lora-rank" in refused.output
