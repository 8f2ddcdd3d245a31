"""Pure data-parallel sharding plans run on DDP and FSDP2 (``meshplace.runtime.data_parallel``):
which plans qualify, the probe of the loss over the batch, the units FSDP2 gathers, and
what the dry run records for each engine."""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import tempfile
from pathlib import Path

import pytest
import torch

from meshplace.runtime import dryrun
from meshplace.runtime.data_parallel import (
    batch_dims,
    data_parallel_stage,
    fsdp_units,
    loss_over_batch,
)
from meshplace.runtime.dryrun import EngineProgram

MLP = """\
import torch


def build():
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    return model, (torch.randn(32, 64),)
"""

BATCH_NORM = """\
import torch


def build():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    )
    return model, (torch.randn(8, 3, 12, 12),)
"""

# the MLP behind a constant table it adds to its input (as the Llama example's rotary
# tables): a buffer every rank builds alike and the training step never changes
WITH_TABLE = """\
import torch


class AddTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, 64))

    def forward(self, x):
        return x + self.table


def build():
    model = torch.nn.Sequential(
        AddTable(), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    return model, (torch.randn(32, 64),)
"""

# the MLP behind a buffer its forward changes (a count of the rows seen): DDP keeps it in
# step with rank 0's before every forward, as by default
WITH_COUNTER = """\
import torch


class Count(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return x


def build():
    model = torch.nn.Sequential(
        Count(), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    return model, (torch.randn(32, 64),)
"""

MLP_PARAMETERS = {"0.weight": 64 * 256, "0.bias": 256, "2.weight": 256 * 64, "2.bias": 64}


def _record(path: str, engine: str, out: str) -> None:
    """A forked child: ``python -m meshplace.runtime.dryrun``'s ``main`` on the plan at
    ``path``, its one JSON document written to ``out``; its exit status main's."""
    torch.set_num_threads(1)  # as the dry run's own process: OMP_NUM_THREADS=1
    with open(out, "w") as stdout, contextlib.redirect_stdout(stdout):
        status = dryrun.main([path, "--engine", engine])
    os._exit(status)


#: what a dry run imports (DTensor, DDP, FSDP2, the fake process group, the runtime),
#: imported here once so that each forked child starts with it
DRY_RUN_IMPORTS = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch.testing._internal.distributed.fake_pg",
    "meshplace.graph.capture",
    "meshplace.runtime.launch",
    "meshplace.runtime.sharded",
)


def dry_run(plan: dict, engine: str = "auto") -> EngineProgram:
    """What :func:`meshplace.runtime.dryrun.dry_run` records (rank 0's step of ``plan`` on a
    fake process group, by the module's own ``main``), in a forked child of this process
    rather than a fresh interpreter: importing torch there was most of this file's time
    (``dry_run`` itself, its process and its refusals, is tested in
    tests/test_runtime_dryrun.py)."""
    for name in DRY_RUN_IMPORTS:
        importlib.import_module(name)
    with tempfile.TemporaryDirectory(prefix="meshplace-dryrun-") as folder:
        path, out = Path(folder) / "plan.json", Path(folder) / "program.json"
        path.write_text(json.dumps(plan))
        child = multiprocessing.get_context("fork").Process(
            target=_record, args=(str(path), engine, str(out))
        )
        child.start()
        child.join(timeout=600)
        assert child.exitcode == 0, child.exitcode
        return EngineProgram.from_dict(json.loads(out.read_text()))


def pure_data_parallel_plan(source: str, parameters: list[str], zero: int) -> dict:
    return {
        "format": "meshplace.parallel_plan",
        "graph": {"source": source},
        "cluster": "dgx-h100",
        "mesh": {"shape": [2], "axes": ["x"], "devices": [0, 1]},
        "parameters": {n: {"placements": ["Replicate()"], "zero": zero} for n in parameters},
        "inputs": {"input": {"placements": ["Shard(0)"]}},
    }


