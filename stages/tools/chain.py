"""The in-process iteration chain (`smdctl chain`): rollout -> compact -> learn -> evaluate -> progress.

The same stage functions `dvc repro` runs, writing the same artifact layout under `<run-dir>/artifacts/`, but
imports, the process group and the tokenizer/data caches are paid for once instead of once per stage and
iteration (on the tiny model start-up is most of an iteration's cost in separate processes). For sweeps and
seeds: `dvc repro` stays the reproducible, cached path of the default experiment. A chain resumes after the
last iteration whose evaluation is written; `smdctl report <run-dir>` draws its curves.
"""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import yaml

from schemas.atomic import atomic_path, check_replaceable
from schemas.layout import DETAILS, EVAL_PROMPTS, METRICS, TRAIN_PROMPTS, RunLayout
from schemas.params import Params

T = TypeVar("T")
REWARD_RECORD = "reward_files.json"  # under the run directory: what the run's scores depend on


def run_chain(p: Params, run_dir: Path, iterations: int, warmstart: Path, data: Path, eval_every: int = 1) -> RunLayout:
    """Run iterations 1..`iterations` under `run_dir` (resuming after the last complete one); return its layout.
    A resumed run whose reward functions or reward files changed is refused (`run_dir/reward_files.json`); a
    reward file that does not load fails before anything is written, and a start that failed before any rollout
    (a reward that raised on a row, ...) is retried after the fix as a first start.

    The warm start's metrics are copied in as iteration 0 of summary and report; `run_dir/params.yaml` holds the
    effective params (what `smdctl report` labels the run by). Evaluation runs every `eval_every` iterations and
    at the last (`eval_every` 0: never). With the warm start's metrics at hand, the run's headline
    (`artifacts/metrics.json`) follows the last iteration."""
    from stages.common.scoring import check_reward_record, reward_file_digests

    if p.reward.function:  # a reward file that cannot load fails before anything is written (issue 41)
        from stages.common.reward_functions import load_reward_functions

        reward_file_digests(p.reward)
        load_reward_functions(p.reward.function)
    run = RunLayout(run_dir / "artifacts")
    # a resumed run scores as it started: the reward functions and their files' digests (issue 33); until an
    # iteration has sampled (a first start that failed), the record is the reward of this start (issue 41)
    check_reward_record(p.reward, run_dir / REWARD_RECORD, started=has_scores(run))
    run.artifacts.mkdir(parents=True, exist_ok=True)
    for name in (METRICS, DETAILS):
        source = Path(warmstart).parent / name
        if source.is_file() and not (run.warmstart / name).exists():
            run.warmstart.mkdir(exist_ok=True)
            shutil.copyfile(source, run.warmstart / name)
    write_params(run_dir / "params.yaml", p)
    for n in range(1, iterations + 1):
        it = run.iteration(n)
        evaluated = eval_every > 0 and (n % eval_every == 0 or n == iterations)
        if it.progress.exists() and (not evaluated or (it.evaluate / METRICS).exists()):
            drop_older_trainer_state(run, n)  # a chain killed between progress.json and this cleanup
            continue  # done in an earlier run of this chain
        policy = run.start_policy(n, warmstart)
        t0 = time.perf_counter()
        run_iteration(p, n, policy, run, data, evaluated)
        print(f"iteration {n}/{iterations} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    if (run.warmstart / METRICS).is_file():  # the run's headline, as `dvc repro`'s headline stage writes it
        from stages.progress.headline import run_headline

        run_headline(iterations, run.iteration(iterations).progress, run.warmstart / METRICS, run.headline)
    return run


def has_scores(run: RunLayout) -> bool:
    """Whether an iteration of the run has rollouts (scored with the run's reward): a start that failed before
    any has none, and its retry takes the reward as it is now."""
    return any(path.is_dir() for path in run.artifacts.glob("iter-*/rollout"))


def write_params(path: Path, p: Params) -> None:
    """The effective params of the chain: what `smdctl report` labels the run by."""
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(p.model_dump(mode="json"), sort_keys=False))


def run_iteration(p: Params, n: int, policy: Path, run: RunLayout, data: Path, evaluated: bool) -> None:
    """One iteration's stages in order, with the artifact paths dvc.yaml declares (`schemas.layout`)."""
    from stages.compaction import run_compaction
    from stages.evaluate.stage import run_evaluate
    from stages.learner.train import run_learner
    from stages.progress.stage import run_progress
    from stages.rollout.stage import run_rollout

    it = run.iteration(n)
    for stale in (it.rollout, it.compact, it.learn, it.policy, it.evaluate):
        if stale.exists():  # a half-done iteration reruns whole; never a directory smd did not write
            check_replaceable(stale)
            shutil.rmtree(stale)
    # A vLLM stage runs in a process of its own, as under `dvc repro`: vLLM's in-process engine leaves the
    # process changed (its torch.distributed state), and DeepSpeed's learner cannot set up its groups after it.
    rollout = partial(in_own_process, run_rollout) if p.rollout.engine == "vllm" else run_rollout
    evaluate = partial(in_own_process, run_evaluate) if p.evaluate.engine == "vllm" else run_evaluate
    out = rollout(p, n, policy, data / TRAIN_PROMPTS, it.rollout, show_progress=False)
    run_compaction(p.compaction, out["trajectories"], out["raw_masks"], it.masks)
    run_learner(p, n, policy, out["trajectories"], it.masks, it.policy, it.learn)
    if evaluated:
        evaluate(p, n, it.policy, data / EVAL_PROMPTS, it.evaluate, show_progress=False)
    run_progress(n, run.artifacts)
    drop_older_trainer_state(run, n)


def drop_older_trainer_state(run, n: int) -> None:
    """Only the newest policy's optimizer state is needed to resume: remove iteration n-1's, once iteration n is
    complete (its progress.json written). Not before: a chain killed inside iteration n reruns it whole, and its
    learn resumes from n-1's optimizer state (found by scripts/fault_soak.py: removing it right after learn n
    made a rerun of n start Adam afresh, and every later iteration differ)."""
    if n > 1:
        shutil.rmtree(run.iteration(n - 1).policy / "trainer_state", ignore_errors=True)


def in_own_process(stage: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a stage function in a fresh (spawned) Python process and return its result; its exception (one-line
    bad input included) is raised here."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(stage, *args, **kwargs).result()
