"""pytest set-up shared by every test module (their shared helpers are in tests/helpers.py).

DeepSpeed picks its accelerator when first imported: without CUDA the suite runs it on the CPU (gloo), as
`.ci/run` asks, also when pytest is started from a plain shell.

torch.compile's on-disk caches (TORCHINDUCTOR_CACHE_DIR, by default shared by every process of the machine) are
keyed to the CPU vector ISA for the whole suite, not only where smd compiles FlexAttention: an entry compiled
under another `ATEN_CPU_CAPABILITY` (a kernel x thread matrix run, an older checkout) otherwise comes back on a
cache hit with the other ISA's vector width and computes wrong results (stages/common/compile_cache.py).

Under pytest-xdist (`-n N`, as CI runs it) the workers share the machine's cores: each gets cores // N torch
threads, and its subprocesses the same through OMP_NUM_THREADS, unless the caller set OMP_NUM_THREADS. Left at
torch's default (every core per worker), 2 workers oversubscribe 2 cores and OpenMP's spinning barriers stall
both. The files that take longest are handed out first (`--dist loadfile` gives whole files in collection
order; see `pytest_collection_modifyitems`), so the workers finish together instead of one running the longest
file alone at the end.
"""

from __future__ import annotations

import os

import torch

from stages.common.compile_cache import key_compile_caches_to_cpu_isa

key_compile_caches_to_cpu_isa()

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    threads_per_worker = max(1, (os.cpu_count() or 1) // XDIST_WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker)
    torch.set_num_threads(threads_per_worker)

# The slowest files of the full suite (`--durations`, 2 workers on 2 cores), longest first: each holds a test of
# 2-7 minutes (a whole warm start, the 2-node pipeline, `dvc repro`, the README's example, 2-process learners).
LONGEST_FILES = ("test_warmstart.py", "test_multinode.py", "test_pipeline_e2e.py", "test_your_data.py",
                 "test_learner_distributed.py", "test_vllm_engine.py", "test_crash_safety.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first, every other test in its collected order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
