"""`smdctl bench learner --sequence-parallel N`: the peak memory of one learner micro-step per process, one process
against N processes of sequence parallelism (`learner.sequence_parallel`, DeepSpeed-Ulysses; docs/design.md §6b,
"Sequence parallelism"; issue 55's target: at T = 8k a process's peak <= 0.6x one process's, equal results).

The micro-step is the learner's own: smd (the default objective, kl_lambda 0.1) with its dense teacher, per-sample
rows (`shared_prompt: false`, as sequence parallelism needs) --

  1 process    `train.micro_step`'s path at `sequence_parallel: 1`: `response_hidden_with_teacher` (the rows
               before the first eviction once, then the teacher's dense rows under no_grad and the policy's
               shadow-masked rows), `chunked_token_scores`, `objective_loss`, backward (`one_process_loss`)
  N processes  its path at `sequence_parallel: N`: `sequence_parallel_loss` (each process forwards T/N positions,
               DeepSpeed's DistributedAttention all-to-alls q/k/v around the local shadow-mask replay of H/N heads;
               the dense teacher a second sequence-parallel forward under no_grad; the scores summed over the
               group, the same objective on every process), backward

-- on a synthetic micro-batch (`synthetic_micro_batch`: `rows` rows of up to T tokens, prompt 3/4, SnapKV-like
shadow masks at keep ratio 0.5, random rollout log-probs) of a random-initialised model (`--shape`; by default
`qwen3-0.6b-4l`: Qwen3-0.6B's layers, heads and vocabulary with 4 of its 28 layers) or a model directory.

Each configuration runs in its own fresh processes (spawned; the N processes over gloo on the CPU, NCCL on N GPUs):
the model and the parameter gradients are allocated (the gradients as after an earlier micro-batch: the learner
accumulates into them), one warm-up micro-step at `WARMUP_TOKENS` tokens (kernels, the process group's buffers),
then the measured micro-step at T. Peak per process: its working memory, on the CPU the peak resident set (VmHWM,
reset through /proc/self/clear_refs) minus the resident set just before the step, with glibc set to return freed
memory (`stages.bench.learner`'s rule); on CUDA `torch.cuda.max_memory_allocated` minus the allocation before the
step. On the CPU also the anonymous resident set sampled every 2 ms during the step (`_AnonPeak`: file-backed
pages, which a loaded machine may drop and fault back in mid-step, excluded) as a cross-check, and on both what
autograd saves for the backward (the activations). The weights, the gradients, the inputs and the runtime (torch,
DeepSpeed, the process group) are held before the step on every process alike and are not in the peak; the base
column prints them. The N-process row's peak is its
largest process's (the response, and with it the lm head's work, is at the end of the sequence: on the last
process). Equal results: the loss (every process of the group computes the whole micro-batch's), the per-token
log-probs and, after the gradients are summed over the group (`sum_gradients`, outside the measured step), the
gradient norm, against the one process's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from stages.bench.learner import (
    SHAPES,
    _start_peak,
    _status_kib,
    build_bench_model,
    describe_shape,
    is_model_dir,
    weights_note,
)

DEFAULT_SHAPE = "qwen3-0.6b-4l"
DEFAULT_LENGTHS = (8192,)
BACKENDS = ("tiled", "sdpa", "flex")
WARMUP_TOKENS = 256
TARGET_RATIO = 0.6  # issue 55: a process's peak at T = 8k <= 0.6x one process's
MIB = 2.0**20


# ------------------------------------------------------------------------------------------ the micro-batch and loss
def synthetic_micro_batch(T: int, rows: int, num_layers: int, num_kv_heads: int, vocab_size: int, seed: int = 0,
                          device: str = "cpu"):
    """A right-padded `stages.learner.data.MicroBatch` of `rows` rows, row b of T - b * (T // 8) tokens (prompt 3/4
    of it, the response the rest): random ids, SnapKV-like shadow masks at keep ratio 0.5 (every row evicts),
    random rollout log-probs, advantages +1, -1, +1, ... Seeded: the same on every process."""
    import numpy as np
    import torch

    from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
    from stages.learner.data import MicroBatch
    from stages.learner.shadow_attention import pad_evict_at

    rng = np.random.default_rng(seed)
    eviction = eviction_config("snapkv", 0.5)
    lengths = [T - b * (T // 8) for b in range(rows)]
    if min(lengths) < 8:
        raise ValueError(f"{rows} rows of up to {T} tokens: the shortest would have {min(lengths)} (< 8)")
    prompts = [(3 * n) // 4 for n in lengths]
    responses = [n - p for n, p in zip(lengths, prompts)]
    ids = torch.zeros(rows, T, dtype=torch.long)
    evs = []
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        ids[b, :n] = torch.from_numpy(rng.integers(4, vocab_size, n))
        evs.append(torch.from_numpy(synthetic_evict_at("snapkv", n, p, num_layers, num_kv_heads, eviction,
                                                       rng).astype(np.int64)))
    R = max(responses)
    valid = torch.arange(R).view(1, R) < torch.tensor(responses).view(-1, 1)
    rollout = torch.from_numpy(-rng.uniform(0.5, 6.0, (rows, R))).float() * valid
    advantages = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(rows)])
    return MicroBatch(rows=list(range(rows)), input_ids=ids.to(device), prompt_lens=prompts, resp_lens=responses,
                      rollout_logp=rollout.to(device), valid=valid.to(device), advantages=advantages.to(device),
                      evict_at=pad_evict_at(evs, T).to(device))


def one_process_loss(model, mb, cfg, temperature: float = 1.0, score=None, head_grad_in_place: bool = False):
    """The learner's loss of one micro-batch on one process (`train.micro_step` at `sequence_parallel: 1`, per-sample
    rows): `response_hidden_with_teacher` for an objective with its dense teacher (kl_lambda > 0), else
    `response_hidden` (shadow-masked or dense as the objective needs); `score` (default `chunked_token_scores`,
    the learner's; tests pass a float64 one); `objective_loss`; `head_grad_in_place`: a tied head's gradient into
    `.grad` during the backward, as the learner does (`logprobs.accumulate_head_grad`). Returns (loss, scores)."""
    from stages.learner.logprobs import chunked_token_scores, lm_head_of
    from stages.learner.objectives import ObjectiveBatch, objective_loss, objective_spec
    from stages.learner.shadow_attention import response_hidden, response_hidden_with_teacher

    spec = objective_spec(cfg.objective)
    masked, backend = spec.masked_forward, cfg.backend_for(mb.input_ids.device.type)
    teacher_hidden = None
    if spec.dense_teacher and cfg.kl_lambda > 0:
        hidden, teacher_hidden, targets, valid = response_hidden_with_teacher(
            model, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens, backend, cfg.flex_block_size)
    else:
        extra = {}
        if masked and backend == "flex":
            from stages.learner.flex_backend import build_block_masks

            extra["smd_block_masks"] = build_block_masks(mb.evict_at, model.config.num_attention_heads,
                                                         cfg.flex_block_size)
        hidden, targets, valid = response_hidden(model, mb.input_ids, mb.evict_at if masked else None,
                                                 mb.prompt_lens, mb.resp_lens, backend, **extra)
    scores = (score or chunked_token_scores)(hidden, lm_head_of(model), targets, valid, temperature=temperature,
                                  chunk_tokens=cfg.logit_chunk_tokens, teacher_hidden=teacher_hidden,
                                  accumulate_head_grad=head_grad_in_place)
    batch = ObjectiveBatch(advantages=mb.advantages, mask=mb.valid, rollout_logp=mb.rollout_logp,
                           masked_logp=scores["logp"] if masked else None,
                           dense_logp=None if masked else scores["logp"], kl_per_token=scores.get("kl"))
    return objective_loss(cfg, batch)[0], scores


# ------------------------------------------------------------------------------------------ one process of a run
class _AnonPeak:
    """The process's anonymous resident memory (resident less file-backed and shared pages, /proc/self/statm) while
    in the block, sampled every `interval` seconds on a thread: its largest rise over the value on entry (`peak`,
    bytes). A cross-check of VmHWM, which also counts the file-backed pages (torch's libraries) the kernel may drop
    and fault back in during a step on a loaded machine; a sample can miss a spike shorter than `interval`."""

    def __init__(self, interval: float = 0.002, enabled: bool = True):
        self.interval, self.enabled, self.peak = interval, enabled, float("nan")
        self._page = os.sysconf("SC_PAGE_SIZE")

    def now(self) -> int:
        resident, shared = (int(x) for x in Path("/proc/self/statm").read_text().split()[1:3])
        return (resident - shared) * self._page

    def __enter__(self):
        if not self.enabled:
            return self
        import threading

        self._base, self._top, self._stop = self.now(), 0, threading.Event()

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self._top = max(self._top, self.now())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._top, self.now()) - self._base


def _worker(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    """Process `rank` of a run on `world` processes (1: no process group): the warm-up micro-step, the measured one
    at T, then the results (`rank{r}.json`; rank 0 also its log-probs, `logp.pt`)."""
    if spec.get("cores"):
        os.sched_setaffinity(0, spec["cores"])
    cuda = spec["device"] == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cuda" if cuda else "cpu", PYTHONWARNINGS="ignore")
    import torch
    import torch.distributed as dist

    from schemas.params.learner import LearnerParams
    from stages.common.model import configure_precision
    from stages.learner.logprobs import accumulate_head_grad
    from stages.learner.sequence_parallel import new_sequence_parallel, sequence_parallel_loss, sum_gradients
    from stages.learner.shadow_attention import checkpointed_layers, enable_layer_checkpointing

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        model = build_bench_model(spec["shape"], spec["T"], device, spec["dtype"]).eval()
        configure_precision(device, next(model.parameters()).dtype)
        cfg = LearnerParams(shared_prompt=False, attention_backend=spec["backend"],
                            gradient_checkpointing=spec["gradient_checkpointing"],
                            **({"logit_chunk_tokens": spec["chunk_tokens"]} if spec["chunk_tokens"] else {}))
        if cfg.gradient_checkpointing:
            enable_layer_checkpointing(model)
        mc = model.config
        sp = new_sequence_parallel(world, mc.num_attention_heads, mc.num_key_value_heads)
        in_place = accumulate_head_grad(model, zero_stage=0)  # as the learner's engine.backward
        for p in model.parameters():  # as after an earlier micro-batch: the learner accumulates into them
            p.grad = torch.zeros_like(p)

        param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t):  # what autograd keeps for the backward: distinct storages, parameters excluded
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                saved.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        def forward(mb):
            with checkpointed_layers(model) if cfg.gradient_checkpointing else contextlib.nullcontext():
                if sp is None:
                    return one_process_loss(model, mb, cfg, head_grad_in_place=in_place)
                loss, _, scores = sequence_parallel_loss(model, sp, mb, cfg, temperature=1.0,
                                                         head_grad_in_place=in_place)
                return loss, scores

        def micro_step(mb):
            loss, scores = forward(mb)
            loss.backward()
            return loss.detach(), scores["logp"].detach()

        def saved_by_forward(mb) -> int:
            """What autograd keeps for the backward of `mb`'s forward, counted in a forward of its own: a saved-tensor
            hook that returns the tensor itself keeps every saved output alive until the graph is freed (a reference
            cycle), so the measured step runs without it (it added ~1.2 GiB to the peak at T = 8k)."""
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss, _ = forward(mb)
            del loss
            return sum(saved.values())

        def batch(T: int):
            return synthetic_micro_batch(T, spec["rows"], mc.num_hidden_layers, mc.num_key_value_heads,
                                         mc.vocab_size, seed=spec["seed"], device=device)

        micro_step(batch(min(WARMUP_TOKENS, spec["T"])))
        for p in model.parameters():
            p.grad.zero_()
        mb = batch(spec["T"])
        base, can_reset = _start_peak(device)
        anon = _AnonPeak(enabled=not cuda)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with anon:
            loss, logp = micro_step(mb)
            if cuda:
                torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            work, whole = peak - base, peak
        else:
            whole = _status_kib("VmHWM") * 1024
            work = whole - base if can_reset else float("nan")
        if sp is not None:
            sum_gradients(model, sp)
        grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        saved_bytes = saved_by_forward(mb)  # after the peak was read
        params = list(model.parameters())
        result = {"rank": rank, "world": world, "peak_mb": work / MIB, "base_mb": base / MIB,
                  "hwm_mb": whole / MIB, "anon_mb": anon.peak / MIB if not cuda else work / MIB,
                  "saved_mb": saved_bytes / MIB, "step_s": seconds, "loss": float(loss),
                  "grad_norm": grad_norm,
                  "weights_mb": sum(p.numel() * p.element_size() for p in params) / MIB,
                  "tokens": int(mb.input_ids.shape[1]), "rows": int(mb.input_ids.shape[0]),
                  "response_tokens": int(mb.valid.sum())}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        if rank == 0:
            torch.save(logp.cpu(), Path(out, "logp.pt"))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run(world: int, spec: dict[str, Any], timeout_s: float) -> tuple[list[dict[str, Any]] | None, Any, str]:
    """`world` fresh processes of `_worker` (spawned), at most `timeout_s` seconds: (their results by rank, rank 0's
    log-probs, "") or (None, None, why)."""
    import torch
    import torch.multiprocessing as mp

    from stages.common.distributed import _free_port

    with tempfile.TemporaryDirectory(prefix="smd-bench-sp-") as out:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), spec, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    return None, None, f"over {timeout_s:.0f} s: stopped"
        except Exception as exc:  # noqa: BLE001 - a process failed (out of memory, ...): the row says so
            lines = [x for x in str(exc).strip().splitlines() if x.strip()]
            return None, None, (lines[-1] if lines else type(exc).__name__)[:200]
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
        return results, torch.load(Path(out, "logp.pt")), ""


# ------------------------------------------------------------------------------------------ the table
def bench_learner_sequence_parallel(processes: int, shape: str | None = None, lengths=None, backend: str = "tiled",
                                    rows: int = 1, threads: int = 1, cores: str | None = None, device: str = "cpu",
                                    dtype: str = "float32", chunk_tokens: int | None = None,
                                    gradient_checkpointing: bool = False, seed: int = 0, timeout_s: float = 900,
                                    print_fn=print) -> list[dict[str, Any]]:
    """One learner micro-step at each T on 1 process and on `processes` processes of sequence parallelism (module
    docstring): prints and returns the rows (processes, backend, T, peak per process MiB and per rank, x one
    process, step seconds, |loss difference|, max |log-prob difference|, relative gradient-norm difference)."""
    from schemas.errors import SmdInputError
    from stages.common.model import DTYPES, resolve_device
    from stages.learner.sequence_parallel import check_sequence_parallel

    shape = shape or DEFAULT_SHAPE
    if shape not in SHAPES and not is_model_dir(shape):
        raise SmdInputError(f"bench learner: unknown shape {shape!r}; choose from {', '.join(SHAPES)} or give a model "
                            "directory (--model)")
    if backend not in BACKENDS:
        raise SmdInputError(f"bench learner: --backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise SmdInputError(f"bench learner: dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if rows < 1:
        raise SmdInputError(f"bench learner: --rows {rows}: must be >= 1")
    where = resolve_device(device, rank=0)
    heads = _heads(shape)
    check_sequence_parallel(processes, processes, *heads)
    if processes < 2:
        raise SmdInputError(f"bench learner: --sequence-parallel {processes}: compare 1 process with >= 2")
    if where.type == "cuda":
        import torch

        if torch.cuda.device_count() < processes:
            raise SmdInputError(f"bench learner: --sequence-parallel {processes} on CUDA needs {processes} GPUs (one "
                                f"per process), this machine has {torch.cuda.device_count()}")
    lengths = list(lengths or DEFAULT_LENGTHS)
    if not lengths or min(lengths) < 16:
        raise SmdInputError("bench learner: lengths must be >= 16 tokens")
    core_list = _parse_cores(cores)
    spec_base = {"shape": shape, "backend": backend, "rows": rows, "threads": threads, "cores": core_list,
                 "device": where.type, "dtype": dtype, "chunk_tokens": chunk_tokens,
                 "gradient_checkpointing": gradient_checkpointing, "seed": seed}
    cuda = where.type == "cuda"
    peak_what = ("torch.cuda.max_memory_allocated minus the allocation before it" if cuda else
                 "VmHWM minus the resident set before it")
    print_fn(f"bench learner, sequence parallelism (learner.sequence_parallel, DeepSpeed-Ulysses): "
             f"{describe_shape(shape)}, {weights_note(shape)}{dtype} on {'CUDA (NCCL)' if cuda else 'CPU (gloo)'}; "
             f"{rows} row(s) of up to T tokens (prompt 3/4), SnapKV-like masks keep 0.5; one micro-step: smd with "
             f"its dense teacher (kl_lambda 0.1), forward + backward, backend {backend}"
             + (", every layer checkpointed" if gradient_checkpointing else "")
             + f"; {threads or 'default'} thread(s) a process, cores {cores or 'any'}. Peak per process = the step's "
             f"working memory ({peak_what}); the N-process row's is its largest process's (per rank beside it). "
             "Anon = the same from the anonymous resident set sampled every 2 ms (file-backed pages excluded: "
             "a cross-check on a loaded machine). Saved = what autograd keeps for the backward, counted in a "
             "forward of its own after the measured step (the activations: distinct storages, parameters "
             "excluded; the largest process's). Held before the step on every process: weights, gradients, inputs, "
             "runtime (base).")
    print_fn(f"{'processes':>9}  {'backend':<8}{'T':>6}{'peak/proc MiB':>15}{'per rank MiB':>18}{'x one':>8}"
             f"{'anon MiB':>10}{'x one':>7}{'saved MiB':>11}{'base MiB':>10}{'step s':>9}{'|d loss|':>11}{'|d logp|max':>13}{'d gradnorm':>12}")
    out_rows: list[dict[str, Any]] = []
    for T in lengths:
        one: dict[str, Any] | None = None
        one_logp = None
        for world in (1, processes):
            results, logp, err = _run(world, {**spec_base, "T": T}, timeout_s)
            if results is None:
                print_fn(f"{world:>9}  {backend:<8}{T:>6}  failed: {err}")
                continue
            peak = max(r["peak_mb"] for r in results)
            row = {"processes": world, "backend": backend, "T": T, "peak_mb": peak,
                   "rank_peak_mb": [r["peak_mb"] for r in results], "base_mb": max(r["base_mb"] for r in results),
                   "hwm_mb": max(r["hwm_mb"] for r in results),
                   "saved_mb": max(r["saved_mb"] for r in results), "anon_mb": max(r["anon_mb"] for r in results), "step_s": max(r["step_s"] for r in results),
                   "loss": results[0]["loss"], "grad_norm": results[0]["grad_norm"],
                   "weights_mb": results[0]["weights_mb"], "response_tokens": results[0]["response_tokens"]}
            if world == 1:
                one, one_logp = row, logp
            row["ratio"] = peak / one["peak_mb"] if one and one["peak_mb"] > 0 else float("nan")
            row["anon_ratio"] = row["anon_mb"] / one["anon_mb"] if one and one["anon_mb"] > 0 else float("nan")
            row["loss_diff"] = abs(row["loss"] - one["loss"]) if one else float("nan")
            row["logp_diff"] = float((logp - one_logp).abs().max()) if one_logp is not None else float("nan")
            row["grad_norm_rel_diff"] = (abs(row["grad_norm"] - one["grad_norm"]) / max(one["grad_norm"], 1e-30)
                                         if one else float("nan"))
            out_rows.append(row)
            ranks = "/".join(f"{x:.0f}" for x in row["rank_peak_mb"])
            print_fn(f"{world:>9}  {backend:<8}{T:>6}{peak:>15.0f}{ranks:>18}{row['ratio']:>7.2f}x"
                     f"{row['anon_mb']:>10.0f}{row['anon_ratio']:>6.2f}x{row['saved_mb']:>11.0f}{row['base_mb']:>10.0f}{row['step_s']:>9.1f}{row['loss_diff']:>11.2e}{row['logp_diff']:>13.2e}"
                     f"{row['grad_norm_rel_diff']:>12.2e}")
    picked = [r for r in out_rows if r["processes"] > 1 and math.isfinite(r["ratio"])]
    if picked:
        longest = max(picked, key=lambda r: r["T"])
        verdict = "PASS" if longest["ratio"] <= TARGET_RATIO else "MISS"
        print_fn(f"target peak per process <= {TARGET_RATIO}x one process's (issue 55, at T = 8k): "
                 f"{longest['ratio']:.2f}x at T={longest['T']} on {longest['processes']} processes -> {verdict}"
                 + ("" if longest["T"] >= 8192 else " (below 8k)"))
    return out_rows


def _heads(shape: str) -> tuple[int, int]:
    """(query heads, KV heads) of `shape` or a model directory's config."""
    if is_model_dir(shape):
        c = json.loads((Path(shape) / "config.json").read_text())
        return c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    if shape == "tiny":
        from schemas.params.model import TinyModelParams

        t = TinyModelParams()
        return t.num_attention_heads, t.num_key_value_heads
    return SHAPES[shape]["num_attention_heads"], SHAPES[shape]["num_key_value_heads"]


def _parse_cores(cores: str | None) -> list[int] | None:
    """taskset's core list ("1", "0,1", "0-3") -> the cores; None for any."""
    from schemas.errors import SmdInputError

    if not cores:
        return None
    out: list[int] = []
    try:
        for part in cores.split(","):
            a, _, b = part.strip().partition("-")
            out += list(range(int(a), int(b or a) + 1))
    except ValueError:
        raise SmdInputError(f"bench learner: --cores {cores!r}: expected a core list such as 1 or 0,1 or 0-3") from None
    return out
