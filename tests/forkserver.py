"""A fork server for the crash-safety tests: `smdctl` stage commands in fresh processes without paying the imports.

Started once (`python -m tests.forkserver`), it imports the CLI and every stage module, then serves one JSON
request per stdin line: fork, run `smdctl <argv>` in the child (cwd, stdout/stderr to a log file), and answer
one JSON line when the child is gone: its exit code (negative: the signal that ended it) and wall time. A
request may ask for the child to be killed with SIGKILL after `kill_after` seconds, or as soon as an entry
matching `kill_on` (a regex) appears in one of the `watch` directories (the stage's atomic temporaries). The
server kills through a pidfd of its own unreaped child, so the signal can never reach a recycled pid.

A forked child is a fresh process for everything the stage writes (it inherits only the imported modules), so
a kill lands inside the stage's own work, not in Python's start-up.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import sys
import time
from pathlib import Path


def _preload() -> None:
    # DeepSpeed JIT-builds (or loads) its CPU shared-memory op in every process that initializes the learner
    # engine; loaded once here, the children reuse it from DeepSpeed's op cache.
    from deepspeed.comm.torch import build_shm_op

    import cli.main  # noqa: F401 - every command module
    import stages.common.model  # noqa: F401
    import stages.compaction  # noqa: F401
    import stages.evaluate.stage  # noqa: F401
    import stages.learner.train  # noqa: F401
    import stages.prepare  # noqa: F401
    import stages.progress.stage  # noqa: F401
    import stages.rollout.stage  # noqa: F401
    import stages.warmstart  # noqa: F401

    build_shm_op()


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 1
    try:
        from cli.main import app

        app(args=request["argv"], prog_name="smdctl", standalone_mode=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a traceback in the log, exit 1 (what the real process would do)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _temporary_seen(pattern: re.Pattern, watch: list[str]) -> bool:
    for directory in watch:
        try:
            with os.scandir(directory) as entries:
                if any(pattern.match(e.name) for e in entries):
                    return True
        except OSError:
            continue
    return False


def _serve(request: dict) -> dict:
    sys.stdout.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request)
    pidfd = os.pidfd_open(pid)
    killed_at = None
    try:
        if request.get("kill_on"):
            pattern = re.compile(request["kill_on"])
            deadline = t0 + float(request.get("timeout", 300))
            while time.monotonic() < deadline:
                if select.select([pidfd], [], [], 0.001)[0]:
                    break  # exited before any temporary was seen
                if _temporary_seen(pattern, request.get("watch", [])):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed_at = time.monotonic() - t0
                    break
        elif request.get("kill_after") is not None:
            if not select.select([pidfd], [], [], float(request["kill_after"]))[0]:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed_at = time.monotonic() - t0
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return {"code": code, "seconds": time.monotonic() - t0, "killed_at": killed_at}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")  # the protocol; anything else printed goes to stderr
    os.dup2(2, 1)
    _preload()
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_serve(json.loads(line))), file=answers, flush=True)


def private_extensions_dir(path: str | None = None) -> str:
    """A JIT-op build directory (DeepSpeed's CPU ops) of this interpreter and of the `ninja` on `path` (default:
    PATH): a directory shared with another installation or another ninja (ninja 1.13 hashes commands differently
    from its predecessors) is rebuilt, for minutes, at every switch."""
    import hashlib
    import shutil

    key = hashlib.sha1(f"{sys.prefix}:{shutil.which('ninja', path=path)}".encode()).hexdigest()[:8]
    return str(Path.home() / ".cache" / "torch_extensions" / f"smd-{key}")


class ForkServer:
    """The test side: start the server, run stage commands through it, stop it."""

    def __init__(self, env: dict[str, str]):
        import subprocess

        env = {"TORCH_EXTENSIONS_DIR": private_extensions_dir(env.get("PATH")), **env}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=Path(__file__).resolve().parents[1])
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("fork server did not start")

    def run(self, cwd: Path, argv: list[str], log: Path, **kill: object) -> dict:
        self.proc.stdin.write(json.dumps({"cwd": str(cwd), "argv": argv, "log": str(log), **kill}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError("fork server died")
        return json.loads(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    main()
