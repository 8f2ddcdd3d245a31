"""Pipeline placement: the optimal contiguous split of the model into stages for throughput.

PipeDream (Narayanan et al., SOSP 2019, §3.1) and Tarnawski et al. (NeurIPS 2020) cut the
layers, in execution order, into contiguous *stages*, one per device, and choose the cut by
dynamic programming so that the slowest stage — the pipeline's bottleneck, which sets the
steady-state time per (micro-)batch — is as fast as possible. meshplace does the same on
*forward units*:

1. the forward compute ops in topological order are the units; every other op is attributed
   to the unit :func:`complete_placement` would co-locate it with (a backward op to its
   forward op, a parameter and its update ops to its first forward consumer, …), so a
   unit's load is its forward, backward and update time (:func:`forward_units`);
2. units are coarsened into at most 256 contiguous chunks of similar time;
3. :func:`best_contiguous_split` finds the split into stages on the accelerators taken in
   ``cluster.ring_order`` order (stage *j* on the *j*-th accelerator; the DP may leave the
   last ones empty), minimising the bottleneck under each device's memory;
4. forward ops go to their stage's device and :func:`complete_placement` places the rest.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> r = run_placer("pipeline", p, budget_s=2.0, seed=0)
>>> r.stats["stages"] <= 2, r.stats["micro_batches"] == 4 * r.stats["stages"]
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplace.placers.base import OpAssignment, PlacementProblem, register
from meshplace.placers.baselines import accelerators, cpus
from meshplace.placers.colocate import complete_placement

MAX_CHUNKS = 256
# GPipe (Huang et al., NeurIPS 2019, §2.3): with M >= 4 x K micro-batches for K stages the
# pipeline's fill-and-drain bubble, (K - 1) / (M + K - 1) of the time, is negligible.
MICRO_BATCHES_PER_STAGE = 4

CommCost = np.ndarray | Callable[[int], np.ndarray] | None


# --------------------------------------------------------------------- the DP itself
def best_contiguous_split(
    loads: np.ndarray,
    comm: CommCost,
    n_stages: int,
    memory: np.ndarray | None = None,
    capacities: np.ndarray | None = None,
    device_comm: CommCost = None,
) -> tuple[float, list[int]]:
    """The split of ``n`` units, in order, into at most ``n_stages`` non-empty contiguous
    stages that minimises the bottleneck (the largest stage cost).

    Args:
        loads: ``[n]`` seconds per unit, or ``[n_stages, n]`` seconds per unit on stage
            *j*'s device.
        comm: seconds stage *j* spends receiving when it holds units ``[a, b)``: an array
            ``[n_stages, n + 1, n + 1]`` indexed ``[j, a, b]``, a function ``j -> [n + 1,
            n + 1]`` array, or ``None`` for free communication.
        n_stages: the most stages (devices) to use; stage *j* runs on device *j*, and
            using m < n_stages stages leaves the last devices empty.
        memory: ``[n]`` bytes per unit (optional); ``capacities``: ``[n_stages]`` bytes per
            stage device. A stage whose memory exceeds its capacity is infeasible.
        device_comm: like ``comm``, the seconds stage *j*'s device itself spends on
            transfers (a device without a copy engine, ``transfers: occupy``), or ``None``.

    Stage cost of units ``[a, b)`` on stage *j* =
    ``max(sum(loads[j, a:b]) + device_comm[j, a, b], comm[j, a, b])``: communication
    overlaps compute in a pipeline's steady state, except what occupies the device.

    Returns:
        ``(bottleneck, bounds)``: stage *j* holds units ``bounds[j]:bounds[j + 1]``,
        ``bounds[0] == 0`` and ``bounds[-1] == n``; among optimal splits the one with the
        fewest stages. ``(inf, [])`` if no split fits in memory; ``(0.0, [0, 0])`` if n = 0.

    Recurrence: ``f[j][b] = min over j <= a < b of max(f[j-1][a], cost_j(a, b))`` with
    ``f[0][b] = cost_0(0, b)``; the answer is ``min_j f[j][n]``. Time O(n² · n_stages)
    (numpy over all ``(a, b)`` per stage), memory O(n² + n · n_stages).

    >>> best_contiguous_split(np.array([1.0, 1.0, 1.0, 1.0]), None, 2)
    (2.0, [0, 2, 4])
    >>> best_contiguous_split(np.array([3.0, 1.0, 1.0, 1.0]), None, 3)
    (3.0, [0, 1, 4])
    """
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    n = loads.shape[1]
    if n == 0:
        return 0.0, [0, 0]
    if n_stages < 1:
        raise ValueError(f"n_stages must be at least 1, got {n_stages}")
    stages = min(n_stages, n)
    if loads.shape[0] == 1:
        loads = np.repeat(loads, stages, axis=0)
    cum = np.concatenate([np.zeros((loads.shape[0], 1)), np.cumsum(loads, axis=1)], axis=1)
    idx = np.arange(n + 1)
    nonempty = idx[:, None] < idx[None, :]
    mem_ab = None
    if memory is not None and capacities is not None:
        cm = np.concatenate([[0.0], np.cumsum(np.asarray(memory, dtype=np.float64))])
        mem_ab = cm[None, :] - cm[:, None]
    parents = np.zeros((stages, n + 1), dtype=np.int64)
    best_by_count = np.full(stages, np.inf)
    f_prev = np.full(n + 1, np.inf)
    cols = np.arange(n + 1)
    for j in range(stages):
        cost = cum[j][None, :] - cum[j][:, None]
        if device_comm is not None:
            cost = cost + (device_comm(j) if callable(device_comm) else device_comm[j])
        if comm is not None:
            cj = comm(j) if callable(comm) else comm[j]
            cost = np.maximum(cost, cj)
        ok = nonempty
        if mem_ab is not None:
            ok = ok & (mem_ab <= float(capacities[j]))  # type: ignore[index]
        cost = np.where(ok, cost, np.inf)
        if j == 0:
            f = cost[0].copy()
        else:
            cand = np.maximum(f_prev[:, None], cost)
            parents[j] = np.argmin(cand, axis=0)  # smallest a among ties: deterministic
            f = cand[parents[j], cols]
        best_by_count[j] = f[n]
        f_prev = f
    m = int(np.argmin(best_by_count))  # first minimum: the fewest stages
    bottleneck = float(best_by_count[m])
    if not np.isfinite(bottleneck):
        return float("inf"), []
    bounds = [n]
    b = n
    for j in range(m, 0, -1):
        b = int(parents[j][b])
        bounds.append(b)
    bounds.append(0)
    return bottleneck, bounds[::-1]


def receive_bytes(unit_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes a stage holding units ``[a, b)`` receives, from ``unit_bytes[u, v]`` (bytes from
    unit u to unit v): ``(forward[a, b], backward[a, b])`` = bytes from units before ``a``
    (activations, from earlier stages) and from units at or after ``b`` (gradients, from
    later stages), as ``[n + 1, n + 1]`` arrays. O(n²) by 2-D prefix sums.

    >>> m = np.array([[0, 5, 1], [2, 0, 7], [0, 3, 0]], float)  # 2 -> 1 is a gradient
    >>> fwd, bwd = receive_bytes(m)
    >>> float(fwd[1, 3]), float(bwd[1, 2]), float(fwd[2, 3]), float(bwd[0, 2])
    (6.0, 3.0, 8.0, 3.0)
    """
    m = np.asarray(unit_bytes, dtype=np.float64).copy()
    np.fill_diagonal(m, 0.0)
    n = m.shape[0]
    p = np.zeros((n + 1, n + 1))
    p[1:, 1:] = m.cumsum(axis=0).cumsum(axis=1)  # p[x, y] = sum of m[u < x, v < y]
    diag = np.diagonal(p).copy()
    col_total = p[n]  # col_total[y] = sum of m[all u, v < y]
    forward = p - diag[:, None]  # sum m[u < a, a <= v < b] = p[a, b] - p[a, a]
    # sum m[u >= b, a <= v < b] = (col_total[b] - col_total[a]) - (p[b, b] - p[b, a])
    backward = (col_total[None, :] - col_total[:, None]) - (diag[None, :] - p.T)
    return np.maximum(forward, 0.0), np.maximum(backward, 0.0)


