"""Hybrid parallelism chosen jointly: pipeline stages x data x tensor parallelism x ZeRO x
micro-batches x schedule x recomputation (issue 18).

Alpa (Zheng et al., OSDI 2022, §5) splits a model into pipeline stages by a dynamic
program over contiguous layer ranges and sub-meshes, calling its intra-operator (sharding)
solver for every candidate stage on every sub-mesh; Megatron-LM (Narayanan et al., SC
2021) adds the schedule (1F1B, interleaved), and Galvatron, Aceso and Mist add
recomputation and optimizer-state sharding to the search. meshplace does the same on a
model with a stack of identical layers (a transformer); step 1 captures two layers when the
workload's depth can vary, and otherwise takes the model's own capture at its own batch
(``graphs``, ``layers``, one micro-batch size):

1. **Intra-stage sharding, solved once per (tensor-parallel degree, micro-batch).** The
   model is captured with two layers at the per-replica micro-batch ``b`` and sharded over
   a ``tp``-device mesh inside one host by the integer program of
   :mod:`meshplace.parallel.search` (no weight-update sharding on that axis; every
   collective charged in full, as the parts below are charged on every micro-batch, so
   the solve minimises what the pipeline DP reads). Every op is
   attributed to the part before the layers (embeddings), to a layer, or to the part after
   them (final norm, head, loss) — backward and optimizer work to the part of its forward
   op or parameter — so the solution gives, per part, the forward and backward seconds of
   one micro-batch (compute, blocking collectives and resharding on the tp axis), the
   optimizer seconds, the parameter, gradient and optimizer-state bytes, and the
   activations kept for backward (:class:`PartCosts`, from the second layer: its input
   arrives from a layer, as in every later one). Identical layers cost what that layer
   costs, so a stage of ``k`` layers is ``k`` times it: repeated layers cost one solve.
   The solve minimises its own one-step objective, not the pipelined score of step 5, so
   each ``tp >= 2`` is also solved under Megatron's pattern
   (:func:`meshplace.parallel.grid.restrict_to_megatron`: its own column- and row-parallel
   layers, read from the graph) and both layouts are candidates.
2. **Data parallelism and ZeRO** over the ``dp`` replicas of a stage, with the collectives
   of :meth:`meshplace.mesh.layout.Mesh.collective_time` on the mesh axis laid across
   hosts: ZeRO-0 all-reduces the gradients after the last micro-batch, ZeRO-1 (Megatron's
   distributed optimizer) reduce-scatters them and all-gathers the updated parameters,
   ZeRO-2 reduce-scatters after every micro-batch, ZeRO-3 also all-gathers the parameters
   before every micro-batch's forward and backward; each overlaps the stage's backward
   (forward for gathers) and only the excess is exposed. ZeRO-1 and up divide the
   optimizer step by ``dp``. DeepSpeed does not combine ZeRO-2/3 with pipelining, and
   neither does the search (``pp > 1``: ZeRO 0 or 1).
3. **Recomputation per stage**: ``none`` keeps every activation of the micro-batches in
   flight, ``full`` keeps only each layer's input and re-runs the layers' forward during
   backward (one more forward). Selective recomputation (Korthikanti et al., 2022) only
   re-runs attention's score computation, which a fused attention kernel never stores, so
   on these models it equals ``none`` and is not offered.
4. **Pipeline DP** (Alpa §5.2, specialised to identical layers and equal sub-meshes of
   ``dp x tp`` devices per stage): for a schedule with ``m`` micro-batches, a split into
   ``p`` stages of ``k_i`` layers with recomputation ``r_i`` costs ``Σ_i t_i + (m - 1)
   max_i t_i`` (``t_i``: stage ``i``'s forward + backward + sends per micro-batch), each
   stage's memory — its parameters, gradients and optimizer state under its ZeRO stage,
   its kept activations times the micro-batches it holds (1F1B: ``min(p - i, m)``;
   GPipe: ``m``) and the largest transient — within each device's capacity. The DP runs
   for each candidate bottleneck ``t_max`` (every stage time that can occur, searched by
   bisection for the smallest feasible and then upwards while ``m t_max`` can still
   win), minimising ``Σ_i t_i`` over stages no slower than it; optimal over contiguous
   splits and per-stage recomputation (:func:`best_split`, brute-force checked).
   Interleaved 1F1B (``v = 2`` chunks per device) is scored for the even split only.
5. **Scoring**: every configuration's best split is then run through the schedule
   simulator (:func:`meshplace.sim.schedule.simulate_schedule`: per-micro-batch forward
   and backward per stage, the activation and gradient sends on the real links, each
   stage's gradient reduction and optimizer step after its last backward), which gives
   the time per global batch that ranks the plans and that the plan reports; plans that do
   not fit are never chosen (:attr:`HybridResult.best`).

A strict co-location class (``meta.strict_colocation``, issue 17) never spans two stages:
where one spans layers or the parts around them, the model stays one stage
(:func:`class_across_stages`).

Enumerated: ``pp`` dividing the chips (at most the layers), ``tp`` in 1, 2, 4, 8 inside a
host, ``dp = chips / (pp tp)``, per-replica micro-batch ``b`` in 1, 2, 4, 8 with ``m =
global batch / (dp b)`` micro-batches, ZeRO 0-3 (0-1 with ``pp > 1``), schedule 1F1B,
GPipe or interleaved, recomputation per stage.

Complexity: ``|b|`` captures and up to ``2 |tp| x |b|`` integer programs, then per
configuration ``O(log(L p) x p L^2)`` for the DP and ``O(p m)`` for the simulation.

Example
-------
>>> from meshplace.hardware import load_cluster
>>> result = hybrid_search("gpt", "124m", load_cluster("h2-8xh100"), global_batch=64,
...                        tensor_parallel=(1,), micro_batch_sizes=(2,))
>>> best = result.best
>>> best.fits, best.dp * best.tp * best.pp == 16
(True, True)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
from meshplace.cost.compute import CostModel
from meshplace.cost.pipeline import GradientAccumulation, HostCosts
from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.hardware.cluster import Cluster
from meshplace.mesh.layout import LayoutError, Mesh, accelerators, build_mesh, mesh_over
from meshplace.parallel.search import dtensor_placements
from meshplace.parallel.sharding import ShardingError, ShardingProblem
from meshplace.parallel.units import (
    best_unit_split,
    bottleneck_search,
    boundary_crossings,
    op_units,
    shared_parameters,
)
from meshplace.sim.schedule import RECOMPUTE, StageTimes, simulate_schedule

HYBRID_SCHEDULES = ("1f1b", "gpipe", "interleaved")
INTERLEAVE_CHUNKS = 2
DEFAULT_TENSOR_PARALLEL = (1, 2, 4, 8)
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
PIPELINE_ZERO = (0, 1)  # DeepSpeed does not run ZeRO-2/3 under pipeline parallelism
PARTS = ("pre", "layer", "post")
#: what a stage's device holds, as the runtime reports it (HybridPlan.stage_held_bytes)
HELD_KINDS = ("parameters", "gradients", "optimizer_state")
MAX_DRAWN = 20_000  # schedule tasks a plan's JSON carries for the report to draw


# ------------------------------------------------------------------ per-part costs
@dataclass(frozen=True)
class Part:
    """One part's cost per micro-batch on one replica of ``tp`` devices (per device).

    Attributes:
        forward_s, backward_s: one micro-batch's forward and backward seconds.
        update_s: the optimizer step (once per global batch), before ZeRO divides it.
        parameter_bytes, gradient_bytes, state_bytes: per device, before ZeRO.
        activation_bytes: kept from forward for backward, per micro-batch.
        input_bytes: the part's input per micro-batch (what full recomputation keeps).
        transient_bytes: the largest working set of one op.
        flops: model FLOPs of one micro-batch (forward + backward, over all tp devices).
        parameter_tensors: how many parameter tensors the part holds (an engine that
            reduces each gradient on its own runs one collective per tensor).
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    parameter_bytes: float = 0.0
    gradient_bytes: float = 0.0
    state_bytes: float = 0.0
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    transient_bytes: float = 0.0
    flops: float = 0.0
    parameter_tensors: float = 0.0


@dataclass(frozen=True)
class PartCosts:
    """The three parts of a layered model at one (tp, micro-batch): what one solve of the
    intra-stage sharding problem gives the pipeline DP.

    Attributes:
        tp, micro_batch: tensor-parallel degree and sequences per micro-batch per replica.
        pre, layer, post: :class:`Part` costs (``layer``: one of the identical layers).
        boundary_bytes: the activation one stage sends the next per micro-batch (the
            layer input, per device).
        boundary_values: how many values cross a cut between layers (the layer input
            and whatever later layers or the last part read from the first part or the
            inputs: rotary tables, labels), each a message of its own.
        tied_bytes: per-device bytes of parameters both the first and the last part read
            (a tied embedding): with ``pp > 1`` both end stages hold them and exchange
            their gradients once per batch.
        strategies: the layer's ops and their tp strategies (for the report).
        solve_s: seconds the capture and the integer program took.
        tensor_placements: every parameter of the captured graph (by name) and its DTensor
            placement on the tp axis (``Shard(k)`` or ``Replicate()``): what the torchrun
            runtime gives the parameters inside a stage.
    """

    tp: int
    micro_batch: int
    pre: Part
    layer: Part
    post: Part
    boundary_bytes: float
    tied_bytes: float
    strategies: dict[str, str] = field(default_factory=dict)
    solve_s: float = 0.0
    tensor_placements: dict[str, str] = field(default_factory=dict)
    boundary_values: int = 1


@dataclass(frozen=True)
class EngineCost:
    """What the training engine runs at one (tp, micro-batch), as a dry run of it records
    it and the search's own cost model prices it (:func:`meshplace.runtime.dryrun.
    engine_pricer`): one tp replica's seconds for one micro-batch's forward and backward
    of the whole model (its kernels, the engine's dispatch of each op, its collectives),
    and for the optimizer's step."""

    forward_backward_s: float
    update_s: float


#: a (tp, micro-batch)'s :class:`PartCosts`, the model's layer count, its layer container
#: and the cluster devices of one tp replica -> the :class:`EngineCost` of that program
EnginePricer = Callable[[PartCosts, int, str, Sequence[int]], EngineCost]


def engine_priced(parts: PartCosts, cost: EngineCost, layers: int) -> PartCosts:
    """``parts`` re-priced by what the engine runs: every part's forward and backward
    seconds scaled by one factor so that the whole model's (``pre + layers x layer +
    post``) are ``cost.forward_backward_s``, and the optimizer's likewise to
    ``cost.update_s``; bytes unchanged. Why: DTensor propagates each op's sharding from
    its operands' (and decomposes ops the solver prices whole), so the program it runs is
    not the solver's; the dry run sees the whole model, and the parts share its time as
    the solver shares theirs. O(1).

    >>> one = Part(forward_s=1.0, backward_s=2.0, update_s=0.5)
    >>> pc = PartCosts(2, 4, one, one, one, boundary_bytes=0.0, tied_bytes=0.0)
    >>> priced = engine_priced(pc, EngineCost(forward_backward_s=36.0, update_s=6.0), 4)
    >>> priced.layer.forward_s, priced.layer.backward_s, priced.layer.update_s
    (2.0, 4.0, 1.0)
    """
    counts = {"pre": 1, "layer": layers, "post": 1}
    parts_of = {k: getattr(parts, k) for k in PARTS}
    fb = sum(counts[k] * (p.forward_s + p.backward_s) for k, p in parts_of.items())
    update = sum(counts[k] * p.update_s for k, p in parts_of.items())
    r_fb = cost.forward_backward_s / fb if fb > 0 else 1.0
    r_u = cost.update_s / update if update > 0 else 1.0
    scaled = {
        k: replace(
            p,
            forward_s=p.forward_s * r_fb,
            backward_s=p.backward_s * r_fb,
            update_s=p.update_s * r_u,
        )
        for k, p in parts_of.items()
    }
    return replace(parts, **scaled)


