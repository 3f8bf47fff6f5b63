"""Learner stage: parity through the learner's batching for every eviction policy, GRPO under DeepSpeed,
artifacts, resume, the parity gate and bad input (one line, exit code 2, nothing written)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pytest
import torch
from typer.testing import CliRunner

from schemas.compacted_masks import open_mask_store, write_mask_store
from schemas.errors import SmdInputError
from schemas.params.rollout import POLICIES
from schemas.tables import TRAJECTORIES_SCHEMA, read_table, trajectories_binding
from stages.common.model import load_policy
from stages.learner.data import load_learner_data
from stages.learner.train import HEADLINE, run_learner, score_rows
from tests.helpers import (
    TOL,
    empty_params,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    max_param_diff,
    params_of,
    requires_cpu_flex,
)


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("learner")
    model_dir = make_model_dir(root, "gqa")
    prompts = make_prompts(root)
    traj, masks = make_iteration(root, model_dir, prompts, make_params())
    return root, model_dir, prompts, traj, masks


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("policy", POLICIES)
def test_learner_parity_every_policy(tmp_path, setup, policy):
    """Through the learner's code path (table + mask store, length-grouped micro-batches, right padding), the
    shadow-masked log-probs equal the rollout's within 1e-5; the dense learner's do not."""
    _, model_dir, _, _, _ = setup
    prompts = make_prompts(tmp_path, lengths=(41, 23, 34, 29), seed=5)
    params = make_params(**{"rollout.eviction.policy": policy, "rollout.prompts_per_iteration": 4,
                            "rollout.max_new_tokens": 12})
    traj, masks = make_iteration(tmp_path, model_dir, prompts, params)
    model = load_policy(model_dir)
    data = load_learner_data(params.learner, traj, masks, 2, 2, need_masks=True)
    assert len({data.length(r) for r in range(len(data))}) > 1  # padding inside micro-batches
    rows = list(range(len(data)))
    kw = dict(temperature=0.8, micro_batch_size=3)
    shadow = score_rows(model, data, rows, masked=True, **kw)
    dense = score_rows(model, data, rows, masked=False, **kw)
    d_shadow = max(float(np.abs(shadow[r] - data.rollout_logprobs[r]).max()) for r in rows)
    d_dense = max(float(np.abs(dense[r] - data.rollout_logprobs[r]).max()) for r in rows)
    assert d_shadow <= TOL
    if policy != "dense":
        assert d_dense > 1e-3
    else:
        assert d_dense <= TOL


# ------------------------------------------------------------------------------------------ the stage
def test_learn_smd_writes_policy_state_and_metrics(tmp_path, setup):
    root, model_dir, _, traj, masks = setup
    before = params_of(model_dir)
    out = run_learner(make_params(), 1, model_dir, traj, masks, tmp_path / "iter-001" / "policy")
    assert out["metrics"] == tmp_path / "iter-001" / "learn" / "metrics.json"
    policy = load_policy(out["policy"])  # Hugging Face format
    assert (out["policy"] / "tokenizer.json").exists()
    assert (out["trainer_state"] / "trainer_state.json").exists()
    after = params_of(out["policy"])
    assert max_param_diff(before, after) > 1e-5  # it trained
    m = json.loads(out["details"].read_text())
    assert m["mismatch/logprob_abs_diff_max"] <= TOL  # parity before the first step
    # the DVC metric holds the headline only; details.json the whole record (with the config it ran with)
    assert json.loads(out["metrics"].read_text()) == {k: m[k] for k in (*HEADLINE, "schema_version") if k in m}
    assert m["schema_version"] == 1 and m["config"]["learner"]["objective"] == "smd"
    # the producing config of the rollouts it learned from, as the trajectory table records it (report labels)
    assert m["config"]["rollout"]["eviction"]["policy"] == "snapkv"
    for key in ("mismatch/kl", "mismatch/k3_kl", "mismatch/logprob_abs_diff_mean", "mismatch/token_ratio_mean",
                "mismatch/token_ratio_min", "mismatch/token_ratio_max", "mismatch/seq_kish_ess",
                "mismatch/rollout_is_mean", "mismatch/rollout_is_eff_sample_size", "rejection/seq_fraction",
                "rejection/token_fraction", "pg/dual_clipfrac", "reward/mean", "loss/pg", "loss/kl_dense", "loss/total", "grad_norm", "learner/tokens_per_s",
                "learner/peak_rss_mb"):
        assert key in m and np.isfinite(m[key]), key
    assert m["loss/kl_dense"] > 0 and m["grad_norm"] > 0 and m["learner/global_step"] == 1
    steps = json.loads(out["steps"].read_text())
    assert [s["step"] for s in steps] == [1] and "loss/total" in steps[0]
    assert "dense_mismatch/logprob_abs_diff_max" in steps[0]
    # the training forward (shared prefill, dense teacher + masked policy) also reproduces the rollout
    assert steps[0]["mismatch/logprob_abs_diff_max"] <= TOL < steps[0]["dense_mismatch/logprob_abs_diff_max"]
    assert policy.config.num_hidden_layers == 2


@pytest.mark.parametrize("objective", ["shadow", "naive", "naive_bypass", "tis", "sparse_rl"])
def test_other_objectives_run(tmp_path, setup, objective):
    root, model_dir, _, traj, masks = setup
    out = run_learner(make_params(**{"learner.objective": objective}), 1, model_dir, traj, masks, tmp_path / "policy")
    m = json.loads(out["details"].read_text())
    assert m["objective"] == objective and m["learner/steps"] == 1
    if objective == "shadow":
        assert m["mismatch/logprob_abs_diff_max"] <= TOL and m["loss/kl_dense"] == 0
    else:  # dense learners log the real context mismatch
        assert m["mismatch/logprob_abs_diff_max"] > 1e-3
        assert 0 <= m["rejection/seq_fraction"] <= 1 and 0 <= m["rejection/token_fraction"] <= 1
        assert 0 < m["mismatch/rollout_is_eff_sample_size"] <= 1
    if objective != "sparse_rl":
        assert m["rejection/seq_fraction"] == m["rejection/token_fraction"] == 0


def test_naive_ratio_is_exactly_one_before_the_first_update(tmp_path, setup):
    """naive: the old log-probs are the dense learner's own (parity pass), so the first step's PPO ratio is 1
    on every token although the dense learner is far from the sparse rollout; naive_bypass's is not."""
    root, model_dir, _, traj, masks = setup
    over = {"learner.epochs": 2}
    out = run_learner(make_params(**over, **{"learner.objective": "naive"}), 1, model_dir, traj, masks, tmp_path / "n" / "policy")
    steps = json.loads(out["steps"].read_text())
    first = steps[0]
    assert first["mismatch/logprob_abs_diff_max"] > 1e-3  # the mismatch is there, and ignored
    assert first["pg/ratio_min"] == first["pg/ratio_max"] == 1.0 and first["pg/clipfrac"] == 0.0
    assert steps[1]["pg/ratio_max"] != 1.0  # the second epoch's ratio is against the same old log-probs
    out = run_learner(make_params(**over, **{"learner.objective": "naive_bypass"}), 1, model_dir, traj, masks,
                tmp_path / "b" / "policy")
    first = json.loads(out["steps"].read_text())[0]
    assert first["pg/ratio_max"] > 1.0 + 1e-3 or first["pg/ratio_min"] < 1.0 - 1e-3


