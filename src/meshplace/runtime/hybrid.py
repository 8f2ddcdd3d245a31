"""Run a hybrid plan (``meshplace shard --pipeline auto --out``) under torchrun: pipeline
stages with data and tensor parallelism inside each stage.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC 2021; pipeline x tensor x data parallelism), as torchtitan composes
PyTorch's own pieces: a ``DeviceMesh`` of axes ``(pipe, data, tensor)``, DTensor parameters
on each stage's ``(data, tensor)`` sub-mesh, ``torch.distributed.pipelining`` stages and
schedules (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` with several virtual stages per rank), activation
checkpointing (``torch.utils.checkpoint``, Chen et al. 2016) per layer where the plan
recomputes.

A hybrid plan file is a ``meshplace.parallel_plan`` with ``stages`` (each a range of the
layer stack ``graph.layer_container``, its recomputation and its devices), a
``stage_mesh`` (``[dp, tp]``), per-parameter placements over that sub-mesh with the ZeRO
stage, and ``pipeline`` (global batch, micro-batch per replica, micro-batches, schedule).
Rank ``r`` of ``pp * dp * tp`` is stage ``r // (dp * tp)``, the plan's ``devices`` order.

Every rank builds the ``FILE.py:build`` model from seed 0 (its inputs' batch must be the
plan's global batch), the pipelining front end (``pipeline``, one ``torch.export`` trace
at one global micro-batch: ``dp x micro_batch`` sequences) cuts it at the first layer of
every later stage, and the rank keeps only its stage. The stage's parameters become
DTensors with the plan's placements over the stage mesh
(:func:`meshplace.runtime.sharded.apply_sharding_plan`'s rules, ZeRO through
:class:`meshplace.runtime.launch.WeightUpdateSharding`); a stage on one device (no data or
tensor parallelism) keeps plain tensors (:class:`PlainStageUpdate`), as DTensor's dispatch
would only cost time there. The first stage reads its rows of
each micro-batch as a DTensor split over ``data`` (:class:`StageOnMesh`); activations
cross stages as DTensors (the pipelining stage sends each rank's local block to the rank
of the same ``(data, tensor)`` coordinate in the next stage, torch 2.13's DTensor
metadata support). A plan of one stage (no pipeline; data and tensor parallelism with
micro-batches) runs the model itself, eager, without a schedule: its micro-batches are
plain gradient accumulation (:func:`accumulate_micro_batches`), as a user would write it;
the export-traced stage under torch's single-stage ``Schedule1F1B`` cost a data-parallel
Llama step of 4 micro-batches 15-35 % more (docs/runtime.md, "Session 40"). Stages of
plain tensors run outside :func:`meshplace.runtime.sharded.sharded_step` (DTensor's
context, which they do not need). The schedule scales gradients by
``1 / micro-batches``; after it, each
gradient takes its parameter's placement (the data-parallel all-reduce or
reduce-scatter), and Adam updates the rank's blocks. So a step is one full-batch step of
the model, up to the order in which partial sums are added.

Complexity per step: the stage's kernels on ``1 / (dp * tp)`` of its work, plus per
micro-batch ``2 (pp - 1)`` activation messages per rank, plus the collectives DTensor
inserts for tensor parallelism, plus one gradient reduction over ``data`` per parameter.

Example (4 ranks: 2 stages x 2 replicas)::

    meshplace shard model.py:build --cluster dgx-h100 --chips 4 --pipeline auto \\
        --global-batch 8 --out hybrid.json
    torchrun --standalone --nproc-per-node 4 -m meshplace.runtime --plan hybrid.json
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError
from meshplace.runtime.hybrid_plan import (
    HYBRID_RUNTIME_SCHEDULES,
    held_bytes,
    stage_splits,
)


def check_global_batch(inputs: Sequence[Any], global_batch: int, source: str) -> None:
    """One sentence unless every tensor input's first dimension is the plan's global batch
    (the runtime splits the model's own inputs into the plan's micro-batches and
    replicas).

    >>> check_global_batch((torch.zeros(8, 3), 5), 8, "m.py:build")
    >>> check_global_batch((torch.zeros(4, 3),), 8, "m.py:build")
    Traceback (most recent call last):
    meshplace.errors.InputError: m.py:build's inputs ((4, 3)) must all have the plan's global batch 8 as their first dimension (meshplace shard --global-batch)
    """  # noqa: E501
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    if not tensors or any(t.dim() == 0 or t.shape[0] != global_batch for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise InputError(
            f"{source}'s inputs ({shapes}) must all have the plan's global batch "
            f"{global_batch} as their first dimension (meshplace shard --global-batch)"
        )


def replica_rows(value: torch.Tensor, micro_batches: int, replicas: int, replica: int) -> Any:
    """The rows of a global batch that data-parallel ``replica`` of ``replicas`` reads: its
    ``1 / replicas`` of every one of the ``micro_batches`` consecutive micro-batches, in
    order, so that the schedule's chunks of them are its block of each micro-batch.

    >>> replica_rows(torch.arange(8), 2, 2, 1)
    tensor([2, 3, 6, 7])
    """
    if value.dim() == 0 or value.shape[0] % (micro_batches * replicas):
        raise InputError(
            f"an input of shape {tuple(value.shape)} does not split into {micro_batches} "
            f"micro-batches of {replicas} replicas along its first dimension"
        )
    m = value.shape[0] // (micro_batches * replicas)
    blocks = value.reshape(micro_batches, replicas, m, *value.shape[1:])[:, replica]
    return blocks.reshape(micro_batches * m, *value.shape[1:]).contiguous()


@dataclass(frozen=True)
class StageRoute:
    """Which values a pipeline stage reads, makes and passes on, each named by its
    producer: ``("input", name)`` for a model input, ``(k, i)`` for output ``i`` of stage
    ``k`` (``i`` None: the stage's one output).

    Attributes:
        reads: the stage module's arguments, in order.
        makes: its outputs, in order.
        sends: what the stage hands the next one: every value made so far that a later
            stage reads, in a fixed order (the last stage: nothing, it returns the loss).
        receives: what the stage before sends (the first stage: the model's inputs, in
            the order the schedule passes them: positional, then keywords).
    """

    reads: tuple[tuple[Any, Any], ...]
    makes: tuple[tuple[Any, Any], ...]
    sends: tuple[tuple[Any, Any], ...]
    receives: tuple[tuple[Any, Any], ...]


def stage_routes(split_graph: torch.fx.Graph) -> list[StageRoute]:
    """The :class:`StageRoute` of every stage of a pipelining front end's split graph
    (``pipe.split_gm.graph``: one ``call_module`` per stage, in order).

    The front end lets a stage read a value any earlier stage made (a rotary table, the
    labels, read by every later stage); a stage built by hand (``PipelineStage``, the one
    that takes DTensors) receives from the stage before it only. So every value a later
    stage reads is passed on by each stage in between (:class:`StageOnMesh`), and its
    gradient comes back the same way. O(nodes x stages).
    """
    calls = [n for n in split_graph.nodes if n.op == "call_module"]
    index = {n: k for k, n in enumerate(calls)}

    def producer(node: Any) -> tuple[Any, Any]:
        if node.op == "placeholder":
            return ("input", node.name)
        if node.op == "call_function" and node.target is operator.getitem:
            return (index[node.args[0]], int(node.args[1]))
        if node in index:
            return (index[node], None)
        raise InputError(f"the pipeline's split graph passes {node.name!r} between stages")

    reads = [tuple(producer(a) for a in call.args) for call in calls]
    makes = []
    for k, call in enumerate(calls):
        items = sorted(
            int(u.args[1])
            for u in call.users
            if u.op == "call_function" and u.target is operator.getitem
        )
        makes.append(tuple((k, i) for i in items) if items else ((k, None),))
    inputs = tuple(("input", n.name) for n in split_graph.nodes if n.op == "placeholder")
    routes = []
    receives: tuple[tuple[Any, Any], ...] = inputs
    for k in range(len(calls)):
        later = {v for r in reads[k + 1 :] for v in r}
        known = {*inputs, *(v for m in makes[: k + 1] for v in m)}
        sends = tuple(sorted(known & later, key=str))
        missing = [v for v in reads[k] if v not in receives and v not in makes[k]]
        if missing:
            raise InputError(f"stage {k} of the pipeline reads {missing[0]} before it exists")
        routes.append(StageRoute(reads[k], makes[k], sends, receives))
        receives = sends
    return routes


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient.contiguous()


def contiguous_gradient(value: Any) -> Any:
    """``value`` unchanged, its gradient made contiguous on the way back (a tensor that
    requires one; anything else as it is). Why: a stage sends the gradients of what it
    received back to the stage before, and neither gloo nor NCCL sends a non-contiguous
    tensor; a stage whose first op transposes its input gets that gradient transposed,
    and autograd's layout contract (a leaf's gradient takes the leaf's strides) does not
    reach a DTensor's local tensor, so a hybrid stage died at its first backward send.
    """
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return _ContiguousGradient.apply(value)
    return value


class StageOnMesh(torch.nn.Module):
    """A pipeline stage's module run on its ``(data, tensor)`` mesh, along its
    :class:`StageRoute`. The first stage's inputs (this rank's rows of a micro-batch)
    become DTensors split over ``data`` and replicated over ``tensor``; a later stage
    receives what the stage before sent (DTensors as DTensors, a tensor computed from
    buffers alone as a plain tensor), calls its module on the values it reads, and sends
    on what later stages read. ``distribute=False`` (a stage DDP runs): the inputs stay
    this rank's plain tensors. The module runs with the ZeRO-3 shards gathered
    (``weight_update.forward``); call it, as the schedule's backward, under
    :func:`meshplace.runtime.sharded.sharded_step`."""

    def __init__(
        self,
        stage: torch.nn.Module,
        mesh: Any,
        weight_update: Any,
        route: StageRoute,
        first: bool,
        last: bool,
        distribute: bool = True,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.mesh = mesh
        self.weight_update = weight_update
        self.route = route
        self.first = first
        self.last = last
        self.distribute = distribute  # False: a DDP stage, plain tensors throughout

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        # a multi-stage schedule hands the model's keyword inputs to each of a rank's
        # stages; only the first takes them (later ones get theirs along the route)
        given = [*args, *kwargs.values()] if self.first else list(args)
        if not self.first:  # what it received goes back as a gradient: contiguous too
            given = [contiguous_gradient(a) for a in given]
        values = dict(zip(self.route.receives, given, strict=True))
        if self.distribute and self.first and self.mesh.size() > 1:  # this rank's rows
            # (no data parallelism: replicated; export may have specialised a batch of
            # one, and DTensor will not reshape a dimension it thinks is split)
            split = [Shard(0) if self.mesh.size(0) > 1 else Replicate(), Replicate()]
            for name, a in values.items():
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                    values[name] = DTensor.from_local(a, self.mesh, split, run_check=False)
        # under the caller's sharded_step (run_hybrid_plan): DTensor's implicit
        # replication is one flag, which a nested context would clear on its way out
        out = self.weight_update.forward(self.stage, tuple(values[v] for v in self.route.reads), {})
        if self.last:
            return out
        made = out if isinstance(out, tuple) else (out,)
        values.update(zip(self.route.makes, made, strict=True))
        # neither gloo nor NCCL sends or receives a non-contiguous tensor, and the next
        # stage allocates its receive buffers with the strides of what this one returns
        # (a layer stack whose layer ends in a transposed view died at its first message):
        # a copy where a value is a view, nothing where it is contiguous already
        return tuple(
            values[v].contiguous() if isinstance(values[v], torch.Tensor) else values[v]
            for v in self.route.sends
        )


class WholeModelStage(torch.nn.Module):
    """The whole model as the one stage of a plan without a pipeline, called as a
    pipelining stage is (:class:`StageOnMesh`): every input positionally, the model's
    positional inputs first, then its keyword inputs in order; returns the loss as a
    1-element tensor, as :class:`meshplace.runtime.pipelined.InputsEnterFirst` does. The
    model runs eagerly, its parameters named ``model.NAME`` as a stage's are."""

    def __init__(self, model: torch.nn.Module, positional: int, keywords: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.positional = positional
        self.keywords = tuple(keywords)

    def route(self) -> StageRoute:
        """The stage's :class:`StageRoute`: it reads every input and makes the loss."""
        names = tuple(("input", i) for i in range(self.positional)) + tuple(
            ("input", k) for k in self.keywords
        )
        return StageRoute(reads=names, makes=((0, None),), sends=(), receives=names)

    def forward(self, *values: Any) -> torch.Tensor:
        from meshplace.graph.capture import as_loss

        args = values[: self.positional]
        kwargs = dict(zip(self.keywords, values[self.positional :], strict=True))
        loss, _how = as_loss(self.model(*args, **kwargs))
        return loss.reshape(1)


def zero_filled_stage_class() -> type:
    """``PipelineStage`` whose metadata inference runs on zeros.

    In torch 2.13 a stage that is not the first infers its outputs' metadata on the first
    step by running its forward on tensors made from the received metadata, which are
    uninitialised memory: an integer input such as a language model's labels then holds
    indices far out of range and the loss's forward fails. Zeros are valid everywhere
    (the runtime's convention for inputs it makes up: zero integers). Only the tensors
    the stage makes from metadata are filled; real inputs pass unchanged. (Overrides the
    private ``_to_tensor``: torch is pinned to 2.13.0, whose stage this was written for.)
    """
    from torch.distributed.pipelining import PipelineStage

    class ZeroFilledStage(PipelineStage):
        def _to_tensor(self, arg: Any) -> torch.Tensor:
            made = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):  # made from metadata: uninitialised
                local = made.to_local() if hasattr(made, "to_local") else made
                with torch.no_grad():
                    local.zero_()
            return made

    return ZeroFilledStage


