"""Two learner processes (gloo, DeepSpeed data parallel) make the same update as one on the same global batch."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from stages.learner.train import run_learner
from tests.helpers import make_iteration, make_model_dir, make_params, make_prompts, max_param_diff, params_of

# 3 prompts x 3 responses = 9 rows: ranks get 5 and 4 rows, i.e. 3 and 2 (+1 zero-weight filler) micro-batches.
# Adam's first step is lr * g / (|g| + eps): for weights whose gradient is ~eps it amplifies the float32
# summation-order noise of g (different micro-batches, an all-reduce) by lr / eps; adam_eps 1e-6 keeps that
# below the 1e-6 tolerance while the update itself is ~lr = 1e-4 per weight.
OVER = {"rollout.group_size": 3, "learner.micro_batch_size": 2, "learner.lr": 1e-4, "learner.adam_eps": 1e-6,
        "learner.num_threads": 1}


def _worker(rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    zero_stage, model_dir, traj, masks, out = args
    run_learner(make_params(**OVER, **{"learner.zero_stage": zero_stage}), 1, model_dir, traj, masks, out)
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_processes_equal_one(tmp_path: Path, zero_stage: int):
    model_dir = make_model_dir(tmp_path, "gqa")
    prompts = make_prompts(tmp_path)
    traj, masks = make_iteration(tmp_path, model_dir, prompts, make_params(**OVER))
    one = tmp_path / "one" / "policy"
    two = tmp_path / "two" / "policy"
    for world, out in ((1, one), (2, two)):
        mp.spawn(_worker, args=(world, free_port(), (zero_stage, model_dir, traj, masks, out)), nprocs=world,
                 join=True)
    before, a, b = params_of(model_dir), params_of(one), params_of(two)
    assert max_param_diff(before, a) > 5e-5  # a real update (lr 1e-4)
    assert max_param_diff(a, b) <= 1e-6
    norms = [json.loads((d.parent / "learn" / "steps.json").read_text())[0]["grad_norm"] for d in (one, two)]
    assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0]  # the same global gradient
    assert (two / "trainer_state" / "trainer_state.json").read_text().count('"world_size": 2') == 1


def _resume_worker(rank: int, world: int, port: int, jobs: list[tuple]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    for policy, traj, masks, out in jobs:  # in one pair of processes: a process start costs more than a step
        # The second step trains the first step's policy on the same batch (off-policy by one step): gate open.
        run_learner(make_params(**OVER, **{"learner.parity_tol": 1.0}), 1, policy, traj, masks, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_resume_two_to_one_process_keeps_optimizer(tmp_path: Path):
    """~25 s: a step on 2 processes (ZeRO 1: each holds half the Adam moments), then a second step on 2
    processes (uninterrupted) and, from the same checkpoint, on 1 process through DeepSpeed's universal
    checkpoint: the same weights within 1e-6. Without the moments Adam's second step would differ by ~lr."""
    model_dir = make_model_dir(tmp_path, "gqa")
    prompts = make_prompts(tmp_path)
    traj, masks = make_iteration(tmp_path, model_dir, prompts, make_params(**OVER))
    first, two, one = (tmp_path / name / "policy" for name in ("first", "two", "one"))
    for world, jobs in ((2, [(model_dir, traj, masks, first), (first, traj, masks, two)]),
                        (1, [(first, traj, masks, one)])):
        mp.spawn(_resume_worker, args=(world, free_port(), jobs), nprocs=world, join=True)
    assert max_param_diff(params_of(first), params_of(two)) > 5e-5  # the second step moved the weights
    assert max_param_diff(params_of(two), params_of(one)) <= 1e-6
    details = json.loads((one.parent / "learn" / "details.json").read_text())
    assert details["learner/resumed_optimizer"] is True and details["learner/world_size"] == 1
    assert json.loads((one / "trainer_state" / "trainer_state.json").read_text())["global_step"] == 2
    assert not [p for p in first.parent.iterdir() if "universal" in p.name]  # the converted copy is removed


def _failing_write_worker(rank: int, world: int, port: int, args: tuple) -> None:
    """learn on `world` processes whose rank 0 fails while writing the Hugging Face weights (after every rank
    saved its trainer-state shards); each rank records the one line it raised."""
    import stages.learner.train as train
    from schemas.errors import SmdRankError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    model_dir, traj, masks, out, report = args

    def disk_full(_path):
        raise OSError(28, "No space left on device")

    if rank == 0:
        train.write_weights_digest = disk_full
    try:
        run_learner(make_params(**OVER), 1, model_dir, traj, masks, out)
        Path(report, f"rank{rank}").write_text("no error")
    except SmdRankError as exc:
        Path(report, f"rank{rank}").write_text(str(exc))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_rank_failing_mid_write_fails_every_rank_and_writes_nothing(tmp_path: Path):
    """The policy is written collectively (stages.common.distributed.write_collectively): rank 0 failing inside its part
    of the write makes every rank raise one line naming it, within a bounded time (no rank left in a barrier),
    and no policy directory or temporary is left behind."""
    model_dir = make_model_dir(tmp_path, "gqa")
    prompts = make_prompts(tmp_path)
    traj, masks = make_iteration(tmp_path, model_dir, prompts, make_params(**OVER))
    out, report = tmp_path / "run" / "policy", tmp_path / "report"
    report.mkdir()
    context = mp.spawn(_failing_write_worker, args=(2, free_port(), (model_dir, traj, masks, out, report)),
                       nprocs=2, join=False)
    for _ in range(60):  # 5 minutes at most, then the test fails instead of hanging CI
        if context.join(timeout=5):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail("a rank hung after another failed while writing the policy")
    for rank in (0, 1):
        line = (report / f"rank{rank}").read_text()
        assert line.startswith("rank 0 of 2") and "No space left on device" in line and "\n" not in line
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == []
