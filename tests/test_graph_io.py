"""The OpGraph IR and its JSON format: round trips and every rejected input."""

from __future__ import annotations

import json
import math
import subprocess

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings

from meshplace.graph import GraphError, Op, OpGraph, graph_from_json, graph_to_json
from meshplace.graph.io import graph_from_dict, load_graph, save_graph
from tests.forked_cli import run_meshplace

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


# ------------------------------------------------------------------ bad inputs (issue 13)
@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (_op(flops=True), "op 'mm' field 'flops' must be a number, not true"),
        (_op(flops="100"), "op 'mm' field 'flops' must be a number, not the string '100'"),
        (_op(param_bytes=False), "op 'mm' field 'param_bytes' must be a number, not false"),
        (_op(output_shapes=[[True]]), "field 'output_shapes.0.0' must be a number"),
        (_op(measured_time={"k80": "1e-3"}), "field 'measured_time.k80' must be a number"),
        (_op(kind="matmull"), "unknown kind 'matmull' (did you mean 'matmul'?); allowed kinds:"),
        (_op(kind="MatMul"), "(did you mean 'matmul'?)"),
        (_op(kind="frobnicate"), "has unknown kind 'frobnicate'; allowed kinds: matmul, conv"),
        (_op(forward_op="mm"), "op 'mm' field 'forward_op' names the op itself"),
        (_op(param_bytes=10**30), "op 'mm' field 'param_bytes'"),
        (_op(output_shapes=[[2**62] * 20]), "gives output 0 more than 2^62 elements"),
    ],
)
def test_wrong_types_kinds_and_self_links_are_one_sentence(op, expected) -> None:
    with pytest.raises(GraphError) as info:
        graph_from_dict(_doc(ops=[op], edges=[]), "bad.json")
    message = str(info.value)
    assert expected in message
    assert message.startswith("bad.json: ") and "\n" not in message


def test_meta_numbers_and_version_must_have_their_types() -> None:
    for meta, got in (({"batch": "64"}, "(got '64')"), ({"batch": 0}, "(got 0)")):
        with pytest.raises(GraphError, match=r"field 'meta\.batch' must be an integer") as info:
            graph_from_dict(_doc(meta=meta), "bad.json")
        assert got in str(info.value)
    with pytest.raises(GraphError, match=r"field 'meta\.params' must be an integer"):
        graph_from_dict(_doc(meta={"params": True}), "bad.json")
    with pytest.raises(GraphError, match="field 'version' must be a number, not true"):
        graph_from_dict(_doc(version=True), "bad.json")


def test_every_kind_capture_gives_is_allowed() -> None:
    from meshplace.graph import flops
    from meshplace.graph.ir import OP_KINDS

    names = set().union(*(v for v in vars(flops).values() if isinstance(v, set)))
    assert {flops.op_kind(n) for n in names} <= set(OP_KINDS)
    assert {"parameter", "buffer", "input", "collective", "elementwise"} <= set(OP_KINDS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "a", "name": "b"}', "key 'name' appears twice in one JSON object"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
        ('{"version": ' + "9" * 5001 + "}", "holds an integer with too many digits to read"),
        ('{"name": "unterminated', "not valid JSON (line 1, column 10: Unterminated string"),
    ],
)
def test_json_that_python_reads_badly_is_one_sentence(text, expected) -> None:
    with pytest.raises(GraphError) as info:
        graph_from_json(text, "bad.json")
    message = str(info.value)
    assert expected in message and message.startswith("bad.json: ")
    assert "\n" not in message and "at at" not in message


def test_files_that_are_not_graphs_are_named(tmp_path) -> None:
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "latin1.json").write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    (tmp_path / "folder.json").mkdir()
    cases = {
        "binary.json": "is a binary file",
        "latin1.json": "is not a UTF-8 text file",
        "folder.json": "is a folder, not a graph file",
        "missing.json": "no such graph file",
    }
    for name, expected in cases.items():
        with pytest.raises(GraphError, match=expected):
            load_graph(tmp_path / name)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + graph_to_json(graph_from_dict(_doc())).encode())
    assert load_graph(bom).num_ops == 3


