"""`smdctl report`: compare experiments — a Markdown table and a PNG plot of reward and evaluation per iteration.

Inputs (any mix):
- run directories: an `artifacts/` tree (or a project directory holding one) with
  `iter-NNN/{rollout,learn,evaluate}/metrics.json`. A run is labelled from its artifacts: the producing
  config that the stages record beside their metrics (`config` in details.json or metrics.json: evaluate
  records learner.objective and rollout.eviction, learn its learner section and the rollout config of the
  trajectory table it learned from; a `config` tree or dotted keys count). Only a key no artifact records is
  taken from `params.yaml` beside `artifacts/` (schema defaults fill the keys it omits): a run made with
  `-S` overrides is labelled by what ran, not by the params file it sits beside.
- the output of `dvc exp show --json` (a list of experiment states, experiments nested under their
  baseline): metrics from its one DVC metric, the headline `artifacts/metrics.json` (the last iteration's
  figures and the warm start's dense score as iteration 0, `stages.progress.headline`), or from the
  `iter-NNN/<stage>/metrics.json` of experiments made when those were DVC metrics; labels from the config
  those record, else from the experiment's params files.

One row per (run, iteration) with: objective (learner.objective), policy (rollout.eviction.policy),
keep_ratio (rollout.eviction.keep_ratio), reward/mean (rollout), eval dense / compressed score (evaluate),
mismatch/logprob_abs_diff_max (learn). A missing file or key shows as "—". One line per series
(objective, policy, keep ratio; the run name when several runs share them) in the plot.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.layout import DETAILS, METRICS, RunLayout
from stages.progress.headline import HEADLINE_KEYS, WARMSTART_KEY

STAGES = ("rollout", "learn", "evaluate")
MISSING = "—"
PARAM_KEYS = {
    "objective": "learner.objective",
    "policy": "rollout.eviction.policy",
    "keep_ratio": "rollout.eviction.keep_ratio",
}
# What labels a run: the table's parameter columns plus the KL weight, where the KL applies and whose dense forward
# teaches (tell smd arms apart), and whether the rollout applied the eviction or only simulated it.
CONFIG_KEYS = {**PARAM_KEYS, "kl_lambda": "learner.kl_lambda", "kl_tokens": "learner.kl_tokens",
               "kl_teacher": "learner.kl_teacher", "eviction_apply": "rollout.eviction.apply"}
# (column header, stage, metrics key)
VALUE_COLUMNS = [
    ("reward/mean", "rollout", "reward/mean"),
    ("eval dense score", "evaluate", "eval/dense/score"),
    ("eval compressed score", "evaluate", "eval/compressed/score"),
    ("mismatch/logprob_abs_diff_max", "learn", "mismatch/logprob_abs_diff_max"),
]
HEADERS = ["run", *PARAM_KEYS, "iteration", *(c for c, _, _ in VALUE_COLUMNS)]
_METRICS_PATH = re.compile(r"(?:^|/)iter-(\d{3,})/(rollout|learn|evaluate)/metrics\.json$")
_HEADLINE_PATH = re.compile(r"(?:^|/)artifacts/metrics\.json$")


@dataclass
class Run:
    """One experiment: its name, where it came from, its parameters and its metrics per iteration and stage."""

    name: str
    source: str
    config: dict[str, Any] = field(default_factory=dict)  # objective / policy / keep_ratio (None = unknown)
    metrics: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # iteration -> stage -> metrics


# ---------------------------------------------------------------- lookups


def _dotted(tree: Any, dotted: str) -> Any:
    """`a.b.c` in a nested mapping, or the flat key `a.b.c` itself; None when absent."""
    if isinstance(tree, dict) and dotted in tree:
        return tree[dotted]
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _default(dotted: str) -> Any:
    from schemas.params import Params

    return _dotted(Params().model_dump(), dotted)


def _config_from_params(tree: dict[str, Any]) -> dict[str, Any]:
    """Report parameters from a params.yaml tree; keys it omits take the schema default (what a run used)."""
    out = {}
    for name, dotted in CONFIG_KEYS.items():
        value = _dotted(tree, dotted)
        out[name] = _default(dotted) if value is None else value
    return out


def _config_from_metrics(metrics: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Report parameters recorded in metrics files (a `config` tree, or dotted keys at the top level)."""
    out: dict[str, Any] = {name: None for name in CONFIG_KEYS}
    for iteration in sorted(metrics):
        if iteration == 0:  # the starting policy's evaluation (possibly shared by several arms), not the run's config
            continue
        for stage in STAGES:
            m = metrics[iteration].get(stage)
            if not isinstance(m, dict):
                continue
            for name, dotted in CONFIG_KEYS.items():
                if out[name] is None:
                    value = _dotted(m.get("config"), dotted)
                    out[name] = value if value is not None else _dotted(m, dotted)
    return out


