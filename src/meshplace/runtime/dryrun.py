"""What DTensor runs for a sharding plan, and what that costs: a dry run of the torchrun
runtime's training step on a fake process group.

Why: a sharding plan fixes the placements of parameters and inputs; the solver also
chooses a strategy for every op in between (it may, say, gather a batch-split input once
and compute replicated rather than all-reduce every gradient), but under torchrun the
model's forward and backward run in PyTorch, and DTensor's own sharding propagation
decides each op's placement from its operands' (PyTorch's ``torch.distributed.tensor``:
per op, the registered strategy whose inputs cost least to redistribute to). Source of
the recording technique: a dispatch mode that defers to tensor subclasses, as PyTorch's
``make_fx`` traces through them. Predicting the runtime's step from the solver's op
strategies predicts another program. This module records the program DTensor actually
runs, then costs it with the same cost model (calibrated op efficiencies, launch and
dispatch overheads, the measured collectives).

How: :func:`record_step` runs :class:`meshplace.runtime.launch.ShardedTraining` — the
runtime's own setup and step — under a ``TorchDispatchMode`` that returns
``NotImplemented`` for DTensor operands (so DTensor handles them and its local kernels
come back through the mode) and records every local kernel (aten name, flops from
:func:`meshplace.graph.flops.flop_count`, bytes read and written) and every functional
collective (kind, bytes, the mesh axes of its process group), plus how many DTensor-level
ops were dispatched. The third step is recorded (the first also creates Adam's state and
DDP's buckets, the second rebuilds DDP's buckets).
:func:`dry_run` does this for rank 0 of a ``world_size``-rank plan in a fresh process
(``python -m meshplace.runtime.dryrun``) joined to PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``: collectives wait for no peer, so one
process stands in for every rank — though not free: a functional all-gather on it took
0.2 ms at 64 KiB and 1.1-1.4 ms at 1-4 MiB here, its buffers' work); rank 0 holds the
largest block of any uneven split.
:meth:`EngineProgram.predict` sums the kernels' roofline times, DTensor's dispatch per
op and the collectives (synchronous on this engine: nothing overlaps).

A hybrid plan of one stage (``meshplace shard --pipeline auto``'s, micro-batches under
torch's pipelining schedule) is recorded the same way through
:func:`meshplace.runtime.hybrid.run_hybrid_plan`'s own step (:func:`record_hybrid_step`);
:func:`engine_pricer` prices those for the hybrid search, each (tp, micro-batch) as the
engine runs it. What runs inside the optimizer's step is marked (``update``), so a
prediction can tell a micro-batch's forward and backward from the once-a-step update.

Complexity: one training step of one rank's share on the host (real tensors: the rank's
share must fit the host's memory), plus O(kernels) to cost it.

Example::

    program = dry_run(plan, "examples/llama.py:build_tiny")
    program.predict(cost_model, mesh.calibrated(cost_model), device_spec)["step_s"]
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshplace.errors import InputError
from meshplace.hostmemory import keep_freed_memory
from meshplace.runtime.processes import one_rank_world

#: the functional collectives DTensor issues, by the kind names the cost model uses
COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    # DTensor's own op for Shard(i) -> Shard(j) on one mesh axis: an all-to-all (which
    # backends without one, like gloo, carry out as an all-gather and a local slice)
    "shard_dim_alltoall": "all_to_all",
}
#: the namespaces those ops live in
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor"})
#: the process group's own collectives (``torch.distributed``'s, which DDP's reducer and
#: FSDP2 call), by the cost model's kind names, and the argument holding the bytes the
#: cost model's formula counts (:class:`EngineCollective`): the rank's input, an
#: all-gather's gathered output
C10D_COLLECTIVES = {
    "allreduce_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
}
#: FSDP2's own kernels (its gather buffers' copies in and out, the reduce-scatter's input):
#: part of the per-unit cost that :func:`meshplace.runtime.data_parallel.
#: measure_fsdp_overhead` measures, so a prediction that charges it does not cost them
FSDP_KERNELS = frozenset({"all_gather_copy_in", "split_with_sizes_copy", "chunk_cat"})
#: namespaces of ops that are bookkeeping, not kernels
_NOT_KERNEL_NAMESPACES = frozenset({"profiler"})
#: ops that only wait on, or wrap, a collective's result: no kernel
_NOT_KERNELS = frozenset(
    {
        "wait_tensor",
        "_wrap_tensor_autograd",
        "detach",
        "lift_fresh",
        # allocations: no kernel touches the memory (DDP's 25 MB bucket and FSDP2's gather
        # buffers, costed as fills' writes, put an 8 MB ``empty`` at seconds under a fill
        # efficiency fitted to launch-bound fills)
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
    }
)


@dataclass
class LocalKernel:
    """One kernel a rank runs: aten name, coarse kind, flops, bytes read and written, the
    dtype of its first output; ``update``: run inside the optimizer's step; ``target``:
    the exact operator (``aten.mm.default``), whose calibrated fit the cost model prefers
    to its kind's."""

    name: str
    kind: str
    flops: float
    bytes: float
    dtype: str
    update: bool = False
    target: str = ""


@dataclass
class EngineCollective:
    """One collective a rank runs: kind (cost-model name), bytes per device as the ring
    formula and the measured collectives count them (:func:`meshplace.cost.collectives.
    collective_time`, :func:`meshplace.profile.link.measure_collectives`) — an
    all-gather's gathered output, every other kind's local input — the mesh axes its
    process group spans; ``update``: run inside the optimizer's step; ``c10d``: the
    process group's own call (DDP's, FSDP2's, a bucketed gradient reduction's or ZeRO
    gather's), not one of DTensor's functional collectives — they are measured apart
    (``CostModel.c10d_collectives``)."""

    kind: str
    nbytes: float
    axes: list[str]
    update: bool = False
    c10d: bool = False


