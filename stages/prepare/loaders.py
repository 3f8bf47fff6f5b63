"""Loaders for local data set files in their public formats.

Every record becomes an `Example(source_id, body, question, reference)`; `render` turns it into the
prompt text (document/context truncated to fit `max_prompt_tokens`). Bad input raises SmdInputError
with one line `FILE:LINE: FIELD: problem`.

Required fields (others are ignored):
- gsm8k (jsonl, as openai/grade-school-math): `question` (str), `answer` (str containing "#### N").
  Calculator annotations `<<48/2=24>>` are removed from the reference.
- hotpotqa (json list as distributed, or jsonl): `question` (str), `answer` (str), `context`
  (list of [title, [sentence, ...]], or Hugging Face's {title: [...], sentences: [[...], ...]}); `_id`
  (or `id`) is used as prompt id when present.
- tldr (jsonl): either OpenAI's summarize-from-feedback rows `post` (str), `summary` (str), optional
  `id`, `subreddit`, `title`; or CarperAI/openai_summarize_tldr rows `prompt` (str, ends "TL;DR:"),
  `label` (str).
- govreport (jsonl): `report` or `document` (str, a list of paragraphs, or the original release's nested
  sections {section_title, paragraphs, subsections}), `summary` (str or list of paragraphs), optional `id`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.errors import SmdInputError


@dataclass(frozen=True)
class Example:
    source_id: str
    line: int
    prefix: str  # text before the body (kept whole)
    body: str  # document/context, truncated to fit the prompt budget
    suffix: str  # question and answer cue (kept whole)
    reference: str


def _fail(path: Path, line: int, field: str, problem: str) -> SmdInputError:
    return SmdInputError(f"{path}:{line}: {field}: {problem}")


def _json_error(path: Path, line: int, exc: json.JSONDecodeError) -> SmdInputError:
    return _fail(path, line, "<json>", f"not valid JSON ({exc.msg} at column {exc.colno})")


def iter_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) for a JSON Lines file or a JSON array file.

    Read as UTF-8 with an optional byte-order mark ("utf-8-sig"), as `datasets.load_dataset("json")` reads it:
    editors on Windows save one at the start of the file."""
    if not path.is_file():
        raise SmdInputError(f"{path}: file not found")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SmdInputError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from _iter_array(path, text)
        return
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield lineno, json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _json_error(path, lineno, exc) from exc


def _iter_array(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each one starts on."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        return text.count("\n", 0, i) + 1

    pos = skip_ws(pos)
    if pos < n and text[pos] == "]":
        return
    while True:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise _json_error(path, exc.lineno, exc) from exc
        yield line_of(pos), obj
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos = skip_ws(pos + 1)
            continue
        if pos < n and text[pos] == "]":
            return
        raise _fail(
            path, line_of(min(pos, n - 1)), "<json>", "not valid JSON (expected ',' or ']' in the list)"
        )


def _get_str(path: Path, line: int, rec: dict, field: str, *, optional: bool = False) -> str | None:
    if field not in rec or rec[field] is None:
        if optional:
            return None
        raise _fail(path, line, field, "missing field")
    value = rec[field]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and field in ("id", "_id"):
        return str(value)
    if not isinstance(value, str):
        raise _fail(path, line, field, f"expected a string, got {type(value).__name__}")
    return value


def _source_id(path: Path, line: int, rec: dict) -> str:
    for field in ("_id", "id"):
        value = _get_str(path, line, rec, field, optional=True)
        if value:
            return value
    return f"{path.stem}-L{line}"


_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k(path: Path, line: int, rec: dict) -> Example:
    question = _get_str(path, line, rec, "question")
    answer = _get_str(path, line, rec, "answer")
    if "####" not in answer:
        raise _fail(path, line, "answer", "no '#### N' final answer")
    if not question.strip():
        raise _fail(path, line, "question", "empty")
    reference = _CALC.sub("", answer).strip()
    return Example(
        _source_id(path, line, rec), line, "", "", f"question : {question.strip()}\nanswer :", reference
    )


def hotpotqa(path: Path, line: int, rec: dict) -> Example:
    question = _get_str(path, line, rec, "question")
    answer = _get_str(path, line, rec, "answer")
    if "context" not in rec:
        raise _fail(path, line, "context", "missing field")
    context = rec["context"]
    if (
        isinstance(context, dict)
        and isinstance(context.get("title"), list)
        and isinstance(context.get("sentences"), list)
    ):
        # Hugging Face `hotpot_qa` layout: {"title": [...], "sentences": [[...], ...]}
        if len(context["title"]) != len(context["sentences"]):
            raise _fail(path, line, "context", "title and sentences lists differ in length")
        context = [[t, s] for t, s in zip(context["title"], context["sentences"], strict=True)]
    if not isinstance(context, list):
        raise _fail(
            path, line, "context", f"expected a list of [title, [sentences]], got {type(context).__name__}"
        )
    paragraphs = []
    for i, item in enumerate(context):
        ok = (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], list)
            and all(isinstance(s, str) for s in item[1])
        )
        if not ok:
            raise _fail(path, line, f"context[{i}]", "expected [title, [sentence, ...]]")
        paragraphs.append(f"{item[0]} : {''.join(item[1]).strip()}")
    return Example(
        _source_id(path, line, rec),
        line,
        "context : ",
        "\n".join(paragraphs),
        f"\nquestion : {question.strip()}\nanswer :",
        answer.strip(),
    )


