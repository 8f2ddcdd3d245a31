"""Run several placers on one problem and compare them: what ``meshplace plan`` does.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> results = run_placers(p, ["round_robin"], budget_s=1.0, seed=0)
>>> [r.placer for r in results]
['round_robin', 'single', 'expert']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshplace.placers.base import (
    PlacementProblem,
    PlacerResult,
    best_result,
    run_placer,
)
from meshplace.plan.placement import Plan

REFERENCES = ("single", "expert")


def run_placers(
    problem: PlacementProblem,
    names: list[str],
    budget_s: float,
    seed: int,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[PlacerResult], None] | None = None,
) -> list[PlacerResult]:
    """Run each placer in ``names`` (plus the ``single`` and ``expert`` references, which
    the speed-ups are measured against) and return their results in that order."""
    todo = list(dict.fromkeys([*names, *REFERENCES]))
    results = []
    for name in todo:
        if on_start:
            on_start(name)
        result = run_placer(name, problem, budget_s, seed)
        results.append(result)
        if on_done:
            on_done(result)
    return results


def plan_report(problem: PlacementProblem, results: list[PlacerResult], args: Any) -> dict:
    """The JSON-ready comparison: lower bound, one entry per placer, the best placer."""
    by_name = {r.placer: r for r in results}
    single = by_name.get("single")
    expert = by_name.get("expert")
    rows = []
    for r in results:
        row = r.to_dict()
        for label, ref in (("single", single), ("expert", expert)):
            ok = ref is not None and not ref.oom and not r.oom and r.value > 0
            row[f"speedup_vs_{label}"] = ref.value / r.value if ok else None  # type: ignore[union-attr]
        rows.append(row)
    best = best_result(results)
    return {
        "graph": problem.graph.name,
        "cluster": problem.cluster.name,
        "objective": problem.objective,
        "ops": problem.graph.num_ops,
        "groups": problem.num_groups,
        "budget_s": getattr(args, "budget", None),
        "seed": getattr(args, "seed", None),
        "lower_bound_s": problem.simulator.lower_bound(),
        "results": rows,
        "best": best.placer if best else None,
        "out": getattr(args, "out", None),
    }


def best_plan(
    problem: PlacementProblem, results: list[PlacerResult], budget_s: float, seed: int
) -> Plan:
    """The fastest fitting result as a per-op :class:`Plan`."""
    best = best_result(results)
    assert best is not None
    names = [problem.device_names[d] for d in best.op_devices.tolist()]
    return Plan.from_devices(
        problem.graph,
        problem.cluster.name,
        names,
        objective=problem.objective,
        meta={
            "placer": best.placer,
            "objective_value_s": best.value,
            "step_time_s": best.step_time_s,
            "budget_s": budget_s,
            "seed": seed,
        },
    )
