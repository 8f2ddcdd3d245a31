"""A placement run's prediction by the one cost model: ``meshplace run --plan PLACEMENT
--launcher torchrun --cluster C --calibration FILE`` reports the step as the simulator
predicts it on ``C`` with that calibration (``meshplace simulate --calibration``'s
number), and refuses what it cannot predict in one sentence before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplace.cost.calibration import CostCalibration, calibrated_cost_model, save_calibration
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import load_cluster
from meshplace.plan import Plan, save_plan


def _chain() -> OpGraph:
    """Two matmuls forward and their two backward ops, batch 8: a pipeline of two stages
    when each pair is on its own GPU."""
    g = OpGraph("chain")
    g.add_op(Op("input:x", "input", output_shapes=[[8, 4]]))
    for i in range(2):
        g.add_op(Op(f"f{i}", "matmul", flops=4e9, output_shapes=[[8, 4]]))
        g.add_edge("input:x" if i == 0 else "f0", f"f{i}", 4e6)
    for i in reversed(range(2)):
        g.add_op(Op(f"b{i}", "matmul", phase="backward", flops=8e9, forward_op=f"f{i}"))
        g.add_edge(f"f{i}", f"b{i}", 4e6)
    g.add_edge("b1", "b0", 4e6)
    return g


def _calibration(tmp_path: Path, kind: str = "k80") -> str:
    """A calibration file of ``kind`` with a measured pipeline exchange."""
    cal = CostCalibration(
        device_kind=kind,
        peak_flops=4e12,
        memory_bandwidth=2e11,
        launch_overhead_s=1e-5,
        pipeline_exchange_s=2e-3,
        pipeline_message_s=5e-4,
    )
    save_calibration(cal, tmp_path / f"{kind}.json")
    return str(tmp_path / f"{kind}.json")


def test_a_pipelined_placement_is_predicted_as_the_simulator_schedules_it(tmp_path) -> None:
    """The simulated prediction is the throughput objective of the same cost model at the
    run's micro-batches and schedule — the calibration's exchange charged per
    micro-batch — and one step of the event simulation for a placement that is no
    pipeline."""
    from meshplace.runtime.launch import simulated_placement_step
    from meshplace.sim.simulator import Simulator

    graph, cluster = _chain(), load_cluster("colocrl-2gpu")
    devices = ["gpu0", "gpu0", "gpu1", "gpu1", "gpu0"]  # input, f0, f1, b1, b0
    plan = Plan.from_devices(graph, cluster.name, devices, micro_batches=4)
    cal = CostCalibration.model_validate_json(Path(_calibration(tmp_path)).read_text())
    model = calibrated_cost_model(cal, cluster)
    out = simulated_placement_step(plan, graph, cluster, model, micro_batches=4, schedule="GPipe")
    sim = Simulator(graph, cluster, model)
    placement = sim.placement_of(devices)
    expected = sim.simulate(placement, objective="throughput", micro_batches=4, schedule="gpipe")
    assert out["step_time_s"] == expected.throughput_time_s
    assert out["micro_batches"] == 4 and out["schedule"] == "GPipe"
    assert 0 < out["bubble_fraction"] < 1 and out["cluster"] == "colocrl-2gpu"
    idle = calibrated_cost_model(cal.model_copy(update={"pipeline_exchange_s": 0.0}), cluster)
    without = simulated_placement_step(plan, graph, cluster, idle, micro_batches=4)
    assert out["step_time_s"] > without["step_time_s"]  # the exchange is charged
    one = simulated_placement_step(plan, graph, cluster, model)
    assert one["step_time_s"] == sim.simulate(placement).step_time_s
    assert one["schedule"] is None and one["micro_batches"] == 1


def test_what_cannot_be_predicted_is_one_sentence_before_any_rank(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from meshplace.cli import main as meshplace_main
    from meshplace.runtime.launch import main as runtime_main

    graph = _chain()
    plan = Plan.from_devices(graph, "colocrl-2gpu", ["gpu0", "gpu0", "gpu1", "gpu1", "gpu0"])
    save_plan(plan, tmp_path / "placed.json")
    foreign = json.loads((tmp_path / "placed.json").read_text())
    foreign["cluster"] = "nowhere"
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    _calibration(tmp_path, "k80")
    _calibration(tmp_path, "tpu-v3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    model = ["--model", "mlp"]
    for args, message in (
        (["--plan", "placed.json", "--calibration", "tpu-v3.json"], "has none"),
        (["--plan", "placed.json", "--cluster", "tpu-v3-8"], "has no device 'gpu0'"),
        (["--plan", "foreign.json", "--calibration", "k80.json"], "pass --cluster"),
        (["--plan", "placed.json", "--calibration", "missing.json"], "missing.json"),
    ):
        assert runtime_main([*args, *model]) == 2, args
        out, err = capsys.readouterr()
        assert message in err and err.count("\n") == 1 and out == "", (args, err)
    # through meshplace run: refused before torchrun starts; the local launcher has its
    # own calibration
    run = ["run", "--graph", "mlp", "--launcher", "torchrun"]
    assert meshplace_main([*run, "--plan", "placed.json", "--cluster", "tpu-v3-8"]) == 2
    assert "has no device 'gpu0'" in capsys.readouterr().err
    assert (
        meshplace_main(
            ["run", "--graph", "mlp", "--plan", "placed.json", "--calibration", "k80.json"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "placements run with --launcher torchrun" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--cluster", "--calibration"])
def test_a_hybrid_plan_still_refuses_the_prediction_flags(flag: str) -> None:
    from meshplace.errors import InputError
    from meshplace.runtime.launch import check_prediction_options

    class Args:
        plan = "hybrid.json"
        cluster = "colocrl-2gpu" if flag == "--cluster" else None
        calibration = "c.json" if flag == "--calibration" else None
        engine = None

    with pytest.raises(InputError, match=f"{flag} applies to sharding and placement plans"):
        check_prediction_options(Args(), {}, sharding=False, placement=False)
