"""ColocRL's Table 1 rebuilt on simulated testbeds.

Mirhoseini et al. (ICML 2017) compared single CPU, single GPU, Scotch, MinCut, a human
expert and their RL placer on RNNLM, NMT and Inception-V3 with 1 CPU + 2 or 4 K80 GPUs.
This script runs every registered meshplace placer on the same workloads and on the
simulated ``colocrl-2gpu`` / ``colocrl-4gpu`` clusters — **simulated step times, not
measurements on K80s** — and prints the table with the lower bound beside it.

Writes ``benchmarks/results/colocrl_table.json`` and prints Markdown.

Usage::

    .venv/bin/python benchmarks/colocrl_table.py [--budget 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import PlacementProblem, registry, run_placer
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = [("rnnlm", None), ("nmt", "2layer"), ("nmt", "4layer"), ("inception_v3", None)]
CLUSTERS = ["colocrl-2gpu", "colocrl-4gpu"]
BASELINES = ("single", "metis", "mincut", "expert")  # the paper's baselines (GPU side)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per search placer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    placers = list(registry())
    rows = []
    for name, size in WORKLOADS:
        graph = workload_graph(name, size=size)
        for cname in CLUSTERS:
            problem = PlacementProblem.build(graph, load_cluster(cname))
            row = {
                "workload": graph.name,
                "cluster": cname,
                "ops": graph.num_ops,
                "groups": problem.num_groups,
                "lower_bound_s": problem.simulator.lower_bound(),
                "results": {},
            }
            for placer in placers:
                r = run_placer(placer, problem, args.budget, args.seed)
                row["results"][placer] = {
                    "step_time_s": r.step_time_s,
                    "oom": r.oom,
                    "search_time_s": r.search_time_s,
                    "evaluations": r.evaluations,
                    "stopped_at_deadline": bool(r.stats.get("stopped_at_deadline")),
                }
                print(
                    f"{graph.name} {cname} {placer}: {r.step_time_s:.3f} s"
                    f"{' OOM' if r.oom else ''} ({r.search_time_s:.1f} s search)",
                    file=sys.stderr,
                    flush=True,
                )
            fitting = {p: v for p, v in row["results"].items() if not v["oom"]}
            baseline = {p: fitting[p]["step_time_s"] for p in BASELINES if p in fitting}
            best_name = min(fitting, key=lambda p: fitting[p]["step_time_s"]) if fitting else None
            row["best"] = best_name
            row["best_baseline"] = min(baseline, key=baseline.get) if baseline else None
            if best_name and baseline:
                best_base = min(baseline.values())
                row["gain_over_best_baseline"] = 1 - fitting[best_name]["step_time_s"] / best_base
            rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    payload = {"budget_s": args.budget, "seed": args.seed, "rows": rows}
    write_result(RESULTS / "colocrl_table.json", payload)
    _print_markdown(rows, placers)


def _cell(result: dict) -> str:
    if result["oom"]:
        return "OOM"
    return f"{result['step_time_s']:.3f}" + ("*" if result.get("stopped_at_deadline") else "")


def _print_markdown(rows: list[dict], placers: list[str]) -> None:
    ordered = ["single_cpu", "single", "metis", "mincut", "expert"]
    ordered += [p for p in placers if p not in ordered]
    print(
        "Simulated step time per training step (seconds); OOM = exceeds device memory; "
        "* = stopped at its wall-clock deadline before its planned updates or simulations.\n"
    )
    print(
        "| workload | GPUs | "
        + " | ".join(ordered)
        + " | lower bound | best | gain vs best baseline |"
    )
    print("|---" * (len(ordered) + 5) + "|")
    for row in rows:
        gpus = row["cluster"].split("-")[1]
        cells = [_cell(row["results"][p]) for p in ordered]
        gain = row.get("gain_over_best_baseline")
        print(
            f"| {row['workload']} | {gpus} | "
            + " | ".join(cells)
            + f" | {row['lower_bound_s']:.3f} | {row['best']} | "
            + (f"{gain * 100:.1f}% ({row['best_baseline']})" if gain is not None else "–")
            + " |"
        )
    print("\nSearch time (seconds) of the best placer per row:\n")
    for row in rows:
        b = row["best"]
        if b:
            r = row["results"][b]
            print(
                f"- {row['workload']} on {row['cluster']}: {b}, {r['search_time_s']:.1f} s, "
                f"{r['evaluations']:,} simulations"
            )


if __name__ == "__main__":
    main()
