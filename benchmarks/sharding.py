"""Captured-graph sharding vs the named-dimension layout search, and vs the Megatron-style grid.

Part ``cross`` — issue 14's cross-check: for the models both paths know (Transformer base,
GPT-2 1.5B, Mesh-TensorFlow's 5B LM), the best step time of
:func:`meshplace.parallel.search.shard_graph` (the integer program on the captured graph,
forward under bf16 autocast) beside :func:`meshplace.mesh.search.search` (the hand-written
programs, built with ``kernels="pytorch-fused"`` so that they describe the kernels the
captured model runs under ``torch.compile``: FlashAttention, autocast's weight and
activation casts, biases inside ``addmm``, point-wise chains fused as the captured graph's
``compute="fused"`` fuses them) on one fixed mesh, with both searches' seconds.
**Simulated** step times from meshplace's cost models, not measurements. Both overlap
gradient reductions with backward and weight gathers with forward. The searches' spaces
differ (the captured graph also offers ZeRO-3 and a ZeRO stage per parameter, the programs
weight-update sharding for all or none), so the table also costs the *same layout* on both
paths: the captured graph with every named dimension pinned to the program's best rules
(``pin_inputs``; dimensions the captured parameters do not name, such as ``heads`` inside a
fused projection, stay free) and, for Mesh-TensorFlow's 5B model, its hand layout on 16x32
chips (``meshplace.mesh.search.hand_layout``).

Part ``grid`` — the solver against the configurations users search by hand: for GPT
1.5B / 6.7B / 13B on 1, 4 and 8 hosts of 8 H100s (global batch 4 sequences of 1024 tokens
per GPU, forward under bf16 autocast, Adam) and Mesh-TensorFlow's 5B model on 512 TPU-v3
chips (its own batch), the best point of :func:`meshplace.parallel.grid.megatron_grid`
(data x tensor parallel degrees x one ZeRO stage; tensor parallelism inside a host) beside
:func:`meshplace.parallel.search.shard_graph` over every 1- and 2-axis mesh — both scored
by the same cost model and memory limit, with memory per device and search seconds.

Part ``models`` — issue 14's first acceptance item as a user runs it: ``meshplace shard
MODEL --method graph --json`` (a subprocess each, the command exactly as typed) for every
reference workload at its default size and ``examples/llama.py:build_tiny``, on
``dgx-h100`` (8 H100s), ``h4-8xh100`` (32) and ``tpu-v3-pod --chips 512``: the mesh chosen,
step time, memory per device against capacity, the solver's status on that mesh, the ops
no rule covers, the search's seconds (capture excluded) and the command's wall seconds, or
the one sentence it exits 2 with.

Writes ``benchmarks/results/sharding.json`` (cross), ``benchmarks/results/sharding_grid.json``
(grid) and ``benchmarks/results/sharding_models.json`` (models) and prints Markdown tables.

Usage::

    .venv/bin/python benchmarks/sharding.py [--part cross|grid|models|all] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from meshplace.graph.capture import capture
from meshplace.hardware import load_cluster
from meshplace.mesh.program import program_for
from meshplace.mesh.search import evaluate_layout, hand_layout, search
from meshplace.models import available, get
from meshplace.parallel.grid import megatron_grid
from meshplace.parallel.search import shard_graph
from meshplace.parallel.sharding import ShardingError
from meshplace.provenance import write_result

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CASES = [
    # (workload, size, cluster, mesh, chips)
    ("transformer", "base", "dgx-h100", (2, 4), 8),
    ("gpt", "1.5b", "dgx-h100", (2, 4), 8),
    ("transformer", "mtf-5b", "tpu-v3-pod", (16, 32), 512),
]
GRID_CASES = [
    # (workload, size, cluster, chips, batch: None for the workload's own)
    *[
        ("gpt", size, f"h{hosts}-8xh100", 8 * hosts, 4 * 8 * hosts)
        for size in ("1.5b", "6.7b", "13b")
        for hosts in (1, 4, 8)
    ],
    ("transformer", "mtf-5b", "tpu-v3-pod", 512, None),
]


MODEL_CLUSTERS = [
    # (cluster, chips: None for all its accelerators)
    ("dgx-h100", None),
    ("h4-8xh100", None),
    ("tpu-v3-pod", 512),
]


def model_row(model: str, cluster: str, chips: int | None) -> dict:
    """One ``meshplace shard MODEL --method graph --json`` run, summarised."""
    executable = str(Path(sys.executable).with_name("meshplace"))  # the venv's entry point
    command = [executable, "shard", model, "--cluster", cluster]
    command += ["--method", "graph", "--json"] + (["--chips", str(chips)] if chips else [])
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    row: dict = {
        "model": model,
        "cluster": cluster,
        "chips": chips,
        "command": "meshplace " + " ".join(command[1:]),
        "exit_code": done.returncode,
        "wall_s": time.perf_counter() - t0,
    }
    if done.returncode != 0:
        row["message"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        return row
    data = json.loads(done.stdout)
    row.update(
        ops=data["ops"],
        chips=data["chips"],
        mesh=data["mesh"]["shape"],
        step_time_s=data["step_time_s"],
        peak_memory_bytes=data["peak_memory_bytes"],
        memory_capacity_bytes=data["memory_capacity_bytes"],
        fits=data["fits"],
        solver_status=data["solver"]["status"],
        solver_s=data["solver"]["seconds"],
        search_s=data["search"]["seconds"],
        meshes=len(data["search"]["mesh_shapes"]),
        replicated_ops=data["replicated_ops"],
    )
    return row


def print_header(columns: str, numeric: str) -> None:
    """A Markdown table's header: ``columns`` separated by ``|``; ``numeric`` one letter
    per column, ``r`` for right-aligned numbers, ``l`` for text."""
    names = [c.strip() for c in columns.split("|")]
    print("| " + " | ".join(names) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in numeric) + "|")


def print_models(rows: list[dict]) -> None:
    print_header(
        "model | cluster (chips) | ops | mesh | step | GiB/dev (capacity) | solver on that mesh"
        " | meshes | search s | command s | ops no rule covers",
        "llrlrrlrrrl",
    )
    for r in rows:
        where = f"{r['cluster']} ({r['chips']})"
        if r["exit_code"] != 0:
            print(f"| {r['model']} | {where} | | exit {r['exit_code']}: {r['message']} |||||||")
            continue
        kinds = sorted({n.rstrip("_0123456789") or n for n in r["replicated_ops"]})
        print(
            f"| {r['model']} | {where} | {r['ops']:,} | {'x'.join(map(str, r['mesh']))}"
            f" | {r['step_time_s'] * 1e3:.2f} ms | {r['peak_memory_bytes'] / 2**30:.2f}"
            f" ({r['memory_capacity_bytes'] / 2**30:.0f}) | {r['solver_status']}"
            f" | {r['meshes']} | {r['search_s']:.1f} | {r['wall_s']:.1f}"
            f" | {len(r['replicated_ops'])}{' (' + ', '.join(kinds) + ')' if kinds else ''} |"
        )


def pinned_like(graph, rules: dict[str, str], zero: bool) -> dict:
    """Keyword arguments of ``shard_graph`` that fix the captured graph's named dimensions
    to a program's rules (unnamed ones whole) and its weight-update sharding."""
    names = {
        n
        for o in graph.ops
        if o.kind in ("parameter", "input") and o.dim_names
        for n in o.dim_names[0]
        if n
    }
    return {
        "pinned": {n: rules.get(n) for n in sorted(names)},
        "zero_stages": (2,) if zero else (0,),
    }