def layer_container(graph: OpGraph) -> str:
    """The module path holding the repeated layers (``"layers"`` for ``layers.0.attn``): a
    path prefix followed by an index that takes at least two values, not itself inside
    another such stack's layers (a ``Sequential`` within each block). A model with two
    separate stacks (an encoder and a decoder, ResNet's four stages) is refused in one
    sentence: the search cuts one stack.

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for m in ("embed", "layers.0.mlp.0", "layers.0.mlp.1", "layers.1.mlp.0", "head"):
    ...     _ = g.add_op(Op(m, "matmul", module=m))
    >>> layer_container(g)
    'layers'
    """
    seen: dict[str, set[str]] = {}
    for o in graph.ops:
        parts = (o.module or "").split(".")
        for i, p in enumerate(parts):
            if p.isdigit():
                seen.setdefault(".".join(parts[:i]), set()).add(p)
    candidates = [k for k, v in seen.items() if len(v) >= 2]

    def inside(k: str, outer: str) -> bool:  # k lies within one layer of stack `outer`
        rest = k[len(outer) + 1 :] if outer else k
        return (
            k != outer
            and (not outer or k.startswith(outer + "."))
            and (rest.split(".")[0].isdigit())
        )

    stacks = [k for k in candidates if not any(inside(k, o) for o in candidates)]
    if not stacks:
        raise InputError(
            f"graph {graph.name!r} has no stack of repeated layers (module paths such as "
            "layers.0, layers.1): the hybrid search cuts pipeline stages between layers"
        )
    if len(stacks) > 1:
        raise InputError(
            f"graph {graph.name!r} has {len(stacks)} separate layer stacks "
            f"({', '.join(sorted(stacks)[:4])}); the hybrid search cuts a model with one"
        )
    return stacks[0]


def check_layer_stack(graph: OpGraph, part: Sequence[str], layer: Sequence[int]) -> None:
    """Refuse (one sentence) a stack whose layers are not a chain of identical layers —
    each reading the one before, with the same forward FLOPs and parameter bytes — since
    the search prices every layer as one and cuts the stack between layers. O(V + E)."""
    ops = graph.ops
    n = max((x for x in layer if x >= 0), default=-1) + 1
    flops = np.zeros(n)
    params = np.zeros(n)
    for i, o in enumerate(ops):
        if layer[i] >= 0 and o.phase == "forward":
            flops[layer[i]] += o.flops
            params[layer[i]] += o.param_bytes if o.kind == "parameter" else 0.0
    for k in range(1, n):
        for name, values in (("forward FLOPs", flops), ("parameter bytes", params)):
            if not math.isclose(values[k], values[0], rel_tol=1e-6, abs_tol=1e-9):
                raise InputError(
                    f"graph {graph.name!r}: layer {k} has {values[k]:,.0f} {name} and layer 0 "
                    f"{values[0]:,.0f}; the hybrid search needs identical layers"
                )
    a = graph.arrays()
    forward = [o.phase == "forward" for o in ops]
    preds: dict[int, list[int]] = {}
    for src, dst in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True):
        preds.setdefault(dst, []).append(src)
    follows = set()  # layers read (directly or through ops outside the stack) by layer k
    for d in range(len(ops)):
        if layer[d] < 1 or not forward[d]:
            continue
        for src in preds.get(d, []):
            if layer[src] >= 0:
                follows.add((layer[src], layer[d]))
            elif forward[src]:
                follows.update((layer[s2], layer[d]) for s2 in preds.get(src, []) if layer[s2] >= 0)
    for k in range(1, n):
        if (k - 1, k) not in follows:
            raise InputError(
                f"graph {graph.name!r}: layer {k} does not read layer {k - 1}'s output; the "
                "hybrid search cuts a chain of layers, not parallel branches"
            )


def op_parts(graph: OpGraph, container: str) -> tuple[list[str], list[int]]:
    """Part (``pre``, ``layer`` or ``post``) and layer index (-1 outside the layers) of
    every op. Layer ops are those under ``container.N``; a forward op outside them is
    ``pre`` if it runs before the first layer op and ``post`` otherwise; a backward op
    follows its forward op (or, without one, runs ``post`` before the layers' backward
    and ``pre`` after it); a parameter, its update and optimizer state follow the parameter's
    first forward reader. O(V + E).
    """
    ops = graph.ops
    prefix = container + "." if container else ""
    part = [""] * len(ops)
    layer = [-1] * len(ops)
    for i, o in enumerate(ops):
        m = o.module or ""
        if m.startswith(prefix):
            idx = m[len(prefix) :].split(".")[0]
            if idx.isdigit():
                part[i], layer[i] = "layer", int(idx)
    compute = [o.kind not in ("parameter", "buffer", "input") for o in ops]
    fwd_layer = [
        i for i, o in enumerate(ops) if compute[i] and o.phase == "forward" and part[i] == "layer"
    ]
    bwd_layer = [
        i for i, o in enumerate(ops) if compute[i] and o.phase == "backward" and part[i] == "layer"
    ]
    first_fwd = fwd_layer[0] if fwd_layer else len(ops)
    last_bwd = bwd_layer[-1] if bwd_layer else -1
    index = {o.name: i for i, o in enumerate(ops)}
    for i, o in enumerate(ops):
        if part[i] or o.kind in ("parameter", "buffer") or o.phase == "update":
            continue
        if o.phase == "forward" or o.kind == "input":
            part[i] = "pre" if i < first_fwd or o.kind == "input" else "post"
        elif o.forward_op is not None and o.forward_op in index and part[index[o.forward_op]]:
            f = index[o.forward_op]
            part[i], layer[i] = part[f], layer[f]
        else:
            part[i] = "pre" if i > last_bwd else "post"
    # parameters, buffers and update ops: their parameter's first forward reader
    a = graph.arrays()
    succ = {i: [] for i in range(len(ops))}
    for s, d in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True):
        succ[s].append(d)
    for i, o in enumerate(ops):
        if o.kind in ("parameter", "buffer") and not part[i]:
            readers = [d for d in succ[i] if ops[d].phase == "forward" and part[d]]
            first = min(readers) if readers else None
            part[i], layer[i] = (part[first], layer[first]) if first is not None else ("post", -1)
    owner: dict[str, int] = {}
    for i, o in enumerate(ops):
        if o.kind == "parameter":
            owner.setdefault(o.module or "", i)
    for i, o in enumerate(ops):  # update ops: beside the parameter of their module
        if not part[i]:
            j = owner.get(o.module or "")
            part[i], layer[i] = (part[j], layer[j]) if j is not None else ("post", -1)
    return part, layer


def layer_count(graph: OpGraph) -> int:
    """How many layers the stack of :func:`layer_container` holds.

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for m in ("embed", "h.0.mlp", "h.1.mlp", "h.2.attn"):
    ...     _ = g.add_op(Op(m, "matmul", module=m))
    >>> layer_count(g)
    3
    """
    _, layer = op_parts(graph, layer_container(graph))
    return len({x for x in layer if x >= 0})


def graph_batch(graph: OpGraph) -> int:
    """The batch a captured graph was traced at
    (:func:`meshplace.graph.summary.traced_batch`); :class:`InputError` when the inputs
    do not agree on one.

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("input:ids", "input", output_shapes=[[4, 32]]))
    >>> graph_batch(g)
    4
    """
    from meshplace.graph.summary import traced_batch

    batch = traced_batch(graph)
    if batch is None:
        raise InputError(
            f"graph {graph.name!r}: cannot tell its batch size (its inputs do not share a "
            "leading dimension); the hybrid search splits the batch into micro-batches"
        )
    return batch


def class_across_stages(graph: OpGraph) -> str | None:
    """The first strict co-location class (issue 17) whose ops lie in two different parts
    or layers — one a pipeline cut could split — or ``None``. O(V).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g", meta={"strict_colocation": True})
    >>> for name, module, key in (("a", "layers.0", "k"), ("b", "layers.1", "k")):
    ...     _ = g.add_op(Op(name, "matmul", module=module, colocation=key))
    >>> class_across_stages(g)
    'k'
    """
    from meshplace.graph.groups import strict_classes

    classes = strict_classes(graph)
    if not classes:
        return None
    part, layer = op_parts(graph, layer_container(graph))
    for key, members in classes.items():
        if len({(part[i], layer[i]) for i in members}) > 1:
            return key
    return None


def has_layer_stack(graph: OpGraph) -> bool:
    """Whether ``graph`` has one stack of identical layers in a chain, which the search
    prices by one layer (else it is cut between units, :mod:`meshplace.parallel.units`).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for m in ("stem", "stage1.0", "stage2.0"):
    ...     _ = g.add_op(Op(m, "conv", module=m))
    >>> has_layer_stack(g)
    False
    """
    try:
        container = layer_container(graph)
        part, layer = op_parts(graph, container)
        check_layer_stack(graph, part, layer)
    except InputError:
        return False
    return True


def class_across_units(graph: OpGraph) -> str | None:
    """:func:`class_across_stages` for a model cut between units: the first strict
    co-location class whose ops lie in two units, or ``None``. O(V + E)."""
    from meshplace.graph.groups import strict_classes

    classes = strict_classes(graph)
    if not classes:
        return None
    unit = op_units(graph)[1]
    for key, members in classes.items():
        if len({int(unit[i]) for i in members}) > 1:
            return key
    return None


def tied_parameters(graph: OpGraph, part: Sequence[str]) -> list[int]:
    """Parameters read in forward by both the ``pre`` and the ``post`` part."""
    a = graph.arrays()
    readers: dict[int, set[str]] = {}
    for s, d in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True):
        if graph.ops[s].kind == "parameter" and graph.ops[d].phase == "forward":
            readers.setdefault(s, set()).add(part[d])
    return sorted(i for i, r in readers.items() if {"pre", "post"} <= r)


