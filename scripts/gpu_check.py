"""The GPU check (issues 21, 32; docs/design.md "Devices" and §3b): one command, one table. `scripts/gpu_check.sh`
installs the carried wheels and calls this; `python scripts/gpu_check.py --help` lists the options.

Parts, in this order (each in a child process with its own time limit, so an out-of-memory error, a hang or a crash
in one part still leaves the others' rows; `--parts` picks some):

  preflight    ~30 s: versions (Python, torch, transformers), the modules the check imports, CUDA and the device
               name, a C compiler and Python.h (Triton builds its launchers with them), free device memory, and a
               tiny FlexAttention forward + backward in float32 and bf16 (which also warms the compile workers).
               A FAIL or ERROR row stops the check: the later parts are CUT rows naming it (a TIMEOUT, e.g. a slow
               cold compile, is a failed row but the check goes on).
  correctness  `pytest -m gpu tests/test_gpu.py`: rollout -> compact -> learn parity on CUDA for every eviction
               policy in float32 (<= 1e-5, TF32 off) and bf16 (its gate), flex against the SDPA reference in
               values and gradients, the learner under DeepSpeed on one GPU. One row per test, written as the
               test finishes (scripts/gpu_check_plugin.py).
  rollout      a Qwen3-1.7B-shaped model built from its config (random bf16 weights), prompts of 4k / 16k / 32k
               tokens: generated tokens/s and peak memory (`torch.cuda.max_memory_allocated`, weights included,
               reset before each run) of smd SnapKV 0.5, smd dense and transformers `generate` (dense,
               DynamicCache), side by side; then the largest batch each fits in a fixed memory budget at one
               prompt length (per-sequence memory measured at batch 1 and 2, the extrapolated batch run once).
  learner      the same shape, T = 4k and 16k: step time and step working memory of smd (flex), the dense
               learner and physical KV slicing (`stages.bench.learner.measure_steps`); an out-of-memory error
               is the row "OOM at N GiB".
  e2e          the default experiment (params.yaml; init-model, prepare, warm start capped at
               `--warmstart-minutes` (1), then `smdctl chain` for 2 iterations) in a scratch directory, on the GPU.

What survives a limit (issue 32): every row is appended to a JSON-lines file the moment it is measured (flushed), and
the parent echoes it to stderr as it arrives; a part killed at its limit keeps the rows it finished and adds one
TIMEOUT row naming what was running. Every exception of a measurement is a row with its one-line cause; the part
goes on with the next measurement. One deadline is shared by the parts (`--total-s`, counted from
SMD_GPU_CHECK_T0, the epoch second gpu_check.sh started, so the wheel install counts too): a part gets its own
limit or what is left, whichever is less, and a part with too little left is a CUT row. The closing lines count
PASS, SKIP and failures apart and list what was cut.

The table logic runs on the CPU too, at the tiny shape (`--shape tiny --device cpu`): tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages.bench.floors import hbm_bandwidth  # noqa: E402  (the HBM floor of a decoding step)

PARTS = ("preflight", "correctness", "rollout", "learner", "e2e")
# "k64": rollout.eviction.interval 64; "compiled": rollout.compile (the decoding step, eviction included, as one
# captured graph: CUDA graphs); the compiled engines run after the eager ones, so a slow compile cuts only them
ENGINES = ("smd snapkv 0.5", "smd snapkv 0.5 k64", "smd dense", "hf generate", "smd snapkv 0.5 k64 compiled",
           "smd dense compiled")
PREFILL_CHUNK_TOKENS = 2048  # rollout.prefill_chunk_tokens' default (the layer-by-layer prefill, issue 54)
LEARNERS = ("dense", "smd_flex", "smd_gather")
LEARNER_LABELS = {"dense": "dense learner", "smd_flex": "smd (flex)", "smd_gather": "physical KV slicing",
                  "smd_sdpa": "smd (sdpa)", "smd_tiled": "smd (tiled)"}
GIB = 2**30
# Seconds per part on one H200, from the first run on one (2026-12-04, docs/design.md §3b): preflight 37 s,
# correctness 102 s with the two flex tests failing at once (a cold flex compile adds ~30 s each), rollout 77 s,
# learner > 100 s (cut during physical KV slicing at 16k), e2e 162 s. A part past its limit is one TIMEOUT row
# after the rows it finished; the shared deadline cuts the last part rather than leave time unused.
DEFAULT_LIMITS = {"preflight": 60, "correctness": 170, "rollout": 100, "learner": 120, "e2e": 190}
# The whole check, wheel install included (gpu_check.sh sets SMD_GPU_CHECK_T0): under one 600 s command limit
# with room for the table and the interpreter's start-up.
DEFAULT_TOTAL_S = 570
MIN_PART_S = 20  # a part with less left than this is not started (a CUT row)
RESERVE_S = 5  # kept back from the deadline for the table
ROWS_ENV = "SMD_GPU_CHECK_ROWS"  # a child's JSON-lines rows file (scripts/gpu_check_plugin.py writes it too)
T0_ENV = "SMD_GPU_CHECK_T0"
FAILED = ("FAIL", "ERROR", "TIMEOUT", "STOPPED", "OOM", "CUT")  # result prefixes that fail the check
# What the check imports beyond torch and transformers (the GPU image's): the wheels gpu_wheels.sh carries.
CHECK_IMPORTS = ("numpy", "yaml", "pydantic", "typer", "rich", "pyarrow", "zarr", "numcodecs", "deepspeed",
                 "pytest", "safetensors", "tokenizers")


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


def is_failure(row: Row) -> bool:
    return row.result.startswith(FAILED)


def tally(rows: list[Row]) -> dict[str, int]:
    """PASS (and ok), SKIP, failed and measured (a figure) rows, counted apart."""
    counts = {"PASS": 0, "SKIP": 0, "failed": 0, "measured": 0}
    for r in rows:
        key = "PASS" if r.result in ("PASS", "ok") else "SKIP" if r.result == "SKIP" else \
            "failed" if is_failure(r) else "measured"
        counts[key] += 1
    return counts


def summary_lines(rows: list[Row], cuda: bool) -> list[str]:
    """The closing lines: the counts (a SKIP is not a PASS; on CUDA a SKIP fails the check), what was cut."""
    c = tally(rows)
    lines = [f"{c['PASS']} passed, {c['failed']} failed, {c['SKIP']} skipped; {c['measured']} measured rows"]
    cut = [f"{r.part}: {r.item} ({r.detail})" for r in rows if r.result.startswith(("CUT", "TIMEOUT", "STOPPED"))]
    lines.append("cut to fit: " + ("; ".join(cut) if cut else "nothing"))
    if cuda and c["SKIP"]:
        lines.append(f"{c['SKIP']} SKIP rows on a CUDA device: the check does not pass")
    return lines


def check_passed(rows: list[Row], cuda: bool) -> bool:
    c = tally(rows)
    return c["failed"] == 0 and not (cuda and c["SKIP"])


def one_line(exc: BaseException) -> str:
    """An exception's one-line cause: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:140]}" if text else type(exc).__name__