def one(workload: str, size: str, cluster_name: str, mesh: tuple[int, ...], chips: int) -> dict:
    cluster = load_cluster(cluster_name)
    # the program lowered as the captured PyTorch model runs (FlashAttention, autocast's
    # casts, biases in addmm, point-wise chains fused like compute="fused"): both paths
    # cost the same computation
    program = program_for(workload, size=size, kernels="pytorch-fused")
    t0 = time.perf_counter()
    named = search(program, cluster, chips=chips, mesh_shape=mesh).best
    named_s = time.perf_counter() - t0
    # and as PyTorch eager runs it, against the captured graph's compute="eager"
    eager_program = program_for(workload, size=size, kernels="pytorch")
    named_eager = search(eager_program, cluster, chips=chips, mesh_shape=mesh).best
    w = get(workload, size=size)
    t0 = time.perf_counter()
    graph = capture(w.model, w.example_inputs, training=True, dims=w.dims, autocast="bf16")
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    captured = shard_graph(graph, cluster, chips=chips, mesh_shape=mesh).best
    search_s = time.perf_counter() - t0
    fused = shard_graph(graph, cluster, chips=chips, mesh_shape=mesh, compute="fused").best
    same = shard_graph(
        graph,
        cluster,
        chips=chips,
        mesh_shape=mesh,
        compute="fused",
        **pinned_like(graph, named.rules, named.weight_update_sharding),
    ).best
    hand = None
    if (workload, size) == ("transformer", "mtf-5b"):
        shape, rules = hand_layout(program, chips)
        hand_program = evaluate_layout(program, cluster, shape, rules)
        hand_graph = shard_graph(
            graph,
            cluster,
            chips=chips,
            mesh_shape=shape,
            compute="fused",
            **pinned_like(graph, rules, False),
        ).best
        hand = {
            "hand_rules": ", ".join(f"{k}:{v}" for k, v in sorted(rules.items())),
            "hand_program_step_s": hand_program.step_time_s,
            "hand_graph_step_s": hand_graph.step_time_s,
            "hand_ratio": hand_graph.step_time_s / hand_program.step_time_s,
        }
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
        "graph_exposed_comm_s": captured.exposed_communication_s,
        "graph_peak_bytes": captured.peak_memory_bytes,
        "graph_status": captured.status,
        "graph_capture_s": capture_s,
        "graph_search_s": search_s,
        "program_eager_step_s": named_eager.step_time_s,
        "ratio": captured.step_time_s / named_eager.step_time_s,
        "program_compute_s": sum(named.compute_s.values()),
        "program_exposed_comm_s": named.exposed_comm_s,
        "fused_step_s": fused.step_time_s,
        "fused_compute_s": fused.compute_s,
        "fused_comm_s": fused.communication_s,
        "fused_exposed_comm_s": fused.exposed_communication_s,
        "fused_ratio": fused.step_time_s / named.step_time_s,
        "same_layout_step_s": same.step_time_s,
        "same_layout_ratio": same.step_time_s / named.step_time_s,
        **(hand or {}),
    }


