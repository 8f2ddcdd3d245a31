"""Run a pipelined placement under torchrun with ``torch.distributed.pipelining``.

Source: Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism" (NeurIPS 2019) and Narayanan et al., "PipeDream" (SOSP 2019; the 1F1B
schedule), as PyTorch implements them (``torch.distributed.pipelining``:
``pipeline``/``SplitPoint``, ``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``).

A placement plan whose objective is throughput with more than one micro-batch (``meshplace
plan --objective throughput``; the ``pipeline`` placer writes the micro-batch count whose
simulated 1F1B schedule is fastest) describes a pipeline: its forward ops form one
contiguous run per device, in the order the devices appear. :func:`stage_boundaries`
reads the module where each run begins (the first op of the next device: the child of the
two ops' common module path that holds it, e.g. ``layers.1``); torch's pipelining front
end traces the model once (``torch.export``) and splits it there into one
``PipelineStage`` per rank. The schedule
(1F1B by default, or GPipe) runs the plan's micro-batches through the stages; each rank's
Adam updates only its stage's parameters.

Every model input enters the first stage (:class:`InputsEnterFirst`): the front end gives a
later stage the inputs it reads directly (a language model's ``labels``), which the
schedules, feeding inputs to stage 0 only, cannot pass. The model returns its loss (a
0-dim tensor, or a tensor reduced by its mean, as capture does); the last stage reports it
per micro-batch, the schedule scales gradients by ``1 / micro-batches``, so a step equals
one full-batch step up to the summation order of the micro-batches' gradients.

Cost per step: the kernels, plus ``2 x micro-batches x (stages - 1)`` activation and
gradient messages.

Example (2 ranks)::

    meshplace plan model.py:build --cluster colocrl-2gpu --placer pipeline \\
        --objective throughput --out pipe.json
    torchrun --standalone --nproc-per-node 2 -m meshplace.runtime --plan pipe.json \\
        --model model.py:build
"""

from __future__ import annotations

import operator
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.runtime.activity import RankActivity
from meshplace.runtime.processes import one_rank_world

#: Schedules a pipelined plan can run with (``--schedule``).
SCHEDULES = ("1F1B", "GPipe")
_NOT_COMPUTE = ("parameter", "buffer", "input")


def is_pipelined(plan: Any) -> bool:
    """Whether a placement plan describes a pipeline: the throughput objective and more
    than one micro-batch."""
    return plan.objective == "throughput" and int(plan.micro_batches) > 1


def stage_boundaries(
    graph: OpGraph, device_names: Sequence[str]
) -> tuple[list[str], list[str], list[int]]:
    """``(devices in stage order, module where each later stage begins, forward ops moved
    to each later stage)`` of a pipelined placement.

    The forward compute ops, in graph order, must form one run per device. A stage can
    only begin where a submodule begins, so a run that begins inside a module's code is
    moved back to the start of a module holding its first op that begins after the previous
    run did: the one beginning last, the outermost on a tie (a cut inside
    ``layers.1.input_norm`` begins the stage at ``layers.1``); the ops that moves are
    counted. Raises :class:`InputError` (one
    sentence) when a device's forward ops are not contiguous or no such module exists.
    O(ops x module depth).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> for name, module in (("a", "embed"), ("b", "layers.0.mlp"), ("c", "layers.1.norm"),
    ...                      ("d", "layers.1.norm"), ("e", "layers.1.mlp")):
    ...     _ = g.add_op(Op(name, "matmul", module=module))
    >>> stage_boundaries(g, ["gpu0", "gpu0", "gpu1", "gpu1", "gpu1"])
    (['gpu0', 'gpu1'], ['layers.1'], [0])
    >>> stage_boundaries(g, ["gpu0", "gpu0", "gpu0", "gpu1", "gpu1"])
    (['gpu0', 'gpu1'], ['layers.1'], [1])
    """
    ops = [
        (op, device)
        for op, device in zip(graph.ops, device_names, strict=True)
        if op.phase == "forward" and op.kind not in _NOT_COMPUTE
    ]
    first: dict[str, int] = {}  # module path (and every prefix) -> its first forward op
    for i, (op, _) in enumerate(ops):
        parts = op.module.split(".") if op.module else []
        for d in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:d]), i)
    order: list[str] = []
    boundaries: list[str] = []
    moved: list[int] = []
    run_start = 0
    for i, (op, device) in enumerate(ops):
        if i and device != ops[i - 1][1]:
            if device in order:
                raise InputError(
                    f"the placement is not a pipeline torch can cut: {device}'s forward ops "
                    f"are not contiguous in execution order ({op.name!r} returns to it after "
                    f"{ops[i - 1][1]}); run it as an op placement with --micro-batches 1, or "
                    "plan one with `meshplace plan --placer pipeline --runnable-stages`"
                )
            parts = op.module.split(".") if op.module else []
            # the modules holding the op that begin after the previous run did; of those,
            # the one beginning last (fewest ops moved), the outermost on a tie
            holding = [".".join(parts[:d]) for d in range(1, len(parts) + 1)]
            after = [m for m in holding if first[m] > run_start]
            cut = max(after, key=lambda m: (first[m], -m.count("."))) if after else None
            if cut is None:
                raise InputError(
                    f"the placement starts a pipeline stage at op {op.name!r}, inside module "
                    f"{op.module or '(the model)'!r} whose code began in the previous stage; a "
                    "stage must begin at a submodule"
                )
            boundaries.append(cut)
            moved.append(i - first[cut])
            run_start = i
        if device not in order:
            order.append(device)
    return order, boundaries, moved


