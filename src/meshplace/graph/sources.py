"""Turn what a user names on the command line into an OpGraph.

A model is named in one of three ways:

* a reference workload: ``resnet50``, ``gpt`` (with ``size``/``batch``);
* a graph file: ``graph.json`` (written by meshplace or by hand; see ``docs/formats.md``);
* a Python file and function: ``path/to/file.py:build``, where ``build()`` returns
  ``(model, example_inputs)`` or ``(model, example_inputs, example_kwargs)`` (keyword
  inputs, as Hugging Face models take ``input_ids=..., labels=...``).

Every mistake is one :class:`~meshplace.errors.InputError` sentence naming what was given: a
folder where a file belongs, a misspelt workload (with difflib's "did you mean"), a user
file whose import or ``build()`` raises or calls ``sys.exit``, or a ``build()`` that does not
return ``(model, example_inputs[, example_kwargs])`` with a ``torch.nn.Module``.

A ``file.py:build`` capture is cached (:func:`graph_source`): the graph is saved under
:func:`cache_dir` keyed by the file's bytes, the function's name, the capture options
(training, optimizer, dtype, autocast) and the versions of meshplace's capture code and of
torch, so planning the same model again loads the graph instead of importing the file and
tracing it (GPT-2: minutes). Only the named file is hashed: a change in a module it
imports is not seen (``cache=False``, ``--no-cache``).

Example
-------
>>> g = graph_for("resnet50", batch=1, training=False)
>>> g.meta["workload"]
'resnet50'
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplace.errors import InputError
from meshplace.graph.io import load_graph, save_graph
from meshplace.graph.ir import GraphError, OpGraph

_FORMS = "a graph file (.json), a Python file and its function (file.py:build) or a workload"


@dataclass
class GraphSource:
    """A graph and where it came from.

    Attributes:
        graph: the OpGraph.
        cache: for a ``file.py:build`` model, ``{"status": ..., "path": ...}`` — status
            ``"hit"`` (loaded from the cache, nothing imported or traced), ``"stored"``
            (captured and saved there), ``"off"`` (``cache=False``) or ``"unwritable"``
            (captured; the cache folder could not be written, ``reason`` says why); None
            for graph files and reference workloads (which are cached too, silently:
            :func:`workload_graph`).
        notes: sentences the user should see (``graph.meta['notes']``: a
            ``torch.compile``d module captured through ``_orig_mod``, a stand-in loss).
    """

    graph: OpGraph
    cache: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def graph_for(
    spec: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
    dtype: str | None = None,
    autocast: str | None = None,
    cache: bool = True,
) -> OpGraph:
    """The OpGraph for ``spec`` (workload name, ``.json`` graph file or ``file.py:fn``);
    :func:`graph_source` without the provenance."""
    return graph_source(
        spec,
        batch=batch,
        size=size,
        training=training,
        optimizer=optimizer,
        dtype=dtype,
        autocast=autocast,
        cache=cache,
    ).graph


def graph_source(
    spec: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
    dtype: str | None = None,
    autocast: str | None = None,
    cache: bool = True,
) -> GraphSource:
    """The OpGraph for ``spec`` and where it came from (a ``file.py:fn`` capture may come
    from the cache, see the module docstring).

    ``dtype`` (``bf16``/``fp16``/``fp32``) casts parameters and floating inputs before a
    capture, ``autocast`` (``bf16``/``fp16``) runs its forward under ``torch.autocast``
    (:func:`meshplace.graph.capture.capture`); neither applies to a saved graph file.
    """
    if spec and Path(spec).is_dir():
        raise InputError(f"{spec}: is a folder; name {_FORMS}")
    if spec.endswith(".json"):
        if batch is not None or size is not None:
            raise InputError(
                f"{spec}: --batch and --size apply to models, not to a saved graph file"
            )
        if dtype is not None or autocast is not None:
            raise InputError(
                f"{spec}: --dtype and --autocast apply to models captured here; a saved graph "
                "keeps the dtypes it was captured with"
            )
        return _with_notes(GraphSource(load_graph(spec)))
    if ".py:" in spec or spec.endswith(".py"):
        if size is not None:
            raise InputError(
                f"{spec}: --size applies to reference workloads; set it inside your build function"
            )
        return _with_notes(
            _graph_from_python(
                spec,
                training=training,
                optimizer=optimizer,
                dtype=dtype,
                autocast=autocast,
                cache=cache,
                batch=batch,
            )
        )
    graph = workload_graph(
        spec,
        batch=batch,
        size=size,
        training=training,
        optimizer=optimizer,
        dtype=dtype,
        autocast=autocast,
        cache=cache,
    )
    return _with_notes(GraphSource(graph))


def _with_notes(source: GraphSource) -> GraphSource:
    notes = source.graph.meta.get("notes")
    if isinstance(notes, list):
        source.notes = [str(n) for n in notes]
    return source


def workload_graph(
    name: str,
    *,
    batch: int | None = None,
    size: str | None = None,
    training: bool = True,
    optimizer: str = "adam",
    dtype: str | None = None,
    autocast: str | None = None,
    cache: bool = True,
) -> OpGraph:
    """Capture reference workload ``name`` (see :mod:`meshplace.models`), optionally cast
    to ``dtype`` or under ``autocast`` (:func:`meshplace.graph.capture.capture`).

    With ``cache`` (the default) the graph is kept in :func:`cache_dir` under a key of the
    workload, its size, batch and options and the code that captures it (graph and models
    packages, torch's version), so the next call with the same arguments loads it instead
    of capturing again (NMT: ~0.5 s instead of ~8 s)."""
    from meshplace import models

    known = models.available()
    if name not in known:
        raise InputError(_unknown_workload(name, list(known)))
    options = {
        "workload": name,
        "size": models.canonical_size(name, size),  # one entry for both spellings
        "batch": batch,
        "training": training,
        "optimizer": optimizer,
        "dtype": dtype,
        "autocast": autocast,
    }
    head = {"options": options, "code": _code_version()}
    key = hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()
    entry = cache_dir() / "graphs" / f"workload-{key}.json"
    if not cache:
        return _capture_workload(name, batch, size, training, optimizer, dtype, autocast)
    with one_capture_at_a_time(key):
        hit = _load_cached(entry)
        if hit is not None:
            return hit
        graph = _capture_workload(name, batch, size, training, optimizer, dtype, autocast)
        _store_cached(graph, entry)
    return graph


@contextlib.contextmanager
def one_capture_at_a_time(key: str) -> Iterator[None]:
    """Hold an exclusive lock (``flock``) on cache entry ``key`` while it is looked up and
    captured, so that processes asking for the same uncached graph at once (two test
    workers, two shells) capture it once: the others wait, then load what the first
    stored. Where no lock can be taken (an unwritable cache, no ``fcntl``) nothing waits.
    The lock ends with its process, however that ends. O(1)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        folder = cache_dir() / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / f"{key}.lock", "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _capture_workload(
    name: str,
    batch: int | None,
    size: str | None,
    training: bool,
    optimizer: str,
    dtype: str | None,
    autocast: str | None,
) -> OpGraph:
    from meshplace import models
    from meshplace.graph.capture import capture

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
        dtype=dtype,
        autocast=autocast,
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


