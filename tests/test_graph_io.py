"""The OpGraph IR and its JSON format: round trips and every rejected input."""

from __future__ import annotations

import json
import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings

from meshplace.graph import GraphError, Op, OpGraph, graph_from_json, graph_to_json
from meshplace.graph.io import graph_from_dict, load_graph, save_graph

from .strategies import random_dags


def _doc(**overrides):
    doc = {
        "format": "meshplace.opgraph",
        "version": 1,
        "name": "g",
        "ops": [
            {"name": "x", "kind": "input", "output_shapes": [[4, 8]]},
            {"name": "mm", "kind": "matmul", "flops": 512.0, "measured_time": {"k80": 1e-4}},
            {"name": "relu", "kind": "elementwise", "flops": 32},
        ],
        "edges": [
            {"src": "x", "dst": "mm", "bytes": 128},
            {"src": "mm", "dst": "relu", "bytes": 128},
        ],
    }
    doc.update(overrides)
    return doc


def test_hand_written_graph_without_torch_loads() -> None:
    g = graph_from_dict(_doc())
    assert g.num_ops == 3 and g.num_edges == 2
    assert g.op("mm").measured_time == {"k80": 1e-4}
    assert g.total_flops() == 544.0
    arrays = g.arrays()
    assert arrays.topo_order.tolist() == [0, 1, 2]
    assert arrays.succ_idx[arrays.succ_ptr[0] : arrays.succ_ptr[1]].tolist() == [1]


def test_networkx_conversion_keeps_ops_and_bytes() -> None:
    g = graph_from_dict(_doc())
    nxg = g.to_networkx()
    assert nx.is_directed_acyclic_graph(nxg)
    assert nxg.edges["x", "mm"]["bytes"] == 128
    assert nxg.nodes["mm"]["op"].flops == 512.0


def test_file_round_trip_is_exact(tmp_path) -> None:
    g = graph_from_dict(_doc())
    path = tmp_path / "g.json"
    save_graph(g, path)
    assert load_graph(path) == g
    assert graph_to_json(load_graph(path)) == graph_to_json(g)


@settings(max_examples=60, deadline=None)
@given(random_dags())
def test_json_round_trips_exactly(graph: OpGraph) -> None:
    text = graph_to_json(graph)
    again = graph_from_json(text)
    assert again == graph
    assert graph_to_json(again) == text


def _op(**kw):
    base = {"name": "mm", "kind": "matmul"}
    base.update(kw)
    return base


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            _doc(edges=[{"src": "x", "dst": "mm"}, {"src": "mm", "dst": "x"}]),
            "has a cycle: ",
        ),
        (_doc(edges=[{"src": "x", "dst": "ghost", "bytes": 1}]), "names op 'ghost'"),
        (
            _doc(ops=[{"name": "a", "kind": "x"}, {"name": "a", "kind": "y"}], edges=[]),
            "duplicate op name 'a'",
        ),
        (_doc(ops=[_op(flops=-1)], edges=[]), "op 'mm' field 'flops'"),
        (_doc(ops=[_op(flops=math.nan)], edges=[]), "op 'mm' field 'flops'"),
        (_doc(ops=[_op(bytes_read=math.inf)], edges=[]), "op 'mm' field 'bytes_read'"),
        (
            _doc(ops=[_op(measured_time={"k80": -2.0})], edges=[]),
            "op 'mm' field 'measured_time.k80'",
        ),
        (_doc(ops=[_op(colour="red")], edges=[]), "op 'mm' has unknown field 'colour'"),
        (_doc(extra=1), "the graph has unknown field 'extra'"),
        (
            _doc(edges=[{"src": "x", "dst": "mm", "bytes": 1, "weight": 2}]),
            "edge 0 has unknown field 'weight'",
        ),
        (_doc(edges=[{"src": "x", "dst": "mm", "bytes": -5}]), "edge 0 field 'bytes'"),
        (_doc(ops=[_op(phase="sideways")], edges=[]), "op 'mm' field 'phase'"),
        (_doc(ops=[{"name": "mm"}], edges=[]), "op 'mm' is missing the required field 'kind'"),
        (_doc(format="onnx"), "not a meshplace graph"),
        (_doc(version=7), "unsupported graph format version 7"),
        (
            _doc(ops=[_op(output_shapes=[[2]], output_dtypes=["float33"])], edges=[]),
            "unknown dtype 'float33'",
        ),
        (_doc(ops=[_op(forward_op="nope")], edges=[]), "field 'forward_op' names op 'nope'"),
        (
            _doc(ops=[_op(output_shapes=[[2, 3]], dim_names=[["batch"]])], edges=[]),
            "gives 1 names for a 2-dimensional output",
        ),
        (_doc(edges=[{"src": "mm", "dst": "mm"}]), "connects op 'mm' to itself"),
    ],
)
def test_bad_graphs_are_rejected_with_one_sentence(doc, expected) -> None:
    with pytest.raises(GraphError) as info:
        graph_from_dict(doc, "bad.json")
    message = str(info.value)
    assert expected in message
    assert message.startswith("bad.json: ")
    assert "\n" not in message


def test_not_json_and_not_an_object(tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(GraphError, match="not valid JSON"):
        load_graph(path)
    path.write_text("[1, 2]")
    with pytest.raises(GraphError, match="top level must be a JSON object"):
        load_graph(path)
    with pytest.raises(GraphError, match="no such graph file"):
        load_graph(tmp_path / "missing.json")


def test_duplicate_edges_add_their_bytes() -> None:
    g = OpGraph("d")
    g.add_op(Op("a", "x"))
    g.add_op(Op("b", "y"))
    g.add_edge("a", "b", 10)
    g.add_edge("a", "b", 6)
    assert g.edge_bytes("a", "b") == 16
    assert g.num_edges == 1


def test_arrays_are_recomputed_after_a_change() -> None:
    g = OpGraph("d")
    g.add_op(Op("a", "x", flops=1))
    assert g.arrays().flops.tolist() == [1.0]
    g.add_op(Op("b", "y", flops=2))
    assert np.array_equal(g.arrays().flops, [1.0, 2.0])


def test_written_json_is_plain_and_documented_keys() -> None:
    g = graph_from_dict(_doc())
    data = json.loads(graph_to_json(g))
    assert set(data) == {"format", "version", "name", "meta", "ops", "edges"}
    assert data["ops"][0] == {"name": "x", "kind": "input", "output_shapes": [[4, 8]]}
