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

Usage: ``python benchmarks/pipeline_overhead.py [--repeats 2] [--steps 25] [--warmup 5]
[--schedules 1F1B,GPipe]`` (about 4 minutes; ``benchmarks/results/pipeline_overhead.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_ranks import relative_overhead, report_slowest_median, torchrun_json  # noqa: E402

SOURCE = f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_deep_mlp"


def worker(micro_batches: int, steps: int, warmup: int, cut: str, schedule_name: str) -> None:
    """One rank of the hand-written pipeline (under torchrun); rank 0 prints the median
    step time as JSON."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    import fidelity_models

    dist.init_process_group("gloo")
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
    times = []
    for _ in range(steps + warmup):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    report_slowest_median(times, warmup)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs (default 2)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schedules", default="1F1B,GPipe", help="comma-separated")
    parser.add_argument("--cut", default="8", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_overhead.json"))
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.steps, args.warmup, args.cut, args.schedules)
        return 0
    schedules = args.schedules.split(",")
    if any(s not in ("1F1B", "GPipe") for s in schedules):
        parser.error(f"--schedules {args.schedules!r}: a comma-separated list of 1F1B, GPipe")
    from meshplace.provenance import write_result

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
