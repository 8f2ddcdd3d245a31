"""Turn what a user names on the command line into an OpGraph.

A model is named in one of three ways:

* a reference workload: ``resnet50``, ``gpt`` (with ``size``/``batch``);
* a graph file: ``graph.json`` (written by meshplace or by hand; see ``docs/formats.md``);
* a Python file and function: ``path/to/file.py:build``, where ``build()`` returns
  ``(model, example_inputs)``.

Every mistake is one :class:`~meshplace.errors.InputError` sentence naming what was given: a
folder where a file belongs, a misspelt workload (with difflib's "did you mean"), a user
file whose import or ``build()`` raises or calls ``sys.exit``, or a ``build()`` that does not
return ``(model, example_inputs)`` with a ``torch.nn.Module``.

Example
-------
>>> g = graph_for("resnet50", batch=1, training=False)
>>> g.meta["workload"]
'resnet50'
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplace.errors import InputError
from meshplace.graph.io import load_graph
from meshplace.graph.ir import OpGraph

_FORMS = "a graph file (.json), a Python file and its function (file.py:build) or a workload"


def graph_for(
    spec: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
) -> OpGraph:
    """The OpGraph for ``spec`` (workload name, ``.json`` graph file or ``file.py:fn``)."""
    if spec and Path(spec).is_dir():
        raise InputError(f"{spec}: is a folder; name {_FORMS}")
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
    from meshplace.graph.capture import capture

    known = models.available()
    if name not in known:
        raise InputError(_unknown_workload(name, list(known)))
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


def _unknown_workload(name: str, known: list[str]) -> str:
    """The sentence for a name that is no workload, no graph file and no Python file."""
    if Path(name).is_file():
        return (
            f"{name}: is a file but neither a graph file (.json) nor a Python file and its "
            "function (file.py:build)"
        )
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"Unknown workload {name!r}{hint}; choose one of {', '.join(map(repr, known))}, or "
        "name a graph file (.json) or a Python file and its function (file.py:build)"
    )


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_build_function(spec: str) -> Callable[[], tuple[Any, Any]]:
    """The function named by ``FILE.py:FUNCTION``, imported from that file, wrapped so that
    calling it returns ``(model, example_inputs)`` or raises one :class:`InputError` sentence
    naming the file and function: when the import or the call raises, when either calls
    ``sys.exit`` (which would otherwise end meshplace with status 0 and nothing written), and
    when the result is not a pair whose first item is a ``torch.nn.Module``."""
    path_text, _, fn_name = spec.rpartition(":") if ".py:" in spec else (spec, "", "")
    if not fn_name:
        raise InputError(f"{spec}: name the build function as FILE.py:FUNCTION")
    path = Path(path_text)
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not a Python file (name it as FILE.py:FUNCTION)")
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
    except SystemExit as exc:
        raise InputError(
            f"{path}: importing it called sys.exit({exc.code!r}); a model file must not exit"
        ) from None
    except Exception as exc:  # the user's file failed to import: say so in one sentence
        raise InputError(
            f"{path}: importing it failed with {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    finally:
        sys.modules.pop(mod_name, None)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(fn_name, public, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"{path}: has no function named {fn_name!r}{hint}")
    where = f"{path}:{fn_name}"

    @functools.wraps(fn)
    def build() -> tuple[Any, Any]:
        try:
            built = fn()
        except SystemExit as exc:
            raise InputError(
                f"{where}: {fn_name}() called sys.exit({exc.code!r}) instead of returning "
                "(model, example_inputs)"
            ) from None
        except Exception as exc:  # the user's builder failed: one sentence, no traceback
            raise InputError(
                f"{where}: {fn_name}() failed with {type(exc).__name__}: {_one_line(exc)}"
            ) from None
        return _check_built(built, where, fn_name)

    return build


def _check_built(built: Any, where: str, fn_name: str) -> tuple[Any, Any]:
    import torch

    if not (isinstance(built, tuple | list) and len(built) == 2):
        got = f"a {type(built).__name__}" if built is not None else "None"
        if isinstance(built, tuple | list):
            got = f"a {type(built).__name__} of {len(built)} items"
        raise InputError(f"{where}: {fn_name}() must return (model, example_inputs), got {got}")
    model, inputs = built
    if not isinstance(model, torch.nn.Module):
        raise InputError(
            f"{where}: {fn_name}() returned a {type(model).__name__} as the model; it must be a "
            "torch.nn.Module"
        )
    return model, inputs


def _graph_from_python(spec: str, *, training: bool, optimizer: str) -> OpGraph:
    from meshplace.graph.capture import CaptureError, capture

    model, inputs = load_build_function(spec)()
    try:
        graph = capture(
            model,
            inputs,
            training=training,
            optimizer=optimizer,
            name=Path(spec.rpartition(":")[0]).stem,
        )
    except CaptureError as exc:
        raise CaptureError(f"{spec}: {exc}") from None
    graph.meta.setdefault("workload", spec)
    return graph
