"""Where smd's numeric rule and the built-in `math_verify` disagree on gsm8k-style rows (issue 33).

    .venv/bin/python scripts/math_verify_disagreements.py [--golds 40] [--seed 0] [--examples 1]

Generates seeded rows: a gold answer in gsm8k's form ("#### N", alone or after a worked solution; N an integer,
some in the thousands and written "1,250", some negative, some decimal) and one response per style a model
writes ("#### 1,000", "The answer is $1000.", "\\boxed{1000}", "1000.00", "1,000 dollars", a fraction for a
decimal, a wrong answer, two numbers, ...). Each row is scored by smd's rule
(`schemas.rewards.exact_match("gsm8k", response, gold)`: the number after the last "####", else the last number)
and by `math_verify` (stages/common/reward_functions.py, HF math-verify as TRL's accuracy_reward). The last
column scores with the built-in `math_verify_verl` (verl's math-verify rule, verl/utils/reward_score/
math_verify.py, on the number after "#### " as verl's gsm8k preprocessing extracts it). Prints, per style,
whether the response is meant to be right, how often each rule says so, and the disagreements between smd's
rule and `math_verify`, with an example of each. Needs math-verify (`pip install 'smd[math]'`). A measurement,
not a test.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, defaultdict
from fractions import Fraction

from schemas.rewards import exact_match
from stages.common.reward_functions import math_verify_reward, math_verify_verl_reward


def _commas(n: int) -> str:
    return f"{n:,}"


def _golds(rng: random.Random, count: int) -> list[tuple[str, Fraction]]:
    """(gold text, value): integers (small, thousands, negative) and a few decimals, in gsm8k's form."""
    out = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            value = Fraction(rng.randint(2, 99))
        elif kind == 1:
            value = Fraction(rng.randint(1, 999) * 1000 + rng.choice([0, 0, rng.randint(1, 999)]))
        elif kind == 2:
            value = Fraction(-rng.randint(1, 60))
        elif kind == 3:
            value = Fraction(rng.randint(1, 40) * 2 + 1, 2)  # x.5
        else:
            value = Fraction(rng.randint(100, 999))
        shown = _commas(int(value)) if value.denominator == 1 and abs(value) >= 1000 else _fmt(value)
        if rng.random() < 0.5:
            a = rng.randint(2, 9)
            gold = f"She has {a} boxes, so {a} * 2 = <<{a}*2={a * 2}>>{a * 2} items in all.\n#### {shown}"
        else:
            gold = f"#### {shown}"
        out.append((gold, value))
    return out


def _fmt(value: Fraction) -> str:
    if value.denominator == 1:
        return str(int(value))
    return str(float(value))


STYLES = {
    # style: (builds the response from the value, meant to be right?)
    "#### N (commas)": (lambda v: f"So the total is {_fmt(v)} + 0.\n#### {_commas_any(v)}", True),
    "#### N": (lambda v: f"#### {_fmt(v)}", True),
    "The answer is $N.": (lambda v: f"The answer is ${_fmt(v)}.", True),
    "The answer is $N$ (LaTeX)": (lambda v: f"The answer is ${_fmt(v)}$.", True),
    "\\boxed{N}": (lambda v: f"Adding up, we get \\boxed{{{_fmt(v)}}}.", True),
    "\\boxed{N,NNN}": (lambda v: f"\\boxed{{{_commas_any(v)}}}", True),
    "N.00": (lambda v: f"{float(v):.2f}", True),
    "N,NNN dollars": (lambda v: f"It costs {_commas_any(v)} dollars", True),
    "bare N": (lambda v: _fmt(v), True),
    "fraction for a decimal": (lambda v: f"The answer is {v.numerator}/{v.denominator}", True),
    "\\boxed{\\frac{a}{b}}": (lambda v: f"\\boxed{{\\frac{{{v.numerator}}}{{{v.denominator}}}}}", True),
    "N then a unit count": (lambda v: f"The answer is {_fmt(v)} after 3 steps.", True),
    "two numbers, right last": (lambda v: f"First I got {_fmt(v + 7)}, but then {_fmt(v)}.", True),
    "two numbers, right first (boxed)": (lambda v: f"\\boxed{{{_fmt(v)}}} Check: {_fmt(v + 7)} is wrong.", True),
    "wrong: right first, wrong last": (lambda v: f"First I got {_fmt(v)}, but then {_fmt(v + 7)}.", False),
    "wrong: #### N+1": (lambda v: f"#### {_fmt(v + 1)}", False),
    "wrong: \\boxed{N+1}": (lambda v: f"\\boxed{{{_fmt(v + 1)}}}", False),
    "wrong: no number": (lambda v: "I don't know.", False),
}


def _commas_any(v: Fraction) -> str:
    if v.denominator == 1:
        return _commas(int(v))
    return f"{float(v):,}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--golds", type=int, default=40, help="gold answers generated (each gets every style)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=1, help="examples printed per disagreement kind and style")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    golds = _golds(rng, args.golds)
    counts: dict[str, Counter] = defaultdict(Counter)
    examples: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for gold, value in golds:
        for style, (build, meant) in STYLES.items():
            if "fraction" in style or "frac" in style:
                if value.denominator == 1:
                    continue  # fractions only for the decimal golds
            response = build(value)
            smd = exact_match("gsm8k", response, gold)
            mv = math_verify_reward("gsm8k", response, gold)
            c = counts[style]
            c["rows"] += 1
            c["smd right"] += smd == meant
            c["mv right"] += (mv == 1.0) == meant and mv is not None
            c["mv None"] += mv is None
            c["verl right"] += (math_verify_verl_reward("gsm8k", response, gold) == 1.0) == meant
            if mv is None:
                kind = "mv None"
            elif smd and mv == 0.0:
                kind = "smd 1, mv 0"
            elif not smd and mv == 1.0:
                kind = "smd 0, mv 1"
            else:
                continue
            c[kind] += 1
            if len(examples[(style, kind)]) < args.examples:
                examples[(style, kind)].append((gold.replace("\n", " / "), response.replace("\n", " / ")))
    total = Counter()
    header = f"{'response style':34} {'meant':>5} {'rows':>5} {'smd ok':>6} {'mv ok':>6} {'smd1 mv0':>8} " \
             f"{'smd0 mv1':>8} {'mv None':>7} {'verl-mv ok':>10}"
    print(f"{len(golds)} golds, seed {args.seed}; ok = the rule agrees with what the response meant")
    print(header)
    print("-" * len(header))
    for style, (_, meant) in STYLES.items():
        c = counts[style]
        total.update(c)
        print(f"{style:34} {'right' if meant else 'wrong':>5} {c['rows']:5d} {c['smd right']:6d} {c['mv right']:6d} "
              f"{c['smd 1, mv 0']:8d} {c['smd 0, mv 1']:8d} {c['mv None']:7d} {c['verl right']:10d}")
    print("-" * len(header))
    print(f"{'total':34} {'':>5} {total['rows']:5d} {total['smd right']:6d} {total['mv right']:6d} "
          f"{total['smd 1, mv 0']:8d} {total['smd 0, mv 1']:8d} {total['mv None']:7d} {total['verl right']:10d}")
    print("\nexamples (gold | response):")
    for (style, kind), rows in examples.items():
        for gold, response in rows:
            print(f"  [{kind}] {style}: {gold!r} | {response!r}")


if __name__ == "__main__":
    main()
