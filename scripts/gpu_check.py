"""The GPU check (issue 21; docs/design.md "Devices"): one command, one table. `scripts/gpu_check.sh` installs and
calls this; `python scripts/gpu_check.py --help` lists the options.

Parts (each in a child process with its own time limit, so an out-of-memory error, a hang or a crash in one part
still leaves the others' rows; `--parts` picks some):

  correctness  `pytest -m gpu tests/test_gpu.py`: rollout -> compact -> learn parity on CUDA for every eviction
               policy in float32 (<= 1e-5, TF32 off) and bf16 (its gate), flex against the SDPA reference in
               values and gradients, the learner under DeepSpeed on one GPU. One row per test.
  rollout      a Qwen3-1.7B-shaped model built from its config (random bf16 weights), prompts of 4k / 16k / 32k
               tokens: generated tokens/s and peak memory (`torch.cuda.max_memory_allocated`, weights included)
               of smd SnapKV 0.5, smd dense and transformers `generate` (dense, DynamicCache), side by side;
               then the largest batch each fits in a fixed memory budget at one prompt length (per-sequence
               memory measured at batch 1 and 2, the extrapolated batch run once to confirm it fits).
  learner      the same shape, T = 4k and 16k: step time and step working memory of smd (flex), the dense
               learner and physical KV slicing (`stages.bench.learner.measure_steps`).
  e2e          the default experiment (params.yaml; init-model, prepare, warm start capped at
               `--warmstart-minutes` (1), then `smdctl chain` for 2 iterations) in a scratch directory, on the GPU.

The table logic runs on the CPU too, at the tiny shape (`--shape tiny --device cpu`): tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARTS = ("correctness", "rollout", "learner", "e2e")
ENGINES = ("smd snapkv 0.5", "smd dense", "hf generate")
LEARNERS = ("dense", "smd_flex", "smd_gather")
LEARNER_LABELS = {"dense": "dense learner", "smd_flex": "smd (flex)", "smd_gather": "physical KV slicing",
                  "smd_sdpa": "smd (sdpa)", "smd_tiled": "smd (tiled)"}
GIB = 2**30
# Seconds per part on one H200 (together 460 s: the whole check stays under 8 minutes with start-up); a part past its
# limit is one TIMEOUT row. Estimates, not measurements (no GPU has run the check yet).
DEFAULT_LIMITS = {"correctness": 170, "rollout": 90, "learner": 90, "e2e": 110}


@dataclass
class Row:
    """One line of the table: which part, what was measured, the result, and what it means."""

    part: str
    item: str
    result: str
    detail: str = ""


def format_table(rows: list[Row], title: str) -> str:
    """The check's one table, plain text, columns sized to their content."""
    head = Row("part", "item", "result", "detail")
    cells = [head, *rows]
    widths = [max(len(getattr(r, f)) for r in cells) for f in ("part", "item", "result")]
    lines = [title, ""]
    for i, r in enumerate(cells):
        lines.append(f"{r.part:<{widths[0]}}  {r.item:<{widths[1]}}  {r.result:<{widths[2]}}  {r.detail}".rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(lines)


def _num(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


# ------------------------------------------------------------------ correctness
def pytest_rows(junit_xml: str | Path) -> list[Row]:
    """One row per test case of a pytest JUnit XML report: PASS / FAIL / ERROR / SKIP, and why."""
    rows = []
    for case in ET.parse(str(junit_xml)).getroot().iter("testcase"):
        name = case.get("name", "?")
        seconds = float(case.get("time") or 0.0)
        result, detail = "PASS", f"{seconds:.1f}s"
        for tag, label in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "SKIP")):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                result, detail = label, (message[0][:110] if message else "")
                break
        rows.append(Row("correctness", name, result, detail))
    return rows


