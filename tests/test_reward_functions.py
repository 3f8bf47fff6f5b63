"""User reward functions (stages/common/reward_functions.py, issue 33): verl's and TRL's conventions, TRL's
weighted nansum with None, one-line errors, the process pool, the built-in math_verify."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from schemas.errors import SmdInputError
from stages.common.reward_functions import (
    MATH_EXTRA_HINT,
    RewardResult,
    RewardSample,
    RewardScorer,
    load_reward_functions,
    weighted_rewards,
)

REWARDS = """
import json, os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # hand-checkable: 1 for an exact answer, plus a tenth of the completion's length
    return float(solution_str == ground_truth) + len(solution_str) / 10


def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "plain":
        return 0.25
    return {"score": 1.0 if solution_str == ground_truth else 0.0, "length": len(solution_str), "src": data_source}


def echo_verl(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["SMD_TEST_DUMP"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return None


def echo_trl(prompts, completions, completion_ids, **kwargs):
    with open(os.environ["SMD_TEST_DUMP"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                            **kwargs}) + "\\n")
    return [None] * len(prompts)


def length_trl(prompts, completions, completion_ids, **kwargs):
    # hand-checkable: the number of completion tokens, None for an empty completion
    return [len(ids) if ids else None for ids in completion_ids]


def solution_trl(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def verl_raises(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ValueError("cannot score boom")
    return 1.0


def trl_raises(prompts, completions, completion_ids, **kwargs):
    if "boom" in completions:
        raise KeyError("boom")
    return [1.0] * len(completions)


def trl_raises_in_batch(prompts, completions, completion_ids, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("batch too large")
    return [1.0]


def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if solution_str == "bad" else 1.0


def returns_inf(prompts, completions, completion_ids, **kwargs):
    return [float("inf") if c == "bad" else 1.0 for c in completions]


def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0" if solution_str == "bad" else 1.0


def wrong_length(prompts, completions, completion_ids, **kwargs):
    return [1.0] * (len(completions) + 1)


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"reward": 1.0}


def wrong_signature(text, answer):
    return 1.0


def _make_closure(bonus):
    def scored(data_source, solution_str, ground_truth, extra_info=None):
        return bonus + len(solution_str)
    return scored


closure_verl = _make_closure(0.5)  # a closure: not picklable, so a pool must load it by path


async def async_trl(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def only_kwargs(**kwargs):
    return 1.0


NOT_CALLABLE = 3
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def _samples(completions, references=None, prompt="What?", columns=None) -> list[RewardSample]:
    references = references or [""] * len(completions)
    return [
        RewardSample(
            f"row-{i}", prompt, c, list(range(len(c))), r, dict(columns[i]) if columns else {}
        )
        for i, (c, r) in enumerate(zip(completions, references))
    ]


def _score(path: Path, names: list[str], samples, weights=None, workers=0) -> RewardResult:
    specs = load_reward_functions([f"{path}:{n}" for n in names])
    with RewardScorer(specs, weights, workers=workers) as scorer:
        return scorer.score(samples)


# --------------------------------------------------------------------------------------------- conventions
def test_verl_convention_hand_checked_values_and_spec(rewards_file):
    specs = load_reward_functions([f"{rewards_file}:compute_score", f"{rewards_file}:length_trl"])
    assert [(s.name, s.convention, s.attr) for s in specs] == [
        ("compute_score", "verl", "compute_score"),
        ("length_trl", "trl", "length_trl"),
    ]
    digest = "sha256:" + hashlib.sha256(rewards_file.read_bytes()).hexdigest()
    assert all(s.digest == digest and s.path == rewards_file for s in specs)
    result = _score(rewards_file, ["compute_score"], _samples(["42", "7", ""], ["42", "8", ""]))
    # "42" == "42": 1 + 2/10; "7" != "8": 1/10; "" == "": 1 + 0
    assert result.per_function["compute_score"] == pytest.approx([1.2, 0.1, 1.0])
    assert result.rewards == pytest.approx([1.2, 0.1, 1.0])
    assert result.extras == {}


def test_verl_default_name_and_relative_path(rewards_file):
    (spec,) = load_reward_functions(["rewards.py"], base_dir=rewards_file.parent)
    assert (spec.attr, spec.convention, spec.path) == ("compute_score", "verl", rewards_file)


def test_verl_keywords_as_verl_passes_them(rewards_file, tmp_path, monkeypatch):
    dump = tmp_path / "dump.jsonl"
    monkeypatch.setenv("SMD_TEST_DUMP", str(dump))
    columns = [{"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3}}, {}]
    result = _score(rewards_file, ["echo_verl"], _samples(["a", "b"], ["1", "2"], columns=columns))
    assert result.per_function["echo_verl"] == [None, None] and result.rewards == [0.0, 0.0]
    assert result.unscorable == [True, True]
    calls = [json.loads(line) for line in dump.read_text().splitlines()]
    assert calls == [
        # verl's NaiveRewardManager: extra_info from the row, num_turns and rollout_reward_scores added
        {"data_source": "openai/gsm8k", "solution_str": "a", "ground_truth": "1",
         "extra_info": {"split": "train", "index": 3, "num_turns": None, "rollout_reward_scores": {}}},
        {"data_source": "dataset", "solution_str": "b", "ground_truth": "2",
         "extra_info": {"num_turns": None, "rollout_reward_scores": {}}},
    ]


def test_trl_convention_passes_columns_as_lists_and_standard_completions(rewards_file, tmp_path, monkeypatch):
    dump = tmp_path / "dump.jsonl"
    monkeypatch.setenv("SMD_TEST_DUMP", str(dump))
    columns = [{"solution": "4", "level": 1}, {"solution": "5", "level": 2}]
    _score(rewards_file, ["echo_trl"], _samples(["4", "no"], columns=columns, prompt="2+2?"))
    (call,) = [json.loads(line) for line in dump.read_text().splitlines()]
    assert call == {"prompts": ["2+2?", "2+2?"], "completions": ["4", "no"], "completion_ids": [[0], [0, 1]],
                    "solution": ["4", "5"], "level": [1, 2]}


def test_trl_conversational_prompt_gives_message_completions(rewards_file, tmp_path, monkeypatch):
    dump = tmp_path / "dump.jsonl"
    monkeypatch.setenv("SMD_TEST_DUMP", str(dump))
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    _score(rewards_file, ["echo_trl"], _samples(["4"], prompt=prompt))
    (call,) = [json.loads(line) for line in dump.read_text().splitlines()]
    assert call["prompts"] == [prompt]
    assert call["completions"] == [[{"role": "assistant", "content": "4"}]]  # TRL's message form


def test_trl_without_kwargs_gets_only_what_it_names(rewards_file):
    result = _score(rewards_file, ["solution_trl"], _samples(["4", "x"], columns=[{"solution": "4"}, {"solution": "5"}]))
    assert result.per_function["solution_trl"] == [1.0, 0.0]


def test_verl_dict_return_score_and_extras(rewards_file):
    result = _score(rewards_file, ["with_extras"], _samples(["7", "plain", "xyz"], ["7", "", "8"]))
    assert result.per_function["with_extras"] == [1.0, 0.25, 0.0]
    assert result.extras == {
        "with_extras/length": [1, None, 3],
        "with_extras/src": ["dataset", None, "dataset"],
    }
    means = result.logged_means()
    assert means["rewards/with_extras/length/mean"] == pytest.approx(2.0)  # over the rows that gave it
    assert "rewards/with_extras/src/mean" not in means  # not numeric


# ------------------------------------------------------------------------------------ weights and None
def test_weighted_nansum_matches_an_independent_computation():
    rng = np.random.default_rng(7)
    values = rng.normal(size=(40, 3))
    values[rng.random(values.shape) < 0.35] = np.nan
    values[5] = np.nan  # every function None
    weights = [1.0, -0.5, 2.0]
    per_function = [[None if math.isnan(v) else float(v) for v in values[:, f]] for f in range(3)]
    rewards, unscorable = weighted_rewards(per_function, weights)
    want = np.nansum(values * np.array(weights)[None, :], axis=1)  # TRL: (rewards_per_func * w).nansum(dim=1)
    np.testing.assert_allclose(rewards, want, rtol=0, atol=1e-12)
    assert rewards[5] == 0.0 and unscorable[5] is True
    assert unscorable == list(np.isnan(values).all(axis=1))
    result = RewardResult(rewards, {f"f{f}": per_function[f] for f in range(3)}, {}, unscorable)
    means = result.logged_means()
    for f in range(3):
        col = values[:, f]
        assert means[f"rewards/f{f}/mean"] == pytest.approx(np.nanmean(col))
        assert means[f"rewards/f{f}/std"] == pytest.approx(np.nanstd(col, ddof=1))  # TRL's nanstd: Bessel


def test_scorer_weights_and_none_hand_checked(rewards_file):
    samples = _samples(["42", ""], ["42", "x"])
    result = _score(rewards_file, ["compute_score", "length_trl"], samples, weights=[2.0, 0.5])
    # row 0: 2 * (1 + 0.2) + 0.5 * 2 tokens = 3.4; row 1: 2 * 0 + None (empty) = 0
    assert result.per_function == {"compute_score": pytest.approx([1.2, 0.0]), "length_trl": [2.0, None]}
    assert result.rewards == pytest.approx([3.4, 0.0])
    assert result.unscorable == [False, False]
    means = result.logged_means()
    assert means["rewards/length_trl/mean"] == 2.0 and math.isnan(means["rewards/length_trl/std"])


def test_same_name_in_two_files_is_isolated_and_renamed(tmp_path):
    for d, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "rewards.py").write_text(
            f"def accuracy(data_source, solution_str, ground_truth, extra_info=None):\n    return {value}\n"
        )
    before = set(sys.modules)
    specs = load_reward_functions([f"{tmp_path}/a/rewards.py:accuracy", f"{tmp_path}/b/rewards.py:accuracy"])
    assert [s.name for s in specs] == ["accuracy", "accuracy#2"]
    with RewardScorer(specs) as scorer:
        result = scorer.score(_samples(["x"]))
        assert scorer.digests()[f"{tmp_path}/b/rewards.py:accuracy"].startswith("sha256:")
    assert result.per_function == {"accuracy": [1.0], "accuracy#2": [2.0]}
    assert result.rewards == [3.0]
    assert set(sys.modules) - before == set()  # the user files are not left in sys.modules


def test_weights_are_checked(rewards_file):
    specs = load_reward_functions([f"{rewards_file}:compute_score"])
    with pytest.raises(SmdInputError, match=r"reward.weights: 2 weights for 1 reward functions"):
        RewardScorer(specs, [1.0, 2.0])
    with pytest.raises(SmdInputError, match=r"reward.weights: every weight must be a finite number"):
        RewardScorer(specs, [math.nan])


# -------------------------------------------------------------------------------------------- bad input
def _error(rewards_file, name, completions, **kw) -> str:
    with pytest.raises(SmdInputError) as info:
        _score(rewards_file, [name], _samples(completions), **kw)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"reward.function: {rewards_file}:{name}: ")
    return message


def test_load_errors_are_one_line_naming_file_and_function(rewards_file, tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(SmdInputError, match=rf"^reward.function: {missing}:f: no such file {missing}$"):
        load_reward_functions([f"{missing}:f"])
    with pytest.raises(SmdInputError) as info:
        load_reward_functions([f"{rewards_file}:accuracy"])
    assert str(info.value) == (
        f"reward.function: {rewards_file}:accuracy: rewards.py defines no 'accuracy' (it defines: async_trl, closure_verl, "
        "compute_score, echo_trl, echo_verl, length_trl, no_score, only_kwargs, returns_inf, returns_nan, returns_text, solution_trl, "
        "trl_raises, trl_raises_in_batch, verl_raises, with_extras, wrong_length, wrong_signature)"
    )
    with pytest.raises(SmdInputError, match=r"rewards.py:NOT_CALLABLE: 'NOT_CALLABLE' in rewards.py is a int"):
        load_reward_functions([f"{rewards_file}:NOT_CALLABLE"])
    broken = tmp_path / "broken.py"
    broken.write_text("import json\nraise ImportError('no module named sympy_extra')\n")
    with pytest.raises(SmdInputError) as info:
        load_reward_functions([f"{broken}:f"])
    assert str(info.value) == (
        f"reward.function: {broken}:f: importing broken.py failed: ImportError: no module named sympy_extra"
    )
    (tmp_path / "typo.py").write_text("def f(data_source, solution_str, ground_truth):\n    return (\n")
    with pytest.raises(SmdInputError) as info:
        load_reward_functions([f"{tmp_path / 'typo.py'}:f"])
    assert str(info.value) == (
        f"reward.function: {tmp_path / 'typo.py'}:f: importing typo.py failed: "
        "SyntaxError: '(' was never closed (typo.py, line 2)"
    )
    with pytest.raises(SmdInputError) as info:
        load_reward_functions([f"{rewards_file}:wrong_signature"])
    assert str(info.value) == (
        f"reward.function: {rewards_file}:wrong_signature: signature wrong_signature(text, answer) is neither "
        "verl's fn(data_source, solution_str, ground_truth, extra_info=None) nor "
        "TRL's fn(prompts, completions, completion_ids, **kwargs)"
    )


def test_async_and_keyword_only_functions_are_refused(rewards_file):
    with pytest.raises(SmdInputError, match=r"rewards.py:async_trl: is an async function; accepted: a plain def"):
        load_reward_functions([f"{rewards_file}:async_trl"])
    with pytest.raises(SmdInputError, match=r"rewards.py:only_kwargs: signature only_kwargs\(\*\*kwargs\) is neither"):
        load_reward_functions([f"{rewards_file}:only_kwargs"])


def test_exception_inside_a_verl_function_names_the_row(rewards_file):
    message = _error(rewards_file, "verl_raises", ["ok", "boom", "boom"])
    assert message.endswith("raised on row row-1: ValueError: cannot score boom")


def test_exception_inside_a_trl_batch_names_the_first_row_that_fails_alone(rewards_file):
    message = _error(rewards_file, "trl_raises", ["ok", "ok", "boom", "boom"])
    assert message.endswith("raised on row row-2: KeyError: 'boom'")
    message = _error(rewards_file, "trl_raises_in_batch", ["a", "b", "c"])
    assert message.endswith(
        "raised on the batch of rows row-0, row-1, row-2 but on no row alone: RuntimeError: batch too large"
    )


def test_non_finite_or_non_numeric_returns_name_the_row(rewards_file):
    assert _error(rewards_file, "returns_nan", ["ok", "bad"]).endswith(
        "returned nan for row row-1; a reward is a finite number or None"
    )
    assert _error(rewards_file, "returns_inf", ["bad", "ok"]).endswith(
        "returned inf for row row-0; a reward is a finite number or None"
    )
    assert _error(rewards_file, "returns_text", ["ok", "ok", "bad"]).endswith(
        "returned '1.0' (str) for row row-2; a reward is a finite number or None"
    )
    assert _error(rewards_file, "wrong_length", ["a", "b"]).endswith(
        "returned 3 values for a batch of 2 (rows row-0 ...); one per completion"
    )
    assert _error(rewards_file, "no_score", ["a"]).endswith(
        "returned a dict without 'score' for row row-0 (keys: reward)"
    )


def test_pool_gives_the_in_process_results_and_errors(rewards_file):
    names = ["compute_score", "with_extras", "length_trl", "closure_verl"]
    completions = ["42", "plain", "", "7", "abc", "42", "x"]
    samples = _samples(completions, ["42", "", "", "8", "abc", "1", "x"],
                       columns=[{"data_source": f"src{i % 2}"} for i in range(len(completions))])
    specs = load_reward_functions([f"{rewards_file}:{n}" for n in names])
    with RewardScorer(specs, [1.0, 0.5, -1.0, 2.0]) as local:
        want = local.score(samples)
    bad_specs = load_reward_functions([f"{rewards_file}:compute_score", f"{rewards_file}:verl_raises"])
    bad = _samples(["ok", "x", "y", "z", "boom", "boom"])
    with RewardScorer(bad_specs) as local, pytest.raises(SmdInputError) as local_error:
        local.score(bad)
    with RewardScorer(specs, [1.0, 0.5, -1.0, 2.0], workers=2) as pool:
        handle = pool.submit(samples)  # returns at once; the work runs in the pool
        got = pool.result(handle)
    with RewardScorer(bad_specs, workers=2) as pool, pytest.raises(SmdInputError) as pool_error:
        pool.score(bad)
    assert got == want
    assert want.per_function["closure_verl"] == [2.5, 5.5, 0.5, 1.5, 3.5, 2.5, 1.5]
    assert want.extras["with_extras/src"] == ["src0", None, "src0", "src1", "src0", "src1", "src0"]
    assert str(pool_error.value) == str(local_error.value)
    assert str(local_error.value).endswith("verl_raises: raised on row row-4: ValueError: cannot score boom")


# ----------------------------------------------------------------------------------------- math_verify
def test_math_verify_hand_picked_cases():
    pytest.importorskip("math_verify")
    (spec,) = load_reward_functions(["math_verify"])
    assert (spec.name, spec.convention, spec.path) == ("math_verify", "verl", None)
    assert spec.digest.startswith("builtin:math_verify@")
    cases = [
        (r"The answer is \boxed{72}.", "#### 72", 1.0),
        (r"\boxed{1,000}", "#### 1,000", 1.0),  # thousands separator in gold and answer
        (r"The final answer is $1000$", "Natalia sold 10 clips.\n#### 1,000", 1.0),  # a full gsm8k solution
        (r"\boxed{\frac{5}{2}}", "#### 2.5", 1.0),  # fraction vs decimal
        (r"\boxed{2.5}", r"\frac{5}{2}", 1.0),
        (r"\boxed{1000.00}", "1000", 1.0),
        (r"\boxed{-5}", "#### -5", 1.0),
        (r"\boxed{71}", "#### 72", 0.0),  # wrong
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", 0.0),  # TRL's docstring example
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{3}", 1.0),
        ("#### 72", "#### 72", 0.0),  # no LaTeX anchor: TRL's extraction finds nothing
        ("72", "72", 0.0),
        (r"\boxed{72}", "no number here", None),  # unparseable gold: skipped, as TRL
    ]
    with RewardScorer([spec]) as scorer:
        result = scorer.score(_samples([c for c, _, _ in cases], [g for _, g, _ in cases]))
    assert result.per_function["math_verify"] == [want for _, _, want in cases]


def test_math_verify_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import raises ImportError
    with pytest.raises(SmdInputError) as info:
        load_reward_functions(["math_verify"])
    assert str(info.value) == MATH_EXTRA_HINT == (
        "reward.function: math_verify needs the math-verify package: pip install 'smd[math]'"
    )


def test_math_verify_verl_reads_answers_without_a_latex_anchor():
    pytest.importorskip("math_verify")
    specs = load_reward_functions(["math_verify", "math_verify_verl"])
    assert [s.name for s in specs] == ["math_verify", "math_verify_verl"]
    assert specs[1].digest.startswith("builtin:math_verify_verl@")
    cases = [
        ("#### 72", "She has 9 boxes.\n#### 72", 0.0, 1.0),  # gsm8k's own form: TRL's rule needs LaTeX
        ("It costs 1,000 dollars", "#### 1,000", 0.0, 1.0),
        ("First I got 58, but then 51.", "#### 51", 0.0, 1.0),
        ("First I got 51, but then 58.", "#### 51", 0.0, 0.0),  # the last number counts
        (r"\boxed{\frac{63}{2}}", "#### 31.5", 1.0, 1.0),
        ("I don't know.", "#### 5", 0.0, 0.0),
        ("5", "no number here", None, 0.0),  # verl: an unparseable gold scores 0 (TRL's rule: None)
    ]
    with RewardScorer(specs) as scorer:
        result = scorer.score(_samples([c for c, *_ in cases], [g for _, g, *_ in cases]))
    assert result.per_function == {
        "math_verify": [trl for *_, trl, _ in cases],
        "math_verify_verl": [verl for *_, verl in cases],
    }


def test_empty_batch_and_a_file_changed_after_loading(rewards_file):
    specs = load_reward_functions([f"{rewards_file}:compute_score", f"{rewards_file}:trl_raises_in_batch"])
    with RewardScorer(specs) as scorer:
        assert scorer.score([]) == RewardResult([], {"compute_score": [], "trl_raises_in_batch": []}, {}, [])
    rewards_file.write_text(rewards_file.read_text() + "\n# edited\n")
    with pytest.raises(SmdInputError, match=rf"^reward.function: {rewards_file}:compute_score: rewards.py changed "
                       r"since it was loaded \(sha256:[0-9a-f]{12} -> sha256:[0-9a-f]{12}\)$"):
        RewardScorer(specs)
