"""The dry run of a sharding plan (``meshplace.runtime.dryrun``): the step DTensor runs for
it, recorded on a fake process group in a child process, and its cost."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshplace.cost.collectives import collective_time
from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.graph.capture import capture
from meshplace.graph.sources import graph_for, load_build_function
from meshplace.hardware import load_cluster
from meshplace.mesh.layout import accelerators, mesh_over
from meshplace.parallel.grid import megatron_grid
from meshplace.runtime import dryrun
from meshplace.runtime.dryrun import EngineProgram, dry_run, dry_runs, program_cost
from tests.forked_cli import run_forked, run_meshplace

# What a dry run's child imports on its way (DTensor, DDP, torch's pipelining, the fake
# process group, the runtime): imported here once, so that no forked child imports them
DRY_RUN_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.nn.parallel",
    "torch.testing._internal.distributed.fake_pg",
    "meshplace.graph.capture",
    "meshplace.runtime.data_parallel",
    "meshplace.runtime.hybrid",
    "meshplace.runtime.launch",
    "meshplace.runtime.pipelined",
    "meshplace.runtime.sharded",
)


def _dry_run_main(argv: list[str]) -> int:
    return dryrun.main(argv)


def _forked_run(
    command: Sequence[str], *, timeout: float, env: dict[str, str], **_: object
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=, env=)`` for the
    dry run's command, ``python -m meshplace.runtime.dryrun ARGS``, in a fork of this
    process running the module's ``main`` (:func:`tests.forked_cli.run_forked`): its exit
    status, standard output and error; past ``timeout`` it is killed and
    :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` does."""
    assert list(command[:3]) == [sys.executable, "-m", "meshplace.runtime.dryrun"], command
    status, stdout, stderr = run_forked(_dry_run_main, command[3:], env=env, timeout=timeout)
    if status is None:
        raise subprocess.TimeoutExpired(list(command), timeout)
    return subprocess.CompletedProcess(list(command), status, stdout, stderr)


def fork_the_dry_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here to the test's end, :func:`meshplace.runtime.dryrun.dry_run`'s process (in
    this process, and in a command forked from it by :func:`run_meshplace`) is a fork of
    this one running the module's own ``main``, not a fresh interpreter: importing torch,
    DTensor and torch's pipelining there was most of this file's time. The dry run's own
    process — a fresh interpreter recording a step, its exit status, its time limit — is
    tested through real processes: the ``dp_program`` fixture's, and those of the test of
    a plan whose model cannot be built."""
    for module in DRY_RUN_MODULES:
        importlib.import_module(module)
    fake = SimpleNamespace(run=_forked_run, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(dryrun, "subprocess", fake)


@pytest.fixture
def forked_dry_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`fork_the_dry_runs` for the whole test."""
    fork_the_dry_runs(monkeypatch)


MODEL = """\
import torch


def build():
    print("building the MLP")  # on stdout: the dry run's JSON document must survive it
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    return model, (torch.randn(32, 64),)
"""


@pytest.fixture(scope="module")
def grid_plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, dict]]:
    """The MLP's Megatron grid points on 2 H100s, as plan files, by label."""
    folder = tmp_path_factory.mktemp("dryrun")
    (folder / "mlp.py").write_text(MODEL)
    source = f"{folder / 'mlp.py'}:build"
    model, (x,) = load_build_function(source)()
    graph = capture(model, (x,), training=True)
    grid = megatron_grid(graph, load_cluster("dgx-h100"), chips=2, zero_stages=(0,))
    return source, {p.label: p.plan.plan_file(source, "dgx-h100") for p in grid.points if p.fits}


@pytest.fixture(scope="module")
def dp_program(grid_plans: tuple[str, dict[str, dict]]) -> tuple[dict, EngineProgram]:
    """The data-parallel grid point's plan and its dry run on DTensor (``--engine
    dtensor``; by default the runtime runs such a plan on DDP: tests/test_data_parallel.py)."""
    source, plans = grid_plans
    dp = next(p for label, p in plans.items() if label.startswith("dp2 x tp1"))
    return dp, dry_run(dp, source, engine="dtensor")


def test_data_parallelism_runs_one_bucketed_gradient_all_reduce(
    dp_program: tuple[dict, EngineProgram],
) -> None:
    """Under DTensor a replicated weight fed a batch-split input gets a partial gradient,
    which the runtime all-reduces in buckets, as DDP does: the dry run sees one all-reduce
    of the partial gradients together (both weights and the first bias: the last bias is
    not among them, since the stand-in loss's gradient comes back replicated, so DTensor
    sums it over the whole batch on each rank), and kernels on half the batch."""
    _, program = dp_program
    assert program.world_size == 2
    # split only over the batch's mesh dimension: no op at the model-parallel split rate,
    # those with a batch-split operand at the batch-split one
    assert program.dispatched > 0 and program.dispatched_split == 0
    assert 0 < program.dispatched_batch_split <= program.dispatched
    reduced = [c.nbytes for c in program.collectives if c.kind == "all_reduce"]
    assert (2 * 64 * 256 + 256) * 4 in reduced, reduced  # weights and the 1st bias, at once
    assert {c.kind for c in program.collectives} == {"all_reduce"}
    # the flat bucket is the process group's own call, priced at its own measured rate
    bucket = [c for c in program.collectives if c.nbytes == (2 * 64 * 256 + 256) * 4]
    assert bucket and all(c.c10d for c in bucket)
    # the first linear layer's forward matmul runs on this rank's 16 rows of 32
    matmuls = [k for k in program.kernels if k.kind == "matmul"]
    assert min(k.flops for k in matmuls) <= 2 * 16 * 64 * 256
    assert program.dispatched > 0


