"""The floors a rollout bench prints beside each engine (docs/design.md §4b): the KV cache it holds, for memory,
and the bytes a decoding step must read at the device's memory bandwidth, for speed.

A decoding step reads every weight and the whole cache it attends over at least once, so no engine decodes a step
faster than (weights + KV read) / bandwidth: the memory-bound (roofline) floor of LLM decoding. On a GPU the
bandwidth is the data sheet's peak (`HBM_BANDWIDTH`); on the CPU it is measured here, a read of a buffer larger
than the caches on the bench's threads (`measured_read_bandwidth`), since a core's share of a socket's bandwidth
is on no data sheet. Where the engine runs far below its floor, it is bound by compute or overheads, not by the
bytes its cache makes it read.
"""

from __future__ import annotations

import time

# Peak memory bandwidth, bytes/s, by the device's name (the vendors' data sheets: H200 4.8 TB/s, H100 SXM
# 3.35 TB/s, H100 PCIe 2.0 TB/s, A100 80GB SXM 2.039 TB/s); another GPU has no floor (nan)
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12))


def hbm_bandwidth(device) -> float:
    """The GPU's peak memory bandwidth in bytes/s (`HBM_BANDWIDTH`), nan where unknown (and on the CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_BANDWIDTH if key in name), float("nan"))


def measured_read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """The CPU's read bandwidth in bytes/s on this process's threads: the best of `repeats` sums over a float32
    buffer of `mib` MiB (larger than the last-level cache, so every byte comes from memory)."""
    import torch

    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def decode_floor_tokens_per_s(batch: int, weight_bytes: float, kv_read_bytes: float, bandwidth: float) -> float:
    """The most tokens/s a decoding step of `batch` sequences can make when it reads `weight_bytes` plus
    `kv_read_bytes` once at `bandwidth` bytes/s: batch / ((weights + KV) / bandwidth)."""
    return batch * bandwidth / (weight_bytes + kv_read_bytes)


def dense_kv_read_bytes(per_token: int, batch: int, prompt: int, new: int) -> float:
    """The KV bytes a dense engine's decoding step reads on average, each sequence its own cache: the steps after
    the prefill feed tokens 1..new - 1, step j attending over prompt + j keys, so batch x (prompt + new / 2) x per
    token (the prompt alone when no step follows the prefill)."""
    return per_token * batch * (prompt + new / 2 if new > 1 else prompt)
