"""Tasks and rewards: generator determinism, no [UNK] in synthetic text, hand-checked rewards, loader errors."""

from __future__ import annotations

import json

import pytest

from schemas import rewards
from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.params.prepare import SYNTHETIC_TASKS
from stages.model import build_tiny_tokenizer
from stages.prepare import loaders
from stages.prepare.stage import run_prepare
from stages.prepare.synthetic import generate
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("prep"), "gqa")


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_synthetic_tables_are_byte_identical_per_seed(model_dir, tmp_path, task):
    cfg = load_params(None, [f"prepare.task={task}", "prepare.num_train=12", "prepare.num_eval=4",
                             "prepare.context_tokens=120"]).prepare
    a = run_prepare(cfg, model_dir, tmp_path / "a", seed=3)
    b = run_prepare(cfg, model_dir, tmp_path / "b", seed=3)
    c = run_prepare(cfg, model_dir, tmp_path / "c", seed=4)
    for split in ("train", "eval"):
        assert a[split].read_bytes() == b[split].read_bytes()
        assert a[split].read_bytes() != c[split].read_bytes()


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_synthetic_text_is_in_vocabulary_and_length_follows_param(task):
    tok = build_tiny_tokenizer()
    for context in (100, 600):
        cfg = load_params(None, [f"prepare.task={task}", f"prepare.context_tokens={context}"]).prepare
        for prompt, reference in generate(task, cfg, seed=0, split="train", n=5):
            ids = tok(prompt)["input_ids"]
            assert tok.unk_token_id not in ids and tok.unk_token_id not in tok(reference)["input_ids"]
            assert len(ids) >= 0.2 * context


def test_rewards_by_hand():
    assert rewards.score("gsm8k", "so 3 + 4 = 7 #### 7", "... #### 7") == 1.0
    assert rewards.score("gsm8k", "so #### 1,200", "#### 1200") == 1.0  # separators dropped after ####
    assert rewards.score("gsm8k", "the answer is 12", "#### 12") == 1.0  # else the last number
    assert rewards.score("gsm8k", "#### 8", "#### 7") == 0.0
    # token F1: prediction "the cat sat" vs reference "cat sat down" (articles dropped): p=1, r=2/3 -> 0.8
    assert rewards.score("hotpotqa", "the cat sat", "cat sat down") == pytest.approx(0.8)
    # ROUGE-L F: LCS("a b c d", "a c d e") = 3 -> p = r = 0.75
    assert rewards.score("tldr", "a b c d", "a c d e") == pytest.approx(0.75)
    # kv retrieval: fraction of values right, in order
    assert rewards.score("kv_retrieval", "1 2 ; 3 4", "1 2 ; 9 9") == pytest.approx(0.5)
    assert rewards.exact_match("kv_retrieval", "1 2 ; 3 4", "1 2 ; 3 4")
    with pytest.raises(SmdInputError):
        rewards.score("no_such_task", "a", "b")


def test_loader_errors_name_file_line_and_field(tmp_path):
    f = tmp_path / "gsm8k.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{not json\n")
    with pytest.raises(SmdInputError, match=r"gsm8k.jsonl:2: <json>"):
        loaders.load_examples("gsm8k", f)
    f.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(SmdInputError, match=r"gsm8k.jsonl:1: answer"):
        loaders.load_examples("gsm8k", f)
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"question": "Tom has 3 apples", "answer": "3 + 4 = 7 #### 7"}) + "\n")
    (ex,) = loaders.load_examples("gsm8k", good)
    assert rewards.score("gsm8k", "#### 7", ex.reference) == 1.0
