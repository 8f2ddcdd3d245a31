"""What the by-hand-versus-meshplace benchmarks (``pipeline_overhead.py``,
``sharded_overhead.py``) share: launching a command on 2 torchrun ranks and reporting a
rank program's step time the same way meshplace's runtime does (per step the slowest
rank's, the median after warm-up), and the overhead of meshplace's steps over the hand's
(of the medians of separate runs, or paired step by step in one run)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

#: what a rank prints when gloo's threads are torn down under it at exit: the by-hand
#: FSDP2 ranks of ``sharded_overhead.py`` did so in about one run in six, after measuring
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_json(args: list[str], attempts: int = 3) -> dict:
    """Run ``args`` under ``torchrun --standalone --nproc-per-node 2`` (one thread per
    rank) and return the JSON document its last stdout line holds. A run that ends in
    gloo's teardown abort (:data:`TEARDOWN_ABORT`) is run again, up to ``attempts``
    times in all (its measurement is discarded, not used); any other failure raises."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(attempts):
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        if TEARDOWN_ABORT not in done.stderr or attempt == attempts - 1:
            break
        print(f"(run aborted in gloo's teardown; again: {' '.join(args[:3])})", file=sys.stderr)
    raise RuntimeError(done.stderr[-3000:] if done.stderr else "failed")


def report_slowest_median(
    times: list[float], warmup: int, cpu_times: list[float] | None = None
) -> None:
    """On every rank of a torchrun program: gather each rank's step times; rank 0 prints
    ``{"step_time_s": ...}`` (per step the slowest rank, median after ``warmup``) and,
    given each step's CPU time of the rank's process (``time.process_time``),
    ``"cpu_time_s_per_rank"`` (each rank's median after ``warmup``), by meshplace's own
    :func:`meshplace.runtime.launch.step_timing`, so both sides are timed alike; then
    leave the process group."""
    import torch.distributed as dist

    from meshplace.runtime.launch import step_timing

    mine = {"times_s": times} if cpu_times is None else {"times_s": times, "cpu_times_s": cpu_times}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        timing = step_timing(every, warmup)
        keys = ("step_time_s", "cpu_time_s_per_rank")
        print(json.dumps({key: timing[key] for key in keys if key in timing}))
    dist.barrier()
    dist.destroy_process_group()


def relative_overhead(ours: list[float], by_hand: list[float]) -> float:
    """What meshplace adds to the same work by hand: the median of ``ours`` over the median
    of ``by_hand``, less one (the repeats alternate, so a slow spell of the host falls on
    both).

    >>> round(relative_overhead([1.1, 1.2, 9.0], [1.0, 1.0, 1.1]), 6)
    0.2
    """
    return statistics.median(ours) / statistics.median(by_hand) - 1


def paired_overhead(ours: list[float], by_hand: list[float]) -> float:
    """The median over pairs of steps of ``ours / by_hand``, less one: each pair ran a few
    milliseconds apart, so what the host does to one it mostly does to the other.

    >>> paired_overhead([1.1, 2.2, 9.0], [1.0, 2.0, 3.0])
    0.10000000000000009
    """
    return statistics.median(a / b for a, b in zip(ours, by_hand, strict=True)) - 1


def report_alternating(
    sides: list[tuple[str, Any]], steps: int, warmup: int, extra: dict | None = None
) -> None:
    """On every rank of a torchrun program: run ``steps + warmup`` steps of each side
    (``(name, step)``, ``step(i)`` returning the step's wall-clock and CPU seconds) in
    rotation — side ``k`` first in steps ``i`` with ``i % len(sides) == k`` — then gather
    every rank's times; rank 0 prints, per step after ``warmup``, each side's slowest
    rank's wall clock (``NAME_s``) and its ranks' mean CPU time (``NAME_cpu_s``) as JSON,
    with ``extra``'s entries; then leave the process group. A slow spell of the host
    falls on every side of a step, a few milliseconds apart."""
    import torch.distributed as dist

    mine: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in sides}
    for i in range(steps + warmup):
        turn = i % len(sides)  # who goes first rotates, as does the order after
        for name, run in sides[turn:] + sides[:turn]:
            mine[name].append(tuple(run(i)))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out: dict[str, Any] = dict(extra or {})
        for name in mine:
            per_rank = [ranks[name][warmup:] for ranks in every]
            out[f"{name}_s"] = [max(t[0] for t in ts) for ts in zip(*per_rank, strict=True)]
            out[f"{name}_cpu_s"] = [
                statistics.mean(t[1] for t in ts) for ts in zip(*per_rank, strict=True)
            ]
        print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