def grid_row(workload: str, size: str, cluster_name: str, chips: int, batch: int | None) -> dict:
    cluster = load_cluster(cluster_name)
    w = get(workload, size=size) if batch is None else get(workload, size=size, batch=batch)
    graph = capture(w.model, w.example_inputs, training=True, dims=w.dims, autocast="bf16")
    grid = megatron_grid(graph, cluster, chips=chips)
    t0 = time.perf_counter()
    solver = shard_graph(graph, cluster, chips=chips)
    solver_s = time.perf_counter() - t0
    row: dict = {
        "model": f"{workload} {size}",
        "cluster": cluster_name,
        "chips": chips,
        "batch": w.example_inputs[0].shape[0],
        "graph_ops": graph.num_ops,
        "grid_points": [
            {
                "dp": p.dp,
                "tp": p.tp,
                "zero": p.zero,
                "step_s": p.plan.step_time_s if p.plan else None,
                "peak_bytes": p.plan.peak_memory_bytes if p.plan else None,
                "fits": p.fits,
                "reason": p.reason,
            }
            for p in grid.points
        ],
        "grid_search_s": grid.seconds,
        "solver_search_s": solver_s,
    }
    try:
        best = grid.best
    except ShardingError as exc:  # no grid point fits: the row says so
        row.update(grid_best=None, grid_step_s=None, grid_peak_bytes=None, grid_reason=str(exc))
    else:
        assert best.plan is not None
        row.update(
            grid_best=best.label,
            grid_mesh=best.plan.mesh.label,
            grid_step_s=best.plan.step_time_s,
            grid_peak_bytes=best.plan.peak_memory_bytes,
        )
    plan = solver.best
    row.update(
        solver_mesh=plan.mesh.label,
        solver_step_s=plan.step_time_s,
        solver_peak_bytes=plan.peak_memory_bytes,
        solver_fits=plan.fits,
        solver_status=plan.status,
        capacity_bytes=plan.capacity_bytes,
        solver_zero=sorted({p["zero"] for p in plan.parameters().values()}),
        gain=(row["grid_step_s"] / plan.step_time_s - 1) if row["grid_step_s"] else None,
    )
    return row


