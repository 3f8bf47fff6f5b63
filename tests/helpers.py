"""The test suite's one helpers module (test modules import from here, never from each other): tiny models,
prompt tables, rollout-to-learner batches, synthetic rollouts written to disk, float bounds, learner inputs
(rollout + compaction on a tiny model), free ports, project copies for `dvc repro` and stage commands, and
shadow-attention batches."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from schemas.params import iterations_yaml, load_params
from schemas.params.compaction import CompactionParams
from schemas.params.model import TinyModelParams
from schemas.tables import read_table, table_config, write_table
from stages.bench.synthetic_rollouts import (
    eviction_config,
    synthetic_evict_at,
    synthetic_rollout,
    write_synthetic_inputs,
)
from stages.common.model import load_policy
from stages.compaction import run_compaction
from stages.learner.shadow_attention import pad_evict_at
from stages.rollout.stage import run_rollout

SHAPES = {
    "gqa": TinyModelParams(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128, max_position_embeddings=512),
    "mha": TinyModelParams(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                           head_dim=16, intermediate_size=96, max_position_embeddings=512),
}


def make_model_dir(root: Path, shape: str = "gqa", seed: int = 0) -> Path:
    from stages.common.model import init_tiny_model

    return init_tiny_model(SHAPES[shape], root / f"model-{shape}", seed=seed)


def random_prompts(lengths, vocab_low: int = 4, vocab_high: int = 120, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_low, vocab_high, (n,), generator=g).tolist() for n in lengths]


def replay_batch(prompts, results):
    """Right-padded [B, T] ids and [L, B, H, T] evict_at for a learner forward over rollout results."""
    seqs = [p + r.response_ids for p, r in zip(prompts, results)]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    evict_at = pad_evict_at([torch.from_numpy(r.evict_at) for r in results], T)
    rec = torch.zeros(len(seqs), max(len(r.logprobs) for r in results))
    for b, r in enumerate(results):
        rec[b, : len(r.logprobs)] = torch.tensor(r.logprobs)
    return ids, evict_at, rec


def make_inputs(
    directory: Path,
    policy: str,
    lengths: list[int],
    prompt_lens: list[int],
    *,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    num_shards: int = 1,
    seed: int = 0,
    eviction: dict[str, Any] | None = None,
    permute: bool = True,
) -> dict[str, Any]:
    """Generate and write a synthetic rollout; returns paths, rows, shards and the expected masks."""
    table, shards, per_mask_row, eviction = synthetic_rollout(
        policy, lengths, prompt_lens, num_layers=num_layers, num_kv_heads=num_kv_heads, eviction=eviction,
        seed=seed, num_shards=num_shards, permute=permute,
    )
    traj, raw = write_synthetic_inputs(directory, table, shards, eviction, num_layers, num_kv_heads)
    return {
        "trajectories": traj,
        "raw": raw,
        "table": table,
        "shards": shards,
        "expected": per_mask_row,
        "eviction": eviction,
    }


def empty_params(directory: Path) -> Path:
    """An empty params file (all defaults; a params path that does not exist is an error)."""
    path = Path(directory) / "defaults.yaml"
    path.write_text("")
    return path


def write_prompt_splits(data: Path) -> Path:
    """Tiny train and eval prompt tables (3 random prompts each) in `data/`, as prepare writes them."""
    from schemas.tables import write_table

    for split, seed in (("train", 1), ("eval", 2)):
        rows = [{"prompt_id": f"{split}{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids,
                 "reference": "cat 12"} for i, ids in enumerate(random_prompts([20, 26, 23], seed=seed))]
        write_table(rows, data / f"{split}.arrow", "prompts")
    return data


def float_bound(dtype: torch.dtype, reduction_size: int, scale: float) -> float:
    """The largest difference two evaluations of the same floating-point sum may show: a derived bound, not a
    guess. Why: the order of a reduction's additions is not fixed. Chunking (the learner's lm-head chunks),
    another SIMD kernel (MKL/oneDNN dispatch by `ATEN_CPU_CAPABILITY`, and by vendor: AMD and Intel take
    different paths) or another thread count all reorder it, so a fixed 1e-6 on float32 holds on one machine
    and fails on the next.

    Recursive summation of n terms satisfies |fl(s) - s| <= gamma_n * sum |x_i| with gamma_n = n u / (1 - n u)
    and u = eps / 2 (Higham, Accuracy and Stability of Numerical Algorithms, §4.2); any summation order
    (pairwise, blocked, SIMD lanes) obeys it. Two evaluations in different orders thus differ by at most
    2 gamma_n sum |x_i| ~= n * eps * scale, where `scale` bounds sum |x_i| / n (the magnitude of the terms, or of
    the result where the terms do not cancel) and `reduction_size` is the number of terms; for a value that
    passes through a chain of reductions (a dot product, then a log-sum-exp, then a backward matmul) pass the
    sum of the chain's lengths: the first-order errors of well-conditioned steps add.

    The bound is worst-case; real differences are ~sqrt(n) smaller, and a bug (a dropped chunk, a wrong mask)
    shows as an error of order `scale` itself, far above it. Check the algorithm itself in float64, where the
    same bound is ~1e-13 x scale."""
    eps = torch.finfo(dtype).eps
    n = max(1, int(reduction_size))
    if n * eps >= 1.0:
        raise ValueError(f"float_bound: {n} terms exceed the first-order bound for {dtype}")
    return n * eps * float(scale) / (1.0 - n * eps / 2)


def float32_bound(reduction_size: int, scale: float) -> float:
    """`float_bound` for float32 (eps 1.19e-7): the allowance for a float32 result computed in two orders."""
    return float_bound(torch.float32, reduction_size, scale)


def cpu_flex_supported() -> bool:
    """Whether torch.compile can build FlexAttention's CPU kernels here: Inductor needs a vector ISA (AVX2 or
    better) and has none with `ATEN_CPU_CAPABILITY=default` or on an x86-64 CPU without AVX2; the flex backend's
    CPU tests skip there (the learner's CPU default, `auto`, is sdpa)."""
    if torch.cuda.is_available():
        return True
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return bool(pick_vec_isa())


requires_cpu_flex = pytest.mark.skipif(not cpu_flex_supported(), reason="FlexAttention on CPU needs a vector ISA "
                                       "(AVX2+); Inductor has none with ATEN_CPU_CAPABILITY=default")


def within_float32_bound(got: torch.Tensor, want: torch.Tensor, reduction_size: int) -> bool:
    """max |got - want| <= `float32_bound(reduction_size, max(1, max |want|))`: two float32 computations of the
    same quantity in different orders (another kernel, tile or chunk size, thread count)."""
    scale = max(1.0, float(want.detach().abs().max()))
    return float((got.detach() - want.detach()).abs().max()) <= float32_bound(reduction_size, scale)


def attention_chain(keys: int, queries: int, head_dim: int) -> int:
    """Reduction lengths of an attention gradient: the q.k dot product, the softmax over the keys, and the
    backward's sums over the keys (dq) and over the queries (dk, dv)."""
    return head_dim + 2 * keys + queries


def model_chain(config, tokens: int) -> int:
    """Reduction lengths a parameter gradient of a causal LM passes through, forward and backward, per layer
    (attention over `tokens` keys, the projections and the MLP), plus the lm head's log-sum-exp over the
    vocabulary and the weight gradients' sum over the tokens."""
    layer = attention_chain(tokens, tokens, config.head_dim) + 3 * config.hidden_size + config.intermediate_size
    return 2 * config.num_hidden_layers * layer + config.hidden_size + 2 * config.vocab_size + tokens


# ------------------------------------------------------------------ learner inputs (rollout + compaction)
TOL = 1e-5
BASE = {
    "rollout.prompts_per_iteration": 3,
    "rollout.group_size": 2,
    "rollout.max_new_tokens": 7,
    "rollout.batch_size": 6,
    "rollout.temperature": 0.8,
    "rollout.eviction.window": 4,
    "rollout.eviction.sinks": 2,
    "learner.micro_batch_size": 2,
    "learner.lr": 1e-3,
}


def make_params(**over):
    return load_params(None, [f"{k}={v}" for k, v in {**BASE, **over}.items()])


def make_prompts(root: Path, lengths=(30, 45, 38), seed: int = 1) -> Path:
    rows = [
        {"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids, "reference": "cat"}
        for i, ids in enumerate(random_prompts(list(lengths), seed=seed))
    ]
    return write_table(rows, root / "train.arrow", "prompts")


def set_rewards(path: Path, seed: int = 0) -> None:
    """Replace the (all-zero, random-policy) rewards with varied ones so GRPO advantages are non-zero."""
    table = read_table(path, "trajectories")
    rows = table.to_pylist()
    rng = np.random.default_rng(seed)
    for row in rows:
        row["reward"] = float(rng.integers(0, 3))
    write_table(rows, path, "trajectories", table_config(table))


def make_iteration(root: Path, model_dir: Path, prompts: Path, params, name: str = "it1") -> tuple[Path, Path]:
    """Rollout (with varied rewards) + compaction: (trajectories.arrow, masks.zarr)."""
    out = run_rollout(params, 1, model_dir, prompts, root / name / "rollout", show_progress=False)
    set_rewards(out["trajectories"])
    c = run_compaction(CompactionParams(chunk_rows=2), out["trajectories"], out["raw_masks"], root / name / "compact" / "masks.zarr")
    return out["trajectories"], c["masks"]


# A tiny Qwen3 shape for the BPE chat-model tests (model.tiny.* overrides of `smdctl init-model`).
SMALL_CHAT_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 512}


def replay_gap(params, policy: Path, rollout: dict[str, Path], masks_path: Path) -> tuple[Path, float]:
    """Compact a rollout's raw masks to `masks_path`, replay every row in the learner (shadow-masked, micro-batches
    of 3): (the compacted masks, the largest |learner - rollout| log-prob)."""
    from stages.learner.data import load_learner_data
    from stages.learner.train import score_rows

    c = run_compaction(CompactionParams(chunk_rows=2), rollout["trajectories"], rollout["raw_masks"], masks_path)
    data = load_learner_data(params.learner, rollout["trajectories"], c["masks"], 2, 2, need_masks=True)
    rows = list(range(len(data)))
    got = score_rows(load_policy(policy), data, rows, masked=True, temperature=params.rollout.temperature,
                     micro_batch_size=3)
    return c["masks"], max(float(np.abs(got[i] - data.rollout_logprobs[i]).max()) for i in rows if len(got[i]))


def float64_policy(model_dir: Path):
    """The policy computed in float64 throughout (tests/test_shared_prompt.py's `float64_model`): transformers
    computes RMSNorm and RoPE's cos/sin in float32 whatever the model's dtype (an RMSNorm's backward then rounds its
    incoming gradient to float32: ~1e-9 relative gaps between two batchings that are rounding, not the algorithm);
    both run in float64 here."""
    model = load_policy(model_dir).double()
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):  # transformers' RMSNorm (Qwen3, Llama): x / rms(x) * weight
            def rms_norm_float64(x, m=module):
                return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))

            module.forward = rms_norm_float64
    rotary = model.model.rotary_emb

    def rope_float64(x, position_ids):
        freqs = position_ids[..., None].double() * rotary.inv_freq.double()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = rope_float64
    return model


