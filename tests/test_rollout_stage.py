"""`smdctl rollout` as a stage: artifacts, determinism, bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.raw_masks import read_raw_masks
from schemas.tables import read_table, write_table
from stages.rollout.stage import run_rollout
from tests.helpers import empty_params, make_model_dir, random_prompts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    model_dir = make_model_dir(root, "gqa")
    rows = [
        {"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids, "reference": "cat"}
        for i, ids in enumerate(random_prompts([30, 45, 38], seed=1))
    ]
    prompts = write_table(rows, root / "train.arrow", "prompts")
    return root, model_dir, prompts


def _params(**over):
    sets = [f"{k}={v}" for k, v in {"rollout.prompts_per_iteration": 3, "rollout.group_size": 2,
                                    "rollout.max_new_tokens": 6, "rollout.batch_size": 4,
                                    "rollout.shard_rows": 4, "rollout.eviction.window": 4, **over}.items()]
    return load_params(None, sets)


def test_rollout_writes_contract_artifacts(setup):
    root, model_dir, prompts = setup
    out = run_rollout(_params(), 1, model_dir, prompts, root / "it1", show_progress=False)
    table = read_table(out["trajectories"], "trajectories")
    assert table.num_rows == 6
    df = pd.read_feather(out["trajectories"])
    assert set(df.group_index) == {0, 1} and (df.eviction_policy == "snapkv").all()
    attrs, shards = read_raw_masks(out["raw_masks"])
    assert len(shards) == 2 and attrs["num_layers"] == 2 and attrs["num_kv_heads"] == 2
    lengths = [len(a) + len(b) for a, b in zip(df.prompt_token_ids, df.response_token_ids)]
    got = [int(x) for s in shards for x in (s["offsets"][1:] - s["offsets"][:-1])]
    assert got == lengths
    again = run_rollout(_params(), 1, model_dir, prompts, root / "it1b", show_progress=False)
    assert (root / "it1" / "trajectories.arrow").read_bytes() == (root / "it1b" / "trajectories.arrow").read_bytes()
    assert again["metrics"].exists()


def test_rollout_bad_inputs_leave_nothing(setup, tmp_path):
    root, model_dir, prompts = setup
    with pytest.raises(SmdInputError, match="no policy checkpoint"):
        run_rollout(_params(), 1, tmp_path / "nope", prompts, tmp_path / "out", show_progress=False)
    with pytest.raises(SmdInputError, match="exceeds the model's 512 positions"):
        run_rollout(_params(**{"rollout.max_new_tokens": 500}), 1, model_dir, prompts, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SmdInputError, match="rollout.group_size"):
        _params(**{"rollout.group_size": 1})
    with pytest.raises(SmdInputError, match="rollout.eviction.keep_ratio"):
        _params(**{"rollout.eviction.keep_ratio": 1.5})


def test_cli_exit_code_2_on_bad_params(setup, tmp_path):
    from cli.main import app

    root, model_dir, prompts = setup
    result = CliRunner().invoke(app, ["rollout", "--params", str(empty_params(tmp_path)), "-S", "rollout.group_size=1",
                                      "--policy", str(model_dir), "--prompts", str(prompts),
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "rollout.group_size" in result.output
    assert not (tmp_path / "o").exists()


def test_min_prompt_tokens_samples_only_long_prompts(setup, tmp_path):
    root, model_dir, prompts = setup  # prompts of 30, 45, 38 tokens (p0, p1, p2)
    out = run_rollout(_params(**{"rollout.min_prompt_tokens": 38}), 1, model_dir, prompts, tmp_path / "long",
                  show_progress=False)
    picked = read_table(out["trajectories"], "trajectories").column("prompt_id").to_pylist()
    assert len(picked) == 6 and set(picked) <= {"p1", "p2"}
    with pytest.raises(SmdInputError, match=r"train.arrow: prompt_token_ids: no prompt has "
                                            r"rollout.min_prompt_tokens=46 tokens \(the longest has 45\)"):
        run_rollout(_params(**{"rollout.min_prompt_tokens": 46}), 1, model_dir, prompts, tmp_path / "none",
                show_progress=False)
    assert not (tmp_path / "none").exists()


def test_rollout_sampler_reaches_the_engine(setup, tmp_path):
    """rollout.sampler inverse_cdf: deterministic under the seed, another stream than multinomial (other
    responses), and the recorded log-probs are still those of the drawn tokens (the replay's check)."""
    from schemas.params.compaction import CompactionParams
    from schemas.params.learner import float32_parity_bound
    from stages.compaction import run_compaction
    from tests.helpers import independent_replay

    root, model_dir, prompts = setup
    runs = {name: run_rollout(_params(**{"rollout.sampler": name, "rollout.max_new_tokens": 12}), 1, model_dir,
                              prompts, tmp_path / name, show_progress=False)
            for name in ("multinomial", "inverse_cdf")}
    again = run_rollout(_params(**{"rollout.sampler": "inverse_cdf", "rollout.max_new_tokens": 12}), 1, model_dir,
                        prompts, tmp_path / "again", show_progress=False)
    icdf = pd.read_feather(runs["inverse_cdf"]["trajectories"])
    mult = pd.read_feather(runs["multinomial"]["trajectories"])
    assert list(map(list, icdf.response_token_ids)) != list(map(list, mult.response_token_ids))
    assert (tmp_path / "inverse_cdf" / "trajectories.arrow").read_bytes() == \
        (tmp_path / "again" / "trajectories.arrow").read_bytes()
    assert again["metrics"].exists()
    out = runs["inverse_cdf"]
    masks = run_compaction(CompactionParams(chunk_rows=2), out["trajectories"], out["raw_masks"],
                           tmp_path / "masks.zarr")["masks"]
    exact, rollout, max_logit = independent_replay(model_dir, out["trajectories"], masks, temperature=1.0)
    assert np.abs(rollout - exact).max() <= float32_parity_bound(max_logit, 1.0)
