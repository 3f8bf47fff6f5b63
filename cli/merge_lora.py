"""`smdctl merge-lora POLICY --out DIR`: a LoRA policy checkpoint (`learner.lora`) -> a plain Hugging Face model
directory with the merged weights W + (alpha / r) B A (stages/common/lora.py, `write_merged_policy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded


def register(app: typer.Typer) -> None:
    @app.command("merge-lora")
    def merge_lora(
        policy: Annotated[Path, typer.Argument(
            help="A LoRA policy checkpoint written by `smdctl learn` with learner.lora (e.g. "
                 "artifacts/iter-006/policy): PEFT's adapter plus the record of its base.")],
        out: Annotated[Path, typer.Option(
            help="Output directory (written atomically; never a directory smd did not create).")],
        dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16 or float16.")] = "float32",
    ) -> None:
        """Write the merged weights (base + adapter, PEFT's merge_and_unload) as a plain model directory that
        `from_pretrained`, vLLM and `-S model.init_path=DIR` read; the base must be the one the adapter was
        trained on (its weights digest is checked)."""
        from stages.common.lora import write_merged_policy

        echo_written(guarded(lambda: write_merged_policy(policy, out, dtype=dtype)))
