"""Sharding any captured model (issue 14): index notation and view maps at capture, the
resharding table, the training-memory terms, the integer program against brute force, and
``meshplace shard`` on captured graphs through the command line (forked,
tests/forked_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplace.graph.capture import capture
from meshplace.graph.io import graph_from_json, graph_to_json
from meshplace.graph.opdims import OpDims, alias_map, op_einsum, view_map
from meshplace.hardware import load_cluster
from meshplace.mesh.layout import build_mesh
from meshplace.parallel import ilp
from meshplace.parallel.search import ShardingError, data_parallel_plans, shard_graph
from meshplace.parallel.sharding import FLAT, P, R, ShardingProblem
from tests.forked_cli import run_meshplace

ROOT = Path(__file__).resolve().parents[1]


def mlp(d_in: int = 64, hidden: int = 256, batch: int = 32) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d_in)
    )
    return model, (torch.randn(batch, d_in),)


# ------------------------------------------------------------------ index notation
def test_notation_round_trips_and_labels_what_the_op_computes() -> None:
    for text in (
        "m k,k n->m n|k",
        "a b c->a b c; whole c",
        "n i h w,o i _ _,o->n o h w|i; halo h=1 w=1",
        "(),n c,n,()->n c",
        "->a",
        "n c,n->()|n c,()|n",
    ):
        assert str(OpDims.parse(text)) == text
    d = OpDims.parse("n i h w,o i _ _,o->n o h w|i; halo h=1 w=1")
    assert d.splittable() == ["n", "i", "h", "w", "o"] and d.halo == {"h": 1, "w": 1}
    assert str(op_einsum("addmm", [], [[16], [8, 4], [4, 16]], [[8, 16]])) == "n,m k,k n->m n|k"
    conv = op_einsum(
        "convolution",
        [[2, 3, 8, 8], [4, 3, 3, 3], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1],
        [[2, 3, 8, 8], [4, 3, 3, 3], None],
        [[2, 4, 8, 8]],
    )
    assert str(conv) == "n i h w,o i _ _->n o h w|i; halo h=1 w=1"
    strided = op_einsum(  # stride 2, 7x7: spatial dims stay whole
        "convolution",
        [[2, 3, 9, 9], [4, 3, 7, 7], None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1],
        [[2, 3, 9, 9], [4, 3, 7, 7], None],
        [[2, 4, 5, 5]],
    )
    assert str(strided) == "n i _ _,o i _ _->n o _ _|i"
    soft = op_einsum("_softmax", [[4, 8, 16], -1, False], [[4, 8, 16]], [[4, 8, 16]])
    assert str(soft) == "a b c->a b c; whole c"
    emb = op_einsum("embedding", [[100, 8], [2, 5]], [[100, 8], [2, 5]], [[2, 5, 8]])
    # the gradient of a slice, placed into zeros: the sliced dimension stays whole
    grad = [[2, 4, 32, 8], [2, 4, 32, 16], 3, 0, 8, 1]
    sliced = op_einsum("slice_backward", grad, [grad[0], *[None] * 5], [[2, 4, 32, 16]])
    assert str(sliced) == "a b c _->a b c _"
    assert str(emb) == "v d,a b->a b d|v"  # a split vocabulary gives partial sums
    assert op_einsum("cumsum", [[4, 8], 1], [[4, 8]], [[4, 8]]) is None  # not pointwise


def test_view_maps_follow_block_splits_through_reshapes_and_permutes() -> None:
    assert view_map([2048, 768], [2, 1024, 768]) == [0, -1, 1]
    assert view_map([2, 1024, 768], [2048, 768]) == [0, 2]
    assert view_map([4, 1, 6], [4, 6]) == [0, 2]
    assert alias_map("permute", [[0, 2, 1, 3]], [2, 8, 4, 16], [[2, 4, 8, 16]]) == [[0, 2, 1, 3]]
    assert alias_map("t", [], [3, 5], [[5, 3]]) == [[1, 0]]
    assert alias_map("expand", [[4, 3, 5]], [1, 5], [[4, 3, 5]]) == [[-1, -1, 1]]
    assert alias_map("split", [4, 1], [2, 12], [[2, 4]] * 3) == [[0, -1]] * 3
    assert alias_map("unsqueeze", [1], [3, 5], [[3, 1, 5]]) == [[0, -1, 1]]


def test_capture_records_operands_and_notation_and_files_keep_them() -> None:
    model, inputs = mlp()
    g = capture(model, inputs, training=True)
    computing = [o for o in g.ops if o.kind not in ("parameter", "buffer", "input")]
    assert all(o.einsum is not None for o in computing), [
        o.target for o in computing if o.einsum is None
    ]
    first = next(o for o in g.ops if o.target == "aten.addmm.default")
    assert first.einsum == "n,m k,k n->m n|k"
    # the weight is read through t(): the operand's dims map to the parameter's, swapped
    weight = first.operands[2]
    assert weight["op"] == "param:0.weight" and weight["map"] == [1, 0]
    assert weight["shape"] == [64, 256]
    for o in computing:
        for rec in o.operands:
            producer = g.op(rec["op"])
            pshape = producer.output_shapes[rec["out"]]
            for dim, pd in enumerate(rec["map"]):
                if pd >= 0:  # a mapped dimension is the producer's, or its leading factor
                    assert (
                        pshape[pd] % rec["shape"][dim] == 0 or rec["shape"][dim] % pshape[pd] == 0
                    )
    again = graph_from_json(graph_to_json(g))
    assert again == g


def test_graph_files_with_bad_notation_are_one_sentence() -> None:
    model, inputs = mlp()
    data = json.loads(graph_to_json(capture(model, inputs, training=True)))
    op = next(o for o in data["ops"] if o.get("einsum"))
    op["einsum"] = "m k->m n"  # one operand labelled where the op has three
    with pytest.raises(Exception, match="field 'einsum'"):
        graph_from_json(json.dumps(data))
    op["einsum"] = None
    op["operands"][0]["op"] = "nowhere"
    with pytest.raises(Exception, match="names op 'nowhere'"):
        graph_from_json(json.dumps(data))


# ------------------------------------------------------------------ costs and memory
@pytest.fixture(scope="module")
def problem() -> ShardingProblem:
    model, inputs = mlp()
    g = capture(model, inputs, training=True)
    return ShardingProblem(g, build_mesh(load_cluster("dgx-h100"), (4,)), tie_layers=False)


def test_resharding_table_charges_the_collective_each_change_needs(
    problem: ShardingProblem,
) -> None:
    shape, ident = [32, 256], [0, 1]
    full = 32 * 256 * 4
    mesh = problem.mesh
    cases = {
        ((P,), (R,)): ("all_reduce", full),
        ((P,), (0,)): ("reduce_scatter", full),
        ((0,), (R,)): ("all_gather", full),
        ((0,), (1,)): ("all_to_all", full / 4),
        ((P,), (FLAT,)): ("reduce_scatter", full),
    }
    for (have, need), (kind, nbytes) in cases.items():
        t, colls = problem.reshard(have, need, ident, shape, 4)
        assert [c[0] for c in colls] == [kind]
        assert t == pytest.approx(mesh.collective_time(kind, nbytes, ["x"]))
    for have, need in (((R,), (0,)), ((0,), (0,)), ((R,), (R,)), ((1,), (1,))):
        assert problem.reshard(have, need, ident, shape, 4) == (0.0, ())
    # through a transposing view, S(0) of the producer is S(1) of the consumer
    assert problem.reshard((0,), (1,), [1, 0], [256, 32], 4) == (0.0, ())


def test_each_gradient_is_reduced_once_for_the_update_as_the_runtime_reduces_it() -> None:
    """Adam's captured update reads each gradient three times (both moments, the second
    squared); a runtime brings it to the update's placement once — the torchrun runtime's
    bucketed all-reduce at ZeRO 0 and 1 (ZeRO 1 keeps the whole gradient and slices its
    block), its reduce-scatter from ZeRO 2 — and so does the plan: one collective per
    parameter, of that kind, on the gradient's bytes."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    g = capture(model, (torch.randn(256, 64),), training=True)
    problem = ShardingProblem(g, build_mesh(load_cluster("dgx-h100"), (4,)))
    bundles = problem.group_edges()
    kinds = {0: "all_reduce", 1: "all_reduce", 2: "reduce_scatter", 3: "reduce_scatter"}
    checked = 0
    for gv, group in enumerate(problem.groups):
        if group.kind != "parameter":
            continue
        reads = [
            (pv, j)
            for pv, i in enumerate(group.members)
            for j, rec in enumerate(g.ops[i].operands or [])
            if problem.group_of[g.index(rec["op"])] != gv
        ]
        assert len(reads) == 3, reads  # the gradient, read by three of the update's ops
        (gu,) = [u for (u, v) in bundles if v == gv]
        (record,) = bundles[(gu, gv)]  # one read charged
        assert set(problem.repeated_reads()) >= {
            (group.members[pv], j) for pv, j in reads if (pv, j) != record[2:]
        }
        producer = problem.groups[gu]
        partial = [s for s in producer.strategies if s.out_specs[record[0]][record[1]] == (P,)]
        if not partial:
            continue  # a bias gradient summed inside its producer's group
        pu, out, pv, j = record
        rec = g.ops[group.members[pv]].operands[j]
        nbytes = math.prod(rec["shape"]) * 4
        for strategy in group.strategies:
            if strategy.out_specs[0][0] != (R,):
                continue
            charged = problem.reshard(
                partial[0].out_specs[pu][out], strategy.in_specs[pv][j], rec["map"], rec["shape"], 4
            )[1]
            # (a collective's bytes: the tensor whole along the axis, as the mesh's
            # collective_time takes them)
            assert [(k, b) for k, _, b, _ in charged] == [(kinds[strategy.zero], nbytes)], (
                strategy.name,
                charged,
            )
            checked += 1
    assert checked >= 8  # two weights, four update shardings each


