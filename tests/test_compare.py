"""`smdctl compare`: the comparison as one resumable command (a micro version: 2 arms, 2 iterations, 1 seed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from schemas.compare import load_compare_spec
from schemas.errors import SmdInputError
from schemas.tables import read_table
from tests.helpers import empty_params, make_model_dir, write_prompt_splits

SETS = ["rollout.prompts_per_iteration=2", "rollout.max_new_tokens=4", "rollout.batch_size=4",
        "rollout.eviction.window=4", "learner.micro_batch_size=4", "evaluate.max_new_tokens=4",
        "evaluate.batch_size=4"]

SPEC = """
iterations: 2
eval_every: 2
seeds: [0]
workers: 1
common: {rollout.group_size: 2}
arms:
  dense: {rollout.eviction.policy: dense, learner.objective: dense}
  smd-l0.1@0.5: {learner.objective: smd, learner.kl_lambda: 0.1, rollout.eviction.keep_ratio: 0.5}
"""


def _inputs(tmp_path):
    model_dir = make_model_dir(tmp_path, "gqa")
    data = write_prompt_splits(tmp_path / "data")
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    return model_dir, data, spec


@pytest.mark.slow
def test_compare_runs_every_arm_reports_and_resumes(tmp_path):
    model_dir, data, spec = _inputs(tmp_path)
    out = tmp_path / "cmp"
    args = ["compare", "--out", str(out), "--spec", str(spec), "--params", str(empty_params(tmp_path)),
            "--warmstart", str(model_dir), "--data", str(data), *[x for s in SETS for x in ("-S", s)]]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    for run in ("dense-s0", "smd-l0.1@0.5-s0"):
        art = out / run / "artifacts"
        assert (art / "iter-002" / "evaluate" / "metrics.json").is_file()
        assert not (art / "iter-001" / "evaluate").exists()  # eval_every 2
        start = json.loads((art / "iter-000" / "evaluate" / "metrics.json").read_text())
        assert "eval/compressed/score" in start  # iteration 0: the warm start under the arm's own compression
    # one start evaluation per evaluation setting (dense and SnapKV 0.5), shared by the arms that have it
    assert len(list((out / "_start").iterdir())) == 2
    text = (out / "report" / "report.md").read_text()
    assert "| dense / dense @ 0.5 | 1 | 2 |" in text and "| smd λ0.1 / snapkv @ 0.5 | 1 | 2 |" in text
    smd_row = next(line for line in text.splitlines() if line.startswith("| smd λ0.1"))
    assert "(@0 " in smd_row.split("|")[7]  # compressed score at iteration 0, from the run's own iter-000
    summary = json.loads((out / "compare.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["dense-s0", "smd-l0.1@0.5-s0"]
    assert not any(r["skipped"] for r in summary["runs"]) and summary["wall_seconds"] > 0
    table = read_table(out / "dense-s0" / "artifacts" / "iter-001" / "rollout" / "trajectories.arrow", "trajectories")
    assert table.num_rows == 4  # 2 prompts x the spec's common group size 2

    # Rerun: every run is complete, nothing is recomputed.
    before = {f: f.stat().st_mtime_ns for f in out.rglob("iter-*/**/*") if f.is_file()}
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert all(r["skipped"] for r in json.loads((out / "compare.json").read_text())["runs"])
    assert {f: f.stat().st_mtime_ns for f in before} == before


@pytest.mark.slow
def test_iterations_and_seeds_options_replace_the_specs(tmp_path):
    model_dir, data, spec = _inputs(tmp_path)
    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["compare", "--out", str(out), "--spec", str(spec), "--params",
                                   str(empty_params(tmp_path)), "--warmstart", str(model_dir), "--data", str(data),
                                   "--arms", "dense", "--iterations", "1", "--seeds", "3",
                                   *[x for s in SETS for x in ("-S", s)]])
    assert res.exit_code == 0, res.output
    assert [r["run"] for r in json.loads((out / "compare.json").read_text())["runs"]] == ["dense-s3"]
    art = out / "dense-s3" / "artifacts"
    assert (art / "iter-001" / "evaluate" / "metrics.json").is_file() and not (art / "iter-002").exists()


def test_compare_spec_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: 0\narms: {a: {}}\n")
    with pytest.raises(SmdInputError, match=r"bad.yaml: iterations: "):
        load_compare_spec(bad)
    bad.write_text("arms: {'a/b': {}}\n")
    with pytest.raises(SmdInputError, match="arm name"):
        load_compare_spec(bad)
    with pytest.raises(SmdInputError, match="no such comparison spec"):
        load_compare_spec(tmp_path / "missing.yaml")
    model_dir, data, spec = _inputs(tmp_path)
    spec.write_text("arms: {x: {learner.objective: nonsense}}\n")
    res = CliRunner().invoke(app, ["compare", "--out", str(tmp_path / "o"), "--spec", str(spec), "--params",
                                   str(empty_params(tmp_path)), "--warmstart", str(model_dir), "--data", str(data)])
    assert res.exit_code == 2 and "learner.objective" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written before every arm's params validated
    res = CliRunner().invoke(app, ["compare", "--out", str(tmp_path / "o"), "--spec", str(spec), "--arms", "nope",
                                   "--params", str(empty_params(tmp_path)), "--warmstart", str(model_dir)])
    assert res.exit_code == 2 and "no arm nope" in res.output
    res = CliRunner().invoke(app, ["compare", "--out", str(tmp_path / "o"), "--spec", str(spec), "--seeds", "0,x",
                                   "--params", str(empty_params(tmp_path)), "--warmstart", str(model_dir)])
    assert res.exit_code == 2 and "--seeds: expected comma-separated seeds" in res.output


def test_paper_comparison_spec_is_valid():
    spec = load_compare_spec("experiments/paper_comparison.yaml")
    assert len(spec.arms) == 10 and len(spec.seeds) >= 3
    objectives = {a: o.get("learner.objective") for a, o in spec.arms.items()}
    assert set(objectives.values()) == {"dense", "smd", "shadow", "naive", "tis", "sparse_rl"}


def _arm_params(name: str) -> dict:
    from schemas.params import load_params

    spec = load_compare_spec(f"experiments/{name}.yaml")
    return {arm: load_params("params.yaml", spec.overrides(arm)) for arm in spec.arms}


@pytest.mark.parametrize("name", ["paper_comparison", "pointer_chasing_comparison", "smollm2_fact_recall"])
def test_every_arm_of_every_experiment_spec_validates(name):
    """A typo in an arm's key or value fails here, not hours into a comparison."""
    assert all(p.seed == 0 for p in _arm_params(name).values())  # a spec's seeds come from its `seeds`, not an arm


