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

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from meshplace.placers.base import (
    PlacementProblem,
    PlacerOptions,
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
    options: PlacerOptions | None = None,
) -> list[PlacerResult]:
    """Run each placer in ``names`` (plus the ``single`` and ``expert`` references, which
    the speed-ups are measured against) and return their results in that order.

    ``options`` (checkpoints, resume, fine-tuning, progress) go to the learned placers."""
    todo = list(dict.fromkeys([*names, *REFERENCES]))
    results = []
    for name in todo:
        if on_start:
            on_start(name)
        result = run_placer(name, problem, budget_s, seed, options)
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
    out = {
        "graph": problem.graph.name,
        "cluster": problem.cluster.name,
        "objective": problem.objective,
        "ops": problem.graph.num_ops,
        "groups": problem.num_groups,
        "budget_s": getattr(args, "budget", None),
        "seed": getattr(args, "seed", None),
        "lower_bound_s": problem.simulator.lower_bound(problem.objective),
        "results": rows,
        "best": best.placer if best else None,
        "out": None,  # the command sets it once the plan is written
    }
    curves = [
        {
            "placer": r.placer,
            "evaluations": list(r.stats["learning_curve"]["evaluations"]),
            "best_step_time_s": list(r.stats["learning_curve"]["best_step_time_s"]),
        }
        for r in results
        if "learning_curve" in r.stats
    ]
    if curves:  # learned placers: the report draws best step time against evaluations
        out["learning_curves"] = curves
    if best is not None:
        out["best_plan"] = best_plan_details(problem, best)
    return out


#: Spans and transfers kept for the report: enough for a readable timeline, small enough
#: that the result JSON of a 7,000-op model stays well under a megabyte or two.
MAX_SPANS = 6000
MAX_TRANSFERS = 4000
MAX_GROUP_EDGES = 300


def layer_label(module: str, phase: str, depth: int = 3) -> str:
    """The label an op is drawn under: its module path cut to ``depth`` parts, or its phase
    in brackets when it belongs to no module (parameters, loss, optimizer updates).

    >>> layer_label("encoder.lstm.0.cell", "forward")
    'encoder.lstm.0'
    >>> layer_label("", "update")
    '(update)'
    """
    return ".".join(module.split(".")[:depth]) if module else f"({phase})"


def _r(x: float, digits: int = 9) -> float:
    return float(f"{x:.{digits}g}")


def _spans(
    labels: list[int], devices: np.ndarray, start: np.ndarray, end: np.ndarray, gap: float
) -> list[list[float]]:
    """Consecutive ops of one label on one device, less than ``gap`` apart, as one span
    ``[device, start, end, label, ops]`` (what a profiler draws when zoomed out)."""
    order = np.lexsort((start, devices))
    spans: list[list[float]] = []
    cur: list[float] | None = None
    for i in order.tolist():
        if end[i] <= start[i]:
            continue
        d, lab = int(devices[i]), labels[i]
        if cur is not None and cur[0] == d and cur[3] == lab and start[i] - cur[2] <= gap:
            cur[2] = max(cur[2], float(end[i]))
            cur[4] += 1
            continue
        cur = [d, float(start[i]), float(end[i]), lab, 1]
        spans.append(cur)
    return spans