@dataclass
class EngineProgram:
    """The step one rank runs under DTensor (module docstring)."""

    world_size: int
    kernels: list[LocalKernel] = field(default_factory=list)
    collectives: list[EngineCollective] = field(default_factory=list)
    dispatched: int = 0  # DTensor-level ops (each pays DTensor's dispatch)
    fsdp_units: int = 0  # modules FSDP2 gathers as one (each pays FSDP2's own cost)
    dispatched_update: int = 0  # of ``dispatched``, those inside the optimizer's step
    # of ``dispatched`` (and of ``dispatched_update``), those with an operand split or a
    # partial sum over some mesh axis: DTensor's dispatch costs more on them (sharding
    # propagation over more strategies, redistribution planning, Megatron's boundaries)
    dispatched_split: int = 0
    dispatched_update_split: int = 0
    # of ``dispatched`` (and ``dispatched_update``), those split over the batch's mesh
    # dimensions only (data parallelism on DTensor), at a rate of their own
    dispatched_batch_split: int = 0
    dispatched_update_batch_split: int = 0
    # the rank's whole step timed on the fake process group, where collectives return at
    # once: the median of a few steps after the recorded one (0: not timed). Not a
    # prediction — a measurement of the rank's local work alone, which the benchmark
    # sets beside the cost model's to tell its error from the local work's from the rest
    timed_step_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineProgram:
        return cls(
            world_size=int(d["world_size"]),
            kernels=[LocalKernel(**k) for k in d["kernels"]],
            collectives=[EngineCollective(**c) for c in d["collectives"]],
            dispatched=int(d["dispatched"]),
            fsdp_units=int(d.get("fsdp_units", 0)),  # recorded before FSDP2 ran plans: none
            # recorded before phases were: none
            dispatched_update=int(d.get("dispatched_update", 0)),
            # recorded before split operands were told apart: priced as replicated ones
            dispatched_split=int(d.get("dispatched_split", 0)),
            dispatched_update_split=int(d.get("dispatched_update_split", 0)),
            dispatched_batch_split=int(d.get("dispatched_batch_split", 0)),
            dispatched_update_batch_split=int(d.get("dispatched_update_batch_split", 0)),
            # recorded before it was timed: none
            timed_step_s=float(d.get("timed_step_s", 0.0)),
        )

    def collective_counts(self) -> dict[str, int]:
        """How many collectives of each kind the step runs."""
        return dict(Counter(c.kind for c in self.collectives))

    def predict(
        self, cost_model: Any, mesh: Any, spec: Any, device_kind: str | None = None
    ) -> dict[str, float]:
        """Seconds of the step on devices of ``spec`` (a device spec: peak, bandwidth,
        launch overhead) by ``cost_model`` (its efficiencies, launch and dispatch
        overheads for the cluster's ``device_kind``, by default ``spec.kind``),
        collectives by ``mesh`` (a
        :class:`meshplace.mesh.layout.Mesh`, calibrated for measured collectives).
        A DTensor-level op with an operand split or partial over a model-parallel mesh
        dimension pays the cost model's ``split_dispatch_overhead``, one split over the
        batch's dimensions only ``batch_dispatch_overhead``, where they were measured;
        the others ``dispatch_overhead``.
        Kernels cost the roofline, ``max(flops / (peak e_c), bytes / (bandwidth e_m))``
        plus their fixed cost (:meth:`meshplace.cost.compute.CostModel.kernel_seconds`: the
        operator's or kind's calibrated one, else one launch); every DTensor-level op the
        dispatch overhead — except under FSDP2, whose units each cost the measured
        ``fsdp_unit_overhead`` instead, the dispatch on its sharded parameters and, where
        that cost was measured, its own copies (:data:`FSDP_KERNELS`) included; the
        collectives the mesh's formula, the process group's own calls at their own
        measured rates where there are some (``EngineCollective.c10d``). A step with
        collectives also pays the cost model's ``sync_skew`` for the device kind times its
        local work (kernels and dispatch): every collective makes the ranks wait for the
        slowest (:func:`meshplace.profile.link.measure_sync_skew`).
        Returns ``step_s``, ``compute_s``, ``dispatch_s`` (the engine's: DTensor's or
        FSDP2's), ``communication_s`` and ``sync_s`` (the skew's), and ``update_s``: the
        part of ``step_s`` inside the optimizer's step (its kernels, their DTensor
        dispatch, its collectives; the skew is the whole step's).
        O(kernels + collectives)."""
        kind = device_kind or spec.kind
        compute = update = 0.0
        # FSDP2's own copies are in its measured cost per unit, where one was measured;
        # without one they are kernels like any other
        per_unit = cost_model.fsdp_unit_overhead.get(kind, 0.0)
        for k in self.kernels:
            if self.fsdp_units and per_unit and k.name in FSDP_KERNELS:
                continue
            seconds = cost_model.kernel_seconds(
                kind, spec, k.kind, k.flops, k.bytes, k.dtype, k.target
            )
            compute += seconds
            update += seconds if k.update else 0.0
        per_op = cost_model.dispatch_overhead.get(kind, 0.0)
        # ops on split operands at their own measured rates, where they were measured
        per_split_op = cost_model.split_dispatch_overhead.get(kind, per_op)
        per_batch_op = cost_model.batch_dispatch_overhead.get(kind, per_op)
        if self.fsdp_units:  # FSDP2's measured cost per unit holds its DTensor dispatch
            dispatch = self.fsdp_units * per_unit
        else:
            whole = self.dispatched - self.dispatched_split - self.dispatched_batch_split
            dispatch = whole * per_op + self.dispatched_split * per_split_op
            dispatch += self.dispatched_batch_split * per_batch_op
            whole_update = (
                self.dispatched_update
                - self.dispatched_update_split
                - self.dispatched_update_batch_split
            )
            update += whole_update * per_op + self.dispatched_update_split * per_split_op
            update += self.dispatched_update_batch_split * per_batch_op
        communication = 0.0
        for c in self.collectives:
            seconds = mesh.collective_time(c.kind, c.nbytes, c.axes, c10d=c.c10d)
            communication += seconds
            update += seconds if c.update else 0.0
        # ranks that meet wait for the slowest: a measured fraction of the local work
        skew = cost_model.sync_skew.get(kind, 0.0) if self.collectives else 0.0
        return {
            "step_s": (compute + dispatch) * (1.0 + skew) + communication,
            "compute_s": compute,
            "dispatch_s": dispatch,
            "communication_s": communication,
            "sync_s": (compute + dispatch) * skew,
            "update_s": update,
        }


def _tensor_bytes(values: Any) -> float:
    import torch
    from torch.utils._pytree import tree_leaves

    return float(
        sum(
            t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor)
        )
    )


def _first_dtype(out: Any) -> str:
    import torch
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def _shapes(values: Any) -> list[list[int] | None]:
    import torch

    items = values if isinstance(values, list | tuple) else [values]
    return [list(v.shape) if isinstance(v, torch.Tensor) else None for v in items]


