"""pytest set-up shared by every test module (their shared helpers are in tests/helpers.py).

DeepSpeed picks its accelerator when first imported: without CUDA the suite runs it on the CPU (gloo), as
`.ci/run` asks, also when pytest is started from a plain shell.

torch.compile's on-disk caches (TORCHINDUCTOR_CACHE_DIR, by default shared by every process of the machine) are
keyed to the CPU vector ISA for the whole suite, not only where smd compiles FlexAttention: an entry compiled
under another `ATEN_CPU_CAPABILITY` (a kernel x thread matrix run, an older checkout) otherwise comes back on a
cache hit with the other ISA's vector width and computes wrong results (stages/common/compile_cache.py).
"""

from __future__ import annotations

import os

import torch

from stages.common.compile_cache import key_compile_caches_to_cpu_isa

key_compile_caches_to_cpu_isa()

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