def test_only_pure_data_parallelism_of_zero_0_1_or_3_leaves_dtensor() -> None:
    plan = pure_data_parallel_plan("m.py:build", list(MLP_PARAMETERS), 0)
    assert data_parallel_stage(plan) == 0
    plan["parameters"] = {n: {**p, "zero": 3} for n, p in plan["parameters"].items()}
    assert data_parallel_stage(plan) == 3
    ones = {n: {**p, "zero": 1} for n, p in plan["parameters"].items()}
    assert data_parallel_stage({**plan, "parameters": ones}) == 1  # DDP, the update sharded
    twos = {n: {**p, "zero": 2} for n, p in plan["parameters"].items()}
    assert data_parallel_stage({**plan, "parameters": twos}) is None  # DTensor's
    mixed = dict(plan["parameters"], **{"0.bias": {"placements": ["Replicate()"], "zero": 0}})
    assert data_parallel_stage({**plan, "parameters": mixed}) is None
    split = dict(plan["parameters"], **{"0.weight": {"placements": ["Shard(0)"], "zero": 3}})
    assert data_parallel_stage({**plan, "parameters": split}) is None  # tensor parallelism
    one = {**plan, "mesh": {"shape": [1], "axes": ["x"]}}
    assert data_parallel_stage(one) is None
    replicated = {"input": {"placements": ["Replicate()"]}}
    assert data_parallel_stage({**plan, "inputs": replicated}) is None  # nothing split
    # a 2-d mesh whose both axes split the batch is data parallelism over all 4 ranks
    square = {
        "x": {"placements": ["Shard(0)", "Shard(0)"]},
        "n": {"placements": ["Replicate()"] * 2},
    }
    assert batch_dims({"inputs": square}) == {"x": 0, "n": None}
    crossed = {"x": {"placements": ["Shard(0)", "Shard(1)"]}}
    assert batch_dims({"inputs": crossed}) == {}


def test_the_probe_tells_a_mean_from_a_sum_and_refuses_batch_statistics() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 3)
    x, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def loss(reduction: str):
        return lambda t: torch.nn.functional.cross_entropy(linear(t[0]), t[1], reduction=reduction)

    with torch.no_grad():
        assert loss_over_batch(loss("mean"), [x, labels], [0, 0], 2) == "mean"
        assert loss_over_batch(loss("sum"), [x, labels], [0, 0], 4) == "sum"
        # batch normalisation in training: each shard's statistics are not the batch's
        norm = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
        assert loss_over_batch(lambda t: norm(t[0]).pow(2).mean(), [x], [0], 2) is None
        # a model that cannot run on part of its batch, uneven shards, one shard
        fixed = lambda t: t[0].reshape(8, 6).mean()  # noqa: E731
        assert loss_over_batch(fixed, [x], [0], 2) is None
        assert loss_over_batch(loss("mean"), [x, labels], [0, 0], 3) is None
        assert loss_over_batch(loss("mean"), [x, labels], [0, 0], 1) is None
        # a replicated input is passed whole to every part
        seen = []
        loss_over_batch(lambda t: seen.append(t[1].shape) or t[0].mean(), [x, x], [0, None], 2)
        assert seen == [x.shape] * 3


def test_fsdp_gathers_each_block_then_the_rest_and_keeps_tied_weights_together() -> None:
    from meshplace.graph.sources import load_build_function

    llama = f"{Path(__file__).resolve().parents[1] / 'examples' / 'llama.py'}:build_tiny"
    model = load_build_function(llama)()[0]
    units = fsdp_units(model)
    assert units[:-1] == list(model.layers) and units[-1] is model

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
            self.blocks[1].weight = self.blocks[0].weight

    tied = Tied()
    assert fsdp_units(tied) == [tied]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("data_parallel")
    (folder / "mlp.py").write_text(MLP)
    (folder / "bn.py").write_text(BATCH_NORM)
    (folder / "table.py").write_text(WITH_TABLE)
    (folder / "counter.py").write_text(WITH_COUNTER)
    return {name: f"{folder / name}.py:build" for name in ("mlp", "bn", "table", "counter")}


