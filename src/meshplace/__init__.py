"""meshplace: decide where every part of a neural network should run, and prove it.

The package imports nothing heavy itself (PEP 562 lazy attributes): ``meshplace.Op`` and
friends load ``meshplace.graph`` (and with it torch) on first use, so the command line can
answer ``--help``, bad flags and Ctrl-C before paying for torch's import.
"""

from __future__ import annotations

from typing import Any

from meshplace.errors import InputError

__version__ = "0.1.0"

__all__ = ["InputError", "Op", "OpGraph", "__version__", "capture", "load_graph", "save_graph"]

_FROM_GRAPH = {"Op", "OpGraph", "capture", "load_graph", "save_graph"}


def __getattr__(name: str) -> Any:
    if name in _FROM_GRAPH:
        import meshplace.graph as graph

        return getattr(graph, name)
    raise AttributeError(f"module 'meshplace' has no attribute {name!r}")
