"""Operator profiles for the benches' `--profile` (issue 40: "where a target is missed, paste the profile of both
engines"): `torch.profiler` over one untimed run, operators ranked by self CPU time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def profiled(run: Callable[[], Any], top: int = 12) -> tuple[float, list[tuple[str, float, int]]]:
    """`run()` once under torch.profiler (CPU activity): (its wall seconds with the profiler on, the `top`
    operators as (name, self CPU seconds, calls), the largest first)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
    return seconds, top_operators(prof, top)


def top_operators(prof, top: int = 12) -> list[tuple[str, float, int]]:
    """A finished profiler's `top` operators by self CPU time: (name, seconds, calls)."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in ops[:top]]


def log_operators(rows: list[tuple[str, float, int]], log=print) -> None:
    """The operators as a markdown table."""
    log("| operator | self CPU s | calls |")
    log("|---|---|---|")
    for name, seconds, calls in rows:
        log(f"| {name} | {seconds:.2f} | {calls} |")
