"""A group's prompt, computed once in the learner (docs/design.md §3c, "Shared prompts").

GRPO samples G responses per prompt; the per-sample learner forwards every sample's prompt again. A shadow mask
never restricts a prompt token's queries (eviction starts after the prefill: every prompt key has
evict_at >= P), so a prompt's hidden states, keys and values are the same in every sample of its group, in the
shadow-masked pass and in the dense teacher's pass. Here each run of micro-batch rows with the same prompt
(a group, or part of one) forwards that prompt once, batch 1, into a KV cache with gradient, and the G
responses run on top of it, each under its own shadow mask (or densely). On the tiled backend every row's
attention reads the prompt's one copy of its keys and values in place (`smd_prefix`); on the others the cache is
expanded (a view) to the run's G rows and concatenated with the responses' keys per row. Autograd sums the G
rows' gradients into the one prompt forward, so the prompt's gradient accumulates once and equals the sum of the
per-sample computation's (float64 tests to 1e-10, tests/test_shared_prompt.py).

The suffix starts at the prompt's last token (s = P - 1, the first position whose output predicts a response
token) or earlier where a mask evicts inside the prompt, and for FlexAttention at a multiple of its block size
(its block masks start at a block boundary); the rows [s, P) then run per sample, as few as the block size.

Anchors: Prefix Grouper (arXiv 2506.05433: the shared prefix forwarded once, exact, in verl), Unsloth's
shared-prefix FlexAttention path (P + G R tokens instead of G (P + R)); neither replays eviction masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from stages.common.model import attention_implementation
from stages.learner.shadow_attention import (
    SHADOW_SUFFIX_ATTENTION,
    decoder_of,
    full_attention_layers,
    gather_response,
    layer_checkpointing_enabled,
    masked_suffix_hidden,
    read_only_prefix_cache,
    response_hidden,
    response_hidden_with_teacher,
    teacher_suffix_hidden,
)


def prompt_runs(input_ids: torch.Tensor, prompt_lens: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive rows of a right-padded batch that have the same prompt tokens
    (rows of one GRPO group are adjacent in the learner's micro-batches); a prompt seen again after another
    starts a new run."""
    runs: list[tuple[int, int]] = []
    start = 0
    for b in range(1, len(prompt_lens) + 1):
        if b == len(prompt_lens) or prompt_lens[b] != prompt_lens[start] or not torch.equal(
                input_ids[b, : prompt_lens[b]], input_ids[start, : prompt_lens[start]]):
            runs.append((start, b))
            start = b
    return runs


def shared_prefix_rows(prompt_len: int, evict_at: torch.Tensor | None, align: int = 1) -> int:
    """Rows [0, s) that every sample of a run computes identically and that no loss position needs: before the
    prompt's last token (s <= P - 1) and before any eviction of the run's masks ([L, G, H, T]: a key evicted at
    q hides it from query q on, so rows before min(evict_at) see their whole causal prefix); a multiple of
    `align` (FlexAttention's block size)."""
    s = prompt_len - 1
    if evict_at is not None:
        s = min(s, int(evict_at.min()))
    return max(s // align * align, 0)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[G, R_run, ...] -> [G, rows, ...] zero-padded along dim 1."""
    extra = rows - x.shape[1]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, extra]
    return F.pad(x, pad)


def _per_sample_hidden(model, ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                       resp_lens: list[int], backend: str, block_size: int, teacher: bool):
    """The per-sample forward in `shared_prompt_hidden`'s return shape (policy hidden, teacher hidden or None,
    targets, valid), for the cases that share nothing."""
    if teacher:
        return response_hidden_with_teacher(model, ids, evict_at, prompt_lens, resp_lens, backend, block_size)
    extra = {}
    if evict_at is not None and backend == "flex":
        from stages.learner.flex_backend import build_block_masks

        extra["smd_block_masks"] = build_block_masks(evict_at, model.config.num_attention_heads, block_size)
    hidden, targets, valid = response_hidden(model, ids, evict_at, prompt_lens, resp_lens, backend, **extra)
    return hidden, None, targets, valid


