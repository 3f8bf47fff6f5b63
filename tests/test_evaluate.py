"""`smdctl evaluate`: dense vs compressed greedy evaluation, determinism, bad input."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.feather as feather
import pytest
from typer.testing import CliRunner

from schemas import rewards
from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.tables import PROMPTS_SCHEMA, SCHEMA_VERSION, read_table, write_table
from stages.evaluate import stage as evaluate_stage
from stages.evaluate.stage import run_evaluate
from tests.helpers import empty_params, make_model_dir, random_prompts

REFERENCES = ["7, 3", "12", "4, 4, 9", "0"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    model_dir = make_model_dir(root, "gqa")
    rows = [
        {"prompt_id": f"e{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids, "reference": ref}
        for i, (ids, ref) in enumerate(zip(random_prompts([40, 28, 35, 33], seed=3), REFERENCES))
    ]
    prompts = write_table(rows, root / "eval.arrow", "prompts")
    return root, model_dir, prompts


def _params(**over):
    sets = {"evaluate.max_new_tokens": 6, "evaluate.batch_size": 3, "rollout.eviction.policy": "snapkv",
            "rollout.eviction.keep_ratio": 0.5, "rollout.eviction.window": 4, "rollout.eviction.sinks": 2, **over}
    return load_params(None, [f"{k}={v}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def snapkv_run(setup):
    root, model_dir, prompts = setup
    return run_evaluate(_params(), 3, model_dir, prompts, root / "iter-003" / "evaluate", show_progress=False)


def test_evaluate_writes_predictions_and_metrics(setup, snapkv_run):
    out = snapkv_run
    assert set(out) == {"predictions", "metrics", "details"}
    read_table(out["predictions"], "eval_predictions")  # validates the contract
    df = pd.read_feather(out["predictions"])
    assert len(df) == 8
    assert list(df["mode"]) == ["dense"] * 4 + ["compressed"] * 4
    assert list(df.prompt_id) == ["e0", "e1", "e2", "e3"] * 2
    assert (df.iteration == 3).all() and (df.task == "kv_retrieval").all()
    for r in df.itertuples():
        assert r.score == pytest.approx(rewards.score(r.task, r.response_text, r.reference))
        assert r.exact_match == rewards.exact_match(r.task, r.response_text, r.reference)
        assert 1 <= len(r.response_token_ids) <= 6
    dense, comp = df[df["mode"] == "dense"], df[df["mode"] == "compressed"]
    assert (dense.kv_peak_tokens == dense.kv_dense_tokens).all()
    assert (comp.kv_peak_tokens < comp.kv_dense_tokens).all()  # 50% SnapKV really compressed

    headline = json.loads(out["metrics"].read_text())
    m = json.loads(out["details"].read_text())
    assert headline == {**{k: m[k] for k in evaluate_stage.HEADLINE}, "schema_version": 1}  # the headline only
    assert m["iteration"] == 3 and m["eval/prompts"] == 4 and m["metric"] == "kv_fraction"
    for mode, part in (("dense", dense), ("compressed", comp)):
        assert m[f"eval/{mode}/score"] == pytest.approx(part.score.mean())
        assert m[f"eval/{mode}/exact_match"] == pytest.approx(part.exact_match.mean())
    assert m["eval/compressed/kv_kept_fraction"] == pytest.approx(comp.kv_peak_tokens.sum() / comp.kv_dense_tokens.sum())
    assert 0 < m["eval/compressed/kv_kept_fraction"] < 0.75
    assert m["eval/dense/kv_kept_fraction"] == 1.0
    assert m["config"]["rollout"]["eviction"]["policy"] == "snapkv"
    assert m["config"]["learner"]["objective"] == "smd"
    assert not any(p.name.startswith(".") for p in out["metrics"].parent.parent.iterdir())  # no temp leftovers


def test_evaluate_is_deterministic(setup, snapkv_run):
    root, model_dir, prompts = setup
    again = run_evaluate(_params(), 3, model_dir, prompts, root / "again", show_progress=False)
    assert again["predictions"].read_bytes() == snapkv_run["predictions"].read_bytes()
    a, b = (json.loads(p.read_text()) for p in (snapkv_run["details"], again["details"]))
    timing = {k for k in a if k.endswith(("/seconds", "/tokens_per_s"))}
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


def test_dense_eviction_gives_identical_modes(setup):
    root, model_dir, prompts = setup
    out = run_evaluate(_params(**{"rollout.eviction.policy": "dense", "evaluate.num_prompts": 3}), 1, model_dir, prompts,
                   root / "dense", show_progress=False)
    df = pd.read_feather(out["predictions"])
    assert len(df) == 6
    cols = ["prompt_id", "response_text", "score", "exact_match", "kv_peak_tokens", "kv_dense_tokens"]
    dense = df[df["mode"] == "dense"][cols].reset_index(drop=True)
    comp = df[df["mode"] == "compressed"][cols].reset_index(drop=True)
    pd.testing.assert_frame_equal(dense, comp)
    assert [list(x) for x in df.response_token_ids[:3]] == [list(x) for x in df.response_token_ids[3:]]
    m = json.loads(out["details"].read_text())
    assert m["eval/dense/score"] == m["eval/compressed/score"]
    assert m["eval/compressed/kv_kept_fraction"] == 1.0 and m["eval/agreement"] == 1.0


def test_compressed_eviction_scores_a_dense_arm_under_compression(setup, snapkv_run):
    """evaluate.compressed_eviction: a dense-rollout arm's compressed mode runs the given compression, so its
    compressed figures are those of an arm whose rollout compresses with it (here: the snapkv run's), not a copy
    of its dense ones."""
    root, model_dir, prompts = setup
    ev = {f"evaluate.compressed_eviction.{k}": v for k, v in
          _params().rollout.eviction.model_dump(exclude_none=True).items()}
    params = _params(**{"rollout.eviction.policy": "dense", **ev})
    assert params.evaluate.compressed_eviction == _params().rollout.eviction
    out = run_evaluate(params, 3, model_dir, prompts, root / "dense-arm", show_progress=False)
    got, want = json.loads(out["details"].read_text()), json.loads(snapkv_run["details"].read_text())
    for key in ("eval/compressed/score", "eval/compressed/kv_kept_fraction", "eval/dense/score"):
        assert got[key] == want[key], key
    assert got["eval/compressed/kv_kept_fraction"] < 1.0
    assert got["config"]["compressed_eviction"]["policy"] == "snapkv"
    assert got["config"]["rollout"]["eviction"]["policy"] == "dense"


def _empty_prompts(path):
    table = pa.Table.from_pylist([], schema=PROMPTS_SCHEMA).replace_schema_metadata(
        {b"schema_version": SCHEMA_VERSION.encode(), b"kind": b"prompts", b"config": b"{}"})
    feather.write_feather(table, str(path), compression="uncompressed")
    return path


def test_bad_inputs_leave_nothing(setup, tmp_path):
    root, model_dir, prompts = setup
    out = tmp_path / "out"
    cases = [
        ((tmp_path / "nope", prompts), "no policy checkpoint"),
        ((model_dir, tmp_path / "missing.arrow"), "missing prompts table"),
        ((model_dir, _empty_prompts(tmp_path / "empty.arrow")), "empty prompts table"),
    ]
    for (policy, table), message in cases:
        with pytest.raises(SmdInputError, match=message):
            run_evaluate(_params(), 1, policy, table, out, show_progress=False)
    with pytest.raises(SmdInputError, match="exceeds the model's 512 positions"):
        run_evaluate(_params(**{"evaluate.max_new_tokens": 500}), 1, model_dir, prompts, out, show_progress=False)
    with pytest.raises(SmdInputError, match="evaluate.num_prompts"):
        _params(**{"evaluate.num_prompts": -1})
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "empty.arrow"]


def test_cli_evaluate(setup, tmp_path):
    from cli.main import app

    root, model_dir, prompts = setup
    base = ["evaluate", "--params", str(empty_params(tmp_path)), "-S", "evaluate.max_new_tokens=3",
            "-S", "evaluate.num_prompts=2", "--prompts", str(prompts)]
    bad = CliRunner().invoke(app, [*base, "--policy", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2
    assert "no policy checkpoint" in bad.output and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    ok = CliRunner().invoke(app, [*base, "-i", "0", "--policy", str(model_dir), "--out", str(tmp_path / "o")])
    assert ok.exit_code == 0, ok.output
    assert "compressed" in ok.output  # the summary table
    assert json.loads((tmp_path / "o" / "details.json").read_text())["iteration"] == 0


def test_summary_rows_warm_start_and_iterations(tmp_path):
    from cli.main import app
    from stages.progress.stage import run_progress, summary_table

    (tmp_path / "warmstart").mkdir()
    (tmp_path / "warmstart" / "metrics.json").write_text(json.dumps(
        {"task": "kv_retrieval", "exact_match": 0.5, "reward": 0.75, "reference_nll": 2.25, "steps": 900,
         "stop_reason": "target"}))
    for stage, metrics in {"rollout": {"reward/mean": 0.4, "kv/kept_fraction": 0.5},
                           "learn": {"mismatch/logprob_abs_diff_max": 1e-6, "mismatch/kl": 0.0, "note": "x"},
                           "evaluate": {"eval/dense/score": 0.8, "eval/compressed/score": 0.7,
                                        "eval/dense/exact_match": 0.6, "eval/compressed/exact_match": 0.4}}.items():
        (tmp_path / "iter-001" / stage).mkdir(parents=True)
        (tmp_path / "iter-001" / stage / "metrics.json").write_text(json.dumps(metrics))
    rows = summary_table(tmp_path)
    # The warm start's eval is dense: its reward and exact match sit under the evaluate stage's names.
    assert rows[0]["iteration"] == 0 and rows[0]["eval/dense/score"] == 0.75
    assert rows[0]["eval/dense/exact_match"] == 0.5 and "eval/compressed/score" not in rows[0]
    assert rows[0]["eval/dense/reference_nll"] == 2.25
    assert rows[1] == {"iteration": 1, "reward/mean": 0.4, "kv/kept_fraction": 0.5,
                       "mismatch/logprob_abs_diff_max": 1e-6, "mismatch/kl": 0.0, "eval/dense/score": 0.8,
                       "eval/compressed/score": 0.7, "eval/dense/exact_match": 0.6,
                       "eval/compressed/exact_match": 0.4}
    assert json.loads(run_progress(1, tmp_path).read_text())["rows"] == [rows[1]]
    out = CliRunner().invoke(app, ["summary", "--artifacts", str(tmp_path)])
    assert out.exit_code == 0
    warm_line = next(line for line in out.output.splitlines() if "warm start" in line)
    assert [c.strip() for c in warm_line.strip("│ ").split("│")] == ["warm start *", "—", "0.75", "—", "0.5", "—",
                                                                      "2.25", "—", "—", "—", "—"]
    # what the |dlogp| column is held to (docs/design.md section 3): the largest gap, the gate, the float32 bound
    assert "largest 1e-06 (iteration 1), held to the learner's gate." in out.output.replace("\n", " ")
    assert "16 eps x max|logit| / temperature" in out.output.replace("\n", " ")
    assert "warm start stage's own greedy evaluation" in " ".join(out.output.split())
    # titled by task and model: the task from the predictions, the model from the policy iteration 1 sampled with
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
                                                   "hidden_size": 576}))
    (model / "provenance.json").write_text(json.dumps({"source": {"path": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}}))
    (tmp_path / "iter-001" / "rollout" / "details.json").write_text(json.dumps({"config": {"policy": str(model)}}))
    write_table([{"prompt_id": "p", "task": "fact_recall", "mode": "dense", "response_text": "1", "score": 1.0,
                  "exact_match": True, "kv_peak_tokens": 3, "kv_dense_tokens": 3, "iteration": 1, "reference": "1",
                  "response_token_ids": [1], "finish_reason": "stop"}],
                tmp_path / "iter-001" / "evaluate" / "predictions.arrow", "eval_predictions", {})
    from stages.progress.stage import run_title

    title = "smd: fact_recall on SmolLM2-135M-Instruct.Q4_1 (LlamaForCausalLM, 30 layers, hidden 576)"
    assert run_title(tmp_path) == title
    assert title in " ".join(CliRunner().invoke(app, ["summary", "--artifacts", str(tmp_path)]).output.split())
    # a compare run's start (the warm start evaluated with evaluate's settings, iteration 0) replaces the warm start
    (tmp_path / "iter-000" / "evaluate").mkdir(parents=True)
    (tmp_path / "iter-000" / "evaluate" / "metrics.json").write_text(json.dumps(
        {"eval/dense/score": 0.7, "eval/compressed/score": 0.5}))
    start = summary_table(tmp_path)[0]
    assert start == {"iteration": 0, "start": "evaluate", "eval/dense/score": 0.7, "eval/compressed/score": 0.5}
    (tmp_path / "iter-001" / "learn" / "metrics.json").write_text("{broken")
    bad = CliRunner().invoke(app, ["summary", "--artifacts", str(tmp_path)])
    assert bad.exit_code == 2 and "learn/metrics.json: not valid JSON" in bad.output
