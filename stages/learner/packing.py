"""Packed rows (`learner.pack`; docs/design.md §3e, issue 55): a micro-batch's rows concatenated into one row.

The padded learner right-pads a micro-batch to its longest row: a batch whose response lengths vary 4x forwards
up to twice its real tokens. Packed, the rows [prompt_b + response_b] sit one after another in a single row of
N = sum of their lengths (batch 1, no padding), row b at packed positions [s_b, e_b); position ids restart at 0 in
every row, so RoPE rotates each token as in its own row.

The attention mask is "same row AND shadow-visible", and it is itself a shadow mask: key k of row b carries
`min(evict_at_b[k - s_b] + s_b, e_b)` (`packed_evict_at`). Query q sees key k iff k <= q and evict_at[k] > q
(`schemas.raw_masks.visibility`): a key of row b is hidden from every query of a later row (those start at
e_b), causality hides later rows' keys from earlier ones, and inside a row the shifted mask is the row's own. So
every backend replays it unchanged: sdpa's explicit mask, the tiled backend's per-tile key lists (a tile gathers
only keys with evict_at > its first query: the earlier rows' keys drop out) and FlexAttention's block mask (a key
block whose largest evict_at is at or before a query block's start is empty: cross-row blocks are skipped).
A dense pass of a packed row (the dense objectives, smd's dense teacher, a frozen or EMA teacher model) is not
unmasked either: every key of row b carries e_b (`dense_packed_evict_at`), the block-diagonal causal mask,
through the same shadow attention. The response positions are gathered back into the padded learner's
[B, R_max] layout (`packed_response_index`), so the scoring, the objective and its normalisation see the same
tensors as without packing: the loss and every gradient are the padded learner's (float64 tests to 1e-10,
tests/test_packing.py).

What packing does not do: share a GRPO group's prompt (`learner.shared_prompt`). A prompt key's `evict_at`
differs per sample of its group, so the group's responses cannot read one copy of it under a single `evict_at`
vector (a key's visibility must be one interval of the packed queries); `learner.pack: true` needs
`learner.shared_prompt: false` (validated by `LearnerParams`). Nor does the dense teacher share the rows before
the first eviction with the masked pass as the padded path does (`response_hidden_with_teacher`): those rows are
per row, not one prefix of the packed row, so the teacher runs the whole packed row.

Anchors: verl's `use_remove_padding` (flash-attn varlen over packed rows, position ids restarting per sequence),
OpenRLHF's `--ds.packing_samples`, Hugging Face's `DataCollatorWithFlattening` (packed rows with restarting
position ids; transformers derives the block-diagonal mask from them). None of them replays an eviction mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.common.model import attention_implementation
from stages.learner.shadow_attention import SHADOW_ATTENTION, decoder_of, response_index


def row_starts(lengths: Sequence[int]) -> list[int]:
    """Packed start s_b of each row of `lengths` tokens (prompt + response), rows one after another."""
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += int(n)
    return out


def packed_position_ids(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, N] position ids restarting at 0 in every row: row b's token t has position t."""
    return torch.cat([torch.arange(int(n), dtype=torch.long, device=device) for n in lengths]).view(1, -1)


