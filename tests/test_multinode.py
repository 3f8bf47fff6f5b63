"""The multi-node recipe, for real: 2 nodes (network namespaces with an sshd each, tests/multinode.py) run the
micro pipeline through its front door, `dvc exp run -S pipeline.hostfile=H -S pipeline.processes=1`, with one
process on each node (the deepspeed launcher over pdsh and ssh, gloo between the namespace addresses).

Checks: rollout, compact, learn and evaluate of 2 iterations across the nodes give the 1-process artifacts
(trajectory table, compacted masks and eval predictions byte for byte, weights within 1e-6), the learner
resumes a 2-node checkpoint on 1 process, and faults across nodes (a remote rank killed mid-stage, a node
unreachable at start, a hostfile entry with no sshd) fail with one line, in bounded time, writing nothing.

The launcher's ssh check and the lost-peer message also have fast unit tests here (no nodes needed).

Needs root (namespaces), openssh-server and pdsh. Not root and not in CI: skipped with the reason; as root or
with SMD_REQUIRE_MULTINODE=1 (.ci/run sets it) a harness that cannot come up fails the tests with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.launch import SSH_CHECK_TIMEOUT_S, check_nodes, hostfile_nodes
from schemas.errors import SmdInputError
from schemas.params import load_params
from stages.common.distributed import DistContext, SmdRankLost, lost_peer
from tests import multinode
from tests.helpers import ROOT, make_project, max_param_diff, params_of

# The e2e micro pipeline with every stage split over both processes: 3 rollout batches of 2 (rank 0 samples
# 0 and 2, rank 1 batch 1), 3 trajectories per learner process, 2 eval batches of 2.
OVER = {"rollout": {"batch_size": 2, "shard_rows": 2}, "evaluate": {"batch_size": 2}}
ITERATIONS = ("001", "002")
BIN = Path(sys.executable).parent
TIMINGS: dict[str, float] = {}  # printed at the end of the module (pytest -s), for the docs
OUTCOMES: dict[str, str] = {}  # each fault's error line, printed with them


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    problem = multinode.setup_problem()
    if problem and os.geteuid() != 0 and os.environ.get("SMD_REQUIRE_MULTINODE") != "1":
        pytest.skip(f"multi-node harness: {problem}")
    if problem:
        pytest.fail(f"multi-node harness cannot run: {problem}")
    start = time.monotonic()
    # What the processes need that the launcher does not forward (docs/design.md §6b): gloo's interface (the
    # nodes' hostnames resolve to nothing), the accelerator, one thread per process (2 cores, shared).
    env_lines = (f"GLOO_SOCKET_IFNAME={multinode.NODE_IFNAME}", "DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1")
    try:
        nodes = multinode.start(tmp_path_factory.mktemp("nodes"), env_lines=env_lines)
    except Exception as exc:  # noqa: BLE001 - the reason is the test's failure
        pytest.fail(f"multi-node harness did not come up: {' '.join(str(exc).split())}")
    TIMINGS["harness up"] = time.monotonic() - start
    yield nodes
    multinode.stop(nodes)
    print("\nmulti-node timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))
    print("".join(f"{fault}: {line}\n" for fault, line in OUTCOMES.items()), end="")


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "DS_ENV_FILE")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DVC_NO_ANALYTICS": "1"}


def run_ok(argv: list[str], cwd: Path, timeout: float = 900) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def on_node1(nodes: multinode.Cluster, proj: Path, command: str) -> list[str]:
    """argv that runs `command` in `proj` on node1, logged in over ssh, with the project's venv and the ssh
    wrapper on PATH and the launcher's environment file: the setup a cluster user's shell has."""
    exports = {"PATH": f"{nodes.bin_dir}:{BIN}:/usr/local/bin:/usr/bin:/bin", "DS_ENV_FILE": str(nodes.env_file),
               "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(proj),  # the project's copy of the code
               "DVC_NO_ANALYTICS": "1"}  # node1 has no route out, and nothing should try one
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items())
    return nodes.ssh_argv("node1", f"cd {shlex.quote(str(proj))} && exec env {prefix} {command}")


def run_on_node1(nodes: multinode.Cluster, proj: Path, command: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(on_node1(nodes, proj, command), capture_output=True, text=True, timeout=timeout)


def _one_process_stages(proj: Path, out: Path) -> None:
    """Each iteration's rollout, compact, learn and evaluate again on 1 process (in this process), from the 2-node
    run's own inputs (its policy of the iteration before, its trajectories and masks), with the relative paths
    dvc.yaml passes (they are recorded in the artifacts). Learn@2 starts from learn@1's 2-node checkpoint: the
    resume across 2 -> 1 processes. Same inputs, so every stage is compared on its own: iteration 2's inputs
    differ from a whole 1-process pipeline's by the learner's float32 summation order (weights within 1e-6)."""
    import torch

    from stages.compaction import run_compaction
    from stages.evaluate.stage import run_evaluate
    from stages.learner.train import run_learner
    from stages.rollout.stage import run_rollout

    params = load_params(proj / "params.yaml", None)
    cwd, threads = Path.cwd(), torch.get_num_threads()
    os.chdir(proj)
    torch.set_num_threads(1)  # as the stage processes (OMP_NUM_THREADS=1)
    try:
        for n, it in enumerate(ITERATIONS, 1):
            before = Path("artifacts/warmstart/policy" if n == 1 else f"artifacts/iter-{n - 1:03d}/policy")
            two = Path("artifacts") / f"iter-{it}"
            run_rollout(params, n, before, Path("artifacts/data/train.arrow"), out / it / "rollout", show_progress=False)
            run_compaction(params.compaction, out / it / "rollout" / "trajectories.arrow", out / it / "rollout" / "masks.raw.zarr",
                    out / it / "compact" / "masks.zarr", out / it / "compact" / "metrics.json")
            run_learner(params, n, before, two / "rollout" / "trajectories.arrow", two / "compact" / "masks.zarr",
                  out / it / "policy")
            run_evaluate(params, n, two / "policy", Path("artifacts/data/eval.arrow"), out / it / "evaluate",
                     show_progress=False)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The micro pipeline across the 2 nodes, through the front door on node1
    (`dvc exp run -S pipeline.hostfile=... -S pipeline.processes=1`), then every stage of it on 1 process.
    Returns (project, the 1-process stages' outputs, the 2-node run's log)."""
    root = tmp_path_factory.mktemp("multinode-runs")
    proj = make_project(root, OVER, git=True)
    hosts = cluster.hostfile(["node1", "node2"])
    start = time.monotonic()
    multi = run_on_node1(cluster, proj, f"dvc exp run -S pipeline.hostfile={hosts} -S pipeline.processes=1")
    TIMINGS["2-node dvc exp run (init, prepare, warm start on 1 process; 2 iterations on 2 nodes)"] = (
        time.monotonic() - start)
    assert multi.returncode == 0, f"2-node run failed:\n{multi.stdout[-4000:]}\n{multi.stderr[-4000:]}"
    start = time.monotonic()
    one = root / "one"
    _one_process_stages(proj, one)
    TIMINGS["the same stages on 1 process"] = time.monotonic() - start
    return proj, one, multi.stdout + multi.stderr


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_every_stage_ran_on_both_nodes(runs):
    proj, _, log = runs
    for stage in ("rollout", "compact", "learn", "evaluate"):
        for it in (1, 2):
            assert f"Running stage '{stage}@{it}'" in log, log[-3000:]
    art = proj / "artifacts"
    for it in ITERATIONS:
        assert json.loads((art / f"iter-{it}" / "rollout" / "details.json").read_text())["rollout/processes"] == 2
        assert json.loads((art / f"iter-{it}" / "evaluate" / "details.json").read_text())["eval/processes"] == 2
        learn = json.loads((art / f"iter-{it}" / "learn" / "details.json").read_text())
        assert learn["learner/world_size"] == 2
    # the launcher ran rank 1 on node2 (pdsh prefixes each node's output with its name)
    assert "node2: " in log


