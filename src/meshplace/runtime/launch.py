"""Run a sharding plan under torchrun, the launcher users already have.

Usage (one process per device of the plan's mesh; ``--nnodes``/``--rdzv-*`` for several
hosts, as for any torchrun job)::

    torchrun --standalone --nproc-per-node 4 -m meshplace.runtime \\
        --plan plan.json [--model FILE.py:build] [--steps 10] [--warmup 2] [--json]

Each process reads its rank and the world from torchrun's environment (``env://``
rendezvous), joins a gloo (CPU) or NCCL (GPU) process group, builds the model from the plan's
``graph.source`` (or ``--model``) with a fixed seed, turns every parameter and input into a
DTensor with the plan's placements (:func:`meshplace.runtime.sharded.apply_sharding_plan`),
and trains for ``--steps`` Adam steps with PyTorch's own forward, backward and optimizer —
no meshplace interpreter on this path. Rank 0 prints what every rank measured beside the
plan's predictions: the median step time after ``--warmup`` steps (the slowest rank's, each
step), the loss of every step, and per rank the bytes of its parameter, gradient and
optimizer-state blocks (the plan predicts these exactly) and its peak memory (CUDA:
``max_memory_allocated``; CPU: the process's peak resident set, which includes the Python
runtime and is not comparable to the plan's tensor bytes).

The plan's predicted step time is for the cluster it was made for (``plan["cluster"]``);
on other hardware it is printed for reference, not as a prediction of this run (issue 15's
calibration is what will make it one).

Weight-update sharding (``zero`` > 0) is applied per parameter
(:class:`WeightUpdateSharding`: ZeRO stages 1 and 2 on DTensor; stage 3 runs as stage
2). Not yet here (issue 15): building each rank's share without the whole model first
(every rank builds the full model, then keeps its blocks), pipelined and op-placement
plans.

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
from meshplace.errors import InputError

#: Fault injection for tests: ``"RANK:STEP"`` makes that rank kill itself (SIGKILL) as
#: that step starts, as a crashed or OOM-killed process would end.
FAULT_ENV = "MESHPLACE_TORCHRUN_FAULT"


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m meshplace.runtime``."""
    parser = argparse.ArgumentParser(
        prog="python -m meshplace.runtime",
        description="Run a meshplace sharding plan (meshplace shard --out) under torchrun.",
    )
    parser.add_argument("--plan", required=True, help="plan JSON (meshplace.parallel_plan)")
    parser.add_argument(
        "--model", help="FILE.py:build (default: the plan's graph.source)", default=None
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="Adam steps (default 10)")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=2, help="steps not timed (default 2)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    return parser


def read_plan(path: str) -> dict[str, Any]:
    """The plan file, checked to be a ``meshplace.parallel_plan``."""
    from meshplace.runtime.sharded import PLAN_FORMAT

    try:
        plan = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"plan {path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"plan {path!r} is not readable JSON: {exc}") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise InputError(
            f"plan {path!r} is not a sharding plan (format {PLAN_FORMAT!r}, from "
            "`meshplace shard --out`)"
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


def zero_placements(placements: list[Any], shape: Sequence[int], mesh_shape: Sequence[int]) -> list:
    """The plan's placements of a parameter with every replica axis (``Replicate``) turned
    into ``Shard(d)``, ``d`` the first dimension whose block that axis's size divides (the
    plan's ZeRO shard is a flat ``1/N``: the same bytes where it divides evenly).

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> zero_placements([Shard(0), Replicate()], [8, 6], [4, 3])
    [Shard(dim=0), Shard(dim=1)]
    """
    from torch.distributed.tensor import Shard

    local = list(shape)
    for p, size in zip(placements, mesh_shape, strict=True):
        if p.is_shard():
            local[p.dim] //= size
    out = list(placements)
    for axis, (p, size) in enumerate(zip(placements, mesh_shape, strict=True)):
        if p.is_replicate() and size > 1:
            d = next((d for d, n in enumerate(local) if n % size == 0), 0)
            out[axis] = Shard(d)
            local[d] //= size
    return out


def refuse_split_convolutions(model: Any, plan: dict[str, Any]) -> None:
    """DTensor's convolution runs only on whole weights (and batch-split inputs): a plan
    that splits a convolution's weight is one sentence here, not an error deep in a rank.
    ``meshplace.runtime.spmd.run_plan`` executes such plans op by op."""
    import torch

    convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    for name, module in model.named_modules():
        if not isinstance(module, convs):
            continue
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            placements = plan["parameters"].get(full, {}).get("placements", [])
            if any(p != "Replicate()" for p in placements):
                raise InputError(
                    f"the plan splits convolution parameter {full!r} ({', '.join(placements)}), "
                    "and DTensor's convolution needs it whole; run it op by op with "
                    "meshplace.runtime.spmd.run_plan, or shard with the convolutions replicated"
                )