def best_plan_details(problem: PlacementProblem, best: PlacerResult) -> dict[str, Any]:
    """What the HTML report draws for the best plan, compactly.

    * ``timeline``: ``labels`` and ``spans`` ``[device, start_s, end_s, label, ops]`` —
      consecutive ops of one layer on one device merged (gaps shorter than 0.02 % of the
      step; coarser only if more than :data:`MAX_SPANS` remain), so idle gaps stay visible;
    * ``transfers``: per link ``[start_s, end_s, bytes, label]`` (a transfer routed over
      several links appears on each), merged like spans beyond :data:`MAX_TRANSFERS`;
    * ``memory``: peak and capacity per device;
    * ``groups``: the co-location group graph: per group its name, topological level
      (longest path from a source), device (the device most of its ops run on), start,
      busy seconds and op count; ``edges`` ``[src, dst, bytes]``, the
      :data:`MAX_GROUP_EDGES` heaviest.
    """
    sim = best.sim
    graph = problem.graph
    ops = graph.ops
    names: dict[str, int] = {}
    labels = [names.setdefault(layer_label(o.module, o.phase), len(names)) for o in ops]
    step = float(sim.step_time_s) or 1.0
    gap = step * 2e-4
    spans = _spans(labels, sim.placement, sim.op_start, sim.op_end, gap)
    while len(spans) > MAX_SPANS:
        gap *= 4
        spans = _spans(labels, sim.placement, sim.op_start, sim.op_end, gap)

    n_links = len(sim.link_names)
    per_link: list[list[list[float]]] = [[] for _ in range(n_links)]
    for x in np.argsort(sim.transfer_start, kind="stable").tolist():
        src_op = int(sim.transfer_src_op[x])
        src_dev = int(sim.placement[src_op])
        dst_dev = int(sim.transfer_dst_device[x])
        for link in problem.cluster.route(src_dev, dst_dev):
            per_link[int(link)].append(
                [
                    float(sim.transfer_start[x]),
                    float(sim.transfer_end[x]),
                    float(sim.transfer_bytes[x]),
                    labels[src_op],
                ]
            )
    tgap = step * 2e-4
    while sum(len(t) for t in per_link) > MAX_TRANSFERS:
        per_link = [_merge_transfers(t, tgap) for t in per_link]
        tgap *= 4

    gg = problem.group_graph
    level = np.zeros(gg.num_ops, dtype=np.int64)
    succ: list[list[int]] = [[] for _ in range(gg.num_ops)]
    edges = list(gg.edges())
    for s, d, _ in edges:
        succ[s].append(d)
    for g in gg.arrays().topo_order.tolist():
        for d in succ[g]:
            level[d] = max(level[d], level[g] + 1)
    group_of = problem.group_of
    n_groups = problem.num_groups
    n_dev = problem.num_devices
    counts = np.zeros((n_groups, n_dev), dtype=np.int64)
    np.add.at(counts, (group_of, sim.placement), 1)
    g_dev = counts.argmax(axis=1)
    g_start = np.full(n_groups, np.inf)
    np.minimum.at(g_start, group_of, sim.op_start)
    busy = np.bincount(group_of, weights=sim.op_end - sim.op_start, minlength=n_groups)
    n_ops = np.bincount(group_of, minlength=n_groups)
    heavy = sorted(edges, key=lambda e: -e[2])[:MAX_GROUP_EDGES]
    groups = [
        {
            "name": problem.grouping.names[g],
            "module": gg.ops[g].module,
            "level": int(level[g]),
            "device": int(g_dev[g]),
            "start_s": _r(g_start[g]) if np.isfinite(g_start[g]) else 0.0,
            "busy_s": _r(busy[g]),
            "ops": int(n_ops[g]),
        }
        for g in range(n_groups)
    ]
    return {
        "placer": best.placer,
        "step_time_s": sim.step_time_s,
        "devices": list(sim.device_names),
        "device_kinds": list(sim.device_kinds),
        "links": list(sim.link_names),
        "timeline": {
            "labels": list(names),
            "spans": [[s[0], _r(s[1]), _r(s[2]), s[3], s[4]] for s in spans],
        },
        "transfers": {
            name: [[_r(a), _r(b), _r(c, 6), int(lab)] for a, b, c, lab in per_link[li]]
            for li, name in enumerate(sim.link_names)
            if per_link[li]
        },
        "memory": [
            {
                "device": sim.device_names[d],
                "peak_bytes": float(sim.peak_memory_bytes[d]),
                "capacity_bytes": float(sim.memory_capacity_bytes[d]),
                "ops": int(np.count_nonzero(sim.placement == d)),
            }
            for d in range(n_dev)
        ],
        "groups": groups,
        "group_edges": [[int(s), int(d), _r(b, 6)] for s, d, b in heavy],
        "group_edges_total": len(edges),
    }


def _merge_transfers(items: list[list[float]], gap: float) -> list[list[float]]:
    """Transfers on one link closer than ``gap`` merged into one (bytes summed)."""
    out: list[list[float]] = []
    for a, b, c, lab in items:
        if out and a - out[-1][1] <= gap:
            last = out[-1]
            last[1] = max(last[1], b)
            last[2] += c
            continue
        out.append([a, b, c, lab])
    return out


def best_plan(
    problem: PlacementProblem, results: list[PlacerResult], budget_s: float, seed: int
) -> Plan:
    """The fastest fitting result as a per-op :class:`Plan`."""
    best = best_result(results)
    assert best is not None
    return result_plan(problem, best, budget_s, seed)


def result_plan(
    problem: PlacementProblem, result: PlacerResult, budget_s: float, seed: int
) -> Plan:
    """One placer's result as a per-op :class:`Plan` (what ``--out`` writes for the best
    and ``--out-all`` for each), its objective value, step time and memory verdict in
    ``meta``."""
    names = [problem.device_names[d] for d in result.op_devices.tolist()]
    # the micro-batches the throughput objective scored the plan at travel with it, so
    # that `simulate` and the runtime run it as one (meshplace.runtime.pipelined)
    micro_batches = result.sim.micro_batches if problem.objective == "throughput" else 1
    return Plan.from_devices(
        problem.graph,
        problem.cluster.name,
        names,
        objective=problem.objective,
        micro_batches=micro_batches,
        meta={
            "placer": result.placer,
            "objective_value_s": result.value,
            "step_time_s": result.step_time_s,
            "oom": result.oom,
            "runs_every_op": bool(math.isfinite(result.value)),
            "budget_s": budget_s,
            "seed": seed,
        },
    )
