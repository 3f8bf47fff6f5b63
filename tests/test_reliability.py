"""No data loss and one-line refusals (issue 13): directory ownership, init-model with a user's model, missing
params files, top-k/top-p refused, metrics files versioned and carrying their config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
import zarr
from typer.testing import CliRunner

from cli.main import app
from schemas.atomic import OWNER_MARKER, atomic_path, owned_by_smd
from schemas.errors import SmdInputError
from schemas.metrics import METRICS_SCHEMA_VERSION, write_metrics
from schemas.params import load_params
from stages.common.model import build_tiny_model, build_tiny_tokenizer
from tests.helpers import SHAPES, empty_params


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path -> sha256): byte-identical means equal snapshots."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _user_model(path: Path) -> Path:
    """A stand-in for a user's Hugging Face model directory: saved by transformers, not by smd (no marker)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(SHAPES["gqa"], vocab_size=len(tokenizer), seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text("my fine-tuned model\n")
    assert (path / "model.safetensors").is_file() and not owned_by_smd(path)
    return path


def _weights_only(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "notes.txt").write_text("do not delete\n")
    return path


def _one_line_error(result, *needles: str) -> str:
    err = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output, err
    for needle in needles:
        assert needle in err, err
    return err


# --- atomic_path ownership ----------------------------------------------------------------------------------


def test_atomic_path_marks_its_directories_and_replaces_them(tmp_path):
    target = tmp_path / "out"
    for text in ("one", "two"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "a").write_text(text)
    assert (target / "a").read_text() == "two"
    assert owned_by_smd(target) and (target / OWNER_MARKER).is_file()
    first = (target / OWNER_MARKER).read_bytes()
    with atomic_path(target) as tmp:
        tmp.mkdir()
    assert (target / OWNER_MARKER).read_bytes() == first  # constant content: reruns stay byte-identical
    with atomic_path(tmp_path / "f.txt") as tmp:  # files get no marker
        tmp.write_text("x")
    assert (tmp_path / "f.txt").read_text() == "x"


@pytest.mark.parametrize("writes", ["dir", "file"])
def test_atomic_path_refuses_a_foreign_directory(tmp_path, writes):
    foreign = _weights_only(tmp_path / "mine")
    before = _snapshot(foreign)
    with pytest.raises(SmdInputError) as err, atomic_path(foreign) as tmp:
        if writes == "dir":
            tmp.mkdir()
            (tmp / "model.safetensors").write_text("tiny")
        else:
            tmp.write_text("x")
    msg = str(err.value)
    assert str(foreign) in msg and "did not create" in msg and "\n" not in msg
    assert _snapshot(foreign) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left behind


def test_atomic_path_refuses_a_directory_that_appears_while_writing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(SmdInputError, match="did not create"), atomic_path(target) as tmp:
        tmp.mkdir()
        _weights_only(target)  # e.g. the user copied a model there meanwhile
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_path_replaces_an_empty_directory_and_refuses_a_link(tmp_path):
    (tmp_path / "empty").mkdir()
    with atomic_path(tmp_path / "empty") as tmp:
        tmp.mkdir()
    assert owned_by_smd(tmp_path / "empty")
    real = _weights_only(tmp_path / "real")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(SmdInputError, match="link"), atomic_path(tmp_path / "link") as tmp:
        tmp.mkdir()
    assert (tmp_path / "link").is_symlink() and (real / "notes.txt").is_file()


def test_zarr_stores_are_owned_through_their_metadata(tmp_path):
    """A Zarr store carries no marker file (Zarr would warn about it); its smd root attributes mark it."""
    store = tmp_path / "s.zarr"
    for _ in range(2):
        with atomic_path(store) as tmp:
            root = zarr.open_group(str(tmp), mode="w")
            root.attrs.update({"kind": "raw_masks", "schema_version": 1})
            root.create_group("shard-00000")
    assert not (store / OWNER_MARKER).exists() and owned_by_smd(store)
    foreign = tmp_path / "theirs.zarr"
    zarr.open_group(str(foreign), mode="w").create_group("data")
    before = _snapshot(foreign)
    with pytest.raises(SmdInputError, match="did not create"), atomic_path(foreign) as tmp:
        tmp.mkdir()
    assert _snapshot(foreign) == before


