"""Vocabulary of the tiny default word-level tokenizer.

Synthetic tasks write only these words (a test checks that they tokenize without [UNK]); real data
sets still load (unknown words become [UNK]) and real models bring their own tokenizers.
"""

from __future__ import annotations

import random

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
DIGITS = [str(d) for d in range(10)]
PUNCTUATION = list(".,:;?!=+-*/#()'\"$%&<>[]{}|_")
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]

# Words used by the synthetic tasks and common short English words.
WORDS = """
the a an of to and in is was are be it that this for on with as at by from or not
key keys value values query queries answer question what which who where when how many much
var vars variable variables let set assign equals copy
total left has have had buys buy sells sell gives give gets get more less each every per
apple apples pen pens book books coin coins cookie cookies marble marbles egg eggs box boxes
tom ann bob eve sam kim lee max joe amy
then so now after before finally therefore
context document note notes find return list
red blue green yellow black white
cat dog bird fish lion bear wolf fox owl frog
moon sun star sky river lake hill tree rock sand
he she his her him does do did eats eat finds find loses lose sees see sits near track
big small old new tall short warm cold dark bright quiet loud
day night wind rain snow cloud road house door window table chair cup ball hat shoe
ship car city town field garden bell drum kite lamp map ring rope seed leaf wall gate
bank shop farm park boat train bus plane bridge tower castle forest island desert valley
goat horse mouse duck swan deer crow bee ant seal
read story
summary summarize title post subreddit report tl dr
""".split()


def tiny_vocabulary() -> list[str]:
    """Token strings in id order; ids are stable for a given list."""
    seen: dict[str, None] = {}
    for token in SPECIAL_TOKENS + DIGITS + PUNCTUATION + LETTERS + WORDS:
        seen.setdefault(token, None)
    return list(seen)


# Chat roles of the ChatML template (stages.common.model.CHATML_TEMPLATE): "<|im_start|>user\n" etc.
CHAT_ROLES = ["system", "user", "assistant"]


def bpe_training_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """The fixed text the tiny byte-level BPE tokenizer is trained on (`stages.common.model.build_bpe_tokenizer`):
    `lines` seeded lines, each a chat role name and a newline (as the template renders a turn) then words, numbers
    (1-3 digits) and punctuation the synthetic tasks write, joined by single spaces as the tasks join them. Same
    (lines, seed) -> the same list in any process (`random.Random` with a str seed ignores PYTHONHASHSEED)."""
    rng = random.Random(f"smd-bpe-corpus:{seed}")
    symbols = PUNCTUATION + WORDS
    corpus = []
    for _ in range(lines):
        parts = [str(rng.randrange(10 ** rng.randint(1, 3))) if rng.random() < 0.2 else rng.choice(symbols)
                 for _ in range(rng.randint(4, 16))]
        corpus.append(rng.choice(CHAT_ROLES) + "\n" + " ".join(parts))
    return corpus
