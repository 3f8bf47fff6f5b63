"""`smdctl report`: Markdown table and PNG plot over synthetic metrics trees and `dvc exp show --json`."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from schemas.errors import SmdInputError
from stages.tools.report import parse_dvc_exp_show, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _run(root, name, iterations, params=None, config=None, learn=True):
    """A project dir `root/name` with artifacts/iter-NNN/{rollout,learn,evaluate}/metrics.json (and the
    evaluate details.json holding the config when given)."""
    project = root / name
    art = project / "artifacts"
    for i in iterations:
        it = art / f"iter-{i:03d}"
        _write(it / "rollout" / "metrics.json", {"iteration": i, "reward/mean": 0.1 * i})
        if learn:
            _write(it / "learn" / "metrics.json", {"mismatch/logprob_abs_diff_max": 2.5e-7 * i})
        ev = {"eval/dense/score": 0.5 + 0.01 * i, "eval/compressed/score": 0.4 + 0.01 * i}
        _write(it / "evaluate" / "metrics.json", ev)
        if config:  # as `smdctl evaluate` records it: in details.json beside the headline metrics
            _write(it / "evaluate" / "details.json", {**ev, "iteration": i, "config": config})
    if params is not None:
        (project / "params.yaml").write_text(yaml.safe_dump(params))
    return project


def _table(md: str, first: str = "| run |") -> list[list[str]]:
    """The Markdown table whose header line starts with `first` (the per-iteration one by default)."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|-"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_arms_mean_and_std_over_seeds(tmp_path):
    from stages.tools.report import arm_rows, load_run

    runs = []
    for seed, ems in ((0, [0.5, 0.6]), (1, [0.5, 0.8])):
        root = tmp_path / f"s{seed}"
        (root / "artifacts" / "warmstart").mkdir(parents=True)
        _write(root / "artifacts" / "warmstart" / "metrics.json", {"exact_match": 0.4, "reward": 0.7})
        for i, em in enumerate(ems, start=1):
            _write(root / "artifacts" / f"iter-{i:03d}" / "evaluate" / "metrics.json", {"eval/dense/exact_match": em})
            _write(root / "artifacts" / f"iter-{i:03d}" / "rollout" / "metrics.json", {"reward/mean": 0.1 * i + seed})
        (root / "params.yaml").write_text(yaml.safe_dump({"learner": {"objective": "dense"}}))
        runs.append(load_run(root))
    (arm,) = arm_rows(runs)
    assert arm["runs"] == 2 and arm["iterations"] == 2
    mean, std, n = arm["dense EM"]
    assert (round(mean, 9), round(std, 9), n) == (0.7, 0.1, 2)  # last iteration: 0.6 and 0.8
    assert arm["dense EM @0"] == 0.4  # the warm start
    assert arm["train reward (last 3)"][0] == pytest.approx(((0.1 + 0.2) / 2 + (1.1 + 1.2) / 2) / 2)
    assert arm["ref NLL"] is None


def test_report_rows_and_plot(tmp_path):
    a = _run(tmp_path, "smd-snap", [1, 2],
             params={"learner": {"objective": "smd"}, "rollout": {"eviction": {"policy": "snapkv", "keep_ratio": 0.3}}})
    b = _run(tmp_path, "naive", [1], learn=False,
             config={"learner": {"objective": "dense"}, "rollout": {"eviction": {"policy": "h2o", "keep_ratio": 0.5}}})
    # b also misses its iteration-2 evaluate: only the rollout file exists there
    _write(b / "artifacts" / "iter-002" / "rollout" / "metrics.json", {"reward/mean": 0.7})
    out = report([a / "artifacts", b], None, tmp_path / "reports")
    md = out["markdown"].read_text()
    rows = _table(md)
    assert rows[0] == ["run", "objective", "policy", "keep_ratio", "iteration", "reward/mean", "eval dense score",
                       "eval compressed score", "mismatch/logprob_abs_diff_max"]
    body = rows[1:]
    assert body == [
        ["naive", "dense", "h2o", "0.5", "1", "0.1000", "0.5100", "0.4100", "—"],
        ["naive", "dense", "h2o", "0.5", "2", "0.7000", "—", "—", "—"],
        ["smd-snap", "smd", "snapkv", "0.3", "1", "0.1000", "0.5100", "0.4100", "2.5e-07"],
        ["smd-snap", "smd", "snapkv", "0.3", "2", "0.2000", "0.5200", "0.4200", "5e-07"],
    ]
    assert "report.png" in md
    assert out["plot"].read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["report.md", "report.png"]