class PlainEngine:
    """The part of the DeepSpeed engine a learner step uses, on a plain module: `backward` accumulates gradients,
    `step` leaves them (the test reads them); one process at ZeRO 0 in float64 (the learner measures the norm)."""

    def __init__(self, module) -> None:
        from types import SimpleNamespace

        self.module = module
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])

    def backward(self, loss, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def zero_optimization(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        return 0

    def bfloat16_enabled(self) -> bool:
        return False

    def fp16_enabled(self) -> bool:
        return False

    def get_global_grad_norm(self) -> None:
        return None


def float64_token_scores(hidden, head, targets, valid, *, temperature=1.0, chunk_tokens=256, teacher_hidden=None,
                         teacher_head=None, accumulate_head_grad=False):
    """`chunked_token_scores` in float64 (the learner's rounds its logits to float32, so two batchings would
    differ at float32 eps): log-probs, entropy, and with a teacher its KL, log-probs and argmax. The head's
    gradient always goes through autograd (`accumulate_head_grad` changes where it is summed, not the sum)."""
    logq = torch.log_softmax(head(hidden) / temperature, dim=-1)
    out = {"logp": logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * valid,
           "entropy": -(logq.exp() * logq).sum(-1).detach() * valid}
    if teacher_hidden is not None:
        logt = torch.log_softmax((teacher_head or head)(teacher_hidden.detach()) / temperature, dim=-1).detach()
        out["kl"] = (logt.exp() * (logt - logq)).sum(-1) * valid
        out["teacher_logp"] = logt.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * valid
        out["teacher_argmax"] = logt.argmax(-1) * valid  # 0 at invalid positions, as chunked_token_scores
    return out


def params_of(policy_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(policy_dir / "model.safetensors"))


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a torch.distributed rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ project copies (dvc repro, stage commands)
ROOT = Path(__file__).resolve().parents[1]

MICRO = {
    "seed": 0,
    "model": {"tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 512}},
    "prepare": {"task": "kv_retrieval", "num_train": 32, "num_eval": 4, "context_tokens": 48, "num_pairs": 3,
                "num_queries": 1},
    "warmstart": {"steps": 4, "batch_size": 8, "warmup_steps": 1, "eval_batch_size": 4},
    "rollout": {"prompts_per_iteration": 3, "group_size": 2, "max_new_tokens": 5, "batch_size": 6,
                "shard_rows": 4, "eviction": {"policy": "snapkv", "keep_ratio": 0.5, "sinks": 2, "window": 4}},
    "learner": {"objective": "smd", "micro_batch_size": 3},
    "evaluate": {"max_new_tokens": 5, "batch_size": 4},
    "pipeline": {"num_iterations": 2},
}


def make_project(tmp_path: Path, over: dict | None = None, git: bool = False) -> Path:
    """A DVC project copy (code, dvc.yaml) with the micro params (and `over` merged on top); with `git`, a
    committed git repository too (`dvc exp run` needs one)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, proj / name)
    for name in ("cli", "stages", "schemas"):  # dvc.yaml deps name the code of each command
        shutil.copytree(ROOT / name, proj / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = load_params(None, None).model_dump()
    merge_into(params, MICRO)
    merge_into(params, over or {})
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (proj / "iterations.yaml").write_text(iterations_yaml(params["pipeline"]["num_iterations"]))
    if not git:
        run_ok(["dvc", "init", "--no-scm", "-q"], proj)
        return proj
    as_user = ["git", "-c", "user.name=smd-test", "-c", "user.email=smd-test@localhost"]
    run_ok(["git", "init", "-q"], proj)
    run_ok(["dvc", "init", "-q"], proj)
    run_ok([*as_user, "add", "."], proj)
    run_ok([*as_user, "commit", "-q", "-m", "micro"], proj)
    return proj


def merge_into(base: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge_into(base[k], v)
        else:
            base[k] = v


def subprocess_env() -> dict:
    # Stage subprocesses must not inherit a rendezvous of this test process (other tests run learn in-process).
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_ok(cmd: list[str], cwd: Path, timeout: int = 1200) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------ shadow-attention batches
def flex_model_batch(tmp_path, policy: str, seed: int, ids_seed: int):
    """Tiny GQA model and a 3-row batch (lengths 120/77/101, prompts 60/40/70) with synthetic masks."""
    model = load_policy(make_model_dir(tmp_path, "gqa"))
    lengths, prompts = [120, 77, 101], [60, 40, 70]
    rng = np.random.default_rng(seed)
    ev_cfg = eviction_config(policy, 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at(policy, T, P, 2, 2, ev_cfg, rng).astype(np.int64))
            for T, P in zip(lengths, prompts)]
    T = max(lengths)
    ids = torch.randint(4, 200, (3, T), generator=torch.Generator().manual_seed(ids_seed))
    return model, ids, pad_evict_at(rows, T), prompts, [t - p for t, p in zip(lengths, prompts)]


# A pointer-chasing-like prompt (facts "a b ." as token pairs, then the query; small-int tokens) and a response
# "10 11 ; 11 12 ; 12 13" for the induction-key tests (test_kl_probe, test_kl_tokens): 10 after 99 has no key,
# 11 after 10 has k=2 (10 30 at k=11 is another pair), ";" (3) is never in the prompt, 12 after 11 has k=5, and
# 13 after 12 is a wrong hop ("12 13" absent; the fact the right answer needed, "12 1", is at k=6).
#                  0   1   2  3   4   5  6   7   8  9   10  11  12 13
INDUCTION_PROMPT = [50, 10, 11, 1, 11, 12, 1, 20, 21, 1, 10, 30, 2, 99]
INDUCTION_RESPONSE = [10, 11, 3, 11, 12, 3, 12, 13]


# ------------------------------------------------------------------ real-model shape (issue 31): SmolLM2's architecture, tiny
# SmolLM2-135M-Instruct's ChatML template (default system prompt) and special tokens: <|endoftext|> 0 (unk),
# <|im_start|> 1 (bos), <|im_end|> 2 (eos, pad).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_like_tokenizer():
    """A byte-level BPE tokenizer trained here (`build_bpe_tokenizer`, 512 tokens) with SmolLM2's special tokens,
    their ids and its chat template."""
    from stages.common.model import build_bpe_tokenizer
    from stages.common.vocab import bpe_training_corpus

    tok = build_bpe_tokenizer(bpe_training_corpus(), vocab_size=512)
    tok.bos_token, tok.unk_token, tok.pad_token = "<|im_start|>", "<|endoftext|>", "<|im_end|>"
    tok.chat_template = SMOLLM2_TEMPLATE
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    return tok


def smollm2_like_model(vocab_size: int, seed: int = 0):
    """A random LlamaForCausalLM with SmolLM2-135M's architecture at tiny sizes: GQA with 9 query and 3 KV heads,
    tied embeddings, rope_theta 1e5, RMSNorm eps 1e-5, SiLU MLP, no biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=72, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, max_position_embeddings=512,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # RMSNorm weights of 1 would hide a norm loaded into the wrong place
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def make_smollm2_like_dir(root: Path, seed: int = 0) -> Path:
    """The tiny SmolLM2-shaped model and tokenizer saved as a plain Hugging Face directory (not smd's: no marker)."""
    tok = smollm2_like_tokenizer()
    model = smollm2_like_model(len(tok), seed)
    out = Path(root) / "smollm2-like"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` of q/k rows (transformers' GGUF loader reverses it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """Write `model` (LlamaForCausalLM, tied) and its byte-level BPE `tokenizer` as a GGUF file, as llama.cpp's
    converter lays it out (tensor names, q/k permutation, float32 tensors, gpt2 tokenizer with merges, special
    token ids and the chat template), with the `gguf` package."""
    import json as _json

    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("smollm2-like")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    spec = _json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_unk_token_id(tokenizer.unk_token_id)
    w.add_chat_template(tokenizer.chat_template)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------ an independent replay of one iteration
def _independent_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention written out by hand (no SDPA, no smd code): query q sees key k iff k <= q and evict_at[k] > q."""
    evict_at = kwargs["independent_evict_at"][module.layer_idx]  # [B, H_kv, T]
    B, Hq, T, D = query.shape
    groups = Hq // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pos = torch.arange(T)
    visible = (pos.view(1, 1, 1, T) <= pos.view(1, 1, T, 1)) & (evict_at.unsqueeze(2) > pos.view(1, 1, T, 1))
    visible = visible.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else D ** -0.5)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), None


def independent_replay(policy_dir: Path, trajectories: Path, masks: Path, temperature: float,
                       dtype: torch.dtype = torch.float64) -> tuple[np.ndarray, np.ndarray, float]:
    """Replay every row of one iteration apart from the learner: read the trajectory table and the compacted mask
    store with the schemas' readers, run the policy one row at a time with attention written out by hand
    (`_independent_attention`) in `dtype`, and return (replayed log-probs, the rollout's) over all response
    tokens, concatenated in row order, and the largest |logit| (before temperature) at those positions."""
    from transformers import AttentionInterface

    from schemas.compacted_masks import read_mask_rows

    AttentionInterface.register("smd_test_independent", _independent_attention)
    model = load_policy(policy_dir).to(dtype)
    model.config._attn_implementation = "smd_test_independent"
    table = read_table(trajectories, "trajectories").to_pylist()
    evs = read_mask_rows(masks, [row["mask_row"] for row in table])
    got, want, scale = [], [], 0.0
    with torch.no_grad():
        for row, ev in zip(table, evs):
            prompt, resp = row["prompt_token_ids"], row["response_token_ids"]
            ids = torch.tensor([prompt + resp])
            evict_at = torch.from_numpy(ev).permute(1, 2, 0).unsqueeze(1)  # [T, L, H] -> [L, 1, H, T]
            hidden = model.model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0),
                                 use_cache=False, independent_evict_at=evict_at).last_hidden_state
            logits = model.lm_head(hidden[0, len(prompt) - 1: len(prompt) + len(resp) - 1])
            scale = max(scale, float(logits.abs().max()))
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(resp).unsqueeze(-1)).squeeze(-1)
            got.append(lp.double().numpy())
            want.append(np.asarray(row["rollout_logprobs"], dtype=np.float64))
    return np.concatenate(got), np.concatenate(want), scale