def rewrite_stage_graphs(module: torch.nn.Module, rewrite: Callable[[torch.fx.Graph], int]) -> int:
    """Apply ``rewrite`` (a graph -> how many changes it made) to every fx graph of a
    pipelining stage's module and regenerate the code of each graph it changed. The
    total number of changes. O(nodes) plus the rewrites."""
    changes = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = rewrite(graph)
        changes += changed
        if changed and isinstance(sub, torch.fx.GraphModule):
            sub.recompile()
        elif changed and getattr(sub, "graph_module", None) is not None:
            sub.graph_module.recompile()  # an InterpreterModule's generated code
    return changes


def drop_export_assertions(module: torch.nn.Module) -> int:
    """Erase the metadata assertions ``torch.export`` leaves in a pipelining stage's graphs
    (``aten._assert_tensor_metadata``, from a ``.to(dtype)``): they compute nothing (no
    users) and DTensor has no sharding rule for them. How many were erased. O(nodes)."""
    assertions = {torch.ops.aten._assert_tensor_metadata.default}

    def erase(graph: torch.fx.Graph) -> int:
        dead = [
            n
            for n in graph.nodes
            if n.op == "call_function" and n.target in assertions and not n.users
        ]
        for node in dead:
            graph.erase_node(node)
        return len(dead)

    return rewrite_stage_graphs(module, erase)


