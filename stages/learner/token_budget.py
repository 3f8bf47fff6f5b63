"""Token-budget micro-batches and token-balanced processes (`learner.micro_batch_tokens`; docs/design.md §3d).

Pure functions over token counts; `stages.learner.train` maps them onto the batch's rows.

- `padded_tokens`: the cost a budget bounds. The learner right-pads a micro-batch to its longest row, so every
  per-row tensor it builds (ids, evict_at [L, B, H, T], the per-sample forward's activations) holds rows x the
  longest row's prompt + response tokens, whatever the real tokens are: the padded count bounds memory, the real
  one does not.
- `budget_micro_batches`: consecutive items (a row, or a whole GRPO group under `learner.shared_prompt`), longest
  first, cut into micro-batches whose padded tokens stay within the budget (next fit: a micro-batch closes when
  the next item would cross it); with `learner.pack` their packed (real) tokens, `packed_tokens`. verl (`rearrange_micro_batches`) balances packed micro-batches with
  Karmarkar-Karp instead; smd pads, so sorting by length and cutting is what keeps the padding low, and the
  budget is a hard cap.
- `karmarkar_karp`: the largest differencing method (Karmarkar & Karp 1982; its k-way form as verl's
  `verl/utils/seqlen_balancing.py` `karmarkar_karp` / `get_seqlen_balanced_partitions`, equal_size false), which
  splits the rows (or groups) among processes by tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from schemas.errors import SmdInputError

FIELD = "learner.micro_batch_tokens"


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens of a right-padded micro-batch of rows of `lengths` (prompt + response each): rows x the longest."""
    return len(lengths) * max(lengths, default=0)


def packed_tokens(lengths: Sequence[int]) -> int:
    """Tokens of a packed micro-batch (`learner.pack`: the rows one after another in one row): their sum."""
    return sum(lengths)


def budget_micro_batches(item_lengths: Sequence[Sequence[int]], budget: int, item: str = "a row",
                         packed: bool = False) -> list[list[int]]:
    """Indices of consecutive items per micro-batch: each item (the row lengths of a row or of a whole group, never
    split) joins the open micro-batch while the micro-batch's `padded_tokens` (`packed`: `packed_tokens`, the
    learner.pack micro-batch's real tokens) stays <= `budget`, else opens the next. Items sorted longest first give
    the least padding. One line naming `learner.micro_batch_tokens` when an item alone exceeds the budget (`item`
    names what an item is)."""
    if budget < 1:
        raise SmdInputError(f"{FIELD}={budget}: a token budget must be >= 1 (null or 0 turns it off)")
    cost = packed_tokens if packed else padded_tokens
    costs = [cost(lengths) for lengths in item_lengths]
    if costs and max(costs) > budget:
        worst = max(range(len(costs)), key=costs.__getitem__)
        n, longest = len(item_lengths[worst]), max(item_lengths[worst])
        what = f"{costs[worst]} tokens (packed)" if packed else f"{costs[worst]} padded tokens ({n} rows x {longest})"
        raise SmdInputError(f"{FIELD}={budget}: {item} needs {what}; set it to at least {costs[worst]}")
    out: list[list[int]] = []
    current: list[int] = []
    rows = longest = total = 0
    for i, lengths in enumerate(item_lengths):
        grown_rows, grown_longest = rows + len(lengths), max(longest, max(lengths, default=0))
        grown_total = total + sum(lengths)
        if current and (grown_total if packed else grown_rows * grown_longest) > budget:
            out.append(current)
            current, grown_rows, grown_longest, grown_total = [], len(lengths), max(lengths, default=0), sum(lengths)
        current.append(i)
        rows, longest, total = grown_rows, grown_longest, grown_total
    if current:
        out.append(current)
    return out


def karmarkar_karp(weights: Sequence[int], parts: int) -> list[list[int]]:
    """`parts` lists of indices of `weights` whose sums are balanced by the largest differencing method: every
    weight starts as a state of `parts` sets (itself, then empty ones); the two states of largest spread (largest
    set sum - smallest) merge, the largest set of one with the smallest of the other, until one state is left.
    Ties: the larger top set first, then the earlier state. Parts in decreasing sum, indices ascending in each;
    deterministic (every process computes the same split). Parts may be empty when there are fewer weights."""
    if parts < 1:
        raise ValueError(f"karmarkar_karp: parts must be >= 1, got {parts}")
    heap: list[tuple[int, int, int, list[tuple[int, list[int]]]]] = []
    order = 0
    # as verl: states pushed in increasing weight (ties by index)
    for index in sorted(range(len(weights)), key=lambda i: (weights[i], i)):
        sets = [(int(weights[index]), [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), -sets[0][0], order, sets))
        order += 1
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        merged = [(first[j][0] + second[parts - 1 - j][0], first[j][1] + second[parts - 1 - j][1])
                  for j in range(parts)]
        merged.sort(key=lambda s: (-s[0], min(s[1], default=-1)))  # disjoint sets: a deterministic order
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), -merged[0][0], order, merged))
        order += 1
    return [sorted(items) for _, items in heap[0][3]]
