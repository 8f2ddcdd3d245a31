"""The graph-partitioning placers: ``metis`` and ``mincut``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.graph.groups import group_ops
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import partition
from meshplace.placers.base import PlacementProblem, run_placer
from meshplace.placers.baselines import accelerators

PLACERS = ["metis", "mincut"]
WORKLOADS = ["dmcca", "rnnlm", "resnet50"]


@pytest.fixture(scope="module")
def problems() -> dict[str, PlacementProblem]:
    cluster = load_cluster("colocrl-4gpu")
    return {w: PlacementProblem.build(workload_graph(w), cluster) for w in WORKLOADS}


def _shrunk(problem: PlacementProblem, share: float) -> PlacementProblem:
    """The same problem with every GPU holding ``share`` of the model's memory estimate (at
    least its largest group), so a compute-balanced split alone may not fit."""
    shrunk = PlacementProblem(
        problem.graph, problem.cluster, grouping=problem.grouping, simulator=problem.simulator
    )
    cap = max(share * problem.group_memory.sum(), 1.02 * problem.group_memory.max())
    for d in accelerators(problem):
        shrunk.device_memory[d] = cap
    return shrunk


@pytest.mark.parametrize("name", PLACERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_valid_deterministic_fast(problems, name: str, workload: str) -> None:
    problem = problems[workload]
    first = run_placer(name, problem, budget_s=2.0, seed=0)
    again = run_placer(name, problem, budget_s=2.0, seed=0)
    assert first.op_devices.shape == (problem.graph.num_ops,)
    assert np.array_equal(first.sim.placement, first.op_devices)
    assert np.array_equal(first.op_devices, again.op_devices)
    # Fast as fixed work: no simulations, and a budget a thousand times smaller gives the
    # same plan (how fast in seconds: benchmarks/budgets.py).
    assert first.evaluations == 0
    tiny = run_placer(name, problem, budget_s=2e-3, seed=0)
    assert np.array_equal(tiny.op_devices, first.op_devices)
    assert not first.oom and first.stats["fits"]
    # Accelerators only, and more than one of them (every workload here can be split).
    used = set(first.op_devices.tolist())
    assert used <= set(accelerators(problem)) and len(used) > 1


@pytest.mark.parametrize("name", PLACERS)
@pytest.mark.parametrize("workload", ["dmcca", "resnet50"])
def test_respects_memory_when_it_can(problems, name: str, workload: str) -> None:
    problem = _shrunk(problems[workload], 0.3)
    result = run_placer(name, problem, budget_s=2.0, seed=0)
    groups = result.op_devices[np.unique(problem.group_of, return_index=True)[1]]
    assert problem.fits(groups)
    assert result.stats["fits"]


@pytest.mark.parametrize("name", PLACERS)
def test_uses_the_cpu_when_the_gpus_are_full(problems, name: str) -> None:
    problem = _shrunk(problems["resnet50"], 0.15)  # the GPUs hold 60 % of the model
    place = {"metis": partition.place_metis, "mincut": partition.place_mincut}[name]
    groups, stats = place(problem, 2.0, 0)
    assert problem.fits(groups) and stats["fits"]
    assert set(groups.tolist()) & {0}  # cpu0 took what the GPUs could not


def _two_branches(join: bool) -> OpGraph:
    g = OpGraph("branches")
    for b in "ab":
        g.add_op(Op(f"{b}_in", "input", output_shapes=[[1]]))
        for i in range(6):
            g.add_op(Op(f"{b}{i}", "matmul", flops=4e9))
        g.add_edge(f"{b}_in", f"{b}0", 1e3)
        for i in range(5):
            g.add_edge(f"{b}{i}", f"{b}{i + 1}", 4e8)
    if join:
        g.add_op(Op("join", "elementwise", flops=1.0))
        g.add_edge("a5", "join", 1e3)
        g.add_edge("b5", "join", 1e3)
    return g


@pytest.mark.parametrize("join", [False, True])
@pytest.mark.parametrize("name", PLACERS)
def test_independent_branches_go_to_different_gpus(name: str, join: bool) -> None:
    graph = _two_branches(join)
    cluster = load_cluster("colocrl-2gpu")
    # With a join, op-level groups (merging would fold everything into one group).
    grouping = group_ops(graph, None, merge_single_consumer=False) if join else None
    problem = PlacementProblem(graph, cluster, grouping=grouping)
    result = run_placer(name, problem, budget_s=2.0, seed=0)
    dev = {o.name: int(d) for o, d in zip(graph.ops, result.op_devices)}
    a = {dev[f"a{i}"] for i in range(6)}
    b = {dev[f"b{i}"] for i in range(6)}
    assert len(a) == 1 and len(b) == 1 and a != b
    assert a | b == set(accelerators(problem))


def test_metis_seed_changes_nothing_but_its_random_start(problems) -> None:
    problem = problems["resnet50"]
    for seed in (1, 7):
        x, _ = partition.place_metis(problem, 2.0, seed)
        y, _ = partition.place_metis(problem, 2.0, seed)
        assert np.array_equal(x, y)


# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 14),
    density=st.floats(0.1, 1.0),
    fraction=st.sampled_from([0.5, 1 / 3, 2 / 3]),
    seed=st.integers(0, 2**16),
)
def test_fm_bisect_never_worse_than_its_prefix_start(
    n: int, density: float, fraction: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    adj = np.triu(rng.random((n, n)) * (rng.random((n, n)) < density), 1)
    adj = adj + adj.T
    w = rng.integers(1, 10, n).astype(float)
    side = partition.fm_bisect(adj, w, fraction, np.random.default_rng(seed))
    assert set(side.tolist()) <= {0, 1}
    start = partition._prefix_start(w, w.sum() * fraction)

    def cut(s: np.ndarray) -> float:
        return float(adj[s == 0][:, s == 1].sum())

    def imbalance(s: np.ndarray) -> float:
        return abs(w[s == 0].sum() - w.sum() * fraction)

    tolerance = 0.03 * w.sum()
    # The winner is balanced (within 3 %) unless the prefix start could not be ...
    assert imbalance(side) <= max(tolerance, imbalance(start)) + 1e-9
    # ... and, when the refined prefix start is balanced, cuts no more than it, which cuts no
    # more than the start (Fiduccia–Mattheyses keeps only improving prefixes of moves).
    refined = partition._fm_refine(adj, w, start, w.sum() * fraction, tolerance)
    assert cut(refined) <= cut(start) + 1e-9
    if imbalance(refined) <= tolerance:
        assert cut(side) <= cut(refined) + 1e-9


def test_repair_memory_moves_smallest_first(problems) -> None:
    problem = _shrunk(problems["dmcca"], 0.5)
    gpu = accelerators(problem)[0]
    everything = np.full(problem.num_groups, gpu, dtype=np.int64)
    fixed, moved = partition.repair_memory(problem, everything, accelerators(problem))
    assert problem.fits(fixed) and moved > 0
    moved_mem = problem.group_memory[fixed != gpu]
    kept_mem = problem.group_memory[(fixed == gpu) & (problem.group_memory > 0)]
    # Every moved group is no larger than the largest group that stayed.
    assert moved_mem.max() <= kept_mem.max()
