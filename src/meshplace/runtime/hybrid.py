"""Run a hybrid plan (``meshplace shard --pipeline auto --out``) under torchrun: pipeline
stages with data and tensor parallelism inside each stage.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC 2021; pipeline x tensor x data parallelism), as torchtitan composes
PyTorch's own pieces: a ``DeviceMesh`` of axes ``(pipe, data, tensor)``, DTensor parameters
on each stage's ``(data, tensor)`` sub-mesh, ``torch.distributed.pipelining`` stages and
schedules (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``), activation
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
:class:`meshplace.runtime.launch.WeightUpdateSharding`). The first stage reads its rows of
each micro-batch as a DTensor split over ``data`` (:class:`StageOnMesh`); activations
cross stages as DTensors (the pipelining stage sends each rank's local block to the rank
of the same ``(data, tensor)`` coordinate in the next stage, torch 2.13's DTensor
metadata support). The schedule scales gradients by ``1 / micro-batches``; after it, each
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

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError

#: The schedules a hybrid plan names and the torch schedule classes that run them.
HYBRID_RUNTIME_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def is_hybrid(plan: Mapping[str, Any]) -> bool:
    """Whether a ``meshplace.parallel_plan`` is a hybrid plan (it has pipeline stages)."""
    return bool(plan.get("stages")) and "pipeline" in plan


def stage_splits(plan: Mapping[str, Any]) -> list[str]:
    """The module path where each stage after the first begins: the first layer of its
    range in the plan's layer stack (``layers.4``). One sentence when the plan is cut
    between units (a model without one stack of identical layers) or names no stack.

    >>> stage_splits({"graph": {"layer_container": "layers"},
    ...               "stages": [{"layers": [0, 2]}, {"layers": [2, 4]}]})
    ['layers.2']
    """
    container = (plan.get("graph") or {}).get("layer_container")
    stages = plan["stages"]
    if any("units" in s for s in stages) or not container:
        raise InputError(
            "the plan is cut between the units of a model without one stack of identical "
            "layers; the torchrun runtime runs hybrid plans of a layer stack only"
        )
    firsts = [int(s["layers"][0]) for s in stages]
    if firsts != sorted(firsts) or firsts[0] != 0:
        raise InputError("the plan's stages do not cover the layer stack in order")
    return [f"{container}.{k}" for k in firsts[1:]]


def check_hybrid_memory_budget(plan: Mapping[str, Any], budget: int) -> None:
    """Refuse a hybrid plan in which a rank would hold more than ``budget`` bytes of
    parameters and optimizer state between steps (its stage's ``held_bytes``).

    >>> check_hybrid_memory_budget({"stages": [{"held_bytes": {"parameters": 4,
    ...     "optimizer_state": 8}}]}, 12)
    """
    for k, stage in enumerate(plan["stages"]):
        held = stage.get("held_bytes") or {}
        total = int(float(held.get("parameters", 0)) + float(held.get("optimizer_state", 0)))
        if total > budget:
            raise InputError(
                f"a rank of stage {k} would hold {total:,} bytes of parameters and optimizer "
                f"state under this plan, over --memory-budget {budget:,}"
            )


def check_hybrid_world(plan: Mapping[str, Any], world_size: int) -> None:
    """One sentence unless torchrun started ``pp * dp * tp`` processes."""
    pp, dp, tp = (int(x) for x in plan["mesh"]["shape"])
    if pp * dp * tp != world_size:
        raise InputError(
            f"the plan is {pp} stages x {dp} data x {tp} tensor = {pp * dp * tp} devices; "
            f"torchrun started {world_size} processes (--nproc-per-node x --nnodes)"
        )
    schedule = plan["pipeline"]["schedule"]
    if schedule not in HYBRID_RUNTIME_SCHEDULES:
        raise InputError(
            f"the plan's schedule {schedule!r} does not run under torchrun yet; plan with "
            f"one of {', '.join(HYBRID_RUNTIME_SCHEDULES)} (meshplace shard --pipeline auto "
            "chooses among its schedules)"
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


class StageOnMesh(torch.nn.Module):
    """A pipeline stage's module run on its ``(data, tensor)`` mesh: the first stage's
    inputs (this rank's rows of a micro-batch) become DTensors split over ``data`` and
    replicated over ``tensor``; later stages receive what the stage before sent (DTensors
    as DTensors, a tensor computed from buffers alone as a plain tensor). The
    stage's forward runs with the ZeRO-3 shards gathered (``weight_update.forward``); call
    it, as the schedule's backward, under :func:`meshplace.runtime.sharded.sharded_step`."""

    def __init__(
        self,
        stage: torch.nn.Module,
        mesh: Any,
        weight_update: Any,
        device_type: str,
        first: bool,
    ) -> None:
        super().__init__()
        self.first = first
        self.stage = stage
        self.mesh = mesh
        self.weight_update = weight_update
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        split = [Shard(0), Replicate()]

        def rows(a: Any) -> Any:
            if self.first and isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                return DTensor.from_local(a, self.mesh, split, run_check=False)
            return a

        args = tuple(rows(a) for a in args)
        kwargs = {k: rows(v) for k, v in kwargs.items()}
        # under the caller's sharded_step (run_hybrid_plan): DTensor's implicit
        # replication is one flag, which a nested context would clear on its way out
        return self.weight_update.forward(self.stage, args, kwargs)


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


def drop_export_assertions(module: torch.nn.Module) -> int:
    """Erase the metadata assertions ``torch.export`` leaves in a pipelining stage's graphs
    (``aten._assert_tensor_metadata``, from a ``.to(dtype)``): they compute nothing (no
    users) and DTensor has no sharding rule for them. How many were erased. O(nodes)."""
    assertions = {torch.ops.aten._assert_tensor_metadata.default}
    erased = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        dead = [
            n
            for n in graph.nodes
            if n.op == "call_function" and n.target in assertions and not n.users
        ]
        for node in dead:
            graph.erase_node(node)
        erased += len(dead)
        if dead and isinstance(sub, torch.fx.GraphModule):
            sub.recompile()
    return erased


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


def run_hybrid_plan(
    plan: dict[str, Any],
    source: str,
    *,
    steps: int,
    lr: float,
    device_type: str,
    checkpoint_dir: str | None = None,
    fault_step: int | None = None,
) -> dict[str, Any]:
    """Train the ``FILE.py:build`` model of ``source`` under the hybrid ``plan`` for
    ``steps`` Adam steps on this rank (``torch.distributed`` initialised with ``pp * dp *
    tp`` ranks); what this rank measured (module docstring). ``checkpoint_dir``: after the
    last step each stage gathers its parameters whole and the stage's first rank writes
    them (``rank{R}.pt``, the model's own names). ``fault_step`` (tests): this rank kills
    itself (SIGKILL) in that step's first micro-batch forward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining import schedules as torch_schedules

    from meshplace.graph.sources import build_from_seed
    from meshplace.runtime.launch import WeightUpdateSharding
    from meshplace.runtime.pipelined import InputsEnterFirst, run_schedule, watch_stage
    from meshplace.runtime.sharded import (
        apply_sharding_plan,
        local_nbytes,
        peak_bytes,
        rank_device,
        sharded_step,
    )

    pp, dp, tp = (int(x) for x in plan["mesh"]["shape"])
    pipeline_spec = plan["pipeline"]
    micro_batches = int(pipeline_spec["micro_batches"])
    global_batch = int(pipeline_spec["global_batch"])
    splits = stage_splits(plan)
    rank = dist.get_rank()
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pipe", "data", "tensor"))
    stage_mesh = mesh["data", "tensor"]
    pipe_index, data_index, _ = (int(c) for c in mesh.get_coordinate())
    device = rank_device(device_type)

    model, args, kwargs = build_from_seed(source)  # the same on every rank
    check_global_batch((*args, *kwargs.values()), global_batch, source)
    if any(p.is_meta for p in model.parameters()):
        raise InputError(
            f"{source} builds its model on the meta device; a hybrid plan's stages are cut "
            "from a model built for real"
        )
    rows = global_batch // micro_batches  # one micro-batch of every replica together
    pipe = pipeline(
        InputsEnterFirst(model.to(device)),
        mb_args=tuple(a[:rows].to(device) if isinstance(a, torch.Tensor) else a for a in args),
        mb_kwargs={
            k: v[:rows].to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        },
        split_spec={f"model.{s}": SplitPoint.BEGINNING for s in splits},
    )
    if pipe.num_stages != pp:
        raise InputError(
            f"torch's pipelining cut the model into {pipe.num_stages} stages at "
            f"{', '.join(splits)}; the plan has {pp}"
        )
    stage_module = pipe.get_stage_module(pipe_index)
    del pipe, model  # each rank keeps its stage only
    drop_export_assertions(stage_module)

    # the stage's parameters, by the model's own names, placed as the plan says
    named = {n.removeprefix("model."): p for n, p in stage_module.named_parameters()}
    unplanned = [n for n in named if n not in plan["parameters"]]
    if unplanned:
        raise InputError(f"the plan does not match the model: {unplanned[0]!r} is not in it")
    stage_plan = {
        "format": plan["format"],
        "parameters": {f"model.{n}": plan["parameters"][n] for n in named},
    }
    apply_sharding_plan(stage_module, stage_plan, stage_mesh)
    weight_update = WeightUpdateSharding(stage_module, stage_plan, stage_mesh)
    spec = plan["stages"][pipe_index]
    recomputed = 0
    if spec.get("recompute", "none") == "full":
        first, last = (int(x) for x in spec["layers"])
        recomputed = recompute_layers(
            stage_module, plan["graph"]["layer_container"], range(first, last)
        )
    wrapped = StageOnMesh(stage_module, stage_mesh, weight_update, device_type, pipe_index == 0)

    def get_mesh(names: tuple[str, ...], _layout: Any) -> Any:
        return mesh[names] if len(names) > 1 else mesh[names[0]]

    stage = zero_filled_stage_class()(
        wrapped, pipe_index, pp, device, group=mesh["pipe"].get_group(), get_mesh=get_mesh
    )
    schedule_name = pipeline_spec["schedule"]
    if schedule_name == "1f1b" and micro_batches < pp:
        # torch's 1F1B wants a micro-batch per stage; with fewer, 1F1B's order on every
        # stage is GPipe's (all forwards, then all backwards)
        schedule_name = "gpipe"
    runner = getattr(torch_schedules, HYBRID_RUNTIME_SCHEDULES[schedule_name])(
        stage, n_microbatches=micro_batches, loss_fn=lambda out, _target: out.sum()
    )
    optimizer = torch.optim.Adam(
        weight_update.optimizer_parameters(stage_module), lr=lr, foreach=True
    )
    first_stage, last_stage = pipe_index == 0, pipe_index == pp - 1
    inputs = [
        replica_rows(a, micro_batches, dp, data_index).to(device)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]
    keywords = {
        k: replica_rows(v, micro_batches, dp, data_index).to(device)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in kwargs.items()
    }
    target = torch.zeros(micro_batches, device=device)  # the loss is the model's own
    activity = watch_stage(stage_module, rank, dist.get_world_size(), micro_batches, pipe_index)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    losses: list[float | None] = []
    grad_bytes = 0
    from meshplace.runtime.activity import SYNC

    for step in range(steps):
        activity.start_step(step)
        activity.at(0, SYNC)
        dist.barrier()
        activity.at(0)
        if step == fault_step:
            activity.kill_at_forward = True
        start = time.perf_counter()
        # the schedule runs the backward too: plain tensors (a rotary table) saved for it
        # meet DTensor gradients there, so the whole step is a sharded step
        with sharded_step(device_type):
            micro = run_schedule(runner, first_stage, last_stage, inputs, keywords, target)
        activity.at(2 * micro_batches)
        grad_bytes = weight_update.update(stage_module, optimizer)
        if device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if last_stage:
            values = [m.full_tensor() if hasattr(m, "full_tensor") else m for m in micro]
            losses.append(float(torch.stack([v.detach().reshape(()) for v in values]).mean()))
        else:
            losses.append(None)
    state_bytes = sum(
        local_nbytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # Adam's step counter is a scalar
    )
    if checkpoint_dir is not None:
        whole = {
            name.removeprefix("model."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach()
            .cpu()
            for name, p in stage_module.named_parameters()
        }
        if (
            int(stage_mesh.get_local_rank("data")) == 0
            and int(stage_mesh.get_local_rank("tensor")) == 0
        ):
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            torch.save(whole, Path(checkpoint_dir) / f"rank{rank}.pt")
    return {
        "stage": pipe_index,
        "stage_begins": splits[pipe_index - 1] if pipe_index else "",
        "times_s": times,
        "losses": losses,
        "parameters": sum(local_nbytes(p) for p in stage_module.parameters()),
        "gradients": grad_bytes,
        "optimizer_state": state_bytes,
        "buffers": sum(local_nbytes(b) for b in stage_module.buffers()),
        "peak_bytes": peak_bytes(device_type),
        "recomputed_layers": recomputed,
        "schedule": schedule_name,
        "uneven": weight_update.uneven,
    }


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
    from meshplace.runtime.launch import peak_kind, step_timing

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
    uneven = per_rank[0].get("uneven", [])
    if uneven:
        notes.append(
            f"{len(uneven)} parameters with weight-update sharding have no dimension their "
            f"replica count divides ({', '.join(uneven[:3])}): their blocks are uneven"
        )
    return {
        "model": source,
        "plan": "hybrid",
        "world_size": len(per_rank),
        "mesh": plan["mesh"],
        "device": device,
        "schedule": ran,
        "micro_batches": int(plan["pipeline"]["micro_batches"]),
        "stage_begins": [r["stage_begins"] for r in per_rank],
        "steps": timing["steps"],
        "warmup": timing["warmup"],
        "measured": {
            "step_time_s": timing["step_time_s"],
            "step_times_s": timing["step_times_s"],
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


def held_bytes(stage: Mapping[str, Any], kind: str) -> int | None:
    """A stage's predicted per-device bytes of ``kind`` (``parameters``, ``gradients``,
    ``optimizer_state``) as a whole number, or None for a plan that does not say.

    >>> held_bytes({"held_bytes": {"parameters": 512.0}}, "parameters")
    512
    """
    value = (stage.get("held_bytes") or {}).get(kind)
    return None if value is None else round(float(value))
