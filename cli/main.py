"""The `smdctl` Typer app. Each command lives in its own module and only parses and calls a stage."""

from __future__ import annotations

import importlib
import os

import typer

app = typer.Typer(
    name="smdctl",
    help="Shadow Mask Distillation: on-policy RL post-training under a compressed KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def main(
    local_rank: int | None = typer.Option(None, "--local_rank", "--local-rank", hidden=True,
                                          help="Set by the `deepspeed` launcher; exported as LOCAL_RANK."),
) -> None:
    """smdctl: run one pipeline stage; parameters come from params.yaml (override with -S key=value)."""
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))


# One module per command (or command group); each exposes register(app).
COMMAND_MODULES = [
    "cli.init_model",
    "cli.convert_model",
    "cli.merge_lora",
    "cli.prepare",
    "cli.warmstart",
    "cli.rollout",
    "cli.evaluate",
    "cli.report",
    "cli.compact",
    "cli.learn",
    "cli.inspect",
    "cli.bench",
    "cli.progress",
    "cli.headline",
    "cli.params_cmd",
    "cli.iterations",
    "cli.chain",
    "cli.launch",
    "cli.compare",
    "cli.probe_kl",
    "cli.seed_stats",
    "cli.reward_files",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


if __name__ == "__main__":
    app()
