"""The comparison runner (`smdctl compare`): a comparison of arms x seeds as one resumable command (docs/results-comparison.md).

For each arm of the spec (`experiments/paper_comparison.yaml` by default: `-S` overrides of one params file)
and each seed, a `smdctl chain` run in `<out>/<arm>-s<seed>/`, `workers` at a time in child processes; each
gets the caller's `OMP_NUM_THREADS` when set, else the CPUs this process may run on (`os.sched_getaffinity`,
so `taskset` counts) // workers threads. Every run starts from the same warm start. Before the runs, the
warm start is evaluated once per distinct evaluation setting (dense, each compression) and copied in as
each run's iteration 0, so every arm's curve starts from its own compressed score; `eval_every: 0` turns
evaluation off (no start evaluation, none in the runs). Then `smdctl report` over all runs of `<out>` into
`<out>/report/`, and `<out>/compare.json` with the wall time of each run and of the whole: a later
invocation into the same `--out` (another arm, other seeds) adds its runs to those recorded there, a run
it runs again replacing its record. Interrupted, the same command resumes: finished runs are skipped, a
chain resumes after its last evaluated iteration.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from schemas.atomic import atomic_path
from schemas.compare import CompareSpec, load_compare_spec
from schemas.errors import SmdInputError
from schemas.layout import DETAILS, EVAL_PROMPTS, METRICS, TRAIN_PROMPTS, RunLayout
from schemas.params import Params, load_params


def run_compare(spec_path: Path, out: Path, params_path: Path, overrides: list[str], warmstart: Path, data: Path,
            only: str | None = None, workers: int | None = None, iterations: int | None = None,
            seeds: str | None = None, eval_every: int | None = None) -> dict[str, Path]:
    """Validate the spec and every arm's params, evaluate the start, run the chains, report. `iterations`,
    `seeds` (comma-separated) and `eval_every` (0: no evaluation) replace the spec's."""
    spec = load_compare_spec(spec_path)
    if iterations is not None:
        spec = spec.model_copy(update={"iterations": iterations})
    if eval_every is not None:
        if eval_every < 0:
            raise SmdInputError(f"--eval-every: expected 0 (no evaluation) or more, got {eval_every}")
        spec = spec.model_copy(update={"eval_every": eval_every})
    if seeds is not None:
        parts = [s.strip() for s in seeds.split(",") if s.strip()]
        if not parts or not all(s.isdigit() for s in parts):
            raise SmdInputError(f"--seeds: expected comma-separated seeds such as 0,1, got {seeds!r}")
        spec = spec.model_copy(update={"seeds": [int(s) for s in parts]})
    out, params_path, warmstart, data = (Path(x).resolve() for x in (out, params_path, warmstart, data))
    names = list(spec.arms)
    if only:
        names = [a.strip() for a in only.split(",") if a.strip()]
        unknown = [a for a in names if a not in spec.arms]
        if unknown:
            raise SmdInputError(f"{spec_path}: no arm {', '.join(unknown)} (arms: {', '.join(spec.arms)})")
    for path, what in ((warmstart / "config.json", "warm-start policy"), (data / EVAL_PROMPTS, "eval split"),
                       (data / TRAIN_PROMPTS, "train split")):
        if not path.is_file():
            raise SmdInputError(f"{path}: missing {what} (run `dvc repro warmstart` first, or pass --warmstart/--data)")
    arm_params = {arm: load_params(params_path, [*overrides, *spec.overrides(arm)]) for arm in names}
    earlier = recorded_runs(out / "compare.json")  # (read before any run: a damaged file stops nothing midway)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    starts = evaluate_starts(arm_params, warmstart, data, out / "_start") if spec.eval_every else {}
    jobs = [(arm, seed) for seed in spec.seeds for arm in names]  # every arm once first: a whole sweep per seed
    n_workers = workers or spec.workers
    env = thread_env(n_workers)
    cmd_base = [params_path, overrides, warmstart, data, spec, env]
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        results = list(pool.map(lambda job: run_arm(out, *job, starts.get(job[0]), *cmd_base), jobs))
    for r in results:  # what each run ran with: a later invocation into the same --out may use another spec
        r.update({"spec": str(spec_path), "overrides": [*overrides, *spec.overrides(r["arm"])]})
    failed = [r for r in results if r["returncode"] != 0]
    from stages.tools.report import report

    merged = merge_runs(earlier, results)
    runs = [out / r["run"] for r in merged if r.get("returncode") == 0 and (out / r["run"] / "artifacts").is_dir()]
    written = report(runs, out_dir=out / "report") if runs else {}
    threads = env["OMP_NUM_THREADS"]  # (a caller's may be OpenMP's per-level list, "4,2")
    summary = {"spec": str(spec_path), "spec_values": spec.model_dump(), "params": str(params_path),
               "overrides": overrides, "warmstart": str(warmstart), "workers": n_workers,
               "threads_per_run": int(threads) if threads.isdigit() else threads,
               "wall_seconds": round(time.perf_counter() - t0, 1), "runs": merged}
    with atomic_path(out / "compare.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    if failed:
        raise SmdInputError(f"{len(failed)} of {len(results)} runs failed: " + ", ".join(
            f"{r['run']} (exit {r['returncode']}, log {out / r['run'] / 'chain.log'})" for r in failed))
    return {"report": written["markdown"], "plot": written["plot"], "summary": out / "compare.json"}


def recorded_runs(path: Path) -> list[dict[str, Any]]:
    """The run records of an earlier `compare.json` in the same --out (none without one); one line naming the file
    and field when it is not one."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SmdInputError(f"{path}: not readable JSON ({exc.__class__.__name__}); move it away or choose another "
                            "--out") from exc
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and isinstance(r.get("run"), str) for r in runs):
        raise SmdInputError(f"{path}: runs: expected a list of run records with a `run` name; move it away or "
                            "choose another --out")
    return runs


def merge_runs(earlier: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The earlier invocations' run records with this one's: a run run again replaces its record in place (one
    found complete and skipped keeps the seconds it took when it ran), a new run comes after them."""
    by_name = {r["run"]: r for r in now}
    merged = []
    for old in earlier:
        new = by_name.pop(old["run"], None)
        if new is not None and new.get("skipped") and isinstance(old.get("seconds"), int | float):
            new = {**new, "seconds": old["seconds"]}
        merged.append(old if new is None else new)
    return merged + [r for r in now if r["run"] in by_name]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: `taskset` and cgroup cpusets count), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # (no sched_getaffinity on macOS and Windows)
        return os.cpu_count() or 1