def test_sparse_rl_normalises_over_the_mini_batch_across_micro_batches(tmp_path, setup):
    """sparse_rl with micro-batches of 1 and of the whole batch: the same update (rejection and the weight
    normalisation are fixed per mini-batch from the parity pass, not per micro-batch)."""
    root, model_dir, _, traj, masks = setup
    over = {"learner.objective": "sparse_rl", "learner.grad_clip": 0, "learner.lr": 1e-4, "learner.adam_eps": 1e-6,
            # a window the tiny model's mismatch lands across, so that some tokens and weights differ from 1
            "learner.sparse_rl_token_ratio_low": 0.99, "learner.sparse_rl_token_ratio_high": 1.01,
            "learner.sparse_rl_is_cap": 1.003}
    outs = [run_learner(make_params(**over, **{"learner.micro_batch_size": mbs}), 1, model_dir, traj, masks,
                  tmp_path / f"mbs{mbs}" / "policy") for mbs in (1, 6)]
    m = json.loads(outs[0]["details"].read_text())
    assert 0 < m["rejection/token_fraction"] < 1
    assert m["is_weight/mean"] != pytest.approx(1.0)  # a micro-batch's own mean differs from the mini-batch's
    a, b = params_of(outs[0]["policy"]), params_of(outs[1]["policy"])
    assert max_param_diff(params_of(model_dir), a) > 5e-5
    assert max_param_diff(a, b) <= 1e-6


