"""`fact_recall`, the task phrased for pretrained instruct models (stages.prepare.instruct): natural facts among
everyday filler, a question with an answer format, rendered through the chat template; scored by the asked
numbers in order (schemas.rewards kv_fraction)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from schemas import rewards
from schemas.params import load_params
from schemas.params.model import TinyModelParams
from stages.common.model import (
    generation_prompt_ids,
    init_tiny_model,
    load_tokenizer,
    prompt_token_ids,
    rendered_as_chat,
    response_ids,
)
from stages.prepare import run_prepare
from stages.prepare.instruct import ANIMALS, INSTRUCTION
from stages.prepare.stage import GENERATORS
from stages.prepare.synthetic import count_tokens, generate

BPE = TinyModelParams(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, max_position_embeddings=1024, tokenizer="bpe",
                      bpe_vocab_size=400)
FACT = re.compile(r"The (\w+) has number (\d+)\.")


def cfg(*overrides: str):
    return load_params(None, ["prepare.task=fact_recall", *overrides]).prepare


@pytest.mark.parametrize("queries", [1, 3])
def test_facts_question_and_reference(queries):
    c = cfg("prepare.num_pairs=5", f"prepare.num_queries={queries}", "prepare.context_tokens=150")
    pairs = generate("fact_recall", c, seed=3, split="eval", n=20, generators=GENERATORS)
    assert pairs == generate("fact_recall", c, seed=3, split="eval", n=20, generators=GENERATORS)
    for prompt, reference in pairs:
        head, notes, question = prompt.split("\n\n")
        assert head == INSTRUCTION
        facts = dict(FACT.findall(notes))
        assert len(facts) == 5 and len(set(facts.values())) == 5
        # an animal's name occurs only in its fact (filler never names one)
        for animal in ANIMALS:
            assert len(re.findall(rf"\b{animal}\b", notes)) == (animal in facts)
        asked = [w for w in re.findall(r"the (\w+)", question) if w in ANIMALS]
        assert len(asked) == queries and all(a in facts for a in asked)
        assert reference == ", ".join(facts[a] for a in asked)
        assert question.endswith("Answer with the number only." if queries == 1 else "separated by commas.")
        assert 150 <= count_tokens(prompt) <= 170
        assert rewards.score("fact_recall", reference, reference) == 1.0


def test_question_at_the_start_precedes_the_same_notes():
    """question_position=start moves the question before the notes: the same draws (facts, filler, asked
    animals, reference), only the order of the prompt's parts differs, and the prompt ends in notes."""
    end = cfg("prepare.num_pairs=5", "prepare.context_tokens=150")
    start = cfg("prepare.num_pairs=5", "prepare.context_tokens=150", "prepare.question_position=start")
    at_end = generate("fact_recall", end, seed=3, split="eval", n=20, generators=GENERATORS)
    at_start = generate("fact_recall", start, seed=3, split="eval", n=20, generators=GENERATORS)
    for (prompt_end, ref_end), (prompt_start, ref_start) in zip(at_end, at_start, strict=True):
        head, notes, question = prompt_end.split("\n\n")
        assert prompt_start.split("\n\n") == [head, question, notes]
        assert ref_start == ref_end
        assert prompt_start.endswith(notes) and not prompt_start.endswith(question)


def test_scoring_reads_the_numbers_in_order():
    assert rewards.metric_name("fact_recall") == "kv_fraction"
    assert rewards.score("fact_recall", "The owl has number 42.", "42") == 1.0
    assert rewards.exact_match("fact_recall", "42", "42") and not rewards.exact_match("fact_recall", "42, 7", "42")
    assert rewards.score("fact_recall", "The numbers are 42 and 18.", "42, 17") == 0.5
    assert rewards.score("fact_recall", "17, 42", "42, 17") == 0.0
    assert rewards.score("fact_recall", "I don't know.", "42") == 0.0


def test_prepare_renders_through_the_chat_template(tmp_path):
    policy = init_tiny_model(BPE, tmp_path / "policy")
    c = cfg("prepare.num_train=8", "prepare.num_eval=4", "prepare.context_tokens=60")
    out = run_prepare(c, policy, tmp_path / "data", seed=1)
    tok = load_tokenizer(policy)
    df = pd.read_feather(out["eval"])
    assert (df.task == "fact_recall").all() and len(df) == 4
    for row in df.itertuples():
        ids = list(row.prompt_token_ids)
        assert ids == prompt_token_ids(tok, row.prompt) and rendered_as_chat(tok, ids)
        assert ids[-len(generation_prompt_ids(tok)):] == generation_prompt_ids(tok)
        assert tok.decode(response_ids(tok, row.reference, chat=True)) == row.reference + "<|im_end|>"


@pytest.mark.parametrize("overrides, field", [(["prepare.num_pairs=21", "prepare.num_queries=1"], "num_pairs"),
                                              (["prepare.num_pairs=2", "prepare.num_queries=3"], "num_queries"),
                                              (["prepare.question_position=middle"], "question_position")])
def test_out_of_range_parameters_name_the_field(overrides, field):
    with pytest.raises(Exception, match=field):
        cfg(*overrides)
