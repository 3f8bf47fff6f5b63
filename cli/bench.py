"""`smdctl bench ...`: benchmarks that print ratios measured side by side in one run (docs/design.md §8).

`bench_app` is the shared sub-app; each stage adds its own command here (compaction now; rollout and
learner later), with the measuring code on the stage side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import guarded
from schemas.errors import SmdInputError
from schemas.params.rollout import POLICIES

bench_app = typer.Typer(help="Benchmarks: ratios measured side by side in one run.", no_args_is_help=True)


@bench_app.callback()
def bench() -> None:
    """Benchmarks of the pipeline stages (absolute times count only on a GPU)."""


@bench_app.command("compaction")
def bench_compaction(
    lengths: Annotated[str, typer.Option(help="Comma-separated tokens per row.")] = "1024,4096,16384",
    policies: Annotated[str, typer.Option(help="Comma-separated eviction policies (synthetic schedules).")] = ",".join(
        POLICIES),
    keep_ratio: Annotated[float, typer.Option(help="Eviction keep ratio.")] = 0.5,
    microbatch_tokens: Annotated[int, typer.Option(help="Learner micro-batch tokens (rows = this // T, >= 1).")] = 4096,
    fwd_only_from: Annotated[
        int, typer.Option(help="From this T on, time only the attention forward (SDPA per layer) to keep the run short.")
    ] = 16384,
    json_out: Annotated[Path | None, typer.Option(help="Also write the results as JSON here.")] = None,
) -> None:
    """Compacted size vs dense bitmask and raw int32, compaction throughput, micro-batch read vs learner step."""
    from stages.bench.compaction import run_compaction_bench

    guarded(
        lambda: run_compaction_bench(
            [int(x) for x in lengths.split(",") if x],
            [x.strip() for x in policies.split(",") if x.strip()],
            keep_ratio=keep_ratio,
            microbatch_tokens=microbatch_tokens,
            fwd_only_from=fwd_only_from,
            json_out=json_out,
        )
    )


@bench_app.command("rollout")
def bench_rollout_cmd(
    lengths: Annotated[str, typer.Option(
        help="Comma-separated shapes: `default` (the default rollout: 64 sequences of ~110 prompt tokens, 16 new, "
             "16 together) or prompt lengths.")] = "default,2048,4096",
    keep_ratio: Annotated[float, typer.Option(help="Eviction keep ratio.")] = 0.5,
    batch_size: Annotated[int | None, typer.Option(
        help="Sequences decoded together (default 4; with --processes the stage's 16).")] = None,
    new_tokens: Annotated[int | None, typer.Option(
        help="Tokens generated per sequence (default 128; with --processes 16).")] = None,
    repeats: Annotated[int | None, typer.Option(
        min=1, help="Runs per configuration, interleaved; the fastest counts (default 3; with --processes 2).")] = None,
    processes: Annotated[str | None, typer.Option(
        help="Comma-separated process counts, e.g. 1,2: the rollout stage data parallel (gloo), tokens/s side by "
             "side instead of the policy comparison.")] = None,
    prompts: Annotated[int | None, typer.Option(
        min=1, help="With --processes or --group-size: prompts sampled (default 32; with --group-size 16).")] = None,
    group_size: Annotated[int | None, typer.Option(
        min=2, help="With --processes: samples per prompt (default 8). With --model: the GRPO workload instead, "
                    "--prompts x G samples: smd SnapKV shared and per sample, smd dense shared, vLLM n=G with "
                    "prefix caching on and off (--lengths: prompt lengths, default 140). With --model and --long: "
                    "the long-context table on GRPO groups (--batch-size / G prompts, G samples each).")] = None,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="With --processes: tokens per random prompt.")] = 110,
    policy: Annotated[Path | None, typer.Option(
        help="With --processes: policy directory (default: the default tiny model, random init).")] = None,
    device: Annotated[str, typer.Option(help="Device, as model.device: auto, cpu, cuda, cuda:N.")] = "auto",
    compile: Annotated[bool, typer.Option(help="Compile smd's decoding step (rollout.compile).")] = False,
    model: Annotated[Path | None, typer.Option(
        help="A model directory (e.g. from `smdctl convert-model`): transformers `generate`, smd dense, smd SnapKV "
             "and vLLM's CPU build at 256, 1k and 2k prompt tokens (--lengths to change), then the largest batch "
             "per engine under one KV-cache byte budget and its tokens/s.")] = None,
    engines: Annotated[str | None, typer.Option(
        help="With --model: comma-separated engines (default generate,dense,snapkv,vllm; with --group-size "
             "smd-snapkv-shared,smd-snapkv-shared-icdf,smd-snapkv-per-sample,smd-dense-shared,vllm-prefix-cache,"
             "vllm-no-prefix-cache; each may end in @B to decode B sequences together instead of --batch-size, "
             "e.g. smd-snapkv-shared@64).")] = None,
    budget_sequences: Annotated[int, typer.Option(
        min=1, help="With --model: the KV-cache budget is the dense cache of this many sequences of 1024 prompt "
                    "tokens plus the new tokens.")] = 4,
    profile: Annotated[bool, typer.Option(
        "--profile/--no-profile",
        help="With --model and --group-size: after the timed runs, each engine once more under torch.profiler "
             "(vLLM in this process): its top operators by self CPU time.")] = False,
    long: Annotated[bool, typer.Option(
        "--long/--no-long",
        help="With --model: the long-context table (stages/bench/rollout_long.py): per case (--cases) smd dense, "
             "smd SnapKV every step and at --interval, transformers generate and vLLM, each run in its own "
             "process, at --batch-size (default 8): tokens/s and the measured peak memory per sequence; with "
             "--budget-mib, the largest batch each engine runs within that budget, found by running it.")] = False,
    cases: Annotated[str | None, typer.Option(
        help="With --long: PROMPTxNEW cases, comma-separated (default 2048x512,4096x1024,6144x2048,1024x4096).")
    ] = None,
    interval: Annotated[int, typer.Option(
        min=1, help="With --long: rollout.eviction.interval of the smd-snapkv-k engine.")] = 64,
    prefill_chunk_tokens: Annotated[int, typer.Option(
        min=0, help="With --long: rollout.prefill_chunk_tokens of the smd engines (0 = one forward).")] = 2048,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads per process (--processes, --long).")] = 1,
    budget_mib: Annotated[float | None, typer.Option(
        min=1, help="With --long: the memory budget (MiB beyond the model) of the largest-batch search.")] = None,
    budget_case: Annotated[str | None, typer.Option(
        help="With --long and --budget-mib: the PROMPTxNEW case of the search (default: the first case).")] = None,
    max_batch: Annotated[int, typer.Option(
        min=1, help="With --long and --budget-mib: the largest batch the search tries (each probe is a whole "
                    "run of the case: a cap bounds the search's time).")] = 256,
) -> None:
    """transformers `generate` (the anchor) vs smd's engine, dense and every eviction policy: tokens/s, KV-cache
    bytes and peak memory side by side. With --processes: the rollout stage on 1, 2, ... processes, tokens/s and
    wall time side by side. With --model: a real model against vLLM (see --model); with --model and --group-size,
    the GRPO workload (see --group-size)."""
    def parse_lengths() -> list[int] | None:
        if lengths == "default,2048,4096":  # the option's default: the real model's own lengths
            return None
        if not all(x.strip().isdigit() for x in lengths.split(",") if x.strip()):
            raise SmdInputError(f"--lengths: {lengths!r}: with --model, prompt lengths only")
        return [int(x) for x in lengths.split(",") if x.strip()]

    engine_list = [x.strip() for x in engines.split(",") if x.strip()] if engines else None
    if model is not None and long:
        from stages.bench.rollout_long import bench_rollout_long, parse_cases

        guarded(lambda: bench_rollout_long(
            model, parse_cases(cases), batch_size or 8, keep_ratio, interval, prefill_chunk_tokens, engine_list,
            threads, budget_mib, parse_cases(budget_case)[0] if budget_case else None, device,
            max_batch=max_batch, group_size=group_size or 1))
        return
    if model is not None and group_size is not None:
        from stages.bench.rollout import bench_rollout_groups

        guarded(lambda: bench_rollout_groups(model, group_size, parse_lengths(), prompts or 16, keep_ratio,
                                             new_tokens or 16, batch_size or 16, repeats or 2, engine_list,
                                             profile=profile))
        return
    if model is not None:
        from stages.bench.rollout import bench_rollout_model

        guarded(lambda: bench_rollout_model(
            model, parse_lengths(), keep_ratio, new_tokens or 32, repeats or 2, engine_list,
            budget_sequences=budget_sequences, batch_size=batch_size))
        return
    if processes:
        from stages.bench.rollout_scale import bench_rollout_processes

        guarded(lambda: bench_rollout_processes([int(x) for x in processes.split(",") if x], threads, policy,
                                                prompts or 32, group_size or 8, prompt_tokens, new_tokens or 16,
                                                batch_size or 16, repeats or 2))
        return
    from stages.bench.rollout import bench_rollout

    guarded(lambda: bench_rollout([x.strip() for x in lengths.split(",") if x.strip()], keep_ratio, batch_size or 4,
                                  new_tokens or 128, repeats or 3, device=device, compile=compile))


@bench_app.command("engine")
def bench_engine_cmd(
    policy: Annotated[Path | None, typer.Option(help="Policy directory (default: the default tiny model, random init).")] = None,
    prompts: Annotated[Path | None, typer.Option(help="Prompts table, e.g. artifacts/data/eval.arrow (default: random).")] = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="Eval prompts.")] = 128,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens per random prompt.")] = 110,
    rollout_prompts: Annotated[int, typer.Option(min=1, help="Prompts of the rollout batch.")] = 64,
    group_size: Annotated[int, typer.Option(min=1, help="Samples per rollout prompt.")] = 8,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per sequence.")] = 16,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = 16,
    temperature: Annotated[float, typer.Option(help="Rollout sampling temperature.")] = 1.0,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per measurement; the fastest counts.")] = 2,
) -> None:
    """smd's engine vs vLLM for dense generation: start-up, rollout and eval tokens/s side by side (needs vLLM)."""
    from stages.bench.rollout_engines import bench_engines

    guarded(lambda: bench_engines(policy, prompts, num_prompts, prompt_tokens, rollout_prompts, group_size, new_tokens,
                                  batch_size, temperature, repeats))


