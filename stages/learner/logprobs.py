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


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    # The head runs in the model's dtype, as the model's own forward does; the softmax in float32.
    return F.linear(h, weight, bias).float() / temperature


class _ChunkedScores(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], bias [V] | None, targets [N], teacher [N, D] | None) ->
    logp [N], kl [N] (zeros without teacher), entropy [N], teacher_logp [N]; gradients for hidden, weight, bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher, temperature: float, chunk: int):
        N = hidden.shape[0]
        logp = hidden.new_zeros(N, dtype=torch.float32)
        kl = torch.zeros_like(logp)
        entropy = torch.zeros_like(logp)
        teacher_logp = torch.zeros_like(logp)
        lse = torch.zeros_like(logp)
        with torch.no_grad():
            for a in range(0, N, chunk):
                b = min(a + chunk, N)
                z = _chunk_logits(hidden[a:b], weight, bias, temperature)
                lse[a:b] = torch.logsumexp(z, dim=-1)  # for the backward's recomputation of softmax(z)
                log_q = torch.log_softmax(z, dim=-1)  # as objectives.token_logprobs computes it
                del z
                logp[a:b] = log_q.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
                q = log_q.exp()
                entropy[a:b] = -(q * log_q).sum(-1)
                del q
                if teacher is not None:
                    log_p = torch.log_softmax(_chunk_logits(teacher[a:b], weight, bias, temperature), dim=-1)
                    teacher_logp[a:b] = log_p.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
                    p = log_p.exp()
                    kl[a:b] = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
                    del p, log_p
                del log_q
        ctx.save_for_backward(hidden, weight, bias, targets, teacher, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy, teacher_logp)
        return logp, kl, entropy, teacher_logp

    @staticmethod
    def backward(ctx, g_logp, g_kl, _g_entropy, _g_teacher):
        hidden, weight, bias, targets, teacher, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        N = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g_logp = g_logp if g_logp is not None else torch.zeros(N, device=hidden.device)
        use_kl = teacher is not None and g_kl is not None
        d_hidden = torch.zeros_like(hidden) if need_h else None
        # float32 accumulation over chunks (a bf16 weight's gradient is cast back once at the end)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        d_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for a in range(0, N, chunk):
            b = min(a + chunk, N)
            with torch.no_grad():
                q = _chunk_logits(hidden[a:b], weight, bias, T).sub_(lse[a:b].unsqueeze(-1)).exp_()
                # d logp_t / dz = onehot(o_t) - q ;  d KL(p || q) / dz = q - p   (z = logits / T)
                coef = -g_logp[a:b] + (g_kl[a:b] if use_kl else 0.0)
                grad_z = q.mul_(coef.unsqueeze(-1))
                grad_z.scatter_add_(-1, targets[a:b].unsqueeze(-1), g_logp[a:b].unsqueeze(-1).float())
                if use_kl:
                    p = torch.softmax(_chunk_logits(teacher[a:b], weight, bias, T), dim=-1)
                    grad_z.sub_(p.mul_(g_kl[a:b].unsqueeze(-1)))
                    del p
                grad_z.div_(T)  # float32 [chunk, V]
                if need_h:
                    d_hidden[a:b] = grad_z.to(weight.dtype) @ weight
                if need_w:
                    d_weight.addmm_(grad_z.t(), hidden[a:b].float())
                if need_b:
                    d_bias.add_(grad_z.sum(0))
                del grad_z, q
        return (d_hidden, d_weight.to(weight.dtype) if need_w else None,
                d_bias.to(bias.dtype) if need_b else None, None, None, None, None)


def chunked_token_scores(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, valid: Tensor, *,
                         temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                         teacher_hidden: Tensor | None = None) -> dict[str, Tensor]:
    """Per response token, from final hidden states `hidden [B, R, D]` (the policy's, with gradient) and, for smd,
    `teacher_hidden [B, R, D]` (the dense teacher's; detached here), through the lm head `head`, `chunk_tokens`
    valid positions at a time:

      logp          [B, R] log softmax(logits / temperature) at `targets` (with gradient)
      kl            [B, R] KL(sg[pi_teacher] || pi) over the full vocabulary (with gradient; only with a teacher)
      entropy       [B, R] entropy of softmax(logits / temperature) (no gradient)
      teacher_logp  [B, R] the teacher's log-probs at `targets` (no gradient; only with a teacher)

    All float32, 0 at invalid positions (only the valid ones are computed)."""
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
    logp, kl, entropy, teacher_logp = _ChunkedScores.apply(h, head.weight, head.bias, tgt, th, float(temperature),
                                                           int(chunk_tokens))

    def scatter(values: Tensor) -> Tensor:
        out = values.new_zeros(B * R)
        return out.index_copy(0, index, values).view(B, R)

    out = {"logp": scatter(logp), "entropy": scatter(entropy)}
    if th is not None:
        out["kl"] = scatter(kl)
        out["teacher_logp"] = scatter(teacher_logp)
    return out