def _run_hidden(model, ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_len: int, resp_lens: list[int],
                backend: str, block_size: int, teacher: bool):
    """One run (rows sharing a prompt): (policy hidden [G, R_run, D], dense teacher hidden or None, targets,
    valid). Masked when `evict_at` ([L, G, H, T_run]) is given, dense otherwise; `teacher`: also the dense pass
    of the same weights under no_grad (smd's teacher), on the same prompt cache."""
    G, T = ids.shape
    prompt_lens = [prompt_len] * G
    align = block_size if evict_at is not None and backend == "flex" else 1
    s = shared_prefix_rows(prompt_len, evict_at, align)
    if s == 0:  # nothing to share (a one-token prompt, or flex with a prompt shorter than a block)
        return _per_sample_hidden(model, ids, evict_at, prompt_lens, resp_lens, backend, block_size, teacher)
    decoder = decoder_of(model)
    device = ids.device
    cache = DynamicCache(config=model.config)
    decoder(input_ids=ids[:1, :s], position_ids=torch.arange(s, device=device).unsqueeze(0), past_key_values=cache,
            use_cache=True)
    suffix = ids[:, s:]
    suffix_pos = torch.arange(s, T, device=device).unsqueeze(0).expand(G, T - s)
    if backend == "tiled" and full_attention_layers(model.config):
        # the G rows read the prompt's one copy of its keys and values (the tiled backend's shared prefix)
        prefix = [(layer.keys, layer.values) for layer in cache.layers]
        hidden, dense = _prefix_passes(model, suffix, suffix_pos, prefix, [0] * G, evict_at, teacher)
    else:
        hidden, dense = _expanded_cache_passes(model, suffix, suffix_pos, cache, evict_at, backend, block_size, s,
                                               teacher)
    start = prompt_len - 1  # hidden row start - s predicts the first response token
    kept = (hidden[:, start - s:],) if dense is None else (hidden[:, start - s:], dense[:, start - s:])
    gathered, targets, valid = gather_response(kept, ids, prompt_lens, resp_lens, start)
    return gathered[0], (gathered[1] if dense is not None else None), targets, valid


def _expanded_cache_passes(model, suffix: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                           evict_at: torch.Tensor | None, backend: str, block_size: int, s: int, teacher: bool):
    """`_prefix_passes` for the sdpa and flex backends: the one prompt cache expanded (a view; its gradient sums)
    to the suffix's G rows, each row's layer concatenating it with its own keys and values."""
    G = suffix.shape[0]
    prompt_kv = [(layer.keys.expand(G, -1, -1, -1), layer.values.expand(G, -1, -1, -1)) for layer in cache.layers]
    dense = teacher_suffix_hidden(model, suffix, positions, prompt_kv) if teacher else None
    run_cache = DynamicCache(prompt_kv, config=model.config)
    if evict_at is None:
        return decoder_of(model)(input_ids=suffix, position_ids=positions, past_key_values=run_cache,
                                 use_cache=True).last_hidden_state, dense
    return masked_suffix_hidden(model, suffix, positions, run_cache, evict_at, backend, block_size, s), dense


def _prefix_passes(model, suffix: torch.Tensor, positions: torch.Tensor,
                   prefix: list[tuple[torch.Tensor, torch.Tensor]], prefix_rows: list[int],
                   evict_at: torch.Tensor | None, teacher: bool,
                   dense_ev: torch.Tensor | None = None):
    """The suffix rows [B, W] on top of shared prompt caches that they read in place (`prefix`: per layer keys and
    values [R, H, S, D], row b reading prefix `prefix_rows[b]`; the tiled backend), shadow-masked by `evict_at`
    ([L, B, H, S + W]) or densely when None, and with `teacher` also the dense pass under no_grad. The dense
    passes see the keys through `dense_ev` (default: every key visible to every later query).
    Returns (hidden [B, W, D], dense teacher hidden or None)."""
    B, W = suffix.shape
    if dense_ev is None and (teacher or evict_at is None):
        L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
        T = prefix[0][0].shape[2] + W
        dense_ev = torch.full((L, B, H, T), T + 1, dtype=torch.long, device=suffix.device)
    decoder = decoder_of(model)

    def run(kv, ev):
        with attention_implementation(model, SHADOW_SUFFIX_ATTENTION):
            return decoder(input_ids=suffix, position_ids=positions, use_cache=False, smd_evict_at=ev,
                           smd_backend="tiled", smd_prefix=kv, smd_prefix_rows=prefix_rows).last_hidden_state

    dense = None
    if teacher:
        with torch.no_grad():
            dense = run([(k.detach(), v.detach()) for k, v in prefix], dense_ev)
    return run(prefix, dense_ev if evict_at is None else evict_at), dense