def run_stage_compiled(module: torch.nn.Module) -> int:
    """Run every ``InterpreterModule`` of a pipelining stage (``torch.export.unflatten``'s
    submodules, which the front end's stages are made of) as its generated Python code
    instead of node by node through ``torch.fx.Interpreter``; how many. Same ops, same
    order (the code is generated from the same graph, as ``GraphModule`` runs any graph);
    the interpreter cost about 0.5 ms per micro-batch on a stage of four Linear+GELU
    layers (a 1-stage pipeline on one gloo rank vs eager on the same chunks: 0.85-0.99 ms
    of overhead per micro-batch interpreted, 0.41-0.48 ms compiled, at 4 and 8
    micro-batches). O(modules), plus generating their code.
    """
    from torch.export.unflatten import InterpreterModule

    done = 0
    for sub in module.modules():
        if isinstance(sub, InterpreterModule) and getattr(sub, "graph_module", None) is not None:
            sub.graph_module.recompile()  # the graph as it is now
            sub._run_with_interpreter = False
            done += 1
    return done


def contiguous_between_stages(pipe: Any) -> int:
    """Make every tensor that one stage of ``pipe`` (``torch.distributed.pipelining``'s
    ``Pipe``, before ``build_stage``) sends another contiguous, at both ends: each stage
    module returns its tensor outputs through ``.contiguous()``, and a stage's inputs
    received from another stage are declared contiguous, so the receive buffers torch's
    stages allocate from that declaration (``empty_strided`` with the traced strides) are
    too. Why: torch keeps a value's traced strides, and neither gloo nor NCCL sends or
    receives a non-contiguous tensor ("input tensor has to be contiguous"), so a stage
    that began inside a module, where a transposed view crosses the cut (the Llama's
    queries when a stage begins at ``layers.1.attn.k_proj``), failed at its first message.
    The values and their gradients are unchanged (a copy, or nothing where a value is
    contiguous already); gradients w.r.t. a contiguous input come back contiguous
    (autograd's layout contract for leaves). Returns how many values it made contiguous.
    O(nodes of the split graph and the stage modules' outputs).
    """
    split = pipe.split_gm
    made = 0
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        module = split.get_submodule(node.target)
        graph = module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for value, placeholder in zip(node.args, placeholders):
            source = value
            while (
                isinstance(source, torch.fx.Node)
                and source.op == "call_function"
                and source.target is operator.getitem
            ):
                source = source.args[0]
            received = isinstance(source, torch.fx.Node) and source.op == "call_module"
            if received and _contiguous_value(placeholder):
                made += 1
        output = next(n for n in graph.nodes if n.op == "output")
        # every tensor output: its traced strides may say contiguous where the run's
        # kernel returns a view (``.contiguous()`` is a no-op where the tensor is)
        copy_of = {x: x for x in output.all_input_nodes}
        for x in output.all_input_nodes:
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor):
                with graph.inserting_before(output):
                    copy_of[x] = graph.call_method("contiguous", (x,))
                copy_of[x].meta = {**x.meta, "val": _contiguous_copy(val)}
                made += 1
        output.args = torch.fx.node.map_arg(output.args, copy_of.__getitem__)
        graph.lint()
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()  # its code, generated from the graph as it is now
        elif getattr(module, "graph_module", None) is not None:
            module.graph_module.recompile()
    return made


