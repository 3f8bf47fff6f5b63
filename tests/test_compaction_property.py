"""Property tests (hypothesis): compaction is lossless and independent of the shard (and row) order."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.compacted_masks import open_mask_store, read_mask_rows
from schemas.params.compaction import CompactionParams
from schemas.params.rollout import POLICIES
from schemas.raw_masks import visible_counts, write_raw_masks
from schemas.tables import read_table, trajectories_binding
from stages.bench.synthetic_rollouts import (
    budget_table,
    eviction_config,
    synthetic_rollout,
    write_synthetic_inputs,
)
from stages.compaction import run_compaction


@st.composite
def rollouts(draw):
    policy = draw(st.sampled_from(POLICIES))
    sinks = draw(st.integers(0, 4))
    window = draw(st.integers(1, 8))
    keep_ratio = draw(st.sampled_from([0.1, 0.3, 0.5, 0.9, 1.0]))
    max_tokens = draw(st.one_of(st.none(), st.integers(sinks + window + 1, sinks + window + 40)))
    n = draw(st.integers(1, 5))
    # lengths on both sides of the uint8 boundary (255) exercise the dtype narrowing
    lengths = draw(st.lists(st.sampled_from([1, 2, 7, 33, 120, 255, 256, 300]) | st.integers(1, 300), min_size=n, max_size=n))
    prompts = [draw(st.integers(1, T)) for T in lengths]
    return {
        "policy": policy,
        "eviction": eviction_config(policy, keep_ratio, sinks=sinks, window=window, max_tokens=max_tokens),
        "lengths": lengths,
        "prompts": prompts,
        "layers": draw(st.integers(1, 3)),
        "heads": draw(st.integers(1, 3)),
        "shards": draw(st.integers(1, n)),
        "chunk_rows": draw(st.integers(1, 4)),
        "seed": draw(st.integers(0, 2**16)),
        "order_seed": draw(st.integers(0, 2**16)),
    }


def _tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(rollouts())
def test_lossless_and_shard_order_independent(case):
    L, H = case["layers"], case["heads"]
    table, shards, expected, ev = synthetic_rollout(
        case["policy"], case["lengths"], case["prompts"], num_layers=L, num_kv_heads=H,
        eviction=case["eviction"], seed=case["seed"], num_shards=case["shards"],
    )
    # the generator's schedules are valid: evict_at in [k+1, T], budget at every decode query
    for e, P in zip(expected, [case["prompts"][i] for i in np.argsort([t["mask_row"] for t in table])]):
        T = e.shape[0]
        assert ((e > np.arange(T)[:, None, None]) & (e <= T)).all()
        assert (visible_counts(e)[P:] <= budget_table(T, ev)[P + 1 :, None, None]).all()

    rng = np.random.default_rng(case["order_seed"])
    reordered = []
    for i in rng.permutation(len(shards)):  # another shard order, rows shuffled inside each shard
        s = shards[i]
        perm = rng.permutation(len(s["mask_row"]))
        lens = np.diff(s["offsets"])[perm]
        rows = [s["evict_at"][s["offsets"][j] : s["offsets"][j + 1]] for j in perm]
        reordered.append(
            {
                "evict_at": np.concatenate(rows),
                "offsets": np.concatenate([[0], np.cumsum(lens)]),
                "mask_row": s["mask_row"][perm],
                "prompt_len": s["prompt_len"][perm],
            }
        )
    cfg = CompactionParams(chunk_rows=case["chunk_rows"])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        traj, raw = write_synthetic_inputs(tmp, table, shards, ev, L, H)
        raw2 = write_raw_masks(tmp / "other.raw.zarr", reordered, L, H, ev,
                               trajectories_binding(read_table(traj, "trajectories")))
        a = run_compaction(cfg, traj, raw, tmp / "a" / "masks.zarr")["masks"]
        b = run_compaction(cfg, traj, raw2, tmp / "b" / "masks.zarr")["masks"]
        assert _tree(a) == _tree(b)

        store = open_mask_store(a)
        rows = list(rng.permutation(len(table)))
        for r, got in zip(rows, read_mask_rows(store, rows)):
            np.testing.assert_array_equal(got, expected[r])
        max_len = max(case["lengths"])
        assert store.evict_at.dtype == (np.uint8 if max_len <= 255 else np.uint16)
        if case["policy"] in ("dense", "recent"):
            assert store.attrs["num_columns"] == 1