def test_resume_equals_uninterrupted(tmp_path, setup):
    """Two steps in one run == one step, save, resume the optimizer state, one more step (same batch)."""
    root, model_dir, _, traj, masks = setup
    common = {"learner.objective": "dense", "learner.updates_per_epoch": 1}
    a = run_learner(make_params(**common, **{"learner.epochs": 2}), 1, model_dir, traj, masks, tmp_path / "a" / "policy")
    b1 = run_learner(make_params(**common), 1, model_dir, traj, masks, tmp_path / "b1" / "policy")
    b2 = run_learner(make_params(**common), 2, b1["policy"], traj, masks, tmp_path / "b2" / "policy")
    m = json.loads(b2["details"].read_text())
    assert m["learner/resumed_optimizer"] and m["learner/global_step"] == 2
    assert max_param_diff(params_of(a["policy"]), params_of(b2["policy"])) <= 1e-6
    fresh = run_learner(make_params(**common, **{"learner.resume_optimizer": False}), 2, b1["policy"], traj, masks,
                  tmp_path / "fresh" / "policy")
    assert max_param_diff(params_of(a["policy"]), params_of(fresh["policy"])) > 1e-5  # the state mattered


def test_zero_stage_auto_resolves_by_process_count_and_saved_state():
    """`learner.zero_stage: auto`: a resumed state's stage, else 0 on one process and 1 on several; a set stage
    is kept."""
    from stages.learner.deepspeed_runtime import zero_stage_for

    assert [zero_stage_for("auto", w) for w in (1, 2, 8)] == [0, 1, 1]
    assert [zero_stage_for("auto", 1, s) for s in (0, 1, 2)] == [0, 1, 2]
    assert zero_stage_for("auto", 4, 0) == 0
    assert [zero_stage_for(s, 1, 0) for s in (0, 1, 2)] == [0, 1, 2]


def test_auto_zero_stage_resumes_a_stage_one_state_bit_for_bit(tmp_path, setup):
    """A trainer state saved under ZeRO 1 resumes under `auto` as under an explicit 1 (its stage is kept, so
    the optimizer moments load); a fresh one-process run records stage 0 and takes stage 1's step."""
    root, model_dir, _, traj, masks = setup
    common = {"learner.objective": "dense"}
    b1 = run_learner(make_params(**common, **{"learner.zero_stage": 1}), 1, model_dir, traj, masks,
                     tmp_path / "b1" / "policy")
    b2 = {stage: run_learner(make_params(**common, **{"learner.zero_stage": stage}), 2, b1["policy"], traj, masks,
                             tmp_path / f"b2-{stage}" / "policy") for stage in ("auto", 1)}
    m = json.loads(b2["auto"]["details"].read_text())
    assert m["learner/resumed_optimizer"] and m["config"]["learner"]["zero_stage"] == 1
    assert max_param_diff(params_of(b2["auto"]["policy"]), params_of(b2[1]["policy"])) == 0
    fresh = run_learner(make_params(**common), 1, model_dir, traj, masks, tmp_path / "fresh" / "policy")
    assert json.loads(fresh["details"].read_text())["config"]["learner"]["zero_stage"] == 0
    state = json.loads((fresh["trainer_state"] / "trainer_state.json").read_text())
    assert state["zero_stage"] == 0
    # one process: stage 0 steps the same AdamW as stage 1's flat partition (the default's change moves no result)
    assert max_param_diff(params_of(fresh["policy"]), params_of(b1["policy"])) <= 1e-6
    # and the learner's own pre-clip gradient norm (DeepSpeed reports none at stage 0) is ZeRO 1's global norm:
    # the same squares summed in another order (per tensor vs one flat buffer); torch's cascade sums err by
    # ~eps x log2(n) ~ 2e-6 relative at this model's size, so 1e-5
    norms = [json.loads(out["steps"].read_text())[0]["grad_norm"] for out in (fresh, b1)]
    assert norms[0] > 0 and abs(norms[0] - norms[1]) <= 1e-5 * norms[1]