def test_bucketed_gradient_reductions_share_one_fixed_cost_per_bucket() -> None:
    """The runtime reduces gradients in flat buckets of GRADIENT_BUCKET_BYTES (DDP, the
    torchrun runtime), so a model whose gradients fill one bucket pays one all-reduce's
    fixed cost (the latency of its steps), not one per parameter: each reduction into a
    parameter's update carries its bytes' share of it, and the shares of the whole model
    add up to ceil(G / bucket) fixed costs. A reduction anywhere else pays its own."""
    from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
    from meshplace.cost.compute import CostModel

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    g = capture(model, (torch.randn(32, 64),), training=True)
    mesh = build_mesh(load_cluster("dgx-h100"), (2,), chips=2)
    # gloo-like collectives: a millisecond of latency, then 1 GB/s
    slow = CostModel(collectives={mesh.device_kind: {"all_reduce": (1e-3, 1e9)}})
    problem = ShardingProblem(g, mesh, zero_stages=(0,), cost_model=slow)
    fixed = problem.fixed_comm_time("all_reduce", 0)
    assert fixed == pytest.approx(2e-3)  # ring of 2: 2 (p - 1) steps of 1 ms
    held = sum(math.prod(o.output_shapes[0]) * 4 for o in g.ops if o.kind == "parameter")
    assert held < GRADIENT_BUCKET_BYTES
    whole = problem.comm_time("all_reduce", held, 0)
    shares = [
        problem.comm_time("all_reduce", math.prod(o.output_shapes[0]) * 4, 0, problem.bucket_bytes)
        for o in g.ops
        if o.kind == "parameter"
    ]
    assert len(shares) == 12 and sum(shares) == pytest.approx(whole)  # one bucket, whole
    # the data-parallel plan's reductions into the updates cost that one bucket
    dtensor = dataclasses.replace(slow, dispatch_overhead={mesh.device_kind: 1e-5})
    plan = data_parallel_plans(g, mesh, 8e10, dtensor, zero_stages=(0,))[0]
    rows = [r for r in plan.collectives() if r["category"] == "gradients"]
    assert [(r["kind"], r["calls"], r["bytes"]) for r in rows] == [("all_reduce", 12, held)]
    assert rows[0]["seconds"] == pytest.approx(whole)
    # an activation's partial sums completed for a reader in backward: no bucket
    assert problem.comm_time("all_reduce", 1024, 0) > fixed


