"""`smdctl seed-stats`: intervals over seeds and paired differences, hand-checked on hand-built run directories."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from schemas.errors import SmdInputError
from stages.tools.report import Run
from stages.tools.seed_stats import (
    METRICS,
    SEED_LINE,
    T_975,
    compute,
    curve_figure,
    group_runs,
    interval,
    metric_range,
    paired,
    parse_run_name,
    run_name,
    seed_stats,
    t_975,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Held-out scores at the final iteration (6), per arm and seed.
DENSE = {"dense": {0: 0.6, 1: 0.7, 2: 0.8}, "naive@0.5": {0: 0.5, 1: 0.5, 2: 0.8}}
COMPRESSED = {"dense": {0: 0.6, 1: 0.7, 2: 0.8}, "naive@0.5": {0: 0.3, 1: 0.35, 2: 0.4}}


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _run(root, arm, seed, last=6, evaluate_every=3, nll=True, reward_offset=0.0):
    """`root/<arm>-s<seed>/artifacts/iter-NNN/...`: iteration 0 evaluate only (as `smdctl compare` copies in
    the warm start's), iterations 1..last rollout + learn (no rejection keys), evaluate every few iterations;
    at iteration 6 the scores of DENSE / COMPRESSED, else 0.1·i. Train reward 0.1·i + 0.01·seed + offset."""
    art = root / f"{arm}-s{seed}" / "artifacts"
    for i in range(last + 1):
        it = art / f"iter-{i:03d}"
        if i:
            _write(it / "rollout" / "metrics.json", {"reward/mean": 0.1 * i + 0.01 * seed + reward_offset})
            _write(it / "learn" / "metrics.json", {"mismatch/kl": 0.001 * seed, "mismatch/logprob_abs_diff_max": 1.0})
        if i % evaluate_every == 0:
            ev = {"eval/dense/score": DENSE.get(arm, {}).get(seed, 0.5) if i == 6 else 0.1 * i,
                  "eval/compressed/score": COMPRESSED.get(arm, {}).get(seed, 0.5) if i == 6 else 0.1 * i,
                  "eval/dense/exact_match": 0.5, "eval/compressed/exact_match": 0.25 + 0.1 * seed}
            if nll:
                ev["eval/dense/reference_nll"] = 1.0 + seed
            _write(it / "evaluate" / "metrics.json", ev)
    (root / f"{arm}-s{seed}" / "params.yaml").write_text("{}\n")
    return art.parent


@pytest.fixture()
def runs(tmp_path):
    root = tmp_path / "cmp"
    dirs = [_run(root, "dense", s) for s in (0, 1, 2)]
    dirs += [_run(root, "naive@0.5", s, nll=(s != 2), reward_offset=-0.2) for s in (0, 1, 2)]
    dirs.append(_run(root, "dense", 3, last=3))  # still running: evaluated up to iteration 3
    return dirs


def _t_cdf(t, df, steps=200_001):
    """P(T <= t) for Student's t by the trapezoid rule on its density (independent of the table)."""
    x = np.linspace(0.0, t, steps)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    return 0.5 + float(np.sum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x)))


def test_t_table_hand_values_and_exact_quantiles():
    assert T_975[1] == 12.706 and T_975[2] == 4.303 and T_975[4] == 2.776 and T_975[10] == 2.228
    assert T_975[30] == 2.042 and sorted(T_975) == list(range(1, 31))
    assert all(T_975[d] > T_975[d + 1] for d in range(1, 30))
    for df in (1, 2, 3, 4, 7, 15, 30):  # each entry is the 0.975 quantile rounded to 3 decimals
        assert _t_cdf(T_975[df] - 0.0005, df) < 0.975 < _t_cdf(T_975[df] + 0.0005, df), df
    assert abs(t_975(30) - 2.042) < 1e-3 and abs(t_975(40) - 2.021) < 1e-3 and abs(t_975(120) - 1.980) < 1e-3
    with pytest.raises(ValueError):
        t_975(0)


