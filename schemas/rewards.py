"""Reward functions shared by every stage that scores a response (rollout, warmstart, evaluate).

`score(task, response_text, reference)` returns a float in [0, 1]; `exact_match` a bool;
`metric_name(task)` names what `score` measures.

- `gsm8k`, `arithmetic`, `var_tracking`: numeric exact match of the final number (GSM8K convention:
  the number after the last `####`, else the last number in the text). score = 1.0 or 0.0.
- `kv_retrieval`, `fact_recall`: fraction of the queried values answered correctly, position by position (a dense
  signal for RL); exact match = every value right and no extra value.
- `pointer_chasing`: fraction of the reference's hops (units between ";", e.g. "fox owl") that the
  response gives at the same position, words compared exactly (a wrong hop usually derails the hops
  after it, which then miss too; extra hops past the reference cost nothing); exact match = the same
  hops and no extra one.
- `hotpotqa`: token F1 after SQuAD normalization (lowercase, drop punctuation and articles);
  exact match = normalized strings equal.
- `tldr`, `govreport`: ROUGE-L F-measure (rouge-score, Porter stemmer); exact match = normalized
  strings equal.
- `dataset`: no built-in scorer; `reward.function` scores it (stages.common.scoring).

Texts decoded by word-level tokenizers come back with every token separated by a space (the tiny
default tokenizer writes "37" as "3 7" and "####" as "# # # #"), so numbers are read after
`canonical_numbers`, which joins digits separated only by whitespace. Two numbers that a response
separates by whitespace alone therefore read as one number: tasks separate their numbers with
punctuation or words.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

from schemas.errors import SmdInputError
from schemas.params.prepare import TASKS

METRICS = {
    "kv_retrieval": "kv_fraction",
    "fact_recall": "kv_fraction",
    "var_tracking": "numeric_exact_match",
    "arithmetic": "numeric_exact_match",
    "gsm8k": "numeric_exact_match",
    "pointer_chasing": "unit_fraction",
    "hotpotqa": "token_f1",
    "tldr": "rougeL_f",
    "govreport": "rougeL_f",
    # a user's data set: scored only by reward.function (stages.common.reward_functions)
    "dataset": "reward_function",
}
assert set(METRICS) == set(TASKS)

_HASHES = re.compile(r"#(?:\s*#){3}")
_SPLIT_DIGITS = re.compile(r"(?<=\d)\s+(?=\d)")
_NEG = re.compile(r"(^|[\s#=(:,;$])-\s+(?=\d)")
_DECIMAL = re.compile(r"(?<=\d)\s*\.\s*(?=\d)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FINAL = re.compile(r"^[\s:$]*(-?\s*\d[\d,\s]*(?:\.\s*\d+)?)")


def _check_task(task: str) -> str:
    if task not in METRICS:
        raise SmdInputError(f"task: unknown task {task!r}; choose one of {', '.join(METRICS)}")
    return METRICS[task]


def _builtin(task: str) -> str:
    metric = _check_task(task)
    if metric == "reward_function":
        raise SmdInputError(f"reward.function: task {task!r} has no built-in scorer; set reward.function")
    return metric


def metric_name(task: str) -> str:
    """Name of the quantity `score` returns for `task` (for metrics files and logs)."""
    return _check_task(task)


def canonical_numbers(text: str) -> str:
    """Join digits, signs, decimal points and `####` that a word-level decode split with spaces."""
    text = _HASHES.sub("####", text)
    text = _SPLIT_DIGITS.sub("", text)
    text = _NEG.sub(r"\1-", text)
    return _DECIMAL.sub(".", text)


def _number_value(raw: str) -> str | None:
    raw = re.sub(r"[\s,]", "", raw)
    if not _NUMBER.fullmatch(raw):
        return None
    if "." in raw:
        raw = raw.rstrip("0").rstrip(".")
    sign = "-" if raw.startswith("-") else ""
    digits = raw.lstrip("-").lstrip("0")
    if digits == "" or digits.startswith("."):
        digits = "0" + digits
    return digits if digits == "0" else sign + digits


def extract_final_number(text: str) -> str | None:
    """The answer number: after the last `####` (GSM8K), else the last number; None when there is none.

    Thousands separators after `####` are dropped ("#### 1,000" -> "1000"); leading zeros and trailing
    decimal zeros are normalized ("08", "8.0" -> "8").
    """
    text = canonical_numbers(text)
    if "####" in text:
        m = _FINAL.match(text.rsplit("####", 1)[1])
        if m:
            return _number_value(m.group(1))
    numbers = _NUMBER.findall(text)
    return _number_value(numbers[-1]) if numbers else None


def numbers_in(text: str) -> list[str]:
    """All numbers in order, after `canonical_numbers` (normalized like `extract_final_number`)."""
    out = []
    for raw in _NUMBER.findall(canonical_numbers(text)):
        value = _number_value(raw)
        if value is not None:
            out.append(value)
    return out


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, remove punctuation, articles and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD/HotpotQA token F1 between normalized prediction and reference."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (rouge-score package, Porter stemmer)."""
    return float(_rouge().score(reference, prediction)["rougeL"].fmeasure)


def positional_fraction(predicted: list, reference: list) -> float:
    """Fraction of the reference's items that the prediction has at the same position (0 for an empty one)."""
    if not reference:
        return 0.0
    return sum(1 for r, p in zip(reference, predicted, strict=False) if r == p) / len(reference)


def kv_fraction(prediction: str, reference: str) -> float:
    """Fraction of reference values that the prediction gives at the same position."""
    return positional_fraction(numbers_in(prediction), numbers_in(reference))


def answer_units(text: str) -> list[str]:
    """The ";"-separated units of an answer, each with its whitespace collapsed (empty units dropped)."""
    return [unit for unit in (" ".join(part.split()) for part in text.split(";")) if unit]


def unit_fraction(prediction: str, reference: str) -> float:
    """Fraction of reference units that the prediction gives at the same position."""
    return positional_fraction(answer_units(prediction), answer_units(reference))


def score(task: str, response_text: str, reference: str) -> float:
    """Reward in [0, 1] of `response_text` against `reference` for `task`."""
    metric = _builtin(task)
    if metric == "numeric_exact_match":
        return float(exact_match(task, response_text, reference))
    if metric == "kv_fraction":
        return kv_fraction(response_text, reference)
    if metric == "unit_fraction":
        return unit_fraction(response_text, reference)
    if metric == "token_f1":
        return token_f1(response_text, reference)
    return rouge_l(response_text, reference)


def exact_match(task: str, response_text: str, reference: str) -> bool:
    """Whether the response is fully right (the accuracy reported by warmstart and evaluate)."""
    metric = _builtin(task)
    if metric == "numeric_exact_match":
        want = extract_final_number(reference)
        return want is not None and extract_final_number(response_text) == want
    if metric == "kv_fraction":
        ref = numbers_in(reference)
        return bool(ref) and numbers_in(response_text) == ref
    if metric == "unit_fraction":
        ref = answer_units(reference)
        return bool(ref) and answer_units(response_text) == ref
    return normalize_answer(response_text) == normalize_answer(reference)
