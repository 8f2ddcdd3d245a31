"""Fidelity of the simulator on this machine: measured vs predicted step time of many plans.

For small configurations of several reference models (``meshplace.runtime.program``'s
``*-small`` models), the local machine is calibrated once per model (device, op times on a
runtime worker, gloo link, message cost), each placer in :data:`PLACERS` places the graph
on the calibrated ``local`` cluster (2 CPU workers), and every distinct placement is run
for real (``run_placement``, 1 thread per worker) and simulated (``Calibration.predict``: the
runtime's messages at their measured cost, in-order workers, the end-of-step exchange;
docs/runtime.md). The load average is recorded before and after, since other jobs on the
host distort multi-worker runs. Reported per model and overall: median absolute
percentage error and Kendall's tau-b between the measured and predicted rankings
(computed here, O(n^2) pairs).

Each plan runs ``--passes`` times (default 2), the passes one after the other over all
plans, each run ``--warmup`` untimed then ``--steps`` timed steps; the measured step time
is the median of the timed steps of all passes, and the spread between the passes'
medians is reported as the measurement's own noise. The predictions use, as ``meshplace
run`` does, the message costs :func:`~meshplace.profile.calibrate.calibrate_in_situ`
measures inside steps of probe placements; every plan is also predicted with the
micro-benchmarks' message costs alone, on the same runs (an ablation; ``--no-in-situ``
predicts that way only).

Usage: ``python benchmarks/fidelity.py [--models a,b] [--steps N] [--passes P] [--out F.json]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from meshplace.provenance import write_result

MODELS = ("mlp", "dmcca-small", "nmt-small", "rnnlm-small", "resnet-small", "transformer-small")
PLACERS = (
    "single",
    "expert",
    "metis",
    "m_etf",
    "anneal",
    "random",
    "round_robin",
    "m_topo",
    "heft",
    "mincut",
    "pipeline",
    "m_sct",
)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two equally long score lists (ties counted as neither).

    >>> kendall_tau([1, 2, 3], [10, 20, 30]), kendall_tau([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    n = len(a)
    conc = disc = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def _median_abs(errors: Any) -> float | None:
    vals = [abs(e) for e in errors if e is not None]
    return statistics.median(vals) if vals else None


def run_model(
    name: str, steps: int, warmup: int, passes: int, budget: float, in_situ: bool = True
) -> dict:
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import calibrate, calibrate_in_situ
    from meshplace.runtime.executor import WorkerFailure, run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    spec = ModelSpec(name, batch=8)
    step = trace_step(spec)
    cal = calibrate(step)
    names = cal.cluster.device_names
    problem = PlacementProblem(step.graph, cal.cluster, simulator=cal.simulator())
    seen: dict[tuple, str] = {}
    plans: list[tuple[str, list[str], float]] = []
    micro: dict[str, float] = {}
    for placer in PLACERS:
        for seed in (0, 1) if placer == "random" else (0,):
            try:
                res = run_placer(placer, problem, budget, seed)
            except Exception as exc:  # a placer that cannot handle this graph: skip it
                print(f"  {placer}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
            devices = [names[i] for i in res.op_devices.tolist()]
            key = tuple(devices)
            label = placer if seed == 0 else f"{placer}#{seed}"
            if key in seen:
                print(f"  {label}: same placement as {seen[key]}", file=sys.stderr)
                continue
            seen[key] = label
            plans.append((label, devices, cal.predict(step.graph, devices)))
    if in_situ:  # the headline: in-situ costs; the micro-benchmark-only model alongside
        micro = {label: predicted for label, _, predicted in plans}
        calibrate_in_situ(cal)
        plans = [(label, devices, cal.predict(step.graph, devices)) for label, devices, _ in plans]
    # Every plan runs once per pass, passes one after the other, so a slow spell of the
    # host spreads over all plans instead of landing on one; a plan's measured time is the
    # median of its timed steps pooled over the passes.
    timed: dict[str, list[float]] = {label: [] for label, _, _ in plans}
    per_pass: dict[str, list[float]] = {label: [] for label, _, _ in plans}
    messages: dict[str, int] = {}
    for _ in range(passes):
        for label, devices, _ in plans:
            try:
                run = run_placement(
                    spec, devices, warmup + steps, warmup=warmup, step=step, start_method="fork"
                )
            except WorkerFailure as exc:
                print(f"  {label}: run failed: {exc}", file=sys.stderr)
                continue
            timed[label] += run.step_times[warmup:]
            per_pass[label].append(run.step_time_s)
            messages[label] = run.messages
    rows = []
    for label, devices, predicted in plans:
        if not timed[label]:
            continue
        measured = statistics.median(timed[label])
        err = (predicted - measured) / measured
        spread = (max(per_pass[label]) - min(per_pass[label])) / measured
        rows.append(
            {
                "placement": label,
                "workers_used": len(set(devices)),
                "messages": messages[label],
                "measured_s": measured,
                "measured_per_pass_s": per_pass[label],
                "pass_spread": spread,
                "predicted_s": predicted,
                "error": err,
                "predicted_micro_s": micro.get(label),
                "error_micro": (micro[label] - measured) / measured if label in micro else None,
            }
        )
        print(
            f"  {label:12} measured {measured * 1e3:9.2f} ms (passes spread {100 * spread:5.1f} %)"
            f"  predicted {predicted * 1e3:9.2f} ms  error {100 * err:+7.1f} %  "
            f"msgs {messages[label]}",
            file=sys.stderr,
        )
    return {
        "model": name,
        "ops": step.graph.num_ops,
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "message_cpu": {
            k: cal.messages[k]
            for k in (
                "send_s",
                "send_s_per_byte",
                "recv_s",
                "recv_s_per_byte",
                "spacing",
                "in_situ",
            )
            if k in cal.messages
        },
        "placements": rows,
        **_summary(rows),
    }


def _summary(rows: list[dict]) -> dict[str, Any]:
    """Median absolute error and Kendall's tau of the predictions, and of the
    micro-benchmark-only ones (when in situ was on); the passes' spread."""
    meas = [r["measured_s"] for r in rows]
    micro = [r["predicted_micro_s"] for r in rows]
    return {
        "median_abs_error": _median_abs(r["error"] for r in rows),
        "kendall_tau": kendall_tau(meas, [r["predicted_s"] for r in rows])
        if len(rows) > 1
        else None,
        "median_abs_error_micro": _median_abs(r["error_micro"] for r in rows),
        "kendall_tau_micro": kendall_tau(meas, micro)
        if len(rows) > 1 and None not in micro
        else None,
        "median_pass_spread": _median_abs(r["pass_spread"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument(
        "--no-in-situ",
        action="store_true",
        help="predict with the micro-benchmarks' message costs only (no calibrate_in_situ)",
    )
    parser.add_argument("--passes", type=int, default=2, help="runs per plan, interleaved")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per placer")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fidelity.json"))
    args = parser.parse_args(argv)
    t0 = time.time()
    load_before = os.getloadavg()
    results = []
    for name in args.models.split(","):
        print(f"{name}:", file=sys.stderr)
        results.append(
            run_model(name, args.steps, args.warmup, args.passes, args.budget, not args.no_in_situ)
        )
    rows = [r for m in results for r in m["placements"]]
    overall = {
        **_summary(rows),
        "placements": len(rows),
        "protocol": {
            "steps": args.steps,
            "warmup": args.warmup,
            "passes": args.passes,
            "in_situ": not args.no_in_situ,
        },
        "seconds": time.time() - t0,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    # Kendall's tau overall: the mean of the per-model values (rankings within a model)
    for key in ("kendall_tau", "kendall_tau_micro"):
        vals = [m[key] for m in results if m[key] is not None]
        overall[key] = statistics.mean(vals) if vals else None

    def pct(x: Any) -> str:
        return f"{100 * x:.1f}%" if x is not None else "-"

    def num(x: Any) -> str:
        return f"{x:.2f}" if x is not None else "-"

    print(
        f"\n{'model':20} {'plans':>5} {'median |err|':>13} {'tau':>6} {'pass spread':>12} "
        f"{'micro only: |err|':>18} {'tau':>6}"
    )
    for name, m, plans in [(m["model"], m, len(m["placements"])) for m in results] + [
        ("overall (mean tau)", overall, len(rows))
    ]:
        print(
            f"{name:20} {plans:5d} {pct(m['median_abs_error']):>13} {num(m['kendall_tau']):>6} "
            f"{pct(m['median_pass_spread']):>12} {pct(m['median_abs_error_micro']):>18} "
            f"{num(m['kendall_tau_micro']):>6}"
        )
    print(
        "pass spread: (max - min) / measured of a plan's per-pass medians, median over plans "
        "(the measurement's own noise); micro only: the same runs predicted with the "
        "micro-benchmarks' message costs, without calibrate_in_situ (an ablation)"
    )
    print(
        "load average (1, 5, 15 min) before "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_before"])
        + "; after "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_after"])
    )
    write_result(args.out, {"models": results, "overall": overall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
