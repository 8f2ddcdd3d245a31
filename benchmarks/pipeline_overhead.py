"""The pipelined runtime's overhead over torch's pipelining written by hand (issue 15's
target: at most 5 %).

The same 2-stage pipeline of ``fidelity_models.py:build_deep_mlp`` (eight 512-wide
Linear+GELU layers, batch 64, cut at module ``8``) on 2 gloo CPU ranks, one thread each,
under ``Schedule1F1B`` and ``ScheduleGPipe`` with Adam, run two ways in alternation:

* **by hand**, as torch's pipelining tutorial writes it (``pipeline`` + ``build_stage`` +
  the schedule, the loss as the schedule's ``loss_fn``): this script's ``--worker``;
* **meshplace**: ``python -m meshplace.runtime`` on a placement plan with the same cut
  (the pipeline placer's split of the model, as ``benchmarks/fidelity.py --family
  pipelined`` makes it), which adds the activity hooks, every input entering the first
  stage, and runs the stages as generated code (``run_stage_compiled``).

Each run: ``--warmup`` untimed then ``--steps`` timed steps, the step the slowest rank's,
the median reported; ``--repeats`` alternating pairs per schedule and micro-batch count.
Both schedules take ``m + 1`` beats on two stages, so comparing them by hand and in
meshplace also says whether a gap between them is the runtime's or torch's.

``--interleaved`` runs both in one torchrun job instead, step by step in alternation on
the same ranks (:func:`interleaved_worker`, meshplace's own
:class:`~meshplace.runtime.pipelined.PipelinedRankSteps`), the overhead the median over
the pairs of steps (:func:`two_ranks.paired_overhead`).

Usage: ``python benchmarks/pipeline_overhead.py [--repeats 2] [--steps 25] [--warmup 5]
[--schedules 1F1B,GPipe] [--interleaved]`` (about 4 minutes;
``benchmarks/results/pipeline_overhead.json``, or ``pipeline_overhead_interleaved.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshplace.hostmemory import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_ranks import (  # noqa: E402
    paired_overhead,
    relative_overhead,
    report_alternating,
    report_slowest_median,
    torchrun_json,
)

SOURCE = f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_deep_mlp"


def by_hand_steps(micro_batches: int, cut: str, schedule_name: str) -> Any:
    """This rank's stage of the hand-written pipeline (``torch.distributed``
    initialised): a function that runs one step after a barrier of the ranks and returns
    its wall-clock and CPU seconds (this process, all threads)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    import fidelity_models

    rank = dist.get_rank()
    torch.manual_seed(0)
    model, (x,) = fidelity_models.build_deep_mlp()
    pipe = pipeline(
        model, mb_args=(x.chunk(micro_batches)[0],), split_spec={cut: SplitPoint.BEGINNING}
    )
    stage = pipe.build_stage(rank, torch.device("cpu"))
    runner = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule_name]
    schedule = runner(stage, n_microbatches=micro_batches, loss_fn=lambda o, _t: o.mean())
    optimizer = torch.optim.Adam(stage.submod.parameters(), lr=1e-3)
    target = torch.zeros(micro_batches)

    def step() -> tuple[float, float]:
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu_start

    return step