def recorder(
    program: EngineProgram,
    axis_of: dict[str, list[str]] | None = None,
    batch_dims: Sequence[int] = (),
    seconds: list[float] | None = None,
) -> Any:
    """The dispatch mode that fills ``program`` (module docstring) while active;
    ``axis_of`` maps a process group's name to the mesh axes it spans (a collective on
    any other group is recorded over every axis). What runs inside an optimizer's
    ``step`` (PyTorch's global optimizer step hooks mark it) is recorded as the update.
    The process group's own collectives (DDP's, FSDP2's, the runtime's flat buckets) are
    marked ``c10d``: the cost model prices them apart from DTensor's functional ones.
    A DTensor-level op counts as split (``dispatched_split``) when an operand is split or
    a partial sum over a mesh dimension other than ``batch_dims`` (those the batch is
    split over), as batch-split (``dispatched_batch_split``) when its operands are split
    or partial over those only: each kind pays a dispatch rate of its own. ``seconds``:
    a list to which each recorded kernel's own time is appended (the kernel's call alone,
    not the mode's bookkeeping around it)."""
    import time

    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from meshplace.graph.capture import is_alias
    from meshplace.graph.flops import flop_count, op_kind

    axis_of = axis_of or {}
    every_axis = sorted({a for axes in axis_of.values() for a in axes})
    updating = [False]

    def set_updating(value: bool) -> Callable[..., None]:
        def hook(*_args: Any) -> None:
            updating[0] = value

        return hook

    class Recorder(TorchDispatchMode):
        def __enter__(self) -> Any:
            self.hooks = [
                register_optimizer_step_pre_hook(set_updating(True)),
                register_optimizer_step_post_hook(set_updating(False)),
            ]
            return super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            for handle in self.hooks:
                handle.remove()
            updating[0] = False
            return super().__exit__(*exc)

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                if not is_alias(func):
                    placed = [
                        (dim, p)
                        for t in tree_leaves((args, kwargs))
                        if isinstance(t, DTensor)
                        for dim, p in enumerate(t.placements)
                        if not p.is_replicate()
                    ]
                    split = any(dim not in batch_dims for dim, _ in placed)
                    batch = bool(placed) and not split
                    program.dispatched += 1
                    program.dispatched_update += updating[0]
                    program.dispatched_split += split
                    program.dispatched_update_split += split and updating[0]
                    program.dispatched_batch_split += batch
                    program.dispatched_update_batch_split += batch and updating[0]
                return NotImplemented  # DTensor runs it; its local kernels come back here
            start = time.perf_counter()
            out = func(*args, **kwargs)
            took = time.perf_counter() - start
            name = func.overloadpacket.__name__
            namespace = getattr(func, "namespace", "")
            if namespace in COLLECTIVE_NAMESPACES and name in COLLECTIVE_KINDS:
                group = kwargs.get("group_name", args[-1] if args else None)
                kind = COLLECTIVE_KINDS[name]
                program.collectives.append(
                    EngineCollective(
                        kind,
                        # the formula's bytes: an all-gather's whole output (the rank's
                        # input was a 1/p block of it; counted as the input, every gather
                        # was priced at 1/p of its bytes)
                        _tensor_bytes(out if kind == "all_gather" else args[0]),
                        axis_of.get(str(group), every_axis),
                        updating[0],
                    )
                )
                return out
            if namespace == "c10d" and name in C10D_COLLECTIVES:
                kind, position = C10D_COLLECTIVES[name]
                # the mesh axes of the call's process group (a bucket reduced over the
                # data axis of a 2-D mesh spans that axis only)
                group = _process_group_name(args)
                program.collectives.append(
                    EngineCollective(
                        kind,
                        _tensor_bytes(args[position]),
                        axis_of.get(str(group), every_axis),
                        updating[0],
                        c10d=True,
                    )
                )
                return out
            if name in _NOT_KERNELS or namespace in _NOT_KERNEL_NAMESPACES or is_alias(func):
                return out
            if name.startswith("_foreach_"):  # one kernel per tensor of the list
                flops = float(sum(t.numel() for t in out)) if isinstance(out, list) else 0.0
                flops = flops or float(sum(s.numel() for s in args[0]))
                program.kernels.append(
                    LocalKernel(
                        name,
                        "elementwise",
                        flops,
                        _tensor_bytes(args) + _tensor_bytes(out),
                        _first_dtype(args[0]),
                        updating[0],
                        str(func),
                    )
                )
                if seconds is not None:
                    seconds.append(took)
                return out
            outs = out if isinstance(out, list | tuple) else [out]
            program.kernels.append(
                LocalKernel(
                    name,
                    op_kind(name),
                    flop_count(
                        name,
                        _shapes(list(args)),
                        [s for s in _shapes(list(outs)) if s is not None],
                        args,
                        kwargs,
                    ),
                    _tensor_bytes((args, kwargs)) + _tensor_bytes(out),
                    _first_dtype(out),
                    updating[0],
                    str(func),
                )
            )
            if seconds is not None:
                seconds.append(took)
            return out

    return Recorder()


def _process_group_name(args: Sequence[Any]) -> str | None:
    """The name of the process group among a c10d op's ``args``, which reach a dispatch
    mode boxed as ``torch.ScriptObject`` (unboxed by c10d's own ``ProcessGroup.unbox``;
    the op's reduce-op argument is a ScriptObject too, and does not unbox); ``None``
    when there is none. O(arguments)."""
    import torch
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, ProcessGroup):
            return a.group_name
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).group_name
            except RuntimeError:  # another boxed argument (the reduce op)
                continue
    return None


def mesh_axes(mesh: Any) -> dict[str, list[str]]:
    """Each process group of the ``DeviceMesh`` ``mesh`` by name, and the mesh axis it
    spans (the recorder's ``axis_of``). O(mesh dimensions)."""
    names = list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)])
    return {mesh.get_group(i).group_name: [names[i]] for i in range(mesh.ndim)}


def recorded_step(training: Any) -> tuple[Any, int, EngineProgram]:
    """One step of ``training`` (a :class:`meshplace.runtime.launch.ShardedTraining`)
    recorded: its loss, gradient bytes and :class:`EngineProgram`, each collective named
    by the mesh axis of its process group."""
    import torch.distributed as dist

    program = EngineProgram(dist.get_world_size(), fsdp_units=training.fsdp_units)
    inputs = (getattr(training, "args", ()), getattr(training, "kwargs", {}))
    with recorder(program, mesh_axes(training.mesh), split_dims(inputs)):
        loss, grad_bytes = training.step()
    return loss, grad_bytes, program


