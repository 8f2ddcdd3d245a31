"""Run a sharding plan on PyTorch's own engine: parameters and inputs as DTensors.

Source: PyTorch DTensor (``torch.distributed.tensor``: ``DeviceMesh``,
``distribute_tensor``, ``Shard``/``Replicate``), the engine torchtitan builds on. A plan
file of ``meshplace shard`` (format ``meshplace.parallel_plan``, ``docs/formats.md``) gives
each parameter and input its placements, one per mesh axis; :func:`apply_sharding_plan`
replaces every parameter of the model by a DTensor so placed, :func:`distribute_inputs`
does the same for the inputs, and the model's own forward and backward then run under
DTensor's dispatch — PyTorch chooses the intermediate ops' layouts and inserts the
collectives, no meshplace interpreter is involved. Each rank holds only its block of every
sharded parameter (:func:`local_parameter_bytes`), which a test compares with the plan's
prediction byte for byte.

:func:`sharded_step` is the context to run the step in: tensors the model creates inside
its forward (rotary tables, masks, ``arange``) take part as replicated DTensors
(``implicit_replication``), and attention on host DTensors runs the CPU flash kernel
(a sharding rule DTensor lacks, :func:`register_cpu_attention_sharding`) where query,
key and value are split alike over batch or heads (key and value moved to the query's
placements where they are not), PyTorch's math kernel otherwise: a run's first step
watches every attention call (:class:`CpuAttentionKernel`) and :class:`HostAttention`
keeps the choice for the later steps.

Between modules DTensor alone would choose every layout, op by op; at the plan's column-
and row-parallel ``Linear`` layers :func:`tensor_parallel_boundaries` places Megatron's
``f`` and ``g`` operators instead (what ``parallelize_module``'s styles do), so a
Megatron layout runs Megatron's collectives.

:func:`parallelize_module_plan` exports the plan's choices along one mesh axis as
PyTorch's ``parallelize_module`` styles (colwise / rowwise ``Linear`` and ``Embedding``).

Not applied here: weight-update sharding (``zero`` > 0; the torchrun runtime,
:mod:`meshplace.runtime.launch`, applies it), and the plan's choices for intermediate ops
(DTensor propagates its own from the parameters' and inputs' placements).

Complexity: one ``distribute_tensor`` per parameter (a scatter from the tensor every rank
builds).

Example (one process, a 1-device mesh; a real run has one process per device)::

    mesh = device_mesh(plan, "cpu")            # after torch.distributed is initialised
    apply_sharding_plan(model, plan, mesh)
    x = distribute_inputs(plan, {"input": x}, mesh)["input"]
    with sharded_step():
        loss = model(x).mean(); loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
from meshplace.errors import InputError

PLAN_FORMAT = "meshplace.parallel_plan"


def placements(names: list[str]) -> list[Any]:
    """DTensor placements from their plan-file names (``"Shard(0)"``, ``"Replicate()"``).

    >>> placements(["Shard(1)", "Replicate()"])
    [Shard(dim=1), Replicate()]
    """
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for name in names:
        if name == "Replicate()":
            out.append(Replicate())
        elif name.startswith("Shard(") and name.endswith(")") and name[6:-1].isdigit():
            out.append(Shard(int(name[6:-1])))
        else:
            raise InputError(
                f"unknown placement {name!r} in the plan; allowed: Shard(N), Replicate()"
            )
    return out


def _check(plan: Mapping[str, Any]) -> None:
    if plan.get("format") != PLAN_FORMAT:
        raise InputError(f"not a sharding plan (field 'format' must be {PLAN_FORMAT!r})")


def device_mesh(plan: Mapping[str, Any], device_type: str = "cpu") -> Any:
    """The plan's ``DeviceMesh`` over the initialised process group (ranks in order)."""
    from torch.distributed.device_mesh import init_device_mesh

    _check(plan)
    shape = tuple(int(s) for s in plan["mesh"]["shape"])
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(plan["mesh"]["axes"]))


def check_plan_matches(model: torch.nn.Module, plan: Mapping[str, Any]) -> None:
    """One :class:`InputError` sentence when the plan's parameters are not exactly the
    model's (the plan was made for another model): the first of the model's parameters
    it lacks, else the first name it has that the model does not. O(parameters).

    >>> plan = {"format": "meshplace.parallel_plan", "parameters": {"weight": {}}}
    >>> check_plan_matches(torch.nn.Linear(2, 2), plan)
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: the plan does not match the model: the model's 'bias' is not in it
    """
    _check(plan)
    planned = plan["parameters"]
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in planned]
    extra = [n for n in planned if n not in set(names)]
    if missing or extra:
        which = (
            f"the model's {missing[0]!r} is not in it"
            if missing
            else f"{extra[0]!r} is not a parameter of the model"
        )
        raise InputError(f"the plan does not match the model: {which}")