def contiguous_before_merging_transposes(module: torch.nn.Module) -> int:
    """Copy a transposed value contiguous before a ``reshape`` reads it, in a pipelining
    stage's graphs. Under DTensor a transposed attention output split over heads can
    claim a contiguous layout while its local block is laid out transposed (measured:
    global ``[4, 16, 4, 16]`` strides ``(1024, 64, 16, 1)``, local ``[4, 16, 2, 16]``
    strides ``(512, 16, 256, 1)``), so the reshape that merges the heads takes the view
    path and fails ("view size is not compatible"). The copy is what the reshape of a
    transposed tensor costs in one process anyway. How many copies were inserted.
    O(nodes)."""
    transposes = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default}
    reshapes = {torch.ops.aten.reshape.default, torch.ops.aten.view.default}

    def copy_first(graph: torch.fx.Graph) -> int:
        inserted = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in reshapes or not node.args:
                continue
            source = node.args[0]
            if not (
                isinstance(source, torch.fx.Node)
                and source.op == "call_function"
                and source.target in transposes
            ):
                continue
            with graph.inserting_before(node):
                copy = graph.call_function(
                    torch.ops.aten.clone.default,
                    (source,),
                    {"memory_format": torch.contiguous_format},
                )
            node.replace_input_with(source, copy)
            inserted += 1
        return inserted

    return rewrite_stage_graphs(module, copy_first)