def correctness_part(limit_s: int) -> list[Row]:
    """`pytest -m gpu tests/test_gpu.py` in a child process; its JUnit report as rows."""
    with tempfile.TemporaryDirectory(prefix="smd-gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return [Row("correctness", "pytest -m gpu", "TIMEOUT", f"past {limit_s}s")]
        if not xml.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            return [Row("correctness", "pytest -m gpu", "ERROR", f"exit {proc.returncode}: {tail[0][:110]}")]
        return pytest_rows(xml)


# ------------------------------------------------------------------ rollout
def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_bytes(device) -> float:
    import torch

    if torch.device(device).type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float("nan")  # a CPU process's peak is its RSS (smdctl bench rollout); not comparable here


def random_prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Equal-length random prompts (no padding: every engine runs the same shapes), seeded on the host."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed + length)
    high = min(vocab_size, 250) if vocab_size < 1000 else vocab_size
    return torch.randint(4, high, (batch, length), generator=g, device="cpu").tolist()


def run_engine(model, engine: str, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Generate `new_tokens` for every prompt (no stop token) with one engine; seconds, tokens/s, peak bytes."""
    import torch

    from schemas.params.rollout import EvictionParams
    from stages.common.kvcache.sampler import generate_batch

    device = next(model.parameters()).device
    _sync(device)
    _peak_reset(device)
    t0 = time.perf_counter()
    if engine.startswith("smd"):
        eviction = (EvictionParams(policy="snapkv", keep_ratio=0.5) if "snapkv" in engine
                    else EvictionParams(policy="dense"))
        _, stats = generate_batch(model, prompts, eviction, new_tokens, eos_token_id=None,
                                  generator=torch.Generator(device="cpu").manual_seed(0))
        generated = stats.generated_tokens
    elif engine == "hf generate":
        ids = torch.tensor(prompts, dtype=torch.long, device="cpu").to(device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=0)
        generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    else:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": generated / seconds, "peak_bytes": _peak_bytes(device),
            "generated": float(generated)}


def _oom_types() -> tuple[type[BaseException], ...]:
    import torch

    return (torch.cuda.OutOfMemoryError,)


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def largest_batch(model, engine: str, length: int, budget_bytes: float, vocab_size: int) -> tuple[int, str]:
    """The largest batch of `length`-token prompts `engine` runs within `budget_bytes` of peak memory: peaks at
    batch 1 and 2 give the bytes per sequence, the extrapolated batch runs once (2 new tokens) to confirm it
    stays within the budget, and steps down by 10% until it does (at most 3 tries)."""
    peaks = []
    for batch in (1, 2):
        peaks.append(run_engine(model, engine, random_prompts(batch, length, vocab_size), 2)["peak_bytes"])
        _free(next(model.parameters()).device)
    per_seq = peaks[1] - peaks[0]
    if not per_seq > 0:
        return 0, "per-sequence memory not measurable"
    fixed = peaks[0] - per_seq
    batch = int((budget_bytes - fixed) // per_seq)
    for _ in range(3):
        if batch < 1:
            return 0, f"{per_seq / GIB:.2f} GiB/seq; not even one sequence fits"
        try:
            peak = run_engine(model, engine, random_prompts(batch, length, vocab_size), 2)["peak_bytes"]
        except _oom_types():
            peak = math.inf
        _free(next(model.parameters()).device)
        if peak <= budget_bytes:
            return batch, f"{per_seq / GIB:.2f} GiB/seq, confirmed peak {peak / GIB:.1f} GiB"
        batch = int(batch * 0.9)
    return batch, f"{per_seq / GIB:.2f} GiB/seq, not confirmed"


def rollout_part(shape: str = "qwen3-1.7b", device: str = "cuda", dtype: str = "bfloat16",
                 lengths: tuple[int, ...] = (4096, 16384, 32768), batches: dict[int, int] | None = None,
                 new_tokens: int = 64, budget_gib: float | None = 64.0, budget_length: int = 16384,
                 engines: tuple[str, ...] = ENGINES) -> list[Row]:
    """Rows of the rollout part: per prompt length and engine tokens/s (and x generate) and peak memory; then the
    largest batch within `budget_gib` at `budget_length` (None: skipped, e.g. on the CPU)."""
    from stages.bench.learner import build_bench_model

    batches = batches or {4096: 8, 16384: 2, 32768: 1}
    model = build_bench_model(shape, max(lengths) + new_tokens, device, dtype).eval()
    from stages.common.model import configure_precision

    configure_precision(device, next(model.parameters()).dtype)
    vocab = model.config.vocab_size
    rows: list[Row] = []
    # warm-up: kernels, allocator, cuBLAS handles (not timed)
    for engine in engines:
        run_engine(model, engine, random_prompts(1, min(lengths), vocab), 2)
    for length in lengths:
        batch = batches.get(length, 1)
        results: dict[str, dict[str, float] | None] = {}
        for engine in engines:
            try:
                results[engine] = run_engine(model, engine, random_prompts(batch, length, vocab), new_tokens)
            except _oom_types():
                results[engine] = None
            _free(device)
        anchor = results.get("hf generate")
        for engine in engines:
            r = results[engine]
            item = f"P={length} B={batch} {engine}"
            if r is None:
                rows.append(Row("rollout", item, "OOM"))
                continue
            ratio = r["tokens_per_s"] / anchor["tokens_per_s"] if anchor else float("nan")
            memory = ("peak n/a on the CPU" if math.isnan(r["peak_bytes"]) else
                      f"peak {r['peak_bytes'] / GIB:.2f} GiB")
            rows.append(Row("rollout", item, f"{r['tokens_per_s']:.0f} tok/s",
                            f"{_num(ratio, '.2f')}x generate, {memory}, {new_tokens} new tokens in "
                            f"{r['seconds']:.2f}s"))
    if budget_gib is not None:
        for engine in engines:
            try:
                batch, detail = largest_batch(model, engine, budget_length, budget_gib * GIB, vocab)
                rows.append(Row("rollout", f"largest batch P={budget_length} in {budget_gib:g} GiB {engine}",
                                f"B={batch}", detail))
            except _oom_types():
                rows.append(Row("rollout", f"largest batch P={budget_length} in {budget_gib:g} GiB {engine}", "OOM"))
            _free(device)
    return rows


# ------------------------------------------------------------------ learner
def learner_part(shape: str = "qwen3-1.7b", device: str = "cuda", dtype: str = "bfloat16",
                 lengths: tuple[int, ...] = (4096, 16384), modes: tuple[str, ...] = LEARNERS,
                 rounds: int = 2) -> list[Row]:
    """Rows of the learner part: per T and learner the step time and step working memory, both x dense."""
    from stages.bench.learner import measure_steps

    rows = []
    for r in measure_steps(shape, lengths, modes, device=device, dtype=dtype, rounds=rounds):
        item = f"T={r['T']} {LEARNER_LABELS.get(r['mode'], r['mode'])}"
        if r["status"] != "ok":
            rows.append(Row("learner", item, r["status"]))
            continue
        memory = ("peak n/a on the CPU" if math.isnan(r["peak_mb"]) else
                  f"peak {r['peak_mb'] / 1024:.2f} GiB = {_num(r['mem_ratio'], '.2f')}x dense")
        rows.append(Row("learner", item, f"{r['step_s']:.3f} s/step",
                        f"{_num(r['time_ratio'], '.2f')}x dense time, {memory}"))
    return rows


# ------------------------------------------------------------------ end to end
E2E_METRICS = (
    ("rollout", "metrics.json", "reward/mean", ".3f"),
    ("rollout", "metrics.json", "rollout/tokens_per_s", ".0f"),
    ("learn", "details.json", "mismatch/logprob_abs_diff_max", ".2e"),
    ("learn", "details.json", "learner/seconds_per_step", ".2f"),
    ("learn", "details.json", "learner/peak_device_mb", ".0f"),
    ("evaluate", "metrics.json", "eval/dense/score", ".3f"),
    ("evaluate", "metrics.json", "eval/compressed/score", ".3f"),
)


def e2e_rows(work: Path, iterations: int, steps: list[tuple[str, float, str]]) -> list[Row]:
    """Rows of the end-to-end part from its scratch directory `work`: each command's status and wall time, then
    the headline figures of every iteration (what `smdctl summary` shows)."""
    rows = [Row("e2e", name, status, f"{seconds:.0f}s") for name, seconds, status in steps]
    warm = work / "artifacts" / "warmstart" / "metrics.json"
    if warm.is_file():
        m = json.loads(warm.read_text())
        rows.append(Row("e2e", "warm start exact_match", _num(m.get("exact_match"), ".3f"),
                        f"{m.get('steps')} steps, {_num(m.get('minutes'), '.1f')} min"))
    for n in range(1, iterations + 1):
        base = work / "run" / "artifacts" / f"iter-{n:03d}"
        for stage, name, key, fmt in E2E_METRICS:
            path = base / stage / name
            if path.is_file():
                value = json.loads(path.read_text()).get(key)
                rows.append(Row("e2e", f"iter {n} {key}", _num(value, fmt) if value is not None else "absent"))
        details = base / "learn" / "details.json"
        if details.is_file():
            backend = json.loads(details.read_text()).get("attention_backend")
            rows.append(Row("e2e", f"iter {n} learner attention_backend", str(backend)))
    return rows


def e2e_part(limit_s: int, iterations: int = 2, warmstart_minutes: float = 1.0,
             extra: list[str] | None = None) -> list[Row]:
    """The default experiment in a scratch directory: init-model, prepare, warmstart, chain of `iterations`."""
    steps: list[tuple[str, float, str]] = []
    deadline = time.monotonic() + limit_s
    with tempfile.TemporaryDirectory(prefix="smd-gpu-e2e-") as tmp:
        work = Path(tmp)
        (work / "params.yaml").write_text((ROOT / "params.yaml").read_text())
        sets = [a for s in (extra or []) for a in ("-S", s)]
        commands = [("init-model", ["init-model", *sets]), ("prepare", ["prepare", *sets]),
                    ("warmstart", ["warmstart", "-S", f"warmstart.max_minutes={warmstart_minutes:g}", *sets]),
                    (f"chain ({iterations} iterations)",
                     ["chain", "--run-dir", "run", "--iterations", str(iterations), *sets])]
        for name, args in commands:
            left = deadline - time.monotonic()
            if left <= 0:
                steps.append((name, 0.0, "TIMEOUT"))
                break
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-c", "from cli.main import app; app()", *args], cwd=work,
                                      env=_child_env(), capture_output=True, text=True, timeout=left)
                status = "ok" if proc.returncode == 0 else "FAIL: " + (
                    (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"])[0][:100]
            except subprocess.TimeoutExpired:
                status = "TIMEOUT"
            steps.append((name, time.perf_counter() - t0, status))
            if status != "ok":
                break
        return e2e_rows(work, iterations, steps)


# ------------------------------------------------------------------ orchestration
def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def environment_line() -> str:
    """What the check ran on: GPU, torch / CUDA, transformers, Python."""
    import torch
    import transformers

    gpu = (f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / GIB:.0f} GiB)"
           if torch.cuda.is_available() else "no CUDA device")
    return (f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def run_part_in_child(part: str, args: argparse.Namespace, limit_s: int) -> list[Row]:
    """A measuring part in its own process (its GPU memory, its crash, its time limit)."""
    with tempfile.TemporaryDirectory(prefix="smd-gpu-part-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part, "--child-out", str(out),
               "--shape", args.shape, "--device", args.device, "--dtype", args.dtype,
               "--rollout-lengths", args.rollout_lengths, "--learner-lengths", args.learner_lengths,
               "--learner-modes", args.learner_modes,
               "--new-tokens", str(args.new_tokens), "--budget-gib", str(args.budget_gib)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return [Row(part, part, "TIMEOUT", f"past {limit_s}s")]
        if not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            return [Row(part, part, "ERROR", f"exit {proc.returncode}: {tail[0][:110]}")]
        return [Row(**r) for r in json.loads(out.read_text())]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--shape", default="qwen3-1.7b", help="model shape of rollout and learner (stages/bench/learner.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rollout-lengths", default="4096,16384,32768")
    ap.add_argument("--learner-lengths", default="4096,16384")
    ap.add_argument("--learner-modes", default=",".join(LEARNERS), help="learners (stages/bench/learner.py MODES)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget-gib", type=float, default=64.0, help="memory budget of the largest-batch search (0: skip)")
    ap.add_argument("--warmstart-minutes", type=float, default=1.0,
                    help="e2e: the warm start's wall-clock cap (warmstart.max_minutes; params.yaml has 5)")
    for part in PARTS:
        ap.add_argument(f"--limit-{part}", type=int, default=DEFAULT_LIMITS[part], help=f"seconds for {part}")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", choices=("rollout", "learner"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        rows = (rollout_part(args.shape, args.device, args.dtype, _ints(args.rollout_lengths),
                             new_tokens=args.new_tokens, budget_gib=args.budget_gib or None)
                if args.child == "rollout" else
                learner_part(args.shape, args.device, args.dtype, _ints(args.learner_lengths),
                             tuple(m for m in args.learner_modes.split(",") if m)))
        args.child_out.write_text(json.dumps([asdict(r) for r in rows]))
        return 0

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    t_start = time.perf_counter()
    rows: list[Row] = []
    for part in parts:
        limit = getattr(args, f"limit_{part}")
        t0 = time.perf_counter()
        print(f"gpu check: {part} (limit {limit}s) ...", file=sys.stderr, flush=True)
        if part == "correctness":
            rows += correctness_part(limit)
        elif part == "e2e":
            rows += e2e_part(limit, warmstart_minutes=args.warmstart_minutes)
        else:
            rows += run_part_in_child(part, args, limit)
        print(f"gpu check: {part} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_start
    title = (f"smd GPU check: {environment_line()}; shape {args.shape} {args.dtype}; {total:.0f}s in all")
    print(format_table(rows, title))
    if args.json:
        args.json.write_text(json.dumps({"title": title, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    bad = [r for r in rows if r.result in ("FAIL", "ERROR", "TIMEOUT") or r.result.startswith("FAIL")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
