"""How a stage that scores responses (rollout, evaluate, the warm start's checks) scores them (issue 33).

`Scoring` is the one entry: the task's built-in scorer (`schemas.rewards`) when `reward.function` is empty, else
the user's reward functions (`stages.common.reward_functions`: verl's per-sample or TRL's batched convention,
several with weights, optionally in a process pool). A stage submits each batch as soon as it is decoded and
collects the scores at the end, so a pool scores one batch while the next one samples.

What a reward function receives for a prompt-table row:
- `prompt`: the data set's prompt as given (a string or chat messages, from `row_json`), else the row's prompt text;
- `completion` / `completion_ids`: the decoded response and its token ids;
- `reference`: the row's reference (`ground_truth` for verl);
- `columns`: every other column of the data set row (`row_json`; TRL: as keywords; verl: `data_source`,
  `extra_info`); a built-in task's rows have none, and their `data_source` is the task's name.

`record()` is what a stage writes into its table's metadata: the reward section and each function's digest
(`sha256` of its file), so a rescored or edited reward is visible in the artifacts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import rewards
from schemas.params.reward import RewardParams
from schemas.weights import file_sha256


@dataclass
class Scored:
    """Scores of a list of responses, in order."""

    rewards: list[float]
    exact_match: list[bool]
    terms: list[str] | None  # per row, each function's value as JSON {name: value or null}; None for built-ins
    # per row, a verl dict return's other keys as JSON {"<fn>/<key>": value} (None for a row without); None: no
    # function returned any (verl's reward_extra_info)
    extras: list[str | None] | None = None


def _row(prompt: dict[str, Any]) -> dict[str, Any] | None:
    raw = prompt.get("row_json")
    return json.loads(raw) if raw else None


class Scoring:
    """The stage's scorer (module docstring); a context manager (closes the pool)."""

    def __init__(self, reward: RewardParams, prompt_key: str = "prompt", base_dir: Path | None = None):
        self.params = reward
        self.prompt_key = prompt_key
        self.scorer = None
        self.specs: list = []
        if reward.function:
            from stages.common.reward_functions import RewardScorer, load_reward_functions

            self.specs = load_reward_functions(reward.function, base_dir)
            self.scorer = RewardScorer(self.specs, reward.weights, reward.workers, timeout_s=reward.timeout_s)
            self.scorer.start()  # a pool's workers up before the stage's clock starts
    def __enter__(self) -> Scoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()

    def record(self) -> dict[str, Any]:
        """The reward section and the functions' digests, for a table's or a metrics file's config."""
        digests = self.scorer.digests() if self.scorer is not None else {}
        return {"reward": self.params.model_dump(mode="json"), "reward_digests": digests}

    def metric_name(self, task: str) -> str:
        """What `rewards` measure: the task's metric, or the reward functions' names."""
        if self.scorer is None:
            return rewards.metric_name(task)
        return "reward:" + "+".join(spec.name for spec in self.specs)

    def samples(self, prompts: list[dict[str, Any]], texts: list[str], ids: list[list[int]]) -> list:
        """The reward functions' inputs for prompt-table rows and their responses (module docstring)."""
        from stages.common.reward_functions import RewardSample

        out = []
        for prompt, text, completion_ids in zip(prompts, texts, ids, strict=True):
            row = _row(prompt)
            if row is None:
                given, columns = prompt["prompt"], {"data_source": prompt["task"]}
            else:
                given = row.get(self.prompt_key, prompt["prompt"])
                columns = {k: v for k, v in row.items() if k != self.prompt_key}
            out.append(RewardSample(prompt_id=prompt["prompt_id"], prompt=given, completion=text,
                                    completion_ids=list(completion_ids), reference=prompt["reference"],
                                    columns=columns))
        return out

    def submit(self, prompts: list[dict[str, Any]], texts: list[str], ids: list[list[int]]) -> Any:
        """Start scoring (a pool starts at once; in-process scoring runs now); `result` collects it."""
        if self.scorer is None:
            return Scored([float(rewards.score(p["task"], t, p["reference"])) for p, t in zip(prompts, texts)],
                          [bool(rewards.exact_match(p["task"], t, p["reference"])) for p, t in zip(prompts, texts)],
                          None)
        return self.scorer.submit(self.samples(prompts, texts, ids))

    def result(self, handle: Any) -> Scored:
        if isinstance(handle, Scored):
            return handle
        out = self.scorer.result(handle)
        threshold = self.params.exact_match_threshold
        names = list(out.per_function)
        terms = [json.dumps({name: out.per_function[name][i] for name in names}) for i in range(len(out.rewards))]
        extras = None
        if out.extras:
            rows = [{key: _jsonable(column[i]) for key, column in out.extras.items() if column[i] is not None}
                    for i in range(len(out.rewards))]
            extras = [json.dumps(row) if row else None for row in rows]
        return Scored([float(r) for r in out.rewards], [r >= threshold for r in out.rewards], terms, extras)

    def score(self, prompts: list[dict[str, Any]], texts: list[str], ids: list[list[int]]) -> Scored:
        return self.result(self.submit(prompts, texts, ids))


