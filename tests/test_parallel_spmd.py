"""A sharding plan runs op by op as planned (issue 14, correctness): the captured step on
DTensor with every operand placed as the plan's strategy reads it
(``meshplace.runtime.spmd``), on 4 CPU ranks with gloo — the loss and updated weights equal
the one-process step, every collective that runs is one the plan charged to that op, and
each rank's peak of live tensor bytes is the plan's liveness prediction — for an MLP, the
Llama-style decoder of ``examples/llama.py`` and a small conv net."""

from __future__ import annotations

import collections
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
        if which == "mlp":  # and here exactly as many
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