def test_pure_data_parallelism_is_priced_as_ddp_runs_it_without_dtensor_dispatch() -> None:
    """A cost model that charges DTensor's per-op dispatch prices every plan of the
    integer program with it; the runtime runs pure data parallelism at ZeRO 0-1 on DDP,
    plain tensors, so those plans are priced apart without it — every op on its share of
    the batch (no resharding: each rank's loss is its own), the gradients reduced in one bucket
    — and join the solver's candidates and the grid's points: with a dispatch that
    dwarfs the compute, the kept plan is DDP's."""
    from meshplace.cost.compute import CostModel
    from meshplace.parallel.grid import megatron_grid

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    g = capture(model, (torch.randn(32, 64),), training=True)
    cluster = load_cluster("dgx-h100")
    mesh = build_mesh(cluster, (2,), chips=2)
    dtensor = CostModel(dispatch_overhead={mesh.device_kind: 1e-3})
    kernels = sum(1 for o in g.ops if o.kind not in ("parameter", "buffer", "input"))
    result = shard_graph(g, cluster, chips=2, cost_model=dtensor, zero_stages=(0, 1))
    best = result.best
    assert best.plain_tensors and best.mesh.shape == (2,)
    assert best.to_dict(detail=False)["plain_tensors"] is True
    assert all(c.compute_s >= kernels * 1e-3 for c in result.candidates if not c.plain_tensors)
    ddp = data_parallel_plans(g, mesh, 8e10, dtensor, zero_stages=(0, 1, 2))
    assert sorted(ddp) == [0, 1]  # ZeRO 2 runs on DTensor
    for zero, plan in ddp.items():
        assert plan.compute_s < 0.1 * kernels * 1e-3  # no dispatch in it
        resharded = [r for r in plan.collectives() if r["category"] == "reshard"]
        assert not resharded, resharded  # each rank keeps its own loss: no all-reduce of it
        names = [r["kind"] for r in plan.collectives() if r["category"] == "gradients"]
        assert names == ["all_reduce"], (zero, names)
    grid = megatron_grid(g, cluster, chips=2, cost_model=dtensor, zero_stages=(0, 1, 2))
    kept = {(p.tp, p.zero): p.plan.plain_tensors for p in grid.points if p.plan is not None}
    assert kept == {(1, 0): True, (1, 1): True, (1, 2): False, (2, 0): False}
    with pytest.raises(ShardingError, match="one mesh axis"):
        data_parallel_plans(g, mesh, 8e10, CostModel())