def test_micro_batching_does_not_change_the_update(tmp_path, setup):
    """Gradient accumulation is exact: micro-batch 1 and 6 (whole batch) give the same update. (Adam's first
    step lr * g / (|g| + eps) amplifies the float noise of gradients near eps by lr / eps: adam_eps 1e-6.)"""
    root, model_dir, _, traj, masks = setup
    over = {"learner.grad_clip": 0, "learner.lr": 1e-4, "learner.adam_eps": 1e-6}
    outs = [run_learner(make_params(**over, **{"learner.micro_batch_size": mbs}), 1, model_dir, traj, masks,
                  tmp_path / f"mbs{mbs}" / "policy") for mbs in (1, 6)]
    before, a, b = params_of(model_dir), params_of(outs[0]["policy"]), params_of(outs[1]["policy"])
    assert max_param_diff(before, a) > 5e-5
    assert max_param_diff(a, b) <= 1e-6


def test_fused_adamw_takes_the_foreach_step(tmp_path, setup):
    """`learner.adam_fused` (default true, transformers' `adamw_torch_fused`) runs torch's fused AdamW kernel: the
    engine holds it, and its update equals the foreach implementation's to float32 rounding (adam_eps 1e-6: see
    test_micro_batching_does_not_change_the_update)."""
    root, model_dir, _, traj, masks = setup
    over = {"learner.grad_clip": 0, "learner.lr": 1e-4, "learner.adam_eps": 1e-6}
    outs = {fused: run_learner(make_params(**over, **{"learner.adam_fused": fused}), 1, model_dir, traj, masks,
                               tmp_path / f"fused-{fused}" / "policy") for fused in (True, False)}
    assert json.loads(outs[True]["details"].read_text())["config"]["learner"]["adam_fused"] is True
    before, fused, foreach = (params_of(model_dir), params_of(outs[True]["policy"]),
                              params_of(outs[False]["policy"]))
    assert max_param_diff(before, fused) > 5e-5
    assert max_param_diff(fused, foreach) <= 1e-6


def test_one_process_skips_the_identity_allreduce_bit_for_bit(tmp_path, setup, monkeypatch):
    """On one process at ZeRO stage 0 the engine's gradient all-reduce is off (`skip_single_process_allreduce`:
    there it is the identity, through a flat copy of every gradient); the policy it writes is bit for bit the one
    the all-reduce gives, and several processes or ZeRO stages 1-2 keep it."""
    import stages.learner.deepspeed_runtime as ds_runtime

    root, model_dir, _, traj, masks = setup
    seen: list[bool] = []
    skip = ds_runtime.skip_single_process_allreduce

    def recorded(engine, world):
        seen.append(skip(engine, world))
        assert engine.enable_backward_allreduce is not seen[-1]
        return seen[-1]

    monkeypatch.setattr(ds_runtime, "skip_single_process_allreduce", recorded)
    skipped = run_learner(make_params(), 1, model_dir, traj, masks, tmp_path / "skipped" / "policy")
    monkeypatch.setattr(ds_runtime, "skip_single_process_allreduce", lambda engine, world: False)
    reduced = run_learner(make_params(), 1, model_dir, traj, masks, tmp_path / "reduced" / "policy")
    assert seen == [True]
    before, a, b = params_of(model_dir), params_of(skipped["policy"]), params_of(reduced["policy"])
    assert max_param_diff(before, a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)

    class Engine:
        enable_backward_allreduce = True

        def __init__(self, stage):
            self.stage = stage

        def zero_optimization_stage(self):
            return self.stage

    for world, stage in ((2, 0), (1, 1), (1, 2)):
        engine = Engine(stage)
        assert skip(engine, world) is False and engine.enable_backward_allreduce is True


