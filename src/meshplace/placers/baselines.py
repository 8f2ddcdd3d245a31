"""The baselines the placement papers compare against: one device, the human expert,
round-robin and random.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("rnnlm"), load_cluster("colocrl-4gpu"))
>>> r = run_placer("expert", p, 1.0, 0)
>>> sorted({p.device_names[d] for d in r.op_devices.tolist()})
['cpu0', 'gpu0', 'gpu1']
"""

from __future__ import annotations

import re

import numpy as np

from meshplace.placers.base import OpAssignment, PlacementProblem, register
from meshplace.placers.colocate import complete_placement


def accelerators(problem: PlacementProblem) -> list[int]:
    """Indices of the non-CPU devices (all devices if there are none)."""
    devices = problem.cluster.devices
    acc = [i for i, d in enumerate(devices) if getattr(d.spec, "category", "") != "cpu"]
    return acc or list(range(len(devices)))


def cpus(problem: PlacementProblem) -> list[int]:
    devices = problem.cluster.devices
    return [i for i, d in enumerate(devices) if getattr(d.spec, "category", "") == "cpu"]


def _single_device_results(problem: PlacementProblem) -> dict[int, tuple[float, bool]]:
    """Objective and OOM for every device kind alone (one representative device each)."""
    seen: dict[str, int] = {}
    for i, d in enumerate(problem.cluster.devices):
        seen.setdefault(d.kind, i)
    out = {}
    for i in seen.values():
        r = problem.evaluate(np.full(problem.num_groups, i, dtype=np.int64))
        out[i] = (r.value, r.oom)
    return out


@register(
    "single",
    family="baseline",
    description="every op on the one device that runs the step fastest (fitting in memory)",
    source="Mirhoseini et al., ICML 2017, Table 1 (single CPU / single GPU)",
)
def place_single(problem: PlacementProblem, budget_s: float, seed: int):
    """The fastest single device that fits (the fastest overall if none fits). O(kinds · sim)."""
    results = _single_device_results(problem)
    fitting = {i: v for i, (v, oom) in results.items() if not oom}
    pool = fitting or {i: v for i, (v, _) in results.items()}
    best = min(pool, key=lambda i: (pool[i], i))
    stats = {
        problem.device_names[i]: {"objective_s": v, "oom": oom} for i, (v, oom) in results.items()
    }
    return np.full(problem.num_groups, best, dtype=np.int64), {"per_device": stats}


@register(
    "single_cpu",
    family="baseline",
    description="every op on the CPU",
    source="Mirhoseini et al., ICML 2017, Table 1 (single CPU)",
)
def place_single_cpu(problem: PlacementProblem, budget_s: float, seed: int):
    """Every op on the first CPU (the first device if the cluster has no CPU)."""
    devices = cpus(problem) or [0]
    return np.full(problem.num_groups, devices[0], dtype=np.int64)


@register(
    "round_robin",
    family="baseline",
    description="co-location groups dealt to the accelerators in topological order",
    source="a standard baseline (e.g. Addanki et al., Placeto, NeurIPS 2019)",
)
def place_round_robin(problem: PlacementProblem, budget_s: float, seed: int):
    acc = np.array(accelerators(problem), dtype=np.int64)
    return acc[np.arange(problem.num_groups) % len(acc)]


@register(
    "random",
    family="baseline",
    description="each co-location group on a uniformly random accelerator (seeded)",
    source="a standard baseline (e.g. Mirhoseini et al., ICLR 2018)",
)
def place_random(problem: PlacementProblem, budget_s: float, seed: int):
    acc = np.array(accelerators(problem), dtype=np.int64)
    rng = np.random.default_rng(seed)
    return acc[rng.integers(0, len(acc), problem.num_groups)]


_LSTM_LAYER = re.compile(r"^(?:(encoder|decoder)\.)?lstm\.(\d+)")


