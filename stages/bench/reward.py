"""`smdctl bench reward`: the rollout stage's tokens/s with a slow reward function, scored in the stage's process
(`reward.workers: 0`) against a pool (`reward.workers: N`), with the built-in scorer as the anchor (issue 33).

The workload is the real stage (`stages.rollout.stage.run_rollout`) on the default tiny model (random init) or
`--policy`, random prompts, the default eviction, one torch thread. The reward is a verl-convention function that
sleeps `sleep_ms` per sample (a stand-in for a slow verifier) in a file written for the run. tokens/s is the
stage's own `rollout/tokens_per_s`: generated tokens over the wall time of sampling and scoring (a pool still
scoring when sampling ends is waited for). Repeats are interleaved and the fastest run counts. The trajectory
tables of the function runs are compared: the rewards must be identical whatever the worker count.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
import torch

from schemas.params import load_params
from schemas.params.model import TinyModelParams
from schemas.tables import write_table
from stages.common.model import init_tiny_model
from stages.rollout.stage import run_rollout

SLOW_REWARD = '''import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return float(len(solution_str) % 2)
'''


def bench_reward(workers: list[int], sleep_ms: float, policy: Path | None, num_prompts: int, group_size: int,
                 prompt_tokens: int, new_tokens: int, batch_size: int, repeats: int, print_fn=print) -> list[dict]:
    """Rollout tokens/s: the built-in scorer, then the slow function at each worker count; ratios to workers 0."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="smd-bench-reward-") as tmp:
        root = Path(tmp)
        policy = policy or init_tiny_model(TinyModelParams(), root / "model")
        (root / "slow_reward.py").write_text(SLOW_REWARD.format(seconds=sleep_ms / 1000))
        g = torch.Generator().manual_seed(0)
        rows = [{"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": "x", "reference": "a",
                 "prompt_token_ids": torch.randint(4, 120, (prompt_tokens,), generator=g).tolist()}
                for i in range(num_prompts)]
        prompts = write_table(rows, root / "prompts.arrow", "prompts")
        common = [f"rollout.prompts_per_iteration={num_prompts}", f"rollout.group_size={group_size}",
                  f"rollout.max_new_tokens={new_tokens}", f"rollout.batch_size={batch_size}",
                  "rollout.min_prompt_tokens=1", "model.device=cpu"]
        configs = [("built-in scorer", None)] + [(f"{sleep_ms:g} ms reward, workers {w}", w) for w in workers]
        best: dict[str, dict] = {}
        for r in range(repeats):
            for name, w in configs:
                extra = [] if w is None else [f"reward.function={root / 'slow_reward.py'}:compute_score",
                                              f"reward.workers={w}"]
                out = root / f"run-{len(best)}-{r}-{w}"
                run_rollout(load_params(None, common + extra), 1, policy, prompts, out, show_progress=False)
                details = json.loads((out / "details.json").read_text())
                result = {"config": name, "workers": w, "tokens_per_s": details["rollout/tokens_per_s"],
                          "seconds": details["rollout/seconds"],
                          "rewards": pd.read_feather(out / "trajectories.arrow").reward.tolist()}
                if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                    best[name] = result
        results = [best[name] for name, _ in configs]
    base = next((b for b in results if b["workers"] == 0), results[0])
    samples = num_prompts * group_size
    print_fn(f"rollout, tiny model, {samples} samples x {new_tokens} new tokens, {prompt_tokens}-token prompts, "
             f"batch {batch_size}, 1 torch thread, fastest of {repeats}; the reward sleeps {sleep_ms:g} ms a sample "
             f"({samples * sleep_ms / 1000:.2f} s per rollout in one process)")
    print_fn(f"{'configuration':<28} {'tokens/s':>9} {'seconds':>8} {'vs workers 0':>13}")
    for b in results:
        print_fn(f"{b['config']:<28} {b['tokens_per_s']:>9.1f} {b['seconds']:>8.2f} "
                 f"{b['tokens_per_s'] / base['tokens_per_s']:>12.2f}x")
    scored = [b for b in results if b["workers"] is not None]
    same = all(b["rewards"] == scored[0]["rewards"] for b in scored)
    print_fn(f"rewards identical across worker counts: {same}")
    return results
