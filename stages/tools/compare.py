"""The comparison runner (`smdctl compare`): a comparison of arms x seeds as one resumable command (docs/results-comparison.md).

For each arm of the spec (`experiments/paper_comparison.yaml` by default: `-S` overrides of one params file)
and each seed, a `smdctl chain` run in `<out>/<arm>-s<seed>/`, `workers` at a time in child processes with
`cpu_count // workers` torch threads each; every run starts from the same warm start. Before the runs, the
warm start is evaluated once per distinct evaluation setting (dense, each compression) and copied in as
each run's iteration 0, so every arm's curve starts from its own compressed score. Then `smdctl report`
over all runs into `<out>/report/`, and `<out>/compare.json` with the wall time of each run and of the
whole. Interrupted, the same command resumes: finished runs are skipped, a chain resumes after its last
evaluated iteration.
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
            seeds: str | None = None) -> dict[str, Path]:
    """Validate the spec and every arm's params, evaluate the start, run the chains, report. `iterations` and
    `seeds` (comma-separated) replace the spec's."""
    spec = load_compare_spec(spec_path)
    if iterations is not None:
        spec = spec.model_copy(update={"iterations": iterations})
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
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    starts = evaluate_starts(arm_params, warmstart, data, out / "_start")
    jobs = [(arm, seed) for seed in spec.seeds for arm in names]  # every arm once first: a whole sweep per seed
    n_workers = workers or spec.workers
    threads = max(1, (os.cpu_count() or 1) // n_workers)
    cmd_base = [params_path, overrides, warmstart, data, spec, threads]
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        results = list(pool.map(lambda job: run_arm(out, *job, starts[job[0]], *cmd_base), jobs))
    failed = [r for r in results if r["returncode"] != 0]
    from stages.tools.report import report

    runs = [out / r["run"] for r in results if r["returncode"] == 0]
    written = report(runs, out_dir=out / "report") if runs else {}
    summary = {"spec": str(spec_path), "spec_values": spec.model_dump(), "params": str(params_path),
               "overrides": overrides, "warmstart": str(warmstart), "workers": n_workers, "threads_per_run": threads,
               "wall_seconds": round(time.perf_counter() - t0, 1), "runs": results}
    with atomic_path(out / "compare.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    if failed:
        raise SmdInputError(f"{len(failed)} of {len(results)} runs failed: " + ", ".join(
            f"{r['run']} (exit {r['returncode']}, log {out / r['run'] / 'chain.log'})" for r in failed))
    return {"report": written["markdown"], "plot": written["plot"], "summary": out / "compare.json"}


def _eval_key(p: Params) -> str:
    """What the warm start's evaluation depends on: the evaluation settings, the compression and the reward
    (functions and their files' digests)."""
    from stages.common.scoring import reward_record

    tree = {"evaluate": p.evaluate.model_dump(mode="json"), "eviction": p.rollout.eviction.model_dump(mode="json"),
            "model": p.model.model_dump(mode="json")}
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
            if not (target / METRICS).is_file():
                print(f"evaluating the warm start ({arm}'s compression) -> {target}", file=sys.stderr, flush=True)
                run_evaluate(p, 0, warmstart, data / EVAL_PROMPTS, target, show_progress=False)
            by_key[key] = target
        out[arm] = by_key[key]
    return out


def run_arm(out: Path, arm: str, seed: int, start_eval: Path, params_path: Path, overrides: list[str],
            warmstart: Path, data: Path, spec: CompareSpec, threads: int) -> dict[str, Any]:
    """One `smdctl chain` run in a child process (its output in chain.log); skipped when already complete."""
    name = f"{arm}-s{seed}"
    run_dir = out / name
    run = RunLayout(run_dir / "artifacts")
    iter0 = run.iteration(0).evaluate  # the warm start's evaluation as iteration 0
    if not (iter0 / METRICS).is_file():
        iter0.mkdir(parents=True, exist_ok=True)
        for f in (METRICS, DETAILS):
            shutil.copyfile(start_eval / f, iter0 / f)
    last = run.iteration(spec.iterations).evaluate / METRICS
    if last.is_file():
        return {"run": name, "arm": arm, "seed": seed, "returncode": 0, "seconds": 0.0, "skipped": True}
    sets = [*overrides, *spec.overrides(arm), f"seed={seed}"]
    cmd = [sys.executable, "-m", "cli.main", "chain", "--run-dir", str(run_dir), "--params", str(params_path),
           "--warmstart", str(warmstart), "--data", str(data), "--iterations", str(spec.iterations),
           "--eval-every", str(spec.eval_every), *[x for s in sets for x in ("-S", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"run {name}: {' '.join(sets)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(run_dir / "chain.log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    seconds = round(time.perf_counter() - t0, 1)
    print(f"run {name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {seconds}s", file=sys.stderr, flush=True)
    return {"run": name, "arm": arm, "seed": seed, "returncode": rc, "seconds": seconds, "skipped": False}
