"""A real tokenizer path (issue 16, item 5): `smdctl init-model -S model.tiny.tokenizer=bpe` builds the tiny model
with a byte-level BPE tokenizer trained here with `tokenizers`, Qwen's special tokens and ChatML chat template;
prepare renders prompts through the template (prepare.chat_template), the response ends with the tokenizer's EOS
(<|im_end|>), and rollout -> compaction -> learn keep parity (learn's gate passes and it trains)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from schemas.params import load_params
from schemas.params.model import TinyModelParams
from schemas.tables import read_table
from stages.common.model import (
    generation_prompt_ids,
    init_tiny_model,
    load_policy,
    load_tokenizer,
    prompt_token_ids,
    rendered_as_chat,
    response_ids,
)
from stages.learner.train import run_learner
from stages.prepare.stage import run_prepare
from stages.rollout.stage import run_rollout
from tests.helpers import SMALL_CHAT_MODEL, empty_params, replay_gap

SMALL = SMALL_CHAT_MODEL
SHAPE = TinyModelParams(**SMALL, tokenizer="bpe", bpe_vocab_size=400)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


def test_bpe_tokenizer_chat_template_and_eos(tmp_path):
    policy = init_tiny_model(SHAPE, tmp_path / "policy")
    tok = load_tokenizer(policy)  # as every stage loads it (AutoTokenizer)
    assert len(tok) == 400  # exactly model.tiny.bpe_vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None and tok.pad_token == "<|endoftext|>"
    ids = prompt_token_ids(tok, "key 12 is blue")
    assert tok.decode(ids) == "<|im_start|>user\nkey 12 is blue<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompt_token_ids(tok, "key 12 is blue", chat_template=False)) == "key 12 is blue"
    assert response_ids(tok, "blue", chat=True)[-1] == tok.eos_token_id  # the assistant turn ends with <|im_end|>
    # the model config carries the tokenizer's special ids (generation stops on <|im_end|>; Qwen has no BOS)
    model = load_policy(policy)
    assert model.config.vocab_size == 400
    for config in (model.config, model.generation_config):
        assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (tok.eos_token_id,
                                                                                  tok.pad_token_id, None)


def test_response_target_is_the_templates_assistant_turn(tmp_path):
    """The target the warm start trains and the reference NLL scores is exactly what the chat template's assistant
    turn holds after the prompt: no leading space (the turn opens with `<|im_start|>assistant\n`), then EOS."""
    tok = load_tokenizer(init_tiny_model(SHAPE, tmp_path / "policy"))
    assert tok.decode(generation_prompt_ids(tok)) == "<|im_start|>assistant\n"
    for reference in ("bird 78", "fox 11 ; bear 20", "7"):
        prompt = prompt_token_ids(tok, "key 12 is blue")
        assert rendered_as_chat(tok, prompt) and not rendered_as_chat(tok, prompt_token_ids(tok, "x", False))
        target = response_ids(tok, reference, chat=True)
        # independent rendering: the whole conversation as the template writes it, tokenised as one text
        text = tok.apply_chat_template([{"role": "user", "content": "key 12 is blue"},
                                        {"role": "assistant", "content": reference}], tokenize=False)
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert whole[: len(prompt)] == prompt
        assert target == whole[len(prompt): len(prompt) + len(target)]
        assert tok.decode(target) == reference + "<|im_end|>"
        # the plain form (a prompt ending with its answer cue) keeps the space the cue is followed by
        assert response_ids(tok, reference) == tok(" " + reference, add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id]
        assert target != response_ids(tok, reference)


def test_init_model_bpe_is_deterministic_and_validated(tmp_path):
    a = init_tiny_model(SHAPE, tmp_path / "a", seed=3)
    b = init_tiny_model(SHAPE, tmp_path / "b", seed=3)
    for name in MODEL_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # the word-level default is unchanged: no chat template, its own special ids
    word = load_policy(init_tiny_model(TinyModelParams(**SMALL), tmp_path / "word"))
    assert not (tmp_path / "word" / "chat_template.jinja").exists()
    assert (word.config.pad_token_id, word.config.bos_token_id, word.config.eos_token_id) == (0, 2, 3)
    # a vocabulary smaller than the byte alphabet and special tokens: one line naming the field, nothing written
    res = CliRunner().invoke(app, ["init-model", "--params", str(empty_params(tmp_path)), "--out",
                                   str(tmp_path / "bad"), "-S", "model.tiny.tokenizer=bpe",
                                   "-S", "model.tiny.bpe_vocab_size=100"])
    assert res.exit_code == 2 and "model.tiny.bpe_vocab_size" in res.output
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_init_model_bpe_chat_prompts_through_learn(tmp_path):
    """init-model (bpe, through the CLI) -> prepare (chat template) -> rollout -> compact -> learn: the learner's
    shadow-masked log-probs equal the rollout's within 1e-5, and learn's parity gate passes and it trains."""
    sizing = [f"model.tiny.{k}={v}" for k, v in SMALL.items()] + ["model.tiny.tokenizer=bpe"]
    res = CliRunner().invoke(app, ["init-model", "--params", str(empty_params(tmp_path)), "--out",
                                   str(tmp_path / "policy"), *[x for s in sizing for x in ("-S", s)]])
    assert res.exit_code == 0, res.output
    policy = tmp_path / "policy"
    over = ["prepare.context_tokens=40", "prepare.num_train=8", "prepare.num_eval=4",
            "rollout.prompts_per_iteration=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "rollout.batch_size=8", "rollout.eviction.window=4", "rollout.eviction.sinks=2",
            "rollout.min_prompt_tokens=0", "learner.micro_batch_size=4", "learner.lr=1e-3"]
    params = load_params(None, over)
    tok = load_tokenizer(policy)
    assert len(tok) == 512 and bool(tok.chat_template)  # the default model.tiny.bpe_vocab_size
    out = run_prepare(params.prepare, policy, tmp_path / "data", seed=0)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    for row in read_table(out["train"], "prompts").to_pylist():  # rendered through the chat template
        assert row["prompt_token_ids"][0] == start and tok.decode(row["prompt_token_ids"]).endswith("assistant\n")
    r = run_rollout(params, 1, policy, out["train"], tmp_path / "rollout", show_progress=False)
    masks, gap = replay_gap(params, policy, r, tmp_path / "masks.zarr")
    assert gap <= 1e-5
    learned = run_learner(params, 1, policy, r["trajectories"], masks, tmp_path / "iter-001" / "policy")
    details = json.loads(learned["details"].read_text())
    assert details["mismatch/logprob_abs_diff_max"] <= 1e-5 and details["learner/global_step"] >= 1
    assert load_tokenizer(learned["policy"]).chat_template == tok.chat_template  # the new policy keeps it
