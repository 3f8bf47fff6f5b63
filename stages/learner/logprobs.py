"""Response-token log-probs and the dense-teacher KL from final hidden states, in token chunks
(docs/design.md §7, "Memory").

The learner needs, per response token t: log pi(o_t) under the policy, the full-vocabulary
KL(sg[pi_dense] || pi_masked) for smd, and the policy entropy (logged). Computing them from [B, R, V] float32
logits holds several [B, R, V] tensors at once (logits, log-softmax, its gradient): with Qwen3's 151,936-token
vocabulary that is ~2.5 GB per tensor for one 4,096-token response. Here the lm head runs on `chunk_tokens`
response positions at a time: forward keeps per token only the log-sum-exp; backward recomputes each chunk's
logits (and the teacher's) and accumulates the gradients of the hidden states and of the head's weight. Peak
logit memory is O(chunk_tokens x V) whatever the response length, at the price of running the lm head once more
per pass in backward (the recomputation of Liger-Kernel's fused linear cross-entropy / JSD; Hsu et al. 2024,
arXiv 2410.10989; here the loss stays outside, so the head runs again instead of fusing the gradient into the
forward).

Values equal the unchunked ones (`objectives.token_logprobs`, `objectives.dense_teacher_kl_per_token`,
`objectives.token_entropy` on the head's logits) up to float rounding; tests check values and gradients to 1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from schemas.errors import SmdInputError

DEFAULT_CHUNK_TOKENS = 256


def lm_head_of(model) -> torch.nn.Linear:
    """The model's output projection, refusing heads whose logits are not `lm_head(hidden)` (soft-capped or scaled
    logits, e.g. Gemma 2 / Cohere), which the chunked scoring would get wrong."""
    cfg = model.config
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        value = getattr(cfg, key, None)
        if value not in (None, 1, 1.0):
            raise SmdInputError(f"model config: {key}: {value} (the learner scores logits = lm_head(hidden) only)")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise SmdInputError(f"model: output embeddings are a {type(head).__name__}, not a Linear lm head")
    return head


def _logits_into(out: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """out[:n] <- (h @ weight.T + bias) / temperature in float32; the head runs in the model's dtype, as the model's
    own forward does. Writing into one buffer per call: a fresh [chunk, V] tensor per chunk costs page faults that
    took longer than the arithmetic on CPU."""
    n = h.shape[0]
    z = out[:n]
    if weight.dtype == torch.float32:
        torch.mm(h, weight.t(), out=z)
        if bias is not None:
            z.add_(bias)
    else:
        z.copy_(F.linear(h, weight, bias))
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum(a * b, -1) for [n, V] rows without an [n, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _log_softmax_(z: Tensor) -> tuple[Tensor, Tensor]:
    """In place: z <- log softmax(z) (rows); returns (z, log-sum-exp [n])."""
    lse = torch.logsumexp(z, dim=-1)
    return z.sub_(lse.unsqueeze(-1)), lse


class _ChunkedScores(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], bias [V] | None, targets [N], teacher [N, D] | None, teacher_weight [V, D] |
    None, teacher_bias [V] | None) -> logp [N], kl [N] (zeros without teacher), entropy [N], teacher_logp [N],
    teacher_argmax [N] (int64, zeros without teacher); gradients for hidden, weight, bias. The teacher's logits
    come from teacher_weight / teacher_bias (the policy's own head detached, or a separate teacher model's; never
    differentiated). Two [chunk / 2, V] float32 buffers per call (one [chunk, V] in a backward without teacher),
    reused by every chunk; everything else in place on them.

    `accumulate`: the weight's gradient goes straight into `weight.grad` inside the backward (created when None)
    and autograd gets None for it (`accumulate_head_grad`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher, teacher_weight, teacher_bias, temperature: float,
                chunk: int, accumulate: bool = False):
        N, V = hidden.shape[0], weight.shape[0]
        logp = torch.zeros(N, dtype=torch.float32, device=hidden.device)
        kl, entropy, teacher_logp, lse, teacher_lse = (torch.zeros_like(logp) for _ in range(5))
        teacher_argmax = torch.zeros(N, dtype=torch.long, device=hidden.device)
        # two buffers (log q, and q or the teacher's log p) of half a chunk each: chunk x V floats in all, as the
        # backward; this forward runs while every saved activation is alive, so its buffers add to the step's peak
        step = max(1, chunk // 2)
        rows = min(step, max(N, 1))
        buf_q, buf_p = (torch.empty(rows, V, dtype=torch.float32, device=hidden.device) for _ in range(2))
        with torch.no_grad():
            for a in range(0, N, step):
                b = min(a + step, N)
                tgt = targets[a:b].unsqueeze(-1)
                log_q, lse[a:b] = _log_softmax_(_logits_into(buf_q, hidden[a:b], weight, bias, temperature))
                logp[a:b] = log_q.gather(-1, tgt).squeeze(-1)
                q = torch.exp(log_q, out=buf_p[: b - a])
                entropy[a:b] = -_rowdot(q, log_q)
                if teacher is not None:  # two buffers in all: log q is overwritten by log p - log q
                    z_p = _logits_into(buf_p, teacher[a:b], teacher_weight, teacher_bias, temperature)
                    teacher_argmax[a:b] = z_p.argmax(-1)  # on the logits (the log-softmax's shift may round ties)
                    log_p, teacher_lse[a:b] = _log_softmax_(z_p)
                    teacher_logp[a:b] = log_p.gather(-1, tgt).squeeze(-1)
                    log_ratio = torch.sub(log_p, log_q, out=log_q)
                    # sum_v p (log p - log q); log-probs of finite logits are finite, so p = 0 adds exactly 0
                    kl[a:b] = _rowdot(log_p.exp_(), log_ratio)
        # the log-sum-exps let the backward rebuild q and p from the logits alone (no second reduction)
        ctx.save_for_backward(hidden, weight, bias, targets, teacher, lse, teacher_lse, teacher_weight, teacher_bias)
        ctx.temperature, ctx.chunk, ctx.accumulate = temperature, chunk, accumulate
        ctx.mark_non_differentiable(entropy, teacher_logp, teacher_argmax)
        return logp, kl, entropy, teacher_logp, teacher_argmax
    @staticmethod
    def backward(ctx, g_logp, g_kl, _g_entropy, _g_teacher, _g_argmax):
        hidden, weight, bias, targets, teacher, lse, teacher_lse, teacher_weight, teacher_bias = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        N, V = hidden.shape[0], weight.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g_logp = g_logp if g_logp is not None else torch.zeros(N, device=hidden.device)
        use_kl = teacher is not None and g_kl is not None
        d_hidden = torch.zeros_like(hidden) if need_h else None
        # float32 accumulation over chunks (a bf16 weight's gradient is cast back once at the end); with
        # `accumulate` a float32 weight's existing .grad is the accumulator itself: no [V, D] buffer at all
        into_grad = (need_w and ctx.accumulate and weight.grad is not None and weight.dtype == torch.float32
                     and weight.grad.dtype == torch.float32 and not weight.grad.is_sparse)
        d_weight = None
        if need_w:
            d_weight = weight.grad if into_grad else torch.zeros(weight.shape, dtype=torch.float32,
                                                                   device=weight.device)
        d_bias = torch.zeros(V, dtype=torch.float32, device=weight.device) if need_b else None
        # With the teacher the backward needs q and p at once: half-size chunks keep the two buffers at the size of
        # the dense learner's one (the peak is the same as without the teacher)
        if use_kl:
            chunk = max(1, chunk // 2)
        rows = min(chunk, max(N, 1))
        buf_q = torch.empty(rows, V, dtype=torch.float32, device=hidden.device)
        buf_p = torch.empty_like(buf_q) if use_kl else None
        # z = logits / T:  d logp_t / dz = onehot(o_t) - q ;  d KL(p || q) / dz = q - p ;  d / dlogits = (...) / T
        g_logp_t = g_logp.float() / T
        g_kl_t = g_kl.float() / T if use_kl else None
        with torch.no_grad():
            for a in range(0, N, chunk):
                b = min(a + chunk, N)
                q = _logits_into(buf_q, hidden[a:b], weight, bias, T).sub_(lse[a:b].unsqueeze(-1)).exp_()
                coef = -g_logp_t[a:b] + (g_kl_t[a:b] if use_kl else 0.0)
                grad_z = q.mul_(coef.unsqueeze(-1))
                grad_z.scatter_add_(-1, targets[a:b].unsqueeze(-1), g_logp_t[a:b].unsqueeze(-1))
                if use_kl:
                    p = _logits_into(buf_p, teacher[a:b], teacher_weight, teacher_bias, T).sub_(teacher_lse[a:b].unsqueeze(-1)).exp_()
                    grad_z.addcmul_(p, g_kl_t[a:b].unsqueeze(-1), value=-1.0)
                if need_h:
                    g = grad_z if weight.dtype == torch.float32 else grad_z.to(weight.dtype)
                    d_hidden[a:b] = g @ weight
                if need_w:
                    d_weight.addmm_(grad_z.t(), hidden[a:b] if hidden.dtype == torch.float32 else hidden[a:b].float())
                if need_b:
                    d_bias.add_(grad_z.sum(0))
        if need_w and ctx.accumulate:
            if not into_grad:
                with torch.no_grad():
                    if weight.grad is None:
                        weight.grad = d_weight.to(weight.dtype)
                    else:
                        weight.grad.add_(d_weight.to(weight.grad.dtype))
            d_weight = None  # autograd gets no gradient for the weight: it is in .grad already
        return (d_hidden, d_weight.to(weight.dtype) if d_weight is not None else None,
                d_bias.to(bias.dtype) if need_b else None, None, None, None, None, None, None, None)


def accumulate_head_grad(model, zero_stage: int) -> bool:
    """Whether the learner's chunked scoring adds the lm head's weight gradient straight into `weight.grad`
    (`chunked_token_scores(accumulate_head_grad=True)`): when the head is tied to the input embedding (SmolLM2,
    Qwen3 up to 4B) and trainable, and ZeRO does not partition the gradients (stage < 3 keeps each parameter's
    whole `.grad`; its hooks read `.grad` when autograd's accumulation of the parameter runs, after the embedding's
    part, last).

    Why: a tied weight is one leaf used twice, so autograd holds the head's [V, D] gradient in the leaf's input
    buffer from the head's backward (first) until the embedding's (last), i.e. across the whole backward, on top
    of `.grad` itself: 594 MiB float32 at Qwen3's vocabulary and D 1024 (docs/design.md §7, "Memory"). Megatron-LM
    accumulates the weight gradient inside the backward for the same reason (`gradient_accumulation_fusion`,
    `LinearWithGradAccumulationAndAsyncCommunication`: into `main_grad`, returning no weight gradient)."""
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return (zero_stage < 3 and head is not None and embed is not None and head.weight is embed.weight
            and head.weight.requires_grad)


def chunked_token_scores(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, valid: Tensor, *,
                         temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                         teacher_hidden: Tensor | None = None,
                         teacher_head: torch.nn.Linear | None = None,
                         accumulate_head_grad: bool = False) -> dict[str, Tensor]:
    """Per response token, from final hidden states `hidden [B, R, D]` (the policy's, with gradient) and, for smd,
    `teacher_hidden [B, R, D]` (the dense teacher's; detached here), through the lm head `head` (the teacher's
    through `teacher_head` when given: a separate, frozen teacher model, `learner.kl_teacher=reference`; else
    through `head`), `chunk_tokens` valid positions at a time:

      logp          [B, R] log softmax(logits / temperature) at `targets` (with gradient)
      kl            [B, R] KL(sg[pi_teacher] || pi) over the full vocabulary (with gradient; only with a teacher)
      entropy       [B, R] entropy of softmax(logits / temperature) (no gradient)
      teacher_logp  [B, R] the teacher's log-probs at `targets` (no gradient; only with a teacher)
      teacher_argmax [B, R] int64: the teacher's most likely token (argmax of its logits, taken per chunk: no
                    [B, R, V] tensor; only with a teacher; `learner.kl_tokens=keyed` reads it)

    float32 but teacher_argmax, 0 at invalid positions (only the valid ones are computed).

    `accumulate_head_grad`: the backward adds the head's weight gradient into `head.weight.grad` itself instead of
    handing it to autograd (the same sum, no [V, D] buffer held through the backward; see `accumulate_head_grad`).
    Only for a backward that accumulates into `.grad` (`loss.backward()`, DeepSpeed's `engine.backward`), never
    under `torch.autograd.grad`, which would not see that part."""
    if temperature <= 0:
        raise SmdInputError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise SmdInputError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    B, R, D = hidden.shape
    if targets.shape != (B, R) or valid.shape != (B, R):
        raise SmdInputError(f"targets/valid: shapes {tuple(targets.shape)}, {tuple(valid.shape)} do not match "
                            f"hidden {tuple(hidden.shape)}")
    index = valid.reshape(-1).nonzero().squeeze(-1)
    h = hidden.reshape(B * R, D).index_select(0, index)
    tgt = targets.reshape(-1).index_select(0, index).long()
    th = None
    if teacher_hidden is not None:
        if teacher_hidden.shape != hidden.shape:
            raise SmdInputError(f"teacher_hidden: shape {tuple(teacher_hidden.shape)} does not match hidden "
                                f"{tuple(hidden.shape)}")
        th = teacher_hidden.detach().reshape(B * R, D).index_select(0, index)
    if teacher_head is not None:
        if th is None:
            raise SmdInputError("teacher_head: given without teacher_hidden")
        if teacher_head.weight.shape != head.weight.shape:
            raise SmdInputError(f"teacher_head: weight shape {tuple(teacher_head.weight.shape)} does not match the "
                                f"policy's lm head {tuple(head.weight.shape)} (teacher and policy need one vocabulary)")
    t_head = teacher_head if teacher_head is not None else head
    t_weight = t_head.weight.detach() if th is not None else None
    t_bias = t_head.bias.detach() if th is not None and t_head.bias is not None else None
    logp, kl, entropy, teacher_logp, teacher_argmax = _ChunkedScores.apply(
        h, head.weight, head.bias, tgt, th, t_weight, t_bias, float(temperature), int(chunk_tokens),
        bool(accumulate_head_grad))

    def scatter(values: Tensor) -> Tensor:
        out = values.new_zeros(B * R)
        return out.index_copy(0, index, values).view(B, R)

    out = {"logp": scatter(logp), "entropy": scatter(entropy)}
    if th is not None:
        out["kl"] = scatter(kl)
        out["teacher_logp"] = scatter(teacher_logp)
        out["teacher_argmax"] = scatter(teacher_argmax)
    return out