def test_report_labels_runs_from_their_artifacts_not_params_yaml(tmp_path):
    """A run made with `-S` overrides sits beside a params.yaml that says otherwise: the config its stages
    recorded wins; params.yaml fills only what no artifact records."""
    params = {"learner": {"objective": "smd"}, "rollout": {"eviction": {"policy": "snapkv", "keep_ratio": 0.5}}}
    ran = {"learner": {"objective": "dense"}, "rollout": {"eviction": {"policy": "dense", "keep_ratio": 0.5}}}
    a = _run(tmp_path, "overridden", [1, 2], params=params, config=ran)
    # only learn's details.json records a config (its learner section, the trajectory table's rollout config)
    b = _run(tmp_path, "learn-only", [1], params=params)
    _write(b / "artifacts" / "iter-001" / "learn" / "details.json",
           {"config": {"learner": {"objective": "naive"}, "rollout": {"eviction": {"policy": "h2o"}}}})
    out = report([a, b], None, tmp_path / "r")
    rows = _table(out["markdown"].read_text())
    assert [r[:5] for r in rows[1:]] == [
        ["overridden", "dense", "dense", "0.5", "1"],
        ["overridden", "dense", "dense", "0.5", "2"],
        ["learn-only", "naive", "h2o", "0.5", "1"],  # keep ratio: recorded nowhere, from params.yaml
    ]


def test_arm_label_names_lora_from_the_artifacts_else_params_yaml(tmp_path):
    from stages.tools.report import _series_label, arm_rows, load_run

    full = load_run(_run(tmp_path, "full", [1], params={"learner": {"objective": "dense"}}))
    lora = load_run(_run(tmp_path, "lora", [1], params={"learner": {"objective": "dense", "lora": {"rank": 4}}}))
    default_rank = load_run(_run(tmp_path, "lora-default", [1], params={"learner": {"lora": {"alpha": 8.0}}}))
    # learn's details.json records the whole learner section: a run it says has no LoRA has none, whatever
    # params.yaml beside it says
    recorded = _run(tmp_path, "recorded", [1], params={"learner": {"lora": {"rank": 4}}})
    _write(recorded / "artifacts" / "iter-001" / "learn" / "details.json",
           {"config": {"learner": {"objective": "dense", "lora": None}}})
    assert [r.config.get("lora") for r in (full, lora, default_rank, load_run(recorded))] == [None, 4, 16, None]
    assert "lora" not in full.config  # (a full-weight run's config is as before)
    assert _series_label(lora.config) == "dense LoRA r4 / snapkv @ 0.5"
    assert _series_label(full.config) == "dense / snapkv @ 0.5"
    assert sorted(row["arm"] for row in arm_rows([full, lora])) == ["dense / snapkv @ 0.5",
                                                                   "dense LoRA r4 / snapkv @ 0.5"]


def test_report_defaults_fill_params_and_unknown_config(tmp_path, monkeypatch):
    _run(tmp_path, "proj", [1], params={"learner": {"kl_lambda": 0.2}})  # objective etc. take schema defaults
    bare = _run(tmp_path, "bare", [1])  # neither params.yaml nor a recorded config
    monkeypatch.chdir(tmp_path / "proj")
    out = report(None, None, "reports")  # default: ./artifacts as one run
    assert _table(out["markdown"].read_text())[1][:5] == ["proj", "smd", "snapkv", "0.5", "1"]
    out = report([bare], None, tmp_path / "r2")
    assert _table(out["markdown"].read_text())[1][:5] == ["bare", "—", "—", "—", "1"]


def test_report_bad_runs(tmp_path):
    (tmp_path / "empty" / "artifacts").mkdir(parents=True)
    with pytest.raises(SmdInputError, match="no metrics"):
        report([tmp_path / "empty"], None, tmp_path / "reports")
    with pytest.raises(SmdInputError, match="no such run directory"):
        report([tmp_path / "nope"], None, tmp_path / "reports")
    bad = _run(tmp_path, "bad", [1])
    (bad / "artifacts" / "iter-001" / "learn" / "metrics.json").write_text("{not json")
    with pytest.raises(SmdInputError, match="learn/metrics.json: not readable JSON"):
        report([bad], None, tmp_path / "reports")
    assert not (tmp_path / "reports").exists()


def _exp(rev, name, params, metrics, experiments=None):
    return {
        "rev": rev, "name": name, "error": None,
        "data": {"rev": rev, "timestamp": None, "params": {"params.yaml": {"data": params}},
                 "metrics": {k: {"data": v} for k, v in metrics.items()}, "deps": {}, "outs": {}, "meta": {}},
        "experiments": experiments,
    }


