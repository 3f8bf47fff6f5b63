"""`smdctl init-model`: build the tiny default policy from params (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load


def register(app: typer.Typer) -> None:
    @app.command("init-model")
    def init_model(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        out: Annotated[
            Path | None,
            typer.Option(help="Output directory (default: model.init_path); never a directory smd did not create."),
        ] = None,
    ) -> None:
        """Build the tiny Qwen3-architecture default model and its tokenizer (model.tiny.tokenizer: word-level,
        or byte-level BPE with Qwen's special tokens and ChatML chat template).

        When model.init_path is a model directory smd did not create (your Hugging Face model), nothing is
        built and the directory is left untouched; its name is recorded in artifacts/model/init/source.json.
        A directory smd did not create is never replaced.
        """
        from stages.common.model import init_model as run_init_model

        p = load(params, overrides, scores=False)  # never scores: no reward.function needed
        echo_written(guarded(lambda: run_init_model(p.model, seed=p.seed, out=out)))
