"""`smd_sdpa_gqa`: the learner's dense attention (the dense learner, smd's teacher, the reference policy).

transformers' SDPA attention (`sdpa_attention_forward`) copies each KV head to its query heads (`repeat_kv`)
whenever a mask is passed (`use_gqa_in_sdpa`: on CUDA the fused kernels take `enable_gqa` only without a mask).
A forward that continues a cached prompt (the learner's shared prompts, issue 40) always has a mask: its
queries start after the prompt, so the causal pattern is not SDPA's top-left `is_causal`. On the CPU, PyTorch's
flash kernel takes the boolean mask and `enable_gqa` together, so the copies are pure overhead: at 8 rows x 512
queries over 2,560 keys, 9 query heads over 3 KV heads, the grouped call measured ~1.2x faster forward and
backward on one core. This function is transformers' SDPA attention with that one difference on the CPU (the
same mask from transformers' `sdpa_mask`, the same kernel, the same result within float rounding); elsewhere
it is transformers' function itself. It makes the dense anchor of `smdctl bench learner` fair against smd's
tiled backend, which uses the kernel's GQA too (issue 55).
"""

from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SDPA_GQA_ATTENTION = "smd_sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' `sdpa_attention_forward`; on the CPU with a mask and grouped KV heads, one SDPA call with
    `enable_gqa` instead of repeated heads. Returns transformers' (output [B, T, Hq, D], None)."""
    groups = query.shape[1] // key.shape[1]
    if query.device.type != "cpu" or attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_GQA_ATTENTION, sdpa_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA_ATTENTION, sdpa_mask)


def use_sdpa_gqa(*models) -> None:
    """Make `smd_sdpa_gqa` the attention of each model (None skipped) that runs transformers' SDPA."""
    for model in models:
        if model is not None and model.config._attn_implementation == "sdpa":
            model.config._attn_implementation = SDPA_GQA_ATTENTION