class _Blocks(torch.nn.Module):
    """Three blocks in a ModuleList (FSDP2's units, as torchtitan wraps them) and a head
    at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_fsdp2_units_read_from_the_graph_are_the_runtimes() -> None:
    """The solver reads FSDP2's units from the parameters' names; the runtime wraps
    modules: both put each block's parameters in its own unit and the rest in the root,
    and a weight tied into a block puts everything in the root."""
    from meshplace.parallel.sharding import fsdp_unit_names
    from meshplace.runtime.data_parallel import fsdp_units

    model = _Blocks()
    units = fsdp_unit_names(capture(model, (torch.randn(8, 64),), training=True))
    wrapped = fsdp_units(model)
    runtime = {
        f"param:{name}": next(
            (
                prefix
                for prefix, m in model.named_modules()
                if m in wrapped[:-1] and name.startswith(prefix + ".")
            ),
            "",
        )
        for name, _ in model.named_parameters()
    }
    assert units == runtime
    assert sorted(set(units.values())) == ["", "layers.0", "layers.1", "layers.2"]

    class Tied(_Blocks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = super().forward(x)
            return x @ self.layers[0].weight[:8, :8]

    tied = fsdp_unit_names(capture(Tied(), (torch.randn(8, 64),), training=True))
    assert set(tied.values()) == {""}


def test_zero3_data_parallelism_is_priced_as_fsdp2_runs_it() -> None:
    """The runtime runs a ZeRO-3 data-parallel plan on FSDP2, one unit per block plus the
    root: plain tensors (no DTensor dispatch), each unit's parameters gathered in one
    collective before forward and, but the root's, again before backward, its gradients
    reduce-scattered in one, and FSDP2's own cost paid once per unit."""
    from meshplace.cost.compute import CostModel

    g = capture(_Blocks(), (torch.randn(32, 64),), training=True)
    mesh = build_mesh(load_cluster("dgx-h100"), (2,), chips=2)
    links = {kind: (1e-3, 1e9) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    kind = mesh.device_kind
    dtensor = CostModel(collectives={kind: links}, dispatch_overhead={kind: 1e-3})
    fsdp = dataclasses.replace(dtensor, fsdp_unit_overhead={kind: 2e-3})
    plan = data_parallel_plans(g, mesh, 8e10, fsdp, zero_stages=(3,))[3]
    alone = data_parallel_plans(g, mesh, 8e10, dtensor, zero_stages=(3,))[3]
    assert plan.plain_tensors and plan.to_dict(detail=False)["plain_tensors"] is True
    assert plan.compute_s - alone.compute_s == pytest.approx(4 * 2e-3)  # four units
    unit_bytes = [(64 * 64 + 64) * 4] * 3 + [(64 * 8 + 8) * 4]  # three blocks, the root
    on = mesh.calibrated(fsdp)  # the measured collectives
    times = {
        k: [on.collective_time(k, b, list(mesh.axis_names)) for b in unit_bytes]
        for k in ("all_gather", "reduce_scatter")
    }
    rows = {(r["kind"], r["category"]): r for r in plan.collectives()}
    gathers = rows[("all_gather", "weights")]
    assert gathers["calls"] == 8  # a weight and a bias in each unit
    assert gathers["seconds"] == pytest.approx(
        2 * sum(times["all_gather"][:3]) + times["all_gather"][3]
    )
    assert sorted(rows) == [("all_gather", "weights"), ("reduce_scatter", "gradients")]
    reductions = rows[("reduce_scatter", "gradients")]
    assert reductions["seconds"] == pytest.approx(sum(times["reduce_scatter"]))
    # on DTensor, each parameter's gather pays a fixed cost of its own
    per_parameter = ShardingProblem(g, mesh, zero_stages=(3,), cost_model=dtensor)
    for name in ("param:layers.0.bias", "param:head.weight"):
        op = g.ops[g.index(name)]
        nbytes = math.prod(op.output_shapes[0]) * 4
        group = per_parameter.groups[int(per_parameter.group_of[g.index(name)])]
        replicated = [s for s in group.strategies if s.zero == 3 and s.out_specs[0][0] == (R,)]
        assert replicated[0].gather_s == pytest.approx(
            on.collective_time("all_gather", nbytes, list(mesh.axis_names))
        )


def test_a_split_dtensor_cannot_view_is_never_planned() -> None:
    """DTensor (torch 2.13) refuses to unflatten a split dimension into a leading one its
    ways do not divide (32 features = 2 heads x 16, split 4 ways): no strategy makes that
    split, nor one that DTensor would carry into it (the weight split by rows, whose
    product it then splits); split 2 ways, both are offered."""

    class Heads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(64, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).view(x.shape[0], 2, 16).sum()

    g = capture(Heads(), (torch.randn(8, 64),), training=True)
    cluster = load_cluster("dgx-h100")
    weight = g.index("param:proj.weight")
    projection = next(i for i, o in enumerate(g.ops) if o.target == "aten.mm.default")
    for ways, allowed in ((4, False), (2, True)):
        problem = ShardingProblem(g, build_mesh(cluster, (ways,), chips=ways), zero_stages=(0,))
        rows = {st.out_specs[0][0] for st in problem.groups[problem.group_of[weight]].strategies}
        made = {
            st.out_specs[problem.member_pos[projection]][0]
            for st in problem.groups[problem.group_of[projection]].strategies
        }
        assert ((0,) in rows) is allowed and ((1,) in made) is allowed, (ways, rows, made)
        assert (R,) in rows and (0,) in made  # whole, or split by the batch


def test_parameter_memory_is_exact_for_every_placement_and_update_sharding(
    problem: ShardingProblem,
) -> None:
    g = problem.graph
    seen = set()
    for group in problem.groups:
        if group.kind != "parameter":
            continue
        op = g.ops[group.anchor]
        for s in group.strategies:
            spec = s.out_specs[0][0]
            shards = 4 if any(p >= 0 for p in spec) else 1
            replicas = 4 // shards
            local = op.param_bytes / shards
            want = {
                "parameters": local / (replicas if s.zero >= 3 else 1),
                "gradients": local / (replicas if s.zero >= 2 else 1),
                "optimizer_state": 2 * local / (replicas if s.zero >= 1 else 1),  # Adam
            }
            assert s.parts == pytest.approx(want, rel=0, abs=0)
            seen.add((shards, s.zero))
    assert {(1, 0), (1, 1), (1, 2), (1, 3), (4, 0)} <= seen


def test_data_parallel_wins_for_a_large_batch_and_gradients_are_reduced() -> None:
    model, _ = mlp(d_in=1024, hidden=1024)
    g = capture(model, (torch.randn(16384, 1024),), training=True)
    best = shard_graph(g, load_cluster("dgx-h100"), mesh_shape=(4,)).best
    strategies = best.op_strategies()
    matmuls = [o.name for o in g.ops if o.target == "aten.addmm.default"]
    assert all(strategies[m] == "m@x" for m in matmuls), strategies  # rows (batch) split
    kinds = {(c["kind"], c["category"]) for c in best.collectives()}
    assert kinds & {("all_reduce", "gradients"), ("reduce_scatter", "gradients")}
    assert best.fits and best.step_time_s > 0


def _simulate_streams(problem: ShardingProblem, choice: list[int]) -> float:
    """An event-by-event simulation of the step (the oracle for the closed form of
    ``ShardingProblem.timeline``): one compute stream running blocking work in graph
    order; a gather channel fetching, from the step's start and in order, what forward
    ops read of the parameters, each op waiting for its fetches; a backward channel
    running gradient reductions and backward fetches first-come first-served from the
    moment they are issued; the optimizer phase after the last."""
    tl = problem.events()
    strat = [g.strategies[c] for g, c in zip(problem.groups, choice, strict=True)]

    def bundle(gu: int, gv: int) -> float:
        t = 0.0
        for pu, out, pv, j in tl.bundles[(gu, gv)]:
            rec = problem.graph.ops[problem.groups[gv].members[pv]].operands[j]
            have, need = strat[gu].out_specs[pu][out], strat[gv].in_specs[pv][j]
            itemsize = problem.itemsize(rec["op"], rec["out"])
            bucket = problem.edge_bucket_bytes(gu, gv)
            t += problem.reshard(have, need, rec["map"], rec["shape"], itemsize, bucket)[0]
        return t

    def job(kind: str, key: Any) -> float:
        if kind == "edge":
            return bundle(*key)
        if kind == "internal":
            return strat[key].comm_s
        wanted = 1 if kind == "gather" else 2
        return strat[key].gather_s if strat[key].gathers >= wanted else 0.0

    releases = sorted(tl.reduce_events, key=lambda e: e[0])
    fetches = sorted(tl.gather_events, key=lambda e: e[0])
    clock, channel, fetched, k, f = 0.0, 0.0, 0.0, 0, 0
    update = 0.0
    for pos, (kind, key) in tl.work:
        if kind == "node":
            t = strat[key].compute_s + (0 if key in tl.tail else strat[key].comm_s)
        else:
            t = bundle(*key)
        if pos >= tl.update_start:
            update += t
            continue
        # a job issued before this op (the first work past its issuing op) joins the
        # queue now: the clock is when that op, and everything before, ended
        while k < len(releases) and releases[k][0] < pos:
            channel = max(channel, clock) + job(*releases[k][1])
            k += 1
        while f < len(fetches) and fetches[f][0] <= pos:  # what this op reads, fetched
            fetched += job(*fetches[f][1])
            f += 1
        clock = max(clock, fetched) + t
    while f < len(fetches):
        fetched += job(*fetches[f][1])
        f += 1
    clock = max(clock, fetched)
    while k < len(releases):
        channel = max(channel, clock) + job(*releases[k][1])
        k += 1
    return max(clock, channel) + update


def test_gradient_reduction_overlaps_backward_and_the_program_counts_it_exactly() -> None:
    # 1024-wide layers: with each gradient reduced once (not once per read of Adam's
    # update), 512-wide ones reduce entirely behind their backward
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    g = capture(model, (torch.randn(4096, 1024),), training=True)
    cluster = load_cluster("dgx-h100")
    mesh = build_mesh(cluster, (4,))
    for stages in ((0,), (0, 1, 2, 3)):
        problem = ShardingProblem(g, mesh, zero_stages=stages)
        tables = problem.cost_tables(checkpoints=10**6)  # every position a row: exact
        sol = tables.solve()
        choice = [sol.choice[int(problem.class_of[i])] for i in range(len(problem.groups))]
        tl = problem.timeline(choice)
        assert sol.objective == pytest.approx(tl["step_s"], rel=1e-9)
        assert tl["step_s"] == pytest.approx(
            tl["compute_s"]
            + tl["blocking_comm_s"]
            + tl["backward_stream_exposed_s"]
            + tl["forward_gathers_exposed_s"],
            rel=1e-12,
        )
        if stages == (0,):
            # the gradients' reductions, mostly hidden behind backward
            assert 0 < tl["backward_stream_exposed_s"] < tl["backward_stream_s"]
        # the closed form is the simulation, and the program's objective is the closed
        # form, at the optimum and at random plans (ZeRO-3 regathers, prefetched weights)
        rng = np.random.default_rng(0)
        kinds = set()
        for trial in range(25):
            cls = (
                sol.choice
                if trial == 0
                else [
                    int(rng.integers(len(problem.groups[cg[0]].strategies)))
                    for cg in problem.class_groups
                ]
            )
            flat = [cls[int(problem.class_of[i])] for i in range(len(problem.groups))]
            t = problem.timeline(flat)
            assert t["step_s"] == pytest.approx(_simulate_streams(problem, flat), rel=1e-9)
            assert tables.evaluate(cls) == pytest.approx(t["step_s"], rel=1e-9)
            kinds |= {
                k for k in ("backward_stream_exposed_s", "forward_gathers_exposed_s") if t[k] > 0
            }
        assert kinds == {"backward_stream_exposed_s", "forward_gathers_exposed_s"}
        serial = ShardingProblem(g, mesh, zero_stages=stages, overlap=False)
        plain = serial.cost_tables().solve()
        assert sol.objective <= plain.objective * (1 + 1e-9)  # hiding never costs time
        flat = [plain.choice[int(serial.class_of[i])] for i in range(len(serial.groups))]
        t = serial.timeline(flat)
        assert t["step_s"] == pytest.approx(
            t["compute_s"] + t["blocking_comm_s"] + t["backward_stream_s"] + t["forward_gathers_s"],
            rel=1e-12,
        )
        assert plain.objective == pytest.approx(t["step_s"], rel=1e-9)


def test_memory_limit_is_a_hard_constraint_and_misses_are_explained() -> None:
    model, _ = mlp(d_in=1024, hidden=8192)
    g = capture(model, (torch.randn(8192, 1024),), training=True)
    cluster = load_cluster("dgx-h100")
    problem = ShardingProblem(g, build_mesh(cluster, (4,)))
    lean = problem.cost_tables().solve(None, minimise="memory").memory
    free = shard_graph(g, cluster, mesh_shape=(4,)).best
    assert free.fits and free.peak_memory_bytes > 1.01 * lean  # the fastest plan is not the leanest
    cap = (lean + free.peak_memory_bytes) / 2
    tight = shard_graph(g, cluster, mesh_shape=(4,), memory_fraction=cap / free.capacity_bytes).best
    assert tight.peak_memory_bytes <= cap * (1 + 1e-6)
    assert tight.step_time_s >= free.step_time_s * (1 - 1e-6)
    with pytest.raises(ShardingError, match=r"iB short"):
        shard_graph(g, cluster, mesh_shape=(4,), memory_fraction=0.9 * lean / free.capacity_bytes)


def test_identical_layers_share_one_decision() -> None:
    layers = [torch.nn.Linear(32, 32) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    g = capture(model, (torch.randn(16, 32),), training=True)
    mesh = build_mesh(load_cluster("dgx-h100"), (2,))
    tied = ShardingProblem(g, mesh)
    untied = ShardingProblem(g, mesh, tie_layers=False)
    assert tied.num_classes < untied.num_classes / 3
    a = tied.cost_tables().solve()
    b = untied.cost_tables().solve()
    assert a.objective >= b.objective * (1 - 1e-6)  # tying restricts, never improves


# ------------------------------------------------------------------ the integer program
@st.composite
def assignment_problems(draw):
    n = draw(st.integers(2, 5))
    sizes = [draw(st.integers(1, 3)) for _ in range(n)]
    cost = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    node = [np.array([draw(cost) for _ in range(s)]) for s in sizes]
    mem = [np.array([draw(cost) for _ in range(s)]) for s in sizes]
    trans = [np.array([draw(cost) for _ in range(s)]) for s in sizes]
    edges = {}
    for a in range(n):
        for b in range(a + 1, n):
            if draw(st.booleans()):
                edges[(a, b)] = np.array(
                    [[draw(cost) for _ in range(sizes[b])] for _ in range(sizes[a])]
                )
    capacity = draw(st.one_of(st.none(), st.floats(0, 60)))
    # overlapped streams: exposures max(0, max_k R[k] . q) over linear forms q of the choice
    quantities = []
    for _ in range(draw(st.integers(0, 3))):
        q = ilp.Quantity()
        for v in draw(st.sets(st.integers(0, n - 1), max_size=2)):
            q.node[v] = np.array([draw(cost) for _ in range(sizes[v])])
        for key in draw(st.sets(st.sampled_from(sorted(edges)), max_size=2)) if edges else ():
            q.edge[key] = np.array(
                [[draw(cost) for _ in range(sizes[key[1]])] for _ in range(sizes[key[0]])]
            )
        quantities.append(q)
    exposures = []
    if quantities:
        for _ in range(draw(st.integers(0, 2))):
            k = draw(st.integers(1, 3))
            exposures.append(
                np.array(
                    [[draw(st.integers(-2, 2)) for _ in quantities] for _ in range(k)], dtype=float
                )
            )
    return ilp.Tables(node, edges, mem, trans, quantities, exposures), capacity


@settings(max_examples=80, deadline=None)
@given(assignment_problems())
def test_integer_program_equals_brute_force(case) -> None:
    tables, capacity = case
    want = ilp.brute_force(
        tables.node,
        tables.edges,
        tables.memory,
        tables.transient,
        capacity,
        tables.quantities,
        tables.exposures,
    )
    got = tables.solve(capacity)
    if want.status == ilp.INFEASIBLE:
        # HiGHS's feasibility tolerance may accept a plan a hair over the capacity
        assert got.status == ilp.INFEASIBLE or got.memory <= capacity * (1 + 1e-6) + 1e-6
        return
    assert got.status == ilp.OPTIMAL
    assert got.objective == pytest.approx(want.objective, rel=1e-5, abs=1e-6)
    if capacity is not None:
        assert got.memory <= capacity * (1 + 1e-6) + 1e-6


@settings(max_examples=80, deadline=None)
@given(assignment_problems())
def test_the_least_memory_choice_equals_brute_force(case) -> None:
    """``minimise="memory"``, solved in closed form: the least resident-plus-transient
    memory over every combination, and among those the choice it returns is valid."""
    import itertools

    tables, capacity = case
    combos = itertools.product(*(range(len(c)) for c in tables.node))
    least = min(ilp.memory_of(c, tables.memory, tables.transient) for c in combos)
    got = tables.solve(capacity, minimise="memory")
    if capacity is not None and least > capacity * (1 + 1e-9):
        assert got.status == ilp.INFEASIBLE and got.choice == []
        return
    assert got.status == ilp.OPTIMAL
    assert got.memory == pytest.approx(least, rel=1e-12, abs=1e-12)
    assert got.memory == ilp.memory_of(got.choice, tables.memory, tables.transient)
    assert got.objective == ilp.evaluate(got.choice, tables.node, tables.edges)


def test_the_least_memory_choice_ignores_infinite_times() -> None:
    """A strategy's infinite time does not make the least-memory choice take another of
    more memory; among equal memory the finite time wins."""
    got = ilp.least_memory(
        [np.array([np.inf, np.inf, 1.0]), np.array([np.inf, 2.0])],
        {},
        [np.array([5.0, 1.0, 3.0]), np.array([1.0, 1.0])],
        [np.zeros(3), np.zeros(2)],
    )
    assert (got.choice, got.memory) == ([1, 1], 2.0)


def test_solver_works_after_highs_ran_elsewhere_in_the_process() -> None:
    import highspy

    other = highspy.Highs()  # m_sct and others start HiGHS's process-wide scheduler first
    other.setOptionValue("output_flag", False)
    other.setOptionValue("threads", 2)
    other.run()
    got = ilp.solve([np.array([3.0, 1.0]), np.array([1.0, 3.0])], {})
    assert (got.status, got.choice, got.objective) == (ilp.OPTIMAL, [1, 0], 2.0)


# ------------------------------------------------------------------ command line
def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_meshplace(argv, cwd=cwd)


def test_shard_any_model_through_the_command_line(tmp_path: Path) -> None:
    llama = f"{ROOT / 'examples' / 'llama.py'}:build_tiny"
    done = run(
        "shard", llama, "--cluster", "dgx-h100", "--chips", "4", "--json", "--out", "plan.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["method"] == "graph" and data["fits"] and data["chips"] == 4
    assert math.prod(data["mesh"]["shape"]) == 4
    assert data["parameters"] and data["top_ops"] and data["step_time_s"] > 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["format"] == "meshplace.parallel_plan" and plan["version"] == 1
    assert set(plan["parameters"]) == set(data["parameters"])
    live = plan["predicted"]["live_peak_bytes"]
    assert live == data["live_peak_bytes"] and live >= data["memory_bytes"]["parameters"] > 0
    # the step is compute and the communication it waits for; the rest overlaps compute
    exposed = data["exposed_communication_s"]
    assert 0 <= exposed <= data["communication_s"]
    assert data["step_time_s"] == pytest.approx(data["compute_s"] + exposed, rel=1e-12)
    assert plan["predicted"]["exposed_communication_s"] == exposed
    tl = data["timeline"]
    assert tl["backward_stream_s"] > tl["backward_stream_exposed_s"] >= 0
    table = run("shard", "rnnlm", "--cluster", "dgx-h100", "--mesh", "2", cwd=tmp_path)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "memory per device" in table.stdout and "parameters" in table.stdout


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--memory-fraction", "0"], ["--memory-fraction"]),
        (["--memory-fraction", "1.5"], ["--memory-fraction"]),
        (["--mesh", "3", "--chips", "4"], ["--mesh 3", "--chips"]),
        (["--optimizer", "lars"], ["lars"]),
        (["--method", "program"], ["named-dimension program"]),
    ],
)
def test_shard_bad_input_is_one_sentence_and_writes_nothing(
    tmp_path: Path, argv: list[str], words: list[str]
) -> None:
    done = run("shard", "dmcca", "--cluster", "dgx-h100", *argv, "--out", "p.json", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-1000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip() and "HiGHS" not in ln]
    lines = [ln for ln in lines if "third-party" not in ln]
    assert len(lines) == 1 and lines[0].startswith("meshplace: error: "), done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "p.json").exists()


