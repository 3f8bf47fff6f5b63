"""Which response tokens smd's dense-teacher KL applies to (`learner.kl_tokens`; issue 22 item 5).

- `all`:    every valid response token (the SMD paper; the default).
- `no_eos`: every valid response token but EOS (the tokenizer's `eos_token_id`: the token the rollout stops at,
            the last token of a finished response).
- `keyed`:  the valid response tokens that have an induction key in the prompt (`induction_keys`) for the sampled
            token or for the dense teacher's most likely token at that position (the `classes_needed` rule of
            `smdctl probe-kl`: a wrong hop samples a token with no key, the teacher's token has one, the fact the
            right answer needed).

The probe (stages/tools/kl_probe.py) measured on pointer_chasing that the KL's gradient on the tokens without a
key (EOS, separators, wrong hops) is anti-aligned with the gradient of the dense policy's held-out reference NLL,
and increasingly so over iterations, while the keyed tokens' part is near-orthogonal to it.

Pure host-side functions (numpy / torch on the CPU); the learner moves the mask to its device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from schemas.errors import SmdInputError
from schemas.params.learner import KL_TOKENS


def _bigram_positions(prompt: Sequence[int]) -> dict[tuple[int, int], list[int]]:
    """(prompt[k-1], prompt[k]) -> every k >= 1 where the pair occurs."""
    where: dict[tuple[int, int], list[int]] = {}
    for k in range(1, len(prompt)):
        where.setdefault((int(prompt[k - 1]), int(prompt[k])), []).append(k)
    return where


def _keys(where: dict[tuple[int, int], list[int]], last: int | None, response: list[int],
          wanted: list[int]) -> np.ndarray:
    out = np.full(len(response), -1, dtype=np.int64)
    for t, tok in enumerate(wanted):
        prev = response[t - 1] if t > 0 else last
        found = where.get((prev, tok), []) if prev is not None else []
        if len(found) == 1:
            out[t] = found[0]
    return out


def induction_keys(prompt: Sequence[int], response: Sequence[int], targets: Sequence[int] | None = None) -> np.ndarray:
    """Per response token t, the prompt position k with prompt[k] == response[t] (or `targets[t]`, another
    token at that position: the dense teacher's choice) and prompt[k-1] == the token before t (response[t-1], or
    the prompt's last token for t = 0): int64 [R], -1 where there is no such k or more than one."""
    prompt, response = [int(x) for x in prompt], [int(x) for x in response]
    wanted = response if targets is None else [int(x) for x in targets[: len(response)]]
    return _keys(_bigram_positions(prompt), prompt[-1] if prompt else None, response, wanted)


def keyed_tokens(prompt: Sequence[int], response: Sequence[int], teacher_argmax: Sequence[int]) -> np.ndarray:
    """bool [R]: response token t has an induction key for the sampled token or for `teacher_argmax[t]`."""
    prompt, response = [int(x) for x in prompt], [int(x) for x in response]
    where, last = _bigram_positions(prompt), (prompt[-1] if prompt else None)
    sampled = _keys(where, last, response, response)
    teacher = _keys(where, last, response, [int(x) for x in teacher_argmax[: len(response)]])
    return (sampled >= 0) | (teacher >= 0)


def kl_token_mask(kind: str, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], width: int, *,
                  eos_token_id: int | None = None, teacher_argmax: torch.Tensor | np.ndarray | None = None,
                  ) -> torch.Tensor:
    """bool [B, width] on the host: the response tokens (right-padded to `width`, False at padding) the KL applies
    to under `kind` (`learner.kl_tokens`). no_eos needs `eos_token_id`; keyed needs `teacher_argmax` [B, >= R_b]
    (the dense teacher's most likely token per response position, `chunked_token_scores`' teacher_argmax)."""
    if kind not in KL_TOKENS:
        raise SmdInputError(f"unknown learner.kl_tokens {kind!r}; choose one of {', '.join(KL_TOKENS)}")
    if len(prompts) != len(responses):
        raise SmdInputError(f"kl_token_mask: {len(prompts)} prompts for {len(responses)} responses")
    out = torch.zeros(len(responses), width, dtype=torch.bool)
    if kind == "no_eos" and eos_token_id is None:
        raise SmdInputError("learner.kl_tokens=no_eos: the tokenizer has no eos_token_id")
    if kind == "keyed":
        if teacher_argmax is None:
            raise SmdInputError("learner.kl_tokens=keyed needs the dense teacher's argmax tokens")
        argmax = np.asarray(teacher_argmax.cpu() if isinstance(teacher_argmax, torch.Tensor) else teacher_argmax)
    for b, response in enumerate(responses):
        n = len(response)
        if n > width:
            raise SmdInputError(f"kl_token_mask: response {b} has {n} tokens, more than the width {width}")
        if kind == "all":
            row = np.ones(n, dtype=bool)
        elif kind == "no_eos":
            row = np.asarray([int(x) != eos_token_id for x in response], dtype=bool)
        else:
            row = keyed_tokens(prompts[b], response, argmax[b])
        out[b, :n] = torch.from_numpy(row.reshape(n))
    return out