def test_the_runtimes_flat_buckets_are_recorded_over_their_own_mesh_axis() -> None:
    """The runtime's flat buckets (gradients all-reduced, ZeRO shards gathered and
    reduce-scattered) are the process group's own calls, recorded as such (``c10d``,
    priced at their own measured rates) over the mesh axis of their group — on a 2 x 2
    mesh the data axis alone, not every axis (a c10d op's group reaches the dispatch
    mode boxed) — and with the bytes the ring formula counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplace.runtime.sharded import flat_all_gather, flat_all_reduce, flat_reduce_scatter

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
        program = EngineProgram(4)
        with dryrun.recorder(program, dryrun.mesh_axes(mesh)):
            flat_all_reduce(torch.ones(8), mesh, 0)
            gathered = flat_all_gather(torch.ones(8), mesh, 1)
            scattered = flat_reduce_scatter(torch.ones(8), mesh, 0)
    finally:
        dist.destroy_process_group()
    assert gathered.shape == (16,) and scattered.shape == (4,)
    recorded = [(c.kind, c.nbytes, c.axes, c.c10d) for c in program.collectives]
    assert recorded == [
        ("all_reduce", 32.0, ["data"], True),
        ("all_gather", 64.0, ["tensor"], True),  # the gathered output
        ("reduce_scatter", 32.0, ["data"], True),  # the input
    ]


def test_zero_1_gathers_the_updated_parameters_in_one_flat_all_gather(
    grid_plans: tuple[str, dict[str, dict]], forked_dry_runs: None
) -> None:
    """The data-parallel plan with every parameter at ZeRO 1: after the optimizer's step
    on the master shards, the runtime gathers them back as one flat buffer (all four
    tensors, 66 KiB, within one bucket), not one collective per parameter; the
    gradients' bucketed all-reduce is as at ZeRO 0, and a ZeRO-1 shard of a reduced
    gradient is a local slice, no collective."""
    source, plans = grid_plans
    dp = json.loads(json.dumps(next(p for k, p in plans.items() if k.startswith("dp2 x tp1"))))
    for spec in dp["parameters"].values():
        spec["zero"] = 1
    program = dry_run(dp, source, engine="dtensor")
    gathers = [c for c in program.collectives if c.kind == "all_gather"]
    whole = (64 * 256 + 256 + 256 * 64 + 64) * 4
    assert [c.nbytes for c in gathers] == [whole], gathers
    assert gathers[0].c10d  # the process group's own all-gather of the flat buffer
    assert {c.kind for c in program.collectives} == {"all_reduce", "all_gather"}


def test_the_dry_run_times_the_ranks_step_alone_when_asked(
    grid_plans: tuple[str, dict[str, dict]],
    dp_program: tuple[dict, EngineProgram],
    forked_dry_runs: None,
) -> None:
    """``timed_steps``: the rank's step timed on the fake process group after the
    recorded one (a measurement, kept apart from the prediction); by default not timed,
    and a program recorded before the field existed reads as not timed."""
    source, _ = grid_plans
    dp, untimed = dp_program
    assert untimed.timed_step_s == 0.0
    timed = dry_run(dp, source, engine="dtensor", timed_steps=3)
    assert timed.timed_step_s > 0.0
    assert timed.collective_counts() == untimed.collective_counts()  # the same program
    old = {k: v for k, v in timed.to_dict().items() if k != "timed_step_s"}
    assert EngineProgram.from_dict(old).timed_step_s == 0.0


def test_tensor_parallelism_records_its_collectives_on_the_plans_mesh_axis(
    grid_plans: tuple[str, dict[str, dict]], forked_dry_runs: None
) -> None:
    source, plans = grid_plans
    tp = next(p for label, p in plans.items() if label.startswith("dp1 x tp2"))
    program = dry_run(tp, source)
    assert program.collectives
    axes = set(tp["mesh"]["axes"])
    assert all(set(c.axes) <= axes and c.axes for c in program.collectives)
    # no weight is replicated whole, so no all-reduce moves a whole weight's gradient
    assert all(c.nbytes < 64 * 256 * 4 for c in program.collectives if c.kind == "all_reduce")
    # its ops on split weights and activations pay the split operands' dispatch rate
    assert 0 < program.dispatched_split <= program.dispatched


def test_the_prediction_costs_kernels_dispatch_and_collectives_by_the_cost_model(
    dp_program: tuple[dict, EngineProgram],
) -> None:
    dp, recorded = dp_program
    program = EngineProgram.from_dict(json.loads(json.dumps(recorded.to_dict())))
    assert program == recorded
    cluster = load_cluster("dgx-h100")
    device = cluster.devices[0]
    devices = np.arange(2).reshape(dp["mesh"]["shape"])
    latency, bandwidth = 1e-4, 1e9
    measured = CostModel(
        collectives={device.kind: {"all_reduce": (latency, bandwidth)}},
        dispatch_overhead={device.kind: 2e-5},
    )
    mesh = mesh_over(cluster, devices, tuple(dp["mesh"]["axes"]), "dp").calibrated(measured)
    base = program.predict(replace(measured, dispatch_overhead={}), mesh, device.spec, device.kind)
    with_dispatch = program.predict(measured, mesh, device.spec, device.kind)
    # the engine's dispatch: exactly its per-op cost on every DTensor-level op
    assert with_dispatch["dispatch_s"] == pytest.approx(program.dispatched * 2e-5)
    assert with_dispatch["step_s"] - base["step_s"] == pytest.approx(program.dispatched * 2e-5)
    # every recorded collective at the measured ring formula, one after another
    expected = sum(
        collective_time(c.kind, "ring", c.nbytes, 2, bandwidth=bandwidth, latency=latency)
        for c in program.collectives
    )
    assert base["communication_s"] == pytest.approx(expected)
    assert base["compute_s"] > 0
    assert base["step_s"] == pytest.approx(base["compute_s"] + base["communication_s"])


def test_a_plan_whose_model_cannot_be_built_is_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = {
        "format": "meshplace.parallel_plan",
        "version": 1,
        "graph": {"source": f"{tmp_path / 'missing.py'}:build"},
        "mesh": {"axes": ["x"], "shape": [2]},
        "parameters": {},
        "inputs": {},
    }
    # the dry run's own process, a fresh interpreter: a child that runs out of time is
    # stopped (one sentence, not a traceback); the module run as a command on this plan
    # exits 2 with one sentence and prints nothing
    with pytest.raises(InputError, match=r"dry run of the 2 plans took longer than 0.02 s"):
        dry_runs([plan, plan], timeout_s=0.01)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run(
        [sys.executable, "-m", "meshplace.runtime.dryrun", str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().startswith("meshplace: error:")
    assert len(done.stderr.strip().splitlines()) == 1
    # the rest in forks of this process running the same module
    fork_the_dry_runs(monkeypatch)
    with pytest.raises(InputError, match=r"dry run of the plan failed: .*missing\.py"):
        dry_run(plan)
    # an op placement is not a sharding plan
    placed = {"format": "meshplace.plan", "version": 1, "graph": "g", "graph_ops": 1}
    (tmp_path / "placed.json").write_text(json.dumps({**placed, "placement": {"a": "gpu0"}}))
    with pytest.raises(InputError, match="is not a sharding plan"):
        dry_run(tmp_path / "placed.json")


def test_each_kernel_is_recorded_and_a_view_is_none() -> None:
    """Views are metadata (no kernel); a matmul of local tensors is one kernel."""
    from meshplace.runtime.dryrun import recorder

    program = EngineProgram(1)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with recorder(program):
        c = (a.t().t() @ b).view(12)
    assert c.shape == (12,)
    assert [k.name for k in program.kernels] == ["mm"]
    assert program.kernels[0].flops == 2 * 4 * 8 * 3
    assert program.kernels[0].bytes == (4 * 8 + 8 * 3 + 4 * 3) * 4


def test_a_runs_report_costs_the_recorded_step_by_the_calibration_it_is_given(
    tmp_path: Path, dp_program: tuple[dict, EngineProgram]
) -> None:
    """``meshplace run --calibration FILE`` on a sharding plan: rank 0's recorded step is
    costed by that file's cost model (its dispatch and collectives) on the plan's
    cluster; without one, by the catalogue's; an unreadable cluster is a note."""
    from meshplace.cost.calibration import CostCalibration, save_calibration
    from meshplace.runtime.launch import summarise

    plan, program = dp_program
    kind = load_cluster("dgx-h100").devices[plan["mesh"]["devices"][0]].kind
    calibration = CostCalibration(
        device_kind=kind,
        peak_flops=1e12,
        memory_bandwidth=1e11,
        launch_overhead_s=1e-5,
        collectives={"all_reduce": (2e-4, 1e9)},
        collectives_measured_on=2,
        dispatch_overhead_s=3e-5,
    )
    save_calibration(calibration, tmp_path / "cal.json")
    rank = {"times_s": [1.0, 0.5], "losses": [1.0, 0.9], "peak_bytes": 0}
    rank.update(parameters=0, gradients=0, optimizer_state=0, program=program.to_dict())

    def engine(**options: str) -> dict:
        report = summarise(
            plan, [rank, rank], source="m.py:build", warmup=1, device="cpu", **options
        )
        return report["predicted"].get("engine") or {"notes": report["notes"]}

    calibrated = engine(calibration=str(tmp_path / "cal.json"))
    catalogue = engine()
    assert calibrated["dispatch_s"] == pytest.approx(program.dispatched * 3e-5)
    assert catalogue["dispatch_s"] == 0.0
    reduces = sum(1 for c in program.collectives if c.kind == "all_reduce")
    assert calibrated["communication_s"] >= reduces * 2e-4 * 2  # the ring: 2 (p - 1) steps
    assert calibrated["communication_s"] > 10 * catalogue["communication_s"]  # NVLink's
    assert calibrated["collectives"] == {"all_reduce": reduces}
    missing = engine(cluster=str(tmp_path / "none.yaml"))
    assert any("no prediction as its engine runs it" in n for n in missing["notes"])
    # a plan chosen by its engine price (shard --engine-costs) keeps that price apart from
    # the run's own, and the text report leads with it
    import contextlib
    import io

    from meshplace.runtime.launch import print_report

    priced = {**plan, "predicted": {**plan["predicted"], "engine": {"step_s": 0.0123}}}
    report = summarise(priced, [rank, rank], source="m.py:build", warmup=1, device="cpu")
    assert report["predicted"]["engine_planned"] == {"step_s": 0.0123}
    assert report["predicted"]["engine"]["step_s"] == pytest.approx(catalogue["step_s"])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_report(report)
    assert "the plan predicted 12.30 ms as its engine runs it (the solver: " in text.getvalue()


