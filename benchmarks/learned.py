"""Learned placement: learning curves and the generalisation of the pretrained policy.

Two measurements, both on the simulator (simulated step times, not measurements on GPUs):

1. **Learning curves.** On NMT (2 layers) with 1 CPU + 4 GPUs (``colocrl-4gpu``), every
   learned placer (``rl``, ``hrl``, and ``gnn`` fine-tuning from its pretrained weights)
   and the two search references (``anneal`` and ``random_search``) get the same budget;
   each records the best step time found so far against simulator evaluations and wall
   seconds (``stats["learning_curve"]``). ``expert`` is drawn as a line.
   Writes ``learned_curves.json`` and ``learned_curves.png``.
2. **Generalisation.** The ``gnn`` policy was trained on a family of graphs that leaves some
   reference workloads out (:func:`meshplace.learn.train_gnn.held_out_problems`). On each
   held-out graph and cluster (:func:`meshplace.learn.train_gnn.generalisation_table`):
   ``expert``, ``gnn`` zero-shot (and its seconds), ``gnn`` fine-tuned for ``--finetune``
   seconds, and ``anneal`` with ``--anneal-budget`` seconds; the gap is
   ``gnn / anneal − 1``. Writes ``learned_generalisation.json``.

Both tables are printed as Markdown. Budgets become fixed numbers of updates or
simulations, so a seed reproduces the plans (wall times vary with the machine).

Usage::

    .venv/bin/python benchmarks/learned.py [--budget 60] [--finetune 30] [--anneal-budget 30]
        [--seed 0] [--skip-curves] [--skip-generalisation] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import PlacementProblem, PlacerOptions, run_placer
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
CURVE_PLACERS = ("rl", "hrl", "gnn", "anneal", "random_search")
STYLE = {
    "rl": ("tab:blue", "-"),
    "hrl": ("tab:orange", "-"),
    "gnn": ("tab:green", "-"),
    "anneal": ("tab:red", "--"),
    "random_search": ("tab:gray", ":"),
}


def learning_curves(budget_s: float, seed: int) -> dict:
    """Every placer in :data:`CURVE_PLACERS` on NMT / colocrl-4gpu with ``budget_s``."""
    problem = PlacementProblem.build(workload_graph("nmt"), load_cluster("colocrl-4gpu"))
    expert = run_placer("expert", problem, budget_s, seed)
    out = {
        "graph": problem.graph.name,
        "cluster": problem.cluster.name,
        "budget_s": budget_s,
        "seed": seed,
        "expert_step_time_s": expert.step_time_s,
        "lower_bound_s": problem.simulator.lower_bound(),
        "placers": {},
    }
    for name in CURVE_PLACERS:
        # gnn spends the budget fine-tuning its pretrained policy on this graph.
        options = PlacerOptions(finetune_s=budget_s if name == "gnn" else None)
        r = run_placer(name, problem, budget_s, seed, options)
        out["placers"][name] = {
            "step_time_s": r.step_time_s,
            "oom": r.oom,
            "search_time_s": r.search_time_s,
            "evaluations": r.evaluations,
            # ColocRL's measure: how much shorter the step is than the expert's.
            "step_time_cut_vs_expert": 1 - r.step_time_s / expert.step_time_s,
            "stopped_at_deadline": bool(r.stats.get("stopped_at_deadline")),
            "learning_curve": r.stats["learning_curve"],
        }
        print(f"  {name}: {r.step_time_s:.3f} s in {r.search_time_s:.1f} s", file=sys.stderr)
    return out


def plot_curves(curves: dict, path: Path) -> None:
    """Two panels: best step time against simulator evaluations and against wall time."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, x_key, label in (
        (axes[0], "evaluations", "simulator evaluations"),
        (axes[1], "wall_s", "wall time (s)"),
    ):
        for name, r in curves["placers"].items():
            c = r["learning_curve"]
            if not c["evaluations"]:
                continue
            colour, line = STYLE.get(name, ("black", "-"))
            ax.step(
                c[x_key],
                [t * 1e3 for t in c["best_step_time_s"]],
                where="post",
                color=colour,
                linestyle=line,
                label=f"{name} ({r['step_time_s'] * 1e3:.0f} ms)",
            )
        ax.axhline(curves["expert_step_time_s"] * 1e3, color="black", linewidth=0.8, label="expert")
        ax.axhline(
            curves["lower_bound_s"] * 1e3,
            color="black",
            linewidth=0.8,
            linestyle=":",
            label="lower bound",
        )
        ax.set_xscale("symlog", linthresh=10 if x_key == "evaluations" else 1)
        ax.set_xlim(left=0)
        ax.set_xlabel(label)
        ax.set_ylabel("best step time so far (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{curves['graph']} on {curves['cluster']}: budget {curves['budget_s']:g} s "
        f"per placer, seed {curves['seed']} (simulated)"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per curve placer")
    parser.add_argument("--finetune", type=float, default=30.0, help="gnn fine-tuning seconds")
    parser.add_argument("--anneal-budget", type=float, default=30.0, help="anneal's seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-curves", action="store_true")
    parser.add_argument("--skip-generalisation", action="store_true")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from learned_curves.json"
    )
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.plot_only:
        plot_curves(
            json.loads((RESULTS / "learned_curves.json").read_text()),
            RESULTS / "learned_curves.png",
        )
        return

    if not args.skip_curves:
        curves = learning_curves(args.budget, args.seed)
        write_result(RESULTS / "learned_curves.json", curves)
        plot_curves(curves, RESULTS / "learned_curves.png")
        print(
            f"\n{curves['graph']} on {curves['cluster']}, budget {args.budget:g} s, "
            f"seed {args.seed} (expert {curves['expert_step_time_s']:.3f} s, "
            f"lower bound {curves['lower_bound_s']:.3f} s)\n"
        )
        print(
            "| placer | step time | shorter than expert's | search time | simulator evaluations |"
        )
        print("|---|---:|---:|---:|---:|")
        for name, r in curves["placers"].items():
            print(
                f"| {name} | {r['step_time_s']:.3f} s | {r['step_time_cut_vs_expert']:.1%} | "
                f"{r['search_time_s']:.1f} s | {r['evaluations']:,} |"
            )
        print(f"\nwrote {RESULTS / 'learned_curves.json'} and learned_curves.png")

    if not args.skip_generalisation:
        from meshplace.learn.train_gnn import generalisation_table, held_out_problems

        problems = held_out_problems()
        run_placer("gnn", problems[0][1], 1.0, args.seed)  # compile the decoder first
        rows = generalisation_table(args.anneal_budget, args.finetune, args.seed, problems)
        write_result(
            RESULTS / "learned_generalisation.json",
            {
                "finetune_s": args.finetune,
                "anneal_budget_s": args.anneal_budget,
                "seed": args.seed,
                "rows": rows,
            },
        )
        print(
            f"\ngnn on graphs held out of its training family (fine-tune {args.finetune:g} s, "
            f"anneal {args.anneal_budget:g} s)\n"
        )
        print(
            "| held-out problem | groups | expert | gnn zero-shot | zero-shot time | "
            f"gnn +{args.finetune:g} s | anneal {args.anneal_budget:g} s | "
            "zero-shot vs anneal | fine-tuned vs anneal |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['problem']} | {r['groups']} | {r['expert_step_s']:.3f} s | "
                f"{r['gnn_zero_shot_step_s']:.3f} s | {r['gnn_zero_shot_s']:.2f} s | "
                f"{r['gnn_finetune_step_s']:.3f} s | {r['anneal_step_s']:.3f} s | "
                f"{r['zero_shot_gap_pct']:+.1f} % | {r['finetune_gap_pct']:+.1f} % |"
            )
        print(f"\nwrote {RESULTS / 'learned_generalisation.json'}")


if __name__ == "__main__":
    main()
