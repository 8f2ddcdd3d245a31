"""Simulator speed: simulated ops per second on the largest reference training graphs.

For each (graph, cluster) pair: build the Simulator once (op times, route table), compile
once (numba, not timed), then time ``simulate`` on fresh random placements — a new
placement per run, so nothing is cached between runs — and report the median of the runs.
numba runs the event loop on one thread, so this is one core's speed.

Writes ``benchmarks/results/simulator_speed.json`` and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/simulator_speed.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster, torus
from meshplace.provenance import write_result
from meshplace.sim.simulator import Simulator

RESULTS = Path(__file__).resolve().parent / "results"
GRAPHS = [("nmt", "4layer"), ("nmt", "2layer"), ("gpt", "1.5b"), ("inception_v3", "default")]


def clusters():
    return {
        "colocrl-4gpu": load_cluster("colocrl-4gpu"),
        "h8-8xa100 (80 devices)": load_cluster("h8-8xa100"),
        "tpu-v3 8x8 torus (64 chips)": torus((8, 8)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per pair (median)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    built = clusters()
    for name, size in GRAPHS:
        graph = workload_graph(name, size=size)
        for cname, cluster in built.items():
            t0 = time.perf_counter()
            sim = Simulator(graph, cluster)
            setup = time.perf_counter() - t0
            sim.simulate(rng.integers(0, sim.num_devices, graph.num_ops))  # compile/warm up
            times = []
            for _ in range(args.runs):
                placement = rng.integers(0, sim.num_devices, graph.num_ops)
                start = time.perf_counter()
                result = sim.simulate(placement)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            rows.append(
                {
                    "graph": graph.name,
                    "ops": graph.num_ops,
                    "edges": graph.num_edges,
                    "cluster": cname,
                    "devices": sim.num_devices,
                    "runs": args.runs,
                    "median_s": median,
                    "min_s": min(times),
                    "ops_per_s": graph.num_ops / median,
                    "setup_s": setup,
                    "transfers": len(result.transfer_bytes),
                }
            )
            print(f"{graph.name} on {cname}: {graph.num_ops / median:,.0f} ops/s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "simulator_speed.json", rows)
    print()
    print("| graph | ops | cluster | devices | transfers/run | median ms | ops/s | setup s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['graph']} | {r['ops']:,} | {r['cluster']} | {r['devices']} "
            f"| {r['transfers']:,} | {r['median_s'] * 1e3:.2f} | {r['ops_per_s']:,.0f} "
            f"| {r['setup_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