def _recorded_lora(*records: dict[int, dict[str, dict[str, Any]]]) -> tuple[bool, Any]:
    """(found, value) of `learner.lora` in the config the stages recorded (learn records its whole learner
    section, so a run without LoRA records null); iteration 0 (the shared start) does not count."""
    for metrics in records:
        for iteration in sorted(metrics):
            if iteration == 0:
                continue
            for stage in STAGES:
                m = metrics[iteration].get(stage)
                config = m.get("config") if isinstance(m, dict) else None
                learner = config.get("learner") if isinstance(config, dict) else None
                if isinstance(learner, dict) and "lora" in learner:
                    return True, learner["lora"]
                if isinstance(config, dict) and "learner.lora" in config:
                    return True, config["learner.lora"]
    return False, None


def _lora_rank(value: Any) -> Any:
    """What the label shows of `learner.lora`: its rank (the schema's default when the section gives none), None
    without LoRA."""
    if value is None or value is False:
        return None
    if isinstance(value, dict):
        from schemas.params.learner import LoraParams

        rank = value.get("rank")
        return rank if rank is not None else LoraParams.model_fields["rank"].default
    return "?"


def _with_lora(config: dict[str, Any], lora: Any) -> dict[str, Any]:
    """`config` with `lora` (the rank) when the run trained LoRA adapters (a full-weight run's config has no key)."""
    rank = _lora_rank(lora)
    return config if rank is None else {**config, "lora": rank}


def metric_value(metrics: dict[str, Any] | None, key: str) -> float | None:
    """A numeric metric: the key itself, or nested under its `/`-separated parts. A list gives its max for a
    `_max` key, else its last element. None when absent or not a number."""
    if not isinstance(metrics, dict):
        return None
    value = metrics.get(key)
    if value is None:
        node: Any = metrics
        for part in key.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        value = node
    if isinstance(value, list):
        nums = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        value = (max(nums) if key.endswith("_max") else nums[-1]) if nums else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ---------------------------------------------------------------- inputs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SmdInputError(f"{path}: not readable JSON ({exc.__class__.__name__})") from exc
    if not isinstance(data, dict):
        raise SmdInputError(f"{path}: expected a JSON object of metrics")
    return data