def pack_ids(seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """[1, N] token ids of the rows `seqs` one after another, on the host (the caller copies them once)."""
    return torch.tensor([t for s in seqs for t in s], dtype=torch.long, device="cpu").view(1, -1)


def packed_evict_at(rows: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Per-row evict_at [T_b, L, H] (row-local positions, k < evict_at[k] <= T_b) -> the packed row's [L, 1, H, N]:
    row b's key k at s_b + k carries min(evict_at[k] + s_b, e_b), e_b = s_b + T_b, so that query q sees key k iff
    both are in one row and the row's shadow mask shows k to q (module docstring). The min is the row's end for a
    mask whose sentinel is past it (none from the store: its sentinel is T_b)."""
    lengths = [int(r.shape[0]) for r in rows]
    if device is None:
        device = rows[0].device if isinstance(rows[0], torch.Tensor) else torch.device("cpu")
    parts = []
    for s, n, r in zip(row_starts(lengths), lengths, rows):
        ev = torch.as_tensor(r, dtype=torch.int64, device=device).permute(1, 2, 0)  # [L, H, T_b]
        parts.append((ev + s).clamp(max=s + n))
    return torch.cat(parts, dim=-1).unsqueeze(1)


def dense_packed_evict_at(lengths: Sequence[int], num_layers: int, num_kv_heads: int,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """[L, 1, H, N] of a dense pass over the packed row: every key of row b carries e_b (the block-diagonal causal
    mask: a row's keys stay visible to all its later queries and to no other row's)."""
    ends = [s + int(n) for s, n in zip(row_starts(lengths), lengths)]
    per_key = torch.cat([torch.full((int(n),), e, dtype=torch.int64, device=device) for n, e in zip(lengths, ends)])
    return per_key.view(1, 1, 1, -1).expand(num_layers, 1, num_kv_heads, -1).contiguous()


def packed_response_index(prompt_lens: Sequence[int], resp_lens: Sequence[int], offset: int = 0,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed positions [B, R_max] whose outputs predict each response token (s_b + P_b - 1 + t, minus `offset`;
    0 where invalid) and validity [B, R_max]: `response_index` with each row's prompt ending at s_b + P_b."""
    starts = row_starts([p + r for p, r in zip(prompt_lens, resp_lens)])
    return response_index([s + p for s, p in zip(starts, prompt_lens)], list(resp_lens), offset, device)


def gather_packed(hidden: tuple[torch.Tensor, ...], input_ids: torch.Tensor, prompt_lens: Sequence[int],
                  resp_lens: Sequence[int], offset: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor,
                                                                      torch.Tensor]:
    """From outputs [1, N - offset, D] of the packed row's positions [offset, N), the response positions in the
    padded learner's layout ([B, R_max, D] each), the tokens they predict [B, R_max] and validity [B, R_max].
    `index_select` on the one row: its backward scatters into [N, D], not into B copies of the row."""
    N = input_ids.shape[1]
    idx, valid = packed_response_index(prompt_lens, resp_lens, offset, input_ids.device)
    B, R = idx.shape
    flat = idx.reshape(-1)
    targets = input_ids[0].index_select(0, (flat + offset + 1).clamp(max=N - 1)).view(B, R)
    out = tuple(h[0].index_select(0, flat).view(B, R, h.shape[-1]) for h in hidden)
    return out, targets, valid


def _packed_forward(model, input_ids: torch.Tensor, evict_at: torch.Tensor, lengths: list[int], backend: str,
                    block_size: int, extra: dict) -> torch.Tensor:
    """Final hidden states [1, N, D] of the packed row under `evict_at` [L, 1, H, N] (the shadow attention on
    `backend`; FlexAttention's block masks from `extra`, else built here)."""
    if input_ids.shape != (1, sum(lengths)):
        raise ValueError(f"packed ids {tuple(input_ids.shape)} do not hold rows of {sum(lengths)} tokens in all")
    if backend == "flex" and "smd_block_masks" not in extra:
        from stages.learner.flex_backend import build_block_masks

        extra = {"smd_block_masks": build_block_masks(evict_at, model.config.num_attention_heads, block_size)}
    positions = packed_position_ids(lengths, input_ids.device)
    with attention_implementation(model, SHADOW_ATTENTION):
        return decoder_of(model)(input_ids=input_ids, position_ids=positions, use_cache=False, smd_evict_at=evict_at,
                                 smd_backend=backend, **extra).last_hidden_state


def packed_hidden(model, input_ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                  resp_lens: list[int], backend: str = "sdpa", block_size: int = 128,
                  **extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`response_hidden` of a packed micro-batch: input_ids [1, N] (the rows one after another), evict_at
    [L, 1, H, N] from `packed_evict_at` (None: the dense pass, under `dense_packed_evict_at`) -> (hidden
    [B, R_max, D], targets [B, R_max], valid [B, R_max]), the padded learner's layout."""
    lengths = [p + r for p, r in zip(prompt_lens, resp_lens)]
    if evict_at is None:
        cfg = model.config
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        evict_at = dense_packed_evict_at(lengths, cfg.num_hidden_layers, num_kv, input_ids.device)
        extra = {}  # a masked pass's block masks are not the dense pass's
    hidden = _packed_forward(model, input_ids, evict_at, lengths, backend, block_size, extra)
    (sel,), targets, valid = gather_packed((hidden,), input_ids, prompt_lens, resp_lens)
    return sel, targets, valid


def packed_hidden_with_teacher(model, input_ids: torch.Tensor, evict_at: torch.Tensor, prompt_lens: list[int],
                               resp_lens: list[int], backend: str = "sdpa", block_size: int = 128):
    """`response_hidden_with_teacher` of a packed micro-batch: (the shadow-masked policy's hidden [B, R, D] with
    gradient, the dense teacher's [B, R, D] detached, targets, valid). The teacher runs the whole packed row under
    the block-diagonal causal mask, under no_grad (module docstring: the rows before each row's first eviction are
    not one prefix of the packed row, so they are not shared with the masked pass)."""
    with torch.no_grad():
        dense, _, _ = packed_hidden(model, input_ids, None, prompt_lens, resp_lens, backend, block_size)
    masked, targets, valid = packed_hidden(model, input_ids, evict_at, prompt_lens, resp_lens, backend, block_size)
    return masked, dense, targets, valid