def link_time(nbytes: np.ndarray, latency: float, seconds_per_byte: float) -> np.ndarray:
    """Uncontended transfer time of ``nbytes`` (0 where nothing is sent)."""
    return np.where(nbytes > 0, latency + nbytes * seconds_per_byte, 0.0)


# --------------------------------------------------------------------- forward units
@dataclass(frozen=True)
class ForwardUnits:
    """The forward compute ops in execution order and what each op is attributed to.

    Attributes:
        ops: op indices of the forward compute ops (unit *u* is ``ops[u]``).
        unit_of_op: for every op of the graph, the unit it follows.
        time_by_kind: ``[device kinds, units]`` seconds attributed to each unit.
        memory: ``[units]`` bytes attributed to each unit (``problem.op_memory``).
    """

    ops: np.ndarray
    unit_of_op: np.ndarray
    time_by_kind: np.ndarray
    memory: np.ndarray


def forward_units(problem: PlacementProblem) -> ForwardUnits:
    """The forward units of ``problem.graph`` with everything attributed to them.

    Attribution is computed once by running :func:`complete_placement` with each unit's
    number as its "device": the co-location rules only look at which ops are placed, so the
    label an op receives is exactly the forward op it would share a device with. O(V + E).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> u = forward_units(p)
    >>> bool(np.isclose(u.time_by_kind.sum(axis=1), p.simulator.op_time_by_kind.sum(1)).all())
    True
    """
    graph = problem.graph
    ops = graph.ops
    order = graph.arrays().topo_order.tolist()
    fwd = np.array(
        [
            i
            for i in order
            if ops[i].phase == "forward" and ops[i].kind not in ("parameter", "buffer", "input")
        ],
        dtype=np.int64,
    )
    label = np.full(graph.num_ops, -1, dtype=np.int64)
    label[fwd] = np.arange(len(fwd))
    unit_of_op = complete_placement(graph, label, default=0) if len(fwd) else label + 1
    n_units = max(len(fwd), 1)
    sim = problem.simulator
    time_by_kind = np.stack(
        [
            np.bincount(unit_of_op, weights=sim.op_time_by_kind[k], minlength=n_units)
            for k in range(len(sim.kind_names))
        ]
    )
    memory = np.bincount(unit_of_op, weights=problem.op_memory, minlength=n_units)
    return ForwardUnits(fwd, unit_of_op, time_by_kind, memory)


