"""Spatially partitioned convolutions on DTensor: an image split along its height or width
over mesh axes, each rank convolving its own rows or columns plus a halo of its
neighbours'.

Source: Dryden et al., "Improving Strong-Scaling of CNN Training by Exploiting
Finer-Grained Parallelism" (IPDPS 2019), spatial parallelism by halo exchange; Shazeer et
al., "Mesh-TensorFlow" (NeurIPS 2018), which splits image dimensions the same way. The
sharding solver's ``h@x``/``w@x`` convolution strategies (``parallel/sharding.py``) are
this layout, and its halo collectives (``collective_permute`` of ``halo`` rows each side)
are the messages :class:`HaloExchange` sends.

Why hand-written: PyTorch 2.13's own spatial convolution (``torch.distributed.tensor``'s
``_tp_conv``) gives wrong results without a warning — a newer sharding strategy for
``aten.convolution`` admits only batch splits, and the halo handler then wraps a rank's
local block as if it were the whole image; with that bypassed, its backward returns no
input gradient, and the halo always runs along the last dimension whatever dimension is
split. Here the split dimensions' halos go over ``torch.distributed`` point-to-point
messages (``batch_isend_irecv``: what NCCL needs), the rest is PyTorch's: the local
``torch.nn.functional.conv{1,2,3}d``, DTensor's ``to_local``/``from_local`` (whose
``grad_placements`` make the replicated weight's gradient a partial sum over the ranks
that split the image, reduced when the optimizer reads it), and autograd.

What runs: a stride-1 convolution whose padding along each split dimension is
``dilation * (kernel - 1) / 2`` ("same": its output rows are its input rows, so the
output keeps the input's split) with zero padding. A weight the plan stores split (the
solver may keep a replicated-compute weight sharded, gathered at use) is all-gathered
first; a gradient then returns to it as a reduce-scatter. Any other convolution of a
spatially split input is refused in one sentence. An input split only along its batch
(or not at all) runs DTensor's own convolution.

Cost per convolution: two messages of ``halo x (other dims)`` elements per neighbour in
the forward, the same in the backward; the convolution of ``local + 2 * halo`` rows.

Example (one process; a real run has one rank per mesh device)::

    use_spatial_convolutions(model)   # before apply_sharding_plan
    x = distribute_tensor(image, mesh, [Shard(3)])  # columns split
    model(x).mean().backward()
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from meshplace.errors import InputError

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def spatial_dims(placements: Any, ndim: int) -> list[tuple[int, int]]:
    """The (mesh dimension, tensor dimension) pairs along which a convolution input of
    ``ndim`` dimensions (``N, C, *spatial``) with these DTensor placements is split
    spatially.

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> spatial_dims([Shard(0), Shard(3)], 4), spatial_dims([Replicate()], 4)
    ([(1, 3)], [])
    """
    return [
        (m, p.dim % ndim) for m, p in enumerate(placements) if p.is_shard() and p.dim % ndim >= 2
    ]


class HaloExchange(torch.autograd.Function):
    """``local`` extended along ``dim`` by ``halo`` rows of each neighbour in ``group``
    (zeros past the image's edges); the backward sends each halo's gradient back to the
    rank it came from, which adds it to its edge rows. O(halo x other dims) per message."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, halo: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.halo, ctx.group = dim, halo, group
        before, after = _exchange(
            local.narrow(dim, 0, halo), local.narrow(dim, local.shape[dim] - halo, halo), group
        )
        return torch.cat([before, local, after], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dim, halo = ctx.dim, ctx.halo
        rows = grad.shape[dim] - 2 * halo
        # the halo rows' gradients go back to their owners: the first halo to the previous
        # rank (its last rows), the last halo to the next rank (its first rows)
        from_previous, from_next = _exchange(
            grad.narrow(dim, 0, halo), grad.narrow(dim, rows + halo, halo), ctx.group
        )
        local = grad.narrow(dim, halo, rows).clone()
        local.narrow(dim, 0, halo).add_(from_previous)
        local.narrow(dim, rows - halo, halo).add_(from_next)
        return local, None, None, None


def _exchange(first: torch.Tensor, last: torch.Tensor, group: Any) -> tuple[Any, Any]:
    """Send ``first`` to the previous rank of ``group`` and ``last`` to the next one;
    return (what the previous rank sent, what the next rank sent), zeros where there is no
    neighbour."""
    index, size = dist.get_rank(group), dist.get_world_size(group)
    from_previous = torch.zeros_like(last)
    from_next = torch.zeros_like(first)
    ops = []
    if index > 0:
        previous = dist.get_global_rank(group, index - 1)
        ops += [
            dist.P2POp(dist.isend, first.contiguous(), previous, group),
            dist.P2POp(dist.irecv, from_previous, previous, group),
        ]
    if index < size - 1:
        following = dist.get_global_rank(group, index + 1)
        ops += [
            dist.P2POp(dist.isend, last.contiguous(), following, group),
            dist.P2POp(dist.irecv, from_next, following, group),
        ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return from_previous, from_next


class SpatialConvolution:
    """Mixed into ``torch.nn.Conv1d/2d/3d`` by :func:`use_spatial_convolutions`: the same
    module, parameters and names; a spatially split DTensor input runs the halo exchange
    and the local convolution (module doc), anything else PyTorch's convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        conv: Any = self
        weight, bias = conv.weight, conv.bias
        if not isinstance(x, DTensor):
            return super().forward(x)  # type: ignore[misc]
        mesh = x.device_mesh
        whole = [Replicate()] * mesh.ndim
        if isinstance(weight, DTensor) and any(not p.is_replicate() for p in weight.placements):
            weight = weight.redistribute(mesh, whole)  # stored split, used whole
        if isinstance(bias, DTensor) and any(not p.is_replicate() for p in bias.placements):
            bias = bias.redistribute(mesh, whole)
        split = spatial_dims(x.placements, x.ndim)
        if not split:
            return conv._conv_forward(x, weight, bias)
        padding = list(_same_padding(conv, split, x))
        local = x.to_local()
        for mesh_dim, dim in split:
            halo = padding[dim - 2]
            if halo:
                rows = min(_block_rows(x.shape[dim], mesh.size(mesh_dim)))
                if rows < halo:
                    raise InputError(
                        f"a convolution with a halo of {halo} rows gets blocks of {rows} "
                        f"rows along dimension {dim}: split the image over fewer devices"
                    )
                local = HaloExchange.apply(local, dim, halo, mesh.get_group(mesh_dim))
            padding[dim - 2] = 0  # the halo (or the image's zero edge) is the padding
        # the weight's gradient: a partial sum over the mesh dimensions that split the
        # input (each rank saw part of the batch or image), whole over the others
        grads = [_partial() if p.is_shard() else Replicate() for p in x.placements]
        local_weight = weight.to_local(grad_placements=grads)
        local_bias = bias.to_local(grad_placements=grads) if bias is not None else None
        functional = (
            torch.nn.functional.conv1d,
            torch.nn.functional.conv2d,
            torch.nn.functional.conv3d,
        )[x.ndim - 3]
        out = functional(local, local_weight, local_bias, 1, padding, conv.dilation, conv.groups)
        shape = (x.shape[0], conv.out_channels, *x.shape[2:])
        return DTensor.from_local(
            out,
            mesh,
            x.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )


def _partial() -> Any:
    from torch.distributed.tensor import Partial

    return Partial()


def _block_rows(length: int, parts: int) -> list[int]:
    """The rows of each block of ``length`` rows split over ``parts`` as DTensor's
    ``Shard`` splits them (``torch.chunk``: equal blocks of ``ceil``, the last short).

    >>> _block_rows(10, 4)
    [3, 3, 3, 1]
    """
    size = math.ceil(length / parts)
    return [max(0, min(size, length - i * size)) for i in range(parts)]


def _same_padding(conv: Any, split: list[tuple[int, int]], x: Any) -> tuple[int, ...]:
    """The convolution's padding, checked to run on a spatially split input: stride 1,
    zero padding, and along each split dimension ``dilation * (kernel - 1) / 2``."""
    dims = ", ".join(str(d) for _, d in split)
    problem = None
    if isinstance(conv.padding, str):
        problem = f"padding {conv.padding!r}"  # "same"/"valid": a string, not rows
    elif conv.padding_mode != "zeros":
        problem = f"padding mode {conv.padding_mode!r}"
    elif any(s != 1 for s in conv.stride):
        problem = f"stride {tuple(conv.stride)}"
    else:
        for _, dim in split:
            k, d, p = conv.kernel_size[dim - 2], conv.dilation[dim - 2], conv.padding[dim - 2]
            if d * (k - 1) != 2 * p:
                problem = f"kernel {k}, dilation {d} and padding {p} along dimension {dim}"
    if problem is not None:
        raise InputError(
            f"a {type(conv).__name__} with {problem} gets an input split along dimension "
            f"{dims} ({x.placements}); spatially split convolutions run with stride 1 and "
            "'same' zero padding only"
        )
    return tuple(conv.padding)


def use_spatial_convolutions(model: torch.nn.Module) -> int:
    """Make every ``Conv1d/2d/3d`` of ``model`` a :class:`SpatialConvolution` of its own
    kind (its class swapped in place: parameters, names and hooks unchanged); the number
    of modules changed. O(modules).

    >>> m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU())
    >>> use_spatial_convolutions(m), type(m[0]).__name__
    (1, 'SpatialConv2d')
    """
    changed = 0
    for module in model.modules():
        kind = type(module)
        if kind in _CONVS:
            module.__class__ = _SPATIAL[kind]
            changed += 1
    return changed


_SPATIAL = {
    kind: type(f"Spatial{kind.__name__}", (SpatialConvolution, kind), {"__module__": __name__})
    for kind in _CONVS
}