def print_grid(rows: list[dict]) -> None:
    print_header(
        "model | cluster | batch | best grid plan | grid step | grid GiB/dev | solver mesh"
        " | solver step | solver GiB/dev | gain | grid s | solver s",
        "llrlrrlrrrrr",
    )
    for r in rows:
        grid = (
            f"{r['grid_best']} ({r['grid_mesh']}) | {r['grid_step_s'] * 1e3:.1f} ms"
            f" | {r['grid_peak_bytes'] / 2**30:.1f}"
            if r["grid_step_s"]
            else "nothing fits | - | -"
        )
        gain = f"{r['gain'] * 100:+.1f} %" if r["gain"] is not None else "-"
        print(
            f"| {r['model']} | {r['cluster']} | {r['batch']} | {grid} | {r['solver_mesh']}"
            f" | {r['solver_step_s'] * 1e3:.1f} ms | {r['solver_peak_bytes'] / 2**30:.1f}"
            f" | {gain} | {r['grid_search_s']:.1f} | {r['solver_search_s']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cross", "grid", "models", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="the first case of each part only")
    args = parser.parse_args()
    if args.part in ("grid", "all"):
        grid_rows = [grid_row(*c) for c in (GRID_CASES[:1] if args.quick else GRID_CASES)]
        write_result(RESULTS / "sharding_grid.json", grid_rows)
        print_grid(grid_rows)
        print()
    if args.part in ("models", "all"):
        models = [*available(), "examples/llama.py:build_tiny"]
        cases = [(m, c, n) for m in models for c, n in MODEL_CLUSTERS]
        model_rows = [model_row(*c) for c in (cases[:1] if args.quick else cases)]
        write_result(RESULTS / "sharding_models.json", model_rows)
        print_models(model_rows)
        print()
    if args.part in ("grid", "models"):
        return
    rows = [one(*case) for case in (CASES[:1] if args.quick else CASES)]
    write_result(RESULTS / "sharding.json", rows)
    print_header(
        "model | cluster | mesh | program step (compute + exposed comm) | program rules"
        " | program, eager kernels | captured, eager (compute + exposed comm)"
        " | eager / program eager | captured, fused"
        " (compute + exposed comm) | fused / program | captured, fused, program's layout"
        " | same layout / program | peak GiB (program / captured) | capture s | ILP search s",
        "lllrlrrrrrrrrrr",
    )
    for r in rows:
        print(
            f"| {r['model']} | {r['cluster']} | {r['mesh']} | {r['program_step_s'] * 1e3:.2f} ms"
            f" ({r['program_compute_s'] * 1e3:.2f} + {r['program_exposed_comm_s'] * 1e3:.2f})"
            f" | {r['program_rules']}{' +WUS' if r['program_wus'] else ''}"
            f" | {r['program_eager_step_s'] * 1e3:.2f} ms"
            f" | {r['graph_step_s'] * 1e3:.2f} ms ({r['graph_compute_s'] * 1e3:.2f} + "
            f"{r['graph_exposed_comm_s'] * 1e3:.2f}) | {r['ratio']:.2f}x"
            f" | {r['fused_step_s'] * 1e3:.2f} ms ({r['fused_compute_s'] * 1e3:.2f} + "
            f"{r['fused_exposed_comm_s'] * 1e3:.2f}) | {r['fused_ratio']:.2f}x"
            f" | {r['same_layout_step_s'] * 1e3:.2f} ms | {r['same_layout_ratio']:.2f}x"
            f" | {r['program_peak_bytes'] / 2**30:.2f} / {r['graph_peak_bytes'] / 2**30:.2f}"
            f" | {r['graph_capture_s']:.1f} | {r['graph_search_s']:.1f} |"
        )
    for r in rows:
        if "hand_rules" in r:
            print(
                f"\nHand layout of {r['model']} ({r['hand_rules']}, no weight-update sharding): "
                f"program {r['hand_program_step_s'] * 1e3:.2f} ms, captured graph (fused) "
                f"{r['hand_graph_step_s'] * 1e3:.2f} ms = {r['hand_ratio']:.2f}x"
            )


if __name__ == "__main__":
    main()