def _contiguous_copy(val: torch.Tensor) -> torch.Tensor:
    """``val.contiguous()`` for a traced value (a fake tensor computes under its own mode)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val.contiguous()
    with mode:
        return val.contiguous()


def _contiguous_value(placeholder: torch.fx.Node) -> bool:
    """Declare ``placeholder``'s traced value contiguous; whether it was not."""
    val = placeholder.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return False
    placeholder.meta["val"] = _contiguous_copy(val)
    return True


class InputsEnterFirst(torch.nn.Module):
    """``model`` with every tensor input passed through an identity op on entry, so that
    the pipelining front end hands all inputs to the first stage (see the module doc), and
    its loss returned as a 1-element tensor (the schedules concatenate micro-batch
    outputs)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        from meshplace.graph.capture import as_loss

        def enter(x: Any) -> Any:
            return x * 1 if isinstance(x, torch.Tensor) else x

        args = tuple(enter(a) for a in args)
        kwargs = {k: enter(v) for k, v in kwargs.items()}
        loss, _how = as_loss(self.model(*args, **kwargs))
        return loss.reshape(1)


class StageActivity(RankActivity):
    """A stage's places (runtime/activity.py): the forward and the backward of each
    micro-batch, then the optimizer step; the stage's forward calls in a step count the
    micro-batches."""

    def __init__(self, rank: int, world: int, micro_batches: int, stage: int | None = None) -> None:
        where = rank if stage is None else stage
        places = [
            f"the {phase} of micro-batch {i + 1} of {micro_batches} on stage {where}"
            for i in range(micro_batches)
            for phase in ("forward", "backward")
        ]
        super().__init__(rank, world, [*places, "the optimizer step"])
        self.forwards = 0
        self.kill_at_forward = False

    def start_step(self, step: int) -> None:
        super().start_step(step)
        self.forwards = 0


def watch_stage(
    module: torch.nn.Module, rank: int, world: int, micro_batches: int, stage: int | None = None
) -> Any:
    """Publish which micro-batch's forward or backward the stage ``module`` runs: a forward
    pre-hook counts the step's forwards, a forward hook hooks the outputs, whose gradient
    marks the micro-batch's backward as it starts. ``stage``: the stage's number where it
    is not the rank's (several ranks per stage). Returns the :class:`StageActivity`."""
    from torch.utils._pytree import tree_leaves

    activity = StageActivity(rank, world, micro_batches, stage)

    def backward_of(index: int) -> Any:
        def hook(_grad: Any) -> None:
            activity.at(index)

        return hook

    def pre(_module: Any, _args: Any) -> None:
        activity.at(2 * min(activity.forwards, micro_batches - 1))
        if activity.kill_at_forward:
            os.kill(os.getpid(), signal.SIGKILL)

    def post(_module: Any, _args: Any, output: Any) -> None:
        index = 2 * min(activity.forwards, micro_batches - 1) + 1
        activity.forwards += 1
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(backward_of(index))

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    return activity


def begin_stage_step(activity: StageActivity, index: int, fault: bool = False) -> None:
    """What a stage's rank does before step ``index`` (0-based) of a pipeline: it
    publishes that it waits for the other ranks, meets them at a barrier, and is then at
    the step's first forward; with ``fault`` (tests) it is to kill itself in that
    forward."""
    activity.meet_for_step(index)
    if fault:
        activity.kill_at_forward = True


def _chunk(value: Any, micro_batches: int) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0 or value.shape[0] % micro_batches:
        raise InputError(
            f"an input of shape {tuple(value.shape)} does not split into {micro_batches} "
            "micro-batches along its first dimension; pass --micro-batches"
        )
    return value.chunk(micro_batches)[0]


def run_schedule(
    runner: Any,
    first: bool,
    last: bool,
    inputs: Sequence[Any],
    keywords: dict[str, Any],
    target: torch.Tensor,
) -> list[Any]:
    """One step of a pipeline schedule on this rank's stage: the first stage feeds the
    inputs, the last the loss's target; the last stage's loss per micro-batch (empty
    elsewhere)."""
    micro: list[Any] = []
    if first and last:
        runner.step(*inputs, target=target, losses=micro, **keywords)
    elif first:
        runner.step(*inputs, **keywords)
    elif last:
        runner.step(target=target, losses=micro)
    else:
        runner.step()
    return micro


