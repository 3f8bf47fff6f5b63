"""schemas.rewards: hand-checked scores, tiny-tokenizer decodes, range."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import rewards
from schemas.errors import SmdInputError
from schemas.params.prepare import TASKS
from stages.common.model import build_tiny_tokenizer


def test_final_number_gsm8k_convention():
    f = rewards.extract_final_number
    assert f("48/2 = 24 clips.\n48+24 = 72\n#### 72") == "72"
    assert f("#### 1,000") == "1000"
    assert f("# # # # 1 , 0 0 0") == "1000"  # tiny-tokenizer decode of "#### 1,000"
    assert f("so she has 5 then 7 left") == "7"  # no ####: last number
    assert f("#### -3.50") == "-3.5" and f("#### 08") == "8" and f("#### 8.0") == "8"
    assert f("no number here") is None and f("#### none") is None


def test_numeric_exact_match_tasks():
    for task in ("gsm8k", "arithmetic", "var_tracking"):
        assert rewards.metric_name(task) == "numeric_exact_match"
    assert rewards.score("gsm8k", "5 + 3 = 8 . # # # # 8", "5 + 3 = 8 . #### 8") == 1.0
    assert rewards.score("arithmetic", "5 + 3 = 9 . #### 9", "5 + 3 = 8 . #### 8") == 0.0
    assert rewards.score("var_tracking", "h = d = s = 6 8", "h = d = s = 68") == 1.0
    assert rewards.score("var_tracking", "h = d = 68 = 7", "h = d = s = 68") == 0.0
    assert rewards.exact_match("gsm8k", "#### 72", "#### 72") is True


def test_kv_retrieval_fraction_in_order():
    ref = "bear 20 ; bird 58 ; fox 33"
    assert rewards.score("kv_retrieval", "bear 2 0 ; bird 5 8 ; fox 3 3", ref) == 1.0
    assert rewards.exact_match("kv_retrieval", "bear 2 0 ; bird 5 8 ; fox 3 3", ref)
    assert rewards.score("kv_retrieval", "bear 2 0 ; bird 5 9 ; fox 3 3", ref) == pytest.approx(2 / 3)
    assert rewards.score("kv_retrieval", "bird 5 8 ; bear 2 0", ref) == 0.0  # order matters
    assert rewards.score("kv_retrieval", "bear 2 0", ref) == pytest.approx(1 / 3)
    assert not rewards.exact_match("kv_retrieval", "bear 2 0 ; bird 5 8", ref)
    assert not rewards.exact_match("kv_retrieval", "bear 2 0 ; bird 5 8 ; fox 3 3 ; owl 1 1", ref)
    assert rewards.score("kv_retrieval", "", ref) == 0.0


def test_token_f1_and_rouge_l():
    # SQuAD normalization: case, punctuation, articles.
    assert rewards.score("hotpotqa", "The Eiffel Tower!", "eiffel tower") == 1.0
    assert rewards.exact_match("hotpotqa", "The Eiffel Tower!", "eiffel tower")
    # pred {chief, of, protocol, us} vs ref {chief, of, protocol}: p = 3/4, r = 1 -> 6/7
    assert rewards.score("hotpotqa", "Chief of Protocol US", "Chief of Protocol") == pytest.approx(6 / 7)
    assert rewards.score("hotpotqa", "no", "yes") == 0.0
    # ROUGE-L: LCS("the cat sat on the mat", "the cat is on the mat") = 5 of 6 -> 5/6; stemming: cats ~ cat
    assert rewards.score("tldr", "the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert rewards.score("govreport", "cats", "cat") == 1.0
    assert rewards.metric_name("tldr") == "rougeL_f" and rewards.metric_name("hotpotqa") == "token_f1"


def test_responses_decoded_by_the_tiny_tokenizer_score_like_the_reference():
    tok = build_tiny_tokenizer()
    cases = {
        "kv_retrieval": "bear 20 ; bird 58",
        "arithmetic": "6 - 3 = 3 . 5 * 8 = 40 . 3 + 40 = 43 . #### 43",
        "var_tracking": "h = d = s = 68",
        "gsm8k": "Natalia sold 48/2 = 24 clips in May.\n#### 72",
    }
    for task, reference in cases.items():
        decoded = tok.decode(tok(reference, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                             skip_special_tokens=True)
        assert decoded != reference
        assert rewards.score(task, decoded, reference) == 1.0 and rewards.exact_match(task, decoded, reference)


def test_unknown_task_is_bad_input():
    for fn in (rewards.score, rewards.exact_match):
        with pytest.raises(SmdInputError, match="task: unknown task 'nope'"):
            fn("nope", "a", "b")
        # a user's data set has no built-in scorer: reward.function scores it
        with pytest.raises(SmdInputError, match="reward.function: task 'dataset' has no built-in scorer"):
            fn("dataset", "a", "b")
    with pytest.raises(SmdInputError):
        rewards.metric_name("nope")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(task=st.sampled_from([t for t in TASKS if t != "dataset"]), response=st.text(max_size=40),
       reference=st.text(max_size=40))
def test_score_is_in_unit_interval(task, response, reference):
    value = rewards.score(task, response, reference)
    assert 0.0 <= value <= 1.0
    assert isinstance(rewards.exact_match(task, response, reference), bool)
