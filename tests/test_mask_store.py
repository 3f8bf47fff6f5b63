"""The compacted mask store reader (schemas.compacted_masks): the learner's entry points and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from schemas.compacted_masks import (
    mask_row_frame,
    narrowest_dtype,
    open_mask_store,
    read_kept_final,
    read_mask_rows,
    retention_frame,
    write_mask_store,
)
from schemas.errors import SmdInputError
from schemas.params.compaction import CompactionParams
from stages.compaction import run_compaction
from tests.helpers import make_inputs


@pytest.fixture()
def store(tmp_path):
    inp = make_inputs(tmp_path / "in", "h2o", [30, 50, 41], [10, 20, 41], num_layers=2, num_kv_heads=2, num_shards=2)
    out = run_compaction(CompactionParams(chunk_rows=1), inp["trajectories"], inp["raw"], tmp_path / "masks.zarr")
    return out["masks"], inp


def test_narrowest_dtype():
    assert narrowest_dtype(0) == np.uint8 and narrowest_dtype(255) == np.uint8
    assert narrowest_dtype(256) == np.uint16 and narrowest_dtype(65_535) == np.uint16
    assert narrowest_dtype(65_536) == np.uint32 and narrowest_dtype(2**32) == np.uint64


def test_mask_row_frame(store):
    path, inp = store
    df = mask_row_frame(path, 1)
    exp = inp["expected"][1]
    T = exp.shape[0]
    assert list(df.columns) == ["token", "layer", "kv_head", "evict_at", "kept_final"]
    assert len(df) == T * 2 * 2
    row = df[(df.token == 7) & (df.layer == 1) & (df.kv_head == 0)].iloc[0]
    assert row.evict_at == exp[7, 1, 0] and row.kept_final == (exp[7, 1, 0] == T)
    wide = df.pivot_table(index="token", columns=["layer", "kv_head"], values="evict_at")
    np.testing.assert_array_equal(wide.to_numpy().reshape(T, 2, 2), exp)


def test_retention_frame(store):
    path, _ = store
    df = retention_frame(path)
    assert len(df) == 4 and {"kept_final_fraction", "mean_visible_fraction", "peak_visible_tokens"} <= set(df.columns)
    assert ((df.kept_final_fraction > 0) & (df.kept_final_fraction <= 1)).all()


def test_open_rejects_other_kinds_and_versions(store, tmp_path):
    path, inp = store
    with pytest.raises(SmdInputError, match="kind: expected masks, found raw_masks"):
        open_mask_store(inp["raw"])
    with pytest.raises(SmdInputError, match="missing compacted mask store"):
        open_mask_store(tmp_path / "nowhere.zarr")
    zarr.open_group(str(path), mode="r+").attrs["schema_version"] = "99"
    with pytest.raises(SmdInputError, match="schema_version: 99 but this smd reads 1") as err:
        read_mask_rows(path, [0])
    assert "\n" not in str(err.value)


def test_rows_out_of_range(store):
    path, _ = store
    with pytest.raises(SmdInputError, match="row 3 out of range"):
        read_mask_rows(path, [0, 3])


def test_truncated_chunk(store):
    path, _ = store
    chunk = path / "evict_at" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    read_mask_rows(path, [0])  # other chunks still read
    with pytest.raises(SmdInputError, match="evict_at: unreadable chunk for rows 1..1"):
        read_mask_rows(path, [1])


def test_damaged_kept_final_detected_by_frame(store):
    path, inp = store
    exp = inp["expected"][0]
    assert (exp == exp.shape[0]).any()
    (path / "kept_final" / "c" / "0" / "0").unlink()
    assert not read_kept_final(path, [0])[0].any()  # a missing bitmask chunk reads as zeros ...
    with pytest.raises(SmdInputError, match="kept_final: row 0 disagrees with evict_at"):
        mask_row_frame(path, 0)  # ... which the frame cross-checks


def test_reopened_after_atomic_replacement(store, tmp_path):
    path, inp = store
    first = read_mask_rows(path, [0])[0]
    other = make_inputs(tmp_path / "in2", "dense", [12, 13, 14], [4, 4, 4], num_layers=2, num_kv_heads=2)
    run_compaction(CompactionParams(), other["trajectories"], other["raw"], path)
    again = read_mask_rows(path, [0])[0]
    assert not np.array_equal(first, again)
    np.testing.assert_array_equal(again, other["expected"][0])


def test_write_mask_store_directly(tmp_path):
    """Other stages' tests can build a store from arrays (validation is compaction's job)."""
    ev = np.array([[3], [3], [3], [5], [5]])  # two dense rows of 3 and 2 tokens, one shared column
    write_mask_store(
        tmp_path / "m.zarr",
        evict_at=ev,
        offsets=np.array([0, 3, 5]),
        prompt_len=np.array([1, 1]),
        table_row=np.array([0, 1]),
        column_map=np.zeros((2, 3), dtype=np.int32),
        eviction={"policy": "dense"},
        config={},
        retention={},
    )
    a, b = read_mask_rows(tmp_path / "m.zarr", [0, 1])
    assert a.shape == (3, 2, 3) and b.shape == (2, 2, 3)
    assert (a == 3).all() and (b == 5).all()