# ------------------------------------------------------------------ model sources
USER_FILE = """
import sys
import torch

def raises():
    raise KeyError("weights.pt")

def exits():
    sys.exit(0)

def not_a_model():
    return "resnet", (torch.zeros(1),)

def three():
    return 1, 2, 3
"""


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        ("raises", "user.py:raises: raises() failed with KeyError: 'weights.pt'"),
        ("exits", "user.py:exits: exits() called sys.exit(0) instead of returning"),
        ("not_a_model", "not_a_model() returned a str as the model; it must be a torch.nn."),
        ("three", "three() must return (model, example_inputs), got a tuple of 3 items"),
        ("rasies", "has no function named 'rasies' (did you mean 'raises'?)"),
    ],
)
def test_user_build_functions_fail_in_one_sentence(tmp_path, fn, expected) -> None:
    from meshplace.errors import InputError
    from meshplace.graph.sources import graph_for

    (tmp_path / "user.py").write_text(USER_FILE)
    with pytest.raises(InputError) as info:
        graph_for(f"{tmp_path / 'user.py'}:{fn}")
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_sources_name_folders_typos_and_exiting_imports(tmp_path) -> None:
    from meshplace.errors import InputError
    from meshplace.graph.sources import graph_for

    (tmp_path / "exit_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "pkg.py").mkdir()
    cases = {
        str(tmp_path): "is a folder; name a graph file (.json)",
        f"{tmp_path / 'pkg.py'}:build": "is a folder, not a Python file",
        f"{tmp_path / 'exit_on_import.py'}:build": "importing it called sys.exit(3)",
        "resnet5": "Unknown workload 'resnet5' (did you mean 'resnet50'?)",
        "inceptionv3": "(did you mean 'inception_v3'?)",
    }
    for spec, expected in cases.items():
        with pytest.raises(InputError) as info:
            graph_for(spec)
        assert expected in str(info.value), (spec, str(info.value))


# ------------------------------------------------------------------ plans
def _two_graphs():
    a, b = OpGraph("tiny"), OpGraph("tiny")
    for name in ("x", "mm", "relu"):
        a.add_op(Op(name, "matmul"))
    for name in ("x", "mm", "gelu"):
        b.add_op(Op(name, "matmul"))
    return a, b


def test_a_plan_for_another_graph_says_what_differs() -> None:
    from meshplace.plan import Plan, PlanError

    a, b = _two_graphs()
    plan = Plan.for_graph(a, "c", {"x": "gpu0", "mm": "gpu0", "relu": "gpu1"})
    with pytest.raises(PlanError) as info:
        plan.device_names(b, "p.json")
    msg = str(info.value)
    assert "'tiny' (also 3 ops), has no op 'relu', which the plan places" in msg
    # placing only ops both graphs have: the fingerprint is what differs
    plan = Plan.for_graph(a, "c", {"x": "gpu0"}, default_device="gpu0")
    with pytest.raises(PlanError, match="differs in its op names, their order or its edge count"):
        plan.device_names(b, "p.json")
    b.add_op(Op("extra", "matmul"))
    with pytest.raises(PlanError, match="was made for graph 'tiny' with 3 ops, but the graph "):
        plan.device_names(b, "p.json")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"graph_ops": True}, "field 'graph_ops' must be a number, not true"),
        ({"micro_batches": "4"}, "field 'micro_batches' must be a number, not the string '4'"),
        ({"placement": {"x": 3}}, "field 'placement.x': input should be a valid string (got 3)"),
    ],
)
def test_plan_fields_have_strict_types(change, expected) -> None:
    from meshplace.plan import Plan, PlanError
    from meshplace.plan.placement import plan_from_dict

    a, _ = _two_graphs()
    data = Plan.for_graph(a, "c", {"x": "gpu0"}).to_dict()
    data.update(change)
    with pytest.raises(PlanError) as info:
        plan_from_dict(data, "p.json")
    assert expected in str(info.value)


def test_plan_files_that_python_reads_badly(tmp_path) -> None:
    from meshplace.plan import PlanError, load_plan

    (tmp_path / "dup.json").write_text('{"format": "meshplace.plan", "format": "x"}')
    (tmp_path / "deep.json").write_text("[" * 50_000 + "]" * 50_000)
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "bin.json").write_bytes(bytes(range(256)))
    cases = {
        "dup.json": "key 'format' appears twice in one JSON object",
        "deep.json": "JSON nested too deeply to read",
        "dir.json": "is a folder, not a plan file",
        "bin.json": "is a binary file",
        "none.json": "no such plan file",
    }
    for name, expected in cases.items():
        with pytest.raises(PlanError, match=expected):
            load_plan(tmp_path / name)


# ------------------------------------------------------------------ the command line
def _meshplace(*argv: str, cwd) -> subprocess.CompletedProcess:
    return run_meshplace(argv, cwd=cwd, timeout=120)


def _graph_text(op: dict) -> str:
    return json.dumps(_doc(ops=[op], edges=[]))


CLI_CASES = {
    "flops-true": (_graph_text(_op(flops=True)), "field 'flops' must be a number, not true"),
    "unknown-kind": (_graph_text(_op(kind="matmull")), "(did you mean 'matmul'?)"),
    "duplicate-keys": ('{"format": "meshplace.opgraph", "format": 1}', "key 'format' appears"),
    "deep-json": ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
    "long-integer": ('{"version": ' + "7" * 5001 + "}", "an integer with too many digits"),
    "folder": (None, "model.json: is a folder"),
    "build-exits": ("import sys\ndef build():\n    sys.exit(0)\n", "called sys.exit(0)"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_graph_inputs_exit_2_with_one_line_and_write_nothing(tmp_path, case) -> None:
    text, expected = CLI_CASES[case]
    if case == "folder":
        (tmp_path / "model.json").mkdir()
        model = "model.json"
    elif case == "build-exits":
        (tmp_path / "model.py").write_text(text)
        model = "model.py:build"
    else:
        (tmp_path / "model.json").write_text(text)
        model = "model.json"
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = _meshplace("graph", model, "--out", "out.json", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no out.json, no temp file