def test_smollm2_spec_has_the_pretrained_arms_of_issue_34():
    arms = _arm_params("smollm2_fact_recall")
    teachers = {(p.learner.objective, p.learner.kl_teacher) for a, p in arms.items() if a != "dense"}
    assert {("smd", "current"), ("smd", "reference"), ("smd", "ema"), ("smd_released", "current"),
            ("shadow", "current"), ("naive", "current")} <= teachers
    # every arm compresses at 0.5 unless its name says another keep ratio (issue 42's extended arms at 0.3)
    assert all(p.rollout.eviction.keep_ratio == (0.3 if a.endswith("@0.3") else 0.5) for a, p in arms.items())
    core = {("dense", "dense"), ("shadow", "snapkv"), ("smd", "snapkv"), ("naive", "snapkv"), ("sparse_rl", "snapkv"),
            ("smd_released", "snapkv"), ("naive", "h2o"), ("smd", "h2o")}
    assert core <= {(p.learner.objective, p.rollout.eviction.policy) for p in arms.values()}  # issue 42's arms
    released = arms["smd_released-sim@0.5"].rollout.eviction  # the authors' own setting: decisions simulated
    assert (released.apply, released.compress) == (False, "prefill_only")


def test_smollm2_strict_reward_arms_score_a_run_on_zero():
    """Issue 42 item 3: the `-em` arms train on the task's exact match, which a run-on answer fails while the
    built-in kv_fraction gives it full credit."""
    from schemas.rewards import score
    from stages.common.reward_functions import load_reward_functions

    arms = _arm_params("smollm2_fact_recall")
    assert arms["smd-l0.1-em@0.5"].reward.function == ["experiments/rewards/fact_recall_strict.py:exact_numbers"]
    assert arms["dense-em"].reward.function == arms["smd-l0.1-em@0.5"].reward.function
    (spec,) = load_reward_functions(arms["dense-em"].reward.function)
    assert spec.convention == "verl"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("strict", spec.path))
    module.__spec__.loader.exec_module(module)
    fn = module.exact_numbers
    run_on = "The fox has number 56. The bear has number 52."
    assert score("fact_recall", run_on, "56") == 1.0
    assert fn(data_source="fact_recall", solution_str=run_on, ground_truth="56") == 0.0
    assert fn(data_source="fact_recall", solution_str="56", ground_truth="56") == 1.0
    assert fn(data_source="fact_recall", solution_str="The fox has number 56.", ground_truth="56") == 1.0
    assert fn(data_source="fact_recall", solution_str="65", ground_truth="56") == 0.0