def _dvc_json():
    def metrics(objective_offset):
        return {
            "artifacts/iter-001/rollout/metrics.json": {"reward/mean": 0.2 + objective_offset},
            "artifacts/iter-001/evaluate/metrics.json": {"eval/dense/score": 0.6, "eval/compressed/score": 0.5},
            "artifacts/iter-001/learn/metrics.json": {"mismatch/logprob_abs_diff_max": 1e-7},
            "artifacts/iter-002/rollout/metrics.json": {"reward/mean": 0.3 + objective_offset},
        }

    def params(objective, keep):
        return {"learner": {"objective": objective}, "rollout": {"eviction": {"policy": "snapkv", "keep_ratio": keep}}}

    exp1 = _exp("a" * 40, "exp-tis", params("tis", 0.5), metrics(0.0))
    exp2 = _exp("b" * 40, "exp-smd", params("smd", 0.3), metrics(0.1))
    queued = {"rev": "c" * 40, "name": "exp-queued", "data": None, "error": None, "experiments": None}
    baseline = _exp("d" * 40, "main", params("smd", 0.5), {}, experiments=[
        {"revs": [exp1], "executor": None, "name": "exp-tis"},
        {"revs": [exp2], "executor": None, "name": "exp-smd"},
        {"revs": [queued], "executor": {"state": "queued", "name": None, "local": None}, "name": "exp-queued"},
    ])
    workspace = _exp("workspace", None, params("smd", 0.3), metrics(0.1))  # exp-smd applied there
    return [workspace, baseline]


def test_dvc_exp_show_json(tmp_path):
    runs, skipped = parse_dvc_exp_show(_dvc_json())
    assert [r.name for r in runs] == ["exp-tis", "exp-smd"]
    assert runs[1].config == {"objective": "smd", "policy": "snapkv", "keep_ratio": 0.3, "kl_lambda": 0.1,
                              "kl_tokens": "all", "kl_teacher": "current", "eviction_apply": True}  # defaults
    assert any("exp-queued" in s for s in skipped) and any("main" in s for s in skipped)
    assert "workspace (same as exp-smd)" in skipped
    path = tmp_path / "exps.json"
    path.write_text(json.dumps(_dvc_json()))
    out = report(None, path, tmp_path / "reports")
    body = _table(out["markdown"].read_text())[1:]
    assert body == [
        ["exp-smd", "smd", "snapkv", "0.3", "1", "0.3000", "0.6000", "0.5000", "1e-07"],
        ["exp-smd", "smd", "snapkv", "0.3", "2", "0.4000", "—", "—", "—"],
        ["exp-tis", "tis", "snapkv", "0.5", "1", "0.2000", "0.6000", "0.5000", "1e-07"],
        ["exp-tis", "tis", "snapkv", "0.5", "2", "0.3000", "—", "—", "—"],
    ]
    assert out["plot"].read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SmdInputError, match="expected the JSON list"):
        parse_dvc_exp_show({"not": "a list"})


def test_dvc_exp_show_json_of_the_headline(tmp_path):
    """Experiments whose one DVC metric is the headline (artifacts/metrics.json): the last iteration's row and
    the warm start's dense score as iteration 0."""
    def headline(objective, reward):
        return {"artifacts/metrics.json": {"iteration": 6, "reward": reward, "dense": 0.68, "compressed": 0.65,
                                           "dense_em": 0.33, "compressed_em": 0.27, "ref_nll": 2.7, "kv_kept": 0.5,
                                           "dlogp_max": 1.2e-5, "mismatch_kl": 1e-8, "warm_dense": 0.69}}

    params = {"learner": {"objective": "smd"}, "rollout": {"eviction": {"policy": "snapkv", "keep_ratio": 0.5}}}
    naive = _exp("a" * 40, "exp-naive", {**params, "learner": {"objective": "naive"}}, headline("naive", 0.4))
    baseline = _exp("d" * 40, "main", params, {}, experiments=[{"revs": [naive], "executor": None, "name": "exp-naive"}])
    workspace = _exp("workspace", None, params, headline("smd", 0.6))
    runs, skipped = parse_dvc_exp_show([workspace, baseline])
    assert [r.name for r in runs] == ["workspace", "exp-naive"] and skipped == ["main (no iteration metrics)"]
    assert runs[1].config["objective"] == "naive"
    assert runs[1].metrics == {
        0: {"evaluate": {"eval/dense/score": 0.69}},
        6: {"rollout": {"reward/mean": 0.4, "kv/kept_fraction": 0.5},
            "evaluate": {"eval/dense/score": 0.68, "eval/compressed/score": 0.65, "eval/dense/exact_match": 0.33,
                         "eval/compressed/exact_match": 0.27, "eval/dense/reference_nll": 2.7},
            "learn": {"mismatch/logprob_abs_diff_max": 1.2e-5, "mismatch/kl": 1e-8}},
    }
    out = report(None, _write_json(tmp_path / "exps.json", [workspace, baseline]), tmp_path / "reports")
    body = _table(out["markdown"].read_text())[1:]
    assert ["exp-naive", "naive", "snapkv", "0.5", "6", "0.4000", "0.6800", "0.6500", "1.2e-05"] in body
    assert ["exp-naive", "naive", "snapkv", "0.5", "0", "—", "0.6900", "—", "—"] in body


def _write_json(path, data):
    path.write_text(json.dumps(data))
    return path


def test_cli_report(tmp_path):
    from cli.main import app

    (tmp_path / "empty").mkdir()
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    assert bad.exit_code == 2 and "no metrics" in bad.output
    run = _run(tmp_path, "ok", [1])
    ok = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "r")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "r" / "report.md").exists() and (tmp_path / "r" / "report.png").exists()
