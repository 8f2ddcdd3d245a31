"""Ops a device cannot run (``Op.unsupported``, issue 17): infinitely slow there, so no
placer's best plan puts them there, ``simulate`` refuses a plan that does, and an op no
device of the cluster can run is one sentence."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshplace.cli import main
from meshplace.errors import InputError
from meshplace.graph.io import graph_from_dict, graph_to_dict, save_graph
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import load_cluster
from meshplace.placers import ManualClock, PlacementProblem, registry, run_placer, use_clock
from meshplace.placers.base import best_result
from meshplace.plan.placement import Plan, save_plan
from meshplace.sim.simulator import Simulator


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    with use_clock(ManualClock()) as clock:
        yield clock


def _profiled(n: int = 12) -> OpGraph:
    """A chain of measured layers; every third one only the CPU can run."""
    g = OpGraph("profiled")
    for i in range(n):
        g.add_op(
            Op(
                f"l{i}",
                "matmul",
                measured_time={"gpu": 1e-3, "cpu": 4e-3},
                unsupported=["gpu"] if i % 3 == 2 else [],
                memory_bytes=2**20,
            )
        )
        if i:
            g.add_edge(i - 1, i, 2**20)
    return g


def test_the_mark_round_trips_and_makes_the_time_infinite_there() -> None:
    g = graph_from_dict(graph_to_dict(_profiled()), "g.json")
    assert g.ops[2].unsupported == ["gpu"] and g.ops[1].unsupported == []
    sim = Simulator(g, load_cluster("colocrl-2gpu"))
    gpu = sim.kind_names.index("k80")
    assert np.isinf(sim.op_time_by_kind[gpu, 2]) and np.isfinite(sim.op_time_by_kind[gpu, 1])
    # the bounds stay finite, and no plan beats them
    for objective in ("step", "throughput"):
        bound = sim.lower_bound(objective)
        cpu_only = sim.simulate(np.zeros(g.num_ops, np.int64), objective)
        assert math.isfinite(bound) and cpu_only.value >= bound


def test_no_placers_best_plan_puts_an_op_where_it_cannot_run() -> None:
    g = _profiled()
    problem = PlacementProblem.build(g, load_cluster("colocrl-4gpu"), objective="throughput")
    results = [run_placer(name, problem, 0.05, seed=0) for name in registry()]
    best = best_result(results)
    assert best is not None and math.isfinite(best.value)
    problem.simulator.check_runnable(best.op_devices)
    for name in ("pipeline", "m_etf", "heft", "single_cpu"):  # these read the op times
        r = next(r for r in results if r.placer == name)
        assert math.isfinite(r.value), name


def test_simulate_refuses_a_plan_that_puts_an_op_where_it_cannot_run(
    tmp_path: Path, capsys
) -> None:
    g = _profiled(3)
    save_graph(g, tmp_path / "g.json")
    save_plan(Plan.for_graph(g, "colocrl-2gpu", {}, default_device="gpu0"), tmp_path / "p.json")
    code = main(["simulate", "--graph", str(tmp_path / "g.json"), "--cluster", "colocrl-2gpu",
                 "--plan", str(tmp_path / "p.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "places op 'l2' on gpu0" in err and "unsupported on gpu" in err


def test_an_op_no_device_can_run_is_one_sentence() -> None:
    g = OpGraph("nowhere")
    g.add_op(Op("x", "matmul", flops=1e9, unsupported=["gpu", "cpu"]))
    with pytest.raises(InputError, match="op 'x' can run on no device of cluster"):
        Simulator(g, load_cluster("colocrl-2gpu"))


def test_the_pipeline_dp_chunks_and_places_around_an_op_the_accelerators_cannot_run() -> None:
    """300 layers (more than the 256 chunks) with one only the CPU can run: the chunks
    stay balanced and in order, and the plan runs every op where it can."""
    from meshplace.placers.pipeline import pipeline_split

    g = OpGraph("long")
    for i in range(300):
        unsupported = ["gpu"] if i == 150 else []
        g.add_op(Op(f"l{i}", "matmul", flops=1e9, unsupported=unsupported))
        if i:
            g.add_edge(i - 1, i, 1e3)
    problem = PlacementProblem.build(g, load_cluster("colocrl-4gpu"), objective="throughput")
    plan, stats = pipeline_split(problem)
    assert stats["chunks"] > 200 and math.isfinite(stats["bottleneck_s"])
    problem.simulator.check_runnable(plan.devices)
    # without the CPU no pipeline can run it: one stage, infinitely slow, no crash
    _, no_cpu = pipeline_split(problem, cpu_stage=False)
    assert no_cpu["stages"] == 1 and math.isinf(no_cpu["bottleneck_s"])


def test_an_infinitely_slow_plan_is_written_as_strict_json(tmp_path: Path) -> None:
    import json

    from meshplace.placers.base import PlacerResult
    from meshplace.planning import result_plan

    g = _profiled(3)
    problem = PlacementProblem.build(g, load_cluster("colocrl-2gpu"))
    on_gpu = np.full(g.num_ops, problem.device_names.index("gpu0"))
    result = PlacerResult("by-hand", on_gpu, problem.simulator.simulate(on_gpu), 0.0, 1)
    assert math.isinf(result.value)
    save_plan(result_plan(problem, result, 0.05, 0), tmp_path / "p.json")
    meta = json.loads((tmp_path / "p.json").read_text(), parse_constant=float)["meta"]
    assert meta["objective_value_s"] is None and meta["runs_every_op"] is False


def test_grouping_never_mixes_ops_that_different_devices_can_run() -> None:
    """A chain whose ops alternate between GPU-only and CPU-only blocks: every group holds
    ops of one mark, so every group can run somewhere, and the placers that read op times
    find a plan that runs through their groups."""
    from meshplace.graph.groups import group_ops

    g = OpGraph("alternating")
    for i in range(40):
        mark = ["cpu"] if (i // 5) % 2 == 0 else ["gpu"]
        g.add_op(Op(f"l{i}", "matmul", flops=1e9, unsupported=mark))
        if i:
            g.add_edge(i - 1, i, 1e3)
    for max_groups in (2, 4, 64):
        grouping = group_ops(g, max_groups)
        for members in grouping.members():
            assert len({tuple(g.ops[i].unsupported) for i in members}) == 1
    problem = PlacementProblem.build(g, load_cluster("colocrl-4gpu"), max_groups=4)
    assert problem.group_runs.any(axis=0).all()
    for name in ("m_etf", "heft", "cpop", "anneal"):
        assert math.isfinite(run_placer(name, problem, 0.05, seed=0).value), name
    # a pipeline would need the CPU for four separate stretches: it has one CPU stage
    assert math.isinf(run_placer("pipeline", problem, 0.05, seed=0).value)
