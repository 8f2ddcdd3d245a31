"""Graphs profiled elsewhere, placed for pipelined throughput on a host with accelerators
whose transfers occupy them (issue 17).

A user of another framework brings a graph with per-op *measured* times per device, tensor
sizes, forward/backward co-location classes that must hold (the hardware keeps an
activation where it was made), parameter bytes and a per-device memory cap — and no FLOPs.
This benchmark writes such graphs in the documented format (``docs/formats.md``: JSON with
``measured_time``, ``colocation`` and ``meta.strict_colocation``) with a generator of its
own, reads them back through ``load_graph`` as a user's file would be, and places them on
a cluster written as a user's YAML (``docs/clusters.md``): one host CPU and four
accelerators behind one switch, ``transfers: occupy`` (no copy engine: each transfer costs
both ends its time, as the FPGA/host and PipeDream evaluators charge it), each accelerator
with a memory cap that the whole model exceeds.

Families (each with a forward op, a backward op and an update op per layer or operator, the
three in one strict class):

* ``chain-N`` — N layers in a chain, the layer-level graphs of the pipeline literature;
* ``cnn-N`` — a stem, then N Inception-style blocks of 3–4 parallel branches of 1–3 convs
  joined by a concat;
* ``bert-N`` — N BERT encoder layers at operator level (layer norms, q/k/v projections in
  parallel, scores, softmax, context, output projection, residuals, a feed-forward pair).

Every plan is scored by the max-load objective — the largest over devices of compute +
incoming + outgoing transfer time. For a graph without batched inputs (its times are one
micro-batch's, and the stream of micro-batches has no end) that is meshplace's throughput
objective, the steady state, and it is what the simulator computes for occupying transfers
(a property test pins it to that closed form), with memory checked
against the cap. The reference is PipeDream's optimal *contiguous* split (runs of one
topological order on the accelerators, no CPU stage: ``pipeline_split(over_ideals=False,
cpu_stage=False)``); ``pipeline`` is meshplace's DP over ideals with the CPU as a possible
stage; every other placer runs with ``--budget``.

Writes ``benchmarks/results/profiled_graphs.json`` (with provenance) and prints a Markdown
table.

Usage::

    .venv/bin/python benchmarks/profiled_graphs.py [--budget 5] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from meshplace.graph.io import load_graph, save_graph
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware.yaml_format import load_cluster_file
from meshplace.placers import PlacementProblem, registry, run_placer
from meshplace.placers.pipeline import pipeline_split
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results" / "profiled_graphs.json"
MB = 2**20
ACCELERATORS = 4
ACCELERATOR = "fpga"


# ------------------------------------------------------------------ the generator
class _Builder:
    """Forward ops with measured times; :meth:`finish` adds the loss, the backward pass
    (edges reversed, plus each forward op's saved activation), the update ops and the
    strict classes."""

    def __init__(self, name: str, seed: int) -> None:
        self.graph = OpGraph(name, meta={"strict_colocation": True, "source": "generated"})
        self.rng = np.random.default_rng(seed)
        self.forward: list[str] = []
        self.inputs: dict[str, list[tuple[str, float]]] = {}

    def op(self, name: str, kind: str, after: list[str], scale: float = 1.0) -> str:
        """A forward op reading ``after``: accelerator time log-normal around ``scale`` ms,
        the CPU 3–12x slower, an output (activation) of 1–16 MB, parameters of up to
        40 MB on matmuls and convs."""
        accel = float(self.rng.lognormal(np.log(scale * 1e-3), 0.5))
        params = int(self.rng.uniform(0, 40) * MB) if kind in ("matmul", "conv") else 0
        self.graph.add_op(
            Op(
                name,
                kind,
                param_bytes=params,
                state_bytes=2 * params,
                memory_bytes=int(self.rng.uniform(1, 16) * MB),
                measured_time={ACCELERATOR: accel, "cpu": accel * float(self.rng.uniform(3, 12))},
                colocation=name,
            )
        )
        self.inputs[name] = []
        for src in after:
            nbytes = float(self.graph.ops[self.graph.index(src)].memory_bytes)
            self.graph.add_edge(src, name, nbytes)
            self.inputs[name].append((src, nbytes))
        self.forward.append(name)
        return name

    def finish(self, last: str) -> OpGraph:
        g = self.graph
        g.add_op(Op("loss", "elementwise", measured_time={ACCELERATOR: 1e-5, "cpu": 5e-5}))
        g.add_edge(last, "loss", 4 * MB)
        grad_of = {"loss": "loss"}
        for name in reversed(self.forward):
            op = g.ops[g.index(name)]
            back = f"{name}.grad"
            g.add_op(
                Op(
                    back,
                    _BACKWARD_KIND.get(op.kind, "elementwise"),
                    phase="backward",
                    measured_time={k: 2 * t for k, t in op.measured_time.items()},
                    memory_bytes=int(sum(b for _, b in self.inputs[name]) or MB),
                    colocation=name,
                    forward_op=name,
                )
            )
            consumers = [d for d in self.forward if any(s == name for s, _ in self.inputs[d])]
            for d in consumers or ["loss"]:
                nbytes = dict(self.inputs.get(d, [])).get(name, 4 * MB)
                g.add_edge(grad_of[d], back, nbytes)  # the gradient of its output
            g.add_edge(name, back, sum(b for _, b in self.inputs[name]) or MB)  # saved input
            grad_of[name] = back
            if op.param_bytes:
                update = f"{name}.update"
                g.add_op(
                    Op(
                        update,
                        "elementwise",
                        phase="update",
                        measured_time={k: 0.1 * t for k, t in op.measured_time.items()},
                        colocation=name,
                    )
                )
                g.add_edge(back, update, op.param_bytes)
        return g


_BACKWARD_KIND = {
    "matmul": "matmul",
    "conv": "conv_grad",
    "layer_norm": "layer_norm_grad",
    "softmax": "softmax_grad",
}


def layer_chain(n: int, seed: int) -> OpGraph:
    b = _Builder(f"chain-{n}", seed)
    last = b.op("layer0", "matmul", [])
    for i in range(1, n):
        last = b.op(f"layer{i}", "matmul", [last])
    return b.finish(last)


def branching_cnn(blocks: int, seed: int) -> OpGraph:
    b = _Builder(f"cnn-{blocks}", seed)
    last = b.op("stem.conv0", "conv", [], 2.0)
    last = b.op("stem.conv1", "conv", [last], 2.0)
    for k in range(blocks):
        ends = []
        for branch in range(int(b.rng.integers(3, 5))):
            x = last
            for depth in range(int(b.rng.integers(1, 4))):
                x = b.op(f"block{k}.b{branch}.conv{depth}", "conv", [x], 0.6)
            ends.append(x)
        last = b.op(f"block{k}.concat", "copy", ends, 0.05)
    return b.finish(b.op("head.fc", "matmul", [last], 0.5))


def bert_like(layers: int, seed: int) -> OpGraph:
    b = _Builder(f"bert-{layers}", seed)
    x = b.op("embed", "matmul", [], 1.0)
    for i in range(layers):
        p = f"layer{i}"
        h = b.op(f"{p}.ln1", "layer_norm", [x], 0.1)
        q, k, v = (b.op(f"{p}.{n}", "matmul", [h], 0.8) for n in "qkv")
        scores = b.op(f"{p}.scores", "matmul", [q, k], 0.5)
        probs = b.op(f"{p}.softmax", "softmax", [scores], 0.2)
        ctx = b.op(f"{p}.context", "matmul", [probs, v], 0.5)
        out = b.op(f"{p}.out", "matmul", [ctx], 0.8)
        x = b.op(f"{p}.add1", "elementwise", [x, out], 0.05)
        h = b.op(f"{p}.ln2", "layer_norm", [x], 0.1)
        up = b.op(f"{p}.ff1", "matmul", [h], 2.0)
        act = b.op(f"{p}.gelu", "elementwise", [up], 0.2)
        down = b.op(f"{p}.ff2", "matmul", [act], 2.0)
        x = b.op(f"{p}.add2", "elementwise", [x, down], 0.05)
    return b.finish(b.op("pooler", "matmul", [x], 0.5))


FAMILIES = {
    "chain": (layer_chain, [48, 177]),
    "cnn": (branching_cnn, [4, 11]),
    "bert": (bert_like, [4, 12]),
}


def cluster_yaml(capacity_bytes: float) -> str:
    """One host CPU and four accelerators behind one switch at 12 GB/s, transfers
    occupying every device, each accelerator holding ``capacity_bytes``."""
    devices = "\n".join(f"  - {{name: acc{i}, kind: {ACCELERATOR}}}" for i in range(ACCELERATORS))
    links = "\n".join(
        f"  - {{src: {d}, dst: switch, bandwidth: 12 GB/s, latency: 5 us, kind: pcie}}"
        for d in ["host", *[f"acc{i}" for i in range(ACCELERATORS)]]
    )
    return f"""name: host-{ACCELERATORS}x{ACCELERATOR}
source: benchmarks/profiled_graphs.py (a host-and-accelerators setting, made up)
transfers: occupy
device_kinds:
  {ACCELERATOR}:
    base: accelerator
    memory_bytes: {int(capacity_bytes)}
devices:
  - {{name: host, kind: xeon}}
{devices}
switches: [switch]
links:
{links}
"""


# ------------------------------------------------------------------------ scoring
def score(problem: PlacementProblem, op_devices: np.ndarray) -> dict[str, Any]:
    sim = problem.simulator.simulate(op_devices, "throughput")
    # these graphs have no batched inputs: the throughput objective is the steady state
    assert sim.throughput_model == "steady state", sim.throughput_model
    return {
        "max_load_s": float(sim.throughput_time_s),
        "oom": bool(sim.oom),
        "devices_used": len(set(op_devices.tolist())),
    }


def run_graph(graph: OpGraph, folder: Path, budget: float, seed: int) -> dict[str, Any]:
    path = folder / f"{graph.name}.json"
    save_graph(graph, path)
    graph = load_graph(path)  # as a user's file is read
    resident = sum(o.param_bytes + o.state_bytes for o in graph.ops)
    capacity = resident / (ACCELERATORS - 1)  # the accelerators need three of them (or the CPU)
    cluster_file = folder / f"{graph.name}.yaml"
    cluster_file.write_text(cluster_yaml(capacity))
    cluster = load_cluster_file(cluster_file)
    problem = PlacementProblem.build(graph, cluster, objective="throughput")
    row: dict[str, Any] = {
        "graph": graph.name,
        "ops": graph.num_ops,
        "strict_classes": len({o.colocation for o in graph.ops if o.colocation}),
        "groups": problem.num_groups,
        "capacity_bytes": capacity,
        "lower_bound_s": problem.simulator.lower_bound("throughput"),
    }
    problem.warm_up()  # the simulator's one-off costs, outside every timing
    start = time.perf_counter()
    plan, stats = pipeline_split(problem, over_ideals=False, cpu_stage=False)
    row["contiguous_dp"] = {
        **score(problem, problem.keep_strict(plan.devices)[0]),
        "search_s": time.perf_counter() - start,
        "stages": stats["stages"],
    }
    placers = {}
    for name in registry():
        result = run_placer(name, problem, budget, seed)
        placers[name] = {
            **score(problem, result.op_devices),
            "search_s": result.search_time_s,
            "stages": result.stats.get("stages"),
            "ideals": result.stats.get("ideals"),
            "cpu_stage": result.stats.get("cpu_stage"),
        }
        print(f"  {graph.name} {name}: {placers[name]['max_load_s'] * 1e3:.2f} ms", file=sys.stderr)
    row["placers"] = placers
    fitting = {n: r for n, r in placers.items() if not r["oom"]}
    best = min(fitting, key=lambda n: (fitting[n]["max_load_s"], n)) if fitting else None
    row["best"] = best
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| graph | ops | groups | contiguous DP (PipeDream) | `pipeline` (ideals + CPU) "
        "| best placer | best / contiguous | lower bound | fitting placers |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        dp, pipe = r["contiguous_dp"], r["placers"]["pipeline"]
        best = r["placers"][r["best"]] if r["best"] else None
        fitting = sum(not p["oom"] for p in r["placers"].values())

        def ms(x: dict[str, Any]) -> str:
            mark = " OOM" if x["oom"] else ""
            return f"{x['max_load_s'] * 1e3:.2f} ms{mark} ({x['search_s']:.2f} s)"

        ratio = best["max_load_s"] / dp["max_load_s"] if best and not dp["oom"] else math.nan
        lines.append(
            f"| {r['graph']} | {r['ops']} | {r['groups']} | {ms(dp)} | {ms(pipe)} | "
            f"{r['best']}: {ms(best) if best else '–'} | {ratio:.3f} | "
            f"{r['lower_bound_s'] * 1e3:.2f} ms | {fitting} of {len(r['placers'])} |"
        )
    return head + "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=5.0, help="seconds per search placer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the smallest graph of each family")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, (make, sizes) in FAMILIES.items():
            for size in sizes[:1] if args.quick else sizes:
                graph = make(size, args.seed)
                print(f"{family} {size}: {graph.num_ops} ops", file=sys.stderr)
                rows.append(run_graph(graph, Path(tmp), args.budget, args.seed))
    write_result(args.out, {"budget_s": args.budget, "seed": args.seed, "graphs": rows})
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
