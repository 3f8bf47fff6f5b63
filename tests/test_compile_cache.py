"""torch.compile's on-disk caches keyed to the CPU vector ISA (stages/common/compile_cache.py).

Inductor's FX graph cache key ignores the ISA it generated C++ for (`ATEN_CPU_CAPABILITY`): a FlexAttention
kernel compiled under avx2 and read back under avx512 from the same cache directory gave wrong attention."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stages.common.compile_cache import TAG_PREFIX, cpu_isa, key_compile_caches_to_cpu_isa
from tests.helpers import ROOT, requires_cpu_flex, subprocess_env


def _capabilities() -> list[str]:
    """The `ATEN_CPU_CAPABILITY` values of this CPU with a vector ISA Inductor uses (avx2, avx512)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    isas = [str(isa).split() for isa in valid_vec_isa_list()]
    return [cap for cap in ("avx2", "avx512") if any(cap in names for names in isas)]


@pytest.fixture
def restore_tag():
    before = torch.compiler.config.cache_key_tag
    yield
    torch.compiler.config.cache_key_tag = before


def test_tag_names_the_isa_keeps_other_tags_and_is_idempotent(monkeypatch, restore_tag):
    torch.compiler.config.cache_key_tag = "user-tag"
    tag = key_compile_caches_to_cpu_isa()
    assert tag == torch.compiler.config.cache_key_tag == f"user-tag,{TAG_PREFIX}{cpu_isa().replace(' ', '+')}"
    assert key_compile_caches_to_cpu_isa() == tag  # no second ISA part
    caps = _capabilities()
    if len(caps) < 2:
        pytest.skip("needs a CPU with AVX2 and AVX-512")
    tags = set()
    for cap in caps:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        tags.add(key_compile_caches_to_cpu_isa())
        assert torch.compiler.config.cache_key_tag.startswith("user-tag,")
    assert len(tags) == len(caps)  # each ISA its own cache entries


_FLEX_VS_SDPA = """
import numpy as np, torch, torch.nn.functional as F
from schemas.raw_masks import visibility
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.learner.flex_backend import build_block_masks, flex_shadow_attention
from stages.learner.shadow_attention import pad_evict_at
rng = np.random.default_rng(0)
ev_cfg = eviction_config("snapkv", 0.5, sinks=2, window=4)
rows = [torch.from_numpy(synthetic_evict_at("snapkv", T, 40, 1, 2, ev_cfg, rng).astype(np.int64)) for T in (150, 97)]
ev = pad_evict_at(rows, 150)
torch.manual_seed(0)
q, k, v = torch.randn(2, 4, 150, 16), torch.randn(2, 2, 150, 16), torch.randn(2, 2, 150, 16)
with torch.no_grad():
    out = flex_shadow_attention(q, k, v, ev[0], 0.25, build_block_masks(ev, 4, 16), 0)
ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visibility(ev[0]).repeat_interleave(2, 1), scale=0.25,
                                     enable_gqa=True)
print("ERR", (out - ref).abs().max().item())
"""


@pytest.mark.slow
@requires_cpu_flex
def test_flex_kernels_of_two_isas_in_one_cache_dir_stay_apart(tmp_path):
    """Two processes, one fresh cache directory: the first compiles the CPU FlexAttention kernel under avx2,
    the second runs under avx512. Before the ISA was in the key the second hit the first's entry and rebuilt
    its 8-lane source with AVX-512 flags: max |flex - sdpa| 3.67 (zero rows) instead of ~1e-7."""
    caps = _capabilities()
    if torch.cuda.is_available() or len(caps) < 2:
        pytest.skip("needs the CPU path and a CPU with AVX2 and AVX-512")
    for cap in caps:
        env = {**subprocess_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "ATEN_CPU_CAPABILITY": cap}
        proc = subprocess.run([sys.executable, "-c", _FLEX_VS_SDPA], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        err = float(proc.stdout.split("ERR")[-1])
        assert err <= 1e-5, f"ATEN_CPU_CAPABILITY={cap}: max |flex - sdpa| = {err}"