# ----- a second invocation into the same --out, threads, --eval-every 0 (cheap: the chains are faked) -----

CHEAP_SPEC = """
iterations: 2
eval_every: 2
seeds: [0]
workers: 1
arms:
  dense: {rollout.eviction.policy: dense, learner.objective: dense}
  smd-lora: {learner.objective: smd, learner.kl_lambda: 0.1, learner.lora.rank: 8}
"""


def _cheap_inputs(tmp_path):
    """A spec, an empty params file and the files compare checks for (nothing reads them: the chains are faked)."""
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    for split in ("train", "eval"):
        (tmp_path / "data" / f"{split}.arrow").write_bytes(b"")
    spec = tmp_path / "spec.yaml"
    spec.write_text(CHEAP_SPEC)
    return spec, empty_params(tmp_path), tmp_path / "warm", tmp_path / "data"


def _fake_chains(monkeypatch, calls: list) -> None:
    """`run_arm` writing what a chain's stages would (rollout and learn metrics, learn's recorded config), and no
    start evaluation."""
    import stages.tools.compare as compare
    from schemas.params import load_params

    def run_arm(out, arm, seed, start_eval, params_path, overrides, warmstart, data, spec, env):
        p = load_params(params_path, [*overrides, *spec.overrides(arm)])
        name = f"{arm}-s{seed}"
        calls.append({"run": name, "start_eval": start_eval, "eval_every": spec.eval_every, "env": env})
        for n in range(1, spec.iterations + 1):
            it = out / name / "artifacts" / f"iter-{n:03d}"
            (it / "rollout").mkdir(parents=True, exist_ok=True)
            (it / "learn").mkdir(parents=True, exist_ok=True)
            (it / "rollout" / "metrics.json").write_text(json.dumps({"reward/mean": 0.1 * n}))
            (it / "learn" / "metrics.json").write_text(json.dumps({"mismatch/kl": 0.01}))
            (it / "learn" / "details.json").write_text(json.dumps({"config": {
                "learner": p.learner.model_dump(mode="json"),
                "rollout": {"eviction": p.rollout.eviction.model_dump(mode="json")}}}))
        return {"run": name, "arm": arm, "seed": seed, "returncode": 0, "seconds": float(len(calls)),
                "skipped": False}

    monkeypatch.setattr(compare, "run_arm", run_arm)
    monkeypatch.setattr(compare, "evaluate_starts", lambda arm_params, *a: {arm: None for arm in arm_params})


