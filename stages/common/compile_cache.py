"""torch.compile's on-disk caches keyed to the CPU vector ISA Inductor generates code for (docs/design.md §8).

Inductor's FX graph cache (and the AOT autograd cache built on it) keys an entry on the graph, the inputs'
metadata, the Inductor config, the torch version and, on CPU, the thread count, but not on the vector ISA that
`torch._inductor.cpu_vec_isa.pick_vec_isa()` chose, which follows `ATEN_CPU_CAPABILITY` (and the CPU). The
cached entry holds the generated C++ source, which hard-codes the ISA's vector width (`Vectorized<float>` loads
of 8 lanes for AVX2, 16 for AVX-512); on a hit that source is rebuilt with the current process's ISA flags. So
a kernel generated under `ATEN_CPU_CAPABILITY=avx2` and read back by a process running AVX-512 (the default on
an AVX-512 machine), or the reverse, mixes the two widths: the CPU FlexAttention kernel then computed whole
query rows as zeros (max |flex - sdpa| 3.67, tests/test_shadow_attention_flex.py), silently. Same class of
torch bug as the thread count (pytorch/pytorch#167463, fixed by #185049, whose key now holds
`parallel_num_threads()`) and the SDPA backend (#185449); torch 2.13 has no key part for the ISA.

`key_compile_caches_to_cpu_isa` puts the ISA into `torch.compiler.config.cache_key_tag`, which every
torch.compile cache key includes ("a tag ... in the cache key generation for all torch compile caching"): each
ISA then has its own entries in one cache directory, and entries written before (without the tag) are never
read. Call it before a torch.compile whose graphs may run on the CPU.
"""

from __future__ import annotations

TAG_PREFIX = "smd-cpu-isa="


def cpu_isa() -> str:
    """The vector ISA Inductor compiles CPU kernels for now, e.g. "avx512 avx512_vnni", "avx2", "INVALID_VEC_ISA"
    (under `ATEN_CPU_CAPABILITY=default`); "" where Inductor does not import."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:
        return ""
    return str(pick_vec_isa())


def key_compile_caches_to_cpu_isa() -> str:
    """Add (or update) `smd-cpu-isa=<isa>` in `torch.compiler.config.cache_key_tag`, keeping any other tag the
    user set (comma-separated); returns the tag. Idempotent; re-run it if `ATEN_CPU_CAPABILITY` changes."""
    import torch

    cfg = torch.compiler.config
    part = TAG_PREFIX + cpu_isa().replace(" ", "+")
    kept = [t for t in cfg.cache_key_tag.split(",") if t and not t.startswith(TAG_PREFIX)]
    tag = ",".join([*kept, part])
    if cfg.cache_key_tag != tag:
        cfg.cache_key_tag = tag
    return tag
