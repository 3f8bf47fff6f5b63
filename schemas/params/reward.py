"""`reward:` section: how the stages that score a response (rollout, evaluate, the warm start's checks) score it.

By default each task's built-in scorer (`schemas.rewards`). `function` replaces it with reward functions from a
user's file, in verl's per-sample convention (`compute_score(data_source, solution_str, ground_truth,
extra_info=None)`) or TRL's batched one (`f(prompts, completions, completion_ids, **columns)`), or with the
built-in `math_verify` (HF's math-verify, as TRL's `accuracy_reward`); `stages.common.reward_functions`.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Built-in reward function names `function` accepts besides `path.py:name`.
BUILTIN_REWARD_FUNCTIONS: tuple[str, ...] = ("math_verify", "math_verify_verl")


class RewardParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: list[str] = Field(
        default_factory=list,
        description="Reward functions replacing the task's built-in scorer: `path/to/rewards.py:name` (a path "
        "relative to the working directory: the repository root under `dvc repro`; `path.py` alone means verl's "
        "default name `compute_score`) or a built-in name "
        f"{BUILTIN_REWARD_FUNCTIONS}; one string or a list. Empty = the task's built-in scorer (schemas.rewards). "
        "Each function's convention is read from its signature: verl's per-sample `compute_score(data_source, "
        "solution_str, ground_truth, extra_info=None)` returning a number or a dict with `score`, or TRL's "
        "batched `f(prompts, completions, completion_ids, **kwargs)` returning a list of numbers or None. Every "
        "other data set column reaches the function (TRL: as keywords; verl: `data_source`, `extra_info`).",
    )
    weights: list[float] | None = Field(
        None,
        description="One weight per function (TRL's `reward_weights`); null = 1.0 each. The reward is the weighted "
        "sum over functions, a None value counting as nothing (TRL's nansum: a sample that every function "
        "scores None gets 0).",
    )
    workers: int = Field(
        0,
        ge=0,
        le=64,
        description="Processes that run the reward functions (a spawn pool), so a slow verifier scores one batch "
        "while the next one samples; 0 = in the stage's own process, after each batch.",
    )
    timeout_s: float | None = Field(
        300.0,
        gt=0,
        description="Seconds one call of a reward function may take (verl's prime reward manager's per-call "
        "timeout, whose default is 300 s; a verl function is called per sample, a TRL one per batch); past it the "
        "stage stops with one line naming the function and the row, nothing written (verl's prime manager would "
        "score it 0 and go on; smd does not hide a hang). null = no limit. A call or a batch that runs longer than "
        "30 s prints a progress line meanwhile. The built-ins keep math-verify's own timeouts.",
    )
    exact_match_threshold: float = Field(
        1.0,
        description="With reward functions: a response counts as an exact match (evaluate's and the warm start's "
        "`exact_match`) when its reward is at least this. The built-in scorers keep their own rule.",
    )

    @field_validator("function", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("function")
    @classmethod
    def _well_formed(cls, value: list[str]) -> list[str]:
        for source in value:
            if source in BUILTIN_REWARD_FUNCTIONS:
                continue
            path, sep, name = source.rpartition(":")
            if sep and path and name.isidentifier():
                continue
            if not sep and source.endswith(".py"):  # verl's default name: path.py means path.py:compute_score
                continue
            raise ValueError(f"{source!r}: expected path/to/rewards.py:function_name or one of "
                             f"{', '.join(BUILTIN_REWARD_FUNCTIONS)}")
        return value

    @model_validator(mode="after")
    def _weights_match(self) -> RewardParams:
        if self.weights is not None:
            if len(self.weights) != len(self.function):
                raise ValueError(f"weights: {len(self.weights)} weight(s) for {len(self.function)} function(s)")
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError("weights: must be finite numbers")
        return self

    def files(self) -> list[str]:
        """The user files the functions come from (built-ins have none), in order, without repeats."""
        out: list[str] = []
        for source in self.function:
            if source not in BUILTIN_REWARD_FUNCTIONS:
                path = source.rpartition(":")[0] or source
                if path not in out:
                    out.append(path)
        return out
