"""Seeded synthetic long-context tasks that a tiny model can learn on a CPU.

Each generator returns `(prompt, reference)` pairs. Prompts end with the answer cue "answer :"; the
policy's response is the reference followed by EOS. Every word comes from `stages.common.vocab` (a test
checks the tiny tokenizer maps them without [UNK]). The important facts are spread over filler
sentences and distractors up to `context_tokens`, so a KV cache that evicts them costs reward.

- kv_retrieval: facts "key bear 20 bear ." (the key on both sides of its value, so both an induction
  head and a value-to-key lookup can solve it; a tiny model learns it within minutes on a CPU) among
  filler; "query : key bird ; key bear . answer :" -> "bird 58 ; bear 20" (each queried key with its
  value, in query order, separated by ";").
- var_tracking: chains "let a = 5 . ... let b = a . ... let c = b ." plus distractor chains;
  "question : what is c ? answer :" -> "c = b = a = 5" (each hop, then the number).
- arithmetic: GSM8K-like story with distractor facts; "question : how many apples does tom have now ?
  answer :" -> "5 + 3 = 8 . 8 - 2 = 6 . #### 6".
- pointer_chasing: facts "fox owl ." (fox points to owl; each node has at most one outgoing fact) in
  shuffled order among filler, `pointer_hops` of them forming the asked path and `pointer_distractors`
  leaving nodes off it; "query : from fox . answer :" -> "fox owl ; owl bee ; bee moon" (the whole path
  hop by hop, each hop restating the fact it follows: its source was written by the answer just before,
  its target needs the context). The node just written is the lookup key, as in kv_retrieval: the token
  after its fact's occurrence (a first design, "fox to owl", put "to" between them, so the lookup had to
  match two tokens back; the tiny model did not learn it within 10 minutes).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable

from schemas.params.prepare import PrepareParams

ANSWER_CUE = "answer :"

ANIMALS = (
    "cat dog bird fish lion bear wolf fox owl frog goat horse mouse duck swan deer crow bee ant seal".split()
)
PLACES = (
    "moon sun star sky river lake hill tree rock sand house door window table chair cup ball hat shoe ship car "
    "city town field garden bell drum kite lamp map ring rope seed leaf wall gate bank shop farm park boat train "
    "bus plane bridge tower castle forest island desert valley"
).split()
# Keys never occur in filler sentences, so the fact "key fox 37 ." is the only place a key is followed by a value.
KEY_WORDS = ANIMALS
FILLER_PLACES = PLACES[20:]
COLORS = "red blue green yellow black white".split()
ADJECTIVES = COLORS + "big small old new tall short warm cold dark bright quiet loud".split()
PEOPLE = "tom ann bob eve sam kim lee max joe amy".split()
HE_SHE = {"tom": "he", "bob": "he", "sam": "he", "lee": "he", "max": "he", "joe": "he",
          "ann": "she", "eve": "she", "kim": "she", "amy": "she"}  # fmt: skip
ITEMS = "apples pens books coins cookies marbles eggs boxes".split()
# Nodes never occur in filler sentences (FILLER_PLACES is PLACES[20:]), so "owl to" occurs only in owl's fact.
POINTER_NODE_WORDS = ANIMALS + PLACES[:20]
VAR_NAMES = [chr(c) for c in range(ord("b"), ord("z") + 1)]  # not "a": filler uses the article

_TOKEN = re.compile(r"\d|[^\w\s]|[^\W\d_]+")


def count_tokens(text: str) -> int:
    """Token count under the tiny tokenizer's rules (words, single punctuation marks, single digits)."""
    return len(_TOKEN.findall(text))


def filler_sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"the {rng.choice(FILLER_PLACES)} is {rng.choice(ADJECTIVES)} ."
    if kind == 1:
        return f"{rng.choice(PEOPLE)} sits near the {rng.choice(ADJECTIVES)} {rng.choice(FILLER_PLACES)} ."
    if kind == 2:
        return f"{rng.choice(PEOPLE)} sees the {rng.choice(FILLER_PLACES)} ."
    return f"it was {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)} at the {rng.choice(FILLER_PLACES)} ."


def interleave(rng: random.Random, facts: list[str], used: int, context_tokens: int,
               filler: Callable[[random.Random], str] = filler_sentence) -> list[str]:
    """`facts` (order kept) merged with `filler` sentences drawn until `used` + their tokens reach ~context_tokens;
    every interleaving equally likely."""
    used += sum(count_tokens(f) for f in facts)
    sentences: list[str] = []
    while used < context_tokens:
        sentence = filler(rng)
        sentences.append(sentence)
        used += count_tokens(sentence)
    slots = [True] * len(facts) + [False] * len(sentences)
    rng.shuffle(slots)
    fi, gi = iter(facts), iter(sentences)
    return [next(fi) if is_fact else next(gi) for is_fact in slots]


def spread(rng: random.Random, head: str, facts: list[str], tail: str, context_tokens: int) -> str:
    """Interleave `facts` (order kept) with filler sentences until the prompt reaches ~context_tokens."""
    body = interleave(rng, facts, count_tokens(head) + count_tokens(tail), context_tokens)
    return " ".join([head, *body, tail])


def kv_retrieval(rng: random.Random, p: PrepareParams, context_tokens: int) -> tuple[str, str]:
    keys = rng.sample(KEY_WORDS, p.num_pairs)
    low = 10 ** (p.value_digits - 1) if p.value_digits > 1 else 0
    values = rng.sample(range(low, 10**p.value_digits), p.num_pairs)  # distinct: one right answer per key
    facts = [f"key {k} {v} {k} ." for k, v in zip(keys, values, strict=True)]
    asked = rng.sample(range(p.num_pairs), p.num_queries)
    query = " ; ".join(f"key {keys[i]}" for i in asked)
    prompt = spread(
        rng, "find the value of each key .", facts, f"query : {query} . {ANSWER_CUE}", context_tokens
    )
    return prompt, " ; ".join(f"{keys[i]} {values[i]}" for i in asked)