def _num(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


# ------------------------------------------------------------------ rows that survive a kill
class RowLog:
    """Rows appended to a JSON-lines file the moment they are measured (one write and flush per row, so a kill of
    the process keeps every row before it). A `started` record names what runs now, for the TIMEOUT row."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.rows: list[Row] = []

    def _write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def start(self, part: str, item: str) -> None:
        self._write({"started": item, "part": part})

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        self._write(asdict(row))
        return row

    def __call__(self, row: Row) -> Row:
        return self.add(row)


class RowReader:
    """Reads a RowLog's file while its writer runs: the new complete lines since the last call (a cut last line
    waits for its end); `running` is the last started item without its own row yet."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.rows: list[Row] = []
        self.running: str | None = None

    def new(self) -> list[Row]:
        if not self.path.is_file():
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind("\n") + 1
        self.offset += len(data[:end].encode("utf-8"))
        fresh = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "started" in record:
                self.running = record["started"]
                continue
            row = Row(**{k: str(record.get(k, "")) for k in ("part", "item", "result", "detail")})
            if row.item == self.running:  # its own row; another (an e2e figure harvested meanwhile) leaves it
                self.running = None
            fresh.append(row)
        self.rows += fresh
        return fresh


def _echo(row: Row) -> None:
    print(f"gpu check row: {row.part} | {row.item} | {row.result} | {row.detail}", file=sys.stderr, flush=True)


