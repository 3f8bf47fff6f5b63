"""`smdctl reward-files`: record the reward functions and their files' digests (dvc.yaml's `reward-files` stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load


def register(app: typer.Typer) -> None:
    @app.command("reward-files")
    def reward_files(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        out: Annotated[Path, typer.Option(help="Where to write the record.")] = Path("artifacts/reward/files.json"),
    ) -> None:
        """Write reward.function, its weights and the sha256 of each reward file. dvc.yaml runs it on every
        `dvc repro`; the record changes only when a reward file or the functions change, and rollout, evaluate
        and the warm start depend on it, so editing a reward file reruns exactly the stages that score."""
        from stages.common.scoring import write_reward_record

        p = load(params, overrides)
        echo_written(guarded(lambda: write_reward_record(p.reward, out)))