def part_costs(
    graph: OpGraph,
    cluster: Cluster,
    tp: int,
    micro_batch: int,
    *,
    cost_model: CostModel | None = None,
    time_limit_s: float = 20.0,
    restrict: Callable[..., ShardingProblem] | None = None,
    compute: str = "eager",
) -> PartCosts:
    """Shard the two-layer ``graph`` (captured at ``micro_batch`` sequences) over ``tp``
    devices of one host and read each part's costs off the solution (module docstring,
    step 1); ``restrict`` (:func:`meshplace.parallel.grid.restrict_to_megatron`) limits
    the tp axis to Megatron's pattern; ``compute`` is the sharding problem's compute model
    (``"eager"``: one kernel per op; ``"fused"``: point-wise chains fused). Raises
    :class:`ShardingError` when no sharding exists on that mesh."""
    start = time.perf_counter()
    container = layer_container(graph)
    part, layer = op_parts(graph, container)
    check_layer_stack(graph, part, layer)
    problem, choice = _solve_over_tp(
        graph, cluster, tp, cost_model, compute, time_limit_s, restrict
    )
    layers_present = sorted({x for x in layer if x >= 0})
    probe = layers_present[-1]  # a layer whose input comes from a layer

    def bucket(i: int) -> str | None:
        if part[i] == "layer":
            return "layer" if layer[i] == probe else None
        return part[i]

    tied = set(tied_parameters(graph, part))
    acc, tied_bytes = _attributed_costs(problem, choice, bucket, PARTS, tied)
    ops = graph.ops
    # the activation a stage boundary carries: what the probe layer's forward reads from
    # outside it (its input), per device as placed (replicated over tp unless split)
    a = graph.arrays()
    boundary = 0.0
    seen: set[int] = set()
    for s, d, nbytes in zip(
        a.edge_src.tolist(), a.edge_dst.tolist(), a.edge_bytes.tolist(), strict=True
    ):
        if (
            bucket(d) == "layer"
            and ops[d].phase == "forward"
            and bucket(s) != "layer"
            and ops[s].phase == "forward"
            and ops[s].kind not in ("parameter", "buffer")
            and s not in seen
        ):
            seen.add(s)
            boundary += float(nbytes)
    # every value a cut between layers carries (the runtime passes on what a later stage
    # reads): the layer's input, what layers or the last part read of the first part's
    # values and the inputs, and the buffers of modules outside the layer stack that the
    # layers read (a Llama's rotary tables: the first stage reads them off the root)
    prefix = container + "." if container else ""

    def carried_by_cuts(s: int, d: int) -> bool:
        if ops[s].phase != "forward" or ops[d].phase != "forward":
            return False
        if ops[s].kind == "buffer":
            return part[d] == "layer" and not (ops[s].module or "").startswith(prefix)
        return part[s] == "pre" and part[d] in ("layer", "post") and ops[s].kind != "parameter"

    carried = {
        s
        for s, d in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True)
        if carried_by_cuts(s, d)
    }
    acc["layer"]["input_bytes"] = boundary
    acc["post"]["input_bytes"] = boundary
    strategies = {
        ops[g.anchor].name: g.strategies[choice[gi]].name
        for gi, g in enumerate(problem.groups)
        if bucket(g.anchor) == "layer" and g.kind == "op"
    }
    return PartCosts(
        tp,
        micro_batch,
        *(Part(**acc[p]) for p in PARTS),
        boundary_bytes=boundary,
        tied_bytes=tied_bytes,
        strategies=strategies,
        solve_s=time.perf_counter() - start,
        tensor_placements=like_probe_layer(tensor_placements(problem, choice), container, probe),
        boundary_values=max(1, len(carried)),
    )


def like_probe_layer(placements: dict[str, str], container: str, probe: int) -> dict[str, str]:
    """``placements`` with every layer's parameters placed as the probe layer's are: the
    per-part costs count the probe layer once per layer, so that is the placement they
    price (a whole-model capture may solve other layers differently). O(parameters).

    >>> like_probe_layer({"layers.0.w": "Shard(1)", "layers.1.w": "Shard(0)", "e": "Shard(0)"},
    ...                  "layers", 1)
    {'layers.0.w': 'Shard(0)', 'layers.1.w': 'Shard(0)', 'e': 'Shard(0)'}
    """
    prefix = f"{container}."
    out = {}
    for name, placement in placements.items():
        index, _, rest = name.removeprefix(prefix).partition(".")
        if name.startswith(prefix) and index.isdigit() and rest:
            placement = placements.get(f"{prefix}{probe}.{rest}", placement)
        out[name] = placement
    return out


def _solve_over_tp(
    graph: OpGraph,
    cluster: Cluster,
    tp: int,
    cost_model: CostModel | None,
    compute: str,
    time_limit_s: float,
    restrict: Callable[..., ShardingProblem] | None = None,
) -> tuple[ShardingProblem, list[int]]:
    """The integer program of ``graph`` over a ``tp``-device mesh of one host (no ZeRO on
    that axis; ``restrict``: Megatron's pattern, a grid's baseline) and each group's
    chosen strategy; :class:`ShardingError` when it has no solution. Every collective is
    charged in full (``overlap=False``), as :func:`_attributed_costs` charges the parts
    on every micro-batch: the solve then minimises the very sum the pipeline DP reads.
    (With the overlapped timeline it chose layouts whose weights are fetched ahead of
    their readers and whose gradients are reduced behind backward, 3-17 % dearer in
    that sum on a 2-layer GPT at tp 2-8 than the layouts it now finds.)"""
    mesh = build_mesh(cluster, (tp,), chips=tp)
    problem = ShardingProblem(
        graph, mesh, zero_stages=(0,), cost_model=cost_model, compute=compute, overlap=False
    )
    if restrict is not None:
        problem = restrict(problem, None, 0, 0)
    solution = problem.cost_tables().solve(float("inf"), time_limit_s=time_limit_s)
    if not solution.choice:
        raise ShardingError(f"the sharding solver found no plan of {graph.name!r} over {tp}")
    return problem, [solution.choice[int(problem.class_of[g])] for g in range(len(problem.groups))]


def tensor_placements(problem: ShardingProblem, choice: Sequence[int]) -> dict[str, str]:
    """Each parameter's DTensor placement on the (one) tp axis of a solution (``choice``
    per group), by the parameter's name: ``Shard(k)`` or ``Replicate()``. O(groups)."""
    ops = problem.graph.ops
    return {
        ops[g.anchor].name.removeprefix("param:"): dtensor_placements(
            g.strategies[choice[gi]].out_specs[0][0]
        )[0]
        for gi, g in enumerate(problem.groups)
        if g.kind == "parameter"
    }


def _attributed_costs(
    problem: ShardingProblem,
    choice: Sequence[int],
    bucket: Callable[[int], Any],
    buckets: Sequence[Any],
    tied: set[int],
) -> tuple[dict[Any, dict[str, float]], float]:
    """Each bucket's costs in a sharding solution (``choice`` per group): forward,
    backward and optimizer seconds (compute, collectives on the tp axis, resharding into
    the bucket's ops), parameter, gradient, optimizer-state and kept-activation bytes per
    device, the largest working set, and model FLOPs; ``bucket(op)`` names an op's bucket
    (``None``: not counted). Also the per-device bytes of the ``tied`` parameters. O(V + E)."""
    acc: dict[Any, dict[str, float]] = {b: {} for b in buckets}
    tied_bytes = 0.0  # per device, as the solution places them

    def add(b: Any, key: str, value: float) -> None:
        if b is not None:
            acc[b][key] = acc[b].get(key, 0.0) + float(value)

    ops = problem.graph.ops
    phase_key = {"forward": "forward_s", "backward": "backward_s", "update": "update_s"}
    for gi, g in enumerate(problem.groups):
        st = g.strategies[choice[gi]]
        anchor = ops[g.anchor]
        b = bucket(g.anchor)
        key = phase_key.get(anchor.phase, "forward_s")
        if g.kind == "parameter":
            # a parameter group holds its optimizer update (its compute) and its gradient's
            # reduction over the tp axis where the ILP splits the batch there (its comm)
            if g.anchor in tied:
                tied_bytes += st.parts.get("parameters", 0.0)
            add(b, "update_s", st.compute_s)
            add(b, "parameter_tensors", 1.0)
            add(b, "backward_s", st.comm_s)
            add(b, "forward_s", st.gather_s if st.gathers >= 1 else 0.0)
            add(b, "backward_s", st.gather_s if st.gathers >= 2 else 0.0)
        else:
            add(b, key, st.compute_s + st.comm_s)
        for k, v in st.parts.items():
            name = {
                "parameters": "parameter_bytes",
                "gradients": "gradient_bytes",
                "optimizer_state": "state_bytes",
                "activations": "activation_bytes",
            }.get(k)
            if name is not None:
                add(b, name, v)
        if b is not None:
            acc[b]["transient_bytes"] = max(acc[b].get("transient_bytes", 0.0), st.transient)
    events = problem.events()
    for gu, gv in events.bundles:
        gv_anchor = problem.groups[gv].anchor
        t = _bundle_seconds(problem, choice, gu, gv, events)
        add(bucket(gv_anchor), phase_key.get(ops[gv_anchor].phase, "forward_s"), t)
    for i, o in enumerate(ops):  # model FLOPs: forward and backward (not the optimizer)
        if o.phase != "update":
            add(bucket(i), "flops", o.flops)
    return acc, tied_bytes


def _bundle_seconds(
    problem: ShardingProblem, choice: Sequence[int], gu: int, gv: int, events: Any
) -> float:
    """Resharding seconds of the edge bundle from group ``gu`` to ``gv`` under ``choice``
    (as :meth:`ShardingProblem.timeline` charges it)."""
    su = problem.groups[gu].strategies[choice[gu]]
    sv = problem.groups[gv].strategies[choice[gv]]
    t = 0.0
    for pu, out, pv, j in events.bundles[(gu, gv)]:
        rec = problem.graph.ops[problem.groups[gv].members[pv]].operands[j]
        t += problem.reshard(
            su.out_specs[pu][out],
            sv.in_specs[pv][j],
            rec["map"],
            rec["shape"],
            problem.itemsize(rec["op"], rec["out"]),
            problem.edge_bucket_bytes(gu, gv),
        )[0]
    return t


# ------------------------------------------------------------------ the pipeline DP
def best_split(
    stage_time: np.ndarray, feasible: np.ndarray, micro_batches: int
) -> tuple[float, list[int], list[int]]:
    """The split of ``L`` identical layers into ``p`` contiguous stages, with one option
    (recomputation) per stage, minimising ``Σ_i t_i + (m - 1) max_i t_i`` (Alpa, Zheng et
    al., OSDI 2022, §5.2: the latency of a synchronous pipeline of ``m`` micro-batches).

    ``stage_time[i, k, r]``: seconds per micro-batch of stage ``i`` (of ``p``) holding
    ``k`` layers (``k = 0..L``; ``k = 0`` is never used) with option ``r``;
    ``feasible[i, k, r]``: whether that stage fits its devices. For each candidate
    bottleneck ``t_max`` (a value of ``stage_time``) a DP over (stage, layers placed)
    minimises ``Σ t_i`` over stages no slower than ``t_max``; the smallest feasible
    ``t_max`` is found by bisection (feasibility grows with it), then larger ones are
    tried while ``(m - 1) t_max`` plus the unconstrained ``Σ`` can still win. Returns
    ``(objective, layers per stage, option per stage)``, or ``(inf, [], [])``.

    Complexity: ``O(log(p L R) + tried) x p L^2``.

    >>> t = np.zeros((2, 4, 1)); t[:, 1:, 0] = np.arange(1, 4)  # k layers take k seconds
    >>> best_split(t, np.ones_like(t, dtype=bool), micro_batches=4)  # 1 + 2 + 3 x 2
    (9.0, [1, 2], [0, 0])
    """
    p, n_k, _ = stage_time.shape
    n_layers = n_k - 1
    ok = feasible.copy()
    ok[:, 0, :] = False
    finite = stage_time[ok]
    if not finite.size or p > n_layers:
        return float("inf"), [], []
    candidates = np.unique(finite)
    gap = np.arange(n_k)[None, :] - np.arange(n_k)[:, None]  # l' - l
    valid_gap = (gap >= 1) & (gap <= n_layers)
    gap_index = np.clip(gap, 0, n_layers)

    def solve(t_max: float) -> tuple[float, list[int], list[int]]:
        allowed = ok & (stage_time <= t_max)
        masked = np.where(allowed, stage_time, np.inf)
        option = np.argmin(masked, axis=2)  # [p, n_k]: the cheapest allowed option
        cost = np.take_along_axis(masked, option[:, :, None], axis=2)[:, :, 0]
        f = np.full(n_k, np.inf)
        f[0] = 0.0
        back: list[np.ndarray] = []
        for i in range(p):
            c = np.where(valid_gap, cost[i][gap_index], np.inf)  # [l, l']
            total = f[:, None] + c
            arg = np.argmin(total, axis=0)
            f = total[arg, np.arange(n_k)]
            back.append(arg)
        if not np.isfinite(f[n_layers]):
            return float("inf"), [], []
        layers: list[int] = []
        end = n_layers
        for i in reversed(range(p)):
            start = int(back[i][end])
            layers.append(end - start)
            end = start
        layers.reverse()
        options = [int(option[i, k]) for i, k in enumerate(layers)]
        return float(f[n_layers]), layers, options

    def slowest(layers: list[int], options: list[int]) -> float:
        return max(float(stage_time[i, k, r]) for i, (k, r) in enumerate(zip(layers, options)))

    return bottleneck_search(candidates, solve, slowest, micro_batches)