def tldr(path: Path, line: int, rec: dict) -> Example:
    if "prompt" in rec and "label" in rec and "post" not in rec:  # CarperAI/openai_summarize_tldr
        prompt = _get_str(path, line, rec, "prompt")
        label = _get_str(path, line, rec, "label")
        head, cue = prompt, ""
        m = re.search(r"\s*TL;DR:\s*$", prompt)
        if m:
            head, cue = prompt[: m.start()], prompt[m.start() :]
        return Example(
            _source_id(path, line, rec),
            line,
            "",
            head.strip(),
            "\n" + (cue.strip() or "TL;DR:"),
            label.strip(),
        )
    post = _get_str(path, line, rec, "post")
    summary = _get_str(path, line, rec, "summary")
    subreddit = _get_str(path, line, rec, "subreddit", optional=True)
    title = _get_str(path, line, rec, "title", optional=True)
    head = ""
    if subreddit:
        head += f"subreddit : r/{subreddit.strip()}\n"
    if title:
        head += f"title : {title.strip()}\n"
    return Example(
        _source_id(path, line, rec), line, head + "post : ", post.strip(), "\ntl;dr :", summary.strip()
    )


def _flatten(value: Any) -> list[str] | None:
    """Strings of a nested section structure, in order (None if something else is in it)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = [value[k] for k in ("section_title", "paragraphs", "subsections") if k in value] or list(
            value.values()
        )
    if isinstance(value, list):
        out: list[str] = []
        for item in value:
            part = _flatten(item)
            if part is None:
                return None
            out += part
        return out
    return None


def _joined_text(path: Path, line: int, rec: dict, field: str, sep: str, expected: str) -> str:
    """`rec[field]` (text, paragraphs or nested sections) as one string, its parts joined by `sep`."""
    if field not in rec:
        raise _fail(path, line, field, "missing field")
    parts = _flatten(rec[field])
    if parts is None:
        raise _fail(path, line, field, f"expected {expected}, got {type(rec[field]).__name__}")
    return sep.join(p.strip() for p in parts if p.strip())


def govreport(path: Path, line: int, rec: dict) -> Example:
    field = "report" if "report" in rec else "document"
    if field not in rec:
        raise _fail(path, line, "report", "missing field (expected report or document)")
    doc = _joined_text(path, line, rec, field, "\n", "text, a list of paragraphs or sections")
    summary = _joined_text(path, line, rec, "summary", " ", "text or a list of paragraphs")
    if not summary:
        raise _fail(path, line, "summary", "empty")
    return Example(
        _source_id(path, line, rec),
        line,
        "report : ",
        doc.strip(),
        "\nsummarize the report .\nsummary :",
        summary.strip(),
    )


LOADERS = {"gsm8k": gsm8k, "hotpotqa": hotpotqa, "tldr": tldr, "govreport": govreport}


def load_examples(task: str, path: str | Path) -> list[Example]:
    """Parse and validate every record of `path` for `task` (raises on the first bad record)."""
    path = Path(path)
    parse = LOADERS[task]
    out = []
    for line, rec in iter_records(path):
        if not isinstance(rec, dict):
            raise _fail(path, line, "<record>", f"expected a JSON object, got {type(rec).__name__}")
        out.append(parse(path, line, rec))
    return out


def render(example: Example, tokenizer, max_prompt_tokens: int) -> tuple[str, list[int]] | None:
    """Prompt text and token ids, the body truncated (at a token boundary) to fit; None if it cannot fit."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = example.prefix + example.body + example.suffix
    ids = encode(prompt)
    if len(ids) <= max_prompt_tokens:
        return prompt, ids
    if not example.body:
        return None
    enc = tokenizer(example.body, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    budget = len(offsets) - (len(ids) - max_prompt_tokens)
    while budget > 0:
        cut = offsets[budget - 1][1]
        prompt = example.prefix + example.body[:cut] + example.suffix
        ids = encode(prompt)
        if len(ids) <= max_prompt_tokens:
            return prompt, ids
        budget -= max(1, len(ids) - max_prompt_tokens)
    return None