def load_run(run_dir: str | Path) -> Run:
    """Read one run directory (an `artifacts/` tree, or a directory that holds `artifacts/`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SmdInputError(f"{run_dir}: no such run directory")
    artifacts = run_dir / "artifacts" if (run_dir / "artifacts").is_dir() else run_dir
    root = artifacts.parent
    metrics: dict[int, dict[str, dict[str, Any]]] = {}
    for path in sorted(artifacts.glob("iter-*/*/metrics.json")):
        m = _METRICS_PATH.search(path.relative_to(artifacts).as_posix())
        if m:
            metrics.setdefault(int(m.group(1)), {})[m.group(2)] = _read_json(path)
    warm = RunLayout(artifacts).warmstart / METRICS
    if metrics and warm.is_file() and 0 not in metrics:
        # The warm start as iteration 0 (unless the run evaluated it itself under iter-000, as `smdctl compare`
        # does with each arm's compression): its greedy eval is a dense one, reported under the evaluate names.
        w = _read_json(warm)
        metrics[0] = {"evaluate": {"eval/dense/score": w.get("reward"), "eval/dense/exact_match": w.get("exact_match"),
                                   "eval/dense/reference_nll": w.get("reference_nll")}}
    if not metrics:
        raise SmdInputError(
            f"{run_dir}: no metrics: expected {artifacts}/iter-NNN/{{rollout,learn,evaluate}}/metrics.json "
            "(run the pipeline first, or pass another run directory)"
        )
    details_records = _details(artifacts, metrics)
    recorded = _config_from_metrics(metrics)
    details = _config_from_metrics(details_records)
    config = {key: details[key] if value is None else value for key, value in recorded.items()}
    source = f"{run_dir} (params: recorded in its artifacts)"
    params_file = root / "params.yaml"
    found, lora = _recorded_lora(metrics, details_records)
    if not found and params_file.is_file():  # (not part of the source line: a run without LoRA records none)
        lora = _dotted(_params_tree(params_file), "learner.lora")
    if any(value is None for value in config.values()) and params_file.is_file():
        tree = _params_tree(params_file)
        from_params = _config_from_params(tree)
        missing = [key for key, value in config.items() if value is None]
        config = {key: from_params[key] if value is None else value for key, value in config.items()}
        source = (f"{run_dir} (params: {params_file})" if len(missing) == len(config)
                  else f"{run_dir} (params: recorded in its artifacts; {', '.join(missing)} from {params_file})")
    name = root.resolve().name or str(root)
    return Run(name=name, source=source, config=_with_lora(config, lora), metrics=metrics)


def _params_tree(params_file: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(params_file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SmdInputError(f"{params_file}: not valid YAML ({exc.__class__.__name__})") from exc
    if not isinstance(tree, dict):
        raise SmdInputError(f"{params_file}: top level must be a mapping of sections")
    return tree


def _details(artifacts: Path, metrics: dict[int, dict[str, dict[str, Any]]]) -> dict[int, dict[str, dict[str, Any]]]:
    """The details.json beside each metrics file (where a stage records the config it ran with)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for iteration, stages in metrics.items():
        for stage in stages:
            path = RunLayout(artifacts).iteration(iteration).stage(stage) / DETAILS
            if path.is_file():
                out.setdefault(iteration, {})[stage] = _read_json(path)
    return out


def _walk_states(states: Any):
    for state in states or []:
        if not isinstance(state, dict):
            continue
        yield state
        for exp_range in state.get("experiments") or []:
            if isinstance(exp_range, dict):
                yield from _walk_states(exp_range.get("revs"))


def parse_dvc_exp_show(data: Any, source: str = "dvc exp show") -> tuple[list[Run], list[str]]:
    """Runs from `dvc exp show --json` output; also the names of experiments skipped (no metrics or errors)."""
    if not isinstance(data, list):
        raise SmdInputError(f"{source}: expected the JSON list that `dvc exp show --json` prints")
    runs, skipped = [], []
    for state in _walk_states(data):
        rev = str(state.get("rev") or "?")
        name = state.get("name") or (rev if rev == "workspace" else rev[:7])
        body = state.get("data")
        if not isinstance(body, dict):
            skipped.append(f"{name} ({'error' if state.get('error') else 'no data'})")
            continue
        metrics: dict[int, dict[str, dict[str, Any]]] = {}
        headlines = []
        for path, result in (body.get("metrics") or {}).items():
            path = str(path).replace("\\", "/")
            if not (isinstance(result, dict) and isinstance(result.get("data"), dict)):
                continue
            m = _METRICS_PATH.search(path)
            if m:
                metrics.setdefault(int(m.group(1)), {})[m.group(2)] = result["data"]
            elif _HEADLINE_PATH.search(path):
                headlines.append(result["data"])
        for data in headlines:
            _merge_headline(metrics, data)
        if not metrics:
            skipped.append(f"{name} (no iteration metrics)")
            continue
        tree: dict[str, Any] = {}
        for result in (body.get("params") or {}).values():
            if isinstance(result, dict) and isinstance(result.get("data"), dict):
                tree.update(result["data"])
        config = _config_from_metrics(metrics)  # what the artifacts record ran first, then the params files
        if tree:
            from_params = _config_from_params(tree)
            config = {key: from_params[key] if value is None else value for key, value in config.items()}
        found, lora = _recorded_lora(metrics)
        config = _with_lora(config, lora if found else _dotted(tree, "learner.lora"))
        runs.append(Run(name=str(name), source=f"{source}: {rev}", config=config, metrics=metrics))
    # The workspace repeats the experiment last applied (`dvc exp run` leaves its results there): keep one.
    for ws in [r for r in runs if r.source.endswith(": workspace")]:
        twin = next((r for r in runs if r is not ws and (r.config, r.metrics) == (ws.config, ws.metrics)), None)
        if twin is not None:
            runs.remove(ws)
            skipped.append(f"workspace (same as {twin.name})")
    return runs, skipped