def test_a_second_compare_into_the_same_out_keeps_the_earlier_runs(tmp_path, monkeypatch):
    from stages.tools.compare import run_compare

    spec, params, warm, data = _cheap_inputs(tmp_path)
    calls: list = []
    _fake_chains(monkeypatch, calls)
    out = tmp_path / "cmp"
    run_compare(spec, out, params, [], warm, data, only="dense")
    written = run_compare(spec, out, params, [], warm, data, only="smd-lora")  # another arm, as the README invites
    summary = json.loads((out / "compare.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["dense-s0", "smd-lora-s0"]
    assert summary["runs"][1]["overrides"] == ["learner.objective=smd", "learner.kl_lambda=0.1",
                                               "learner.lora.rank=8"]
    text = written["report"].read_text()
    assert "| dense / dense @ 0.5 | 1 | 2 |" in text  # the first invocation's run is still in the report
    assert "| smd λ0.1 LoRA r8 / snapkv @ 0.5 | 1 | 2 |" in text  # and the arm's label says LoRA
    # the same run again: its record replaced in place, the other kept
    run_compare(spec, out, params, [], warm, data, only="dense")
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert [(r["run"], r["seconds"]) for r in runs] == [("dense-s0", 3.0), ("smd-lora-s0", 2.0)]
    # a damaged compare.json: one line naming it, before any run
    (out / "compare.json").write_text("{")
    with pytest.raises(SmdInputError, match=r"compare\.json: not readable JSON"):
        run_compare(spec, out, params, [], warm, data, only="dense")
    (out / "compare.json").write_text('{"runs": {}}')
    with pytest.raises(SmdInputError, match=r"compare\.json: runs: expected a list"):
        run_compare(spec, out, params, [], warm, data, only="dense")
    assert len(calls) == 3


def test_merge_runs_keeps_a_skipped_runs_seconds():
    from stages.tools.compare import merge_runs

    earlier = [{"run": "a-s0", "seconds": 12.5, "skipped": False}, {"run": "b-s0", "seconds": 3.0, "skipped": False}]
    now = [{"run": "b-s0", "seconds": 0.0, "skipped": True}, {"run": "c-s0", "seconds": 1.0, "skipped": False}]
    assert merge_runs(earlier, now) == [earlier[0], {"run": "b-s0", "seconds": 3.0, "skipped": True}, now[1]]


def test_threads_respect_the_callers_omp_num_threads_and_cpu_affinity(monkeypatch):
    import os

    from stages.tools.compare import available_cpus, thread_env

    assert thread_env(2, {"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert thread_env(2, {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "1"})["MKL_NUM_THREADS"] == "1"
    if hasattr(os, "sched_getaffinity"):
        assert available_cpus() == len(os.sched_getaffinity(0))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # `taskset -c 0`
        monkeypatch.setattr(os, "cpu_count", lambda: 64)
        assert thread_env(2, {}) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
        assert thread_env(2, {"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "4"


def test_run_arm_passes_the_thread_env_and_eval_every_0(tmp_path, monkeypatch):
    import subprocess

    from schemas.compare import CompareSpec
    from stages.tools.compare import run_arm

    seen = {}

    def fake_run(cmd, stdout, stderr, env):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    spec = CompareSpec(iterations=2, eval_every=0, seeds=[0], arms={"dense": {"learner.objective": "dense"}})
    rec = run_arm(tmp_path, "dense", 0, None, tmp_path / "p.yaml", [], tmp_path / "w", tmp_path / "d", spec,
                  {"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "5"})
    assert rec["returncode"] == 0 and not rec["skipped"]
    assert seen["env"]["OMP_NUM_THREADS"] == "5"
    assert seen["cmd"][seen["cmd"].index("--eval-every") + 1] == "0"
    assert not (tmp_path / "dense-s0" / "artifacts" / "iter-000").exists()  # no start evaluation copied in
    progress = tmp_path / "dense-s0" / "artifacts" / "iter-002" / "progress.json"
    progress.parent.mkdir(parents=True)
    progress.write_text("{}")  # without evaluation, a run is complete when its last iteration's progress is written
    assert run_arm(tmp_path, "dense", 0, None, tmp_path / "p.yaml", [], tmp_path / "w", tmp_path / "d", spec,
                   {})["skipped"]


def test_compare_eval_every_0_evaluates_nothing(tmp_path, monkeypatch):
    import stages.tools.compare as compare

    spec, params, warm, data = _cheap_inputs(tmp_path)
    calls: list = []
    _fake_chains(monkeypatch, calls)
    monkeypatch.setattr(compare, "evaluate_starts", lambda *a: pytest.fail("evaluated the start"))
    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["compare", "--out", str(out), "--spec", str(spec), "--params", str(params),
                                   "--warmstart", str(warm), "--data", str(data), "--eval-every", "0"])
    assert res.exit_code == 0, res.output
    assert [(c["eval_every"], c["start_eval"]) for c in calls] == [(0, None), (0, None)]
    assert json.loads((out / "compare.json").read_text())["spec_values"]["eval_every"] == 0
    res = CliRunner().invoke(app, ["compare", "--out", str(out), "--spec", str(spec), "--eval-every", "-1"])
    assert res.exit_code == 2


def test_chain_eval_every_0_never_evaluates(tmp_path, monkeypatch):
    import stages.tools.chain as chain
    from schemas.params import load_params

    evaluated = []

    def fake_iteration(p, n, policy, run, data, is_evaluated):
        evaluated.append(is_evaluated)
        run.iteration(n).progress.parent.mkdir(parents=True, exist_ok=True)
        run.iteration(n).progress.write_text("{}")

    monkeypatch.setattr(chain, "run_iteration", fake_iteration)
    p = load_params(None, [])
    chain.run_chain(p, tmp_path / "off", 3, tmp_path / "warm" / "policy", tmp_path / "data", eval_every=0)
    assert evaluated == [False, False, False]
    chain.run_chain(p, tmp_path / "off", 3, tmp_path / "warm" / "policy", tmp_path / "data", eval_every=0)
    assert len(evaluated) == 3  # resumed: every iteration complete without an evaluation
    chain.run_chain(p, tmp_path / "on", 3, tmp_path / "warm" / "policy", tmp_path / "data", eval_every=2)
    assert evaluated[3:] == [False, True, True]


def test_warm_start_evaluations_are_shared_by_their_effective_compression(tmp_path, monkeypatch):
    """A dense arm scored under `evaluate.compressed_eviction` SnapKV 0.5 and an arm rolling out under SnapKV 0.5
    evaluate the same thing: one evaluation. Another keep ratio is another; an evaluation stored under the earlier
    key (the evaluate section and rollout.eviction as written) is found and reused."""
    import stages.evaluate.stage as evaluate_stage
    from schemas.params import load_params
    from stages.tools.compare import _legacy_eval_key, evaluate_starts

    params = empty_params(tmp_path)
    arms = {
        "dense": load_params(params, ["rollout.eviction.policy=dense", "evaluate.compressed_eviction.policy=snapkv",
                                      "evaluate.compressed_eviction.keep_ratio=0.5"]),
        "smd@0.5": load_params(params, ["rollout.eviction.policy=snapkv", "rollout.eviction.keep_ratio=0.5"]),
        "naive@0.5": load_params(params, ["rollout.eviction.policy=snapkv", "rollout.eviction.keep_ratio=0.5",
                                          "learner.objective=naive"]),
        "smd@0.1": load_params(params, ["rollout.eviction.policy=snapkv", "rollout.eviction.keep_ratio=0.1"]),
    }
    evaluated: list = []

    def fake_evaluate(p, iteration, policy, prompts, target, show_progress=True):
        evaluated.append(target)
        target.mkdir(parents=True)
        (target / "metrics.json").write_text("{}")

    monkeypatch.setattr(evaluate_stage, "run_evaluate", fake_evaluate)
    root = tmp_path / "_start"
    out = evaluate_starts(arms, tmp_path / "warm", tmp_path / "data", root)
    assert len(evaluated) == 2
    assert out["dense"] == out["smd@0.5"] == out["naive@0.5"] != out["smd@0.1"]
    # a comparison started before the shared key: its smd@0.1 evaluation under the old key is reused
    legacy = tmp_path / "old" / _legacy_eval_key(arms["smd@0.1"]) / "evaluate"
    legacy.mkdir(parents=True)
    (legacy / "metrics.json").write_text("{}")
    evaluated.clear()
    again = evaluate_starts({"smd@0.1": arms["smd@0.1"]}, tmp_path / "warm", tmp_path / "data", tmp_path / "old")
    assert evaluated == [] and again["smd@0.1"] == legacy
