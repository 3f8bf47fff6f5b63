#!/usr/bin/env bash
# Issue 57, item 1: the zero-shot probe that sizes the long-context task. For each context length, prepare
# fact_recall's eval split (64 held-out prompts, N facts) and greedy-decode it from the pretrained SmolLM2 with the
# dense cache and with each compressed cache; print one table row per (length, cache).
#
#   bash scripts/long_context_probe.sh OUT [CONTEXTS] [PAIRS] [CACHES] [TASK_OVERRIDES]
#     OUT       output directory (data and evaluations per setting; rerunning skips what exists)
#     CONTEXTS  space-separated prepare.context_tokens (default "512 1000 2000 4000")
#     PAIRS     prepare.num_pairs, the facts in the context (default 6)
#     CACHES    space-separated name=overrides;... (default: SnapKV 0.5, SnapKV 0.5 with the window at the user
#               turn's end, SnapKV 0.3)
#     TASK_OVERRIDES space-separated prepare overrides for every setting, e.g. "prepare.question_position=start"
# Needs `smdctl` on PATH and models/smollm2-135m-instruct (`smdctl convert-model smollm2 --out ...`).
set -euo pipefail
out=${1:?usage: long_context_probe.sh OUT [CONTEXTS] [PAIRS] [CACHES] [TASK_OVERRIDES]}
contexts=${2:-"512 1000 2000 4000"}
pairs=${3:-6}
caches=${4:-"snapkv0.5=policy=snapkv;keep_ratio=0.5 snapkv0.5-user_end=policy=snapkv;keep_ratio=0.5;window_anchor=user_end snapkv0.3=policy=snapkv;keep_ratio=0.3"}
model=${SMD_MODEL:-models/smollm2-135m-instruct}
common=(-S "model.init_path=$model" -S prepare.task=fact_recall -S "prepare.num_pairs=$pairs" -S prepare.num_queries=1
        -S prepare.train_context_min_fraction=1.0 -S prepare.num_train=8 -S prepare.num_eval=64
        -S evaluate.max_new_tokens=16)
for o in ${5:-}; do common+=(-S "$o"); done
mkdir -p "$out"
for c in $contexts; do
  data="$out/c$c/data"
  [ -f "$data/eval.arrow" ] || smdctl prepare "${common[@]}" -S "prepare.context_tokens=$c" --out "$data"
  for spec in $caches; do
    name=${spec%%=*}
    sets=()
    IFS=';' read -ra kvs <<< "${spec#*=}"
    for kv in "${kvs[@]}"; do sets+=(-S "evaluate.compressed_eviction.$kv"); done
    dir="$out/c$c/$name"
    [ -f "$dir/metrics.json" ] || smdctl evaluate -i 0 "${common[@]}" -S "prepare.context_tokens=$c" "${sets[@]}" \
        --policy "$model" --prompts "$data/eval.arrow" --out "$dir" --no-progress
  done
done
python3 - "$out" $contexts <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'context':>8} {'cache':>20} {'dense score':>12} {'compressed':>11} {'cost':>7}")
for c in sys.argv[2:]:
    for m in sorted((out / f"c{c}").glob("*/metrics.json")):
        r = json.loads(m.read_text())
        d, k = r["eval/dense/score"], r["eval/compressed/score"]
        print(f"{c:>8} {m.parent.name:>20} {d:>12.3f} {k:>11.3f} {d - k:>7.3f}")
PY