def measure_engine_overhead(source: str, micro_batches: int | None = None, reps: int = 20) -> float:
    """What ``torch.distributed.pipelining`` adds per micro-batch, measured in this
    process: the whole model as one stage (split and compiled as the runtime does,
    ``run_stage_compiled``) under ``Schedule1F1B`` on a gloo world of one, against the
    same chunks' forward and backward in eager PyTorch (one thread), the difference per
    micro-batch. The schedule's bookkeeping, the stage's input and output handling and the
    generated code's calls are in it; messages are not (a world of one sends none). The
    calibration file's ``pipeline_overhead_s``. ``micro_batches``: by default the most of
    8, 4, 2 and 1 that divide the model's batch (the first input's first dimension; the
    largest signal over the noise). Cost: ``2 (reps + 2)`` steps of the model.
    """
    import statistics

    from torch.distributed.pipelining import Schedule1F1B, pipeline

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed

    model, args, kwargs = build_from_seed(source)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    batch = int(first.shape[0]) if first is not None and first.dim() else 1
    if micro_batches is None:
        micro_batches = next(m for m in (8, 4, 2, 1) if batch % m == 0)
    elif micro_batches < 1 or batch % micro_batches:
        raise InputError(
            f"{source}: a batch of {batch} does not split into {micro_batches} micro-batches"
        )

    def chunks(k: int) -> tuple[list, dict]:
        def cut(x: Any) -> Any:
            return x.chunk(micro_batches)[k] if isinstance(x, torch.Tensor) else x

        return [cut(a) for a in args], {n: cut(v) for n, v in kwargs.items()}

    def eager() -> None:
        for k in range(micro_batches):
            a, kw = chunks(k)
            loss, _how = as_loss(model(*a, **kw))
            (loss / micro_batches).backward()
        model.zero_grad(set_to_none=True)

    with one_rank_world():
        a, kw = chunks(0)
        pipe = pipeline(InputsEnterFirst(model), mb_args=tuple(a), mb_kwargs=kw)
        stage = pipe.build_stage(0, torch.device("cpu"))
        run_stage_compiled(stage.submod)
        runner = Schedule1F1B(
            stage, n_microbatches=micro_batches, loss_fn=lambda out, _t: out.sum()
        )
        target = torch.zeros(micro_batches)

        def piped() -> None:
            runner.step(*args, target=target, losses=[], **kwargs)
            stage.submod.zero_grad(set_to_none=True)

        differences = []
        for i in range(reps + 2):  # interleaved, the first two untimed
            start = time.perf_counter()
            piped()
            middle = time.perf_counter()
            eager()
            if i >= 2:
                differences.append((middle - start) - (time.perf_counter() - middle))
    return max(0.0, statistics.median(differences) / micro_batches)


