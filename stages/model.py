"""Policy loading and the tiny default model, importable by every stage.

The tiny default is a Qwen3-architecture causal LM built from a config (nothing can be downloaded
here) with a word-level tokenizer built with `tokenizers`. Any Hugging Face causal-LM directory works
in its place through `model.init_path`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.params.model import TinyModelParams
from stages.vocab import tiny_vocabulary

hf_logging.disable_progress_bar()  # stage logs stay readable; stages print their own progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: lowercase, split on whitespace and punctuation, one token per digit."""
    vocab = {tok: i for i, tok in enumerate(tiny_vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(shape: TinyModelParams, vocab_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def init_tiny_model(shape: TinyModelParams, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model and its tokenizer and save both as one Hugging Face directory (atomically)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(shape, vocab_size=len(tokenizer), seed=seed)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    path = Path(path)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise SmdInputError(f"{path}: no tokenizer found (tokenizer.json); run `smdctl init-model` or fix model.init_path")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Load a causal LM from a Hugging Face directory; one clear line if it is missing or unloadable."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise SmdInputError(f"{path}: no policy checkpoint (config.json missing)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad artifact
        raise SmdInputError(f"{path}: cannot load policy checkpoint ({exc.__class__.__name__}: {str(exc)[:120]})") from exc
    model.eval()
    return model


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator:
    """Run the model's forward passes with the attention function registered as `name` (restored on exit)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield model
    finally:
        model.config._attn_implementation = previous


def check_positions(model, tokens: int, what: str) -> None:
    """One line (SmdInputError) when a sequence of `tokens` tokens does not fit the model's positions.

    `what` describes the sequence and leads the message: "<what> exceeds the model's N positions".
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise SmdInputError(f"{what} exceeds the model's {limit} positions")