def test_dtensors_dispatch_is_measured_per_op_it_dispatches(tmp_path: Path) -> None:
    from meshplace.runtime.dryrun import measure_dispatch_overhead

    (tmp_path / "mlp.py").write_text(MODEL)
    measured = measure_dispatch_overhead(f"{tmp_path / 'mlp.py'}:build", reps=2)
    # forward, backward and foreach Adam of a 2-layer MLP: a few tens of DTensor ops
    assert 10 <= measured["ops"] <= 60, measured
    assert measured["per_op_s"] >= 0 and measured["dtensor_step_s"] > 0
    # and on split operands, under Megatron's layout (the first layer by columns, the
    # second by rows) on a fake 2-rank group: its forward and backward hold both kinds
    assert "split_note" not in measured and "batch_note" not in measured, measured
    assert measured["split_ops"] > 0 and measured["split_replicated_ops"] > 0, measured
    assert measured["per_split_op_s"] >= 0 and measured["split_pass_s"] > 0
    # the layout's collectives (the row-parallel layer's all-reduce, its input gradient's)
    # at what issuing one costs the host on the fake group, which the difference sheds:
    # the collectives measured between real ranks hold that cost already
    assert measured["split_collectives"] > 0 and measured["fake_collective_s"] > 0
    # and under data parallelism on DTensor (inputs split along their rows)
    assert measured["batch_split_ops"] > 0 and measured["per_batch_split_op_s"] >= 0
    assert not torch.distributed.is_initialized()  # the fake group is gone
    graph = graph_for(f"{tmp_path / 'mlp.py'}:build")
    plan = dryrun.megatron_plan_file(graph, build_mlp(tmp_path))
    assert plan is not None
    placements = {k: v["placements"] for k, v in plan["parameters"].items()}
    assert placements == {"0.weight": ["Shard(0)"], "0.bias": ["Shard(0)"],
                          "2.weight": ["Shard(1)"], "2.bias": ["Replicate()"]}  # fmt: skip
    # a model without matrix layers: nothing to measure, said so, and the rate 0 (its
    # ops then pay the replicated one)
    (tmp_path / "conv.py").write_text(CONV)
    conv = dryrun.measure_split_dispatch_overhead(f"{tmp_path / 'conv.py'}:build", 1e-5, reps=1)
    assert conv["per_split_op_s"] == 0.0 and conv["split_ops"] == 0
    assert "splits none of its parameters" in conv["split_note"]


