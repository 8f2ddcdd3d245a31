"""meshplace: decide where every part of a neural network should run, and prove it."""

from meshplace.errors import InputError
from meshplace.graph import Op, OpGraph, capture, load_graph, save_graph

__version__ = "0.1.0"

__all__ = ["InputError", "Op", "OpGraph", "__version__", "capture", "load_graph", "save_graph"]
