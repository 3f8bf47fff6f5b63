"""`prepare`: seeded synthetic tasks, data set loaders on fixtures, the prompts table contract, bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.params.prepare import SYNTHETIC_TASKS
from schemas.tables import read_table, table_config
from stages.common.model import build_tiny_tokenizer, load_tokenizer
from stages.prepare import run_prepare
from stages.prepare.loaders import iter_records
from stages.prepare.synthetic import ANSWER_CUE, count_tokens, generate
from tests.helpers import make_model_dir

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("prepare"), "gqa")


def cfg(*overrides: str):
    return load_params(None, list(overrides)).prepare


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_same_seed_same_bytes_and_pandas_reads_it(model_dir, tmp_path, task):
    c = cfg(f"prepare.task={task}", "prepare.num_train=24", "prepare.num_eval=6")
    a = run_prepare(c, model_dir, tmp_path / "a", seed=7)
    b = run_prepare(c, model_dir, tmp_path / "b", seed=7)
    other = run_prepare(c, model_dir, tmp_path / "c", seed=8)
    for split in ("train", "eval"):
        assert a[split].read_bytes() == b[split].read_bytes()
        assert a[split].read_bytes() != other[split].read_bytes()
    df = pd.read_feather(a["train"])
    assert list(df.columns) == ["prompt_id", "task", "prompt", "prompt_token_ids", "reference"]
    assert len(df) == 24 and df.prompt_id.is_unique and (df.task == task).all()
    tok = load_tokenizer(model_dir)
    for row in df.itertuples():
        assert row.prompt.endswith(ANSWER_CUE)
        assert list(row.prompt_token_ids) == tok(row.prompt, add_special_tokens=False)["input_ids"]
        assert tok.bos_token_id not in row.prompt_token_ids and row.reference
    table = read_table(a["eval"], "prompts")
    assert table.schema.field("prompt_token_ids").type.value_type.bit_width == 32
    assert table_config(table)["prepare"]["task"] == task and table_config(table)["split"] == "eval"


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_synthetic_words_are_in_the_tiny_vocabulary(task):
    tok = build_tiny_tokenizer()
    for prompt, reference in generate(task, cfg(f"prepare.task={task}"), seed=0, split="train", n=30):
        ids = tok(prompt + " " + reference, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(ids) == count_tokens(prompt + " " + reference)


@pytest.mark.parametrize("context", [100, 400, 2000])
def test_context_tokens_sets_eval_prompt_length(context):
    for task in SYNTHETIC_TASKS:
        c = cfg(f"prepare.task={task}", f"prepare.context_tokens={context}")
        lengths = [count_tokens(p) for p, _ in generate(task, c, seed=0, split="eval", n=10)]
        assert all(context <= n <= context + 20 for n in lengths), (task, lengths)
        # Train prompts vary between train_context_min_fraction * context and context.
        train = [count_tokens(p) for p, _ in generate(task, c, seed=0, split="train", n=40)]
        assert max(train) <= context + 20 and min(train) < 0.8 * context


def test_kv_retrieval_answer_is_in_context():
    c = cfg("prepare.num_pairs=5", "prepare.num_queries=3", "prepare.context_tokens=200")
    for prompt, reference in generate("kv_retrieval", c, seed=1, split="eval", n=20):
        items = [item.split() for item in reference.split(";")]
        assert len(items) == 3
        for key, value in items:
            assert f"key {key} {value} {key} ." in prompt
            assert f"key {key} ;" in prompt or f"key {key} ." in prompt.split("query :")[1]


def test_var_tracking_and_arithmetic_references_are_consistent():
    for prompt, reference in generate("var_tracking", cfg("prepare.task=var_tracking"), seed=2, split="eval", n=20):
        names = reference.split(" = ")
        target, value = names[0], names[-1]
        assert prompt.endswith(f"what is {target} ? {ANSWER_CUE}")
        assert f"let {names[-2]} = {value} ." in prompt
        for a, b in zip(names[:-2], names[1:-1], strict=True):
            assert f"let {a} = {b} ." in prompt
    for _, reference in generate("arithmetic", cfg("prepare.task=arithmetic", "prepare.num_steps=3"), 0, "eval", 30):
        *steps, final = reference.split(" . ")
        assert final.startswith("#### ")
        for step in " . ".join(steps).split(" . "):
            lhs, rhs = step.rstrip(" .").split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307 - digits and + - * only
        assert int(final[5:]) == int(steps[-1].rstrip(" .").split(" = ")[1]) and int(final[5:]) >= 0


# ----- data set loaders on fixtures -----


def test_gsm8k_files(model_dir, tmp_path):
    c = cfg("prepare.task=gsm8k", f"prepare.train_file={FIXTURES / 'gsm8k_train.jsonl'}",
            f"prepare.eval_file={FIXTURES / 'gsm8k_eval.jsonl'}")
    out = run_prepare(c, model_dir, tmp_path)
    train, ev = pd.read_feather(out["train"]), pd.read_feather(out["eval"])
    assert len(train) == 4 and len(ev) == 2
    assert train.reference[0].endswith("#### 72") and "<<" not in train.reference[0]
    assert train.prompt[0].startswith("question : Natalia") and train.prompt[0].endswith("answer :")
    assert train.prompt_id[3] == "gsm8k_train-L5"  # blank line 4 skipped, line numbers kept


def test_utf8_byte_order_mark_is_read_as_datasets_reads_it(model_dir, tmp_path):
    """A file saved with a UTF-8 BOM (Windows editors) reads as without one, as `datasets.load_dataset("json")`
    reads it ("utf-8-sig"), for JSON Lines and a JSON list alike."""
    plain = {n: FIXTURES / f"gsm8k_{n}.jsonl" for n in ("train", "eval")}
    bom = {}
    for n, src in plain.items():
        bom[n] = tmp_path / f"gsm8k_{n}.jsonl"
        bom[n].write_bytes(b"\xef\xbb\xbf" + src.read_bytes())
    args = ("prepare.task=gsm8k",)
    a = run_prepare(cfg(*args, f"prepare.train_file={plain['train']}", f"prepare.eval_file={plain['eval']}"),
                    model_dir, tmp_path / "plain")
    b = run_prepare(cfg(*args, f"prepare.train_file={bom['train']}", f"prepare.eval_file={bom['eval']}"),
                    model_dir, tmp_path / "bom")
    def rows(path):
        df = pd.read_feather(path)
        return df.assign(prompt_token_ids=df.prompt_token_ids.map(list)).to_dict("records")

    for split in ("train", "eval"):
        assert rows(a[split]) == rows(b[split]) and len(rows(a[split])) > 0
    listed = tmp_path / "hotpotqa.json"
    listed.write_bytes(b"\xef\xbb\xbf" + (FIXTURES / "hotpotqa.json").read_bytes())
    assert list(iter_records(listed)) == list(iter_records(FIXTURES / "hotpotqa.json"))


def test_hotpotqa_split_off_train_file_and_truncation(model_dir, tmp_path):
    c = cfg("prepare.task=hotpotqa", f"prepare.train_file={FIXTURES / 'hotpotqa.json'}", "prepare.num_eval=1",
            "prepare.max_prompt_tokens=40")
    out = run_prepare(c, model_dir, tmp_path)
    train, ev = pd.read_feather(out["train"]), pd.read_feather(out["eval"])
    assert len(train) == 2 and len(ev) == 1
    assert set(train.prompt_id) | set(ev.prompt_id) == {
        "5a8b57f25542995d1e6f1371", "5a8c7595554299585d9e36b6", "5a85ea095542994775f606a8"}
    for row in pd.concat([train, ev]).itertuples():
        assert len(row.prompt_token_ids) <= 40
        assert row.prompt.startswith("context : ") and row.prompt.endswith("answer :") and "question :" in row.prompt


def test_hotpotqa_hugging_face_layout(model_dir, tmp_path):
    c = cfg("prepare.task=hotpotqa", f"prepare.train_file={FIXTURES / 'hotpotqa_hf.jsonl'}", "prepare.num_eval=1")
    out = run_prepare(c, model_dir, tmp_path)
    df = pd.concat([pd.read_feather(out["train"]), pd.read_feather(out["eval"])]).set_index("prompt_id")
    row = df.loc["5a879ab05542996e4f30887e"]
    assert row.reference == "Delhi" and "The Oberoi Group : The Oberoi Group is a hotel company" in row.prompt


@pytest.mark.parametrize("name", ["tldr.jsonl", "tldr_carper.jsonl"])
def test_tldr_both_public_layouts(model_dir, tmp_path, name):
    c = cfg("prepare.task=tldr", f"prepare.train_file={FIXTURES / name}", "prepare.num_eval=1")
    out = run_prepare(c, model_dir, tmp_path)
    df = pd.concat([pd.read_feather(out["train"]), pd.read_feather(out["eval"])])
    assert df.prompt.str.contains("post", case=False).all()
    assert df.prompt.str.lower().str.endswith("tl;dr :").all() | df.prompt.str.endswith("TL;DR:").all()
    assert (df.reference.str.len() > 0).all()


def test_govreport_report_or_document(model_dir, tmp_path):
    c = cfg("prepare.task=govreport", f"prepare.train_file={FIXTURES / 'govreport.jsonl'}", "prepare.num_eval=1",
            "prepare.max_prompt_tokens=30")
    out = run_prepare(c, model_dir, tmp_path)
    df = pd.concat([pd.read_feather(out["train"]), pd.read_feather(out["eval"])])
    assert set(df.prompt_id) == {"GAO-17-1", "CRS-R1", "GAO-18-2", "GAO-19-3"}
    assert all(len(ids) <= 30 for ids in df.prompt_token_ids) and df.prompt.str.endswith("summary :").all()
    nested = df.set_index("prompt_id").loc["GAO-19-3"]
    assert nested.reference == "GAO reviewed the readiness of the aging Coast Guard cutter fleet."
    assert nested.prompt.startswith("report : Letter\nThe Coast Guard")


# ----- bad input: one line naming file, line and field -----


@pytest.mark.parametrize(
    ("task", "name", "pattern"),
    [
        ("gsm8k", "gsm8k_bad_json.jsonl", r"gsm8k_bad_json\.jsonl:2: <json>: not valid JSON \(.+ at column \d+\)$"),
        ("gsm8k", "gsm8k_missing_field.jsonl", r"gsm8k_missing_field\.jsonl:3: answer: missing field$"),
        ("gsm8k", "gsm8k_no_final.jsonl", r"gsm8k_no_final\.jsonl:1: answer: no '#### N' final answer$"),
        ("hotpotqa", "hotpotqa_bad_context.json", r"hotpotqa_bad_context\.json:8: context\[0\]: expected \[title"),
        ("tldr", "gsm8k_train.jsonl", r"gsm8k_train\.jsonl:1: post: missing field$"),
        ("govreport", "tldr.jsonl", r"tldr\.jsonl:1: report: missing field"),
        ("gsm8k", "empty.jsonl", r"empty\.jsonl: train split is empty"),
        ("gsm8k", "no_such_file.jsonl", r"no_such_file\.jsonl: file not found$"),
    ],
)
def test_bad_files_fail_with_one_line_and_write_nothing(model_dir, tmp_path, task, name, pattern):
    c = cfg(f"prepare.task={task}", f"prepare.train_file={FIXTURES / name}", "prepare.num_eval=1")
    with pytest.raises(SmdInputError) as err:
        run_prepare(c, model_dir, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert re.search(pattern, str(err.value)), str(err.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_empty_splits(model_dir, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(SmdInputError, match=r"one\.jsonl: eval split is empty"):
        run_prepare(cfg("prepare.task=gsm8k", f"prepare.train_file={one}"), model_dir, tmp_path / "o")
    with pytest.raises(SmdInputError, match=r"gsm8k_train\.jsonl: train split is empty .*max_prompt_tokens"):
        run_prepare(cfg("prepare.task=gsm8k", f"prepare.train_file={FIXTURES / 'gsm8k_train.jsonl'}",
                        f"prepare.eval_file={FIXTURES / 'gsm8k_eval.jsonl'}", "prepare.max_prompt_tokens=16"),
                    model_dir, tmp_path / "o")


def _params_file(tmp_path, model_dir, **prepare) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"init_path": str(model_dir)}, "prepare": prepare}))
    return path


def test_cli_writes_tables(model_dir, tmp_path):
    params = _params_file(tmp_path, model_dir, num_train=5, num_eval=2)
    result = CliRunner().invoke(app, ["prepare", "--params", str(params), "--out", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert len(pd.read_feather(tmp_path / "data" / "train.arrow")) == 5


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["-S", "prepare.task=no_such_task"], r"prepare\.task: Input should be 'kv_retrieval'"),
        (["-S", "prepare.num_pairs=0"], r"prepare\.num_pairs: Input should be greater than or equal to 1"),
        (["-S", "prepare.task=gsm8k"], r"train_file"),
        (["-S", "prepare.task=gsm8k", "-S", f"prepare.train_file={FIXTURES / 'gsm8k_bad_json.jsonl'}"],
         r"gsm8k_bad_json\.jsonl:2: <json>"),
    ],
)
def test_cli_bad_input_exit_code_2_and_nothing_written(model_dir, tmp_path, overrides, pattern):
    params = _params_file(tmp_path, model_dir, num_train=5, num_eval=2)
    out = tmp_path / "data"
    result = CliRunner().invoke(app, ["prepare", "--params", str(params), "--out", str(out), *overrides])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(pattern, lines[0]), result.stderr
    assert not out.exists()
