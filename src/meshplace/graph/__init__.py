"""The op-graph IR, its JSON format, PyTorch capture, and co-location grouping."""

from meshplace.graph.capture import CaptureError, capture, capture_callable
from meshplace.graph.io import (
    graph_from_dict,
    graph_from_json,
    graph_to_dict,
    graph_to_json,
    load_graph,
    save_graph,
)
from meshplace.graph.ir import PHASES, GraphArrays, GraphError, Op, OpGraph

__all__ = [
    "PHASES",
    "CaptureError",
    "GraphArrays",
    "GraphError",
    "Op",
    "OpGraph",
    "capture",
    "capture_callable",
    "graph_from_dict",
    "graph_from_json",
    "graph_to_dict",
    "graph_to_json",
    "load_graph",
    "save_graph",
]
