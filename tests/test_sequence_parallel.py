"""Sequence parallelism (`learner.sequence_parallel`, DeepSpeed-Ulysses, issue 55): the pure pieces (heads a process
owns, the evict_at slice, the sequence shard) and, on 2 processes (gloo), the learner's loss and every parameter
gradient against one process: equal in float64, within float32 rounding in float32."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from stages.bench.learner_sp import one_process_loss as bench_one_process_loss
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.learner.data import MicroBatch
from stages.learner.logprobs import chunked_token_scores
from stages.learner.sequence_parallel import (
    HeadShard,
    check_sequence_parallel,
    local_evict_at,
    local_response,
    owned_heads,
    pad_sequence_dim,
    padded_length,
    shard_batch,
    shard_bounds,
)
from stages.learner.shadow_attention import (
    pad_evict_at,
    response_index,
)
from tests.helpers import float64_policy, float64_token_scores, free_port, make_model_dir

# ------------------------------------------------------------------------------------------ pure pieces


def test_owned_heads_are_contiguous_blocks_that_keep_gqa_groups_whole():
    shards = [owned_heads(8, 4, 2, r) for r in range(2)]
    assert shards[0] == HeadShard(rank=0, size=2, q_heads=range(0, 4), kv_heads=range(0, 2))
    assert shards[1] == HeadShard(rank=1, size=2, q_heads=range(4, 8), kv_heads=range(2, 4))
    for num_q, num_kv, size in ((8, 4, 4), (12, 4, 2), (4, 4, 4), (16, 2, 2)):
        group = num_q // num_kv
        seen_q, seen_kv = [], []
        for r in range(size):
            s = owned_heads(num_q, num_kv, size, r)
            # every query head's KV head (transformers' repeat_kv: q // group) is one this rank owns
            assert {q // group for q in s.q_heads} == set(s.kv_heads)
            seen_q += list(s.q_heads)
            seen_kv += list(s.kv_heads)
        assert seen_q == list(range(num_q)) and seen_kv == list(range(num_kv))


@pytest.mark.parametrize("size,world,num_q,num_kv,message", [
    (2, 3, 4, 2, "does not divide the 3 learner processes"),
    (4, 4, 8, 2, "does not divide the model's 2 KV heads"),
    (3, 3, 6, 3, None),
    (0, 1, 4, 2, "must be >= 1"),
])
def test_a_split_that_would_tear_a_head_is_refused_in_one_line(size, world, num_q, num_kv, message):
    if message is None:
        check_sequence_parallel(size, world, num_q, num_kv)
        return
    with pytest.raises(SmdInputError) as err:
        check_sequence_parallel(size, world, num_q, num_kv)
    assert "learner.sequence_parallel" in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_sequence_shards_cover_the_padded_sequence_once():
    assert [padded_length(T, 2) for T in (1, 2, 29, 30)] == [2, 2, 30, 30]
    assert [shard_bounds(30, 3, r) for r in range(3)] == [(0, 10), (10, 20), (20, 30)]
    with pytest.raises(ValueError):
        shard_bounds(29, 2, 0)
    ids = torch.arange(2 * 7).view(2, 7) + 10
    ev = pad_evict_at([torch.randint(1, 8, (7, 2, 4)), torch.randint(1, 6, (5, 2, 4))], 7)
    ev = torch.maximum(ev, torch.arange(7).view(1, 1, 1, 7) + 1)
    padded_ids, padded_ev = pad_sequence_dim(ids, ev, 8)
    assert torch.equal(padded_ids[:, :7], ids) and (padded_ids[:, 7] == 0).all()
    assert torch.equal(padded_ev[..., :7], ev) and (padded_ev[..., 7] == 8).all()  # a padding key: only itself
    parts = [shard_batch(ids, ev, owned_heads(4, 4, 2, r)) for r in range(2)]
    assert torch.equal(torch.cat([p.input_ids for p in parts], 1), padded_ids)
    assert torch.equal(torch.cat([p.position_ids for p in parts], 1), torch.arange(8).expand(2, 8))  # global
    assert torch.equal(torch.cat([p.evict_at for p in parts], 2), padded_ev)  # KV heads split, every position
    assert parts[1].evict_at.shape == (2, 2, 2, 8) and torch.equal(parts[1].evict_at, padded_ev[:, :, 2:])
    assert torch.equal(local_evict_at(ev, owned_heads(4, 4, 4, 3)), ev[:, :, 3:4])
    assert shard_batch(ids, None, owned_heads(4, 2, 2, 0)).evict_at is None


def test_every_response_position_is_scored_by_exactly_one_process():
    prompt_lens, resp_lens = [4, 2, 6], [3, 5, 0]
    T = 8
    ids = torch.arange(3 * T).view(3, T)
    hidden_full = torch.randn(3, padded_length(T, 3), 5)
    idx, valid = response_index(prompt_lens, resp_lens)
    count = torch.zeros_like(valid, dtype=torch.long)
    for r in range(3):
        shard = shard_batch(ids, None, owned_heads(3, 3, 3, r))
        hidden, targets, mine, every = local_response(hidden_full[:, shard.start : shard.stop], shard, ids,
                                                      prompt_lens, resp_lens)
        assert torch.equal(every, valid) and not (mine & ~valid).any()
        count += mine.long()
        want = torch.gather(hidden_full, 1, idx.unsqueeze(-1).expand(-1, -1, 5))
        assert torch.equal(hidden[mine], want[mine])
        assert torch.equal(targets[valid], torch.gather(ids, 1, idx + 1)[valid])
    assert torch.equal(count, valid.long())


# ------------------------------------------------------------------------------------------ 2 processes
PROMPTS, RESPONSES = (20, 13, 17), (9, 14, 6)  # T = 29: padded to 30 for 2 processes
CASES = {
    # name: (dtype, scoring, learner overrides); scoring "chunked" is the learner's (`chunked_token_scores`: the lm
    # head in float32, its weight gradient accumulated in float32), "float64" the same scores in float64 throughout
    "smd_teacher_seq_mean": (torch.float64, "chunked",
                             {"objective": "smd", "kl_lambda": 0.1, "loss_agg": "seq_mean_token_mean"}),
    "smd_teacher_float64_head": (torch.float64, "float64",
                                 {"objective": "smd", "kl_lambda": 0.1, "loss_agg": "seq_mean_token_mean"}),
    "dense_token_mean": (torch.float64, "chunked", {"objective": "dense", "loss_agg": "token_mean"}),
    "shadow_tiled": (torch.float64, "chunked", {"objective": "shadow", "attention_backend": "tiled",
                                                "loss_agg": "seq_mean_token_sum"}),
    "smd_float32": (torch.float32, "chunked", {"objective": "smd", "kl_lambda": 0.1}),
    # layer checkpointing on the 2 processes (the all-to-alls run again in the backward's recomputation)
    "smd_checkpointed": (torch.float64, "float64", {"objective": "smd", "kl_lambda": 0.1,
                                                    "gradient_checkpointing": True}),
}
# the tied embedding / lm head: `chunked_token_scores` accumulates its weight gradient over the scored tokens in
# float32 (stages/learner/logprobs.py), so one process's sum over all tokens and two processes' sums over theirs
# round differently there (float32 eps), whatever the model's dtype
HEAD = "model.embed_tokens.weight"


def make_micro_batch(seed: int = 0, num_layers: int = 2, num_kv: int = 2) -> MicroBatch:
    """A right-padded micro-batch of 3 rows with random SnapKV-like shadow masks (every row evicts), random rollout
    log-probs and advantages."""
    rng = np.random.default_rng(seed)
    eviction = eviction_config("snapkv", 0.5, sinks=2, window=4)
    seqs, evs = [], []
    for p, r in zip(PROMPTS, RESPONSES):
        seqs.append(rng.integers(4, 120, p + r).tolist())
        evs.append(torch.from_numpy(synthetic_evict_at("snapkv", p + r, p, num_layers, num_kv, eviction,
                                                       rng).astype(np.int64)))
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    R = max(RESPONSES)
    valid = torch.arange(R).view(1, R) < torch.tensor(RESPONSES).view(-1, 1)
    rollout = torch.from_numpy(-rng.uniform(0.5, 6.0, (len(seqs), R))).float() * valid
    return MicroBatch(rows=[0, 1, 2], input_ids=ids, prompt_lens=list(PROMPTS), resp_lens=list(RESPONSES),
                      rollout_logp=rollout, valid=valid, advantages=torch.from_numpy(rng.normal(size=3)).float(),
                      evict_at=pad_evict_at(evs, T))


def load_model(model_dir: Path, dtype: torch.dtype):
    from stages.common.model import load_policy

    model = float64_policy(model_dir) if dtype == torch.float64 else load_policy(model_dir)
    return model.eval()


def one_process_loss(model, mb: MicroBatch, cfg: LearnerParams, scoring: str, temperature: float = 1.0):
    """The learner's own path on one process (`stages.bench.learner_sp.one_process_loss`), scored by the learner's
    `chunked_token_scores` or in float64 end to end."""
    return bench_one_process_loss(model, mb, cfg, temperature,
                                  score=chunked_token_scores if scoring == "chunked" else float64_token_scores)


def _worker(rank: int, world: int, port: int, model_dir: Path, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import stages.learner.logprobs as logprobs
    from stages.learner.sequence_parallel import new_sequence_parallel, sequence_parallel_loss, sum_gradients
    from stages.learner.shadow_attention import checkpointed_layers, enable_layer_checkpointing

    try:
        sp = new_sequence_parallel(world, 4, 2)
        for name, (dtype, scoring, over) in CASES.items():
            # (sequence_parallel_scores reads the module's function when it runs)
            logprobs.chunked_token_scores = chunked_token_scores if scoring == "chunked" else float64_token_scores
            model = load_model(model_dir, dtype)
            cfg = LearnerParams(**over)
            if cfg.gradient_checkpointing:
                enable_layer_checkpointing(model)
            with checkpointed_layers(model) if cfg.gradient_checkpointing else contextlib.nullcontext():
                loss, _, scores = sequence_parallel_loss(model, sp, make_micro_batch(), cfg, temperature=1.0)
            loss.backward()
            sum_gradients(model, sp)
            if rank == 0:
                torch.save({"loss": loss.detach(), "logp": scores["logp"].detach(),
                            "grads": {n: p.grad for n, p in model.named_parameters()}}, out / f"{name}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-300))


@pytest.mark.slow  # ~25-45 s on 2 shared cores: two processes start and import DeepSpeed
def test_two_processes_give_the_one_process_loss_and_gradients(tmp_path: Path):
    model_dir = make_model_dir(tmp_path, "gqa")  # 4 query heads, 2 KV heads: one KV head per process
    out = tmp_path / "sp"
    out.mkdir()
    mp.spawn(_worker, args=(2, free_port(), model_dir, out), nprocs=2, join=True)
    report = {}
    for name, (dtype, scoring, over) in CASES.items():
        model = load_model(model_dir, dtype)
        cfg = LearnerParams(**over)
        loss, scores = one_process_loss(model, make_micro_batch(), cfg, scoring)
        loss.backward()
        got = torch.load(out / f"{name}.pt")
        loss_gap = _rel(got["loss"], loss.detach())
        logp_gap = float((got["logp"] - scores["logp"].detach()).abs().max())
        gaps = {n: _rel(got["grads"][n], p.grad) for n, p in model.named_parameters()}
        head_gap = gaps.pop(HEAD)
        report[name] = {"loss": loss_gap, "logp": logp_gap, "grads": max(gaps.values()), "head": head_gap}
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
        if dtype == torch.float64:  # equal but for rounding in float64
            head_tol = 1e-10 if scoring == "float64" else 1e-6  # float32 accumulation of the head's gradient
            assert loss_gap <= 1e-10 and logp_gap <= 1e-10 and max(gaps.values()) <= 1e-10, (name, report[name])
            assert head_gap <= head_tol, (name, report[name])
        else:  # float32: the same math in another summation order (attention over the whole sequence per head)
            assert max(loss_gap, logp_gap, head_gap, *gaps.values()) <= 1e-5, (name, report[name])
    print(report)


def test_sequence_parallel_needs_per_sample_rows():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="learner.sequence_parallel > 1 needs learner.shared_prompt: false"):
        LearnerParams(sequence_parallel=2)
    assert LearnerParams(sequence_parallel=2, shared_prompt=False).sequence_parallel == 2
    assert LearnerParams().sequence_parallel == 1


# ------------------------------------------------------------------------------------------ through `smdctl learn`
# as tests/test_learner_distributed.py: Adam's first step amplifies float32 rounding of near-zero gradients by
# lr / eps; adam_eps 1e-6 keeps that below the 1e-6 tolerance while the update itself is ~lr = 1e-4 per weight
LEARN = {"rollout.group_size": 3, "learner.micro_batch_size": 2, "learner.lr": 1e-4, "learner.adam_eps": 1e-6,
         "learner.num_threads": 1, "learner.shared_prompt": "false", "learner.zero_stage": 0}


def _learn_worker(rank: int, world: int, port: int, args: tuple) -> None:
    from stages.learner.train import run_learner
    from tests.helpers import make_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    model_dir, traj, masks, out, over = args
    run_learner(make_params(**LEARN, **over), 1, model_dir, traj, masks, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_learn_with_one_sequence_on_two_processes_makes_the_one_process_update(tmp_path: Path):
    """`learner.sequence_parallel: 2` on 2 processes (one group: both hold every row, each half of its positions)
    against 1 process: smd with its dense teacher (kl_lambda), the parity pass, DeepSpeed's all-reduce."""
    import json

    from tests.helpers import make_iteration, make_params, make_prompts, max_param_diff, params_of

    model_dir = make_model_dir(tmp_path, "gqa")
    traj, masks = make_iteration(tmp_path, model_dir, make_prompts(tmp_path), make_params(**LEARN))
    one, two = tmp_path / "one" / "policy", tmp_path / "two" / "policy"
    for world, out, over in ((1, one, {}), (2, two, {"learner.sequence_parallel": 2})):
        mp.spawn(_learn_worker, args=(world, free_port(), (model_dir, traj, masks, out, over)), nprocs=world,
                 join=True)
    before, a, b = params_of(model_dir), params_of(one), params_of(two)
    assert max_param_diff(before, a) > 5e-5  # a real update (lr 1e-4)
    assert max_param_diff(a, b) <= 1e-6
    details = [json.loads((d.parent / "learn" / "details.json").read_text()) for d in (one, two)]
    steps = [json.loads((d.parent / "learn" / "steps.json").read_text())[0] for d in (one, two)]
    assert abs(steps[0]["grad_norm"] - steps[1]["grad_norm"]) <= 1e-6 * steps[0]["grad_norm"]
    for key in ("loss/total", "tokens", "policy/entropy"):  # each row counted once, not once per process
        assert abs(steps[0][key] - steps[1][key]) <= 1e-5 * max(abs(steps[0][key]), 1.0), key
    gaps = [d["mismatch/logprob_abs_diff_max"] for d in details]
    assert abs(gaps[0] - gaps[1]) <= 1e-5 and details[1]["config"]["learner"]["sequence_parallel"] == 2