CONV = """\
import torch


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    return model, (torch.randn(2, 3, 8, 8),)
"""


def build_mlp(folder: Path) -> torch.nn.Module:
    return load_build_function(f"{folder / 'mlp.py'}:build")()[0]


def test_ops_on_split_operands_pay_their_own_dispatch_rate() -> None:
    """An engine program's DTensor ops with an operand split or partial over a
    model-parallel axis are charged the cost model's ``split_dispatch_overhead`` (a
    calibration's ``split_dispatch_overhead_s``), those split over the batch's axes only
    ``batch_dispatch_overhead``, where set, the others ``dispatch_overhead``; without the
    two rates, every op the one rate; a program recorded before the split counts existed
    reads as none split."""
    from meshplace.cost.calibration import CostCalibration, calibrated_cost_model

    cluster = load_cluster("dgx-h100")
    device = cluster.devices[accelerators(cluster)[0]]
    program = EngineProgram(2, dispatched=12, dispatched_update=3)
    program.dispatched_split, program.dispatched_update_split = 4, 1
    program.dispatched_batch_split = 2
    mesh = mesh_over(cluster, np.asarray([0, 1]), ("tensor",), "given")
    kind = device.kind
    rates = CostModel(
        dispatch_overhead={kind: 1e-5},
        split_dispatch_overhead={kind: 3e-5},
        batch_dispatch_overhead={kind: 2e-5},
    )
    cost = program.predict(rates, mesh, device.spec)
    assert cost["dispatch_s"] == pytest.approx(6 * 1e-5 + 4 * 3e-5 + 2 * 2e-5)
    assert cost["update_s"] == pytest.approx(2 * 1e-5 + 1 * 3e-5)
    one_rate = program.predict(CostModel(dispatch_overhead={kind: 1e-5}), mesh, device.spec)
    assert one_rate["dispatch_s"] == pytest.approx(12 * 1e-5)
    old = {k: v for k, v in program.to_dict().items() if "split" not in k}
    assert EngineProgram.from_dict(old).dispatched_split == 0
    assert EngineProgram.from_dict(program.to_dict()) == program
    calibration = CostCalibration(
        device_kind=kind, peak_flops=1e12, memory_bandwidth=1e11, launch_overhead_s=1e-5,
        dispatch_overhead_s=1e-5, split_dispatch_overhead_s=3e-5, batch_dispatch_overhead_s=2e-5,
    )  # fmt: skip
    model = calibrated_cost_model(calibration, cluster)
    assert model.split_dispatch_overhead[kind] == 3e-5
    assert model.batch_dispatch_overhead[kind] == 2e-5
    assert program.predict(model, mesh, device.spec)["dispatch_s"] == pytest.approx(
        cost["dispatch_s"]
    )


