"""`prepare.task: dataset` (issue 33): a user's data set in TRL's or verl's layout, from JSON Lines, JSON, Parquet
or a `datasets` directory, with its other columns carried whole (`row_json`); bad rows are one line FILE:ROW."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.tables import read_table
from stages.common.model import load_tokenizer, prompt_token_ids
from stages.prepare import run_prepare
from tests.helpers import make_model_dir, smollm2_like_tokenizer


def verl_row(i: int, messages: bool = False) -> dict:
    question = f"key fox {10 + i} fox . query : key fox . answer :"
    prompt = [{"role": "user", "content": question}] if messages else question
    return {"data_source": "kv_demo", "prompt": prompt, "ability": "retrieval",
            "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
            "extra_info": {"split": "train", "index": i}}


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("user-data"), "gqa")


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat-tok")
    smollm2_like_tokenizer().save_pretrained(out)
    return out


def cfg(*overrides: str):
    return load_params(None, ["prepare.task=dataset", "reward.function=math_verify", *overrides]).prepare


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_parquet_with_chat_messages_loads_unmapped(chat_tokenizer_dir, tmp_path):
    rows = [verl_row(i, messages=True) for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    c = cfg(f"prepare.train_file={tmp_path / 'train.parquet'}", "prepare.num_eval=4")
    written = run_prepare(c, chat_tokenizer_dir, tmp_path / "data", seed=0)
    tok = load_tokenizer(chat_tokenizer_dir)
    train, held = pd.read_feather(written["train"]), pd.read_feather(written["eval"])
    assert (len(train), len(held)) == (8, 4) and set(train.prompt_id) | set(held.prompt_id) == {
        f"train-{i}" for i in range(12)}  # verl's extra_info.index names the row
    for row in train.itertuples():
        original = rows[int(row.prompt_id.split("-")[1])]
        assert json.loads(row.row_json) == original  # every column, whole
        assert json.loads(row.prompt) == original["prompt"]
        want = tok.apply_chat_template(original["prompt"], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert list(row.prompt_token_ids) == list(want)
        assert row.reference == original["reward_model"]["ground_truth"]
    assert "row_json" in read_table(written["train"], "prompts").column_names


def test_trl_jsonl_without_reference_and_json_list_and_datasets_dir(word_model, tmp_path):
    rows = [{"prompt": f"key owl {20 + i} owl . answer :", "solution": str(20 + i)} for i in range(6)]
    tok = load_tokenizer(word_model)
    # TRL layout, JSON Lines: no reward_model.ground_truth anywhere -> empty reference, the column travels
    c = cfg(f"prepare.train_file={write_jsonl(tmp_path / 't.jsonl', rows)}", "prepare.num_eval=2")
    table = pd.read_feather(run_prepare(c, word_model, tmp_path / "a", seed=0)["train"])
    assert (table.reference == "").all() and len(table) == 4
    for row in table.itertuples():
        assert json.loads(row.row_json)["solution"] == row.prompt.split()[2]
        assert list(row.prompt_token_ids) == prompt_token_ids(tok, row.prompt)
    # the same rows as a JSON list, with the reference mapped
    (tmp_path / "t.json").write_text(json.dumps(rows, indent=1))
    c = cfg(f"prepare.train_file={tmp_path / 't.json'}", "prepare.num_eval=2", "prepare.reference_key=solution")
    table = pd.read_feather(run_prepare(c, word_model, tmp_path / "b", seed=0)["train"])
    assert all(row.reference == row.prompt.split()[2] for row in table.itertuples())
    # a `datasets` save_to_disk directory of one split
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    c = cfg(f"prepare.train_file={tmp_path / 'hf'}", "prepare.num_eval=2", "prepare.reference_key=solution")
    again = pd.read_feather(run_prepare(c, word_model, tmp_path / "c", seed=0)["train"])
    assert sorted(again.reference) == sorted(table.reference)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SmdInputError, match=r"dd: a DatasetDict \(splits: train\).*dd/train"):
        run_prepare(cfg(f"prepare.train_file={tmp_path / 'dd'}"), word_model, tmp_path / "d", seed=0)


def test_overlong_prompts_are_dropped_and_counted(word_model, tmp_path):
    rows = [verl_row(i) for i in range(8)] + [{**verl_row(99), "prompt": "key fox 1 fox . " * 40 + "answer :"}]
    c = cfg(f"prepare.train_file={write_jsonl(tmp_path / 't.jsonl', rows)}", f"prepare.eval_file={tmp_path / 't.jsonl'}",
            "prepare.max_prompt_tokens=64")
    written = run_prepare(c, word_model, tmp_path / "data", seed=0)
    stats = json.loads((tmp_path / "data" / "details.json").read_text())
    assert len(pd.read_feather(written["train"])) == 8
    assert stats["train"]["dropped"] == 1 or stats.get("values", stats)["train"]["dropped"] == 1


@pytest.mark.parametrize(("rows", "overrides", "message"), [
    ([{"question": "x"}], [], r"t.jsonl:1: prompt: missing"),
    ([{"prompt": ""}], [], r"t.jsonl:1: prompt: empty"),
    ([{"prompt": 3}], [], r"t.jsonl:1: prompt: expected a string or a list of chat messages"),
    ([{"prompt": [{"role": "user"}]}], [], r"t.jsonl:1: prompt: expected a string or a list of chat messages"),
    ([verl_row(0), {"prompt": "a"}], [], r"t.jsonl:2: reward_model.ground_truth: missing"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], ["prepare.reference_key=answer"], r"t.jsonl:2: answer: missing"),
    ([verl_row(0, messages=True)], [], r"t.jsonl:1: prompt: chat messages need a chat template \(the policy's "
                                       r"tokenizer has no chat template\)"),
    ([verl_row(0), ["not", "a", "row"]], [], r"t.jsonl:2: <row>: expected an object of columns, got list"),
    ([{"q": {"text": "a"}, "a": 1}], ["prepare.prompt_key=q.missing", "prepare.reference_key=a"],
     r"t.jsonl:1: q.missing: missing"),
])
def test_bad_rows_are_one_line_naming_file_row_and_key(word_model, tmp_path, rows, overrides, message):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    c = cfg(f"prepare.train_file={path}", f"prepare.eval_file={path}", *overrides)
    with pytest.raises(SmdInputError, match=message):
        run_prepare(c, word_model, tmp_path / "data", seed=0)
    assert not (tmp_path / "data").exists()  # nothing written


def test_nested_keys_and_parquet_row_numbers(word_model, tmp_path):
    rows = [{"q": {"text": f"key fox {i} fox . answer :"}, "a": i} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    c = cfg(f"prepare.train_file={tmp_path / 't.parquet'}", f"prepare.eval_file={tmp_path / 't.parquet'}",
            "prepare.prompt_key=q.text", "prepare.reference_key=a")
    table = pd.read_feather(run_prepare(c, word_model, tmp_path / "data", seed=0)["train"])
    assert list(table.reference) == ["0", "1", "2"] and list(table.prompt_id) == ["t-0", "t-1", "t-2"]
    bad = [*rows, {"q": {"text": "x"}}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    c = cfg(f"prepare.train_file={tmp_path / 'bad.parquet'}", f"prepare.eval_file={tmp_path / 'bad.parquet'}",
            "prepare.prompt_key=q.text", "prepare.reference_key=a")
    with pytest.raises(SmdInputError, match=r"bad.parquet:3: a: missing"):  # row index from 0, as pandas counts
        run_prepare(c, word_model, tmp_path / "bad", seed=0)


def test_the_dataset_task_needs_a_reward_function():
    with pytest.raises(SmdInputError, match=r"reward.function: task `dataset` has no built-in scorer"):
        load_params(None, ["prepare.task=dataset", "prepare.train_file=x.jsonl"])
    with pytest.raises(SmdInputError, match=r"reward.function.*expected path/to/rewards.py:function_name"):
        load_params(None, ["reward.function=rewards"])
    with pytest.raises(SmdInputError, match=r"reward: .*weights: 2 weight\(s\) for 1 function"):
        load_params(None, ["reward.function=r.py:f", "reward.weights=[1, 2]"])
    p = load_params(None, ["reward.function=[r.py:f, r.py:g, math_verify]"])
    assert p.reward.files() == ["r.py"]


def test_a_verl_parquet_without_reward_model_is_one_line_and_null_means_no_reference(word_model, tmp_path):
    """A file whose rows have data_source is verl's layout: its reference is required (verl's reward manager reads
    reward_model.ground_truth of every row); a TRL file (no data_source) has none, and reference_key null says so."""
    rows = [{k: v for k, v in verl_row(i).items() if k != "reward_model"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    path = tmp_path / "verl.parquet"
    with pytest.raises(SmdInputError, match=r"verl.parquet:0: reward_model.ground_truth: missing in every row of a "
                                            r"verl data set"):
        run_prepare(cfg(f"prepare.train_file={path}", f"prepare.eval_file={path}"), word_model, tmp_path / "a", seed=0)
    assert not (tmp_path / "a").exists()
    table = pd.read_feather(run_prepare(cfg(f"prepare.train_file={path}", f"prepare.eval_file={path}",
                                            "prepare.reference_key=null"), word_model, tmp_path / "b", seed=0)["train"])
    assert list(table.reference) == ["", "", ""]
    trl = [{k: v for k, v in r.items() if k != "data_source"} for r in rows]  # TRL's layout: no reference, no error
    pq.write_table(pa.Table.from_pylist(trl), tmp_path / "trl.parquet")
    path = tmp_path / "trl.parquet"
    table = pd.read_feather(run_prepare(cfg(f"prepare.train_file={path}", f"prepare.eval_file={path}"), word_model,
                                        tmp_path / "c", seed=0)["train"])
    assert list(table.reference) == ["", "", ""]