def _merge_headline(metrics: dict[int, dict[str, dict[str, Any]]], headline: dict[str, Any]) -> None:
    """Fill in the figures of a headline file (artifacts/metrics.json) under their stage names: the last
    iteration's, and the warm start's dense score as iteration 0; per-stage metrics already there win."""
    iteration = headline.get("iteration")
    if isinstance(iteration, int) and not isinstance(iteration, bool):
        for key, stage, stage_key in HEADLINE_KEYS:
            if stage is not None and key in headline:
                metrics.setdefault(iteration, {}).setdefault(stage, {}).setdefault(stage_key, headline[key])
    warm = headline.get(WARMSTART_KEY[0])
    if warm is not None:
        metrics.setdefault(0, {}).setdefault("evaluate", {}).setdefault("eval/dense/score", warm)


def read_dvc_exp_json(path: str | Path) -> tuple[list[Run], list[str]]:
    path = Path(path)
    if not path.is_file():
        raise SmdInputError(f"{path}: no such file (write it with `dvc exp show --json > {path.name}`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SmdInputError(f"{path}: not readable JSON ({exc.__class__.__name__})") from exc
    return parse_dvc_exp_show(data, str(path))


# ---------------------------------------------------------------- rows and rendering


def _unique_names(runs: list[Run]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        n = seen.get(run.name, 0) + 1
        seen[run.name] = n
        if n > 1:
            run.name = f"{run.name}#{n}"


def _sort_key(value: Any) -> tuple:
    """Numbers numerically, then text; unknown (None) last."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value)) if value is not None else (2, 0.0, "")


def table_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict per (run, iteration): HEADERS as keys, None for anything missing."""
    rows = []
    for run in runs:
        for iteration in sorted(run.metrics):
            stage_metrics = run.metrics[iteration]
            row: dict[str, Any] = {"run": run.name, **run.config, "iteration": iteration}
            for header, stage, key in VALUE_COLUMNS:
                row[header] = metric_value(stage_metrics.get(stage), key)
            rows.append(row)
    rows.sort(key=lambda r: (*(_sort_key(r[k]) for k in PARAM_KEYS), r["run"], r["iteration"]))
    return rows


# (column, stage, key, how a run's series reduces to one number): "last" = the last iteration that has it,
# "tail" = mean of the last 3 iterations (train reward is noisy), "mean" = mean over the iterations.
ARM_COLUMNS = [
    ("dense EM", "evaluate", "eval/dense/exact_match", "last"),
    ("dense score", "evaluate", "eval/dense/score", "last"),
    ("compressed EM", "evaluate", "eval/compressed/exact_match", "last"),
    ("compressed score", "evaluate", "eval/compressed/score", "last"),
    ("ref NLL", "evaluate", "eval/dense/reference_nll", "last"),
    ("train reward (last 3)", "rollout", "reward/mean", "tail"),
    ("entropy (last)", "learn", "policy/entropy", "last"),
    ("mismatch KL (mean)", "learn", "mismatch/kl", "mean"),
    ("rejected seq frac (mean)", "learn", "rejection/seq_fraction", "mean"),
    ("rejected token frac (mean)", "learn", "rejection/token_fraction", "mean"),
    ("learner s/step", "learn", "learner/seconds_per_step", "mean"),
    ("learner peak RSS MB", "learn", "learner/peak_rss_mb", "mean"),
]


def _reduce(run: Run, stage: str, key: str, how: str, start: int = 1) -> float | None:
    pts = [v for it in sorted(run.metrics) if it >= start
           for v in [metric_value(run.metrics[it].get(stage), key)] if v is not None]
    if not pts:
        return None
    if how == "last":
        return pts[-1]
    tail = pts[-3:] if how == "tail" else pts
    return sum(tail) / len(tail)


def arm_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per arm (runs sharing objective, policy and keep ratio, e.g. seeds): mean and std over its runs
    of each ARM_COLUMNS figure, the warm start (iteration 0) where the runs have one, and the last iteration."""
    arms: dict[str, list[Run]] = {}
    for run in runs:
        arms.setdefault(_series_label(run.config), []).append(run)
    rows = []
    for label, members in sorted(arms.items()):
        row: dict[str, Any] = {"arm": label, "runs": len(members),
                               "iterations": min(max(r.metrics) for r in members)}
        for column, stage, key, how in ARM_COLUMNS:
            values = [v for r in members for v in [_reduce(r, stage, key, how)] if v is not None]
            row[column] = (float(np.mean(values)), float(np.std(values)), len(values)) if values else None
            starts = [v for r in members if 0 in r.metrics
                      for v in [metric_value(r.metrics[0].get(stage), key)] if v is not None]
            row[f"{column} @0"] = float(np.mean(starts)) if starts else None
        rows.append(row)
    return rows


def render_arms(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    cols = [c for c, *_ in ARM_COLUMNS]
    lines = ["## Arms (mean ± std over runs; `@0`: the warm start)", "",
             "| arm | runs | iterations | " + " | ".join(cols) + " |",
             "|---|---:|---:|" + "---:|" * len(cols)]
    for row in rows:
        cells = []
        for c in cols:
            v = row[c]
            cell = MISSING if v is None else f"{v[0]:.4g} ± {v[1]:.2g}"
            if row[f"{c} @0"] is not None:
                cell += f" (@0 {row[f'{c} @0']:.4g})"
            cells.append(cell)
        lines.append(f"| {row['arm']} | {row['runs']} | {row['iterations']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _fmt(header: str, value: Any) -> str:
    if value is None:
        return MISSING
    if header == "mismatch/logprob_abs_diff_max":
        return f"{value:.3g}"
    if isinstance(value, float) and header not in PARAM_KEYS:
        return f"{value:.4f}"
    return str(value)


def render_markdown(rows: list[dict[str, Any]], sources: list[str], skipped: list[str], plot_name: str,
                    arms: list[dict[str, Any]] | None = None) -> str:
    lines = [
        "# smd experiment report",
        "",
        "Reward: mean rollout reward (`reward/mean`, rollout metrics). Eval scores: mean greedy score of the task's "
        "metric on the eval split, with the dense KV cache and with the rollout's compression (evaluate metrics). "
        "Mismatch: max |learner - rollout| token log-prob (learn metrics). "
        f"{MISSING} = metrics file or key missing.",
        "",
        "",
        *render_arms(arms or []),
        "Sources:",
        "",
        *(f"- {s}" for s in sources),
    ]
    if skipped:
        lines += ["", "Skipped experiments: " + ", ".join(skipped)]
    lines += [
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" if h in ("run", *PARAM_KEYS) else "---:" for h in HEADERS) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(h, row[h]) for h in HEADERS) + " |")
    lines += ["", f"![reward and evaluation per iteration]({plot_name})", ""]
    return "\n".join(lines)


def _series_label(config: dict[str, Any]) -> str:
    objective = config.get("objective") or "?"
    if objective == "smd":  # the KL weight tells smd arms apart (shadow is smd at 0; the others have no KL)
        objective += f" λ{config.get('kl_lambda')}"
        if config.get("kl_tokens") not in (None, "all"):  # learner.kl_tokens; runs from before it: all (the paper)
            objective += f" kl:{config['kl_tokens']}"
        if config.get("kl_teacher") not in (None, "current"):  # learner.kl_teacher; runs from before it: current
            objective += f" teacher:{config['kl_teacher']}"
    if objective == "smd_released":  # the weight of its one-sided distillation term
        objective += f" λ{config.get('kl_lambda')}"
    if config.get("lora") is not None:  # learner.lora: the adapters' rank (a LoRA arm is not its full-weight twin)
        objective += f" LoRA r{config['lora']}"
    simulated = " simulated" if config.get("eviction_apply") is False else ""  # rollout.eviction.apply false
    return f"{objective} / {config.get('policy') or '?'}{simulated} @ {config.get('keep_ratio') or '?'}"


# (title, [(stage, metrics key, line style, legend suffix)]) per panel of the learning curves.
PANELS = [
    ("train reward (rollout reward/mean)", [("rollout", "reward/mean", "o-", "")]),
    ("held-out score (solid dense, dashed compressed)",
     [("evaluate", "eval/dense/score", "o-", " dense"), ("evaluate", "eval/compressed/score", "s--", " compressed")]),
    ("held-out exact match (solid dense, dashed compressed)",
     [("evaluate", "eval/dense/exact_match", "o-", " dense"),
      ("evaluate", "eval/compressed/exact_match", "s--", " compressed")]),
    ("held-out reference NLL, dense (nats per answer)", [("evaluate", "eval/dense/reference_nll", "o-", "")]),
    ("policy entropy on response tokens (nats)", [("learn", "policy/entropy", "o-", "")]),
    ("rollout/learner mismatch KL (mismatch/kl)", [("learn", "mismatch/kl", "o-", "")]),
    ("groups with all-equal rewards", [("learn", "batch/zero_adv_group_frac", "o-", "")]),
]


def render_plot(runs: list[Run], path: Path) -> None:
    """Learning curves against iteration, one line per run: PANELS (train reward, held-out dense and compressed
    score and exact match, entropy, mismatch, zero-advantage groups)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4).flatten()
    labels = [_series_label(r.config) for r in runs]
    ordered = sorted(range(len(runs)), key=lambda i: (labels[i], runs[i].name))
    for n, i in enumerate(ordered):
        run, label = runs[i], labels[i]
        if labels.count(label) > 1:
            label = f"{label} [{run.name}]"
        color = f"C{n % 10}"
        its = sorted(run.metrics)
        for ax, (_, lines) in zip(axes, PANELS):
            for stage, key, style, suffix in lines:
                pts = [(it, metric_value(run.metrics[it].get(stage), key)) for it in its]
                pts = [(it, v) for it, v in pts if v is not None]
                if pts:
                    ax.plot([p for p, _ in pts], [v for _, v in pts], style, color=color, label=label + suffix,
                            markersize=3)
    for ax, (title, _) in zip(axes, PANELS):
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[len(PANELS):]:
        ax.set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside lower center", ncols=min(4, len(handles)), fontsize="small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def report(runs: list[str | Path] | None = None, dvc_exp_json: str | Path | None = None,
           out_dir: str | Path = "reports") -> dict[str, Path]:
    """Write `out_dir/report.md` and `out_dir/report.png` comparing the runs (default: ./artifacts as one run)."""
    run_dirs = list(runs or [])
    if not run_dirs and dvc_exp_json is None:
        run_dirs = [Path("artifacts")]
    loaded = [load_run(d) for d in run_dirs]
    skipped: list[str] = []
    if dvc_exp_json is not None:
        exps, skipped = read_dvc_exp_json(dvc_exp_json)
        loaded += exps
    if not loaded:
        raise SmdInputError(f"{dvc_exp_json}: no experiment with iteration metrics (skipped: {', '.join(skipped)})")
    _unique_names(loaded)
    out_dir = Path(out_dir)
    written = {"markdown": out_dir / "report.md", "plot": out_dir / "report.png"}
    rows = table_rows(loaded)
    render_plot(loaded, written["plot"])
    text = render_markdown(rows, [f"{r.name}: {r.source}" for r in loaded], skipped, written["plot"].name,
                           arm_rows(loaded))
    with atomic_path(written["markdown"]) as tmp:
        tmp.write_text(text)
    return written