def var_tracking(rng: random.Random, p: PrepareParams, context_tokens: int) -> tuple[str, str]:
    names = rng.sample(VAR_NAMES, p.num_chains * p.num_hops)
    chains: list[list[str]] = []
    for c in range(p.num_chains):
        chain_names = names[c * p.num_hops : (c + 1) * p.num_hops]
        value = rng.randrange(1, 100)
        statements = [f"let {chain_names[0]} = {value} ."]
        statements += [f"let {b} = {a} ." for a, b in zip(chain_names, chain_names[1:], strict=False)]
        chains.append(statements)
    # Interleave the chains, keeping each chain's order (an assignment comes before its use).
    order = [c for c in range(p.num_chains) for _ in range(p.num_hops)]
    rng.shuffle(order)
    positions = [0] * p.num_chains
    facts = []
    for c in order:
        facts.append(chains[c][positions[c]])
        positions[c] += 1
    target = names[: p.num_hops]  # chain 0 is the one asked about
    value = chains[0][0].split()[3]
    prompt = spread(
        rng,
        "track the variables .",
        facts,
        f"question : what is {target[-1]} ? {ANSWER_CUE}",
        context_tokens,
    )
    return prompt, " = ".join([*reversed(target), value])


def arithmetic(rng: random.Random, p: PrepareParams, context_tokens: int) -> tuple[str, str]:
    person, other = rng.sample(PEOPLE, 2)
    item, other_item = rng.sample(ITEMS, 2)
    he = HE_SHE[person]
    amount = rng.randrange(1, p.max_operand + 1)
    facts = [f"{person} has {amount} {item} ."]
    steps = []
    for _ in range(p.num_steps):
        kind = rng.randrange(3)
        if kind == 2 and amount == 0:
            kind = 0
        if kind == 0:
            n = rng.randrange(1, p.max_operand + 1)
            verb = rng.choice(["buys", "finds", "gets"])
            facts.append(f"then {he} {verb} {n} more {item} .")
            steps.append(f"{amount} + {n} = {amount + n} .")
            amount += n
        elif kind == 1:
            k = rng.randrange(2, max(3, min(p.max_operand, 5) + 1))
            n = rng.randrange(1, p.max_operand + 1)
            facts.append(f"then {he} buys {k} boxes with {n} {item} each .")
            steps.append(f"{k} * {n} = {k * n} . {amount} + {k * n} = {amount + k * n} .")
            amount += k * n
        else:
            n = rng.randrange(1, amount + 1)
            verb = rng.choice(["gives", "sells", "loses"])
            tail = f" to {other}" if verb != "loses" else ""
            facts.append(f"then {he} {verb} {n} {item}{tail} .")
            steps.append(f"{amount} - {n} = {amount - n} .")
            amount -= n
    distractors = [
        f"{other} has {rng.randrange(1, p.max_operand + 1)} {other_item} .",
        f"{other} buys {rng.randrange(1, p.max_operand + 1)} more {rng.choice([item, other_item])} .",
    ]
    # Distractors sit anywhere between the facts; the story's own order is kept.
    merged = list(facts)
    for d in distractors:
        merged.insert(rng.randrange(1, len(merged) + 1), d)
    question = f"question : how many {item} does {person} have now ? {ANSWER_CUE}"
    prompt = spread(rng, "read the story .", merged, question, context_tokens)
    return prompt, " ".join([*steps, f"#### {amount}"])


def pointer_chasing(rng: random.Random, p: PrepareParams, context_tokens: int) -> tuple[str, str]:
    nodes = rng.sample(POINTER_NODE_WORDS, p.pointer_hops + 1 + p.pointer_distractors)
    path, off_path = nodes[: p.pointer_hops + 1], nodes[p.pointer_hops + 1 :]
    hops = [f"{a} {b}" for a, b in zip(path, path[1:], strict=False)]
    # A distractor may point into the path ("cat owl ."), so owl also occurs followed by "." (its fact is the
    # occurrence followed by a node), as a kv_retrieval key does in "key owl 37 owl .".
    distractors = [f"{a} {rng.choice([n for n in nodes if n != a])}" for a in off_path]
    facts = [f"{fact} ." for fact in hops + distractors]
    rng.shuffle(facts)  # not in path order: the answer cannot copy the context in sequence
    prompt = spread(rng, "track each key .", facts, f"query : from {path[0]} . {ANSWER_CUE}", context_tokens)
    return prompt, " ; ".join(hops)


GENERATORS: dict[str, Callable[[random.Random, PrepareParams, int], tuple[str, str]]] = {
    "kv_retrieval": kv_retrieval,
    "var_tracking": var_tracking,
    "arithmetic": arithmetic,
    "pointer_chasing": pointer_chasing,
}


Generator = Callable[[random.Random, PrepareParams, int], tuple[str, str]]


def generate(task: str, p: PrepareParams, seed: int, split: str, n: int,
             generators: dict[str, Generator] = GENERATORS) -> list[tuple[str, str]]:
    """`n` (prompt, reference) pairs; deterministic in (task, params, seed, split). `generators`: the task
    registry (this module's; prepare adds stages.prepare.instruct's)."""
    rng = random.Random(f"smd-prepare:{task}:{seed}:{split}")
    shortest = max(1, math.ceil(p.train_context_min_fraction * p.context_tokens)) if split == "train" else None
    out = []
    for _ in range(n):
        target = rng.randint(shortest, p.context_tokens) if shortest is not None else p.context_tokens
        out.append(generators[task](rng, p, target))
    return out
