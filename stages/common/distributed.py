"""Data parallelism over processes (shared by rollout, evaluate and the learner): torch.distributed.

One process by default. Under the `deepspeed` launcher (or `torchrun`), RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT come from the environment and every process runs the same command. Every stage's
device follows one rule (`model.device`, `stages.common.model.resolve_device`: auto = the local rank's GPU when CUDA is
available, else the CPU), and the process group follows the device: gloo on CPU, NCCL on CUDA (rollout and
evaluation exchange only Python objects and barriers, NCCL carries those through the process's own GPU). No
process pool or job queue of our own.

Work is split in whole batches: batch b goes to process b mod N (`my_batches`), and a sampling batch is
seeded from the run seed, the iteration and b (`batch_seed`), so what a batch samples does not depend on
N. A stage's outputs are written collectively (`write_collectively`): rank 0 owns the atomic temporary
directory (`schemas.atomic.atomic_path`), each process writes its own part into it, rank 0 merges them
into the canonical order and renames. Failures are agreed on (`agree`): when any process raises, every
process raises `SmdRankError` naming the first failing rank (and its host, when the processes span several
nodes), rank 0 deletes the temporary directory before the others exit, and nothing is written. A process that
is gone (killed, its node lost) cannot report: its peers' next collective fails on the closed connection, and
they raise `SmdRankLost` naming the rank and host behind the address that closed (gathered at start-up).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError, SmdRankError
from stages.common.model import local_rank as launcher_local_rank
from stages.common.model import resolve_device

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    hosts: tuple[str, ...] = ()  # every rank's hostname, in rank order (several processes only)
    addresses: tuple[str, ...] = ()  # every rank's address on the route to MASTER_ADDR: tells a lost peer's rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_world() -> int:
    """Number of processes the launcher started (WORLD_SIZE; 1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str | None = None, device: str = "auto") -> DistContext:
    """Join (or create) the process group: the launcher's env when present, else a one-process group.

    `device` is `model.device` (resolved for this process's local rank by `stages.common.model.resolve_device`);
    `backend` defaults to nccl when that is a GPU, gloo otherwise."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    where = resolve_device(device, local_rank)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if where.type == "cuda" else "cpu")
    if where.type == "cuda":
        torch.cuda.set_device(where)  # before NCCL starts: its communicator binds to the current GPU
    backend = backend or ("nccl" if where.type == "cuda" else "gloo")
    if not (dist.is_available() and dist.is_initialized()):
        _release_stale_deepspeed_groups()
        # A one-process group needs no agreed address: always take a fresh local port (a MASTER_PORT
        # inherited from a parent process may still be bound by it).
        own_port = world == 1
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        for attempt in range(8 if own_port else 1):
            if own_port:
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.environ["MASTER_PORT"] = str(_free_port())
            try:
                dist.init_process_group(backend, rank=rank, world_size=world)
                break
            except dist.DistNetworkError:
                # Another process took the free port between probing and binding: pick another.
                if not own_port or attempt == 7:
                    raise
    ctx = DistContext(rank=rank, world=world, local_rank=local_rank, device=where)
    if world > 1:
        peers: list[Any] = [None] * world
        try:
            dist.all_gather_object(peers, (socket.gethostname(), _own_address()))
        except RuntimeError as exc:  # a process died between joining and this first exchange
            raise lost_peer(ctx, exc) from None
        ctx.hosts, ctx.addresses = (tuple(column) for column in zip(*peers))
    return ctx


def _release_stale_deepspeed_groups() -> None:
    """Before a new default process group: drop DeepSpeed's module-level references to groups of an earlier one.

    DeepSpeed clones the world group once per process (`deepspeed.utils.groups._WORLD_GROUP`, used by ZeRO) and
    releases it only when the group is torn down through `deepspeed.comm.destroy_process_group`. A process that
    destroyed the default group with torch's own call (a notebook, a test session, vLLM's clean-up) and then runs
    the learner again would hand ZeRO the dead clone ("Group ... is not registered"). Only when DeepSpeed is
    already imported; its own release helper where it has one (DeepSpeed >= 0.18)."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    else:
        groups._WORLD_GROUP = None
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None and not comm.cdb.is_initialized():
        comm.cdb = None


def _own_address() -> str:
    """This process's address on the route to MASTER_ADDR (connecting a UDP socket sends nothing); '' if none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT") or 1)))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return ""


class SmdRankLost(SmdRankError):
    """A peer process is gone (its connection closed mid-collective): there is no agreement to be had, so the
    survivors exit without the closing barrier. `reporter` is the rank that prints the line (0 unless 0 is lost)."""

    reporter = 0


# gloo names the far end of a broken pair as "[address]:port" (its own source location is "[file:line] ").
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_peer(ctx: DistContext, exc: BaseException) -> SmdRankLost:
    """The one-line error for a collective that failed because a peer's process ended: the rank and host behind
    the address that closed, when the ranks' addresses tell it (several ranks on that host: 'a rank')."""
    text = " ".join(str(exc).split())
    match = _PEER_ADDRESS.search(text)
    address = match.group(1) if match else None
    ranks = [r for r, a in enumerate(ctx.addresses) if address is not None and a == address and r != ctx.rank]
    reason = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0]  # without gloo's source location and advice
    if len(ranks) > 1:
        reason += f" (ranks {', '.join(map(str, ranks))} run there)"
    host = ctx.hosts[ranks[0]] if ranks else address
    error = SmdRankLost(ranks[0] if len(ranks) == 1 else None, ctx.world, f"process lost: {reason}", 1, host=host)
    error.reporter = 1 if ranks == [0] else 0
    return error