def brute_force_split(
    stage_time: np.ndarray, feasible: np.ndarray, micro_batches: int
) -> tuple[float, list[int], list[int]]:
    """:func:`best_split` by enumerating every composition of the layers and every option
    per stage (the tests' oracle; exponential)."""
    p, n_k, n_r = stage_time.shape
    n_layers = n_k - 1
    best: tuple[float, list[int], list[int]] = (float("inf"), [], [])
    for cuts in itertools.combinations(range(1, n_layers), p - 1):
        bounds = (0, *cuts, n_layers)
        layers = [bounds[i + 1] - bounds[i] for i in range(p)]
        for options in itertools.product(range(n_r), repeat=p):
            if not all(feasible[i, k, r] for i, (k, r) in enumerate(zip(layers, options))):
                continue
            times = [float(stage_time[i, k, r]) for i, (k, r) in enumerate(zip(layers, options))]
            value = sum(times) + (micro_batches - 1) * max(times)
            if value < best[0] - 1e-15:
                best = (value, layers, list(options))
    return best


# ------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class HybridConfig:
    """One point of the outer search: degrees, micro-batching, ZeRO stage, schedule."""

    pp: int
    dp: int
    tp: int
    micro_batch: int  # sequences per micro-batch per data-parallel replica
    micro_batches: int
    zero: int
    schedule: str

    @property
    def label(self) -> str:
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch}x{self.micro_batches} "
            f"zero{self.zero} {self.schedule}"
        )


@dataclass
class HybridPlan:
    """A configuration with its stages, simulated time per global batch and memory."""

    config: HybridConfig
    layers_per_stage: list[int]
    recompute: list[str]
    time_per_batch_s: float
    closed_form_s: float
    bubble_fraction: float
    stage_forward_s: list[float]
    stage_backward_s: list[float]
    stage_memory_bytes: list[float]
    capacity_bytes: float
    model_flops: float
    chips: int
    peak_flops: float
    #: per stage, once per batch after the schedule: the gradients' synchronisation, the
    #: tied weights' exchange and, on a stage of several devices, its ranks' wait for the
    #: slowest (the cost model's ``sync_skew``, :func:`_waiting_for_the_slowest`)
    sync_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    strategies: dict[str, str] = field(default_factory=dict)
    stage_times: StageTimes | None = field(default=None, repr=False)
    schedule_tasks: list[list[float]] = field(default_factory=list, repr=False)
    stage_units: list[str] = field(default_factory=list)
    #: every parameter's placement on the tp axis (:func:`tensor_placements`)
    tensor_placements: dict[str, str] = field(default_factory=dict)
    #: per stage, a device's parameter, gradient and optimizer-state bytes after ZeRO
    stage_held_bytes: list[dict[str, float]] = field(default_factory=list)
    #: whose tensor-parallel layout the stages run: the sharding solver's (``"solver"``)
    #: or Megatron's pattern (``"megatron"``, where the solver chose another)
    tensor_layout: str = "solver"

    @property
    def fits(self) -> bool:
        return all(m <= self.capacity_bytes for m in self.stage_memory_bytes)

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs per batch (no recomputation) over
        the time per batch times every chip's peak."""
        denominator = self.time_per_batch_s * self.chips * self.peak_flops
        return self.model_flops / denominator if denominator > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "dp": c.dp,
            "tp": c.tp,
            "pp": c.pp,
            "micro_batch": c.micro_batch,
            "micro_batches": c.micro_batches,
            "zero": c.zero,
            "schedule": c.schedule,
            "layers_per_stage": self.layers_per_stage,
            "recompute": self.recompute,
            "time_per_batch_s": self.time_per_batch_s,
            "closed_form_s": self.closed_form_s,
            "bubble_fraction": self.bubble_fraction,
            "mfu": self.mfu,
            "stage_forward_s": self.stage_forward_s,
            "stage_backward_s": self.stage_backward_s,
            "stage_memory_bytes": self.stage_memory_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "sync_s": self.sync_s,
            "update_s": self.update_s,
            "label": c.label,
            "tensor_layout": self.tensor_layout,
            # a model cut between heterogeneous units: each stage's first and last unit
            **({"stage_units": self.stage_units} if self.stage_units else {}),
            # what the report draws: [device, virtual stage, 0 forward / 1 backward,
            # micro-batch, start, end] per task, for schedules small enough to draw
            "schedule_tasks": self.schedule_tasks if len(self.schedule_tasks) <= MAX_DRAWN else [],
        }


@dataclass
class HybridResult:
    """Every configuration's best split, simulated ones first by time."""

    model: str
    chips: int
    global_batch: int
    layers: int
    plans: list[HybridPlan]
    search_s: float
    solves: int
    configurations: int
    part_costs: dict[tuple[int, int], PartCosts | UnitCosts] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    micro_batch_sizes: tuple[int, ...] = ()
    units: list[str] = field(default_factory=list)
    #: the module path of the layer stack stages are cut in (``"layers"``; "" for units)
    layer_container: str = ""
    #: the joint search's solves under Megatron's pattern, where they differ from the
    #: solver's (plans with ``tensor_layout == "megatron"`` were scored on these)
    megatron_part_costs: dict[tuple[int, int], PartCosts | UnitCosts] = field(default_factory=dict)

    def costs_of(self, plan: HybridPlan) -> PartCosts | UnitCosts:
        """The parts ``plan`` was scored on."""
        key = (plan.tp, plan.config.micro_batch)
        if plan.tensor_layout == "megatron" and key in self.megatron_part_costs:
            return self.megatron_part_costs[key]
        return self.part_costs[key]

    @property
    def best(self) -> HybridPlan:
        """The fastest plan that fits; :class:`ShardingError` (one sentence) if none."""
        fitting = [p for p in self.plans if p.fits and not math.isnan(p.time_per_batch_s)]
        if not self.plans:
            why = "; ".join(f"{k}: {v}" for k, v in self.skipped.items()) or (
                "no data x tensor x pipeline degrees divide the chips, and the global batch "
                "into micro-batches of "
                + " or ".join(map(str, self.micro_batch_sizes or ("?",)))
                + " sequences"
                + (f", with at most {self.layers} stages" if self.layers else "")
            )
            raise ShardingError(
                f"no hybrid configuration of {self.model} exists for {self.chips} chips at "
                f"global batch {self.global_batch}: {why}"
            )
        if not fitting:
            raise ShardingError(
                f"no hybrid plan of {self.model} fits {self.chips} chips at global batch "
                f"{self.global_batch}: every configuration's stages exceed device memory"
            )
        return min(fitting, key=lambda p: p.time_per_batch_s)


# ------------------------------------------------------------------ heterogeneous units
@dataclass(frozen=True)
class UnitCosts:
    """A model without identical layers at one (tp, micro-batch): each pipeline unit's
    :class:`Part` from one solve of the whole model (:mod:`meshplace.parallel.units`).

    Attributes:
        names: the units in execution order; ``units``: their costs.
        boundary_bytes: ``[U + 1]`` activation bytes crossing the cut before unit ``c``.
        boundary_values: ``[U + 1]`` how many values cross it (each a message).
        shared: per parameter several units read (a tied embedding), its per-device
            parameter, gradient and optimizer-state bytes and its reader units.
    """

    tp: int
    micro_batch: int
    names: list[str]
    units: list[Part]
    boundary_bytes: np.ndarray
    shared: list[tuple[float, float, float, list[int]]]
    strategies: dict[str, str] = field(default_factory=dict)
    solve_s: float = 0.0
    tensor_placements: dict[str, str] = field(default_factory=dict)
    boundary_values: np.ndarray | None = None


def unit_costs(
    graph: OpGraph,
    cluster: Cluster,
    tp: int,
    micro_batch: int,
    *,
    cost_model: CostModel | None = None,
    time_limit_s: float = 20.0,
    compute: str = "eager",
) -> UnitCosts:
    """Shard the whole ``graph`` (captured at ``micro_batch``) over ``tp`` devices of one
    host and read each unit's costs off the solution — :func:`part_costs` for a model cut
    between heterogeneous units (:func:`meshplace.parallel.units.op_units`). Raises
    :class:`ShardingError` when no sharding exists on that mesh."""
    start = time.perf_counter()
    names, unit = op_units(graph)
    problem, choice = _solve_over_tp(graph, cluster, tp, cost_model, compute, time_limit_s)
    n_units = len(names)
    acc, _ = _attributed_costs(problem, choice, lambda i: int(unit[i]), range(n_units), set())
    crossing, values = boundary_crossings(graph, unit, n_units)
    readers = shared_parameters(graph, unit)
    shared = []
    for gi, g in enumerate(problem.groups):
        if g.kind == "parameter" and g.anchor in readers:
            parts = g.strategies[choice[gi]].parts
            kinds = ("parameters", "gradients", "optimizer_state")
            held = [float(parts.get(k, 0.0)) for k in kinds]
            shared.append((held[0], held[1], held[2], readers[g.anchor]))
    ops = graph.ops
    strategies = {
        ops[g.anchor].name: g.strategies[choice[gi]].name
        for gi, g in enumerate(problem.groups)
        if g.kind == "op"
    }
    return UnitCosts(
        tp,
        micro_batch,
        names,
        [Part(**{**acc[u], "input_bytes": float(crossing[u])}) for u in range(n_units)],
        crossing,
        shared,
        strategies,
        time.perf_counter() - start,
        tensor_placements(problem, choice),
        values,
    )


def _range_sum(values: np.ndarray) -> np.ndarray:
    """``[U + 1, U + 1]``: the sum of ``values[s:e]`` at ``[s, e]`` (0 where ``e <= s``)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return np.maximum(prefix[None, :] - prefix[:, None], 0.0)


def _range_max(values: np.ndarray) -> np.ndarray:
    """``[U + 1, U + 1]``: the largest of ``values[s:e]`` at ``[s, e]`` (0 where ``e <= s``)."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for s in range(n):
        out[s, s + 1 :] = np.maximum.accumulate(values[s:])
    return out