def apply_sharding_plan(model: torch.nn.Module, plan: Mapping[str, Any], mesh: Any) -> None:
    """Replace every parameter the plan names by a DTensor with the plan's placements.

    A parameter on the meta device (a model built with ``torch.device("meta")``, too big
    for one rank) becomes its :func:`~meshplace.runtime.program.initial_value`, created one
    parameter at a time on every rank alike, of which each rank keeps only its block
    (``src_data_rank=None``: no scatter), so no rank ever holds the whole model.

    A parameter the plan does not name, or a name the model does not have, is an
    :class:`InputError` (the plan was made for another model)."""
    from torch.distributed.tensor import distribute_tensor

    from meshplace.runtime.program import initial_value

    check_plan_matches(model, plan)
    planned = plan["parameters"]
    # a tied parameter (a language model's embedding and head) is one parameter under its
    # first name, as the capture and named_parameters() see it: every alias must get the
    # same DTensor, or the model would train two tensors and name one the plan does not
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    names = [n for n, _ in model.named_parameters()]
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        param = getattr(owner, attr)
        full, source_rank = param.detach(), 0
        if full.is_meta:
            full = initial_value(name, full.shape, full.dtype, parameter=True)
            full, source_rank = full.to(mesh.device_type), None
        placed = distribute_tensor(
            full, mesh, placements(planned[name]["placements"]), src_data_rank=source_rank
        )
        del full
        shared = torch.nn.Parameter(placed, requires_grad=param.requires_grad)
        vocabulary_split = "Shard(0)" in planned[name]["placements"]
        for alias in aliases[id(param)]:
            alias_owner_name, _, alias_attr = alias.rpartition(".")
            alias_owner = model.get_submodule(alias_owner_name) if alias_owner_name else model
            setattr(alias_owner, alias_attr, shared)
            embedding = isinstance(alias_owner, torch.nn.Embedding) and alias_attr == "weight"
            if embedding and vocabulary_split:
                alias_owner.forward = functools.partial(vocabulary_parallel_lookup, alias_owner)
                alias_owner.register_forward_hook(_complete_partial_sums)
    tensor_parallel_boundaries(model)