class PipelinedRankSteps:
    """One rank's timed steps of a pipelined placement, as :func:`run_pipelined_plan` runs
    them: the rank's stage cut from the model (torch's pipelining at the plan's stage
    boundaries), run as generated code, its schedule, Adam and inputs, the rank's
    activity published for the launcher; each :meth:`step` after a barrier, its
    wall-clock and CPU time measured around the schedule and the optimizer's step. A
    benchmark that sets the runtime beside torch's pipelining by hand step by step calls
    the same :meth:`step` (``benchmarks/pipeline_overhead.py --interleaved``).
    ``torch.distributed`` must be initialised, one rank per stage."""

    def __init__(
        self,
        plan: Any,
        plan_path: str,
        source: str,
        *,
        micro_batches: int,
        lr: float,
        schedule: str,
        device_type: str,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            SplitPoint,
            pipeline,
        )

        from meshplace.graph.capture import capture
        from meshplace.graph.sources import build_from_seed
        from meshplace.runtime.sharded import rank_device

        if schedule not in SCHEDULES:
            raise InputError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
        rank, world = dist.get_rank(), dist.get_world_size()
        model, args, kwargs = build_from_seed(source)  # the same on every rank
        graph = capture(model, args, example_kwargs=kwargs, training=True)
        plan.check_graph(graph, plan_path)
        names = plan.device_names(graph, plan_path)
        devices, boundaries, moved = stage_boundaries(graph, names)
        if len(devices) != world:
            raise InputError(
                f"{plan_path} is a pipeline of {len(devices)} stages ({', '.join(devices)}); "
                f"torchrun started {world} processes"
            )
        device = rank_device(device_type)
        pipe = pipeline(
            InputsEnterFirst(model),
            mb_args=tuple(_chunk(a, micro_batches) for a in args),
            mb_kwargs={k: _chunk(v, micro_batches) for k, v in kwargs.items()},
            split_spec={f"model.{b}": SplitPoint.BEGINNING for b in boundaries},
        )
        contiguous_between_stages(pipe)  # gloo and NCCL send contiguous tensors only
        self.stage = pipe.build_stage(rank, device)
        del pipe, model  # each rank keeps its stage only
        run_stage_compiled(self.stage.submod)
        self.runner = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule](
            self.stage, n_microbatches=micro_batches, loss_fn=lambda out, _target: out.sum()
        )
        self.optimizer = torch.optim.Adam(self.stage.submod.parameters(), lr=lr)
        self.first, self.last = rank == 0, rank == world - 1
        self.inputs = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        self.keywords = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        self.target = torch.zeros(micro_batches, device=device)  # the loss is the model's own
        self.activity = watch_stage(self.stage.submod, rank, world, micro_batches)
        self.rank, self.micro_batches, self.device_type = rank, micro_batches, device_type
        self.graph, self.names, self.devices = graph, names, devices
        self.boundaries, self.moved = boundaries, moved

    def step(self, index: int, *, fault: bool = False) -> tuple[float | None, float, float]:
        """Step ``index`` (0-based) after a barrier of the ranks: the batch's loss (on the
        last stage's rank, else None) and the step's wall-clock and CPU seconds (this
        process, all threads). ``fault`` (tests): the rank kills itself in the step's
        first micro-batch forward."""
        activity = self.activity
        begin_stage_step(activity, index, fault)
        start, cpu_start = time.perf_counter(), time.process_time()
        micro = run_schedule(
            self.runner, self.first, self.last, self.inputs, self.keywords, self.target
        )
        activity.at(2 * self.micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        return (float(torch.stack(micro).detach().mean()) if self.last else None), wall, cpu


def run_pipelined_plan(
    plan: Any,
    plan_path: str,
    source: str,
    *,
    micro_batches: int,
    steps: int,
    lr: float,
    schedule: str,
    device_type: str,
    checkpoint_dir: str | None = None,
    fault_step: int | None = None,
) -> tuple[dict[str, Any], Any]:
    """Train the ``FILE.py:build`` model of ``source`` (built from seed 0, as every rank
    builds it) under the pipelined placement ``plan`` with ``micro_batches`` per step, for
    ``steps`` Adam steps on this rank (``torch.distributed`` initialised, one rank per
    stage; :class:`PipelinedRankSteps`); what this rank measured, and the whole model's
    captured ``OpGraph`` (the launcher's prediction of the run simulates it rather than
    capturing the model again). ``checkpoint_dir``:
    after the last step this rank writes its stage's parameters there (``rank{R}.pt``, a
    dict from the model's own parameter names to tensors). ``fault_step`` (tests): this
    rank kills itself (SIGKILL) in that step's first micro-batch forward.
    """
    from meshplace.runtime.placed import share_bytes
    from meshplace.runtime.sharded import optimizer_state_bytes, peak_bytes

    rank_steps = PipelinedRankSteps(
        plan,
        plan_path,
        source,
        micro_batches=micro_batches,
        lr=lr,
        schedule=schedule,
        device_type=device_type,
    )
    times: list[float] = []
    cpu_times: list[float] = []  # the process's CPU time in each step (step_timing)
    losses: list[float | None] = []
    for step in range(steps):
        loss, wall, cpu = rank_steps.step(step, fault=step == fault_step)
        times.append(wall)
        cpu_times.append(cpu)
        losses.append(loss)
    rank, stage = rank_steps.rank, rank_steps.stage
    devices, boundaries = rank_steps.devices, rank_steps.boundaries
    # parameters and buffers, as the OpGraph's param_bytes counts them
    held = [*stage.submod.parameters(), *stage.submod.buffers()]
    params = sum(t.numel() * t.element_size() for t in held)
    state = optimizer_state_bytes(rank_steps.optimizer)
    predicted = share_bytes(rank_steps.graph, [devices.index(d) for d in rank_steps.names], rank)
    peak = peak_bytes(device_type)
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        own = {  # the stage keeps the model's names under InputsEnterFirst's "model."
            name.removeprefix("model."): p.detach().cpu()
            for name, p in stage.submod.named_parameters()
        }
        torch.save(own, Path(checkpoint_dir) / f"rank{rank}.pt")
    report = {
        "device": devices[rank],
        "stage_begins": boundaries[rank - 1] if rank else "",
        "ops_moved": rank_steps.moved[rank - 1] if rank else 0,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "predicted_bytes": predicted,
        "held_bytes": {"parameters": params, "optimizer_state": state},
        "peak_bytes": peak,
    }
    return report, rank_steps.graph