def _host_of(ctx: DistContext, rank: int) -> str | None:
    """A rank's hostname when the processes span several hosts (one node: messages stay as they were)."""
    return ctx.hosts[rank] if len(set(ctx.hosts)) > 1 else None


def worker_context(device: str = "auto") -> DistContext:
    """The context of a data-parallel stage (rollout, evaluate) on `device` (`model.device`, resolved for the local
    rank): a process group only when launched with several processes (gloo on CPU, NCCL on CUDA). On the CPU each
    process then runs `cpu_count // local processes` torch threads (at least 1) unless OMP_NUM_THREADS says
    otherwise, so N processes on one machine do not oversubscribe its cores."""
    if launched_world() <= 1 and not (dist.is_available() and dist.is_initialized()):
        return DistContext(rank=0, world=1, local_rank=0, device=resolve_device(device, launcher_local_rank()))
    ctx = init_distributed(device=device)
    if ctx.world > 1 and ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or ctx.world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return ctx


def my_batches(num_batches: int, ctx: DistContext) -> list[int]:
    """The batch indices this process runs: b with b mod N == rank."""
    return list(range(ctx.rank, num_batches, ctx.world))


def batch_seed(seed: int, iteration: int, batch: int) -> int:
    """The sampling seed of one batch: a function of the run seed, the iteration and the batch index only
    (numpy's SeedSequence mixes them), so the samples do not depend on the number of processes."""
    return int(np.random.SeedSequence([seed, iteration, batch]).generate_state(1, np.uint64)[0])


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """(fn(), None), or (None, the exception) when it raises."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every process by `agree`
        return None, exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SmdInputError):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return " ".join(f"{exc.__class__.__name__}: {exc}{where}".split())


def agree(ctx: DistContext, value: T | None, error: BaseException | None) -> list[T]:
    """Collective: every process's value, in rank order, on every process; if any process failed, every
    process raises SmdRankError naming the first failing rank (exit code 2 for bad input, else 1)."""
    if ctx.world == 1:
        if error is not None:
            raise error
        return [value]  # type: ignore[list-item]
    report = (value, None) if error is None else (None, (_describe(error), isinstance(error, SmdInputError)))
    gathered: list[Any] = [None] * ctx.world
    try:
        dist.all_gather_object(gathered, report)
    except RuntimeError as exc:  # gloo / NCCL: a peer's connection closed (its process killed, its node gone)
        raise lost_peer(ctx, exc) from error
    for rank, (_, failure) in enumerate(gathered):
        if failure is not None:
            message, bad_input = failure
            raise SmdRankError(rank, ctx.world, message, 2 if bad_input else 1, host=_host_of(ctx, rank)) from error
    return [v for v, _ in gathered]


def write_collectively(final: str | Path, ctx: DistContext, each_rank: Callable[[Path], T],
                       on_main: Callable[[Path, list[T]], None]) -> None:
    """Write the directory `final` with every process: rank 0 creates the temporary directory, each process
    runs `each_rank(tmp)` (writes its own part, returns a small summary), rank 0 runs
    `on_main(tmp, summaries in rank order)` (merges), then renames tmp to `final`. Any failure, on any
    process, raises SmdRankError everywhere after rank 0 removed tmp: nothing is written."""
    final = Path(final)
    if ctx.world == 1:
        with atomic_path(final) as tmp:
            tmp.mkdir(parents=True)
            on_main(tmp, [each_rank(tmp)])
        return
    writer = atomic_path(final) if ctx.is_main else None
    entered = False

    def enter() -> Path:
        nonlocal entered
        tmp = writer.__enter__()
        entered = True
        tmp.mkdir(parents=True)
        return tmp

    try:
        made, err = attempt(enter) if ctx.is_main else (None, None)
        tmp = Path(agree(ctx, str(made) if made is not None else None, err)[0])
        summaries = agree(ctx, *attempt(lambda: each_rank(tmp)))
        agree(ctx, None, attempt(lambda: on_main(tmp, summaries))[1] if ctx.is_main else None)
    except SmdRankError as exc:
        if entered:
            writer.__exit__(type(exc), exc, exc.__traceback__)  # atomic_path removes tmp
        if not isinstance(exc, SmdRankLost):  # a lost peer would fail the barrier too
            dist.barrier()  # the others exit only after tmp is gone
        raise
    # The rename (atomic_path re-checks `final` first and removes tmp if it must refuse): agreed on too, so
    # that no process returns before `final` is in place or every process knows it failed.
    agree(ctx, None, attempt(lambda: writer.__exit__(None, None, None))[1] if ctx.is_main else None)