def test_an_engines_kernels_cost_as_eager_pytorch_runs_them(tmp_path: Path) -> None:
    """The kernels of the model's eager step (DDP on a world of one, forward, backward,
    foreach Adam) are timed one by one at its own batch and on two rows, beside a busy
    neighbour, fitted like the
    graph's op times, and written to the calibration file's ``eager`` entry, which then
    prices an engine's recorded kernels (and only those: a graph's ops keep the fit to
    the runtime's op times); the file keeps it through a save and a load, and a negative
    cost in it is one sentence."""
    import multiprocessing

    from meshplace.cost.calibration import (
        CalibrationError,
        CostCalibration,
        EagerKernels,
        calibrated_cost_model,
        load_calibration,
        save_calibration,
    )
    from meshplace.profile.calibrate import fit_eager_kernels
    from meshplace.runtime.dryrun import LocalKernel, time_eager_kernels

    (tmp_path / "mlp.py").write_text(MODEL)
    # timed beside a process running the same step, as beside a run's other rank
    timed = time_eager_kernels(f"{tmp_path / 'mlp.py'}:build", reps=2, neighbours=1)
    assert not multiprocessing.active_children()  # the neighbour is stopped and reaped
    assert len(timed) == 2  # 32 rows and the first 2
    for kernels, seconds in timed:
        assert len(kernels) == len(seconds) and all(t > 0 for t in seconds)
        targets = {k.target for k in kernels}
        assert "aten.copy_.default" in targets  # DDP's gradient buckets
        assert any("_foreach_" in t for t in targets)  # Adam's
        assert "aten.addmm.default" in targets or "aten.mm.default" in targets
    assert timed[0][0][0].flops > timed[1][0][0].flops  # the same kernel, 16x the rows
    cluster = load_cluster("dgx-h100")
    device = cluster.devices[accelerators(cluster)[0]]
    kind = device.kind
    base = CostCalibration(
        device_kind=kind, peak_flops=1e12, memory_bandwidth=1e11, launch_overhead_s=3e-5,
        efficiency={"matmul": (0.2, 0.2)}, kernel_overhead_s={"matmul": 4e-5},
    )  # fmt: skip
    fitted = fit_eager_kernels(timed, base)
    assert fitted.eager is not None and fitted.eager.launch_overhead_s > 0
    assert fitted.model_copy(update={"eager": None}) == base  # nothing else changed

    # what the entry does: an engine's matmul kernel at the eager fit, a graph op not
    eager = base.model_copy(
        update={
            "eager": EagerKernels(
                launch_overhead_s=1e-6,
                kernel_overhead_s={"aten.mm.default": 2e-6},
                efficiency={"matmul": (0.5, 0.5)},
            )
        }
    )
    mm = LocalKernel("mm", "matmul", 1e9, 0.0, "float32", target="aten.mm.default")
    mesh = mesh_over(cluster, np.asarray([0, 1]), ("data",), "given")
    priced = EngineProgram(1, kernels=[mm]).predict(
        calibrated_cost_model(eager, cluster), mesh, device.spec
    )
    # efficiencies are relative to the calibration's peak (1e12): 1e9 flops at 0.5 of it
    assert priced["compute_s"] == pytest.approx(1e9 / (1e12 * 0.5) + 2e-6)
    plain = EngineProgram(1, kernels=[mm]).predict(
        calibrated_cost_model(base, cluster), mesh, device.spec
    )
    assert plain["compute_s"] == pytest.approx(1e9 / (1e12 * 0.2) + 4e-5)
    graph = capture(torch.nn.Linear(64, 64), (torch.randn(8, 64),), training=True)
    times = [calibrated_cost_model(c, cluster).op_times(graph, {kind: device.spec})[kind]
             for c in (base, eager)]  # fmt: skip
    assert np.array_equal(times[0], times[1])

    path = tmp_path / "calibration.json"
    save_calibration(eager, path)
    assert load_calibration(path) == eager
    document = json.loads(path.read_text())
    document["eager"]["launch_overhead_s"] = -1.0
    path.write_text(json.dumps(document))
    with pytest.raises(CalibrationError) as err:
        load_calibration(path)
    assert str(err.value).count("\n") == 0
    assert "field 'eager.launch_overhead_s'" in str(err.value)


