"""Your data, your reward (issue 33) through the stages: rollout scores with the user's functions (in-process or in
a pool, the same rewards), records each function's value and the file's digest, carries the data set row; a bad
reward is one line naming file, function and row, with nothing written; the README's worked example runs as
written (slow)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from schemas.errors import SmdInputError
from schemas.tables import read_table, table_config, write_table
from scripts.readme_commands import command
from stages.common.scoring import check_reward_record, reward_file_digests
from stages.rollout.stage import run_rollout
from tests.helpers import ROOT, make_model_dir, make_params, random_prompts, subprocess_env

REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (len(solution_str) % 3) / 2, "source_ok": data_source == "kv_demo"}


def per_row(prompts, completions, completion_ids, **kwargs):
    return [None if ids[0] % 4 == 0 else float(len(ids)) + int(kwargs["extra_info"][i]["index"])
            for i, ids in enumerate(completion_ids)]


def broken(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 2:
        raise ValueError("cannot score this one")
    return 1.0
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("your-data"), "gqa")


def user_prompts(root: Path) -> Path:
    rows = []
    for i, ids in enumerate(random_prompts([30, 41, 36], seed=3)):
        row = {"data_source": "kv_demo", "prompt": f"question {i}", "reward_model": {"ground_truth": str(i)},
               "extra_info": {"split": "train", "index": i}}
        rows.append({"prompt_id": f"train-{i}", "task": "dataset", "prompt": row["prompt"], "prompt_token_ids": ids,
                     "reference": str(i), "row_json": json.dumps(row)})
    return write_table(rows, root / "train.arrow", "prompts")


def rollout_params(rewards: Path, *functions: str, **over):
    return make_params(**{"prepare.task": "dataset", "prepare.train_file": "x.jsonl",
                          "reward.function": "[" + ",".join(f"{rewards}:{f}" for f in functions) + "]", **over})


def test_rollout_scores_with_the_users_functions_pool_or_not(model_dir, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    prompts = user_prompts(tmp_path)
    p = rollout_params(rewards, "compute_score", "per_row", **{"reward.weights": "[2.0,0.5]"})
    out = run_rollout(p, 1, model_dir, prompts, tmp_path / "a", show_progress=False)
    table = read_table(out["trajectories"], "trajectories")
    df = table.to_pandas()
    for row in df.itertuples():
        data = json.loads(row.row_json)
        terms = json.loads(row.reward_terms)
        text, ids = row.response_text, list(row.response_token_ids)
        want_a = (len(text) % 3) / 2  # hand rule of compute_score
        want_b = None if ids[0] % 4 == 0 else float(len(ids)) + data["extra_info"]["index"]
        assert terms == {"compute_score": want_a, "per_row": want_b}
        assert row.reward == pytest.approx(2.0 * want_a + (0.5 * want_b if want_b is not None else 0.0), abs=1e-6)
    digest = reward_file_digests(p.reward)[str(rewards)]
    assert table_config(table)["reward_digests"] == {f"{rewards}:compute_score": digest, f"{rewards}:per_row": digest}
    details = json.loads((tmp_path / "a" / "details.json").read_text())
    values = details.get("values", details)
    assert values["rewards/compute_score/mean"] == pytest.approx(df.reward_terms.map(
        lambda t: json.loads(t)["compute_score"]).mean())
    # the dict return's other keys (verl's reward_extra_info): per row in the table, their mean in details.json
    assert [json.loads(e) for e in df.reward_extras] == [{"compute_score/source_ok": True}] * len(df)
    assert values["rewards/compute_score/source_ok/mean"] == 1.0
    from stages.progress.stage import iteration_row  # and in progress.json's rows, which TensorBoard draws

    (tmp_path / "run" / "iter-001").mkdir(parents=True)
    shutil.copytree(tmp_path / "a", tmp_path / "run" / "iter-001" / "rollout")
    row = iteration_row(tmp_path / "run", 1)
    assert row["rewards/compute_score/source_ok/mean"] == 1.0
    assert row["rewards/per_row/mean"] == values["rewards/per_row/mean"]
    # the same rewards from a pool of 2 processes
    pooled = run_rollout(rollout_params(rewards, "compute_score", "per_row", **{"reward.weights": "[2.0,0.5]",
                                                                                 "reward.workers": 2}),
                         1, model_dir, prompts, tmp_path / "b", show_progress=False)
    again = pd.read_feather(pooled["trajectories"])
    assert list(again.reward) == list(df.reward) and list(again.reward_terms) == list(df.reward_terms)


def test_warm_start_writes_each_functions_mean_for_tensorboards_iteration_0(model_dir, tmp_path):
    """The warm start's details.json has each reward function's mean and a verl function's extras, as rollout's and
    evaluate's do, and the progress row of iteration 0 (TensorBoard's) carries them under evaluate's names."""
    from stages.progress.stage import warmstart_row
    from stages.warmstart import run_warmstart

    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(user_prompts(data), data / "eval.arrow")
    p = rollout_params(rewards, "compute_score", "per_row", **{"model.init_path": str(model_dir),
                                                                "warmstart.steps": 0,
                                                                "warmstart.eval_max_new_tokens": 5})
    run = tmp_path / "run" / "artifacts"
    out = run_warmstart(p.warmstart, p.model, data, run / "warmstart", seed=0, reward=p.reward)
    details = json.loads(out["details"].read_text())
    for key in ("rewards/compute_score/mean", "rewards/per_row/mean", "rewards/compute_score/source_ok/mean"):
        assert isinstance(details[key], float), key
    assert details["rewards/compute_score/source_ok/mean"] == 1.0
    assert 0.0 <= details["rewards/compute_score/mean"] <= 1.0
    row = warmstart_row(run)
    assert row["eval/dense/rewards/compute_score/mean"] == details["rewards/compute_score/mean"]
    assert row["eval/dense/rewards/compute_score/source_ok/mean"] == 1.0
    assert row["eval/dense/score"] == details["reward"]


