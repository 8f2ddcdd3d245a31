"""Pure data-parallel sharding plans on PyTorch's own data-parallel engines: DDP for
replicated weight updates (ZeRO 0, and ZeRO 1 with the update sharded beside it), FSDP2
(``fully_shard``) for sharded parameters (ZeRO 3), as torchtitan composes them; DTensor
stays the engine of every other plan.

Why: a plan that replicates every parameter and splits only the batch needs no DTensor —
under DTensor every op of the forward, backward and optimizer pays its dispatch and every
gradient its own reduction, which measured 4x DDP's step on the Llama example
(``benchmarks/sharded_overhead.py``). DDP (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020) all-reduces gradients in buckets while the
backward runs; FSDP2 (Zhao et al., "PyTorch FSDP", VLDB 2023; per-parameter DTensor
sharding) gathers each block's parameters before its forward and backward and
reduce-scatters its gradients — ZeRO-3 (Rajbhandari et al., SC 2020, Sec. 5).

Both engines average the ranks' gradients, which is the gradient of the plan's loss only
if that loss is the mean of the ranks' losses (a sum: the sum). The plan does not say,
so :func:`loss_over_batch` finds out on the model itself before anything is wrapped:
the loss of two shards' worth of rows against the mean and the sum of the two shards'
losses (three small forwards without gradients; buffers and random state restored). A
loss that is neither (batch normalisation's batch statistics, a contrastive loss, a
model that cannot run on part of the batch) keeps the plan on DTensor, which computes the
loss of the whole batch exactly.

ZeRO 1 runs beside DDP: DDP reduces the whole gradients as at ZeRO 0, Adam updates each
rank's block of every parameter (its state a block too), and the updated blocks are
all-gathered into the parameters in flat buckets — where every trainable parameter
splits evenly along one of its dimensions over the ranks; else (a scalar parameter, say)
the plan runs on DTensor (:class:`meshplace.runtime.launch.WeightUpdateSharding`, which
gathers the even ones in flat buckets too and the rest one by one).

Not here: ZeRO stage 2 (PyTorch has no per-parameter engine for it;
:class:`meshplace.runtime.launch.WeightUpdateSharding` runs it on DTensor), uneven
batch splits (DDP's mean of means is not the batch's mean), images split along their
height or width (a convolution's halo: :mod:`meshplace.runtime.spatial`), and models
built on the meta device (no forward to probe; DTensor creates them block by block).

Complexity: O(parameters) to set up, plus three forwards of two shards' rows; each step is
the engine's.

Example (under torchrun, ``torch.distributed`` initialised)::

    stage = data_parallel_stage(plan)           # 0, 1, 3 or None (DTensor's plan)
    built = build_from_seed("examples/llama.py:build_tiny")  # the same on every rank
    training = DataParallelTraining.create(plan, built, stage=stage, lr=1e-3,
                                           device_type="cpu")
    loss, gradient_bytes = training.step()      # training None: the loss needs DTensor
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from meshplace.runtime.processes import one_rank_world

#: relative agreement that :func:`loss_over_batch` asks of a loss and the mean (or sum) of
#: its halves: rounding of a float32 reduction is ~1e-7; a mean taken for a sum is off 2x
LOSS_TOLERANCE = 1e-4


def data_parallel_stage(plan: Mapping[str, Any]) -> int | None:
    """The ZeRO stage, 0, 1 or 3, of a plan that is pure data parallelism — every
    parameter replicated on every mesh axis with the same ``zero``, every input replicated
    or split along one dimension over every axis — else ``None`` (tensor or spatial
    parallelism, mixed or ZeRO-2 weight updates, a convolution split along anything but
    its batch: DTensor's). O(parameters + inputs + ops).

    >>> p = {"mesh": {"shape": [2]}, "parameters": {"w": {"placements": ["Replicate()"]}},
    ...      "inputs": {"x": {"placements": ["Shard(0)"]}}}
    >>> data_parallel_stage(p)
    0
    >>> print(data_parallel_stage({**p, "ops": {"convolution": "h@x"}}))  # spatial
    None
    >>> p["parameters"]["w"]["placements"] = ["Shard(0)"]
    >>> print(data_parallel_stage(p))
    None
    """
    if math.prod(int(s) for s in plan["mesh"]["shape"]) < 2:
        return None
    stages = set()
    for spec in plan["parameters"].values():
        if any(p != "Replicate()" for p in spec["placements"]):
            return None
        stages.add(int(spec.get("zero", 0)))
    if len(stages) != 1 or not stages <= {0, 1, 3}:
        return None
    for op, strategy in plan.get("ops", {}).items():  # spatial splits: halo exchanges
        labels = {word.partition("@")[0] for word in strategy.split() if "@" in word}
        if op.startswith("convolution") and labels - {"n"}:
            return None
    if not batch_dims(plan):
        return None
    return stages.pop()


def uneven_over(shape: Sequence[int], world: int) -> bool:
    """Whether no dimension of ``shape`` splits evenly over ``world`` ranks (the ZeRO shard
    of :func:`~meshplace.runtime.sharded.zero_placements` then has blocks of unequal
    size). O(dimensions).

    >>> uneven_over((6, 5), 4), uneven_over((6, 8), 4)
    (True, False)
    """
    return world > 1 and all(n % world for n in shape)


def batch_dims(plan: Mapping[str, Any]) -> dict[str, int | None]:
    """Per input, the dimension the plan splits over every mesh axis (``None``:
    replicated); empty when an input is split otherwise or no input is split.

    >>> batch_dims({"inputs": {"x": {"placements": ["Shard(1)", "Shard(1)"]},
    ...                        "n": {"placements": ["Replicate()", "Replicate()"]}}})
    {'x': 1, 'n': None}
    """
    out: dict[str, int | None] = {}
    for name, spec in plan["inputs"].items():
        kinds = set(spec["placements"])
        if kinds == {"Replicate()"}:
            out[name] = None
        elif len(kinds) == 1 and next(iter(kinds)).startswith("Shard("):
            out[name] = int(next(iter(kinds))[6:-1])
        else:
            return {}
    return out if any(d is not None for d in out.values()) else {}


def loss_over_batch(
    loss_of: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    inputs: Sequence[torch.Tensor],
    dims: Sequence[int | None],
    shards: int,
) -> str | None:
    """How ``loss_of(inputs)`` combines over the batch when it is split into ``shards``
    equal shards along ``dims`` (per input; ``None``: the input is not split): ``"mean"``
    when the loss of two shards' rows is the mean of the two shards' losses, ``"sum"``
    when it is their sum, else ``None`` (not decomposable, shards of unequal size, fewer
    than two shards, or the model fails on part of the batch). Within
    :data:`LOSS_TOLERANCE`, relative. Three calls of ``loss_of``.

    >>> x = torch.arange(8.0).reshape(8, 1)
    >>> loss_over_batch(lambda t: t[0].mean(), [x], [0], 4), loss_over_batch(
    ...     lambda t: t[0].sum(), [x], [0], 4), loss_over_batch(lambda t: t[0].max(), [x], [0], 4)
    ('mean', 'sum', None)
    """
    split = [(t, d) for t, d in zip(inputs, dims, strict=True) if d is not None]
    if shards < 2 or not split:
        return None
    sizes = {t.shape[d] for t, d in split}
    if len(sizes) != 1 or next(iter(sizes)) % shards:
        return None
    rows = next(iter(sizes)) // shards

    def part(start: int, count: int) -> list[torch.Tensor]:
        return [t if d is None else t.narrow(d, start, count) for t, d in zip(inputs, dims)]

    try:
        first, second, both = (
            float(loss_of(part(*r))) for r in ((0, rows), (rows, rows), (0, 2 * rows))
        )
    except Exception:  # a model that cannot run on part of its batch
        return None
    if not all(math.isfinite(v) for v in (first, second, both)):
        return None
    scale = max(abs(both), abs(first), abs(second), 1e-30)
    mean_fits = abs(both - (first + second) / 2) <= LOSS_TOLERANCE * scale
    sum_fits = abs(both - (first + second)) <= LOSS_TOLERANCE * scale
    if mean_fits == sum_fits:  # neither, or both (a loss of 0: undecidable)
        return None
    return "mean" if mean_fits else "sum"


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 gathers one at a time, innermost first, then ``model``: every
    element of a ``ModuleList`` or ``Sequential`` that has parameters (a transformer's
    blocks, as torchtitan wraps them), unless one of them shares a parameter with any
    other part of the model (tied weights stay in one unit: the root). O(modules).
    """
    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    units = [
        child
        for module in model.modules()
        if isinstance(module, containers) and module is not model
        for child in module.children()
        if any(True for _ in child.parameters())
    ]
    # a unit inside another unit: FSDP2 would wrap both; keep the outer ones only
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    units = [u for u in units if id(u) not in inner]
    seen: dict[int, set[int]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        unit = next((i for i, u in enumerate(units) if _owns(u, model, name)), -1)
        seen.setdefault(id(p), set()).add(unit)
    if any(len(where) > 1 for where in seen.values()):
        return [model]
    return [*units, model]


def _owns(unit: torch.nn.Module, model: torch.nn.Module, name: str) -> bool:
    owner_name = name.rpartition(".")[0]
    owner = model.get_submodule(owner_name) if owner_name else model
    return any(m is owner for m in unit.modules())


def reduce_gradient_bucket(state, bucket):
    """DDP's communication hook: the bucket all-reduced (summed) in place over ``state``'s
    group, then divided by its size when ``state`` (``(group, size, mean)``; group
    ``None``: every rank) says the loss is a mean of the ranks' losses — DDP's own
    arithmetic, in Python so that a fake process group (the dry run) can stand in for the
    ranks, and so that a sum loss is summed. No annotations: DDP compares them with the
    classes themselves, which this module's postponed (string) annotations are not."""
    import torch.distributed as dist

    group, size, mean = state
    buffer = bucket.buffer()
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda _: buffer.div_(size) if mean else buffer)


def bucket_megabytes() -> float:
    """DDP's bucket size, in MiB: the cost model's gradient bucket
    (:data:`meshplace.cost.collectives.GRADIENT_BUCKET_BYTES`), so that the prediction
    buckets as the run does."""
    from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES

    return GRADIENT_BUCKET_BYTES / 2**20


def batch_reduction(
    model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], shards: int, rows: int
) -> str | None:
    """How ``model``'s loss on the first ``rows`` rows of its inputs (every tensor input
    split along its first dimension) combines over ``shards`` equal shards of them:
    ``"mean"``, ``"sum"`` or ``None`` (:func:`loss_over_batch`), probed without side
    effects (buffers and random state restored). Three forwards of ``rows`` rows."""
    from meshplace.graph.capture import as_loss

    values = [
        v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v
        for v in (*args, *kwargs.values())
    ]
    dims = [0 if isinstance(v, torch.Tensor) and v.dim() else None for v in values]
    positional = len(args)

    def loss_of(inputs: Sequence[Any]) -> torch.Tensor:
        keywords = dict(zip(kwargs, inputs[positional:], strict=True))
        return as_loss(model(*inputs[:positional], **keywords))[0]

    return _probe_without_side_effects(
        model, lambda: loss_over_batch(loss_of, values, dims, shards)
    )