def test_ranks_that_meet_in_collectives_pay_the_measured_skew_on_their_local_work(
    tmp_path: Path,
) -> None:
    """The synchronisation skew is measured on two forked ranks running the model's own
    step, with and without a meeting after the backward (every process reaped); the
    calibration file keeps it and the cost model charges it, times the local work
    (kernels and dispatch), to an engine program with collectives and to no other; a
    negative one in the file, one rank, one step or no budget is one sentence; pairs
    of steps the budget cannot buy are not run."""
    import multiprocessing

    from meshplace.cost.calibration import (
        CalibrationError,
        CostCalibration,
        calibrated_cost_model,
        load_calibration,
        save_calibration,
    )
    from meshplace.profile.link import measure_sync_skew
    from meshplace.runtime.dryrun import EngineCollective, LocalKernel

    (tmp_path / "mlp.py").write_text(MODEL)
    source = f"{tmp_path / 'mlp.py'}:build"
    measured = measure_sync_skew(source, steps=3)
    assert not multiprocessing.active_children()
    assert measured["skew"] >= 0 and measured["steps"] == 3 and measured["world_size"] == 2
    assert min(measured["free_step_s"], measured["met_step_s"], measured["token_s"]) > 0
    # the skew is what the met step took beyond the free one and the meeting's collective
    beyond = measured["met_step_s"] - measured["free_step_s"] - measured["token_s"]
    assert measured["skew"] == pytest.approx(max(0.0, beyond / measured["free_step_s"]))
    # pairs the budget cannot buy are not run (two at least)
    assert measure_sync_skew(source, steps=50, budget_s=1e-6)["steps"] == 2
    for bad in ({"world_size": 1}, {"steps": 1}, {"budget_s": 0.0}):
        with pytest.raises(InputError) as err:
            measure_sync_skew(source, **bad)
        assert str(err.value).count("\n") == 0

    cluster = load_cluster("dgx-h100")
    device = cluster.devices[accelerators(cluster)[0]]
    kind = device.kind
    calibration = CostCalibration(
        device_kind=kind, peak_flops=1e12, memory_bandwidth=1e11, launch_overhead_s=1e-5,
        dispatch_overhead_s=2e-5, sync_skew=0.25,
    )  # fmt: skip
    model = calibrated_cost_model(calibration, cluster)
    assert model.sync_skew == {kind: 0.25}
    mesh = mesh_over(cluster, np.asarray([0, 1]), ("data",), "given").calibrated(model)
    mm = LocalKernel("mm", "matmul", 1e9, 0.0, "float32", target="aten.mm.default")
    reduce = EngineCollective("all_reduce", 1e6, ["data"])
    met = EngineProgram(2, kernels=[mm], collectives=[reduce], dispatched=3)
    cost = met.predict(model, mesh, device.spec)
    local = cost["compute_s"] + cost["dispatch_s"]
    assert local > 0 and cost["communication_s"] > 0
    assert cost["sync_s"] == pytest.approx(0.25 * local)
    assert cost["step_s"] == pytest.approx(1.25 * local + cost["communication_s"])
    free = replace(met, collectives=[]).predict(model, mesh, device.spec)
    assert free["sync_s"] == 0 and free["step_s"] == pytest.approx(local)
    unmeasured = replace(model, sync_skew={})
    assert met.predict(unmeasured, mesh, device.spec)["step_s"] == pytest.approx(
        local + cost["communication_s"]
    )

    path = tmp_path / "calibration.json"
    save_calibration(calibration, path)
    assert load_calibration(path) == calibration
    document = json.loads(path.read_text())
    document["sync_skew"] = -0.1
    path.write_text(json.dumps(document))
    with pytest.raises(CalibrationError) as err:
        load_calibration(path)
    assert str(err.value).count("\n") == 0 and "field 'sync_skew'" in str(err.value)


def test_the_pipelining_engines_cost_per_micro_batch_is_measured(tmp_path: Path) -> None:
    from meshplace.runtime.pipelined import measure_engine_overhead

    # a batch of 6: the micro-batch count is the most of 8, 4, 2, 1 that divides it (2)
    (tmp_path / "mlp6.py").write_text(MODEL.replace("torch.randn(32, 64)", "torch.randn(6, 64)"))
    seconds = measure_engine_overhead(f"{tmp_path / 'mlp6.py'}:build", reps=2)
    assert math.isfinite(seconds) and seconds >= 0
    with pytest.raises(InputError, match="a batch of 6 does not split into 4 micro-batches"):
        measure_engine_overhead(f"{tmp_path / 'mlp6.py'}:build", micro_batches=4, reps=1)


LLAMA = """
import dataclasses, sys
import torch
sys.path.insert(0, {folder!r})
import llama

def build():
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], batch=1, n_layers=2, seq=16)
    model = llama.Llama(cfg)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    return model, (ids,), {{"labels": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))}}
"""


