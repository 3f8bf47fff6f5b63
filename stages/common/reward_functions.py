"""User reward functions from a file, in verl's or TRL's convention, and two built-ins (issue 33).

Built-ins (verl's convention, need `pip install 'smd[math]'`): `math_verify`, HF math-verify exactly as TRL's
`accuracy_reward`; `math_verify_verl`, math-verify as verl's `reward_score/math_verify.py` (reads answers without a
LaTeX anchor, such as gsm8k's "#### 72"). scripts/math_verify_disagreements.py compares both with smd's numeric rule.

`reward.function: path/to/rewards.py:name` (several allowed, with weights). `load_reward_functions` resolves and
checks each one; `RewardScorer` calls them on a batch of `RewardSample`s, in this process or in a process pool.

Two conventions, told apart by the function's parameter names:

- **verl** (per sample), as verl's `NaiveRewardManager.__call__` calls `compute_score`
  (verl/workers/reward_manager/naive.py; docs/preparation/reward_function.rst, "Customized"):
  `fn(data_source=..., solution_str=completion, ground_truth=reference, extra_info=...)`, all keywords.
  `data_source` is the row's `data_source` column, else `default_data_source`. `extra_info` is, as verl builds
  it, a copy of the row's `extra_info` column (`{}` when absent) with `num_turns` (None: one turn) and
  `rollout_reward_scores` (`{}`) added when it is a dict. It is passed only when the function names it or takes
  `**kwargs` (verl always passes it; its docs write `extra_info=None`). The return is a number or bool, or a
  dict whose `"score"` is the reward and whose other keys are logged (`extras["<fn>/<key>"]`), as verl's
  `reward_extra_info`. Like verl's default name, a source without `:name` means `:compute_score`.
- **TRL** (batched), as `GRPOTrainer._calculate_rewards` calls `reward_funcs` (trl/trainer/grpo_trainer.py):
  `fn(prompts=[...], completions=[...], completion_ids=[...], **columns)`, every other data set column as a
  keyword list (TRL passes each input column but "prompt", "completion", "completion_ids"). When the prompt is
  conversational (a list of `{"role", "content"}` messages, TRL's `is_conversational`), each completion is
  `[{"role": "assistant", "content": text}]`, as TRL's `_generate_and_score_completions` builds it; else the
  text. The return is a list of float or None, one per completion. TRL also passes `trainer_state`,
  `log_extra`, `log_metric` (and `environments`): smd has no trainer state or completions table, so none of
  them is passed (a function that reads `kwargs["trainer_state"]` fails with its row named). A function without
  `**kwargs` receives only the keywords it names.

Several functions, weights `w` (default 1 each): the reward of a sample is TRL's `nansum_f(value_f * w_f)`, a
`None` counting as NaN (`rewards_per_func * reward_weights).nansum(dim=1)` in `_generate_and_score_completions`).
A sample where every function returns None therefore gets reward 0 (nansum of nothing), and is flagged in
`RewardResult.unscorable`. As TRL from v1.6.0 (PR #5902, "Exclude None reward completions from GRPO/RLOO
advantage baseline"), smd's GRPO advantages leave such rows out of their group's mean and std and set their
advantage to 0 (stages/learner/objectives.py `group_advantages(scored=)`, read from `reward_terms`). A bool
return is 1.0 or 0.0, as verl's reward tensor and TRL's `torch.tensor(..., dtype=torch.float32)` cast it. Logged: TRL's `rewards/<name>/mean` and `rewards/<name>/std`, nan-
aware (over non-None values, std with Bessel's correction as TRL's `nanstd`, NaN for fewer than 2 values).

Bad input raises `SmdInputError`, one line `reward.function: FILE:FUNCTION: problem`: a missing file or
function, an import failure, a signature of neither convention, an exception inside the function (its row's
prompt id and the exception's last line; a TRL batch that raises is rerun row by row to name the first row that
fails alone), a return that is not a finite number or None (with its row), a TRL list of the wrong length.

`timeout_s` (reward.timeout_s, per call as verl's prime reward manager's `timeout`): a call that runs past it stops
the stage with one line naming the function and the row (a TRL batch that hangs is rerun row by row to name the
first row that hangs alone); verl's prime manager scores such a sample 0 and goes on, smd does not hide a hang. A
call that runs 30 s prints a line, and so does a batch that has scored for 30 s (`_Clock`: SIGALRM in the main
thread of the scoring process, so in-process and pool scoring time out the same way).

`workers > 0`: a `ProcessPoolExecutor` (spawn context, so a rollout's torch threads are never forked) whose
initializer loads every function by path in each worker (functions need not be picklable). verl functions run
on the batch split into one chunk per worker; each TRL function gets the whole batch as one task. `submit`
returns at once; `result` waits. Errors are chosen the same way in both modes (first function in order, then
first row), so a pool and `workers=0` give the same result and the same error line.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import SmdInputError
from schemas.weights import file_sha256

BUILTIN_MATH_VERIFY = "math_verify"
BUILTIN_MATH_VERIFY_VERL = "math_verify_verl"
VERL_DEFAULT_NAME = "compute_score"  # verl's custom_reward_function.name default
MATH_EXTRA_HINT = "reward.function: math_verify needs the math-verify package: pip install 'smd[math]'"
VERL_SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info=None)"
TRL_SIGNATURE = "fn(prompts, completions, completion_ids, **kwargs)"
_VERL_REQUIRED = ("data_source", "solution_str", "ground_truth")
_VERL_KEYWORDS = (*_VERL_REQUIRED, "extra_info")
_TRL_KEYWORDS = ("prompts", "completions", "completion_ids")


# ----------------------------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class RewardSample:
    """One completion to score."""

    prompt_id: str
    prompt: str | list[dict[str, str]]  # the data set's prompt as given: a string, or chat messages
    completion: str  # decoded response (special tokens skipped)
    completion_ids: list[int]
    reference: str  # ground truth ("" when the data set has none)
    # every other data set column (verl: data_source, extra_info, reward_model, ...; TRL: e.g. "solution")
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    """Rewards of one batch (same order as the samples)."""

    rewards: list[float]  # weighted reward per sample: nansum_f(value * weight), None as NaN (TRL)
    per_function: dict[str, list[float | None]]  # each function's raw values (None kept), by display name
    extras: dict[str, list[Any]]  # verl dict returns: "<fn name>/<key>" -> values (None where absent)
    # True where every function returned None (reward 0 by nansum; TRL >= 1.6 zeroes such a row's advantage)
    unscorable: list[bool] = field(default_factory=list)

    def logged_means(self) -> dict[str, float]:
        """TRL's names: `rewards/<name>/mean`, `rewards/<name>/std` over non-None values (nan-aware, std with
        Bessel's correction as TRL's `nanstd`; NaN when there are too few values); for each extra with numeric
        values (bools count as 0/1), `rewards/<fn name>/<key>/mean` over its finite numeric values."""
        out: dict[str, float] = {}
        for name, values in self.per_function.items():
            mean, std = nan_mean_std([v for v in values if v is not None])
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = std
        for key, values in self.extras.items():
            nums = [float(v) for v in values if _is_real(v) and math.isfinite(float(v))]
            if nums:
                out[f"rewards/{key}/mean"] = sum(nums) / len(nums)
        return out


@dataclass(frozen=True)
class RewardFunctionSpec:
    """A checked reward function: where it lives and how to call it."""

    name: str  # display name: the function name ("accuracy"), or "math_verify"; unique ("#2" on clashes)
    source: str  # "path/to/rewards.py:accuracy" as written, or "math_verify"
    path: Path | None  # resolved file (None for a built-in)
    attr: str
    convention: str  # "verl" | "trl"
    digest: str  # "sha256:<hex>" of the file's bytes; "builtin:math_verify@<version>" for the built-in

    @property
    def label(self) -> str:
        """FILE:FUNCTION as the user wrote it (the source), for error lines."""
        if self.path is None:
            return self.source
        return self.source if ":" in self.source else f"{self.source}:{self.attr}"


def nan_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and unbiased std (Bessel) of `values`, NaN ignored; NaN mean for none, NaN std for fewer than 2
    (TRL's `torch.nanmean` and `nanstd`, trl/trainer/utils.py)."""
    vals = [float(v) for v in values if not math.isnan(float(v))]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def weighted_rewards(per_function: list[list[float | None]], weights: list[float]) -> tuple[list[float], list[bool]]:
    """TRL's combination: reward_i = nansum_f(value_fi * w_f), None as NaN; (rewards, unscorable) where
    unscorable_i says every function returned None for sample i (its reward is then 0)."""
    n = len(per_function[0]) if per_function else 0
    rewards, unscorable = [], []
    for i in range(n):
        terms = [values[i] * w for values, w in zip(per_function, weights) if values[i] is not None]
        rewards.append(float(sum(terms)) if terms else 0.0)
        unscorable.append(not terms)
    return rewards, unscorable