# ------------------------------------------------------------------------------------------ gate + bad input
def corrupt_store(src: Path, dst: Path, shift: int = 1) -> Path:
    """A structurally valid store whose keys stay visible `shift` queries longer than the rollout's."""
    store = open_mask_store(src)
    ev = np.asarray(store.evict_at[...]).astype(np.int64)
    lengths = store.lengths()
    row_len = np.repeat(lengths, lengths)[:, None]
    bad = np.minimum(ev + shift, row_len)
    return write_mask_store(dst, evict_at=bad, offsets=store.offsets, prompt_len=store.prompt_len,
                            table_row=store.table_row, column_map=store.column_map,
                            eviction=store.attrs["eviction"], config=store.attrs["config"],
                            retention=store.attrs["retention"], trajectories=store.attrs["trajectories"])


def rebind_store(src: Path, dst: Path, trajectories: Path) -> Path:
    """A copy of a store bound to the table at `trajectories` (another rollout's masks past the binding check:
    the structural checks behind it)."""
    store = open_mask_store(src)
    return write_mask_store(dst, evict_at=np.asarray(store.evict_at[...]), offsets=store.offsets,
                            prompt_len=store.prompt_len, table_row=store.table_row, column_map=store.column_map,
                            eviction=store.attrs["eviction"], config=store.attrs["config"],
                            retention=store.attrs["retention"],
                            trajectories=trajectories_binding(read_table(trajectories, "trajectories")))


def assert_nothing_written(tmp_path: Path, model_dir: Path, digest: str) -> None:
    assert not (tmp_path / "iter-001").exists()
    assert tree_digest(model_dir) == digest  # the previous checkpoint is untouched


@pytest.mark.parametrize("objective", ["smd", "shadow"])
def test_fused_parity_gate_trains_as_the_separate_pass(tmp_path, setup, objective):
    """The gate on the training forward's own log-probs (`learner.parity_from_training_forward`, smd/shadow with
    one optimizer step) makes the same update as the separate parity pass, and reports the same parity within
    float32 rounding."""
    _, model_dir, _, traj, masks = setup
    runs = {}
    for separate in (False, True):
        p = make_params(**{"learner.objective": objective, "learner.parity_from_training_forward": not separate})
        out = run_learner(p, 1, model_dir, traj, masks, tmp_path / str(separate) / "policy")
        runs[separate] = (params_of(out["policy"]), json.loads(out["details"].read_text()))
    (fused_w, fused), (sep_w, sep) = runs[False], runs[True]
    assert fused["learner/parity_fused"] == 1.0 and sep["learner/parity_fused"] == 0.0
    assert max_param_diff(fused_w, sep_w) == 0.0  # the parity pass never enters the update
    for key in ("mismatch/logprob_abs_diff_max", "mismatch/logprob_abs_diff_mean"):
        assert fused[key] <= TOL and sep[key] <= TOL
        assert abs(fused[key] - sep[key]) <= TOL
    # not fused when the pass serves more: several steps, a recomputed old policy
    p = make_params(**{"learner.objective": objective, "learner.updates_per_epoch": 2,
                       "learner.parity_from_training_forward": True})
    two = run_learner(p, 1, model_dir, traj, masks, tmp_path / "two" / "policy")
    assert json.loads(two["details"].read_text())["learner/parity_fused"] == 0.0


@pytest.mark.parametrize("separate", [False, True])
def test_parity_gate_refuses_corrupted_mask(tmp_path, setup, separate):
    root, model_dir, _, traj, masks = setup
    digest = tree_digest(model_dir)
    bad = corrupt_store(masks, tmp_path / "bad.zarr")
    out = tmp_path / "iter-001" / "policy"
    with pytest.raises(SmdInputError, match=r"parity gate: mismatch/logprob_abs_diff_max=.* > tol 0.0001"):
        run_learner(make_params(**{"learner.parity_from_training_forward": not separate}), 1, model_dir, traj, bad,
                    out)
    assert_nothing_written(tmp_path, model_dir, digest)
    if separate:
        return

    from cli.main import app

    res = CliRunner().invoke(app, ["learn", "-i", "1", "--params", str(empty_params(tmp_path)), "--policy",
                                   str(model_dir), "--trajectories", str(traj), "--masks", str(bad), "--out", str(out),
                                   "--metrics-dir", str(tmp_path / "iter-001" / "learn")])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith("refusing to train off-policy")
    assert_nothing_written(tmp_path, model_dir, digest)
    # The dense baselines have no gate: they log the mismatch instead.
    m = run_learner(make_params(**{"learner.objective": "naive"}), 1, model_dir, traj, bad, tmp_path / "d" / "policy")
    assert json.loads(m["details"].read_text())["mismatch/logprob_abs_diff_max"] > 1e-3


