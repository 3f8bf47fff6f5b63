"""Tiny model and tokenizer: round trips of task text and of saved weights."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from schemas.params import load_params
from schemas.params.prepare import SYNTHETIC_TASKS
from stages.common.model import build_tiny_model, build_tiny_tokenizer, load_policy, load_tokenizer
from stages.prepare.synthetic import generate
from tests.helpers import SHAPES, make_model_dir


def test_tokenizer_round_trip_on_task_text(tmp_path):
    built = build_tiny_tokenizer()
    built.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert [built.pad_token_id, built.unk_token_id, built.bos_token_id, built.eos_token_id] == [0, 1, 2, 3]
    for task in SYNTHETIC_TASKS:
        cfg = load_params(None, [f"prepare.task={task}"]).prepare
        for prompt, reference in generate(task, cfg, seed=5, split="eval", n=3):
            for text in (prompt, reference):
                ids = built(text, add_special_tokens=False)["input_ids"]
                assert loaded(text, add_special_tokens=False)["input_ids"] == ids
                # Word-level: decoding joins tokens with single spaces; encoding that again is lossless.
                decoded = loaded.decode(ids)
                assert loaded(decoded, add_special_tokens=False)["input_ids"] == ids
                assert decoded.split() == built.convert_ids_to_tokens(ids)
    ids = built("37 apples", add_special_tokens=False)["input_ids"]
    assert built.convert_ids_to_tokens(ids) == ["3", "7", "apples"]  # digits split individually


def test_saved_model_gives_identical_logits(tmp_path):
    model_dir = make_model_dir(tmp_path, "gqa", seed=11)
    tok = load_tokenizer(model_dir)
    fresh = build_tiny_model(SHAPES["gqa"], vocab_size=len(tok), seed=11).eval()
    loaded = load_policy(model_dir)
    ids = torch.tensor([tok("key bear 2 0 bear . query : key bear . answer :")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, loaded(ids).logits)
    loaded.save_pretrained(tmp_path / "again")
    again = load_policy(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, loaded(ids).logits)
    # Any transformers user loads it without smd.
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(hf).__name__ == "Qwen3ForCausalLM"


def test_reference_nll_matches_one_sequence_at_a_time(tmp_path):
    """Batched, right-padded reference NLL == the same sum computed one unpadded sequence at a time."""
    import torch

    from stages.common.model import load_policy, load_tokenizer, reference_nll, response_ids
    from tests.helpers import make_model_dir, random_prompts

    model_dir = make_model_dir(tmp_path, "gqa")
    model, tok = load_policy(model_dir), load_tokenizer(model_dir)
    prompts = random_prompts([7, 12, 9], seed=4)
    refs = ["cat 12", "dog 3 ; cat 4", "owl"]
    want = []
    for p, r in zip(prompts, refs):
        resp = response_ids(tok, r)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + resp])).logits[0].float(), -1)
        want.append(-sum(float(logp[len(p) - 1 + i, t]) for i, t in enumerate(resp)))
    assert resp[-1] == tok.eos_token_id
    got = reference_nll(model, tok, prompts, refs, batch_size=2)
    assert abs(got - sum(want) / 3) < 1e-4