STOP = threading.Event()  # set by SIGTERM / SIGINT (main): the running part is killed, the rest cut, the table printed


def run_child(part: str, cmd: list[str], limit_s: float, cwd: Path = ROOT,
              env: dict[str, str] | None = None, stop: threading.Event = STOP) -> list[Row]:
    """Run a part's child process (its own session, killed with its whole process group at `limit_s` or when
    `stop` is set), echo its rows as they arrive and return them: every row it wrote, then an ERROR row if it
    exited non-zero or wrote nothing, or a TIMEOUT (STOPPED) row naming what was running when it was killed."""
    with tempfile.TemporaryDirectory(prefix=f"smd-gpu-{part}-") as tmp:
        rows_path, log_path = Path(tmp) / "rows.jsonl", Path(tmp) / "log.txt"
        child_env = dict(env or _child_env(), **{ROWS_ENV: str(rows_path)})
        reader = RowReader(rows_path)
        deadline = time.monotonic() + limit_s
        timed_out = stopped = False
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    rc = None
                for row in reader.new():
                    _echo(row)
                if rc is not None:
                    break
                if time.monotonic() >= deadline or stop.is_set():
                    timed_out, stopped = True, stop.is_set()
                    _kill_group(proc)
                    rc = proc.wait()
                    break
        for row in reader.new():
            _echo(row)
        rows = list(reader.rows)
        tail = _last_line(log_path)
        if timed_out:
            what = reader.running or part
            rows.append(Row(part, what, "STOPPED" if stopped else "TIMEOUT",
                            ("stopped by a signal" if stopped else f"killed at the part's {limit_s:.0f}s limit") +
                            f"; {len(reader.rows)} rows above kept"))
        elif rc != 0:
            rows.append(Row(part, reader.running or part, "ERROR", f"exit {rc}: {tail}"))
        elif not rows:
            rows.append(Row(part, part, "ERROR", f"no rows written: {tail}"))
        if rows[len(reader.rows):]:
            _echo(rows[-1])
        return rows


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: pytest's and DeepSpeed's children too
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "?"
    return lines[-1].strip()[:140] if lines else "no output"


# ------------------------------------------------------------------ preflight
def _version_row(name: str, minimum: tuple[int, ...]) -> Row:
    import importlib

    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the row
        return Row("preflight", name, "FAIL", one_line(exc))
    version = getattr(mod, "__version__", "?")
    nums = tuple(int(x) for x in version.split("+")[0].split(".")[:len(minimum)] if x.isdigit())
    if nums < minimum:
        return Row("preflight", name, "FAIL", f"{version}: the code needs >= {'.'.join(map(str, minimum))}")
    return Row("preflight", name, "ok", version)


