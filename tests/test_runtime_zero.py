"""ZeRO stages 1-2 on DTensor (meshplace.runtime.launch.WeightUpdateSharding): the
gradients moved onto the master shards by local slices and the updated shards gathered
back in flat buckets, and stage 2's partial-sum gradients reduce-scattered onto them in
flat buckets, hold exactly what DTensor's own redistributions give, on a 2 x 2 mesh of 4
forked gloo ranks, for every kind of placement a plan gives a parameter."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.test_parallel_execution import four_ranks, leave_and_exit

#: name -> (global shape, the parameter's placements on the ("x", "y") mesh)
PARAMETERS = {
    "replicated": ((8, 6), ("R", "R")),  # cut on "x" and then "y", both along dim 0
    "row_split": ((8, 6), ("S0", "R")),  # cut on "y" within the rows "x" gave it
    "column_split": ((4, 6), ("R", "S1")),  # cut on "x" along dim 0
    "vector": ((12,), ("R", "R")),  # cut on both axes
    "uneven": ((5, 3), ("R", "R")),  # nothing divides evenly: DTensor moves it
    "later_split": ((8, 6), ("R", "S0")),  # its shard splits rows before "y" does: DTensor
}
SLICED = {"replicated", "row_split", "column_split", "vector"}


def _placements(names: tuple[str, ...]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if n == "R" else Shard(int(n[1])) for n in names]


def _body(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from meshplace.runtime.launch import WeightUpdateSharding

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model = torch.nn.Module()
    wholes, grads, updated = {}, {}, {}
    for i, (name, (shape, placements)) in enumerate(PARAMETERS.items()):
        gen = torch.Generator().manual_seed(i)  # the same on every rank
        wholes[name] = torch.randn(shape, generator=gen)
        grads[name] = torch.randn(shape, generator=gen)
        updated[name] = torch.randn(shape, generator=gen)
        placed = distribute_tensor(wholes[name], mesh, _placements(placements))
        model.register_parameter(name, torch.nn.Parameter(placed))
    plan = {"parameters": {name: {"zero": 1 if "split" in name else 2} for name in PARAMETERS}}
    zero = WeightUpdateSharding(model, plan, mesh)
    assert set(zero.cuts) == SLICED, zero.cuts
    for name, param in model.named_parameters():
        param.grad = distribute_tensor(grads[name], mesh, param.placements)
    expected = {
        name: param.grad.redistribute(mesh, zero.masters[name][1].placements).to_local()
        for name, param in model.named_parameters()
    }
    zero.after_backward()
    for name, (param, shard, stage) in zero.masters.items():
        got = shard.grad
        assert got.placements == shard.placements and got.shape == shard.shape, name
        assert torch.equal(got.to_local(), expected[name]), name
        assert torch.equal(got.full_tensor(), grads[name]), name
        assert (param.grad is None) == (stage == 2), name  # stage 2 drops the whole gradient
        with torch.no_grad():  # the optimizer's update, as the shard's own block
            target = distribute_tensor(updated[name], mesh, shard.placements)
            shard.to_local().copy_(target.to_local())
    zero.after_step(bucket_bytes=6 * 4 * 4)  # several buckets: ~one parameter each
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), updated[name]), name
    _partial_gradients(rank, model, zero, mesh)
    Path(out, f"rank{rank}.ok").write_text("ok")


def _partial_gradients(rank: int, model: torch.nn.Module, zero: object, mesh: object) -> None:
    """Data parallelism's gradients, partial sums over every axis the parameter is
    replicated on: stage 2's sliceable ones reduce-scattered onto their shards in one
    flat bucket (one reduce-scatter per axis), the rest all-reduced and sliced or
    redistributed; each shard's gradient equal to DTensor's own reduction onto it."""
    from torch.distributed.tensor import DTensor, Partial

    from meshplace.runtime.dryrun import EngineProgram, recorder

    for i, param in enumerate(model.parameters()):
        gen = torch.Generator().manual_seed(100 * i + rank)  # each rank its own part
        local = param.to_local()
        part = torch.randint(-8, 8, local.shape, generator=gen).float()  # sums are exact
        summed = [Partial() if p.is_replicate() else p for p in param.placements]
        param.grad = DTensor.from_local(part, mesh, summed, run_check=False)
    expected = {
        name: param.grad.redistribute(mesh, zero.masters[name][1].placements)
        for name, param in model.named_parameters()
    }
    program = EngineProgram(world_size=4)
    with recorder(program, {}):
        zero.gradients_placed(model)
    kinds = [c.kind for c in program.collectives]
    # stage 2's "replicated" and "vector", both cut along x and then y, share one bucket
    # reduce-scattered over x and then y; the rest are all-reduced in buckets by the axes
    # they sum over: "row_split" over y; "column_split" and "later_split" over x; "uneven"
    # (stage 2, but no block of its parameter) over x and y
    assert kinds.count("reduce_scatter") == 2 and kinds.count("all_reduce") == 4, kinds
    for name, (param, shard, stage) in zero.masters.items():
        assert torch.equal(shard.grad.to_local(), expected[name].to_local()), name
        assert torch.equal(shard.grad.full_tensor(), expected[name].full_tensor()), name
        assert (param.grad is None) == (stage == 2), name


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4)
    _body(rank, out)
    leave_and_exit()


def test_zero_slices_and_bucketed_gathers_equal_dtensors_redistributions(tmp_path: Path) -> None:
    """Per parameter: the master shard's gradient after :meth:`after_backward` is
    ``torch.equal`` to DTensor's redistribution of the whole gradient onto the shard's
    placements (a local slice where the shard is a block of the parameter's block, DTensor
    itself elsewhere: a dimension the parameter splits on a later axis, an uneven split);
    the whole gradient is
    dropped at stage 2 only; and after :meth:`after_step`, gathering in buckets of about
    one parameter, every parameter holds exactly the shards' update."""
    store = str(tmp_path / "store")
    four_ranks("fork", _rank, lambda r: (r, store, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == [f"rank{r}.ok" for r in range(4)]


def _dtensor_block(whole: torch.Tensor, placements: list, mesh_shape: tuple, coordinate: tuple):
    """The block of ``whole`` that DTensor gives the rank at ``coordinate``: each mesh
    axis's ``Shard(d)`` in axis order splits dimension ``d`` of what the axes before it
    left (even splits)."""
    for axis, p in enumerate(placements):
        if p.is_shard():
            whole = whole.chunk(mesh_shape[axis], p.dim)[coordinate[axis]]
    return whole


@pytest.mark.parametrize("mesh_shape", [(2, 3), (3, 2), (2, 3, 2)])
def test_master_blocks_and_their_rows_nest_as_dtensor_does_on_uneven_meshes(
    mesh_shape: tuple,
) -> None:
    """Without processes, on meshes whose axes differ in size (which a 2 x 2 mesh cannot
    tell apart): for every parameter shape and placement whose ZeRO shard is a block of
    the parameter's, at every mesh coordinate, :func:`master_block` of the rank's block
    is the block DTensor gives the master shard, and :func:`rows_by_destination` puts
    each destination's master block in its row (the first cut axis outermost)."""
    from torch.distributed.tensor import Replicate, Shard

    from meshplace.runtime.sharded import (
        master_block,
        master_block_cuts,
        rows_by_destination,
        zero_placements,
    )

    covered = 0
    for shape in [(12, 6), (6, 12), (2, 9), (36,), (4, 6, 6)]:
        whole = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        options = [Replicate()] + [Shard(d) for d in range(len(shape))]
        for placements in itertools.product(options, repeat=len(mesh_shape)):
            if not any(p.is_replicate() for p in placements):
                continue
            target = zero_placements(list(placements), shape, mesh_shape)
            cuts = master_block_cuts(placements, target, shape, mesh_shape)
            if cuts is None or not cuts:
                continue
            covered += 1
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                block = _dtensor_block(whole, list(placements), mesh_shape, coordinate)
                expected = _dtensor_block(whole, target, mesh_shape, coordinate)
                got = master_block(block, cuts, mesh_shape, coordinate)
                assert torch.equal(got, expected), (shape, placements, coordinate)
                rows = rows_by_destination(block, cuts, mesh_shape)
                row = 0
                for axis, _ in cuts:  # the destination's index, first cut axis outermost
                    row = row * mesh_shape[axis] + coordinate[axis]
                assert torch.equal(rows[row], expected.reshape(-1)), (shape, placements)
    assert covered >= 15, covered
