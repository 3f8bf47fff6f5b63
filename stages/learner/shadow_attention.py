"""Shadow attention: replay the rollout's shadow mask inside the learner's attention (docs/design.md §3–4).

Registered as a transformers attention implementation (`smd_shadow`). The forward receives the
per-layer `evict_at` through a forward kwarg, and each layer masks evicted keys with -inf before the
softmax, so the learner's policy equals the policy that sampled.

Backends:
- `sdpa` (reference): an explicit per-head boolean mask [B, H, T, T] built per layer from evict_at.
- `flex`: FlexAttention with a BlockMask built from evict_at (mask memory O(T) plus O((T/block)^2)
  block indices; fully masked blocks are skipped).
- `tiled`: query tiles through PyTorch's fused CPU flash-attention kernel, forward and backward, over the keys
  each (sequence, KV head) still shows the tile (stages/learner/tiled_backend.py; the fast path on CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from schemas.raw_masks import visibility
from stages.common.model import attention_implementation

SHADOW_ATTENTION = "smd_shadow"


def pad_evict_at(rows: list[torch.Tensor], T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Stack per-row evict_at [T_i, L, H] into [L, B, H, T]; padding key k gets k+1 (seen only by itself).
    Built on `device` (default: the first row's, the host for rows read from a mask store)."""
    L, H = rows[0].shape[1:]
    if device is None:  # (torch.as_tensor would follow torch's default device, not the rows')
        device = rows[0].device if isinstance(rows[0], torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    out = (torch.arange(T, dtype=torch.int64, device=device) + 1).view(1, 1, 1, T).repeat(L, len(rows), H, 1)
    for b, r in enumerate(rows):
        out[:, b, :, : r.shape[0]] = torch.as_tensor(r, dtype=torch.int64, device=device).permute(1, 2, 0)
    return out


def shadow_mask(evict_at_layer: torch.Tensor) -> torch.Tensor:
    """[B, H, T] -> bool [B, H, T, T]: query q sees key k iff k <= q and evict_at[k] > q."""
    return visibility(evict_at_layer)


def shadow_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if "smd_sequence_parallel" in kwargs:  # learner.sequence_parallel: DeepSpeed-Ulysses around the same replay
        from stages.learner.sequence_parallel import sequence_parallel_attention

        return sequence_parallel_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if "smd_evict_at" not in kwargs:  # a dense forward (the teacher, the dense learners): transformers' SDPA
        from stages.learner.dense_attention import sdpa_gqa_attention

        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)
    return replay_shadow_mask(module, query, key, value, scaling, kwargs)


def replay_shadow_mask(module, query, key, value, scaling, kwargs):
    """The shadow-masked attention of the query rows [T_k - T_q, T_k) (all rows in a full forward, the rows after a
    cached prefix otherwise) on the backend `smd_backend` names; returns transformers' (output, weights).

    `smd_prefix` (one (keys, values) [R, H_kv, S, D] per layer) and `smd_prefix_rows` (row b reads prefix
    `smd_prefix_rows[b]`): the rows continue shared prefixes that the forward holds once (a GRPO group's prompt,
    `stages.learner.shared_prompt`); the keys of row b are its prefix's followed by `key`'s. Only the tiled backend
    reads a prefix in place; for the others the caller passes the concatenation as `key` and `value`."""
    evict_at = kwargs["smd_evict_at"]  # [L, B, H_kv, T]
    backend = kwargs.get("smd_backend", "sdpa")
    layer = module.layer_idx
    groups = query.shape[1] // key.shape[1]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix = kwargs["smd_prefix"][layer] if kwargs.get("smd_prefix") is not None else None
    if prefix is not None and backend == "tiled":
        from stages.learner.tiled_backend import tiled_shadow_attention

        out = tiled_shadow_attention(query, key, value, evict_at[layer], scaling, prefix=prefix,
                                     prefix_rows=kwargs.get("smd_prefix_rows"))
        return out.transpose(1, 2).contiguous(), None
    if prefix is not None:  # the other backends take the whole keys (the shared prompt concatenates them)
        raise ValueError(f"smd_prefix: the {backend} backend reads no shared prefix; use tiled")
    if backend == "flex":
        from stages.learner.flex_backend import flex_shadow_attention

        out = flex_shadow_attention(query, key, value, evict_at[layer], scaling, kwargs.get("smd_block_masks"), layer)
    elif backend == "tiled":
        from stages.learner.tiled_backend import tiled_shadow_attention

        out = tiled_shadow_attention(query, key, value, evict_at[layer], scaling)
    else:
        offset = key.shape[2] - query.shape[2]
        mask = shadow_mask(evict_at[layer])[:, :, offset:].repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SHADOW_ATTENTION, shadow_attention)