def tensor_parallel_boundaries(model: torch.nn.Module) -> dict[str, str]:
    """Megatron's two conjugate operators at every ``Linear`` whose weight is a DTensor
    split over a mesh axis: ``f`` before a column-parallel layer (weight ``Shard(0)``:
    identity forward, the input's gradient summed over the axis in backward) and ``g``
    after a row-parallel one (weight ``Shard(1)``: its partial output summed in forward).
    Returns module name -> ``"column"`` or ``"row"``. O(modules).

    Source: Shoeybi et al., "Megatron-LM" (2019), Sec. 3, Fig. 3; PyTorch's
    ``ColwiseParallel(input_layouts=Replicate())`` and ``RowwiseParallel(
    output_layouts=Replicate())``, whose module boundaries do the same for the local
    tensors torchtitan's models pass between modules.

    Why: here every tensor between modules is a DTensor and DTensor decides each op's
    layout alone, by what that op's redistribution costs. It keeps a gradient a partial
    sum for as long as no single op must pay to reduce it, so on a Megatron layout the
    residual stream's gradient stays partial through the backward and each weight's
    gradient is computed as a partial sum over the tokens and reduced on its own after
    it: on 2 gloo ranks the Llama example's Megatron layout ran 68 collectives a step
    (15 of its 21 gradients came out partial sums) against 17 for ``parallelize_module``
    by hand, and took 2.35x its step time (160 against 68 ms, steps interleaved). With
    the boundaries the gradient of a column-parallel layer's input is reduced once where
    the layer reads it — once for all the layers that read the same tensor (a block's
    query, key and value projections), as Megatron's fused QKV does — and the weights'
    gradients come out as their blocks: 11 collectives, and as fast as the hand's step
    (``benchmarks/sharded_overhead.py --interleaved``: −0.1 %).

    Only where it is the plan's own layout: ``f`` when the input is a DTensor replicated
    over an axis the weight is split over by rows (``Shard(0)``), ``g`` when the output is
    a partial sum over an axis the weight is split over by columns (``Shard(1)``); a
    ``Linear`` fed a plain tensor, or whose weight is whole, keeps DTensor's own choices.
    A column-parallel layer's output also gets its gradient in the output's own
    placements (a slice, no communication), so a reader that gathered it (a loss over a
    vocabulary-split head) does not make every rank compute the whole weight's gradient.

    Example: :func:`apply_sharding_plan` calls it once, after placing the parameters (a
    second call would hook every layer twice)::

        apply_sharding_plan(model, plan, mesh)   # q/k/v, gate, up: "column"; o, down: "row"
    """
    from torch.distributed.tensor import DTensor, Replicate

    def column(module: torch.nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        axes = module.weight.placements  # type: ignore[union-attr]
        if isinstance(x, DTensor) and any(
            w.is_shard(0) and p.is_replicate() for w, p in zip(axes, x.placements, strict=True)
        ):
            # the partial sums the split layers send back are reduced where x's gradient
            # is complete: once for all the layers that read x
            gradient_as_placed(x)

    def column_output(module: torch.nn.Module, args: tuple, out: Any) -> None:
        # a reader that needs the output whole (the loss reading a vocabulary-split
        # head's logits) redistributes inside its own op, which autograd does not see,
        # and sends back a whole gradient: the weight's gradient would then be computed
        # whole on every rank. It is sliced to the output's block first (no
        # communication), as ColwiseParallel(output_layouts=Replicate())'s is
        if isinstance(out, DTensor) and any(p.is_shard() for p in out.placements):
            gradient_as_placed(out)

    def row(module: torch.nn.Module, args: tuple, out: Any) -> Any:
        axes = module.weight.placements  # type: ignore[union-attr]
        if not isinstance(out, DTensor):
            return out
        summed = [
            Replicate() if w.is_shard(1) and p.is_partial() else p
            for w, p in zip(axes, out.placements, strict=True)
        ]
        return out if summed == list(out.placements) else out.redistribute(out.device_mesh, summed)

    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or not isinstance(weight, DTensor):
            continue
        if any(p.is_shard(0) for p in weight.placements):
            module.register_forward_pre_hook(column)
            module.register_forward_hook(column_output)
            kinds[name] = "column"
        elif any(p.is_shard(1) for p in weight.placements):
            module.register_forward_hook(row)
            kinds[name] = "row"
    return kinds


def materialize_meta_buffers(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Give every buffer on the meta device its
    :func:`~meshplace.runtime.program.initial_value` on ``device`` (zeros; ``running_var``
    ones); the names of those buffers. A buffer the model computes when it is built (a
    rotary table) cannot be recovered from the meta device: build such buffers for real.
    O(buffers)."""
    from meshplace.runtime.program import initial_value

    done = []
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            value = initial_value(name, buffer.shape, buffer.dtype, parameter=False)
            setattr(owner, attr, value.to(device))
            done.append(name)
    return done


def parallelize_module_plan(
    model: torch.nn.Module, plan: Mapping[str, Any], axis: str
) -> tuple[dict[str, Any], list[str]]:
    """The plan's choices along one mesh axis as a ``parallelize_module`` plan (PyTorch's
    tensor-parallel API, torchtitan's idiom): module name -> ``ParallelStyle``, and the
    parameters split along ``axis`` that no style expresses.

    A ``Linear`` whose weight the plan splits along its output rows (``Shard(0)``) is
    ``ColwiseParallel``, along its input columns (``Shard(1)``) ``RowwiseParallel``; an
    ``Embedding`` split along its vocabulary is ``RowwiseParallel``, along its width
    ``ColwiseParallel``. Column-parallel outputs stay DTensors (``use_local_output=False``)
    and plain inputs are read as replicated, so a style composes with whatever precedes it
    (run the model under :func:`sharded_step`). Other parameters, and a Linear whose bias
    is split differently from its weight, are listed, not expressed. Apply with
    ``parallelize_module(model, mesh[axis], styles)``. O(modules).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _check(plan)
    axes = list(plan["mesh"]["axes"])
    if axis not in axes:
        raise InputError(f"the plan's mesh has no axis {axis!r}; its axes: {', '.join(axes)}")
    k = axes.index(axis)
    planned = plan["parameters"]

    def on_axis(name: str) -> str:
        return planned[name]["placements"][k] if name in planned else "Replicate()"

    styles: dict[str, Any] = {}
    expressed: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        weight = on_axis(prefix + "weight")
        bias = on_axis(prefix + "bias") if getattr(module, "bias", None) is not None else None
        style = None
        if isinstance(module, torch.nn.Linear):
            if weight == "Shard(0)" and bias in (None, "Shard(0)"):
                style = ColwiseParallel(use_local_output=False)
            elif weight == "Shard(1)" and bias in (None, "Replicate()"):
                style = RowwiseParallel(input_layouts=Replicate())
        elif isinstance(module, torch.nn.Embedding):
            if weight == "Shard(0)":
                style = RowwiseParallel(input_layouts=Replicate())
            elif weight == "Shard(1)":
                style = ColwiseParallel(use_local_output=False)
        if style is not None:
            styles[name] = style
            expressed.update(prefix + p for p, _ in module.named_parameters(recurse=False))
    left = [n for n in planned if n not in expressed and on_axis(n) != "Replicate()"]
    return styles, left


class _SumOverAxes(torch.autograd.Function):
    """Megatron's ``g`` for a vocabulary-parallel lookup (Shoeybi et al. 2019, Sec. 3;
    Megatron-LM's ``VocabParallelEmbedding``): forward sums each rank's partial lookup
    over the mesh axes the table is split over (one all-reduce each); backward passes the
    gradient through, whole, to every rank's partial (the sum's derivative by each term
    is the identity)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: Any, dims: tuple[int, ...]) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        for dim in dims:
            local = funcol.wait_tensor(funcol.all_reduce(local, "sum", (mesh, dim)))
        return local

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def vocabulary_parallel_lookup(embedding: torch.nn.Embedding, ids: Any) -> Any:
    """``embedding(ids)`` for a table split over its vocabulary (``Shard(0)`` on some mesh
    axes, whole on the others), as Megatron-LM's ``VocabParallelEmbedding`` computes it:
    each rank looks up the ids its rows hold (the others read as zeros), the partial
    lookups are summed over the split axes (one all-reduce each), and in backward each
    rank's gradient is its own rows' — where DTensor's rule for the embedding's backward
    computes the whole table's gradient on every rank (a transient the size of the
    table, zeroed every step), of which the runtime then kept a slice. The result is a
    DTensor whole over the split axes and placed as ``ids`` over the others.

    Falls back to the module's own forward (DTensor's masked partial, summed by
    :func:`_complete_partial_sums`) where the lookup does not split so: ``ids`` split
    over an axis the table is split over, a table split along its width too, or the
    options a local lookup would change (``max_norm``, ``scale_grad_by_freq``,
    ``sparse``). O(ids x width) per rank, plus the all-reduce of the output.

    Source: Shoeybi et al., "Megatron-LM" (2019), Sec. 3 (input embedding parallel along
    the vocabulary dimension).

    Example: :func:`apply_sharding_plan` installs it as the ``forward`` of every
    ``Embedding`` whose weight the plan splits over its vocabulary::

        apply_sharding_plan(model, plan, mesh)   # model.embed(ids): one all-reduce
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    weight = embedding.weight
    mesh = weight.device_mesh  # type: ignore[union-attr]
    table = list(weight.placements)  # type: ignore[union-attr]
    split = tuple(k for k, p in enumerate(table) if p.is_shard(0))
    placed = list(ids.placements) if isinstance(ids, DTensor) else [Replicate()] * len(table)
    local_ok = (
        split
        and all(p.is_shard(0) or p.is_replicate() for p in table)
        and all(placed[k].is_replicate() for k in split)
        and all(p.is_shard() or p.is_replicate() for p in placed)
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )
    if not local_ok:
        return torch.nn.Embedding.forward(embedding, ids)
    # this rank's rows: DTensor splits dimension 0 over the axes in mesh order, each
    # split as torch.chunk does
    start, rows = 0, int(weight.shape[0])
    for k in split:
        n, r = mesh.size(k), mesh.get_local_rank(k)
        chunk = -(-rows // n)
        start += r * chunk
        rows = max(0, min(chunk, rows - r * chunk))
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    outside = (local_ids < start) | (local_ids >= start + rows)
    padding = embedding.padding_idx
    padding = padding - start if padding is not None and start <= padding < start + rows else None
    # the table's gradient from this rank's ids: a partial sum over the axes that split
    # the ids (the batch), this rank's rows over the axes that split the table
    grad_placements = [Partial() if placed[k].is_shard() else p for k, p in enumerate(table)]
    block = weight.to_local(grad_placements=grad_placements)  # type: ignore[union-attr]
    found = torch.nn.functional.embedding(
        (local_ids - start).masked_fill(outside, 0), block, padding
    )
    summed = _SumOverAxes.apply(found.masked_fill(outside.unsqueeze(-1), 0), mesh, split)
    shape = (*ids.shape, int(weight.shape[1]))
    return DTensor.from_local(
        summed,
        mesh,
        [Replicate() if k in split else p for k, p in enumerate(placed)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def completed_lookup(out: Any) -> Any:
    """An embedding lookup's output summed over the mesh axes it is a partial sum on (a
    vocabulary-split table's masked partial), once, its gradient completed likewise
    (:func:`_complete_partial_sums`, which says why); anything else unchanged. What a
    pipelining stage's graph runs after each lookup
    (:func:`meshplace.runtime.hybrid.complete_vocabulary_lookups`). O(one all-reduce per
    partial axis)."""
    return _complete_partial_sums(None, (), out)


def _complete_partial_sums(module: torch.nn.Module | None, args: Any, out: Any) -> Any:
    """Sum a vocabulary-split embedding's output over the axes it is partial on, once, at
    the module's boundary — what ``parallelize_module``'s ``RowwiseParallel`` does for a
    vocabulary-parallel embedding (torchtitan: ``use_local_output``, the next module
    reading the local tensor as replicated).

    Why a boundary and not just the redistribution: DTensor marks such an output with a
    masked partial placement whose mask the first reduction consumes; a second reader of
    the same tensor (a residual and a norm) then fails inside DTensor
    (``_MaskPartial._reduce_shard_value``). And the redistribution's backward turns the
    output's gradient back into that masked placement, which DTensor cannot do from a
    gradient that is itself a partial sum — what column-parallel readers (Megatron's
    query, key and value projections) send back: "Redistribution from one partial type
    (P(sum)) to another (MaskP(...)) is unsupported". :func:`gradient_as_placed` on the
    summed output makes the backward first complete any partial gradient (one
    all-reduce, as the rowwise style's does), so the embedding receives a replicated
    one. (Only where :func:`vocabulary_parallel_lookup` falls back to the module's own
    forward.)"""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(out, DTensor) or not any(p.is_partial() for p in out.placements):
        return out
    done = [Replicate() if p.is_partial() else p for p in out.placements]
    return gradient_as_placed(out.redistribute(out.device_mesh, done))


# the tensors gradient_as_placed has hooked, weakly held (by identity: a tensor's == is
# element-wise)
_PLACED_GRADIENTS: Any = WeakIdKeyDictionary()


def gradient_as_placed(x: Any) -> Any:
    """Make the gradient that reaches the DTensor ``x`` take ``x``'s own placements before
    ``x``'s producer sees it — a partial sum reduced, a whole gradient sliced to the
    block — as ``parallelize_module``'s styles do at module boundaries (there by
    ``DTensor.from_local``, whose backward redistributes). Here by a gradient hook on
    ``x``, registered once however often it is asked: the hook runs on the sum of every
    reader's contribution, so readers of the same tensor share one reduction, and no
    autograd function is added to the forward (re-wrapping with ``from_local`` added
    four autograd calls a boundary, about 0.45 ms under the profiler on this project's
    CPU, at the 17 boundaries of the Llama example's tensor-parallel step). Returns
    ``x``. O(1).

    >>> import torch
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Replicate, distribute_tensor
    >>> from meshplace.runtime.processes import one_rank_world
    >>> with one_rank_world():
    ...     mesh = init_device_mesh("cpu", (1,))
    ...     w = distribute_tensor(torch.ones(2), mesh, [Replicate()]).requires_grad_()
    ...     (gradient_as_placed(w * 2) * 3).sum().backward()
    ...     w.grad.full_tensor().tolist()
    [6.0, 6.0]
    """
    if not x.requires_grad or x in _PLACED_GRADIENTS:
        return x
    _PLACED_GRADIENTS[x] = True
    mesh, placements = x.device_mesh, tuple(x.placements)

    def as_placed(grad: Any) -> Any:
        have = tuple(getattr(grad, "placements", placements))
        # over an axis where x is a partial sum each term's gradient is the whole one:
        # the gradient keeps its placement there (DTensor moves nothing to a partial)
        want = tuple(g if p.is_partial() else p for p, g in zip(placements, have, strict=True))
        return grad if want == have else grad.redistribute(mesh, want)

    x.register_hook(as_placed)
    return x


def distribute_inputs(
    plan: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], mesh: Any
) -> dict[str, Any]:
    """The inputs as DTensors with the plan's placements (by the capture's input names)."""
    from torch.distributed.tensor import distribute_tensor

    _check(plan)
    out = {}
    for name, tensor in inputs.items():
        spec = plan["inputs"].get(name)
        if spec is None:
            raise InputError(
                f"the plan has no input {name!r}; its inputs: {', '.join(plan['inputs'])}"
            )
        out[name] = distribute_tensor(tensor, mesh, placements(spec["placements"]))
    return out


def attention_shardings(
    outputs: int, tensors: Sequence[Any], others: int, mask: Any
) -> list[tuple[list[Any], list[Any]]]:
    """The placements, along one mesh axis, under which an attention kernel computes each
    block of its result from the same blocks of its inputs: every tensor whole, or split
    over the batch (dimension 0) or over the heads (dimension 1) alike, as DTensor's own
    rule for CUDA's flash attention (``_ops/_matrix_ops.py``) reads Megatron's attention
    (Shoeybi et al. 2019, Sec. 3: heads split over the tensor-parallel devices). The
    result is ``register_sharding``'s: ``(outputs' placements, inputs' placements)`` per
    choice; ``tensors`` are the kernel's positional tensor inputs (``q``, ``k``, ``v`` and
    the backward's saved ones), ``others`` its positional non-tensors, ``mask`` its
    ``attn_mask`` (``None``, or a spec with ``shape``), split only along a dimension it
    does not broadcast over. O(1).

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> [outs for outs, _ins in attention_shardings(2, [0, 0, 0], 2, None)][1:]
    [[Shard(dim=0), Shard(dim=0)], [Shard(dim=1), Shard(dim=1)]]
    """
    from torch.distributed.tensor import Replicate, Shard

    choices = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        inputs: list[Any] = [placement] * len(tensors) + [None] * others
        if mask is not None:  # a mask broadcast along the split dimension stays whole
            shape = tuple(mask.shape)
            whole = isinstance(placement, Replicate) or len(shape) < 4 or shape[placement.dim] == 1
            inputs.append(Replicate() if whole else placement)
        choices.append(([placement] * outputs, [*inputs, None]))  # + scale
    return choices


@functools.cache
def register_cpu_attention_sharding() -> None:
    """Give DTensor a sharding rule for the CPU flash-attention kernel and its backward
    (``aten._scaled_dot_product_flash_attention_for_cpu``), which it lacks (torch 2.13
    has rules for the CUDA kernels only), through its public ``register_sharding``:
    :func:`attention_shardings`. Without it a sharded step on the host had to run the
    math kernel instead, whose ``(batch x heads)`` reshapes cost DTensor ~0.1 s of
    redistribution planning per distinct shape on a 2-D mesh (30-60 s per rank on the
    first step of a 2 x 2 GPT) and ran a different kernel than the captured graph, the
    profile and a single process do. Once per process. O(1)."""
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(q: Any, k: Any, v: Any, *rest: Any, attn_mask: Any = None, **_: Any) -> Any:
        return attention_shardings(2, [q, k, v], len(rest), attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(
        grad: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        *rest: Any,
        attn_mask: Any = None,
        **_: Any,
    ) -> Any:
        return attention_shardings(3, [grad, q, k, v, out, lse], len(rest), attn_mask)


def host_attention_kernel(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """How ``scaled_dot_product_attention(*args, **kwargs)`` runs on the host inside a
    sharded step: ``"torch"`` (no DTensor among query, key and value: PyTorch's own
    choice), ``"flash"`` (4-D DTensors of one and the same placements, each whole or split
    over batch or heads, no mask: the CPU flash kernel under :func:`attention_shardings`'
    rule), ``"align"`` (the query so placed, key and value 4-D DTensors placed otherwise —
    a key projected with its contracting dimension split arrives a partial sum: they are
    redistributed to the query's placements, then the flash kernel runs) or ``"math"``
    (anything else: PyTorch's math kernel).

    The query is never moved: the flash kernel lays its output out like the query it is
    given, while DTensor derives the output's layout from the query before any
    redistribution, so a query gathered whole (contiguous) from another split would yield
    a block laid out unlike its DTensor, whose next ``view`` then fails. Grouped-query
    attention (``enable_gqa``: fewer key/value heads than query heads) takes the flash
    kernel too, which reads the groups from the blocks' head counts, where the heads split
    into as many equal blocks of key/value heads as of query heads: query head ``h`` then
    meets key/value head ``h // group`` on the same device, as in one process (Ainslie et
    al. 2023, GQA). Its math kernel repeats the key/value heads and multiplies
    ``(batch x heads)`` views, whose strided blocks cost DTensor's redistribution planner
    ~0.05 s per distinct pair of layouts on a 2-D mesh (295 of them, 14.9 s of rank 0's
    first step of a data 2 x tensor 2 Llama, where aligning the key costs one
    reduce-scatter). Heads
    split unevenly take the math kernel, grouped or not. O(mesh axes).

    >>> host_attention_kernel([torch.ones(1, 1, 1, 1)] * 3, {})  # plain tensors
    'torch'
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = ("query", "key", "value")
    qkv = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    if not any(isinstance(t, DTensor) for t in qkv):
        return "torch"
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not None or not all(isinstance(t, DTensor) and t.dim() == 4 for t in qkv):
        return "math"
    placements = qkv[0].placements
    if not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1)) for p in placements
    ):
        return "math"
    mesh_shape = qkv[0].device_mesh.shape
    head_blocks = math.prod(
        size for size, p in zip(mesh_shape, placements, strict=True) if p == Shard(1)
    )
    # equal blocks of heads on every device (an uneven split would pair query heads with
    # the wrong key/value heads under grouping)
    if any(t.shape[1] % head_blocks for t in qkv):
        return "math"
    if any(t.device_mesh != qkv[0].device_mesh for t in qkv):
        return "math"
    return "flash" if all(t.placements == placements for t in qkv) else "align"


def aligned_attention_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(args, kwargs)`` of an attention call with key and value redistributed to the
    query's placements (the ``"align"`` case of :func:`host_attention_kernel`; DTensor's
    ``redistribute`` carries the gradients back). Each is redistributed in the order of
    its memory (a model's key is a transposed view of its projection), so that its block
    is laid out as its DTensor says: redistributing the view itself leaves a block
    contiguous in the view's order, which the backward's ``view`` of the projection's
    gradient then refuses. O(1) calls."""
    from torch.distributed.tensor import Shard

    def aligned(t: Any, like: Any) -> Any:
        order = sorted(range(t.dim()), key=lambda d: -t.stride()[d])  # outermost first
        inverse = [order.index(d) for d in range(t.dim())]
        placements = [Shard(inverse[p.dim]) if isinstance(p, Shard) else p for p in like]
        return t.permute(order).redistribute(t.device_mesh, placements).permute(inverse)

    names = ("query", "key", "value")
    args, kwargs = list(args), dict(kwargs)
    query = args[0] if args else kwargs["query"]
    for i, name in enumerate(names[1:], start=1):
        if i < len(args):
            args[i] = aligned(args[i], query.placements)
        else:
            kwargs[name] = aligned(kwargs[name], query.placements)
    return args, kwargs


class CpuAttentionKernel(torch.overrides.TorchFunctionMode):
    """Attention on the host inside a sharded step, as :func:`host_attention_kernel`
    says: the flash kernel where query, key and value are placed alike (PyTorch's own
    choice under the registered rule), after moving key and value to the query's
    placements where they are not, PyTorch's math kernel (ordinary DTensor ops) where
    the flash kernel cannot run. A mode sees every torch function the step calls, so a
    run keeps it only while it needs it (:class:`HostAttention`)."""

    def __init__(self) -> None:
        super().__init__()
        self.math_calls = 0  # attention calls that ran the math kernel
        self.aligned_calls = 0  # attention calls whose key and value were moved

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        kernel = host_attention_kernel(args, kwargs)
        if kernel == "align":
            self.aligned_calls += 1
            args, kwargs = aligned_attention_inputs(args, kwargs)
        if kernel == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.math_calls += 1
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class HostAttention:
    """The attention kernel of one run's sharded steps on the host, decided on its first
    step: that step runs under :class:`CpuAttentionKernel`, which counts the attention
    calls that need the math kernel and those whose key and value it moved to the
    query's placements. When neither happened, later steps run as they are (every
    attention call takes the flash kernel under the registered rule: ``"flash"``); when
    some call needed the math kernel, later steps run every attention call on it
    (``sdpa_kernel``, as before session 41: ``"math"``); when some were only aligned,
    later steps keep the mode that aligns them (``"align"``). Only ``"align"`` keeps a
    mode: a ``TorchFunctionMode`` sees every torch call and takes DTensor off its fast
    path — a DTensor step of the Llama example (batch 8, a 1-rank mesh) took 21.7 ms with
    the flash kernel under it, 20.2 ms without it and 24.3 ms on the math kernel
    (``benchmarks/host_attention.py``). A plan's placements are the same every step, so
    the first step shows what every step's attention sees. A step that raises decides
    nothing. ``kernel``: ``None`` until decided, then ``"flash"``, ``"align"`` or
    ``"math"``. O(1).

    >>> attention = HostAttention()
    >>> with attention.context():  # no attention call: nothing needs the math kernel
    ...     _ = torch.ones(2) * 2
    >>> attention.kernel
    'flash'
    """

    def __init__(self) -> None:
        self.kernel: str | None = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The context of one step (see the class)."""
        if self.kernel == "flash":
            yield
            return
        if self.kernel == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                yield
            return
        if self.kernel == "align":
            with CpuAttentionKernel():
                yield
            return
        mode = CpuAttentionKernel()
        with mode:
            yield
        self.kernel = "math" if mode.math_calls else "align" if mode.aligned_calls else "flash"


@contextlib.contextmanager
def sharded_step(
    device_type: str = "cpu", attention: HostAttention | None = None
) -> Iterator[None]:
    """Run a forward and backward under DTensor (see the module docstring). ``attention``:
    the run's :class:`HostAttention`, kept from step to step (by default a fresh one: the
    first step's careful choice every time)."""
    from torch.distributed.tensor.experimental import implicit_replication

    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if device_type == "cpu":
            register_cpu_attention_sharding()
            stack.enter_context((attention or HostAttention()).context())
        yield


def rank_device(device_type: str) -> torch.device:
    """This rank's torch device: its current CUDA device (torchrun's ``LOCAL_RANK``, set
    before the process group), or the host."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_bytes(device_type: str) -> int:
    """This process's peak memory so far: CUDA's ``max_memory_allocated``, or on the host
    the peak resident set (which includes the Python runtime, so it is not comparable to a
    plan's tensor bytes)."""
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's block of ``t`` (a DTensor's local shard, or a plain tensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def master_block_cuts(
    placements: Sequence[Any],
    target: Sequence[Any],
    shape: Sequence[int],
    mesh_shape: Sequence[int],
) -> tuple[tuple[int, int], ...] | None:
    """Where a ZeRO master shard (placements ``target``, from
    :func:`~meshplace.runtime.sharded.zero_placements`) sits in the rank's block of its
    parameter (``placements``, global ``shape``) on a mesh of ``mesh_shape``: the
    ``(mesh axis, tensor dimension)`` of every replica axis the shard splits, in mesh-axis
    order, when the shard is the parameter's block split evenly along those dimensions —
    each axis's coordinate picks a slice of what the axes before it left, as DTensor
    nests ``Shard`` placements of one dimension — and ``None`` when it is not: blocks of
    unequal size, or a dimension the parameter itself splits on a later mesh axis (DTensor
    would split by the shard's axis first); the shard is then moved by DTensor's
    redistribution. O(mesh dimensions).

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> master_block_cuts([Shard(0), Replicate()], [Shard(0), Shard(1)], [8, 6], [4, 3])
    ((1, 1),)
    >>> master_block_cuts([Replicate(), Replicate()], [Shard(0), Shard(0)], [8, 6], [2, 2])
    ((0, 0), (1, 0))
    >>> master_block_cuts([Replicate()], [Shard(0)], [5, 3], [2]) is None  # 5 rows, 2 ranks
    True
    """
    split = [1] * len(shape)
    last_own_axis: dict[int, int] = {}  # dimension -> the last mesh axis the parameter splits
    for axis, (p, size) in enumerate(zip(placements, mesh_shape, strict=True)):
        if p.is_shard():
            split[p.dim] *= size
            last_own_axis[p.dim] = axis
    cuts = []
    for axis, (p, t, size) in enumerate(zip(placements, target, mesh_shape, strict=True)):
        if p.is_replicate() and t.is_shard() and size > 1:
            if last_own_axis.get(t.dim, -1) > axis:
                return None
            split[t.dim] *= size
            cuts.append((axis, t.dim))
    if any(n % k for n, k in zip(shape, split, strict=True)):
        return None
    return tuple(cuts)


def flat_all_reduce(flat: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """``flat`` summed over mesh dimension ``dim``, in place, by the process group's own
    all-reduce (a bucket of gradients). The runtime's flat buckets call the process group
    directly rather than through functional collectives, as DDP and FSDP2 do: on gloo
    between two CPU ranks a functional all-reduce took 1.1 ms at 16 KiB and 2.4 ms at 1
    MiB against the process group's 0.7 and 2.0 (medians, docs/runtime.md, session 60),
    and the cost model prices such calls at their own measured rates
    (``CostModel.c10d_collectives``). O(bytes)."""
    import torch.distributed as dist

    dist.all_reduce(flat, group=mesh.get_group(dim))
    return flat


def flat_all_gather(flat: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """The ranks' ``flat`` buffers over mesh dimension ``dim`` concatenated in rank order
    (a new buffer), by the process group's own all-gather (:func:`flat_all_reduce` says
    why). O(bytes gathered)."""
    import torch.distributed as dist

    out = flat.new_empty(flat.numel() * mesh.size(dim))
    dist.all_gather_single(out, flat, group=mesh.get_group(dim))
    return out


def flat_reduce_scatter(flat: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """This rank's share (its slice in rank order, a new buffer) of ``flat`` summed over
    mesh dimension ``dim``, by the process group's own reduce-scatter
    (:func:`flat_all_reduce` says why). ``flat``'s length divides by the dimension's
    size. O(bytes reduced)."""
    import torch.distributed as dist

    out = flat.new_empty(flat.numel() // mesh.size(dim))
    dist.reduce_scatter_single(out, flat, group=mesh.get_group(dim))
    return out


def gather_master_shards(
    members: Sequence[tuple[Any, Any, tuple[tuple[int, int], ...]]], mesh: Any, axes: tuple
) -> None:
    """All-gather updated ZeRO master shards into their parameters, as one flat buffer:
    ``members`` are ``(parameter block, shard block, cuts)`` local tensors, every shard cut
    along mesh ``axes`` (:func:`master_block_cuts`, the same axes for all); the shards are
    concatenated, gathered over each axis in turn (:func:`flat_all_gather`: one
    collective per axis for the whole bucket, where one per parameter pays gloo's and
    DTensor's per-call cost every time), and each parameter's block is written from the
    gathered ranks' slices, which are its sub-blocks in mesh-coordinate order. Source: the
    flat-parameter all-gather of ZeRO (Rajbhandari et al., SC 2020, Sec. 5) and FSDP
    (Zhao et al., VLDB 2023, Sec. 3.2). O(bytes gathered).
    """
    import torch

    flat = torch.cat([shard.reshape(-1) for _, shard, _ in members])
    for axis in axes:
        flat = flat_all_gather(flat, mesh, axis)
    counts = [mesh.shape[axis] for axis in reversed(axes)]  # the last axis gathered outermost
    rows = flat.view(*counts, -1)
    offset = 0
    for whole, shard, cuts in members:
        n = shard.numel()
        stacked = rows[..., offset : offset + n].reshape(*counts, *shard.shape)
        offset += n
        # each cut's rank index goes before the dimension it cut, earlier axes outermost
        ranks_of: dict[int, list[int]] = {}
        for i, (_, dim) in enumerate(cuts):
            ranks_of.setdefault(dim, []).append(len(cuts) - 1 - i)
        order: list[int] = []
        split_shape: list[int] = []
        for d, extent in enumerate(shard.shape):
            for position in ranks_of.get(d, []):
                order.append(position)
                split_shape.append(counts[position])
            order.append(len(cuts) + d)
            split_shape.append(extent)
        if whole.is_contiguous():
            whole.view(split_shape).copy_(stacked.permute(order))
        else:
            whole.copy_(stacked.permute(order).reshape(whole.shape))


def master_block(
    block: torch.Tensor,
    cuts: Sequence[tuple[int, int]],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> torch.Tensor:
    """The part of ``block`` (a rank's block of a parameter, or of its gradient) that is
    the rank's ZeRO master shard: sliced along each cut's dimension by the rank's
    ``coordinate`` on the cut's mesh axis, in the cuts' order (:func:`master_block_cuts`).
    A view. O(cuts).

    >>> master_block(torch.arange(8).reshape(4, 2), [(0, 0)], [2], [1]).tolist()
    [[4, 5], [6, 7]]
    """
    for axis, dim in cuts:
        size = block.shape[dim] // mesh_shape[axis]
        block = block.narrow(dim, coordinate[axis] * size, size)
    return block


def gather_master_shards_in_buckets(
    members: Sequence[tuple[Any, Any, tuple[tuple[int, int], ...]]],
    mesh: Any,
    bucket_bytes: int = GRADIENT_BUCKET_BYTES,
) -> None:
    """:func:`gather_master_shards` of ``members`` (``(parameter block, shard block,
    cuts)``) grouped by the mesh axes they are cut along and their dtype, in buckets of up
    to ``bucket_bytes`` of parameter each (a bucket holds at least one), as DDP buckets
    its gradients: one all-gather per bucket and axis. O(bytes gathered)."""
    groups: dict[tuple, list[tuple[Any, Any, tuple[tuple[int, int], ...]]]] = {}
    for member in members:
        axes = tuple(axis for axis, _ in member[2])
        groups.setdefault((axes, member[0].dtype), []).append(member)
    for (axes, _), group in groups.items():
        for bucket in buckets_of(group, lambda m: m[0].numel() * m[0].element_size(), bucket_bytes):
            gather_master_shards(bucket, mesh, axes)


def reduce_scatter_master_blocks(
    members: Sequence[tuple[torch.Tensor, tuple[tuple[int, int], ...]]], mesh: Any, axes: tuple
) -> list[torch.Tensor]:
    """Reduce-scatter partial-sum gradients onto their ZeRO master shards, as one flat
    buffer: ``members`` are ``(gradient block, cuts)`` — the rank's block of each
    parameter's gradient, a partial sum over mesh ``axes``, which are the axes the master
    shard is cut along (:func:`master_block_cuts`, the same axes for all). Each block is
    laid out by destination — its sub-blocks in mesh-coordinate order, the first axis
    outermost — the blocks are concatenated per destination, and the buffer is
    reduce-scattered over each axis in turn (:func:`flat_reduce_scatter`: one collective
    per axis for the whole bucket), leaving each rank the sums of its own sub-blocks: per
    member, the summed gradient's :func:`master_block`, returned as views of one buffer.
    The sums equal an all-reduce sliced by :func:`master_block` where addition order does
    not matter (two ranks an axis; integer-valued tensors), else to rounding. Half the
    bytes of an all-reduce, and no rank ever holds the whole summed gradient. Source:
    ZeRO's gradient partitioning (Rajbhandari et al., SC 2020, Sec. 5.2: P_os+g reduces
    each partition's gradients onto its owner only) with FSDP's flat reduce-scatter (Zhao
    et al., VLDB 2023, Sec. 3.2). O(bytes reduced).

    >>> import torch
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from meshplace.runtime.processes import one_rank_world
    >>> with one_rank_world():
    ...     mesh = init_device_mesh("cpu", (1,))
    ...     [block] = reduce_scatter_master_blocks([(torch.ones(2, 3), ((0, 1),))], mesh, (0,))
    ...     block.shape
    torch.Size([2, 3])
    """
    import torch

    rows = [rows_by_destination(block, cuts, mesh.shape) for block, cuts in members]
    shapes = [
        master_block(block, cuts, mesh.shape, [0] * mesh.ndim).shape for block, cuts in members
    ]
    flat = torch.cat(rows, dim=1).reshape(-1)
    for axis in axes:  # the first axis's destinations are the outermost rows
        flat = flat_reduce_scatter(flat, mesh, axis)
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def rows_by_destination(
    block: torch.Tensor, cuts: Sequence[tuple[int, int]], mesh_shape: Sequence[int]
) -> torch.Tensor:
    """``block`` (a rank's block of a parameter or its gradient) laid out by the rank
    whose ZeRO master shard each part is: one row per destination, in mesh-coordinate
    order over the cuts' axes (the first cut's axis outermost), row ``r`` the flattened
    :func:`master_block` of the destination ``r`` names — what a reduce-scatter over
    those axes in turn hands each rank. A copy where the cuts are not all along the
    first dimension. O(block).

    >>> rows_by_destination(torch.arange(8).reshape(2, 4), [(0, 1)], [2]).tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    cuts_of: dict[int, list[int]] = {}  # dimension -> the indices of its cuts
    for i, (_, dim) in enumerate(cuts):
        cuts_of.setdefault(dim, []).append(i)
    # each dimension split into its cuts' rank indices (earlier axes outermost, as DTensor
    # nests them and master_block narrows them) and the shard's extent; the rank indices
    # then moved to the front in the cuts' (mesh-axis) order
    split_shape: list[int] = []
    rank_dims = [0] * len(cuts)
    extent_dims: list[int] = []
    for d, size in enumerate(block.shape):
        for i in cuts_of.get(d, []):
            n = mesh_shape[cuts[i][0]]
            rank_dims[i] = len(split_shape)
            split_shape.append(n)
            size //= n
        extent_dims.append(len(split_shape))
        split_shape.append(size)
    destinations = math.prod(mesh_shape[axis] for axis, _ in cuts)
    by_destination = block.reshape(split_shape).permute(rank_dims + extent_dims)
    return by_destination.reshape(destinations, -1)


def buckets_of(items: Sequence[Any], nbytes: Any, limit: int) -> Iterator[list[Any]]:
    """``items`` in order, in consecutive buckets each closed once its ``nbytes(item)``
    reach ``limit`` (a bucket holds at least one item), as DDP fills its gradient
    buckets. O(items).

    >>> list(buckets_of([3, 3, 5, 1], lambda n: n, 6))
    [[3, 3], [5, 1]]
    """
    bucket: list[Any] = []
    size = 0
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def block_as_dtensor_of(block: torch.Tensor, like: Any) -> Any:
    """This rank's ``block`` as a DTensor laid out as ``like`` (a DTensor of the same
    dtype: its mesh, placements, global shape and stride), not differentiable: a
    parameter's gradient or a ZeRO master shard's, made from a local tensor. Built from
    ``like``'s spec directly, as FSDP2 builds its sharded gradients (PyTorch's
    ``_from_local_no_grad``), where ``DTensor.from_local`` runs an autograd function and
    derives the spec anew: about 7 against 33 us a call on this project's CPU, paid per
    parameter per step. Falls back to ``from_local`` for another dtype. O(1).

    >>> import torch
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Replicate, distribute_tensor
    >>> from meshplace.runtime.processes import one_rank_world
    >>> with one_rank_world():
    ...     mesh = init_device_mesh("cpu", (1,))
    ...     weight = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    ...     grad = block_as_dtensor_of(torch.zeros(4, 2), weight)
    ...     (grad.placements, tuple(grad.shape), grad.requires_grad)
    ((Replicate(),), (4, 2), False)
    """
    from torch.distributed.tensor import DTensor

    if block.dtype != like.dtype:
        return DTensor.from_local(
            block,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    return DTensor(block, like._spec, requires_grad=False)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's blocks of ``optimizer``'s state tensors (Adam's moments; its
    step counter, a scalar, is not counted, as the plans' memory models do not)."""
    return sum(
        local_nbytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def local_parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of this rank's block of every parameter (a DTensor's local shard)."""
    return {name: local_nbytes(p) for name, p in model.named_parameters()}


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