def test_ddp_runs_a_replicated_plan_with_one_bucketed_all_reduce(sources: dict[str, str]) -> None:
    """What the dry run records is DDP's step: no DTensor op, one all-reduce of every
    gradient together (one 25 MB bucket), kernels on this rank's 16 rows of 32."""
    plan = pure_data_parallel_plan(sources["mlp"], list(MLP_PARAMETERS), 0)
    program = dry_run(plan)
    assert program.dispatched == 0
    reduced = [c.nbytes for c in program.collectives if c.kind == "all_reduce"]
    assert reduced == [4 * sum(MLP_PARAMETERS.values())]
    # DDP's all-reduce is the process group's own call: priced at its own measured rate
    assert all(c.c10d for c in program.collectives)
    matmuls = [k for k in program.kernels if k.kind == "matmul"]
    assert 2 * 16 * 64 * 256 <= max(k.flops for k in matmuls) < 2 * 32 * 64 * 256
    # --engine dtensor: the same plan under DTensor, which dispatches every op
    assert dry_run(plan, engine="dtensor").dispatched > 0


def test_ddp_broadcasts_the_buffers_only_where_the_forward_changes_them(
    sources: dict[str, str],
) -> None:
    """A model with a constant buffer (every rank builds it alike) runs on DDP without
    DDP's broadcast of the buffers before every forward: one all-reduce a step, no
    broadcast. A buffer the forward changes (a count of the rows seen) is kept in step
    with rank 0's, as DDP keeps buffers by default: a broadcast every step."""
    parameters = ["1.weight", "1.bias", "3.weight", "3.bias"]
    program = dry_run(pure_data_parallel_plan(sources["table"], parameters, 0))
    assert program.dispatched == 0  # DDP's
    assert program.collective_counts() == {"all_reduce": 1}
    program = dry_run(pure_data_parallel_plan(sources["counter"], parameters, 0))
    assert program.dispatched == 0
    assert program.collective_counts() == {"broadcast": 1, "all_reduce": 1}


def test_a_batch_split_over_a_2d_mesh_is_data_parallelism_over_every_rank(
    sources: dict[str, str],
) -> None:
    """Both axes of a 2 x 2 mesh split the batch: DDP over the 4 ranks (each 8 rows of
    32), its all-reduce over both axes; FSDP2 shards over the 4 ranks."""
    plan = pure_data_parallel_plan(sources["mlp"], list(MLP_PARAMETERS), 0)
    plan["mesh"] = {"shape": [2, 2], "axes": ["x", "y"], "devices": [[0, 1], [2, 3]]}
    plan["parameters"] = {n: {"placements": ["Replicate()"] * 2, "zero": 0} for n in MLP_PARAMETERS}
    plan["inputs"] = {"input": {"placements": ["Shard(0)", "Shard(0)"]}}
    program = dry_run(plan)
    assert program.world_size == 4 and program.dispatched == 0
    reduced = [c for c in program.collectives if c.kind == "all_reduce"]
    assert [(c.nbytes, sorted(c.axes)) for c in reduced] == [
        (4 * sum(MLP_PARAMETERS.values()), ["x", "y"])
    ]
    matmuls = [k for k in program.kernels if k.kind == "matmul"]
    assert 2 * 8 * 64 * 256 <= max(k.flops for k in matmuls) < 2 * 16 * 64 * 256
    plan["parameters"] = {n: {**p, "zero": 3} for n, p in plan["parameters"].items()}
    gathered = [c.nbytes for c in dry_run(plan).collectives if c.kind == "all_gather"]
    # counted as the ring formula counts them: the whole output, gathered from quarters
    assert gathered and all(n == 4 * sum(MLP_PARAMETERS.values()) for n in gathered)


def test_fsdp2_runs_a_zero_3_plan_gathering_and_reduce_scattering(sources: dict[str, str]) -> None:
    plan = pure_data_parallel_plan(sources["mlp"], list(MLP_PARAMETERS), 3)
    program = dry_run(plan)
    kinds = {c.kind for c in program.collectives}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds
    whole = 4 * sum(MLP_PARAMETERS.values())
    # every gradient is reduce-scattered once: the input of each is the whole gradient
    assert sum(c.nbytes for c in program.collectives if c.kind == "reduce_scatter") == whole
    # and the parameters are gathered whole from the ranks' halves (the gathered bytes:
    # what the ring formula and the measured all-gathers count)
    gathered = [c.nbytes for c in program.collectives if c.kind == "all_gather"]
    assert gathered and all(n == whole for n in gathered)


