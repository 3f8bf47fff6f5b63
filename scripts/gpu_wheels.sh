#!/usr/bin/env bash
# Builds wheels/ (gitignored) for the GPU check's machine (issue 32; docs/design.md §3b): Python 3.12 with torch
# 2.11 and transformers 5.17 (and their dependencies: numpy, pyyaml, typer, rich, safetensors, tokenizers,
# packaging, tqdm, sympy, ...) in its image, and no package registry. It carries cp312 manylinux x86_64 wheels of
# what the check imports and the image lacks, nothing else:
#   pydantic + pydantic-core + annotated-types + typing-inspection + typing-extensions (the image's package list,
#   as read on 2026-11-17, has no pydantic, which the schemas need), zarr + donfig + google-crc32c, numcodecs,
#   deepspeed (no wheel on the registry: built here as a pure-Python wheel from its sdist, no ops compiled) with
#   hjson. The image's own pyarrow, pytest, psutil, py-cpuinfo, msgpack, einops and ninja are used: pyarrow 17 (the
#   smallest cp312 wheel in pyproject's range, 38 MiB) no longer fits beside the working tree, and the preflight
#   prints the image's pyarrow version (pyproject's range: >= 17).
# Versions are the ones the CPU venv runs (pyproject.toml's ranges). Then it prints the size of what travels to the
# GPU machine (tracked and untracked-but-not-ignored files plus wheels/, which goes as `carry`) and fails above
# LIMIT_MIB (62; the machine takes 64 MiB in all).
#
#   scripts/gpu_wheels.sh            # PYTHON: the interpreter whose pip downloads (default python3); BUILD_PYTHON:
#                                    # one with torch and setuptools for the deepspeed build (default: PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
BUILD_PY="${BUILD_PYTHON:-$PY}"
LIMIT_MIB="${LIMIT_MIB:-62}"
DEEPSPEED="deepspeed==0.19.8"
BINARY=(
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    zarr==3.1.6 donfig==0.8.1.post1 google-crc32c==1.9.0 numcodecs==0.16.6
    hjson==3.1.0
)
rm -rf wheels
mkdir -p wheels
# cp312 manylinux x86_64 (or pure-Python) wheels only, no dependency resolution: the list above is the closure
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps -d wheels \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${BINARY[@]}"
# deepspeed: its sdist built into a py3-none-any wheel (DS_BUILD_OPS=0: no C++/CUDA op compiled; the learner uses
# torch's AdamW). --no-build-isolation: its setup.py imports torch, which the build python has.
DS_BUILD_OPS=0 "$BUILD_PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    --no-binary deepspeed -w wheels "$DEEPSPEED"
ls -l wheels/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
wheels_b=$(du -cb wheels/*.whl | tail -1 | cut -f1)
tree_b=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
         | awk '$2 == "total" {s += $1} END {print s + 0}')
total_b=$((wheels_b + tree_b))
printf 'wheels/ %.1f MiB + working tree %.1f MiB = %.1f MiB (limit %s MiB)\n' \
    "$(echo "$wheels_b / 1048576" | bc -l)" "$(echo "$tree_b / 1048576" | bc -l)" \
    "$(echo "$total_b / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total_b" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels: ${total_b} bytes exceed ${LIMIT_MIB} MiB: the GPU machine takes 64 MiB in all" >&2
    exit 1
fi
