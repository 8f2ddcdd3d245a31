"""Automatic SPMD sharding of a captured training graph on one device mesh.

Source: the intra-operator pass of Alpa (Zheng et al., OSDI 2022, Sec. 4) on the graph
capture gives (``meshplace.graph.capture``), with Mesh-TensorFlow's collectives
(Shazeer et al., 2018) and ZeRO's weight-update sharding (Rajbhandari et al., SC 2020;
Xu et al., "Automatic cross-replica sharding of weight update", 2020).

What is decided
---------------
Every op's *strategy* on a mesh with axes ``x, y, ...``: for each mesh axis, which label of
the op's index notation (``meshplace.graph.opdims``) it splits, or none. From it follow,
per mesh axis, the placement of each operand the op needs and of each output it makes —
``S(d)`` (split along dimension ``d``), ``R`` (replicated) or ``P`` (partial sums, when a
contracted label is split) — the op's compute time (its roofline time divided by the
number of blocks) and any halo exchange. Parameters, buffers and inputs choose a
placement directly; a parameter also chooses its **weight-update sharding**: ``0``
replicated update, ``1`` optimizer state sharded over the axes the parameter is
replicated on (ZeRO-1), ``2`` and gradients (ZeRO-2), ``3`` and the parameter itself,
gathered before forward and before backward (ZeRO-3 / FSDP).

Between a producer's output placement and what a consumer needs, per mesh axis (Alpa's
resharding table): ``P→R`` all-reduce, ``P→S`` reduce-scatter, ``S→R`` all-gather,
``S(d)→S(d')`` all-to-all, ``R→S`` a local slice (free), each costed by
:meth:`meshplace.mesh.layout.Mesh.collective_time` on the cluster's real rings and tori.

Grouping
--------
Point-wise ops (labels of their operands ⊆ their output's, nothing summed or kept whole)
follow their main operand's producer, as in Alpa: they join its group and take its
output's placement (a partial sum is completed first). A parameter's update ops join the
parameter. Groups in identical repeated blocks — same module path up to layer indices,
same ops and shapes, same position in the block — form one *class*: they share a decision
(:mod:`meshplace.parallel.ilp`), so a 48-layer model costs about one layer's solve.

Memory (per device, bytes)
--------------------------
Parameters, gradients and optimizer state under each parameter's placement and update
sharding; buffers and inputs; every forward output that a backward op reads (activations
saved for backward, after any recomputation the graph already shows); and the largest
working set of one op (operands + outputs) on top. A strategy's memory is linear in the
decision, so the limit is a row of the integer program.

Complexity: ``O(ops x S + operands x S_u x S_v)`` to build (``S``: strategies per group,
``(labels + 1) ** axes`` at most), then :func:`meshplace.parallel.ilp.solve`.

Example
-------
>>> import torch
>>> from meshplace.graph.capture import capture
>>> from meshplace.hardware import load_cluster
>>> from meshplace.mesh.layout import build_mesh
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
>>> g = capture(model, (torch.randn(32, 64),), training=True)
>>> problem = ShardingProblem(g, build_mesh(load_cluster("dgx-h100"), (8,)))
>>> len(problem.groups) < g.num_ops
True
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.graph.ir import Op, OpGraph, dtype_size
from meshplace.graph.opdims import FIXED, NotationError, OpDims, label_sizes
from meshplace.mesh.layout import Mesh
from meshplace.parallel.ilp import Quantity, Tables

# Placement of a tensor on one mesh axis: a dimension index (split along it) or one of:
R, P, FLAT, UNMAPPED = -1, -2, -3, -4
SOURCE_KINDS = ("parameter", "buffer", "input")
COMPUTE_MODELS = ("eager", "fused")
ZERO_STAGES = (0, 1, 2, 3)


class ShardingError(InputError):
    """A sharding problem that cannot be set up or has no plan (one sentence)."""


Spec = tuple[int, ...]


def spec_text(spec: Spec, axes: Sequence[str]) -> str:
    """``"S(0)@x R@y"`` style description of one tensor's placement.

    >>> spec_text((0, -1), ("x", "y"))
    'S(0)@x'
    >>> spec_text((-1, -1), ("x", "y"))
    'R'
    """
    words = []
    for a, p in zip(axes, spec, strict=True):
        if p >= 0:
            words.append(f"S({p})@{a}")
        elif p == P:
            words.append(f"P@{a}")
        elif p == FLAT:
            words.append(f"F@{a}")
    return " ".join(words) or "R"


@dataclass
class Strategy:
    """One choice for a group: per member op the placements it needs and makes."""

    name: str
    assign: tuple[str | None, ...]
    zero: int
    in_specs: list[list[Spec]]  # per member, per operand
    out_specs: list[list[Spec]]  # per member, per output
    compute_s: float
    comm_s: float = 0.0  # collectives the next op waits for (resharding inside, halos)
    gather_s: float = 0.0  # one all-gather of a ZeRO-sharded parameter (overlappable)
    gathers: int = 0  # how many per step: ZeRO-1/2 once (updated weights), ZeRO-3 twice
    memory: float = 0.0
    transient: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    collectives: list[tuple[str, str, float, float, str]] = field(default_factory=list)


@dataclass
class Group:
    """Ops decided together: an anchor and the ops that follow it."""

    anchor: int
    members: list[int]
    kind: str  # "parameter", "buffer", "input", "op", "fixed"
    strategies: list[Strategy] = field(default_factory=list)
    key: tuple = ()


_DIGITS = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$)")


def _module_pattern(module: str) -> tuple[str, str]:
    """(module path with layer indices replaced by ``*``, the indices) — ``h.3.attn`` →
    ``("h.*.attn", "3")``."""
    return _DIGITS.sub("*", module), ",".join(_DIGITS.findall(module))


def fsdp_unit_names(graph: OpGraph) -> dict[str, str]:
    """Per parameter op of ``graph``, the FSDP2 unit the torchrun runtime gathers it in
    (:func:`meshplace.runtime.data_parallel.fsdp_units`, read from the parameters'
    qualified names): the module path through its first layer index below the root —
    an element of a ``ModuleList`` or ``Sequential``, as torchtitan wraps a
    transformer's blocks — or ``""`` for the root unit, which holds the rest. A parameter
    of a unit that ops of another unit read (a weight tied into a block) puts them all in
    the root, as the runtime does for tied weights.
    The names cannot tell a numbered child of another container (a ``ModuleDict`` keyed
    ``"0"``) from a list's. O(parameters).

    >>> import torch
    >>> from meshplace.graph.capture import capture
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(
    ...     torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    >>> units = fsdp_unit_names(capture(model, (torch.randn(2, 4),)))
    >>> sorted(set(units.values()))
    ['', '1.0', '1.1']
    """

    def unit_of(module: str) -> str:  # the path through its first layer index below the root
        parts = module.split(".")
        layer = next((k for k in range(1, len(parts)) if parts[k].isdigit()), None)
        return ".".join(parts[: layer + 1]) if layer is not None else ""

    units = {
        o.name: unit_of(o.name.removeprefix("param:").rpartition(".")[0])
        for o in graph.ops
        if o.kind == "parameter"
    }
    # a parameter read inside two units (tied): FSDP2 cannot shard it twice
    readers: dict[str, set[str]] = {}
    for o in graph.ops:
        if o.kind == "parameter" or o.phase != "forward":
            continue
        unit = unit_of(o.module)
        for rec in o.operands or []:
            if rec["op"] in units:
                readers.setdefault(rec["op"], set()).add(unit)
    if any(units[name] and where - {units[name]} for name, where in readers.items()):
        return dict.fromkeys(units, "")
    return units


class ShardingProblem:
    """Groups, strategies, costs and memory of one graph on one mesh (module docstring).

    Args:
        graph: a captured training (or inference) graph; ops need ``einsum`` and
            ``operands`` (graphs captured by this version have them; other ops stay
            replicated and are listed in :attr:`replicated_ops`).
        mesh: the device mesh (:func:`meshplace.mesh.layout.build_mesh`).
        optimizer_state_factor: optimizer state bytes per parameter byte; default from
            the graph (its captured state) — Adam 2, momentum 1, SGD 0.
        zero_stages: the weight-update sharding choices offered.
        tie_layers: share one decision between identical repeated blocks.
        cost_model: per-op compute times (roofline on the mesh's device kind).
        compute: ``"eager"`` — every op is its own kernel (its roofline time plus a launch),
            as PyTorch eager runs the step; ``"fused"`` — a group's point-wise followers
            (and a parameter's optimizer update) are one kernel, as a fusing compiler
            (XLA, TorchInductor, fused optimizers) emits: ``max(their arithmetic, the bytes
            that enter or leave the chain / bandwidth) + one launch``; the anchor (matmul,
            convolution, attention, norm) stays its own library kernel.
        overlap: gradient reductions and ZeRO's parameter all-gathers run on
            communication streams beside compute and only their exposed tails count
            (:meth:`cost_tables`); ``False`` counts every collective in full (Alpa's and
            XLA's objective).
        fsdp_units: the plan runs on FSDP2 (``fully_shard`` per unit): parameter op name
            → the unit that gathers it (``""``: the root, :func:`fsdp_unit_names`). Each
            unit then gathers its ZeRO-3 parameters in one flat collective (one fixed cost
            per unit, shared by its parameters by their bytes) before forward and, but the
            root (which FSDP2 keeps gathered), again before backward; the gradients are
            reduced in one bucket per unit; and each unit costs the cost model's
            ``fsdp_unit_overhead`` (FSDP2's hooks, copies and the dispatch on its sharded
            parameters), shared the same way. ``None``: DTensor's engine, one collective
            per parameter at ZeRO 3, gradients in the runtime's 25 MiB buckets.
        local_reductions: the plan runs on DDP or FSDP2, whose ranks each keep their own
            partial sums — the loss of their share of the batch, batch norm's statistics
            of it — and complete only the gradients (in their buckets): a partial value
            read outside the gradient buckets costs nothing. ``False``: DTensor's engine,
            which completes every partial value its reader needs whole.
    """

    def __init__(
        self,
        graph: OpGraph,
        mesh: Mesh,
        *,
        zero_stages: Sequence[int] = ZERO_STAGES,
        tie_layers: bool = True,
        cost_model: CostModel | None = None,
        state_bytes_per_param_byte: float | None = None,
        compute: str = "eager",
        overlap: bool = True,
        fsdp_units: Mapping[str, str] | None = None,
        local_reductions: bool = False,
    ) -> None:
        if compute not in COMPUTE_MODELS:
            raise ShardingError(
                f"unknown compute model {compute!r}; choose one of: {', '.join(COMPUTE_MODELS)}"
            )
        self.compute = compute
        self.overlap = overlap
        self._timeline: Timeline | None = None
        self._repeated_reads: set[tuple[int, int]] | None = None
        self.graph = graph
        # the collectives measured on the mesh's device kind, where the cost model has them
        self.mesh = mesh = mesh.calibrated(cost_model)
        self.axes = tuple(mesh.axis_names)
        self.sizes = tuple(int(s) for s in mesh.shape)
        self.zero_stages = tuple(zero_stages)
        self.tie_layers = tie_layers
        dev = mesh.cluster.devices[int(mesh.devices.reshape(-1)[0])]
        self.device = dev
        cm = cost_model or CostModel()
        self.op_time = cm.op_times(graph, {dev.kind: dev.spec})[dev.kind]
        self.arith_s, self.byte_s = cm.roofline_terms(graph, dev.spec)
        self.launch = cm.launches(graph, dev.kind, dev.spec)  # per op
        # what the ranks' meetings cost a step beyond its collectives, a fraction of its
        # compute (profile.link.measure_sync_skew): charged by the timeline, not the solve
        self.sync_skew = cm.sync_skew.get(dev.kind, 0.0) if mesh.size > 1 else 0.0
        self.state_factor = state_bytes_per_param_byte
        self.dims: list[OpDims | None] = []
        for o in graph.ops:
            d = None
            if o.einsum is not None:
                try:
                    d = OpDims.parse(o.einsum)
                except NotationError:
                    d = None
                if d is not None and len(d.inputs) != len(o.operands or []):
                    d = None
            self.dims.append(d)
        self.replicated_ops: list[str] = []
        self._comm_memo: dict[tuple, float] = {}
        self._reshard_memo: dict[tuple, tuple[float, tuple]] = {}
        self._backward_reads = self._saved_outputs()
        self.groups: list[Group] = []
        self.group_of = np.full(graph.num_ops, -1, dtype=np.int64)
        self.member_pos: dict[int, int] = {}
        self.follow_main: dict[int, int] = {}  # follower op -> operand it follows
        self._build_groups()
        # weight gradients' tails: their partial sums are completed in the runtime's
        # gradient buckets (comm_time's ``bucket_bytes``), whatever the placements chosen
        edges = self.group_edges()
        self.gradient_tail = self._gradient_tail(edges)
        held = {
            o.name: math.prod(o.output_shapes[0]) * self.itemsize(o.name, 0)
            for o in graph.ops
            if o.kind == "parameter" and o.output_shapes
        }
        total = sum(held.values())
        self.fsdp_units = dict(fsdp_units) if fsdp_units is not None else None
        self.local_reductions = local_reductions
        self.fsdp_unit_overhead = cm.fsdp_unit_overhead.get(dev.kind, 0.0)
        #: FSDP2 units -> the bytes of their parameters (one flat gather each)
        self.unit_bytes: dict[str, float] = {}
        if self.fsdp_units is not None:
            for name, nbytes in held.items():
                unit = self.fsdp_units.get(name, "")
                self.unit_bytes[unit] = self.unit_bytes.get(unit, 0.0) + nbytes
            buckets = len(self.unit_bytes)
        else:
            buckets = math.ceil(total / GRADIENT_BUCKET_BYTES)
        #: the bytes of the runtime's mean gradient bucket: ``G / ceil(G / bucket)`` for
        #: the model's ``G`` parameter bytes (FSDP2: per unit)
        self.bucket_bytes = total / buckets if total else 0.0
        self._tail_buckets = self._gradient_tail_buckets(edges)
        self.chain_bytes = self._chain_bytes() if compute == "fused" else {}
        self._readers = self._readers_of_outputs()
        self._splits_memo: dict[tuple, bool] = {}
        for g in self.groups:
            g.strategies = [st for st in self._strategies(g) if self._views_run(g, st)]
            if not g.strategies:
                op = graph.ops[g.anchor]
                raise ShardingError(
                    f"op {op.name!r} ({op.target or op.kind}) has no legal placement on mesh "
                    f"{mesh.label}"
                )
        self.assign_classes()

    # ------------------------------------------------------------------ grouping
    def _saved_outputs(self) -> set[tuple[int, int]]:
        """(op, output) pairs of forward ops that a backward op reads."""
        saved: set[tuple[int, int]] = set()
        index = {o.name: i for i, o in enumerate(self.graph.ops)}
        for o in self.graph.ops:
            if o.phase != "backward":
                continue
            for rec in o.operands or []:
                src = index.get(rec["op"])
                if src is not None and self.graph.ops[src].phase == "forward":
                    saved.add((src, rec["out"]))
        return saved

    def _follow_target(self, i: int) -> tuple[int, int] | None:
        """(producer op, operand position) this point-wise op follows, or ``None``."""
        op, d = self.graph.ops[i], self.dims[i]
        if d is None or len(d.outputs) != 1 or d.whole or d.halo or any(d.sums):
            return None
        out = d.outputs[0]
        labels = set(out) - {FIXED}
        for ins in d.inputs:
            if not set(ins) - {FIXED} <= labels:
                return None
        for j, ins in enumerate(d.inputs):
            rec = op.operands[j]
            if sorted(ins) != sorted(out) or (FIXED in ins and ins != out):
                continue
            if any(m < 0 for k, m in enumerate(rec["map"]) if ins[k] != FIXED):
                continue
            src = self.graph.index(rec["op"])
            g = self.group_of[src]
            if g < 0 or self.groups[g].kind != "op":
                continue
            return src, j
        return None

    def _build_groups(self) -> None:
        ops = self.graph.ops
        by_name = {o.name: i for i, o in enumerate(ops)}
        for i, o in enumerate(ops):
            if o.kind in SOURCE_KINDS:
                self._new_group(i, o.kind)
        for i, o in enumerate(ops):
            if o.kind in SOURCE_KINDS:
                continue
            if o.phase == "update" and o.colocation and o.colocation in by_name:
                owner = by_name[o.colocation]
                g = self.group_of[owner]
                if g >= 0 and self.groups[g].kind == "parameter":
                    self._join(g, i)
                    continue
            if self.dims[i] is None:
                self.replicated_ops.append(o.name)
                self._new_group(i, "fixed")
                continue
            target = self._follow_target(i)
            if target is not None:
                self.follow_main[i] = target[1]
                self._join(int(self.group_of[target[0]]), i)
            else:
                self._new_group(i, "op")

    def _chain_bytes(self) -> dict[int, float]:
        """Per follower, the bytes its fused chain moves on its behalf (whole tensors): the
        operands it reads from outside the chain (the anchor's output included) and the
        outputs it writes that leave the chain (read by another group's op, or saved for
        backward, or by nobody: the step's results, such as updated weights). O(operands)."""
        ops = self.graph.ops
        leaves: set[tuple[int, int]] = set(self._backward_reads)
        read: set[tuple[int, int]] = set()
        for i, o in enumerate(ops):
            for rec in o.operands or []:
                src = self.graph.index(rec["op"])
                read.add((src, rec["out"]))
                g = self.group_of[src]
                if g < 0 or self.group_of[i] != g or self.groups[g].anchor == i:
                    leaves.add((src, rec["out"]))
        out: dict[int, float] = {}
        for g in self.groups:
            chain = set(g.members[1:])
            for i in chain:
                o = ops[i]
                n = 0.0
                for rec in o.operands or []:
                    if self.graph.index(rec["op"]) not in chain:
                        n += math.prod(rec["shape"]) * self.itemsize(rec["op"], rec["out"])
                for k, shape in enumerate(o.output_shapes):
                    if (i, k) in leaves or (i, k) not in read:
                        n += math.prod(shape) * self.itemsize(o.name, k)
                out[i] = n
        return out

    def _new_group(self, i: int, kind: str) -> None:
        self.group_of[i] = len(self.groups)
        self.member_pos[i] = 0
        self.groups.append(Group(i, [i], kind))

    def _join(self, g: int, i: int) -> None:
        self.group_of[i] = g
        self.member_pos[i] = len(self.groups[g].members)
        self.groups[g].members.append(i)

    # ------------------------------------------------------------------ costs
    def comm_time(
        self,
        kind: str,
        nbytes: float,
        axis: int,
        bucket_bytes: float = 0.0,
        *,
        c10d: bool | None = None,
    ) -> float:
        """Seconds of collective ``kind`` of ``nbytes`` per device over mesh axis ``axis``.
        ``bucket_bytes``: the value is one of many the runtime sends in one flat bucket of
        that many bytes (DDP's and the torchrun runtime's gradient reductions and ZeRO
        gathers of updated shards, in buckets of
        :data:`~meshplace.cost.collectives.GRADIENT_BUCKET_BYTES`: :attr:`bucket_bytes`;
        FSDP2's gathers and reductions, one per unit), so it pays its bytes' time and its
        share ``min(1, nbytes / bucket_bytes)`` of the bucket's fixed cost
        (:meth:`fixed_comm_time`) — linear in the decision, as the integer program needs,
        and the shares of a bucket's values add up to one fixed cost. Exact for pure data
        parallelism; where tensor parallelism splits the parameters, the fewer bytes left
        per device may fill fewer buckets than that charges. 0: sent alone. ``c10d``:
        whether the runtime issues it as the process group's own call (DDP's, FSDP2's,
        its flat buckets) rather than as DTensor's redistribution, each at its measured
        rate where the mesh has both (:meth:`meshplace.mesh.layout.Mesh.collective_time`);
        by default a bucketed collective is one."""
        if c10d is None:
            c10d = bucket_bytes > 0
        key = (kind, nbytes, axis, bucket_bytes, c10d)
        t = self._comm_memo.get(key)
        if t is None:
            t = self.mesh.collective_time(kind, nbytes, [self.axes[axis]], c10d=c10d)
            if bucket_bytes > 0 and t > 0:
                share = min(1.0, nbytes / bucket_bytes)
                t -= (1.0 - share) * min(t, self.fixed_comm_time(kind, axis, c10d=c10d))
            self._comm_memo[key] = t
        return t

    def fixed_comm_time(self, kind: str, axis: int, *, c10d: bool = False) -> float:
        """The part of collective ``kind``'s time on mesh axis ``axis`` that does not grow
        with its bytes (the latencies of its steps): ``2 t(b) - t(2b)``, exact for the
        closed forms, which are affine in the bytes; ``c10d`` as in :meth:`comm_time`.
        O(1), memoised."""
        key = ("fixed", kind, axis, c10d)
        t = self._comm_memo.get(key)
        if t is None:
            b = float(GRADIENT_BUCKET_BYTES)
            one = self.mesh.collective_time(kind, b, [self.axes[axis]], c10d=c10d)
            two = self.mesh.collective_time(kind, 2 * b, [self.axes[axis]], c10d=c10d)
            t = self._comm_memo[key] = max(0.0, 2 * one - two)
        return t

    def edge_bucket_bytes(self, gu: int, gv: int) -> float:
        """The bytes of the gradient bucket the runtime sends what group ``gu`` gives group
        ``gv`` in (:meth:`comm_time`), or 0 where it is sent alone: a reduction into a
        parameter's update, or between two groups of a weight gradient's tail
        (:meth:`_gradient_tail`), goes in the parameter's bucket."""
        if self.groups[gv].kind == "parameter":
            return self.parameter_bucket_bytes(self.groups[gv].anchor)
        if gu in self.gradient_tail:
            return self.tail_bucket_bytes(gv)
        return 0.0

    def tail_bucket_bytes(self, gi: int) -> float:
        """The bytes of the gradient bucket a collective into group ``gi`` goes in when
        ``gi`` is part of a weight gradient's tail (:meth:`_gradient_tail_buckets`), else
        0 (sent alone). O(1)."""
        if gi not in self.gradient_tail:
            return 0.0
        return self._tail_buckets.get(gi, self.bucket_bytes)

    def parameter_bucket_bytes(self, i: int) -> float:
        """The bytes of the bucket parameter op ``i``'s gradient (and ZeRO gather) goes
        in: its FSDP2 unit's (``fsdp_units``), else the mean gradient bucket. O(1)."""
        if self.fsdp_units is None:
            return self.bucket_bytes
        unit = self.fsdp_units.get(self.graph.ops[i].name, "")
        return self.unit_bytes.get(unit, self.bucket_bytes)

    def _gradient_tail_buckets(self, edges: dict[tuple[int, int], list[tuple]]) -> dict[int, float]:
        """Per group of a weight gradient's tail (:meth:`_gradient_tail`), the bytes of the
        one bucket every parameter it feeds goes in — under FSDP2, the unit's; where
        they go in several (a weight shared across units), the mean bucket's. O(edges)."""
        if self.fsdp_units is None:
            return {}
        readers: dict[int, set[int]] = {}
        for gu, gv in edges:
            readers.setdefault(gu, set()).add(gv)
        buckets: dict[int, set[float]] = {}

        def fed(gi: int) -> set[float]:  # the buckets of the parameters ``gi`` feeds
            if gi not in buckets:
                buckets[gi] = set()
                for gv in readers.get(gi, ()):
                    if self.groups[gv].kind == "parameter":
                        buckets[gi].add(self.parameter_bucket_bytes(self.groups[gv].anchor))
                    elif gv in self.gradient_tail:
                        buckets[gi] |= fed(gv)
            return buckets[gi]

        found = {gi: fed(gi) for gi in self.gradient_tail}
        return {gi: next(iter(b)) if len(b) == 1 else self.bucket_bytes for gi, b in found.items()}

    def local_bytes(self, shape: Sequence[int], itemsize: int, spec: Spec) -> float:
        """Bytes of one device's block of a tensor placed as ``spec``."""
        n = float(math.prod(shape)) * itemsize
        for a, p in enumerate(spec):
            if p >= 0 or p == FLAT:
                n /= self.sizes[a]
        return n

    def reshard(
        self,
        have: Spec,
        need: Spec,
        dim_map: Sequence[int],
        shape: Sequence[int],
        itemsize: int,
        bucket_bytes: float = 0.0,
    ) -> tuple[float, tuple]:
        """Seconds (and the collectives) to turn a producer placement ``have`` into the
        placement ``need`` a consumer reads, through the view ``dim_map``;
        ``bucket_bytes``: sent in a gradient bucket of that many bytes (:meth:`comm_time`)."""
        key = (have, need, tuple(dim_map), tuple(shape), itemsize, bucket_bytes)
        hit = self._reshard_memo.get(key)
        if hit is not None:
            return hit
        inv = {p: c for c, p in enumerate(dim_map) if p >= 0}
        full = float(math.prod(shape)) * itemsize
        total = 0.0
        colls = []
        # a split that the view carries onto a dimension its blocks do not divide (64 rows
        # in 4 blocks read as 2 x 32) is not a split of the consumer's tensor: gather it
        ways: dict[int, int] = {}
        for a, h in enumerate(have):
            if h >= 0 and h in inv:
                ways[inv[h]] = ways.get(inv[h], 1) * self.sizes[a]
        uneven = {c for c, w in ways.items() if c < len(shape) and shape[c] % w}
        mapped = []
        for h in have:
            if h >= 0:
                h = inv.get(h, UNMAPPED)
                if h in uneven:
                    h = UNMAPPED
            mapped.append(h)
        held = tuple(mapped)  # before any gather below

        def whole_along(spec: Sequence[int], a: int) -> float:
            """Bytes of one device's block of the tensor placed ``spec``, whole along
            mesh axis ``a``."""
            nbytes = full
            for b, q in enumerate(spec):
                if b != a and (q >= 0 or q == FLAT):
                    nbytes /= self.sizes[b]
            return nbytes

        # a dimension split over several axes is nested in mesh order (the first axis
        # outermost, as DTensor lays blocks out): when the producer's splits of a dimension
        # are not a prefix of the consumer's (nor the reverse), the blocks are in another
        # order, and the producer's splits past the common prefix are gathered first
        for c in {h for h in mapped if h >= 0}:
            on_have = [a for a, h in enumerate(mapped) if h == c and self.sizes[a] > 1]
            on_need = [a for a, n in enumerate(need) if n == c and self.sizes[a] > 1]
            k = 0
            while k < min(len(on_have), len(on_need)) and on_have[k] == on_need[k]:
                k += 1
            if k == len(on_have) or k == len(on_need):
                continue
            for a in reversed(on_have[k:]):  # innermost first
                nbytes = whole_along(mapped, a)  # DTensor's redistribution
                t = self.comm_time("all_gather", nbytes, a, bucket_bytes, c10d=False)
                total += t
                colls.append(("all_gather", self.axes[a], nbytes, t))
                mapped[a] = R
        for a, (h, n) in enumerate(zip(mapped, need, strict=True)):
            if self.sizes[a] == 1:
                continue
            if h == n or (h == R and n != P):
                continue
            if h == P and self.local_reductions and not bucket_bytes:
                continue  # each rank keeps its own partial value (DDP, FSDP2)
            # bytes per device over this axis: the consumer's block, whole along axis a
            nbytes = whole_along(need, a)
            if h == P and n >= 0 and self._reduced_whole(held, need, a, n):
                kind, nbytes = "all_reduce", whole_along(held, a)  # the block held now
            elif h == P:
                kind = "all_reduce" if n == R else "reduce_scatter"
            elif n == R:
                kind = "all_gather"
            else:
                kind, nbytes = "all_to_all", nbytes / self.sizes[a]
            # the process group's own call: a partial gradient all-reduced in the runtime's
            # flat bucket or DDP's, reduce-scattered by FSDP2; DTensor's redistribution:
            # any other change into a parameter's placement, and a reduce-scatter outside
            # FSDP2 (ZeRO 3's autograd, and ZeRO 2's flat one priced alike: the dearer)
            c10d = bucket_bytes > 0 and h == P
            c10d = c10d and (kind == "all_reduce" or self.fsdp_units is not None)
            t = self.comm_time(kind, nbytes, a, bucket_bytes, c10d=c10d)
            total += t
            colls.append((kind, self.axes[a], nbytes, t))
        out = (total, tuple(colls))
        self._reshard_memo[key] = out
        return out

    def _reduced_whole(self, held: Spec, need: Spec, a: int, dim: int) -> bool:
        """Whether DTensor completes a partial sum on axis ``a`` whole (all-reduce, then a
        local slice) rather than reduce-scattering it onto dimension ``dim``: when an
        outer axis (an earlier one: DTensor nests a dimension's blocks in mesh order)
        must give up or take a split of ``dim`` by a collective, blocks scattered along
        ``dim`` on ``a`` would sit inside a split still to be moved. Measured with
        torch 2.13 on a fake 2 x 2 process group, every placement of a 2-D tensor:
        ``(S(0), P) -> (R, S(0))`` and ``(S(0), P) -> (S(1), S(1))`` all-reduce on the
        second axis, ``(S(0), P) -> (R, S(1))`` reduce-scatters."""
        return any(
            self.sizes[b] > 1 and held[b] >= 0 and held[b] != need[b] and dim in (held[b], need[b])
            for b in range(a)
        )

    def _op_seconds(self, i: int, blocks: int) -> float:
        t = float(self.op_time[i])
        if blocks <= 1 or t <= 0:
            return t
        return max(t - self.launch[i], 0.0) / blocks + self.launch[i]

    # ------------------------------------------------------------------ strategies
    def _assignments(self, labels: dict[str, list[int]]) -> list[tuple[str | None, ...]]:
        """Every assignment of a label (or none) to each mesh axis whose block counts
        divide every size the label takes."""
        options = [None, *labels]
        out = []
        for combo in itertools.product(options, repeat=len(self.sizes)):
            ok = True
            for lab in set(combo) - {None}:
                n = math.prod(s for s, c in zip(self.sizes, combo, strict=True) if c == lab)
                if n > 1 and any(size % n for size in labels[lab]):
                    ok = False
                    break
            if ok:
                # an axis of size 1 splits nothing: keep only the None choice for it
                if any(c is not None and s == 1 for s, c in zip(self.sizes, combo, strict=True)):
                    continue
                out.append(combo)
        return out

    def _spec_for(self, labels: Sequence[str], assign: Sequence[str | None]) -> Spec:
        return tuple(labels.index(a) if a is not None and a in labels else R for a in assign)

    def _readers_of_outputs(self) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """Per (op, output), its readers as (op, operand). O(operands)."""
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, o in enumerate(self.graph.ops):
            for j, rec in enumerate(o.operands or []):
                out.setdefault((self.graph.index(rec["op"]), rec["out"]), []).append((i, j))
        return out

    def _views_run(self, g: Group, st: Strategy) -> bool:
        """Whether DTensor can run every view of what ``st`` splits (:meth:`_splits_run`)."""
        for pos, i in enumerate(g.members):
            for k, spec in enumerate(st.out_specs[pos]):
                ways: dict[int, int] = {}
                for a, d in enumerate(spec):
                    if d >= 0 and self.sizes[a] > 1:
                        ways[d] = ways.get(d, 1) * self.sizes[a]
                if ways and not self._splits_run(i, k, tuple(sorted(ways.items())), 2):
                    return False
        return True

    def _splits_run(self, i: int, k: int, ways: tuple[tuple[int, int], ...], hops: int) -> bool:
        """Whether output ``k`` of op ``i``, split ``ways`` (dimension, ways) pairs, can be
        read through every view of it, and — DTensor carries an operand's split into the
        result where it can, whatever the plan says of the reader — through the views of
        what its readers make from it, ``hops`` readers deep. DTensor (torch 2.13) refuses a
        view that changes a split dimension ("Cannot flatten/unflatten unevenly sharded
        tensor") unless the dimension's size, and the size of the view's dimension that
        takes the split, divide by its ways: such a split would stop the step, so no plan
        makes it. O(readers^hops), memoised."""
        key = (i, k, ways, hops)
        known = self._splits_memo.get(key)
        if known is not None:
            return known
        ops = self.graph.ops
        made = ops[i].output_shapes[k]
        ok = True
        for c, j in self._readers.get((i, k), []):
            rec = ops[c].operands[j]
            shape = rec["shape"]
            into = {p: q for q, p in enumerate(rec["map"]) if p >= 0}
            carried: dict[int, int] = {}
            for d, w in ways:
                q = into.get(d)
                changed = q is None or shape[q] != made[d]  # by a view of the read
                if changed and (made[d] % w or (q is not None and shape[q] % w)):
                    ok = False
                    break
                if q is not None:
                    carried[q] = w
            if not ok:
                break
            dims = self.dims[c]
            if hops == 0 or not carried or dims is None or j >= len(dims.inputs):
                continue
            for n, (labels, summed) in enumerate(zip(dims.outputs, dims.sums, strict=True)):
                after: dict[int, int] = {}
                for q, w in carried.items():
                    label = dims.inputs[j][q] if q < len(dims.inputs[j]) else FIXED
                    if label != FIXED and label in labels and label not in summed:
                        after[labels.index(label)] = w
                if after and not self._splits_run(c, n, tuple(sorted(after.items())), hops - 1):
                    ok = False
                    break
            if not ok:
                break
        self._splits_memo[key] = ok
        return ok

    def _strategies(self, g: Group) -> list[Strategy]:
        op = self.graph.ops[g.anchor]
        if g.kind in SOURCE_KINDS:
            return self._source_strategies(g, op)
        if g.kind == "fixed":
            return [self._fixed_strategy(g)]
        d = self.dims[g.anchor]
        assert d is not None
        in_shapes = [r["shape"] for r in op.operands or []]
        sizes = label_sizes(d, in_shapes, op.output_shapes)
        split = {lab: sizes[lab] for lab in d.splittable() if max(sizes[lab]) > 1}
        out = []
        for assign in self._assignments(split):
            ins = [self._spec_for(t, assign) for t in d.inputs]
            outs = []
            for t, summed in zip(d.outputs, d.sums, strict=True):
                spec = list(self._spec_for(t, assign))
                for a, lab in enumerate(assign):
                    if lab is not None and spec[a] == R and lab in summed:
                        spec[a] = P
                outs.append(tuple(spec))
            blocks = math.prod(s for s, lab in zip(self.sizes, assign, strict=True) if lab)
            st = Strategy(
                _assign_name(assign, self.axes),
                tuple(assign),
                0,
                [ins],
                [outs],
                self._op_seconds(g.anchor, blocks),
            )
            self._halo(st, g.anchor, d, assign)
            self._complete(g, st)
            out.append(st)
        return out

    def _halo(self, st: Strategy, i: int, d: OpDims, assign: Sequence[str | None]) -> None:
        """Halo exchange of a spatially split convolution: ``k // 2`` rows each way."""
        if not d.halo:
            return
        op = self.graph.ops[i]
        rec = op.operands[0]
        shape, labels = rec["shape"], d.inputs[0]
        itemsize = self.itemsize(rec["op"], rec["out"])
        local = self.local_bytes(shape, itemsize, st.in_specs[0][0])
        for a, lab in enumerate(assign):
            if lab in d.halo and lab in labels:
                rows_local = shape[labels.index(lab)] / math.prod(
                    s for s, c in zip(self.sizes, assign, strict=True) if c == lab
                )
                nbytes = 2 * d.halo[lab] * local / max(rows_local, 1)
                t = self.comm_time("collective_permute", nbytes, a)
                st.comm_s += t
                st.collectives.append(("collective_permute", self.axes[a], nbytes, t, "halo"))

    def _fixed_strategy(self, g: Group) -> Strategy:
        op = self.graph.ops[g.anchor]
        rep = tuple(R for _ in self.sizes)
        st = Strategy(
            "R",
            tuple(None for _ in self.sizes),
            0,
            [[rep for _ in op.operands or []]],
            [[rep for _ in op.output_shapes]],
            self._op_seconds(g.anchor, 1),
        )
        self._complete(g, st)
        return st

    def _source_strategies(self, g: Group, op: Op) -> list[Strategy]:
        shape = op.output_shapes[0] if op.output_shapes else []
        labels = [f"d{k}" for k in range(len(shape))]
        sizes = {lab: [n] for lab, n in zip(labels, shape, strict=True) if n > 1}
        out = []
        for assign in self._assignments(sizes):
            spec = self._spec_for(labels, assign)
            replicas = math.prod(s for s, p in zip(self.sizes, spec, strict=True) if p == R)
            stages = self.zero_stages if g.kind == "parameter" and replicas > 1 else (0,)
            for zero in stages:
                name = spec_text(spec, self.axes) + (f" +zero{zero}" if zero else "")
                st = Strategy(name, tuple(assign), zero, [[]], [[spec]], 0.0)
                self._complete(g, st)
                out.append(st)
        return out

    def _complete(self, g: Group, st: Strategy) -> None:
        """Fill in the followers' placements, internal resharding, compute and memory."""
        ops = self.graph.ops
        anchor = ops[g.anchor]
        param_spec = st.out_specs[0][0] if g.kind == "parameter" else None
        arith = moved = 0.0  # the followers as one fused kernel (compute="fused")
        for i in g.members[1:]:
            if g.kind == "parameter":
                ins, outs = self._update_specs(i, anchor, param_spec, st.zero)
                blocks = _blocks(self.sizes, param_spec, st.zero)
            else:
                ins, outs, blocks = self._follower_specs(i, g, st)
            st.in_specs.append(ins)
            st.out_specs.append(outs)
            if self.compute == "fused":
                arith += self.arith_s[i] / blocks
                moved += self.chain_bytes.get(i, 0.0) * self.byte_s[i] / blocks
            else:
                st.compute_s += self._op_seconds(i, blocks)
        if self.compute == "fused" and len(g.members) > 1:
            # one kernel: the largest fixed cost of the ops fused into it
            st.compute_s += max(arith, moved) + float(self.launch[g.members[1:]].max())
        # resharding inside the group (a weight gradient's tail: in the gradient buckets)
        bucket = self.tail_bucket_bytes(int(self.group_of[g.anchor]))
        for pos, i in enumerate(g.members):
            for j, rec in enumerate(ops[i].operands or []):
                src = self.graph.index(rec["op"])
                if self.group_of[src] != self.group_of[i] or src == i:
                    continue
                have = st.out_specs[self.member_pos[src]][rec["out"]]
                need = st.in_specs[pos][j]
                t, colls = self.reshard(
                    have,
                    need,
                    rec["map"],
                    rec["shape"],
                    self.itemsize(rec["op"], rec["out"]),
                    bucket,
                )
                st.comm_s += t
                st.collectives.extend((k, a, b, tt, "reshard") for k, a, b, tt in colls)
        if g.kind == "parameter":
            self._weight_update_comm(g, st)
        self._memory(g, st)

    def _update_specs(
        self, i: int, param: Op, spec: Spec, zero: int
    ) -> tuple[list[Spec], list[Spec]]:
        """What update op ``i`` of ``param`` (placed ``spec``, weight-update sharding
        ``zero``) reads and makes: the parameter's shape on the master shard (``FLAT``
        over its replica axes from stage 1), anything else replicated. At stage 1 the
        gradient (a parameter-shaped read from outside the group) is read whole, as the
        parameter is placed: the runtime all-reduces it and keeps it (its memory is the
        whole gradient at stage 1), the update slicing its block; from stage 2 it is
        reduce-scattered onto the shard."""
        op = self.graph.ops[i]
        pshape = param.output_shapes[0] if param.output_shapes else []
        sharded = tuple(
            FLAT if (p == R and zero >= 1 and s > 1) else p
            for p, s in zip(spec, self.sizes, strict=True)
        )
        rep = tuple(R for _ in self.sizes)
        own = int(self.group_of[i])

        def place(shape: Sequence[int]) -> Spec:
            return sharded if list(shape) == list(pshape) else rep

        def read(rec: dict[str, Any]) -> Spec:
            outside = int(self.group_of[self.graph.index(rec["op"])]) != own
            if zero == 1 and outside and list(rec["shape"]) == list(pshape):
                return tuple(spec)
            return place(rec["shape"])

        ins = [read(r) for r in op.operands or []]
        outs = [place(s) for s in op.output_shapes]
        return ins, outs

    def _follower_specs(self, i: int, g: Group, st: Strategy) -> tuple[list[Spec], list[Spec], int]:
        op, d = self.graph.ops[i], self.dims[i]
        assert d is not None
        out_labels = d.outputs[0]
        j = self.follow_main[i]
        rec = op.operands[j]
        src = self.graph.index(rec["op"])
        have = st.out_specs[self.member_pos[src]][rec["out"]]
        inv = {p: c for c, p in enumerate(rec["map"]) if p >= 0}
        main_labels = d.inputs[j]
        assign: list[str | None] = []
        for h in have:
            c = inv.get(h) if h >= 0 else None
            assign.append(main_labels[c] if c is not None and main_labels[c] != FIXED else None)
        ins = [self._spec_for(t, assign) for t in d.inputs]
        outs = [self._spec_for(out_labels, assign)]
        blocks = math.prod(s for s, lab in zip(self.sizes, assign, strict=True) if lab)
        return ins, outs, blocks

    def _weight_update_comm(self, g: Group, st: Strategy) -> None:
        """ZeRO's all-gathers of (updated) parameters over the replica axes: at ZeRO 1 and
        2 after the update, in the runtime's flat buckets (:meth:`comm_time`); at ZeRO 3
        before each use, one parameter at a time on DTensor, one unit at a time on FSDP2
        (``fsdp_units``), whose share of its unit's fixed cost per step it also pays."""
        op = self.graph.ops[g.anchor]
        unit = None if self.fsdp_units is None else self.fsdp_units.get(op.name, "")
        bucket = self.parameter_bucket_bytes(g.anchor)
        if unit is not None and bucket and len(g.members) > 1:  # FSDP2's cost per unit
            whole = math.prod(op.output_shapes[0]) * self.itemsize(op.name, 0)
            st.compute_s += self.fsdp_unit_overhead * whole / bucket
        if st.zero == 0:
            return
        spec = st.out_specs[0][0]
        local = self.local_bytes(op.output_shapes[0], self.itemsize(op.name, 0), spec)
        # ZeRO-3: before forward and before backward (FSDP2 keeps its root gathered)
        st.gathers = 1 if st.zero < 3 or unit == "" else 2
        if st.zero == 3 and unit is None:  # DTensor gathers each parameter alone
            bucket = 0.0
        for a, p in enumerate(spec):
            if p == R and self.sizes[a] > 1:
                t = self.comm_time("all_gather", local, a, bucket)
                st.gather_s += t
                st.collectives.append(
                    ("all_gather", self.axes[a], local, st.gathers * t, "weights")
                )

    def itemsize(self, name: str, out: int) -> int:
        op = self.graph.op(name)
        dt = op.output_dtypes[out] if out < len(op.output_dtypes) else "float32"
        return dtype_size(dt)

    def _memory(self, g: Group, st: Strategy) -> None:
        ops = self.graph.ops
        anchor = ops[g.anchor]
        if g.kind == "parameter":
            spec = st.out_specs[0][0]
            replicas = math.prod(s for s, p in zip(self.sizes, spec, strict=True) if p == R)
            shards = math.prod(self.sizes) / replicas
            pbytes = anchor.param_bytes / shards
            state = (
                anchor.state_bytes
                if self.state_factor is None
                else anchor.param_bytes * self.state_factor
            ) / shards
            trained = len(g.members) > 1
            st.parts = {
                "parameters": pbytes / (replicas if st.zero >= 3 else 1),
                "gradients": pbytes / (replicas if st.zero >= 2 else 1) if trained else 0.0,
                "optimizer_state": state / (replicas if st.zero >= 1 else 1) if trained else 0.0,
            }
            st.memory = sum(st.parts.values())
        elif g.kind in ("buffer", "input"):
            st.memory = self.local_bytes(
                anchor.output_shapes[0] if anchor.output_shapes else [],
                self.itemsize(anchor.name, 0),
                st.out_specs[0][0],
            )
            st.parts = {"buffers" if g.kind == "buffer" else "inputs": st.memory}
        else:
            saved = 0.0
            for pos, i in enumerate(g.members):
                for k, shape in enumerate(ops[i].output_shapes):
                    if (i, k) in self._backward_reads:
                        saved += self.local_bytes(
                            shape, self.itemsize(ops[i].name, k), st.out_specs[pos][k]
                        )
            st.memory = saved
            st.parts = {"activations": saved}
        work = 0.0
        for pos, i in enumerate(g.members):
            o = ops[i]
            w = sum(
                self.local_bytes(s, self.itemsize(o.name, k), st.out_specs[pos][k])
                for k, s in enumerate(o.output_shapes)
            )
            w += sum(
                self.local_bytes(r["shape"], self.itemsize(r["op"], r["out"]), st.in_specs[pos][j])
                for j, r in enumerate(o.operands or [])
            )
            work = max(work, w)
        st.transient = work

    # ------------------------------------------------------------------ classes
    def assign_classes(self) -> None:
        """Identical repeated groups share a class (module docstring): same kind, same
        module path up to layer indices, same member ops and shapes — the layers of a
        stack, and the time steps of a recurrent cell applied again and again."""
        ops = self.graph.ops
        keys = []
        for g in self.groups:
            a = ops[g.anchor]
            pattern, _ = _module_pattern(a.module)
            sig = tuple(
                (
                    ops[i].target,
                    ops[i].phase,
                    tuple(map(tuple, ops[i].output_shapes)),
                    ops[i].einsum,
                    tuple(tuple(r["shape"]) for r in ops[i].operands or []),
                )
                for i in g.members
            )
            key: tuple = (g.kind, pattern, sig, len(g.strategies))
            if not self.tie_layers or g.kind == "input":
                key = (*key, a.name)
            keys.append(key)
        self.class_of = np.zeros(len(self.groups), dtype=np.int64)
        index: dict[tuple, int] = {}
        for gi, k in enumerate(keys):
            self.class_of[gi] = index.setdefault(k, len(index))
            self.groups[gi].key = k
        self.num_classes = len(index)
        self.class_groups: list[list[int]] = [[] for _ in range(self.num_classes)]
        for gi in range(len(self.groups)):
            self.class_groups[int(self.class_of[gi])].append(gi)

    def restricted(self, keep: Callable[[Group, Strategy], bool], why: str = "") -> ShardingProblem:
        """A copy offering only the strategies ``keep`` accepts, with classes drawn again;
        the set-up (groups, costs, resharding memo) is shared, so one problem serves many
        restrictions. A group left with none is a :class:`ShardingError` naming its op and
        ``why``. O(groups x S)."""
        out = copy.copy(self)
        out.groups = []
        for g in self.groups:
            kept = [st for st in g.strategies if keep(g, st)]
            if not kept:
                op = self.graph.ops[g.anchor]
                shape = op.output_shapes[0] if op.output_shapes else []
                raise ShardingError(
                    f"{op.name} (shape {shape}) has no placement left on mesh "
                    f"{self.mesh.label}{' ' + why if why else ''}"
                )
            out.groups.append(dataclasses.replace(g, strategies=kept))
        out.assign_classes()
        return out

    # ------------------------------------------------------------------ ILP inputs
    def cost_tables(self, checkpoints: int = 48) -> Tables:
        """The integer program of this problem (:class:`meshplace.parallel.ilp.Tables`).

        Per class: blocking time per strategy (compute and the collectives its ops wait
        for), memory and transient per strategy; per ordered pair of classes joined by an
        edge: the resharding time matrix. With :attr:`overlap`, two communication streams
        run beside compute, as FSDP2 and Megatron's distributed optimizer run them (the
        timeline of :mod:`meshplace.mesh.cost`, per op instead of per layer):

        - *backward stream*: a gradient's reduction (all-reduce, reduce-scatter: the edge
          into its parameter, or the collectives inside its *tail*, the weight-gradient
          matmul and the cast or sum after it that nothing in backward waits for,
          :meth:`_gradient_tail`) starts when the op making it finishes; ZeRO-3's
          all-gathers in backward share these links, each issued when backward reaches the
          parameter read before it (FSDP's prefetch); one after another; the optimizer
          update waits for the last. Exposed: ``max(0, max_k (jobs issued at or after k) -
          (blocking work after k))``.
        - *forward gathers*: ZeRO's all-gather of a parameter (the updated weights at
          ZeRO-1/2, the shards at ZeRO-3) must finish before its first forward reader;
          prefetched in order from the start of the step. Exposed: ``max(0, max_k
          (gathers up to k) - (blocking work before k))``.

        Not modelled: the two streams and blocking collectives sharing a link's bandwidth
        (each is costed as if it had the link alone, as :mod:`meshplace.mesh.cost` does).

        Each is an exposure of the integer program over per-instance quantities (one per
        class, one per edge bundle); ``checkpoints`` bounds its rows per stream (the first
        and last third of the events' positions, the rest evenly spread — a lower bound on
        the exposure when there are more positions; :meth:`timeline` is exact and is what a
        plan reports). O(groups + operands + checkpoints x events)."""
        tl = self.events()
        node = [np.zeros(len(self.groups[cg[0]].strategies)) for cg in self.class_groups]
        mem = [np.zeros_like(c) for c in node]
        trans = [np.zeros_like(c) for c in node]
        quantities: list[Quantity] = []
        split_q: dict[int, tuple[int, int]] = {}  # class -> (its compute, its internal comm)
        for c, cg in enumerate(self.class_groups):
            strategies = self.groups[cg[0]].strategies
            compute = np.array([s.compute_s for s in strategies])
            comm = np.array([s.comm_s for s in strategies])
            gather = np.array([s.gather_s * s.gathers for s in strategies])
            in_tail = sum(1 for g in cg if g in tl.tail)  # their comm is a reduction
            node[c] = (compute + comm) * len(cg) - comm * in_tail
            if not self.overlap:
                node[c] += gather * len(cg)
            mem[c] = np.array([s.memory for s in strategies]) * len(cg)
            trans[c] = np.array([s.transient for s in strategies])
            quantities.append(Quantity(node={c: compute + comm}))  # c: one instance's work
        for c, cg in enumerate(self.class_groups):
            if any(g in tl.tail for g in cg):
                strategies = self.groups[cg[0]].strategies
                split_q[c] = (len(quantities), len(quantities) + 1)
                quantities.append(Quantity(node={c: np.array([s.compute_s for s in strategies])}))
                quantities.append(Quantity(node={c: np.array([s.comm_s for s in strategies])}))
        gather_q: dict[tuple[int, int], int] = {}  # (class, which gather) -> quantity
        for c, cg in enumerate(self.class_groups):
            strategies = self.groups[cg[0]].strategies
            if self.overlap and any(s.gathers for s in strategies):
                for which in (1, 2):
                    v = np.array([s.gather_s if s.gathers >= which else 0.0 for s in strategies])
                    gather_q[(c, which)] = len(quantities)
                    quantities.append(Quantity(node={c: v}))
        edges: dict[tuple[int, int], np.ndarray] = {}
        bundle_memo: dict[tuple, np.ndarray] = {}
        bundle_q: dict[tuple, int] = {}
        edge_q: dict[tuple[int, int], int] = {}  # (producer group, consumer group) -> quantity
        for (gu, gv), recs in tl.bundles.items():
            cu, cv = int(self.class_of[gu]), int(self.class_of[gv])
            sig = (
                self.groups[gu].key,
                self.groups[gv].key,
                tuple(recs),
                self.edge_bucket_bytes(gu, gv),
            )
            m = bundle_memo.get(sig)
            if m is None:
                m = self._edge_matrix(gu, gv, recs)
                bundle_memo[sig] = m
            background = self.overlap and ((gu, gv) in tl.reductions or (gu, gv) in tl.prefetches)
            if cu == cv:
                diag = np.diag(m) if m.shape[0] == m.shape[1] else np.zeros(m.shape[0])
                if not background:
                    node[cu] += diag
                q = Quantity(node={cu: diag})
            else:
                key, mat = ((cu, cv), m) if cu < cv else ((cv, cu), m.T)
                if key not in edges:
                    edges[key] = np.zeros_like(mat)
                if not background:
                    edges[key] += mat
                q = Quantity(edge={key: mat})
            if self.overlap:
                qi = bundle_q.get(sig)
                if qi is None:
                    qi = bundle_q[sig] = len(quantities)
                    quantities.append(q)
                edge_q[(gu, gv)] = qi
        exposures: list[np.ndarray] = []
        if self.overlap:
            nq = len(quantities)
            work_pos = np.array([p for p, _ in tl.work], dtype=np.int64)
            work_q = np.array(
                [self._work_quantity(k, tl.tail, split_q, edge_q) for _, k in tl.work]
            )
            fb = work_pos < tl.update_start
            work_pos, work_q = work_pos[fb], work_q[fb]

            def stream(events: list[tuple[int, tuple]]) -> tuple[np.ndarray, np.ndarray]:
                """Positions and quantities of a stream's jobs (none for this class: left out)."""
                pos = np.array([p for p, _ in events], dtype=np.int64)
                qs = np.array(
                    [self._reduction_quantity(e, split_q, edge_q, gather_q) for _, e in events],
                    dtype=np.int64,
                )
                return pos[qs >= 0], qs[qs >= 0]

            red_pos, red_q = stream(tl.reduce_events)
            gat_pos, gat_q = stream(tl.gather_events)
            for pos, qs, after in ((red_pos, red_q, True), (gat_pos, gat_q, False)):
                if pos.size == 0:
                    continue
                rows = []
                for p in _checkpoints(np.unique(pos), checkpoints, last=after):
                    if after:  # released at or after p, against work after p
                        plus, minus = qs[pos >= p], work_q[work_pos > p]
                    else:  # needed by p, against work before p
                        plus, minus = qs[pos <= p], work_q[work_pos < p]
                    rows.append(
                        np.bincount(plus, minlength=nq).astype(float)
                        - np.bincount(minus, minlength=nq)
                    )
                exposures.append(np.array(rows))
        if not self.overlap:
            return Tables(node, edges, mem, trans)
        return Tables(node, edges, mem, trans, quantities, exposures)

    def _reduction_quantity(
        self,
        item: tuple,
        split_q: dict[int, tuple[int, int]],
        edge_q: dict[tuple[int, int], int],
        gather_q: dict[tuple[int, int], int],
    ) -> int:
        """The quantity of one job of an overlapped stream (``-1``: none for this class)."""
        kind, key = item
        if kind == "edge":
            return edge_q[key]
        c = int(self.class_of[key])
        if kind == "internal":
            return split_q[c][1]
        return gather_q.get((c, 1 if kind == "gather" else 2), -1)

    def _work_quantity(
        self,
        item: tuple,
        tail: set[int],
        split_q: dict[int, tuple[int, int]],
        edge_q: dict[tuple[int, int], int],
    ) -> int:
        """The quantity of one work item: an edge bundle's, a group's class (compute and
        collectives), or only its compute for a group of a gradient's tail."""
        kind, key = item
        if kind == "edge":
            return edge_q[key]
        c = int(self.class_of[key])
        return split_q[c][0] if key in tail else c

    def events(self) -> Timeline:
        """Where on the step's timeline each group's work, each edge bundle and each
        overlapped collective sits (graph positions; strategy-independent, so computed
        once and shared by :meth:`restricted` copies). O(operands)."""
        if self._timeline is not None:
            return self._timeline
        ops = self.graph.ops
        n = len(ops)
        update_start = next((i for i, o in enumerate(ops) if o.phase == "update"), n)
        first_backward = next((i for i, o in enumerate(ops) if o.phase == "backward"), update_start)
        bundles = self.group_edges()
        work: list[tuple[int, tuple]] = []
        for gi, g in enumerate(self.groups):
            pos = g.members[1] if g.kind in SOURCE_KINDS and len(g.members) > 1 else g.anchor
            work.append((pos, ("node", gi)))
        tail = set(self.gradient_tail) if self.overlap else set()
        head = self._parameter_head(bundles) if self.overlap else set()
        reductions: set[tuple[int, int]] = set()
        prefetches: set[tuple[int, int]] = set()
        reduce_events: list[tuple[int, tuple]] = []
        gather_events: list[tuple[int, tuple]] = []
        regather: list[tuple[int, tuple]] = []
        for gi in sorted(tail):  # a tail group's own collectives complete its gradient
            reduce_events.append((self.groups[gi].anchor, ("internal", gi)))
        for (gu, gv), recs in bundles.items():
            U, V = self.groups[gu], self.groups[gv]
            need = min(V.members[pv] for _, _, pv, _ in recs)
            # into the update, or between two groups of a weight gradient's tail (the
            # gradient's partial sums completed before its cast): nothing in backward waits
            if V.kind == "parameter" or (gv in tail and gu in tail):
                reductions.add((gu, gv))
                release = max(U.members[pu] for pu, _, _, _ in recs)
                reduce_events.append((release, ("edge", (gu, gv))))
            elif (
                self.overlap
                and (U.kind == "parameter" or gu in head)
                and ops[need].phase in ("forward", "backward")
            ):
                # made of parameters only: fetched ahead of its reader, as FSDP prefetches
                prefetches.add((gu, gv))
                if ops[need].phase == "forward":
                    gather_events.append((need, ("edge", (gu, gv))))
                else:
                    regather.append((need, ("edge", (gu, gv))))
            else:
                work.append((need, ("edge", (gu, gv))))
        readers: dict[int, list[int]] = {}
        for i, o in enumerate(ops):
            for rec in o.operands or []:
                readers.setdefault(self.graph.index(rec["op"]), []).append(i)
        for gi, g in enumerate(self.groups):
            if g.kind != "parameter":
                continue
            outside = [i for i in readers.get(g.anchor, []) if self.group_of[i] != gi]
            fwd = [i for i in outside if ops[i].phase != "backward"]
            bwd = [i for i in outside if ops[i].phase == "backward"]
            gather_events.append((min(fwd or outside or [0]), ("gather", gi)))
            regather.append((min(bwd or [first_backward]), ("regather", gi)))
        # fetches in backward (ZeRO-3's second gathers, resharding of parameters and of
        # what is made of them alone) share the links with the gradient reductions: they
        # join that stream, each issued when backward reaches the fetch before it (FSDP's
        # prefetch of the next layer), the first at backward's start
        regather.sort(key=lambda e: e[0])
        issue = first_backward
        for need, item in regather:
            reduce_events.append((min(issue, need), item))
            issue = need
        work.sort(key=lambda e: e[0])
        reduce_events.sort(key=lambda e: e[0])
        gather_events.sort(key=lambda e: e[0])
        self._timeline = Timeline(
            update_start,
            bundles,
            work,
            reductions,
            prefetches,
            reduce_events,
            gather_events,
            tail,
            head,
        )
        return self._timeline

    def _parameter_head(self, bundles: dict[tuple[int, int], list[tuple]]) -> set[int]:
        """Forward groups that read only parameters, directly or through other such
        groups: a weight's cast to the compute dtype (autocast), a transposed or tied
        weight. What they make depends on nothing the step computes, so resharding it
        (and the parameter itself) can be fetched ahead of its reader, as FSDP all-gathers
        the next layer's weights. O(groups x depth)."""
        producers: dict[int, set[int]] = {}
        for gu, gv in bundles:
            producers.setdefault(gv, set()).add(gu)
        return self._only_parameters(producers, "forward")

    def _gradient_tail(self, bundles: dict[tuple[int, int], list[tuple]]) -> set[int]:
        """Backward groups whose outputs only parameters' updates read, directly or through
        other such groups: a weight gradient's cast to the parameter's dtype (autocast),
        the sum of a shared weight's gradients, the weight-gradient matmul itself. Nothing
        in backward waits for them, so a collective between two of them (the matmul's
        partial sums completed before the cast) is a gradient reduction like one into the
        parameter (the stream of :meth:`cost_tables`); their own work stays on the compute
        stream where it sits. O(groups x depth)."""
        readers: dict[int, set[int]] = {}
        for gu, gv in bundles:
            readers.setdefault(gu, set()).add(gv)
        return self._only_parameters(readers, "backward")

    def _only_parameters(self, linked: dict[int, set[int]], phase: str) -> set[int]:
        """The op groups of ``phase`` whose every linked group (producers
        or readers) is a parameter or one of them: the least fixed point, grown from none."""
        ops = self.graph.ops
        candidates = [
            gi
            for gi, g in enumerate(self.groups)
            if g.kind in ("op", "fixed")
            and gi in linked
            and all(ops[i].phase == phase for i in g.members)
        ]
        found: set[int] = set()
        grew = True
        while grew:
            grew = False
            for gi in candidates:
                if gi not in found and all(
                    self.groups[u].kind == "parameter" or u in found for u in linked[gi]
                ):
                    found.add(gi)
                    grew = True
        return found

    def timeline(self, choice: Sequence[int]) -> dict[str, float]:
        """The step of one strategy per group, exactly (:meth:`cost_tables` with every
        event a checkpoint): ``step_s``, ``compute_s``, ``blocking_comm_s`` (collectives
        compute waits for), ``update_s`` (blocking work of the optimizer phase),
        ``backward_stream_s``/``backward_stream_exposed_s`` (gradient reductions and
        ZeRO-3's gathers in backward) and ``forward_gathers_s``/``forward_gathers_exposed_s``
        (ZeRO's gathers ahead of forward) and ``sync_s``: on a mesh of several devices,
        a step with collectives pays the cost model's ``sync_skew`` times its compute
        (the ranks' meetings make each wait for the slowest,
        :func:`meshplace.profile.link.measure_sync_skew`), which the integer program's
        objective leaves out (it holds only where some chosen strategy communicates, a
        term that is not linear in the choice). Without :attr:`overlap`
        the last two pairs are exposed in full. O(groups + operands)."""
        tl = self.events()
        strat = [g.strategies[choice[gi]] for gi, g in enumerate(self.groups)]
        memo: dict[tuple[int, int], float] = {}

        def bundle(key: tuple[int, int]) -> float:
            t = memo.get(key)
            if t is None:
                gu, gv = key
                t = 0.0
                for pu, out, pv, j in tl.bundles[key]:
                    rec = self.graph.ops[self.groups[gv].members[pv]].operands[j]
                    t += self.reshard(
                        strat[gu].out_specs[pu][out],
                        strat[gv].in_specs[pv][j],
                        rec["map"],
                        rec["shape"],
                        self.itemsize(rec["op"], rec["out"]),
                        self.edge_bucket_bytes(gu, gv),
                    )[0]
                memo[key] = t
            return t

        compute = float(sum(st.compute_s for st in strat))
        blocking = float(sum(st.comm_s for gi, st in enumerate(strat) if gi not in tl.tail))
        work_pos, work_t = [], []
        for pos, (kind, key) in tl.work:
            if kind == "node":
                t = float(strat[key].compute_s)
                if key not in tl.tail:
                    t += strat[key].comm_s
            else:
                t = bundle(key)
                blocking += t
            work_pos.append(pos)
            work_t.append(t)
        wp, wt = np.array(work_pos, dtype=np.int64), np.array(work_t)
        fb = wp < tl.update_start
        update = float(wt[~fb].sum())
        wp, wt = wp[fb], wt[fb]
        before = np.concatenate([[0.0], np.cumsum(wt)])  # work strictly before index k
        fb_work = float(before[-1])
        rp = np.array([p for p, _ in tl.reduce_events], dtype=np.int64)

        def job(kind: str, key: Any) -> float:
            if kind == "edge":
                return bundle(key)
            st = strat[key]
            if kind == "internal":
                return st.comm_s
            return st.gather_s if st.gathers >= (1 if kind == "gather" else 2) else 0.0

        rt = np.array([job(*e) for _, e in tl.reduce_events])
        gp = np.array([p for p, _ in tl.gather_events], dtype=np.int64)
        gt = np.array([job(*e) for _, e in tl.gather_events])
        reduce_total, gather_total = float(rt.sum()), float(gt.sum())
        if self.overlap:
            suffix = np.cumsum(rt[::-1])[::-1]  # released at or after event k
            after = fb_work - before[np.searchsorted(wp, rp, side="right")]
            reduce_exposed = max(0.0, float(np.max(suffix - after))) if rt.size else 0.0
            prefix = np.cumsum(gt)
            ahead = before[np.searchsorted(wp, gp, side="left")]
            gather_exposed = max(0.0, float(np.max(prefix - ahead))) if gt.size else 0.0
        else:
            reduce_exposed, gather_exposed = reduce_total, gather_total
        # ranks that meet in collectives wait for the slowest: a measured fraction of the
        # compute, for a step with any collective
        meets = blocking + reduce_total + gather_total > 0
        sync = self.sync_skew * compute if meets else 0.0
        return {
            "step_s": fb_work + update + reduce_exposed + gather_exposed + sync,
            "compute_s": compute,
            "sync_s": sync,
            "blocking_comm_s": blocking,
            "update_s": update,
            "backward_stream_s": reduce_total,
            "backward_stream_exposed_s": reduce_exposed,
            "forward_gathers_s": gather_total,
            "forward_gathers_exposed_s": gather_exposed,
        }

    def repeated_reads(self) -> set[tuple[int, int]]:
        """(op, operand) pairs that read, from outside a parameter's group, a value another
        of that parameter's update ops has already read through the same view: the
        gradient, which Adam's update reads three times (its two moments and, squared,
        the second). A runtime brings the gradient to the update's placement once — DDP's
        and the torchrun runtime's bucketed all-reduce, ZeRO's reduce-scatter — so the
        plan charges the first read only; the reads of any other group are each charged,
        as DTensor redistributes an operand at every op that reads it. O(operands),
        computed once."""
        if self._repeated_reads is not None:
            return self._repeated_reads
        repeated: set[tuple[int, int]] = set()
        first: set[tuple] = set()
        for i, o in enumerate(self.graph.ops):
            gv = int(self.group_of[i])
            if self.groups[gv].kind != "parameter":
                continue
            for j, rec in enumerate(o.operands or []):
                src = self.graph.index(rec["op"])
                if int(self.group_of[src]) == gv:
                    continue
                key = (gv, src, rec["out"], tuple(rec["map"]), tuple(rec["shape"]))
                if key in first:
                    repeated.add((i, j))
                first.add(key)
        self._repeated_reads = repeated
        return repeated

    def group_edges(self) -> dict[tuple[int, int], list[tuple]]:
        """Operand records between different groups, bundled by (producer, consumer) group;
        each record as (producer member pos, output, consumer member pos, operand). A
        parameter's update reading one value several times is one record
        (:meth:`repeated_reads`)."""
        out: dict[tuple[int, int], list[tuple]] = {}
        repeated = self.repeated_reads()
        for i, o in enumerate(self.graph.ops):
            gv = int(self.group_of[i])
            for j, rec in enumerate(o.operands or []):
                src = self.graph.index(rec["op"])
                gu = int(self.group_of[src])
                if gu == gv or (i, j) in repeated:
                    continue
                out.setdefault((gu, gv), []).append(
                    (self.member_pos[src], rec["out"], self.member_pos[i], j)
                )
        return out

    def _edge_matrix(self, gu: int, gv: int, recs: list[tuple]) -> np.ndarray:
        U, V = self.groups[gu], self.groups[gv]
        bucket = self.edge_bucket_bytes(gu, gv)
        m = np.zeros((len(U.strategies), len(V.strategies)))
        for pu, out, pv, j in recs:
            rec = self.graph.ops[V.members[pv]].operands[j]
            itemsize = self.itemsize(rec["op"], rec["out"])
            for a, su in enumerate(U.strategies):
                have = su.out_specs[pu][out]
                for b, sv in enumerate(V.strategies):
                    need = sv.in_specs[pv][j]
                    m[a, b] += self.reshard(have, need, rec["map"], rec["shape"], itemsize, bucket)[
                        0
                    ]
        return m


def restrict_to_grid(
    problem: ShardingProblem,
    dp_axis: int | None,
    tp_axis: int | None,
    zero: int,
    tensor_splits: dict[str, int] | None = None,
) -> ShardingProblem:
    """The problem restricted to what a grid point allows (:mod:`meshplace.parallel.grid`):
    on the data axis ``dp_axis`` every parameter replicated with ZeRO stage ``zero`` and
    every input split along its batch; on the tensor axis ``tp_axis`` every matrix split
    along one of its two dimensions (Megatron's pattern), vectors split or whole; either
    axis ``None`` when absent. ``tensor_splits`` (parameter op name → dimension, e.g.
    :func:`meshplace.parallel.grid.megatron_layers`) fixes which dimension a parameter is
    split along on the tensor axis where the axis divides it, or keeps it whole there
    (``-1``). Raises
    :class:`ShardingError` naming the tensor left with no placement. O(groups x
    strategies)."""
    splits = tensor_splits or {}
    tp = problem.sizes[tp_axis] if tp_axis is not None else 1

    def on(spec: tuple[int, ...], axis: int | None) -> int:
        return R if axis is None else spec[axis]

    def keep(g: Group, st: Strategy) -> bool:
        if g.kind not in ("parameter", "input"):
            return True
        op = problem.graph.ops[g.anchor]
        shape = op.output_shapes[0] if op.output_shapes else []
        spec = st.out_specs[0][0]
        if g.kind == "input":
            names = (op.dim_names or [[]])[0] or []
            batch = names.index("batch") if "batch" in names else 0
            want_dp = batch if shape and dp_axis is not None else R
            return on(spec, dp_axis) == want_dp and on(spec, tp_axis) == R
        if st.zero != (zero if any(p == R for p in spec) else 0):
            return False
        if on(spec, dp_axis) != R:
            return False
        split_tp = (0, 1) if len(shape) >= 2 else (R, 0)
        fixed = splits.get(op.name)
        if fixed == R:
            return on(spec, tp_axis) == R
        if fixed is not None and fixed < len(shape) and shape[fixed] % tp == 0:
            split_tp = (fixed,)
        if on(spec, tp_axis) in split_tp:
            return True
        # tp divides neither dimension of this matrix: it stays replicated
        return all(p == R for p in spec) and not any(
            on(o.out_specs[0][0], dp_axis) == R and on(o.out_specs[0][0], tp_axis) in split_tp
            for o in g.strategies
        )

    ways = problem.sizes[dp_axis] if dp_axis is not None else 1
    return problem.restricted(keep, f"that the grid allows (batch split {ways} ways)")


@dataclass
class Timeline:
    """Positions (graph order) of a problem's work and overlapped collectives."""

    update_start: int  # first op of the optimizer phase
    bundles: dict[tuple[int, int], list[tuple]]  # group_edges()
    work: list[tuple[int, tuple]]  # (position, ("node", group) | ("edge", (gu, gv)))
    reductions: set[tuple[int, int]]  # bundles into a parameter or its gradient tail
    prefetches: set[tuple[int, int]]  # bundles out of a parameter or its head
    # (release position, ("edge", bundle) | ("internal", tail group))
    reduce_events: list[tuple[int, tuple]]
    # (position needed, ("gather", parameter group) | ("edge", bundle)) ahead of forward
    gather_events: list[tuple[int, tuple]]
    tail: set[int]  # groups of weight gradients' tails (ShardingProblem._gradient_tail)
    head: set[int]  # groups made of parameters only (ShardingProblem._parameter_head)


def _checkpoints(positions: np.ndarray, limit: int, *, last: bool) -> np.ndarray:
    """At most ``limit`` of the sorted ``positions``: a third at the end that matters
    most (``last``: the end, else the start), the rest evenly spread."""
    if positions.size <= limit:
        return positions
    k = limit // 3
    edge = positions[-k:] if last else positions[:k]
    rest = positions[:-k] if last else positions[k:]
    spread = rest[np.linspace(0, rest.size - 1, limit - k).round().astype(np.int64)]
    return np.unique(np.concatenate([edge, spread]))


def _blocks(sizes: Sequence[int], spec: Spec, zero: int) -> int:
    n = 1
    for s, p in zip(sizes, spec, strict=True):
        if p >= 0 or (p == R and zero >= 1):
            n *= s
    return n


def _assign_name(assign: Sequence[str | None], axes: Sequence[str]) -> str:
    words = [f"{lab}@{a}" for a, lab in zip(axes, assign, strict=True) if lab is not None]
    return " ".join(words) or "replicated"
