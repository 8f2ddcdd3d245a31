"""Turn what a user names on the command line into an OpGraph.

A model is named in one of three ways:

* a reference workload: ``resnet50``, ``gpt`` (with ``size``/``batch``);
* a graph file: ``graph.json`` (written by meshplace or by hand; see ``docs/formats.md``);
* a Python file and function: ``path/to/file.py:build``, where ``build()`` returns
  ``(model, example_inputs)``.

Example
-------
>>> g = graph_for("resnet50", batch=1, training=False)
>>> g.meta["workload"]
'resnet50'
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplace.errors import InputError
from meshplace.graph.capture import CaptureError, capture, capture_callable
from meshplace.graph.io import load_graph
from meshplace.graph.ir import OpGraph


def graph_for(
    spec: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
) -> OpGraph:
    """The OpGraph for ``spec`` (workload name, ``.json`` graph file or ``file.py:fn``)."""
    if spec.endswith(".json"):
        if batch is not None or size is not None:
            raise InputError(
                f"{spec}: --batch and --size apply to models, not to a saved graph file"
            )
        return load_graph(spec)
    if ".py:" in spec or spec.endswith(".py"):
        if batch is not None or size is not None:
            raise InputError(
                f"{spec}: --batch and --size apply to reference workloads; "
                "set them inside your build function"
            )
        return _graph_from_python(spec, training=training, optimizer=optimizer)
    return workload_graph(spec, batch=batch, size=size, training=training, optimizer=optimizer)


def workload_graph(
    name: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
) -> OpGraph:
    """Capture reference workload ``name`` (see :mod:`meshplace.models`)."""
    from meshplace import models

    w = models.get(name, batch=batch, size=size)  # UnknownWorkloadError is an InputError
    batch_size = w.dims.get("batch")
    graph_name = name if len(models.available()[name]) == 1 else f"{name}-{w.size}"
    meta: dict[str, Any] = {
        "workload": name,
        "size": w.size,
        "batch": batch_size,
        "tokens": w.tokens,
        "source": w.source,
        "description": w.description,
    }
    return capture(
        w.model,
        w.example_inputs,
        training=training,
        name=graph_name,
        optimizer=optimizer,
        dims=w.dims,
        meta=meta,
    )


def load_build_function(spec: str) -> Callable[[], Any]:
    """The function named by ``FILE.py:FUNCTION``, imported from that file."""
    path_text, _, fn_name = spec.rpartition(":") if ".py:" in spec else (spec, "", "")
    if not fn_name:
        raise InputError(f"{spec}: name the build function as FILE.py:FUNCTION")
    path = Path(path_text)
    if not path.is_file():
        raise InputError(f"{path}: no such Python file")
    mod_name = f"meshplace_user_{uuid.uuid4().hex}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise InputError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file failed to import: say so in one sentence
        raise InputError(f"{path}: importing it failed with {type(exc).__name__}: {exc}") from None
    finally:
        sys.modules.pop(mod_name, None)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise InputError(f"{path}: has no function named {fn_name!r}")
    return fn


def _graph_from_python(spec: str, *, training: bool, optimizer: str) -> OpGraph:
    fn = load_build_function(spec)
    try:
        graph = capture_callable(
            fn, training=training, optimizer=optimizer, name=Path(spec.rpartition(":")[0]).stem
        )
    except CaptureError as exc:
        raise CaptureError(f"{spec}: {exc}") from None
    graph.meta.setdefault("workload", spec)
    return graph
