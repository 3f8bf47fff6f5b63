"""A real tokenizer path (issue 16, item 5): a byte-level BPE tokenizer trained here with `tokenizers`, Qwen's
special tokens and ChatML chat template; prepare renders prompts through the template (prepare.chat_template), the
response ends with the tokenizer's EOS (<|im_end|>), and rollout -> compaction -> learner keep parity."""

from __future__ import annotations

import numpy as np

from schemas.params import load_params
from schemas.params.compaction import CompactionParams
from schemas.params.model import TinyModelParams
from schemas.tables import read_table
from stages.compaction import compact
from stages.learner.data import load_learner_data
from stages.learner.train import score_rows
from stages.model import build_bpe_tokenizer, build_tiny_model, load_policy, prompt_token_ids, response_ids
from stages.prepare import synthetic
from stages.prepare.stage import run_prepare
from stages.rollout.stage import rollout

SHAPE = TinyModelParams(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, max_position_embeddings=512)


def _bpe_policy(root, params):
    texts = [p + " " + r for p, r in synthetic.generate("kv_retrieval", params.prepare, 0, "train", 200)]
    tok = build_bpe_tokenizer(texts, vocab_size=400)
    model = build_tiny_model(SHAPE, vocab_size=len(tok), seed=0)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.config.bos_token_id = None
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return root / "policy", tok


def test_bpe_tokenizer_chat_template_and_eos(tmp_path):
    params = load_params(None, ["prepare.context_tokens=40"])
    _, tok = _bpe_policy(tmp_path, params)
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None and tok.pad_token == "<|endoftext|>"
    ids = prompt_token_ids(tok, "key 12 is blue")
    assert tok.decode(ids) == "<|im_start|>user\nkey 12 is blue<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompt_token_ids(tok, "key 12 is blue", chat_template=False)) == "key 12 is blue"
    assert response_ids(tok, "blue")[-1] == tok.eos_token_id  # the assistant turn ends with <|im_end|>


def test_bpe_chat_prompts_rollout_learner_parity(tmp_path):
    over = ["prepare.context_tokens=40", "prepare.num_train=8", "prepare.num_eval=4",
            "rollout.prompts_per_iteration=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "rollout.batch_size=8", "rollout.eviction.window=4", "rollout.eviction.sinks=2", "rollout.min_prompt_tokens=0"]
    params = load_params(None, over)
    policy, tok = _bpe_policy(tmp_path, params)
    out = run_prepare(params.prepare, policy, tmp_path / "data", seed=0)
    table = read_table(out["train"], "prompts").to_pylist()
    start = tok.convert_tokens_to_ids("<|im_start|>")
    for row in table:  # rendered through the chat template
        assert row["prompt_token_ids"][0] == start and tok.decode(row["prompt_token_ids"]).endswith("assistant\n")
    r = rollout(params, 1, policy, out["train"], tmp_path / "rollout", show_progress=False)
    c = compact(CompactionParams(chunk_rows=2), r["trajectories"], r["raw_masks"], tmp_path / "masks.zarr")
    data = load_learner_data(params.learner, r["trajectories"], c["masks"], 2, 2, need_masks=True)
    model = load_policy(policy)
    rows = list(range(len(data)))
    got = score_rows(model, data, rows, masked=True, temperature=params.rollout.temperature, micro_batch_size=3)
    assert max(float(np.abs(got[i] - data.rollout_logprobs[i]).max()) for i in rows if len(got[i])) <= 1e-5
