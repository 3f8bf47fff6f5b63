"""Chunked response scoring (issue 16, item 1): log-probs, dense-teacher KL and entropy through the lm head in
token chunks equal the full-logits computation in values and gradients, for the head alone and for the
learner's whole smd loss through the model (shared-prefix teacher split). Both paths run in float32 and chunking
reorders their reductions, so they agree to `tests.helpers.float32_bound` of the reduction chain, not to a fixed
constant (issue 24: a fixed 1e-6 failed on AMD EPYC, where MKL takes other kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from stages.bench.full_logits import full_logits_objective_loss
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.common.model import load_policy
from stages.learner.logprobs import chunked_token_scores, lm_head_of
from stages.learner.objectives import (
    ObjectiveBatch,
    dense_teacher_kl_per_token,
    group_advantages,
    objective_loss,
    token_entropy,
    token_logprobs,
)
from stages.learner.shadow_attention import (
    pad_evict_at,
    response_hidden_with_teacher,
    response_logits,
    response_logits_with_teacher,
)
from tests.helpers import float32_bound, make_model_dir


def _close(a: torch.Tensor, b: torch.Tensor, reduction_size: int) -> bool:
    """max |a - b| within the float32 bound of a `reduction_size`-long reduction chain at b's magnitude (>= 1)."""
    return float((a - b).abs().max()) <= float32_bound(reduction_size, max(1.0, float(b.abs().max())))


def _head_chain(hidden_size: int, vocab: int) -> int:
    """Reduction lengths a score or gradient passes through in the head: the logit dot product (+ bias), the
    log-sum-exp and the KL's sum over the vocabulary, and the backward matmul over the vocabulary."""
    return hidden_size + 1 + 3 * vocab


