"""The hybrid search on a model without identical layers (issue 18, item 3's "op groups
where there are no layers"): units, their costs, the DP over unit ranges."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from meshplace.cli import main
from meshplace.errors import InputError
from meshplace.graph.capture import capture
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import load_cluster
from meshplace.parallel import hybrid
from meshplace.parallel.units import (
    best_unit_split,
    boundary_bytes,
    brute_force_unit_split,
    op_units,
)
from meshplace.sim.schedule import simulate_schedule


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.norm(self.conv(x)))


class TinyResNet(nn.Module):
    """A stem, two stages of two blocks of different widths, a head: no identical layers
    in one stack (ResNet's shape, small)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stage1 = nn.Sequential(Block(8), Block(8))
        self.widen = nn.Conv2d(8, 16, 1)
        self.stage2 = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.widen(self.stage1(torch.relu(self.stem(x)))))
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), y)


@functools.lru_cache(maxsize=8)
def tiny_resnet(batch: int) -> OpGraph:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyResNet()
    x = torch.zeros(batch, 3, 16, 16)
    y = torch.zeros(batch, dtype=torch.int64)
    return capture(model, (x, y), training=True, name=f"tiny-resnet-b{batch}")


def test_units_follow_the_blocks_and_every_op_has_one() -> None:
    g = tiny_resnet(4)
    names, unit = op_units(g)
    assert names == ["stem", "stage1.0", "stage1.1", "widen", "stage2.0", "stage2.1", "head"]
    assert np.all(unit >= 0) and unit.max() == len(names) - 1
    index = {o.name: i for i, o in enumerate(g.ops)}
    for i, o in enumerate(g.ops):  # a backward op is priced with its forward op
        if o.phase == "backward" and o.forward_op in index:
            assert unit[i] == unit[index[o.forward_op]]
    crossing = boundary_bytes(g, unit, len(names))
    assert crossing[0] == crossing[-1] == 0 and np.all(crossing[1:-1] > 0)
    assert not hybrid.has_layer_stack(g)


def test_interleaved_layers_and_a_single_unit_are_one_sentence() -> None:
    g = OpGraph("rnn")
    for name, module in (("a", "cell.0"), ("b", "cell.1"), ("c", "cell.0")):
        g.add_op(Op(name, "matmul", module=module))
    with pytest.raises(InputError, match="not contiguous"):
        op_units(g)
    one = OpGraph("one")
    one.add_op(Op("x", "matmul", module="fc"))
    with pytest.raises(InputError, match="fewer than two pipeline units"):
        op_units(one)


@pytest.mark.parametrize("seed", range(60))
def test_the_unit_dp_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_units = int(rng.integers(1, 7))
    p = int(rng.integers(1, n_units + 1))
    n_r = int(rng.integers(1, 3))
    m = int(rng.integers(1, 9))
    times = rng.uniform(0.1, 5.0, (p, n_units + 1, n_units + 1, n_r))
    times[rng.random(times.shape) < 0.1] = np.inf  # a stage a unit range cannot be
    feasible = rng.random(times.shape) < 0.8
    ours = best_unit_split(times, feasible, m)
    truth = brute_force_unit_split(times, feasible, m)
    assert ours[0] == pytest.approx(truth[0], rel=1e-12) or ours[0] == truth[0] == np.inf
    if np.isfinite(truth[0]):
        bounds, options = ours[1], ours[2]
        cells = [(i, bounds[i], bounds[i + 1], options[i]) for i in range(p)]
        assert bounds[0] == 0 and bounds[-1] == n_units
        assert all(feasible[c] for c in cells)
        stage = [times[c] for c in cells]
        assert sum(stage) + (m - 1) * max(stage) == pytest.approx(ours[0], rel=1e-12)


@pytest.fixture(scope="module")
def resnet_result() -> hybrid.HybridResult:
    return hybrid.hybrid_search(
        "tiny-resnet", None, load_cluster("h2-8xh100"), global_batch=16,
        tensor_parallel=(1,), micro_batch_sizes=(2, 4), graphs=tiny_resnet, simulate_top=1000,
    )  # fmt: skip


