"""`smdctl bench rollout --processes 1,2`: the rollout stage on N data-parallel processes, side by side.

Each configuration runs the real stage (`stages.rollout.stage.rollout`) on the same workload: the default
tiny model (random init) or `--policy`, random prompts of the held-out length, the default eviction. N
processes are started like the launcher starts them (RANK / WORLD_SIZE / MASTER_* in the environment, gloo),
each with `threads` torch threads. Reported per configuration: generated tokens/s of the parallel phase
(the stage's own `rollout/tokens_per_s`: all tokens over the slowest process's sampling time), the wall time
of the whole run (process start, model load, sampling, writing and merging the parts), tokens per CPU
second of sampling (summed over processes: the overhead of the split, independent of how busy the machine
is), each relative to the first configuration. Repeats are interleaved and the best run counts (the machine is shared). The
trajectory tables of all configurations are compared byte for byte (they must be identical).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from schemas.layout import TRAJECTORIES
from schemas.params import Params, load_params
from schemas.params.model import TinyModelParams
from schemas.tables import write_table
from stages.common.model import init_tiny_model
from stages.rollout.stage import run_rollout


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, params: Params, policy: Path, prompts: Path,
            out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    run_rollout(params, 1, policy, prompts, out, show_progress=False)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_config(world: int, threads: int, params: Params, policy: Path, prompts: Path, out: Path) -> dict:
    """One rollout on `world` processes with `threads` torch threads each: its metrics and wall time."""
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(world, _free_port(), threads, params, policy, prompts, out), nprocs=world, join=True)
    wall = time.perf_counter() - t0
    details = json.loads((out / "details.json").read_text())
    return {"processes": world, "threads": threads, "tokens_per_s": details["rollout/tokens_per_s"],
            "tokens": details["rollout/generated_tokens"], "wall_s": wall,
            "tokens_per_cpu_s": details["rollout/generated_tokens"] / max(details["rollout/cpu_seconds"], 1e-9),
            "table": (out / TRAJECTORIES).read_bytes()}


def bench_rollout_processes(processes: list[int], threads: int | None, policy: Path | None, num_prompts: int,
                            group_size: int, prompt_tokens: int, new_tokens: int, batch_size: int, repeats: int,
                            print_fn=print) -> list[dict]:
    """Tokens/s of the rollout stage at each process count (threads per process: `threads`, default 1), plus
    one process with every core as torch threads; ratios to the first configuration."""
    cores = os.cpu_count() or 1
    configs = [(n, threads or 1) for n in processes]
    if (1, cores) not in configs and cores > 1:
        configs.append((1, cores))  # the alternative use of the same cores: intra-op threads in one process
    params = load_params(None, [f"rollout.prompts_per_iteration={num_prompts}", f"rollout.group_size={group_size}",
                                f"rollout.max_new_tokens={new_tokens}", f"rollout.batch_size={batch_size}",
                                "rollout.min_prompt_tokens=1",
                                # CPU processes sharing the cores is what this bench measures, GPU or not
                                "model.device=cpu"])
    with tempfile.TemporaryDirectory(prefix="smd-bench-rollout-") as tmp:
        root = Path(tmp)
        policy = policy or init_tiny_model(TinyModelParams(), root / "model")
        g = torch.Generator().manual_seed(0)
        rows = [{"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": "x", "reference": "a",
                 "prompt_token_ids": torch.randint(4, 100, (prompt_tokens,), generator=g).tolist()}
                for i in range(num_prompts)]
        prompts = write_table(rows, root / "prompts.arrow", "prompts")
        best: dict[tuple[int, int], dict] = {}
        for r in range(repeats):
            for world, t in configs:
                res = run_config(world, t, params, policy, prompts, root / f"out-{world}x{t}-{r}")
                if (world, t) not in best or res["tokens_per_s"] > best[(world, t)]["tokens_per_s"]:
                    best[(world, t)] = res
    results = [best[c] for c in configs]
    base = results[0]
    print_fn(f"rollout on N processes: {num_prompts} prompts x {group_size} samples of {prompt_tokens} tokens, "
             f"{new_tokens} new tokens, batch {batch_size}, {params.rollout.eviction.policy} keep_ratio "
             f"{params.rollout.eviction.keep_ratio}; {cores} CPU cores; best of {repeats}")
    print_fn(f"{'processes':>9} {'threads/proc':>12} {'tokens/s':>9} {'x first':>8} {'wall s':>7} {'x first':>8} "
             f"{'tokens/CPU-s':>12} {'x first':>8}")
    for res in results:
        res["speedup"] = res["tokens_per_s"] / base["tokens_per_s"]
        res["wall_speedup"] = base["wall_s"] / res["wall_s"]
        res["cpu_efficiency"] = res["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        print_fn(f"{res['processes']:>9} {res['threads']:>12} {res['tokens_per_s']:>9.0f} {res['speedup']:>7.2f}x "
                 f"{res['wall_s']:>7.1f} {res['wall_speedup']:>7.2f}x {res['tokens_per_cpu_s']:>12.0f} "
                 f"{res['cpu_efficiency']:>7.2f}x")
    same = all(res["table"] == base["table"] for res in results)
    print_fn(f"trajectory tables identical across configurations: {'yes' if same else 'NO'}")
    for res in results:
        res.pop("table")
    return results
