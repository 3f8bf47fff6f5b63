#!/usr/bin/env bash
# The GPU check (docs/design.md "Devices"): one command, one table, under 8 minutes on one H200.
#
#   scripts/gpu_check.sh [options of scripts/gpu_check.py, e.g. --parts correctness,rollout]
#
# Parts: correctness (`pytest -m gpu`: rollout -> compact -> learn parity on CUDA for every eviction policy in
# float32 with TF32 off and in bf16, flex vs the SDPA reference in values and gradients, the learner under
# DeepSpeed on one GPU), rollout and learner speed and memory at a Qwen3-1.7B shape (random bf16 weights), and
# the default experiment for 2 iterations. Each part runs in its own process with a time limit; the table says
# PASS/FAIL/OOM/TIMEOUT per row and the exit code is 1 when any row failed.
#
# Install. With a package registry, install the GPU pins first (README: `pip install -e '.[dev,gpu]'`). On a
# machine without one (the lent GPU machine: Python 3.12, torch 2.11, transformers 5.17 in its image), carry
# the missing packages as cp312 wheels in ./wheels/ (zarr, numcodecs, pydantic, deepspeed, pytest, ...): this
# script installs every wheels/*.whl without an index or dependency resolution, then the project itself with
# `--no-deps` (its pins are for registries; the code supports torch >= 2.11 and transformers >= 5.17). vLLM's
# GPU build is too large to carry: the vLLM engine stays untested there. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if compgen -G "wheels/*.whl" > /dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps wheels/*.whl \
        || echo "gpu_check: installing wheels/*.whl failed; continuing with what is installed" >&2
fi
# --no-build-isolation: no registry to fetch setuptools from; the image's own setuptools builds the editable
# install. If that still fails, the check runs from the checkout through PYTHONPATH.
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
    || echo "gpu_check: pip install -e . failed; running from the checkout (PYTHONPATH)" >&2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py "$@"
