"""A sharding plan runs op by op as planned (issue 14, correctness): the captured step on
DTensor with every operand placed as the plan's strategy reads it
(``meshplace.runtime.spmd``), on 4 CPU ranks with gloo — the loss and updated weights equal
the one-process step, the collectives that run are those the plan charged to each op, and
each rank's peak of live tensor bytes is the plan's liveness prediction — for an MLP, the
Llama-style decoder of ``examples/llama.py`` and a small conv net."""

from __future__ import annotations

import collections
import itertools
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplace.runtime.spmd import CollectiveLog, planned_collectives, run_plan
from tests.test_parallel_execution import build, four_ranks, leave_and_exit, tight_plan


class ConvNet(torch.nn.Module):
    """A small conv net with a classification loss."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return torch.nn.functional.cross_entropy(self.fc(h.mean(dim=(2, 3))), y)


def traced(which: str) -> tuple[Any, list, list, list, list]:
    """The captured step and its (params, buffers, states, inputs)."""
    from meshplace.graph.capture import capture_step

    if which == "conv":
        torch.manual_seed(0)
        model: torch.nn.Module = ConvNet()
        args, kwargs = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))), {}
    else:
        model, args, kwargs = build(which)
    step = capture_step(model, args, example_kwargs=kwargs, training=True)
    named = dict(model.named_parameters())
    params = [named[n].detach().clone() for n in step.param_names]
    named_b = {**dict(model.named_buffers()), **named}
    buffers = [named_b[n].detach().clone() for n in step.buffer_names]
    states = [torch.zeros_like(p) for p in params for _ in range(step.n_state)]
    return step, params, buffers, states, [*args, *kwargs.values()]


MODELS = ("mlp", "llama", "conv")


def _spmd_worker(rank: int, cases: dict, plans: dict, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    first = next(iter(plans.values()))  # every plan here is on the same 2x2 mesh: one mesh
    mesh = init_device_mesh("cpu", tuple(first.mesh.shape), mesh_dim_names=first.problem.axes)
    for which, (step, *state) in cases.items():  # one set of processes for every model
        plan = plans[which]
        assert tuple(plan.mesh.shape) == tuple(mesh.shape)
        with CollectiveLog(mesh) as log:
            out, interp = run_plan(step, plan, mesh, *state, log=log)
        leaves = [
            t.full_tensor() if hasattr(t, "full_tensor") else t
            for t in torch.utils._pytree.tree_leaves(out)
        ]
        result = {
            "out": leaves,
            "by_node": interp.by_node,
            "peak": interp.peak_bytes,
            "resident": interp.resident_bytes,
        }
        torch.save(result, Path(out_dir) / f"{which}{rank}.pt")


def _forked_rank(rank: int, cases: dict, plans: dict, store_path: str, out_dir: str) -> None:
    """One forked rank: join the gloo group, run the plans of the parent's traced steps
    (``cases``: a traced step does not pickle, and a forked rank needs none, nor a fresh
    interpreter importing torch and tracing every model again: start-up was most of this
    test's time), leave the group. One thread: the host's cores are shared by 4 ranks, and
    the OpenMP pool of the parent does not survive the fork (as the executor's forked
    workers, ``meshplace.runtime.executor``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    _spmd_worker(rank, cases, plans, out_dir)
    leave_and_exit()


def on_four_forked_ranks(cases: dict, plans: dict, tmp_path: Path) -> None:
    """Run every plan on its traced step on 4 forked gloo ranks; each must end cleanly
    (an exception exits non-zero)."""
    store = str(tmp_path / "store")
    four_ranks("fork", _forked_rank, lambda r: (r, cases, plans, store, str(tmp_path)))


def test_the_plan_runs_op_by_op_with_the_collectives_and_memory_it_charged(
    tmp_path: Path,
) -> None:
    cases = {which: traced(which) for which in MODELS}
    # The Llama's limit is 1.3x the leanest plan's, not 1.02x: HiGHS proves that program
    # optimal in ~2 s where the 1.02x one takes ~11 s (and runs into shard_graph's 20 s
    # limit on a busy machine, so the plan then depended on the machine's speed). The
    # limit still binds (the plan needs 1.296x the leanest), every parameter is split and
    # the plan charges all-gathers, reduce-scatters and all-to-alls on both mesh axes.
    slack = {"llama": 1.3}
    plans = {
        which: tight_plan(case[0].graph, slack=slack.get(which, 1.02))
        for which, case in cases.items()
    }
    on_four_forked_ranks(cases, plans, tmp_path)
    for which, (step, *state) in cases.items():
        check_run(which, step, state, plans[which], tmp_path)


def check_run(which: str, step: Any, state: list, plan: Any, tmp_path: Path) -> None:
    """Outputs, collectives and memory of the 4 ranks' run of ``which`` against the
    one-process step and the plan."""
    reference = torch.utils._pytree.tree_leaves(step.gm(*state))
    planned = planned_collectives(plan)
    # gloo has no all-to-all: DTensor runs it as an all-gather and a local slice
    charged = {
        op: collections.Counter(("all_gather" if k == "all_to_all" else k, a) for k, a in calls)
        for op, calls in planned.items()
    }
    predicted_peak, _ = plan.live_peak()
    for rank in range(4):
        got = torch.load(tmp_path / f"{which}{rank}.pt", weights_only=False)
        # loss and the updated parameters equal the unsharded step
        assert len(got["out"]) == len(reference)
        for a, b in zip(got["out"], reference, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (which, float((a - b).abs().max()))
        # every collective that ran is one the plan charged to that op (kind and mesh axis)
        for op, calls in got["by_node"].items():
            ran = collections.Counter(calls)
            assert set(ran) <= set(charged.get(op, {})), (which, op, ran, charged.get(op))
        # and exactly as many
        ran_all = {op: collections.Counter(c) for op, c in got["by_node"].items()}
        assert ran_all == {op: c for op, c in charged.items() if c}, which
        if rank == 0:  # the figures docs/parallel.md quotes (`pytest -s` shows them)
            error = max(float((a - b).abs().max()) for a, b in zip(got["out"], reference))
            ran = collections.Counter(c for calls in got["by_node"].values() for c in calls)
            print(
                f"{which}: max error {error:.2g}; charged "
                f"{dict(sorted(sum(charged.values(), collections.Counter()).items()))}; ran "
                f"{dict(sorted(ran.items()))}; live peak predicted {predicted_peak:,.0f} B, "
                f"measured {got['peak']:,} B; solver bound {plan.peak_memory_bytes:,.0f} B"
            )
        # memory: this rank's parameter, gradient and optimizer-state blocks exactly as
        # predicted
        for kind in ("parameters", "gradients", "optimizer_state"):
            assert got["resident"][kind] == plan.memory_bytes[kind], (which, kind)
        # and the live tensor bytes it held at its peak against the plan's liveness count
        assert abs(got["peak"] - predicted_peak) <= 0.10 * got["peak"], (
            which,
            got["peak"],
            predicted_peak,
        )


def _dtensor_redistributions(out_path: str, cases: list) -> None:
    """A forked process on PyTorch's fake process group of 4 (collectives return at once):
    every ``(have, need)`` of ``cases`` redistributed on a 2 x 2 mesh, the collectives
    DTensor runs for each saved to ``out_path``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplace.runtime.spmd import dtensor_placements

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    ran = []
    for have, need in cases:
        # the rank's block of a 32 x 32 tensor placed ``have`` (a partial sum's block is
        # the rank's summand)
        whole = [Replicate()] * 2
        blocks = [Replicate() if p.is_partial() else p for p in dtensor_placements(have)]
        t = DTensor.from_local(torch.randn(32, 32), mesh, whole, run_check=False)
        local = t.redistribute(mesh, blocks)
        t = DTensor.from_local(
            local.to_local(),
            mesh,
            dtensor_placements(have),
            run_check=False,
            shape=local.shape,
            stride=local.stride(),
        )
        with CollectiveLog(mesh) as log:
            t.redistribute(mesh, dtensor_placements(need))
        ran.append(collections.Counter(log.calls))
    torch.save(ran, out_path)
    os._exit(0)


def test_the_resharding_table_charges_the_collectives_dtensor_runs(tmp_path: Path) -> None:
    """Every placement of a 2-D tensor on a 2 x 2 mesh (replicated, a partial sum, split
    along either dimension, per axis) to every placement an op reads: the collectives the
    solver's resharding table charges are, kind and axis, the ones DTensor runs (gloo's
    all-to-all being an all-gather and a slice) — including a partial sum that DTensor
    all-reduces whole because an outer axis must move a split of the dimension it would
    scatter onto (``(S(0), P) -> (S(1), S(1))``)."""
    from meshplace.graph.capture import capture
    from meshplace.hardware import load_cluster
    from meshplace.mesh.layout import build_mesh
    from meshplace.parallel.sharding import P, R, ShardingProblem

    graph = capture(torch.nn.Linear(8, 8), (torch.randn(4, 8),), training=True)
    problem = ShardingProblem(graph, build_mesh(load_cluster("dgx-h100"), (2, 2)))
    cases = list(
        itertools.product(
            itertools.product((R, P, 0, 1), repeat=2), itertools.product((R, 0, 1), repeat=2)
        )
    )
    out = tmp_path / "ran.pt"
    child = mp.get_context("fork").Process(target=_dtensor_redistributions, args=(str(out), cases))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    ran = torch.load(out, weights_only=False)
    wrong = {}
    for (have, need), got in zip(cases, ran, strict=True):
        _, colls = problem.reshard(have, need, [0, 1], [32, 32], 4)
        charged = collections.Counter(
            ("all_gather" if kind == "all_to_all" else kind, axis) for kind, axis, _, _ in colls
        )
        if charged != got:
            wrong[(have, need)] = (dict(charged), dict(got))
    assert not wrong, wrong
    assert any(kind == "all_reduce" for c in ran for kind, _ in c)  # the table is not empty
