"""Co-location grouping and coarsening always give an acyclic group graph."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.graph import GraphError, Op, OpGraph
from meshplace.graph.groups import group_ops

from .strategies import random_dags


def _is_acyclic_quotient(graph: OpGraph, group_of) -> bool:
    q = nx.DiGraph()
    q.add_nodes_from(set(group_of.tolist()))
    for s, d, _ in graph.edges():
        if group_of[s] != group_of[d]:
            q.add_edge(int(group_of[s]), int(group_of[d]))
    return nx.is_directed_acyclic_graph(q)


# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(max_ops=60), st.one_of(st.none(), st.integers(1, 20)), st.booleans())
def test_group_graph_is_always_acyclic(graph: OpGraph, max_groups, colocate: bool) -> None:
    grouping = group_ops(graph, max_groups, colocate=colocate)
    assert _is_acyclic_quotient(graph, grouping.group_of)
    if max_groups is not None:
        assert grouping.num_groups <= max_groups
    # Every op is in exactly one group and group ids are 0..G-1.
    assert sorted(set(grouping.group_of.tolist())) == list(range(grouping.num_groups))
    gg = grouping.group_graph()
    assert gg.num_ops == grouping.num_groups
    assert gg.total_flops() == pytest.approx(graph.total_flops())
    assert gg.param_bytes() == graph.param_bytes()


# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(max_ops=60))
def test_group_ids_follow_a_topological_order(graph: OpGraph) -> None:
    grouping = group_ops(graph, 8)
    for s, d, _ in graph.edges():
        assert grouping.group_of[s] <= grouping.group_of[d]


def _chain_with_side_input() -> OpGraph:
    g = OpGraph("t")
    for name in ("w", "x", "a", "b", "c", "d"):
        g.add_op(Op(name, "matmul", flops=1.0))
    g.add_edge("x", "a", 1)
    g.add_edge("w", "a", 1)
    g.add_edge("a", "b", 1)
    g.add_edge("w", "d", 1)  # w has two consumers: a and the sink d
    g.add_edge("b", "c", 1)
    return g


def test_single_consumer_ops_join_their_consumer() -> None:
    grouping = group_ops(_chain_with_side_input(), None, colocate=False)
    members = [sorted(grouping.graph.ops[i].name for i in m) for m in grouping.members()]
    # x -> a -> b -> c is a chain of single consumers; w feeds a and d.
    assert ["a", "b", "c", "x"] in members
    assert ["w"] in members
    assert ["d"] in members


def test_colocation_key_merges_when_it_keeps_the_graph_acyclic() -> None:
    g = OpGraph("k")
    for name in ("p", "q", "r"):
        g.add_op(Op(name, "matmul", flops=1.0, colocation="same" if name != "q" else None))
    g.add_edge("p", "q", 1)
    g.add_edge("q", "r", 1)
    g.add_op(Op("s", "matmul", flops=1.0, colocation="other"))
    g.add_op(Op("t", "matmul", flops=1.0, colocation="other"))
    g.add_edge("s", "q", 1)
    g.add_edge("t", "q", 1)
    grouping = group_ops(g, None, merge_single_consumer=False)
    gid = {g.ops[i].name: int(grouping.group_of[i]) for i in range(g.num_ops)}
    # p and r share a key, but p -> q -> r: merging them would close a cycle.
    assert gid["p"] != gid["r"]
    # s and t share a key and no path joins them: they merge.
    assert gid["s"] == gid["t"]


def test_coarsening_reaches_the_requested_count_on_a_wide_graph() -> None:
    g = OpGraph("wide")
    g.add_op(Op("src", "input"))
    g.add_op(Op("sink", "reduction"))
    for i in range(300):
        g.add_op(Op(f"m{i}", "matmul", flops=float(i + 1)))
        g.add_edge("src", f"m{i}", 4)
        g.add_edge(f"m{i}", "sink", 4)
    grouping = group_ops(g, 16)
    assert grouping.num_groups <= 16
    assert _is_acyclic_quotient(g, grouping.group_of)


def test_max_groups_must_be_positive() -> None:
    with pytest.raises(GraphError, match="max_groups must be at least 1"):
        group_ops(_chain_with_side_input(), 0)


@pytest.mark.parametrize("groups", [1, 2, 8, 64, 100, 256])
def test_a_chain_of_measured_layers_keeps_the_choices_it_was_asked_for(groups: int) -> None:
    """A graph profiled elsewhere — 100 layers in a chain, measured times, no FLOPs —
    keeps min(100, groups) groups (ColocRL's merge-into-the-only-consumer rule alone
    leaves one), balanced by measured time."""
    rng = np.random.default_rng(groups)
    g = OpGraph("layers")
    for i in range(100):
        g.add_op(Op(f"layer{i}", "layer", measured_time={"gpu": float(rng.uniform(1, 3))}))
        if i:
            g.add_edge(i - 1, i, 1e6)
    grouping = group_ops(g, max_groups=groups)
    assert grouping.num_groups == min(100, groups)
    time = np.bincount(grouping.group_of, weights=[o.measured_time["gpu"] for o in g.ops])
    assert time.max() <= 2 * time.sum() / grouping.num_groups + 3.0  # + one layer
    assert group_ops(g, max_groups=None).num_groups == 1  # the rule alone


def test_the_measured_time_decides_what_is_heavy() -> None:
    """One slow layer then 50 fast ones: two groups split at the slow layer, whatever the
    FLOPs say."""
    g = OpGraph("slow-first")
    for i in range(51):
        g.add_op(
            Op(
                f"l{i}",
                "layer",
                flops=1e12 if i else 1.0,
                measured_time={"cpu": 50.0 if i == 0 else 1.0},
            )
        )
        if i:
            g.add_edge(i - 1, i, 8)
    grouping = group_ops(g, max_groups=2)
    assert [len(m) for m in grouping.members()] == [1, 50]
