"""`smdctl seed-stats`: a comparison's statistics over seeds (issue 22) — 95% intervals per arm and paired
differences to a reference arm, seed by seed, with learning curves and their bands.

Inputs: the run directories `smdctl compare` writes, `<out>/<arm>-s<seed>/` (read with
`stages.tools.report.load_run`). The arm is the name before the trailing `-s<int>` (an arm may contain `@`,
`.` and `-`: `smd-l0.1@0.3-s0` is arm `smd-l0.1@0.3`, seed 0); any other name is an error.

Completeness: only runs that evaluated iteration `complete_at` are used (default: the largest iteration any
given run evaluated, so runs still in progress are left out); each one left out is named in the `skipped`
notes (printed by the command, listed in the outputs). `complete_at=0` keeps every run.

Per arm, its final iteration F is the largest iteration that every seed of the arm evaluated; the arm's
per-iteration figures stop at F, so each mean is over the same seeds. For every metric of METRICS, per arm
and iteration: n (seeds with a value), the mean over seeds, the sample standard deviation (ddof 1) and the 95%
Student-t interval mean ± t_{0.975, n-1} · s / sqrt(n) (T_975 below; no interval for n < 2). The headline
is at F; the training-side metrics (`window` in METRICS: train reward, mismatch, rejected fractions, logged
every iteration) are also given as each seed's mean over the last WINDOW iterations (F-4..F) first, then the
same statistics over seeds.

Paired differences to the reference arm: arm seed s minus reference seed s, only the seeds both have, at the
same iteration (the headline: the smaller of the two arms' final iterations); each seed's difference, their
mean and 95% t interval, "separated" when the interval excludes 0. A metric a run does not log (the
rejected fractions under most objectives) is "—" in the tables and null in the JSON.

Outputs, each written atomically: `seed_stats.md` (tables), `seed_stats.json` (every number) and one PNG per
curve of CURVES (per arm each seed's curve as a thin line, the mean over seeds and its shaded 95% band). The
band is drawn clipped to the metric's range (`metric_range`: a score cannot leave [0, 1], an NLL cannot go
below 0), since with few seeds the t interval runs far past it (two seeds: t = 12.706); the tables and the JSON
keep the interval as computed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from stages.tools.report import MISSING, Run, load_run, metric_value


@dataclass(frozen=True)
class Metric:
    name: str  # the JSON key
    label: str  # the tables' and plots' name
    stage: str
    key: str  # in <stage>/metrics.json
    window: bool = False  # logged every iteration: also the last-WINDOW-iterations mean per seed


# The metrics, each named by stage and key (as in artifacts/iter-NNN/<stage>/metrics.json).
METRICS: tuple[Metric, ...] = (
    Metric("dense_score", "held-out dense score", "evaluate", "eval/dense/score"),
    Metric("compressed_score", "held-out compressed score", "evaluate", "eval/compressed/score"),
    Metric("dense_exact_match", "held-out dense EM", "evaluate", "eval/dense/exact_match"),
    Metric("compressed_exact_match", "held-out compressed EM", "evaluate", "eval/compressed/exact_match"),
    Metric("reference_nll", "reference NLL", "evaluate", "eval/dense/reference_nll"),
    Metric("train_reward", "train reward", "rollout", "reward/mean", window=True),
    Metric("mismatch_kl", "mismatch KL", "learn", "mismatch/kl", window=True),
    Metric("mismatch_max", "mismatch max abs Δlogp", "learn", "mismatch/logprob_abs_diff_max", window=True),
    Metric("rejected_seq", "rejected seq fraction", "learn", "rejection/seq_fraction", window=True),
    Metric("rejected_token", "rejected token fraction", "learn", "rejection/token_fraction", window=True),
)
BY_NAME = {m.name: m for m in METRICS}
# One PNG per metric group: (file stem, metric).
CURVES: tuple[tuple[str, str], ...] = (
    ("curve_dense_score", "dense_score"),
    ("curve_compressed_score", "compressed_score"),
    ("curve_reference_nll", "reference_nll"),
    ("curve_train_reward", "train_reward"),
)
WINDOW = 5  # iterations in the training metrics' late-training mean

# Two-sided 95% critical values t_{0.975, df} of Student's t distribution, df = 1..30, from NIST/SEMATECH
# e-Handbook of Statistical Methods, section 1.3.6.7.2 "Critical Values of the Student's t Distribution"
# (https://www.itl.nist.gov/div898/handbook/eda/section3/eda3672.htm), column 0.975 (3 decimals).
T_975: dict[int, float] = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042,
}
_Z_975 = 1.959963984540054
_RUN_NAME = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


# ---------------------------------------------------------------- statistics


def t_975(df: int) -> float:
    """t_{0.975, df}: the table for df <= 30; beyond it the Cornish-Fisher expansion around the normal
    quantile (within 1e-4 of the exact value there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df in T_975:
        return T_975[df]
    z = _Z_975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(values: list[float]) -> dict[str, Any]:
    """n, mean, sample std (ddof 1) and the 95% t interval of `values` (None where undefined: no values, or
    fewer than 2 for the std and the interval)."""
    n = len(values)
    out: dict[str, Any] = {"n": n, "mean": None, "std": None, "half_width": None, "low": None, "high": None}
    if n == 0:
        return out
    mean = math.fsum(values) / n
    out["mean"] = mean
    if n >= 2:
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        hw = t_975(n - 1) * std / math.sqrt(n)
        out.update(std=std, half_width=hw, low=mean - hw, high=mean + hw)
    return out


def paired(values: dict[int, float | None], reference: dict[int, float | None]) -> dict[str, Any]:
    """Seed-by-seed differences `values[s] - reference[s]` over the seeds both have a value for; their
    interval and whether it excludes 0 (`separated`; None without an interval)."""
    seeds = sorted(s for s in values if values[s] is not None and reference.get(s) is not None)
    diffs = {s: values[s] - reference[s] for s in seeds}  # type: ignore[operator]
    stats = interval([diffs[s] for s in seeds])
    separated = None if stats["low"] is None else bool(stats["low"] > 0 or stats["high"] < 0)
    return {"seeds": seeds, "differences": diffs, **stats, "separated": separated}


# ---------------------------------------------------------------- runs


def parse_run_name(name: str) -> tuple[str, int]:
    """`<arm>-s<seed>` -> (arm, seed)."""
    m = _RUN_NAME.match(name)
    if not m:
        raise SmdInputError(f"{name}: not a run directory named <arm>-s<seed> (as `smdctl compare` writes them)")
    return m.group("arm"), int(m.group("seed"))


def run_name(run_dir: str | Path) -> str:
    """The run's directory name (the directory holding artifacts/, when given the artifacts/ tree)."""
    path = Path(os.path.abspath(run_dir))
    return path.parent.name if path.name == "artifacts" else path.name


def evaluated(run: Run) -> list[int]:
    return sorted(it for it, stages in run.metrics.items() if "evaluate" in stages)


def final_iteration(seeds: dict[int, Run]) -> int:
    """The largest iteration every seed evaluated (else the largest one every seed has any metrics for)."""
    common = set.intersection(*(set(evaluated(r)) for r in seeds.values()))
    if not common:
        common = set.intersection(*(set(r.metrics) for r in seeds.values()))
    if not common:
        raise SmdInputError(f"seeds {sorted(seeds)} of one arm share no iteration")
    return max(common)


def value(run: Run, metric: Metric, iteration: int) -> float | None:
    return metric_value(run.metrics.get(iteration, {}).get(metric.stage), metric.key)


def seed_values(seeds: dict[int, Run], metric: Metric, iteration: int) -> dict[int, float | None]:
    return {s: value(r, metric, iteration) for s, r in sorted(seeds.items())}


def window_values(seeds: dict[int, Run], metric: Metric, end: int, width: int = WINDOW) -> dict[int, float | None]:
    """Each seed's mean of the metric over iterations end-width+1..end (the ones it logged; None if none)."""
    out: dict[int, float | None] = {}
    for s, r in sorted(seeds.items()):
        vals = [v for it in range(end - width + 1, end + 1) if (v := value(r, metric, it)) is not None]
        out[s] = math.fsum(vals) / len(vals) if vals else None
    return out


def _present(values: dict[int, float | None]) -> list[float]:
    return [v for v in values.values() if v is not None]


def _cell(values: dict[int, float | None], ref: dict[int, float | None] | None) -> dict[str, Any]:
    cell: dict[str, Any] = {"values": values, **interval(_present(values))}
    if ref is not None:
        cell["paired"] = paired(values, ref)
    return cell


def group_runs(runs: list[tuple[str, Run]]) -> dict[str, dict[int, Run]]:
    """(name, run) pairs -> arm -> seed -> run, arms in order of first appearance."""
    arms: dict[str, dict[int, Run]] = {}
    for name, run in runs:
        arm, seed = parse_run_name(name)
        if seed in arms.setdefault(arm, {}):
            raise SmdInputError(f"{name}: arm {arm!r} seed {seed} given twice")
        arms[arm][seed] = run
    return arms


def compute(arms: dict[str, dict[int, Run]], reference: str) -> dict[str, Any]:
    """Every number of the report (the JSON): per arm its seeds and final iteration, per metric, arm and
    iteration the statistics over seeds (and the paired differences to the reference), and the headline."""
    if reference not in arms:
        raise SmdInputError(f"reference arm {reference!r} not among the runs' arms: {', '.join(arms)}")
    order = [reference, *(a for a in arms if a != reference)]
    finals = {a: final_iteration(arms[a]) for a in order}
    ref_seeds = arms[reference]
    per_iteration: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for metric in METRICS:
        per_arm: dict[str, list[dict[str, Any]]] = {}
        for arm in order:
            seeds = arms[arm]
            its = sorted({it for r in seeds.values() for it, st in r.metrics.items()
                          if metric.stage in st and it <= finals[arm]})
            rows = []
            for it in its:
                vals = seed_values(seeds, metric, it)
                ref = None if arm == reference else seed_values(ref_seeds, metric, it)
                rows.append({"iteration": it, **_cell(vals, ref)})
            per_arm[arm] = rows
        per_iteration[metric.name] = per_arm
    headline: dict[str, dict[str, Any]] = {}
    for arm in order:
        seeds = arms[arm]
        at = finals[arm]
        pair_at = min(at, finals[reference])
        entry: dict[str, Any] = {"iteration": at, "paired_iteration": None if arm == reference else pair_at}
        for metric in METRICS:
            cell = _cell(seed_values(seeds, metric, at), None)
            if arm != reference:
                cell["paired"] = paired(seed_values(seeds, metric, pair_at), seed_values(ref_seeds, metric, pair_at))
            entry[metric.name] = cell
            if metric.window:
                cell = _cell(window_values(seeds, metric, at), None)
                if arm != reference:
                    cell["paired"] = paired(window_values(seeds, metric, pair_at),
                                            window_values(ref_seeds, metric, pair_at))
                entry[f"{metric.name}/last{WINDOW}"] = cell
        headline[arm] = entry
    return {
        "reference": reference,
        "window": WINDOW,
        "t_975": {str(k): v for k, v in T_975.items()},
        "t_975_source": "NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2",
        "metrics": {m.name: {"label": m.label, "stage": m.stage, "key": m.key, "window": m.window} for m in METRICS},
        "arms": {a: {"seeds": sorted(arms[a]), "runs": {str(s): arms[a][s].source for s in sorted(arms[a])},
                     "final_iteration": finals[a]} for a in order},
        "per_iteration": per_iteration,
        "headline": headline,
    }


# ---------------------------------------------------------------- rendering

# metric_range's rules, on the name's last `/` component, lower case.
_UNIT_NAMES = ("score", "exact_match")
_UNIT_SUFFIXES = ("_score", "_exact_match", "fraction", "_frac")
_NON_NEGATIVE_PARTS = ("nll", "entropy", "seconds", "bytes", "abs_diff")


def metric_range(name: str) -> tuple[float | None, float | None]:
    """The range (low, high) a metric's values can take, None for an unbounded side, from its name: a metrics
    key such as `eval/compressed/score` or a METRICS name such as `compressed_score` (the last `/` component
    decides, case-insensitively).

    - (0, 1): scores and exact match (`score`, `exact_match`, `*_score`, `*_exact_match`: schemas.rewards'
      scores are in [0, 1]) and fractions (`*fraction`, `*_frac`: `kv/kept_fraction`,
      `rejection/seq_fraction`, `batch/zero_adv_group_frac`).
    - (0, None): non-negative quantities, names containing `nll`, `entropy`, `seconds`, `bytes` or
      `abs_diff` (`eval/dense/reference_nll`, `policy/entropy`, `learner/seconds_per_step`,
      `mismatch/logprob_abs_diff_max`).
    - (None, None): anything else, e.g. `reward/mean` (a `reward.function` may return any number),
      `mismatch/kl` (the k1 estimate mean(-Δlogp), which can be negative) and `eval/score_gap` (a difference).
    """
    leaf = name.rsplit("/", 1)[-1].lower()
    if leaf in _UNIT_NAMES or leaf.endswith(_UNIT_SUFFIXES):
        return 0.0, 1.0
    if any(part in leaf for part in _NON_NEGATIVE_PARTS):
        return 0.0, None
    return None, None


def fmt(x: float | None) -> str:
    if x is None:
        return MISSING
    return f"{x:.4g}" if x != 0 else "0"


def _ci(cell: dict[str, Any]) -> str:
    return MISSING if cell.get("low") is None else f"[{fmt(cell['low'])}, {fmt(cell['high'])}]"


def _separated(p: dict[str, Any]) -> str:
    return MISSING if p["separated"] is None else ("separated" if p["separated"] else "not separated")


def _seed_list(values: dict[Any, float | None]) -> str:
    return ", ".join(f"s{s}: {fmt(v)}" for s, v in values.items()) or MISSING


def _row(lead: list[str], arm: str, cell: dict[str, Any]) -> str:
    p = cell.get("paired")
    pair = ([fmt(p["mean"]), _ci(p), _seed_list(p["differences"]), _separated(p)] if p
            else [MISSING, MISSING, MISSING, MISSING])
    return "| " + " | ".join([*lead, arm, str(cell["n"]), fmt(cell["mean"]), fmt(cell["std"]), _ci(cell),
                              _seed_list(cell["values"]), *pair]) + " |"


_COLS = ["arm", "n", "mean", "std", "95% CI", "per seed", "Δ mean", "Δ 95% CI", "Δ per seed", "Δ ≠ 0?"]


def headline_lines(result: dict[str, Any]) -> list[str]:
    """The headline table: every metric at each arm's final iteration (and the last-window means)."""
    ref = result["reference"]
    lines = ["| metric | iteration | " + " | ".join(_COLS) + " |", "|" + "---|" * (len(_COLS) + 2)]
    for metric in METRICS:
        names = [metric.name] + ([f"{metric.name}/last{WINDOW}"] if metric.window else [])
        for name in names:
            for arm, entry in result["headline"].items():
                at = str(entry["iteration"])
                if entry["paired_iteration"] is not None and entry["paired_iteration"] != entry["iteration"]:
                    at += f" (Δ at {entry['paired_iteration']})"
                label = metric.label + (f" (mean of last {WINDOW})" if name != metric.name else "")
                lines.append(_row([label, at], arm, entry[name]))
    lines.append("")
    lines.append(f"Δ: arm minus `{ref}`, seed by seed (only the seeds both have). 95% CI: mean ± "
                 "t_{0.975,n-1}·s/√n; \"separated\" when the Δ interval excludes 0. — : not logged, or n < 2.")
    return lines


def render_markdown(result: dict[str, Any], skipped: list[str], pngs: list[str]) -> str:
    ref = result["reference"]
    out = ["# Statistics over seeds", "",
           f"Reference arm: `{ref}`. Arms (seeds, final iteration = the largest every seed evaluated):", ""]
    for arm, info in result["arms"].items():
        out.append(f"- `{arm}`: seeds {', '.join(map(str, info['seeds']))}; final iteration {info['final_iteration']}")
    if skipped:
        out += ["", "Left out (incomplete):", "", *(f"- {s}" for s in skipped)]
    out += ["", "## Headline (final iteration)", "", *headline_lines(result), ""]
    out += ["## Per evaluated iteration", ""]
    for metric in METRICS:
        out += [f"### {metric.label} (`{metric.stage}` `{metric.key}`)", "",
                "| iteration | " + " | ".join(_COLS) + " |", "|" + "---|" * (len(_COLS) + 1)]
        rows = []
        for arm, arm_rows in result["per_iteration"][metric.name].items():
            evaluated_its = {r["iteration"] for r in result["per_iteration"]["dense_score"][arm]} | \
                {r["iteration"] for r in result["per_iteration"]["compressed_score"][arm]}
            rows += [(r["iteration"], arm, r) for r in arm_rows if r["iteration"] in evaluated_its and r["n"]]
        order = list(result["arms"])
        for it, arm, r in sorted(rows, key=lambda x: (x[0], order.index(x[1]))):
            out.append(_row([str(it)], arm, r))
        if not rows:
            out.append("| " + " | ".join([MISSING] * (len(_COLS) + 1)) + " |")
        out.append("")
    if pngs:
        out += ["## Learning curves (mean over seeds; thin lines: each seed; shaded: the 95% t interval, clipped to the metric's range)", ""]
        out += [f"![{p}]({p})" for p in pngs]
        out.append("")
    return "\n".join(out)


def _band_limits(name: str, observed: list[float]) -> tuple[float | None, float | None]:
    """metric_range(name), widened to the observed values (a run scored by a `reward.function` outside
    [0, 1] keeps its band around its own points): where the drawn band is clipped."""
    low, high = metric_range(name)
    if observed and low is not None:
        low = min(low, min(observed))
    if observed and high is not None:
        high = max(high, max(observed))
    return low, high


SEED_LINE = {"alpha": 0.35, "linewidth": 0.8}  # each seed's own curve
MEAN_LINEWIDTH = 1.8


def curve_figure(result: dict[str, Any], metric_name: str):
    """One metric's learning curves as a matplotlib Figure: per arm each seed's curve (a thin line in the
    arm's colour, no legend entry; its label starts with `_seed`), the mean over seeds and its 95% band (where
    n >= 2), the band clipped to the metric's range (`_band_limits`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = BY_NAME[metric_name]
    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for n, (arm, rows) in enumerate(result["per_iteration"][metric_name].items()):
        rows = [r for r in rows if r["mean"] is not None]
        if not rows:
            continue
        color = f"C{n % 10}"
        its = [r["iteration"] for r in rows]
        seeds = result["arms"][arm]["seeds"]
        observed = []
        for seed in seeds:
            pts = [(r["iteration"], v) for r in rows if (v := r["values"].get(seed)) is not None]
            if pts:
                observed += [v for _, v in pts]
                ax.plot([it for it, _ in pts], [v for _, v in pts], "-", color=color,
                        label=f"_seed {arm} s{seed}", **SEED_LINE)
        ax.plot(its, [r["mean"] for r in rows], "-o", color=color, markersize=3, linewidth=MEAN_LINEWIDTH,
                label=f"{arm} (n={len(seeds)})")
        low = np.array([np.nan if r["low"] is None else r["low"] for r in rows], dtype=float)
        high = np.array([np.nan if r["high"] is None else r["high"] for r in rows], dtype=float)
        lo, hi = _band_limits(metric.key, observed)
        if lo is not None or hi is not None:
            low, high = np.clip(low, lo, hi), np.clip(high, lo, hi)
        ax.fill_between(its, low, high, color=color, alpha=0.2, linewidth=0)
    ax.set_title(f"{metric.label} ({metric.stage} {metric.key}): seeds, mean and 95% band", fontsize="medium")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return fig


def render_curve(result: dict[str, Any], metric_name: str, path: Path) -> None:
    """Write curve_figure(result, metric_name) as a PNG to `path`."""
    fig = curve_figure(result, metric_name)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


# ---------------------------------------------------------------- entry


def select_complete(runs: list[tuple[str, Run]], complete_at: int | None) -> tuple[list[tuple[str, Run]], list[str], int]:
    """The runs that evaluated iteration `complete_at` (default: the largest any run evaluated), the notes on
    the others, and the iteration used."""
    target = complete_at if complete_at is not None else max((max(evaluated(r), default=-1) for _, r in runs),
                                                             default=-1)
    kept, skipped = [], []
    for name, run in runs:
        last = max(evaluated(run), default=None)
        if target > 0 and target not in evaluated(run):
            skipped.append(f"{name}: no evaluation at iteration {target} (last evaluated: "
                           f"{MISSING if last is None else last})")
        else:
            kept.append((name, run))
    return kept, skipped, target


def seed_stats(run_dirs: list[str | Path], reference: str = "dense", out_dir: str | Path = "reports/seed_stats",
               complete_at: int | None = None) -> tuple[dict[str, Path], list[str], dict[str, Any]]:
    """Write seed_stats.md, seed_stats.json and the curves' PNGs into `out_dir`; return the written paths,
    the notes on runs left out, and the result."""
    if not run_dirs:
        raise SmdInputError("no run directories given (pass <out>/<arm>-s<seed> directories of `smdctl compare`)")
    names = [run_name(d) for d in run_dirs]
    for name in names:
        parse_run_name(name)
    runs = [(name, load_run(d)) for name, d in zip(names, run_dirs)]
    kept, skipped, target = select_complete(runs, complete_at)
    if not kept:
        raise SmdInputError(f"no run evaluated iteration {target}: " + "; ".join(skipped))
    result = compute(group_runs(kept), reference)
    result["complete_at"] = target
    result["skipped"] = skipped
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    pngs = []
    for stem, metric_name in CURVES:
        path = out_dir / f"{stem}.png"
        render_curve(result, metric_name, path)
        written[stem] = path
        pngs.append(path.name)
    md, js = out_dir / "seed_stats.md", out_dir / "seed_stats.json"
    with atomic_path(js) as tmp:
        tmp.write_text(json.dumps(result, indent=2, sort_keys=False, allow_nan=False) + "\n")
    with atomic_path(md) as tmp:
        tmp.write_text(render_markdown(result, skipped, pngs))
    written = {"markdown": md, "json": js, **written}
    return written, skipped, result
