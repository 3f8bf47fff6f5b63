"""One sequence across processes: DeepSpeed-Ulysses sequence parallelism for the learner (docs/design.md §6b,
"Sequence parallelism"; Jacobs et al. 2023, arXiv 2309.14509; issue 55).

`learner.sequence_parallel: N` splits each micro-batch's sequence dimension over N consecutive processes (one
sequence-parallel group): every process of the group holds the same rows and runs the decoder on its contiguous
chunk of T/N positions (T padded to a multiple of N with positions no loss reads), with the global position ids,
so RoPE is the one-process rotation. Attention needs the whole sequence: DeepSpeed's own
`deepspeed.sequence.layer.DistributedAttention` exchanges q/k/v with an all-to-all so that each process holds the
whole sequence for H/N heads (a contiguous block of heads: query heads [r Hq/N, (r+1) Hq/N) with their KV heads
[r Hkv/N, (r+1) Hkv/N), so a GQA group is never split; H_kv must divide by N), runs the local attention -- the
shadow-mask replay of its own KV heads' evict_at slice over all T positions, on the configured backend, or causal
SDPA for a dense forward -- and the reverse all-to-all gives each process its own positions for all heads back.

The loss: each process scores (log-prob, entropy, teacher KL) the response positions it holds; the per-token
scores are summed over the group (each position is held by one process, so the sum is exact) into the whole
micro-batch's [B, R] scores, with gradient only into the process's own part; every process then computes the same
objective over the whole micro-batch, so each normaliser (tokens, sequences, sparse_rl's means) is the global one.
Backpropagating that loss on every process seeds each position's gradient once (on the process that holds it) and
the all-to-all's backward routes the attention's gradients between processes: the group's parameter gradients,
summed, are exactly the one-process gradient. DeepSpeed's data-parallel all-reduce averages over all W processes,
so the learner's existing loss scale (the micro-batch's weight x W) turns that average into the sum over every
sequence-parallel group (each group one data-parallel "process" of the batch split).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from schemas.errors import SmdInputError
from stages.common.distributed import DistContext
from stages.common.model import attention_implementation

FIELD = "learner.sequence_parallel"
SP_KWARG = "smd_sequence_parallel"  # the forward keyword that carries the `SequenceParallel` to the attention


# ------------------------------------------------------------------------------------------ pure pieces
@dataclass(frozen=True)
class HeadShard:
    """The attention heads process `rank` of a sequence-parallel group of `size` holds during attention: a
    contiguous block of query heads and the KV heads they read (DeepSpeed-Ulysses' all-to-all scatters the head
    dimension in `size` equal, contiguous blocks)."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range


