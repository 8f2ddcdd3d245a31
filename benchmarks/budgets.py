"""Budget overruns: how long every registered placer really searches against its budget.

Budgets are fixed amounts of work (simulations, updates) sized from the problem so that a
seed reproduces a plan; the tests check the work, never the clock. This script measures
the clock: for every registered placer on a few workload x cluster problems it records
``search_time_s / budget`` (1.0 = exactly the budget; the search placers plan to fill
about 60 % of it and stop hard at 97 %), the one-off ``warmup_s`` paid before the timed
region (numba loading its kernels in a fresh process), the evaluations, and what stopped
the search (``budget`` or ``deadline``). ``--busy N`` runs N CPU-bound processes beside
it, as on a loaded CI machine.

Writes ``benchmarks/results/budgets.json`` (stamped with the git commit and the command
line by :func:`meshplace.provenance.write_result`) and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/budgets.py [--budget 2] [--seed 0] [--busy 0]
        [--placers all] [--problems dmcca@colocrl-2gpu,nmt@h2-8xv100]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import PlacementProblem, registry, resolve, run_placer
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
# The test grid's clusters (4 GPUs + CPU, 8 H100, 16 V100 on two hosts), the issue's
# overrunning case (nmt on h2-8xv100), and 80 A100s for the list schedulers.
PROBLEMS = [
    "dmcca@colocrl-2gpu",
    "nmt@colocrl-4gpu",
    "nmt@h2-8xv100",
    "inception_v3@dgx-h100",
    "resnet50@h8-8xa100",
]


@contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """``count`` CPU-bound Python processes for the duration of the block (each is ended
    by its own id afterwards)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(problem_label: str, placers: list[str], budget_s: float, seed: int) -> list[dict]:
    """One row per placer on the problem ``workload@cluster``."""
    workload, cluster = problem_label.split("@")
    problem = PlacementProblem.build(workload_graph(workload), load_cluster(cluster))
    rows = []
    for name in placers:
        result = run_placer(name, problem, budget_s, seed)
        stats = result.stats
        rows.append(
            {
                "problem": problem_label,
                "ops": problem.graph.num_ops,
                "groups": problem.num_groups,
                "devices": problem.num_devices,
                "placer": name,
                "family": registry().family(name),
                "budget_s": budget_s,
                "search_time_s": result.search_time_s,
                "overrun": result.search_time_s / budget_s,
                "warmup_s": result.warmup_s,
                "evaluations": result.evaluations,
                "stopped_by": stats.get("stopped_by"),
                "updates": stats.get("updates", stats.get("finetune_updates")),
                "planned_updates": stats.get("planned_updates"),
                "planned_simulations": stats.get("planned_simulations"),
                "estimated_work_s": stats.get("estimated_work_s"),
            }
        )
        print(
            f"{problem_label:24} {name:14} {result.search_time_s:7.3f} s "
            f"({result.search_time_s / budget_s:5.2f} x budget, warm-up "
            f"{result.warmup_s:.2f} s, {stats.get('stopped_by') or '-'})",
            flush=True,
        )
    return rows


def markdown(rows: list[dict[str, Any]], problems: list[str]) -> str:
    """Placers down, problems across: search time over budget, ``!`` past the budget and
    ``d`` where the deadline stopped the search; the worst ratio and the largest warm-up."""
    placers = list(dict.fromkeys(r["placer"] for r in rows))
    cell = {(r["placer"], r["problem"]): r for r in rows}
    lines = [
        "| placer | " + " | ".join(problems) + " | worst | warm-up |",
        "|---|" + "---:|" * (len(problems) + 2),
    ]
    for name in placers:
        mine = [cell[(name, p)] for p in problems if (name, p) in cell]
        texts = []
        for p in problems:
            r = cell.get((name, p))
            if r is None:
                texts.append("–")
                continue
            mark = ("!" if r["overrun"] > 1.0 else "") + (
                " d" if r["stopped_by"] == "deadline" else ""
            )
            texts.append(f"{r['overrun']:.2f}{mark}")
        worst = max(r["overrun"] for r in mine)
        warm = max(r["warmup_s"] for r in mine)
        lines.append(f"| `{name}` | " + " | ".join(texts) + f" | {worst:.2f} | {warm:.2f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per placer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--busy", type=int, default=0, help="CPU-bound processes to run beside (default 0)"
    )
    parser.add_argument("--placers", default="all", help="comma-separated names or 'all'")
    parser.add_argument(
        "--problems", default=",".join(PROBLEMS), help="comma-separated workload@cluster"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "budgets.json")
    args = parser.parse_args(argv)
    placers = resolve(args.placers)
    problems = [p.strip() for p in args.problems.split(",") if p.strip()]
    rows: list[dict] = []
    with busy_processes(args.busy):
        for label in problems:
            rows.extend(measure(label, placers, args.budget, args.seed))
    worst = max(rows, key=lambda r: r["overrun"])
    record = write_result(
        args.out,
        {
            "budget_s": args.budget,
            "seed": args.seed,
            "busy_processes": args.busy,
            "problems": problems,
            "worst": {k: worst[k] for k in ("placer", "problem", "overrun")},
            "rows": rows,
        },
    )
    print()
    print(markdown(rows, problems))
    print(
        f"\nsearch time / budget ({args.budget:g} s), seed {args.seed}, {args.busy} busy "
        f"processes beside; '!' past the budget, 'd' stopped by the deadline.\n"
        f"commit {record['provenance']['commit']}; command: {record['provenance']['command']}"
    )


if __name__ == "__main__":
    main()
