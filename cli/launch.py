"""`smdctl launch CMD ...`: run `smdctl CMD ...` on `pipeline.processes` processes (per node) through the
`deepspeed` launcher, on the nodes of `pipeline.hostfile` when set; in this process when 1 and no hostfile.

dvc.yaml's rollout, learn and evaluate stages run through it, so the same `dvc repro` runs one process or
many. The command's own `--params` / `--set` options go to launch, which reads the two keys and hands them on.
With a hostfile, every node must answer ssh within `SSH_CHECK_TIMEOUT_S` before anything starts (`check_nodes`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, guarded, load
from schemas.errors import SmdInputError


def _tool(name: str) -> str:
    """The executable beside this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long each node of a hostfile gets to answer ssh before the launch is refused.
SSH_CHECK_TIMEOUT_S = 10


def check_hostfile(params: Path, hostfile: str | None) -> None:
    """A hostfile that is set must exist: the launcher would otherwise run on this machine alone, silently."""
    if hostfile and not Path(hostfile).is_file():
        raise SmdInputError(f"{params}: pipeline.hostfile: {hostfile} is not a file")


def hostfile_nodes(params: Path, hostfile: str) -> list[str]:
    """The node names of an MPI-style hostfile (`name slots=N` lines; blank lines and `#` comments skipped),
    in order; a line of another form is one line of error (DeepSpeed would raise a traceback)."""
    nodes = []
    for number, line in enumerate(Path(hostfile).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots=") or not fields[1][6:].isdigit():
            raise SmdInputError(f"{params}: pipeline.hostfile: {hostfile} line {number}: expected 'name slots=N'")
        nodes.append(fields[0])
    if not nodes:
        raise SmdInputError(f"{params}: pipeline.hostfile: {hostfile} names no node")
    return nodes


def check_nodes(params: Path, hostfile: str, ssh: str, timeout_s: float = SSH_CHECK_TIMEOUT_S) -> None:
    """Every node of the hostfile answers `ssh NODE true` (batch mode: no password prompt) within timeout_s, all
    checked at once; otherwise one line naming each node that did not and why, before any process starts. The
    launcher checks only the first node, and pdsh would start the others, whose ranks then wait for the missing
    one until torch's process-group timeout (30 min)."""
    nodes = hostfile_nodes(params, hostfile)
    checks = {node: subprocess.Popen([ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout_s)}", node,
                                      "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for node in dict.fromkeys(nodes)}
    deadline = time.monotonic() + timeout_s + 2  # ConnectTimeout bounds the connection; this bounds the rest
    failed = []
    for node, check in checks.items():
        try:
            _, err = check.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            check.kill()
            check.wait()
            failed.append(f"{node} (no answer within {timeout_s:g} s)")
            continue
        if check.returncode != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            failed.append(f"{node} ({lines[-1].strip() if lines else f'ssh exit code {check.returncode}'})")
    if failed:
        raise SmdInputError(f"{params}: pipeline.hostfile: {hostfile}: not reachable over ssh within "
                            f"{timeout_s:g} s: {'; '.join(failed)}")


def launcher_argv(processes: int, hostfile: str | None, command: list[str], smdctl: str, deepspeed: str,
                  master_port: int | None, master_addr: str | None = None) -> list[str]:
    """The command line that runs `smdctl <command>`: smdctl itself for one process on this machine, else the
    deepspeed launcher with `processes` processes per node (`--num_gpus`; CPU processes on a machine without
    GPUs), the hostfile's nodes when given, and `--no_local_rank` (the processes read LOCAL_RANK from the
    environment). `master_addr`, with a hostfile: the first node's address the processes meet at (else the
    launcher takes the first word of `hostname -I` there)."""
    if processes == 1 and not hostfile:
        return [smdctl, *command]
    argv = [deepspeed]
    if hostfile:
        argv += ["--hostfile", hostfile]
        if master_addr:
            argv += ["--master_addr", master_addr]
    argv += ["--num_gpus", str(processes)]
    if master_port is not None:
        argv += ["--master_port", str(master_port)]
    return [*argv, "--no_local_rank", smdctl, *command]


def register(app: typer.Typer) -> None:
    @app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch_cmd(
        ctx: typer.Context,
        command: Annotated[str, typer.Argument(help="The smdctl command to run (rollout, learn, evaluate, ...).")],
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
    ) -> None:
        """Run `smdctl COMMAND ARGS...` on pipeline.processes processes (per node; the nodes of pipeline.hostfile
        when set) through the deepspeed launcher; in this process when 1 and no hostfile."""
        p = load(params, overrides)
        guarded(lambda: check_hostfile(params, p.pipeline.hostfile))
        if p.pipeline.hostfile:
            guarded(lambda: check_nodes(params, p.pipeline.hostfile, shutil.which("ssh") or "ssh"))
        forwarded = [command, *ctx.args, "--params", str(params)]
        for item in overrides or []:
            forwarded += ["--set", item]
        # One node: a free local port, so that concurrent runs on one machine do not collide (MASTER_PORT
        # overrides). Several nodes: the port must be free on the first host; MASTER_PORT or the launcher's 29500.
        port = os.environ.get("MASTER_PORT")
        master_port = int(port) if port else (None if p.pipeline.hostfile else _free_port())
        smdctl = _tool("smdctl")
        # MASTER_ADDR names the first node's address where it has several (the launcher's guess may be wrong).
        argv = launcher_argv(p.pipeline.processes, p.pipeline.hostfile, forwarded, smdctl, _tool("deepspeed"),
                             master_port, os.environ.get("MASTER_ADDR"))
        env = dict(os.environ)
        if argv[0] != smdctl and "DS_ACCELERATOR" not in env:
            # the launcher's accelerator follows model.device (CPU processes, gloo, without CUDA or with cpu)
            from stages.common.model import resolve_device

            device = guarded(lambda: resolve_device(p.model.device, 0))
            env["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(argv[0], argv, env)
