"""Foundation contracts: params validation, table schemas, atomic writes, tiny model and tokenizer, CLI."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.feather as feather
import pytest
import yaml
from typer.testing import CliRunner

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.params import check_iterations_file, iterations_yaml, load_params
from schemas.tables import SCHEMA_VERSION, read_table, write_table
from stages.common.model import load_policy

PROMPT_ROW = {"prompt_id": "p0", "task": "kv_retrieval", "prompt": "key cat = 1 2", "prompt_token_ids": [1, 2],
              "reference": "1 2"}


def test_params_unknown_key_and_range_name_the_key(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(SmdInputError, match=r"params.yaml: rollout.group_sise: unknown key"):
        load_params(f)
    with pytest.raises(SmdInputError, match=r"rollout.eviction.keep_ratio"):
        load_params(None, ["rollout.eviction.keep_ratio=0"])
    with pytest.raises(SmdInputError, match=r"expected KEY=VALUE"):
        load_params(None, ["rollout.group_size"])
    assert load_params(None, ["learner.kl_lambda=0.8"]).learner.kl_lambda == 0.8


def test_params_yaml_in_repo_is_valid_and_complete():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = load_params(root / "params.yaml")
    check_iterations_file(root / "iterations.yaml", p.pipeline.num_iterations)  # the committed chain is in sync


def test_iterations_file_generated_from_the_count(tmp_path):
    path = tmp_path / "iterations.yaml"
    path.write_text(iterations_yaml(3))
    items = yaml.safe_load(path.read_text())["iterations"]
    assert items["1"] == {"n": 1, "id": "001", "policy": "artifacts/warmstart/policy"}
    assert items["3"] == {"n": 3, "id": "003", "policy": "artifacts/iter-002/policy"}
    assert list(items) == ["1", "2", "3"]
    check_iterations_file(path, 3)
    with pytest.raises(SmdInputError, match=r"iterations.yaml: iterations: lists 3 iteration\(s\), params "
                                            r"pipeline.num_iterations is 5; run `smdctl iterations`"):
        check_iterations_file(path, 5)
    with pytest.raises(SmdInputError, match="pipeline.num_iterations"):
        load_params(None, ["pipeline.num_iterations=0"])


def test_prompts_table_round_trip_with_pandas(tmp_path):
    import pandas as pd

    path = write_table([PROMPT_ROW], tmp_path / "train.arrow", "prompts", {"task": "kv_retrieval"})
    table = read_table(path, "prompts")
    assert table.schema.metadata[b"schema_version"].decode() == SCHEMA_VERSION
    assert json.loads(table.schema.metadata[b"config"]) == {"task": "kv_retrieval"}
    df = pd.read_feather(path)
    assert df.prompt_id.tolist() == ["p0"] and list(df.prompt_token_ids[0]) == [1, 2]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.drop_columns(["reference"]), "reference: missing column"),
        (lambda t: t.replace_schema_metadata({b"schema_version": b"0", b"kind": b"prompts"}), "schema_version: 0"),
        (lambda t: t.replace_schema_metadata({}), "schema_version: missing"),
        (lambda t: t.set_column(3, "prompt_token_ids", pa.array([[1.0, 2.0]])), "prompt_token_ids: type"),
    ],
)
def test_table_validation_rejects_bad_files(tmp_path, mutate, message):
    good = write_table([PROMPT_ROW], tmp_path / "good.arrow", "prompts")
    bad = tmp_path / "bad.arrow"
    feather.write_feather(mutate(feather.read_table(str(good))), str(bad))
    with pytest.raises(SmdInputError, match=message) as err:
        read_table(bad, "prompts")
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_unreadable_and_missing_tables(tmp_path):
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(SmdInputError, match="not a readable Arrow file"):
        read_table(tmp_path / "junk.arrow", "prompts")
    with pytest.raises(SmdInputError, match="missing prompts table"):
        read_table(tmp_path / "nope.arrow", "prompts")


def test_trajectory_validation_rejects_nan_reward(tmp_path):
    row = {"trajectory_id": "t", "prompt_id": "p", "group_index": 0, "iteration": 1, "task": "kv_retrieval",
           "prompt_token_ids": [1], "response_token_ids": [2], "response_text": "x", "rollout_logprobs": [-0.1],
           "reward": float("nan"), "finish_reason": "stop", "eviction_policy": "dense", "keep_ratio": 1.0,
           "max_tokens": None, "kv_peak_tokens": 2, "kv_dense_tokens": 2, "mask_row": 0}
    with pytest.raises(SmdInputError, match="reward: row 0 is nan"):
        write_table([row], tmp_path / "t.arrow", "trajectories")
    assert not list(tmp_path.iterdir())


def test_atomic_path_leaves_nothing_on_error_and_keeps_old(tmp_path):
    target = tmp_path / "out"
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("new")
        raise RuntimeError("boom")
    assert (target / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(SmdInputError, match="no policy checkpoint"):
        load_policy(tmp_path)


def test_cli_help_lists_every_command():
    from cli.main import app

    out = CliRunner().invoke(app, ["--help"]).output
    for cmd in ("init-model", "prepare", "warmstart", "rollout", "compact", "learn", "evaluate", "inspect",
                "report", "summary", "bench", "params"):
        assert cmd in out


def test_cli_unknown_param_exits_2(tmp_path):
    from cli.main import app

    f = tmp_path / "params.yaml"
    f.write_text("learner:\n  objective: ppo\n")
    result = CliRunner().invoke(app, ["params", "--params", str(f)])
    assert result.exit_code == 2
    assert "learner.objective" in result.output
