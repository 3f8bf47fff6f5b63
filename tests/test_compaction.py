"""Compaction stage: round trip per policy, metrics, layout, rejection of bad input, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
import zarr
from typer.testing import CliRunner

from schemas.compacted_masks import (
    open_mask_store,
    read_compact_rows,
    read_kept_final,
    read_mask_rows,
)
from schemas.errors import SmdInputError
from schemas.params.compaction import CompactionParams
from schemas.params.rollout import POLICIES
from schemas.raw_masks import visibility, write_raw_masks
from schemas.tables import read_table, trajectories_binding, write_table
from stages.bench.synthetic_rollouts import eviction_config
from stages.compaction import run_compaction
from tests.helpers import empty_params, make_inputs

LENGTHS = [40, 97, 130, 64, 201]
PROMPTS = [10, 30, 20, 64, 50]  # row 3 is all prompt (no decode query)
L, H = 3, 2


def _inputs(tmp_path: Path, policy: str = "h2o", **kw):
    kw.setdefault("num_layers", L)
    kw.setdefault("num_kv_heads", H)
    kw.setdefault("num_shards", 2)
    return make_inputs(tmp_path / "in", policy, kw.pop("lengths", LENGTHS), kw.pop("prompts", PROMPTS), **kw)


def _compact(tmp_path: Path, inp, chunk_rows: int = 2):
    out = tmp_path / "out" / "masks.zarr"
    return run_compaction(CompactionParams(chunk_rows=chunk_rows), inp["trajectories"], inp["raw"], out, tmp_path / "out" / "metrics.json")


@pytest.mark.parametrize("policy", POLICIES)
def test_round_trip_every_policy(tmp_path, policy):
    inp = _inputs(tmp_path, policy)
    written = _compact(tmp_path, inp)
    store = open_mask_store(written["masks"])
    n = len(LENGTHS)
    assert store.num_rows == n and (store.num_layers, store.num_kv_heads) == (L, H)
    rows = [3, 0, 4, 4, 1, 2]  # unsorted, with a duplicate
    got = read_mask_rows(written["masks"], rows)
    kept = read_kept_final(written["masks"], rows)
    for r, ev, kf in zip(rows, got, kept):
        raw = inp["expected"][r]
        assert ev.dtype == np.int64 and ev.shape == raw.shape
        np.testing.assert_array_equal(ev, raw)
        np.testing.assert_array_equal(kf, raw == raw.shape[0])
        for layer in range(L):
            for head in range(H):
                want = visibility(torch.from_numpy(raw[:, layer, head].astype(np.int64)))
                have = visibility(torch.from_numpy(ev[:, layer, head]))
                assert torch.equal(want, have)
    # row alignment: store row r is the trajectory whose mask_row is r
    for r in range(n):
        t = inp["table"][store.table_row[r]]
        assert t["mask_row"] == r
        assert store.lengths()[r] == len(t["prompt_token_ids"]) + len(t["response_token_ids"])
        assert store.prompt_len[r] == len(t["prompt_token_ids"])
    expected_cols = 1 if policy in ("dense", "recent") else L * H
    assert store.attrs["num_columns"] == expected_cols
    assert store.attrs["evict_at_dtype"] == "uint8"  # longest row 201 <= 255
    assert store.attrs["eviction"] == inp["eviction"]
    assert store.attrs["config"]["compaction"]["chunk_rows"] == 2


def test_metrics_and_retention(tmp_path):
    inp = _inputs(tmp_path, "snapkv")
    written = _compact(tmp_path, inp)
    m = json.loads(Path(written["details"]).read_text())
    headline = json.loads(Path(written["metrics"]).read_text())
    assert set(headline) == {"rows", "unique_columns", "ratio_vs_dense_bitmask", "ratio_vs_raw_int32", "tokens_per_s",
                             "schema_version"}
    assert headline == {k: m[k] for k in headline}
    assert m["rows"] == len(LENGTHS) and m["tokens"] == sum(LENGTHS)
    assert m["bytes"]["raw_int32"] == sum(LENGTHS) * L * H * 4
    assert 0 < m["ratio_vs_dense_bitmask"] and m["tokens_per_s"] > 0
    per_head = m["retention"]["per_head"]
    assert set(per_head) == {f"layer{i}_head{j}" for i in range(L) for j in range(H)}
    # check one head's statistics by hand
    exp = inp["expected"]
    kept = sum(int((e[:, 1, 0] == e.shape[0]).sum()) for e in exp) / sum(LENGTHS)
    assert per_head["layer1_head0"]["kept_final_fraction"] == pytest.approx(kept, abs=1e-6)
    peak = max(int(np.max(_visible(e[:, 1, 0]))) for e in exp)
    assert per_head["layer1_head0"]["peak_visible_tokens"] == peak
    assert 0 < m["retention"]["mean_visible_fraction_mean"] < 1
    store = open_mask_store(written["masks"])
    assert store.attrs["retention"]["kept_final_fraction"][1][0] == pytest.approx(kept, abs=1e-6)


def _visible(col: np.ndarray) -> np.ndarray:
    T = len(col)
    q = np.arange(T)[:, None]
    k = np.arange(T)[None, :]
    return ((k <= q) & (col[None, :] > q)).sum(1)


def test_dense_policy_single_column_and_uint16(tmp_path):
    inp = _inputs(tmp_path, "dense", lengths=[300, 20], prompts=[5, 20])
    written = _compact(tmp_path, inp)
    store = open_mask_store(written["masks"])
    assert store.attrs["num_columns"] == 1 and store.attrs["evict_at_dtype"] == "uint16"
    assert (store.column_map == 0).all()
    assert store.evict_at.dtype == np.uint16
    np.testing.assert_array_equal(read_mask_rows(store, [1])[0], inp["expected"][1])


def test_uint32_for_rows_over_65535_tokens(tmp_path):
    inp = _inputs(tmp_path, "dense", lengths=[65_600], prompts=[65_000], num_layers=1, num_kv_heads=1, num_shards=1)
    written = _compact(tmp_path, inp, chunk_rows=1)
    store = open_mask_store(written["masks"])
    assert store.evict_at.dtype == np.uint32
    assert read_mask_rows(store, [0])[0][-1, 0, 0] == 65_600


def test_chunks_sized_for_microbatch_reads(tmp_path):
    lengths = [50, 60, 70, 80, 90, 100, 30, 40, 120]
    inp = _inputs(tmp_path, "random", lengths=lengths, prompts=[10] * len(lengths), num_shards=3)
    written = _compact(tmp_path, inp, chunk_rows=3)
    store = open_mask_store(written["masks"])
    chunk = store.evict_at.chunks[0]
    assert chunk == store.attrs["chunk_tokens"] and chunk % 8 == 0
    off = store.offsets
    for start in range(0, len(lengths), 3):
        end = min(start + 3, len(lengths))
        first, last = off[start] // chunk, (off[end] - 1) // chunk
        assert last - first + 1 <= 2  # an aligned micro-batch touches at most two chunks
    assert store.kept_final.chunks[0] * 8 == chunk


def test_reads_only_needed_chunks(tmp_path):
    lengths = [64] * 6
    inp = _inputs(tmp_path, "h2o", lengths=lengths, prompts=[16] * 6)
    written = _compact(tmp_path, inp, chunk_rows=2)  # 128 tokens per chunk: rows (0,1), (2,3), (4,5)
    (Path(written["masks"]) / "evict_at" / "c" / "2" / "0").unlink()
    got = read_mask_rows(written["masks"], [0, 1, 2, 3])  # does not touch the deleted chunk
    for r, ev in zip([0, 1, 2, 3], got):
        np.testing.assert_array_equal(ev, inp["expected"][r])
    with pytest.raises(SmdInputError, match="missing chunk for rows 5..5"):
        read_mask_rows(written["masks"], [5])


def test_shard_order_independent_bytes(tmp_path):
    inp = _inputs(tmp_path, "random", num_shards=3)
    raw2 = tmp_path / "in" / "masks.raw.reversed.zarr"
    write_raw_masks(raw2, list(reversed(inp["shards"])), L, H, inp["eviction"], _binding(inp))
    a = run_compaction(CompactionParams(), inp["trajectories"], inp["raw"], tmp_path / "a" / "masks.zarr")
    b = run_compaction(CompactionParams(), inp["trajectories"], raw2, tmp_path / "b" / "masks.zarr")
    assert _tree(a["masks"]) == _tree(b["masks"])


def _tree(path) -> dict[str, bytes]:
    path = Path(path)
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# ---------------------------------------------------------------- rejected input


def _assert_rejected(tmp_path, inp, match: str, traj=None, raw=None) -> str:
    out = tmp_path / "out" / "masks.zarr"
    with pytest.raises(SmdInputError, match=match) as err:
        run_compaction(CompactionParams(), traj or inp["trajectories"], raw or inp["raw"], out, tmp_path / "out" / "metrics.json")
    msg = str(err.value)
    assert "\n" not in msg
    assert not out.exists() and not (tmp_path / "out" / "metrics.json").exists()
    leftovers = list((tmp_path / "out").glob(".*")) if (tmp_path / "out").exists() else []
    assert leftovers == []
    return msg


def _binding(inp, table=None) -> dict[str, str]:
    """The binding of the input's trajectory table, or of the table at `table` (what the rollout records in its
    raw store)."""
    return trajectories_binding(read_table(table or inp["trajectories"], "trajectories"))


def _rewrite_raw(inp, shards=None, eviction=None, bound_to=None):
    """Rewrite the raw store from (possibly modified) shards, bound to the input's trajectory table (or to the
    table at `bound_to`: the structural checks behind the binding see an edited table)."""
    write_raw_masks(inp["raw"], shards or inp["shards"], L, H, eviction or inp["eviction"], _binding(inp, bound_to))


def _tid_of_mask_row(inp, m: int) -> str:
    return next(t["trajectory_id"] for t in inp["table"] if t["mask_row"] == m)


def test_reject_evict_at_not_after_key(tmp_path):
    inp = _inputs(tmp_path, "h2o")
    shard = inp["shards"][1]
    j, k, layer, head = 1, 5, 2, 1
    shard["evict_at"][shard["offsets"][j] + k, layer, head] = k
    _rewrite_raw(inp)
    tid = _tid_of_mask_row(inp, int(shard["mask_row"][j]))
    msg = _assert_rejected(tmp_path, inp, r"evict_at\[5\] = 5 must be > 5")
    assert f"trajectory {tid}" in msg and "layer 2, kv_head 1" in msg


def test_reject_evict_at_beyond_row(tmp_path):
    inp = _inputs(tmp_path, "random")
    shard = inp["shards"][0]
    T = int(shard["offsets"][1] - shard["offsets"][0])
    shard["evict_at"][3, 0, 1] = T + 1
    _rewrite_raw(inp)
    msg = _assert_rejected(tmp_path, inp, f"exceeds the row length {T}")
    assert "layer 0, kv_head 1" in msg and _tid_of_mask_row(inp, int(shard["mask_row"][0])) in msg


def test_reject_budget_violation(tmp_path):
    inp = _inputs(tmp_path, "snapkv")
    shard = inp["shards"][0]
    j, layer, head = 0, 1, 1
    s, e = shard["offsets"][j], shard["offsets"][j + 1]
    col = shard["evict_at"][s:e, layer, head]
    k = int(np.flatnonzero(col < e - s)[0])  # an evicted key: keep it forever
    q = int(col[k])
    col[k] = e - s
    _rewrite_raw(inp)
    msg = _assert_rejected(tmp_path, inp, f"decode query {q} sees .* over the budget")
    assert "layer 1, kv_head 1" in msg and _tid_of_mask_row(inp, int(shard["mask_row"][j])) in msg


def test_reject_wrong_row_count(tmp_path):
    inp = _inputs(tmp_path, "recent", permute=False)
    short = tmp_path / "short.arrow"
    write_table(inp["table"][:-1], short, "trajectories")
    _assert_rejected(tmp_path, inp, "masks from another rollout", traj=short)
    _rewrite_raw(inp, bound_to=short)  # bound to the short table: the row count check behind the binding
    _assert_rejected(tmp_path, inp, "5 mask rows in 2 shard.* but .* has 4 trajectories", traj=short)


def test_reject_row_length_mismatch(tmp_path):
    inp = _inputs(tmp_path, "random")
    rows = [dict(t) for t in inp["table"]]
    rows[2]["response_token_ids"] = rows[2]["response_token_ids"] + [7]
    rows[2]["rollout_logprobs"] = rows[2]["rollout_logprobs"] + [-1.0]
    bad = tmp_path / "longer.arrow"
    write_table(rows, bad, "trajectories")
    _rewrite_raw(inp, bound_to=bad)
    msg = _assert_rejected(tmp_path, inp, "tokens but the trajectory has", traj=bad)
    assert f"trajectory {rows[2]['trajectory_id']}" in msg


def test_reject_prompt_len_mismatch(tmp_path):
    inp = _inputs(tmp_path, "random")
    inp["shards"][0]["prompt_len"][0] += 1
    _rewrite_raw(inp)
    _assert_rejected(tmp_path, inp, "prompt_len .* but the trajectory's prompt has")


def test_reject_raw_masks_of_another_rollout_with_equal_row_lengths(tmp_path):
    """Issue 24: a raw store from another rollout whose rows have the same lengths (the same prompts and response
    lengths, another policy's tokens and masks) passes every structural check; its recorded binding does not."""
    inp = _inputs(tmp_path, "snapkv", permute=False)
    other = make_inputs(tmp_path / "other", "snapkv", LENGTHS, PROMPTS, num_layers=L, num_kv_heads=H,
                        num_shards=2, seed=1, permute=False)
    ours, theirs = read_table(inp["trajectories"], "trajectories"), read_table(other["trajectories"], "trajectories")
    assert ours.column("response_token_ids") != theirs.column("response_token_ids")  # another rollout's tokens
    assert [len(x) for x in ours.column("response_token_ids").to_pylist()] == [
        len(x) for x in theirs.column("response_token_ids").to_pylist()]
    msg = _assert_rejected(tmp_path, inp, "masks from another rollout", raw=other["raw"])
    assert str(other["raw"]) in msg and str(inp["trajectories"]) in msg  # both files named
    unbound = tmp_path / "unbound.raw.zarr"
    write_raw_masks(unbound, inp["shards"], L, H, inp["eviction"])  # no binding at all: refused too
    _assert_rejected(tmp_path, inp, "not bound to a trajectory table", raw=unbound)
    # the structural checks alone would accept the other rollout's masks: only the binding tells them apart
    _rewrite_raw(inp, shards=other["shards"])
    _compact(tmp_path, inp)


def test_reject_shard_from_another_config(tmp_path):
    inp = _inputs(tmp_path, "h2o")
    g = zarr.open_group(str(inp["raw"] / "shard-00001"), mode="r+")
    g.attrs["eviction"] = {**inp["eviction"], "keep_ratio": 0.7}
    msg = _assert_rejected(tmp_path, inp, "shard-00001: eviction")
    assert "another run" in msg


def test_reject_eviction_differs_from_table(tmp_path):
    inp = _inputs(tmp_path, "h2o")
    _rewrite_raw(inp, eviction=eviction_config("h2o", 0.25))
    _assert_rejected(tmp_path, inp, "row 0 \\(trajectory traj-00000\\): eviction h2o/keep_ratio 0.5")


def test_reject_duplicate_mask_row(tmp_path):
    inp = _inputs(tmp_path, "dense")
    inp["shards"][1]["mask_row"][0] = inp["shards"][0]["mask_row"][0]
    _rewrite_raw(inp)
    _assert_rejected(tmp_path, inp, "duplicate row")


def test_reject_truncated_chunk(tmp_path):
    inp = _inputs(tmp_path, "random")
    chunk = inp["raw"] / "shard-00000" / "evict_at" / "c" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    _assert_rejected(tmp_path, inp, "shard-00000/evict_at: unreadable")


def test_reject_deleted_chunk(tmp_path):
    inp = _inputs(tmp_path, "random")
    (inp["raw"] / "shard-00001" / "evict_at" / "c" / "0" / "0" / "0").unlink()
    msg = _assert_rejected(tmp_path, inp, "evict_at\\[0\\] = 0 must be > 0")
    assert "missing chunk" in msg and "layer 0, kv_head 0" in msg


def test_reject_missing_inputs(tmp_path):
    inp = _inputs(tmp_path, "random")
    _assert_rejected(tmp_path, inp, "missing raw mask store", raw=tmp_path / "nope.zarr")
    _assert_rejected(tmp_path, inp, "missing trajectories table", traj=tmp_path / "nope.arrow")


def test_failed_run_keeps_previous_output(tmp_path):
    inp = _inputs(tmp_path, "random")
    written = _compact(tmp_path, inp)
    before = _tree(written["masks"])
    inp["shards"][0]["evict_at"][0, 0, 0] = 0
    _rewrite_raw(inp)
    with pytest.raises(SmdInputError):
        _compact(tmp_path, inp)
    assert _tree(written["masks"]) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["details.json", "masks.zarr", "metrics.json"]


# ---------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    import cli.bench
    import cli.compact
    import cli.inspect

    app = typer.Typer()
    for mod in (cli.compact, cli.inspect, cli.bench):
        mod.register(app)
    return app


def test_cli_compact_default_paths_and_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inp = make_inputs(tmp_path / "artifacts" / "iter-002" / "rollout", "h2o", LENGTHS, PROMPTS, num_layers=L, num_kv_heads=H)
    assert inp["raw"].name == "masks.raw.zarr"
    (tmp_path / "params.yaml").write_text("")  # the default --params (a missing file is an error)
    res = CliRunner().invoke(_app(), ["compact", "--iteration", "2", "-S", "compaction.chunk_rows=3"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "artifacts" / "iter-002" / "compact"
    assert (out / "metrics.json").exists()
    assert open_mask_store(out / "masks.zarr").attrs["chunk_rows"] == 3
    np.testing.assert_array_equal(read_mask_rows(out / "masks.zarr", [2])[0], inp["expected"][2])


def test_cli_compact_bad_input_exit_2(tmp_path):
    inp = _inputs(tmp_path, "h2o")
    inp["shards"][0]["evict_at"][2, 1, 0] = 1
    _rewrite_raw(inp)
    res = CliRunner().invoke(
        _app(),
        ["compact", "--trajectories", str(inp["trajectories"]), "--raw-masks", str(inp["raw"]),
         "--out", str(tmp_path / "o" / "masks.zarr"), "--params", str(empty_params(tmp_path))],
    )
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "layer 1, kv_head 0" in lines[0]
    assert not (tmp_path / "o" / "masks.zarr").exists()


def test_cli_inspect_every_artifact(tmp_path):
    inp = _inputs(tmp_path, "snapkv")
    written = _compact(tmp_path, inp)
    app = _app()
    for path, words in (
        (written["masks"], ["masks", "retention per layer", "unique columns", "kept_final", "visible frac"]),
        (inp["raw"], ["raw_masks", "retention per layer", "shard-00001"]),
        (inp["trajectories"], ["trajectories", "reward", "eviction"]),
    ):
        res = CliRunner().invoke(app, ["inspect", str(path)], terminal_width=200)
        assert res.exit_code == 0, res.output
        for w in words:
            assert w in res.output, (path, w)
    prompts = write_table(
        [{"prompt_id": "p0", "task": "kv_retrieval", "prompt": "a b", "prompt_token_ids": [5, 6], "reference": "c"}],
        tmp_path / "prompts.arrow",
        "prompts",
    )
    res = CliRunner().invoke(app, ["inspect", str(prompts)])
    assert res.exit_code == 0 and "prompts" in res.output and "kv_retrieval: 1" in res.output
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such artifact" in res.output


def test_compact_stored_columns_are_deduplicated(tmp_path):
    inp = _inputs(tmp_path, "recent")
    written = _compact(tmp_path, inp)
    blocks = read_compact_rows(written["masks"], [0, 1])
    assert all(b.shape[1] == 1 for b in blocks) and blocks[0].dtype == np.uint8


def test_compression_level_range():
    from schemas.errors import SmdInputError as Err
    from schemas.params import load_params

    assert load_params(None, ["compaction.compression_level=9"]).compaction.compression_level == 9
    with pytest.raises(Err, match="compaction.compression_level"):
        load_params(None, ["compaction.compression_level=12"])
