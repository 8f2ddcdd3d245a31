"""Run a captured training step on DTensor exactly as a sharding plan says, op by op.

Source: the SPMD lowering of Alpa's intra-operator pass (Zheng et al., OSDI 2022, Sec. 4)
and XLA's sharding propagation, carried out with PyTorch's own DTensor: before every op
of the captured step (``meshplace.graph.capture.capture_step``), each operand is
``redistribute``-d to the placement the plan's strategy for that op reads (``S(d)`` →
``Shard(d)``, ``R`` → ``Replicate()``, ``P`` → ``Partial()``), and DTensor then runs the
op on the local blocks. So the collectives that run are exactly the resharding the plan
charged — or, where DTensor cannot run an op in the planned layout, the extra collectives
it inserts, which :class:`CollectiveLog` records (kind and mesh axis, per op) for
comparison with :func:`planned_collectives`. The peak of live tensor bytes each rank holds
is measured along the way, for comparison with
:meth:`meshplace.parallel.search.ShardingPlan.live_peak`.

This is the *check* of a plan, the way ``jax.experimental.shard_map`` checks a sharding:
it walks the traced step with :class:`torch.fx.Interpreter`. The path a user trains with
is :mod:`meshplace.runtime.sharded` (the model's own modules on DTensor parameters).

Weight-update sharding (``zero`` > 0, a flattened shard) has no DTensor placement; plans
with it are refused (one sentence).

Complexity: one redistribute per operand whose placement changes, plus the step itself;
the memory measurement walks the live values after every node (O(nodes x live values)),
which is fine for the small models a check runs.

Example (inside an initialised 4-rank process group; see tests/test_parallel_spmd.py)::

    step = capture_step(model, args, training=True)
    plan = shard_graph(step.graph, cluster, mesh_shape=(2, 2), zero_stages=(0,)).best
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=plan.problem.axes)
    with CollectiveLog(mesh) as log:
        out, interp = run_plan(step, plan, mesh, params, buffers, states, inputs, log=log)
    interp.by_node      # {"addmm_1": [("all_reduce", "y")], ...}
    planned_collectives(plan)   # the same shape, from the plan's resharding table
    interp.peak_bytes, plan.live_peak()
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshplace.errors import InputError
from meshplace.parallel.sharding import FLAT, P, R
from meshplace.runtime.dryrun import COLLECTIVE_KINDS as _KINDS
from meshplace.runtime.dryrun import COLLECTIVE_NAMESPACES
from meshplace.runtime.sharded import local_nbytes


def dtensor_placements(spec: Sequence[int]) -> list[Any]:
    """DTensor placements of a plan spec, one per mesh axis (``P`` → ``Partial()``).

    >>> dtensor_placements((0, -1, -2))
    [Shard(dim=0), Replicate(), Partial(sum)]
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[Any] = []
    for p in spec:
        if p >= 0:
            out.append(Shard(p))
        elif p == R:
            out.append(Replicate())
        elif p == P:
            out.append(Partial())
        else:
            raise InputError(
                "a weight-update-sharded (ZeRO) placement has no DTensor placement; "
                "check plans solved with zero_stages=(0,)"
            )
    return out


class CollectiveLog(TorchDispatchMode):
    """Records every functional collective that runs: (kind, mesh axis name), counted.

    A collective whose process group is not one mesh axis's is recorded under the axis
    name ``"?"``."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.axis_of = {
            mesh.get_group(i).group_name: name for i, name in enumerate(mesh.mesh_dim_names)
        }
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "")
        name = func.overloadpacket.__name__
        if ns in COLLECTIVE_NAMESPACES and name in _KINDS:
            group = kwargs.get("group_name", args[-1] if args else None)
            self.calls.append((_KINDS[name], self.axis_of.get(group, "?")))
        return func(*args, **kwargs)

    def counts(self) -> dict[tuple[str, str], int]:
        """How many collectives of each (kind, mesh axis) ran."""
        return dict(collections.Counter(self.calls))


def _local_block(t: torch.Tensor, mesh: Any, placements: list[Any]) -> torch.Tensor:
    """This rank's block of a tensor every rank holds whole (no communication)."""
    from torch.distributed.tensor import Shard

    coord = mesh.get_coordinate()
    for axis, pl in enumerate(placements):
        if isinstance(pl, Shard):
            t = t.chunk(mesh.size(axis), dim=pl.dim)[coord[axis]]
    return t