def test_a_mesh_that_divides_nothing_keeps_every_parameter_replicated() -> None:
    # 3 chips: nothing of the MLP divides by 3 except replication — still a legal plan
    model, inputs = mlp(batch=32)
    g = capture(model, inputs, training=True)
    best = shard_graph(g, load_cluster("dgx-h100"), mesh_shape=(3,), zero_stages=(0,)).best
    assert all(p["placements"] == ["Replicate()"] for p in best.parameters().values())


# ------------------------------------------------------------------ the Megatron-style grid
def test_grid_points_are_what_they_say_and_the_solver_is_never_worse() -> None:
    from meshplace.parallel.grid import megatron_grid

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    )
    g = capture(model, (torch.randn(64, 512),), training=True)
    cluster = load_cluster("dgx-h100")
    grid = megatron_grid(g, cluster, chips=4, zero_stages=(0, 1, 3))
    assert sorted((p.dp, p.tp, p.zero) for p in grid.points) == [
        (1, 4, 0), (2, 2, 0), (2, 2, 1), (2, 2, 3), (4, 1, 0), (4, 1, 1), (4, 1, 3)
    ]  # fmt: skip
    for point in grid.points:
        plan = point.plan
        assert plan is not None and plan.fits and plan.status == ilp.OPTIMAL
        axes = list(plan.problem.axes)
        dp = axes.index(point.data_axis) if point.data_axis else None
        tp = axes.index(point.tensor_axis) if point.tensor_axis else None
        assert plan.mesh.shape[dp] == point.dp if dp is not None else point.dp == 1
        assert plan.mesh.shape[tp] == point.tp if tp is not None else point.tp == 1
        for name, p in plan.parameters().items():
            if dp is not None:  # replicated over the data axis, with the point's ZeRO stage
                assert p["placements"][dp] == "Replicate()" and p["zero"] == point.zero, name
            if tp is not None and len(p["shape"]) == 2:  # every matrix is tensor-parallel
                assert p["placements"][tp] in ("Shard(0)", "Shard(1)"), (point.label, name)
        for inp in plan.inputs().values():  # the batch is split over the data axis only
            want = ["Replicate()"] * len(axes)
            if dp is not None:
                want[dp] = "Shard(0)"
            assert inp["placements"] == want, (point.label, inp)
    best = grid.best
    solver = shard_graph(g, cluster, chips=4, zero_stages=(0, 1, 3)).best
    assert solver.status == ilp.OPTIMAL
    # the grid's plans are plans the solver could choose: it is never slower
    assert solver.step_time_s <= best.plan.step_time_s * (1 + 1e-9)