def chunk_units(times: np.ndarray, max_chunks: int = MAX_CHUNKS) -> np.ndarray:
    """Chunk index per unit: contiguous runs of about ``total / max_chunks`` seconds each
    (a unit goes to the chunk its midpoint falls in; empty chunks are dropped).

    >>> chunk_units(np.array([1.0, 1.0, 1.0, 1.0, 4.0]), 2).tolist()
    [0, 0, 0, 0, 1]
    """
    n = len(times)
    if n <= max_chunks:
        return np.arange(n, dtype=np.int64)
    t = np.maximum(np.asarray(times, dtype=np.float64), 0.0)
    total = float(t.sum())
    if total <= 0:
        raw = np.arange(n) * max_chunks // n
    else:
        mid = np.cumsum(t) - t / 2.0
        raw = np.minimum((mid / (total / max_chunks)).astype(np.int64), max_chunks - 1)
    _, compact = np.unique(raw, return_inverse=True)
    return compact.astype(np.int64)


def _chunk_bytes(problem: PlacementProblem, chunk_of_op: np.ndarray, n: int) -> np.ndarray:
    """``[n, n]`` bytes from chunk to chunk. A producer sends its output once to each
    consuming chunk (the largest tensor any consumer there reads), as the simulator sends
    it once per consuming device."""
    a = problem.graph.arrays()
    m = np.zeros((n, n))
    if not len(a.edge_src):
        return m
    cs, cd = chunk_of_op[a.edge_src], chunk_of_op[a.edge_dst]
    cross = cs != cd
    src, dst_chunk, nbytes = a.edge_src[cross], cd[cross], a.edge_bytes[cross]
    if not len(src):
        return m
    key = src * n + dst_chunk
    order = np.lexsort((-nbytes, key))
    first = np.ones(len(order), dtype=bool)
    first[1:] = key[order][1:] != key[order][:-1]
    pick = order[first]
    np.add.at(m, (chunk_of_op[src[pick]], dst_chunk[pick]), np.rint(nbytes[pick]))
    return m