# ------------------------------------------------------------------------------------------------ loading
def _fail(label: str, problem: str) -> SmdInputError:
    return SmdInputError(f"reward.function: {label}: {problem}")


def _last_line(exc: BaseException) -> str:
    """The exception's last line ("ValueError: ..."); a SyntaxError keeps its file name and line number."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({Path(exc.filename or '?').name}, line {exc.lineno})"
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _split_source(source: str) -> tuple[str, str]:
    # "dir/rewards.py:accuracy" -> ("dir/rewards.py", "accuracy"); no ":name" -> verl's default compute_score
    path, sep, attr = source.rpartition(":")
    if not sep or "/" in attr or "\\" in attr or attr.endswith(".py"):
        return source, VERL_DEFAULT_NAME
    return path, attr


def _resolve(path_text: str, base_dir: Path | None) -> Path:
    path = Path(path_text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path.resolve()


def _load_module(path: Path, label: str):
    """Execute the file as its own module (a name derived from its path, never the bare file name, and taken out
    of sys.modules again so two files called rewards.py never shadow each other)."""
    name = "smd_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _fail(label, f"cannot import {path} as Python")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules only while it runs (dataclasses and pickle look their module up there during the import).
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - a user file may raise anything, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _fail(label, f"importing {path.name} failed: {_last_line(exc)}") from None
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    return module


def _convention(fn: Callable, label: str) -> str:
    """'verl' or 'trl' from the parameter names; SmdInputError naming the signature otherwise."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise _fail(label, "has no inspectable signature; accepted: " + _accepted("or")) from None
    params = sig.parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional_only = [p.name for p in params if p.kind == p.POSITIONAL_ONLY]
    required = {
        p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    if not positional_only:
        if set(_VERL_REQUIRED) <= named and required <= set(_VERL_KEYWORDS):
            return "verl"
        if ("prompts" in named or "completions" in named) and not (named & set(_VERL_REQUIRED)):
            return "trl"
    raise _fail(label, f"signature {fn.__name__ if hasattr(fn, '__name__') else 'fn'}{sig} is neither " + _accepted("nor"))


def _accepted(joiner: str) -> str:
    return f"verl's {VERL_SIGNATURE} {joiner} TRL's {TRL_SIGNATURE}"


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be a reward file (one wording for every command that reads one), or None."""
    if path.is_dir():
        return f"{path} is a directory, not a Python file"
    if not path.is_file():
        return f"no such file {path}"
    return None


def source_label(source: str) -> str:
    """FILE:FUNCTION of a `reward.function` entry (verl's default name when it has none), for error lines."""
    return source if ":" in source else f"{source}:{VERL_DEFAULT_NAME}"


def _load_callable(path: Path, attr: str, label: str) -> Callable:
    problem = file_problem(path)
    if problem:
        raise _fail(label, problem)
    module = _load_module(path, label)
    if not hasattr(module, attr):
        defined = sorted(
            n for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise _fail(label, f"{path.name} defines no {attr!r} (it defines: {', '.join(defined) or 'no functions'})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise _fail(label, f"{attr!r} in {path.name} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
        raise _fail(label, "is an async function; accepted: a plain def, " + _accepted("or"))
    return fn


# Functions load_reward_functions imported in this process, by (path, attr, digest): a scorer in the same process
# reuses them instead of running the file's top level a second time (pool workers load their own).
_LOADED: dict[tuple[Path, str, str], Callable] = {}


def _math_verify_version() -> str:
    try:
        from importlib.metadata import version

        import math_verify  # noqa: F401

        return version("math-verify")
    except ImportError:
        raise SmdInputError(MATH_EXTRA_HINT) from None


def load_reward_functions(sources: list[str], base_dir: Path | None = None) -> list[RewardFunctionSpec]:
    """Check and describe each `path/to/file.py:name` (or `math_verify`); relative paths from `base_dir`.

    Each file is imported here (as its own module), its attribute must exist and be callable, with verl's or
    TRL's signature (module docstring). The digest is the sha256 of the file's bytes. Names are the function
    names, made unique with "#2", "#3" (TRL names functions by `__name__` too). Errors: SmdInputError, one line.
    """
    if not sources:
        raise SmdInputError("reward.function: no reward function given")
    specs: list[RewardFunctionSpec] = []
    seen: dict[str, int] = {}
    for source in sources:
        source = str(source).strip()
        if source in (BUILTIN_MATH_VERIFY, BUILTIN_MATH_VERIFY_VERL):
            path, attr, convention = None, source, "verl"
            digest = f"builtin:{source}@{_math_verify_version()}"
        else:
            path_text, attr = _split_source(source)
            label = source if ":" in source else f"{source}:{attr}"
            if not path_text or not attr.isidentifier():
                raise _fail(source, "expected 'path/to/file.py:function' or 'math_verify'")
            path = _resolve(path_text, base_dir)
            fn = _load_callable(path, attr, label)
            convention = _convention(fn, label)
            digest = file_sha256(path)
            _LOADED[(path, attr, digest)] = fn
        seen[attr] = seen.get(attr, 0) + 1
        name = attr if seen[attr] == 1 else f"{attr}#{seen[attr]}"
        specs.append(RewardFunctionSpec(name, source, path, attr, convention, digest))
    return specs


def _materialize(spec: RewardFunctionSpec) -> Callable:
    if spec.path is None:
        if spec.attr in (BUILTIN_MATH_VERIFY, BUILTIN_MATH_VERIFY_VERL):
            _math_verify_version()
            return math_verify_reward if spec.attr == BUILTIN_MATH_VERIFY else math_verify_verl_reward
        raise _fail(spec.label, "unknown built-in")
    problem = file_problem(spec.path)
    if problem:
        raise _fail(spec.label, problem)
    digest = file_sha256(spec.path)
    if digest != spec.digest:
        raise _fail(spec.label, f"{spec.path.name} changed since it was loaded ({spec.digest[:19]} -> {digest[:19]})")
    cached = _LOADED.get((spec.path, spec.attr, digest))
    return cached if cached is not None else _load_callable(spec.path, spec.attr, spec.label)


# ------------------------------------------------------------------------------------------ the built-in
def math_verify_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float | None:
    """Built-in `math_verify`: HF math-verify exactly as TRL's `accuracy_reward` (trl/rewards/accuracy_rewards.py).

    The gold is parsed with math-verify's default extraction (`parse(gold)`); an unparseable gold gives None
    (TRL: "skip the example"). The completion is parsed with `LatexExtractionConfig(normalization_config=
    NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False)`,
    `extraction_mode="first_match"`, and `verify(gold, answer)` gives 1.0 or 0.0. Timeouts as TRL: parse 10 s,
    verify 5 s in the main thread (math-verify times out with signal.alarm), none in other threads.

    GSM8K golds ("#### 72", "72", a full solution ending "#### 1,000") parse under this path unchanged (checked by
    scripts/math_verify_disagreements.py and the tests), so there is no gsm8k fallback. A completion must carry
    a LaTeX anchor (`\\boxed{}`, or `$...$` after "answer is"): a bare "#### 72" or "72" scores 0, as in TRL.
    """
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    parsing_timeout, verify_timeout = (10, 5) if main else (None, None)
    gold = parse(str(ground_truth), parsing_timeout=parsing_timeout)
    if len(gold) == 0:
        return None
    answer = parse(
        solution_str,
        extraction_config=[
            LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ],
        extraction_mode="first_match",
        parsing_timeout=parsing_timeout,
    )
    return float(verify(gold, answer, timeout_seconds=verify_timeout))


_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def math_verify_verl_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Built-in `math_verify_verl`: verl's math-verify rule (verl/utils/reward_score/math_verify.py `compute_score`).

    `math_metric(gold_extraction_target=(LatexExtractionConfig(),), pred_extraction_target=(ExprExtractionConfig(),
    LatexExtractionConfig()))` on `"\\boxed{" + gold + "}"` and the completion; any exception scores 0 (verl's
    `except Exception: pass`). Unlike TRL's rule it reads a completion without a LaTeX anchor ("#### 72", "72",
    "1,000 dollars"). verl's gsm8k data hold the bare final number, which its preprocessing extracts
    (examples/data_preprocess/gsm8k.py `extract_solution`: the number after "#### ", commas removed); a gold that
    still has a "#### N" is reduced the same way here (the last one), any other gold is used as given. The
    "could not extract a prediction" warning math-verify logs per such completion is silenced (ERROR level), as
    TRL silences math-verify's loggers in worker threads.
    """
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    logging.getLogger("math_verify.metric").setLevel(logging.ERROR)
    gold = str(ground_truth)
    finals = _GSM8K_FINAL.findall(gold)
    if finals:
        gold = finals[-1].replace(",", "")
    verify_func = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    try:
        score, _ = verify_func(["\\boxed{" + gold + "}"], [solution_str])
    except Exception:  # noqa: BLE001 - verl scores any failure (no gold, timeout) 0
        return 0.0
    return float(score)


# ------------------------------------------------------------------------------------------ evaluation
@dataclass(frozen=True)
class _Failure:
    """An error line with its sort key (function index, row index): the first in that order is raised."""

    fn_index: int
    row: int
    message: str


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def _check_value(value: Any, label: str, prompt_id: str) -> float | None:
    """A reward: None, or a finite real (bool, int, float, numpy scalar, 0-d tensor)."""
    if value is None:
        return None
    if not _is_real(value) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if not _is_real(value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise _fail(label, f"returned {shown} ({type(value).__name__}) for row {prompt_id}; "
                    "a reward is a finite number or None")
    out = float(value)
    if not math.isfinite(out):
        raise _fail(label, f"returned {out} for row {prompt_id}; a reward is a finite number or None")
    return out


def _accepts(fn: Callable) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params}, any(p.kind == p.VAR_KEYWORD for p in params)


def _verl_extra_info(columns: dict[str, Any]) -> Any:
    # verl: extra_info = non_tensor_batch.get("extra_info", {}); extra_info["num_turns"] = ...;
    # extra_info["rollout_reward_scores"] = ... (verl/workers/reward_manager/naive.py)
    info = columns.get("extra_info")
    if info is None:
        info = {}
    if isinstance(info, dict):
        info = dict(info)
        info.setdefault("num_turns", None)
        info.setdefault("rollout_reward_scores", {})
    return info


# A call that runs this long prints a line (and again each time as long again), as does a batch that scores this long.
PROGRESS_EVERY_S = 30.0


class _CallTimeout(BaseException):
    """Raised inside a reward call that ran past reward.timeout_s (a BaseException: a function's own `except
    Exception`, as verl's math_verify has, does not swallow it)."""


class _Clock:
    """Per call: reward.timeout_s and a progress line while a call runs long (SIGALRM from an interval timer, in
    the main thread of the process that calls: the stage's, or a pool worker's). A built-in, or a call outside the
    main thread, runs without it (math-verify sets its own alarms; signals reach only the main thread). A function
    stuck in C code that never returns to Python (a catastrophic regular expression) is not interrupted here;
    with reward.workers > 0 the stage kills the worker (RewardScorer.result)."""

    def __init__(self, label: str, timeout_s: float | None, builtin: bool, rows: int):
        self.label, self.timeout_s, self.rows = label, timeout_s, rows
        self.on = not builtin and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.t0 = self.last = time.monotonic()

    def scored(self, done: int) -> None:
        """After a row (or batch): a progress line when the batch has scored long."""
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"reward.function: {self.label}: {done} of {self.rows} rows scored in {now - self.t0:.0f} s",
                  file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def call(self, what: str):
        """Time one call (`what`: "row train-3" or "the batch of rows ..."): _CallTimeout past the timeout."""
        if not self.on:
            yield
            return
        start = time.monotonic()

        def next_alarm() -> float:
            elapsed = time.monotonic() - start
            to_progress = PROGRESS_EVERY_S - elapsed % PROGRESS_EVERY_S
            if self.timeout_s is None:
                return to_progress
            return max(1e-3, min(to_progress, self.timeout_s - elapsed))

        def on_alarm(signum, frame):
            elapsed = time.monotonic() - start
            if self.timeout_s is not None and elapsed >= self.timeout_s - 1e-3:
                raise _CallTimeout()
            limit = f"reward.timeout_s={self.timeout_s:g}" if self.timeout_s is not None else "no reward.timeout_s"
            print(f"reward.function: {self.label}: {what} still running after {elapsed:.0f} s ({limit})",
                  file=sys.stderr, flush=True)
            signal.setitimer(signal.ITIMER_REAL, next_alarm())

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, next_alarm())
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _timed_out(label: str, timeout_s: float | None, what: str) -> SmdInputError:
    return _fail(label, f"no result for {what} within reward.timeout_s={timeout_s:g} s (a call that hangs, or set "
                 "reward.timeout_s higher, or null for none)")


def _run_verl(fn: Callable, label: str, name: str, samples: list[RewardSample], default_data_source: str,
              clock: _Clock):
    """Values and extras of a verl per-sample function over `samples`, or raises (_RowError)."""
    accepted, var_kw = _accepts(fn)
    pass_extra = var_kw or "extra_info" in accepted
    values: list[float | None] = []
    extras: dict[str, list[Any]] = {}  # raw key -> one value per row so far (None where absent)
    for i, s in enumerate(samples):
        kwargs = {
            "data_source": s.columns.get("data_source", default_data_source),
            "solution_str": s.completion,
            "ground_truth": s.reference,
        }
        if pass_extra:
            kwargs["extra_info"] = _verl_extra_info(s.columns)
        try:
            with clock.call(f"row {s.prompt_id}"):
                out = fn(**kwargs)
        except _CallTimeout:
            raise _RowError(i, _timed_out(label, clock.timeout_s, f"row {s.prompt_id}")) from None
        except Exception as exc:  # noqa: BLE001 - the user's function
            raise _RowError(i, _fail(label, f"raised on row {s.prompt_id}: {_last_line(exc)}")) from None
        clock.scored(i + 1)
        score, row_extras = out, {}
        if isinstance(out, dict):
            if "score" not in out:
                keys = ", ".join(map(str, out)) or "none"
                raise _RowError(i, _fail(label, f"returned a dict without 'score' for row {s.prompt_id} (keys: {keys})"))
            score = out["score"]
            row_extras = {str(k): v for k, v in out.items() if k != "score"}
        try:
            values.append(_check_value(score, label, s.prompt_id))
        except SmdInputError as err:
            raise _RowError(i, err) from None
        for key in row_extras:
            extras.setdefault(key, [None] * i)
        for key, column in extras.items():
            column.append(row_extras.get(key))
    return values, {f"{name}/{key}": column for key, column in extras.items()}


class _RowError(Exception):
    def __init__(self, row: int, error: SmdInputError):
        super().__init__(row, str(error))
        self.row = row
        self.error = error


def _trl_inputs(samples: list[RewardSample]) -> tuple[list, list, list, dict[str, list]]:
    conversational = bool(samples) and _is_conversational(samples[0].prompt)
    prompts = [s.prompt for s in samples]
    if conversational:
        completions = [[{"role": "assistant", "content": s.completion}] for s in samples]
    else:
        completions = [s.completion for s in samples]
    ids = [list(s.completion_ids) for s in samples]
    keys: list[str] = []
    for s in samples:
        keys.extend(k for k in s.columns if k not in keys and k not in ("prompt", "completion", "completion_ids"))
    columns = {k: [s.columns.get(k) for s in samples] for k in keys}
    return prompts, completions, ids, columns


def _is_conversational(prompt: Any) -> bool:
    # TRL's is_conversational: a list of dicts with "role" and "content" (trl/data_utils.py)
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def _call_trl(fn: Callable, samples: list[RewardSample]) -> Any:
    prompts, completions, ids, columns = _trl_inputs(samples)
    # TRL's own keywords win over a column of the same name (TRL itself would fail on the clash)
    kwargs = {**columns, "prompts": prompts, "completions": completions, "completion_ids": ids}
    accepted, var_kw = _accepts(fn)
    if not var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return fn(**kwargs)


def _run_trl(fn: Callable, label: str, samples: list[RewardSample], clock: _Clock) -> list[float | None]:
    """Values of a TRL batched function over `samples` (one call), or raises _RowError."""
    ids = [s.prompt_id for s in samples]
    shown = ", ".join(ids[:5]) + (f", ... ({len(ids)} rows)" if len(ids) > 5 else "")
    try:
        with clock.call(f"the batch of rows {shown}"):
            out = _call_trl(fn, samples)
    except (Exception, _CallTimeout) as exc:  # noqa: BLE001 - the user's function
        timed_out = isinstance(exc, _CallTimeout)
        for i, s in enumerate(samples):  # name the first row that fails (or hangs) alone
            try:
                with clock.call(f"row {s.prompt_id}"):
                    _call_trl(fn, [s])
            except _CallTimeout:
                raise _RowError(i, _timed_out(label, clock.timeout_s, f"row {s.prompt_id}")) from None
            except Exception as row_exc:  # noqa: BLE001
                raise _RowError(i, _fail(label, f"raised on row {s.prompt_id}: {_last_line(row_exc)}")) from None
        if timed_out:
            raise _RowError(0, _timed_out(label, clock.timeout_s, f"the batch of rows {shown}")) from None
        raise _RowError(0, _fail(label, f"raised on the batch of rows {shown} but on no row alone: "
                                 f"{_last_line(exc)}")) from None
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise _RowError(0, _fail(label, f"returned {type(out).__name__}; TRL's convention returns a list of "
                                 f"{len(samples)} floats or None"))
    if len(out) != len(samples):
        first = samples[0].prompt_id if samples else "-"
        raise _RowError(0, _fail(label, f"returned {len(out)} values for a batch of {len(samples)} "
                                 f"(rows {first} ...); one per completion"))
    values = []
    for i, (value, s) in enumerate(zip(out, samples)):
        try:
            values.append(_check_value(value, label, s.prompt_id))
        except SmdInputError as err:
            raise _RowError(i, err) from None
    return values


def _evaluate(
    fns: list[tuple[int, RewardFunctionSpec, Callable]], samples: list[RewardSample], offset: int,
    default_data_source: str, timeout_s: float | None = None,
) -> tuple[dict[int, list[float | None]], dict[str, list[Any]], _Failure | None]:
    """Run each (index, spec, fn) on `samples` (rows offset..), in order; stop at the first failure."""
    values: dict[int, list[float | None]] = {}
    extras: dict[str, list[Any]] = {}
    for index, spec, fn in fns:
        clock = _Clock(spec.label, timeout_s, spec.path is None, len(samples))
        try:
            if spec.convention == "verl":
                values[index], fn_extras = _run_verl(fn, spec.label, spec.name, samples, default_data_source, clock)
                extras.update(fn_extras)
            else:
                values[index] = _run_trl(fn, spec.label, samples, clock)
        except _RowError as err:
            return values, extras, _Failure(index, offset + err.row, str(err.error))
    return values, extras, None


# ------------------------------------------------------------------------------------- the pool worker
_WORKER: dict[str, Any] = {}


def _worker_init(specs: list[RewardFunctionSpec]) -> None:
    """Pool initializer: load every function by path (errors kept and reported by the first task)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        _WORKER["fns"] = [_materialize(spec) for spec in specs]
    except SmdInputError as err:
        _WORKER["error"] = str(err)


def _worker_ready() -> tuple[int, str | None]:
    """Pool warm-up task: this worker's pid and its loading error, if any."""
    time.sleep(0.05)  # long enough that each warm-up task lands on its own worker
    return os.getpid(), _WORKER.get("error")


def _worker_task(indices: list[int], samples: list[RewardSample], offset: int, default_data_source: str,
                 specs: list[RewardFunctionSpec], timeout_s: float | None = None):
    if "error" in _WORKER:
        return {}, {}, _Failure(-1, -1, _WORKER["error"])
    fns = [(i, specs[i], _WORKER["fns"][i]) for i in indices]
    return _evaluate(fns, samples, offset, default_data_source, timeout_s)


# ------------------------------------------------------------------------------------------- the scorer
@dataclass
class _Handle:
    n: int
    parts: list[tuple[list[int], int, int, Any]]  # (fn indices, offset, count, Future or finished tuple)


class RewardScorer:
    """Scores batches of RewardSample with the loaded functions (module docstring). A context manager."""

    def __init__(self, specs: list[RewardFunctionSpec], weights: list[float] | None = None, workers: int = 0,
                 default_data_source: str = "dataset", timeout_s: float | None = None):
        if not specs:
            raise SmdInputError("reward.function: no reward function given")
        if weights is None:
            weights = [1.0] * len(specs)
        weights = [float(w) for w in weights]
        if len(weights) != len(specs):
            raise SmdInputError(f"reward.weights: {len(weights)} weights for {len(specs)} reward functions")
        if not all(math.isfinite(w) for w in weights):
            raise SmdInputError(f"reward.weights: every weight must be a finite number, got {weights}")
        if workers < 0:
            raise SmdInputError(f"reward.workers: must be >= 0, got {workers}")
        self.specs = list(specs)
        self.weights = weights
        self.workers = int(workers)
        self.timeout_s = timeout_s  # per call (reward.timeout_s); None: no limit
        self.default_data_source = default_data_source
        self._pool: ProcessPoolExecutor | None = None
        self._fns: list[Callable] | None = None
        if self.workers == 0:
            self._fns = [_materialize(spec) for spec in self.specs]
        else:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init, initargs=(self.specs,),
            )

    def start(self) -> None:
        """Start the pool's workers now (spawn, imports, the functions loaded), so the first batch a stage submits
        does not wait for them and a file that fails to load in a worker is reported before any sampling."""
        if self._pool is None:
            return
        for fut in [self._pool.submit(_worker_ready) for _ in range(self.workers)]:
            _, error = fut.result()
            if error:
                raise SmdInputError(error)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def digests(self) -> dict[str, str]:
        """source -> digest, for the trajectory table's metadata."""
        return {spec.source: spec.digest for spec in self.specs}

    def submit(self, samples: list[RewardSample]) -> _Handle:
        """Start scoring `samples`; with workers > 0 the work is queued in the pool now and this returns at once
        (verl functions: one chunk per worker; TRL functions: the whole batch, one task each)."""
        samples = list(samples)
        n = len(samples)
        verl = [i for i, s in enumerate(self.specs) if s.convention == "verl"]
        trl = [i for i, s in enumerate(self.specs) if s.convention == "trl"]
        if n == 0:  # nothing to score: no function is called
            empty = ({i: [] for i in range(len(self.specs))}, {}, None)
            return _Handle(0, [(list(range(len(self.specs))), 0, 0, empty)])
        if self._pool is None:
            assert self._fns is not None
            fns = [(i, self.specs[i], self._fns[i]) for i in range(len(self.specs))]
            done = _evaluate(fns, samples, 0, self.default_data_source, self.timeout_s)
            return _Handle(n, [(list(range(len(self.specs))), 0, n, done)])
        parts: list[tuple[list[int], int, int, Any]] = []
        if verl:
            size = -(-n // self.workers)
            for start in range(0, n, size):
                chunk = samples[start:start + size]
                fut = self._pool.submit(_worker_task, verl, chunk, start, self.default_data_source, self.specs,
                                        self.timeout_s)
                parts.append((verl, start, len(chunk), fut))
        for i in trl:
            fut = self._pool.submit(_worker_task, [i], samples, 0, self.default_data_source, self.specs,
                                    self.timeout_s)
            parts.append(([i], 0, n, fut))
        return _Handle(n, parts)

    def result(self, handle: _Handle) -> RewardResult:
        """Wait for `handle`'s batch; SmdInputError with the first failure (function order, then row order)."""
        values: dict[int, list[float | None]] = {i: [None] * handle.n for i in range(len(self.specs))}
        extras: dict[str, list[Any]] = {}
        failures: list[_Failure] = []
        for indices, offset, count, part in handle.parts:
            if isinstance(part, Future):
                labels = ", ".join(self.specs[i].label for i in indices)
                self._wait(part, labels, offset, count, len(indices))
                try:
                    part = part.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died (os._exit, a crash)
                    raise SmdInputError(f"reward.function: {labels}: a reward worker process failed: "
                                        f"{_last_line(exc)}") from None
            part_values, part_extras, failure = part
            if failure is not None:
                if failure.fn_index < 0:
                    raise SmdInputError(failure.message)
                failures.append(failure)
                continue
            for i in indices:
                values[i][offset:offset + count] = part_values[i]
            for key, column in part_extras.items():
                full = extras.setdefault(key, [None] * handle.n)
                full[offset:offset + len(column)] = column
        if failures:
            first = min(failures, key=lambda f: (f.fn_index, f.row))
            raise SmdInputError(first.message)
        ordered = [values[i] for i in range(len(self.specs))]
        rewards, unscorable = weighted_rewards(ordered, self.weights)
        per_function = {spec.name: ordered[i] for i, spec in enumerate(self.specs)}
        return RewardResult(rewards, per_function, extras, unscorable)

    def _wait(self, future: Future, labels: str, offset: int, count: int, functions: int) -> None:
        """Wait for a pool task. A worker times each call itself (reward.timeout_s); this is the backstop for a
        call that never returns to Python: past every call's limit plus a minute, the workers are killed and the
        task's rows named."""
        deadline = None if self.timeout_s is None else self.timeout_s * (count * functions + 1) + 60.0
        t0 = time.monotonic()
        while not future.done():
            wait_s = PROGRESS_EVERY_S if deadline is None else min(PROGRESS_EVERY_S, deadline - (time.monotonic() - t0))
            if wait_s <= 0:
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    with contextlib.suppress(Exception):
                        proc.kill()
                raise SmdInputError(f"reward.function: {labels}: no result for rows {offset}..{offset + count - 1} "
                                    f"of the batch within reward.timeout_s={self.timeout_s:g} s per call (the worker "
                                    "did not return to Python; it was killed)")
            try:
                future.result(timeout=wait_s)
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - reported by the caller
                return

    def score(self, samples: list[RewardSample]) -> RewardResult:
        """submit + result."""
        return self.result(self.submit(samples))

    def close(self) -> None:
        """Shut the pool down (pending work cancelled)."""
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