def _write_raw_table(rows: list[dict], path: Path) -> Path:
    """Write a trajectory table without write_table's validation (to hand the learner bad files)."""
    table = pa.Table.from_pylist(rows, schema=TRAJECTORIES_SCHEMA).replace_schema_metadata(
        {b"schema_version": b"1", b"kind": b"trajectories", b"config": b"{}"})
    feather.write_feather(table, str(path), compression="uncompressed")
    return path


def test_bad_inputs_one_line_nothing_written(tmp_path, setup):
    root, model_dir, prompts, traj, masks = setup
    digest = tree_digest(model_dir)
    out = tmp_path / "iter-001" / "policy"
    p = make_params()

    def fails(match, params=p, policy=model_dir, trajectories=traj, mask_store=masks):
        with pytest.raises(SmdInputError, match=match) as err:
            run_learner(params, 1, policy, trajectories, mask_store, out)
        assert "\n" not in str(err.value)
        assert_nothing_written(tmp_path, model_dir, digest)

    # masks that do not match the trajectories
    other_rows, other_masks = make_iteration(tmp_path, model_dir, prompts,
                                             make_params(**{"rollout.prompts_per_iteration": 2}), "rows")
    fails("masks from another rollout", mask_store=other_masks)  # the binding (issue 24), then the structure:
    fails("num_rows: 4 mask rows for 6 trajectories", mask_store=rebind_store(other_masks, tmp_path / "o.zarr", traj))
    _, longer = make_iteration(tmp_path, model_dir, prompts, make_params(**{"rollout.max_new_tokens": 5}), "len")
    fails("masks from another rollout", mask_store=longer)
    fails("offsets: mask row 0 has", mask_store=rebind_store(longer, tmp_path / "l.zarr", traj))
    mha = make_model_dir(tmp_path, "mha")
    fails("masks have 2 layers x 2 KV heads, the policy 3 x 3", policy=mha)
    fails("missing compacted mask store", mask_store=tmp_path / "nope.zarr")
    # NaN / inf in rewards or log-probs, empty batch
    rows = read_table(traj, "trajectories").to_pylist()
    nan_reward = [dict(r) for r in rows]
    nan_reward[1]["reward"] = float("nan")
    fails("reward: row 1 is nan", trajectories=_write_raw_table(nan_reward, tmp_path / "nan.arrow"))
    inf_lp = [dict(r) for r in rows]
    inf_lp[2]["rollout_logprobs"] = [float("-inf")] + inf_lp[2]["rollout_logprobs"][1:]
    fails("rollout_logprobs: row 2 has a non-finite value", trajectories=_write_raw_table(inf_lp, tmp_path / "inf.arrow"))
    fails("empty trajectories table", trajectories=_write_raw_table([], tmp_path / "empty.arrow"))
    # unknown objective, lambda < 0: refused when params are read, and by run_learner() itself
    with pytest.raises(SmdInputError, match="learner.objective: Input should be 'smd', 'shadow'"):
        make_params(**{"learner.objective": "ppo"})
    with pytest.raises(SmdInputError, match="learner.kl_lambda"):
        make_params(**{"learner.kl_lambda": -0.1})
    fails("learner.objective: Input should be", params=p.model_copy(update={"learner": p.learner.model_copy(update={"objective": "ppo"})}))
    fails("learner.kl_lambda: Input should be greater than or equal to 0", params=p.model_copy(update={"learner": p.learner.model_copy(update={"kl_lambda": -0.1})}))

    from cli.main import app

    res = CliRunner().invoke(app, ["learn", "-i", "1", "--params", str(empty_params(tmp_path)), "-S",
                                   "learner.kl_lambda=-1", "--policy", str(model_dir), "--out", str(out)])
    assert res.exit_code == 2 and "learner.kl_lambda" in res.output
    res = CliRunner().invoke(app, ["learn", "-i", "1", "--params", str(empty_params(tmp_path)), "--policy",
                                   str(model_dir), "--trajectories", str(traj), "--masks", str(other_masks),
                                   "--out", str(out), "--metrics-dir", str(tmp_path / "iter-001" / "learn")])
    assert res.exit_code == 2 and "masks from another rollout" in res.output
    assert_nothing_written(tmp_path, model_dir, digest)