@pytest.mark.slow
@pytest.mark.parametrize("it", ITERATIONS)
def test_rollout_compact_evaluate_byte_identical_to_one_process(runs, it):
    proj, one, _ = runs
    two, one = proj / "artifacts" / f"iter-{it}", one / it
    assert (two / "rollout" / "trajectories.arrow").read_bytes() == (one / "rollout" / "trajectories.arrow").read_bytes()
    assert tree_bytes(two / "compact" / "masks.zarr") == tree_bytes(one / "compact" / "masks.zarr")
    assert (two / "evaluate" / "predictions.arrow").read_bytes() == (one / "evaluate" / "predictions.arrow").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("it", ITERATIONS)
def test_learner_within_1e6_of_one_process(runs, it):
    """Iteration 2 on 1 process resumes learn@1's 2-node checkpoint (DeepSpeed's universal checkpoint): equal
    within 1e-6 means the optimizer state came across 2 -> 1 processes (a fresh Adam would differ by ~lr)."""
    proj, one, _ = runs
    art = proj / "artifacts"
    before = params_of(art / ("warmstart" if it == "001" else f"iter-{int(it) - 1:03d}") / "policy")
    two, single = params_of(art / f"iter-{it}" / "policy"), params_of(one / it / "policy")
    assert max_param_diff(before, single) > 1e-6  # a real update
    assert max_param_diff(two, single) <= 1e-6
    details = json.loads((one / it / "learn" / "details.json").read_text())
    assert details["learner/world_size"] == 1
    if it == "002":
        assert details["learner/resumed_optimizer"] is True


