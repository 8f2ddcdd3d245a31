"""List-scheduling placers (m-TOPO, m-ETF, m-SCT, HEFT, CPOP): valid, deterministic,
memory-aware and fast on the reference workloads; the textbook behaviours on toy DAGs; the
SCT linear program; and schedule invariants on random DAGs."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.graph.groups import Grouping
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import listsched as ls
from meshplace.placers.base import PlacementProblem, registry, run_placer
from meshplace.placers.baselines import accelerators

from .strategies import random_dags

PLACERS = ["m_topo", "m_etf", "m_sct", "heft", "cpop"]
WORKLOADS = ["dmcca", "rnnlm", "resnet50"]
CLUSTERS = ["colocrl-4gpu", "dgx-h100", "h2-8xa100"]


@functools.cache
def _cluster(name: str):
    return load_cluster(name)


@functools.cache
def _graph(name: str) -> OpGraph:
    return workload_graph(name)


@functools.cache
def _problem(workload: str, cluster: str) -> PlacementProblem:
    return PlacementProblem.build(_graph(workload), _cluster(cluster))


def _fresh(workload: str, cluster: str) -> PlacementProblem:
    """A copy of a cached problem whose ``device_memory`` a test may change."""
    base = _problem(workload, cluster)
    return PlacementProblem(
        base.graph, base.cluster, grouping=base.grouping, simulator=base.simulator
    )


def _toy(ops: list[tuple[str, float]], edges: list[tuple[str, str, float]]) -> PlacementProblem:
    """One group per op (no merging), on the 2-GPU ColocRL machine (1 CPU + 2 K80)."""
    g = OpGraph("toy")
    for name, flops in ops:
        g.add_op(Op(name, "matmul", flops=flops))
    for a, b, nbytes in edges:
        g.add_edge(a, b, nbytes)
    grouping = Grouping(g, np.arange(g.num_ops, dtype=np.int64), [n for n, _ in ops])
    return PlacementProblem(g, _cluster("colocrl-2gpu"), grouping=grouping)


def test_the_placers_are_registered_as_list_scheduling() -> None:
    specs = registry()
    for name in PLACERS:
        assert specs[name].family == "list scheduling"
        assert specs[name].source and specs[name].description
        assert not specs[name].uses_budget


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("placer", PLACERS)
def test_valid_deterministic_fitting_and_fast(placer: str, workload: str, cluster: str) -> None:
    p = _problem(workload, cluster)
    r = run_placer(placer, p, budget_s=5.0, seed=0)
    # Fast as fixed work: no simulations, and the budget is ignored (a tiny one gives the
    # same plan below); how fast in seconds: benchmarks/budgets.py.
    assert r.evaluations == 0
    # The placer's own plan at a budget 1,000x smaller: it is the plan run_placer reported
    # at 5 s (every group holds an op, so expanded plans are equal only if the group plans
    # are), so the one comparison checks both that run_placer reports the placer's plan
    # and that the budget changes nothing, without running the placer a third time.
    devices, stats = registry()[placer].fn(p, 5e-3, 0)
    assert devices.shape == (p.num_groups,)
    assert np.issubdtype(devices.dtype, np.integer)
    assert devices.min() >= 0 and devices.max() < p.num_devices
    assert np.all(np.bincount(p.group_of, minlength=p.num_groups) > 0)
    np.testing.assert_array_equal(p.expand(devices), r.op_devices)
    assert stats["schedule_makespan_s"] == r.stats["schedule_makespan_s"]
    # Memory is plentiful here: every plan fits, on accelerators only.
    assert p.fits(devices) and not r.oom
    assert set(devices.tolist()) <= set(accelerators(p))
    assert r.stats["memory_fallbacks"] == 0  # (r.stats: the placer's stats at 5 s)
    if placer == "m_sct":
        assert r.stats["lp_status"] == "optimal"


@pytest.mark.parametrize("placer", PLACERS)
def test_tight_memory_spreads_the_model_and_still_fits(placer: str) -> None:
    p = _fresh("resnet50", "colocrl-4gpu")
    acc = accelerators(p)
    total = p.group_memory.sum()
    assert p.group_memory.max() < 0.3 * total
    p.device_memory[acc] = 0.3 * total  # four GPUs hold 1.2x the model between them
    devices, _ = registry()[placer].fn(p, 1.0, 0)
    assert p.fits(devices)
    assert len(set(devices.tolist()) & set(acc)) >= 4


@pytest.mark.parametrize("placer", PLACERS)
def test_the_cpu_is_used_only_when_the_accelerators_are_full(placer: str) -> None:
    p = _fresh("resnet50", "colocrl-4gpu")
    acc = accelerators(p)
    cpu = [d for d in range(p.num_devices) if d not in acc]
    p.device_memory[acc] = 0.15 * p.group_memory.sum()  # GPUs hold 60 % of the model
    devices, stats = registry()[placer].fn(p, 1.0, 0)
    assert p.fits(devices)
    assert set(devices.tolist()) & set(cpu)
    assert stats["memory_fallbacks"] > 0


def test_memory_rule_prefers_fitting_accelerators_then_any_fit_then_most_free() -> None:
    free = np.array([100.0, 1.0, 3.0])
    is_acc = np.array([False, True, True])
    runs = np.ones((4, 3), dtype=bool)
    mask = ls._eligible(free, np.array([0.5, 2.0, 50.0, 1000.0]), is_acc, runs)
    assert mask.tolist() == [
        [False, True, True],  # fits both GPUs
        [False, False, True],  # fits one GPU
        [True, False, False],  # fits no GPU: the CPU
        [True, False, False],  # fits nowhere: the device with most free memory
    ]
    # only where the group can run at all (Op.unsupported)
    runs[0, 2] = runs[3, 0] = False
    mask = ls._eligible(free, np.array([0.5, 2.0, 50.0, 1000.0]), is_acc, runs)
    assert mask[0].tolist() == [False, True, False]
    assert mask[3].tolist() == [False, False, True]  # the most free memory where it runs


CHAIN = [(f"op{i}", 1e12) for i in range(6)]
CHAIN_EDGES = [(f"op{i}", f"op{i + 1}", 1e10) for i in range(5)]


@pytest.mark.parametrize("placer", ["heft", "m_etf", "m_sct", "cpop"])
def test_a_chain_with_costly_transfers_stays_on_one_device(placer: str) -> None:
    p = _toy(CHAIN, CHAIN_EDGES)
    devices, stats = registry()[placer].fn(p, 1.0, 0)
    assert len(set(devices.tolist())) == 1
    assert devices[0] in accelerators(p)
    assert stats["schedule_makespan_s"] == pytest.approx(p.group_time[devices[0]].sum())


BRANCHES = [(f"{b}{i}", 1e12) for i in range(3) for b in "ab"]
BRANCH_EDGES = [(f"{b}{i}", f"{b}{i + 1}", 1e6) for b in "ab" for i in range(2)]


@pytest.mark.parametrize("placer", PLACERS)
def test_two_independent_heavy_branches_use_both_gpus(placer: str) -> None:
    p = _toy(BRANCHES, BRANCH_EDGES)
    devices, _ = registry()[placer].fn(p, 1.0, 0)
    assert set(devices.tolist()) == set(accelerators(p))
    if placer in ("heft", "m_etf", "m_sct"):  # and each branch stays whole
        names = p.grouping.names
        dev = {n: int(d) for n, d in zip(names, devices.tolist())}
        assert len({dev[f"a{i}"] for i in range(3)}) == 1
        assert len({dev[f"b{i}"] for i in range(3)}) == 1
        assert dev["a0"] != dev["b0"]


DIAMOND = [("a", 1e11), ("b", 3e11), ("c", 1e11), ("d", 1e11), ("e", 2e11)]
DIAMOND_EDGES = [
    ("a", "b", 1e8),
    ("a", "c", 5e8),
    ("b", "d", 1e8),
    ("c", "d", 2e8),
    ("a", "e", 1e7),
    ("e", "d", 1e7),
]


def test_sct_lp_solves_with_favourite_values_in_the_unit_interval() -> None:
    p = _toy(DIAMOND, DIAMOND_EDGES)
    costs = ls._Costs(p)
    status, x, makespan, _ = ls.favourite_lp(costs)
    assert status == "optimal"
    assert x.shape == (len(DIAMOND_EDGES),)
    assert np.all((x >= 0) & (x <= 1))
    # The LP drops processor limits, so it is at most the one-device schedule.
    assert 0 < makespan <= p.group_time[accelerators(p)[0]].sum() * (1 + 1e-6)
    child, parent = ls._round_favourites(costs, x)
    for i, j in enumerate(child.tolist()):
        if j >= 0:
            assert parent[j] == i
    devices, stats = ls.place_m_sct(p, 1.0, 0)
    assert stats["lp_status"] == "optimal" and "fallback" not in stats
    assert 0 <= stats["lp_x_min"] <= stats["lp_x_max"] <= 1
    assert stats["favourite_edges"] == int(np.count_nonzero(child >= 0))
    assert p.fits(devices)


def test_sct_lp_makes_a_costly_chain_all_favourites() -> None:
    p = _toy(CHAIN, CHAIN_EDGES)
    status, x, makespan, _ = ls.favourite_lp(ls._Costs(p))
    assert status == "optimal"
    np.testing.assert_allclose(x, 1.0, atol=1e-6)
    assert makespan == pytest.approx(ls._Costs(p).mean_time.sum(), rel=1e-6)


def test_m_sct_falls_back_to_m_etf_when_the_lp_fails(monkeypatch) -> None:
    p = _problem("dmcca", "colocrl-4gpu")

    def broken(costs, time_limit_s=1.0):
        raise RuntimeError("no solver")

    monkeypatch.setattr(ls, "favourite_lp", broken)
    devices, stats = ls.place_m_sct(p, 1.0, 0)
    assert stats["fallback"] == "m_etf" and stats["lp_status"].startswith("failed")
    np.testing.assert_array_equal(devices, ls.place_m_etf(p, 1.0, 0)[0])


def test_cpop_puts_the_critical_path_on_one_device() -> None:
    p = _toy(DIAMOND, DIAMOND_EDGES)
    devices, stats = ls.place_cpop(p, 1.0, 0)
    # a -> b -> d is the longest path (the heaviest middle group).
    assert stats["critical_path_groups"] == 3
    names = p.grouping.names
    dev = {n: int(d) for n, d in zip(names, devices.tolist())}
    assert dev["a"] == dev["b"] == dev["d"]
    assert stats["critical_path_device"] == p.device_names[dev["a"]]


# ----------------------------------------------------------------- random DAG invariants
def _sanitised(graph: OpGraph) -> OpGraph:
    for o in graph.ops:
        o.measured_time = {}
        o.output_shapes = [[min(8, s) for s in shape] for shape in o.output_shapes]
        o.flops = float(o.flops % 1e12)
        o.bytes_read = float(o.bytes_read % 1e9)
        o.bytes_written = float(o.bytes_written % 1e9)
    return graph


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    random_dags(max_ops=25, with_keys=False).map(_sanitised),
    st.sampled_from(["colocrl-2gpu", "colocrl-4gpu", "dgx-h100"]),
)
def test_schedules_respect_precedence_communication_and_devices(graph, cluster) -> None:
    p = PlacementProblem.build(graph, _cluster(cluster))
    costs = ls._Costs(p)
    for name, (_, scheduler) in ls._SCHEDULERS.items():
        sched, _ = scheduler(costs)
        dev, start, finish = sched.device, sched.start, sched.finish
        assert dev.shape == (p.num_groups,) and dev.min() >= 0, name
        # finish - start loses the low bits of start when a group starts late (after a long
        # transfer): compare within a few ulps of the schedule's span, not of the duration
        ulps = 8 * np.spacing(float(np.abs(finish).max(initial=0.0)))
        np.testing.assert_allclose(
            finish - start, p.group_time[dev, np.arange(p.num_groups)], rtol=1e-7, atol=ulps
        )
        tol = 1e-9 * max(1.0, float(finish.max(initial=0.0)))
        for e in range(len(costs.edge_bytes)):
            i, j = int(costs.edge_src[e]), int(costs.edge_dst[e])
            comm = 0.0
            if dev[i] != dev[j]:
                comm = (
                    costs.latency[dev[i], dev[j]]
                    + costs.edge_bytes[e] * costs.inv_bw[dev[i], dev[j]]
                )
            assert start[j] + tol >= finish[i] + comm, name
        for d in set(dev.tolist()):
            on = np.flatnonzero(dev == d)
            order = np.lexsort((finish[on], start[on]))
            s, f = start[on][order], finish[on][order]
            assert np.all(s[1:] + tol >= f[:-1]), name
        # Deterministic: the same schedule again.
        again, _ = scheduler(costs)
        np.testing.assert_array_equal(again.device, dev)
        # Memory-aware: if the plan overflows, some group had no device that fit.
        if not p.fits(dev):
            assert sched.fallbacks > 0, name


def test_the_listsched_placers_make_one_pass_on_an_80_device_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quick as fixed work: however many devices, a list scheduler places each group once
    and computes its data-ready times once (O(groups x devices) device scans; seconds on
    the 80-device cluster: benchmarks/budgets.py)."""
    p = PlacementProblem.build(_graph("resnet50"), load_cluster("h8-8xa100"))
    calls: Counter[str] = Counter()
    for method in ("commit", "data_ready"):
        original = getattr(ls._Schedule, method)

        def counted(self, *args, _original=original, _method=method):
            calls[_method] += 1
            return _original(self, *args)

        monkeypatch.setattr(ls._Schedule, method, counted)
    for name in PLACERS:
        calls.clear()
        devices, _ = registry()[name].fn(p, 1.0, 0)
        assert calls["commit"] == p.num_groups, name
        assert calls["data_ready"] <= p.num_groups, name
        assert p.fits(devices)
