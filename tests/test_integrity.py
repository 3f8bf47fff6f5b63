"""Integrity (issue 24): every artifact carries a digest of its data, verified on read, and mask stores are bound
to the trajectory table they belong to. A flipped byte inside a value (which the format itself would read as
another value) is one line naming the file; masks of another rollout are refused by compaction and the learner
with one line naming both files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from schemas.compacted_masks import open_mask_store, read_mask_rows
from schemas.errors import SmdInputError
from schemas.params.compaction import CompactionParams
from schemas.params.learner import LearnerParams
from schemas.raw_masks import read_raw_masks
from schemas.tables import data_digest, read_table, trajectories_binding, write_table
from schemas.weights import DIGEST_FILE, verify_weights_digest
from stages.common.model import load_policy
from stages.compaction import run_compaction
from stages.learner.data import load_learner_data
from tests.helpers import make_inputs, make_model_dir

LENGTHS, PROMPTS, L, H = [40, 57, 33, 64], [10, 30, 20, 24], 2, 2


def _flip(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0x01
    path.write_bytes(bytes(blob))


def _rollout(root: Path, seed: int = 0) -> dict:
    inp = make_inputs(root, "snapkv", LENGTHS, PROMPTS, num_layers=L, num_kv_heads=H, num_shards=2, seed=seed,
                      permute=False)
    inp["masks"] = run_compaction(CompactionParams(chunk_rows=2), inp["trajectories"], inp["raw"],
                           root / "compact" / "masks.zarr")["masks"]
    return inp


def test_table_digest_follows_values_not_chunking(tmp_path):
    rows = [{"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": f"needle-{i:03d}", "prompt_token_ids": [i, 5],
             "reference": "r"} for i in range(50)]
    path = write_table(rows, tmp_path / "p.arrow", "prompts")
    table = read_table(path, "prompts")
    assert table.schema.metadata[b"data_digest"] == data_digest(table).encode()
    rechunked = pa.concat_tables([table.slice(0, 7), table.slice(7)])
    assert data_digest(rechunked) == data_digest(table)
    assert data_digest(table.slice(1)) != data_digest(table)
    # a flipped letter inside one prompt string: still a valid Arrow file of the right schema, refused by the digest
    offset = path.read_bytes().index(b"needle-017") + 8
    _flip(path, offset)
    with pytest.raises(SmdInputError, match="data_digest: the values do not match") as err:
        read_table(path, "prompts")
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_mask_stores_refuse_a_flipped_chunk_byte_and_flipped_attributes(tmp_path):
    inp = _rollout(tmp_path)
    raw_chunk = inp["raw"] / "shard-00000" / "evict_at" / "c" / "0" / "0" / "0"
    _flip(raw_chunk, raw_chunk.stat().st_size // 2)
    with pytest.raises(SmdInputError, match=r"shard-00000/evict_at: unreadable"):
        read_raw_masks(inp["raw"])

    store = inp["masks"]
    assert open_mask_store(store).num_rows == len(LENGTHS)
    chunk = next(p for p in sorted((store / "evict_at" / "c").rglob("*")) if p.is_file())
    _flip(chunk, chunk.stat().st_size // 2)
    with pytest.raises(SmdInputError, match="evict_at: unreadable chunk"):
        read_mask_rows(store, [0])

    # a changed digit in the attributes that still parses (a retention statistic) is refused on open
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["retention"]["kept_final_fraction"][0][0] += 0.125
    meta.write_text(json.dumps(doc))
    with pytest.raises(SmdInputError, match="attrs_digest: the attributes do not match"):
        open_mask_store(store)


def test_learner_refuses_compacted_masks_of_another_rollout(tmp_path):
    """Equal row lengths and prompt lengths, another rollout's masks: every structural check passes, the
    binding does not; the line names both files."""
    ours, theirs = _rollout(tmp_path / "a"), _rollout(tmp_path / "b", seed=1)
    assert trajectories_binding(read_table(ours["trajectories"], "trajectories")) != trajectories_binding(
        read_table(theirs["trajectories"], "trajectories"))
    load_learner_data(LearnerParams(), ours["trajectories"], ours["masks"], L, H, need_masks=True)  # its own: fine
    with pytest.raises(SmdInputError, match="masks from another rollout") as err:
        load_learner_data(LearnerParams(), ours["trajectories"], theirs["masks"], L, H, need_masks=True)
    assert str(theirs["masks"]) in str(err.value) and str(ours["trajectories"]) in str(err.value)
    # rescoring the rewards keeps the binding (the masks describe the sampled tokens, not the reward)
    table = read_table(ours["trajectories"], "trajectories")
    rows = table.to_pylist()
    for row in rows:
        row["reward"] = 1.0
    write_table(rows, ours["trajectories"], "trajectories", json.loads(table.schema.metadata[b"config"]))
    load_learner_data(LearnerParams(), ours["trajectories"], ours["masks"], L, H, need_masks=True)


def test_policy_weights_digest_checked_at_load(tmp_path):
    model_dir = make_model_dir(tmp_path)
    assert json.loads((model_dir / DIGEST_FILE).read_text())["files"].keys() == {"model.safetensors"}
    reference = load_policy(model_dir)
    weights = model_dir / "model.safetensors"
    _flip(weights, weights.stat().st_size - 3)  # inside the last tensor's data: safetensors reads another float
    with pytest.raises(SmdInputError, match="model.safetensors: weights do not match") as err:
        load_policy(model_dir)
    assert "\n" not in str(err.value)
    _flip(weights, weights.stat().st_size - 3)  # restored: loads again, the same weights
    again = load_policy(model_dir)
    assert all(np.array_equal(a.detach().numpy(), b.detach().numpy())
               for a, b in zip(reference.parameters(), again.parameters()))
    (model_dir / DIGEST_FILE).unlink()  # smd wrote the directory (ownership marker): the digest is required
    with pytest.raises(SmdInputError, match=f"{DIGEST_FILE}: missing"):
        verify_weights_digest(model_dir)
    (model_dir / ".smd-owner").unlink()  # a user's model directory (no marker, no digest) loads as it is
    verify_weights_digest(model_dir)


def test_full_disk_during_a_write_is_one_line_and_keeps_the_previous_artifact(tmp_path):
    """A write that runs out of room (RLIMIT_FSIZE: each file capped, EFBIG as on a full disk) fails with one
    line; the atomic write leaves the previous store as it was and no temporary behind."""
    import hashlib
    import os
    import resource
    import signal
    import subprocess
    import sys

    inp = _rollout(tmp_path)
    store = inp["masks"]
    before = {p.relative_to(store): hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()}
    limit = max(p.stat().st_size for p in store.rglob("*") if p.is_file()) // 2

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "cli.main", "compact", "--trajectories", str(inp["trajectories"]),
                          "--raw-masks", str(inp["raw"]), "--out", str(store), "--metrics",
                          str(tmp_path / "m" / "metrics.json")], capture_output=True, text=True, preexec_fn=cap,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: disk full"), res.stderr[-2000:]
    after = {p.relative_to(store): hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in store.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left
    assert not (tmp_path / "m").exists()  # nor the metrics of the failed run
