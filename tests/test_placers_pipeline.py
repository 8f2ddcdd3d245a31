"""The pipeline placer: its DP is optimal (equals brute force) and its plans are valid."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import pipeline
from meshplace.placers.base import OpAssignment, PlacementProblem, run_placer
from meshplace.placers.baselines import accelerators
from meshplace.placers.colocate import complete_placement

WORKLOADS = ["dmcca", "rnnlm", "resnet50"]


# ------------------------------------------------------------------ brute force
def _splits(n: int, max_stages: int):
    """Every split of units 0..n-1 into 1..max_stages non-empty contiguous stages."""
    for m in range(1, min(max_stages, n) + 1):
        for cuts in itertools.combinations(range(1, n), m - 1):
            yield [0, *cuts, n]


def _split_cost(bounds, stage_cost) -> float:
    return max(stage_cost(j, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1))


def _brute_force(n: int, max_stages: int, stage_cost) -> float:
    return min((_split_cost(b, stage_cost) for b in _splits(n, max_stages)), default=np.inf)


def _check_optimal(result: tuple[float, list[int]], n: int, stages: int, stage_cost) -> None:
    bottleneck, bounds = result
    expected = _brute_force(n, stages, stage_cost)
    if np.isinf(expected):
        assert np.isinf(bottleneck) and bounds == []
        return
    assert bottleneck == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # The returned split is a valid split that achieves the bottleneck.
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) - 1 <= stages
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert _split_cost(bounds, stage_cost) == pytest.approx(bottleneck, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------- the DP is optimal
# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 7),
    stages=st.integers(1, 4),
    per_stage=st.booleans(),
    with_memory=st.booleans(),
    occupied=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_dp_equals_brute_force_on_random_costs(
    n: int, stages: int, per_stage: bool, with_memory: bool, occupied: bool, seed: int
) -> None:
    """Arbitrary unit loads (per stage device or shared), arbitrary receive costs per
    (stage, first unit, end unit), memory limits that sometimes make splits infeasible, and
    (``occupied``) transfer time that the stage's device spends itself, added to its
    compute."""
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 20, (stages, n) if per_stage else n).astype(float)
    comm = rng.random((stages, n + 1, n + 1)) * 30.0 * (rng.random((stages, n + 1, n + 1)) < 0.6)
    memory = rng.integers(0, 10, n).astype(float) if with_memory else None
    caps = rng.integers(5, 30, stages).astype(float) if with_memory else None
    busy = rng.random((stages, n + 1, n + 1)) * 10.0 if occupied else None
    loads2d = np.broadcast_to(loads, (stages, n))

    def stage_cost(j: int, a: int, b: int) -> float:
        if memory is not None and memory[a:b].sum() > caps[j]:
            return np.inf
        own = float(busy[j, a, b]) if busy is not None else 0.0
        return max(float(loads2d[j, a:b].sum()) + own, float(comm[j, a, b]))

    result = pipeline.best_contiguous_split(loads, comm, stages, memory, caps, busy)
    _check_optimal(result, n, stages, stage_cost)
    # A callable per stage gives the same answer as the array.
    by_stage = None if busy is None else (lambda j: busy[j])
    assert pipeline.best_contiguous_split(
        loads, lambda j: comm[j], stages, memory, caps, by_stage
    ) == (result)


# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 8),
    stages=st.integers(1, 4),
    shape=st.sampled_from(["chain", "dag"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dp_equals_brute_force_on_chains_and_dags(
    n: int, stages: int, shape: str, seed: int
) -> None:
    """Stage costs built the way the placer builds them — bytes received from earlier
    stages (activations) and later ones (gradients) over per-stage links — against a brute
    force that sums the crossing edges of each split directly."""
    rng = np.random.default_rng(seed)
    m = np.zeros((n, n))
    if shape == "chain":
        for u in range(n - 1):
            m[u, u + 1] = rng.integers(0, 100)
            m[u + 1, u] = rng.integers(0, 100) * (rng.random() < 0.5)  # its gradient
    else:
        mask = rng.random((n, n)) < 0.4
        m = rng.integers(1, 100, (n, n)) * mask
        np.fill_diagonal(m, 0)
    m = m.astype(float)
    loads = rng.integers(0, 50, n).astype(float)
    lat_in, per_in = rng.random(stages), rng.random(stages)
    lat_back, per_back = rng.random(stages), rng.random(stages)
    forward, backward = pipeline.receive_bytes(m)

    def comm(j: int) -> np.ndarray:
        return np.maximum(
            pipeline.link_time(forward, lat_in[j], per_in[j]),
            pipeline.link_time(backward, lat_back[j], per_back[j]),
        )

    def stage_cost(j: int, a: int, b: int) -> float:
        fwd = sum(m[u, v] for u in range(a) for v in range(a, b))
        bwd = sum(m[u, v] for u in range(b, n) for v in range(a, b))
        t_in = lat_in[j] + fwd * per_in[j] if fwd > 0 else 0.0
        t_back = lat_back[j] + bwd * per_back[j] if bwd > 0 else 0.0
        return max(float(loads[a:b].sum()), t_in, t_back)

    _check_optimal(pipeline.best_contiguous_split(loads, comm, stages), n, stages, stage_cost)


def test_dp_edge_cases() -> None:
    assert pipeline.best_contiguous_split(np.zeros(0), None, 3) == (0.0, [0, 0])
    # One stage only: everything on it.
    assert pipeline.best_contiguous_split(np.array([1.0, 2.0]), None, 1) == (3.0, [0, 2])
    # Ties prefer fewer stages: a free second stage does not help a single heavy unit.
    assert pipeline.best_contiguous_split(np.array([5.0]), None, 4) == (5.0, [0, 1])
    # Nothing fits: no split.
    split = pipeline.best_contiguous_split(
        np.ones(2), None, 2, memory=np.array([3.0, 3.0]), capacities=np.array([2.0, 2.0])
    )
    assert split == (float("inf"), [])
    with pytest.raises(ValueError):
        pipeline.best_contiguous_split(np.ones(2), None, 0)


def test_chunks_are_contiguous_and_balanced() -> None:
    times = np.random.default_rng(0).random(1000)
    chunks = pipeline.chunk_units(times, 50)
    assert chunks[0] == 0 and np.all(np.diff(chunks) >= 0) and np.all(np.diff(chunks) <= 1)
    assert chunks.max() + 1 <= 50
    per_chunk = np.bincount(chunks, weights=times)
    assert per_chunk.max() < 3 * times.sum() / 50


# ---------------------------------------------------------------- the placer
@pytest.fixture(scope="module")
def problems() -> dict[str, PlacementProblem]:
    cluster = load_cluster("colocrl-4gpu")
    return {w: PlacementProblem.build(workload_graph(w), cluster) for w in WORKLOADS}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_valid_deterministic_fast(problems, workload: str) -> None:
    problem = problems[workload]
    first = run_placer("pipeline", problem, budget_s=2.0, seed=0)
    again = run_placer("pipeline", problem, budget_s=2.0, seed=3)
    assert first.op_devices.shape == (problem.graph.num_ops,)
    assert np.array_equal(first.sim.placement, first.op_devices)
    assert np.array_equal(first.op_devices, again.op_devices)
    # Fast as fixed work: no simulations, and a budget a thousand times smaller gives the
    # same plan (how fast in seconds: benchmarks/budgets.py).
    assert first.evaluations == 0
    tiny = run_placer("pipeline", problem, budget_s=2e-3, seed=0)
    assert np.array_equal(tiny.op_devices, first.op_devices)
    assert not first.oom and first.stats["fits"]
    stats = first.stats
    assert set(first.op_devices.tolist()) <= set(accelerators(problem))
    assert 1 <= stats["stages"] <= 4 and stats["micro_batches"] == 4 * stats["stages"]
    # The DP's stage loads are exactly what the simulator sees each device busy with:
    # attribution to forward units matches complete_placement.
    for stage in stats["stage_detail"]:
        busy = first.sim.busy_s[problem.device_names.index(stage["device"])]
        assert busy == pytest.approx(stage["compute_s"], rel=1e-9)
    assert stats["bottleneck_s"] <= first.sim.throughput_time_s * (1 + 1e-9)


@pytest.mark.parametrize("workload", ["dmcca", "resnet50"])
@pytest.mark.parametrize("share", [0.3, 0.15])
def test_respects_memory(problems, workload: str, share: float) -> None:
    base = problems[workload]
    problem = PlacementProblem(
        base.graph, base.cluster, grouping=base.grouping, simulator=base.simulator
    )
    cap = max(share * base.group_memory.sum(), 1.02 * base.group_memory.max())
    for d in accelerators(problem):
        problem.device_memory[d] = cap
    plan, stats = pipeline.place_pipeline(problem, 2.0, 0)
    assert isinstance(plan, OpAssignment) and stats["fits"]
    load = np.bincount(plan.devices, weights=problem.op_memory, minlength=problem.num_devices)
    assert np.all(load <= problem.device_memory)
    if share * 4 < 1:  # the GPUs cannot hold the model: the CPU takes the end of it
        assert 0 in set(plan.devices.tolist())


def test_chain_gets_one_op_per_gpu() -> None:
    g = OpGraph("chain")
    for i in range(4):
        g.add_op(Op(f"op{i}", "matmul", flops=1e10))
    for i in range(3):
        g.add_edge(f"op{i}", f"op{i + 1}", 1e3)
    problem = PlacementProblem.build(g, load_cluster("colocrl-4gpu"))
    plan, stats = pipeline.place_pipeline(problem, 2.0, 0)
    assert [problem.device_names[d] for d in plan.devices] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert stats["stages"] == 4


def test_attribution_matches_complete_placement(problems) -> None:
    problem = problems["rnnlm"]
    units = pipeline.forward_units(problem)
    partial = np.full(problem.graph.num_ops, -1)
    colours = np.arange(len(units.ops)) % 3 + 1
    partial[units.ops] = colours
    assert np.array_equal(
        complete_placement(problem.graph, partial, default=1), colours[units.unit_of_op]
    )


@pytest.mark.parametrize("transfer_share", [0.0, 0.7])
def test_where_transfers_occupy_the_devices_the_dp_charges_them_as_the_simulator_does(
    transfer_share: float,
) -> None:
    """A chain of 4 equal ops on GPUs without copy engines: each stage's cost is its
    compute plus what it sends and receives, equal to the simulator's busiest device.
    With activations that take 0.7 of the whole chain's compute to send, splitting pays
    only where transfers overlap compute."""

    def chain(nbytes: float) -> OpGraph:
        g = OpGraph("chain")
        for i in range(4):
            g.add_op(Op(f"op{i}", "matmul", flops=1e10))
        for i in range(3):
            g.add_edge(f"op{i}", f"op{i + 1}", nbytes)
        return g

    cluster = load_cluster("colocrl-4gpu")
    one_op = PlacementProblem.build(chain(0.0), cluster).group_time[1].sum() / 4
    seconds_per_byte = cluster.transfer_time("gpu0", "gpu1", 1e9) / 1e9
    g = chain(max(transfer_share * 4 * one_op / seconds_per_byte, 1e3))
    problem = PlacementProblem.build(g, cluster.with_transfers("occupy"), objective="throughput")
    plan, stats = pipeline.place_pipeline(problem, 2.0, 0)
    simulated = problem.simulator.simulate(plan.devices, "throughput")
    assert stats["bottleneck_s"] == pytest.approx(simulated.busy_s.max(), rel=1e-9)
    _, free = pipeline.place_pipeline(PlacementProblem.build(g, cluster, "throughput"), 2.0, 0)
    assert stats["bottleneck_s"] >= free["bottleneck_s"]
    if transfer_share:
        assert stats["stages"] == 1 and free["stages"] > 1
    else:
        assert stats["stages"] == free["stages"] == 4