def test_a_loss_of_batch_statistics_keeps_a_data_parallel_plan_on_dtensor(
    sources: dict[str, str],
) -> None:
    parameters = ["0.weight", "0.bias", "1.weight", "1.bias", "5.weight", "5.bias"]
    program = dry_run(pure_data_parallel_plan(sources["bn"], parameters, 0))
    assert program.dispatched > 0  # DTensor: the batch's statistics over both ranks


def test_fsdp2_is_charged_its_measured_cost_per_unit_instead_of_dispatch_and_copies(
    sources: dict[str, str], tmp_path: Path
) -> None:
    """A ZeRO-3 program on FSDP2 costs each unit the calibration's measured FSDP2 cost
    (which holds its DTensor dispatch and its buffer copies) instead of dispatch per op
    and those copies' roofline; DTensor and DDP programs are costed as before. The
    calibration carries DDP's measured cost per micro-batch as well."""
    from meshplace.cost.calibration import (
        CostCalibration,
        calibrated_cost_model,
        load_calibration,
        save_calibration,
    )
    from meshplace.hardware import load_cluster
    from meshplace.runtime.data_parallel import measure_ddp_overhead, measure_fsdp_overhead
    from meshplace.runtime.dryrun import EngineProgram, LocalKernel, program_cost

    cluster = load_cluster("dgx-h100")
    kind = cluster.devices[0].kind
    calibration = CostCalibration(
        device_kind=kind,
        peak_flops=1e12,
        memory_bandwidth=1e11,
        launch_overhead_s=1e-5,
        dispatch_overhead_s=3e-5,
        fsdp_unit_overhead_s=2e-3,
        ddp_overhead_s=5e-4,
    )
    save_calibration(calibration, tmp_path / "cal.json")
    cost = calibrated_cost_model(load_calibration(tmp_path / "cal.json"), cluster)
    assert cost.fsdp_unit_overhead[kind] == 2e-3
    assert cost.ddp_overhead[kind] == 5e-4
    plan = pure_data_parallel_plan(sources["mlp"], list(MLP_PARAMETERS), 3)
    copy = LocalKernel("chunk_cat", "elementwise", 0.0, 1e9, "float32")  # 1 GB: 10 ms
    mm = LocalKernel("mm", "matmul", 2e9, 1e6, "float32")
    fsdp = EngineProgram(2, [copy, mm], [], dispatched=7, fsdp_units=3)
    dtensor = EngineProgram(2, [copy, mm], [], dispatched=7)
    on_fsdp = program_cost(fsdp, plan, cluster, cost)
    on_dtensor = program_cost(dtensor, plan, cluster, cost)
    assert on_fsdp["dispatch_s"] == pytest.approx(3 * 2e-3)
    assert on_dtensor["dispatch_s"] == pytest.approx(7 * 3e-5)
    assert on_dtensor["compute_s"] - on_fsdp["compute_s"] > 1e-3  # the copy, not charged
    assert EngineProgram.from_dict(fsdp.to_dict()) == fsdp
    old = dtensor.to_dict()  # a program recorded before FSDP2 ran plans
    del old["fsdp_units"]
    assert EngineProgram.from_dict(old).fsdp_units == 0
    # the measurement itself: one unit for a Sequential (the model), a step each way
    measured = measure_fsdp_overhead(sources["mlp"], reps=3, rounds=1)
    assert measured["units"] == 1
    assert measured["plain_step_s"] > 0 and measured["fsdp_step_s"] > 0
    assert measured["per_unit_s"] >= 0
    # DDP's per micro-batch: both passes timed, their paired difference never negative
    ddp = measure_ddp_overhead(sources["mlp"], reps=3)
    assert ddp["plain_s"] > 0 and ddp["ddp_s"] > 0 and ddp["per_micro_batch_s"] >= 0