def complete_vocabulary_lookups(module: torch.nn.Module) -> int:
    """Sum every embedding lookup's output over the mesh axes it is a partial sum on, once,
    right after the lookup, in a pipelining stage's graphs
    (:func:`meshplace.runtime.sharded.completed_lookup`; a plain tensor passes through).
    Why: a stage runs ``torch.export``'s graph, whose ``aten.embedding`` node is no
    ``nn.Embedding`` for :func:`meshplace.runtime.sharded.apply_sharding_plan` to give its
    boundary, and DTensor marks a vocabulary-split table's lookup with a masked partial
    placement that the first reduction consumes: a second reader of the output (a Llama's
    norm reads it for its variance and again for its scaling) failed inside DTensor
    (``_MaskPartial._reduce_value``). How many lookups were completed. O(nodes)."""
    from meshplace.runtime.sharded import completed_lookup

    lookups = {torch.ops.aten.embedding.default}

    def complete(graph: torch.fx.Graph) -> int:
        done = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in lookups:
                continue
            readers = list(node.users)
            with graph.inserting_after(node):
                summed = graph.call_function(completed_lookup, (node,))
            summed.meta = dict(node.meta)
            for reader in readers:
                reader.replace_input_with(node, summed)
            done += 1
        return done

    return rewrite_stage_graphs(module, complete)


def recompute_layers(stage: torch.nn.Module, container: str, layers: Sequence[int]) -> int:
    """Checkpoint every layer ``container.k`` of ``stage`` (a pipelining stage module, the
    model under ``model.``): its forward runs under ``torch.utils.checkpoint`` (non-
    reentrant), keeping only its inputs for the backward, which runs it again. The layers'
    parameter names do not change. How many layers were found."""
    from torch.utils.checkpoint import checkpoint

    done = 0
    for k in layers:
        try:
            layer = stage.get_submodule(f"model.{container}.{k}")
        except AttributeError:
            continue
        forward = layer.forward

        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = recomputed  # type: ignore[method-assign]
        done += 1
    return done