def check_sequence_parallel(size: int, world: int, num_q_heads: int, num_kv_heads: int) -> None:
    """Refuse a `learner.sequence_parallel` that cannot split: one line naming the field."""
    if size < 1:
        raise SmdInputError(f"{FIELD}: {size} must be >= 1")
    if size == 1:
        return
    if world % size:
        raise SmdInputError(f"{FIELD}: {size} does not divide the {world} learner processes (each sequence-parallel "
                            "group is that many consecutive processes)")
    if num_q_heads % num_kv_heads:
        raise SmdInputError(f"{FIELD}: {num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_kv_heads % size:
        raise SmdInputError(f"{FIELD}: {size} does not divide the model's {num_kv_heads} KV heads (each process "
                            "replays the shadow mask of whole KV heads; a GQA group is never split)")


def owned_heads(num_q_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """The heads `rank` of `size` attends over (`HeadShard`); refuses a split that would tear a KV head or a GQA
    group (`check_sequence_parallel`)."""
    check_sequence_parallel(size, size, num_q_heads, num_kv_heads)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a sequence-parallel group of {size}")
    q, kv = num_q_heads // size, num_kv_heads // size
    return HeadShard(rank=rank, size=size, q_heads=range(rank * q, (rank + 1) * q),
                     kv_heads=range(rank * kv, (rank + 1) * kv))


def padded_length(T: int, size: int) -> int:
    """T rounded up to a multiple of `size` (each process then holds T / size positions)."""
    return -(-T // size) * size


def shard_bounds(T: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the positions `rank` of `size` holds in a sequence of T (padded) positions."""
    if T % size:
        raise ValueError(f"{T} positions do not split into {size} equal chunks: pad with `padded_length` first")
    n = T // size
    return rank * n, (rank + 1) * n


def pad_sequence_dim(input_ids: Tensor, evict_at: Tensor | None, Tp: int, pad_id: int = 0,
                     ) -> tuple[Tensor, Tensor | None]:
    """Right-pad ids [B, T] and evict_at [L, B, H, T] to Tp positions: padding ids `pad_id`, padding key k gets k+1
    (seen only by itself, `pad_evict_at`'s rule). Padding comes after every real position: causal attention never
    shows it to a real query, and no loss reads it."""
    B, T = input_ids.shape
    if Tp == T:
        return input_ids, evict_at
    ids = torch.cat([input_ids, input_ids.new_full((B, Tp - T), pad_id)], dim=1)
    if evict_at is None:
        return ids, None
    L, _, H, _ = evict_at.shape
    tail = (torch.arange(T, Tp, dtype=evict_at.dtype, device=evict_at.device) + 1).view(1, 1, 1, -1)
    return ids, torch.cat([evict_at, tail.expand(L, B, H, Tp - T)], dim=3)


def local_evict_at(evict_at: Tensor, heads: HeadShard) -> Tensor:
    """The shadow mask of the KV heads `heads` holds, all T positions: evict_at [L, B, H_kv, T] ->
    [L, B, H_kv / size, T] (a view)."""
    return evict_at[:, :, heads.kv_heads.start : heads.kv_heads.stop]


@dataclass
class SequenceShard:
    """What process `rank` of a sequence-parallel group forwards of a right-padded micro-batch."""

    start: int  # its positions [start, stop) of the padded sequence
    stop: int
    length: int  # the padded sequence's length (a multiple of the group's size)
    input_ids: Tensor  # [B, stop - start]
    position_ids: Tensor  # [B, stop - start]: the global positions (RoPE rotates as in one process)
    evict_at: Tensor | None  # [L, B, H_kv / size, length]: its KV heads' shadow mask, every position


def shard_batch(input_ids: Tensor, evict_at: Tensor | None, heads: HeadShard, pad_id: int = 0) -> SequenceShard:
    """The sequence shard of `heads.rank` (`SequenceShard`): T padded to a multiple of the group's size, a
    contiguous chunk of positions, and the evict_at slice of its KV heads over the whole padded sequence."""
    B, T = input_ids.shape
    Tp = padded_length(T, heads.size)
    ids, ev = pad_sequence_dim(input_ids, evict_at, Tp, pad_id)
    start, stop = shard_bounds(Tp, heads.size, heads.rank)
    positions = torch.arange(start, stop, device=input_ids.device).unsqueeze(0).expand(B, stop - start)
    return SequenceShard(start=start, stop=stop, length=Tp, input_ids=ids[:, start:stop], position_ids=positions,
                         evict_at=None if ev is None else local_evict_at(ev, heads))


def local_response(hidden: Tensor, shard: SequenceShard, input_ids: Tensor, prompt_lens: list[int],
                   resp_lens: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From the shard's final hidden states [B, stop - start, D]: the hidden states at the response positions it
    holds [B, R, D] (zeros elsewhere), the target tokens [B, R] (read from the whole ids, the next position may
    be another process's), `mine` [B, R] (valid and held here) and `valid` [B, R] (every response token); the
    rows of `hidden` that are not `mine` are another position's (the chunked scoring reads `mine` only). Across
    the group every valid response position is `mine` on exactly one process."""
    from stages.learner.shadow_attention import response_index

    T = input_ids.shape[1]
    idx, valid = response_index(prompt_lens, resp_lens, device=input_ids.device)  # global positions P_b - 1 + t
    mine = valid & (idx >= shard.start) & (idx < shard.stop)
    local = torch.where(mine, idx - shard.start, torch.zeros_like(idx))
    sel = torch.gather(hidden, 1, local.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    targets = torch.gather(input_ids, 1, (idx + 1).clamp(max=T - 1))
    return sel, targets, mine, valid


def data_parallel(ctx: DistContext, size: int) -> DistContext:
    """The learner's `DistContext` as the batch split sees it under `learner.sequence_parallel: size`: one
    "process" per sequence-parallel group (rank // size of world // size); every process of a group takes the
    same rows and micro-batches."""
    from dataclasses import replace

    return ctx if size == 1 else replace(ctx, rank=ctx.rank // size, world=ctx.world // size)


# ------------------------------------------------------------------------------------------ the process group
@dataclass
class SequenceParallel:
    """One process's sequence-parallel setting: its group (`size` consecutive ranks), its rank in it, the heads it
    attends over and DeepSpeed's `DistributedAttention` that runs the all-to-alls around the local attention."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int
    heads: HeadShard
    attention: Any  # deepspeed.sequence.layer.DistributedAttention


def new_sequence_parallel(size: int, num_q_heads: int, num_kv_heads: int) -> SequenceParallel | None:
    """Collective over the whole (already initialised) process group: the groups of `size` consecutive ranks, and
    this process's `SequenceParallel`; None for size 1. DeepSpeed's communication layer is initialised on top of
    torch's process group when it is not yet (`deepspeed.comm.init_distributed`, as `deepspeed.initialize` does)."""
    if size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    check_sequence_parallel(size, world, num_q_heads, num_kv_heads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if dist.get_backend() == "gloo" else "cuda")
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    heads = owned_heads(num_q_heads, num_kv_heads, size, rank % size)
    # [B, S, H, D] (batch first): scatter the heads (dim 2), gather the sequence (dim 1); the KV head count is
    # given, so DeepSpeed partitions by KV groups
    attention = DistributedAttention(_local_attention, mine, scatter_idx=2, gather_idx=1, num_kv_heads=num_kv_heads)
    return SequenceParallel(group=mine, size=size, rank=rank % size, heads=heads, attention=attention)


# ------------------------------------------------------------------------------------------ attention
def _local_attention(query: Tensor, key: Tensor, value: Tensor, module, scaling: float,
                     kwargs: dict[str, Any]) -> Tensor:
    """Inside DistributedAttention: q [B, T, Hq/N, D], k / v [B, T, H_kv/N, D] -- the whole sequence, this
    process's heads. The shadow-mask replay of its KV heads' evict_at (`smd_evict_at` is the slice) on the backend
    `smd_backend` names, or causal SDPA for a dense forward. Returns [B, T, Hq/N, D]."""
    from stages.learner.shadow_attention import replay_shadow_mask

    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, T, D], transformers' layout
    if "smd_evict_at" in kwargs:
        out, _ = replay_shadow_mask(module, q, k, v, scaling, kwargs)
        return out
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous()


def sequence_parallel_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                                dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """The `smd_shadow` attention of a forward carrying `smd_sequence_parallel` (`SequenceParallel`): query
    [B, Hq, S, D] and key / value [B, H_kv, S, D] of this process's S positions (after RoPE at their global
    positions) -> transformers' (output [B, S, Hq, D], None) through DeepSpeed's DistributedAttention. The mask
    transformers built for the S local positions is not read: the local attention is causal over the whole
    sequence (dense) or the shadow mask (`smd_evict_at`)."""
    sp: SequenceParallel = kwargs.pop(SP_KWARG)
    if dropout:
        raise SmdInputError(f"{FIELD}: attention dropout is not supported (the learner scores in eval mode)")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D]: DistributedAttention's layout
    out = sp.attention(q, k, v, 0, None, module, scaling, kwargs)  # batch_dim_idx 0, no rotary (applied)
    return out, None


# ------------------------------------------------------------------------------------------ forward and loss
def sequence_parallel_hidden(model, sp: SequenceParallel, input_ids: Tensor, evict_at: Tensor | None,
                             prompt_lens: list[int], resp_lens: list[int], backend: str = "sdpa",
                             block_size: int = 128) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`response_hidden` of a right-padded micro-batch under sequence parallelism: the decoder on this process's
    positions, shadow-masked with evict_at [L, B, H_kv, T] (the whole one: each process slices its heads) or
    dense with None. Returns (hidden [B, R, D], read at `mine` only; targets [B, R];
    mine [B, R]: the response positions held here; valid [B, R]) (`local_response`)."""
    from stages.learner.shadow_attention import SHADOW_ATTENTION, decoder_of

    shard = shard_batch(input_ids, evict_at, sp.heads)
    extra: dict[str, Any] = {SP_KWARG: sp, "smd_backend": backend}
    if evict_at is not None:
        extra["smd_evict_at"] = shard.evict_at
        if backend == "flex":
            from stages.learner.flex_backend import build_block_masks

            extra["smd_block_masks"] = build_block_masks(shard.evict_at, len(sp.heads.q_heads), block_size)
    with attention_implementation(model, SHADOW_ATTENTION):
        hidden = decoder_of(model)(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                                   **extra).last_hidden_state
    return local_response(hidden, shard, input_ids, prompt_lens, resp_lens)


def gather_sequence(local: Tensor, sp: SequenceParallel) -> Tensor:
    """The whole micro-batch's per-token values [B, R] from each process's (`local`: zero at positions it does not
    hold): their sum over the group, exact (one process holds each position), with gradient into `local` only --
    each process backpropagates its own positions; the attention's all-to-all carries the rest."""
    total = local.detach().clone()
    dist.all_reduce(total, group=sp.group)
    if not local.requires_grad:
        return total
    return local + (total - local.detach())  # = total exactly: x + (x - x) at own positions, 0 + (y - 0) elsewhere


def sequence_parallel_scores(model, sp: SequenceParallel, input_ids: Tensor, evict_at: Tensor | None,
                             prompt_lens: list[int], resp_lens: list[int], *, temperature: float,
                             backend: str = "sdpa", block_size: int = 128, chunk_tokens: int = 256,
                             teacher: bool = False, teacher_model=None,
                             head_grad_in_place: bool = False) -> dict[str, Tensor]:
    """`chunked_token_scores` of a micro-batch under sequence parallelism, for the whole micro-batch on every
    process of the group (`gather_sequence`): logp and entropy [B, R], with `teacher` (smd's dense teacher: the
    dense forward of `teacher_model`, or of the policy itself when None, under no_grad, then the policy's masked
    one) also kl, teacher_logp, teacher_argmax. `head_grad_in_place`: `chunked_token_scores(accumulate_head_grad=...)`
    (every process adds its part of a tied head's gradient into its own `.grad`)."""
    from stages.learner import logprobs

    teacher_hidden = None
    if teacher:
        with torch.no_grad():
            teacher_hidden, _, _, _ = sequence_parallel_hidden(teacher_model if teacher_model is not None else model,
                                                               sp, input_ids, None, prompt_lens, resp_lens)
    hidden, targets, mine, _ = sequence_parallel_hidden(model, sp, input_ids, evict_at, prompt_lens, resp_lens,
                                                        backend, block_size)
    scores = logprobs.chunked_token_scores(
        hidden, logprobs.lm_head_of(model), targets, mine, temperature=temperature, chunk_tokens=chunk_tokens,
        teacher_hidden=teacher_hidden,
        teacher_head=logprobs.lm_head_of(teacher_model) if teacher and teacher_model is not None else None,
        accumulate_head_grad=head_grad_in_place)
    return {name: gather_sequence(value, sp) for name, value in scores.items()}


def sequence_parallel_loss(model, sp: SequenceParallel, mb, cfg, temperature: float,
                           head_grad_in_place: bool = False,
                           **batch_fields: Any) -> tuple[Tensor, dict[str, float], dict[str, Tensor]]:
    """The learner's loss of one micro-batch (`stages.learner.data.MicroBatch`, the whole right-padded one on every
    process of the group) under sequence parallelism: the objective `cfg.objective` (`objective_loss` on an
    `ObjectiveBatch`, as `train.micro_step` builds it) over the whole micro-batch's scores
    (`sequence_parallel_scores`: shadow-masked for the masked objectives, dense otherwise; smd's dense teacher
    when kl_lambda > 0). `batch_fields`: the `ObjectiveBatch` fields the learner fills from outside the forward
    (old_logp, ref_logp, kl_mask, sparse_rl_rejection, ...). `head_grad_in_place`: see `sequence_parallel_scores`.
    Every process of the group returns the same loss; backward on each, then the gradients summed over the group
    are the one-process gradient (`sum_gradients`, or DeepSpeed's average over all processes with the loss scaled
    by their count).
    Returns (loss, terms, scores)."""
    from stages.learner.objectives import ObjectiveBatch, objective_loss, objective_spec

    spec = objective_spec(cfg.objective)
    masked = spec.masked_forward
    scores = sequence_parallel_scores(
        model, sp, mb.input_ids, mb.evict_at if masked else None, mb.prompt_lens, mb.resp_lens,
        temperature=temperature, backend=cfg.backend_for(mb.input_ids.device.type), block_size=cfg.flex_block_size,
        chunk_tokens=cfg.logit_chunk_tokens, teacher=spec.dense_teacher and cfg.kl_lambda > 0,
        head_grad_in_place=head_grad_in_place)
    logp = scores["logp"]
    batch = ObjectiveBatch(advantages=mb.advantages, mask=mb.valid, rollout_logp=mb.rollout_logp,
                           masked_logp=logp if masked else None, dense_logp=None if masked else logp,
                           kl_per_token=scores.get("kl"), **batch_fields)
    loss, terms = objective_loss(cfg, batch)
    return loss, terms, scores


def sum_gradients(model, sp: SequenceParallel) -> None:
    """Sum the trainable parameters' gradients over the sequence-parallel group (outside DeepSpeed: its engine's
    all-reduce averages over every process instead, which the learner's loss scale turns into this sum)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad, group=sp.group)
