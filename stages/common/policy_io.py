"""Plain Hugging Face policy directories: dtypes, device placement, loading weights and tokenizer.

The lowest layer of policy loading, importing no other stage module: `stages.common.model` (the tiny model,
devices, `load_policy`, which routes LoRA checkpoints) and `stages.common.lora` (LoRA checkpoints, whose base is a
plain directory) both build on it, so neither imports the other's loader (issue 56). Concept:
docs/concepts/invariant.md (why a float32 model on CUDA runs with TF32 off).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from schemas.errors import SmdInputError
from schemas.weights import verify_weights_digest

hf_logging.disable_progress_bar()  # stage logs stay readable; stages print their own progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    path = Path(path)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise SmdInputError(f"{path}: no tokenizer found (tokenizer.json); run `smdctl init-model` or fix model.init_path")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any loader failure (JSON, tokenizers, missing files) is a bad artifact
        raise SmdInputError(f"{path}: cannot load the tokenizer ({exc.__class__.__name__}: {str(exc)[:120]})") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def configure_precision(device: torch.device | str, dtype: torch.dtype) -> None:
    """TF32 off for a float32 model on CUDA: the parity invariant (rollout log-probs = learner log-probs within
    1e-5) is float32's, and TF32 matmuls (10-bit mantissa) would break it. Process-wide torch flags (cuBLAS and
    cuDNN; inductor's FlexAttention kernels read the matmul flag too); nothing changes on the CPU or for bf16."""
    if torch.device(device).type != "cuda" or dtype != torch.float32:
        return
    with warnings.catch_warnings():  # torch >= 2.9 announces a newer API; the legacy flags work on 2.11-2.14
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def place_model(model, device: torch.device | str):
    """Move `model` to `device` (a `resolve_device` result) and set the precision flags its dtype needs there."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:  # a bare "cuda" is the current GPU; torch.cuda.set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # kernels, NCCL and CUDA generators default to this process's GPU
    model.to(device)
    configure_precision(device, next(model.parameters()).dtype)
    return model


def load_plain_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                      device: torch.device | str = "cpu"):
    """Load a causal LM from a plain Hugging Face directory (not a LoRA checkpoint) onto `device`, its weights
    digest checked first; one clear line if it is missing or unloadable."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise SmdInputError(f"{path}: no policy checkpoint (config.json missing)")
    verify_weights_digest(path)  # a flipped byte in a weight: one line, before the weights are read
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad artifact
        raise SmdInputError(f"{path}: cannot load policy checkpoint ({exc.__class__.__name__}: {str(exc)[:120]})") from exc
    for name, param in model.named_parameters():  # a damaged weight file can hold NaN/inf: sampling would crash
        if not torch.isfinite(param).all():
            raise SmdInputError(f"{path}: {name}: non-finite weights (damaged checkpoint?)")
    model.eval()
    return place_model(model, device)