class HybridRankSteps:
    """One rank's timed steps of a hybrid plan, as :func:`run_hybrid_plan` runs them: the
    rank's stages cut from the model (torch's pipelining, or the whole model for one stage
    of accumulated micro-batches), placed on the stage's data x tensor mesh or run on DDP
    (:func:`ddp_stages`), their schedule, optimizer and inputs, the rank's activity
    published for the launcher; each :meth:`step` after a barrier, its wall-clock and CPU
    time measured around the schedule and the optimizer's step. A benchmark that sets the
    runtime beside a hand-written pipeline or data parallelism step by step calls the
    same :meth:`step` (``benchmarks/sharded_overhead.py --interleaved``).
    ``torch.distributed`` must be initialised with ``pp * dp * tp`` ranks; ``engine``
    as :func:`run_hybrid_plan`'s."""

    def __init__(
        self,
        plan: dict[str, Any],
        source: str,
        *,
        lr: float,
        device_type: str,
        engine: str = "auto",
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import SplitPoint, pipeline
        from torch.distributed.pipelining import schedules as torch_schedules

        from meshplace.graph.sources import build_from_seed
        from meshplace.runtime.data_parallel import forward_changes_buffers
        from meshplace.runtime.dryrun import EngineProgram
        from meshplace.runtime.pipelined import (
            InputsEnterFirst,
            run_stage_compiled,
            watch_stage,
        )
        from meshplace.runtime.sharded import HostAttention, rank_device

        pp, dp, tp = (int(x) for x in plan["mesh"]["shape"])
        pipeline_spec = plan["pipeline"]
        micro_batches = int(pipeline_spec["micro_batches"])
        global_batch = int(pipeline_spec["global_batch"])
        splits = stage_splits(plan)
        virtual = (len(splits) + 1) // pp  # stages per rank (interleaved: more than one)
        rank = dist.get_rank()
        mesh = init_device_mesh(
            device_type, (pp, dp, tp), mesh_dim_names=("pipe", "data", "tensor")
        )
        stage_mesh = mesh["data", "tensor"]
        pipe_index, data_index, _ = (int(c) for c in mesh.get_coordinate())
        device = rank_device(device_type)

        model, args, kwargs = build_from_seed(source)  # the same on every rank
        check_global_batch((*args, *kwargs.values()), global_batch, source)
        # checked on every rank, before any stage's rank could go on without the others
        names = {n for n, _ in model.named_parameters()}
        missing = sorted(names - set(plan["parameters"]))
        extra = sorted(set(plan["parameters"]) - names)
        if missing or extra:
            which = (
                f"the model's {missing[0]!r} is not in it"
                if missing
                else (f"{extra[0]!r} is not a parameter of the model")
            )
            raise InputError(f"the plan does not match the model: {which}")
        if any(p.is_meta for p in model.parameters()):
            raise InputError(
                f"{source} builds its model on the meta device; a hybrid plan's stages are cut "
                "from a model built for real"
            )
        rows = global_batch // micro_batches  # one micro-batch of every replica together
        ddp, engine_note = ddp_stages(plan, model, args, kwargs, rows, engine)
        # DDP keeps the buffers the forward changes in step with rank 0's, not constant ones
        sync_buffers = ddp is not None and forward_changes_buffers(model, args, kwargs, rows)
        schedule_name = pipeline_spec["schedule"]
        if schedule_name == "1f1b" and micro_batches < pp:
            # torch's 1F1B wants a micro-batch per stage; with fewer, 1F1B's order on every
            # stage is GPipe's (all forwards, then all backwards)
            schedule_name = "gpipe"
        # one stage in 1F1B order: the model itself, eager, its micro-batches accumulated
        # (no export trace, whose aten-level graph ran the Llama example's forward and
        # backward 1.6x slower than eager, and no schedule)
        accumulate = pp * virtual == 1 and schedule_name == "1f1b"
        # this rank's (virtual) stages: i, i + pp, ... in pipeline order
        mine = [pipe_index + j * pp for j in range(virtual)]
        if accumulate:
            whole = WholeModelStage(model.to(device), len(args), list(kwargs))
            modules: list[Any] = [whole]
            routes = [whole.route()]
        else:
            # export specialises the shapes it traces: DTensor stages see a micro-batch's
            # global shape, DDP stages (plain tensors) their replica's rows of it
            traced = rows if ddp is None else rows // dp
            pipe = pipeline(
                InputsEnterFirst(model.to(device)),
                mb_args=tuple(
                    a[:traced].to(device) if isinstance(a, torch.Tensor) else a for a in args
                ),
                mb_kwargs={
                    k: v[:traced].to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in kwargs.items()
                },
                split_spec={f"model.{s}": SplitPoint.BEGINNING for s in splits},
            )
            if pipe.num_stages != pp * virtual:
                raise InputError(
                    f"torch's pipelining cut the model into {pipe.num_stages} stages at "
                    f"{', '.join(splits)}; the plan has {pp * virtual}"
                )
            modules = [pipe.get_stage_module(s) for s in mine]
            routes = stage_routes(pipe.split_gm.graph)
            del pipe  # each rank keeps its stages only
        del model
        spec = plan["stages"][pipe_index]
        runs = spec.get("chunks") or [spec["layers"]]
        weight_updates = []
        recomputed = not_recomputed = 0
        stages = []

        def get_mesh(names: tuple[str, ...], _layout: Any) -> Any:
            return mesh[names] if len(names) > 1 else mesh[names[0]]

        wrapped_modules = []

        for s, module, (first, end) in zip(mine, modules, runs, strict=True):
            if not accumulate:  # a pipelining stage's graph
                drop_export_assertions(module)
                contiguous_before_merging_transposes(module)
                complete_vocabulary_lookups(module)
                run_stage_compiled(module)
            if ddp is None:
                weight_update = place_stage_parameters(module, plan, stage_mesh)
            else:
                check_stage_parameters(module, plan)
                weight_update = PlainStageUpdate()
            weight_updates.append(weight_update)
            if spec.get("recompute", "none") == "full":
                layers = range(int(first), int(end))
                found = recompute_layers(module, plan["graph"]["layer_container"], layers)
                # (a note, not a refusal: this stage's ranks alone would refuse, and the
                # others would wait for them in the schedule)
                not_recomputed += len(layers) - found
                recomputed += found
            last = s == pp * virtual - 1
            route = routes[0] if accumulate else routes[s]
            wrapped: Any = StageOnMesh(
                module, stage_mesh, weight_update, route, s == 0, last, distribute=ddp is None
            )
            if ddp is not None:  # DDP's reduction deferred to the last micro-batch's backward
                wrapped = data_parallel_stage_module(
                    wrapped, mesh["data"], ddp, device, sync_buffers=sync_buffers
                )
            wrapped_modules.append(wrapped)
            if accumulate:
                continue
            stages.append(
                zero_filled_stage_class()(
                    wrapped,
                    s,
                    pp * virtual,
                    device,
                    group=mesh["pipe"].get_group(),
                    get_mesh=get_mesh,
                )
            )
        runner = None
        if not accumulate:
            schedule_class = getattr(torch_schedules, HYBRID_RUNTIME_SCHEDULES[schedule_name])
            runner = schedule_class(
                stages if virtual > 1 else stages[0],
                n_microbatches=micro_batches,
                loss_fn=lambda out, _target: out.sum(),
            )
        self.optimizer = torch.optim.Adam(
            [
                p
                for module, update in zip(modules, weight_updates, strict=True)
                for p in update.optimizer_parameters(module)
            ],
            lr=lr,
            foreach=True,
        )
        self.inputs = [
            replica_rows(a, micro_batches, dp, data_index).to(device)
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        ]
        self.keywords = {
            k: replica_rows(v, micro_batches, dp, data_index).to(device)
            if isinstance(v, torch.Tensor)
            else v
            for k, v in kwargs.items()
        }
        self.target = torch.zeros(micro_batches, device=device)  # the loss is the model's own
        # where this rank is, for the launcher to name if it dies: its first stage's
        # micro-batches (an interleaved rank's later stages are not told apart)
        self.activity = watch_stage(
            modules[0], rank, dist.get_world_size(), micro_batches, pipe_index
        )
        self.plain_tensors = all(isinstance(u, PlainStageUpdate) for u in weight_updates)
        self.program = EngineProgram(dist.get_world_size())
        self.host_attention = HostAttention()  # the kernels of every step, decided on the first
        self.first_stage, self.last_stage = pipe_index == 0, pipe_index == pp - 1
        self.rank, self.dp, self.device_type = rank, dp, device_type
        self.mesh, self.stage_mesh, self.pipe_index = mesh, stage_mesh, pipe_index
        self.micro_batches, self.splits, self.mine = micro_batches, splits, mine
        self.modules, self.weight_updates = modules, weight_updates
        self.wrapped_modules, self.runner = wrapped_modules, runner
        self.ddp, self.engine_note, self.schedule_name = ddp, engine_note, schedule_name
        self.recomputed, self.not_recomputed = recomputed, not_recomputed

    def step(
        self, index: int, *, fault: bool = False, record: bool = False
    ) -> tuple[float | None, int, float, float]:
        """Step ``index`` (0-based) after a barrier of the ranks: the batch's loss (on the
        last stage's ranks, else None), the rank's gradient bytes, and the step's
        wall-clock and CPU seconds (this process, all threads). ``fault`` (tests): the rank
        kills itself in the step's first micro-batch forward; ``record``: the step's
        kernels and collectives go into ``program``
        (:func:`meshplace.runtime.dryrun.recorder`)."""
        import torch.distributed as dist

        from meshplace.runtime.dryrun import mesh_axes, recorder
        from meshplace.runtime.pipelined import begin_stage_step, run_schedule
        from meshplace.runtime.sharded import sharded_step

        activity = self.activity
        begin_stage_step(activity, index, fault)
        # the batch is split over the stage mesh's data axis
        names = list(self.mesh.mesh_dim_names or ())
        batch = tuple(i for i, name in enumerate(names) if name == "data")
        recording = (
            recorder(self.program, mesh_axes(self.mesh), batch)
            if record
            else contextlib.nullcontext()
        )
        start, cpu_start = time.perf_counter(), time.process_time()
        with recording:
            # the schedule runs the backward too: plain tensors (a rotary table) saved for
            # it meet DTensor gradients there, so the whole step is a sharded step; a
            # stage of plain tensors (DDP's, or one device's) runs as plain PyTorch
            with (
                contextlib.nullcontext()
                if self.plain_tensors
                else sharded_step(self.device_type, self.host_attention)
            ):
                if self.runner is None:
                    micro = accumulate_micro_batches(
                        self.wrapped_modules[0], self.micro_batches, self.inputs, self.keywords
                    )
                else:
                    micro = run_schedule(
                        self.runner,
                        self.first_stage,
                        self.last_stage,
                        self.inputs,
                        self.keywords,
                        self.target,
                    )
            activity.at(2 * self.micro_batches)
            pairs = list(zip(self.modules, self.weight_updates, strict=True))
            grad_bytes = sum(update.gradients_placed(module) for module, update in pairs)
            self.optimizer.step()
            for module, update in pairs:
                update.after_step()
                module.zero_grad(set_to_none=True)
            self.optimizer.zero_grad(set_to_none=True)
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if not self.last_stage:
            return None, grad_bytes, wall, cpu
        values = [m.full_tensor() if hasattr(m, "full_tensor") else m for m in micro]
        loss = torch.stack([v.detach().reshape(()) for v in values]).mean()
        if self.ddp is not None:  # each replica's loss on its rows: the batch's, as DDP's
            dist.all_reduce(loss, group=self.mesh["data"].get_group())
            loss = loss / self.dp if self.ddp == "mean" else loss
        return float(loss), grad_bytes, wall, cpu


def run_hybrid_plan(
    plan: dict[str, Any],
    source: str,
    *,
    steps: int,
    lr: float,
    device_type: str,
    checkpoint_dir: str | None = None,
    fault_step: int | None = None,
    engine: str = "auto",
    record_step: int | None = None,
) -> dict[str, Any]:
    """Train the ``FILE.py:build`` model of ``source`` under the hybrid ``plan`` for
    ``steps`` Adam steps on this rank (``torch.distributed`` initialised with ``pp * dp *
    tp`` ranks; :class:`HybridRankSteps`); what this rank measured (module docstring).
    ``checkpoint_dir``: after the last step each stage gathers its parameters whole and
    the stage's first rank writes them (``rank{R}.pt``, the model's own names).
    ``fault_step`` (tests): this rank kills itself (SIGKILL) in that step's first
    micro-batch forward. ``engine``: ``"auto"`` runs data-parallel stages without tensor
    parallelism or ZeRO on DDP (:func:`ddp_stages`), ``"dtensor"`` every stage on
    DTensor. ``record_step``: rank 0 records that step's kernels and collectives
    (:func:`meshplace.runtime.dryrun.recorder`) as ``program``, what
    :func:`meshplace.runtime.dryrun.dry_run` prices."""
    from meshplace.runtime.sharded import local_nbytes, optimizer_state_bytes, peak_bytes

    rank_steps = HybridRankSteps(plan, source, lr=lr, device_type=device_type, engine=engine)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    cpu_times: list[float] = []  # the process's CPU time in each step (step_timing)
    losses: list[float | None] = []
    grad_bytes = 0
    for step in range(steps):
        loss, grad_bytes, wall, cpu = rank_steps.step(
            step,
            fault=step == fault_step,
            record=step == record_step and rank_steps.rank == 0,
        )
        times.append(wall)
        cpu_times.append(cpu)
        losses.append(loss)
    modules, weight_updates = rank_steps.modules, rank_steps.weight_updates
    state_bytes = optimizer_state_bytes(rank_steps.optimizer)
    if checkpoint_dir is not None:
        whole = {
            name.removeprefix("model."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach()
            .cpu()
            for module in modules
            for name, p in module.named_parameters()
        }
        stage_mesh = rank_steps.stage_mesh
        if (
            int(stage_mesh.get_local_rank("data")) == 0
            and int(stage_mesh.get_local_rank("tensor")) == 0
        ):
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            torch.save(whole, Path(checkpoint_dir) / f"rank{rank_steps.rank}.pt")
    pipe_index, splits = rank_steps.pipe_index, rank_steps.splits
    return {
        "stage": pipe_index,
        "stage_begins": splits[pipe_index - 1] if pipe_index else "",
        "virtual_stages": rank_steps.mine,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "parameters": sum(local_nbytes(p) for m in modules for p in m.parameters()),
        "gradients": grad_bytes,
        "optimizer_state": state_bytes,
        "buffers": sum(local_nbytes(b) for m in modules for b in m.buffers()),
        "peak_bytes": peak_bytes(device_type),
        "recomputed_layers": rank_steps.recomputed,
        "layers_not_recomputed": rank_steps.not_recomputed,
        "schedule": rank_steps.schedule_name,
        "uneven": [n for update in weight_updates for n in update.uneven],
        "engine": "dtensor" if rank_steps.ddp is None else "ddp",
        "engine_note": rank_steps.engine_note,
        "program": rank_steps.program.to_dict()
        if record_step is not None and rank_steps.rank == 0
        else None,
    }


def accumulate_micro_batches(
    module: torch.nn.Module,
    micro_batches: int,
    inputs: Sequence[Any],
    keywords: Mapping[str, Any],
) -> list[torch.Tensor]:
    """One step's forwards and backwards of a one-stage plan without a pipeline schedule:
    the inputs cut into ``micro_batches`` chunks along their first dimension as torch's
    pipelining cuts them (``split_args_kwargs_into_chunks``), each chunk's forward then the
    backward of its loss (the module's output summed, the schedule's ``loss_fn``), and
    after the last the gradients divided by ``micro_batches`` (the schedule's
    ``scale_grads``). So the arithmetic is ``Schedule1F1B``'s on one stage, without its
    per-micro-batch bookkeeping. A DDP module reduces its gradients in the last
    micro-batch's backward only (``no_sync`` before it). Returns each micro-batch's loss.
    O(micro_batches) forward and backward passes.

    >>> net = torch.nn.Linear(3, 1)
    >>> losses = accumulate_micro_batches(net, 2, [torch.ones(4, 3)], {})
    >>> len(losses), net.weight.grad.shape
    (2, torch.Size([1, 3]))
    """
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
    from torch.nn.parallel import DistributedDataParallel

    chunks, keyword_chunks = split_args_kwargs_into_chunks(
        tuple(inputs), dict(keywords), micro_batches
    )
    ddp = isinstance(module, DistributedDataParallel)
    losses = []
    for k, (args, kwargs) in enumerate(zip(chunks, keyword_chunks, strict=True)):
        deferred = module.no_sync() if ddp and k < micro_batches - 1 else contextlib.nullcontext()
        with deferred:
            loss = module(*args, **kwargs).sum()
            loss.backward()
        losses.append(loss)
    if micro_batches != 1:
        for parameter in module.parameters():
            if parameter.grad is not None:
                parameter.grad.div_(micro_batches)
    return losses


class PlainStageUpdate:
    """:class:`~meshplace.runtime.launch.WeightUpdateSharding`'s interface for a stage on
    one device: plain tensors, the module's own forward, the optimizer on its
    parameters."""

    def __init__(self) -> None:
        self.uneven: list[str] = []

    def forward(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return model(*args, **kwargs)

    def optimizer_parameters(self, model: Any) -> list[Any]:
        return list(model.parameters())

    def gradients_placed(self, model: Any) -> int:
        """This rank's gradient bytes (nothing to place)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return sum(g.numel() * g.element_size() for g in grads)

    def after_step(self) -> None:
        return None


def ddp_stages(
    plan: Mapping[str, Any],
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    rows: int,
    engine: str = "auto",
) -> tuple[str | None, str | None]:
    """Whether this hybrid plan's stages run on DDP, and a note where DTensor runs them
    instead: ``("mean" or "sum", None)`` — how DDP combines the replicas' gradients — when
    the plan is data-parallel (``dp > 1``) without tensor parallelism or ZeRO and the
    model's loss over one micro-batch of ``rows`` rows is the mean or sum of its replicas'
    losses (:func:`meshplace.runtime.data_parallel.batch_reduction`, probed alike on every
    rank); else ``(None, note)`` (``note`` ``None`` where DDP was never in question; an
    interleaved plan's virtual stages stay on DTensor, with a note).
    ``engine="dtensor"`` keeps DTensor. DDP runs such a stage as its PyTorch user would:
    plain tensors, no DTensor dispatch, gradients bucketed and all-reduced during the last
    micro-batch's backward (torch's pipelining runs the others under ``no_sync``)."""
    from meshplace.runtime.data_parallel import batch_reduction

    _pp, dp, tp = (int(x) for x in plan["mesh"]["shape"])
    if engine == "dtensor" or dp < 2 or tp > 1 or int(plan["pipeline"].get("zero", 0)):
        return None, None
    if int(plan["pipeline"].get("virtual_stages", 1)) > 1:
        # two DDP modules of one rank on one data group trip DDP's bucket rebuilding
        # (torch 2.13: "rebuilt parameter indices size is not same as original model
        # parameters size")
        return None, (
            "the interleaved schedule's data-parallel stages run on DTensor, not DDP "
            "(DDP cannot serve two virtual stages of one rank)"
        )
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None, None  # refused later: stages are cut from a model built for real
    reduction = batch_reduction(model, args, kwargs, dp, rows)
    if reduction is None:
        return None, (
            "the loss over a micro-batch is not the mean or sum of its replicas' losses "
            "(batch statistics?), so the data-parallel stages run on DTensor, not DDP"
        )
    return reduction, None


def data_parallel_stage_module(
    module: torch.nn.Module,
    data_mesh: Any,
    reduction: str,
    device: torch.device,
    sync_buffers: bool = True,
) -> torch.nn.Module:
    """``module`` (a stage's :class:`StageOnMesh`) under DDP over ``data_mesh``'s ranks,
    its gradients summed, or averaged for a mean loss, in buckets of the cost model's size
    (:func:`meshplace.runtime.data_parallel.reduce_gradient_bucket`); ``sync_buffers``:
    whether DDP brings the buffers in step with rank 0's before every forward (where the
    model's forward changes some: :func:`meshplace.runtime.data_parallel.
    forward_changes_buffers`)."""
    from torch.nn.parallel import DistributedDataParallel

    from meshplace.runtime.data_parallel import bucket_megabytes, reduce_gradient_bucket

    group = data_mesh.get_group()
    wrapped = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=bucket_megabytes(),
        # every replica built its buffers from the same seed: constant ones need no
        # broadcast before every micro-batch's forward (torch 2.13's name; synced at init)
        forward_sync_buffers=sync_buffers,
    )
    wrapped.register_comm_hook(
        (group, data_mesh.size(), reduction == "mean"), reduce_gradient_bucket
    )
    return wrapped


def check_stage_parameters(module: torch.nn.Module, plan: Mapping[str, Any]) -> list[str]:
    """The model's names of a pipelining stage ``module``'s parameters (under ``model.``);
    one sentence when the plan does not name one of them."""
    names = [n.removeprefix("model.") for n, _ in module.named_parameters()]
    unplanned = [n for n in names if n not in plan["parameters"]]
    if unplanned:
        raise InputError(f"the plan does not match the model: {unplanned[0]!r} is not in it")
    return names


def place_stage_parameters(module: torch.nn.Module, plan: Mapping[str, Any], mesh: Any) -> Any:
    """Make the parameters of a pipelining stage ``module`` (the model under ``model.``)
    DTensors on the stage ``mesh`` with the plan's placements, by the model's own names,
    and set up the plan's ZeRO for them; the
    :class:`~meshplace.runtime.launch.WeightUpdateSharding`. One sentence when the plan
    does not name a parameter of the stage."""
    from meshplace.runtime.launch import WeightUpdateSharding
    from meshplace.runtime.sharded import apply_sharding_plan

    names = check_stage_parameters(module, plan)
    if mesh.size() == 1:
        # a stage on one device: nothing to place or shard, and DTensor's dispatch would
        # only cost time (about 25 us an op here)
        return PlainStageUpdate()
    stage_plan = {
        "format": plan["format"],
        "parameters": {f"model.{n}": plan["parameters"][n] for n in names},
    }
    apply_sharding_plan(module, stage_plan, mesh)
    return WeightUpdateSharding(module, stage_plan, mesh)


def summarise_hybrid(
    plan: dict[str, Any],
    per_rank: list[dict[str, Any]],
    *,
    source: str,
    warmup: int,
    device: str,
) -> dict[str, Any]:
    """Rank 0's report of a hybrid run: the step times (per step, the slowest rank) and
    the losses (the last stage's) beside the plan's prediction for its own cluster, and
    every rank's parameter, gradient and optimizer-state bytes beside its stage's
    ``held_bytes``."""
    from meshplace.runtime.launch import measured_times, peak_kind, step_timing

    timing = step_timing(per_rank, warmup)
    stages = plan["stages"]
    predicted = plan.get("predicted") or {}
    last = next(r for r in per_rank if r["stage"] == len(stages) - 1)
    notes = []
    ran = per_rank[0]["schedule"]
    if ran != plan["pipeline"]["schedule"]:
        notes.append(
            f"the plan's {plan['pipeline']['schedule']} schedule ran as {ran}: with fewer "
            "micro-batches than stages the two orders are the same, and torch's 1F1B "
            "wants one per stage"
        )
    recomputed = {r["stage"]: r["recomputed_layers"] for r in per_rank if r["recomputed_layers"]}
    if recomputed:
        notes.append(
            "layers recomputed in the backward (torch.utils.checkpoint): "
            + ", ".join(f"stage {k}: {n}" for k, n in sorted(recomputed.items()))
        )
    missed = {r["stage"]: r["layers_not_recomputed"] for r in per_rank}
    if any(missed.values()):
        notes.append(
            "layers the plan recomputes that torch's pipelining stage does not hold as "
            "modules, so they kept their activations (the memory prediction assumed "
            "otherwise): " + ", ".join(f"stage {k}: {n}" for k, n in sorted(missed.items()) if n)
        )
    uneven = per_rank[0].get("uneven", [])
    if uneven:
        notes.append(
            f"{len(uneven)} parameters with weight-update sharding have no dimension their "
            f"replica count divides ({', '.join(uneven[:3])}): their blocks are uneven"
        )
    if per_rank[0].get("engine_note"):
        notes.append(per_rank[0]["engine_note"])
    return {
        "model": source,
        "plan": "hybrid",
        "world_size": len(per_rank),
        "mesh": plan["mesh"],
        "device": device,
        "engine": per_rank[0].get("engine", "dtensor"),
        "schedule": ran,
        "micro_batches": int(plan["pipeline"]["micro_batches"]),
        "stage_begins": [r["stage_begins"] for r in per_rank],
        "steps": timing["steps"],
        "warmup": timing["warmup"],
        "measured": {
            **measured_times(timing),
            "losses": last["losses"],
        },
        "predicted": {
            "cluster": plan.get("cluster"),
            "step_time_s": predicted.get("time_per_batch_s"),
            **predicted,
        },
        "memory_per_rank": {
            kind: {
                "predicted": [held_bytes(stages[r["stage"]], kind) for r in per_rank],
                "measured": [r[kind] for r in per_rank],
            }
            for kind in ("parameters", "gradients", "optimizer_state")
        },
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "peak_kind": peak_kind(device),
        "notes": notes,
    }