def test_stage_directory_restored_file_by_file_stays_replaceable(tmp_path):
    """DVC checks out rollout/, learn/, evaluate/ file by file (no marker): only smd's files there -> smd's."""
    stage = tmp_path / "rollout"
    stage.mkdir()
    for name in ("metrics.json", "details.json", "trajectories.arrow"):
        (stage / name).write_text("{}")
    root = zarr.open_group(str(stage / "masks.raw.zarr"), mode="w")
    root.attrs.update({"kind": "raw_masks", "schema_version": 1})
    (stage / ".masks.raw.zarr.tmp-0123abcd").mkdir()  # a temporary left by a killed run
    assert owned_by_smd(stage)
    (stage / "model.safetensors").write_text("weights")  # anything else makes it someone else's
    with pytest.raises(SmdInputError, match="did not create"), atomic_path(stage) as tmp:
        tmp.mkdir()
    (stage / "model.safetensors").unlink()
    with atomic_path(stage) as tmp:
        tmp.mkdir()
        (tmp / "metrics.json").write_text("new")
    assert sorted(p.name for p in stage.iterdir()) == [OWNER_MARKER, "metrics.json"]


# --- commands and a user's directory -----------------------------------------------------------------------

COMMANDS = {
    "params --write": lambda d: ["params", "--write", str(d)],
    "init-model -S model.init_path (not a model)": lambda d: ["init-model", "-S", f"model.init_path={d}"],
    "init-model --out (a model)": lambda d: ["init-model", "--out", str(d)],
}


@pytest.mark.parametrize("case", list(COMMANDS))
def test_commands_refuse_a_foreign_directory(tmp_path, case):
    foreign = (_user_model if "(a model)" in case else _weights_only)(tmp_path / "mine")
    before = _snapshot(foreign)
    res = CliRunner().invoke(app, [*COMMANDS[case](foreign), "-p", str(empty_params(tmp_path))])
    _one_line_error(res, str(foreign), "refusing")
    assert _snapshot(foreign) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["defaults.yaml", "mine"]


def test_init_model_refuses_a_users_model_at_its_own_output_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user = _user_model(Path("artifacts/model/init"))
    before = _snapshot(user)
    res = CliRunner().invoke(app, ["init-model", "-p", str(empty_params(tmp_path))])
    _one_line_error(res, "artifacts/model/init", "refusing", "model.init_path")
    assert _snapshot(user) == before


def test_init_model_rebuilds_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = str(empty_params(tmp_path))
    for _ in range(2):
        res = CliRunner().invoke(app, ["init-model", "-p", params])
        assert res.exit_code == 0, res.output
    init = tmp_path / "artifacts" / "model" / "init"
    assert owned_by_smd(init) and (init / "model.safetensors").is_file()