def place_whole(t: torch.Tensor, mesh: Any, spec: Sequence[int]) -> Any:
    """A DTensor with ``spec``'s placements from a tensor every rank holds whole."""
    from torch.distributed.tensor import DTensor

    pl = dtensor_placements([R if p == P else p for p in spec])
    return DTensor.from_local(
        _local_block(t, mesh, pl).clone(),  # its own storage, not a view of the whole
        mesh,
        pl,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )


class PlanInterpreter(torch.fx.Interpreter):
    """Runs the traced step with every planned op's operands placed as the plan says."""

    def __init__(
        self, gm: torch.fx.GraphModule, plan: Any, mesh: Any, log: CollectiveLog | None = None
    ) -> None:
        super().__init__(gm)
        self.log = log
        self.by_node: dict[str, list[tuple[str, str]]] = {}
        self.plan = plan
        self.mesh = mesh
        problem = plan.problem
        self.problem = problem
        self.op_index = {o.name: i for i, o in enumerate(problem.graph.ops)}
        self.gathered: list[str] = []  # views whose input had to be gathered first
        self.peak_bytes = 0
        #: fx node -> its value's storages (data pointer -> bytes), read when it is made
        self.storages: dict[torch.fx.Node, dict[int, int]] = {}
        self.peak_node = ""
        #: bytes of this rank's blocks of the parameters, their gradients (as the optimizer
        #: update reads them) and the optimizer state
        self.resident_bytes: dict[str, int] = {}
        #: fx node name -> position of the gradient among its arguments: the first update
        #: node reading each parameter's gradient (:func:`gradient_readers`)
        self.gradient_readers: dict[str, int] = {}
        #: a parameter's update brings a value it reads several times (the gradient) to
        #: its placement once, as the plan charges it (``ShardingProblem.repeated_reads``):
        #: (id of the value read, placements) -> (the value, kept alive; redistributed)
        self.repeated_reads = problem.repeated_reads()
        self.update_reads: dict[tuple[int, tuple], tuple[Any, Any]] = {}

    def _run_view(self, n: torch.fx.Node) -> Any:
        """A node the plan folds into an edge (a view, a tuple index): DTensor carries the
        placement through it. Where the view would put a split on a dimension its blocks
        do not divide (DTensor then fails), the split axes are gathered first — the
        all-gather the plan charges for that edge."""
        try:
            return super().run_node(n)
        except (RuntimeError, ValueError):
            if n.op != "call_function":
                raise
        from torch.distributed.tensor import DTensor, Replicate

        args, kwargs = self.fetch_args_kwargs_from_env(n)

        def whole(v: Any) -> Any:
            if isinstance(v, DTensor) and any(p.is_shard() for p in v.placements):
                pl = [Replicate() if p.is_shard() else p for p in v.placements]
                return v.redistribute(self.mesh, pl)
            return v

        self.gathered.append(n.name)
        args = tuple(whole(a) for a in args)
        return getattr(self, n.op)(n.target, args, kwargs)

    def _specs(self, i: int) -> tuple[list, list]:
        p = self.problem
        g = int(p.group_of[i])
        st = self.plan.strategy(g)
        pos = p.member_pos[i]
        return st.in_specs[pos], st.out_specs[pos]

    def run_node(self, n: torch.fx.Node) -> Any:
        before = len(self.log.calls) if self.log is not None else 0
        out = self._run_node(n)
        self._account(n, out)
        if self.log is not None and len(self.log.calls) > before:
            self.by_node.setdefault(self._owner(n), []).extend(self.log.calls[before:])
        return out

    def _account(self, n: torch.fx.Node, out: Any) -> None:
        """Peak of this rank's live tensor bytes: every value the step still holds (the
        interpreter drops a value after its last use), each storage counted once. Each
        value's storages are read once, when it is made (``DTensor.to_local`` is an
        autograd call: reading every live value's again at every node made the walk
        quadratic in them, a third of the ranks' time in tests/test_parallel_spmd.py);
        O(live values) a node."""
        from torch.distributed.tensor import DTensor

        self.env[n] = out  # counted with the rest; the interpreter stores it again
        storages: dict[int, int] = {}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        self.storages[n] = storages
        live: dict[int, int] = {}
        for m in self.env:
            live.update(self.storages.get(m, {}))
        total = sum(live.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_node = total, n.name

    def _owner(self, n: torch.fx.Node) -> str:
        """The planned op a node's collectives belong to: itself, or for a view the first
        planned op that reads through it (the plan charges resharding on that edge)."""
        queue, seen = [n], {n}
        while queue:
            m = queue.pop(0)
            if m.name in self.op_index:
                return m.name
            for u in m.users:
                if u not in seen:
                    seen.add(u)
                    queue.append(u)
        return n.name

    def _run_node(self, n: torch.fx.Node) -> Any:
        i = self.op_index.get(n.name) if n.op == "call_function" else None
        if i is None:
            return self._run_view(n)
        from torch.distributed.tensor import DTensor

        op = self.problem.graph.ops[i]
        in_specs, out_specs = self._specs(i)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        records = list(op.operands or [])
        j = 0

        def place(v: Any) -> Any:
            nonlocal j
            if not isinstance(v, torch.Tensor) or j >= len(records):
                return v
            if list(v.shape) != list(records[j]["shape"]):
                return v
            spec, read = in_specs[j], (i, j)
            j += 1
            if not isinstance(v, DTensor):
                return place_whole(v, self.mesh, spec)
            want = dtensor_placements(spec)
            have = list(v.placements)
            # a partial sum read where a partial sum is allowed stays as it is
            keep = [
                h if (w.is_partial() and h.is_partial()) else w
                for h, w in zip(have, want, strict=True)
            ]
            if keep == have:
                return v
            key = (id(v), tuple(keep))
            if read in self.repeated_reads and key in self.update_reads:
                return self.update_reads[key][1]
            placed = v.redistribute(self.mesh, keep)
            if self.problem.groups[int(self.problem.group_of[i])].kind == "parameter":
                self.update_reads[key] = (v, placed)
            return placed

        def walk(a: Any) -> Any:
            if isinstance(a, list | tuple) and any(isinstance(x, torch.Tensor) for x in a):
                return type(a)(place(x) for x in a)
            return place(a)

        args = tuple(walk(a) for a in args)
        kwargs = {k: place(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if n.name in self.gradient_readers:
            grad = args[self.gradient_readers[n.name]]
            self.resident_bytes["gradients"] = self.resident_bytes.get("gradients", 0) + (
                local_nbytes(grad)
            )
        if n.target in _LOCAL_OPS:
            return self._run_local(n, op, args, kwargs, out_specs)
        out = getattr(self, n.op)(n.target, args, kwargs)
        # an op that made a plain tensor (a factory, or all-plain operands) joins the mesh
        # with its planned placement
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out_specs:
            out = place_whole(out, self.mesh, out_specs[0])
        return out

    def _run_local(
        self, n: torch.fx.Node, op: Any, args: tuple, kwargs: dict, out_specs: list
    ) -> Any:
        """A convolution or CPU attention (or its gradient) on the local blocks, its outputs
        placed as the plan says. DTensor's convolution runs batch-split inputs with whole
        weights only; split channels are as correct locally (an output-channel split gives
        that block of channels, an input-channel split a partial sum) and need no shape
        rewriting — except the gradient's ``bias_sizes``, which becomes the local channel
        count. Attention split by batch, head or (non-causal) query block is local too. A
        spatial split needs a halo exchange, which this check does not run."""
        from torch.distributed.tensor import DTensor

        strategy = self.plan.strategy(int(self.problem.group_of[self.op_index[n.name]]))
        dims = self.problem.dims[self.op_index[n.name]]
        if dims is not None and any(lab in dims.halo for lab in strategy.assign if lab):
            raise InputError(
                f"{n.name}: a spatially split convolution needs a halo exchange, which "
                "run_plan does not perform"
            )
        local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
        if n.target is torch.ops.aten.convolution_backward.default and local[3] is not None:
            local[3] = [local[0].shape[1]]  # bias_sizes: this rank's output channels
        out = n.target(*local, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        traced = n.meta.get("val")
        traced_outs = [t for t in (traced if isinstance(traced, tuple | list) else (traced,))]
        placed: list[Any] = []
        k = 0  # the plan lists the tensor outputs only (a gradient not asked for is None)
        for pos, t in enumerate(outs):
            if t is None:
                placed.append(None)
                continue
            shape = op.output_shapes[k]
            # the traced layout (a kernel may return a transposed one, and later views
            # depend on it), for the whole tensor and for this block alike
            like = traced_outs[pos] if pos < len(traced_outs) else None
            stride = tuple(like.stride()) if isinstance(like, torch.Tensor) else None
            if stride is not None:
                t = _relayout(t, stride)
            placed.append(
                DTensor.from_local(
                    t,
                    self.mesh,
                    dtensor_placements(out_specs[k]),
                    run_check=False,
                    shape=torch.Size(shape),
                    stride=stride if stride is not None else _stride_like(t, shape),
                )
            )
            k += 1
        return tuple(placed) if isinstance(out, tuple) else placed[0]


def _relayout(t: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``t`` with its dimensions laid out in the order ``stride`` orders them."""
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    return t.permute(order).contiguous().permute([order.index(d) for d in range(t.dim())])


def _stride_like(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of the whole tensor laid out in the local block's dimension order (a kernel
    may return a transposed layout, and later views depend on it)."""
    order = sorted(range(local.dim()), key=lambda d: (-local.stride(d), d))
    stride = [0] * len(shape)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(stride)


# ops whose local result on the planned blocks is the planned block (no shape arguments to
# rewrite): convolutions with split channels, which DTensor's strategy does not offer, and
# the CPU flash-attention kernel, for which DTensor registers none
_LOCAL_OPS = frozenset(
    {
        torch.ops.aten.convolution.default,
        torch.ops.aten.convolution_backward.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
)


def source_placements(plan: Any) -> dict[str, list[int]]:
    """The spec of every parameter, buffer and input op of the plan (by op name); a
    ZeRO-sharded parameter is refused (:func:`dtensor_placements`)."""
    p = plan.problem
    out = {}
    for gi, g in enumerate(p.groups):
        if g.kind in ("parameter", "buffer", "input"):
            st = plan.strategy(gi)
            spec = st.out_specs[0][0]
            if st.zero or any(s == FLAT for s in spec):
                raise InputError(
                    f"{p.graph.ops[g.anchor].name} uses weight-update sharding (zero "
                    f"{st.zero}); run_plan checks plans solved with zero_stages=(0,)"
                )
            out[p.graph.ops[g.anchor].name] = list(spec)
    return out


def gradient_readers(step: Any) -> dict[str, int]:
    """Per parameter of a captured step, the first optimizer-update node that reads its
    gradient, and the gradient's position among that node's arguments (1): the state's
    ``m.mul(b).add(g, …)`` (:func:`meshplace.runtime.program.new_state_nodes`), or, without
    optimizer state (SGD), the weight's ``p.add(g, …)``. O(nodes)."""
    from meshplace.runtime.program import new_state_nodes

    n_params, n_bufs = len(step.param_names), len(step.buffer_names)
    if step.n_state:
        nodes = new_state_nodes(step.gm, n_params, n_bufs, step.n_state)
        return {nodes[k * step.n_state]: 1 for k in range(n_params)}
    placeholders = [n for n in step.gm.graph.nodes if n.op == "placeholder"][:n_params]
    out = {}
    for ph in placeholders:
        for user in ph.users:
            if user.args and user.args[0] is ph and len(user.args) > 1:
                out[user.name] = 1
                break
    return out


def run_plan(
    step: Any,
    plan: Any,
    mesh: Any,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    log: CollectiveLog | None = None,
) -> Any:
    """One training step of ``step`` (a :class:`meshplace.graph.capture.CapturedStep`)
    under ``plan`` on ``mesh``: sources placed as planned (from the whole tensors every
    rank holds), every op's operands redistributed as planned; returns the traced step's
    outputs (DTensors). With ``log`` (active around the call), the interpreter is returned
    too, its ``by_node`` naming the collectives each node ran and its ``resident_bytes``
    this rank's parameter, gradient and optimizer-state bytes."""
    specs = source_placements(plan)
    placed: list[Any] = []
    for name, t in zip(step.param_names, params, strict=True):
        placed.append(place_whole(t, mesh, specs[f"param:{name}"]))
    for name, t in zip(step.buffer_names, buffers, strict=True):
        placed.append(place_whole(t, mesh, specs.get(f"buffer:{name}", [R] * mesh.ndim)))
    for k, t in enumerate(states):  # optimizer state is placed like its parameter
        name = step.param_names[k // max(step.n_state, 1)]
        placed.append(place_whole(t, mesh, specs[f"param:{name}"]))
    for name, t in zip(step.input_names, inputs, strict=True):
        spec = specs.get(f"input:{name}", [R] * mesh.ndim)
        placed.append(place_whole(t, mesh, spec) if isinstance(t, torch.Tensor) else t)
    interp = PlanInterpreter(step.gm, plan, mesh, log)
    n_params = len(step.param_names)
    first_state = n_params + len(step.buffer_names)
    state_blocks = placed[first_state : first_state + len(states)]
    interp.resident_bytes = {
        "parameters": sum(local_nbytes(t) for t in placed[:n_params]),
        "optimizer_state": sum(local_nbytes(t) for t in state_blocks),
    }
    interp.gradient_readers = gradient_readers(step)
    out = interp.run(*placed)
    return (out, interp) if log is not None else out


def planned_collectives(plan: Any) -> dict[str, list[tuple[str, str]]]:
    """Per op, the collectives the plan charges for bringing its operands to the placement
    its strategy reads ((kind, mesh axis), one per collective), from the same resharding
    table the solver used; halo exchanges under the op's own name."""
    p = plan.problem
    out: dict[str, list[tuple[str, str]]] = {}
    repeated = p.repeated_reads()
    for gi, g in enumerate(p.groups):
        st = plan.strategy(gi)
        for pos, i in enumerate(g.members):
            op = p.graph.ops[i]
            for j, rec in enumerate(op.operands or []):
                src = p.graph.index(rec["op"])
                have = plan.strategy(int(p.group_of[src])).out_specs[p.member_pos[src]][rec["out"]]
                if (i, j) in repeated:  # brought to the update's placement once
                    continue
                _, colls = p.reshard(
                    have,
                    st.in_specs[pos][j],
                    rec["map"],
                    rec["shape"],
                    p.itemsize(rec["op"], rec["out"]),
                )
                out.setdefault(op.name, []).extend((k, a) for k, a, _, _ in colls)
        for kind, axis, _, _, cat in st.collectives:
            if cat == "halo":
                out.setdefault(p.graph.ops[g.anchor].name, []).append((kind, axis))
    return out
