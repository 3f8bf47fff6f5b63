"""Fault soak (issue 24): `smdctl chain` killed with SIGKILL at seeded random moments and resumed, against an
uninterrupted run; then a full disk during a write. A script, not a CI test (minutes of CPU).

    .venv/bin/python scripts/fault_soak.py [--iterations 12] [--kills 10] [--seed 0] [--work DIR]

1. Builds a micro project (tiny model, kv_retrieval prompts; `smdctl init-model`, `smdctl prepare`).
2. Reference: `smdctl chain --iterations N` uninterrupted, timed.
3. Soak: the same chain in the same run directory (the reference moved aside), started again and again, each start SIGKILLed (the whole
   process group) after a seeded random delay until at least `--kills` kills have landed, then left to finish.
   After every kill each artifact file that exists must equal the reference's (nothing partial is ever
   published); the chain resumes after the last evaluated iteration.
4. The end state must equal the reference byte for byte: trajectories, raw and compacted masks, policy
   weights, trainer state, eval predictions and metrics (metrics JSON without wall-clock fields).
5. Full disk: `smdctl compact -i 1` rewriting an existing store under RLIMIT_FSIZE (writes past the limit
   fail with EFBIG, as on a full disk) must fail with one line on stderr, leave the previous store as it was
   and no temporary behind.
Prints one table: fault, count, outcome, anything lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MICRO = {
    "seed": 0,
    "model": {"tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                       "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 256}},
    "prepare": {"num_train": 16, "num_eval": 4, "context_tokens": 30, "num_pairs": 2, "num_queries": 1},
    "rollout": {"prompts_per_iteration": 3, "group_size": 2, "max_new_tokens": 4, "batch_size": 6,
                "min_prompt_tokens": 0, "eviction": {"policy": "snapkv", "keep_ratio": 0.5, "sinks": 2, "window": 4}},
    "learner": {"micro_batch_size": 3},
    "evaluate": {"max_new_tokens": 4, "batch_size": 4},
}
# Wall-clock figures in the metrics files: the only bytes that differ between two runs of a stage.
TIMING_KEY = re.compile(r"seconds|minutes|per_s|peak_rss")
TEMPORARY = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}$")


EXTENSIONS = {"dir": ""}  # the soak's own TORCH_EXTENSIONS_DIR (set in main): its JIT locks are the soak's


def env() -> dict[str, str]:
    """The stages' environment: this checkout first on the path, CPU DeepSpeed, one thread (deterministic and
    polite on a shared machine), no rendezvous inherited, a private JIT-extension directory (see stale_locks)."""
    out = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK")}
    out.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}")
    if EXTENSIONS["dir"]:
        out["TORCH_EXTENSIONS_DIR"] = EXTENSIONS["dir"]
    return out


def remove_stale_locks() -> int:
    """Remove the JIT-extension build locks a killed chain left (none of the soak's processes runs now).

    torch.utils.cpp_extension guards every load of a JIT op (DeepSpeed's shm_comm) with a lock *file*
    (FileBaton), created and removed around the load: a SIGKILL in that window leaves it, and every later load
    waits for it forever. Found by this soak; counted in its table."""
    locks = list(Path(EXTENSIONS["dir"]).glob("*/lock")) if EXTENSIONS["dir"] else []
    for lock in locks:
        lock.unlink()
    return len(locks)


def smdctl(args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, **kw)


def digest(path: Path) -> str:
    """A file's SHA-256; JSON metrics files without their wall-clock figures."""
    data = path.read_bytes()
    if path.suffix == ".json" and path.name not in ("config.json", "weights_digest.json", "zarr.json"):
        def drop(node):
            if isinstance(node, dict):
                return {k: drop(v) for k, v in node.items() if not TIMING_KEY.search(k)}
            if isinstance(node, list):
                return [drop(v) for v in node]
            return node
        try:
            data = json.dumps(drop(json.loads(data)), sort_keys=True).encode()
        except ValueError:
            pass
    return hashlib.sha256(data).hexdigest()


def snapshot(run: Path) -> dict[str, str]:
    """Every published artifact file under `run`/artifacts (temporaries excluded) -> its digest."""
    art = run / "artifacts"
    # tensorboard/ is a view rebuilt from the metrics compared here (wall-clock figures included): not compared
    return {p.relative_to(run).as_posix(): digest(p) for p in sorted(art.rglob("*"))
            if p.is_file() and not any(TEMPORARY.match(part) for part in p.relative_to(art).parts)
            and p.relative_to(art).parts[0] != "tensorboard"}


def activity(run: Path) -> tuple[int, int]:
    """(entries, newest mtime) under `run`/artifacts: changes once a started chain writes anything."""
    count, newest = 0, 0
    for top, dirs, files in os.walk(run / "artifacts", onerror=lambda err: None):  # renamed under us: skip
        for name in dirs + files:
            try:
                newest = max(newest, os.stat(os.path.join(top, name), follow_symlinks=False).st_mtime_ns)
                count += 1
            except OSError:
                pass
    return count, newest


def temporaries(run: Path) -> list[str]:
    return sorted(p.relative_to(run).as_posix() for p in (run / "artifacts").rglob("*") if TEMPORARY.match(p.name))


def project(work: Path) -> Path:
    """The micro project: params, the tiny model (the chain's warm start) and the prompt splits."""
    proj = work / "proj"
    proj.mkdir(parents=True)
    (proj / "params.yaml").write_text(yaml.safe_dump(MICRO))
    for args in (["init-model"], ["prepare"]):
        res = smdctl(args, proj)
        if res.returncode:
            sys.exit(f"{args}: {res.stderr[-2000:]}")
    return proj


def chain_argv(proj: Path, run: Path, iterations: int) -> list[str]:
    return [sys.executable, "-m", "cli.main", "chain", "--run-dir", str(run), "--params", str(proj / "params.yaml"),
            "--iterations", str(iterations), "--warmstart", str(proj / "artifacts/model/init"),
            "--data", str(proj / "artifacts/data")]


def soak(proj: Path, work: Path, iterations: int, kills_wanted: int, seed: int) -> list[tuple[str, int, str, str]]:
    # Both runs use the same run directory (moved aside in between): the artifacts record their paths in their
    # configs, so two directories would differ in those bytes alone.
    ref, run = work / "ref", work / "run"
    # warm-up: the first learn builds DeepSpeed's CPU ops (minutes, once per machine); time the reference after it
    subprocess.run(chain_argv(proj, work / "warm-up", 1), cwd=proj, env=env(), capture_output=True, check=True)
    t0 = time.monotonic()
    res = subprocess.run(chain_argv(proj, run, iterations), cwd=proj, env=env(), capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"reference chain failed: {res.stderr[-3000:]}")
    ref_seconds = time.monotonic() - t0
    run.rename(ref)
    expected = snapshot(ref)
    # the chain prints "iteration n/N done in S s": what is left of the wall time is start-up (imports)
    per_iteration = [float(x) for x in re.findall(r"iteration \d+/\d+ done in ([0-9.]+)s", res.stderr)]
    startup_s = max(ref_seconds - sum(per_iteration), 1.0)
    iteration_s = (ref_seconds - startup_s) / iterations  # the mean: iterations vary with the machine's load
    print(f"reference: {iterations} iterations in {ref_seconds:.0f} s ({startup_s:.0f} s start-up, "
          f"{iteration_s:.1f} s per iteration), {len(expected)} files", flush=True)
    rng = random.Random(seed)
    per_iteration_files = max(1, len(list((ref / "artifacts").rglob("*"))) // iterations)
    kills = finished_early = partial = starts = 0
    hit: set[int] = set()  # the iterations the kills landed in (the one after the last with progress.json)
    stale = 0  # JIT-extension locks left by a kill (each would hang every later start)
    while True:
        starts += 1
        stale += remove_stale_locks()
        proc = subprocess.Popen(chain_argv(proj, run, iterations), cwd=proj, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        if kills < kills_wanted:
            # a moment measured in progress, not in seconds (an iteration takes 1 s on an idle machine and 10 s on
            # a loaded one): once the chain writes, let it publish 1 .. 2 iterations' worth of entries, then a
            # jitter of up to half a second. Kills land in every stage, and the chain gets ahead between kills (a
            # killed iteration reruns whole), so they spread over the iterations.
            before = activity(run)
            started = time.monotonic()
            while proc.poll() is None and activity(run) == before and time.monotonic() - started < 600:
                time.sleep(0.05)
            target = activity(run)[0] + rng.randint(1, 2 * per_iteration_files)
            while proc.poll() is None and activity(run)[0] < target and time.monotonic() - started < 600:
                time.sleep(0.02)
            delay = rng.uniform(0.0, 0.5)
            try:
                proc.wait(timeout=delay)
                if proc.returncode:
                    sys.exit(f"resumed chain failed: {proc.stderr.read()[-3000:]}")
                finished_early += 1
                break  # the chain completed before this kill: nothing left to interrupt
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kills += 1
                hit_now = 1 + len(list((run / "artifacts").glob("iter-*/progress.json")))
                hit.add(hit_now)
                present = snapshot(run)
                # nothing partial is published: each file present equals the reference's (the chain keeps the
                # trainer state of the newest policy only, so an older one may still be here mid-run)
                partial += sum(1 for k, v in present.items() if k in expected and expected[k] != v)
                print(f"kill {kills} in iteration {max(hit_now, 1)}: {len(present)} files present", flush=True)
                continue
        else:
            err = proc.communicate()[1]
            if proc.returncode:
                sys.exit(f"resumed chain failed: {err[-3000:]}")
        if proc.returncode == 0 and kills >= kills_wanted:
            break
    got = snapshot(run)
    lost = sorted(set(expected) - set(got))
    differ = sorted(k for k in expected if k in got and got[k] != expected[k])
    extra = sorted(set(got) - set(expected))
    outcome = "identical to the uninterrupted run" if not (lost or differ or extra) else (
        f"{len(differ)} differ, {len(lost)} missing, {len(extra)} extra")
    rows = [(f"SIGKILL at a seeded random moment, then resume (in iterations {sorted(hit)})", kills, outcome,
             "none" if not (lost or differ) else ", ".join((differ + lost)[:3])),
            ("  partial artifact visible after a kill", kills, f"{partial} partial files", "none" if not partial
             else "see above"),
            ("  chain finished before its kill", finished_early, "resumed and compared", "none"),
            ("  temporaries left after the last resume", 1, f"{len(temporaries(run))}", "none"),
            ("  torch JIT-extension lock left by a kill (the next start would wait forever)", stale,
             "removed by the soak before the next start (not by smd)", "none; a real run hangs")]
    return rows


def full_disk(proj: Path, work: Path) -> tuple[str, int, str, str]:
    """`smdctl compact -i 1` over an existing store with writes capped at 64 KiB (EFBIG, like ENOSPC)."""
    run = work / "run"
    store = run / "artifacts/iter-001/compact/masks.zarr"
    before = {p.relative_to(store).as_posix(): digest(p) for p in store.rglob("*") if p.is_file()}
    # below the store's size: the rewrite cannot fit, whichever of its files crosses the limit first
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    limit = max(512, size // 4)

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    it = run / "artifacts/iter-001"
    res = subprocess.run([sys.executable, "-m", "cli.main", "compact", "-p", str(proj / "params.yaml"),
                          "--trajectories", str(it / "rollout/trajectories.arrow"),
                          "--raw-masks", str(it / "rollout/masks.raw.zarr"), "--out", str(store),
                          "--metrics", str(work / "full-disk-metrics.json")],
                         cwd=proj, env=env(), capture_output=True, text=True, preexec_fn=cap)
    after = {p.relative_to(store).as_posix(): digest(p) for p in store.rglob("*") if p.is_file()}
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    one_line = len(lines) == 1 and lines[0].startswith("error: ")
    left = [p.name for p in store.parent.iterdir() if TEMPORARY.match(p.name)]
    outcome = (f"exit {res.returncode}, {'one line' if one_line else f'{len(lines)} lines'}"
               f"{': ' + lines[0][:90] if one_line else ''}; {len(left)} temporaries")
    return (f"file size capped at {limit} B (RLIMIT_FSIZE) during compact", 1, outcome,
            "none: previous store intact" if after == before else "previous store changed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="smd-soak-"))
    EXTENSIONS["dir"] = str(work / "torch_extensions")
    try:
        proj = project(work)
        rows = soak(proj, work, args.iterations, args.kills, args.seed)
        rows.append(full_disk(proj, work))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| fault | count | outcome | lost |\n|---|---|---|---|")
    for fault, count, outcome, lost in rows:
        print(f"| {fault} | {count} | {outcome} | {lost} |")


if __name__ == "__main__":
    main()
