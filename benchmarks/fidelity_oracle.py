"""Where the placed family's error is: the simulator fed each op's *measured* time.

For one model of ``benchmarks/fidelity.py``'s placed family, the machine is calibrated as
there (``calibrate`` and ``calibrate_in_situ``), each placer in ``--placers`` places the
graph on the calibrated workers, and each plan runs once with per-node timelines
(``run_placement(..., timeline=True)``). Beside the measured step and the prediction
(``Calibration.predict``), the *oracle* simulates each timed step of the plan with every
op taking what it took in that step (its fx nodes' spans summed, sends included), each
receive charged the in-situ quick receive (``recv_s``) and the links at the in-situ hop
latency (the median over the steps of the simulated walk), and again at several fixed
link latencies. If the oracle's walk matches the measured walk, the error is in the op
and message costs; if it is short, the workers wait longer than the dependencies and
latency the simulator walks say. Per plan it also reports each worker's busy and idle
(blocked in receives) time and the receives that waited with their mean hop latency
(:func:`meshplace.profile.calibrate.waited_hops`) by how long the reader had waited.

Session 46 (2-core VM, nmt-small, docs/runtime.md): the oracle's walk was short by 4-17 %
for the plans whose two workers wait on each other (m_etf, m_sct, metis, expert) and
over by 1-22 % for m_topo's (one worker sends, the other receives) in two runs; the hop
latency rose with the reader's wait (~60-180 µs after waits under 100 µs, 140-340 µs
after 0.3-1 ms, 240-900 µs after 1-3 ms).

Usage: ``python benchmarks/fidelity_oracle.py [--model nmt-small]
[--placers m_etf,m_topo,m_sct,metis,expert] [--steps 10] [--warmup 3]
[--out results/fidelity_oracle.json]`` (about 2 minutes for nmt-small).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from meshplace.provenance import write_result

LATENCIES_S = (0.0, 1e-4, 2e-4, 4e-4, 8e-4)
WAIT_BINS_S = (1e-4, 3e-4, 1e-3, 3e-3, float("inf"))


def measured_op_times(step: Any, timelines: list, warmup: int) -> np.ndarray:
    """Per timed step (after ``warmup``) and OpGraph op, the summed spans (from the
    previous event's end) of the fx nodes that make it; 0 for an op no node ran."""
    nodes = list(step.gm.graph.nodes)
    node_op = [step.node_op.get(n.name) for n in nodes]
    steps = min(len(worker) for worker in timelines)
    times = np.zeros((steps - warmup, step.graph.num_ops))
    for worker in timelines:
        for s in range(warmup, steps):
            prev = 0.0
            for node, _start, end in worker[s]:
                if node >= 0 and node_op[node] is not None:
                    times[s - warmup, node_op[node]] += end - prev
                prev = end
    return times


def hops_by_wait(timelines: list, warmup: int, value_bytes: dict, bandwidth: float) -> list:
    """``[upper end of the wait bin, hops, mean latency]`` of the receives that waited
    (:func:`meshplace.profile.calibrate.waited_hops`), binned by how long the reader had
    waited when the value's node ended."""
    from meshplace.profile.calibrate import waited_hops

    hops = waited_hops(timelines, warmup, value_bytes, bandwidth)
    which = np.searchsorted(np.array(WAIT_BINS_S), np.array([w for w, _ in hops]), side="left")
    lat = np.array([latency for _, latency in hops])
    return [
        [
            upper,
            int((which == b).sum()),
            float(lat[which == b].mean()) if (which == b).any() else None,
        ]
        for b, upper in enumerate(WAIT_BINS_S)
    ]


def run_plan(cal: Any, step: Any, placer: str, devices: list[str], steps: int, warmup: int) -> dict:
    from meshplace.profile.calibrate import (
        charge_messages,
        node_value_bytes,
        runtime_messages,
        runtime_order,
    )
    from meshplace.runtime.executor import run_placement
    from meshplace.sim.simulator import Simulator

    predicted = cal.predict(step.graph, devices)
    run = run_placement(
        None, devices, warmup + steps, warmup=warmup, step=step, start_method="fork", timeline=True
    )
    timelines = run.timelines
    measured_ops = measured_op_times(step, timelines, warmup)
    situ = cal.messages["in_situ"]
    free = dataclasses.replace(cal.cost_model, message_cpu={})

    def oracle(cluster: Any) -> float:
        """The median over the timed steps of the walk simulated with that step's own op
        times (a median of per-op medians would drop each op's slow steps)."""
        sim = Simulator(
            step.graph,
            cluster,
            free,
            in_order=True,
            order=runtime_order(step),
            latency_overlaps=cal.latency_overlaps,
        )
        placement = sim.placement_of(devices)
        msgs = runtime_messages(step, placement)
        # the ops at their measured spans (sends included); each receive the quick receive
        costs = {**cal.messages, "send_s_per_byte": 0.0}
        recv = charge_messages(step.graph.num_ops, msgs, 0.0, float(situ["recv_s"]), costs)
        modeled = sim.op_times(placement)
        walks = [
            float(sim.simulate(placement, extra_time=times - modeled + recv).op_end.max())
            for times in measured_ops
        ]
        return statistics.median(walks)

    busy: dict[int, list[float]] = {}
    idle: dict[int, list[float]] = {}
    for w, worker in enumerate(timelines):
        for spans in worker[warmup:]:
            prev = b = i = 0.0
            for node, start, end in spans:
                if node >= 0:
                    b += end - prev
                else:
                    i += end - start
                prev = end
            busy.setdefault(w, []).append(b)
            idle.setdefault(w, []).append(i)
    walk_ends = [
        max(worker[s][-1][2] for worker in timelines if worker[s])
        for s in range(warmup, warmup + steps)
    ]
    bins = hops_by_wait(timelines, warmup, node_value_bytes(step), float(cal.link["bandwidth"]))
    return {
        "placement": placer,
        "workers_used": len(set(devices)),
        "messages": run.messages,
        "measured_step_s": run.step_time_s,
        "measured_walk_s": statistics.median(walk_ends),
        "predicted_step_s": predicted,
        "oracle_walk_s": oracle(cal.simulated_cluster()),
        "oracle_walk_by_link_latency_s": {
            str(lat): oracle(cal.cluster.with_link_latency(lat)) for lat in LATENCIES_S
        },
        "measured_op_sum_s": float(np.median(measured_ops.sum(axis=1))),
        "busy_s": [statistics.median(busy[w]) for w in sorted(busy)],
        "idle_s": [statistics.median(idle[w]) for w in sorted(idle)],
        "waited_hops_by_reader_wait": bins,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nmt-small")
    parser.add_argument("--placers", default="m_etf,m_topo,m_sct,metis,expert")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results/fidelity_oracle.json")
    )
    args = parser.parse_args(argv)

    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import calibrate, calibrate_in_situ
    from meshplace.runtime.program import ModelSpec, trace_step

    step = trace_step(ModelSpec(args.model, batch=8))
    cal = calibrate(step)
    situ = calibrate_in_situ(cal)
    names = cal.cluster.device_names
    problem = PlacementProblem(step.graph, cal.cluster, simulator=cal.simulator())
    rows = []
    for placer in args.placers.split(","):
        result = run_placer(placer, problem, args.budget, 0)
        devices = [names[i] for i in result.op_devices.tolist()]
        row = run_plan(cal, step, placer, devices, args.steps, args.warmup)
        rows.append(row)
        oracle_error = row["oracle_walk_s"] / row["measured_walk_s"] - 1
        print(
            f"  {placer:10} walk measured {row['measured_walk_s'] * 1e3:8.2f} ms  oracle "
            f"{row['oracle_walk_s'] * 1e3:8.2f} ms ({100 * oracle_error:+6.1f} %)"
            f"  step measured {row['measured_step_s'] * 1e3:8.2f}  predicted "
            f"{row['predicted_step_s'] * 1e3:8.2f} ms",
            file=sys.stderr,
        )
    write_result(
        args.out,
        {
            "model": args.model,
            "in_situ": {k: v for k, v in situ.items() if k not in ("probes", "exchanges")},
            "plans": rows,
        },
    )
    print("\n| plan | measured walk (ms) | oracle walk (ms) | oracle error | prediction error |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        walk, oracle_walk = row["measured_walk_s"], row["oracle_walk_s"]
        error = row["predicted_step_s"] / row["measured_step_s"] - 1
        print(
            f"| {row['placement']} | {walk * 1e3:.1f} | {oracle_walk * 1e3:.1f} "
            f"| {100 * (oracle_walk / walk - 1):+.1f} % | {100 * error:+.1f} % |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
