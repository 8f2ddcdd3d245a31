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
