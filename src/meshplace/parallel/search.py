"""Shard a captured graph: every mesh shape, one integer program each, the fastest plan that fits.

For each factorisation of the chip count into 1..``max_axes`` mesh axes (laid over the
cluster's topology by :func:`meshplace.mesh.layout.build_mesh`, as the named-dimension
search does), :class:`meshplace.parallel.sharding.ShardingProblem` sets up strategies,
resharding costs and memory, and :func:`meshplace.parallel.ilp.solve` picks the strategy of
every op and parameter minimising the step's compute plus communication time within the
device memory. The best mesh wins; the others are its runners-up. When no plan fits on any
mesh, the least memory any plan needs is found (same program, memory as the objective) and
one sentence says by how much it misses.

The step time is every op's compute time on its block, the collectives the next op waits
for, and the exposed tails of the two streams that overlap compute — gradient reductions
behind backward, ZeRO's parameter all-gathers prefetched ahead of their readers
(:meth:`ShardingProblem.cost_tables`; ``overlap=False`` counts every collective in full,
as Alpa's and XLA's auto-sharding objectives do).

Complexity: ``mesh shapes x (problem set-up + one MIP)``; identical layers share variables.

Example
-------
>>> import torch
>>> from meshplace.graph.capture import capture
>>> from meshplace.hardware import load_cluster
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
>>> g = capture(model, (torch.randn(32, 64),), training=True)
>>> result = shard_graph(g, load_cluster("dgx-h100"), chips=4)
>>> result.best.fits, sorted(c.mesh.label for c in result.candidates)
(True, ['2x2', '4'])
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.graph.opdims import FIXED
from meshplace.hardware.cluster import Cluster
from meshplace.mesh.layout import LayoutError, Mesh, accelerators, build_mesh
from meshplace.mesh.search import mesh_shapes
from meshplace.parallel import ilp
from meshplace.parallel.sharding import (
    ZERO_STAGES,
    Group,
    ShardingError,
    ShardingProblem,
    Spec,
    Strategy,
    fsdp_unit_names,
    restrict_to_grid,
)

PLAN_FORMAT = "meshplace.parallel_plan"
PLAN_VERSION = 1
#: the ZeRO stages at which the torchrun runtime runs a pure data-parallel plan on DDP,
#: with plain tensors (``meshplace.runtime.data_parallel``); ZeRO 3 runs on FSDP2
#: (:data:`FSDP_ZERO_STAGES`), ZeRO 2 and every other plan on DTensor
DDP_ZERO_STAGES = (0, 1)
#: the ZeRO stages at which it runs a pure data-parallel plan on FSDP2, whose units compute
#: on their gathered plain tensors
FSDP_ZERO_STAGES = (3,)


@dataclass
class ShardingPlan:
    """The chosen strategies of one mesh and what they cost."""

    mesh: Mesh
    problem: ShardingProblem
    choice: list[int]  # strategy per group
    step_time_s: float
    compute_s: float
    communication_s: float  # every collective in full
    memory_bytes: dict[str, float]
    peak_memory_bytes: float
    capacity_bytes: float
    status: str
    solve_s: float
    variables: int
    timeline: dict[str, float] = field(default_factory=dict)
    #: priced with plain tensors, as DDP (FSDP2) runs a pure data-parallel plan: without
    #: the cost model's per-op engine dispatch (:func:`data_parallel_plans`)
    plain_tensors: bool = False

    @property
    def exposed_communication_s(self) -> float:
        """Communication compute waits for: blocking collectives and the exposed tails
        of the overlapped gradient reductions and parameter gathers (the step less its
        compute and its ranks' synchronisation skew, ``timeline["sync_s"]``)."""
        return self.step_time_s - self.compute_s - self.timeline.get("sync_s", 0.0)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes * (1 + 1e-9)

    def strategy(self, group: int) -> Strategy:
        return self.problem.groups[group].strategies[self.choice[group]]

    def parameters(self) -> dict[str, dict[str, Any]]:
        """Per parameter: DTensor placements per mesh axis, the JAX ``PartitionSpec``,
        weight-update sharding, and local bytes."""
        p = self.problem
        out: dict[str, dict[str, Any]] = {}
        for gi, g in enumerate(p.groups):
            if g.kind != "parameter":
                continue
            op = p.graph.ops[g.anchor]
            st = self.strategy(gi)
            spec = st.out_specs[0][0]
            shape = op.output_shapes[0] if op.output_shapes else []
            out[op.name.removeprefix("param:")] = {
                "shape": shape,
                "placements": dtensor_placements(spec),
                "partition_spec": partition_spec(spec, len(shape), p.axes),
                "zero": st.zero,
                "local_bytes": p.local_bytes(shape, p.itemsize(op.name, 0), spec),
            }
        return out

    def inputs(self) -> dict[str, dict[str, Any]]:
        p = self.problem
        out = {}
        for gi, g in enumerate(p.groups):
            if g.kind != "input":
                continue
            op = p.graph.ops[g.anchor]
            spec = self.strategy(gi).out_specs[0][0]
            shape = op.output_shapes[0] if op.output_shapes else []
            out[op.name.removeprefix("input:")] = {
                "shape": shape,
                "placements": dtensor_placements(spec),
                "partition_spec": partition_spec(spec, len(shape), p.axes),
            }
        return out

    def op_strategies(self) -> dict[str, str]:
        """Strategy of every op that decides one (followers take their group's)."""
        p = self.problem
        return {
            p.graph.ops[g.anchor].name: self.strategy(gi).name
            for gi, g in enumerate(p.groups)
            if g.kind in ("op", "fixed")
        }

    def top_ops(self, k: int = 10) -> list[dict[str, Any]]:
        """The ``k`` groups taking the most time (compute + their internal collectives)."""
        p = self.problem
        rows = []
        for gi, g in enumerate(p.groups):
            if g.kind not in ("op", "fixed"):
                continue
            st = self.strategy(gi)
            op = p.graph.ops[g.anchor]
            rows.append(
                {
                    "op": op.name,
                    "target": op.target,
                    "module": op.module,
                    "phase": op.phase,
                    "einsum": op.einsum,
                    "strategy": st.name,
                    "followers": len(g.members) - 1,
                    "seconds": st.compute_s + st.comm_s,
                }
            )
        rows.sort(key=lambda r: -r["seconds"])
        return rows[:k]

    def collectives(self) -> list[dict[str, Any]]:
        """Every collective the plan runs, summed by (kind, mesh axis, category)."""
        p = self.problem
        agg: dict[tuple[str, str, str], list[float]] = {}

        def add(kind: str, axis: str, nbytes: float, t: float, cat: str) -> None:
            row = agg.setdefault((kind, axis, cat), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += nbytes
            row[2] += t

        timeline = p.events()
        for gi in range(len(p.groups)):
            for kind, axis, nbytes, t, cat in self.strategy(gi).collectives:
                # a weight gradient's partial sums completed inside its group
                add(kind, axis, nbytes, t, "gradients" if gi in timeline.tail else cat)
        for (gu, gv), recs in timeline.bundles.items():
            su, sv = self.strategy(gu), self.strategy(gv)
            cat = (
                "gradients"
                if (gu, gv) in timeline.reductions
                else "weights"
                if (gu, gv) in timeline.prefetches
                else "reshard"
            )
            for pu, out, pv, j in recs:
                rec = p.graph.ops[p.groups[gv].members[pv]].operands[j]
                have, need = su.out_specs[pu][out], sv.in_specs[pv][j]
                _, colls = p.reshard(
                    have,
                    need,
                    rec["map"],
                    rec["shape"],
                    p.itemsize(rec["op"], rec["out"]),
                    p.edge_bucket_bytes(gu, gv),
                )
                for kind, axis, nbytes, t in colls:
                    add(kind, axis, nbytes, t, cat)
        rows = [
            {"kind": k, "axis": a, "category": c, "calls": v[0], "bytes": v[1], "seconds": v[2]}
            for (k, a, c), v in agg.items()
        ]
        rows.sort(key=lambda r: -r["seconds"])
        return rows

    def live_peak(self) -> tuple[float, str]:
        """(bytes, op) — the largest amount of this plan's local tensor data alive at once
        while the step runs its ops in graph order: every output from the op making it
        to its last reader (or the end of the step when nobody reads it), parameters,
        buffers, inputs and optimizer state throughout, each at its planned placement;
        the optimizer's new weights and state overwrite the old in place, as
        ``optimizer.step()`` does (the ops ``graph.meta["in_place_updates"]`` names, or in
        graphs captured before it, every update value nothing reads).
        The liveness view of memory, against which a run's live tensor bytes are
        measured (``meshplace.runtime.spmd``); the solver's limit uses the cheaper
        resident + largest working set bound (:attr:`peak_memory_bytes`). O(operands)."""
        p = self.problem
        ops = p.graph.ops
        last: dict[tuple[int, int], int] = {}
        for i, o in enumerate(ops):
            for rec in o.operands or []:
                last[(p.graph.index(rec["op"]), rec["out"])] = i
        in_place = set(p.graph.meta.get("in_place_updates", ()))
        resident = self.memory_bytes.get("optimizer_state", 0.0)
        dying: dict[int, float] = {}
        live = resident
        peak, where = live, ""
        for i, o in enumerate(ops):
            st = self.strategy(int(p.group_of[i]))
            pos = p.member_pos[i]
            for k, shape in enumerate(o.output_shapes):
                end = last.get((i, k), len(ops))
                if o.name in in_place or (o.phase == "update" and end == len(ops)):
                    continue  # the new weight or optimizer state, written in place
                nbytes = p.local_bytes(shape, p.itemsize(o.name, k), st.out_specs[pos][k])
                live += nbytes
                if o.kind in ("parameter", "buffer", "input"):
                    continue
                dying[end] = dying.get(end, 0.0) + nbytes
            if live > peak:
                peak, where = live, o.name
            live -= dying.pop(i, 0.0)
        return peak, where

    def to_dict(self, *, detail: bool = True) -> dict[str, Any]:
        p = self.problem
        d: dict[str, Any] = {
            "mesh": self.mesh.describe(),
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "exposed_communication_s": self.exposed_communication_s,
            "timeline": dict(self.timeline),
            "memory_bytes": dict(self.memory_bytes),
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "plain_tensors": self.plain_tensors,
            "solver": {
                "status": self.status,
                "seconds": self.solve_s,
                "variables": self.variables,
                "groups": len(p.groups),
                "classes": p.num_classes,
            },
        }
        if detail:
            d["live_peak_bytes"], d["live_peak_op"] = self.live_peak()
            d["parameters"] = self.parameters()
            d["inputs"] = self.inputs()
            d["top_ops"] = self.top_ops()
            d["collectives"] = self.collectives()
            d["replicated_ops"] = list(p.replicated_ops)
        return d

    def plan_file(self, graph_source: str, cluster: str) -> dict[str, Any]:
        """The versioned plan document (``docs/formats.md``, ``meshplace.parallel_plan``)."""
        g = self.problem.graph
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "graph": {"source": graph_source, "name": g.name, "ops": g.num_ops},
            "cluster": cluster,
            "mesh": {
                "shape": list(self.mesh.shape),
                "axes": list(self.mesh.axis_names),
                "devices": self.mesh.devices.tolist(),
            },
            "parameters": self.parameters(),
            "inputs": self.inputs(),
            "ops": self.op_strategies(),
            "stages": None,
            "predicted": {
                "step_time_s": self.step_time_s,
                "compute_s": self.compute_s,
                "communication_s": self.communication_s,
                "exposed_communication_s": self.exposed_communication_s,
                "sync_s": self.timeline.get("sync_s", 0.0),
                "memory_bytes": dict(self.memory_bytes),
                "peak_memory_bytes": self.peak_memory_bytes,
                "live_peak_bytes": self.live_peak()[0],
            },
        }


def dtensor_placements(spec: Spec) -> list[str]:
    """PyTorch DTensor placements, one per mesh axis (``Shard(0)``, ``Replicate()``).

    >>> dtensor_placements((0, -1))
    ['Shard(0)', 'Replicate()']
    """
    return [f"Shard({p})" if p >= 0 else "Replicate()" for p in spec]


def partition_spec(spec: Spec, rank: int, axes: Sequence[str]) -> list[Any]:
    """A JAX ``PartitionSpec`` as a list: per tensor dimension the mesh axis (or axes, in
    mesh order) splitting it, or ``None``.

    >>> partition_spec((1, 0), 2, ("x", "y"))
    ['y', 'x']
    >>> partition_spec((0, 0), 2, ("x", "y"))
    [['x', 'y'], None]
    """
    out: list[Any] = []
    for d in range(rank):
        names = [a for a, p in zip(axes, spec, strict=True) if p == d]
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return out


@dataclass
class ShardingResult:
    """Every mesh tried, best first (plans that fit before plans that do not)."""

    candidates: list[ShardingPlan]
    chips: int
    seconds: float
    mesh_shapes: list[tuple[int, ...]]
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> ShardingPlan:
        return self.candidates[0]


def plan_from_solution(
    problem: ShardingProblem, sol: ilp.Solution, capacity: float, solve_s: float
) -> ShardingPlan:
    """Expand a class-level solution to every group; its time is the problem's exact
    timeline (:meth:`ShardingProblem.timeline`), its memory the sum of the parts."""
    choice = [sol.choice[int(problem.class_of[g])] for g in range(len(problem.groups))]
    parts: dict[str, float] = {}
    transient = 0.0
    for gi, g in enumerate(problem.groups):
        st = g.strategies[choice[gi]]
        for k, v in st.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        transient = max(transient, st.transient)
    parts["transient"] = transient
    tl = problem.timeline(choice)
    return ShardingPlan(
        problem.mesh,
        problem,
        choice,
        tl["step_s"],
        tl["compute_s"],
        tl["blocking_comm_s"] + tl["backward_stream_s"] + tl["forward_gathers_s"],
        parts,
        sum(parts.values()),
        capacity,
        sol.status,
        solve_s,
        sol.variables,
        tl,
    )


def without_dispatch(cost_model: CostModel | None, mesh: Mesh) -> CostModel | None:
    """``cost_model`` without its per-op engine dispatch (DTensor's) on ``mesh``'s device
    kind — what a plan run on plain tensors pays — or ``None`` when it charges none
    there. O(1)."""
    if cost_model is None or not cost_model.dispatch_overhead.get(mesh.device_kind, 0.0):
        return None
    return dataclasses.replace(
        cost_model, dispatch_overhead={}, split_dispatch_overhead={}, batch_dispatch_overhead={}
    )


def batch_labels(problem: ShardingProblem) -> dict[int, str]:
    """Per op (graph index), the label of its index notation that carries the batch: each
    input's first dimension, followed forwards through every op that keeps it in a result
    (a view that flattens the batch with the sequence keeps it, as the batch's outer
    split) and backwards from every op that reads a batch-carrying value to the other
    values it reads along that label (the loss's gradient, seeded from a scalar, carries
    the batch because the weight gradients contract it with the activations), until
    nothing changes. What a data-parallel engine splits in every op: each DDP rank runs
    the model on its share of the batch. O(sweeps x operands), a few sweeps.

    >>> import torch
    >>> from meshplace.graph.capture import capture
    >>> from meshplace.hardware import load_cluster
    >>> g = capture(torch.nn.Linear(4, 3), (torch.randn(8, 4),), training=True)
    >>> p = ShardingProblem(g, build_mesh(load_cluster("dgx-h100"), (2,), chips=2))
    >>> [g.ops[i].name for i in sorted(batch_labels(p)) if g.ops[i].phase == "backward"]
    ['div', 'mm', 'sum_1']
    """
    graph = problem.graph
    ops = graph.ops
    batch: dict[tuple[int, int], int] = {}  # (op, output) -> its batch dimension
    labels: dict[int, str] = {}
    for i, o in enumerate(ops):
        if o.kind == "input" and o.output_shapes and o.output_shapes[0]:
            batch[(i, 0)] = 0
    sources = ("parameter", "buffer", "input")
    grew = True
    while grew:
        grew = False
        for i, o in enumerate(ops):  # forwards: from what an op reads to what it makes
            dims = problem.dims[i]
            if dims is None or o.kind in sources:
                continue
            label = labels.get(i)
            for j, rec in enumerate(o.operands or []):
                if label is not None or j >= len(dims.inputs):
                    break
                b = batch.get((graph.index(rec["op"]), rec["out"]))
                q = next((q for q, p in enumerate(rec["map"]) if p == b), None)
                if b is not None and q is not None and q < len(dims.inputs[j]):
                    label = dims.inputs[j][q] if dims.inputs[j][q] != FIXED else None
            for k, out in enumerate(dims.outputs):  # or from what it makes, found backwards
                if label is None and (i, k) in batch and batch[(i, k)] < len(out):
                    label = out[batch[(i, k)]] if out[batch[(i, k)]] != FIXED else None
            if label is None:
                continue
            if i not in labels:
                labels[i], grew = label, True
            for k, (out, summed) in enumerate(zip(dims.outputs, dims.sums, strict=True)):
                if label in out and label not in summed and (i, k) not in batch:
                    batch[(i, k)], grew = out.index(label), True
        for i in reversed(range(len(ops))):  # backwards: to the other values read along it
            label, dims = labels.get(i), problem.dims[i]
            if label is None or dims is None:
                continue
            for j, rec in enumerate(ops[i].operands or []):
                src = graph.index(rec["op"])
                if j >= len(dims.inputs) or label not in dims.inputs[j]:
                    continue
                if ops[src].kind in sources or (src, rec["out"]) in batch:
                    continue
                b = rec["map"][dims.inputs[j].index(label)]
                if b >= 0:
                    batch[(src, rec["out"])], grew = b, True
    return labels


def data_parallel_plans(
    graph: OpGraph,
    mesh: Mesh,
    capacity: float,
    cost_model: CostModel,
    *,
    zero_stages: Sequence[int] = ZERO_STAGES,
    compute: str = "eager",
    overlap: bool = True,
    tie_layers: bool = True,
    time_limit_s: float = 20.0,
) -> dict[int, ShardingPlan]:
    """Pure data parallelism over the one-axis ``mesh``, by ZeRO stage, at each stage of
    ``zero_stages`` the torchrun runtime runs on DDP (:data:`DDP_ZERO_STAGES`) or FSDP2
    (:data:`FSDP_ZERO_STAGES`), priced as they run it: every parameter replicated, the
    batch split, plain tensors — so without the per-op dispatch ``cost_model`` charges
    the DTensor engine (:func:`without_dispatch`; ``cost_model`` must charge one) —,
    each rank's loss its own (``ShardingProblem``'s ``local_reductions``: no all-reduce
    of it), and the gradients reduced in buckets (:meth:`ShardingProblem.comm_time`):
    DDP's 25 MiB ones, or FSDP2's units
    (:func:`~meshplace.parallel.sharding.fsdp_unit_names`), which also gather the
    parameters one unit at a time and cost ``cost_model``'s ``fsdp_unit_overhead`` each
    (``ShardingProblem``'s ``fsdp_units``). The integer program cannot price an engine
    chosen by the whole plan, so these are solved apart and set beside its plans
    (:func:`shard_graph`, :func:`meshplace.parallel.grid.megatron_grid`). Plans that do
    not fit or stages the batch does not allow are left out. O(one restricted integer
    program per stage).

    >>> import torch
    >>> from meshplace.graph.capture import capture
    >>> from meshplace.hardware import load_cluster
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> g = capture(model, (torch.randn(8, 64),), training=True)
    >>> mesh = build_mesh(load_cluster("dgx-h100"), (2,), chips=2)
    >>> dtensor = CostModel(dispatch_overhead={mesh.device_kind: 5e-5})
    >>> {z: p.plain_tensors for z, p in data_parallel_plans(g, mesh, 8e10, dtensor).items()}
    {0: True, 1: True, 3: True}
    """
    plain = without_dispatch(cost_model, mesh)
    if plain is None or len(mesh.shape) != 1 or int(mesh.shape[0]) < 2:
        raise ShardingError(
            "data_parallel_plans prices plans on one mesh axis of 2 or more devices, with a "
            "cost model that charges DTensor's dispatch on them"
        )
    stages = [z for z in (*DDP_ZERO_STAGES, *FSDP_ZERO_STAGES) if z in zero_stages]
    units = fsdp_unit_names(graph)
    problems: dict[bool, ShardingProblem] = {}  # on FSDP2 or not -> the whole problem
    for zero in stages:
        fsdp = zero in FSDP_ZERO_STAGES
        if fsdp not in problems:
            problems[fsdp] = ShardingProblem(
                graph,
                mesh,
                zero_stages=[z for z in stages if (z in FSDP_ZERO_STAGES) == fsdp],
                tie_layers=tie_layers,
                compute=compute,
                overlap=overlap,
                cost_model=plain,
                fsdp_units=units if fsdp else None,
                local_reductions=True,
            )
    if not problems:
        return {}
    # every op on its share of the batch, as each DDP (FSDP2) rank runs the model
    labels = batch_labels(next(iter(problems.values())))

    def on_its_share(g: Group, st: Strategy) -> bool:
        if g.kind != "op":
            return True
        want = (labels.get(g.anchor),)
        return st.assign == want or not any(o.assign == want for o in g.strategies)

    plans: dict[int, ShardingPlan] = {}
    for zero in stages:
        try:
            full = problems[zero in FSDP_ZERO_STAGES]
            problem = restrict_to_grid(full, 0, None, zero).restricted(on_its_share)
        except ShardingError:  # the batch does not split over the mesh
            continue
        t0 = time.perf_counter()
        sol = problem.cost_tables().solve(capacity, time_limit_s=time_limit_s)
        if sol.choice:
            plan = plan_from_solution(problem, sol, capacity, time.perf_counter() - t0)
            plans[zero] = dataclasses.replace(plan, plain_tensors=True)
    return plans


def shard_graph(
    graph: OpGraph,
    cluster: Cluster,
    *,
    chips: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    max_axes: int = 2,
    memory_fraction: float = 1.0,
    zero_stages: Sequence[int] = ZERO_STAGES,
    tie_layers: bool = True,
    time_limit_s: float = 20.0,
    pinned: Mapping[str, str | None] | None = None,
    compute: str = "eager",
    overlap: bool = True,
    progress: Callable[[str], None] | None = None,
    cost_model: CostModel | None = None,
) -> ShardingResult:
    """Search every mesh shape (or the given one) for the fastest plan that fits.

    ``cost_model`` gives the ops' compute times (default: the roofline's defaults; a
    calibrated one from :func:`meshplace.cost.calibration.calibrated_cost_model`).
    ``compute`` picks the compute model (:class:`ShardingProblem`: ``"eager"`` or
    ``"fused"``), ``overlap`` whether gradient reductions and parameter gathers overlap
    compute (:meth:`ShardingProblem.cost_tables`). Where ``cost_model`` charges an engine's
    per-op dispatch (DTensor's), the pure data-parallel plans the runtime runs on DDP and
    FSDP2 are priced without it and join the candidates (:func:`data_parallel_plans`).
    Raises :class:`ShardingError` (one sentence) when no plan fits any mesh, naming how
    much memory the leanest plan needs against the capacity; :class:`LayoutError` for a
    mesh that does not match the chips.
    """
    if not memory_fraction > 0 or memory_fraction > 1 or math.isnan(memory_fraction):
        raise InputError(
            f"memory fraction must be in (0, 1], got {memory_fraction}; it is the share of "
            "each device's memory a plan may use"
        )
    if not graph.meta.get("training", True) and zero_stages != (0,):
        zero_stages = (0,)
    missing = sum(
        1
        for o in graph.ops
        if o.kind not in ("parameter", "buffer", "input") and o.operands is None
    )
    if (
        missing == sum(1 for o in graph.ops if o.kind not in ("parameter", "buffer", "input"))
        and missing
    ):
        raise ShardingError(
            f"graph {graph.name!r} has no operand records (ops without 'operands'), so no op "
            "can be split: capture it with this version of meshplace (graph files written by "
            "older versions or other tools lack them)"
        )
    accel = accelerators(cluster)
    n = int(chips) if chips is not None else len(accel)
    if mesh_shape is not None:
        shapes = [tuple(int(s) for s in mesh_shape)]
        if math.prod(shapes[0]) != n and chips is None:
            n = math.prod(shapes[0])
    else:
        shapes = mesh_shapes(n, max_axes)
    start = time.perf_counter()
    candidates: list[ShardingPlan] = []
    failures: dict[str, str] = {}
    problems: list[tuple[ShardingProblem, float]] = []
    for shape in shapes:
        label = "x".join(map(str, shape))
        if progress is not None:
            progress(f"mesh {label}")
        mesh = build_mesh(cluster, shape, chips=n)
        dev = cluster.devices[int(mesh.devices.reshape(-1)[0])]
        capacity = dev.spec.memory_bytes * memory_fraction
        try:
            problem = ShardingProblem(
                graph,
                mesh,
                zero_stages=zero_stages,
                tie_layers=tie_layers,
                compute=compute,
                overlap=overlap,
                cost_model=cost_model,
            )
            if pinned:
                pin_inputs(problem, pinned)
        except ShardingError as exc:
            failures[label] = str(exc)
            continue
        tables = problem.cost_tables()
        t0 = time.perf_counter()
        sol = tables.solve(capacity, time_limit_s=time_limit_s)
        solve_s = time.perf_counter() - t0
        if sol.status == ilp.INFEASIBLE:
            failures[label] = "no plan fits"
            problems.append((problem, capacity))
            continue
        if not sol.choice:
            failures[label] = f"the solver found no plan in its {time_limit_s:g} s limit"
            continue
        candidates.append(plan_from_solution(problem, sol, capacity, solve_s))
        plain_dp = len(shape) == 1 and n > 1 and not pinned
        if plain_dp and without_dispatch(cost_model, mesh) is not None:
            # a pure data-parallel plan runs on DDP or FSDP2, without DTensor's dispatch
            plain = data_parallel_plans(
                graph,
                mesh,
                capacity,
                cost_model,  # type: ignore[arg-type]
                zero_stages=zero_stages,
                compute=compute,
                overlap=overlap,
                tie_layers=tie_layers,
                time_limit_s=time_limit_s,
            )
            candidates.extend(plain.values())
    if not candidates:
        if problems:
            raise ShardingError(_no_fit_sentence(graph, problems, time_limit_s))
        raise ShardingError(
            f"no mesh of {n} chips can shard {graph.name!r}: "
            + "; ".join(f"{k}: {v}" for k, v in failures.items())
        )
    candidates.sort(key=lambda c: (not c.fits, c.step_time_s))
    return ShardingResult(candidates, n, time.perf_counter() - start, shapes, failures)


def _no_fit_sentence(
    graph: OpGraph, problems: list[tuple[ShardingProblem, float]], time_limit_s: float
) -> str:
    best: tuple[float, str, float] | None = None
    for problem, capacity in problems:
        sol = problem.cost_tables().solve(None, minimise="memory", time_limit_s=time_limit_s)
        if sol.choice and (best is None or sol.memory / capacity < best[0] / best[2]):
            best = (sol.memory, problem.mesh.label, capacity)
    if best is None:
        return f"no sharding of {graph.name!r} fits in device memory"
    need, label, cap = best
    return (
        f"no sharding of {graph.name!r} fits: the leanest plan (mesh {label}) needs "
        f"{_size(need)} per device but {_size(cap)} is available ({_size(need - cap)} short); "
        "use more chips, a larger --memory-fraction, a smaller batch, or activation "
        "checkpointing"
    )


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1 (``1.50 GiB``)."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= div:
            return f"{nbytes / div:.2f} {unit}"
    return f"{nbytes:.0f} B"


def pin_inputs(problem: ShardingProblem, pinned: Mapping[str, str | None]) -> None:
    """Keep only the strategies of parameters and inputs that follow pinned rules
    (``{"batch": "x"}``; ``None`` keeps a dimension whole), by the graph's named
    dimensions (``dim_names``)."""
    axes = problem.axes
    for name, axis in pinned.items():
        if axis is not None and axis not in axes:
            raise LayoutError(
                f"layout rule {name}={axis}: mesh {problem.mesh.label} has no axis {axis!r}; "
                f"its axes are: {', '.join(axes)}"
            )
    known = set()
    for g in problem.groups:
        if g.kind not in ("parameter", "input"):
            continue
        op = problem.graph.ops[g.anchor]
        names = (op.dim_names or [[]])[0] if op.dim_names else []
        known.update(n for n in names if n)
        wanted = {d: pinned[n] for d, n in enumerate(names) if n in pinned}
        if not wanted:
            continue

        def ok(st: Strategy, wanted: dict[int, str | None] = wanted) -> bool:
            spec = st.out_specs[0][0]
            for d, axis in wanted.items():
                on = {a for a, p in zip(axes, spec, strict=True) if p == d}
                if (axis is None and on) or (axis is not None and axis not in on):
                    return False
            return True

        kept = [s for s in g.strategies if ok(s)]
        if not kept:
            raise LayoutError(
                f"pinned rules cannot be met for {op.name!r} (shape {op.output_shapes[0]}) on "
                f"mesh {problem.mesh.label}"
            )
        g.strategies = kept
    unknown = set(pinned) - known
    if unknown:
        raise LayoutError(
            f"layout rule {sorted(unknown)[0]}=…: no input or parameter has a dimension named "
            f"{sorted(unknown)[0]!r}; named dimensions: {', '.join(sorted(known)) or 'none'}"
        )
    problem.assign_classes()
