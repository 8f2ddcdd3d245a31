"""Calibration files (``meshplace.cost.calibration``): ``plan``, ``simulate`` and ``shard``
take ``--calibration FILE`` and apply it the same way; bad files are one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplace.cli import main
from meshplace.cost.calibration import (
    CostCalibration,
    calibrated_cost_model,
    load_calibration,
    save_calibration,
    with_collectives,
)
from meshplace.cost.compute import DEFAULT_EFFICIENCY, CostModel
from meshplace.errors import InputError
from meshplace.graph.io import save_graph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.plan.placement import Plan, save_plan
from meshplace.sim.simulator import Simulator


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _slow_matmuls(kind: str, cluster: str) -> CostCalibration:
    """A calibration of ``kind`` at the cluster's own peaks whose matmuls reach a tenth of
    the default efficiency and whose kernels cost 50 us to launch."""
    spec = next(d.spec for d in load_cluster(cluster).devices if d.kind == kind)
    ec, em = DEFAULT_EFFICIENCY["matmul"]
    return CostCalibration(
        device_kind=kind,
        peak_flops=spec.peak("float32"),
        memory_bandwidth=spec.memory_bandwidth,
        launch_overhead_s=50e-6,
        efficiency={"matmul": (ec / 10, em / 10)},
        source="test",
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("calibration")
    graph = workload_graph("dmcca")
    save_graph(graph, folder / "dmcca.json")
    plan = Plan.for_graph(graph, "colocrl-4gpu", {}, default_device="gpu1")
    save_plan(plan, folder / "plan.json")
    save_calibration(_slow_matmuls("k80", "colocrl-4gpu"), folder / "k80.json")
    save_calibration(_slow_matmuls("h100", "dgx-h100"), folder / "h100.json")
    return {"folder": folder, "graph": folder / "dmcca.json", "plan": folder / "plan.json"}


def test_the_file_round_trips_and_scales_to_the_clusters_peaks(tmp_path: Path) -> None:
    cal = _slow_matmuls("k80", "colocrl-4gpu")
    save_calibration(cal, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == cal
    cluster = load_cluster("colocrl-4gpu")
    cm = calibrated_cost_model(cal, cluster)
    assert cm.efficiency_on("k80", "matmul") == pytest.approx((0.07, 0.07))
    assert cm.efficiency_on("xeon-e5-2699v3", "matmul") == DEFAULT_EFFICIENCY["matmul"]
    assert cm.launch_on("k80", cluster.devices[1].spec) == 50e-6
    # measured at twice the spec's peak: the same measured times are twice the efficiency
    doubled = cal.model_copy(update={"peak_flops": 2 * cal.peak_flops})
    ec, _ = calibrated_cost_model(doubled, cluster).efficiency_on("k80", "matmul")
    assert ec == pytest.approx(0.14)


def test_simulate_and_plan_predict_with_the_calibration(capsys, files) -> None:
    base = ["--cluster", "colocrl-4gpu", "--json"]
    sim = ["simulate", "--graph", files["graph"], "--plan", files["plan"], *base]
    code, out, err = _run(capsys, *sim)
    assert code == 0, err
    default = json.loads(out)["step_time_s"]
    code, out, err = _run(capsys, *sim, "--calibration", files["folder"] / "k80.json")
    assert code == 0, err
    calibrated = json.loads(out)
    graph = workload_graph("dmcca")
    cluster = load_cluster("colocrl-4gpu")
    cm = calibrated_cost_model(load_calibration(files["folder"] / "k80.json"), cluster)
    simulator = Simulator(graph, cluster, cm)
    expected = simulator.simulate(simulator.placement_of(["gpu1"] * graph.num_ops)).step_time_s
    assert calibrated["step_time_s"] == pytest.approx(expected, rel=1e-12)
    assert calibrated["step_time_s"] > 2 * default  # slower matmuls, dearer launches
    assert calibrated["calibration"].endswith("k80.json")

    plan = ["plan", files["graph"], "--placer", "single", *base]
    code, out, err = _run(capsys, *plan)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = _run(capsys, *plan, "--calibration", files["folder"] / "k80.json")
    assert code == 0, err
    slow = json.loads(out)

    def single(result: dict) -> float:
        return next(r["step_time_s"] for r in result["results"] if r["placer"] == "single")

    assert single(slow) > 2 * single(plain)


def test_the_named_dimension_search_predicts_with_the_calibration(capsys, files) -> None:
    """``shard`` on a hand-written program (the Mesh-TensorFlow search's evaluator) applies
    the calibration as the captured graph's search does."""
    shard = ["shard", "transformer", "--cluster", "dgx-h100", "--chips", "2", "--json"]
    code, out, err = _run(capsys, *shard)
    assert code == 0, err
    default = json.loads(out)
    code, out, err = _run(capsys, *shard, "--calibration", files["folder"] / "h100.json")
    assert code == 0, err
    calibrated = json.loads(out)
    assert default["program"] == calibrated["program"]  # the program's search, not the graph's
    forward = calibrated["compute_s"]["forward"], default["compute_s"]["forward"]
    assert forward[0] > 2 * forward[1], forward


def test_shard_predicts_with_the_calibration(capsys, files) -> None:
    shard = ["shard", "dmcca", "--cluster", "dgx-h100", "--chips", "2", "--method", "graph"]
    code, out, err = _run(capsys, *shard, "--json")
    assert code == 0, err
    default = json.loads(out)
    code, out, err = _run(capsys, *shard, "--json", "--calibration", files["folder"] / "h100.json")
    assert code == 0, err
    calibrated = json.loads(out)
    assert calibrated["compute_s"] > 2 * default["compute_s"]
    assert calibrated["step_time_s"] > default["step_time_s"]


def test_a_sharding_plan_that_communicates_pays_the_synchronisation_skew() -> None:
    """A calibration's ``sync_skew`` moves the sharding solver's estimate of a plan whose
    devices meet in collectives by that fraction of its compute (the timeline's
    ``sync_s``, in the plan file's prediction), and not its choice (the solve leaves the
    skew out) nor its exposed communication; a plan on one device pays none."""
    from meshplace.parallel.search import shard_graph

    graph = workload_graph("dmcca")
    cluster = load_cluster("dgx-h100")
    calibration = _slow_matmuls("h100", "dgx-h100")

    def plans(chips: int, skew: float) -> dict[str, object]:
        cost_model = calibrated_cost_model(
            calibration.model_copy(update={"sync_skew": skew}), cluster
        )
        found = shard_graph(graph, cluster, chips=chips, cost_model=cost_model)
        return {p.mesh.label: p for p in found.candidates}

    plain, skewed = plans(2, 0.0), plans(2, 0.5)
    communicating = [k for k, p in plain.items() if p.communication_s > 0]
    assert communicating
    for label in communicating:
        before, after = plain[label], skewed[label]
        assert after.choice == before.choice
        assert after.timeline["sync_s"] == pytest.approx(0.5 * before.compute_s)
        assert after.step_time_s == pytest.approx(before.step_time_s + 0.5 * before.compute_s)
        assert after.exposed_communication_s == pytest.approx(before.exposed_communication_s)
        predicted = after.plan_file("dmcca", cluster.name)["predicted"]
        assert predicted["sync_s"] == after.timeline["sync_s"]
        assert before.timeline["sync_s"] == 0
    for label, one in plans(1, 0.5).items():
        assert one.timeline["sync_s"] == 0, label


def test_bad_calibrations_are_one_sentence(capsys, files) -> None:
    folder = files["folder"]
    (folder / "plan-as-cal.json").write_text(files["plan"].read_text())
    bad = json.loads((folder / "k80.json").read_text())
    bad["efficiency"]["matmul"] = [0.0, 0.5]
    (folder / "zero.json").write_text(json.dumps(bad))
    sim = ["simulate", "--graph", files["graph"], "--plan", files["plan"]]
    cases = [
        (["--cluster", "dgx-h100", "--calibration", folder / "k80.json"], "has none"),
        (["--cluster", "colocrl-4gpu", "--calibration", folder / "nope.json"], "no such"),
        (["--cluster", "colocrl-4gpu", "--calibration", folder / "plan-as-cal.json"], "not a"),
        (["--cluster", "colocrl-4gpu", "--calibration", folder / "zero.json"], "efficiency"),
    ]
    for args, message in cases:
        code, _out, err = _run(capsys, *sim, *args)
        assert code == 2, (args, err)
        assert message in err and err.count("\n") == 1, (args, err)


def test_the_default_cost_model_is_unchanged_by_an_empty_calibration_kind() -> None:
    graph = workload_graph("dmcca")
    cluster = load_cluster("colocrl-4gpu")
    kinds = {d.kind: d.spec for d in cluster.devices}
    plain = CostModel().op_times(graph, kinds)
    same = CostModel(device_efficiency={"other": {"matmul": (0.01, 0.01)}}).op_times(graph, kinds)
    assert all((plain[k] == same[k]).all() for k in kinds)


def _slow_collectives(cal: CostCalibration) -> CostCalibration:
    """``cal`` with collectives measured at 1 ms per ring step and 1 GB/s."""
    fits = {k: {"latency_s": 1e-3, "bandwidth": 1e9} for k in ("all_reduce", "all_gather")}
    return with_collectives(cal, {"fits": fits, "world_size": 2})


def _shard_dmcca_on_two_h100s(capsys, calibration: Path) -> dict:
    """``meshplace shard``'s JSON for dmcca on a 2-wide mesh of H100s, calibrated."""
    shard = ["shard", "dmcca", "--cluster", "dgx-h100", "--chips", "2", "--method", "graph"]
    code, out, err = _run(capsys, *shard, "--mesh", "2", "--json", "--calibration", calibration)
    assert code == 0, err
    return json.loads(out)


def test_measured_collectives_cost_the_sharding_plans(tmp_path: Path, capsys) -> None:
    """A calibration's measured collectives replace the cluster's links in the sharding
    solver's costs (``Mesh.calibrated``): the data-parallel plan of the same graph pays
    its collectives at the measured latency and bandwidth, so ``shard --calibration``
    predicts a slower step."""
    from meshplace.mesh.layout import build_mesh

    base = _slow_matmuls("h100", "dgx-h100").model_copy(
        update={"efficiency": {}, "launch_overhead_s": 5e-6}
    )
    slow = _slow_collectives(base)
    save_calibration(base, tmp_path / "links.json")
    save_calibration(slow, tmp_path / "slow.json")
    assert load_calibration(tmp_path / "slow.json") == slow
    cluster = load_cluster("dgx-h100")
    mesh = build_mesh(cluster, (2,), chips=2)
    calibrated = mesh.calibrated(calibrated_cost_model(slow, cluster))
    # 2 (p - 1) (1 ms + n / (p x 1 GB/s)) for an all-reduce of n = 1 MB over 2 devices
    assert calibrated.collective_time("all_reduce", 1e6, ["x"]) == pytest.approx(3e-3)
    assert calibrated.collective_time("all_reduce", 1e6, ["x"]) > 100 * mesh.collective_time(
        "all_reduce", 1e6, ["x"]
    )
    # kinds not measured keep the links' formula; a cost model without them, the mesh
    assert calibrated.collective_time("reduce_scatter", 1e6, ["x"]) == mesh.collective_time(
        "reduce_scatter", 1e6, ["x"]
    )
    assert mesh.calibrated(calibrated_cost_model(base, cluster)) is mesh
    on_links = _shard_dmcca_on_two_h100s(capsys, tmp_path / "links.json")
    measured = _shard_dmcca_on_two_h100s(capsys, tmp_path / "slow.json")
    # dearer collectives: a slower step, even with the plan the solver then prefers
    # (less splitting, more compute per device)
    assert measured["step_time_s"] > on_links["step_time_s"]


def test_the_process_groups_own_collectives_cost_their_own_measured_rates(
    tmp_path: Path, capsys
) -> None:
    """``collectives_c10d`` (the process group's own calls, which DDP, FSDP2 and the
    runtime's flat buckets issue) prices those calls where ``collectives`` (DTensor's
    redistributions) prices the rest: on a mesh (``c10d=True``, kinds not measured so
    falling back to DTensor's rates), in an engine's recorded program (by each
    collective's ``c10d`` mark) and in the sharding solver (its bucketed gradient
    reductions), so ``shard --calibration`` predicts a faster data-parallel step when
    the process group's calls are measured cheaper."""
    from meshplace.mesh.layout import build_mesh
    from meshplace.runtime.dryrun import EngineCollective, EngineProgram

    base = _slow_collectives(
        _slow_matmuls("h100", "dgx-h100").model_copy(
            update={"efficiency": {}, "launch_overhead_s": 5e-6}
        )
    )
    slow = {k: {"latency_s": 1e-3, "bandwidth": 1e9} for k in ("all_reduce", "all_gather")}
    fast = {"all_reduce": {"latency_s": 1e-4, "bandwidth": 1e10}}
    both = with_collectives(base, {"fits": slow, "world_size": 2}, {"fits": fast})
    assert both.collectives == base.collectives
    # measured among other processes than DTensor's: refused; DTensor's alone: none kept
    with pytest.raises(InputError, match="among the same"):
        with_collectives(base, {"fits": slow, "world_size": 2}, {"fits": fast, "world_size": 4})
    assert with_collectives(both, {"fits": slow, "world_size": 2}).collectives_c10d == {}
    assert both.collectives_c10d == {"all_reduce": (1e-4, 1e10)}
    save_calibration(both, tmp_path / "both.json")
    assert load_calibration(tmp_path / "both.json") == both
    cluster = load_cluster("dgx-h100")
    cost_model = calibrated_cost_model(both, cluster)
    assert cost_model.c10d_collectives == {"h100": {"all_reduce": (1e-4, 1e10)}}
    mesh = build_mesh(cluster, (2,), chips=2).calibrated(cost_model)
    # 2 (p - 1) (latency + n / (p bandwidth)) for n = 1 MB over 2 devices
    assert mesh.collective_time("all_reduce", 1e6, ["x"]) == pytest.approx(3e-3)
    assert mesh.collective_time("all_reduce", 1e6, ["x"], c10d=True) == pytest.approx(3e-4)
    # a kind measured only as DTensor runs it costs DTensor's rate either way
    assert mesh.collective_time("all_gather", 1e6, ["x"], c10d=True) == pytest.approx(1.5e-3)
    program = EngineProgram(
        2,
        collectives=[
            EngineCollective("all_reduce", 1e6, ["x"]),
            EngineCollective("all_reduce", 1e6, ["x"], c10d=True),
        ],
    )
    spec = cluster.devices[0].spec
    cost = program.predict(cost_model, mesh, spec)
    assert cost["communication_s"] == pytest.approx(3e-3 + 3e-4)
    # recorded before the mark existed: DTensor's rates
    again = EngineProgram.from_dict(json.loads(json.dumps(program.to_dict())))
    assert [c.c10d for c in again.collectives] == [False, True]
    old = program.to_dict()
    for c in old["collectives"]:
        del c["c10d"]
    assert EngineProgram.from_dict(old).predict(cost_model, mesh, spec)[
        "communication_s"
    ] == pytest.approx(6e-3)
    save_calibration(base, tmp_path / "dtensor.json")
    dtensor_rates = _shard_dmcca_on_two_h100s(capsys, tmp_path / "dtensor.json")
    both_rates = _shard_dmcca_on_two_h100s(capsys, tmp_path / "both.json")
    assert both_rates["step_time_s"] < dtensor_rates["step_time_s"]


def test_the_engine_dispatch_is_charged_on_measured_times_too() -> None:
    """``dispatch_overhead`` (DTensor's per-op cost) is added to every kernel, whether its
    time is the roofline's or measured, and to the launch the sharding solver keeps whole
    when it splits an op."""
    graph = workload_graph("dmcca")
    cluster = load_cluster("colocrl-4gpu")
    kinds = {d.kind: d.spec for d in cluster.devices}
    kernel = [o.kind not in ("parameter", "buffer", "input") for o in graph.ops]
    plain = CostModel().op_times(graph, kinds)["k80"]
    cal = _slow_matmuls("k80", "colocrl-4gpu").model_copy(
        update={"efficiency": {}, "dispatch_overhead_s": 2e-5}
    )
    engine = calibrated_cost_model(cal, cluster)
    launch = CostModel(launch_overhead={"k80": 50e-6}).op_times(graph, kinds)["k80"]
    with_dispatch = engine.op_times(graph, kinds)["k80"]
    assert with_dispatch[kernel] == pytest.approx(launch[kernel] + 2e-5)
    assert (with_dispatch[[not k for k in kernel]] == 0).all()
    assert engine.launch_on("k80", kinds["k80"]) == pytest.approx(70e-6)
    first = next(i for i, k in enumerate(kernel) if k)
    graph.ops[first].measured_time["k80"] = 1e-3
    measured = engine.op_times(graph, kinds)["k80"]
    assert measured[first] == pytest.approx(1e-3 + 2e-5)
    assert CostModel().op_times(graph, kinds)["k80"][first] == pytest.approx(1e-3)
    assert plain[first] != pytest.approx(1e-3)
