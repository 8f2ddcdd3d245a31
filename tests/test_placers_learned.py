"""Every learned placer (``rl``, ``hrl``, ``gnn``...) on every reference workload and three
clusters: a valid plan within the budget, never below the lower bound.

The other half of test_placers.py's grid, in its own file so that pytest-xdist's
``--dist loadfile`` runs the two halves on different workers. Each placer runs once per
problem; determinism, checkpoints and resume are tested in test_learn*.py.
"""

from __future__ import annotations

import functools

import pytest

from meshplace import models
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import PlacementProblem, registry, run_placer

WORKLOADS = list(models.available())
CLUSTERS = ["colocrl-4gpu", "dgx-h100", "h2-8xv100"]  # the last: 16 GPUs on 2 hosts
BUDGET_S = 2.0


def _learned() -> list[str]:
    return [name for name, spec in registry().items() if spec.family == "learned"]


@functools.cache
def _graph(name: str):
    return workload_graph(name)


@functools.cache
def _warm() -> None:
    """One untimed run of each learned placer on a small problem first: numba compiles
    ``gnn``'s decoder once per installation, which is not search time."""
    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    for name in _learned():
        run_placer(name, problem, 0.5, seed=0)


def test_the_learned_placers_are_registered() -> None:
    assert {"rl", "hrl", "gnn"} <= set(_learned())


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_learned_placer_returns_a_valid_plan_within_budget(
    workload: str, cluster: str
) -> None:
    _warm()
    problem = PlacementProblem.build(_graph(workload), load_cluster(cluster))
    for name in _learned():
        result = run_placer(name, problem, BUDGET_S, seed=0)
        devices = result.op_devices
        assert devices.shape == (problem.graph.num_ops,), name
        assert devices.min() >= 0 and devices.max() < problem.num_devices, name
        assert result.search_time_s <= 1.1 * BUDGET_S, (name, result.search_time_s)
        assert result.step_time_s >= problem.simulator.lower_bound() * (1 - 1e-9), name
        assert result.stats["learning_curve"]["evaluations"], name
