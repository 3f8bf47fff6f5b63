"""`model:` section: which policy to start from and the shape of the tiny default model."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# `model.device` values: auto, cpu, cuda, cuda:N (docs/design.md, "Devices"; resolved by stages.common.model.resolve_device).
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_CHOICES = "auto | cpu | cuda | cuda:N"


class TinyModelParams(BaseModel):
    """Shape and tokenizer of the tiny Qwen3-architecture model that `smdctl init-model` builds from a config."""

    model_config = ConfigDict(extra="forbid")
    hidden_size: int = Field(128, ge=8, description="Residual width.")
    num_hidden_layers: int = Field(4, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="KV heads (GQA when smaller than query heads).")
    head_dim: int = Field(32, ge=4, description="Per-head dimension.")
    intermediate_size: int = Field(384, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(8192, ge=64, description="Longest sequence (prompt + response).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    tokenizer: Literal["word", "bpe"] = Field(
        "word",
        description="Tokenizer of the tiny model. `word`: word-level, one token per word of the synthetic tasks' "
        "vocabulary (stages/common/vocab.py), [BOS]/[EOS]/[PAD], no chat template. `bpe`: a byte-level BPE tokenizer "
        "trained with `tokenizers` on a fixed seeded corpus of that vocabulary (the same files every time), with "
        "Qwen's special tokens and ChatML chat template: EOS <|im_end|>, pad <|endoftext|>, no BOS; prepare then "
        "renders prompts through the template (prepare.chat_template).",
    )
    bpe_vocab_size: int = Field(
        512,
        ge=260,
        le=2048,
        description="tokenizer=bpe: vocabulary size, exactly (256 byte tokens, 3 special tokens, the rest BPE "
        "merges); ignored for tokenizer=word.",
    )


class ModelParams(BaseModel):
    """Where the initial policy comes from."""

    model_config = ConfigDict(extra="forbid")
    init_path: str = Field(
        "artifacts/model/init",
        description="Hugging Face model directory of the initial policy. `smdctl init-model` writes the tiny "
        "default here; point it at any causal-LM directory (e.g. Qwen3-4B-Instruct-2507) to use that instead.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Compute dtype.")
    device: str = Field(
        "auto",
        description=f"Where every stage runs the policy ({DEVICE_CHOICES}): warm start, rollout, evaluate, learn, "
        "the reference NLL. auto = the local rank's GPU (cuda:LOCAL_RANK, so each process of the deepspeed launcher "
        "takes its own) when CUDA is available, else the CPU; cuda = cuda:LOCAL_RANK; cuda:N = that GPU; cpu = the "
        "CPU even when a GPU is present. A float32 policy on CUDA runs with TF32 off (the parity invariant is "
        "float32's).",
    )
    tiny: TinyModelParams = TinyModelParams()

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not isinstance(value, str) or not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r} is not a device; expected {DEVICE_CHOICES}")
        return value