def thread_env(workers: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """`OMP_NUM_THREADS` / `MKL_NUM_THREADS` of each run: the caller's when set, else the available CPUs // the
    runs at a time (at least 1); MKL's follows OpenMP's unless the caller set it."""
    environ = os.environ if environ is None else environ
    threads = environ.get("OMP_NUM_THREADS", "").strip() or str(max(1, available_cpus() // workers))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": environ.get("MKL_NUM_THREADS", "").strip() or threads}


def _eval_key(p: Params) -> str:
    """What the warm start's evaluation depends on: the evaluation settings, the compression its compressed mode
    runs (`evaluate.compressed_eviction`, else `rollout.eviction`: the same eviction reached either way is one key,
    so a dense arm scored under SnapKV 0.5 shares the SnapKV 0.5 arms' evaluation), the model and the reward
    (functions and their files' digests)."""
    from stages.evaluate.stage import eviction_for

    return _settings_digest(p, {"evaluate": p.evaluate.model_dump(mode="json", exclude={"compressed_eviction"}),
                                "compressed": eviction_for("compressed", p).model_dump(mode="json")})


def _legacy_eval_key(p: Params) -> str:
    """The key before evaluations were shared by their effective compression (the evaluate section and
    `rollout.eviction` as written): a comparison started then finds its stored evaluations under it."""
    return _settings_digest(p, {"evaluate": p.evaluate.model_dump(mode="json"),
                                "eviction": p.rollout.eviction.model_dump(mode="json")})


def _settings_digest(p: Params, tree: dict[str, Any]) -> str:
    """12 hex digits of sha256 over `tree` plus the model section and, when set, the reward functions' record."""
    from stages.common.scoring import reward_record

    tree = {**tree, "model": p.model.model_dump(mode="json")}
    if p.reward.function:  # (keys of runs without reward functions stay as they were)
        tree["reward"] = reward_record(p.reward)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:12]


def evaluate_starts(arm_params: dict[str, Params], warmstart: Path, data: Path, root: Path) -> dict[str, Path]:
    """Evaluate the warm start once per distinct evaluation setting; return arm -> its evaluate directory."""
    from stages.evaluate.stage import run_evaluate

    by_key: dict[str, Path] = {}
    out: dict[str, Path] = {}
    for arm, p in arm_params.items():
        key = _eval_key(p)
        if key not in by_key:
            target = root / key / "evaluate"
            legacy = root / _legacy_eval_key(p) / "evaluate"
            if not (target / METRICS).is_file() and (legacy / METRICS).is_file():
                target = legacy  # stored by an earlier version under the old key: the same evaluation
            if not (target / METRICS).is_file():
                print(f"evaluating the warm start ({arm}'s compression) -> {target}", file=sys.stderr, flush=True)
                run_evaluate(p, 0, warmstart, data / EVAL_PROMPTS, target, show_progress=False)
            by_key[key] = target
        out[arm] = by_key[key]
    return out


def run_arm(out: Path, arm: str, seed: int, start_eval: Path | None, params_path: Path, overrides: list[str],
            warmstart: Path, data: Path, spec: CompareSpec, env: dict[str, str]) -> dict[str, Any]:
    """One `smdctl chain` run in a child process (its output in chain.log, `env` added to its environment);
    skipped when already complete. `start_eval`: the warm start's evaluation (None: evaluation off)."""
    name = f"{arm}-s{seed}"
    run_dir = out / name
    run = RunLayout(run_dir / "artifacts")
    iter0 = run.iteration(0).evaluate  # the warm start's evaluation as iteration 0
    if start_eval is not None and not (iter0 / METRICS).is_file():
        iter0.mkdir(parents=True, exist_ok=True)
        for f in (METRICS, DETAILS):
            shutil.copyfile(start_eval / f, iter0 / f)
    last_iteration = run.iteration(spec.iterations)
    last = last_iteration.evaluate / METRICS if spec.eval_every else last_iteration.progress
    run_dir.mkdir(parents=True, exist_ok=True)
    if last.is_file():
        return {"run": name, "arm": arm, "seed": seed, "returncode": 0, "seconds": 0.0, "skipped": True}
    sets = [*overrides, *spec.overrides(arm), f"seed={seed}"]
    cmd = [sys.executable, "-m", "cli.main", "chain", "--run-dir", str(run_dir), "--params", str(params_path),
           "--warmstart", str(warmstart), "--data", str(data), "--iterations", str(spec.iterations),
           "--eval-every", str(spec.eval_every), *[x for s in sets for x in ("-S", s)]]
    env = {**os.environ, **env}
    print(f"run {name}: {' '.join(sets)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(run_dir / "chain.log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    seconds = round(time.perf_counter() - t0, 1)
    print(f"run {name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {seconds}s", file=sys.stderr, flush=True)
    return {"run": name, "arm": arm, "seed": seed, "returncode": rc, "seconds": seconds, "skipped": False}
