#!/usr/bin/env bash
# Issue 57, item 4: what one on-policy iteration costs at long context, per arm and stage. Each stage of iteration 1
# (rollout, compact, learn) runs in its own process under GNU time: wall seconds and the process's peak resident
# memory (max RSS). The arms' overrides are read from a comparison spec, so the arms run exactly as `smdctl compare`
# runs them (the spec's `common`, then the arm's).
#
#   bash scripts/long_context_iteration_cost.sh OUT SPEC DATA [ARMS]
#     OUT   output directory (one sub-directory per arm; rerunning skips the stages already written)
#     SPEC  a comparison spec (experiments/smollm2_long_context.yaml)
#     DATA  the prepared data (`smdctl prepare ... --out DATA`, with the spec's prepare settings)
#     ARMS  space-separated arm names (default "dense smd-l0.1@0.5")
#   Environment: STAGES (default "rollout compact learn") runs only those stages; EXTRA ("-S k=v ...") is applied
#   after the arm's overrides, e.g. EXTRA="-S rollout.prompts_per_iteration=4 -S rollout.batch_size=32" STAGES=rollout
#   for the rollout's peak at another batch (the memory per sequence is the slope between two batches); give each
#   EXTRA its own OUT, since stages on record there are skipped.
# Needs `smdctl` on PATH and the spec's model. Prints one line per arm and stage, then the table.
set -euo pipefail
out=${1:?usage: long_context_iteration_cost.sh OUT SPEC DATA [ARMS]}
spec=${2:?usage: long_context_iteration_cost.sh OUT SPEC DATA [ARMS]}
data=${3:?usage: long_context_iteration_cost.sh OUT SPEC DATA [ARMS]}
arms=${4:-"dense smd-l0.1@0.5"}
stages=${STAGES:-"rollout compact learn"}
read -r -a extra <<< "${EXTRA:-}"
mkdir -p "$out"
for arm in $arms; do
  dir="$out/$arm"
  mkdir -p "$dir"
  # The spec's common overrides, then the arm's, as -S flags (the same order `smdctl compare` applies them).
  mapfile -t sets < <(python3 - "$spec" "$arm" <<'PY'
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
if sys.argv[2] not in spec["arms"]:
    sys.exit(f"{sys.argv[1]}: no arm {sys.argv[2]}")
for k, v in {**spec.get("common", {}), **spec["arms"][sys.argv[2]]}.items():
    v = ",".join(map(str, v)) if isinstance(v, list) else v
    print("-S"); print(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
PY
)
  model=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['common']['model.init_path'])" "$spec")
  sets+=("${extra[@]}")
  run() {  # stage name, then its command: skipped when its timing is on record or not in STAGES
    local stage=$1; shift
    [[ " $stages " == *" $stage "* ]] || return 0
    [ -f "$dir/$stage.time" ] && return 0
    /usr/bin/time -f "%e %M" -o "$dir/.$stage.time" "$@" > "$dir/$stage.log" 2>&1
    mv "$dir/.$stage.time" "$dir/$stage.time"
  }
  run rollout smdctl rollout -i 1 "${sets[@]}" --policy "$model" --prompts "$data/train.arrow" --out "$dir/rollout" \
      --no-progress
  run compact smdctl compact -i 1 "${sets[@]}" --trajectories "$dir/rollout/trajectories.arrow" \
      --raw-masks "$dir/rollout/masks.raw.zarr" --out "$dir/compact/masks.zarr" --metrics "$dir/compact/metrics.json"
  run learn smdctl learn -i 1 "${sets[@]}" --policy "$model" --trajectories "$dir/rollout/trajectories.arrow" \
      --masks "$dir/compact/masks.zarr" --out "$dir/policy" --metrics-dir "$dir/learn" --quiet
done
python3 - "$out" $arms <<'PY'
import sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'arm':>20} {'stage':>8} {'wall s':>8} {'peak RSS MiB':>13}")
for arm in sys.argv[2:]:
    for stage in ("rollout", "compact", "learn"):
        f = out / arm / f"{stage}.time"
        if f.exists():
            wall, kib = f.read_text().split()[-2:]
            print(f"{arm:>20} {stage:>8} {float(wall):>8.1f} {int(kib) / 1024:>13.0f}")
PY