def _head_case(seed: int = 0, bias: bool = True, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, R, D, V = 3, 7, 16, 300
    head = torch.nn.Linear(D, V, bias=bias, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(B, R, D, generator=g, dtype=dtype).requires_grad_()
    teacher = torch.randn(B, R, D, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, R), generator=g)
    valid = torch.ones(B, R, dtype=torch.bool)
    valid[1, 4:] = False
    valid[2, :] = False  # a row without response tokens
    w_logp = torch.randn(B, R, generator=g)
    w_kl = torch.rand(B, R, generator=g)
    return head, hidden, teacher, targets, valid, w_logp, w_kl


def _grads(loss, params):
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_scores_equal_full_logits_values_and_gradients(chunk):
    """Values and gradients equal the [B, R, V]-logits computation within float32's bound for the head's
    reductions (logits of magnitude ~10 here; the weight gradient also sums over the B x R tokens)."""
    head, hidden, teacher, targets, valid, w_logp, w_kl = _head_case()
    (B, R, D), V = hidden.shape, head.weight.shape[0]
    chain = _head_chain(D, V)
    T = 0.8
    params = [hidden, head.weight, head.bias]
    # today's path: [B, R, V] logits
    logits = head(hidden)
    with torch.no_grad():
        t_logits = head(teacher)
    ref_logp = token_logprobs(logits, targets, T).masked_fill(~valid, 0.0)
    ref_kl = dense_teacher_kl_per_token(logits, t_logits, T).masked_fill(~valid, 0.0)
    ref_ent = token_entropy(logits, T).masked_fill(~valid, 0.0)
    ref_tlogp = token_logprobs(t_logits, targets, T).masked_fill(~valid, 0.0)
    ref_g = _grads((w_logp * ref_logp + w_kl * ref_kl).sum(), params)

    out = chunked_token_scores(hidden, head, targets, valid, temperature=T, chunk_tokens=chunk,
                               teacher_hidden=teacher)
    for name, ref in (("logp", ref_logp), ("kl", ref_kl), ("entropy", ref_ent), ("teacher_logp", ref_tlogp)):
        assert out[name].shape == ref.shape and out[name].dtype == torch.float32
        assert _close(out[name].detach().double(), ref.double(), chain), name
    assert not out["entropy"].requires_grad and not out["teacher_logp"].requires_grad
    got_g = _grads((w_logp * out["logp"] + w_kl * out["kl"]).sum(), params)
    for name, a, b in zip(("hidden", "weight", "bias"), ref_g, got_g):
        assert a.dtype == b.dtype and _close(b, a, chain + (0 if name == "hidden" else B * R)), name
    assert float(got_g[0][2].abs().max()) == 0.0  # invalid positions get no gradient


def test_chunked_scores_without_teacher_and_head_without_bias():
    head, hidden, _, targets, valid, w_logp, _ = _head_case(seed=1, bias=False)
    ref_logp = token_logprobs(head(hidden), targets).masked_fill(~valid, 0.0)
    ref_g = _grads((w_logp * ref_logp).sum(), [hidden, head.weight])
    out = chunked_token_scores(hidden, head, targets, valid, chunk_tokens=3)
    assert set(out) == {"logp", "entropy"}
    (B, R, D), V = hidden.shape, head.weight.shape[0]
    assert _close(out["logp"], ref_logp, _head_chain(D, V))
    for a, b in zip(ref_g, _grads((w_logp * out["logp"]).sum(), [hidden, head.weight])):
        assert _close(b, a, _head_chain(D, V) + B * R)


def test_chunked_scores_bad_input_one_line():
    head, hidden, teacher, targets, valid, _, _ = _head_case()
    with pytest.raises(SmdInputError, match="chunk_tokens must be >= 1"):
        chunked_token_scores(hidden, head, targets, valid, chunk_tokens=0)
    with pytest.raises(SmdInputError, match="teacher_hidden: shape"):
        chunked_token_scores(hidden, head, targets, valid, teacher_hidden=teacher[:, :3])


def test_lm_head_of_refuses_softcapped_logits(tmp_path):
    model = load_policy(make_model_dir(tmp_path, "gqa"))
    assert lm_head_of(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(SmdInputError, match="final_logit_softcapping"):
        lm_head_of(model)


def test_smd_loss_through_the_model_equals_full_logits(tmp_path):
    """The learner's smd loss (GRPO on the shadow-masked policy + KL to the dense teacher, shared-prefix split) from
    chunked scores equals the loss from [B, R, V] logits, and so do the gradients of every parameter."""
    model = load_policy(make_model_dir(tmp_path, "gqa"))
    rng = np.random.default_rng(0)
    lengths, prompt = [60, 52, 47], 36
    ev = eviction_config("snapkv", 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at("snapkv", T, prompt, 2, 2, ev, rng).astype(np.int64))
            for T in lengths]
    T = max(lengths)
    evict_at = pad_evict_at(rows, T)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (3, T), generator=g)
    prompt_lens, resp_lens = [prompt] * 3, [n - prompt for n in lengths]
    rollout = -torch.rand(3, max(resp_lens), generator=g)
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0]), group_size=3)
    smd, kw = LearnerParams(kl_lambda=0.1), dict(advantages=adv, rollout_logp=rollout)
    params = [p for p in model.parameters() if p.requires_grad]
    # the head's chain, then the backward through every layer (attention over T keys and head_dim, the
    # projections and the MLP) and the weight gradients' sum over the B x T tokens
    cfg = model.config
    layer = cfg.head_dim + 2 * T + 3 * cfg.hidden_size + cfg.intermediate_size
    chain = _head_chain(cfg.hidden_size, cfg.vocab_size) + 2 * cfg.num_hidden_layers * layer + 3 * T

    sel, dsel, targets, valid = response_logits_with_teacher(model, ids, evict_at, prompt_lens, resp_lens)
    logp = token_logprobs(sel, targets, 0.8).masked_fill(~valid, 0.0)
    ref_loss, ref_terms = full_logits_objective_loss(smd, ObjectiveBatch(mask=valid, masked_logp=logp, **kw),
                                                     masked_logits=sel, dense_logits=dsel, temperature=0.8)
    ref_g = torch.autograd.grad(ref_loss, params)

    hidden, teacher, targets2, valid2 = response_hidden_with_teacher(model, ids, evict_at, prompt_lens, resp_lens)
    assert torch.equal(targets, targets2) and torch.equal(valid, valid2)
    scores = chunked_token_scores(hidden, lm_head_of(model), targets2, valid2, temperature=0.8, chunk_tokens=5,
                                  teacher_hidden=teacher)
    loss, terms = objective_loss(smd, ObjectiveBatch(mask=valid2, masked_logp=scores["logp"],
                                                     kl_per_token=scores["kl"], **kw))
    assert _close(loss, ref_loss, chain) and _close(torch.tensor(terms["loss/kl_dense"]),
                                                    torch.tensor(ref_terms["loss/kl_dense"]), chain)
    assert ref_terms["loss/kl_dense"] > 0
    for p, a, b in zip(params, ref_g, torch.autograd.grad(loss, params)):
        assert _close(b, a, chain), p.shape
    # the dense learner's path (no teacher): response logits vs chunked scores
    dense_sel, t3, v3 = response_logits(model, ids, None, prompt_lens, resp_lens)
    ref_dense = token_logprobs(dense_sel, t3, 0.8).masked_fill(~v3, 0.0)
    from stages.learner.shadow_attention import response_hidden

    h3, _, _ = response_hidden(model, ids, None, prompt_lens, resp_lens)
    got = chunked_token_scores(h3, lm_head_of(model), t3, v3, temperature=0.8, chunk_tokens=7)["logp"]
    assert _close(got, ref_dense, _head_chain(cfg.hidden_size, cfg.vocab_size))