def _jsonable(value: Any) -> Any:
    """A verl extra as JSON: numbers, bools, strings and None as they are (a numpy scalar as its item), anything
    else as its text."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not (isinstance(value, float) and value != value) else None
    return str(value)


def concat(parts: list[Scored]) -> Scored:
    """Scores of several submitted batches, in submission order."""
    terms = None if any(p.terms is None for p in parts) else [t for p in parts for t in p.terms]
    extras = None
    if any(p.extras is not None for p in parts):
        extras = [e for p in parts for e in (p.extras if p.extras is not None else [None] * len(p.rewards))]
    return Scored([r for p in parts for r in p.rewards], [e for p in parts for e in p.exact_match], terms, extras)


def term_means(terms: list[str | None], extras: list[str | None] | None = None) -> dict[str, float]:
    """TRL's per-function log lines over rows' `reward_terms`: `rewards/<name>/mean` and `rewards/<name>/std` over
    the values that are not None (TRL's `nanmean` / `nanstd`, trl/trainer/utils.py: the std with Bessel's
    correction), plus `rewards/<name>/none_fraction` (the rows it scored None); and over rows' `reward_extras`
    (a verl dict return's other keys), `rewards/<fn>/<key>/mean` of each numeric key (a bool as 0/1), over the rows
    that have it, as verl averages its `reward_extra_info`."""
    from stages.common.reward_functions import nan_mean_std

    values: dict[str, list[float | None]] = {}
    for raw in terms:
        if raw is None:
            continue
        for name, value in json.loads(raw).items():
            values.setdefault(name, []).append(value)
    out: dict[str, float] = {}
    for name, vals in values.items():
        present = [float(v) for v in vals if v is not None]
        mean, std = nan_mean_std(present)
        if present:  # (no key rather than a NaN, which JSON metrics files cannot hold)
            out[f"rewards/{name}/mean"] = mean
        if len(present) > 1:
            out[f"rewards/{name}/std"] = std
        out[f"rewards/{name}/none_fraction"] = 1 - len(present) / len(vals)
    numeric: dict[str, list[float]] = {}
    for raw in extras or []:
        for key, value in (json.loads(raw) if raw else {}).items():
            if isinstance(value, (bool, int, float)):
                numeric.setdefault(key, []).append(float(value))
    for key, vals in numeric.items():
        out[f"rewards/{key}/mean"] = sum(vals) / len(vals)
    return out


def reward_file_digests(reward: RewardParams, base_dir: Path | None = None) -> dict[str, str]:
    """`sha256:<hex>` of the bytes of each user file `reward.function` names (built-ins have none), relative paths
    taken from `base_dir` (default: the working directory); one line for a file that is missing."""
    from schemas.errors import SmdInputError
    from stages.common.reward_functions import file_problem, source_label

    out = {}
    for name in reward.files():
        path = Path(name) if base_dir is None or Path(name).is_absolute() else Path(base_dir) / name
        problem = file_problem(path.resolve())
        if problem:  # the line load_reward_functions gives for the first function from this file
            source = next(s for s in reward.function if (s.rpartition(":")[0] or s) == name)
            raise SmdInputError(f"reward.function: {source_label(source)}: {problem}")
        out[name] = file_sha256(path)
    return out


def reward_record(reward: RewardParams, base_dir: Path | None = None) -> dict[str, Any]:
    """What a run's scores depend on besides the data and the policy: the functions, weights and file digests."""
    return {"function": list(reward.function), "weights": reward.weights,
            "exact_match_threshold": reward.exact_match_threshold, "files": reward_file_digests(reward, base_dir)}


def write_reward_record(reward: RewardParams, out: Path) -> Path:
    """`smdctl reward-files`: write `reward_record` as JSON (atomically). dvc.yaml runs it every time
    (`always_changed`); its output changes only when a reward file or the functions change, and the stages that
    score depend on it, so editing a reward file reruns exactly them."""
    from schemas.atomic import atomic_path

    record = reward_record(reward)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def check_reward_record(reward: RewardParams, recorded: Path, started: bool = True) -> None:
    """A resumed run scores as it started: one line when a reward file or function changed since `recorded` was
    written (`smdctl chain` / `compare`); writes it on a run's first start, and again while the run has not
    `started` (no iteration scored yet: a first start that failed is retried with the reward as it is now)."""
    from schemas.errors import SmdInputError

    now = reward_record(reward)
    if not Path(recorded).is_file() or not started:
        write_reward_record(reward, recorded)
        return
    try:
        then = json.loads(Path(recorded).read_text())
    except (OSError, ValueError) as exc:
        raise SmdInputError(f"{recorded}: unreadable reward record ({exc.__class__.__name__})") from exc
    for name, digest in now["files"].items():
        if then.get("files", {}).get(name, digest) != digest:
            raise SmdInputError(f"{name}: reward.function: the file changed since this run started (recorded in "
                                f"{recorded}: {then['files'][name][:19]}, now {digest[:19]}); restore it or start "
                                "a new run directory")
    if {k: v for k, v in then.items() if k != "files"} != {k: v for k, v in now.items() if k != "files"} or \
            set(then.get("files", {})) != set(now["files"]):
        raise SmdInputError(f"{recorded}: reward: the reward functions changed since this run started "
                            f"({then.get('function')} -> {now['function']}); start a new run directory")
