#!/usr/bin/env bash
# The GPU check (docs/design.md "Devices" and §3b): one command, one table, within 570 s on one H200, wheel
# install included (scripts/gpu_check.py --total-s).
#
#   scripts/gpu_check.sh [options of scripts/gpu_check.py, e.g. --parts preflight,correctness,rollout]
#
# Parts: preflight (versions, imports, CUDA and the device, C compiler and Python.h for Triton, free memory, a tiny
# FlexAttention forward + backward in float32 and bf16; a failure stops the check), correctness (`pytest -m gpu`:
# rollout -> compact -> learn parity on CUDA for every eviction policy in float32 with TF32 off and in bf16, flex vs
# the SDPA reference in values and gradients, the learner under DeepSpeed on one GPU), rollout and learner speed
# and memory at a Qwen3-1.7B shape (random bf16 weights), and the default experiment for 2 iterations. Each part
# runs in its own process group with a time limit and one shared deadline; every row is kept the moment it is
# measured, so a part killed at its limit still shows what it finished. The exit code is 1 when any row failed
# (or, on CUDA, was skipped).
#
# Install. With a package registry, install the GPU pins first (README: `pip install -e '.[dev,gpu]'`). On a
# machine without one (the lent GPU machine: Python 3.12, torch 2.11, transformers 5.17 in its image), carry
# the missing packages as cp312 wheels in ./wheels/ (built by scripts/gpu_wheels.sh; pass `wheels` as carry): this
# script installs them without an index or dependency resolution (one pip call; if that fails, one wheel at a
# time, a wheel pip refuses unpacked onto PYTHONPATH, each wheel neither installs a FAIL row of the table). The check runs from the checkout
# (PYTHONPATH): the project's pins are for registries; the code supports torch >= 2.11 and transformers >= 5.17.
# vLLM's GPU build is too large to carry: the vLLM engine stays untested there. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export SMD_GPU_CHECK_T0="${SMD_GPU_CHECK_T0:-$(date +%s)}"
PY="${PYTHON:-python3}"
INSTALL_LOG="$(mktemp /tmp/smd-gpu-install.XXXXXX)"
trap 'rm -f "$INSTALL_LOG"' EXIT
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n' '  ' | cut -c1-160)" >> "$INSTALL_LOG"; }
if compgen -G "wheels/*.whl" > /dev/null; then
    t0=$(date +%s); ok=0; unpacked=0; bad=0; cause=""
    site="$PWD/.wheels-site"
    pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps "$@" 2>&1; }
    last() { printf '%s\n' "$1" | grep -v '^[[:space:]]*$' | tail -1; }
    if "$PY" -m pip --version > /dev/null 2>&1 && out=$(pip_install wheels/*.whl); then
        ok=$(compgen -G "wheels/*.whl" | wc -l)  # one pip call for all: each call costs a start-up
    else
        # one wheel at a time; a wheel pip refuses (no pip, an externally managed interpreter, ...) is unpacked
        # onto PYTHONPATH instead (imports work; no entry-point scripts); what neither installs is a FAIL row
        cause="$(last "${out:-no pip}")"
        for w in wheels/*.whl; do
            out=""; out2=""
            if "$PY" -m pip --version > /dev/null 2>&1 && out=$(pip_install "$w"); then
                ok=$((ok + 1))
            elif out2=$("$PY" -m zipfile -e "$w" "$site" 2>&1); then
                unpacked=$((unpacked + 1))
            else
                bad=$((bad + 1))
                row "$(basename "$w")" FAIL "pip: $(last "${out:-no pip}"); unpack: $(last "$out2")"
            fi
        done
    fi
    if [ "$unpacked" -gt 0 ]; then export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"; fi
    row "wheels/*.whl" "$([ "$bad" = 0 ] && echo ok || echo FAIL)" \
        "$ok installed by pip, $unpacked unpacked onto PYTHONPATH, $bad failed, $(($(date +%s) - t0))s${cause:+ (one pip call failed: $cause)}"
else
    row "wheels/*.whl" SKIP "no wheels/ here: the check uses what is installed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/gpu_check.py --install-log "$INSTALL_LOG" "$@"
