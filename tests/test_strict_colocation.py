"""Strict co-location (issue 17): a class marked strict runs on one device — every placer
keeps it whole, plan validation refuses a plan that splits one, and a bad mark is one
sentence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from meshplace.cli import main
from meshplace.graph.groups import group_ops, split_strict_class, strict_classes, tied_groups
from meshplace.graph.io import graph_from_dict, graph_to_dict, save_graph
from meshplace.graph.ir import GraphError, Op, OpGraph
from meshplace.hardware import load_cluster
from meshplace.placers import ManualClock, PlacementProblem, registry, run_placer, use_clock
from meshplace.plan.placement import Plan, PlanError, save_plan

from .strategies import random_dags


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Budgets are fixed work: no deadline cuts a run short on a busy machine."""
    with use_clock(ManualClock()) as clock:
        yield clock


def _training_like(n_layers: int = 6) -> OpGraph:
    """A forward chain, a loss and the backward chain, each forward op and its gradient
    in one strict class — a class no acyclic group can hold (the path between them runs
    through every later layer)."""
    g = OpGraph("fwd-bwd", meta={"strict_colocation": True})
    for i in range(n_layers):
        g.add_op(Op(f"f{i}", "matmul", flops=1e9 * (1 + i % 3), colocation=f"layer{i}"))
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}", 4e6)
    g.add_op(Op("loss", "elementwise", flops=1e6))
    g.add_edge(f"f{n_layers - 1}", "loss", 4e6)
    previous = "loss"
    for i in reversed(range(n_layers)):
        g.add_op(Op(f"b{i}", "matmul", phase="backward", flops=2e9, colocation=f"layer{i}"))
        g.add_edge(previous, f"b{i}", 4e6)
        g.add_edge(f"f{i}", f"b{i}", 4e6)  # the saved activation
        previous = f"b{i}"
    return g


def test_a_class_that_no_acyclic_group_holds_is_tied_across_groups() -> None:
    g = _training_like()
    grouping = group_ops(g, max_groups=64)
    classes = strict_classes(g)
    decider = tied_groups(grouping, classes)
    for members in classes.values():
        groups = {int(grouping.group_of[m]) for m in members}
        assert len({int(decider[x]) for x in groups}) == 1  # one decider per class
    assert any(len({int(grouping.group_of[m]) for m in ms}) > 1 for ms in classes.values())
    # the group graph stays acyclic: ties are not merges
    grouping.group_graph().check_acyclic()


MAX_OPS = 25


def _all_placers() -> list[str]:
    return list(registry())


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(max_ops=MAX_OPS))
def test_every_placer_keeps_every_strict_class_on_one_device(graph: OpGraph) -> None:
    graph.meta["strict_colocation"] = True
    for o in graph.ops:  # finite, small costs so that every plan fits
        o.param_bytes = o.param_bytes % 2**20
        o.output_shapes = [[min(8, s) for s in shape] for shape in o.output_shapes]
    problem = PlacementProblem.build(graph, load_cluster("colocrl-4gpu"), max_groups=8)
    classes = strict_classes(graph)
    # The check holds at any budget: run_placer keeps every strict class whole in whatever
    # plan a placer returns, and simulates that plan. A budget is simulations x ops, so one
    # fixed budget gave a 1-op graph 25x the simulations of a 25-op one (anneal ~50,000 and
    # random_search 90,000, ~5 s each); in proportion to the ops every example gets the
    # search 0.05 s buys the largest (random_search 3,600 plans, anneal ~2,000).
    budget = 0.05 * graph.num_ops / MAX_OPS
    for name in _all_placers():
        result = run_placer(name, problem, budget, seed=0)
        assert split_strict_class(graph, result.op_devices, classes) is None, name
        assert np.array_equal(result.sim.placement, result.op_devices), name


def test_every_placer_keeps_forward_and_backward_together_on_a_training_graph() -> None:
    g = _training_like()
    problem = PlacementProblem.build(g, load_cluster("colocrl-4gpu"), max_groups=64)
    for name in _all_placers():
        result = run_placer(name, problem, 0.05, seed=0)
        assert split_strict_class(g, result.op_devices) is None, name
        if name in ("pipeline", "expert", "single"):  # whole by construction: nothing moved
            assert result.stats["strict_ops_moved"] == 0, name
    # without the mark the same classes are only preferences, and a placer splits them
    classes = strict_classes(g)
    g.meta["strict_colocation"] = False
    loose = PlacementProblem.build(g, load_cluster("colocrl-4gpu"), max_groups=64)
    assert any(
        split_strict_class(g, run_placer(name, loose, 0.05, seed=0).op_devices, classes)
        for name in ("round_robin", "m_etf", "metis")
    )


def test_the_pipeline_local_search_moves_strict_classes_whole() -> None:
    """Under the throughput objective the pipeline DP's plan is improved by moving groups;
    a move takes every group a strict class ties to it, so nothing needs repairing."""
    g = _training_like(12)
    problem = PlacementProblem.build(
        g, load_cluster("colocrl-4gpu"), objective="throughput", max_groups=64
    )
    result = run_placer("pipeline", problem, 1.0, seed=0)
    assert result.stats["local_search"]["evaluations"] > 1
    assert result.stats["strict_ops_moved"] == 0
    assert split_strict_class(g, result.op_devices) is None


def test_plan_validation_refuses_a_split_class(tmp_path: Path, capsys) -> None:
    g = _training_like(2)
    save_graph(g, tmp_path / "g.json")
    plan = Plan.for_graph(g, "colocrl-2gpu", {"b0": "gpu1"}, default_device="gpu0")
    save_plan(plan, tmp_path / "p.json")
    with pytest.raises(PlanError, match="splits strict co-location class 'layer0'"):
        plan.device_indices(g, {"cpu0": 0, "gpu0": 1, "gpu1": 2}, "colocrl-2gpu", "p.json")
    code = main(["simulate", "--graph", str(tmp_path / "g.json"), "--cluster", "colocrl-2gpu",
                 "--plan", str(tmp_path / "p.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "'b0' on gpu1" in err and "'f0' is on gpu0" in err


@pytest.mark.parametrize(
    ("mark", "words"),
    [("yes", "must be true, false or a list"), (["layer0", "nope"], "'nope', which no op")],
)
def test_a_bad_strict_mark_is_one_sentence(mark, words) -> None:
    data = graph_to_dict(_training_like(2))
    data["meta"]["strict_colocation"] = mark
    with pytest.raises(GraphError, match=words):
        graph_from_dict(json.loads(json.dumps(data)), "g.json")
    data["meta"]["strict_colocation"] = ["layer1"]  # per key: only that class is strict
    assert list(strict_classes(graph_from_dict(data, "g.json"))) == ["layer1"]
