"""Run a plan under torchrun, the launcher users already have: a sharding plan (this module,
DTensor), an op placement (:mod:`meshplace.runtime.placed`) or a pipelined placement
(:mod:`meshplace.runtime.pipelined`), told apart by the plan file.

Usage (one process per device of the plan's mesh; ``--nnodes``/``--rdzv-*`` for several
hosts, as for any torchrun job)::

    torchrun --standalone --nproc-per-node 4 -m meshplace.runtime \\
        --plan plan.json [--model FILE.py:build] [--steps 10] [--warmup 2] [--json]

Each process reads its rank and the world from torchrun's environment (``env://``
rendezvous), joins a gloo (CPU) or NCCL (GPU) process group, builds the model from the
plan's ``graph.source`` (or ``--model``) with a fixed seed, and trains for ``--steps`` Adam
steps with PyTorch's own forward, backward and optimizer — no meshplace interpreter on this
path — on the engine that runs the plan (:func:`sharding_training`): a pure data-parallel
plan on DDP (ZeRO 0 and 1) or FSDP2 (ZeRO 3) when its loss is a mean or sum over the batch
(:mod:`meshplace.runtime.data_parallel`), every other plan (or ``--engine dtensor``) with
every parameter and input a DTensor of the plan's placements
(:func:`meshplace.runtime.sharded.apply_sharding_plan`). Rank 0 prints what every rank
measured beside the plan's predictions: the median step time after ``--warmup`` steps (the
slowest rank's, each step), the loss of every step, and per rank the bytes of its parameter,
gradient and optimizer-state blocks (the plan predicts these exactly) and its peak memory
(CUDA: ``max_memory_allocated``; CPU: the process's peak resident set, which includes the
Python runtime and is not comparable to the plan's tensor bytes).

The plan's predicted step time is for the cluster it was made for (``plan["cluster"]``);
on other hardware it is printed for reference, not as a prediction of this run (issue 15's
calibration is what will make it one).

Weight-update sharding (``zero`` > 0) is applied per parameter
(:class:`WeightUpdateSharding`: ZeRO stages 1-3 on DTensor). A model built on the meta
device is never whole on any rank: each parameter is created from its name and only the
rank's block kept (:func:`~meshplace.runtime.sharded.apply_sharding_plan`);
``--memory-budget`` refuses a plan whose predicted per-rank share exceeds it. Not yet here
(issue 15): FSDP's re-gather in backward, collectives overlapping compute, and a prediction
on the hardware the run is on.

Bad input (no plan, a plan of another format, a world size that is not the mesh's device
count, a model that is not ``FILE.py:build``) is one sentence on stderr and exit status 2,
from every rank, before any process group is made.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshplace.argtypes import non_negative_int, positive_int
from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
from meshplace.errors import InputError
from meshplace.hostmemory import keep_freed_memory

#: Fault injection for tests: ``"RANK:STEP"`` makes that rank kill itself (SIGKILL) in that
#: step (0-based) — at its first op (placement), its first leaf module's forward (sharding
#: plan) or its first micro-batch's forward (pipeline) — as a crashed or OOM-killed process
#: would end.
FAULT_ENV = "MESHPLACE_TORCHRUN_FAULT"
#: ``--engine`` choices: ``auto`` runs a pure data-parallel plan on DDP or FSDP2
#: (:mod:`meshplace.runtime.data_parallel`) and every other plan on DTensor
ENGINES = ("auto", "dtensor")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m meshplace.runtime``."""
    parser = argparse.ArgumentParser(
        prog="python -m meshplace.runtime",
        description="Run a meshplace sharding plan (meshplace shard --out) under torchrun.",
    )
    parser.add_argument(
        "--plan",
        required=True,
        help="plan JSON: a sharding plan (meshplace shard --out) or an op placement "
        "(meshplace plan --out)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the model: FILE.py:build for a sharding plan (default: the plan's "
        "graph.source); a runtime model name or FILE.py:FUNCTION for a placement (default: "
        "the plan's graph)",
    )
    parser.add_argument("--batch", type=positive_int, default=None, help="placement: batch size")
    parser.add_argument("--size", default=None, help="placement: the model's size")
    parser.add_argument(
        "--memory-budget",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="placement: refuse to start a rank whose share (parameters, optimizer state, "
        "inputs) exceeds this",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="after the last step, write the parameters: each rank of a placement its own "
        "and their optimizer state, each stage of a pipelined placement its own (both to "
        "DIR/rankR.pt), rank 0 of a sharding plan every parameter whole (DIR/rank0.pt)",
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="Adam steps (default 10)")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=2, help="steps not timed (default 2)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--micro-batches",
        type=positive_int,
        default=None,
        help="pipelined placement: micro-batches per step (default: the plan's; 1 runs it "
        "as an op placement, one step at a time)",
    )
    parser.add_argument(
        "--schedule",
        default="1F1B",
        help="pipelined placement (objective throughput, several micro-batches): 1F1B "
        "(default) or GPipe",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="sharding plan: the cluster (preset or YAML) whose devices the step is "
        "predicted on as its engine runs it; placement: the simulator's prediction of the "
        "run on it (default: the plan's cluster)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="sharding plan: the calibration file (meshplace profile --out, meshplace run "
        "--calibration-out) whose cost model predicts the step as its engine runs it; "
        "placement: the simulator's prediction of the run with it (default: the "
        "catalogue's figures)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="sharding or hybrid plan: auto (default) runs pure data parallelism on DDP (ZeRO "
        "0) or FSDP2 (ZeRO 3), a hybrid plan's data-parallel stages without tensor "
        "parallelism or ZeRO on DDP, and everything else on DTensor; dtensor runs every plan "
        "on DTensor",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    return parser


def read_plan(path: str) -> dict[str, Any]:
    """The plan file, checked to be a ``meshplace.parallel_plan`` or a ``meshplace.plan``
    (an op placement). From the formats' writers, which import no torch: ``meshplace run``
    reads the plan in its own process before torchrun starts the ranks."""
    from meshplace.parallel.search import PLAN_FORMAT
    from meshplace.plan.placement import FORMAT as PLACEMENT_FORMAT

    try:
        plan = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"plan {path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"plan {path!r} is not readable JSON: {exc}") from None
    if not isinstance(plan, dict) or plan.get("format") not in (PLAN_FORMAT, PLACEMENT_FORMAT):
        raise InputError(
            f"plan {path!r} is neither a sharding plan (format {PLAN_FORMAT!r}, from "
            f"`meshplace shard --out`) nor a placement ({PLACEMENT_FORMAT!r}, from "
            "`meshplace plan --out`)"
        )
    return plan


def check_world(plan: dict[str, Any], world_size: int) -> None:
    """The process count must be the plan's mesh size."""
    shape = [int(s) for s in plan["mesh"]["shape"]]
    need = math.prod(shape)
    if world_size != need:
        raise InputError(
            f"the plan's {'x'.join(map(str, shape))} mesh needs {need} processes, torchrun "
            f"started {world_size} (set --nproc-per-node x --nnodes to {need})"
        )


def check_memory_budget(plan: dict[str, Any], budget: int) -> None:
    """Refuse a sharding plan whose ranks would each hold more than ``budget`` bytes between
    steps: the plan's predicted parameter, buffer, optimizer-state and input blocks (the
    same for every rank).

    >>> check_memory_budget({"predicted": {"memory_bytes": {"parameters": 8.0}}}, 8)
    """
    memory = (plan.get("predicted") or {}).get("memory_bytes") or {}
    kinds = ("parameters", "buffers", "optimizer_state", "inputs")
    held = int(sum(float(memory.get(k) or 0) for k in kinds))
    if held > budget:
        raise InputError(
            f"each rank would hold {held:,} bytes of parameters, buffers, optimizer state and "
            f"inputs under this plan, over --memory-budget {budget:,}"
        )


def model_source(plan: dict[str, Any], override: str | None) -> str:
    """``FILE.py:build`` to build the model from."""
    source = override or (plan.get("graph") or {}).get("source", "")
    path, _, fn = str(source).rpartition(":")
    if not (path.endswith(".py") and fn):
        raise InputError(
            f"the runtime builds real weights from FILE.py:build, and the plan's model is "
            f"{source!r} (reference workloads are built on the meta device); pass --model"
        )
    return str(source)


def refuse_channel_split_convolutions(plan: dict[str, Any]) -> None:
    """A plan that splits a convolution over its channels (the solver's ``o@x``/``i@x``
    strategies) is one sentence here, not an error deep in a rank: the DTensor path runs
    convolutions split along the batch (DTensor's own) or the image's height and width
    (:mod:`meshplace.runtime.spatial`), with whole weights (a weight the plan stores split
    is gathered at use). ``meshplace.runtime.spmd.run_plan`` executes any plan op by op.

    >>> refuse_channel_split_convolutions({"ops": {"convolution": "n@x w@y"}})
    >>> try:
    ...     refuse_channel_split_convolutions({"ops": {"convolution_1": "o@x"}})
    ... except InputError as e:
    ...     print(str(e)[:61])
    the plan splits convolution 'convolution_1' over its channels
    """
    for op, strategy in plan.get("ops", {}).items():
        if not op.startswith("convolution"):
            continue
        labels = {word.partition("@")[0] for word in strategy.split() if "@" in word}
        if labels & {"o", "i"}:
            raise InputError(
                f"the plan splits convolution {op!r} over its channels ({strategy}); the "
                "torchrun runtime splits convolutions along the batch, height or width "
                "only: run it op by op with meshplace.runtime.spmd.run_plan, or shard with "
                "the convolutions' channels whole"
            )


def _summed_dims(placed: Sequence[Any], wanted: Sequence[Any]) -> tuple[int, ...] | None:
    """The mesh dimensions over which a gradient placed ``placed`` is a partial sum that
    its parameter's placements ``wanted`` replicate, when that is the whole difference
    (an all-reduce over those dimensions places it); else ``None``."""
    dims = []
    for i, (have, want) in enumerate(zip(placed, wanted, strict=True)):
        if have == want:
            continue
        if have.is_partial() and getattr(have, "reduce_op", "sum") == "sum" and want.is_replicate():
            dims.append(i)
        else:
            return None
    return tuple(dims) if dims else None


def place_gradients_like_parameters(model: Any, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Give every DTensor gradient its parameter's placements, as the plan places them:
    where DTensor ran a split weight's matmul on the gathered weight, the gradient comes
    back whole (a local slice makes it the parameter's block) or as a partial sum (a
    reduce-scatter). Gradients that are partial sums their parameters replicate (data
    parallelism) are all-reduced together, in buckets of up to ``bucket_bytes`` per mesh
    dimension set and dtype, as DDP reduces them (Li et al., "PyTorch Distributed", VLDB
    2020, Sec. 3.2.3: one collective per bucket instead of one per parameter); the sums
    are those of the per-parameter all-reduces. O(parameters) plus one all-reduce per
    bucket and reduced dimension.
    """
    import torch

    from meshplace.runtime.sharded import block_as_dtensor_of, buckets_of, flat_all_reduce

    with torch.no_grad():  # to_local without its autograd function
        buckets: dict[tuple, list[Any]] = {}
        for p in model.parameters():
            g = p.grad
            placed = getattr(g, "placements", None)
            if placed is None or tuple(placed) == tuple(p.placements):
                continue
            dims = _summed_dims(placed, p.placements)
            if dims is None:
                p.grad = g.redistribute(p.device_mesh, p.placements)
                continue
            buckets.setdefault((id(p.device_mesh), dims, g.dtype), []).append(p)

        def grad_bytes(p: Any) -> int:
            return p.grad.to_local().numel() * p.grad.element_size()

        for (_, dims, _), params in buckets.items():
            for bucket in buckets_of(params, grad_bytes, bucket_bytes):
                mesh = bucket[0].device_mesh
                flat = torch.cat([p.grad.to_local().reshape(-1) for p in bucket])
                for dim in dims:
                    flat = flat_all_reduce(flat, mesh, dim)
                offset = 0
                for p in bucket:
                    local = p.grad.to_local()
                    block = flat[offset : offset + local.numel()].view(local.shape)
                    offset += local.numel()
                    p.grad = block_as_dtensor_of(block, p)


class WeightUpdateSharding:
    """The plan's weight-update sharding, per parameter, on DTensor.

    Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models" (SC 2020), Sec. 5: stage 1 shards the optimizer state over the
    data-parallel replicas, stage 2 the gradients too, stage 3 the parameters too. Here a
    parameter's replica axes are the mesh axes its plan placement replicates it over.

    Stages 1 and 2: the optimizer updates a master copy of the parameter sharded over its
    replica axes (:func:`~meshplace.runtime.sharded.zero_placements`). After backward the
    gradient is moved onto it: at stage 2, a data-parallel partial sum is reduce-scattered
    onto the shards in flat buckets (:meth:`reduce_scatter_gradients`); otherwise it is
    reduced like its parameter's (at stage 1 the whole gradient stays, as the plan's
    memory says) and sliced or redistributed (:meth:`after_backward`); from stage 2 the
    whole gradient is dropped;
    after the step (:meth:`after_step`) the updated shard is all-gathered into the
    parameter.

    Stage 3: the shard *is* the module's parameter, so between steps a rank holds only
    its block. :meth:`forward` all-gathers every stage-3 shard into the plan's placement
    as a differentiable DTensor redistribution and runs the model on the gathered tensors
    (``torch.func.functional_call``): the model computes exactly as with whole parameters,
    and autograd carries each gradient back through the gather as its reverse, a
    reduce-scatter (or a local slice) onto the shard, which the optimizer then updates
    in place. The gathered tensors live for one step (forward to backward), as FSDP's
    without ``reshard_after_forward``.

    O(parameters) per step, plus the collectives.
    """

    def __init__(self, model: Any, plan: dict[str, Any], mesh: Any) -> None:
        import torch

        from meshplace.runtime.sharded import local_nbytes, master_block_cuts, zero_placements

        self.mesh = mesh
        self.masters: dict[str, tuple[Any, Any, int]] = {}
        self.uneven: list[str] = []
        self.gathered: dict[str, Any] = {}  # stage 3: name -> the plan's placements
        # stages 1-2: name -> where the master shard sits in the parameter's block, for
        # parameters whose shard is a block of it (the rest are redistributed one by one)
        self.cuts: dict[str, tuple[tuple[int, int], ...]] = {}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for name, param in list(model.named_parameters()):
            zero = int(plan["parameters"][name].get("zero", 0))
            if zero == 0 or not any(p.is_replicate() for p in param.placements):
                continue
            target = zero_placements(list(param.placements), param.shape, mesh.shape)
            shard = torch.nn.Parameter(param.detach().redistribute(mesh, target))
            whole = param.numel() * param.element_size()
            if local_nbytes(shard) * math.prod(mesh.shape) != whole:
                self.uneven.append(name)  # no dimension divides: blocks of unequal size
            if zero >= 3:
                self.gathered[name] = tuple(param.placements)
                for alias in aliases[id(param)]:  # tied weights share the one shard
                    owner, _, leaf = alias.rpartition(".")
                    setattr(model.get_submodule(owner), leaf, shard)
            else:
                cuts = master_block_cuts(param.placements, target, param.shape, mesh.shape)
                if cuts is not None:
                    self.cuts[name] = cuts
            self.masters[name] = (param, shard, zero)
        coordinate = mesh.get_coordinate()
        self.coordinate = tuple(coordinate) if coordinate is not None else ()

    def forward(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The model's forward, with every stage-3 shard all-gathered (differentiably)
        into the plan's placement for this step."""
        if not self.gathered:
            return model(*args, **kwargs)
        from torch.func import functional_call

        named = dict(model.named_parameters())
        full = {
            name: named[name].redistribute(self.mesh, placements)
            for name, placements in self.gathered.items()
        }
        return functional_call(model, full, args, kwargs, strict=False)

    def optimizer_parameters(self, model: Any) -> list[Any]:
        """What the optimizer updates: each weight-update-sharded parameter's master shard
        in its place (stage 3: the shard the model holds), every other parameter as it
        is."""
        return [self.masters[n][1] if n in self.masters else p for n, p in model.named_parameters()]

    def after_backward(self) -> None:
        """Each stage-1/2 gradient onto its master shard: where the shard is a block of
        the parameter's (:attr:`cuts`) and the gradient has the parameter's placements,
        the block of the rank's gradient, sliced locally (a copy from stage 2, whose whole
        gradient is then dropped); else DTensor's redistribution. The values are the same
        either way; the slice skips DTensor's per-call cost (~160 us a parameter on CPU)."""
        import torch

        from meshplace.runtime.sharded import block_as_dtensor_of, master_block

        for name, (param, shard, zero) in self.masters.items():
            if zero >= 3 or param.grad is None:
                continue
            grad, cuts = param.grad, self.cuts.get(name)
            if cuts is None or tuple(getattr(grad, "placements", ())) != tuple(param.placements):
                shard.grad = grad.redistribute(self.mesh, shard.placements)
            else:
                with torch.no_grad():
                    block = master_block(grad.to_local(), cuts, self.mesh.shape, self.coordinate)
                    block = block.clone() if zero == 2 else block.contiguous()
                    shard.grad = block_as_dtensor_of(block, shard)
            if zero == 2:
                param.grad = None

    def after_step(self, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
        """Each updated stage-1/2 shard gathered back into its parameter: the shards that
        are blocks of their parameters (:attr:`cuts`) in flat buckets of up to
        ``bucket_bytes`` of parameter per mesh-axis set and dtype, one all-gather per
        bucket and axis (:func:`~meshplace.runtime.sharded.gather_master_shards_in_buckets`);
        the rest by DTensor's redistribution, one collective each."""
        import torch

        from meshplace.runtime.sharded import gather_master_shards_in_buckets

        members = []
        with torch.no_grad():
            for name, (param, shard, zero) in self.masters.items():
                if zero >= 3:
                    continue
                cuts = self.cuts.get(name)
                if cuts is None:
                    gathered = shard.redistribute(self.mesh, param.placements)
                    param.to_local().copy_(gathered.to_local())
                    continue
                members.append((param.to_local(), shard.to_local(), cuts))
            gather_master_shards_in_buckets(members, self.mesh, bucket_bytes)

    def reduce_scatter_gradients(self, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
        """Stage 2's gradients that are partial sums over exactly the axes their master
        shards are cut along (data parallelism's, before any reduction) reduce-scattered
        onto the shards, in flat buckets of up to ``bucket_bytes`` of gradient per axis set
        and dtype, one reduce-scatter per bucket and axis
        (:func:`~meshplace.runtime.sharded.reduce_scatter_master_blocks`), and the whole
        gradients dropped: ZeRO's P_os+g, half an all-reduce's bytes, and no rank holds
        a whole summed gradient. The rest are left to :meth:`after_backward`. O(bytes
        reduced)."""
        import torch

        from meshplace.runtime.sharded import (
            block_as_dtensor_of,
            buckets_of,
            reduce_scatter_master_blocks,
        )

        groups: dict[tuple, list[tuple[Any, Any, tuple[tuple[int, int], ...]]]] = {}
        for name, (param, shard, zero) in self.masters.items():
            cuts = self.cuts.get(name)
            if zero != 2 or cuts is None or param.grad is None:
                continue
            if not self._summed_over_exactly(param.grad.placements, param.placements, cuts):
                continue
            axes = tuple(axis for axis, _ in cuts)
            groups.setdefault((axes, param.grad.dtype), []).append((param, shard, cuts))

        def grad_bytes(member: tuple[Any, Any, Any]) -> int:
            return member[0].grad.to_local().numel() * member[0].grad.element_size()

        with torch.no_grad():
            for (axes, _), group in groups.items():
                for bucket in buckets_of(group, grad_bytes, bucket_bytes):
                    blocks = reduce_scatter_master_blocks(
                        [(param.grad.to_local(), cuts) for param, _, cuts in bucket],
                        self.mesh,
                        axes,
                    )
                    for (param, shard, _), block in zip(bucket, blocks, strict=True):
                        shard.grad = block_as_dtensor_of(block, shard)
                        param.grad = None

    def _summed_over_exactly(
        self, placed: Sequence[Any], wanted: Sequence[Any], cuts: tuple[tuple[int, int], ...]
    ) -> bool:
        """Whether a gradient placed ``placed`` is its parameter's (placements
        ``wanted``) up to a partial sum over each axis in ``cuts`` (and over axes of one
        rank, where a partial sum is the value)."""
        cut_axes = {axis for axis, _ in cuts}
        for axis, (have, want) in enumerate(zip(placed, wanted, strict=True)):
            summed = (
                have.is_partial()
                and getattr(have, "reduce_op", "sum") == "sum"
                and want.is_replicate()
            )
            if axis in cut_axes:
                if not summed:
                    return False
            elif have != want and not (summed and self.mesh.shape[axis] == 1):
                return False
        return True

    def gradients_placed(self, model: Any) -> int:
        """After the backward: stage 2's data-parallel gradients reduce-scattered onto
        their master shards (:meth:`reduce_scatter_gradients`), every other gradient
        given its parameter's placement (:func:`place_gradients_like_parameters`) and
        moved onto its master shard; this rank's gradient bytes then
        (:meth:`gradient_bytes`)."""
        self.reduce_scatter_gradients()
        place_gradients_like_parameters(model)
        self.after_backward()
        return self.gradient_bytes(model)

    def update(self, model: Any, optimizer: Any) -> int:
        """The step after the backward: :meth:`gradients_placed`, the optimizer's step,
        the shards gathered back, gradients cleared. Returns this rank's gradient bytes
        just before the optimizer's step."""
        held = self.gradients_placed(model)
        optimizer.step()
        self.after_step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        return held

    def gradient_bytes(self, model: Any) -> int:
        """This rank's gradient bytes between backward and the step: every parameter's
        own (a stage-3 shard's included), and the master shards' of stage 2 (whose whole
        gradients are gone)."""
        from meshplace.runtime.sharded import local_nbytes

        own = sum(local_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
        return own + sum(
            local_nbytes(s.grad)
            for _, s, z in self.masters.values()
            if z == 2 and s.grad is not None
        )


class ShardedTraining:
    """One rank's share of a sharding plan, ready to train: the ``FILE.py:build`` model
    built from seed 0, its parameters DTensors with the plan's placements on the plan's
    ``DeviceMesh`` (``torch.distributed`` already initialised), weight-update sharding
    (:class:`WeightUpdateSharding`), the inputs placed, and Adam. :meth:`step` is one
    training step exactly as :func:`run_sharded_plan` times it, so what a dry run records
    (:mod:`meshplace.runtime.dryrun`) is what a run executes."""

    engine = "dtensor"
    fsdp_units = 0

    def __init__(
        self,
        plan: dict[str, Any],
        source: str,
        *,
        lr: float,
        device_type: str,
        built: tuple | None = None,
    ) -> None:
        import torch

        from meshplace.graph.sources import build_from_seed
        from meshplace.runtime.program import concrete_inputs
        from meshplace.runtime.sharded import (
            HostAttention,
            apply_sharding_plan,
            device_mesh,
            distribute_inputs,
            materialize_meta_buffers,
            rank_device,
        )
        from meshplace.runtime.spatial import use_spatial_convolutions

        # the same on every rank
        model, args, kwargs = built if built is not None else build_from_seed(source)
        refuse_channel_split_convolutions(plan)
        use_spatial_convolutions(model)  # a convolution of a split image: halo exchange
        device = rank_device(device_type)
        mesh = device_mesh(plan, device_type)
        # a model built on the meta device: each parameter's block only, never the whole
        built_on_meta = any(p.is_meta for p in model.parameters())
        self.meta_buffers = materialize_meta_buffers(model, device)
        if not built_on_meta:
            model.to(device)
        apply_sharding_plan(model, plan, mesh)
        if built_on_meta:
            for name, buffer in list(model.named_buffers()):
                if buffer.device != device:
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr, buffer.to(device))
        self.zero = WeightUpdateSharding(model, plan, mesh)
        self.uneven = self.zero.uneven
        names = list(plan["inputs"])  # positional inputs first, then keywords, as captured
        # a build that gives shapes only (meta inputs) trains on what real_inputs makes
        values = [a.to(device) for a in concrete_inputs([*args, *kwargs.values()])]
        if len(values) != len(names):
            raise InputError(
                f"{source} gives {len(values)} inputs and the plan has {len(names)}: "
                "it was made for another model"
            )
        placed = distribute_inputs(plan, dict(zip(names, values, strict=True)), mesh)
        self.args = tuple(placed[n] for n in names[: len(args)])
        self.kwargs = {k: placed[k] for k in kwargs}
        # foreach, as torchtitan does: on CPU torch's default is the per-tensor loop, whose
        # ~10 element-wise ops per parameter each pay DTensor's dispatch (2-4 ms of a 40 ms
        # step of the fidelity benchmark's MLP); the update rule is the same
        self.optimizer = torch.optim.Adam(
            self.zero.optimizer_parameters(model), lr=lr, foreach=True
        )
        self.model, self.mesh, self.device_type = model, mesh, device_type
        self.attention = HostAttention()  # the steps' attention kernels, decided on the first

    def step(self) -> tuple[Any, int]:
        """One training step: forward and backward under DTensor
        (:func:`meshplace.runtime.sharded.sharded_step`), then the weight update. Returns
        the loss and this rank's gradient bytes just before the optimizer's step."""
        from meshplace.graph.capture import as_loss
        from meshplace.runtime.sharded import sharded_step

        with sharded_step(self.device_type, self.attention):
            loss, _how = as_loss(self.zero.forward(self.model, self.args, self.kwargs))
            loss.backward()
        return loss, self.zero.update(self.model, self.optimizer)

    def loss_value(self, loss: Any) -> float:
        """The loss of the whole batch (DTensor computed it whole: gathered, if split)."""
        value = loss.detach()
        return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def sharding_training(
    plan: dict[str, Any], source: str, *, lr: float, device_type: str, engine: str = "auto"
) -> tuple[Any, str | None]:
    """One rank's training of a sharding plan on the engine that runs it — DDP (ZeRO 0 and 1)
    or FSDP2 (ZeRO 3) for pure data parallelism whose loss is a mean or sum over the
    batch, DTensor (:class:`ShardedTraining`) for everything else or with ``engine``
    ``"dtensor"`` — and, for a pure data-parallel plan kept on DTensor, why (a note for
    the report). Both have ``step``, ``loss_value``, ``model``, ``mesh``, ``optimizer``,
    ``engine``, ``uneven`` and ``meta_buffers``."""
    from meshplace.graph.sources import build_from_seed
    from meshplace.runtime.data_parallel import DataParallelTraining, data_parallel_stage
    from meshplace.runtime.sharded import check_plan_matches

    if engine not in ENGINES:
        raise InputError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    built = build_from_seed(source)  # the same on every rank
    check_plan_matches(built[0], plan)  # DDP and FSDP2 would wrap any model
    stage = data_parallel_stage(plan) if engine == "auto" else None
    note = None
    if stage is not None:
        training = DataParallelTraining.create(
            plan, built, stage=stage, lr=lr, device_type=device_type
        )
        if training is not None:
            return training, None
        note = (
            "the plan is pure data parallelism, but it runs on DTensor: the model is built "
            "on the meta device, or its loss is not a mean or sum over equal shards of the "
            "batch (DDP and FSDP2 average the ranks' gradients)"
            + (
                ", or a parameter splits evenly along none of its dimensions (ZeRO 1)"
                if stage == 1
                else ""
            )
        )
    return ShardedTraining(plan, source, lr=lr, device_type=device_type, built=built), note


class ShardedRankSteps:
    """One rank's timed steps of a sharding plan, as :func:`run_sharded_plan` runs them:
    the training on its engine (:func:`sharding_training`), the rank's activity published
    for the launcher (:func:`meshplace.runtime.activity.watch_modules`, the fault hook of
    ``MESHPLACE_TORCHRUN_FAULT``), and each :meth:`step` after a barrier, its wall-clock
    and CPU time measured around the engine's step alone. A benchmark that sets the
    runtime beside a hand-written engine step by step calls the same :meth:`step`
    (``benchmarks/sharded_overhead.py --interleaved``). ``torch.distributed`` must be
    initialised. O(modules) to set up."""

    def __init__(
        self,
        plan: dict[str, Any],
        source: str,
        *,
        lr: float,
        device_type: str,
        engine: str = "auto",
    ) -> None:
        import torch

        from meshplace.runtime.activity import RankActivity, module_places, watch_modules

        self.training, self.engine_note = sharding_training(
            plan, source, lr=lr, device_type=device_type, engine=engine
        )
        self.device_type = device_type
        self.rank = torch.distributed.get_rank()
        # where this rank is, for the launcher to name if it dies (runtime/activity.py)
        self.activity = RankActivity(
            self.rank, torch.distributed.get_world_size(), module_places(self.training.model)
        )
        self.fault_step = fault_step_of(os.environ.get(FAULT_ENV, ""), self.rank)
        self.current = 0
        #: the activity hooks' handles (``handle.remove()`` takes one off)
        self.hooks = watch_modules(
            self.training.model, self.activity, on_leaf=self._kill_if_faulted
        )

    def _kill_if_faulted(self) -> None:  # tests: die in the forward, as a crash would
        if self.current == self.fault_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def step(self, index: int, record: bool = False) -> tuple[Any, int, float, float, Any]:
        """Step ``index`` (0-based) after a barrier of the ranks: the rank's loss, its
        gradient bytes, the step's wall-clock and CPU seconds (this process, all threads),
        and with ``record`` the step's kernels and collectives
        (:func:`meshplace.runtime.dryrun.recorded_step`; the recording is in the times)."""
        import torch

        from meshplace.runtime.dryrun import recorded_step

        self.current = index
        self.activity.meet_for_step(index)
        program = None
        start, cpu_start = time.perf_counter(), time.process_time()
        if record:
            loss, grad_bytes, program = recorded_step(self.training)
        else:
            loss, grad_bytes = self.training.step()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        return loss, grad_bytes, wall, cpu, program


def run_sharded_plan(
    plan: dict[str, Any],
    source: str,
    *,
    steps: int,
    warmup: int,
    lr: float,
    device_type: str,
    checkpoint_dir: str | None = None,
    engine: str = "auto",
) -> dict[str, Any]:
    """Train the model of ``source`` under ``plan`` for ``steps`` Adam steps on this rank
    (``torch.distributed`` already initialised), on the engine :func:`sharding_training`
    chooses (``engine``: ``auto`` or ``dtensor``); what this rank measured.
    ``checkpoint_dir``: after the last step every parameter is gathered whole (DTensor's
    ``full_tensor``, on every rank) and rank 0 writes them there (``rank0.pt``, a dict
    name → tensor). Rank 0 records its last warm-up step's kernels and collectives
    (:func:`meshplace.runtime.dryrun.recorded_step`; untimed, so the recording costs no
    measured time) as ``program``, for the prediction of the step as its engine runs it."""
    import torch

    from meshplace.runtime.dryrun import EngineProgram
    from meshplace.runtime.sharded import local_nbytes, optimizer_state_bytes, peak_bytes

    rank_steps = ShardedRankSteps(plan, source, lr=lr, device_type=device_type, engine=engine)
    training = rank_steps.training
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = training.model
    times: list[float] = []
    cpu_times: list[float] = []  # the process's CPU time in each step (step_timing)
    losses: list[float] = []
    grad_bytes = 0
    program: EngineProgram | None = None
    for step in range(steps):
        record = rank_steps.rank == 0 and step == warmup - 1
        loss, grad_bytes, wall, cpu, recorded = rank_steps.step(step, record=record)
        if recorded is not None:
            program = recorded
        times.append(wall)
        cpu_times.append(cpu)
        losses.append(training.loss_value(loss))
    state_bytes = optimizer_state_bytes(training.optimizer)
    peak = peak_bytes(device_type)
    if checkpoint_dir is not None:
        whole = {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for name, p in model.named_parameters()
        }
        if rank_steps.rank == 0:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            torch.save(whole, Path(checkpoint_dir) / "rank0.pt")
    return {
        "times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "parameters": sum(local_nbytes(p) for p in model.parameters()),
        "gradients": grad_bytes,
        "optimizer_state": state_bytes,
        "peak_bytes": peak,
        "uneven": training.uneven,
        "meta_buffers": training.meta_buffers,
        "engine": training.engine,
        "engine_note": rank_steps.engine_note,
        "program": program.to_dict() if program is not None else None,
    }


def fault_step_of(fault: str, rank: int) -> int | None:
    """The step (0-based) at which ``MESHPLACE_TORCHRUN_FAULT`` (``"RANK:STEP"``) makes
    rank ``rank`` kill itself, or None.

    >>> fault_step_of("1:2", 1), fault_step_of("1:2", 0), fault_step_of("", 0)
    (2, None, None)
    """
    who, _, when = fault.partition(":")
    return int(when) if who == str(rank) and when.isdigit() else None


def step_timing(per_rank: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The step times of a run from every rank's ``times_s``: per step the slowest rank's
    (a step ends when its last rank does), and their median after ``warmup`` steps (at
    least one step is timed). Where every rank also gives ``cpu_times_s`` (the CPU time
    its process spent in each step, all its threads: ``time.process_time``),
    ``cpu_time_s_per_rank`` is each rank's median after ``warmup``: the step's work without
    the time the rank waited, for its peers or for a host busy with other jobs (on a
    shared host the steadier measure of what a runtime adds; ``benchmarks/
    sharded_overhead.py``).

    >>> step_timing([{"times_s": [5.0, 1.0, 2.0]}, {"times_s": [4.0, 3.0, 1.0]}], 1)
    {'steps': 3, 'warmup': 1, 'step_time_s': 2.5, 'step_times_s': [5.0, 3.0, 2.0]}
    >>> ranks = [{"times_s": [5.0, 2.0], "cpu_times_s": [4.0, 1.0]}] * 2
    >>> step_timing(ranks, 1)["cpu_time_s_per_rank"]
    [1.0, 1.0]
    """
    steps = len(per_rank[0]["times_s"])
    slowest = [max(r["times_s"][k] for r in per_rank) for k in range(steps)]
    skip = min(warmup, steps - 1)
    timing = {
        "steps": steps,
        "warmup": skip,
        "step_time_s": statistics.median(slowest[skip:]),
        "step_times_s": slowest,
    }
    if all("cpu_times_s" in r for r in per_rank):
        timing["cpu_time_s_per_rank"] = [
            statistics.median(r["cpu_times_s"][skip:]) for r in per_rank
        ]
    return timing


def measured_times(timing: dict[str, Any]) -> dict[str, Any]:
    """The step-time entries of a run report's ``measured`` from :func:`step_timing`'s
    result: ``step_time_s``, ``step_times_s`` and, where the ranks measured it,
    ``cpu_time_s_per_rank``.

    >>> measured_times({"steps": 1, "warmup": 0, "step_time_s": 2.0, "step_times_s": [2.0]})
    {'step_time_s': 2.0, 'step_times_s': [2.0]}
    """
    keys = ("step_time_s", "step_times_s", "cpu_time_s_per_rank")
    return {key: timing[key] for key in keys if key in timing}


def summarise(
    plan: dict[str, Any],
    per_rank: list[dict[str, Any]],
    *,
    source: str,
    warmup: int,
    device: str,
    cluster: str | None = None,
    calibration: str | None = None,
) -> dict[str, Any]:
    """Rank 0's report: every rank's measurements beside the plan's predictions — the
    solver's, the engine price the plan was chosen by where it has one
    (``predicted.engine_planned``: ``shard --engine-costs``), and (``predicted.engine``)
    the step as its engine ran it on rank 0 (its recorded warm-up step) costed by the
    cost model of ``calibration`` on ``cluster``'s devices
    (:func:`meshplace.runtime.dryrun.engine_prediction`)."""
    from meshplace.runtime.dryrun import EngineProgram, engine_prediction

    timing = step_timing(per_rank, warmup)
    predicted = dict(plan.get("predicted") or {})
    if "engine" in predicted:  # the price the plan was chosen by (shard --engine-costs)
        predicted["engine_planned"] = predicted.pop("engine")
    memory = predicted.get("memory_bytes") or {}
    notes = []
    meta_buffers = per_rank[0].get("meta_buffers", [])
    if meta_buffers:
        notes.append(
            f"the model was built on the meta device: its {len(meta_buffers)} buffers "
            f"({', '.join(meta_buffers[:3])}) start as zeros (running_var ones), not as the "
            "model computes them"
        )
    recorded = per_rank[0].get("program")
    if recorded is None:
        notes.append(
            "no warm-up step was recorded (--warmup 0): no prediction as its engine runs it"
        )
    else:
        try:
            predicted["engine"] = engine_prediction(
                plan, EngineProgram.from_dict(recorded), cluster=cluster, calibration=calibration
            )
        except InputError as exc:
            notes.append(f"no prediction as its engine runs it: {exc}")
    if per_rank[0].get("engine_note"):
        notes.append(per_rank[0]["engine_note"])
    if per_rank[0].get("engine") == "ddp" and recorded is not None and warmup < 3:
        notes.append(
            f"the step predicted as DDP ran it is warm-up step {warmup} of {warmup}, in "
            "which DDP rebuilds its buckets once (broadcasts later steps do not run): "
            "--warmup 3 records a steady step"
        )
    uneven = per_rank[0].get("uneven", [])
    if uneven:
        notes.append(
            f"{len(uneven)} parameters with weight-update sharding have no dimension their "
            f"replica count divides ({', '.join(uneven[:3])}): their blocks are uneven, the "
            "plan's flat shards are not"
        )
    return {
        "model": source,
        "world_size": len(per_rank),
        "mesh": plan["mesh"],
        "device": device,
        "engine": per_rank[0].get("engine", "dtensor"),
        "steps": timing["steps"],
        "warmup": timing["warmup"],
        "measured": {
            **measured_times(timing),
            "losses": per_rank[0]["losses"],
        },
        "predicted": {"cluster": plan.get("cluster"), **predicted},
        "memory_per_rank": {
            kind: {"predicted": memory.get(kind), "measured": [r[kind] for r in per_rank]}
            for kind in ("parameters", "gradients", "optimizer_state")
        },
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "peak_kind": peak_kind(device),
        "notes": notes,
    }


def check_prediction_options(
    args: argparse.Namespace, plan: dict[str, Any], *, sharding: bool, placement: bool = False
) -> None:
    """``--cluster`` and ``--calibration`` apply to sharding and placement plans (not
    hybrid ones) and must be readable — for a placement, the cluster (the plan's own by
    default) must have the plan's devices and the calibration's device kind — and
    ``--engine`` to sharding and hybrid plans (not placements): one :class:`InputError`
    sentence otherwise, before any rank starts."""
    from meshplace.cost.calibration import load_calibration
    from meshplace.hardware import load_cluster

    cluster, calibration = getattr(args, "cluster", None), getattr(args, "calibration", None)
    for flag, value in (("--cluster", cluster), ("--calibration", calibration)):
        if value is not None and not (sharding or placement):
            raise InputError(f"{flag} applies to sharding and placement plans, not to {args.plan}")
    if getattr(args, "engine", None) not in (None, "auto") and placement:
        raise InputError(f"--engine applies to sharding and hybrid plans, not to {args.plan}")
    if placement and (cluster is not None or calibration is not None):
        prediction_cost_model(plan, cluster, calibration)
        return
    if cluster is not None:
        load_cluster(cluster)
    if calibration is not None:
        load_calibration(calibration)


def prediction_cost_model(
    plan: dict[str, Any], cluster: str | None, calibration: str | None
) -> tuple[Any, Any]:
    """``(cluster, cost model)`` that predict a placement ``plan``'s run: ``cluster`` (a
    preset or YAML; default the plan's own) with the cost model of ``calibration``
    (:func:`meshplace.cost.calibration.calibrated_cost_model`; default the catalogue's).
    One :class:`InputError` sentence when the cluster cannot be loaded, lacks a device
    the plan places ops on, or has no device of the calibration's kind."""
    from meshplace.cost.calibration import calibrated_cost_model, load_calibration
    from meshplace.cost.compute import CostModel
    from meshplace.hardware import load_cluster

    name = cluster if cluster is not None else str(plan.get("cluster") or "")
    if not name:
        raise InputError("the plan names no cluster to predict its run on; pass --cluster")
    try:
        loaded = load_cluster(name)
    except InputError as exc:
        if cluster is not None:
            raise
        raise InputError(
            f"the plan's cluster {name!r} cannot be loaded ({exc}); pass --cluster"
        ) from None
    used = set((plan.get("placement") or {}).values())
    if plan.get("default_device"):
        used.add(plan["default_device"])
    missing = sorted(used - set(loaded.device_names))
    if missing:
        raise InputError(
            f"cluster {loaded.name!r} has no device {missing[0]!r}, which the plan places ops on"
        )
    if calibration is None:
        return loaded, CostModel()
    return loaded, calibrated_cost_model(load_calibration(calibration), loaded)


def simulated_placement_step(
    placed: Any,
    graph: Any,
    cluster: Any,
    cost_model: Any,
    *,
    micro_batches: int | None = None,
    schedule: str = "1F1B",
) -> dict[str, Any]:
    """A placement run's step as the simulator predicts it on ``cluster`` under
    ``cost_model`` (what ``meshplace simulate --plan --calibration`` says of the same
    plan): a pipelined placement (``micro_batches`` > 1) by the throughput objective's
    ``schedule`` at those micro-batches — the calibrated engine, messages or exchange
    charged per micro-batch (:class:`meshplace.cost.pipeline.HostCosts`) — any other as
    one step of the event simulation. O(simulation).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> from meshplace.hardware import load_cluster
    >>> from meshplace.cost.compute import CostModel
    >>> from meshplace.plan import Plan
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("a", "matmul", flops=1e9))
    >>> plan = Plan.from_devices(g, "colocrl-2gpu", ["gpu0"])
    >>> out = simulated_placement_step(plan, g, load_cluster("colocrl-2gpu"), CostModel())
    >>> out["cluster"], out["micro_batches"], out["step_time_s"] > 0
    ('colocrl-2gpu', 1, True)
    """
    from meshplace.sim.simulator import Simulator

    simulator = Simulator(graph, cluster, cost_model)
    placement = simulator.placement_of(placed.device_names(graph, "the plan"))
    pipelined = micro_batches is not None and micro_batches > 1
    result = simulator.simulate(
        placement,
        objective="throughput" if pipelined else "step",
        micro_batches=micro_batches if pipelined else None,
        schedule=schedule.lower(),
    )
    scheduled = result.schedule
    return {
        "cluster": cluster.name,
        "step_time_s": float(result.throughput_time_s if pipelined else result.step_time_s),
        "micro_batches": int(result.micro_batches),
        "schedule": schedule if pipelined else None,
        "bubble_fraction": float(scheduled.bubble_fraction) if scheduled is not None else None,
    }


def uses_cuda(device: str, local_ranks: int) -> bool:
    """Whether this host's ``local_ranks`` ranks run on CUDA (NCCL) for ``--device``
    ``device``: ``cuda`` needs a GPU per local rank (NCCL refuses two ranks on one GPU),
    else an :class:`InputError`; ``auto`` takes CUDA only when there are that many GPUs,
    else the CPU (gloo); ``cpu`` never.

    >>> uses_cuda("cpu", 2)
    False
    """
    if device == "cpu":
        return False
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < local_ranks:
        raise InputError(
            f"--device cuda runs one rank per GPU: {local_ranks} ranks on this host, "
            f"{gpus} GPU{'s' if gpus != 1 else ''}"
        )
    return gpus >= local_ranks


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m meshplace.runtime`` on every torchrun rank."""
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    keep_freed_memory()
    from meshplace.runtime.hybrid_plan import check_hybrid_plan, is_hybrid

    try:
        if args.warmup >= args.steps:
            raise InputError(f"--warmup {args.warmup} must be fewer than --steps {args.steps}")
        plan = read_plan(args.plan)
        placement = plan["format"] == "meshplace.plan"
        check_prediction_options(
            args, plan, sharding=not placement and not is_hybrid(plan), placement=placement
        )
        pipelined = False
        if placement:
            from meshplace.plan.placement import plan_from_dict
            from meshplace.runtime.pipelined import SCHEDULES, is_pipelined

            placed = plan_from_dict(plan, args.plan)
            # --micro-batches 1 runs a pipeline plan as an op placement, one step at a time
            as_steps = args.micro_batches == 1 and is_pipelined(placed)
            pipelined = is_pipelined(placed) and not as_steps
            if pipelined:
                if args.schedule not in SCHEDULES:
                    raise InputError(
                        f"--schedule {args.schedule!r}: choose one of {', '.join(SCHEDULES)}"
                    )
                for flag in ("batch", "size", "memory_budget"):
                    if getattr(args, flag) is not None:
                        name = "--" + flag.replace("_", "-")
                        raise InputError(f"{name} does not apply to a pipelined placement")
                if args.model is None:
                    raise InputError(
                        "a pipelined placement runs a FILE.py:build model; pass --model"
                    )
                source = model_source({}, args.model)
            elif (args.micro_batches is not None and not as_steps) or args.schedule != "1F1B":
                raise InputError(
                    f"--micro-batches and --schedule apply to pipelined placements; {args.plan} "
                    "is not one (its objective is not throughput with several micro-batches)"
                )
            spec = placement_model(plan, args)
        else:
            for flag in ("batch", "size", "micro_batches"):
                if getattr(args, flag) is not None:
                    name = "--" + flag.replace("_", "-")
                    raise InputError(f"{name} applies to placement plans, not to {args.plan}")
            if args.schedule != "1F1B":
                raise InputError(f"--schedule applies to pipelined placements, not to {args.plan}")
            source = model_source(plan, args.model)
            if args.memory_budget is not None and not is_hybrid(plan):
                check_memory_budget(plan, args.memory_budget)
        if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
            raise InputError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file")
        if "WORLD_SIZE" not in os.environ:
            raise InputError("run it under torchrun (WORLD_SIZE is not set)")
        cuda = uses_cuda(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        hybrid = not placement and is_hybrid(plan)
        if hybrid:
            check_hybrid_plan(plan, int(os.environ["WORLD_SIZE"]), args.memory_budget)
        elif not placement:
            check_world(plan, int(os.environ["WORLD_SIZE"]))
    except InputError as exc:
        if rank == 0:
            print(f"meshplace: error: {exc}", file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    device_type = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    failed: list[Any] = [None] * dist.get_world_size()
    graph = None  # a placement run's step, which its prediction simulates
    try:
        try:
            if pipelined:
                from meshplace.runtime.pipelined import run_pipelined_plan

                mine, graph = run_pipelined_plan(
                    placed,
                    args.plan,
                    source,
                    micro_batches=args.micro_batches or placed.micro_batches,
                    steps=args.steps,
                    lr=args.lr,
                    schedule=args.schedule,
                    device_type=device_type,
                    checkpoint_dir=args.checkpoint_dir,
                    fault_step=fault_step_of(os.environ.get(FAULT_ENV, ""), dist.get_rank()),
                )
            elif placement:
                from meshplace.runtime.placed import run_placed_plan

                mine, graph = run_placed_plan(
                    placed,
                    args.plan,
                    spec,
                    steps=args.steps,
                    device_type=device_type,
                    memory_budget=args.memory_budget,
                    checkpoint_dir=args.checkpoint_dir,
                    fault=os.environ.get(FAULT_ENV, ""),
                )
            elif hybrid:
                from meshplace.runtime.hybrid import run_hybrid_plan

                mine = run_hybrid_plan(
                    plan,
                    source,
                    steps=args.steps,
                    lr=args.lr,
                    device_type=device_type,
                    checkpoint_dir=args.checkpoint_dir,
                    fault_step=fault_step_of(os.environ.get(FAULT_ENV, ""), dist.get_rank()),
                    engine=args.engine,
                )
            else:
                mine = run_sharded_plan(
                    plan,
                    source,
                    steps=args.steps,
                    warmup=args.warmup,
                    lr=args.lr,
                    device_type=device_type,
                    checkpoint_dir=args.checkpoint_dir,
                    engine=args.engine,
                )
            error = None
        except InputError as exc:  # every rank refuses (the same sentence), or one does
            mine, error = None, str(exc)
        dist.all_gather_object(failed, error)
        per_rank: list[Any] = [None] * dist.get_world_size()
        if not any(failed):
            dist.all_gather_object(per_rank, mine)
        # no rank tears the group down while another still uses it (gloo aborts the
        # process at exit otherwise: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    refusal = next((e for e in failed if e), None)
    if refusal is not None:
        if rank == 0:
            print(f"meshplace: error: {refusal}", file=sys.stderr)
        return 2
    if rank == 0:
        simulated, unpredicted = None, None
        if placement and (args.cluster is not None or args.calibration is not None):
            try:
                simulated = placement_run_prediction(args, plan, placed, graph)
            except InputError as exc:  # the run stands; its report says why
                unpredicted = f"the simulator could not predict this run: {exc}"
        if pipelined:
            report = summarise_pipeline(
                plan,
                per_rank,
                model=source,
                warmup=args.warmup,
                schedule=args.schedule,
                micro_batches=args.micro_batches or placed.micro_batches,
                device=device_type,
            )
        elif hybrid:
            from meshplace.runtime.hybrid import summarise_hybrid

            report = summarise_hybrid(
                plan, per_rank, source=source, warmup=args.warmup, device=device_type
            )
        elif placement:
            report = summarise_placement(
                plan, per_rank, model=spec.name, warmup=args.warmup, device=device_type
            )
        else:
            report = summarise(
                plan,
                per_rank,
                source=source,
                warmup=args.warmup,
                device=device_type,
                cluster=args.cluster,
                calibration=args.calibration,
            )
        if simulated is not None:
            report["predicted"]["simulated"] = simulated
        if unpredicted is not None:
            report["notes"].append(unpredicted)
        if args.json:
            print(json.dumps(report))
        else:
            print_report(report)
    return 0


def placement_run_prediction(
    args: argparse.Namespace, plan: dict[str, Any], placed: Any, graph: Any
) -> dict[str, Any]:
    """``--cluster``/``--calibration`` of a placement run: the run's step as the
    simulator predicts it (:func:`simulated_placement_step`) at the run's micro-batches
    and schedule, on ``graph`` (the step the rank ran: a pipelined placement's
    ``FILE.py:build`` captured whole, else the runtime model's traced step), with the
    calibration named."""
    from meshplace.runtime.pipelined import is_pipelined

    cluster, cost_model = prediction_cost_model(plan, args.cluster, args.calibration)
    micro_batches = (args.micro_batches or placed.micro_batches) if is_pipelined(placed) else 1
    out = simulated_placement_step(
        placed, graph, cluster, cost_model, micro_batches=micro_batches, schedule=args.schedule
    )
    return {**out, "calibration": args.calibration}


def placement_model(plan: dict[str, Any], args: argparse.Namespace) -> Any:
    """The :class:`~meshplace.runtime.program.ModelSpec` a placement plan runs: ``--model``
    or the plan's graph name, with ``--batch``/``--size``; one sentence if it is neither a
    runtime model nor ``FILE.py:FUNCTION``."""
    from meshplace.runtime.program import ModelSpec, known_models

    name = args.model or str(plan.get("graph", ""))
    if ".py:" not in name and name not in known_models():
        raise InputError(
            f"the placement's graph {name!r} is not a model the runtime knows; pass --model "
            "NAME or FILE.py:FUNCTION"
        )
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
        raise InputError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file")
    return ModelSpec(name, batch=args.batch, size=args.size)


def _placement_prediction(plan: dict[str, Any]) -> dict[str, Any]:
    """What a placement plan predicted, for the cluster it was made for."""
    meta = plan.get("meta") or {}
    return {
        "cluster": plan.get("cluster"),
        "step_time_s": meta.get("step_time_s"),
        "placer": meta.get("placer"),
    }


def _bytes_per_rank(per_rank: list[dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
    """Each rank's predicted and measured bytes of every kind in ``kinds``."""
    return {
        kind: {
            "predicted": [r["predicted_bytes"][kind] for r in per_rank],
            "measured": [r["held_bytes"][kind] for r in per_rank],
        }
        for kind in kinds
    }


def peak_kind(device: str) -> str:
    """What a report's peak bytes measure on ``device``."""
    return "cuda max_memory_allocated" if device == "cuda" else "process peak RSS"


def summarise_pipeline(
    plan: dict[str, Any],
    per_rank: list[dict[str, Any]],
    *,
    model: str,
    warmup: int,
    schedule: str,
    micro_batches: int,
    device: str,
) -> dict[str, Any]:
    """Rank 0's report of a pipelined run: the step times and losses beside the plan's
    prediction (for its own cluster), and each stage's bytes beside the plan's shares."""
    timing = step_timing(per_rank, warmup)
    return {
        "model": model,
        "plan": "pipeline",
        "world_size": len(per_rank),
        "device": device,
        "devices": [r["device"] for r in per_rank],
        "stage_begins": [r["stage_begins"] for r in per_rank],
        "schedule": schedule,
        "micro_batches": micro_batches,
        "steps": timing["steps"],
        "warmup": timing["warmup"],
        "measured": {
            **measured_times(timing),
            "losses": per_rank[-1]["losses"],
        },
        "predicted": _placement_prediction(plan),
        "memory_per_rank": _bytes_per_rank(per_rank, ("parameters", "optimizer_state")),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "peak_kind": peak_kind(device),
        "notes": [
            f"stage {k} begins at module {r['stage_begins']!r}, {r['ops_moved']} forward ops "
            "before the plan's cut (a stage begins at a submodule)"
            for k, r in enumerate(per_rank)
            if r["ops_moved"]
        ],
    }


def summarise_placement(
    plan: dict[str, Any], per_rank: list[dict[str, Any]], *, model: str, warmup: int, device: str
) -> dict[str, Any]:
    """Rank 0's report of a placement run: every rank's measurements beside the plan's
    predictions (its step time on the plan's cluster; each rank's share of the bytes)."""
    timing = step_timing(per_rank, warmup)
    timed = len(timing["step_times_s"]) - timing["warmup"]
    losses = next(r["losses"] for r in per_rank if r["losses"][0] is not None)
    return {
        "model": model,
        "plan": "placement",
        "world_size": len(per_rank),
        "devices": [r["device"] for r in per_rank],
        "ops_per_rank": [r["ops"] for r in per_rank],
        "device": device,
        "steps": timing["steps"],
        "warmup": timing["warmup"],
        "measured": {
            **measured_times(timing),
            "losses": losses,
            "wait_s_per_rank": [statistics.median(r["wait_s"][-timed:]) for r in per_rank],
            "bytes_sent_per_rank": [r["bytes_sent"] for r in per_rank],
            "messages_per_rank": [r["messages"] for r in per_rank],
        },
        "predicted": _placement_prediction(plan),
        "memory_per_rank": _bytes_per_rank(per_rank, ("parameters", "optimizer_state", "inputs")),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "peak_kind": peak_kind(device),
        "notes": [],
    }


def print_report(report: dict[str, Any]) -> None:
    """The report as a few lines of text."""
    m, p = report["measured"], report["predicted"]
    ranks = f"{report['world_size']} {report['device']} ranks"
    if report.get("plan") == "hybrid":
        mesh = " x ".join(
            f"{a} {n}" for a, n in zip(report["mesh"]["axes"], report["mesh"]["shape"], strict=True)
        )
        print(
            f"{report['model']} on {ranks} ({mesh}; {report['schedule']}, "
            f"{report['micro_batches']} micro-batches)"
        )
    elif report.get("plan") == "pipeline":
        pairs = zip(report["devices"], report["stage_begins"], strict=True)
        where = ", ".join(f"{d} (from {b or 'the inputs'})" for d, b in pairs)
        print(
            f"{report['model']} pipelined over {ranks} ({report['schedule']}, "
            f"{report['micro_batches']} micro-batches): {where}"
        )
    elif report.get("plan") == "placement":
        pairs = zip(report["devices"], report["ops_per_rank"], strict=True)
        where = ", ".join(f"{d} ({n} ops)" for d, n in pairs)
        print(f"{report['model']} placed on {ranks}: {where}")
    else:
        mesh = "x".join(map(str, report["mesh"]["shape"]))
        print(f"{report['model']} on a {mesh} mesh of {ranks}")
    planned = p.get("engine_planned")
    print(
        f"step: {m['step_time_s'] * 1e3:.2f} ms measured (median of "
        f"{report['steps'] - report['warmup']}); the plan predicted "
        + (
            f"{planned['step_s'] * 1e3:.2f} ms as its engine runs it (the solver: "
            f"{(p.get('step_time_s') or 0) * 1e3:.2f} ms)"
            if planned
            else f"{(p.get('step_time_s') or 0) * 1e3:.2f} ms"
        )
        + f" on {p.get('cluster')}"
    )
    simulated = p.get("simulated")
    if simulated:
        how = (
            f"{simulated['micro_batches']} micro-batches, {simulated['schedule']}, bubble "
            f"{100 * simulated['bubble_fraction']:.0f} %"
            if simulated["schedule"] and simulated["bubble_fraction"] is not None
            else "one step"
        )
        print(
            f"as the simulator runs it ({how}): {simulated['step_time_s'] * 1e3:.2f} ms "
            f"predicted on {simulated['cluster']}"
            + (f" with {simulated['calibration']}" if simulated["calibration"] else "")
        )
    engine = p.get("engine")
    if engine:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(engine["collectives"].items()))
        print(
            f"as its engine ran it ({engine['kernels']} kernels, {counts or 'no collectives'}): "
            f"{engine['step_s'] * 1e3:.2f} ms predicted on {engine['cluster']} (compute "
            f"{engine['compute_s'] * 1e3:.2f}, dispatch {engine['dispatch_s'] * 1e3:.2f}, "
            f"collectives {engine['communication_s'] * 1e3:.2f}"
            + (
                f", waiting for the slowest rank {engine['sync_s'] * 1e3:.2f}"
                if engine.get("sync_s")
                else ""
            )
            + " ms)"
        )
    print(f"loss: {' '.join(f'{v:.5g}' for v in m['losses'])}")
    for kind, v in report["memory_per_rank"].items():
        print(f"{kind} bytes: predicted {v['predicted']}, measured per rank {v['measured']}")
    peaks = report.get("peak_bytes_per_rank")
    if peaks:
        predicted = [
            f"{p[key] / 2**20:,.1f} MiB {what}"
            for key, what in (
                ("live_peak_bytes", "live tensors"),
                ("peak_memory_bytes", "the solver's bound"),
            )
            if p.get(key)
        ]
        print(
            f"peak memory per rank: measured {', '.join(f'{b / 2**20:,.1f}' for b in peaks)} "
            f"MiB ({report['peak_kind']}); predicted {' or '.join(predicted) or 'nothing'}"
        )
    for note in report["notes"]:
        print(f"note: {note}")