def c_compiler() -> str | None:
    """The C compiler Triton would use: $CC, else cc, gcc or clang on PATH (triton/runtime/build.py's order)."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def python_header() -> Path:
    """Where Python.h must be for this interpreter (sysconfig's include directory, as Triton looks it up)."""
    return Path(sysconfig.get_paths()["include"]) / "Python.h"


def flex_tiny(device: str, dtype_name: str) -> float:
    """A tiny compiled FlexAttention forward + backward (causal, GQA) against SDPA in float64 on the CPU: the
    largest difference of the output and the query gradient. Warms Triton's compile workers on CUDA."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 4, 128, 64, generator=g)
    k, v = torch.randn(1, 2, 128, 64, generator=g), torch.randn(1, 2, 128, 64, generator=g)
    block = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, 128, 128, device=device)
    qd = q.to(device, dtype).requires_grad_(True)
    out = torch.compile(flex_attention)(qd, k.to(device, dtype), v.to(device, dtype), block_mask=block,
                                        enable_gqa=True)
    out.float().pow(2).sum().backward()
    q64 = q.double().requires_grad_(True)
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k.double(), v.double(), is_causal=True,
                                                           enable_gqa=True)
    ref.pow(2).sum().backward()
    return max(float((out.detach().double().cpu() - ref.detach()).abs().max()),
               float((qd.grad.double().cpu() - q64.grad).abs().max()))


def preflight_part(device: str = "cuda", emit: Callable[[Row], Row] | None = None,
                   start: Callable[[str, str], None] | None = None) -> list[Row]:
    """The preflight rows. On the CPU (`--device cpu`) the GPU-only checks are SKIP rows saying why."""
    log = RowLog(None)
    emit = emit or log.add
    start = start or (lambda part, item: None)
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(emit(row))

    add(Row("preflight", "python", "ok", f"{platform.python_version()} ({sys.executable})"))
    add(_version_row("torch", (2, 11)))
    add(_version_row("transformers", (5, 17)))
    # the image's own pyarrow (scripts/gpu_wheels.sh carries none: pyproject's smallest one no longer fits)
    add(_version_row("pyarrow", (17,)))
    add(_version_row("pydantic", (2, 7)))
    missing = []
    for name in CHECK_IMPORTS:
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"{name} ({one_line(exc)[:60]})")
    add(Row("preflight", "imports", "FAIL" if missing else "ok",
            ("missing: " + ", ".join(missing)) if missing else ", ".join(CHECK_IMPORTS)))
    cc = c_compiler()
    add(Row("preflight", "C compiler", "ok" if cc else "FAIL",
            cc or "none of $CC, cc, gcc, clang on PATH: Triton (FlexAttention on CUDA) cannot build its launchers"))
    header = python_header()
    add(Row("preflight", "Python.h", "ok" if header.is_file() else "FAIL",
            str(header) if header.is_file() else f"{header} missing: Triton cannot build its launchers"))
    try:
        import torch
    except Exception:  # noqa: BLE001 - the torch row already says why
        return rows
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        for item in ("CUDA device", "free device memory", "flex fwd+bwd float32", "flex fwd+bwd bfloat16"):
            add(Row("preflight", item, "SKIP", f"--device {device}: only a CUDA device runs this check"))
        return rows
    if not torch.cuda.is_available():
        add(Row("preflight", "CUDA device", "FAIL", f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                                                    "no CUDA device"))
        return rows
    props = torch.cuda.get_device_properties(0)
    add(Row("preflight", "CUDA device", "ok", f"{props.name}, sm_{props.major}{props.minor}, CUDA "
                                              f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
    free, total = torch.cuda.mem_get_info(0)
    add(Row("preflight", "free device memory", "ok" if free >= 0.8 * total else "FAIL",
            f"{free / GIB:.1f} of {total / GIB:.1f} GiB free" + ("" if free >= 0.8 * total else
                                                                 ": another process holds the device")))
    for dtype_name, tol in (("float32", 1e-4), ("bfloat16", 5e-2)):
        item = f"flex fwd+bwd {dtype_name}"
        start("preflight", item)
        t0 = time.perf_counter()
        try:
            err = flex_tiny(device, dtype_name)
            add(Row("preflight", item, "ok" if err <= tol else "FAIL",
                    f"max |diff| {err:.1e} vs float64 SDPA (<= {tol:g}), {time.perf_counter() - t0:.1f}s"))
        except Exception as exc:  # noqa: BLE001 - the compile's failure is the row
            add(Row("preflight", item, "FAIL", one_line(exc)))
    return rows


# ------------------------------------------------------------------ correctness
def correctness_cmd() -> list[str]:
    """pytest -m gpu with the row-streaming plugin (scripts/gpu_check_plugin.py, on the child's PYTHONPATH)."""
    return [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider",
            "-p", "gpu_check_plugin"]


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
    """Generate `new_tokens` for every prompt (no stop token) with one engine; seconds, tokens/s, peak bytes.

    The timed region is the device work: smd's `generate_batch` runs with the host-side `sample_results`
    (the per-sequence shadow-mask bookkeeping numpy does after the batch) timed apart and excluded, as
    `generate`'s own host-side post-processing has no counterpart; the peak is reset at the start."""
    import torch

    from schemas.params.rollout import EvictionParams
    from stages.common.kvcache import sampler

    device = next(model.parameters()).device
    _sync(device)
    _peak_reset(device)
    host = {"seconds": 0.0}
    steps = {"seconds": float("nan"), "kv_bytes": float("nan")}
    t0 = time.perf_counter()
    if engine.startswith("smd"):
        # "k64": rollout.eviction.interval 64 (issue 54: evict every 64 steps, SnapKV without its ring)
        interval = 64 if " k64" in engine else 1
        eviction = (EvictionParams(policy="snapkv", keep_ratio=0.5, interval=interval) if "snapkv" in engine
                    else EvictionParams(policy="dense"))
        timed = sampler.sample_results

        def untimed(*a, **kw):  # the device work is done; the host bookkeeping is not the engine's speed
            _sync(device)
            h0 = time.perf_counter()
            try:
                return timed(*a, **kw)
            finally:
                host["seconds"] += time.perf_counter() - h0

        decode = sampler.decode

        def timed_decode(*a, **kw):  # the decoding steps alone (the prefill excluded): their floor is below
            _sync(device)
            d0 = time.perf_counter()
            try:
                return decode(*a, **kw)
            finally:
                _sync(device)
                steps["seconds"] = time.perf_counter() - d0

        sampler.sample_results, sampler.decode = untimed, timed_decode
        try:
            _, stats = sampler.generate_batch(model, prompts, eviction, new_tokens, eos_token_id=None,
                                              generator=torch.Generator(device="cpu").manual_seed(0),
                                              prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
                                              compile=engine.endswith(" compiled"))
        finally:
            sampler.sample_results, sampler.decode = timed, decode
        generated = stats.generated_tokens
        steps["kv_bytes"] = float(stats.cache_bytes)
    elif engine == "hf generate":
        ids = torch.tensor(prompts, dtype=torch.long, device="cpu").to(device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=0)
        generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    else:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    _sync(device)
    seconds = time.perf_counter() - t0 - host["seconds"]
    # a decoding step reads every weight and the whole slot cache once at least (the cache's capacity: its
    # physical bytes, what smd's decode attention reads); the floor is those bytes at the device's bandwidth
    step_s = steps["seconds"] / max(new_tokens - 1, 1)
    read = sum(p.numel() * p.element_size() for p in model.parameters()) + steps["kv_bytes"]
    floor_s = read / hbm_bandwidth(device)
    return {"seconds": seconds, "tokens_per_s": generated / seconds, "peak_bytes": _peak_bytes(device),
            "generated": float(generated), "host_seconds": host["seconds"], "step_s": step_s, "floor_s": floor_s}


def _oom_types() -> tuple[type[BaseException], ...]:
    import torch

    return (torch.cuda.OutOfMemoryError,)


def failure_result(exc: BaseException, device) -> tuple[str, str]:
    """(result, detail) of a measurement that raised: "OOM at N GiB" (the peak allocated when it ran out) for an
    out-of-memory error, else ERROR with the exception's one-line cause."""
    if isinstance(exc, _oom_types()):
        peak = _peak_bytes(device)
        return f"OOM at {_num(peak / GIB, '.1f')} GiB", one_line(exc)[:140]
    return "ERROR", one_line(exc)


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
                 engines: tuple[str, ...] = ENGINES, log: RowLog | None = None) -> list[Row]:
    """Rows of the rollout part: per prompt length and engine tokens/s (and x generate) and peak memory; then the
    largest batch within `budget_gib` at `budget_length` (None: skipped, e.g. on the CPU). Each row goes to
    `log` as it is measured; a measurement that raises is its own row and the part goes on."""
    log = log or RowLog(None)
    batches = batches or {4096: 8, 16384: 2, 32768: 1}
    rows: list[Row] = []
    try:
        from stages.bench.learner import build_bench_model
        from stages.common.model import configure_precision

        model = build_bench_model(shape, max(lengths) + new_tokens, device, dtype).eval()
        configure_precision(device, next(model.parameters()).dtype)
    except Exception as exc:  # noqa: BLE001 - the model itself: nothing else can run
        result, detail = failure_result(exc, device)
        return [log.add(Row("rollout", f"build {shape} model", result, detail))]
    vocab = model.config.vocab_size
    # warm-up: kernels, allocator, cuBLAS handles (not timed)
    for engine in engines:
        log.start("rollout", f"warm-up {engine}")
        try:
            run_engine(model, engine, random_prompts(1, min(lengths), vocab), 2)
        except Exception as exc:  # noqa: BLE001
            rows.append(log.add(Row("rollout", f"warm-up {engine}", *failure_result(exc, device))))
        _free(device)
    # generate first at each length: the anchor of the others' ratio, so every row is complete when measured
    order = sorted(engines, key=lambda e: e != "hf generate")
    for length in lengths:
        batch = batches.get(length, 1)
        anchor = None
        for engine in order:
            item = f"P={length} B={batch} {engine}"
            log.start("rollout", item)
            try:
                r = run_engine(model, engine, random_prompts(batch, length, vocab), new_tokens)
            except Exception as exc:  # noqa: BLE001
                rows.append(log.add(Row("rollout", item, *failure_result(exc, device))))
                _free(device)
                continue
            _free(device)
            if engine == "hf generate":
                anchor = r
            ratio = r["tokens_per_s"] / anchor["tokens_per_s"] if anchor else float("nan")
            memory = ("peak n/a on the CPU" if math.isnan(r["peak_bytes"]) else
                      f"peak {r['peak_bytes'] / GIB:.2f} GiB")
            host = f", host bookkeeping {r['host_seconds']:.2f}s untimed" if r["host_seconds"] else ""
            step = "" if math.isnan(r["step_s"]) else (
                f", decode step {r['step_s'] * 1e3:.2f} ms = {_num(r['step_s'] / r['floor_s'], '.1f')}x its HBM "
                f"floor {_num(r['floor_s'] * 1e3, '.2f')} ms")
            rows.append(log.add(Row("rollout", item, f"{r['tokens_per_s']:.0f} tok/s",
                                    f"{_num(ratio, '.2f')}x generate, {memory}, {new_tokens} new tokens in "
                                    f"{r['seconds']:.2f}s{host}{step}")))
    if budget_gib is not None:
        for engine in (e for e in engines if not e.endswith(" compiled")):  # compiling changes no tensor's size
            item = f"largest batch P={budget_length} in {budget_gib:g} GiB {engine}"
            log.start("rollout", item)
            try:
                batch, detail = largest_batch(model, engine, budget_length, budget_gib * GIB, vocab)
                rows.append(log.add(Row("rollout", item, f"B={batch}", detail)))
            except Exception as exc:  # noqa: BLE001
                rows.append(log.add(Row("rollout", item, *failure_result(exc, device))))
            _free(device)
    return rows


# ------------------------------------------------------------------ learner
def learner_row(r: dict) -> Row:
    """A `measure_steps` row as a table row: step time and working memory, both x dense; or its failure."""
    item = f"T={r['T']} {LEARNER_LABELS.get(r['mode'], r['mode'])}"
    if r["status"] != "ok":
        result, _, detail = r["status"].partition(": ")
        return Row("learner", item, result, detail)
    memory = ("peak n/a on the CPU" if math.isnan(r["peak_mb"]) else
              f"peak {r['peak_mb'] / 1024:.2f} GiB = {_num(r['mem_ratio'], '.2f')}x dense")
    return Row("learner", item, f"{r['step_s']:.3f} s/step", f"{_num(r['time_ratio'], '.2f')}x dense time, {memory}")


def learner_part(shape: str = "qwen3-1.7b", device: str = "cuda", dtype: str = "bfloat16",
                 lengths: tuple[int, ...] = (4096, 16384), modes: tuple[str, ...] = LEARNERS,
                 rounds: int = 2, log: RowLog | None = None) -> list[Row]:
    """Rows of the learner part: per T and learner the step time and step working memory, both x dense, each
    written to `log` the moment it is measured."""
    log = log or RowLog(None)
    rows: list[Row] = []
    try:
        from stages.bench.learner import measure_steps

        def on_row(r: dict) -> None:
            rows.append(log.add(learner_row(r)))
            log.start("learner", f"after {rows[-1].item}")  # what runs next is not known here: the last one done

        measure_steps(shape, lengths, modes, device=device, dtype=dtype, rounds=rounds, on_row=on_row)
    except Exception as exc:  # noqa: BLE001 - outside one learner's step (import, set-up)
        rows.append(log.add(Row("learner", "measure_steps", "ERROR", one_line(exc))))
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


def _json_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def e2e_rows(work: Path, iterations: int, steps: list[tuple[str, float, str]]) -> list[Row]:
    """Rows of the end-to-end part from its scratch directory `work`: each command's status and wall time, then
    the headline figures of every iteration written so far (what `smdctl summary` shows)."""
    rows = [Row("e2e", name, status, f"{seconds:.0f}s") for name, seconds, status in steps]
    m = _json_file(work / "artifacts" / "warmstart" / "metrics.json")
    if m is not None:
        rows.append(Row("e2e", "warm start exact_match", _num(m.get("exact_match"), ".3f"),
                        f"{m.get('steps')} steps, {_num(m.get('minutes'), '.1f')} min"))
    for n in range(1, iterations + 1):
        base = work / "run" / "artifacts" / f"iter-{n:03d}"
        for stage, name, key, fmt in E2E_METRICS:
            data = _json_file(base / stage / name)
            if data is not None:
                value = data.get(key)
                rows.append(Row("e2e", f"iter {n} {key}", _num(value, fmt) if value is not None else "absent"))
        details = _json_file(base / "learn" / "details.json")
        if details is not None:
            rows.append(Row("e2e", f"iter {n} learner attention_backend", str(details.get("attention_backend"))))
    return rows


def e2e_part(iterations: int = 2, warmstart_minutes: float = 1.0, extra: list[str] | None = None,
             log: RowLog | None = None, work: Path | None = None) -> list[Row]:
    """The default experiment in the scratch directory `work`: init-model, prepare, warmstart, chain of
    `iterations`. A command's row is written when it ends, an iteration's figures as soon as their files exist
    (so a chain killed in its second iteration still shows the first's)."""
    log = log or RowLog(None)
    rows: list[Row] = []
    seen: set[str] = set()

    def harvest() -> None:
        for row in e2e_rows(work, iterations, []):
            if row.item not in seen:
                seen.add(row.item)
                rows.append(log.add(row))

    cleanup = None
    if work is None:
        cleanup = tempfile.TemporaryDirectory(prefix="smd-gpu-e2e-")
        work = Path(cleanup.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        (work / "params.yaml").write_text((ROOT / "params.yaml").read_text())
        sets = [a for s in (extra or []) for a in ("-S", s)]
        commands = [("init-model", ["init-model", *sets]), ("prepare", ["prepare", *sets]),
                    ("warmstart", ["warmstart", "-S", f"warmstart.max_minutes={warmstart_minutes:g}", *sets]),
                    (f"chain ({iterations} iterations)",
                     ["chain", "--run-dir", "run", "--iterations", str(iterations), *sets])]
        for name, args in commands:
            log.start("e2e", name)
            t0 = time.perf_counter()
            with open(work / f"{name.split()[0]}.log", "w") as out:
                try:
                    proc = subprocess.Popen([sys.executable, "-c", "from cli.main import app; app()", *args],
                                            cwd=work, env=_child_env(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
                    while proc.poll() is None:
                        time.sleep(1.0)
                        harvest()
                    status = "ok" if proc.returncode == 0 else f"FAIL: {_last_line(Path(out.name))}"
                except Exception as exc:  # noqa: BLE001 - the command could not start
                    status = f"ERROR: {one_line(exc)}"
            result, _, cause = status.partition(": ")
            rows.append(log.add(Row("e2e", name, result, f"{time.perf_counter() - t0:.0f}s" +
                                    (f": {cause}" if cause else ""))))
            harvest()
            if status != "ok":
                break
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    return rows


# ------------------------------------------------------------------ orchestration
def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    paths = [str(ROOT), str(ROOT / "scripts"), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def environment_line() -> str:
    """What the check ran on: GPU, torch / CUDA, transformers, Python."""
    try:
        import torch
        import transformers
    except Exception as exc:  # noqa: BLE001 - the preflight rows say more
        return f"{one_line(exc)}; Python {platform.python_version()}"
    gpu = (f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / GIB:.0f} GiB)"
           if torch.cuda.is_available() else "no CUDA device")
    return (f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def part_cmd(part: str, args: argparse.Namespace) -> list[str]:
    """The child process of a part: pytest for correctness, this script's --child mode for the others."""
    if part == "correctness":
        return correctness_cmd()
    return [sys.executable, str(Path(__file__).resolve()), "--child", part,
            "--shape", args.shape, "--device", args.device, "--dtype", args.dtype,
            "--rollout-lengths", args.rollout_lengths, "--learner-lengths", args.learner_lengths,
            "--learner-modes", args.learner_modes, "--new-tokens", str(args.new_tokens),
            "--budget-gib", str(args.budget_gib), "--warmstart-minutes", str(args.warmstart_minutes),
            *[a for s in args.set for a in ("--set", s)]]


def install_rows(path: Path) -> list[Row]:
    """The wheel install's rows (gpu_check.sh writes `item<TAB>result<TAB>detail` lines)."""
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            item, _, rest = line.partition("\t")
            result, _, detail = rest.partition("\t")
            if item:
                rows.append(Row("install", item, result or "?", detail))
    return rows


def run_child_part(part: str, args: argparse.Namespace) -> int:
    """--child: run one part, its rows appended to $SMD_GPU_CHECK_ROWS as they are measured."""
    rows_file = os.environ.get(ROWS_ENV)
    log = RowLog(rows_file)
    if part == "preflight":
        preflight_part(args.device, emit=log.add, start=log.start)
    elif part == "rollout":
        rollout_part(args.shape, args.device, args.dtype, _ints(args.rollout_lengths), new_tokens=args.new_tokens,
                     budget_gib=args.budget_gib or None, log=log)
    elif part == "learner":
        learner_part(args.shape, args.device, args.dtype, _ints(args.learner_lengths),
                     tuple(m for m in args.learner_modes.split(",") if m), log=log)
    elif part == "e2e":
        work = Path(rows_file).parent / "e2e" if rows_file else None
        e2e_part(warmstart_minutes=args.warmstart_minutes, extra=args.set, log=log, work=work)
    return 0


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
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="e2e: a params override passed to every smdctl command as -S (repeatable)")
    ap.add_argument("--total-s", type=float, default=DEFAULT_TOTAL_S,
                    help=f"the whole check's deadline in seconds, counted from ${T0_ENV} (gpu_check.sh's start, so "
                         "the wheel install counts) or from now")
    for part in PARTS:
        ap.add_argument(f"--limit-{part}", type=float, default=DEFAULT_LIMITS[part],
                        help=f"seconds for {part} at most")
    ap.add_argument("--install-log", type=Path, help="gpu_check.sh's install rows (item, result, detail per line)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", choices=("preflight", "rollout", "learner", "e2e"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        return run_child_part(args.child, args)

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    t0_epoch = float(os.environ.get(T0_ENV) or time.time())
    deadline = t0_epoch + args.total_s - RESERVE_S
    rows: list[Row] = install_rows(args.install_log) if args.install_log else []
    for sig in (signal.SIGTERM, signal.SIGINT):  # e.g. `timeout` around the check: still print what it has
        signal.signal(sig, lambda *_: STOP.set())
    stop = None
    for part in parts:
        left = deadline - time.time()
        if STOP.is_set():
            stop = "stopped by a signal"
        if stop or left < MIN_PART_S:
            reason = stop or f"{max(left, 0):.0f}s left of the {args.total_s:.0f}s deadline"
            rows.append(Row(part, "not run", "CUT", reason))
            _echo(rows[-1])
            continue
        own = getattr(args, f"limit_{part}")
        limit = min(own, left)
        t0 = time.perf_counter()
        print(f"gpu check: {part} (limit {limit:.0f}s{'' if limit == own else f', cut from {own:.0f}s'}) ...",
              file=sys.stderr, flush=True)
        part_rows = run_child(part, part_cmd(part, args), limit)
        if limit < own:
            for r in part_rows:
                if r.result == "TIMEOUT":
                    r.detail += f" (cut from {own:.0f}s by the shared deadline)"
        rows += part_rows
        print(f"gpu check: {part} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        if part == "preflight":  # something missing stops the check; a slow compile (TIMEOUT) does not
            bad = [r.item for r in part_rows if r.result.startswith(("FAIL", "ERROR"))]
            if bad:
                stop = f"preflight failed: {', '.join(bad)}"
    total = time.time() - t0_epoch
    cuda = args.device.startswith("cuda")
    title = f"smd GPU check: {environment_line()}; shape {args.shape} {args.dtype}; {total:.0f}s in all"
    print(format_table(rows, title))
    print()
    print("\n".join(summary_lines(rows, cuda)))
    if args.json:
        args.json.write_text(json.dumps({"title": title, "rows": [asdict(r) for r in rows],
                                         "summary": summary_lines(rows, cuda)}, indent=1) + "\n")
    return 0 if check_passed(rows, cuda) else 1


if __name__ == "__main__":
    sys.exit(main())
