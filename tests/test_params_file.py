"""The committed params.yaml is what `dvc repro` runs (issue 41): every parameter dvc.yaml names is in it, it
validates, and it holds every schema key (none is left to its default unnoticed). Fast: files only."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from schemas.params import Params, load_params
from tests.helpers import ROOT

# Schema keys the committed params.yaml leaves to their defaults on purpose (none today). A key added to the schema
# goes into params.yaml, with its default, or here with the reason.
LEFT_TO_DEFAULTS: dict[str, str] = {}


def dvc_params(tree: Any) -> list[str]:
    """Every `params:` entry of dvc.yaml's stages (a `foreach` stage's under `do`), as dotted keys of params.yaml."""
    found: list[str] = []
    for stage in tree["stages"].values():
        body = stage.get("do", stage)
        for entry in body.get("params", []):
            if isinstance(entry, dict):  # {file: [keys]}: another params file's keys
                for file, keys in entry.items():
                    assert file == "params.yaml", f"dvc.yaml names another params file {file}"
                    found.extend(keys)
            else:
                found.append(entry)
    return found


def has_key(tree: dict, dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= leaf_keys(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def committed() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_every_parameter_dvc_yaml_names_is_in_params_yaml():
    names = dvc_params(yaml.safe_load((ROOT / "dvc.yaml").read_text()))
    assert "prepare.prompt_key" in names and "pipeline.num_iterations" in names  # the parser reads foreach stages
    missing = [name for name in names if not has_key(committed(), name)]
    assert not missing, f"dvc.yaml names parameters params.yaml lacks (dvc repro fails on them): {missing}"


def test_params_yaml_validates_and_holds_every_schema_key():
    load_params(ROOT / "params.yaml")  # validates (one line naming the key otherwise)
    schema_keys = leaf_keys(Params().model_dump(mode="json"))
    file_keys = leaf_keys(committed())
    missing = sorted(schema_keys - file_keys - set(LEFT_TO_DEFAULTS))
    assert not missing, f"params.yaml lacks schema keys (add them with their defaults, or to LEFT_TO_DEFAULTS): {missing}"
    stale = sorted(k for k in LEFT_TO_DEFAULTS if k not in schema_keys or k in file_keys)
    assert not stale, f"LEFT_TO_DEFAULTS lists keys the schema lacks or params.yaml sets: {stale}"


def test_the_checks_catch_a_missing_key():
    tree = committed()
    del tree["prepare"]["prompt_key"]
    assert not has_key(tree, "prepare.prompt_key") and "prepare.prompt_key" not in leaf_keys(tree)
    assert has_key(tree, "prepare.task") and "rollout.eviction.policy" in leaf_keys(committed())


def test_an_override_error_names_the_override_and_a_file_error_the_file(tmp_path):
    from schemas.errors import SmdInputError

    with pytest.raises(SmdInputError, match=r"^-S rollout.group_size=1: rollout.group_size: "):
        load_params(ROOT / "params.yaml", ["rollout.group_size=1"])
    bad = tmp_path / "params.yaml"
    bad.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(SmdInputError, match=rf"^{bad}: rollout.group_size: "):
        load_params(bad, ["learner.lr=0.1"])
    with pytest.raises(SmdInputError, match=rf"^{bad} with -S reward.function=r.py:f, -S reward.weights=\[1, 2\]: reward: .*2 weight"):
        load_params(bad, ["rollout.group_size=2", "reward.function=r.py:f", "reward.weights=[1, 2]"])


def test_only_commands_that_score_need_a_reward_function():
    from schemas.errors import SmdInputError

    task = ["prepare.task=dataset", "prepare.train_file=x.jsonl"]
    assert load_params(ROOT / "params.yaml", task, scores=False).prepare.task == "dataset"  # init-model, prepare
    with pytest.raises(SmdInputError, match=r"reward.function: task `dataset` has no built-in scorer"):
        load_params(ROOT / "params.yaml", task)


def test_an_override_fills_a_section_the_committed_file_leaves_null():
    """The committed params.yaml holds optional sections as null (evaluate.compressed_eviction, learner.lora); a
    dotted override into one starts it from its defaults, as the experiment specs' arms do."""
    tree = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert tree["evaluate"]["compressed_eviction"] is None and tree["learner"]["lora"] is None
    params = load_params(ROOT / "params.yaml", ["evaluate.compressed_eviction.policy=snapkv",
                                                "evaluate.compressed_eviction.keep_ratio=0.3", "learner.lora.rank=8"])
    assert params.evaluate.compressed_eviction.policy == "snapkv"
    assert params.evaluate.compressed_eviction.keep_ratio == 0.3
    assert params.learner.lora.rank == 8 and params.learner.lora.alpha == 32.0
    assert load_params(ROOT / "params.yaml").learner.lora is None
