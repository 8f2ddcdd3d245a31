"""Captured-graph sharding vs the named-dimension layout search, on the same mesh and cluster.

Issue 14's cross-check: for the models both paths know (Transformer base, GPT-2 1.5B,
Mesh-TensorFlow's 5B LM), the best step time of :func:`meshplace.parallel.search.shard_graph`
(the integer program on the captured graph, forward under bf16 autocast like the programs'
bf16 activations) beside :func:`meshplace.mesh.search.search` (the hand-written programs) on
one fixed mesh, with both searches' seconds. **Simulated** step times from meshplace's cost
models, not measurements. The two objectives still differ in one known way: the program
search overlaps gradient reduction with backward; the captured-graph step is compute plus
communication with no overlap (docs/parallel.md) — the table reports both, not a verdict.

Writes ``benchmarks/results/sharding.json`` and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/sharding.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from meshplace.graph.capture import capture
from meshplace.hardware import load_cluster
from meshplace.mesh.program import program_for
from meshplace.mesh.search import search
from meshplace.models import get
from meshplace.parallel.search import shard_graph
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
CASES = [
    # (workload, size, cluster, mesh, chips)
    ("transformer", "base", "dgx-h100", (2, 4), 8),
    ("gpt", "1.5b", "dgx-h100", (2, 4), 8),
    ("transformer", "mtf-5b", "tpu-v3-pod", (16, 32), 512),
]


def one(workload: str, size: str, cluster_name: str, mesh: tuple[int, ...], chips: int) -> dict:
    cluster = load_cluster(cluster_name)
    program = program_for(workload, size=size)
    t0 = time.perf_counter()
    named = search(program, cluster, chips=chips, mesh_shape=mesh).best
    named_s = time.perf_counter() - t0
    w = get(workload, size=size)
    t0 = time.perf_counter()
    graph = capture(w.model, w.example_inputs, training=True, dims=w.dims, autocast="bf16")
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    captured = shard_graph(graph, cluster, chips=chips, mesh_shape=mesh).best
    search_s = time.perf_counter() - t0
    return {
        "model": f"{workload} {size}",
        "cluster": cluster_name,
        "mesh": "x".join(map(str, mesh)),
        "program_step_s": named.step_time_s,
        "program_rules": named.rules_label(),
        "program_wus": named.weight_update_sharding,
        "program_peak_bytes": named.peak_memory_bytes,
        "program_search_s": named_s,
        "graph_ops": graph.num_ops,
        "graph_step_s": captured.step_time_s,
        "graph_compute_s": captured.compute_s,
        "graph_comm_s": captured.communication_s,
        "graph_peak_bytes": captured.peak_memory_bytes,
        "graph_status": captured.status,
        "graph_capture_s": capture_s,
        "graph_search_s": search_s,
        "ratio": captured.step_time_s / named.step_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first case only")
    args = parser.parse_args()
    rows = [one(*case) for case in (CASES[:1] if args.quick else CASES)]
    write_result(RESULTS / "sharding.json", rows)
    print(
        "| model | cluster | mesh | program step | program rules | captured step "
        "(compute + comm) | captured / program | peak GiB (program / captured) | "
        "capture s | ILP search s |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['cluster']} | {r['mesh']} | {r['program_step_s'] * 1e3:.2f} ms"
            f" | {r['program_rules']}{' +WUS' if r['program_wus'] else ''}"
            f" | {r['graph_step_s'] * 1e3:.2f} ms ({r['graph_compute_s'] * 1e3:.2f} + "
            f"{r['graph_comm_s'] * 1e3:.2f}) | {r['ratio']:.2f}x"
            f" | {r['program_peak_bytes'] / 2**30:.2f} / {r['graph_peak_bytes'] / 2**30:.2f}"
            f" | {r['graph_capture_s']:.1f} | {r['graph_search_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
