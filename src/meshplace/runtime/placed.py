"""Run an op-placement plan (``meshplace plan --out``) under torchrun: one rank per device.

Source: the setting of Mirhoseini et al., "Device Placement Optimization with
Reinforcement Learning" (ICML 2017): every op of a training step runs on the device the
plan gives it, and tensors cross devices where an edge does. The plan's devices, sorted by
:func:`~meshplace.runtime.executor.natural_key`, become torchrun ranks 0..N-1.

Each rank traces the step on fake tensors with the model on the meta device
(``trace_step(spec, weights=False)``: no rank ever builds the whole model), then creates
only the parameters, buffers, Adam state and inputs of the ops placed on it
(:func:`~meshplace.runtime.executor.held_placeholders`), each from its name and the seed
(:func:`~meshplace.runtime.program.initial_value`), so every rank agrees with a
one-process run value for value. The ranks walk the traced graph in the same global order,
each its own nodes, with non-blocking sends and receives tagged by the producer's position
(:func:`~meshplace.runtime.executor.run_worker_steps`, the local runtime's worker loop):
the same arithmetic in the same order as one process, so losses and parameters are
bit-identical to :func:`~meshplace.runtime.executor.run_reference`.

What a rank holds is known before it allocates: :func:`share_bytes` reads it from the
OpGraph (``param_bytes`` and ``state_bytes`` of the ops on the rank's device, the bytes
the simulator keeps resident), and ``--memory-budget`` refuses a plan whose share exceeds
the budget before anything is created. The report puts the measured bytes beside it.

Example (2 ranks, on this host)::

    meshplace plan --graph nmt-small --cluster my2.yaml --out plan.json
    torchrun --standalone --nproc-per-node 2 -m meshplace.runtime --plan plan.json

Cost per step and rank: O(its fx nodes + its messages) Python dispatch plus the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.runtime.activity import RankActivity
from meshplace.runtime.executor import (
    Fault,
    natural_key,
    run_worker_steps,
)
from meshplace.runtime.program import ModelSpec, TracedStep, schedule_nodes, trace_step
from meshplace.runtime.sharded import peak_bytes, rank_device

#: Placement plan format (``meshplace.plan.placement.FORMAT``).
PLACEMENT_FORMAT = "meshplace.plan"


def plan_ranks(plan: Any, graph: OpGraph, source: str) -> tuple[list[str], list[int]]:
    """``(devices by rank, rank per op)`` of a placement plan bound to ``graph``: the
    distinct devices the plan uses, in natural order, are ranks 0..N-1. Raises
    :class:`~meshplace.plan.PlanError` (one sentence) if the plan was made for another
    graph.

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> from meshplace.plan import Plan
    >>> g = OpGraph("g")
    >>> for name in ("a", "b"):
    ...     _ = g.add_op(Op(name, "matmul"))
    >>> plan_ranks(Plan.for_graph(g, "c", {"a": "gpu:10", "b": "gpu:2"}), g, "p.json")
    (['gpu:2', 'gpu:10'], [1, 0])
    """
    plan.check_graph(graph, source)
    names = plan.device_names(graph, source)
    devices = sorted(set(names), key=natural_key)
    rank = {d: r for r, d in enumerate(devices)}
    return devices, [rank[d] for d in names]


def share_bytes(graph: OpGraph, op_rank: Sequence[int], rank: int) -> dict[str, int]:
    """What ``rank`` holds between steps under a placement, from the OpGraph: the bytes of
    the parameters and buffers (``param_bytes``), optimizer state (``state_bytes``) and
    input batches of the ops on it. O(ops).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("w", "parameter", param_bytes=8, state_bytes=16))
    >>> _ = g.add_op(Op("x", "input", output_shapes=[[1]]))
    >>> share_bytes(g, [0, 1], 0)
    {'parameters': 8, 'optimizer_state': 16, 'inputs': 0}
    """
    out = {"parameters": 0, "optimizer_state": 0, "inputs": 0}
    for op, r in zip(graph.ops, op_rank, strict=True):
        if r != rank:
            continue
        out["parameters"] += int(op.param_bytes)
        out["optimizer_state"] += int(op.state_bytes)
        if op.kind == "input":
            out["inputs"] += int(op.output_bytes())
    return out


def held_bytes(step: TracedStep, held: Mapping[int, torch.Tensor]) -> dict[str, int]:
    """The bytes of the placeholder values a rank holds (position in ``params, buffers,
    states, inputs`` order → tensor, as :class:`~meshplace.runtime.executor.WorkerOutcome`
    gives them), by kind as :func:`share_bytes` counts them. O(placeholders)."""
    n_p, n_b = len(step.param_names), len(step.buffer_names)
    n_s = n_p * step.n_state
    out = {"parameters": 0, "optimizer_state": 0, "inputs": 0}
    for k, v in held.items():
        if k < n_p + n_b:
            kind = "parameters"
        else:
            kind = "optimizer_state" if k < n_p + n_b + n_s else "inputs"
        out[kind] += v.numel() * v.element_size()
    return out


def checkpoint_names(step: TracedStep) -> list[str | None]:
    """A name per placeholder position: the parameter or buffer name, ``NAME.state.J`` for
    the J-th optimizer-state tensor of parameter NAME (Adam: 0 the first moment, 1 the
    second), ``None`` for inputs."""
    states = [f"{n}.state.{j}" for n in step.param_names for j in range(step.n_state)]
    return [*step.param_names, *step.buffer_names, *states, *[None] * len(step.inputs)]


def run_placed_plan(
    plan: Any,
    plan_path: str,
    spec: ModelSpec,
    *,
    steps: int,
    device_type: str,
    memory_budget: int | None = None,
    checkpoint_dir: str | None = None,
    fault: str = "",
) -> tuple[dict[str, Any], Any]:
    """Train ``spec`` under the placement ``plan`` for ``steps`` Adam steps on this rank
    (``torch.distributed`` initialised, one rank per device of the plan); what this rank
    measured and held, and the step's ``OpGraph`` (the launcher's prediction of the run
    simulates it rather than tracing the model again).

    ``memory_budget``: bytes this rank may hold between steps (parameters, buffers,
    optimizer state, inputs); a larger share is refused before anything is allocated.
    ``checkpoint_dir``: this rank writes its parameters and optimizer state there
    (``rank{R}.pt``, a dict name → tensor) after the last step. ``fault``
    (``"RANK:STEP"``, tests): that rank kills itself at that step's first node.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    step = trace_step(spec, weights=False)
    devices, op_rank = plan_ranks(plan, step.graph, plan_path)
    if len(devices) != world:
        raise InputError(
            f"{plan_path} places ops on {len(devices)} devices ({', '.join(devices[:4])}"
            f"{', …' if len(devices) > 4 else ''}); torchrun started {world} processes"
        )
    predicted = share_bytes(step.graph, op_rank, rank)
    total = sum(predicted.values())
    refusal = None
    if memory_budget is not None and total > memory_budget:
        refusal = (
            f"rank {rank} ({devices[rank]}) would hold {total:,} bytes of parameters, "
            f"optimizer state and inputs, over --memory-budget {memory_budget:,}"
        )
    # every rank refuses together, or none does: a rank that went on alone would wait
    # forever on a peer that left
    refusals: list[Any] = [None] * world
    dist.all_gather_object(refusals, refusal)
    first = next((r for r in refusals if r), None)
    if first is not None:
        raise InputError(first)
    sched = schedule_nodes(step, op_rank)
    device = rank_device(device_type)
    kill = None
    if fault.partition(":")[0] == str(rank):
        mine = [n for n, d in zip(sched.names, sched.device) if d == rank]
        kill = Fault(op=mine[0], kind="kill", step=int(fault.partition(":")[2]))
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # published where the launcher can read it if this rank dies (runtime/activity.py)
    activity = RankActivity(rank, world, [f"op {name!r}" for name in sched.names])
    outcome = run_worker_steps(
        rank, step, sched, steps, activity.status, kill, False, device=device
    )
    if checkpoint_dir is not None:
        names = checkpoint_names(step)
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        torch.save(
            {names[k]: v.detach().cpu() for k, v in outcome.held.items() if names[k] is not None},
            Path(checkpoint_dir) / f"rank{rank}.pt",
        )
    peak = peak_bytes(device_type)
    records = outcome.records
    report = {
        "device": devices[rank],
        "ops": sum(1 for r in op_rank if r == rank),
        "times_s": [r[1] - r[0] for r in records],
        "losses": [r[2] for r in records],
        "wait_s": [r[4] for r in records],
        "predicted_bytes": predicted,
        "held_bytes": held_bytes(step, outcome.held),
        "bytes_sent": outcome.bytes_sent,
        "messages": outcome.messages,
        "peak_bytes": peak,
    }
    return report, step.graph