def _link(problem: PlacementProblem, src: int, dst: int) -> tuple[float, float]:
    """(latency, seconds per byte) of the route src -> dst, from ``transfer_time``."""
    c = problem.cluster
    latency = c.transfer_time(src, dst, 0.0)
    return latency, (c.transfer_time(src, dst, 1e9) - latency) / 1e9


def _plan(
    problem: PlacementProblem,
    order: list[int],
    loads_by_kind: np.ndarray,
    chunk_bytes: np.ndarray,
    memory: np.ndarray | None,
) -> tuple[float, list[int], list[dict[str, float]]]:
    n = chunk_bytes.shape[0]
    stages = min(len(order), n)
    kind_index = problem.simulator.device_kind_index
    loads = np.stack([loads_by_kind[kind_index[d]] for d in order[:stages]])
    fwd_in, bwd_in = receive_bytes(chunk_bytes)
    links = [
        (
            _link(problem, order[j - 1], order[j]) if j > 0 else (0.0, 0.0),
            _link(problem, order[j + 1], order[j]) if j + 1 < len(order) else (np.inf, 0.0),
        )
        for j in range(stages)
    ]

    # what a stage sends: gradients to earlier stages, activations to later ones
    bwd_out, fwd_out = receive_bytes(chunk_bytes.T)
    out_links = [
        (
            _link(problem, order[j], order[j - 1]) if j > 0 else (np.inf, 0.0),
            _link(problem, order[j], order[j + 1]) if j + 1 < len(order) else (np.inf, 0.0),
        )
        for j in range(stages)
    ]
    occupy = problem.simulator.occupy

    def comm(j: int) -> np.ndarray:
        (lat_in, per_in), (lat_back, per_back) = links[j]
        return np.maximum(link_time(fwd_in, lat_in, per_in), link_time(bwd_in, lat_back, per_back))

    def device_comm(j: int) -> np.ndarray:
        """A device without a copy engine spends every send and receive itself."""
        (lat_in, per_in), (lat_back, per_back) = links[j]
        (lat_prev, per_prev), (lat_next, per_next) = out_links[j]
        return (
            link_time(fwd_in, lat_in, per_in)
            + link_time(bwd_in, lat_back, per_back)
            + link_time(bwd_out, lat_prev, per_prev)
            + link_time(fwd_out, lat_next, per_next)
        )

    def occupied(j: int) -> np.ndarray:
        return device_comm(j) if occupy[order[j]] else np.zeros_like(fwd_in)

    busy = occupied if occupy[order[:stages]].any() else None

    capacities = problem.device_memory[order[:stages]] if memory is not None else None
    bottleneck, bounds = best_contiguous_split(
        loads, comm, stages, memory, capacities, device_comm=busy
    )
    detail = []
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        detail.append(
            {
                "device": problem.device_names[order[j]],
                "chunks": [a, b],
                "compute_s": float(loads[j, a:b].sum()),
                "receive_s": float(comm(j)[a, b]),
                "device_transfer_s": float(busy(j)[a, b]) if busy is not None else 0.0,
                "memory_bytes": float(memory[a:b].sum()) if memory is not None else 0.0,
            }
        )
    return bottleneck, bounds, detail


