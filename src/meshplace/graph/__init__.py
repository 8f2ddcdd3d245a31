"""The op-graph IR, its JSON format, PyTorch capture, and co-location grouping.

Capture is the only part that needs torch, and importing torch costs seconds, so the
capture names (``capture``, ``capture_callable``, ``CaptureError``) load on first use:
reading, simulating and planning a saved ``graph.json`` never imports torch.

One wrinkle makes this more than a PEP 562 ``__getattr__``: ``capture`` is both a
function and the submodule it lives in, and Python's import system sets the package
attribute ``capture`` to the submodule whenever ``meshplace.graph.capture`` is imported.
The package's module class therefore has a ``capture`` property that always answers the
function (the submodule stays in ``sys.modules``), as the eager import used to do.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

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


class _GraphPackage(types.ModuleType):
    @property
    def capture(self) -> Any:
        from meshplace.graph.capture import capture

        return capture

    @capture.setter
    def capture(self, submodule: types.ModuleType) -> None:
        """The import system recording the submodule: it stays in ``sys.modules``."""

    def __getattr__(self, name: str) -> Any:
        if name in ("capture_callable", "CaptureError"):
            return getattr(importlib.import_module("meshplace.graph.capture"), name)
        raise AttributeError(f"module 'meshplace.graph' has no attribute {name!r}")


sys.modules[__name__].__class__ = _GraphPackage