def response_index(prompt_lens: list[int], resp_lens: list[int], offset: int = 0,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, R_max] whose logits predict each response token (P_b - 1 + t, minus `offset`), and validity,
    on `device`: built from the host-side lengths without a loop of small copies."""
    B, R = len(prompt_lens), max(max(resp_lens), 1)
    t = torch.arange(R, dtype=torch.long, device=device).view(1, R)
    start = torch.tensor([p - 1 - offset for p in prompt_lens], dtype=torch.long, device=device).view(B, 1)
    n = torch.tensor(resp_lens, dtype=torch.long, device=device).view(B, 1)
    valid = t < n
    idx = torch.where(valid, start + t, torch.zeros((), dtype=torch.long, device=device))
    return idx, valid


def decoder_of(model):
    """The model's decoder stack without its lm head (Qwen3ForCausalLM.model, ...): final hidden states."""
    return getattr(model, model.base_model_prefix)


def enable_layer_checkpointing(model) -> None:
    """Activation (gradient) checkpointing of every decoder layer, the transformers way
    (`activation_checkpointing_enable`, `gradient_checkpointing_enable` in 5.19; non-reentrant `torch.utils.checkpoint`): a layer keeps only its input in the
    forward and recomputes its activations in the backward, with the same keyword arguments (the mask included). transformers checkpoints a layer only while it is in
    training mode; the learner runs the model in eval mode (no dropout), so the forward with gradient runs inside
    `checkpointed_layers`."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; transformers 5.19 has only the old one
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # The backward recomputes a layer after the forward's `attention_implementation` context has exited: the
    # attention the model dispatches to must not depend on that context. `smd_shadow` replays the mask when the
    # forward carries `smd_evict_at` and is transformers' SDPA otherwise, so it stays selected for good.
    model.config._attn_implementation = SHADOW_ATTENTION


def layer_checkpointing_enabled(model) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())


@contextlib.contextmanager
def checkpointed_layers(model) -> Iterator[None]:
    """Mark the decoder layers (only them, not their submodules) as training, so that transformers checkpoints them;
    attention and MLP stay in eval mode (no dropout). Restores the flags on exit."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m.training = flag