def _split_spec(spec: str) -> tuple[Path, str]:
    """``FILE.py:FUNCTION`` → (the file, the function name), checked to exist as a file."""
    path_text, _, fn_name = spec.rpartition(":") if ".py:" in spec else (spec, "", "")
    if not fn_name:
        raise InputError(f"{spec}: name the build function as FILE.py:FUNCTION")
    path = Path(path_text)
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not a Python file (name it as FILE.py:FUNCTION)")
    if not path.is_file():
        raise InputError(f"{path}: no such Python file")
    return path, fn_name


def build_from_seed(spec: str, seed: int = 0) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(model, args, kwargs)`` of ``FILE.py:FUNCTION`` built after ``torch.manual_seed
    (seed)``: what every torchrun rank builds, so that all ranks start from the same
    weights and inputs (:func:`load_build_function`'s errors)."""
    import torch

    torch.manual_seed(seed)
    built = load_build_function(spec)()
    return built[0], tuple(built[1]), dict(built[2]) if len(built) > 2 else {}


def load_build_function(spec: str) -> Callable[[], tuple[Any, ...]]:
    """The function named by ``FILE.py:FUNCTION``, imported from that file, wrapped so that
    calling it returns ``(model, example_inputs)`` — or ``(model, example_inputs,
    example_kwargs)`` when ``build()`` returns keyword inputs too — or raises one
    :class:`InputError` sentence naming the file and function: when the import or the call
    raises, when either calls ``sys.exit`` (which would otherwise end meshplace with status 0
    and nothing written), and when the result is not such a tuple whose first item is a
    ``torch.nn.Module``."""
    path, fn_name = _split_spec(spec)
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
    def build() -> tuple[Any, ...]:
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


def _check_built(built: Any, where: str, fn_name: str) -> tuple[Any, ...]:
    """``built`` as ``(model, inputs)`` or ``(model, args, kwargs)``, checked; a dict of
    inputs in a pair is the keyword inputs (``(model, {"input_ids": ...})``)."""
    import torch

    shape = "must return (model, example_inputs)"
    if not (isinstance(built, tuple | list) and len(built) in (2, 3)):
        got = f"a {type(built).__name__}" if built is not None else "None"
        if isinstance(built, tuple | list):
            got = f"a {type(built).__name__} of {len(built)} items"
        raise InputError(
            f"{where}: {fn_name}() {shape}, got {got}; (model, args, kwargs) is accepted too"
        )
    if len(built) == 3 and not isinstance(built[2], Mapping):
        raise InputError(
            f"{where}: {fn_name}() {shape}, got a {type(built).__name__} of 3 items whose "
            f"third is a {type(built[2]).__name__}; a third item must be the dict of keyword "
            "inputs, as in (model, args, kwargs)"
        )
    model = built[0]
    if not isinstance(model, torch.nn.Module):
        raise InputError(
            f"{where}: {fn_name}() returned a {type(model).__name__} as the model; it must be a "
            "torch.nn.Module"
        )
    return tuple(built)


# ----------------------------------------------------------------------- the cache
#: Environment variable naming the capture cache folder (overrides the XDG location).
CACHE_ENV = "MESHPLACE_CACHE_DIR"
#: Graphs kept in the cache; the least recently used beyond this are deleted.
CACHE_ENTRIES = 64


def cache_dir() -> Path:
    """Where captured graphs are cached: ``$MESHPLACE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/meshplace``, else ``~/.cache/meshplace`` (XDG Base Directory spec)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "meshplace"


@functools.cache
def _code_version() -> str:
    """meshplace's version, a digest of the graph and models packages' source (capture,
    FLOPs, IR, the reference workloads) and torch's version: a cached graph is reused only
    by the code that would capture it."""
    from meshplace import __version__

    digest = hashlib.sha256()
    package = Path(__file__).parent.parent
    sources = [*package.joinpath("graph").glob("*.py"), *package.joinpath("models").glob("*.py")]
    for file in sorted(sources):
        digest.update(f"{file.parent.name}/{file.name}".encode())
        digest.update(file.read_bytes())
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        torch_version = "?"
    return f"{__version__}+{digest.hexdigest()[:16]}+torch{torch_version}"


def cache_key(path: Path, fn_name: str, options: dict[str, Any]) -> str:
    """SHA-256 of the file's bytes, the function name, the capture ``options`` and
    :func:`_code_version`."""
    head = {"function": fn_name, "options": options, "code": _code_version()}
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    digest.update(path.read_bytes())
    return digest.hexdigest()


def _prune(folder: Path, keep: int = CACHE_ENTRIES) -> None:
    """Delete all but the ``keep`` most recently used cached graphs (by mtime)."""
    try:
        files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in files[keep:]:
            old.unlink(missing_ok=True)
    except OSError:  # another process pruned the same files: nothing to do
        pass


def _graph_from_python(
    spec: str,
    *,
    training: bool,
    optimizer: str,
    dtype: str | None = None,
    autocast: str | None = None,
    cache: bool = True,
    batch: int | None = None,
) -> GraphSource:
    """Capture ``FILE.py:FUNCTION``, or load it from the cache (:func:`cache_key`);
    ``batch``: the first ``batch`` rows of its inputs (:func:`first_rows`)."""
    path, fn_name = _split_spec(spec)
    options = {
        "training": training,
        "optimizer": optimizer,
        "dtype": dtype,
        "autocast": autocast,
        "fused_attention": True,
        **({"batch": batch} if batch is not None else {}),  # earlier keys stay valid
    }
    name = path.stem
    entry = cache_dir() / "graphs" / f"{cache_key(path, fn_name, options)}.json"
    if cache:
        hit = _load_cached(entry)
        if hit is not None:
            hit.name = name
            hit.meta["workload"] = spec
            return GraphSource(hit, {"status": "hit", "path": str(entry)})
    graph = _capture_python(spec, training, optimizer, dtype, autocast, name, batch)
    if not cache:
        return GraphSource(graph, {"status": "off", "path": None})
    reason = _store_cached(graph, entry)
    if reason is not None:
        return GraphSource(graph, {"status": "unwritable", "path": str(entry), "reason": reason})
    return GraphSource(graph, {"status": "stored", "path": str(entry)})


def _load_cached(entry: Path) -> OpGraph | None:
    """The graph cached at ``entry``, or None (absent, damaged, or from an incompatible
    writer: the caller captures afresh)."""
    if not entry.is_file():
        return None
    try:
        graph = load_graph(entry)
    except (GraphError, InputError):
        return None
    with contextlib.suppress(OSError):
        os.utime(entry)  # most recently used, for _prune
    return graph


def _store_cached(graph: OpGraph, entry: Path) -> str | None:
    """Save ``graph`` at ``entry`` (atomically) and prune the cache; returns why it could
    not be written, or None."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        save_graph(graph, entry)
    except (OSError, InputError) as exc:
        return exc.strerror if isinstance(exc, OSError) else str(exc)
    _prune(entry.parent)
    return None


def _capture_python(
    spec: str,
    training: bool,
    optimizer: str,
    dtype: str | None,
    autocast: str | None,
    name: str,
    batch: int | None = None,
) -> OpGraph:
    from meshplace.graph.capture import CaptureError, capture

    model, inputs, *rest = load_build_function(spec)()
    kwargs = rest[0] if rest else None
    if batch is not None:
        inputs, kwargs = first_rows(inputs, kwargs or {}, batch, spec)
    try:
        graph = capture(
            model,
            inputs,
            training=training,
            optimizer=optimizer,
            name=name,
            example_kwargs=kwargs,
            dtype=dtype,
            autocast=autocast,
        )
    except CaptureError as exc:
        raise CaptureError(f"{spec}: {exc}") from None
    graph.meta.setdefault("workload", spec)
    return graph


def first_rows(
    args: Sequence[Any], kwargs: dict[str, Any], rows: int, spec: str = "the model"
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first ``rows`` rows of every tensor input (positional and keyword): a build
    function's inputs at a smaller batch, as a micro-batch of them. Every tensor input
    must share its leading dimension (the batch, as
    :func:`meshplace.graph.summary.traced_batch` reads it), which ``rows`` must divide;
    else :class:`InputError`. O(inputs).

    >>> import torch
    >>> args, kw = first_rows((torch.zeros(8, 3),), {"labels": torch.zeros(8)}, 2)
    >>> args[0].shape, kw["labels"].shape
    (torch.Size([2, 3]), torch.Size([2]))
    """
    import torch

    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    leading = {int(t.shape[0]) if t.dim() else 0 for t in tensors}
    if len(leading) != 1 or 0 in leading:
        raise InputError(
            f"{spec}: its inputs do not share a leading (batch) dimension, so --batch "
            "cannot take their first rows"
        )
    batch = leading.pop()
    if rows < 1 or batch % rows:
        raise InputError(
            f"{spec}: its inputs have a batch of {batch}; --batch {rows} must divide it "
            "(a file's --batch takes the first rows of its inputs)"
        )

    def cut(v: Any) -> Any:
        return v[:rows] if isinstance(v, torch.Tensor) else v

    return tuple(cut(v) for v in args), {k: cut(v) for k, v in kwargs.items()}


def build_on_two_rows(spec: str, seed: int = 0) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(model, args, kwargs)`` of ``FILE.py:FUNCTION`` built from ``seed``
    (:func:`build_from_seed`) with its inputs cut to their first two rows (one if the
    batch is odd, :func:`first_rows`): what the engine-overhead measurements run, where
    less arithmetic leaves the engine's own cost visible. O(build)."""
    model, args, kwargs = build_from_seed(spec, seed)
    batch = int(args[0].shape[0])
    args, kwargs = first_rows(args, kwargs, 2 if batch % 2 == 0 else 1, spec)
    return model, args, kwargs
