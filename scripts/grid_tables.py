"""The results doc's grid tables (docs/results-smollm2.md, issue 42) from `smdctl seed-stats` JSON and the runs' records.

    python scripts/grid_tables.py RUNS_DIR --stats-dense A/seed_stats.json --stats-smd B/seed_stats.json

prints two markdown tables:
- scores at the final iteration, per arm: the compressed score seed by seed with its mean and 95% t interval, the
  dense score and both exact matches (means), and the paired differences of the compressed score to the `dense`
  arm and to smd (seed by seed, mean, interval; `seed-stats --reference dense` and `--reference smd-l0.1@0.5`);
- cost per arm: seconds an iteration without and with evaluation (the chain log's "iteration i/N done in Xs";
  evaluation runs every 2 iterations), the learner's peak resident set at iteration 1 and its largest over the run
  (`learner/peak_rss_mb` of each iteration's learn details), and the largest parity |Δlogp| (`progress.json`).
An arm's "compressed" score is under its own evaluation cache (`evaluate.compressed_eviction`, else its rollout's
eviction, as its evaluation's details.json records it: SnapKV 0.5 for most arms, SnapKV 0.3 or H2O 0.5 for the extended ones, SnapKV 0.5 for the dense arm), so a
paired difference is printed only between arms scored under the same cache; a third table pairs smd with naive
within each cache (`--pairs`), through seed-stats' own `paired`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from stages.tools.seed_stats import paired as paired_stats

DONE = re.compile(r"iteration (\d+)/(\d+) done in ([0-9.]+)s")


def fmt(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def interval(stat: dict) -> str:
    if stat["n"] < 2:
        return "(1 seed)"
    return f"[{stat['low']:.3f}, {stat['high']:.3f}]".replace("-", "−")


def paired(stat: dict | None) -> str:
    if not stat or "paired" not in stat:
        return "—"
    p = stat["paired"]
    seeds = ", ".join(fmt(p["differences"][str(s)]) for s in p["seeds"])
    if p["n"] < 2:
        return f"{seeds} (s{p['seeds'][0]})"
    # equal differences in every seed give a zero-width interval that seed-stats calls separated; on a score in
    # steps of 1/64 with 2-3 seeds that says nothing about the spread
    sep = ", equal in every seed" if p["std"] == 0 else (", separated" if p["separated"] else "")
    return f"{seeds}; {fmt(p['mean'])} [{p['low']:.3f}, {p['high']:.3f}]{sep}".replace("-", "−")


def compressed_cache(runs_dir: Path, arm: str) -> str:
    """The cache an arm's compressed score is measured under: what its first run's iteration-0 evaluation ran."""
    return evaluated_cache(next(runs_dir.glob(f"{arm}-s[0-9]")) / "artifacts" / "iter-000" / "evaluate")


def evaluated_cache(evaluate_dir: Path) -> str:
    """The compressed mode's cache as the evaluation recorded it (details.json's config, `eviction_for`'s result)."""
    ev = json.loads((evaluate_dir / "details.json").read_text())["config"]["compressed_eviction"]
    if ev["policy"] == "dense":
        return "dense"
    once = ", once after the prefill" if ev.get("compress") == "prefill_only" else ""  # smd_released's simulated mask
    return f"{ev['policy']} {ev['keep_ratio']}{once}"


def paired_cell(values: dict[int, float], reference: dict[int, float]) -> str:
    """values minus reference over their common seeds, through seed-stats' own `paired`, formatted as its JSON is."""
    stat = paired_stats(values, reference)
    stat["differences"] = {str(k): v for k, v in stat["differences"].items()}  # as in seed-stats' JSON
    return paired({"paired": stat}) if stat["n"] else "no common seed"