def response_hidden(model, input_ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                    resp_lens: list[int], backend: str = "sdpa", **extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict the response tokens of a right-padded batch.

    Returns (hidden [B, R_max, D], target tokens [B, R_max], valid [B, R_max]); the lm head is not applied (see
    `stages.learner.logprobs.chunked_token_scores`, which applies it in token chunks). With evict_at
    ([L, B, H, T]) the shadow mask is replayed, with None the forward is dense (full causal context).
    """
    B, T = input_ids.shape
    position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
    decoder = decoder_of(model)
    if evict_at is None:
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    else:
        with attention_implementation(model, SHADOW_ATTENTION):
            hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, smd_evict_at=evict_at,
                             smd_backend=backend, **extra).last_hidden_state
    start = min(prompt_lens) - 1  # the first position whose hidden state predicts a response token
    (sel,), targets, valid = gather_response((hidden[:, start:],), input_ids, prompt_lens, resp_lens, start)
    return sel, targets, valid


def response_logits(model, input_ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                    resp_lens: list[int], backend: str = "sdpa", **extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at the response positions of a right-padded batch, without the full [B, T, V] logits.

    Returns (logits [B, R_max, V] before temperature, target tokens [B, R_max], valid [B, R_max]): the lm head
    of `response_hidden`. Holds [B, R_max, V] logits: the learner scores through `chunked_token_scores` instead.
    """
    hidden, targets, valid = response_hidden(model, input_ids, evict_at, prompt_lens, resp_lens, backend, **extra)
    return model.get_output_embeddings()(hidden), targets, valid


def gather_response(logits: tuple[torch.Tensor, ...], input_ids: torch.Tensor, prompt_lens: list[int],
                    resp_lens: list[int], start: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """From logits kept from position `start` on ([B, T - start, V] each), the response positions
    ([B, R_max, V] each), the tokens they predict [B, R_max] and which are valid [B, R_max]."""
    T = input_ids.shape[1]
    idx, valid = response_index(prompt_lens, resp_lens, offset=start, device=input_ids.device)
    targets = torch.gather(input_ids, 1, (idx + start + 1).clamp(max=T - 1))
    index = idx.unsqueeze(-1).expand(-1, -1, logits[0].shape[-1])
    return tuple(torch.gather(x, 1, index) for x in logits), targets, valid


# ------------------------------------------------------------------ shared prefix: masked policy + dense teacher
SHADOW_SUFFIX_ATTENTION = "smd_shadow_suffix"


def shadow_suffix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`smd_shadow` for the query rows [T_k - T_q, T_k) of a forward that continues a cached prefix."""
    return replay_shadow_mask(module, query, key, value, scaling, kwargs)


AttentionInterface.register(SHADOW_SUFFIX_ATTENTION, shadow_suffix_attention)


class _ReadOnlyLayer(DynamicLayer):
    """A cache layer over fixed keys and values [B, H, s, D] that a forward reads but never grows: `update`
    returns them with the new states appended and keeps nothing, so a forward over a suffix holds one layer's
    whole keys and values at a time (transformers' `DynamicLayer` keeps every layer's until the cache is freed)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def read_only_prefix_cache(prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], config) -> Cache:
    """A KV cache holding `prefix_kv` (one (keys, values) per layer) for a forward that reads it and is not
    continued: the dense teacher's pass on top of the policy's prefix (`response_hidden_with_teacher`, the shared
    prompt's runs). The keys and values the pass appends are not kept, so the teacher no longer holds every
    layer's whole-sequence keys and values (at T = 8k on Qwen3-0.6B's layer, 64 MiB a layer) beside the policy's
    pass. Models with sliding-window or other non-full layers get transformers' `DynamicCache` (which keeps them)."""
    if not full_attention_layers(config):
        return DynamicCache(prefix_kv, config=config)
    return Cache(layers=[_ReadOnlyLayer(k, v) for k, v in prefix_kv])


def full_attention_layers(config) -> bool:
    """Whether every layer of the model attends to its whole causal past (transformers' cache for it holds only
    plain `DynamicLayer`s, no sliding-window or chunked ones): what a forward reading a shared prefix assumes."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def teacher_suffix_hidden(model, suffix: torch.Tensor, positions: torch.Tensor,
                          prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The dense teacher's final hidden states of the rows `suffix` after a prefix whose keys and values are
    `prefix_kv` (one (keys, values) per layer, detached here), under no_grad, through `read_only_prefix_cache`."""
    with torch.no_grad():
        cache = read_only_prefix_cache([(k.detach(), v.detach()) for k, v in prefix_kv], model.config)
        return decoder_of(model)(input_ids=suffix, position_ids=positions, past_key_values=cache,
                                 use_cache=True).last_hidden_state


def masked_suffix_hidden(model, suffix: torch.Tensor, positions: torch.Tensor, cache: Cache, evict_at: torch.Tensor,
                         backend: str, block_size: int, prefix: int) -> torch.Tensor:
    """The shadow-masked final hidden states of the rows `suffix` continuing `cache` (the first `prefix`
    positions), on `backend` (FlexAttention's block masks built for the rows after the prefix)."""
    extra = {}
    if backend == "flex":
        from stages.learner.flex_backend import build_block_masks

        extra["smd_block_masks"] = build_block_masks(evict_at, model.config.num_attention_heads, block_size,
                                                     prefix=prefix)
    with attention_implementation(model, SHADOW_SUFFIX_ATTENTION):
        return decoder_of(model)(input_ids=suffix, position_ids=positions, past_key_values=cache, use_cache=True,
                                 smd_evict_at=evict_at, smd_backend=backend, **extra).last_hidden_state


def shared_prefix_length(evict_at: torch.Tensor, prompt_lens: list[int], align: int = 1) -> int:
    """Rows both policies compute identically: before the first eviction in any layer/row/head (right padding
    counts as one) and before the first logit the loss needs (min prompt length - 1); a multiple of `align`."""
    s = min(int(evict_at.min()), min(prompt_lens) - 1)
    return max(s // align * align, 0)


def response_hidden_with_teacher(model, input_ids: torch.Tensor, evict_at: torch.Tensor, prompt_lens: list[int],
                                 resp_lens: list[int], backend: str = "sdpa", block_size: int = 128):
    """The shadow-masked policy's final hidden states at the response positions (with gradient) and the dense
    teacher's (no gradient) in one pass over the shared prefix.

    Nothing is evicted before the first eviction position s (prefill attends densely), so rows [0, s) are the
    same for both policies: they run once (plain causal attention, with gradient) into a KV cache; then the
    rows [s, T) run twice on top of it — densely under no_grad (teacher), then shadow-masked with gradient.
    With layer checkpointing on (`enable_layer_checkpointing`) the two run as separate full forwards.
    Returns (masked hidden [B, R, D], dense hidden [B, R, D] detached, targets [B, R], valid [B, R]).
    """
    B, T = input_ids.shape
    align = block_size if backend == "flex" else 1
    s = shared_prefix_length(evict_at, prompt_lens, align)
    if layer_checkpointing_enabled(model):
        # A checkpointed layer cannot write a KV cache (its recomputation would write it again): the policy and
        # the teacher run as two full forwards, which give the same values (tests/test_shadow_attention_flex.py).
        s = 0
    if s == 0:
        with torch.no_grad():
            dense, _, _ = response_hidden(model, input_ids, None, prompt_lens, resp_lens)
        extra = {}
        if backend == "flex":
            from stages.learner.flex_backend import build_block_masks

            extra["smd_block_masks"] = build_block_masks(evict_at, model.config.num_attention_heads, block_size)
        masked, targets, valid = response_hidden(model, input_ids, evict_at, prompt_lens, resp_lens, backend, **extra)
        return masked, dense, targets, valid
    decoder = decoder_of(model)
    positions = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
    cache = DynamicCache(config=model.config)
    decoder(input_ids=input_ids[:, :s], position_ids=positions[:, :s], past_key_values=cache, use_cache=True)
    suffix, suffix_pos = input_ids[:, s:], positions[:, s:]
    dense = teacher_suffix_hidden(model, suffix, suffix_pos, [(layer.keys, layer.values) for layer in cache.layers])
    masked = masked_suffix_hidden(model, suffix, suffix_pos, cache, evict_at, backend, block_size, s)
    # hidden rows [s, T); s <= start = min(prompt_lens) - 1, the first row the loss needs
    start = min(prompt_lens) - 1
    (masked, dense), targets, valid = gather_response((masked[:, start - s:], dense[:, start - s:]), input_ids,
                                                      prompt_lens, resp_lens, start)
    return masked, dense, targets, valid


def response_logits_with_teacher(model, input_ids: torch.Tensor, evict_at: torch.Tensor, prompt_lens: list[int],
                                 resp_lens: list[int], backend: str = "sdpa", block_size: int = 128):
    """`response_hidden_with_teacher` through the lm head: (masked logits [B, R, V], dense logits [B, R, V]
    detached, targets [B, R], valid [B, R]). Holds [B, R, V] logits twice (benches and tests)."""
    masked, dense, targets, valid = response_hidden_with_teacher(model, input_ids, evict_at, prompt_lens, resp_lens,
                                                                 backend, block_size)
    head = model.get_output_embeddings()
    with torch.no_grad():
        dense_logits = head(dense)
    return head(masked), dense_logits, targets, valid