def split_dims(values: Any) -> tuple[int, ...]:
    """The mesh dimensions any DTensor among ``values`` is split over (a plan's inputs:
    the dimensions its batch is split over). O(tensors)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    return tuple(
        sorted(
            {
                dim
                for t in tree_leaves(values)
                if isinstance(t, DTensor)
                for dim, p in enumerate(t.placements)
                if p.is_shard()
            }
        )
    )


def record_step(
    plan: dict[str, Any],
    source: str,
    *,
    device_type: str = "cpu",
    engine: str = "auto",
    timed_steps: int = 0,
) -> EngineProgram:
    """The step this rank runs for ``plan`` (``torch.distributed`` initialised, a real or
    a fake process group) on the engine the runtime chooses
    (:func:`meshplace.runtime.launch.sharding_training`): two untimed steps, then the
    third recorded — the first creates Adam's state and DDP's buckets, the second
    rebuilds the buckets in gradient order and broadcasts that order (once per run, not
    per step) — then, with ``timed_steps``, that many more timed
    (:attr:`EngineProgram.timed_step_s`, their median). O(three training steps, plus
    ``timed_steps``)."""
    import statistics
    import time

    from meshplace.runtime.launch import sharding_training

    training, _note = sharding_training(
        plan, source, lr=1e-3, device_type=device_type, engine=engine
    )
    training.step()
    training.step()
    program = recorded_step(training)[2]
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        training.step()
        times.append(time.perf_counter() - start)
    program.timed_step_s = statistics.median(times) if times else 0.0
    return program


def record_hybrid_step(
    plan: dict[str, Any], source: str, *, device_type: str = "cpu", engine: str = "auto"
) -> EngineProgram:
    """The step this rank runs for the one-stage hybrid ``plan`` (its micro-batches under
    torch's pipelining schedule, then the optimizer) as :func:`meshplace.runtime.hybrid.
    run_hybrid_plan` runs it: one untimed step (it creates Adam's state), the second
    recorded. O(two training steps)."""
    from meshplace.runtime.hybrid import run_hybrid_plan

    mine = run_hybrid_plan(
        plan, source, steps=2, lr=1e-3, device_type=device_type, engine=engine, record_step=1
    )
    return EngineProgram.from_dict(mine["program"])


def refuse_pipelines(plan: dict[str, Any], name: str) -> None:
    """One sentence (:class:`InputError`) when ``plan`` (called ``name``) is a hybrid plan of
    more than one pipeline stage, which the dry run cannot record."""
    from meshplace.runtime.hybrid_plan import is_hybrid

    shape = (plan.get("mesh") or {}).get("shape") or [1]
    stages = int(shape[0]) if is_hybrid(plan) else 1
    if stages != 1:
        raise InputError(
            f"{name} pipelines over {stages} stages: the dry run records plans of one stage "
            "(a fake process group carries no activations between stages)"
        )


def dry_run(
    plan: dict[str, Any] | str | Path,
    source: str | None = None,
    *,
    timeout_s: float = 600.0,
    engine: str = "auto",
    timed_steps: int = 0,
) -> EngineProgram:
    """Rank 0's step of ``plan`` (a plan file's dict or path) as its engine runs it, recorded
    in a fresh process on a fake process group of the plan's world size (module
    docstring), and with ``timed_steps`` that many more timed
    (:attr:`EngineProgram.timed_step_s`; not for a one-stage hybrid plan, whose
    recording is the runtime's own run: 0 there); ``source`` overrides the plan's model. Raises
    :class:`InputError` with the child's last line when the model cannot run under the
    plan."""
    if isinstance(plan, dict):  # refused here, without a process that imports torch
        refuse_pipelines(plan, "the plan")
    (program,) = _dry_run_child(
        [plan], source, timeout_s=timeout_s, engine=engine, timed_steps=timed_steps
    )
    if isinstance(program, str):
        raise InputError(f"the dry run of the plan failed: {program}")
    return program


def dry_runs(
    plans: Sequence[dict[str, Any]],
    source: str | None = None,
    *,
    timeout_s: float = 600.0,
    engine: str = "auto",
    timed_steps: int = 0,
) -> list[EngineProgram | str]:
    """:func:`dry_run` of several plans (of one stage each) in one child process — torch
    and the model's module are imported once, not once a plan (~3 s each here) — each on
    a fake process group of its own world size. Per plan, its :class:`EngineProgram`, or
    the sentence saying why its engine cannot run it. ``timeout_s`` is per plan. Raises
    :class:`InputError` when the child itself fails or runs out of time. O(three training
    steps of one rank's share per plan, plus ``timed_steps``)."""
    for plan in plans:
        refuse_pipelines(plan, "the plan")
    return _dry_run_child(
        list(plans), source, timeout_s=timeout_s, engine=engine, timed_steps=timed_steps
    )


def _dry_run_child(
    plans: list[dict[str, Any] | str | Path],
    source: str | None,
    *,
    timeout_s: float,
    engine: str,
    timed_steps: int = 0,
) -> list[EngineProgram | str]:
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="meshplace-dryrun-") as folder:
        paths = []
        for i, plan in enumerate(plans):
            if isinstance(plan, dict):
                path = Path(folder) / f"plan{i}.json"
                path.write_text(json.dumps(plan))
            else:
                path = Path(plan)
            paths.append(str(path))
        command = [sys.executable, "-m", "meshplace.runtime.dryrun", *paths]
        if source is not None:
            command += ["--model", source]
        command += ["--engine", engine, "--timed-steps", str(timed_steps), "--each"]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        limit = timeout_s * len(paths)
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=limit, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            which = "plan" if len(paths) == 1 else f"{len(paths)} plans"
            seconds = f"{limit:.0f}" if limit >= 10 else f"{limit:.2g}"
            raise InputError(
                f"the dry run of the {which} took longer than {seconds} s and was stopped"
            ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise InputError(f"the dry run failed: {last}")
    return [
        EngineProgram.from_dict(entry["program"]) if "program" in entry else entry["error"]
        for entry in json.loads(done.stdout)
    ]


def _record_plan(path: str, model: str | None, engine: str, timed_steps: int = 0) -> EngineProgram:
    """Rank 0's recorded step of the plan file at ``path`` (``main``'s work for one
    plan): a fake process group of the plan's world size around it."""
    import contextlib

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplace.runtime.hybrid_plan import is_hybrid
    from meshplace.runtime.launch import model_source, read_plan

    plan = read_plan(path)
    if plan.get("format") != "meshplace.parallel_plan":
        raise InputError(
            f"{path} is not a sharding plan (meshplace shard --out): the dry run "
            "records DTensor's step of one"
        )
    hybrid = is_hybrid(plan)
    refuse_pipelines(plan, path)
    source = model_source(plan, model)
    world = math.prod(int(s) for s in plan["mesh"]["shape"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        # whatever the model prints goes to stderr: stdout is the one JSON document
        with contextlib.redirect_stdout(sys.stderr):
            if hybrid:
                return record_hybrid_step(plan, source, engine=engine)
            return record_step(plan, source, engine=engine, timed_steps=timed_steps)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m meshplace.runtime.dryrun PLAN [--model FILE.py:build]``: print rank 0's
    recorded step (:class:`EngineProgram` as JSON). ``PLAN PLAN ... --each``: one JSON
    list, per plan ``{"program": ...}`` or ``{"error": sentence}`` (a plan its engine
    cannot run does not stop the others)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshplace.runtime.dryrun")
    parser.add_argument("plan", nargs="+")
    parser.add_argument("--model", default=None)
    parser.add_argument("--engine", choices=("auto", "dtensor"), default="auto")
    parser.add_argument("--each", action="store_true", help="one result per plan, in a list")
    parser.add_argument(
        "--timed-steps", type=int, default=0, help="steps timed after the recorded one"
    )
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the torchrun ranks whose step this records
    if not args.each:
        if len(args.plan) != 1:
            parser.error("several plans need --each")
        try:
            program = _record_plan(args.plan[0], args.model, args.engine, args.timed_steps)
        except InputError as exc:
            print(f"meshplace: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(program.to_dict()))
        return 0
    results: list[dict[str, Any]] = []
    for path in args.plan:
        try:
            program = _record_plan(path, args.model, args.engine, args.timed_steps)
            results.append({"program": program.to_dict()})
        except Exception as exc:  # one plan's failure is that plan's answer, not the run's
            words = str(exc).strip().splitlines() or [""]
            known = isinstance(exc, InputError)
            results.append({"error": words[-1] if known else f"{type(exc).__name__}: {words[-1]}"})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def engine_prediction(
    plan: dict[str, Any],
    program: EngineProgram,
    *,
    cluster: str | None = None,
    calibration: str | None = None,
) -> dict[str, Any]:
    """``program`` (what DTensor runs for ``plan``) costed on the plan's devices of its
    cluster, or on the first accelerators (else devices) of ``cluster`` (a preset name or
    YAML file) when given, by the cost
    model of ``calibration`` (a calibration file; default the catalogue's figures), as
    :meth:`EngineProgram.predict` does, with the collectives it counted. Raises
    :class:`InputError` when the cluster or the calibration cannot be read or the plan's
    devices are not in the cluster."""
    import numpy as np

    from meshplace.cost.calibration import calibrated_cost_model, load_calibration
    from meshplace.cost.compute import CostModel
    from meshplace.hardware import load_cluster

    name = cluster or str(plan.get("cluster") or "")
    loaded = load_cluster(name)
    mesh_doc = plan["mesh"]
    shape = [int(s) for s in mesh_doc["shape"]]
    n = math.prod(shape)
    if cluster is None:  # the plan's own devices
        devices = np.asarray(mesh_doc.get("devices") or range(n), dtype=np.int64)
    else:  # another cluster: its accelerators, else its devices (CPU workers), in order
        devices = np.asarray(list(loaded.accelerators() or range(len(loaded.devices)))[:n])
    if devices.size != n or int(devices.max()) >= len(loaded.devices):
        raise InputError(
            f"the plan's mesh of {n} devices does not fit {loaded.name}'s "
            f"{len(loaded.devices)} devices"
        )
    if calibration is not None:
        cost_model = calibrated_cost_model(load_calibration(calibration), loaded)
    else:
        cost_model = CostModel()
    return {
        "calibration": calibration,
        **program_cost(program, plan, loaded, cost_model, devices),
    }


def engine_pricer(
    source: str,
    cluster: Any,
    cost_model: Any,
    *,
    global_batch: int,
    engine: str = "auto",
    programs: dict[str, EngineProgram] | None = None,
) -> Callable[..., Any]:
    """The hybrid search's ``engine`` (:data:`meshplace.parallel.hybrid.EnginePricer`) for
    the model of ``source`` (``FILE.py:build``, inputs of ``global_batch`` rows): for a
    (tp, micro-batch)'s parts, the one-stage plan with their placements
    (:func:`meshplace.parallel.cli.one_stage_plan_file`) dry-run (:func:`dry_run`: the
    torchrun runtime's step, its micro-batches under torch's pipelining schedule, on a
    fake process group) and priced on the given devices of ``cluster`` by ``cost_model``
    (:func:`program_cost`): one micro-batch's forward and backward, and the optimizer's
    step. Raises :class:`InputError` when the engine cannot run the plan. ``programs``
    (optional) keeps the recorded programs by plan, for pricers of other cost models to
    reuse. O(one dry run, two training steps of one replica's share, per new plan).

    Example::

        pricer = engine_pricer("model.py:build", cluster, cost_model, global_batch=8)
        hybrid_search("model.py:build", None, cluster, global_batch=8, engine=pricer, ...)
    """
    from meshplace.parallel.cli import one_stage_plan_file
    from meshplace.parallel.hybrid import EngineCost

    recorded = programs if programs is not None else {}

    def price(parts: Any, layers: int, container: str, devices: Any) -> Any:
        plan = one_stage_plan_file(parts, layers, container, global_batch, source)
        key = json.dumps(plan, sort_keys=True)
        if key not in recorded:
            recorded[key] = dry_run(plan, source, engine=engine)
        program = recorded[key]
        cost = program_cost(program, plan, cluster, cost_model, list(devices))
        micro_batches = plan["pipeline"]["micro_batches"]
        return EngineCost((cost["step_s"] - cost["update_s"]) / micro_batches, cost["update_s"])

    return price


def plan_prices(
    plans: Sequence[dict[str, Any]],
    source: str,
    cluster: Any,
    cost_model: Any,
    *,
    engine: str = "auto",
) -> list[dict[str, Any] | str]:
    """Each sharding plan of ``source`` (``FILE.py:build``) priced as its engine runs it:
    the plans dry-run in one child process (:func:`dry_runs`) and each program costed on
    the plan's own devices of ``cluster`` by ``cost_model`` (:func:`program_cost`); per
    plan the cost (``step_s`` and its parts), or the sentence saying why its engine cannot
    run it. ``meshplace shard FILE.py:build --engine-costs`` ranks its candidates by
    these (:func:`meshplace.parallel.cli.cmd_shard` receives this function from the
    command line, the sharding package never importing the runtime). O(one dry run per
    plan).

    Example::

        costs = plan_prices([plan_a, plan_b], "model.py:build", cluster, CostModel())
        fastest = min(c["step_s"] for c in costs if not isinstance(c, str))
    """
    programs = dry_runs(plans, source, engine=engine)
    return [
        program if isinstance(program, str) else program_cost(program, plan, cluster, cost_model)
        for program, plan in zip(programs, plans, strict=True)
    ]


def program_cost(
    program: EngineProgram,
    plan: dict[str, Any],
    cluster: Any,
    cost_model: Any,
    devices: Any = None,
) -> dict[str, Any]:
    """:meth:`EngineProgram.predict` of ``program`` on ``plan``'s mesh laid over
    ``devices`` of ``cluster`` (cluster device indices; default the plan's ``devices``),
    the mesh calibrated by ``cost_model``; with the cluster's name and the program's
    collective, kernel and dispatch counts. O(kernels + collectives)."""
    import numpy as np

    from meshplace.mesh.layout import mesh_over

    mesh_doc = plan["mesh"]
    shape = [int(s) for s in mesh_doc["shape"]]
    if devices is None:
        devices = mesh_doc.get("devices") or range(math.prod(shape))
    devices = np.asarray(devices, dtype=np.int64).reshape(shape)
    mesh = mesh_over(cluster, devices, tuple(mesh_doc["axes"]), "given")
    device = cluster.devices[int(devices.reshape(-1)[0])]
    return {
        "cluster": cluster.name,
        **program.predict(cost_model, mesh.calibrated(cost_model), device.spec, device.kind),
        "collectives": program.collective_counts(),
        "kernels": len(program.kernels),
        "dispatched": program.dispatched,
    }


def measure_dispatch_overhead(source: str, reps: int = 20) -> dict[str, Any]:
    """What running a step under DTensor adds per op, measured in this process: the same
    eager step (forward, backward, foreach Adam; one thread) with plain tensors and with
    every parameter and input a replicated DTensor on a 1-rank mesh (gloo,
    ``sharded_step``), the difference divided by the ops DTensor dispatches in that step
    (counted by :func:`meshplace.runtime.dryrun.recorder`, as the engine prediction
    charges them: a foreach call of Adam is one, views are none). The
    sharded runtime pays this on every op; the roofline's launch overhead, fitted to the
    traced step's aten ops, does not contain it. It depends on the op (a view or an
    attention propagates more placements than a GELU: 9 us per op on a stack of tiny
    linear layers, 25 on the Llama example; Adam's foreach calls cover many update ops
    each), so it is measured on the model's own step, run on the first two rows of its
    inputs, where less arithmetic noise swamps the difference (on the fidelity MLP at
    batch 64 it came out anywhere in 0-108 us per op over runs), the two steps alternating
    and the median of their paired differences taken. Returns the plain and DTensor
    steps' medians (``plain_step_s``, ``dtensor_step_s``), the DTensor-level ops of a step
    (``ops``) and ``per_op_s``. O(reps) training steps of the model on two rows.

    Example: ``measure_dispatch_overhead("examples/llama.py:build_tiny")["per_op_s"]``
    (about 25-30 us on this project's 2-core machine)."""
    import contextlib
    import statistics
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_on_two_rows
    from meshplace.runtime.sharded import HostAttention, sharded_step

    def build() -> tuple[Any, tuple, dict]:
        return build_on_two_rows(source)

    def stepper(model: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

        def one() -> float:
            start = time.perf_counter()
            with context():
                loss, _how = as_loss(model(*args, **kwargs))
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        return one

    with one_rank_world():
        plain_step = stepper(*build(), contextlib.nullcontext)
        mesh = init_device_mesh("cpu", (1,))
        model, args, kwargs = build()
        for name, param in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            placed = distribute_tensor(param.detach(), mesh, [Replicate()])
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(placed))

        def replicate(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return distribute_tensor(x, mesh, [Replicate()])
            return x

        args = tuple(replicate(a) for a in args)
        kwargs = {k: replicate(v) for k, v in kwargs.items()}
        # the run's attention choice, kept from step to step as the runtime keeps it
        attention = HostAttention()
        dtensor_step = stepper(model, args, kwargs, lambda: sharded_step(attention=attention))
        # the two steps alternate and each pair's difference counts: the host's
        # speed drifts within seconds here, and a model whose step is mostly
        # arithmetic (Adam over the fidelity MLP's 2.1 M parameters) put the
        # difference of two separate medians anywhere in 0-190 us per op
        pairs = [(plain_step(), dtensor_step()) for _ in range(reps + 2)][2:]
        plain = statistics.median(p for p, _ in pairs)
        on_dtensor = statistics.median(d for _, d in pairs)
        difference = statistics.median(d - p for p, d in pairs)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        program = EngineProgram(1)
        for recorded in (False, True):  # the second step: Adam's state exists
            with recorder(program) if recorded else contextlib.nullcontext():
                with sharded_step(attention=attention):
                    loss, _how = as_loss(model(*args, **kwargs))
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        ops = program.dispatched
    per_op = max(0.0, difference / ops)
    return {
        "plain_step_s": plain,
        "dtensor_step_s": on_dtensor,
        "ops": ops,
        "per_op_s": per_op,
        **measure_split_dispatch_overhead(source, per_op, reps=reps),
    }


@contextlib.contextmanager
def neighbours_busy(source: str, count: int) -> Iterator[None]:
    """``count`` forked processes, each running the ``FILE.py:build`` model's plain eager
    training step (one thread) over and over, for the ``with`` block: this host's other
    cores as busy as a run's other ranks keep them, so that what is timed inside shares
    the caches and memory bandwidth as a rank does (on this project's 2-core host the
    Llama example's step took 1.05-1.5x as long beside a busy neighbour as alone). Each is
    stopped and reaped on every way out. O(count) forks."""
    import multiprocessing
    import os

    context = multiprocessing.get_context("fork")
    stop = context.Event()
    ready = context.Semaphore(0)
    workers = [
        context.Process(target=_busy_neighbour, args=(source, stop, ready), daemon=True)
        for _ in range(count)
    ]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:  # each built its model and ran its first step
            ready.acquire(timeout=120)
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                os.kill(worker.pid, 9)
                worker.join()


def _busy_neighbour(source: str, stop: Any, ready: Any) -> None:
    """A :func:`neighbours_busy` process: the model's eager step until ``stop``, then out
    without interpreter finalisation (a fork of the caller, whatever it holds). ``ready``
    is released after the first step, or on the way out if there is none (a model that
    fails to build here fails in the caller too)."""
    import os

    try:
        import torch

        from meshplace.graph.capture import as_loss
        from meshplace.graph.sources import build_from_seed

        torch.set_num_threads(1)
        model, args, kwargs = build_from_seed(source)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        first = True
        while not stop.is_set():
            loss, _how = as_loss(model(*args, **kwargs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if first:
                ready.release()
                first = False
    finally:
        ready.release()
        os._exit(0)


def time_eager_kernels(
    source: str, reps: int = 10, neighbours: int | None = None
) -> list[tuple[list[LocalKernel], list[float]]]:
    """The kernels of the ``FILE.py:build`` model's eager training step and each one's
    seconds, measured in this process (one thread): the step as torchrun's data-parallel
    engine runs it — the model in ``DistributedDataParallel`` on a gloo world of one (so
    its gradient buckets' copies are among the kernels), forward, backward, foreach Adam —
    at the model's own inputs and on their first two rows (where those differ: two sizes
    of every kernel). Each kernel is timed on its own by :func:`recorder` in ``reps``
    recorded steps, which alternate with as many steps timed whole; per kernel the median,
    and the median whole step's time the kernels leave over (Python in the modules, the
    autograd engine, DDP's hooks: work per kernel that eager PyTorch does around it) spread
    evenly over them, so that they add up to the step. Timed with ``neighbours`` other
    processes running the same step (:func:`neighbours_busy`; default: one, where the
    host has another core), as a run's other ranks keep the host busy. What
    :func:`meshplace.profile.calibrate.fit_eager_kernels` fits the eager kernel costs to.
    Returns per input size the recorded kernels and their seconds. O(reps) steps per size.

    Example::

        timed = time_eager_kernels("examples/llama.py:build_tiny")
        len(timed[0][0]), sum(timed[0][1])  # ~320 kernels, ~6 ms on this 2-core machine
    """
    import os
    import statistics
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils._pytree import tree_leaves

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed, build_on_two_rows

    if neighbours is None:
        neighbours = 1 if (os.cpu_count() or 1) > 1 else 0
    timed: list[tuple[list[LocalKernel], list[float]]] = []
    sizes: set[tuple] = set()
    with neighbours_busy(source, neighbours), one_rank_world():
        for build in (build_from_seed, build_on_two_rows):
            model, args, kwargs = build(source)
            size = tuple(
                tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            )
            if size in sizes:
                continue
            sizes.add(size)
            wrapped = DistributedDataParallel(model)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

            def step(
                wrapped: Any = wrapped, optimizer: Any = optimizer, inputs: Any = (args, kwargs)
            ) -> None:
                loss, _how = as_loss(wrapped(*inputs[0], **inputs[1]))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            for _ in range(3):  # Adam's state, DDP's buckets rebuilt after the first step
                step()
            whole: list[float] = []
            runs: list[list[float]] = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                whole.append(time.perf_counter() - start)
                program, seconds = EngineProgram(1), []
                with recorder(program, seconds=seconds):
                    step()
                runs.append(seconds)
            if len({len(r) for r in runs}) != 1:
                raise RuntimeError(
                    f"{source}: the eager step ran different kernels from step to step"
                )
            per_kernel = [statistics.median(column) for column in zip(*runs, strict=True)]
            left = statistics.median(whole) - sum(per_kernel)
            if left >= 0:
                per_kernel = [t + left / len(per_kernel) for t in per_kernel]
            else:  # the host sped up between the two kinds of step: scale them down
                scale = statistics.median(whole) / sum(per_kernel)
                per_kernel = [t * scale for t in per_kernel]
            timed.append((program.kernels, per_kernel))
    return timed


def megatron_plan_file(graph: Any, model: Any) -> dict[str, Any] | None:
    """The plan file of ``model`` (captured as ``graph``) under Megatron's tensor-parallel
    layout on 2 ranks (:func:`meshplace.parallel.grid.megatron_layers`; a dimension 2 does
    not divide stays whole), inputs replicated; ``None`` when it splits nothing (a model
    without matrix layers). O(ops x layers)."""
    from meshplace.parallel.grid import megatron_layers

    layers = megatron_layers(graph)
    parameters: dict[str, str] = {}
    for name, param in model.named_parameters():
        dim = layers.get(f"param:{name}", -1)
        split = dim >= 0 and param.dim() > dim and param.shape[dim] % 2 == 0
        parameters[name] = f"Shard({dim})" if split else "Replicate()"
    if all(p == "Replicate()" for p in parameters.values()):
        return None
    return _two_rank_plan(graph, "tensor", parameters, "Replicate()")


def data_parallel_plan_file(graph: Any, model: Any) -> dict[str, Any]:
    """The plan file of data parallelism on DTensor over 2 ranks for ``model`` (captured
    as ``graph``): every parameter whole, every input split along its first dimension.
    O(parameters + ops)."""
    parameters = {name: "Replicate()" for name, _ in model.named_parameters()}
    return _two_rank_plan(graph, "data", parameters, "Shard(0)")


def _two_rank_plan(
    graph: Any, axis: str, parameters: dict[str, str], input_placement: str
) -> dict[str, Any]:
    """A plan file on a 2-rank mesh ``axis``: each parameter's placement (ZeRO 0), every
    input of ``graph`` placed ``input_placement``."""
    inputs = [op.name.removeprefix("input:") for op in graph.ops if op.kind == "input"]
    return {
        "format": "meshplace.parallel_plan",
        "version": 1,
        "mesh": {"shape": [2], "axes": [axis]},
        "parameters": {n: {"placements": [p], "zero": 0} for n, p in parameters.items()},
        "inputs": {name: {"placements": [input_placement]} for name in inputs},
    }


def measure_split_dispatch_overhead(source: str, per_op_s: float, reps: int = 20) -> dict[str, Any]:
    """What DTensor's dispatch costs an op with a split or partial operand, measured in
    this process on ``source``'s own forward and backward (two rows of its inputs, one
    thread) as the runtime runs it (:class:`meshplace.runtime.launch.ShardedTraining`: its
    boundaries and vocabulary-parallel lookup included) on rank 0 of a fake 2-rank process
    group, whose collectives wait for no peer, paired with the plain model's: the median
    of the paired differences, less the replicated ops at ``per_op_s`` and the pass's
    collectives at what a functional collective costs the host on that group (0.16-0.3
    ms each here, the Python and dispatch of issuing it, which the collectives measured
    between real ranks hold already: counted in both, each tensor-parallel collective
    was charged twice until session 59), divided by the split
    ops (counted by :func:`recorder`). Two layouts, two rates: Megatron's
    (:func:`megatron_plan_file`; ops split over a model-parallel axis,
    ``per_split_op_s``) and data parallelism's (:func:`data_parallel_plan_file`: every
    input split along its rows, parameters whole; ops split over the batch's axis only,
    ``per_batch_split_op_s``). The optimizer is left out: on two rows its update of half
    the weights against the plain model's whole would take most of the difference.
    Returns the two rates (each 0, with ``split_note`` or ``batch_note`` saying why, when
    it was not measured: no matrix layer to split, or the layout does not run), the ops
    counted (``split_ops``, ``split_replicated_ops``, ``batch_split_ops``), the Megatron
    passes' medians, their collectives (``split_collectives``) and the fake group's cost
    per collective (``fake_collective_s``). O(reps) forward and backward passes on two rows, twice.

    On the Llama example this machine measured 173-200 us per op split over the tensor
    axis where a replicated one costs 71-77: DTensor's Megatron-layout forward and
    backward of that model take about 6x the plain ones.

    Example: ``measure_split_dispatch_overhead("examples/llama.py:build_tiny",
    7e-5)["per_split_op_s"]``."""
    import statistics

    from meshplace.graph.sources import build_on_two_rows, graph_for

    graph, model = graph_for(source), build_on_two_rows(source)[0]

    def rate(passes: tuple[list[tuple[float, float]], EngineProgram, float], counted: int) -> float:
        """Seconds per ``counted`` op: the passes' median paired difference, less the
        ops neither split nor batch-split at ``per_op_s`` and the pass's collectives at
        what the fake group's functional collective costs the host (which the measured
        collectives hold: :func:`meshplace.profile.link.measure_collectives`)."""
        pairs, program, per_collective = passes
        difference = statistics.median(d - p for p, d in pairs)
        difference -= functional_collectives(program) * per_collective
        split, batch = program.dispatched_split, program.dispatched_batch_split
        whole = program.dispatched - split - batch
        return max(0.0, (difference - whole * per_op_s) / counted)

    out: dict[str, Any] = {"per_split_op_s": 0.0, "split_ops": 0, "split_replicated_ops": 0}
    plan = megatron_plan_file(graph, model)
    if plan is None:
        out["split_note"] = "Megatron's layout splits none of its parameters"
    else:
        passes = _paired_dtensor_passes(plan, source, reps, batch_dims=())
        if isinstance(passes, str):
            out["split_note"] = f"Megatron's layout does not run ({passes})"
        elif not passes[1].dispatched_split:
            out["split_note"] = "no op of its step had a split operand"
        else:
            pairs, program, per_collective = passes
            out.update(
                per_split_op_s=rate(passes, program.dispatched_split),
                split_ops=program.dispatched_split,
                split_replicated_ops=program.dispatched - program.dispatched_split,
                split_plain_pass_s=statistics.median(p for p, _ in pairs),
                split_pass_s=statistics.median(d for _, d in pairs),
                split_collectives=functional_collectives(program),
                fake_collective_s=per_collective,
            )
    out.update(per_batch_split_op_s=0.0, batch_split_ops=0)
    batch_plan = data_parallel_plan_file(graph, model)
    batch_passes = _paired_dtensor_passes(batch_plan, source, reps, batch_dims=(0,))
    if isinstance(batch_passes, str):
        out["batch_note"] = f"data parallelism on DTensor does not run ({batch_passes})"
    elif not batch_passes[1].dispatched_batch_split:
        out["batch_note"] = "no op of its step had a batch-split operand"
    else:
        batch = batch_passes[1].dispatched_batch_split
        out.update(per_batch_split_op_s=rate(batch_passes, batch), batch_split_ops=batch)
    return out


def _paired_dtensor_passes(
    plan: dict[str, Any], source: str, reps: int, batch_dims: Sequence[int]
) -> tuple[list[tuple[float, float]], EngineProgram, float] | str:
    """``reps`` pairs of (plain, DTensor) forward-and-backward seconds of ``source`` on two
    rows, the DTensor one under ``plan`` on rank 0 of a fake process group of the plan's
    size, alternating (the host's speed drifts within seconds), one DTensor pass
    recorded, and what a functional collective costs the host on that group
    (:func:`fake_collective_seconds`); or, when the plan does not run, the reason (any
    failure: an optional measurement). One thread, the group destroyed and the thread
    count restored on every way out. O(reps) passes."""
    import time

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_on_two_rows
    from meshplace.runtime.launch import ShardedTraining
    from meshplace.runtime.sharded import sharded_step

    plain_model, plain_args, plain_kwargs = build_on_two_rows(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    world = math.prod(int(n) for n in plan["mesh"]["shape"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        training = ShardedTraining(
            plan, source, lr=1e-3, device_type="cpu", built=build_on_two_rows(source)
        )

        def dtensor_pass() -> float:
            start = time.perf_counter()
            with sharded_step("cpu", training.attention):
                loss, _how = as_loss(
                    training.zero.forward(training.model, training.args, training.kwargs)
                )
                loss.backward()
            elapsed = time.perf_counter() - start
            training.model.zero_grad(set_to_none=True)
            return elapsed

        def plain_pass() -> float:
            start = time.perf_counter()
            loss, _how = as_loss(plain_model(*plain_args, **plain_kwargs))
            loss.backward()
            elapsed = time.perf_counter() - start
            plain_model.zero_grad(set_to_none=True)
            return elapsed

        pairs = [(plain_pass(), dtensor_pass()) for _ in range(reps + 2)][2:]
        program = EngineProgram(world)
        with recorder(program, mesh_axes(training.mesh), batch_dims):
            dtensor_pass()
        functional = functional_collectives(program)
        per_collective = fake_collective_seconds(training.mesh) if functional else 0.0
    except Exception as exc:  # an optional measurement: any failure is its note
        words = str(exc).strip().splitlines() or [""]
        return f"{type(exc).__name__}: {words[-1]}"
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return pairs, program, per_collective


def functional_collectives(program: EngineProgram) -> int:
    """How many of ``program``'s collectives are functional ones (DTensor's), which
    :func:`fake_collective_seconds` prices on the fake group; the process group's own
    calls cost far less there (9-29 us). O(collectives)."""
    return sum(not c.c10d for c in program.collectives)


def fake_collective_seconds(mesh: Any, reps: int = 30) -> float:
    """What issuing a functional collective costs the host on ``mesh``'s first dimension
    of a fake process group, which moves no data and waits for no peer: the median over
    ``reps`` calls each of a 4 KiB all-reduce, all-gather and reduce-scatter, issued and
    waited for as DTensor does (``torch.distributed._functional_collectives``). On this
    host 0.16-0.3 ms, nearly independent of the bytes: the Python and dispatch around
    the call, which a collective between real ranks pays as well. O(reps) calls."""
    import statistics
    import time

    import torch
    import torch.distributed._functional_collectives as funcol

    x = torch.ones(1024 * mesh.size(0))
    calls = (
        lambda: funcol.all_reduce(x, "sum", (mesh, 0)),
        lambda: funcol.all_gather_single(x, 0, (mesh, 0)),
        lambda: funcol.reduce_scatter_single(x, "sum", 0, (mesh, 0)),
    )
    times = []
    for call in calls:
        for _ in range(reps + 2):  # two warm-up calls of each
            start = time.perf_counter()
            funcol.wait_tensor(call())
            times.append(time.perf_counter() - start)
        del times[-reps - 2 : -reps]
    return statistics.median(times)