def _unit_stage_model(
    uc: UnitCosts,
    config: HybridConfig,
    mesh: Mesh,
    dp_axis: str | None,
    synchronous: bool = False,
) -> dict[str, np.ndarray]:
    """:func:`_stage_model` for units: each array ``[p, U + 1, U + 1, R]`` indexed by
    stage position, first unit, end unit and recomputation (``full`` keeps each unit's
    input and re-runs its forward during backward)."""
    p, dp, z = config.pp, config.dp, config.zero

    def attr(name: str) -> np.ndarray:
        return np.array([getattr(u, name) for u in uc.units], dtype=np.float64)

    def summed(name: str) -> np.ndarray:
        return _range_sum(attr(name))[None, :, :, None]

    full = np.array([0.0, 1.0])[None, None, None, :]  # recompute: none, full
    n = len(uc.units) + 1
    # a parameter several units read: a stage with a reader but not the first keeps a
    # copy, with its gradient and optimizer state (sharded by ZeRO like its own)
    copies = np.zeros((4, n, n))  # bytes of parameters, gradients, state; tensors
    s_idx, e_idx = np.arange(n)[:, None], np.arange(n)[None, :]
    for p_bytes, g_bytes, s_bytes, readers in uc.shared:
        owner = readers[0]
        holds_owner = (s_idx <= owner) & (owner < e_idx)
        holds_reader = np.zeros((n, n), dtype=bool)
        for r in readers[1:]:
            holds_reader |= (s_idx <= r) & (r < e_idx)
        copy = holds_reader & ~holds_owner
        copies += np.array([p_bytes, g_bytes, s_bytes, 1.0])[:, None, None] * copy
    params = summed("parameter_bytes") + copies[0][None, :, :, None]
    grads = summed("gradient_bytes") + copies[1][None, :, :, None]
    state = summed("state_bytes") + copies[2][None, :, :, None]

    def collective(kind: str, nbytes: np.ndarray) -> np.ndarray:
        if dp_axis is None or dp == 1:
            return np.zeros_like(nbytes)
        unique, inverse = np.unique(nbytes, return_inverse=True)
        times = np.array([mesh.collective_time(kind, float(b), [dp_axis]) for b in unique])
        return times[inverse].reshape(nbytes.shape)

    fwd = summed("forward_s")
    forward = fwd + 0.0 * full
    backward = summed("backward_s") + full * fwd
    if z >= 3:
        gather = collective("all_gather", params)
        forward = forward + np.maximum(gather - forward, 0.0)
        backward = backward + np.maximum(gather - backward, 0.0)
    if z >= 3 or (z == 2 and not synchronous):
        scatter = collective("reduce_scatter", grads)
        backward = backward + np.maximum(scatter - backward, 0.0)
    divisor = {"p": dp if z >= 3 else 1, "g": dp if z >= 2 else 1, "s": dp if z >= 1 else 1}
    resident = params / divisor["p"] + grads / divisor["g"] + state / divisor["s"]
    kept = np.where(full > 0, summed("input_bytes"), summed("activation_bytes"))
    transient = (
        _range_max(attr("transient_bytes"))[None, :, :, None]
        + full * _range_max(attr("activation_bytes"))[None, :, :, None]
        + (_range_max(attr("parameter_bytes"))[None, :, :, None] if z >= 3 else 0.0)
    )
    shape = (p, n, n, len(RECOMPUTE))
    return {
        "forward": np.broadcast_to(forward, shape),
        "backward": np.broadcast_to(backward, shape),
        "kept": np.broadcast_to(kept, shape),
        "resident": np.broadcast_to(resident, shape),
        "transient": np.broadcast_to(transient, shape),
        "params": np.broadcast_to(params, shape),
        "grads": np.broadcast_to(grads, shape),
        "tensors": np.broadcast_to(
            summed("parameter_tensors") + copies[3][None, :, :, None], shape
        ),
        "update": np.broadcast_to(summed("update_s") / divisor["s"], shape),
        **_held(params, grads, state, divisor, shape),
    }


def _evaluate_units(
    uc: UnitCosts,
    config: HybridConfig,
    capacity: float,
    stage_mesh: Mesh,
    dp_axis: str | None,
    link_s: Callable[[int, int, float], float],
    peak_flops: float,
    global_batch: int,
    chips: int,
    synchronous: bool = False,
    host: HostCosts | None = None,
    send_s: Callable[[int, int, float], float] | None = None,
    accumulation: GradientAccumulation | None = None,
) -> HybridPlan | None:
    """:func:`_evaluate` for a model cut between heterogeneous units: the DP over (first
    unit, end unit) ranges (:func:`meshplace.parallel.units.best_unit_split`), each
    stage charged the activation it receives and the gradient it sends back at its own
    cuts. ``None`` for more stages than units and for the interleaved schedule (whose
    chunks need equal stages)."""
    p, m = config.pp, config.micro_batches
    n_units = len(uc.units)
    if p > n_units or config.schedule == "interleaved":
        return None
    send_s = send_s or link_s
    model = _unit_stage_model(uc, config, stage_mesh, dp_axis, synchronous)
    model = (accumulation or GradientAccumulation()).charge(model, m)
    n = n_units + 1
    crossing = uc.boundary_bytes
    # a stage's messages are those of its first cut (activation in, gradient out) and of
    # its end cut (activation out, gradient in)
    cut_bytes = np.asarray(crossing, dtype=np.float64)
    values = np.ones(n) if uc.boundary_values is None else np.asarray(uc.boundary_values, float)
    model = (host or HostCosts()).charge(
        model,
        cut_bytes[None, :, None, None],
        cut_bytes[None, None, :, None],
        values[None, :, None, None],
        values[None, None, :, None],
    )
    arrive = np.zeros((p, n, 1, 1))  # stage i's input at its first cut (and its gradient back)
    leave = np.zeros((p, 1, n, 1))  # stage i's output at its end cut (and the gradient in)
    for i in range(p):
        if i > 0:
            arrive[i, :, 0, 0] = [send_s(i - 1, i, float(b)) if b else 0.0 for b in crossing]
        if i < p - 1:
            leave[i, 0, :, 0] = [send_s(i, i + 1, float(b)) if b else 0.0 for b in crossing]
    times = model["forward"] + model["backward"] + arrive + leave
    flight = in_flight(config.schedule, p, m)[:, None, None, None]
    memory = model["resident"] + flight * model["kept"] + model["transient"]
    value, bounds, options = best_unit_split(times, memory <= capacity, m)
    if not bounds:  # nothing fits: the fastest split regardless, reported as OOM
        value, bounds, options = best_unit_split(times, np.ones_like(memory, dtype=bool), m)
        if not bounds:
            return None
    idx = (np.arange(p), np.array(bounds[:-1]), np.array(bounds[1:]), np.array(options))
    sync = _stage_syncs(config, model, idx, stage_mesh, dp_axis, synchronous)
    waiting = _waiting_for_the_slowest(host or HostCosts(), model, idx, stage_mesh, m)
    sync = [float(s + w) for s, w in zip(sync, waiting, strict=True)]
    stage_of = np.searchsorted(np.array(bounds[1:]), np.arange(n_units), side="right")
    for _, g_bytes, _, readers in uc.shared:  # a shared parameter's gradient, both ways
        owner = int(stage_of[readers[0]])
        for j in sorted({int(stage_of[r]) for r in readers[1:]} - {owner}):
            t = link_s(min(owner, j), max(owner, j), g_bytes)
            sync[owner] += t
            sync[j] += t
    flops = sum(u.flops for u in uc.units)
    cut = [float(crossing[bounds[i + 1]]) for i in range(p - 1)]
    sends = np.array([send_s(i, i + 1, b) if b else 0.0 for i, b in enumerate(cut)])
    plan = _plan_of(
        config, [bounds[i + 1] - bounds[i] for i in range(p)], options, value, model, idx,
        memory, sync, capacity, (global_batch / config.micro_batch) * flops, chips, peak_flops,
        uc.strategies,
    )  # fmt: skip
    plan.tensor_placements = uc.tensor_placements
    plan.stage_units = [
        uc.names[bounds[i]]
        if bounds[i + 1] - bounds[i] == 1
        else f"{uc.names[bounds[i]]} – {uc.names[bounds[i + 1] - 1]}"
        for i in range(p)
    ]
    update = plan.update_s
    plan.stage_times = StageTimes(
        np.array(plan.stage_forward_s), np.array(plan.stage_backward_s), sends, None,
        np.array(sync), np.array(update),
    )  # fmt: skip
    return plan


# ------------------------------------------------------------------ the search
def _stage_model(
    pc: PartCosts,
    config: HybridConfig,
    layers: int,
    mesh: Mesh,
    dp_axis: str | None,
    synchronous: bool = False,
) -> dict[str, np.ndarray]:
    """Per stage position ``i``, layers ``k`` and recomputation ``r``: forward, backward
    (with the exposed per-micro-batch ZeRO traffic), kept-activation bytes per micro-batch
    in flight, resident bytes and transient bytes, each an array ``[p, L + 1, R]``; plus
    per stage the once-per-batch gradient synchronisation and optimizer step.
    ``synchronous``: meshplace's torchrun runtime, which accumulates a ZeRO-2 stage's
    gradients whole over the micro-batches and reduce-scatters them once, after the
    schedule (:func:`_sync_seconds`), where DeepSpeed reduces after every micro-batch;
    ZeRO 3's reduce-scatter is autograd's, per micro-batch, in both."""
    p, dp, z = config.pp, config.dp, config.zero
    k = np.arange(layers + 1, dtype=np.float64)[None, :, None]
    first = np.zeros((p, 1, 1))
    first[0] = 1.0
    last = np.zeros((p, 1, 1))
    last[-1] = 1.0
    full = np.array([0.0, 1.0])[None, None, :]  # recompute: none, full
    L, pre, post = pc.layer, pc.pre, pc.post

    def total(attr: str) -> np.ndarray:
        return k * getattr(L, attr) + first * getattr(pre, attr) + last * getattr(post, attr)

    # a tied embedding: the last stage holds its own copy when pp > 1
    pre_params = max(pre.parameter_bytes, 1.0)
    tied_share = min(pc.tied_bytes / pre_params, 1.0) if p > 1 else 0.0
    params = total("parameter_bytes") + last * tied_share * pre.parameter_bytes
    grads = total("gradient_bytes") + last * tied_share * pre.gradient_bytes
    tensors = total("parameter_tensors") + last * float(tied_share > 0)  # the tied copy
    state = total("state_bytes") + last * tied_share * pre.state_bytes

    def collective(kind: str, nbytes: np.ndarray | float) -> np.ndarray:
        if dp_axis is None or dp == 1:
            return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
        flat = np.asarray(nbytes, dtype=np.float64)
        unique, inverse = np.unique(flat, return_inverse=True)
        times = np.array([mesh.collective_time(kind, float(b), [dp_axis]) for b in unique])
        return times[inverse].reshape(flat.shape)

    forward = total("forward_s") + 0.0 * full
    backward = total("backward_s") + full * k * L.forward_s
    if z >= 3:  # parameters gathered before every micro-batch's forward and backward
        gather = collective("all_gather", params)
        forward = forward + np.maximum(gather - forward, 0.0)
        backward = backward + np.maximum(gather - backward, 0.0)
    if z >= 3 or (z == 2 and not synchronous):  # reduce-scattered after each backward
        scatter = collective("reduce_scatter", grads)
        backward = backward + np.maximum(scatter - backward, 0.0)
    divisor = {"p": dp if z >= 3 else 1, "g": dp if z >= 2 else 1, "s": dp if z >= 1 else 1}
    resident = params / divisor["p"] + grads / divisor["g"] + state / divisor["s"]
    kept = (
        k * np.where(full > 0, L.input_bytes, L.activation_bytes)
        + first * pre.activation_bytes
        + last * post.activation_bytes
    )
    # the largest op's working set, plus one layer's activations rebuilt for its backward
    # under full recomputation, plus (ZeRO-3) one layer's parameters gathered whole while it
    # runs (FSDP's unit)
    transient = (
        max(L.transient_bytes, pre.transient_bytes, post.transient_bytes)
        + full * L.activation_bytes
        + (L.parameter_bytes if z >= 3 else 0.0)
    )
    return {
        "forward": np.broadcast_to(forward, (p, layers + 1, 2)),
        "backward": np.broadcast_to(backward, (p, layers + 1, 2)),
        "kept": np.broadcast_to(kept, (p, layers + 1, 2)),
        "resident": np.broadcast_to(resident, (p, layers + 1, 2)),
        "transient": np.broadcast_to(transient, (p, layers + 1, 2)),
        "params": np.broadcast_to(params, (p, layers + 1, 2)),
        "grads": np.broadcast_to(grads, (p, layers + 1, 2)),
        "tensors": np.broadcast_to(tensors, (p, layers + 1, 2)),
        "update": np.broadcast_to(total("update_s") / divisor["s"], (p, layers + 1, 2)),
        **_held(params, grads, state, divisor, (p, layers + 1, 2)),
    }