def error_lines(text: str) -> list[str]:
    """The CLI's error lines, without the "node1: " pdsh puts before a node's output."""
    lines = (re.sub(r"^[\w.-]+: (?=error:)", "", line) for line in text.splitlines())
    return [line for line in lines if line.startswith("error:")]


def _rank_process(cluster: multinode.Cluster, node: str, command: str) -> int | None:
    """The pid of the stage process (`python -u .../smdctl COMMAND`, started by the node's deepspeed launcher)."""
    for pid in cluster.pids_in(node):
        argv = multinode.cmdline(pid)
        if len(argv) > 3 and argv[1] == "-u" and argv[2].endswith("smdctl") and argv[3] == command:
            return pid
    return None


@pytest.mark.slow
def test_remote_rank_killed_mid_stage_fails_with_one_line(cluster, runs, tmp_path):
    """Rank 1 (node2) is killed (SIGKILL) while both ranks sample: rank 0's next agreement finds the connection
    closed, the stage fails with one line naming rank 1 and node2, and writes nothing."""
    proj = runs[0]
    hosts = cluster.hostfile(["node1", "node2"])
    out = tmp_path / "killed" / "rollout"
    out.parent.mkdir()
    # Enough sampling on each rank (16 batches of 1) that rank 1 is still at it when killed.
    command = (f"smdctl launch rollout -i 1 --out {out} --no-progress -S pipeline.hostfile={hosts} "
               "-S pipeline.processes=1 -S rollout.prompts_per_iteration=16 -S rollout.batch_size=1 "
               "-S rollout.max_new_tokens=48")
    proc = subprocess.Popen(on_node1(cluster, proj, command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        victim = None
        while victim is None or not any(p.name.startswith(".rollout.tmp-") for p in out.parent.iterdir()):
            assert proc.poll() is None, f"the stage ended before the kill:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "rank 1 never started sampling"
            victim = _rank_process(cluster, "node2", "rollout")
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        log, _ = proc.communicate(timeout=120)
        TIMINGS["remote rank killed -> stage failed"] = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    errors = error_lines(log)
    OUTCOMES["remote rank killed"] = " | ".join(errors)
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith("error: rank 1 of 2 on node2 failed: process lost"), errors
    assert not out.exists() and list(out.parent.iterdir()) == []  # no output, no temporary
    assert TIMINGS["remote rank killed -> stage failed"] < 60


@pytest.mark.slow
def test_node_unreachable_at_start_fails_with_one_line(cluster, runs, tmp_path):
    """node2's link is down: the launch is refused within the ssh check's timeout, with one line naming node2."""
    proj = runs[0]
    hosts = cluster.hostfile(["node1", "node2"])
    out = tmp_path / "evaluate"
    link = ["ip", "netns", "exec", cluster.node("node2").netns, "ip", "link", "set", multinode.NODE_IFNAME]
    subprocess.run([*link, "down"], check=True)
    try:
        start = time.monotonic()
        run = run_on_node1(cluster, proj, f"smdctl launch evaluate -i 1 --out {out} -S pipeline.hostfile={hosts} "
                                          "-S pipeline.processes=1", timeout=SSH_CHECK_TIMEOUT_S + 60)
        TIMINGS["node unreachable -> refused"] = elapsed = time.monotonic() - start
    finally:
        subprocess.run([*link, "up"], check=True)
    assert run.returncode == 2
    errors = error_lines(run.stdout + run.stderr)
    OUTCOMES["node unreachable"] = " | ".join(errors)
    assert len(errors) == 1 and "not reachable over ssh" in errors[0] and "node2 (" in errors[0], errors
    assert "node1" not in errors[0].split("ssh within")[1]  # node1 answered
    assert not out.exists()
    assert elapsed < SSH_CHECK_TIMEOUT_S + 30  # the check's timeout, plus start-up on a loaded machine


@pytest.mark.slow
def test_hostfile_entry_without_sshd_fails_with_one_line(cluster, runs, tmp_path):
    """A hostfile entry whose address answers but where no sshd listens: refused at once, one line."""
    proj = runs[0]
    hosts = cluster.hostfile(["node1", "node2-nosshd"])
    out = tmp_path / "evaluate"
    start = time.monotonic()
    run = run_on_node1(cluster, proj, f"smdctl launch evaluate -i 1 --out {out} -S pipeline.hostfile={hosts} "
                                      "-S pipeline.processes=1", timeout=SSH_CHECK_TIMEOUT_S + 60)
    TIMINGS["no sshd -> refused"] = elapsed = time.monotonic() - start
    assert run.returncode == 2
    errors = error_lines(run.stdout + run.stderr)
    OUTCOMES["no sshd"] = " | ".join(errors)
    assert len(errors) == 1 and "node2-nosshd (" in errors[0] and "Connection refused" in errors[0], errors
    assert not out.exists()
    assert elapsed < SSH_CHECK_TIMEOUT_S + 30


# Fast: the pieces the faults rely on, without nodes.

def test_hostfile_nodes_one_line_errors(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster\nnode1 slots=8\n\nnode2 slots=8  # second\n")
    assert hostfile_nodes(Path("p.yaml"), str(hosts)) == ["node1", "node2"]
    hosts.write_text("node1 slots=8\nnode2\n")
    with pytest.raises(SmdInputError, match=r"^p.yaml: pipeline.hostfile: .*hosts line 2: expected 'name slots=N'$"):
        hostfile_nodes(Path("p.yaml"), str(hosts))
    hosts.write_text("# nothing\n")
    with pytest.raises(SmdInputError, match="names no node"):
        hostfile_nodes(Path("p.yaml"), str(hosts))


def test_check_nodes_names_each_node_that_does_not_answer(tmp_path):
    """A fake ssh: 'down' fails like an unreachable host, 'hung' never answers; both named in one line, within
    the timeout (checked at once, not one after the other)."""
    ssh = tmp_path / "ssh"
    ssh.write_text('#!/bin/sh\nfor a; do host=$b; b=$a; done\n'  # the next-to-last argument is the node
                   'case "$host" in down) echo "ssh: connect to host down port 22: No route to host" >&2; exit 255;;\n'
                   '  hung) exec sleep 30;; esac\nexit 0\n')
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("up slots=1\ndown slots=1\nhung slots=1\n")
    start = time.monotonic()
    with pytest.raises(SmdInputError) as caught:
        check_nodes(Path("p.yaml"), str(hosts), str(ssh), timeout_s=1)
    assert time.monotonic() - start < 10
    assert str(caught.value) == (f"p.yaml: pipeline.hostfile: {hosts}: not reachable over ssh within 1 s: down "
                                 "(ssh: connect to host down port 22: No route to host); hung (no answer within 1 s)")
    hosts.write_text("up slots=1\n")
    check_nodes(Path("p.yaml"), str(hosts), str(ssh), timeout_s=1)


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[10.251.0.2]:5531. This is typically caused by a remote worker crashing. Check the logs.")


def test_lost_peer_names_the_rank_and_host_behind_the_address():
    def ctx(rank, addresses, hosts):
        return DistContext(rank, len(hosts), rank, None, hosts=tuple(hosts), addresses=tuple(addresses))

    lost = lost_peer(ctx(0, ["10.251.0.1", "10.251.0.2"], ["node1", "node2"]), RuntimeError(GLOO_CLOSED))
    assert isinstance(lost, SmdRankLost) and lost.rank == 1 and lost.reporter == 0
    assert str(lost) == "rank 1 of 2 on node2 failed: process lost: Connection closed by peer [10.251.0.2]:5531"
    # rank 0's process lost: rank 1 reports it
    seen_by_1 = lost_peer(ctx(1, ["10.251.0.2", "10.251.0.1"], ["node2", "node1"]), RuntimeError(GLOO_CLOSED))
    assert seen_by_1.rank == 0 and seen_by_1.reporter == 1
    # two ranks on that host: the host is named, the rank cannot be told
    two = lost_peer(ctx(0, ["10.251.0.1", "10.251.0.2", "10.251.0.2"], ["node1", "node2", "node2"]),
                    RuntimeError(GLOO_CLOSED))
    assert str(two).startswith("a rank of 3 on node2 failed: process lost:") and "(ranks 1, 2 run there)" in str(two)