def suffix_evict_at(evict_at: torch.Tensor | None, starts: list[int], frame: int, width: int,
                    num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """`evict_at` of a batch of runs in the frame of `_runs_batched_hidden`'s KV cache ([L, B, H, frame + width]).

    Row b's token t sits at cache index t while t < starts[b] (its run's prompt cache, right-padded to `frame`)
    and at t + frame - starts[b] from there on (its suffix, after the frame). The map is increasing, so causality
    holds in the cache's index order, and an eviction position (a query token, >= starts[b] by `shared_prefix_rows`)
    moves with its query. The frame's padding keys [starts[b], frame) get c + 1 (seen only by a query at their
    own index, which no row has): hidden. `evict_at` None (a dense pass): every real key stays visible."""
    B, total = len(starts), frame + width
    device = evict_at.device if evict_at is not None else torch.device("cpu")
    start = torch.tensor(starts, dtype=torch.long, device=device).view(B, 1)
    col = torch.arange(total, dtype=torch.long, device=device).view(1, total)
    in_prompt = col < start
    in_suffix = col >= frame
    # the token each cache index holds (0 for the frame's padding, whose value is replaced below)
    token = torch.where(in_prompt, col, torch.where(in_suffix, col - frame + start, torch.zeros_like(col)))
    shift = (frame - start).view(1, B, 1, 1)
    if evict_at is None:
        ev = torch.full((num_layers, B, num_kv_heads, total), 2 * total + 1, dtype=torch.long, device=device)
    else:
        T = evict_at.shape[-1]
        index = token.clamp(max=T - 1).view(1, B, 1, total).expand(evict_at.shape[0], B, evict_at.shape[2], total)
        ev = torch.gather(evict_at.to(torch.long), 3, index) + shift
        # suffix columns past the batch's tokens (a run's suffix shorter than the widest): padding
        past = (token >= T) & in_suffix
        ev = torch.where(past.view(1, B, 1, total), col.view(1, 1, 1, total) + 1, ev)
    pad = (~in_prompt & ~in_suffix).view(1, B, 1, total)
    return torch.where(pad, col.view(1, 1, 1, total) + 1, ev)


def _runs_batched_hidden(model, ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                         resp_lens: list[int], runs: list[tuple[int, int]], starts: list[int], backend: str,
                         teacher: bool):
    """Several runs of one micro-batch in two calls: their prompts' shared rows [0, s_run) as one right-padded
    batch (one row per run, plain causal attention), then every row's suffix [s_run, T_row) as one batch on top of
    its run's prompt cache (gathered per row: autograd sums a run's rows into its one prompt forward). The suffix
    pass sees the cache through `suffix_evict_at` (the frame's padding hidden, the shadow mask moved with it), under
    the shadow-suffix attention on the micro-batch's backend for every pass, the dense ones included (their frame
    view is a mask too; the tiled backend runs its fully visible columns without one, issue 55). The weight
    products then see all the runs' rows at once, not one group's (docs/design.md §3c). Returns as
    `_run_hidden`, for the whole batch."""
    decoder = decoder_of(model)
    device = ids.device
    B = ids.shape[0]
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    frame = max(starts[a] for a, _ in runs)
    run_of_row = torch.tensor([i for i, (a, e) in enumerate(runs) for _ in range(a, e)], device=device)
    row_starts = [starts[a] for a, e in runs for _ in range(a, e)]
    heads = torch.stack([ids[a, :frame] for a, _ in runs])  # right-padded past each run's s by its own tokens
    cache = DynamicCache(config=model.config)
    decoder(input_ids=heads, position_ids=torch.arange(frame, device=device).unsqueeze(0).expand(len(runs), frame),
            past_key_values=cache, use_cache=True)
    ends = [prompt_lens[b] + max(resp_lens[b], 1) for b in range(B)]
    width = max(min(ends[b], ids.shape[1]) - row_starts[b] for b in range(B))
    # row b's suffix tokens [s_b, s_b + width) and their positions (past the row's end: its own padding tokens)
    cols = torch.tensor(row_starts, device=device).view(B, 1) + torch.arange(width, device=device).view(1, width)
    suffix = torch.gather(ids, 1, cols.clamp(max=ids.shape[1] - 1))
    # the dense passes' view of the frame (smd's teacher, the dense objectives): every real key visible
    dense_ev = suffix_evict_at(None, row_starts, frame, width, L, H).to(device) if teacher or evict_at is None else None
    ev = dense_ev if evict_at is None else suffix_evict_at(evict_at, row_starts, frame, width, L, H)
    # in the suffix's own coordinates row b's prompt ends at P_b - s_b (its suffix holds its tokens from s_b on)
    suffix_prompts = [prompt_lens[b] - row_starts[b] for b in range(B)]
    if backend == "tiled" and full_attention_layers(model.config):
        # every row reads its run's one copy of the prompt's keys and values (the tiled backend's shared prefix)
        prefix = [(layer.keys, layer.values) for layer in cache.layers]
        hidden, dense = _prefix_passes(model, suffix, cols, prefix, run_of_row.tolist(), ev, teacher, dense_ev)
    else:  # the prompt cache gathered per row (index_select: autograd sums a run's rows into its one forward)
        prompt_kv = [(layer.keys.index_select(0, run_of_row), layer.values.index_select(0, run_of_row))
                     for layer in cache.layers]
        dense = None
        if teacher:
            with torch.no_grad():
                teacher_cache = read_only_prefix_cache([(k.detach(), v.detach()) for k, v in prompt_kv],
                                                       model.config)
                with attention_implementation(model, SHADOW_SUFFIX_ATTENTION):
                    dense = decoder(input_ids=suffix, position_ids=cols, past_key_values=teacher_cache,
                                    use_cache=True, smd_evict_at=dense_ev, smd_backend=backend).last_hidden_state
        run_cache = DynamicCache(prompt_kv, config=model.config)
        with attention_implementation(model, SHADOW_SUFFIX_ATTENTION):
            hidden = decoder(input_ids=suffix, position_ids=cols, past_key_values=run_cache, use_cache=True,
                             smd_evict_at=ev, smd_backend=backend).last_hidden_state
    kept = (hidden,) if dense is None else (hidden, dense)
    gathered, targets, valid = gather_response(kept, suffix, suffix_prompts, resp_lens, 0)
    return gathered[0], (gathered[1] if dense is not None else None), targets, valid


def shared_prompt_hidden(model, input_ids: torch.Tensor, evict_at: torch.Tensor | None, prompt_lens: list[int],
                         resp_lens: list[int], backend: str = "sdpa", block_size: int = 128,
                         teacher: bool = False, batch_runs: bool = True,
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`response_hidden` (teacher False) / `response_hidden_with_teacher` (teacher True) of a right-padded
    micro-batch, each run of rows with the same prompt forwarding that prompt once (module docstring).

    input_ids [B, T], evict_at [L, B, H, T] (None: the dense forward) -> (policy hidden [B, R, D], the dense
    teacher's hidden [B, R, D] detached or None, targets [B, R], valid [B, R]), R = max(resp_lens). With several
    runs (a micro-batch of several groups) and `batch_runs`, all their prompts go in one call and all their
    suffixes in another (`_runs_batched_hidden`; sdpa and tiled: FlexAttention's block masks start at a block
    boundary, so flex runs a run at a time). With layer checkpointing on the per-sample forwards run instead (a
    checkpointed layer cannot write the prompt's cache: its recomputation would write it again)."""
    if layer_checkpointing_enabled(model):
        return _per_sample_hidden(model, input_ids, evict_at, prompt_lens, resp_lens, backend, block_size, teacher)
    R = max(max(resp_lens), 1)
    # each run's rows [a, e), its tokens [0, T_run) and its masks
    runs = []
    for a, e in prompt_runs(input_ids, prompt_lens):
        T_run = min(prompt_lens[a] + max(max(resp_lens[a:e]), 1), input_ids.shape[1])
        runs.append((a, e, T_run, evict_at[:, a:e, :, :T_run] if evict_at is not None else None))
    if batch_runs and len(runs) > 1 and backend != "flex":
        starts = [0] * len(prompt_lens)
        for a, e, _, ev in runs:
            starts[a:e] = [shared_prefix_rows(prompt_lens[a], ev)] * (e - a)
        if min(starts[a] for a, *_ in runs) > 0:
            hidden, dense, targets, valid = _runs_batched_hidden(model, input_ids, evict_at, prompt_lens, resp_lens,
                                                                 [(a, e) for a, e, *_ in runs], starts, backend,
                                                                 teacher)
            return _pad_rows(hidden, R), None if dense is None else _pad_rows(dense, R), _pad_rows(
                targets, R), _pad_rows(valid, R)
    parts = []
    for a, e, T_run, ev in runs:
        parts.append(_run_hidden(model, input_ids[a:e, :T_run], ev, prompt_lens[a], resp_lens[a:e], backend,
                                 block_size, teacher))
    hidden = torch.cat([_pad_rows(p[0], R) for p in parts])
    dense = torch.cat([_pad_rows(p[1], R) for p in parts]) if teacher else None
    targets = torch.cat([_pad_rows(p[2], R) for p in parts])
    valid = torch.cat([_pad_rows(p[3], R) for p in parts])
    return hidden, dense, targets, valid