def score_table(dense_ref: dict, smd_ref: dict, caches: dict[str, str]) -> list[str]:
    rows = ["| arm | compressed cache | seeds | compressed score: per seed; mean [95% CI] | dense score | "
            "compressed EM | dense EM | Δ compressed to dense (paired) | Δ compressed to smd λ 0.1 (paired) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for arm, head in dense_ref["headline"].items():
        comp = head["compressed_score"]
        cache = caches[arm]
        same = cache == caches["dense"]  # a difference across two caches is not a paired comparison
        per_seed = ", ".join(f"{v:.3f}" for v in comp["values"].values())
        seeds = ", ".join(comp["values"])
        smd_head = smd_ref["headline"].get(arm, {}).get("compressed_score")
        rows.append(
            f"| {arm} | {cache} | {seeds} | {per_seed}; {comp['mean']:.3f} {interval(comp)} | "
            f"{head['dense_score']['mean']:.3f} | {head['compressed_exact_match']['mean']:.3f} | "
            f"{head['dense_exact_match']['mean']:.3f} | {paired(comp) if same else 'other cache'} | "
            f"{paired(smd_head) if same else 'other cache'} |")
    return rows


def pair_table(dense_ref: dict, pairs: list[tuple[str, str]]) -> list[str]:
    """arm minus reference arm, paired by seed, on every final-iteration metric (pairs scored under one cache)."""
    metrics = ["compressed_score", "dense_score", "compressed_exact_match", "dense_exact_match"]
    rows = ["| arm − reference | " + " | ".join(m.replace("_", " ") for m in metrics) + " |",
            "|---|" + "---|" * len(metrics)]
    head = dense_ref["headline"]
    for arm, ref in pairs:
        if arm not in head or ref not in head:
            continue
        cells = []
        for m in metrics:
            values = {int(k): v for k, v in head[arm][m]["values"].items()}
            reference = {int(k): v for k, v in head[ref][m]["values"].items()}
            cells.append(paired_cell(values, reference))
        rows.append(f"| {arm} − {ref} | " + " | ".join(cells) + " |")
    return rows


def dense_cache_table(dense_ref: dict, caches: dict[str, str], evals_dir: Path) -> list[str]:
    """Each arm against the dense arm's final policy scored under the arm's own cache (`smdctl evaluate` of the
    dense runs under that cache, in EVALS/dense-s<seed>-<cache>-iter<i>/), paired by seed."""
    dense: dict[str, dict[int, dict[str, float]]] = {}
    start: dict[str, float] = {}
    for d in sorted(evals_dir.glob("dense-s*-iter*")):
        metrics = json.loads((d / "metrics.json").read_text())
        label = evaluated_cache(d)
        seed, it = int(d.name.split("-")[1][1:]), int(d.name.rsplit("iter", 1)[1])
        if it == 0:
            start[label] = metrics["eval/compressed/score"]
        else:
            dense.setdefault(label, {})[seed] = metrics
    rows = ["| arm | cache | dense arm under that cache: iteration 0; 8 per seed | arm − dense arm, compressed score | "
            "compressed EM |", "|---|---|---|---|---|"]
    for arm, head in dense_ref["headline"].items():
        label = caches[arm]
        if label not in dense:
            continue
        ref = dense[label]
        cells = []
        for m, key in (("compressed_score", "eval/compressed/score"),
                       ("compressed_exact_match", "eval/compressed/exact_match")):
            values = {int(k): v for k, v in head[m]["values"].items()}
            cells.append(paired_cell(values, {s: ref[s][key] for s in ref}))
        per_seed = ", ".join(f"{ref[s]['eval/compressed/score']:.3f}" for s in sorted(ref))
        rows.append(f"| {arm} | {label} | {start.get(label, float('nan')):.3f}; {per_seed} | " + " | ".join(cells) + " |")
    return rows


def run_cost(run: Path) -> tuple[str, str, str, str, str]:
    times = {int(m[1]): float(m[3]) for m in DONE.finditer((run / "chain.log").read_text())}
    plain = [t for i, t in times.items() if i % 2 == 1 and i > 1]  # iteration 1 pays DeepSpeed's first JIT build
    evald = [t for i, t in times.items() if i % 2 == 0]
    rss = []
    for i in sorted(times):
        details = run / "artifacts" / f"iter-{i:03d}" / "learn" / "details.json"
        if details.exists():
            rss.append(json.loads(details.read_text()).get("learner/peak_rss_mb", float("nan")))
    prog = run / "artifacts" / f"iter-{max(times):03d}" / "progress.json"
    rows = json.loads(prog.read_text())["rows"] if prog.exists() else []
    parity = max((r.get("mismatch/logprob_abs_diff_max", 0.0) for r in rows), default=float("nan"))

    def span(xs: list[float]) -> str:  # the median, robust to an iteration slowed by other jobs; then the range
        return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})" if xs else "—"
    return (span(plain), span(evald), f"{rss[0]:,.0f}" if rss else "—", f"{max(rss):,.0f}" if rss else "—",
            f"{parity:.1e}" if parity < 1e-2 else f"{parity:.1f}")


def cost_table(runs_dir: Path) -> list[str]:
    rows = ["| run | s/iteration without evaluation (3, 5, 7): median (range) | with evaluation (2, 4, 6, 8) | learner peak RSS MB, "
            "iteration 1 | largest | max rollout-learner |Δlogp| |", "|---|---|---|---|---|---|"]
    for run in sorted(runs_dir.glob("*-s[0-9]")):
        if not (run / "chain.log").exists() or "iteration 8/8 done" not in (run / "chain.log").read_text():
            continue
        rows.append(f"| {run.name} | " + " | ".join(run_cost(run)) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--stats-dense", type=Path, required=True)
    ap.add_argument("--stats-smd", type=Path, required=True)
    ap.add_argument("--pairs", default="smd-l0.1@0.3:naive@0.3,smd-l0.1-h2o@0.5:naive-h2o@0.5,"
                    "smd-l0.1-em@0.5:dense-em,smd-l0.8@0.5:smd-l0.1@0.5,smd-teacher_ema@0.5:smd-l0.1@0.5",
                    help="arm:reference pairs, comma-separated, for the within-cache table")
    ap.add_argument("--dense-evals", type=Path, help="the dense arm's final policies scored under other caches")
    a = ap.parse_args()
    dense_ref = json.loads(a.stats_dense.read_text())
    smd_ref = json.loads(a.stats_smd.read_text())
    caches = {arm: compressed_cache(a.runs, arm) for arm in dense_ref["headline"]}  # read once, used by two tables
    print("\n".join(score_table(dense_ref, smd_ref, caches)))
    print()
    pairs = [tuple(p.split(":")) for p in a.pairs.split(",") if p]
    print("\n".join(pair_table(dense_ref, pairs)))
    print()
    if a.dense_evals:
        print("\n".join(dense_cache_table(dense_ref, caches, a.dense_evals)))
        print()
    print("\n".join(cost_table(a.runs)))


if __name__ == "__main__":
    main()