def test_the_hybrid_search_prices_tensor_parallelism_by_the_engines_program(
    tmp_path: Path, forked_dry_runs: None
) -> None:
    """``engine_pricer`` dry-runs the one-stage plan of a (tp, micro-batch) — the torchrun
    runtime's own step, its micro-batches under torch's pipelining schedule — and prices
    it: the program holds DTensor's ops, its collectives on the tensor axis and, apart,
    Adam's step; a one-stage plan of one micro-batch then costs exactly one forward and
    backward plus the optimizer's step. ``meshplace shard FILE.py:build --pipeline auto
    --engine-costs`` prints that plan at that cost in its one JSON document; the flag on
    a reference workload, or without ``--pipeline auto``, is one sentence and exit 2. A
    pipeline of two stages is refused by the dry run in one sentence (a fake process
    group carries no activations)."""
    from meshplace.graph.sources import graph_source
    from meshplace.parallel.cli import one_stage_plan_file
    from meshplace.parallel.hybrid import hybrid_search
    from meshplace.runtime.dryrun import engine_pricer, program_cost

    example = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    (tmp_path / "llama1.py").write_text(LLAMA.format(folder=str(example.parent)))
    source = f"{tmp_path / 'llama1.py'}:build"
    cluster = load_cluster("dgx-h100")
    gpus = cluster.ring_order(accelerators(cluster))[:2]
    model = CostModel(dispatch_overhead={cluster.devices[gpus[0]].kind: 2e-5})
    programs: dict[str, EngineProgram] = {}
    result = hybrid_search(
        source, None, cluster, global_batch=1, chips=2, tensor_parallel=(2,),
        pipeline_degrees=(1,), micro_batch_sizes=(1,), zero_stages=(0,),
        graphs=lambda b: graph_source(source, batch=b, training=True, autocast="bf16").graph,
        engine=engine_pricer(source, cluster, model, global_batch=1, programs=programs),
    )  # fmt: skip
    # one program per layout: the solver's and Megatron's pattern, which differ here
    assert len(programs) == 2 and set(result.megatron_part_costs) == {(2, 1)}
    best = result.best
    plan = one_stage_plan_file(result.costs_of(best), 2, "layers", 1, source)
    (program,) = [v for k, v in programs.items() if json.loads(k) == json.loads(json.dumps(plan))]
    assert program.world_size == 2
    assert 0 < program.dispatched_update < program.dispatched
    assert any(k.update and k.name.startswith("_foreach_") for k in program.kernels)
    assert not any(k.update and k.kind == "matmul" for k in program.kernels)
    # Megatron's layout splits the weights: its program holds their collectives, all on
    # the tensor axis (the solver's own layout may keep this small model's weights whole)
    megatron = one_stage_plan_file(result.megatron_part_costs[(2, 1)], 2, "layers", 1, source)
    (split,) = [v for k, v in programs.items() if json.loads(k) == json.loads(json.dumps(megatron))]
    assert split.collectives and all(c.axes == ["tensor"] for c in split.collectives)
    cost = program_cost(program, plan, cluster, model, gpus)
    assert 0 < cost["update_s"] < cost["step_s"]
    assert cost["dispatch_s"] == pytest.approx(program.dispatched * 2e-5)
    assert (best.tp, best.pp, best.dp, best.config.micro_batches) == (2, 1, 1, 1)
    assert best.time_per_batch_s == pytest.approx(cost["step_s"], rel=1e-9)
    # the command line: the same search, its cost model the catalogue's (no dispatch)
    command = ["shard", source, "--cluster", "dgx-h100", "--chips", "2", "--pipeline", "auto"]
    command += ["--global-batch", "1", "--json", "--engine-costs"]
    done = run_meshplace(command, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["search"]["tensor_parallelism_priced_by"] == "engine dry run"
    # each tp-2 plan among the best and the runners-up (configurations of the same two
    # layouts) at what the catalogue's model (no dispatch) says that layout's program costs
    tensor = [p for p in [data["best"], *data["runners_up"]] if p["tp"] == 2]
    plain = [
        program_cost(v, json.loads(k), cluster, CostModel(), gpus)["step_s"]
        for k, v in programs.items()
    ]
    assert tensor
    for p in tensor:
        assert any(p["time_per_batch_s"] == pytest.approx(s, rel=1e-9) for s in plain)
    for extra, words in (
        (["--engine-costs"], "is not one"),
        (["--pipeline", "auto", "--global-batch", "8", "--engine-costs"], "is not one"),
    ):
        done = run_meshplace(["shard", "gpt", "--cluster", "dgx-h100", *extra], timeout=120)
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    piped = {**plan, "mesh": {**plan["mesh"], "shape": [2, 1, 1]}}
    with pytest.raises(InputError, match="pipelines over 2 stages"):
        dry_run(piped, source)


def test_shard_engine_costs_ranks_the_candidates_as_the_runtime_runs_them(
    tmp_path: Path, forked_dry_runs: None
) -> None:
    """``meshplace shard FILE.py:build --engine-costs`` (no pipeline): the solver's plan
    and every Megatron grid point that fits, each distinct plan dry-run (one child for
    all) and priced by the same cost model, fastest kept: its one JSON document ranks
    them by that price, the kept plan is the one printed and written (``--out``, its
    engine price in ``predicted.engine``), and that price is what a dry run of the
    written plan on its own gives. ``dry_runs`` answers a plan its engine cannot run
    with a sentence and still records the others."""
    (tmp_path / "mlp.py").write_text(MODEL)
    source = f"{tmp_path / 'mlp.py'}:build"
    out = tmp_path / "plan.json"
    command = ["shard", source, "--cluster", "dgx-h100", "--chips", "2"]
    command += ["--weight-update-sharding", "off", "--engine-costs", "--json", "--out", str(out)]
    done = run_meshplace(command, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["search"]["ranked_by"] == "engine dry run"
    ranking = data["engine_ranking"]
    assert data["search"]["dry_runs"] == len(ranking) and data["search"]["engine_seconds"] > 0
    labels = [r["plan"] for r in ranking] + [a for r in ranking for a in r["same_as"]]
    assert "solver 2" in labels
    assert {"dp2 x tp1 zero0", "dp1 x tp2 zero0"} <= set(labels)
    steps = [r["engine"]["step_s"] for r in ranking]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    assert [r["chosen"] for r in ranking] == [True] + [False] * (len(ranking) - 1)
    # the DDP plan dispatches nothing through DTensor; the tensor-parallel one collects
    # over its tensor axis
    by_label = {label: r for r in ranking for label in [r["plan"], *r["same_as"]]}
    assert by_label["dp2 x tp1 zero0"]["engine"]["dispatched"] == 0
    assert by_label["dp1 x tp2 zero0"]["engine"]["collectives"]
    plan = json.loads(out.read_text())
    assert plan["parameters"] == data["parameters"]
    assert plan["predicted"]["engine"] == data["engine"] == ranking[0]["engine"]
    broken = {**plan, "parameters": {"not.a.parameter": plan["parameters"]["0.weight"]}}
    again, refused = dry_runs([plan, broken], source)
    assert isinstance(again, EngineProgram)
    cost = program_cost(again, plan, load_cluster("dgx-h100"), CostModel())
    assert cost["step_s"] == pytest.approx(ranking[0]["engine"]["step_s"], rel=1e-9)
    assert isinstance(refused, str) and "does not match the model" in refused


def test_rank_by_engine_keeps_the_cheapest_plan_its_engine_runs(tmp_path: Path) -> None:
    """The ranking itself, with a pricer standing in for the dry runs: each distinct plan
    priced once (a grid point equal to the solver's plan is listed beside it), a plan
    the engine cannot run ranked last with its sentence, the cheapest priced plan kept
    whatever the solver thought of it; when none runs, one sentence."""
    import argparse

    from rich.console import Console

    from meshplace.parallel.cli import print_engine_ranking, rank_by_engine
    from meshplace.parallel.search import shard_graph

    (tmp_path / "mlp.py").write_text(MODEL)
    source = f"{tmp_path / 'mlp.py'}:build"
    model, (x,) = load_build_function(source)()
    graph = capture(model, (x,), training=True)
    cluster = load_cluster("dgx-h100")
    result = shard_graph(graph, cluster, chips=2)
    args = argparse.Namespace(model=source, cluster="dgx-h100", weight_update_sharding="off")
    asked: list[list[dict]] = []

    def pricer(plans: list[dict], model: str, cluster: object, cost_model: object) -> list:
        asked.append(plans)
        assert model == source and isinstance(cost_model, CostModel)

        # the tensor-parallel plan cannot run; the others cost less the later they come
        def cost(i: int) -> dict:
            parts = {"compute_s": 1.0 / (i + 1), "dispatch_s": 0.0, "communication_s": 0.0}
            return {"step_s": 1.0 / (i + 1), **parts}

        return ["it cannot" if "Shard" in json.dumps(p["parameters"]) else cost(i)
                for i, p in enumerate(plans)]  # fmt: skip

    best, ranking, unplanned = rank_by_engine(args, result, pricer)
    assert unplanned == []  # on 2 chips every grid point has a plan
    (plans,) = asked
    keys = [json.dumps([p["parameters"], p["inputs"]]) for p in plans]
    assert len(set(keys)) == len(keys) == len(ranking)
    priced = [r for r in ranking if "engine" in r]
    assert [r["engine"]["step_s"] for r in priced] == sorted(r["engine"]["step_s"] for r in priced)
    assert ranking[0]["chosen"] and not any(r["chosen"] for r in ranking[1:])
    assert "error" in ranking[-1] and ranking[-1]["error"] == "it cannot"
    kept = plans[round(1 / ranking[0]["engine"]["step_s"]) - 1]  # the pricer's order
    assert best.parameters() == kept["parameters"]
    assert kept is max((p for p in plans if "Shard" not in json.dumps(p["parameters"])),
                       key=plans.index)  # fmt: skip
    console = Console(record=True, width=120)
    print_engine_ranking(console, ranking)
    text = console.export_text()
    assert f"* {ranking[0]['plan']}" in text and "cannot run: it cannot" in text
    with pytest.raises(InputError, match="no candidate plan runs on its engine"):
        rank_by_engine(args, result, lambda plans, *_: ["no"] * len(plans))
    # a batch of 2 on 4 chips: the grid's dp4 has no plan, and says why
    small = capture(model, (x[:2],), training=True)

    def every(plans: list[dict], *_: object) -> list[dict]:
        return [{"step_s": 1.0, "compute_s": 1.0, "dispatch_s": 0.0, "communication_s": 0.0}
                for _ in plans]  # fmt: skip

    _, _, unplanned = rank_by_engine(args, shard_graph(small, cluster, chips=4), every)
    assert [u["plan"] for u in unplanned] == ["dp4 x tp1 zero0"]
    assert "batch split 4 ways" in unplanned[0]["reason"]
