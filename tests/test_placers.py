"""Every registered placer on every reference workload and three clusters; `meshplace plan`.

The learned placers (family ``learned``) run on the same grid in test_placers_learned.py,
so pytest-xdist's ``--dist loadfile`` can put the two halves on different workers; their
determinism and resume are tested in test_learn*.py."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from meshplace import models
from meshplace.cli import main
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import PlacementProblem, PlacerError, registry, run_placer
from meshplace.plan.placement import load_plan

WORKLOADS = list(models.available())
CLUSTERS = ["colocrl-4gpu", "dgx-h100", "h2-8xv100"]  # the last: 16 GPUs on 2 hosts
BUDGET_S = 2.0


def _not_learned() -> list[str]:
    return [name for name, spec in registry().items() if spec.family != "learned"]


@functools.cache
def _graph(name: str) -> OpGraph:
    return workload_graph(name)


@functools.cache
def _cluster(name: str):
    return load_cluster(name)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_placer_returns_a_valid_plan_within_budget(workload: str, cluster: str) -> None:
    problem = PlacementProblem.build(_graph(workload), _cluster(cluster))
    for name in _not_learned():
        result = run_placer(name, problem, BUDGET_S, seed=0)
        devices = result.op_devices
        assert devices.shape == (problem.graph.num_ops,), name
        assert devices.min() >= 0 and devices.max() < problem.num_devices, name
        assert result.search_time_s <= 1.1 * BUDGET_S, (name, result.search_time_s)
        assert result.step_time_s >= problem.simulator.lower_bound() * (1 - 1e-9), name
        again = run_placer(name, problem, BUDGET_S, seed=0)
        # anneal reproduces its plan unless an overloaded machine stops it at its
        # wall-clock deadline, which it reports.
        if not (result.stats.get("stopped_at_deadline") or again.stats.get("stopped_at_deadline")):
            assert np.array_equal(devices, again.op_devices), (name, "not deterministic")


@pytest.mark.parametrize("workload", ["dmcca", "rnnlm", "resnet50"])
def test_placers_are_deterministic_for_a_seed(workload: str) -> None:
    problem = PlacementProblem.build(_graph(workload), _cluster("colocrl-4gpu"))
    for name in _not_learned():
        first = run_placer(name, problem, 2 * BUDGET_S, seed=3)
        again = run_placer(name, problem, 2 * BUDGET_S, seed=3)
        # anneal is reproducible unless a machine far slower than assumed stops it at the
        # wall-clock deadline; it says so in its stats.
        if first.stats.get("stopped_at_deadline") or again.stats.get("stopped_at_deadline"):
            continue
        assert np.array_equal(first.op_devices, again.op_devices), name


@pytest.mark.parametrize("workload", ["dmcca", "nmt", "inception_v3"])
def test_anneal_never_returns_a_plan_worse_than_its_seed(workload: str) -> None:
    problem = PlacementProblem.build(_graph(workload), _cluster("colocrl-4gpu"))
    result = run_placer("anneal", problem, BUDGET_S, seed=1)
    assert result.stats["best_score_s"] <= result.stats["seed_score_s"]
    assert problem.score(result.sim) == pytest.approx(result.stats["best_score_s"])
    seed = run_placer(result.stats["seed_placer"], problem, BUDGET_S, seed=1)
    assert problem.score(result.sim) <= problem.score(seed.sim) * (1 + 1e-12)


def test_expert_places_rnn_layers_one_per_gpu_and_embeddings_on_the_cpu() -> None:
    problem = PlacementProblem.build(_graph("nmt"), _cluster("colocrl-4gpu"))
    result = run_placer("expert", problem, BUDGET_S, seed=0)
    names = problem.device_names
    where: dict[str, set[str]] = {}
    for o, d in zip(problem.graph.ops, result.op_devices.tolist()):
        if o.phase == "forward" and o.kind not in ("parameter", "buffer", "input"):
            where.setdefault(o.module.split(".fw")[0].split(".bw")[0], set()).add(names[d])
    assert where["encoder.lstm.0"] == {"gpu0"}
    assert where["encoder.lstm.1"] == {"gpu1"}
    assert where["decoder.lstm.0"] == {"gpu2"}
    assert where["decoder.lstm.1"] == {"gpu3"}
    assert where["decoder.attention"] == {"gpu3"}
    assert where["decoder.softmax"] == {"gpu3"}
    assert where["encoder.embedding"] == {"cpu0"}
    # Backward ops follow their forward op.
    for o, d in zip(problem.graph.ops, result.op_devices.tolist()):
        if o.forward_op is not None:
            assert d == result.op_devices[problem.graph.index(o.forward_op)]


def test_a_model_that_fits_no_device_is_one_sentence(capsys, tmp_path) -> None:
    g = OpGraph("huge")
    g.add_op(Op("w", "parameter", param_bytes=10 * 2**40, output_shapes=[[1]]))
    g.add_op(Op("mm", "matmul", flops=1e9))
    g.add_edge("w", "mm", 4)
    from meshplace.graph.io import save_graph

    path = tmp_path / "huge.json"
    save_graph(g, path)
    code = main(["plan", str(path), "--cluster", "colocrl-4gpu", "--placer", "single"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fits no device" in err and "largest device has" in err
    assert "'g0:" in err  # names the group
    assert err.count("\n") == 1


def test_an_empty_graph_has_nothing_to_place() -> None:
    with pytest.raises(PlacerError, match="has no ops to place"):
        PlacementProblem.build(OpGraph("empty"), _cluster("colocrl-2gpu"))


def test_unknown_placer_lists_the_known_ones(capsys) -> None:
    code = main(["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "gurobi"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown placer 'gurobi'" in err
    for name in ("single", "expert", "anneal"):
        assert name in err
    with pytest.raises(PlacerError, match="time budget must be positive"):
        run_placer(
            "single", PlacementProblem.build(_graph("dmcca"), _cluster("colocrl-2gpu")), 0, 0
        )


def test_plan_command_json_and_best_plan(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    result_file = tmp_path / "result.json"
    code = main(
        [
            "plan",
            "dmcca",
            "--cluster",
            "colocrl-4gpu",
            "--placer",
            "round_robin,anneal",
            "--budget",
            "2",
            "--out",
            str(out),
            "--result",
            str(result_file),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lower_bound_s"] > 0
    placers = [r["placer"] for r in report["results"]]
    assert placers == ["round_robin", "anneal", "single", "expert"]
    for r in report["results"]:
        assert {"placer", "step_time_s", "oom", "search_time_s", "evaluations"} <= set(r)
    best = min((r for r in report["results"] if not r["oom"]), key=lambda r: r["step_time_s"])
    assert report["best"] == best["placer"]
    plan = load_plan(out)
    assert plan.meta["placer"] == best["placer"]
    assert len(plan.device_names(_graph("dmcca"))) == _graph("dmcca").num_ops
    assert json.loads(result_file.read_text())["best"] == report["best"]
    # The written plan simulates to the reported time.
    code = main(
        ["simulate", "--graph", "dmcca", "--cluster", "colocrl-4gpu", "--plan", str(out), "--json"]
    )
    assert code == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-12)