def _held(
    params: np.ndarray,
    grads: np.ndarray,
    state: np.ndarray,
    divisor: dict[str, int],
    shape: tuple[int, ...],
) -> dict[str, np.ndarray]:
    """What a device of a stage holds between steps and at the step, after ZeRO divides it
    (parameters from stage 3, gradients from 2, optimizer state from 1): the bytes the
    torchrun runtime reports per rank."""
    return {
        "held_parameters": np.broadcast_to(params / divisor["p"], shape),
        "held_gradients": np.broadcast_to(grads / divisor["g"], shape),
        "held_optimizer_state": np.broadcast_to(state / divisor["s"], shape),
    }


def _sync_seconds(
    config: HybridConfig,
    grads: float,
    params: float,
    forward: float,
    backward: float,
    mesh: Mesh,
    axis: str | None,
    synchronous: bool = False,
) -> float:
    """Exposed once-per-batch data-parallel synchronisation of one stage (module
    docstring, step 2): the gradient reduction after the last backward, overlapping that
    backward except for its last bucket of
    :data:`~meshplace.cost.collectives.GRADIENT_BUCKET_BYTES`, which starts when the
    backward ends (ZeRO-0 all-reduce, ZeRO-1 reduce-scatter; ZeRO-2/3 reduce-scatter after
    every micro-batch instead, in the stage model, the last bucket of the last one
    exposed here), and ZeRO-1/2's all-gather of the updated parameters, which the next
    step's first forward can overlap. ``synchronous``: the engine of meshplace's
    torchrun runtime, which after the schedule all-reduces the gradients in buckets of
    :data:`~meshplace.cost.collectives.GRADIENT_BUCKET_BYTES` (ZeRO 0 and 1; a ZeRO-1
    shard is then a local slice) or reduce-scatters them onto the shards in flat buckets
    of as many bytes (ZeRO 2), and gathers the updated parameters in flat buckets (ZeRO 1
    and 2), overlapping nothing."""
    if axis is None or config.dp == 1:
        return 0.0
    z = config.zero

    # DDP's, FSDP2's and the runtime's flat buckets: the process group's own calls
    def collective(kind: str, nbytes: float) -> float:
        return mesh.collective_time(kind, nbytes, [axis], c10d=True)

    def in_buckets(kind: str, nbytes: float) -> float:
        buckets = max(1.0, float(math.ceil(nbytes / GRADIENT_BUCKET_BYTES)))
        return buckets * mesh.collective_time(kind, nbytes / buckets, [axis], c10d=True)

    if synchronous:
        kind = {0: "all_reduce", 1: "all_reduce", 2: "reduce_scatter"}.get(z)
        reduce = in_buckets(kind, grads) if kind else 0.0
        return reduce + (in_buckets("all_gather", params) if z in (1, 2) else 0.0)
    reduce = tail = 0.0
    if grads > 0:
        kind = "all_reduce" if z == 0 else "reduce_scatter"
        whole = collective(kind, grads)
        # buckets are reduced as the backward fills them, so all but the last can hide
        # behind it; the last (all of a model whose gradients fit in one bucket) starts
        # when the backward ends; ZeRO-2/3 reduce after every micro-batch (the stage
        # model), and only the last micro-batch's last bucket waits here
        buckets = max(1.0, float(math.ceil(grads / GRADIENT_BUCKET_BYTES)))
        last = grads - (buckets - 1) * GRADIENT_BUCKET_BYTES
        tail = min(whole, mesh.collective_time(kind, last, [axis], c10d=True))
        reduce = whole if z < 2 else tail
    gather = collective("all_gather", params) if z in (1, 2) else 0.0
    return tail + max(0.0, reduce - tail - backward) + max(0.0, gather - forward)


def _waiting_for_the_slowest(
    host: HostCosts, model: dict[str, np.ndarray], idx: tuple, stage_mesh: Mesh, m: int
) -> np.ndarray:
    """Per stage, what its ranks' meetings cost a step beyond the collectives: ``host``'s
    ``sync_skew`` times the stage's local work (``m`` micro-batches' forward and
    backward), where the stage spans more than one device (its data- or tensor-parallel
    ranks meet in collectives and wait for the slowest, :func:`meshplace.profile.link.
    measure_sync_skew`); 0 for a stage of one device, whose only meetings are the
    pipeline's exchanges, measured with them (:class:`HostCosts`' ``exchange``)."""
    if not host.sync_skew or stage_mesh.size <= 1:
        return np.zeros(len(idx[0]))
    return host.sync_skew * m * (model["forward"][idx] + model["backward"][idx])


def _stage_syncs(
    config: HybridConfig,
    model: dict[str, np.ndarray],
    idx: tuple[np.ndarray, ...],
    mesh: Mesh,
    axis: str | None,
    synchronous: bool = False,
) -> list[float]:
    """:func:`_sync_seconds` of each stage of a split (``idx`` into the stage model)."""
    forward, backward = model["forward"][idx], model["backward"][idx]
    grads, params = model["grads"][idx], model["params"][idx]
    return [
        _sync_seconds(
            config, float(grads[i]), float(params[i]), float(forward[i]), float(backward[i]),
            mesh, axis, synchronous,
        )
        for i in range(config.pp)
    ]  # fmt: skip


def _plan_of(
    config: HybridConfig,
    per_stage: list[int],
    options: Sequence[int],
    value: float,
    model: dict[str, np.ndarray],
    idx: tuple[np.ndarray, ...],
    memory: np.ndarray,
    sync: list[float],
    capacity: float,
    model_flops: float,
    chips: int,
    peak_flops: float,
    strategies: dict[str, str],
) -> HybridPlan:
    """The :class:`HybridPlan` of a split (``idx`` into the stage model): its closed form
    is the DP's value plus the slowest stage's synchronisation and optimizer step."""
    update = [float(x) for x in model["update"][idx]]
    held = [
        {kind: float(model[f"held_{kind}"][idx][i]) for kind in HELD_KINDS}
        for i in range(len(per_stage))
    ]
    return HybridPlan(
        config,
        per_stage,
        [RECOMPUTE[o] for o in options],
        float("nan"),
        float(value) + max(a + b for a, b in zip(sync, update, strict=True)),
        float("nan"),
        [float(x) for x in model["forward"][idx]],
        [float(x) for x in model["backward"][idx]],
        [float(x) for x in memory[idx]],
        capacity,
        model_flops,
        chips,
        peak_flops,
        sync,
        update,
        strategies,
        stage_held_bytes=held,
    )


def in_flight(schedule: str, stages: int, micro_batches: int) -> np.ndarray:
    """Micro-batches stage ``i`` holds at its peak: 1F1B ``min(p - i, m)``, GPipe ``m``.

    >>> in_flight("1f1b", 4, 2).tolist(), in_flight("gpipe", 2, 3).tolist()
    ([2, 2, 2, 1], [3, 3])
    """
    i = np.arange(stages)
    if schedule == "gpipe":
        return np.full(stages, micro_batches)
    return np.minimum(stages - i, micro_batches)


