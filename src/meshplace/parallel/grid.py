"""The Megatron-style grid: data × tensor parallel degrees × one ZeRO stage, scored like the solver.

Source: the configuration space of Megatron-LM (Shoeybi et al., 2019, Sec. 3; Narayanan
et al., SC 2021, Sec. 3.3) with ZeRO's stages (Rajbhandari et al., SC 2020) — what users
search by hand: a data-parallel degree ``dp`` and a tensor-parallel degree ``tp`` with
``dp * tp = chips``, tensor parallelism kept inside a host, and one weight-update sharding
stage for every parameter.

How a grid point is scored
--------------------------
On the mesh ``(dp, tp)`` (laid over the topology by :func:`meshplace.mesh.layout.build_mesh`,
which puts the small axis on the fast links), the strategies of
:class:`meshplace.parallel.sharding.ShardingProblem` are restricted to what the grid point
means, and the same integer program as :func:`meshplace.parallel.search.shard_graph` fills
in the rest:

- every input is split along its batch dimension (named ``batch``, else dimension 0) over
  the data axis and replicated over the tensor axis;
- every parameter is replicated over the data axis; over the tensor axis every matrix (rank
  >= 2) is split along its first or second dimension — Megatron's column- and row-parallel
  layers, vocabulary-parallel embeddings — and a vector (bias, norm scale) is split or
  replicated; a matrix whose dimensions ``tp`` divides neither stays replicated;
- every parameter that is replicated somewhere uses the grid point's ZeRO stage;
- op strategies are free: activations take the cheapest placement consistent with those
  parameters, which is Megatron's own layout when that is cheapest, and never worse.

With ``layouts=("free", "megatron")`` each point with ``tp > 1`` is also solved with
Megatron's own layout fixed (:func:`megatron_layers`: column-parallel layers split by
their outputs, row-parallel ones by their inputs, the word embedding by vocabulary, norm
scales whole; :func:`restrict_to_megatron`): the integer program prices it like a free
layout it could choose, but an engine that lets DTensor lay out the activations runs
fewer collectives for it (``shard --engine-costs`` prices both).

So the grid's best plan is a lower bound on what a hand search over ``dp x tp x ZeRO``
finds under meshplace's cost model, and every grid plan is a plan the solver could pick
(the solver searches a superset: every mesh shape, every strategy, ZeRO per parameter).

Complexity: ``divisors(chips) x stages`` integer programs, each smaller than the solver's
(parameters and inputs have one or two strategies).

Example
-------
>>> import torch
>>> from meshplace.graph.capture import capture
>>> from meshplace.hardware import load_cluster
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
>>> g = capture(model, (torch.randn(32, 64),), training=True)
>>> grid = megatron_grid(g, load_cluster("dgx-h100"), chips=4, zero_stages=(0, 3))
>>> sorted((p.dp, p.tp, p.zero) for p in grid.points)[:3]
[(1, 4, 0), (2, 2, 0), (2, 2, 3)]
>>> grid.best.plan.fits
True
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from meshplace.cost.compute import CostModel
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware.cluster import Cluster
from meshplace.mesh.layout import accelerators, build_mesh
from meshplace.parallel import ilp
from meshplace.parallel.search import (
    ShardingPlan,
    data_parallel_plans,
    plan_from_solution,
    without_dispatch,
)
from meshplace.parallel.sharding import (
    ZERO_STAGES,
    ShardingError,
    ShardingProblem,
    restrict_to_grid,
)


@dataclass
class GridPoint:
    """One ``(dp, tp, zero)`` configuration and its plan (``None`` with a reason when
    it cannot run: the batch does not divide, or nothing fits)."""

    dp: int
    tp: int
    zero: int
    plan: ShardingPlan | None
    reason: str = ""
    seconds: float = 0.0
    data_axis: str | None = None
    tensor_axis: str | None = None
    # "free": each matrix split along whichever dimension the integer program prefers;
    # "megatron": along the one Megatron's layout splits (:func:`megatron_layers`)
    layout: str = "free"

    @property
    def label(self) -> str:
        suffix = " megatron" if self.layout == "megatron" else ""
        return f"dp{self.dp} x tp{self.tp} zero{self.zero}{suffix}"

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits


@dataclass
class GridResult:
    """Every grid point tried; :attr:`best` is the fastest that fits."""

    points: list[GridPoint]
    seconds: float

    @property
    def best(self) -> GridPoint:
        fitting = [p for p in self.points if p.fits]
        if not fitting:
            raise ShardingError(
                "no data x tensor parallel x ZeRO grid point fits: "
                + "; ".join(f"{p.label}: {p.reason or 'does not fit'}" for p in self.points[:4])
            )
        return min(fitting, key=lambda p: p.plan.step_time_s)  # type: ignore[union-attr]


#: what a layer does over the tensor axis in Megatron's layout
COLUMN, ROW = "column", "row"


def megatron_layers(graph: OpGraph) -> dict[str, int]:
    """Megatron-LM's own tensor-parallel layout of ``graph``'s matrices: for every
    parameter matrix that a forward matrix product or embedding reads, the dimension to
    split over the tensor axis — a layer's output features (column-parallel) or its input
    features (row-parallel), a word embedding's vocabulary (one whose ids are a model
    input; a position table stays out).

    Source: Shoeybi et al., "Megatron-LM", 2019, Sec. 3: an MLP's first layer is split by
    columns and its second by rows, attention's query, key and value projections by
    columns (heads) and its output projection by rows, so each pair needs one all-reduce
    forward (``g``) and one backward (``f``); the embedding is split by vocabulary. Read
    here from the graph's data flow rather than from module names: walking the forward
    in order, a layer is row-parallel when every layer it reads from (through ops that
    are no layer: attention, activations, norms, residual adds) is column-parallel, and
    column-parallel otherwise — a block's first layers read the residual stream, which
    row-parallel layers and the embedding write whole; a chain of plain linear layers
    alternates. Casts are looked through (autocast's copy of a weight to bf16). Which
    parameter dimension is the output and which the input comes from
    the op's index notation (:mod:`meshplace.graph.opdims`), so a weight stored ``[in,
    out]`` (GPT-2's ``Conv1D``) is split as correctly as ``nn.Linear``'s ``[out, in]``.
    A matrix that layers of both kinds read, or that no such op reads, is left out.

    A column-parallel layer's bias is split with its outputs; a row-parallel layer's bias,
    norm scales and every other vector parameter stay whole (``-1``), as in Megatron.

    Returns parameter op name → dimension, or -1 for whole. O(layers x ops) (each
    layer's walk back stops at the layers it reaches).

    >>> import torch
    >>> from meshplace.graph.capture import capture
    >>> mlp = torch.nn.Sequential(
    ...     torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
    ...     torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    >>> layers = megatron_layers(capture(mlp, (torch.randn(4, 8),), training=True))
    >>> [layers[f"param:{i}.weight"] for i in (0, 2, 3, 4)]
    [0, 1, 0, 1]
    """
    from meshplace.graph.opdims import OpDims

    index = {op.name: i for i, op in enumerate(graph.ops)}

    def origin(operand: dict) -> tuple[Op | None, list[int]]:
        """The op whose output ``operand`` reads, looking through casts (autocast's
        ``_to_copy`` of a weight: a copy that keeps every dimension where it was), and
        the operand's dimension map onto that op's output."""
        mapped = list(operand["map"])
        at = index.get(operand["op"])
        while at is not None:
            op = graph.ops[at]
            if op.kind != "copy" or not op.einsum or not op.operands or len(op.operands) != 1:
                return op, mapped
            cast = OpDims.parse(op.einsum)
            if len(cast.outputs) != 1 or cast.inputs[0] != cast.outputs[0]:
                return op, mapped
            inner = op.operands[0]["map"]
            mapped = [inner[d] if 0 <= d < len(inner) else -1 for d in mapped]
            at = index.get(op.operands[0]["op"])
        return None, mapped

    def is_parameter(operand: dict) -> bool:
        op, _ = origin(operand)
        return op is not None and op.kind == "parameter"

    readers: dict[int, list[int]] = {}
    for u, v, _ in graph.edges():
        readers.setdefault(v, []).append(u)
    # the layer ops: op index -> (parameter, its column and row dims), row dim -1 for an
    # embedding (its output is whole: a row-parallel layer's for what reads it)
    layers: dict[int, tuple[str, int, int]] = {}
    biases: dict[int, list[str]] = {}  # layer op -> its vector parameters
    for i, op in enumerate(graph.ops):
        if op.phase != "forward" or op.kind not in ("matmul", "embedding"):
            continue
        if not op.einsum or not op.operands:
            continue
        dims = OpDims.parse(op.einsum)
        out = set(dims.outputs[0]) if dims.outputs else set()
        for j, operand in enumerate(op.operands):
            producer, mapped = origin(operand)
            if producer is None or producer.kind != "parameter":
                continue
            shape = producer.output_shapes[0] if producer.output_shapes else []
            if len(shape) != 2 or len(mapped) != 2 or -1 in mapped or j >= len(dims.inputs):
                continue
            labels = dims.inputs[j]
            # the activation's labels (a bias, also a parameter, carries the output's)
            others = {
                label
                for k, ls in enumerate(dims.inputs)
                if k != j and k < len(op.operands) and not is_parameter(op.operands[k])
                for label in ls
            }
            if op.kind == "embedding":
                # Megatron splits the word embedding, whose ids are the model's input,
                # not a position table read at every position by every rank
                ids = [r for k, r in enumerate(op.operands) if k != j and not is_parameter(r)]
                if not all(getattr(origin(r)[0], "kind", "") == "input" for r in ids):
                    continue
                vocab = [mapped[d] for d, lab in enumerate(labels) if lab not in out]
                if len(vocab) == 1:
                    layers[i] = (producer.name, vocab[0], -1)
                continue
            column = [mapped[d] for d, lab in enumerate(labels) if lab in out and lab not in others]
            row = [mapped[d] for d, lab in enumerate(labels) if lab not in out and lab in others]
            if len(column) == 1 and len(row) == 1:
                layers[i] = (producer.name, column[0], row[0])
                biases[i] = [
                    origin(r)[0].name  # type: ignore[union-attr]
                    for r in op.operands
                    if is_parameter(r) and len(r["shape"]) == 1
                ]
    roles: dict[int, str] = {}
    for i in sorted(layers):  # graph order is a topological order
        if layers[i][2] == -1:
            roles[i] = ROW  # an embedding's output is whole, as a row-parallel layer's
            continue
        upstream: set[int] = set()
        seen: set[int] = set()
        stack = [u for u in readers.get(i, []) if graph.ops[u].kind != "parameter"]
        while stack:
            u = stack.pop()
            if u in seen or graph.ops[u].phase != "forward":
                continue
            seen.add(u)
            if u in layers:
                upstream.add(u)
                continue
            stack.extend(readers.get(u, []))
        reads_columns = bool(upstream) and all(roles.get(u) == COLUMN for u in upstream)
        roles[i] = ROW if reads_columns else COLUMN
    split: dict[str, int] = {}
    conflicting: set[str] = set()

    def decide(name: str, dim: int) -> None:
        if split.setdefault(name, dim) != dim:
            conflicting.add(name)

    for i, (name, column, row) in layers.items():
        decide(name, column if roles[i] == COLUMN or row == -1 else row)
        for bias in biases.get(i, []):  # split with a column's outputs, whole after a row
            decide(bias, 0 if roles[i] == COLUMN else -1)
    for op in graph.ops:  # norm scales and every other vector: whole
        shape = op.output_shapes[0] if op.output_shapes else []
        if op.kind == "parameter" and len(shape) <= 1 and op.name not in split:
            split[op.name] = -1
    return {name: dim for name, dim in split.items() if name not in conflicting}


def restrict_to_megatron(
    problem: ShardingProblem, dp_axis: int | None, tp_axis: int | None, zero: int
) -> ShardingProblem:
    """:func:`restrict_to_grid` with Megatron's own layout of the problem's graph
    (:func:`megatron_layers`) fixed on the tensor axis: the hybrid search's Megatron
    pattern. O(ops x layers + groups x strategies)."""
    return restrict_to_grid(problem, dp_axis, tp_axis, zero, megatron_layers(problem.graph))


def default_max_tensor_parallel(cluster: Cluster, chips: int) -> int:
    """Megatron's rule: tensor parallelism stays inside a host (the accelerators that share
    its fast links); on a torus every chip is one hop class, so any degree is allowed.

    >>> from meshplace.hardware import load_cluster
    >>> default_max_tensor_parallel(load_cluster("h2-8xh100"), 16)
    8
    """
    if cluster.dims is not None:
        return chips
    per_host: dict[str, int] = {}
    for i in accelerators(cluster):
        host = cluster.devices[i].host
        per_host[host] = per_host.get(host, 0) + 1
    return min(chips, max(per_host.values(), default=chips))


def megatron_grid(
    graph: OpGraph,
    cluster: Cluster,
    *,
    chips: int | None = None,
    memory_fraction: float = 1.0,
    max_tensor_parallel: int | None = None,
    zero_stages: Sequence[int] = ZERO_STAGES,
    time_limit_s: float = 20.0,
    compute: str = "eager",
    overlap: bool = True,
    cost_model: CostModel | None = None,
    layouts: Sequence[str] = ("free",),
) -> GridResult:
    """Score every ``dp x tp x ZeRO`` point (module docstring) with ``cost_model``'s op
    times (default: the roofline's defaults); :attr:`GridResult.best` is the fastest that
    fits. ``layouts`` says which tensor-parallel layouts each point with ``tp > 1`` gets:
    ``"free"`` (each matrix split along the dimension the integer program prefers) and
    ``"megatron"`` (along the one Megatron's layout splits, :func:`megatron_layers`; a
    point of its own, skipped for a graph with no such matrix). The integer program
    prices the two alike where they differ only in activation layouts it chooses itself,
    but an engine that lets DTensor choose them (the torchrun runtime) runs different
    programs for them: ``shard --engine-costs`` prices both."""
    unknown = sorted(set(layouts) - {"free", "megatron"})
    if unknown:
        raise ShardingError(f"unknown grid layout {unknown[0]!r}; choose free or megatron")
    megatron = megatron_layers(graph) if "megatron" in layouts else {}
    if not any(dim >= 0 for dim in megatron.values()):
        megatron = {}  # no matrix layer (a conv net): no layout of Megatron's to add
    n = int(chips) if chips is not None else len(accelerators(cluster))
    max_tp = max_tensor_parallel or default_max_tensor_parallel(cluster, n)
    start = time.perf_counter()
    points: list[GridPoint] = []
    for tp in (d for d in range(1, n + 1) if n % d == 0 and d <= max_tp):
        dp = n // tp
        sizes = [s for s in (dp, tp) if s > 1] or [1]
        mesh = build_mesh(cluster, sorted(sizes), chips=n)
        # roles by size; equal sizes: the tensor axis is the one with faster collectives
        if dp > 1 and tp > 1:
            if dp == tp:
                t0 = mesh.collective_time("all_reduce", 2**26, [mesh.axis_names[0]])
                t1 = mesh.collective_time("all_reduce", 2**26, [mesh.axis_names[1]])
                tp_axis = 0 if t0 < t1 else 1
            else:
                tp_axis = 0 if mesh.shape[0] == tp else 1
            dp_axis: int | None = 1 - tp_axis
        else:
            tp_axis = 0 if tp > 1 else None
            dp_axis = 0 if dp > 1 else None
        capacity = cluster.devices[int(mesh.devices.reshape(-1)[0])].spec.memory_bytes
        capacity *= memory_fraction
        stages = tuple(zero_stages) if dp > 1 else (0,)
        names = {
            "data_axis": mesh.axis_names[dp_axis] if dp_axis is not None else None,
            "tensor_axis": mesh.axis_names[tp_axis] if tp_axis is not None else None,
        }
        # one set-up per mesh, restricted once per ZeRO stage
        try:
            full = ShardingProblem(
                graph,
                mesh,
                zero_stages=stages,
                compute=compute,
                overlap=overlap,
                cost_model=cost_model,
            )
        except ShardingError as exc:
            points.extend(GridPoint(dp, tp, z, None, str(exc), **names) for z in stages)
            continue
        # pure data parallelism runs on DDP (ZeRO 0, 1) or FSDP2 (ZeRO 3): priced so,
        # without DTensor's dispatch
        on_plain: dict[int, ShardingPlan] = {}
        if tp == 1 and dp > 1 and without_dispatch(cost_model, mesh) is not None:
            on_plain = data_parallel_plans(
                graph,
                mesh,
                capacity,
                cost_model,  # type: ignore[arg-type]
                zero_stages=stages,
                compute=compute,
                overlap=overlap,
                time_limit_s=time_limit_s,
            )
        variants = [("free", None)] if "free" in layouts or tp == 1 else []
        if tp > 1 and megatron:
            variants.append(("megatron", megatron))
        for zero in stages:
            if zero in on_plain:
                plan = on_plain[zero]
                points.append(GridPoint(dp, tp, zero, plan, "", plan.solve_s, **names))
                continue
            for layout, splits in variants:
                kind = {**names, "layout": layout}
                t0 = time.perf_counter()
                try:
                    problem = restrict_to_grid(full, dp_axis, tp_axis, zero, splits)
                except ShardingError as exc:
                    points.append(GridPoint(dp, tp, zero, None, str(exc), **kind))
                    continue
                sol = problem.cost_tables().solve(capacity, time_limit_s=time_limit_s)
                seconds = time.perf_counter() - t0
                if not sol.choice:
                    why = "does not fit" if sol.status == ilp.INFEASIBLE else "solver time limit"
                    points.append(GridPoint(dp, tp, zero, None, why, seconds, **kind))
                    continue
                plan = plan_from_solution(problem, sol, capacity, seconds)
                points.append(GridPoint(dp, tp, zero, plan, "", seconds, **kind))
    if not points:
        raise ShardingError(f"no grid point for {n} chips")
    return GridResult(points, time.perf_counter() - start)


def grid_label(point: GridPoint) -> str:
    """``dp8 x tp8 zero1 (8x8)`` — the point and its mesh."""
    mesh = point.plan.mesh.label if point.plan is not None else "-"
    return f"{point.label} ({mesh})"


__all__ = [
    "GridPoint",
    "GridResult",
    "default_max_tensor_parallel",
    "grid_label",
    "megatron_grid",
    "megatron_layers",
    "restrict_to_grid",
    "restrict_to_megatron",
]
