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

Usage: ``python benchmarks/fidelity.py [--models a,b] [--steps N] [--out results/fidelity.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

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


def run_model(name: str, steps: int, budget: float) -> dict:
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import calibrate
    from meshplace.runtime.executor import WorkerFailure, run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    spec = ModelSpec(name, batch=8)
    step = trace_step(spec)
    cal = calibrate(step)
    names = cal.cluster.device_names
    problem = PlacementProblem(step.graph, cal.cluster)
    seen: dict[tuple, str] = {}
    rows = []
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
            predicted = cal.predict(step.graph, devices)
            try:
                run = run_placement(spec, devices, steps, warmup=2, step=step, start_method="fork")
            except WorkerFailure as exc:
                print(f"  {label}: run failed: {exc}", file=sys.stderr)
                continue
            measured = run.step_time_s
            err = (predicted - measured) / measured
            rows.append(
                {
                    "placement": label,
                    "workers_used": len(set(devices)),
                    "messages": run.messages,
                    "measured_s": measured,
                    "predicted_s": predicted,
                    "error": err,
                }
            )
            print(
                f"  {label:12} measured {measured * 1e3:9.2f} ms  predicted "
                f"{predicted * 1e3:9.2f} ms  error {100 * err:+7.1f} %  msgs {run.messages}",
                file=sys.stderr,
            )
    meas = [r["measured_s"] for r in rows]
    pred = [r["predicted_s"] for r in rows]
    return {
        "model": name,
        "ops": step.graph.num_ops,
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "message_cpu": {
            k: cal.messages[k]
            for k in ("send_s", "send_s_per_byte", "recv_s", "recv_s_per_byte", "spacing")
            if k in cal.messages
        },
        "placements": rows,
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows) if rows else None,
        "kendall_tau": kendall_tau(meas, pred) if len(rows) > 1 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per placer")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fidelity.json"))
    args = parser.parse_args(argv)
    t0 = time.time()
    load_before = os.getloadavg()
    results = []
    for name in args.models.split(","):
        print(f"{name}:", file=sys.stderr)
        results.append(run_model(name, args.steps, args.budget))
    rows = [r for m in results for r in m["placements"]]
    overall = {
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows) if rows else None,
        "kendall_tau_mean": statistics.mean(
            m["kendall_tau"] for m in results if m["kendall_tau"] is not None
        ),
        "placements": len(rows),
        "seconds": time.time() - t0,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    print(f"\n{'model':20} {'plans':>5} {'median |err|':>13} {'tau':>6}")
    for m in results:
        tau = m["kendall_tau"]
        print(
            f"{m['model']:20} {len(m['placements']):5d} "
            f"{100 * (m['median_abs_error'] or 0):12.1f}% {tau if tau is not None else 0:6.2f}"
        )
    print(
        f"{'overall':20} {overall['placements']:5d} {100 * overall['median_abs_error']:12.1f}% "
        f"{overall['kendall_tau_mean']:6.2f} (mean tau)"
    )
    print(
        "load average (1, 5, 15 min) before "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_before"])
        + "; after "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_after"])
    )
    Path(args.out).write_text(json.dumps({"models": results, "overall": overall}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