def test_a_model_without_identical_layers_is_cut_between_its_units(resnet_result) -> None:
    r = resnet_result
    names = op_units(tiny_resnet(2))[0]
    assert r.units == names and r.layers == len(names) and r.solves == 2
    assert r.best.fits
    staged = [p for p in r.plans if p.pp > 1]
    assert staged and all(p.config.schedule != "interleaved" for p in r.plans)
    costs = r.part_costs[(1, 2)]
    assert isinstance(costs, hybrid.UnitCosts) and len(costs.units) == len(names)
    total = sum(o.flops for o in tiny_resnet(2).ops if o.phase != "update")
    assert sum(u.flops for u in costs.units) == pytest.approx(total, rel=1e-9)
    for plan in staged:
        assert sum(plan.layers_per_stage) == len(names) and min(plan.layers_per_stage) >= 1
        assert len(plan.stage_units) == plan.pp
        assert plan.stage_units[0].startswith(names[0])
        # the stage times the schedule runs are each stage's units' costs
        bounds = np.concatenate([[0], np.cumsum(plan.layers_per_stage)])
        pc = r.costs_of(plan)
        for i in range(plan.pp):
            units = pc.units[bounds[i] : bounds[i + 1]]
            forward = sum(u.forward_s for u in units)
            if plan.config.zero < 3:  # exactly the units' (ZeRO-3 adds exposed gathers)
                assert plan.stage_forward_s[i] == pytest.approx(forward, rel=1e-12)
            else:
                assert plan.stage_forward_s[i] >= forward * (1 - 1e-12)
        if not np.isnan(plan.time_per_batch_s):
            c = plan.config
            simulated = simulate_schedule(plan.stage_times, c.schedule, c.micro_batches)
            assert plan.time_per_batch_s == pytest.approx(simulated.step_s, rel=1e-12)


def test_a_unit_stage_of_several_devices_pays_the_synchronisation_skew() -> None:
    """Cut between units as between layers: a cost model's ``sync_skew`` is charged once
    per step to a stage that spans two devices — its micro-batches' forward and backward
    times the skew — and not to a pipeline of one-device stages."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind

    def search(model: CostModel) -> dict[tuple[int, int, int], hybrid.HybridPlan]:
        result = hybrid.hybrid_search(
            "tiny-resnet", None, cluster, chips=2, global_batch=16, tensor_parallel=(1,),
            micro_batch_sizes=(4,), graphs=tiny_resnet, simulate_top=1000,
            schedules=("gpipe",), zero_stages=(0,), cost_model=model,
        )  # fmt: skip
        return {(p.pp, p.dp, p.config.zero): p for p in result.plans}

    plain, skewed = search(CostModel()), search(CostModel(sync_skew={kind: 0.5}))
    replicas = plain[(1, 2, 0)]
    local = replicas.config.micro_batches * (
        replicas.stage_forward_s[0] + replicas.stage_backward_s[0]
    )
    assert skewed[(1, 2, 0)].sync_s[0] - replicas.sync_s[0] == pytest.approx(0.5 * local)
    assert skewed[(1, 2, 0)].time_per_batch_s == pytest.approx(
        replicas.time_per_batch_s + 0.5 * local, rel=1e-6
    )
    assert skewed[(2, 1, 0)].time_per_batch_s == plain[(2, 1, 0)].time_per_batch_s


def test_the_cli_cuts_a_users_model_between_units(tmp_path: Path, capsys) -> None:
    source = tmp_path / "cnn.py"
    source.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_hybrid_units import TinyResNet\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return TinyResNet(), (torch.zeros(4, 3, 16, 16), torch.zeros(4, dtype=torch.int64))\n"
    )
    argv = ["shard", f"{source}:build", "--cluster", "dgx-h100", "--chips", "2"]
    out = tmp_path / "plan.json"
    assert main([*argv, "--pipeline", "auto", "--global-batch", "16", "--json", "--out",
                 str(out)]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["units"] and data["layers"] == len(data["units"])
    plan = json.loads(out.read_text())
    assert plan["graph"]["units"] == data["units"]
    first = data["best"]
    if first["pp"] > 1:
        assert [s["units"] for s in plan["stages"]] == first["stage_units"]
    # the HTML report names the units of each stage (of the best plan with stages)
    staged = next((p for p in [first, *data["runners_up"]] if p["pp"] > 1), None)
    assert staged is not None
    result = tmp_path / "result.json"
    result.write_text(json.dumps({**data, "best": {**staged, "schedule_tasks": []}}))
    assert main(["report", str(result), "--html", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "<th>units</th>" in html and staged["stage_units"][0] in html
    assert main([*argv, "--pipeline", "auto", "--global-batch", "16", "--style", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "no stack of identical layers" in err and err.count("\n") == 1
    # the engine's dry run prices a layer stack's tensor parallelism only: said, not implied
    assert main([*argv, "--pipeline", "auto", "--global-batch", "16", "--json",
                 "--engine-costs"]) == 0  # fmt: skip
    search = json.loads(capsys.readouterr().out)["search"]
    assert search["tensor_parallelism_priced_by"] == "solver"
    assert "cut between units" in search["skipped"]["engine"]