def place_gradients_like_parameters(model: Any) -> None:
    """Give every DTensor gradient its parameter's placements, as the plan places them:
    where DTensor ran a split weight's matmul on the gathered weight, the gradient comes
    back whole (a local slice makes it the parameter's block) or as a partial sum (a
    reduce-scatter). O(parameters)."""
    for p in model.parameters():
        g = p.grad
        placed = getattr(g, "placements", None)
        if placed is not None and tuple(placed) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


class WeightUpdateSharding:
    """The plan's weight-update sharding, per parameter, on DTensor.

    Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models" (SC 2020), Sec. 5: stage 1 shards the optimizer state over the
    data-parallel replicas, stage 2 the gradients too, stage 3 the parameters too. Here a
    parameter's replica axes are the mesh axes its plan placement replicates it over.

    The optimizer updates a master copy of the parameter sharded over its replica axes
    (:func:`zero_placements`). After backward (:meth:`after_backward`) the gradient is
    redistributed onto it — a reduce-scatter where it is a partial sum, a local slice where
    already reduced — and from stage 2 the whole gradient is dropped; after the step
    (:meth:`after_step`) the updated shard is all-gathered into the parameter.

    Stage 3 runs as stage 2 (listed in :attr:`whole`): keeping only the shard between uses
    needs FSDP's gather before each module's forward and backward. Storing the parameter
    as a sharded DTensor instead lets DTensor use it as a tensor-parallel weight, which
    changes the computation and fails on views DTensor cannot split (Llama's k/v heads).

    O(parameters) per step, plus the collectives.
    """

    def __init__(self, model: Any, plan: dict[str, Any], mesh: Any) -> None:
        import torch

        from meshplace.runtime.sharded import local_nbytes

        self.mesh = mesh
        self.masters: dict[str, tuple[Any, Any, int]] = {}
        self.uneven: list[str] = []
        self.whole: list[str] = []  # stage-3 parameters kept whole between steps
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
                self.whole.append(name)
            self.masters[name] = (param, shard, zero)

    def optimizer_parameters(self, model: Any) -> list[Any]:
        """What the optimizer updates: each weight-update-sharded parameter's master shard
        in its place, every other parameter as it is."""
        return [self.masters[n][1] if n in self.masters else p for n, p in model.named_parameters()]

    def after_backward(self) -> None:
        for param, shard, zero in self.masters.values():
            if param.grad is not None:
                shard.grad = param.grad.redistribute(self.mesh, shard.placements)
                if zero >= 2:
                    param.grad = None

    def after_step(self) -> None:
        import torch

        with torch.no_grad():
            for param, shard, _ in self.masters.values():
                param.to_local().copy_(shard.redistribute(self.mesh, param.placements).to_local())

    def gradient_bytes(self, model: Any) -> int:
        """This rank's gradient bytes between backward and the step: every parameter's
        own, and the master shards' of stage 2 (whose whole gradients are gone)."""
        from meshplace.runtime.sharded import local_nbytes

        own = sum(local_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
        return own + sum(
            local_nbytes(s.grad)
            for _, s, z in self.masters.values()
            if z >= 2 and s.grad is not None
        )


def run_sharded_plan(
    plan: dict[str, Any],
    source: str,
    *,
    steps: int,
    warmup: int,
    lr: float,
    device_type: str,
) -> dict[str, Any]:
    """Train the model of ``source`` under ``plan`` for ``steps`` Adam steps on this rank
    (``torch.distributed`` already initialised); what this rank measured."""
    import torch

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import load_build_function
    from meshplace.runtime.sharded import (
        apply_sharding_plan,
        device_mesh,
        distribute_inputs,
        local_nbytes,
        sharded_step,
    )

    torch.manual_seed(0)  # every rank builds the same weights and inputs
    built = load_build_function(source)()
    model, args = built[0], tuple(built[1])
    kwargs = dict(built[2]) if len(built) > 2 else {}
    refuse_split_convolutions(model, plan)
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    model.to(device)
    mesh = device_mesh(plan, device_type)
    apply_sharding_plan(model, plan, mesh)
    zero = WeightUpdateSharding(model, plan, mesh)
    names = list(plan["inputs"])  # positional inputs first, then keywords, as captured
    values = [a.to(device) for a in [*args, *kwargs.values()]]
    if len(values) != len(names):
        raise InputError(
            f"{source} gives {len(values)} inputs and the plan has {len(names)}: "
            "it was made for another model"
        )
    placed = distribute_inputs(plan, dict(zip(names, values, strict=True)), mesh)
    pos = tuple(placed[n] for n in names[: len(args)])
    kw = {k: placed[k] for k in kwargs}
    optimizer = torch.optim.Adam(zero.optimizer_parameters(model), lr=lr)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    losses: list[float] = []
    grad_bytes = 0
    fault = os.environ.get(FAULT_ENV, "")
    rank = torch.distributed.get_rank()
    for step in range(steps):
        if fault == f"{rank}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()
        start = time.perf_counter()
        with sharded_step(device_type):
            loss, _how = as_loss(model(*pos, **kw))
            loss.backward()
        place_gradients_like_parameters(model)
        zero.after_backward()
        grad_bytes = zero.gradient_bytes(model)
        optimizer.step()
        zero.after_step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        value = loss.detach()
        losses.append(float(value.full_tensor() if hasattr(value, "full_tensor") else value))
    state_bytes = sum(
        local_nbytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # Adam's step counter is a scalar
    )
    if device_type == "cuda":
        peak = int(torch.cuda.max_memory_allocated())
    else:
        import resource

        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return {
        "times_s": times,
        "losses": losses,
        "parameters": sum(local_nbytes(p) for p in model.parameters()),
        "gradients": grad_bytes,
        "optimizer_state": state_bytes,
        "peak_bytes": peak,
        "uneven": zero.uneven,
        "whole": zero.whole,
    }


def summarise(
    plan: dict[str, Any], per_rank: list[dict[str, Any]], *, source: str, warmup: int, device: str
) -> dict[str, Any]:
    """Rank 0's report: every rank's measurements beside the plan's predictions."""
    steps = len(per_rank[0]["times_s"])
    slowest = [max(r["times_s"][k] for r in per_rank) for k in range(steps)]
    timed = slowest[min(warmup, steps - 1) :]
    predicted = plan.get("predicted") or {}
    memory = predicted.get("memory_bytes") or {}
    notes = []
    whole = per_rank[0].get("whole", [])
    if whole:
        notes.append(
            f"{len(whole)} parameters have ZeRO stage 3 in the plan; they ran as stage 2 "
            "(whole parameters between steps, so more parameter bytes than predicted)"
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
        "steps": steps,
        "warmup": min(warmup, steps - 1),
        "measured": {
            "step_time_s": statistics.median(timed),
            "step_times_s": slowest,
            "losses": per_rank[0]["losses"],
        },
        "predicted": {"cluster": plan.get("cluster"), **predicted},
        "memory_per_rank": {
            kind: {"predicted": memory.get(kind), "measured": [r[kind] for r in per_rank]}
            for kind in ("parameters", "gradients", "optimizer_state")
        },
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "peak_kind": "cuda max_memory_allocated" if device == "cuda" else "process peak RSS",
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m meshplace.runtime`` on every torchrun rank."""
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.warmup >= args.steps:
            raise InputError(f"--warmup {args.warmup} must be fewer than --steps {args.steps}")
        plan = read_plan(args.plan)
        source = model_source(plan, args.model)
        if "WORLD_SIZE" not in os.environ:
            raise InputError("run it under torchrun (WORLD_SIZE is not set)")
        check_world(plan, int(os.environ["WORLD_SIZE"]))
    except InputError as exc:
        if rank == 0:
            print(f"meshplace: error: {exc}", file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device_type = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        mine = run_sharded_plan(
            plan, source, steps=args.steps, warmup=args.warmup, lr=args.lr, device_type=device_type
        )
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        # no rank tears the group down while another still uses it (gloo aborts the
        # process at exit otherwise: "terminate called without an active exception")
        dist.barrier()
    except InputError as exc:
        if rank == 0:
            print(f"meshplace: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if rank == 0:
        report = summarise(plan, per_rank, source=source, warmup=args.warmup, device=device_type)
        if args.json:
            print(json.dumps(report))
        else:
            print_report(report)
    return 0


def print_report(report: dict[str, Any]) -> None:
    """The report as a few lines of text."""
    m, p = report["measured"], report["predicted"]
    mesh = "x".join(map(str, report["mesh"]["shape"]))
    print(f"{report['model']} on a {mesh} mesh of {report['world_size']} {report['device']} ranks")
    print(
        f"step: {m['step_time_s'] * 1e3:.2f} ms measured (median of "
        f"{report['steps'] - report['warmup']}); the plan predicted "
        f"{(p.get('step_time_s') or 0) * 1e3:.2f} ms on {p.get('cluster')}"
    )
    print(f"loss: {' '.join(f'{v:.5g}' for v in m['losses'])}")
    for kind, v in report["memory_per_rank"].items():
        print(f"{kind}: predicted {v['predicted']:,.0f} B, measured per rank {v['measured']}")
    for note in report["notes"]:
        print(f"note: {note}")
