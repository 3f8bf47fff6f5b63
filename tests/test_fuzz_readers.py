"""Every reader fuzzed through the CLI (issue 13): truncation, byte flips, a removed file and files of the wrong kind.

For each artifact kind a micro pipeline's pristine artifact is copied, damaged (Hypothesis, derandomized), and
given to the command that reads it in the pipeline: prompts -> rollout, trajectories and raw masks -> compact,
compacted masks -> learn, policy directory -> rollout, trainer_state -> learn (iteration 2, resuming), metrics
JSON -> progress, params YAML -> params --write. The contract: exit 0 (the damage left a valid artifact) or
exit 2 with one line naming the damaged file and nothing written; never a traceback. Damage that cannot leave a
valid artifact (wrong kind, empty file, a removed file, a cut binary file) must be refused, and so must, since
the integrity checks (issue 24), a flipped byte in a checksummed file (a weight file, a Zarr chunk: crc32c) and
another run's masks or trajectories (the mask stores are bound to their table). A flipped byte in an Arrow table
may be accepted only where it changed no value nor metadata (alignment padding): the data digest covers both.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.feather as feather
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli.main import app
from tests.forkserver import private_extensions_dir

MICRO = {
    "model": {"tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                       "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 256}},
    "prepare": {"num_train": 8, "num_eval": 2, "context_tokens": 30, "num_pairs": 2, "num_queries": 1},
    "rollout": {"prompts_per_iteration": 2, "group_size": 2, "max_new_tokens": 3, "batch_size": 4,
                "min_prompt_tokens": 0, "eviction": {"policy": "snapkv", "keep_ratio": 0.5}},
    "learner": {"micro_batch_size": 4},
    "evaluate": {"max_new_tokens": 3, "batch_size": 2},
    "pipeline": {"num_iterations": 2},
}
BINARY = (".arrow", ".safetensors", ".pt")
# files a reader may do without: Hugging Face defaults, DeepSpeed's conversion scripts and `latest` (the learner
# loads its tag by name), the ownership marker (read by writers only)
OPTIONAL = {"generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "zero_to_fp32.py", "zero_to_torch.py", "latest", ".smd-owner"}
TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A micro pipeline (two iterations; the tiny model as the warm start) built through the CLI."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "params.yaml").write_text(yaml.safe_dump(MICRO))
    cwd, extensions = os.getcwd(), os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = private_extensions_dir()  # see forkserver: a stable JIT-op directory
    os.chdir(root)
    try:
        for args in (["init-model"], ["prepare"],
                     ["rollout", "-i", "1", "--policy", "artifacts/model/init", "--no-progress"], ["compact", "-i", "1"],
                     ["learn", "-i", "1", "--policy", "artifacts/model/init", "--quiet"],
                     ["evaluate", "-i", "1", "--no-progress"],
                     ["rollout", "-i", "2", "--policy", "artifacts/iter-001/policy", "--no-progress"],
                     ["compact", "-i", "2"]):
            res = _invoke(args)
            assert res.exit_code == 0, (args, res.output)
    finally:
        os.chdir(cwd)
        if extensions is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    yield root
    for kind, counts in sorted(TALLY.items()):  # the issue note's table (pytest -s shows it)
        print(f"fuzz {kind}: {dict(counts)}")


@dataclass
class Reader:
    """One artifact kind: where the pristine copy is, what replaces it when of the wrong kind, and the command."""

    artifact: str  # relative to the base directory
    wrong: list[str]  # other artifacts (relative to base) or "empty", "dir", "noise", "jsonlist"
    command: Callable[[Path, Path, Path], list[str]]  # (base, damaged artifact, output dir) -> argv
    copy_root: str | None = None  # copy this enclosing directory (the artifact sits inside it)


A = "artifacts"
I1, I2 = f"{A}/iter-001", f"{A}/iter-002"
READERS = {
    "prompts": Reader(f"{A}/data/train.arrow", [f"{I1}/rollout/trajectories.arrow", f"{A}/data/stats.json",
                                                "params.yaml", "empty", "dir", "noise"],
                      lambda b, x, o: ["rollout", "-i", "1", "-p", str(b / "params.yaml"), "--policy",
                                       str(b / A / "model/init"), "--prompts", str(x), "--out", str(o), "--no-progress"]),
    "trajectories": Reader(f"{I1}/rollout/trajectories.arrow", [f"{A}/data/train.arrow", f"other run:{I2}/rollout/trajectories.arrow",
                                                                f"{I1}/rollout/details.json", "empty", "dir", "noise"],
                           lambda b, x, o: ["compact", "-p", str(b / "params.yaml"), "--trajectories", str(x),
                                            "--raw-masks", str(b / I1 / "rollout/masks.raw.zarr"),
                                            "--out", str(o / "masks.zarr"), "--metrics", str(o / "metrics.json")]),
    "raw masks": Reader(f"{I1}/rollout/masks.raw.zarr", [f"{I1}/compact/masks.zarr", f"other run:{I2}/rollout/masks.raw.zarr",
                                                         f"{A}/model/init", f"{A}/data/train.arrow", "dir", "noise"],
                        lambda b, x, o: ["compact", "-p", str(b / "params.yaml"), "--trajectories",
                                         str(b / I1 / "rollout/trajectories.arrow"), "--raw-masks", str(x),
                                         "--out", str(o / "masks.zarr"), "--metrics", str(o / "metrics.json")]),
    "compacted masks": Reader(f"{I1}/compact/masks.zarr", [f"{I1}/rollout/masks.raw.zarr", f"other run:{I2}/compact/masks.zarr",
                                                           f"{A}/model/init", f"{A}/data/train.arrow", "dir", "noise"],
                              lambda b, x, o: ["learn", "-i", "1", "-p", str(b / "params.yaml"), "--quiet", "--policy",
                                               str(b / A / "model/init"), "--trajectories",
                                               str(b / I1 / "rollout/trajectories.arrow"), "--masks", str(x),
                                               "--out", str(o / "policy"), "--metrics-dir", str(o / "learn")]),
    "policy directory": Reader(f"{A}/model/init", [f"{I1}/compact/masks.zarr", f"{A}/data/train.arrow", "dir", "noise"],
                               lambda b, x, o: ["rollout", "-i", "1", "-p", str(b / "params.yaml"), "--policy", str(x),
                                                "--prompts", str(b / A / "data/train.arrow"), "--out", str(o),
                                                "--no-progress"]),
    "trainer_state": Reader("trainer_state", [f"{I1}/compact/masks.zarr", f"{I1}/learn/metrics.json", "dir", "noise"],
                            lambda b, x, o: ["learn", "-i", "2", "-p", str(b / "params.yaml"), "--quiet", "--policy",
                                             str(x.parent), "--trajectories", str(b / I2 / "rollout/trajectories.arrow"),
                                             "--masks", str(b / I2 / "compact/masks.zarr"), "--out", str(o / "policy"),
                                             "--metrics-dir", str(o / "learn")],
                            copy_root=f"{I1}/policy"),
    "metrics": Reader("rollout/details.json", [f"{A}/data/train.arrow", "params.yaml", "jsonlist", "empty", "dir",
                                               "noise"],
                      lambda b, x, o: ["progress", "-i", "1", "--artifacts", str(x.parents[2])],
                      copy_root=I1),
    "params": Reader("params.yaml", [f"{A}/data/stats.json", f"{A}/data/train.arrow", "jsonlist", "dir", "noise"],
                     lambda b, x, o: ["params", "-p", str(x), "--write", str(o / "params.yaml")]),
}
# metrics: progress reads every stage's details.json / metrics.json; each of them is a damage target
METRICS_FILES = [f"{stage}/{name}" for stage in ("rollout", "learn", "evaluate") for name in ("details.json",
                                                                                             "metrics.json")]


def _checksummed(victim: Path) -> bool:
    """A file whose every byte a checksum covers: weights (weights_digest.json) and Zarr chunks (crc32c)."""
    return victim.suffix == ".safetensors" or ("/c/" in victim.as_posix() and ".zarr/" in victim.as_posix())


def _same_table(damaged: Path, pristine: Path) -> None:
    """An accepted flip in an Arrow table left its values and metadata as they were."""
    a, b = feather.read_table(str(damaged)), feather.read_table(str(pristine))
    assert a.equals(b) and a.schema.metadata == b.schema.metadata, f"{damaged}: a changed table was accepted"


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _damage(data: st.DataObject, reader: Reader, base: Path, work: Path) -> tuple[Path, str, bool, Callable | None]:
    """Copy the pristine artifact under `work`, damage it; returns (damaged path, description, must refuse, a
    check of an accepted artifact or None)."""
    if reader.copy_root:  # the artifact lives inside a directory the command reads as a whole
        shutil.copytree(base / reader.copy_root, work / "iter-001", symlinks=True)
        rel = data.draw(st.sampled_from(METRICS_FILES)) if reader is READERS["metrics"] else reader.artifact
        target = work / "iter-001" / rel
        if reader is READERS["metrics"]:
            (work / "artifacts").mkdir()
            (work / "iter-001").rename(work / "artifacts" / "iter-001")
            target = work / "artifacts" / "iter-001" / rel
            if target.name == "metrics.json":  # progress reads the headline file when details.json is absent
                (target.parent / "details.json").unlink()
    else:
        source = base / reader.artifact
        target = work / source.name
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    def pristine_of(victim: Path) -> Path:
        """The pristine copy of a file of the damaged artifact."""
        if reader.copy_root:
            return base / reader.copy_root / victim.relative_to(target.parents[len(Path(rel).parts) - 1])
        return base / reader.artifact / victim.relative_to(target) if target.is_dir() else base / reader.artifact

    how = data.draw(st.sampled_from(["truncate", "flip", "wrong kind"] + (["remove a file"] if target.is_dir() else [])))
    files = _files(target)
    if how == "wrong kind":
        other = data.draw(st.sampled_from(reader.wrong))
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        if other == "empty":
            target.write_bytes(b"")
        elif other == "dir":
            target.mkdir()
        elif other == "noise":
            target.write_bytes(data.draw(st.binary(min_size=1, max_size=256)))
        elif other == "jsonlist":
            target.write_text("[1, 2]\n")
        else:  # another artifact; "other run:" one of the same kind from another rollout (it may well fit)
            source = base / other.removeprefix("other run:")
            (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
            if other.startswith("other run:"):  # bound to another table (or another table of the masks)
                return target, f"another run's artifact: {other}", True, None
        return target, f"{how}: {other}", True, None
    victim = data.draw(st.sampled_from(files))
    name = victim.relative_to(target.parent).as_posix()
    if how == "remove a file":
        victim.unlink()
        return target, f"{how}: {name}", victim.name not in OPTIONAL, None
    blob = bytearray(victim.read_bytes())
    if how == "truncate":
        keep = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        victim.write_bytes(bytes(blob[:keep]))
        # a text file cut at its end may still parse; a binary file, a marker or a JSON object cut short may not
        return target, f"{how}: {name} at {keep}/{len(blob)}", victim.suffix in BINARY, None
    offsets = data.draw(st.lists(st.integers(0, max(len(blob) - 1, 0)), min_size=1, max_size=4))
    for offset in offsets:
        if blob:
            blob[offset] ^= data.draw(st.integers(1, 255))
    victim.write_bytes(bytes(blob))
    check = (lambda: _same_table(victim, pristine_of(victim))) if victim.suffix == ".arrow" else None
    return target, f"{how}: {name} at {offsets}", _checksummed(victim), check


def _check(reader_name: str, data: st.DataObject, base: Path) -> None:
    reader = READERS[reader_name]
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        work = Path(tmp)
        target, what, must_refuse, check_accepted = _damage(data, reader, base, work)
        out = work / "out"
        before = sorted(p.relative_to(work).as_posix() for p in work.rglob("*"))
        res = _invoke(reader.command(base, target, out))
        err = res.stderr.strip()
        assert res.exit_code in (0, 2), f"{reader_name} ({what}): exit {res.exit_code}\n{res.output[-1500:]}" + (
            "".join(traceback.format_exception(res.exception)[-6:])[-3000:] if res.exception else "")
        assert "Traceback" not in res.output, f"{reader_name} ({what}): {res.output[-3000:]}"
        if res.exit_code == 0:
            assert not must_refuse, f"{reader_name} ({what}): accepted"
            if check_accepted is not None:
                check_accepted()
            TALLY[reader_name][f"{what.split(':')[0]}: accepted (still a valid artifact)"] += 1
            return
        TALLY[reader_name][f"{what.split(':')[0]}: refused"] += 1
        assert len(err.splitlines()) == 1 and err.startswith("error: "), f"{reader_name} ({what}): {err}"
        named = target.parent if reader_name == "trainer_state" else target
        assert str(named) in err, f"{reader_name} ({what}): the message does not name {named}: {err}"
        assert not out.exists(), f"{reader_name} ({what}): wrote {out}"
        after = sorted(p.relative_to(work).as_posix() for p in work.rglob("*"))
        assert after == before, f"{reader_name} ({what}): files appeared: {set(after) - set(before)}"


# no shrinking: each example runs a command; a failure prints its damage in full anyway
FUZZ = settings(derandomize=True, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
EXAMPLES = {"prompts": 14, "trajectories": 18, "raw masks": 18, "compacted masks": 16, "policy directory": 14,
            "trainer_state": 12, "metrics": 20, "params": 20}


@pytest.mark.slow
@pytest.mark.parametrize("reader_name", list(READERS))
def test_a_damaged_artifact_is_refused_with_one_line_or_still_valid(base, reader_name):
    @settings(FUZZ, max_examples=EXAMPLES[reader_name])
    @given(data=st.data())
    def fuzz(data):
        _check(reader_name, data, base)

    fuzz()