@requires_cpu_flex
def test_flex_and_tiled_backends_learn_like_sdpa(tmp_path, setup):
    """The FlexAttention learner (block mask from evict_at, CPU block-sparse backward) and the tiled one (CPU
    flash-attention kernel per query tile, forward and backward) pass the parity gate and make the same update
    as the SDPA reference."""
    root, model_dir, _, traj, masks = setup
    over = {"learner.lr": 1e-4, "learner.adam_eps": 1e-6, "learner.flex_block_size": 16}
    outs = {b: run_learner(make_params(**over, **{"learner.attention_backend": b}), 1, model_dir, traj, masks,
                     tmp_path / b / "policy") for b in ("sdpa", "flex", "tiled")}
    for backend in ("flex", "tiled"):
        m = json.loads(outs[backend]["details"].read_text())
        assert m["mismatch/logprob_abs_diff_max"] <= TOL and m["attention_backend"] == backend
        assert max_param_diff(params_of(outs["sdpa"]["policy"]), params_of(outs[backend]["policy"])) <= 1e-6


def test_several_updates_and_reference_kl(tmp_path, setup):
    """updates_per_epoch splits the batch into shuffled mini-batches (one optimizer step each); the reference
    KL is 0 while the policy equals the reference and positive once it moved."""
    root, model_dir, _, traj, masks = setup
    params = make_params(**{"learner.updates_per_epoch": 2, "learner.epochs": 2, "learner.ref_kl_coef": 0.1,
                            "learner.reference_path": str(model_dir)})
    out = run_learner(params, 1, model_dir, traj, masks, tmp_path / "policy")
    steps = json.loads(out["steps"].read_text())
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and [s["epoch"] for s in steps] == [0, 0, 1, 1]
    assert steps[0]["loss/kl_ref"] == pytest.approx(0.0, abs=1e-9) and steps[-1]["loss/kl_ref"] > 0
    assert steps[0]["mismatch/logprob_abs_diff_max"] <= TOL < steps[-1]["mismatch/logprob_abs_diff_max"]  # drift


def test_learner_runs_again_after_the_process_group_was_destroyed(tmp_path, setup):
    """A long-lived process (a notebook, a test session, vLLM's clean-up) may destroy the default process group
    between two learner runs; DeepSpeed keeps module-level references to groups of the old one (its cloned
    world group), which the next run must not use ("Group ... is not registered")."""
    import torch.distributed as dist

    _, model_dir, _, traj, masks = setup
    first = run_learner(make_params(), 1, model_dir, traj, masks, tmp_path / "a" / "policy")
    assert dist.is_initialized()
    dist.destroy_process_group()
    again = run_learner(make_params(), 1, model_dir, traj, masks, tmp_path / "b" / "policy")
    assert max_param_diff(params_of(first["policy"]), params_of(again["policy"])) == 0.0


def test_a_finished_learner_leaves_no_engine_alive(tmp_path, setup):
    """`smdctl chain` learns every iteration in one process: each finished learner's DeepSpeed engine (optimizer
    state and all) is freed, not kept alive (it was: +2 GB per iteration on SmolLM2-135M, OOM at iteration 3)."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    def engines() -> int:
        gc.collect()
        return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())

    root, model_dir, _, traj, masks = setup
    before = engines()  # other tests of this process may have left some behind (they call the learner's parts)
    for n in (1, 2):
        run_learner(make_params(), n, model_dir, traj, masks, tmp_path / f"p{n}" / "policy")
        assert engines() == before, f"a DeepSpeed engine stays alive after learner run {n}"
    with pytest.raises(SmdInputError, match="parity gate"):  # a failed run: the gate refuses a tolerance of 1e-30
        run_learner(make_params(**{"learner.parity_tol": 1e-30}), 1, model_dir, traj, masks, tmp_path / "bad" / "p")
    assert engines() == before, "a DeepSpeed engine stays alive after a failed learner run"
