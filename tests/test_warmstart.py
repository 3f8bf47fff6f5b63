"""`warmstart`: response-only loss, curriculum sampler, a few-step smoke run writing a loadable policy."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from typer.testing import CliRunner

from cli.main import app
from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.tables import read_table
from stages.common.model import load_policy, load_tokenizer, response_ids
from stages.prepare import run_prepare
from stages.warmstart import run_warmstart
from stages.warmstart.train import CurriculumSampler, _batch
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmstart")
    model_dir = make_model_dir(root, "gqa")
    p = load_params(None, [f"model.init_path={model_dir}", "prepare.num_train=32", "prepare.num_eval=4",
                           "prepare.context_tokens=40", "warmstart.steps=3", "warmstart.batch_size=4",
                           "warmstart.warmup_steps=1", "warmstart.log_every=1", "warmstart.eval_batch_size=3"])
    run_prepare(p.prepare, model_dir, root / "data", seed=0)
    return p, root


def test_batch_masks_prompt_and_padding():
    b = _batch([[5, 6, 7], [8]], [[9, 3], [10, 11, 3]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 9, 3], [8, 10, 11, 3, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b["labels"].tolist() == [[-100, -100, -100, 9, 3], [-100, 10, 11, 3, -100]]


def test_response_ends_with_eos(setup):
    tok = load_tokenizer(setup[0].model.init_path)
    ids = response_ids(tok, "bear 20 ; bird 58")
    assert ids[-1] == tok.eos_token_id and tok.decode(ids, skip_special_tokens=True) == "bear 2 0 ; bird 5 8"


def test_curriculum_sampler_starts_short_and_is_seeded():
    lengths = [50 - i for i in range(50)]  # index 49 is the shortest
    make = lambda: CurriculumSampler(lengths, 100, 4, torch.Generator().manual_seed(0),  # noqa: E731
                                     start=0.2, hold=0.3, end=0.6)
    s = make()
    assert s.admitted(0) == s.admitted(30) == 10 and s.admitted(45) == 30 and s.admitted(60) == 50
    first = [s.batch(step) for step in range(30)]
    assert all(lengths[i] <= 10 for batch in first for i in batch)
    assert all(len(set(batch)) == 4 for batch in first)
    twin = make()
    assert first == [twin.batch(step) for step in range(30)]
    flat = CurriculumSampler(lengths, 100, 4, torch.Generator().manual_seed(0))
    assert flat.admitted(0) == 50


def test_smoke_run_writes_loadable_policy_and_metrics(setup):
    p, root = setup
    written = run_warmstart(p.warmstart, p.model, root / "data", root / "ws", seed=0)
    assert set(written) == {"policy", "metrics", "details"}
    headline = json.loads(written["metrics"].read_text())
    assert set(headline) == {"exact_match", "reward", "reference_nll", "steps", "final_loss", "minutes",
                             "schema_version"}
    assert headline["reference_nll"] > 0
    metrics = json.loads(written["details"].read_text())
    assert metrics["steps"] == 3 and metrics["task"] == "kv_retrieval" and metrics["metric"] == "kv_fraction"
    assert 0.0 <= metrics["exact_match"] <= 1.0 and 0.0 <= metrics["reward"] <= 1.0
    assert metrics["eval_rows"] == 4 and metrics["final_loss"] > 0 and metrics["minutes"] >= 0
    model, tok = load_policy(written["policy"]), load_tokenizer(written["policy"])
    assert tok.eos_token_id == 3
    before = load_policy(p.model.init_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before(ids).logits)  # it trained
    # Seeded: a second run writes identical weights.
    again = run_warmstart(p.warmstart, p.model, root / "data", root / "ws2", seed=0)
    with torch.no_grad():
        assert torch.equal(load_policy(again["policy"])(ids).logits, model(ids).logits)
    assert not list(root.glob("ws/.*tmp*"))


def test_missing_data_is_one_line(setup, tmp_path):
    p, _ = setup
    with pytest.raises(SmdInputError, match=r"train\.arrow: missing prompts table"):
        run_warmstart(p.warmstart, p.model, tmp_path, tmp_path / "ws")
    assert not (tmp_path / "ws").exists()


def test_cli_bad_parameter_exits_2(setup, tmp_path):
    p, root = setup
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": {"init_path": p.model.init_path}}))
    out = tmp_path / "ws"
    result = CliRunner().invoke(app, ["warmstart", "--params", str(params), "--data", str(root / "data"),
                                      "--out", str(out), "-S", "warmstart.lr=0"])
    assert result.exit_code == 2
    assert re.search(r"warmstart\.lr: Input should be greater than 0", result.stderr)
    assert not out.exists()


def test_stops_at_target_exact_match_on_held_out_longest_rows(setup, tmp_path, monkeypatch):
    p, root = setup
    from stages.warmstart import train as ws_train

    real_eval, seen, scripted = ws_train.greedy_eval, [], iter([0.0, 0.25, 0.75, 1.0])

    def fake_eval(model, tokenizer, rows, batch_size, max_new_tokens, scoring=None):
        if len(rows) == p.prepare.num_eval:  # the final eval on the eval split runs for real
            return real_eval(model, tokenizer, rows, batch_size, max_new_tokens, scoring)
        seen.append([r["prompt_id"] for r in rows])
        return {"exact_match": next(scripted)}

    monkeypatch.setattr(ws_train, "greedy_eval", fake_eval)
    cfg = p.warmstart.model_copy(update={"steps": 10, "check_every": 2, "check_rows": 5,
                                         "target_exact_match": 0.5})
    written = run_warmstart(cfg, p.model, root / "data", tmp_path / "ws", seed=0)
    metrics = json.loads(written["details"].read_text())
    assert metrics["steps"] == 6 and metrics["stop_reason"] == "target_exact_match"
    assert [c["exact_match"] for c in metrics["checks"]] == [0.0, 0.25, 0.75]
    assert [c["step"] for c in metrics["checks"]] == [2, 4, 6] and metrics["check_rows"] == 5
    # The check rows are the five longest train prompts, the same rows at every check.
    train = read_table(root / "data" / "train.arrow", "prompts").to_pylist()
    longest = sorted(train, key=lambda r: (-len(r["prompt_token_ids"]), r["prompt_id"]))[:5]
    assert all(sorted(ids) == sorted(r["prompt_id"] for r in longest) for ids in seen) and len(seen) == 3


@pytest.mark.slow
def test_default_task_warm_start_lands_in_the_rl_band(tmp_path):
    """The issue's target: from scratch, the default task's warm start ends between 30% and 85% exact match.

    Default parameters, no wall-clock cap (so the outcome does not depend on machine load); one torch
    thread and a fixed seed make the run reproducible. About 2-4 minutes on 2 cores.
    """
    from stages.common.model import init_tiny_model

    p = load_params(None, [f"model.init_path={tmp_path / 'init'}", "warmstart.max_minutes=0",
                           "warmstart.log_every=500"])
    init_tiny_model(p.model.tiny, p.model.init_path, seed=p.seed)
    run_prepare(p.prepare, p.model.init_path, tmp_path / "data", seed=p.seed)
    written = run_warmstart(p.warmstart, p.model, tmp_path / "data", tmp_path / "ws", seed=p.seed)
    metrics = json.loads(written["details"].read_text())
    assert metrics["stop_reason"] == "target_exact_match"
    assert metrics["checks"][-1]["exact_match"] >= p.warmstart.target_exact_match
    assert 0.30 <= metrics["exact_match"] <= 0.85, metrics["exact_match"]
    assert metrics["eval_rows"] == p.prepare.num_eval