def forward_changes_buffers(
    model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], rows: int
) -> bool:
    """Whether a training forward of ``model`` on the first ``rows`` rows of its inputs
    changes any of its buffers (running statistics, a step counter), probed without side
    effects (buffers and random state restored). DDP must keep such buffers in step with
    rank 0's before every forward, as it does by default; constant ones (a rotary table,
    built alike on every rank from one seed) it need not broadcast. Every rank probes the
    same rows, so all decide alike (DDP's broadcast is a collective). A forward that
    fails on those rows counts as changing them (DDP's default kept). One forward without
    gradients.

    >>> forward_changes_buffers(torch.nn.BatchNorm1d(3), (torch.randn(4, 3),), {}, 2)
    True
    >>> forward_changes_buffers(torch.nn.Linear(3, 3), (torch.randn(4, 3),), {}, 2)
    False
    """
    buffers = list(model.buffers())
    if not buffers:
        return False
    device = next((t.device for t in [*model.parameters(), *buffers]), torch.device("cpu"))
    values = [
        v[:rows].to(device) if isinstance(v, torch.Tensor) and v.dim() else v
        for v in (*args, *kwargs.values())
    ]
    positional = len(args)

    def forward() -> bool:
        before = [b.detach().clone() for b in buffers]
        model(*values[:positional], **dict(zip(kwargs, values[positional:], strict=True)))
        return any(not torch.equal(a, b) for a, b in zip(before, buffers, strict=True))

    try:
        return bool(_probe_without_side_effects(model, forward))
    except (RuntimeError, ValueError, IndexError):  # the model cannot run on those rows
        return True