def test_interval_and_paired_by_hand():
    s = interval([0.6, 0.7, 0.8])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.7) and s["std"] == pytest.approx(0.1)
    assert s["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert (s["low"], s["high"]) == pytest.approx((0.7 - 0.248434, 0.7 + 0.248434), abs=1e-6)
    one = interval([0.5])
    assert one["mean"] == 0.5 and one["std"] is None and one["low"] is None
    assert interval([])["mean"] is None
    p = paired({0: 0.3, 1: 0.35, 2: 0.4, 5: 1.0}, {0: 0.6, 1: 0.7, 2: 0.8, 3: 0.0})
    assert p["seeds"] == [0, 1, 2]  # only the seeds both arms have
    assert p["differences"] == pytest.approx({0: -0.3, 1: -0.35, 2: -0.4})
    assert p["mean"] == pytest.approx(-0.35) and p["std"] == pytest.approx(0.05)
    assert p["half_width"] == pytest.approx(4.303 * 0.05 / math.sqrt(3)) and p["separated"] is True
    q = paired({0: 0.5, 1: 0.5, 2: 0.8}, {0: 0.6, 1: 0.7, 2: 0.8})
    assert q["mean"] == pytest.approx(-0.1) and q["separated"] is False
    assert paired({0: 1.0}, {0: 0.5})["separated"] is None  # one seed: no interval
    assert paired({0: None, 1: 1.0}, {0: 0.5, 1: 0.5})["seeds"] == [1]


def test_run_names_group_into_arms(tmp_path):
    assert parse_run_name("naive@0.5-s2") == ("naive@0.5", 2)
    assert parse_run_name("smd-l0.1@0.3-s0") == ("smd-l0.1@0.3", 0)
    assert parse_run_name("dense-s10") == ("dense", 10)
    assert parse_run_name("smd-s1-s3") == ("smd-s1", 3)
    for bad in ("dense", "dense-s", "dense-sx", "-s1", "dense_s1"):
        with pytest.raises(SmdInputError) as err:
            parse_run_name(bad)
        assert "\n" not in str(err.value) and bad in str(err.value)
    assert run_name(tmp_path / "dense-s0" / "artifacts") == "dense-s0"
    assert run_name(str(tmp_path / "dense-s0") + "/") == "dense-s0"


def test_seed_stats_hand_checked(runs, tmp_path):
    written, skipped, result = seed_stats(runs, "dense", tmp_path / "out")
    assert skipped == ["dense-s3: no evaluation at iteration 6 (last evaluated: 3)"]
    assert result["complete_at"] == 6 and result["skipped"] == skipped
    assert result["arms"]["dense"]["seeds"] == [0, 1, 2] and result["arms"]["naive@0.5"]["final_iteration"] == 6
    hw3 = 4.303 / math.sqrt(3)
    head = result["headline"]
    d = head["dense"]["dense_score"]
    assert d["mean"] == pytest.approx(0.7) and d["std"] == pytest.approx(0.1)
    assert d["low"] == pytest.approx(0.7 - 0.1 * hw3) and "paired" not in d
    n = head["naive@0.5"]["dense_score"]
    assert n["mean"] == pytest.approx(0.6) and n["paired"]["differences"] == pytest.approx({0: -0.1, 1: -0.2, 2: 0.0})
    assert n["paired"]["mean"] == pytest.approx(-0.1) and n["paired"]["high"] == pytest.approx(-0.1 + 0.1 * hw3)
    assert n["paired"]["separated"] is False
    c = head["naive@0.5"]["compressed_score"]["paired"]
    assert c["mean"] == pytest.approx(-0.35) and c["low"] == pytest.approx(-0.35 - 0.05 * hw3) and c["separated"]
    em = head["naive@0.5"]["compressed_exact_match"]  # exact match under the compressed cache: 0.25, 0.35, 0.45
    assert em["mean"] == pytest.approx(0.35) and em["paired"]["differences"] == pytest.approx({0: 0, 1: 0, 2: 0})
    # train reward: iteration 6 itself, and each seed's mean over iterations 2..6 first
    r = head["dense"]["train_reward"]
    assert r["values"] == pytest.approx({0: 0.6, 1: 0.61, 2: 0.62})
    w = head["dense"]["train_reward/last5"]
    assert w["values"] == pytest.approx({0: 0.4, 1: 0.41, 2: 0.42}) and w["std"] == pytest.approx(0.01)
    assert w["half_width"] == pytest.approx(0.01 * hw3)
    wp = head["naive@0.5"]["train_reward/last5"]["paired"]
    assert wp["mean"] == pytest.approx(-0.2) and wp["std"] == pytest.approx(0.0, abs=1e-12) and wp["separated"]
    # a metric one seed lacks: n counts the others; a metric no run logs: n 0, null, "—"
    nll = head["naive@0.5"]["reference_nll"]
    assert nll["n"] == 2 and nll["values"][2] is None and nll["paired"]["seeds"] == [0, 1]
    rej = head["naive@0.5"]["rejected_seq"]
    assert rej["n"] == 0 and rej["mean"] is None and rej["paired"]["mean"] is None
    # per evaluated iteration: 0, 3, 6 for scores; 1..6 for the training metrics
    rows = result["per_iteration"]["dense_score"]["naive@0.5"]
    assert [x["iteration"] for x in rows] == [0, 3, 6]
    assert rows[1]["mean"] == pytest.approx(0.3) and rows[1]["paired"]["mean"] == pytest.approx(0.0)
    assert [x["iteration"] for x in result["per_iteration"]["train_reward"]["dense"]] == [1, 2, 3, 4, 5, 6]
    # outputs
    assert set(written) >= {"markdown", "json"} and len(written) == 6
    on_disk = json.loads(written["json"].read_text())
    assert on_disk["headline"]["naive@0.5"]["compressed_score"]["paired"]["separated"] is True
    md = written["markdown"].read_text()
    assert "dense-s3: no evaluation at iteration 6" in md
    assert "| held-out compressed score | 6 | naive@0.5 | 3 | 0.35 | 0.05 |" in md
    assert "| separated |" in md and "| not separated |" in md
    line = next(x for x in md.splitlines() if x.startswith("| rejected seq fraction | 6 | dense |"))
    assert line.count("—") >= 6
    for metric in METRICS:
        assert f"`{metric.stage}` `{metric.key}`" in md
    for key, path in written.items():
        if key.startswith("curve_"):
            assert path.read_bytes()[:8] == PNG_MAGIC


def test_complete_at_zero_keeps_every_run(runs, tmp_path):
    _, skipped, result = seed_stats(runs, "dense", tmp_path / "out", complete_at=0)
    assert skipped == []
    assert result["arms"]["dense"]["seeds"] == [0, 1, 2, 3] and result["arms"]["dense"]["final_iteration"] == 3
    naive = result["headline"]["naive@0.5"]
    assert naive["iteration"] == 6 and naive["paired_iteration"] == 3  # paired where both arms evaluated
    assert naive["dense_score"]["paired"]["differences"] == pytest.approx({0: 0.0, 1: 0.0, 2: 0.0})


def test_bad_inputs_are_one_line(runs, tmp_path):
    bad = tmp_path / "cmp" / "dense_seed0"
    bad.mkdir()
    out = tmp_path / "o"
    for run_dirs, reference, match in (
            ([*runs, bad], "dense", "dense_seed0: not a run directory named <arm>-s<seed>"),
            (runs, "smd", "reference arm 'smd' not among the runs' arms: dense, naive@0.5"),
            ([runs[0], runs[0]], "dense", "dense-s0: arm 'dense' seed 0 given twice"),
            ([], "dense", "no run directories given")):
        with pytest.raises(SmdInputError, match=match) as err:
            seed_stats(run_dirs, reference, out)
        assert "\n" not in str(err.value)
    assert not out.exists()


def test_cli(runs, tmp_path):
    from cli.main import app

    out = tmp_path / "cli"
    ok = CliRunner().invoke(app, ["seed-stats", *map(str, runs), "--reference", "dense", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    assert "left out dense-s3" in ok.output and "| held-out dense score | 6 | naive@0.5 | 3 |" in ok.output
    assert (out / "seed_stats.md").is_file() and (out / "curve_train_reward.png").is_file()
    bad = CliRunner().invoke(app, ["seed-stats", str(runs[0]), "--reference", "naive@0.5", "--out", str(out)])
    assert bad.exit_code == 2 and "reference arm 'naive@0.5'" in bad.output


def test_metric_range_by_name():
    unit, non_negative, free = (0.0, 1.0), (0.0, None), (None, None)
    for name in ("eval/dense/score", "eval/compressed/score", "eval/dense/exact_match", "eval/compressed/exact_match",
                 "dense_score", "compressed_score", "dense_exact_match", "kv/kept_fraction",
                 "eval/dense/kv_kept_fraction", "rejection/seq_fraction", "batch/zero_adv_group_frac", "Eval/Score"):
        assert metric_range(name) == unit, name
    for name in ("eval/dense/reference_nll", "reference_nll", "policy/entropy", "rollout/seconds",
                 "learner/seconds_per_step", "rollout/cpu_seconds", "bytes", "mismatch/logprob_abs_diff_max"):
        assert metric_range(name) == non_negative, name
    for name in ("reward/mean", "train_reward", "mismatch/kl", "eval/score_gap", "response/length_mean", "x"):
        assert metric_range(name) == free, name


def _runs_in_memory(arm, per_seed):
    """(name, Run) per seed: `per_seed[seed][it]` -> the evaluate and learn metrics of iteration `it`."""
    return [(f"{arm}-s{seed}", Run(name=f"{arm}-s{seed}", source="mem",
                                   metrics={it: {"evaluate": ev, "learn": ev} for it, ev in its.items()}))
            for seed, its in per_seed.items()]


def _band(ax):
    (band,) = ax.collections
    return band.get_paths()[0].vertices[:, 1]


def test_curve_band_clipped_to_metric_range_and_seed_lines():
    # two seeds far apart: t_{0.975,1} = 12.706, so every interval runs far past [0, 1]
    scores = {0: [0.0, 0.1, 0.4], 1: [1.0, 0.9, 0.6]}
    per_seed = {s: {it: {"eval/dense/score": v, "eval/dense/reference_nll": 1.0 + 2 * s + it,
                         "mismatch/kl": 0.01 * (s - 0.5)} for it, v in enumerate(vals)}
                for s, vals in scores.items()}
    result = compute(group_runs(_runs_in_memory("a", per_seed)), "a")
    rows = result["per_iteration"]["dense_score"]["a"]
    hw0 = 12.706 * math.sqrt(0.5) / math.sqrt(2)
    assert (rows[0]["low"], rows[0]["high"]) == pytest.approx((0.5 - hw0, 0.5 + hw0))  # the statistics as computed
    assert rows[0]["low"] < -5 and rows[2]["high"] > 1.5

    ax = curve_figure(result, "dense_score").axes[0]
    y = _band(ax)
    assert np.all(np.isfinite(y)) and y.min() == 0.0 and y.max() == 1.0  # clipped, and reaching both ends
    assert rows[0]["low"] < -5  # drawing leaves the result alone
    lines = ax.get_lines()
    seeds = [ln for ln in lines if ln.get_label().startswith("_seed")]
    (mean,) = [ln for ln in lines if not ln.get_label().startswith("_")]
    assert len(lines) == 3 and [ln.get_label() for ln in seeds] == ["_seed a s0", "_seed a s1"]
    for ln, s in zip(seeds, (0, 1)):
        assert list(ln.get_ydata()) == pytest.approx(scores[s]) and list(ln.get_xdata()) == [0, 1, 2]
        assert ln.get_color() == mean.get_color() == "C0"
        assert ln.get_alpha() == SEED_LINE["alpha"] < 1 and ln.get_linewidth() < mean.get_linewidth()
    assert list(mean.get_ydata()) == pytest.approx([0.5, 0.5, 0.5]) and mean.get_label() == "a (n=2)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a (n=2)"]

    # an NLL: clipped at 0 from below only; mismatch KL (can be negative): not clipped
    nll = result["per_iteration"]["reference_nll"]["a"]
    y = _band(curve_figure(result, "reference_nll").axes[0])
    assert nll[0]["low"] < 0 and y.min() == 0.0 and y.max() == pytest.approx(max(r["high"] for r in nll))
    kl = result["per_iteration"]["mismatch_kl"]["a"]
    y = _band(curve_figure(result, "mismatch_kl").axes[0])
    assert y.min() == pytest.approx(kl[0]["low"]) and y.max() == pytest.approx(kl[0]["high"]) and y.min() < 0


def test_curve_band_keeps_observed_values_outside_the_range():
    # a reward.function may score past 1: the band is clipped at the highest seed value, not at 1
    per_seed = {0: {0: {"eval/dense/score": 1.2}, 1: {"eval/dense/score": 1.1}},
                1: {0: {"eval/dense/score": 1.4}, 1: {"eval/dense/score": 1.3}}}
    result = compute(group_runs(_runs_in_memory("b", per_seed)), "b")
    y = _band(curve_figure(result, "dense_score").axes[0])
    assert y.max() == pytest.approx(1.4) and y.min() == 0.0
