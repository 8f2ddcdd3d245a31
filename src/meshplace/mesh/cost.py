"""Lowering cost of a named-dimension program under a layout: compute, collectives, memory.

Sources: Shazeer et al., "Mesh-TensorFlow" (NeurIPS 2018), Sec. 5 (how each op lowers to a
local op plus collectives); Kumar et al., "Scale MLPerf-0.6 models on Google TPU-v3 Pods"
(arXiv:1909.09756, 2019), Sec. 3-4 (weight-update sharding, spatial partitioning, the 2D
torus all-reduce).

Lowering rules (``rules`` maps dimension names to mesh axes; ``split(n)`` is its axis):

=====================  =====================================================================
op                     collective per device
=====================  =====================================================================
einsum                 names summed over (in the inputs, not the output) that are split ->
                       one **all-reduce** of the local output over those axes (e.g. a matmul
                       contracting a split ``d_model``). Partial sums reaching one tensor from
                       several einsums (q, k, v projections) are added first, reduced once.
reduce (norm, softmax, a reduced name that is split -> all-reduce of the float32 statistics
loss, batch norm)      (rows x stats x 4 bytes); batch norm's batch statistics stay per
                       device ("ghost" batch norm), its spatial ones are synchronised
relayout (rename)      old name split, new name not -> **all-gather** over the old axis (its
                       gradient: **reduce-scatter**)
conv / pool            a split spatial name and kernel k > 1 -> **halo exchange** (collective
                       permute with both neighbours): k//2 rows x local width x channels x
                       local batch x bytes, each way
weight gradient        names its einsum sums over that are split (the data-parallel axes)
                       -> **all-reduce** of the local gradient (float32), once per parameter,
                       combined per layer into one collective per set of axes (as XLA's
                       all-reduce combiner does); with **weight-update sharding**:
                       **reduce-scatter**, update 1/N of the weight and optimizer state,
                       **all-gather** the updated weights
=====================  =====================================================================

Compute per op is a roofline on the local shard: ``max(flops / (peak_bf16 x e_c),
bytes / (bandwidth x e_m)) + launch`` with the efficiencies of
:data:`meshplace.cost.compute.DEFAULT_EFFICIENCY`. A program built with
``kernels="pytorch"`` (:data:`meshplace.mesh.program.KERNELS`) also says which values a
fused kernel keeps on chip (no bytes, no launch for the op making them, not saved), which
bias adds are a matmul's epilogue (free) and which weights pass through autocast's cast
kernels (6 bytes per element each way, a launch each). Activations are bfloat16, weights,
gradients and optimizer slots float32. Collective times come from
:meth:`meshplace.mesh.layout.Mesh.collective_time` (ring / torus formulas of
:func:`meshplace.cost.collectives.collective_time` with the axis's real link bandwidth).

Exposed and overlapped communication
------------------------------------
- Collectives *inside* forward and backward (activation all-reduces, all-gathers, halos)
  are data dependencies of the next op: **exposed**, added to the step.
- A layer's weight-gradient reduction can start once that layer's backward is done and runs
  on a communication channel, one collective after another, while the backward of earlier
  layers continues: ``f_u = max(f_{u-1}, ready_u) + c_u`` over units ``u`` in backward order;
  only the tail ``f_last - end of backward`` is exposed.
- Under weight-update sharding the all-gather of updated weights overlaps the next step's
  forward the same way (a layer waits for its own weights only).
- The optimizer update follows the last gradient reduction (synchronous training).

Memory per device = weights (sharded by the layout) + gradients (sharded like the weights;
under weight-update sharding 1/N of them plus the largest layer's transient full gradient) +
optimizer slots (sharded by the layout, and 1/N under weight-update sharding) + saved
forward activations + the largest single gradient buffer. The step fits when this is at most
the device's memory.

Complexity: one evaluation is O(ops + units); op costs are memoised per (op, axes of its
names), so a layout search re-costs only ops whose dimensions' axes changed.

Example
-------
>>> from meshplace.hardware import load_cluster
>>> from meshplace.mesh.layout import build_mesh
>>> from meshplace.mesh.program import ProgramBuilder
>>> b = ProgramBuilder("mm")
>>> x = b.input("x", [("batch", 64), ("d_model", 1024)])
>>> w = b.param("w", [("d_model", 1024), ("d_ff", 4096)])
>>> y = b.einsum("y", x, w, ["batch", "d_ff"])
>>> prog = b.build("sgd", search_dims=("batch", "d_model", "d_ff"), samples=64)
>>> mesh = build_mesh(load_cluster("tpu-v3-8"), (4,))
>>> cost = evaluate(prog, mesh, {"d_model": "x"})
>>> [(c.op, c.kind, c.axes, c.nbytes) for c in cost.collectives if c.phase == "forward"]
[('y', 'all_reduce', ('x',), 524288.0)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshplace.cost.compute import DEFAULT_EFFICIENCY, FALLBACK_EFFICIENCY, CostModel
from meshplace.mesh.layout import LayoutError, Mesh, check_tensor
from meshplace.mesh.program import Op, Program

GRAD_BYTES = 4  # float32 gradients and optimizer slots
CAST_BYTES = 2  # autocast's copies (kernels="pytorch") are bfloat16
STAT_BYTES = 4
_EFF = {**DEFAULT_EFFICIENCY, "pointwise": (0.5, 0.7), "softmax": (0.5, 0.7), "pool": (0.5, 0.7)}


@dataclass(frozen=True)
class Collective:
    """One collective in a step: ``count`` calls of ``kind`` over ``axes`` moving
    ``nbytes`` per device per call; ``time_s`` is all calls together."""

    op: str
    kind: str
    axes: tuple[str, ...]
    nbytes: float
    count: int
    time_s: float
    phase: str
    category: str  # layout | halo | gradient | weight_gather
    tensors: tuple[str, ...] = ()  # gradient buckets: the parameters combined

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "kind": self.kind,
            "axes": list(self.axes),
            "bytes": self.nbytes,
            "count": self.count,
            "time_s": self.time_s,
            "phase": self.phase,
            "category": self.category,
            **({"tensors": list(self.tensors)} if self.tensors else {}),
        }


@dataclass
class LayoutCost:
    """Step time, its breakdown, memory per device and the collectives of one layout."""

    mesh: Mesh
    rules: dict[str, str]
    weight_update_sharding: bool
    step_time_s: float
    compute_s: dict[str, float]
    comm_s: dict[str, float]  # total time per category
    exposed_s: dict[str, float]  # exposed time per category
    memory: dict[str, float]
    peak_memory_bytes: float
    memory_capacity_bytes: float
    collectives: list[Collective] = field(default_factory=list)
    samples: int = 0

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def overlapped_comm_s(self) -> float:
        return sum(self.comm_s.values()) - self.exposed_comm_s

    @property
    def comm_bytes(self) -> float:
        return sum(c.nbytes * c.count for c in self.collectives)

    def rules_label(self) -> str:
        return ", ".join(f"{k}:{v}" for k, v in sorted(self.rules.items())) or "(replicated)"

    def to_dict(self) -> dict[str, Any]:
        mesh = self.mesh.describe()
        return {
            "mesh": mesh,
            "rules": dict(sorted(self.rules.items())),
            "weight_update_sharding": self.weight_update_sharding,
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples / self.step_time_s if self.step_time_s else 0.0,
            "compute_s": self.compute_s,
            "communication_s": self.comm_s,
            "exposed_s": self.exposed_s,
            "exposed_comm_s": self.exposed_comm_s,
            "overlapped_comm_s": self.overlapped_comm_s,
            "comm_bytes_per_device": self.comm_bytes,
            "memory_bytes": self.memory,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits": self.fits,
            "collectives": [c.to_dict() for c in self.collectives],
        }


@dataclass(frozen=True)
class _OpCost:
    compute: float
    comm: tuple[tuple[str, tuple[str, ...], float, float, str], ...]  # kind, axes, bytes, t, cat
    comm_time: float
    out_bytes: float
    partial: tuple[str, ...]  # grad ops: axes the parameter gradient is partial over


class Evaluator:
    """Costs layouts of one program on one mesh, memoising per-op costs (see module doc).

    ``memory_fraction`` scales the device memory a layout may use (default: all of it).
    """

    def __init__(
        self,
        program: Program,
        mesh: Mesh,
        *,
        memory_fraction: float = 1.0,
        cost_model: CostModel | None = None,
    ) -> None:
        self.program = program
        # the collectives measured on the mesh's device kind, where the cost model has them
        self.mesh = mesh = mesh.calibrated(cost_model)
        dev = mesh.cluster.devices[int(mesh.devices.reshape(-1)[0])]
        spec = dev.spec
        self.peak = spec.peak("bfloat16")
        self.bandwidth = spec.memory_bandwidth
        # a calibrated cost model (meshplace.cost.calibration) gives this device kind's
        # measured efficiencies and launch cost; the default gives the roofline's
        self.cost_model = cost_model or CostModel()
        self.device_kind = dev.kind
        self.spec = spec
        self._launch: dict[str, float] = {}  # op kind -> fixed cost per kernel
        self.capacity = spec.memory_bytes * memory_fraction
        self.axis_size = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        self.axis_order = {a: i for i, a in enumerate(mesh.axis_names)}
        t = program.tensors
        self.ops = program.ops
        self.repeat = [program.units[o.unit].repeat for o in self.ops]
        self.names: list[tuple[str, ...]] = []
        for o in self.ops:
            ns: dict[str, None] = {}
            for name in (*o.inputs, o.output):
                if name in t:
                    for n in t[name].names:
                        ns[n] = None
            for part in o.partial:  # accumulate: the names its partial sums are over
                for n in part:
                    ns[n] = None
            self.names.append(tuple(ns))
        self._memo: dict[tuple[int, tuple[str | None, ...]], _OpCost] = {}
        self._comm_memo: dict[tuple[str, float, tuple[str, ...]], float] = {}
        owner = program.param_unit()
        self.param_owner = owner
        self.params = [p for p in program.params if p in owner]
        self.param_names = {p: t[p].names for p in self.params}
        self.grad_ops: dict[str, list[int]] = {p: [] for p in self.params}
        for i, o in enumerate(self.ops):
            if o.grad_param is not None and o.grad_param in self.grad_ops:
                self.grad_ops[o.grad_param].append(i)
        self.units = program.units
        self.unit_fwd: list[list[int]] = [[] for _ in program.units]
        self.unit_bwd: list[list[int]] = [[] for _ in program.units]
        for i, o in enumerate(self.ops):
            if o.phase == "forward":
                self.unit_fwd[o.unit].append(i)
            elif o.phase == "backward":
                self.unit_bwd[o.unit].append(i)
        self.update_op = {o.inputs[0]: i for i, o in enumerate(self.ops) if o.phase == "update"}
        self.chains = _pointwise_chains(program) if program.meta.get("kernels") == FUSED else None

    # ------------------------------------------------------------------ helpers
    def check(self, rules: Mapping[str, str | None]) -> None:
        """Raise :class:`LayoutError` for an illegal layout (unknown or unsplittable name,
        unknown axis, a tensor with two names on one axis, uneven division)."""
        known = self.program.dim_sizes()
        for name, axis in rules.items():
            if axis is None:
                continue
            if name not in known:
                raise LayoutError(
                    f"layout rule {name}={axis}: the program {self.program.name!r} has no "
                    f"dimension {name!r}; its dimensions are: {', '.join(sorted(known))}"
                )
            if name not in self.program.splittable:
                raise LayoutError(
                    f"layout rule {name}={axis}: dimension {name!r} cannot be split in "
                    f"{self.program.name!r}; splittable: {', '.join(self.program.splittable)}"
                )
            if axis not in self.axis_size:
                raise LayoutError(
                    f"layout rule {name}={axis}: mesh {self.mesh.label} has no axis {axis!r}; "
                    f"its axes are: {', '.join(self.mesh.axis_names)}"
                )
        for tensor in self.program.tensors.values():
            check_tensor(tensor.name, tensor.dims, rules, self.axis_size)

    def _local(self, tensor: str, rules: Mapping[str, str | None]) -> float:
        t = self.program.tensors[tensor]
        n = 1.0
        for name, size in t.dims:
            a = rules.get(name)
            n *= size / self.axis_size[a] if a else size
        return n

    def _axes(self, names, rules: Mapping[str, str | None]) -> tuple[str, ...]:
        axes = {rules.get(n) for n in names} - {None}
        return tuple(sorted(axes, key=self.axis_order.__getitem__))  # type: ignore[arg-type]

    def comm_time(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> float:
        key = (kind, nbytes, axes)
        t = self._comm_memo.get(key)
        if t is None:
            t = self.mesh.collective_time(kind, nbytes, axes)
            self._comm_memo[key] = t
        return t

    def _roofline(self, flops: float, nbytes: float, eff: str, launch: bool = True) -> float:
        measured = self.cost_model.device_efficiency.get(self.device_kind, {}).get(eff)
        model_wide = self.cost_model.efficiency.get(eff)
        ec, em = measured or model_wide or _EFF.get(eff, FALLBACK_EFFICIENCY)
        work = max(flops / (self.peak * ec), nbytes / (self.bandwidth * em))
        if not launch:
            return work
        if eff not in self._launch:
            self._launch[eff] = self.cost_model.kernel_launch(self.device_kind, self.spec, eff)
        return work + self._launch[eff]

    # ------------------------------------------------------------------ per op
    def op_cost(self, i: int, rules: Mapping[str, str | None]) -> _OpCost:
        key = (i, tuple(rules.get(n) for n in self.names[i]))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._op_cost(i, rules)
            self._memo[key] = hit
        return hit

    def _op_cost(self, i: int, rules: Mapping[str, str | None]) -> _OpCost:
        o: Op = self.ops[i]
        t = self.program.tensors
        split = 1.0
        for n in self.names[i]:
            a = rules.get(n)
            if a and not (o.partial and any(n in part for part in o.partial)):
                split *= self.axis_size[a]
        out_local = self._local(o.output, rules)
        out_bytes = out_local * t[o.output].itemsize  # what a collective of the output moves
        # what the kernel moves: nothing for values kept on chip by a fused kernel; a weight
        # read through a cast in the activation dtype
        inside: tuple[str, ...] = ()  # operands that come from this op's fused chain
        launch = t[o.output].materialised  # an op whose output stays on chip: no launch
        kept = out_bytes if t[o.output].materialised else 0.0
        if self.chains is not None and i in self.chains:
            inside, leaves, head = self.chains[i]
            launch = launch and head
            kept = kept if leaves else 0.0
        in_bytes = sum(
            self._local(x, rules) * (CAST_BYTES if x in o.reads_cast else t[x].itemsize)
            for x in o.inputs
            if x in t and t[x].materialised and x not in inside
        )
        comm: list[tuple[str, tuple[str, ...], float, float, str]] = []
        partial: tuple[str, ...] = ()

        def add(kind: str, axes: tuple[str, ...], nbytes: float, cat: str = "layout") -> None:
            if axes and nbytes > 0:
                comm.append((kind, axes, nbytes, self.comm_time(kind, nbytes, axes), cat))

        if o.kind == "relayout":
            compute = 0.0
            for old, new in o.renames:
                src, dst = rules.get(old), rules.get(new)
                if o.gather and src and src != dst:
                    add("all_gather", (src,), out_bytes)
                if not o.gather and dst and dst != src:
                    add("reduce_scatter", (dst,), in_bytes)
            if not comm:
                kept = 0.0  # a view
        elif o.kind == "split" or o.epilogue:
            # a view of a part of its input, or a bias add inside the producer's kernel
            # (writing the producer's buffer): no time, no memory of its own
            compute = kept = 0.0
        else:
            compute = self._roofline(o.flops / split, in_bytes + kept, o.eff, launch)
            if o.grad_param is not None:
                partial = self._axes(o.reduce, rules)
            elif o.kind == "einsum" and not o.defer:
                ins = {n for x in o.inputs for n in t[x].names}
                add("all_reduce", self._axes(ins - set(t[o.output].names), rules), out_bytes)
            elif o.kind == "accumulate":
                for axes in dict.fromkeys(self._axes(p, rules) for p in o.partial):
                    add("all_reduce", axes, out_bytes)
            elif o.kind == "reduce" and o.stats:
                names = [n for n in o.reduce if n not in o.local]
                axes = self._axes(names, rules)
                if axes:
                    rows = self._local(o.inputs[0], rules)
                    for n, size in t[o.inputs[0]].dims:
                        if n in o.reduce:
                            a = rules.get(n)
                            rows /= size / self.axis_size[a] if a else size
                    add("all_reduce", axes, rows * o.stats * STAT_BYTES)
            if o.halo and o.kind in ("conv", "pool"):
                x = o.inputs[0]
                local = self._local(x, rules) * t[x].itemsize
                sizes = dict(t[x].dims)
                for name, rows in o.halo:
                    a = rules.get(name)
                    if a and rows > 0:
                        per_row = local / (sizes[name] / self.axis_size[a])
                        add("collective_permute", (a,), 2 * rows * per_row, "halo")
        for x in o.casts:  # autocast's copy kernel: float32 <-> bfloat16, both ways
            compute += self._roofline(0.0, self._local(x, rules) * (4 + CAST_BYTES), "pointwise")
        return _OpCost(compute, tuple(comm), sum(c[3] for c in comm), kept, partial)

    # ------------------------------------------------------------------ per layout
    def evaluate(
        self, rules: Mapping[str, str | None], weight_update_sharding: bool, *, detail: bool = True
    ) -> LayoutCost | tuple[float, float]:
        """Cost of ``rules`` (assumed legal; see :meth:`check`). With ``detail=False``
        returns just ``(step_time_s, peak_memory_bytes)`` (the search's fast path)."""
        rules = {k: v for k, v in rules.items() if v}
        wus = weight_update_sharding
        ops = self.ops
        units = self.units
        nunits = len(units)
        fwd_dur = [0.0] * nunits
        bwd_dur = [0.0] * nunits
        compute = {"forward": 0.0, "backward": 0.0, "update": 0.0}
        comm = {"layout": 0.0, "halo": 0.0, "gradient": 0.0, "weight_gather": 0.0}
        act_bytes = 0.0
        transient = 0.0
        costs: list[_OpCost | None] = [None] * len(ops)
        for u in range(nunits):
            rep = units[u].repeat
            for i in self.unit_fwd[u]:
                c = self.op_cost(i, rules)
                costs[i] = c
                fwd_dur[u] += c.compute + c.comm_time
                act_bytes += c.out_bytes * rep
            for i in self.unit_bwd[u]:
                c = self.op_cost(i, rules)
                costs[i] = c
                bwd_dur[u] += c.compute + c.comm_time
                if c.out_bytes > transient:
                    transient = c.out_bytes
        # parameters: gradient reduction, update, memory
        t = self.program.tensors
        grad_c = [0.0] * nunits
        gather_c = [0.0] * nunits
        update_s = 0.0
        w_bytes = g_bytes = o_bytes = 0.0
        max_grad = 0.0
        slots = self.program.optimizer.slots
        # gradient buckets: one collective per (unit, axes), as XLA's all-reduce combiner
        # (and Horovod/DDP bucketing) fuse a layer's gradient reductions
        buckets: dict[tuple[int, tuple[str, ...]], list] = {}
        for p in self.params:
            u = self.param_owner[p]
            rep = units[u].repeat
            elems = self._local(p, rules)
            wb = elems * t[p].itemsize
            gb = elems * GRAD_BYTES
            axes_set: dict[str, None] = {}
            for i in self.grad_ops[p]:
                c = costs[i] if costs[i] is not None else self.op_cost(i, rules)
                for a in c.partial:
                    axes_set[a] = None
            axes = tuple(sorted(axes_set, key=self.axis_order.__getitem__))
            shard = math.prod(self.axis_size[a] for a in axes) if (wus and axes) else 1
            if axes:
                bucket = buckets.setdefault((u, axes), [0.0, 0.0, []])
                bucket[0] += gb
                bucket[1] += wb
                bucket[2].append(p)
            uo = ops[self.update_op[p]]
            ue = elems / shard
            update_s += (
                self._roofline(uo.flops * ue / t[p].elements, ue * uo.update_bytes, "pointwise")
                * rep
            )
            w_bytes += wb * rep
            g_bytes += gb / shard * rep
            o_bytes += elems * slots * GRAD_BYTES / shard * rep
            if gb > max_grad:
                max_grad = gb
        grad_colls: list[tuple[int, str, tuple[str, ...], float, float, list[str]]] = []
        for (u, axes), (gb, wb, members) in buckets.items():
            if wus:
                rs = self.comm_time("reduce_scatter", gb, axes)
                ag = self.comm_time("all_gather", wb, axes)
                grad_c[u] += rs
                gather_c[u] += ag
                if detail:
                    grad_colls.append((u, "reduce_scatter", axes, gb, rs, members))
                    grad_colls.append((u, "all_gather", axes, wb, ag, members))
            else:
                ar = self.comm_time("all_reduce", gb, axes)
                grad_c[u] += ar
                if detail:
                    grad_colls.append((u, "all_reduce", axes, gb, ar, members))
        if wus:
            g_bytes += max_grad
        # timeline
        fwd_end = 0.0
        gathered = 0.0
        for u in range(nunits):
            rep = units[u].repeat
            fwd_end = _chain(fwd_end, gathered, gather_c[u], fwd_dur[u], rep)
            gathered += gather_c[u] * rep
        fwd_work = sum(fwd_dur[u] * units[u].repeat for u in range(nunits))
        bwd_work = sum(bwd_dur[u] * units[u].repeat for u in range(nunits))
        ready = 0.0
        channel = 0.0
        for u in reversed(range(nunits)):
            rep = units[u].repeat
            channel = _chain(channel, ready, bwd_dur[u], grad_c[u], rep)
            ready += bwd_dur[u] * rep
        grad_tail = max(0.0, channel - bwd_work)
        gather_stall = max(0.0, fwd_end - fwd_work)
        step = fwd_end + bwd_work + grad_tail + update_s
        peak = w_bytes + g_bytes + o_bytes + act_bytes + transient
        if not detail:
            return step, peak
        colls: list = []
        layout_exposed = 0.0
        halo_exposed = 0.0
        for i, o in enumerate(ops):
            c = costs[i]
            if c is None or not c.comm:
                continue
            rep = self.repeat[i]
            compute_phase = o.phase
            for kind, axes, nbytes, tt, cat in c.comm:
                colls.append(
                    Collective(o.name, kind, axes, nbytes, rep, tt * rep, compute_phase, cat)
                )
                if cat == "halo":
                    halo_exposed += tt * rep
                else:
                    layout_exposed += tt * rep
        for u, kind, axes, nbytes, tt, members in grad_colls:
            cat = "weight_gather" if kind == "all_gather" else "gradient"
            rep = units[u].repeat
            colls.append(
                Collective(
                    f"{units[u].name} weights",
                    kind,
                    axes,
                    nbytes,
                    rep,
                    tt * rep,
                    "forward" if cat == "weight_gather" else "backward",
                    cat,
                    tuple(members),
                )
            )
        comm["layout"] = layout_exposed
        comm["halo"] = halo_exposed
        comm["gradient"] = sum(grad_c[u] * units[u].repeat for u in range(nunits))
        comm["weight_gather"] = sum(gather_c[u] * units[u].repeat for u in range(nunits))
        for i, o in enumerate(ops):
            c = costs[i]
            if c is not None and o.phase in ("forward", "backward"):
                compute[o.phase] += c.compute * self.repeat[i]
        compute["update"] = update_s
        exposed = {
            "layout": layout_exposed,
            "halo": halo_exposed,
            "gradient": grad_tail,
            "weight_gather": gather_stall,
        }
        memory = {
            "weights": w_bytes,
            "gradients": g_bytes,
            "optimizer": o_bytes,
            "activations": act_bytes,
            "workspace": transient,
        }
        return LayoutCost(
            self.mesh,
            dict(rules),
            wus,
            step,
            compute,
            comm,
            exposed,
            memory,
            peak,
            self.capacity,
            colls,
            self.program.samples,
        )


FUSED = "pytorch-fused"


def _pointwise_chains(program: Program) -> dict[int, tuple[tuple[str, ...], bool, bool]]:
    """For ``kernels="pytorch-fused"``: which point-wise ops run as one kernel, as
    ``torch.compile`` fuses them (and as :mod:`meshplace.parallel.sharding`'s
    ``compute="fused"`` does on the captured graph). A point-wise or accumulate op joins the
    chain of a point-wise producer of one of its operands in the same unit and phase; per
    chained op: ``(operands from inside its chain, whether its output is read outside the
    chain or by nobody, whether it starts the chain)``. The chain is one launch; values
    that stay inside it move no memory. O(ops + operands)."""
    ops = program.ops
    producer = {o.output: i for i, o in enumerate(ops)}
    readers: dict[str, list[int]] = {}
    for i, o in enumerate(ops):
        for x in o.inputs:
            readers.setdefault(x, []).append(i)
    chain: dict[int, int] = {}  # op -> its chain's first op
    for i, o in enumerate(ops):
        if o.kind not in ("pointwise", "accumulate") or o.epilogue or o.phase == "update":
            continue
        chain[i] = i
        for x in o.inputs:
            p = producer.get(x)
            if p in chain and ops[p].unit == o.unit and ops[p].phase == o.phase:
                chain[i] = chain[p]
                break
    out = {}
    for i, head in chain.items():
        o = ops[i]
        inside = tuple(x for x in o.inputs if chain.get(producer.get(x, -1)) == head)
        users = readers.get(o.output, [])
        leaves = not users or any(chain.get(r) != head for r in users)
        out[i] = (inside, leaves, head == i)
    return out


def _chain(end: float, start: float, lead: float, work: float, k: int) -> float:
    """Closed form of ``k`` steps of ``end = max(end, start + j*lead) + work`` (j = 1..k):
    a resource doing ``work`` per item that may start item j only at ``start + j*lead``.
    O(1): the latest of "all k items back to back from ``end``" and "from the item whose
    start time binds" (the first item when work >= lead, else the last).

    >>> _chain(0.0, 0.0, 1.0, 3.0, 2), _chain(0.0, 0.0, 3.0, 1.0, 2)
    (7.0, 7.0)
    """
    if k <= 0:
        return end
    latest = start + lead + k * work if work >= lead else start + k * lead + work
    return max(end + k * work, latest)


def evaluate(
    program: Program,
    mesh: Mesh,
    rules: Mapping[str, str | None],
    *,
    weight_update_sharding: bool = False,
    memory_fraction: float = 1.0,
    cost_model: CostModel | None = None,
) -> LayoutCost:
    """Check ``rules`` (:class:`LayoutError` when illegal) and cost them on ``mesh``.

    O(ops + units); for many layouts reuse one :class:`Evaluator`."""
    ev = Evaluator(program, mesh, memory_fraction=memory_fraction, cost_model=cost_model)
    ev.check(rules)
    res = ev.evaluate(rules, weight_update_sharding)
    assert isinstance(res, LayoutCost)
    return res