class DataParallelTraining:
    """One rank's share of a pure data-parallel plan (module docstring), with the
    interface of :class:`meshplace.runtime.launch.ShardedTraining`: ``model`` (the
    model's own module, parameter names as in the plan), ``mesh``, ``optimizer``,
    :meth:`step`, :meth:`loss_value`, ``engine`` (``"ddp"`` or ``"fsdp2"``), ``uneven``
    and ``meta_buffers``. Build it with :meth:`create`."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
        *,
        stage: int,
        reduction: str,
        mesh: Any,
        data_mesh: Any,
        lr: float,
        device_type: str,
        sync_buffers: bool = True,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import Replicate

        from meshplace.runtime.sharded import master_block, rank_device, zero_placements

        device = rank_device(device_type)
        world = dist.get_world_size()
        self.mesh, self.device_type, self.reduction = mesh, device_type, reduction
        self.uneven: list[str] = []
        self.gradient_bytes: int | None = None  # counted at the first step (:meth:`step`)
        self.meta_buffers: list[str] = []  # a model built on the meta device runs on DTensor
        self.model, self.args, self.kwargs = model, args, kwargs
        self.data_mesh = data_mesh
        # ZeRO 1: (parameter, this rank's block of it — a view Adam updates in place —,
        # where the block sits), over the ranks in rank order, as FSDP2 shards
        self.masters: list[tuple[torch.nn.Parameter, torch.Tensor, tuple]] = []
        if stage in (0, 1):
            from torch.nn.parallel import DistributedDataParallel

            model.to(device)
            unused = self._unused_parameters()
            self.runner: Any = DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=bucket_megabytes(),
                find_unused_parameters=bool(unused),
                # buffers the forward never changes (the Llama example's rotary tables)
                # are the same on every rank, built from one seed: DDP's broadcast of them
                # before every forward would only cost a collective (a gloo broadcast of
                # ~0.5 ms in a 9 ms step); buffers it changes stay in step with rank 0's,
                # as DDP keeps them by default (:func:`forward_changes_buffers` decides;
                # torch 2.13's name; synced once at init either way)
                forward_sync_buffers=sync_buffers,
            )
            self.runner.register_comm_hook(
                (None, world, reduction == "mean"), reduce_gradient_bucket
            )
            self.engine, self.fsdp_units = "ddp", 0
            if stage == 1:
                rank = data_mesh.get_coordinate()[0]
                for param in model.parameters():
                    if not param.requires_grad:  # frozen: never updated, never gathered
                        continue
                    cuts = ((0, zero_placements([Replicate()], param.shape, [world])[0].dim),)
                    block = master_block(param.detach(), cuts, [world], [rank])
                    self.masters.append((param, block, cuts))
        else:
            from torch.distributed.fsdp import fully_shard

            model.to(device)

            def placement(param: torch.nn.Parameter) -> Any:
                return zero_placements([Replicate()], param.shape, [world])[0]

            # FSDP2's own dimension-0 sharding unless the plan's shard is along another
            # (a placement function takes FSDP2's general, slower copy path)
            given = any(placement(p).dim != 0 for p in model.parameters())
            units = fsdp_units(model)
            for unit in units:
                fully_shard(unit, mesh=data_mesh, shard_placement_fn=placement if given else None)
                if reduction == "sum":
                    unit.set_gradient_divide_factor(1.0)
            for name, param in model.named_parameters():
                whole = param.numel() * param.element_size()
                local = param.to_local()
                if local.numel() * local.element_size() * world != whole:
                    self.uneven.append(name)
            self.runner = model
            self.engine, self.fsdp_units = "fsdp2", len(units)
        updated = [block for _, block, _ in self.masters] or list(model.parameters())
        self.optimizer = torch.optim.Adam(updated, lr=lr, foreach=True)

    @classmethod
    def create(
        cls, plan: Mapping[str, Any], built: tuple, *, stage: int, lr: float, device_type: str
    ) -> DataParallelTraining | None:
        """The training of ``built`` (``(model, args, kwargs)`` as every rank builds it
        from seed) under ``plan`` (pure data parallelism of ZeRO ``stage``), each rank
        keeping its shard of the batch; ``None`` when the loss is not a mean or sum over
        the batch (:func:`loss_over_batch`: the plan then runs on DTensor). Every rank
        decides alike: the probe runs on the first shards of the batch every rank
        builds."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from meshplace.errors import InputError
        from meshplace.graph.capture import as_loss
        from meshplace.runtime.sharded import device_mesh, distribute_inputs, rank_device

        model, args, kwargs = built
        names = list(plan["inputs"])
        values = [*args, *kwargs.values()]
        if len(values) != len(names):
            raise InputError(
                f"the model gives {len(values)} inputs and the plan has {len(names)}: "
                "it was made for another model"
            )
        dims = batch_dims(plan)
        split = [dims.get(n) for n in names]
        world = dist.get_world_size()
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            return None  # no forward to probe the loss with; DTensor creates it by blocks
        trained = [p for p in model.parameters() if p.requires_grad]
        if stage == 1 and any(uneven_over(p.shape, world) for p in trained):
            return None  # ZeRO-1 blocks of unequal size: DTensor's, gathered one by one
        device = rank_device(device_type)
        positional = len(args)

        def loss_of(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
            given = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
            keywords = dict(zip(kwargs, given[positional:], strict=True))
            return as_loss(model(*given[:positional], **keywords))[0]

        model.to(device)
        reduction = _probe_without_side_effects(
            model, lambda: loss_over_batch(loss_of, values, split, world)
        )
        if reduction is None:
            return None
        sync_buffers = False  # FSDP2 (ZeRO 3) broadcasts no buffers: no probe
        if stage in (0, 1):  # DDP's: whether its buffers need a broadcast every forward
            sizes = [int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim()]
            rows = max(1, min(sizes, default=world) // world)  # one rank's share
            sync_buffers = forward_changes_buffers(model, args, kwargs, rows)
        mesh = device_mesh(plan, device_type)  # the plan's axes: what collectives span
        # FSDP2 shards over one data-parallel axis: every rank, in rank order
        data_mesh = mesh if mesh.ndim == 1 else init_device_mesh(device_type, (world,))
        placed = distribute_inputs(
            plan, {n: v.to(device) for n, v in zip(names, values, strict=True)}, mesh
        )
        local = [placed[n].to_local() for n in names]
        return cls(
            model,
            tuple(local[:positional]),
            dict(zip(kwargs, local[positional:], strict=True)),
            stage=stage,
            reduction=reduction,
            mesh=mesh,
            data_mesh=data_mesh,
            lr=lr,
            device_type=device_type,
            sync_buffers=sync_buffers,
        )

    def _unused_parameters(self) -> list[str]:
        """Parameters the loss does not reach (DDP must be told of them), from one
        backward on this rank's shard; gradients cleared, buffers and random state kept."""
        from meshplace.graph.capture import as_loss

        def backward() -> list[str]:
            as_loss(self.model(*self.args, **self.kwargs))[0].backward()
            return [
                n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None
            ]

        unused = _probe_without_side_effects(self.model, backward, grad=True)
        self.model.zero_grad(set_to_none=True)
        return unused

    def step(self) -> tuple[Any, int]:
        """One training step on this rank's shard of the batch, the engine reducing the
        gradients; the rank's loss and its gradient bytes before the optimizer's step.
        Those bytes are counted at the first step only: the engine gives every step the
        same gradients' blocks, and counting FSDP2's (a DTensor ``to_local`` each) cost
        about 0.3 ms a step on the Llama example."""
        from meshplace.graph.capture import as_loss
        from meshplace.runtime.sharded import local_nbytes

        loss, _how = as_loss(self.runner(*self.args, **self.kwargs))
        loss.backward()
        if self.gradient_bytes is None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.gradient_bytes = sum(local_nbytes(g) for g in grads)
        held = self.gradient_bytes
        if self.masters:
            self._update_blocks()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, held

    def _update_blocks(self) -> None:
        """ZeRO 1 beside DDP: Adam updates this rank's block of every parameter with the
        block of its reduced gradient (views: no copy), then the blocks are all-gathered
        into the parameters in flat buckets
        (:func:`~meshplace.runtime.sharded.gather_master_shards_in_buckets`; source:
        Rajbhandari et al., SC 2020, Sec. 5, stage 1)."""
        from meshplace.runtime.sharded import gather_master_shards_in_buckets, master_block

        world, rank = self.data_mesh.size(), self.data_mesh.get_coordinate()[0]
        for param, block, cuts in self.masters:
            if param.grad is not None:
                block.grad = master_block(param.grad, cuts, [world], [rank])
        self.optimizer.step()
        with torch.no_grad():
            gather_master_shards_in_buckets(
                [(param.data, block, cuts) for param, block, cuts in self.masters],
                self.data_mesh,
            )
        self.model.zero_grad(set_to_none=True)

    def loss_value(self, loss: torch.Tensor) -> float:
        """The loss of the whole batch: the mean (or sum) of the ranks' losses."""
        import torch.distributed as dist

        total = loss.detach().clone().reshape(1)
        dist.all_reduce(total)  # gloo has no average: sum, then divide
        return float(total) / (dist.get_world_size() if self.reduction == "mean" else 1)


def _probe_without_side_effects(
    model: torch.nn.Module, probe: Callable[[], Any], *, grad: bool = False
) -> Any:
    """``probe()`` with the model's buffers (batch-norm statistics) and the random state
    (dropout) as they were before it, so the run starts as if it had not happened."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
        try:
            return probe()
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(saved[name])


def measure_ddp_overhead(source: str, reps: int = 20) -> dict[str, Any]:
    """What DDP adds per micro-batch of a data-parallel stage, measured in this process:
    the forward and backward (one thread) of the ``FILE.py:build`` model on the first two
    rows of its inputs, plain and wrapped in ``DistributedDataParallel`` on a gloo world
    of one under ``no_sync`` (as torch's pipelining runs every micro-batch but the last),
    alternating, the median of their paired differences. That is DDP's own work per
    micro-batch: its forward's pre- and post-processing and an autograd hook per
    parameter, which meshplace's hybrid runtime pays on every micro-batch of a stage it
    runs on DDP (:func:`meshplace.runtime.hybrid.ddp_stages`); the gradients' reduction is
    not in it (a world of one, and ``no_sync``), nor the arithmetic (the same on both).
    Returns ``plain_s``, ``ddp_s`` (medians) and ``per_micro_batch_s`` (0 when the
    difference is noise below 0): the calibration file's ``ddp_overhead_s``.
    O(reps) forward and backward passes on two rows.

    Example::

        measure_ddp_overhead("examples/llama.py:build_tiny")["per_micro_batch_s"]  # ~1e-3
    """
    import statistics
    import time

    from torch.nn.parallel import DistributedDataParallel

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_on_two_rows

    with one_rank_world():
        model, args, kwargs = build_on_two_rows(source)
        wrapped = DistributedDataParallel(model)

        def plain() -> float:
            model.zero_grad(set_to_none=True)  # both create the gradients
            start = time.perf_counter()
            as_loss(model(*args, **kwargs))[0].backward()
            return time.perf_counter() - start

        def ddp() -> float:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with wrapped.no_sync():
                as_loss(wrapped(*args, **kwargs))[0].backward()
            return time.perf_counter() - start

        for _ in range(2):  # warm-up
            plain(), ddp()
        pairs = []
        for _ in range(reps):
            pairs.append((plain(), ddp()))
    return {
        "plain_s": statistics.median(p for p, _ in pairs),
        "ddp_s": statistics.median(d for _, d in pairs),
        "per_micro_batch_s": max(0.0, statistics.median(d - p for p, d in pairs)),
    }


def measure_fsdp_overhead(source: str, reps: int = 20, rounds: int = 3) -> dict[str, Any]:
    """What FSDP2 adds per unit per training step, measured in this process: the same
    eager step (forward, backward, foreach Adam; one thread) of the ``FILE.py:build``
    model on the first two rows of its inputs, plain and with :func:`fsdp_units` each
    under ``fully_shard`` on a 1-rank mesh (gloo), alternating ``rounds`` times; the
    difference of the medians over the units. That is FSDP2's own work — its hooks, the
    copies into and out of its gather buffers, and the DTensor dispatch on its sharded
    parameters (the optimizer's) — which a ZeRO-3 plan on FSDP2 pays per unit whatever the
    world (measured on the Llama example: 5.8 ms against 2.8 ms plain, three units). The
    collectives are not in it (a 1-rank group), nor the arithmetic (the same on both).
    Returns ``plain_step_s``, ``fsdp_step_s``, ``units`` and ``per_unit_s`` (0 when the
    difference is noise below 0). O(rounds · reps) steps on two rows.

    Example::

        measure_fsdp_overhead("examples/llama.py:build_tiny")["per_unit_s"]  # ~1e-3
    """
    import statistics
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_on_two_rows

    def build() -> tuple[Any, tuple, dict]:
        return build_on_two_rows(source)

    def stepper(model: Any, args: tuple, kwargs: dict) -> Callable[[], float]:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

        def step() -> float:
            start = time.perf_counter()
            loss, _how = as_loss(model(*args, **kwargs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        return step

    with one_rank_world():
        plain = stepper(*build())
        model, args, kwargs = build()
        units = fsdp_units(model)
        mesh = init_device_mesh("cpu", (1,))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        sharded = stepper(model, args, kwargs)
        times: dict[str, list[float]] = {"plain": [], "fsdp": []}
        for step in (plain, sharded):  # warm-up: Adam's state, FSDP2's lazy init
            step(), step()
        for _ in range(rounds):
            for name, step in (("plain", plain), ("fsdp", sharded)):
                times[name] += [step() for _ in range(reps)]
    plain_s, fsdp_s = statistics.median(times["plain"]), statistics.median(times["fsdp"])
    return {
        "plain_step_s": plain_s,
        "fsdp_step_s": fsdp_s,
        "units": len(units),
        "per_unit_s": max(fsdp_s - plain_s, 0.0) / len(units),
    }