class _InOutLinear(torch.nn.Module):
    """A linear layer storing its weight ``[in, out]``, as GPT-2's ``Conv1D`` does."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def test_megatrons_layout_is_read_from_the_data_flow_and_the_grid_offers_it() -> None:
    """``megatron_layers``: in the Llama example the query, key, value, gate and up
    projections are column-parallel, the attention output and down projections
    row-parallel, embedding and head split by vocabulary, norm scales whole — read from
    the graph, not from names; a weight stored ``[in, out]`` is split along the right
    dimension, its bias with a column's outputs and whole after a row. The grid's
    ``megatron`` points have exactly that layout, priced no lower than the free points
    (whose choices include it)."""
    from meshplace.graph.sources import graph_for
    from meshplace.parallel.grid import megatron_grid, megatron_layers

    graph = graph_for(str(ROOT / "examples" / "llama.py") + ":build_tiny")
    layers = megatron_layers(graph)

    def role(name: str) -> int:
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            return 0
        if name.endswith(("o_proj", "down_proj")):
            return 1
        return 0 if name in ("embed", "lm_head") else -1  # embed, head; norms whole

    params = [op for op in graph.ops if op.kind == "parameter"]
    assert layers == {op.name: role(op.module) for op in params}
    torch.manual_seed(0)
    chain = torch.nn.Sequential(_InOutLinear(16, 64), torch.nn.ReLU(), _InOutLinear(64, 16))
    split = megatron_layers(capture(chain, (torch.randn(8, 16),), training=True))
    assert split == {"param:0.weight": 1, "param:0.bias": 0,
                     "param:2.weight": 0, "param:2.bias": -1}  # fmt: skip
    # under autocast each weight reaches its product through a cast: looked through
    cast = capture(chain, (torch.randn(8, 16),), training=True, autocast="bf16")
    assert any(op.target == "aten._to_copy.default" for op in cast.ops)
    assert megatron_layers(cast) == split
    grid = megatron_grid(graph, load_cluster("dgx-h100"), chips=2, layouts=("free", "megatron"))
    points = {p.label: p for p in grid.points}
    data_parallel = {f"dp2 x tp1 zero{z}" for z in range(4)}
    assert set(points) == {*data_parallel, "dp1 x tp2 zero0", "dp1 x tp2 zero0 megatron"}
    megatron, free = points["dp1 x tp2 zero0 megatron"], points["dp1 x tp2 zero0"]
    assert megatron.layout == "megatron" and megatron.fits
    placed = megatron.plan.parameters()  # type: ignore[union-attr]
    for op in params:
        want = "Replicate()" if role(op.module) == -1 else f"Shard({role(op.module)})"
        assert placed[op.name.removeprefix("param:")]["placements"] == [want], op.name
    assert free.plan.step_time_s <= megatron.plan.step_time_s * (1 + 1e-9)  # type: ignore[union-attr]
    # a model without matrix layers (convolutions only) has no layout of Megatron's
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    convs = capture(conv, (torch.randn(4, 3, 8, 8),), training=True)
    assert all(dim == -1 for dim in megatron_layers(convs).values())
    grid = megatron_grid(convs, load_cluster("dgx-h100"), chips=2, layouts=("free", "megatron"))
    assert grid.points and all(p.layout == "free" for p in grid.points)
    with pytest.raises(ShardingError, match="unknown grid layout 'mine'"):
        megatron_grid(graph, load_cluster("dgx-h100"), chips=2, layouts=("mine",))


def test_a_grid_point_whose_batch_does_not_divide_says_why() -> None:
    from meshplace.parallel.grid import megatron_grid

    model, args = mlp(batch=6)
    g = capture(model, args, training=True)
    grid = megatron_grid(g, load_cluster("dgx-h100"), chips=4, zero_stages=(0,))
    reasons = {(p.dp, p.tp): p.reason for p in grid.points}
    assert "batch split 4 ways" in reasons[(4, 1)] and reasons[(2, 2)] == ""
    assert grid.best.dp in (1, 2)


def test_fused_compute_makes_each_point_wise_chain_and_optimizer_update_one_kernel() -> None:
    model, args = mlp(d_in=256, hidden=1024, batch=64)
    g = capture(model, args, training=True)
    mesh = build_mesh(load_cluster("dgx-h100"), (2,))
    eager = ShardingProblem(g, mesh, zero_stages=(0,))
    fused = ShardingProblem(g, mesh, zero_stages=(0,), compute="fused")
    launch = float(eager.launch.max())  # per op; one device launch when uncalibrated
    assert (eager.launch[eager.op_time > 0] == launch).all()
    chains = 0
    for ge, gf in zip(eager.groups, fused.groups, strict=True):
        kernels = sum(1 for i in ge.members[1:] if eager.op_time[i] > 0)
        for se, sf in zip(ge.strategies, gf.strategies, strict=True):
            assert se.name == sf.name and se.comm_s == sf.comm_s and se.memory == sf.memory
            if kernels >= 2:  # a chain of launches becomes one, and moves fewer bytes
                assert sf.compute_s <= se.compute_s - (kernels - 1) * launch * 0.999
                chains += 1
            elif len(ge.members) == 1:
                assert sf.compute_s == se.compute_s
    assert chains > 0
    # a parameter's Adam update (a dozen element-wise ops) is one kernel: at least the
    # bytes of weight, gradient, two moments read and weight, two moments written
    p = next(g for g in fused.groups if g.kind == "parameter" and len(g.members) > 3)
    nbytes = fused.graph.ops[p.anchor].param_bytes
    st = p.strategies[0]
    assert st.compute_s >= 7 * nbytes * fused.byte_s[p.members[1]] + launch
    with pytest.raises(ShardingError, match="unknown compute model"):
        ShardingProblem(g, mesh, compute="compiled")