@register(
    "pipeline",
    family="pipeline",
    description="optimal contiguous split of the forward units into pipeline stages on the "
    "accelerators (dynamic programming, bottleneck objective, memory-aware)",
    source="Narayanan et al., PipeDream, SOSP 2019, §3.1; Tarnawski et al., NeurIPS 2020",
)
def place_pipeline(
    problem: PlacementProblem, budget_s: float, seed: int
) -> tuple[OpAssignment, dict[str, Any]]:
    """PipeDream's partitioning (Narayanan et al., SOSP 2019, §3.1; Tarnawski et al.,
    NeurIPS 2020): the forward units (:func:`forward_units`, with their backward and update
    work), coarsened to at most 256 chunks of similar time, are split into contiguous stages
    on the accelerators in ring order by :func:`best_contiguous_split`, minimising the
    bottleneck stage.

    Stage cost = max(its compute on its device, the time to receive the bytes crossing into
    it over the route from the previous device (activations from earlier stages) and from
    the next device (gradients from later stages), by ``cluster.transfer_time``) — on a
    device whose transfers occupy it (``transfers: occupy``), its compute plus every send
    and receive, as the simulator charges them; each
    stage's memory must fit its device. If no split of the accelerators fits, the CPUs join
    the end of the pipeline; if none fits even then, memory is ignored (``stats["fits"]``
    says so). Deterministic (``seed`` is unused).

    ``stats["micro_batches"]`` suggests 4 x stages micro-batches (GPipe, Huang et al.,
    NeurIPS 2019, §2.3: the fill/drain bubble is then negligible); the plan is chosen for
    its steady-state time ``stats["bottleneck_s"]``.

    Complexity: O(V + E) for the attribution and O(C² · S) for the DP
    (C ≤ 256 chunks, S stages).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> plan, stats = place_pipeline(p, 2.0, seed=0)
    >>> len(plan.devices) == p.graph.num_ops, stats["fits"], stats["bottleneck_s"] > 0
    (True, True, True)
    """
    graph = problem.graph
    acc = accelerators(problem)
    units = forward_units(problem)
    if len(units.ops) == 0:
        plan = complete_placement(graph, np.full(graph.num_ops, -1), default=acc[0])
        return OpAssignment(plan), {"stages": 1, "micro_batches": MICRO_BATCHES_PER_STAGE}
    kind_index = problem.simulator.device_kind_index
    order = problem.cluster.ring_order(acc)
    ref_kind = kind_index[order[0]]
    chunk_of_unit = chunk_units(units.time_by_kind[ref_kind])
    n_chunks = int(chunk_of_unit.max()) + 1
    loads_by_kind = np.stack(
        [np.bincount(chunk_of_unit, weights=t, minlength=n_chunks) for t in units.time_by_kind]
    )
    memory = np.bincount(chunk_of_unit, weights=units.memory, minlength=n_chunks)
    chunk_of_op = chunk_of_unit[units.unit_of_op]
    chunk_bytes = _chunk_bytes(problem, chunk_of_op, n_chunks)

    fits = True
    bottleneck, bounds, detail = _plan(problem, order, loads_by_kind, chunk_bytes, memory)
    extra = [c for c in cpus(problem) if c not in acc]
    if not bounds and extra:  # the CPUs join the end of the pipeline
        order = order + problem.cluster.ring_order(extra)
        bottleneck, bounds, detail = _plan(problem, order, loads_by_kind, chunk_bytes, memory)
    if not bounds:
        fits = False
        order = problem.cluster.ring_order(acc)
        bottleneck, bounds, detail = _plan(problem, order, loads_by_kind, chunk_bytes, None)

    stage_of_chunk = np.zeros(n_chunks, dtype=np.int64)
    for j in range(len(bounds) - 1):
        stage_of_chunk[bounds[j] : bounds[j + 1]] = j
    device_of_stage = np.asarray(order, dtype=np.int64)
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    partial[units.ops] = device_of_stage[stage_of_chunk[chunk_of_unit]]
    plan = complete_placement(graph, partial, default=order[0])
    load = np.bincount(plan, weights=problem.op_memory, minlength=problem.num_devices)
    stages = len(bounds) - 1
    stats = {
        "units": len(units.ops),
        "chunks": n_chunks,
        "stages": stages,
        "bottleneck_s": bottleneck,
        "micro_batches": MICRO_BATCHES_PER_STAGE * stages,
        "stage_detail": detail,
        "fits": fits and bool(np.all(load <= problem.device_memory)),
    }
    return OpAssignment(plan), stats