class _TiedLM(torch.nn.Module):
    """An embedding, one tanh layer and an lm head tied to the embedding: the layout whose head gradient
    `accumulate_head_grad` adds into `.grad` during the backward."""

    def __init__(self, V: int, D: int, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(V, D, dtype=dtype)
        self.mix = torch.nn.Linear(D, D, bias=False, dtype=dtype)
        self.head = torch.nn.Linear(D, V, bias=False, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(V, D, generator=g, dtype=dtype))
            self.mix.weight.copy_(torch.randn(D, D, generator=g, dtype=dtype) / D ** 0.5)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def loss(self, ids, teacher_ids, valid, w_logp, w_kl, in_place: bool):
        hidden = torch.tanh(self.mix(self.embed(ids)))
        with torch.no_grad():
            teacher = torch.tanh(self.mix(self.embed(teacher_ids)))
        out = chunked_token_scores(hidden, self.head, ids.roll(-1, 1), valid, temperature=0.8, chunk_tokens=3,
                                   teacher_hidden=teacher, accumulate_head_grad=in_place)
        return (w_logp * out["logp"] + w_kl * out["kl"]).sum()


def _tied_case(dtype, seed=0):
    V, D, B, R = 40, 8, 3, 6
    g = torch.Generator().manual_seed(seed + 1)
    model = _TiedLM(V, D, dtype, seed)
    ids, teacher_ids = torch.randint(0, V, (B, R), generator=g), torch.randint(0, V, (B, R), generator=g)
    valid = torch.ones(B, R, dtype=torch.bool)
    valid[1, 4:] = False
    return model, (ids, teacher_ids, valid, torch.randn(B, R, generator=g, dtype=dtype),
                   torch.rand(B, R, generator=g, dtype=dtype))


@pytest.mark.parametrize("earlier_grad", [False, True])
def test_tied_head_gradient_accumulated_in_place_equals_autograd(earlier_grad):
    """float64: with `accumulate_head_grad` the tied weight's `.grad` after `loss.backward()` is autograd's sum of
    the head's and the embedding's parts (added to an earlier micro-batch's `.grad` when there is one), while the
    gradient autograd itself routes to the weight is the embedding's part alone: the head's [V, D] gradient never
    waits in autograd's buffer for the embedding's."""
    model, args = _tied_case(torch.float64)
    weight = model.embed.weight
    ref_w, ref_mix = torch.autograd.grad(model.loss(*args, in_place=False), [weight, model.mix.weight])
    earlier = torch.randn(weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    if earlier_grad:
        weight.grad = earlier.clone()
        model.mix.weight.grad = torch.zeros_like(model.mix.weight)
    grad_object = weight.grad
    routed = []
    hook = weight.register_hook(lambda g: routed.append(g.clone()))  # what autograd hands the leaf
    model.loss(*args, in_place=True).backward()
    hook.remove()
    want = ref_w + (earlier if earlier_grad else 0.0)
    assert torch.allclose(weight.grad, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(model.mix.weight.grad, ref_mix, rtol=1e-12, atol=1e-12)
    if earlier_grad:  # accumulated into the existing tensor, not a new one
        assert weight.grad is grad_object
    # the embedding's part alone: only the rows of the ids looked up are nonzero
    looked_up = torch.zeros(weight.shape[0], dtype=torch.bool)
    looked_up[args[0].reshape(-1)] = True
    assert len(routed) == 1 and float(routed[0][~looked_up].abs().max()) == 0.0
    assert float((ref_w[~looked_up]).abs().max()) > 0  # the head's part is nonzero on those rows


def test_tied_head_gradient_in_place_bf16_matches_returned():
    """bf16 weights (float32 accumulation over chunks, cast once): the in-place path gives the returned path's
    `.grad`, with and without an earlier `.grad`."""
    for earlier_grad in (False, True):
        grads = []
        for in_place in (False, True):
            model, args = _tied_case(torch.bfloat16, seed=3)
            weight = model.embed.weight
            if earlier_grad:
                weight.grad = torch.full_like(weight, 0.5)
            model.loss(*args, in_place=in_place).backward()
            grads.append(weight.grad.float())
        # the same bf16 roundings in another order of three summands: within bf16's spacing of the values
        assert torch.allclose(grads[0], grads[1], rtol=2 ** -7, atol=2 ** -7 * float(grads[0].abs().max())), \
            earlier_grad


def test_accumulate_head_grad_rule():
    """In place only for a trainable head tied to the embedding, and not under ZeRO 3 (partitioned gradients)."""
    from stages.learner.logprobs import accumulate_head_grad

    model, _ = _tied_case(torch.float32)
    assert accumulate_head_grad(model, 0) and accumulate_head_grad(model, 2)
    assert not accumulate_head_grad(model, 3)
    model.embed.weight.requires_grad_(False)
    assert not accumulate_head_grad(model, 0)
    untied, _ = _tied_case(torch.float32)
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    assert not accumulate_head_grad(untied, 0)