def test_real_model_flow_trains_from_the_users_directory_untouched(tmp_path, monkeypatch):
    """What `dvc exp run -S model.init_path=DIR` runs (init-model, prepare, warmstart with params.yaml): init-model
    builds nothing and records DIR in its own output, the stages read DIR, DIR stays byte-identical."""
    user = _user_model(tmp_path / "my-model")
    before = _snapshot(user)
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(yaml.safe_dump({
        "model": {"init_path": str(user)},
        "prepare": {"num_train": 32, "num_eval": 4, "context_tokens": 40},
        "warmstart": {"steps": 2, "batch_size": 4, "warmup_steps": 1, "log_every": 1, "eval_batch_size": 4,
                      "target_exact_match": 0.0},
    }))
    runner = CliRunner()
    res = runner.invoke(app, ["init-model"])
    assert res.exit_code == 0, res.output
    assert "using it as is" in res.output
    record = json.loads((tmp_path / "artifacts/model/init/source.json").read_text())
    assert record["init_path"] == str(user) and record["kind"] == "external_model" and record["schema_version"] == 1
    assert record["files"]["model.safetensors"] == (user / "model.safetensors").stat().st_size
    assert runner.invoke(app, ["init-model"]).exit_code == 0  # a rerun (dvc exp run again) is fine too
    for cmd in (["prepare"], ["warmstart"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 0, res.output
    details = json.loads((tmp_path / "artifacts/warmstart/details.json").read_text())
    assert details["config"]["model"]["init_path"] == str(user)
    assert (tmp_path / "artifacts/warmstart/policy/model.safetensors").is_file()
    assert _snapshot(user) == before


# --- params files -------------------------------------------------------------------------------------------


def test_missing_params_file_is_one_line_exit_2(tmp_path, monkeypatch):
    with pytest.raises(SmdInputError, match=r"absent.yaml: params file not found"):
        load_params(tmp_path / "absent.yaml")
    with pytest.raises(SmdInputError, match=r"is a directory"):
        load_params(tmp_path)
    assert load_params(empty_params(tmp_path)) == load_params(None)  # an empty file = all defaults
    monkeypatch.chdir(tmp_path)
    for args in (["params", "--params", "typo.yaml"], ["params"], ["init-model", "-p", "typo.yaml"]):
        res = CliRunner().invoke(app, args)
        _one_line_error(res, "params file not found")
    assert not (tmp_path / "artifacts").exists()


# --- top-k / top-p ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["rollout.top_k=5", "rollout.top_k=0", "rollout.top_p=0.9", "rollout.top_p=1.0"])
def test_top_k_top_p_refused_before_any_stage(tmp_path, override):
    """The sampler has no truncation (the learner scores the full softmax): the keys are gone, and a params file
    that still sets them, even to "off", gets one line saying why rather than pydantic's "extra field"."""
    with pytest.raises(SmdInputError) as err:
        load_params(None, [override])
    msg = str(err.value)
    assert override.split("=")[0] in msg and "learner" in msg and "\n" not in msg
    res = CliRunner().invoke(app, ["params", "-p", str(empty_params(tmp_path)), "-S", override])
    _one_line_error(res, override.split("=")[0], "full softmax")


# --- metrics files ------------------------------------------------------------------------------------------


def test_write_metrics_versions_both_files_and_requires_a_config(tmp_path):
    record = {"a": 1, "b": {"c": 2.5, "d": 3}, "config": {"seed": 0}}
    written = write_metrics(tmp_path / "metrics.json", record, ["a", "b.c"])
    head = json.loads(written["metrics"].read_text())
    details = json.loads(written["details"].read_text())
    assert head == {"a": 1, "b": {"c": 2.5}, "schema_version": METRICS_SCHEMA_VERSION}
    assert details == {**record, "schema_version": METRICS_SCHEMA_VERSION}
    written = write_metrics(tmp_path / "m2.json", {"a": 1}, ["a"], config={"x": 1})
    assert json.loads(written["details"].read_text())["config"] == {"x": 1}
    with pytest.raises(ValueError, match="config"):
        write_metrics(tmp_path / "m3.json", {"a": 1}, ["a"])
    assert not (tmp_path / "m3.json").exists()


def test_every_stage_metrics_file_carries_version_and_config(tmp_path):
    """The stage writers that go through write_metrics: prepare, rollout, compaction, evaluate (learn and warm
    start: test_learner / the real-model flow above); progress.json too."""
    from schemas.params.compaction import CompactionParams
    from stages.compaction.compact import run_compaction
    from stages.prepare import run_prepare
    from stages.progress.stage import run_progress
    from stages.rollout.stage import run_rollout
    from tests.helpers import make_model_dir

    model_dir = make_model_dir(tmp_path)
    p = load_params(None, [f"model.init_path={model_dir}", "prepare.num_train=8", "prepare.num_eval=4",
                           "prepare.context_tokens=30", "rollout.prompts_per_iteration=2", "rollout.group_size=2",
                           "rollout.max_new_tokens=3", "rollout.eviction.sinks=2", "rollout.eviction.window=4"])
    data = tmp_path / "data"
    run_prepare(p.prepare, model_dir, data, seed=0)
    art = tmp_path / "artifacts"
    base = art / "iter-001"
    run_rollout(p, 1, model_dir, data / "train.arrow", base / "rollout", show_progress=False)
    run_compaction(CompactionParams(), base / "rollout" / "trajectories.arrow", base / "rollout" / "masks.raw.zarr",
            base / "compact" / "masks.zarr", base / "compact" / "metrics.json")
    for headline in (data / "stats.json", base / "rollout" / "metrics.json", base / "compact" / "metrics.json"):
        details = json.loads((headline.parent / "details.json").read_text())
        assert json.loads(headline.read_text())["schema_version"] == METRICS_SCHEMA_VERSION, headline
        assert details["schema_version"] == METRICS_SCHEMA_VERSION and isinstance(details["config"], dict), headline
    rec = json.loads(run_progress(1, art).read_text())
    assert rec["schema_version"] == 1 and rec["kind"] == "progress" and rec["config"]["iteration"] == 1
    assert [r["iteration"] for r in rec["rows"]] == [1]
