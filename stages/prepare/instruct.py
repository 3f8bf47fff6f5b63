"""Seeded synthetic tasks phrased for pretrained instruct (chat) models.

The tasks of `stages.prepare.synthetic` are written in the tiny word-level vocabulary (`key bear 70 bear .`,
`answer :`) for a model trained from scratch; a pretrained chat model answers them in prose. These tasks ask the
same thing the way such a model was tuned to be asked: an instruction, natural sentences, a question and an answer
format it can follow. Prompts are rendered through the policy's chat template by `prepare` (prepare.chat_template),
and the response target is the template's assistant turn (`stages.common.model.response_ids` with `chat`).

- fact_recall: `num_pairs` facts "The owl has number 42." spread over everyday filler sentences up to
  `context_tokens`; the question asks for `num_queries` of the numbers: "What number does the owl have? Answer
  with the number only." -> "42" (or "What numbers do the owl and the fox have? Answer with the 2 numbers only,
  in that order, separated by commas." -> "42, 17"). Scored like kv_retrieval (schemas.rewards `kv_fraction`:
  the fraction of asked numbers given at their position). Animal names never occur in filler, so the fact is
  the only place that links an animal to its number; a KV cache that evicts it costs reward.
  `question_position: start` puts the question before the notes (instruction, question, notes): the prompt's
  last tokens, SnapKV's observation window, are then notes, not the question, so the prefill's selection does
  not know which fact will be asked. This is the query-agnostic setting of SCBench (Li et al. 2024) and of
  kvpress's benchmarks, which compress the context before the question arrives; there SnapKV costs more.
"""

from __future__ import annotations

import random

from schemas.params.prepare import PrepareParams
from stages.prepare.synthetic import count_tokens, interleave

ANIMALS = (
    "cat dog bird fish lion bear wolf fox owl frog goat horse mouse duck swan deer crow bee ant seal".split()
)
PEOPLE = "Tom Ann Bob Eve Sam Kim Lee Max Joe Amy".split()
PLACES = "bridge tower castle forest island desert valley garden market station harbor library park farm".split()
ADJECTIVES = "old new tall quiet busy small large bright dark warm cold empty crowded".split()
INSTRUCTION = "Read the notes below. Some of them give an animal a number."


def filler_sentence(rng: random.Random) -> str:
    """One everyday sentence that names no animal and no number."""
    kind = rng.randrange(5)
    if kind == 0:
        return f"The {rng.choice(PLACES)} is {rng.choice(ADJECTIVES)} today."
    if kind == 1:
        return f"{rng.choice(PEOPLE)} walks to the {rng.choice(ADJECTIVES)} {rng.choice(PLACES)}."
    if kind == 2:
        return f"{rng.choice(PEOPLE)} and {rng.choice(PEOPLE)} meet near the {rng.choice(PLACES)}."
    if kind == 3:
        return f"It was {rng.choice(ADJECTIVES)} at the {rng.choice(PLACES)} in the morning."
    return f"{rng.choice(PEOPLE)} likes the {rng.choice(PLACES)} because it is {rng.choice(ADJECTIVES)}."


def question(names: list[str]) -> str:
    """The question and its answer format for the asked animals, in order."""
    if len(names) == 1:
        return f"What number does the {names[0]} have? Answer with the number only."
    listed = ", ".join(f"the {n}" for n in names[:-1]) + f" and the {names[-1]}"
    return (f"What numbers do {listed} have? Answer with the {len(names)} numbers only, in that order, "
            "separated by commas.")


def fact_recall(rng: random.Random, p: PrepareParams, context_tokens: int) -> tuple[str, str]:
    keys = rng.sample(ANIMALS, p.num_pairs)
    low = 10 ** (p.value_digits - 1) if p.value_digits > 1 else 0
    values = rng.sample(range(low, 10**p.value_digits), p.num_pairs)  # distinct: one right answer per animal
    facts = [f"The {k} has number {v}." for k, v in zip(keys, values, strict=True)]
    asked = rng.sample(range(p.num_pairs), p.num_queries)
    tail = question([keys[i] for i in asked])
    # Every interleaving of facts and filler equally likely, facts in their drawn order (synthetic.interleave).
    notes = " ".join(interleave(rng, facts, count_tokens(INSTRUCTION) + count_tokens(tail), context_tokens,
                                filler_sentence))
    answer = ", ".join(str(values[i]) for i in asked)
    if p.question_position == "start":
        return f"{INSTRUCTION}\n\n{tail}\n\n{notes}", answer
    return f"{INSTRUCTION}\n\n{notes}\n\n{tail}", answer


GENERATORS = {"fact_recall": fact_recall}