def worker(micro_batches: int, steps: int, warmup: int, cut: str, schedule_name: str) -> None:
    """One rank of the hand-written pipeline (under torchrun); rank 0 prints the median
    step time as JSON."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    step = by_hand_steps(micro_batches, cut, schedule_name)
    times = [step()[0] for _ in range(steps + warmup)]
    report_slowest_median(times, warmup)


def interleaved_worker(
    micro_batches: int, steps: int, warmup: int, cut: str, schedule_name: str, plan: str
) -> None:
    """One rank running meshplace's pipelined steps of ``plan`` (the runtime's own
    :class:`meshplace.runtime.pipelined.PipelinedRankSteps`) and the hand-written
    pipeline's in one process, step by step in alternation (meshplace first in even
    steps), each step after a barrier of the ranks; rank 0 prints, per step after
    ``warmup``, each side's slowest rank's wall-clock seconds and its ranks' mean CPU
    seconds (``benchmarks/sharded_overhead.py --interleaved``'s protocol)."""
    import json

    import torch
    import torch.distributed as dist

    from meshplace.plan.placement import plan_from_dict
    from meshplace.runtime.pipelined import PipelinedRankSteps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ours = PipelinedRankSteps(
        plan_from_dict(json.loads(Path(plan).read_text()), plan),
        plan,
        SOURCE,
        micro_batches=micro_batches,
        lr=1e-3,
        schedule=schedule_name,
        device_type="cpu",
    )
    theirs = by_hand_steps(micro_batches, cut, schedule_name)
    sides: list[tuple[str, Any]] = [
        ("meshplace", lambda i: ours.step(i)[1:]),
        ("by_hand", lambda _i: theirs()),
    ]
    report_alternating(sides, steps, warmup)


def pipeline_plan(folder: Path) -> tuple[Path, str]:
    """The pipeline placer's 2-stage split of the deep MLP on the calibrated local
    workers as a plan file, and the module its second stage begins at."""
    from meshplace.placers.base import PlacementProblem
    from meshplace.placers.pipeline import pipeline_split
    from meshplace.plan import Plan, save_plan
    from meshplace.profile.calibrate import calibrate
    from meshplace.runtime.pipelined import stage_boundaries
    from meshplace.runtime.program import ModelSpec, trace_step

    step = trace_step(ModelSpec(SOURCE))
    cal = calibrate(step)
    problem = PlacementProblem.build(step.graph, cal.cluster, "throughput")
    split, _ = pipeline_split(problem, over_ideals=False)
    names = [problem.device_names[d] for d in split.devices]
    plan = Plan.from_devices(
        step.graph, cal.cluster.name, names, objective="throughput", micro_batches=2
    )
    path = folder / "pipe.json"
    save_plan(plan, path)
    _, boundaries, _ = stage_boundaries(step.graph, names)
    return path, boundaries[0]


def interleaved(args: argparse.Namespace, schedules: list[str]) -> int:
    """``--interleaved``: per schedule and micro-batch count (4, 8), ``--repeats`` torchrun
    jobs of :func:`interleaved_worker`; the pairs of steps of all jobs and their paired
    overhead (:func:`two_ranks.paired_overhead`) of the wall-clock and CPU times."""
    from meshplace.provenance import write_result

    rows = []
    print(
        "| schedule | micro-batches | by hand ms | meshplace ms | paired overhead "
        "| paired CPU overhead | pairs |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as folder:
        plan, cut = pipeline_plan(Path(folder))
        for schedule, micro_batches in [(s, m) for s in schedules for m in (4, 8)]:
            pairs: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                done = torchrun_json(
                    [
                        *[__file__, "--interleaved-worker", str(micro_batches), "--cut", cut],
                        *["--schedules", schedule, "--plan", str(plan), *common],
                    ]
                )
                for key, values in done.items():
                    pairs.setdefault(key, []).extend(values)
            row = {
                "schedule": schedule,
                "micro_batches": micro_batches,
                **pairs,
                "pairs": len(pairs["by_hand_s"]),
                "by_hand_median_s": statistics.median(pairs["by_hand_s"]),
                "meshplace_median_s": statistics.median(pairs["meshplace_s"]),
                "overhead": paired_overhead(pairs["meshplace_s"], pairs["by_hand_s"]),
                "cpu_overhead": paired_overhead(pairs["meshplace_cpu_s"], pairs["by_hand_cpu_s"]),
            }
            rows.append(row)
            print(
                f"| {schedule} | {micro_batches} | {1e3 * row['by_hand_median_s']:.1f} | "
                f"{1e3 * row['meshplace_median_s']:.1f} | {100 * row['overhead']:+.1f} % | "
                f"{100 * row['cpu_overhead']:+.1f} % | {row['pairs']} |",
                flush=True,
            )
    out = args.out or str(ROOT / "benchmarks/results/pipeline_overhead_interleaved.json")
    write_result(out, {"model": SOURCE, "cut": cut, "protocol": "interleaved", "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs (default 2)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="meshplace and the hand-written pipeline in one torchrun job, step by step in "
        "alternation",
    )
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--schedules", default="1F1B,GPipe", help="comma-separated")
    parser.add_argument("--cut", default="8", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=None, help="default results/pipeline_overhead[_interleaved].json"
    )
    args = parser.parse_args(argv)
    keep_freed_memory()  # as meshplace's own processes (meshplace.hostmemory)
    if args.worker is not None:
        worker(args.worker, args.steps, args.warmup, args.cut, args.schedules)
        return 0
    if args.interleaved_worker is not None:
        interleaved_worker(
            args.interleaved_worker, args.steps, args.warmup, args.cut, args.schedules, args.plan
        )
        return 0
    schedules = args.schedules.split(",")
    if any(s not in ("1F1B", "GPipe") for s in schedules):
        parser.error(f"--schedules {args.schedules!r}: a comma-separated list of 1F1B, GPipe")
    from meshplace.provenance import write_result

    if args.interleaved:
        return interleaved(args, schedules)
    args.out = args.out or str(ROOT / "benchmarks/results/pipeline_overhead.json")
    rows = []
    print(
        "| schedule | micro-batches | by hand | meshplace | overhead |\n|---|---:|---:|---:|---:|"
    )
    with tempfile.TemporaryDirectory() as folder:
        plan, cut = pipeline_plan(Path(folder))
        for schedule, micro_batches in [(s, m) for s in schedules for m in (4, 8)]:
            by_hand, ours = [], []
            common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            for _ in range(args.repeats):
                by_hand.append(
                    torchrun_json(
                        [
                            *[__file__, "--worker", str(micro_batches), "--cut", cut],
                            *["--schedules", schedule, *common],
                        ]
                    )["step_time_s"]
                )
                report = torchrun_json(
                    [
                        *["-m", "meshplace.runtime", "--plan", str(plan), "--model", SOURCE],
                        *["--micro-batches", str(micro_batches), "--schedule", schedule],
                        *[*common, "--device", "cpu", "--json"],
                    ]
                )
                ours.append(report["measured"]["step_time_s"])
            row = {
                "schedule": schedule,
                "micro_batches": micro_batches,
                "by_hand_s": by_hand,
                "meshplace_s": ours,
                "overhead": relative_overhead(ours, by_hand),
            }
            rows.append(row)
            print(
                f"| {schedule} | {micro_batches} | {1e3 * statistics.median(by_hand):.1f} ms | "
                f"{1e3 * statistics.median(ours):.1f} ms | {100 * row['overhead']:+.1f} % |"
            )
    write_result(args.out, {"model": SOURCE, "cut": cut, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