@bench_app.command("learner")
def bench_learner_cmd(
    shape: Annotated[str | None, typer.Option(
        help="Model shape: tiny (the default model; the default shape), qwen3-vocab (Qwen3's 151,936-token "
             "vocabulary and 16 q / 8 kv heads on a small body), qwen3-0.6b-4l (Qwen3-0.6B's layers, heads and "
             "vocabulary, 4 of its 28 layers; the default with --sequence-parallel), qwen3-0.6b-8l (the same, 8 "
             "layers) or qwen3-1.7b (Qwen3-1.7B's "
             "config: a GPU shape).")] = None,
    lengths: Annotated[str | None, typer.Option(help="Comma-separated sequence lengths T (default: the shape's: "
                                                     "tiny 512,2048,4096; qwen3-vocab 1024,4096; with "
                                                     "--sequence-parallel 8192).")] = None,
    modes: Annotated[str | None, typer.Option(help="Comma-separated learners: dense,smd_flex,smd_sdpa,smd_gather,"
                                                   "fwd_bwd,dense_full,smd_flex_full (default: the shape's).")] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved timing rounds (median per learner).")] = 3,
    block_size: Annotated[int, typer.Option(help="FlexAttention / gather block size.")] = 128,
    chunk_tokens: Annotated[int | None, typer.Option(help="lm-head chunk (default learner.logit_chunk_tokens).")] = None,
    threads: Annotated[int, typer.Option(help="torch threads per configuration (0 = torch's default).")] = 1,
    device: Annotated[str, typer.Option(help="model.device's rule: auto (the GPU when CUDA is available), cpu, "
                                             "cuda, cuda:N.")] = "auto",
    dtype: Annotated[str, typer.Option(help="On a GPU: float32 or bfloat16.")] = "float32",
    model: Annotated[Path | None, typer.Option(
        help="A model directory (e.g. from `smdctl convert-model`) instead of --shape: its weights and config "
             "(default lengths 256,1024; learners dense, smd tiled, smd sdpa).")] = None,
    group_size: Annotated[int | None, typer.Option(
        min=1, help="With --model: the learner stage on GRPO's workload (--prompts x G samples), shared prompts "
                    "against per-sample, smd and dense: step time and itemized memory (stages/bench/learner_grpo.py).")] = None,
    prompts: Annotated[int, typer.Option(min=1, help="With --group-size: prompts per iteration.")] = 16,
    prompt_tokens: Annotated[int, typer.Option(min=2, help="With --group-size: prompt length (the SmolLM2 spec's "
                                                           "~141).")] = 141,
    response_tokens: Annotated[int, typer.Option(min=1, help="With --group-size: longest response.")] = 16,
    min_response_tokens: Annotated[int | None, typer.Option(
        min=1, help="With --group-size: shortest response (default half the longest; a quarter: the 4x spread of "
                    "the packed arm's target).")] = None,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="With --group-size: learner.micro_batch_size.")] = 8,
    shared_micro_batch_size: Annotated[int | None, typer.Option(
        min=1, help="With --group-size: the shared arms also at this learner.micro_batch_size (several groups a "
                    "micro-batch: their prompts in one call), rows labelled 'mb N'.")] = None,
    arms: Annotated[str | None, typer.Option(
        help="With --group-size: comma-separated arms (smd shared, smd token budget, smd per-sample, smd packed, "
             "dense shared, dense per-sample, '... mb N'; default all).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="With --group-size: runs per arm (the fastest counts).")] = 2,
    cores: Annotated[str | None, typer.Option(help="With --group-size or --sequence-parallel: the core list of "
                                                   "every arm / process (taskset's, e.g. 1 or 0,1).")] = None,
    lora_rank: Annotated[int | None, typer.Option(
        min=1, help="LoRA of this rank (learner.lora) against full fine-tuning: one smd learner step each, step time "
                    "and memory itemized (weights, AdamW state, working memory, peak); target peak <= 0.5x.")] = None,
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="With --lora-rank: both learners with every decoder layer checkpointed (learner.gradient_checkpointing); "
             "rows labelled +ckpt. With --sequence-parallel: both runs checkpointed.")] = False,
    profile: Annotated[bool, typer.Option(
        "--profile/--no-profile",
        help="With --group-size: after the timed runs, each arm once more under torch.profiler: its phases "
             "(parity pass, forward, lm head, backward, optimizer) and top operators by self CPU time.")] = False,
    memory: Annotated[bool, typer.Option(
        "--memory/--no-memory",
        help="With --group-size: after the timed runs, each arm's resumed learn call (AdamW's moments loaded, as "
             "a chain's from iteration 2) itemized: torch's allocation at its peak by torch.profiler's memory "
             "category (weights, optimizer state, gradients, activations, temporaries) beside the resident set.")] = False,
    sequence_parallel: Annotated[int | None, typer.Option(
        min=2, help="Sequence parallelism (learner.sequence_parallel, DeepSpeed-Ulysses): one learner micro-step (smd "
                    "with its dense teacher, forward + backward) on 1 process and on N processes (gloo on the CPU, "
                    "one GPU each on CUDA), each process's peak working memory, x one process's, step seconds and "
                    "the loss difference (stages/bench/learner_sp.py; target peak <= 0.6x at T = 8k). --shape "
                    "default qwen3-0.6b-4l (its KV heads must divide by N), --lengths default 8192.")] = None,
    backend: Annotated[str | None, typer.Option(
        help="With --sequence-parallel or --group-size: learner.attention_backend of every run: tiled (query tiles "
             "through the CPU flash kernel: the long-context CPU path; --sequence-parallel's default), sdpa (an "
             "explicit [B, H, T, T] mask per layer; --group-size's default) or flex.")] = None,
    rows: Annotated[int, typer.Option(min=1, help="With --sequence-parallel: rows of the micro-batch (row b "
                                                  "T - bT/8 tokens).")] = 1,
) -> None:
    """smd (FlexAttention) vs dense learner step: time and peak memory side by side, plus physical KV slicing."""
    if gradient_checkpointing and (lora_rank is None and sequence_parallel is None or group_size is not None):
        def refuse() -> None:
            raise SmdInputError("--gradient-checkpointing: only with --lora-rank or --sequence-parallel (not "
                                "--group-size)")

        guarded(refuse)
        return
    if sequence_parallel is not None:  # one sequence across processes (issue 55)
        from stages.bench.learner_sp import bench_learner_sequence_parallel

        lens = [int(x) for x in lengths.split(",") if x.strip()] if lengths else None
        guarded(lambda: bench_learner_sequence_parallel(
            sequence_parallel, str(model.resolve()) if model is not None else shape, lens, backend=backend or "tiled",
            rows=rows, threads=threads, cores=cores, device=device, dtype=dtype, chunk_tokens=chunk_tokens,
            gradient_checkpointing=gradient_checkpointing))
        return
    if group_size is not None:
        def grpo() -> None:
            if model is None:
                raise SmdInputError("--group-size: needs --model (a model directory)")
            from stages.bench.learner_grpo import bench_learner_grpo

            chosen = [a.strip() for a in arms.split(",")] if arms else None
            bench_learner_grpo(model, group_size, prompts, prompt_tokens, response_tokens, micro_batch_size, repeats,
                               threads, cores, arms=chosen, profile=profile,
                               shared_micro_batch_size=shared_micro_batch_size, memory=memory,
                               min_response_tokens=min_response_tokens, backend=backend or "sdpa")

        guarded(grpo)
        return
    shape = str(model.resolve()) if model is not None else shape or "tiny"
    if lora_rank is not None:  # LoRA vs full fine-tuning (issue 43)
        from stages.bench.learner import run_lora_bench

        lens = [int(x) for x in lengths.split(",") if x.strip()] if lengths else None
        guarded(lambda: run_lora_bench(shape, lora_rank, lens, rounds=rounds, block_size=block_size, threads=threads,
                                       chunk_tokens=chunk_tokens, device=device, dtype=dtype,
                                       gradient_checkpointing=gradient_checkpointing))
        return
    from stages.bench.learner import run_learner_bench

    def split(text: str | None) -> list[str] | None:
        return [x.strip() for x in text.split(",") if x.strip()] if text else None

    guarded(lambda: run_learner_bench([int(x) for x in split(lengths) or []] or None, split(modes), rounds=rounds,
                                      block_size=block_size, threads=threads, shape=shape, chunk_tokens=chunk_tokens,
                                      device=device, dtype=dtype))


@bench_app.command("reward")
def bench_reward_cmd(
    workers: Annotated[str, typer.Option(help="Comma-separated reward.workers to compare (0 = in the stage's process).")] = "0,2",
    sleep_ms: Annotated[float, typer.Option(min=0, help="What the reward function sleeps per sample.")] = 5.0,
    policy: Annotated[Path | None, typer.Option(help="Policy directory (default: the default tiny model, random init).")] = None,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts of the rollout.")] = 32,
    group_size: Annotated[int, typer.Option(min=1, help="Samples per prompt.")] = 8,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens per random prompt.")] = 100,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per sequence.")] = 16,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved runs per configuration; the fastest counts.")] = 2,
) -> None:
    """Rollout tokens/s with a slow reward function in the stage's process vs a reward pool (reward.workers)."""
    from stages.bench.reward import bench_reward

    guarded(lambda: bench_reward([int(x) for x in workers.split(",") if x.strip()], sleep_ms, policy, prompts,
                                 group_size, prompt_tokens, new_tokens, batch_size, repeats))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
