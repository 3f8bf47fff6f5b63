"""SnapKV's observation window under a chat template (`rollout.eviction.window_anchor`, issue 42).

The kept sets themselves are checked against an independent SnapKV reference in tests/test_policy_references.py
(`test_snapkv_window_anchored_before_a_tail_matches_reference`); here: the template's closing tokens, the config
check, and the stages (rollout, evaluation, the learner's replay) with a chat tokenizer.
"""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from cli.main import app
from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.params.rollout import EvictionParams
from schemas.raw_masks import read_raw_masks
from schemas.tables import read_table
from stages.common.model import (
    build_bpe_tokenizer,
    chat_template_tail,
    load_tokenizer,
    observation_window_tail,
    prompt_token_ids,
)
from stages.common.vocab import bpe_training_corpus
from stages.evaluate.stage import run_evaluate
from stages.prepare.stage import run_prepare
from stages.rollout.stage import run_rollout
from tests.helpers import SMALL_CHAT_MODEL, empty_params, replay_gap, smollm2_like_tokenizer

ANCHORED = EvictionParams(policy="snapkv", window_anchor="user_end")


def test_chat_template_tail_is_chatml_closing_tokens():
    tok = smollm2_like_tokenizer()
    tail = chat_template_tail(tok)
    assert tok.decode(tail) == "<|im_end|>\n<|im_start|>assistant\n"
    ids = prompt_token_ids(tok, "key fox 42 . query : fox")
    assert ids[-len(tail):] == tail and tok.decode(ids[: -len(tail)]).endswith("query : fox")


def test_no_template_no_tail():
    tok = build_bpe_tokenizer(bpe_training_corpus(), vocab_size=300)
    tok.chat_template = None
    assert chat_template_tail(tok) == []
    assert observation_window_tail(ANCHORED, tok, [[5, 6, 7]]) == 0


def test_observation_window_tail_checks_every_prompt():
    tok = smollm2_like_tokenizer()
    rendered = [prompt_token_ids(tok, text) for text in ("a b c", "query : owl")]
    assert observation_window_tail(ANCHORED, tok, rendered, "train.arrow") == len(chat_template_tail(tok)) > 0
    assert observation_window_tail(EvictionParams(policy="snapkv"), tok, [[1, 2]]) == 0  # prompt_end: no check
    plain = tok("a b c", add_special_tokens=False)["input_ids"]
    with pytest.raises(SmdInputError, match=r"^train\.arrow: prompt_token_ids: .*closing tokens.*"
                                            r"evaluate\.compressed_eviction\.window_anchor user_end"):
        observation_window_tail(ANCHORED, tok, [*rendered, plain], "train.arrow",
                                "evaluate.compressed_eviction.window_anchor")


@pytest.mark.parametrize("policy", ["h2o", "recent", "random", "dense"])
def test_anchor_is_snapkvs_only(policy):
    with pytest.raises(ValidationError, match="window_anchor user_end places SnapKV's observation window"):
        EvictionParams(policy=policy, window_anchor="user_end")


@pytest.fixture(scope="module")
def chat_project(tmp_path_factory):
    """A tiny BPE chat model (init-model) and its chat-rendered kv_retrieval data."""
    tmp = tmp_path_factory.mktemp("anchor")
    sizing = [f"model.tiny.{k}={v}" for k, v in SMALL_CHAT_MODEL.items()] + ["model.tiny.tokenizer=bpe"]
    res = CliRunner().invoke(app, ["init-model", "--params", str(empty_params(tmp)), "--out", str(tmp / "policy"),
                                   *[x for s in sizing for x in ("-S", s)]])
    assert res.exit_code == 0, res.output
    over = ["prepare.context_tokens=40", "prepare.num_train=8", "prepare.num_eval=4",
            "rollout.prompts_per_iteration=4", "rollout.group_size=2", "rollout.max_new_tokens=6",
            "rollout.batch_size=8", "rollout.eviction.window=4", "rollout.eviction.keep_ratio=0.4",
            "rollout.min_prompt_tokens=0", "evaluate.max_new_tokens=4", "learner.micro_batch_size=4"]
    data = run_prepare(load_params(None, over).prepare, tmp / "policy", tmp / "data", seed=0)
    return tmp, over, data


def test_rollout_and_replay_with_the_anchored_window(chat_project):
    """The rollout records other kept sets with the anchor than without, and the learner's replay of them is the
    sampling policy (log-probs within float32 rounding)."""
    tmp, over, data = chat_project
    policy = tmp / "policy"
    evict = {}
    for anchor in ("prompt_end", "user_end"):
        params = load_params(None, [*over, f"rollout.eviction.window_anchor={anchor}"])
        r = run_rollout(params, 1, policy, data["train"], tmp / anchor, show_progress=False)
        attrs, shards = read_raw_masks(r["raw_masks"])
        assert attrs["eviction"]["window_anchor"] == anchor  # the store records what ran
        evict[anchor] = np.concatenate([s["evict_at"] for s in shards])
        assert read_table(r["trajectories"], "trajectories").num_rows == 8
    assert evict["prompt_end"].shape == evict["user_end"].shape
    assert not np.array_equal(evict["prompt_end"], evict["user_end"])
    assert replay_gap(params, policy, r, tmp / "masks.zarr")[1] <= 1e-5


def test_evaluate_anchored_and_refuses_unrendered_prompts(chat_project, tmp_path):
    tmp, over, data = chat_project
    params = load_params(None, [*over, "rollout.eviction.window_anchor=user_end"])
    out = run_evaluate(params, 1, tmp / "policy", data["eval"], tmp_path / "eval", show_progress=False)
    assert out["metrics"].exists()
    plain = load_params(None, [*over, "prepare.chat_template=false"])
    raw = run_prepare(plain.prepare, tmp / "policy", tmp_path / "raw", seed=0)
    with pytest.raises(SmdInputError, match=r"eval\.arrow: prompt_token_ids: .*rollout\.eviction\.window_anchor"):
        run_evaluate(params, 1, tmp / "policy", raw["eval"], tmp_path / "bad", show_progress=False)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SmdInputError, match=r"train\.arrow: prompt_token_ids: .*rollout\.eviction\.window_anchor"):
        run_rollout(params, 1, tmp / "policy", raw["train"], tmp_path / "bad", show_progress=False)
    assert not (tmp_path / "bad").exists()
    assert load_tokenizer(tmp / "policy").chat_template  # the refusal is about the data, not the tokenizer
