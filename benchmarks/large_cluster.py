"""Large hand-written clusters: load a 10,000-device YAML cluster and simulate a 5-op plan.

Issue 13 found that the simulator built all n² routes before its first simulation: a
hand-written cluster of 1,000 devices took 39 s, 3,000 devices 282 s and 10,000 never
finished, even for a 5-op plan on one device. Routes are now computed per device pair a
plan uses (``meshplace.sim.simulator``, ``Cluster.route``), so the target is a 10,000-device
YAML cluster simulated in under 10 s, end to end, through the command line.

The cluster is written here, in a temp folder, the way a user would write one by hand or
from a script (the YAML format of ``docs/clusters.md``; no ``topology:`` generator, so
routes are shortest paths, not arithmetic): ``hosts`` hosts of 8 A100s, every GPU linked to
its host's NVSwitch, every NVSwitch to one network switch. A hand-written 5-op graph
(``docs/formats.md``) is placed by two plans: ``one-device`` (every op on the last GPU: no
transfer, no route) and ``five-hosts`` (each op on a GPU of a different host: four routes,
one Dijkstra per source device).

Each scenario runs through the command line (``meshplace simulate --graph g.json --cluster
c.yaml --plan p.json --json``: wall time of the whole process, imports included) and
through the library (load the cluster, load the graph and plan, build the Simulator,
simulate: each stage timed). The results agree (same step time). Writes
``benchmarks/results/large_cluster.json`` stamped with the git commit and the command, and
prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/large_cluster.py [--hosts 1250] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshplace.graph.io import load_graph
from meshplace.hardware import load_cluster
from meshplace.plan import Plan, load_plan, save_plan
from meshplace.sim.simulator import Simulator
from meshplace.util import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GPUS_PER_HOST = 8
TARGET_S = 10.0


def cluster_yaml(hosts: int) -> str:
    """A hand-written style cluster file: one line per device and per link."""
    lines = [
        "format: meshplace.cluster",
        "version: 1",
        f"name: lab-{hosts * GPUS_PER_HOST}",
        "kind: multi-host",
        "source: benchmarks/large_cluster.py (A100 NVSwitch hosts on one network switch)",
        "meta: {written_by: benchmarks/large_cluster.py}",
        "devices:",
    ]
    for h in range(hosts):
        for g in range(GPUS_PER_HOST):
            lines.append(f"  - {{name: h{h}/gpu{g}, kind: a100, host: h{h}}}")
    lines.append("switches:")
    lines.append("  - network")
    lines.extend(f"  - h{h}/nvswitch" for h in range(hosts))
    lines.append("links:")
    for h in range(hosts):
        for g in range(GPUS_PER_HOST):
            lines.append(
                f"  - {{src: h{h}/gpu{g}, dst: h{h}/nvswitch, bandwidth: 300 GB/s, "
                "latency: 0.5 us, kind: nvlink}"
            )
        lines.append(
            f"  - {{src: h{h}/nvswitch, dst: network, bandwidth: 25 GB/s, latency: 5 us, "
            "kind: network}"
        )
    return "\n".join(lines) + "\n"


def graph_json() -> str:
    """Five ops: an input and a parameter feeding a matmul, a ReLU and a loss."""
    mib = 2**20
    return json.dumps(
        {
            "format": "meshplace.opgraph",
            "version": 1,
            "name": "five-ops",
            "meta": {"batch": 64},
            "ops": [
                {"name": "x", "kind": "input", "output_shapes": [[64, 1024]]},
                {
                    "name": "w",
                    "kind": "parameter",
                    "output_shapes": [[1024, 1024]],
                    "param_bytes": 4 * mib,
                },
                {
                    "name": "mm",
                    "kind": "matmul",
                    "flops": 2 * 64 * 1024 * 1024,
                    "output_shapes": [[64, 1024]],
                },
                {"name": "relu", "kind": "elementwise", "flops": 64 * 1024},
                {"name": "loss", "kind": "loss", "flops": 64 * 1024},
            ],
            "edges": [
                {"src": "x", "dst": "mm", "bytes": 256 * 1024},
                {"src": "w", "dst": "mm", "bytes": 4 * mib},
                {"src": "mm", "dst": "relu", "bytes": 256 * 1024},
                {"src": "relu", "dst": "loss", "bytes": 256 * 1024},
            ],
        },
        indent=1,
    )


def plans(hosts: int) -> dict[str, dict[str, str]]:
    ops = ["x", "w", "mm", "relu", "loss"]
    last = f"h{hosts - 1}/gpu{GPUS_PER_HOST - 1}"
    spread = {op: f"h{(k * (hosts - 1)) // 4}/gpu{k % GPUS_PER_HOST}" for k, op in enumerate(ops)}
    return {"one-device": dict.fromkeys(ops, last), "five-hosts": spread}


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return commit + ("+dirty" if dirty.stdout.strip() else "")


def run_library(folder: Path, plan_file: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    cluster = load_cluster(folder / "c.yaml")
    t1 = time.perf_counter()
    graph = load_graph(folder / "g.json")
    plan = load_plan(plan_file)
    placement = plan.device_indices(
        graph, {d.name: i for i, d in enumerate(cluster.devices)}, cluster.name, str(plan_file)
    )
    t2 = time.perf_counter()
    sim = Simulator(graph, cluster)
    t3 = time.perf_counter()
    result = sim.simulate(placement)
    t4 = time.perf_counter()
    times.update(
        load_cluster_s=t1 - t0,
        load_graph_and_plan_s=t2 - t1,
        simulator_s=t3 - t2,
        simulate_s=t4 - t3,
        total_s=t4 - t0,
        step_time_s=result.step_time_s,
        transfers=len(result.transfer_bytes),
    )
    return times


def run_cli(folder: Path, plan_file: Path) -> dict[str, float]:
    exe = Path(sys.executable).with_name("meshplace")
    argv = [str(exe), "simulate", "--graph", str(folder / "g.json")]
    argv += ["--cluster", str(folder / "c.yaml"), "--plan", str(plan_file), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"meshplace simulate failed ({proc.returncode}): {proc.stderr.strip()}")
    out = json.loads(proc.stdout)
    return {"wall_s": wall, "step_time_s": out["step_time_s"], "transfers": out["transfers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1250, help="hosts of 8 GPUs (1250: 10,000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (median)")
    args = parser.parse_args()
    devices = args.hosts * GPUS_PER_HOST
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshplace-large-cluster-") as tmp:
        folder = Path(tmp)
        (folder / "c.yaml").write_text(cluster_yaml(args.hosts))
        (folder / "g.json").write_text(graph_json())
        graph = load_graph(folder / "g.json")
        for name, placement in plans(args.hosts).items():
            plan_file = folder / f"{name}.plan.json"
            save_plan(Plan.for_graph(graph, f"lab-{devices}", placement), plan_file)
            lib = [run_library(folder, plan_file) for _ in range(args.repeats)]
            cli = [run_cli(folder, plan_file) for _ in range(args.repeats)]
            if {r["step_time_s"] for r in lib} != {c["step_time_s"] for c in cli}:
                raise SystemExit(f"{name}: library and command line disagree on the step time")
            row = {
                "scenario": name,
                "devices": devices,
                "links": 2 * args.hosts * (GPUS_PER_HOST + 1),
                "ops": graph.num_ops,
                "devices_used": len(set(placement.values())),
                "transfers": int(lib[0]["transfers"]),
                "step_time_s": lib[0]["step_time_s"],
                "cli_wall_s": statistics.median(c["wall_s"] for c in cli),
                "cli_wall_s_runs": [c["wall_s"] for c in cli],
                "under_target": statistics.median(c["wall_s"] for c in cli) < TARGET_S,
            }
            for key in ("load_cluster_s", "load_graph_and_plan_s", "simulator_s", "simulate_s"):
                row[f"library_{key}"] = statistics.median(r[key] for r in lib)
            row["library_total_s"] = statistics.median(r["total_s"] for r in lib)
            rows.append(row)
            print(
                f"{name}: command line {row['cli_wall_s']:.2f} s, library "
                f"{row['library_total_s']:.2f} s",
                flush=True,
            )
    record = {
        "benchmark": "large_cluster",
        "command": " ".join(["python", *sys.argv]),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "target_s": TARGET_S,
        "repeats": args.repeats,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    write_text_atomic(RESULTS / "large_cluster.json", json.dumps(record, indent=2) + "\n")
    print()
    print(
        "| scenario | devices | links | ops | transfers | CLI wall s | library: load cluster s "
        "| graph+plan s | Simulator s | simulate s | total s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['devices']:,} | {r['links']:,} | {r['ops']} "
            f"| {r['transfers']} | {r['cli_wall_s']:.2f} | {r['library_load_cluster_s']:.2f} "
            f"| {r['library_load_graph_and_plan_s']:.3f} | {r['library_simulator_s']:.3f} "
            f"| {r['library_simulate_s']:.3f} | {r['library_total_s']:.2f} |"
        )
    print(f"\ncommit {record['commit']}; command: {record['command']}")


if __name__ == "__main__":
    main()