def _evaluate(
    pc: PartCosts,
    config: HybridConfig,
    layers: int,
    capacity: float,
    stage_mesh: Mesh,
    dp_axis: str | None,
    link_s: Callable[[int, int, float], float],
    peak_flops: float,
    global_batch: int,
    chips: int,
    uniform: bool = False,
    synchronous: bool = False,
    host: HostCosts | None = None,
    send_s: Callable[[int, int, float], float] | None = None,
    accumulation: GradientAccumulation | None = None,
) -> HybridPlan | None:
    """The best split of one configuration by the DP (``uniform``: equal stages and one
    recomputation for all, as a Megatron-style grid sets them), ranked by its closed form;
    :func:`simulate_plan` then runs its schedule. ``host``: the pipelining engine's and
    the stage messages' cost to the stages' compute (:class:`HostCosts`). ``None`` where
    the configuration has no split (more stages than layers, an interleaving the layers or
    micro-batches do not divide). ``send_s``: a micro-batch's message between two stages
    (default ``link_s``, which also times the once-per-step exchanges). ``accumulation``:
    what adding a micro-batch's gradients into the held ones costs a device
    (:class:`GradientAccumulation`, charged on every stage's backward)."""
    p, m = config.pp, config.micro_batches
    if p > layers:
        return None
    host = host or HostCosts()
    send_s = send_s or link_s
    accumulation = accumulation or GradientAccumulation()
    model = accumulation.charge(
        _stage_model(pc, config, layers, stage_mesh, dp_axis, synchronous), m
    )
    nbytes = np.full((p, 1, 1), float(pc.boundary_bytes))
    model = host.charge(model, nbytes, nbytes, pc.boundary_values, pc.boundary_values)
    send = np.array([send_s(i, i + 1, pc.boundary_bytes) for i in range(max(p - 1, 0))])
    per_stage_send = np.zeros(p)
    if p > 1:
        per_stage_send[:-1] += send  # activations out
        per_stage_send[1:] += send  # gradients back
    times = model["forward"] + model["backward"] + per_stage_send[:, None, None]
    v = INTERLEAVE_CHUNKS if config.schedule == "interleaved" else 1
    if v > 1:
        if layers % (p * v) or m % p or p < 2:
            return None
        # a device's v chunks hold the micro-batches the schedule keeps in flight:
        # Megatron-LM's count for stage 0, (p v + p - 1) chunk-micro-batches, is the most
        flight = np.minimum((p * v + p - 1 - 2 * np.arange(p)) / v, m)[:, None, None]
    else:
        flight = in_flight(config.schedule, p, m)[:, None, None]
    memory = model["resident"] + flight * model["kept"] + model["transient"]
    feasible = memory <= capacity
    if uniform or v > 1:
        if layers % p:
            return None
        split = [layers // p] * p
        choices = []
        for r in range(len(RECOMPUTE)):
            t = [float(times[i, k, r]) for i, k in enumerate(split)]
            ok = all(feasible[i, k, r] for i, k in enumerate(split))
            value = sum(t) + (m - 1) * max(t) if v == 1 else m * max(t) + (p - 1) * max(t) / v
            choices.append((not ok, value, r))
        _, value, r = min(choices)
        options = [r] * p
    else:
        value, split, options = best_split(times, feasible, m)
        if not split:  # nothing fits: the fastest split regardless, reported as OOM
            value, split, options = best_split(times, np.ones_like(feasible), m)
            if not split:
                return None
    idx = (np.arange(p), np.array(split), np.array(options))
    sync = _stage_syncs(config, model, idx, stage_mesh, dp_axis, synchronous)
    waiting = _waiting_for_the_slowest(host, model, idx, stage_mesh, m)
    sync = [float(s + w) for s, w in zip(sync, waiting, strict=True)]
    if p > 1 and pc.tied_bytes:  # the tied embedding's gradient, first <-> last stage
        tie = link_s(0, p - 1, pc.tied_bytes)
        sync[0] += tie
        sync[-1] += tie
    model_flops = (global_batch / config.micro_batch) * (
        pc.pre.flops + layers * pc.layer.flops + pc.post.flops
    )
    plan = _plan_of(
        config, [int(x) for x in split], options, value, model, idx, memory, sync, capacity,
        model_flops, chips, peak_flops, pc.strategies,
    )  # fmt: skip
    plan.tensor_placements = pc.tensor_placements
    wrap = send_s(p - 1, 0, pc.boundary_bytes) if v > 1 else 0.0
    # a device's accumulation per micro-batch, its chunks' shares (interleaving)
    accumulated = accumulation.per_micro_batch(
        model["held_gradients"][idx], model["tensors"][idx], m
    )
    plan.stage_times = _stage_times(pc, plan, send, wrap, v, host, accumulated)
    return plan


def _stage_times(
    pc: PartCosts,
    plan: HybridPlan,
    send: np.ndarray,
    wrap: float,
    v: int,
    host: HostCosts | None = None,
    accumulated: np.ndarray | None = None,
) -> StageTimes:
    """The (virtual) stages' times for the schedule simulator: virtual stage ``s`` runs on
    device ``s mod p``, so its send crosses the link ``s mod p -> (s + 1) mod p``
    (``wrap`` from the last device back to the first); each virtual stage pays ``host``'s
    costs as :meth:`HostCosts.charge` charges a stage, and its share (``1 / v``) of its
    device's gradient accumulation per micro-batch (``accumulated``, which a one-chunk
    stage's backward already holds)."""
    p = plan.pp
    host = (host or HostCosts()).pipelined(p * v)
    sync, update = np.array(plan.sync_s), np.array(plan.update_s)
    if v == 1:
        return StageTimes(
            np.array(plan.stage_forward_s), np.array(plan.stage_backward_s), send, None, sync,
            update,
        )  # fmt: skip
    forward, backward = [], []
    for chunk in range(v):
        for i in range(p):
            k = plan.layers_per_stage[i] / v
            full = 1.0 if plan.recompute[i] == "full" else 0.0
            pre = 1.0 if (chunk == 0 and i == 0) else 0.0
            post = 1.0 if (chunk == v - 1 and i == p - 1) else 0.0
            s_index, last_s = chunk * p + i, p * v - 1
            into, out = host.stage_messages(pc.boundary_bytes, s_index > 0, s_index < last_s)
            cuts = ((s_index > 0) + (s_index < last_s)) * host.cut_s(pc.boundary_values)
            forward.append(
                k * pc.layer.forward_s
                + pre * pc.pre.forward_s
                + post * pc.post.forward_s
                + (host.engine_s + host.data_parallel_s + cuts) / 2
                + into[0]
                + out[0]
            )
            backward.append(
                k * (pc.layer.backward_s + full * pc.layer.forward_s)
                + pre * pc.pre.backward_s
                + post * pc.post.backward_s
                + (host.engine_s + host.data_parallel_s + cuts) / 2
                + into[1]
                + out[1]
                + (0.0 if accumulated is None else float(accumulated[i]) / v)
            )
    per_device = [*(float(x) for x in send), float(wrap)]  # device d -> d + 1 (mod p)
    wire = np.array([per_device[s % p] for s in range(p * v - 1)])
    return StageTimes(np.array(forward), np.array(backward), wire, None, sync, update)


def simulate_plan(plan: HybridPlan) -> HybridPlan:
    """Run ``plan``'s schedule in the simulator: its time per global batch and bubble."""
    c = plan.config
    v = INTERLEAVE_CHUNKS if c.schedule == "interleaved" else 1
    result = simulate_schedule(plan.stage_times, c.schedule, c.micro_batches, v)
    plan.time_per_batch_s = float(result.step_s)
    plan.bubble_fraction = float(result.bubble_fraction)
    plan.schedule_tasks = [
        [t["device"], t["stage"], 0 if t["kind"] == "F" else 1, t["micro_batch"], t["start_s"],
         t["end_s"]]
        for t in result.tasks
    ]  # fmt: skip
    return plan


def capture_layers(
    workload: str, size: str | None, layers: int, batch: int, autocast: str | None = "bf16"
) -> OpGraph:
    """Capture ``workload`` (a reference workload whose depth can vary, such as ``gpt``)
    with ``layers`` layers at ``batch`` sequences, one training step with Adam."""
    from meshplace.graph.capture import capture
    from meshplace.models import get

    w = get(workload, size=size, batch=batch, layers=layers)
    return capture(
        w.model,
        w.example_inputs,
        training=True,
        name=f"{workload}-{w.size}-{layers}layers-b{batch}",
        dims=w.dims,
        autocast=autocast,
    )


def _plan_key(plan: HybridPlan) -> tuple:
    """What makes two candidate plans the same plan: configuration, split, recomputation,
    layouts and closed-form time."""
    return (
        plan.config,
        tuple(plan.layers_per_stage),
        tuple(plan.recompute),
        tuple(sorted(plan.tensor_placements.items())),
        tuple(sorted(plan.strategies.items())),
        plan.closed_form_s,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hybrid_search(
    workload: str,
    size: str | None,
    cluster: Cluster,
    *,
    global_batch: int,
    chips: int | None = None,
    tensor_parallel: Sequence[int] = DEFAULT_TENSOR_PARALLEL,
    micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
    schedules: Sequence[str] = HYBRID_SCHEDULES,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    pipeline_degrees: Sequence[int] | None = None,
    memory_fraction: float = 1.0,
    autocast: str | None = "bf16",
    cost_model: CostModel | None = None,
    compute: str = "eager",
    style: str = "joint",
    simulate_top: int = 12,
    progress: Callable[[str], None] | None = None,
    graphs: Callable[[int], OpGraph] | None = None,
    layers: int | None = None,
    units: bool | None = None,
    solved: dict[tuple[int, int, str], PartCosts | UnitCosts] | None = None,
    synchronous_gradients: bool = False,
    engine: EnginePricer | None = None,
) -> HybridResult:
    """The fastest hybrid plan of ``workload`` (module docstring) that fits.

    ``style="joint"`` searches everything; ``"megatron"`` is the hand grid a user of
    Megatron-LM searches, scored by the same model: Megatron's tensor-parallel pattern
    (:func:`meshplace.parallel.grid.restrict_to_megatron`), equal stages, one recomputation for
    all, ZeRO 0 or 1. On a layer stack the joint search also solves Megatron's pattern at
    each (tp >= 2, micro-batch) and simulates the grid's own best ``simulate_top`` plans
    beside its own, so its best plan is never slower than the grid's. ``compute``: the
    sharding problem's compute model (``"fused"`` for the fused kernels Megatron-LM and
    torch.compile run). ``graphs`` (optional) gives the
    graph at a micro-batch size — two layers of a deeper model, or a model's own capture at
    its own batch (``micro_batch_sizes`` then that batch) — and ``layers`` the full depth
    (by default the graph's own stack). A model with no stack of identical layers (ResNet's
    stages, an encoder and a decoder; ``units=True`` forces it, ``None`` decides by
    :func:`has_layer_stack`) is cut between its units instead
    (:mod:`meshplace.parallel.units`): one solve of the whole graph per (tp, micro-batch),
    the DP over unit ranges, no interleaving. ``solved`` (optional) holds the per-(tp,
    micro-batch) costs of earlier searches of the same model on the same cluster, keyed
    ``(tp, micro_batch, "solver" | "megatron")``, reused and extended: the sharding solves
    do not depend on the chip count or the batch.
    The ``simulate_top`` plans best by the DP's closed form are simulated; the fastest
    simulated plan that fits is :attr:`HybridResult.best`. ``synchronous_gradients``:
    score data parallelism as meshplace's torchrun runtime runs it: stages with tensor
    parallelism or ZeRO on DTensor, their gradients reduced after the schedule one bucket
    at a time, none overlapped; data-parallel stages without ZeRO on DDP, plain tensors
    (no DTensor dispatch) with the gradients bucketed and overlapped with the backward
    (default: every configuration as DDP and Megatron-LM run it, bucketed and overlapped).
    ``engine`` (optional; a layer stack only): tensor parallelism priced by the program
    the engine runs rather than by the solver's strategies — each (tp >= 2, micro-batch)'s
    parts re-priced by :func:`engine_priced` with what ``engine`` says that program costs
    (:func:`meshplace.runtime.dryrun.engine_pricer`: a dry run of the torchrun runtime);
    where the engine cannot run it, that (tp, micro-batch) is skipped, with the reason.
    """
    from meshplace.models import get

    if style not in ("joint", "megatron"):
        raise InputError(f"unknown search style {style!r}; choose joint or megatron")
    if not 0 < memory_fraction <= 1:
        raise InputError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    bad = [s for s in schedules if s not in HYBRID_SCHEDULES]
    if bad:
        raise InputError(f"unknown schedule {bad[0]!r}; choose from {', '.join(HYBRID_SCHEDULES)}")
    if global_batch < 1:
        raise InputError(
            f"the global batch must be a positive number of sequences, got {global_batch}"
        )
    start = time.perf_counter()
    accel = accelerators(cluster)
    order = cluster.ring_order(accel)  # a host's devices consecutive
    n = int(chips) if chips is not None else len(accel)
    if not 1 <= n <= len(accel):
        raise InputError(f"{cluster.name} has {len(accel)} accelerators, asked for {n}")
    if graphs is None:
        depth = get(workload, size=size).dims.get("layers")
        if not depth:
            raise InputError(f"workload {workload!r} has no layer count to split into stages")
        layers = int(depth)

        def graphs(batch: int) -> OpGraph:
            return capture_layers(workload, size, 2, batch, autocast)

    device = cluster.devices[accel[0]]
    capacity = device.spec.memory_bytes * memory_fraction
    peak = device.spec.peak("bfloat16" if autocast else "float32")
    from meshplace.parallel.grid import default_max_tensor_parallel, restrict_to_megatron

    max_tp = default_max_tensor_parallel(cluster, n)
    tps = [t for t in tensor_parallel if t <= max_tp and n % t == 0]
    parts: dict[tuple[int, int], PartCosts | UnitCosts] = {}
    skipped: dict[str, str] = {}
    captured: dict[int, OpGraph] = {}
    for b in micro_batch_sizes:
        if global_batch % b == 0 and tps:
            if progress is not None:
                progress(f"capturing micro-batch {b}")
            try:
                captured[b] = graphs(b)
            except InputError as exc:  # a model that cannot run at this batch
                skipped[f"mb{b}"] = str(exc)
    unit_names: list[str] = []
    container = ""
    if captured:
        first = next(iter(captured.values()))
        if units is None:
            units = not has_layer_stack(first)
        if units:
            if style == "megatron":
                raise InputError(
                    f"graph {first.name!r} has no stack of identical layers, which the "
                    "Megatron-style grid splits evenly; search it with the joint style"
                )
            unit_names = op_units(first)[0]
            layers = len(unit_names)
        else:
            container = layer_container(first)
            if layers is None:
                layers = layer_count(first)
    if captured and (layers is None or layers < 1):
        raise InputError("the hybrid search needs the model's layer count with its graphs")
    layers = layers or 0  # nothing captured: no configuration, said by HybridResult.best
    solves = 0
    # A stage on one device (no data or tensor parallelism) runs plain tensors, not
    # DTensors (meshplace.runtime.hybrid), so it pays no engine dispatch: its parts are
    # costed again without it (keyed by tp 0), when the cost model has one and a
    # pipeline of one-device stages is possible.
    plain_model = (
        replace(
            cost_model,
            dispatch_overhead={},
            split_dispatch_overhead={},
            batch_dispatch_overhead={},
        )
        if cost_model is not None
        else None
    )
    plain_stages = (
        plain_model is not None
        and any(cost_model.dispatch_overhead.values())
        and 1 in tps
        and (
            n in (pipeline_degrees if pipeline_degrees is not None else [n])
            or (synchronous_gradients and 0 in zero_stages)  # the runtime's DDP stages
        )
    )
    own_pattern = "megatron" if style == "megatron" else "solver"
    # The joint search also keeps Megatron's tensor-parallel pattern of each (tp >= 2,
    # micro-batch) as candidates of their own: the solver minimises its one-step
    # objective, not the pipelined score, so the layout it picks can score below
    # Megatron's; with both, the joint search contains the grid's every plan.
    patterns = [own_pattern] + (["megatron"] if style == "joint" and not units else [])
    grid_parts: dict[tuple[int, int], PartCosts | UnitCosts] = {}
    for b, graph in captured.items():
        for tp in [*tps, *([0] if plain_stages else [])]:
            for pattern in patterns:
                if pattern != own_pattern and tp < 2:
                    continue  # a one-device mesh has no layout to restrict
                into = parts if pattern == own_pattern else grid_parts
                key = (tp, b, pattern)
                if solved is not None and key in solved:
                    into[(tp, b)] = solved[key]
                    continue
                if progress is not None:
                    progress(
                        f"tp {max(tp, 1)}, micro-batch {b}"
                        + (" (plain tensors)" if not tp else "")
                        + (" (Megatron's pattern)" if pattern != own_pattern else "")
                    )
                model = plain_model if tp == 0 else cost_model
                try:
                    if units:
                        into[(tp, b)] = unit_costs(
                            graph, cluster, max(tp, 1), b, cost_model=model, compute=compute
                        )
                    else:
                        into[(tp, b)] = part_costs(
                            graph,
                            cluster,
                            max(tp, 1),
                            b,
                            cost_model=model,
                            restrict=restrict_to_megatron if pattern == "megatron" else None,
                            compute=compute,
                        )
                    solves += 1
                    if solved is not None:
                        solved[key] = into[(tp, b)]
                except (ShardingError, LayoutError) as exc:
                    suffix = " megatron" if pattern != own_pattern else ""
                    skipped[f"tp{max(tp, 1)} mb{b}{suffix}"] = str(exc)
    for key, pc in list(grid_parts.items()):
        own = parts.get(key)
        if (
            isinstance(own, PartCosts)
            and isinstance(pc, PartCosts)
            and own.tensor_placements == pc.tensor_placements
            and own.strategies == pc.strategies
        ):
            del grid_parts[key]  # the solver chose Megatron's layout: nothing new
    if engine is not None and units:
        skipped["engine"] = (
            "the model is cut between units, whose tensor parallelism the sharding solver "
            "prices: the engine's dry run prices a layer stack's only"
        )
    elif engine is not None:
        for into in (parts, grid_parts):
            for (tp, b), pc in sorted(into.items()):
                if tp < 2 or not isinstance(pc, PartCosts):
                    continue
                if progress is not None:
                    progress(f"tp {tp}, micro-batch {b}: the engine's program")
                try:
                    priced = engine(pc, layers, container, order[:tp])
                except InputError as exc:  # the engine cannot run it: neither can the plan
                    del into[(tp, b)]
                    suffix = " megatron" if into is grid_parts else ""
                    skipped[f"tp{tp} mb{b}{suffix}"] = str(exc)
                    continue
                into[(tp, b)] = engine_priced(pc, priced, layers)
    degrees = [d for d in _divisors(n) if d <= layers]
    if pipeline_degrees is not None:
        degrees = [d for d in degrees if d in set(pipeline_degrees)]
    across = class_across_units if units else class_across_stages
    crossing = next((k for k in map(across, captured.values()) if k), None)
    if crossing is not None:  # a strict class no stage cut may split: one stage only
        degrees = [d for d in degrees if d == 1]
        skipped["pipeline"] = (
            f"strict co-location class {crossing!r} spans layers or the parts around them, "
            "so the model is not cut into stages"
        )
    candidates: list[HybridPlan] = []
    configurations = 0
    meshes: dict[tuple[int, int], Mesh] = {}
    kind = device.kind
    # what the cost model says a message between stages costs its two ends' compute
    # (host-staged devices) and what the pipelining engine adds per micro-batch and stage
    host = HostCosts.of(cost_model, kind)
    ddp_host = HostCosts.of(cost_model, kind, ddp=True)  # a stage DDP runs: its hooks too
    # each micro-batch after the first adds its gradients into the held ones (on plain
    # tensors, without the engine's dispatch, where a stage runs them)
    accumulation = GradientAccumulation.of(cost_model, kind, device.spec)
    plain_accumulation = GradientAccumulation.of(cost_model, kind, device.spec, dispatched=False)

    def evaluated(
        view: dict[tuple[int, int], PartCosts | UnitCosts], megatron: bool
    ) -> list[HybridPlan]:
        """Every configuration's best split over ``view``'s parts (``megatron``: the
        grid's rules, equal stages and ZeRO 0-1), closed form only."""
        found: list[HybridPlan] = []
        for (tp, b), pc in sorted(view.items()):
            if tp == 0:  # one-device stages' plain-tensor costs: used for tp 1 below
                continue
            for pp in degrees:
                if n % (pp * tp):
                    continue
                dp = n // (pp * tp)
                # a one-device stage: the same parts without the engine's dispatch
                costs = parts[(0, b)] if dp * tp == 1 and (0, b) in parts else pc
                if global_batch % (dp * b):
                    continue
                m = global_batch // (dp * b)
                if (dp, tp) not in meshes:
                    # tensor parallelism on consecutive devices (inside a host, as the sharding
                    # solve assumed), data parallelism across them: stage 0's devices
                    devices = np.array(order[: dp * tp]).reshape(dp, tp)
                    meshes[(dp, tp)] = mesh_over(
                        cluster, devices, ("data", "tensor"), "tp inner"
                    ).calibrated(cost_model)
                mesh = meshes[(dp, tp)]
                dp_axis = "data" if dp > 1 else None
                stage_size = dp * tp

                def link_s(i: int, j: int, nbytes: float, stage_size: int = stage_size) -> float:
                    a, z = order[i * stage_size], order[j * stage_size]
                    return cluster.transfer_time(a, z, nbytes) if a != z else 0.0

                def send_s(i: int, j: int, nbytes: float, stage_size: int = stage_size) -> float:
                    # a micro-batch's message between stages: its latency is inside a
                    # measured exchange where the cost model has one (HostCosts.wire_s)
                    a, z = order[i * stage_size], order[j * stage_size]
                    if a == z:
                        return 0.0
                    return host.wire_s(
                        cluster.transfer_time(a, z, nbytes), cluster.path_latency(a, z)
                    )

                zs = [z for z in zero_stages if pp == 1 or z in PIPELINE_ZERO]
                if megatron:
                    zs = [z for z in zs if z in PIPELINE_ZERO]
                for z in zs:
                    for schedule in schedules if pp > 1 else tuple(schedules)[:1]:
                        # meshplace's runtime runs a data-parallel stage without ZeRO on DDP
                        # (not an interleaved one's): plain tensors, the gradients bucketed
                        # and reduced during the backward
                        ddp = synchronous_gradients and tp == 1 and dp > 1 and z == 0
                        ddp = ddp and schedule != "interleaved"
                        staged = parts[(0, b)] if ddp and (0, b) in parts else costs
                        synchronous = synchronous_gradients and not ddp
                        config = HybridConfig(pp, dp, tp, b, m, z, schedule)
                        counted[0] += 1
                        charged = ddp_host if ddp else host
                        if engine is not None and tp > 1 and not units:
                            # the engine's price of a tensor-parallel replica holds its
                            # ranks' synchronisation skew (EngineProgram.predict)
                            charged = replace(charged, sync_skew=0.0)
                        plain = (0, b) in parts and staged is parts[(0, b)]
                        adding = plain_accumulation if plain else accumulation
                        if pp == 1 and schedule == "1f1b":
                            # the runtime accumulates one stage's micro-batches without a
                            # schedule (runtime.hybrid.accumulate_micro_batches): no engine
                            charged = replace(charged, engine_s=0.0)
                        if isinstance(staged, UnitCosts):
                            plan = _evaluate_units(
                                staged, config, capacity, mesh, dp_axis, link_s, peak, global_batch,
                                n, synchronous=synchronous, host=charged, send_s=send_s,
                                accumulation=adding,
                            )  # fmt: skip
                        else:
                            plan = _evaluate(
                                staged, config, layers, capacity, mesh, dp_axis, link_s, peak,
                                global_batch, n, uniform=megatron,
                                synchronous=synchronous, host=charged, send_s=send_s,
                                accumulation=adding,
                            )  # fmt: skip
                        if plan is not None:
                            if tp > 1 and (style == "megatron" or pc is grid_parts.get((tp, b))):
                                plan = replace(plan, tensor_layout="megatron")
                            found.append(plan)
        return found

    counted = [0]
    candidates = evaluated(parts, style == "megatron")
    candidates.sort(key=lambda p: (not p.fits, p.closed_form_s))
    chosen, rest = candidates[:simulate_top], candidates[simulate_top:]
    if grid_parts:  # the grid's own candidates, ranked and cut as the grid ranks them
        grid = evaluated({**parts, **grid_parts}, True)
        grid.sort(key=lambda p: (not p.fits, p.closed_form_s))
        kept = {_plan_key(p) for p in chosen}
        for p in grid[:simulate_top]:
            if _plan_key(p) not in kept:
                chosen.append(p)
                kept.add(_plan_key(p))
        others, rest = rest + grid[simulate_top:], []
        for p in others:
            if _plan_key(p) not in kept:
                rest.append(p)
                kept.add(_plan_key(p))
        rest.sort(key=lambda p: (not p.fits, p.closed_form_s))
    configurations = counted[0]
    simulated = [simulate_plan(p) for p in chosen]
    simulated.sort(key=lambda p: (not p.fits, p.time_per_batch_s))
    return HybridResult(
        workload if size is None else f"{workload} {size}",
        n,
        global_batch,
        layers,
        simulated + rest,
        time.perf_counter() - start,
        solves,
        configurations,
        parts,
        skipped,
        tuple(micro_batch_sizes),
        unit_names,
        container,
        grid_parts,
    )