def test_a_reward_that_raises_is_one_line_and_nothing_is_written(model_dir, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    p = rollout_params(rewards, "broken")
    with pytest.raises(SmdInputError, match=r"rewards.py:broken: .*train-2.*ValueError: cannot score this one"):
        run_rollout(p, 1, model_dir, user_prompts(tmp_path), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_changed_reward_file_stops_a_resumed_run(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    p = rollout_params(rewards, "compute_score")
    check_reward_record(p.reward, tmp_path / "reward_files.json")  # first start: recorded
    check_reward_record(p.reward, tmp_path / "reward_files.json")  # same file: fine
    rewards.write_text(REWARDS + "\n# edited\n")
    with pytest.raises(SmdInputError, match=r"rewards.py: reward.function: the file changed since this run started"):
        check_reward_record(p.reward, tmp_path / "reward_files.json")
    other = rollout_params(rewards, "compute_score", "per_row")
    rewards.write_text(REWARDS)
    with pytest.raises(SmdInputError, match=r"reward: the reward functions changed since this run started"):
        check_reward_record(other.reward, tmp_path / "reward_files.json")


def repo_copy(root: Path) -> Path:
    """The repository's tracked files (the committed params.yaml among them) copied under `root`: a README block
    runs there as from the repository root."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, root / name)
    return root


def as_test_venv(script: str) -> str:
    """A README block with `.venv/bin/` pointing at the interpreter running the tests."""
    return script.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")


@pytest.mark.slow
def test_the_readme_example_runs_end_to_end(tmp_path):
    script = command("your_data")  # the README's block, as written (scripts/readme_commands.py)
    assert "smdctl chain" in script and "docs/examples/your_data/rewards.py" in script
    root = repo_copy(tmp_path / "repo")
    assert (root / "params.yaml").read_text() == (ROOT / "params.yaml").read_text()
    proc = subprocess.run(["bash", "-euc", as_test_venv(script)], cwd=root, env=subprocess_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = root / "runs" / "your_data" / "run" / "artifacts" / "iter-001"
    trajectories = pd.read_feather(run / "rollout" / "trajectories.arrow")
    assert len(trajectories) == 16 and (trajectories.task == "dataset").all()
    for row in trajectories.itertuples():
        terms = json.loads(row.reward_terms)
        assert row.reward == pytest.approx(terms["compute_score"] + 0.5 * (terms["distinct"] or 0.0), abs=1e-6)
        assert json.loads(row.row_json)["data_source"] == "kv_demo"
    details = json.loads((run / "evaluate" / "details.json").read_text())
    values = details.get("values", details)
    assert values["metric"] == "reward:compute_score+distinct" and "eval/dense/rewards/distinct/mean" in values
    assert "smd: dataset on" in proc.stdout + proc.stderr  # the summary's title


def test_bench_reward_prints_the_side_by_side_table():
    from stages.bench.reward import bench_reward

    lines: list[str] = []
    results = bench_reward([0, 2], 1.0, None, num_prompts=2, group_size=2, prompt_tokens=12, new_tokens=3,
                           batch_size=2, repeats=1, print_fn=lines.append)
    assert [r["config"] for r in results] == ["built-in scorer", "1 ms reward, workers 0", "1 ms reward, workers 2"]
    assert results[1]["rewards"] == results[2]["rewards"] and len(results[1]["rewards"]) == 4
    assert lines[-1] == "rewards identical across worker counts: True"
    assert any(line.startswith("1 ms reward, workers 2") and line.endswith("x") for line in lines)


CHAIN_SETS = ["rollout.prompts_per_iteration=2", "rollout.group_size=2", "rollout.max_new_tokens=3",
              "rollout.batch_size=4", "rollout.eviction.window=4", "rollout.eviction.sinks=2",
              "learner.micro_batch_size=4", "evaluate.max_new_tokens=3", "evaluate.batch_size=4"]


def test_a_failed_first_start_is_retried_after_the_fix(model_dir, tmp_path, monkeypatch):
    """A chain whose reward file has a syntax error stops before writing anything; one whose reward raises on a
    row stops in iteration 1's rollout; after the fix, the same command runs (no clean-up by hand)."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.helpers import empty_params, write_prompt_splits

    monkeypatch.chdir(tmp_path)
    data = write_prompt_splits(tmp_path / "data")
    rewards = tmp_path / "rewards.py"
    run = tmp_path / "run"
    args = ["chain", "--run-dir", str(run), "--params", str(empty_params(tmp_path)), "--warmstart", str(model_dir),
            "--data", str(data), "--iterations", "1", "-S", f"reward.function={rewards}:compute_score",
            *[x for s in CHAIN_SETS for x in ("-S", s)]]
    rewards.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n    return 1.0\n")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "SyntaxError" in res.output and len(res.output.strip().splitlines()) == 1
    assert not run.exists()  # left as it was found
    rewards.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    raise ValueError('not yet')\n")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "raised on row" in res.output and "not yet" in res.output
    assert (run / "reward_files.json").is_file() and not list(run.glob("artifacts/iter-*/rollout"))
    rewards.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return float(len(solution_str) % 2)\n")
    res = CliRunner().invoke(app, args)  # the fixed file, the same command
    assert res.exit_code == 0, res.output
    table = pd.read_feather(run / "artifacts" / "iter-001" / "rollout" / "trajectories.arrow")
    assert [json.loads(t)["compute_score"] for t in table.reward_terms] == [float(len(s) % 2) for s in
                                                                            table.response_text]
    # once an iteration has scored, a changed file is refused as before
    rewards.write_text(rewards.read_text() + "# edited\n")
    res = CliRunner().invoke(app, [*args, "--iterations", "2"])
    assert res.exit_code == 2 and "the file changed since this run started" in res.output


HANGS = '''
import time


def hang(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        while True:
            try:
                time.sleep(3600)
            except Exception:  # a function's own broad except does not swallow the timeout
                pass
    return 1.0


def hang_batch(prompts, completions, completion_ids, **kwargs):
    if any(info["index"] == 2 for info in kwargs["extra_info"]):
        time.sleep(3600)
    return [1.0] * len(prompts)


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.3)
    return 1.0
'''


@pytest.mark.parametrize("function,workers,row", [("hang", 0, "train-1"), ("hang", 2, "train-1"),
                                                  ("hang_batch", 0, "train-2")])
def test_a_reward_that_hangs_stops_at_the_timeout_naming_the_row(model_dir, tmp_path, function, workers, row):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(HANGS)
    p = rollout_params(rewards, function, **{"reward.timeout_s": 1, "reward.workers": workers})
    prompts = user_prompts(tmp_path)
    out = tmp_path / "iter" / "rollout"
    with pytest.raises(SmdInputError, match=rf"^reward.function: {rewards}:{function}: no result for row {row} "
                                            r"within reward.timeout_s=1 s"):
        run_rollout(p, 1, model_dir, prompts, out, show_progress=False)
    assert not (tmp_path / "iter").exists() or not list((tmp_path / "iter").iterdir())  # no partial directory


def test_scoring_that_runs_long_prints_progress(model_dir, tmp_path, monkeypatch, capsys):
    import stages.common.reward_functions as rf

    monkeypatch.setattr(rf, "PROGRESS_EVERY_S", 0.2)
    rewards = tmp_path / "rewards.py"
    rewards.write_text(HANGS)
    out = run_rollout(rollout_params(rewards, "slow", **{"reward.timeout_s": "null"}), 1, model_dir,
                      user_prompts(tmp_path), tmp_path / "out", show_progress=False)
    err = capsys.readouterr().err
    assert re.search(rf"reward.function: {rewards}:slow: row train-\d still running after 0 s \(no reward.timeout_s\)",
                     err), err
    assert re.search(rf"reward.function: {rewards}:slow: \d+ of \d+ rows scored in \d+ s", err), err
    assert pd.read_feather(out["trajectories"]).reward.eq(1.0).all()