@register(
    "expert",
    family="baseline",
    description="the papers' human placements: RNN layers one per GPU with attention and "
    "softmax on the last and embeddings on the CPU; otherwise a FLOP-balanced layer-wise split",
    source="Mirhoseini et al., ICML 2017, §4 (human experts); Wu et al. 2016 (GNMT, §3)",
)
def place_expert(problem: PlacementProblem, budget_s: float, seed: int) -> OpAssignment:
    """Forward ops are placed by the rules below; backward ops, parameters and updates
    follow them (:func:`complete_placement`).

    * Recurrent models (module paths ``lstm.N``, ``encoder.lstm.N``, ``decoder.lstm.N``):
      the k-th LSTM layer (encoder layers first, then decoder layers) goes to GPU
      ``k mod #GPUs``; attention and the softmax layer go to the GPU of the last decoder
      layer; embeddings (and the inputs) go to the CPU, as in ColocRL's expert baseline and
      GNMT's one-layer-per-GPU placement.
    * Anything else: the forward ops, in execution order, are cut into one contiguous run per
      accelerator with equal FLOPs (a layer-wise model-parallel split, cut at the module
      boundary nearest to the balanced point).
    """
    graph = problem.graph
    ops = graph.ops
    acc = accelerators(problem)
    cpu = cpus(problem)
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    layers = sorted(
        {(m.group(1) or "", int(m.group(2))) for o in ops if (m := _LSTM_LAYER.match(o.module))},
        key=lambda t: (t[0] != "encoder", t[0], t[1]),
    )
    if layers:
        gpu_of = {layer: acc[k % len(acc)] for k, layer in enumerate(layers)}
        last = gpu_of[layers[-1]]
        for i, o in enumerate(ops):
            if o.phase != "forward" or o.kind in ("parameter", "buffer"):
                continue
            m = _LSTM_LAYER.match(o.module)
            if m:
                partial[i] = gpu_of[(m.group(1) or "", int(m.group(2)))]
            elif "embedding" in o.module or o.kind == "input":
                partial[i] = cpu[0] if cpu else acc[0]
            else:
                partial[i] = last
        return OpAssignment(complete_placement(graph, partial, default=last))
    return OpAssignment(complete_placement(graph, layerwise_split(problem, acc), default=acc[0]))


def layerwise_split(problem: PlacementProblem, devices: list[int]) -> np.ndarray:
    """Forward compute ops in execution order, cut into ``len(devices)`` runs of about equal
    FLOPs, each cut moved to the nearest change of top-level module; -1 elsewhere."""
    graph = problem.graph
    ops = graph.ops
    order = [
        i
        for i in graph.arrays().topo_order.tolist()
        if ops[i].phase == "forward" and ops[i].kind not in ("parameter", "buffer", "input")
    ]
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    if not order:
        return partial
    flops = np.array([ops[i].flops for i in order]) + 1.0
    cum = np.cumsum(flops)
    total = cum[-1]
    blocks = [_block(ops[i].module) for i in order]
    cuts = []
    for k in range(1, len(devices)):
        target = int(np.searchsorted(cum, total * k / len(devices)))
        cuts.append(_nearest_boundary(blocks, target))
    cuts = sorted(set(cuts))
    start = 0
    for k, end in enumerate([*cuts, len(order)]):
        for i in order[start:end]:
            partial[i] = devices[min(k, len(devices) - 1)]
        start = end
    return partial


def _block(module: str) -> str:
    """The layer a module belongs to: ``layers.3.attn`` → ``layers.3``, ``layer2.1.conv1`` →
    ``layer2.1``, ``Mixed_6a.branch3x3`` → ``Mixed_6a``."""
    parts = module.split(".")
    for k, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: k + 1])
    return parts[0]


def _nearest_boundary(blocks: list[str], target: int) -> int:
    n = len(blocks)
    target = min(max(target, 1), n - 1) if n > 1 else 0
    for delta in range(n):
        for pos in (target - delta, target + delta):
            if 0 < pos < n and blocks[pos] != blocks[pos - 1]:
                return pos
    return target
