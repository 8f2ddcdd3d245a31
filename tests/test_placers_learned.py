"""Every learned placer (``rl``, ``hrl``, ``gnn``...) on every reference workload and three
clusters: a valid plan within the budget (as fixed work: with the placers' clock frozen,
every planned update is made and no deadline cuts a run short on a busy machine), never
below the lower bound.

The other half of test_placers.py's grid, in its own file so that pytest-xdist's
``--dist loadfile`` runs the two halves on different workers. Each placer runs once per
problem; determinism, checkpoints and resume are tested in test_learn*.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pytest

from meshplace import models
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import ManualClock, PlacementProblem, registry, run_placer, use_clock

WORKLOADS = list(models.available())
CLUSTERS = ["colocrl-4gpu", "dgx-h100", "h2-8xv100"]  # the last: 16 GPUs on 2 hosts
BUDGET_S = 0.25  # fixed work: an eighth of the default keeps the grid affordable


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the placers: no deadline stop, so every run is exact work."""
    with use_clock(ManualClock()) as clock:
        yield clock


def _learned() -> list[str]:
    return registry().names(family="learned")


@functools.cache
def _graph(name: str):
    return workload_graph(name)


def test_the_learned_placers_are_registered() -> None:
    assert {"rl", "hrl", "gnn"} <= set(_learned())


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_learned_placer_returns_a_valid_plan_within_budget(
    workload: str, cluster: str
) -> None:
    problem = PlacementProblem.build(_graph(workload), load_cluster(cluster))
    for name in _learned():
        result = run_placer(name, problem, BUDGET_S, seed=0)
        devices = result.op_devices
        assert devices.shape == (problem.graph.num_ops,), name
        # The reported simulation is the simulation of the returned plan.
        assert np.array_equal(result.sim.placement, devices), name
        # Within budget as fixed work: the budget (every planned update, or gnn's fixed
        # zero-shot samples), not a deadline, ended the run.
        stats = result.stats
        assert stats["stopped_by"] == "budget", name
        assert stats.get("updates", 0) == stats.get("planned_updates", 0), name
        assert stats["evaluations"] == result.evaluations > 0, name
        assert result.step_time_s >= problem.simulator.lower_bound() * (1 - 1e-9), name
        # The curve's last point is at most the final greedy plan's simulation short.
        last = stats["learning_curve"]["evaluations"][-1]
        assert result.evaluations - 1 <= last <= result.evaluations, name
