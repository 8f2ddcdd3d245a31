"""Reading and writing OpGraphs as versioned JSON (format documented in ``docs/formats.md``).

A graph file needs no torch: a graph profiled elsewhere — ops with costs and measured times,
edges with sizes — can be written by hand or by another tool and planned. Loading validates
everything and turns the first problem into one sentence that names the op and the field.

Example
-------
>>> import json
>>> text = json.dumps({"format": "meshplace.opgraph", "version": 1, "name": "two",
...     "ops": [{"name": "a", "kind": "input"}, {"name": "b", "kind": "matmul", "flops": 8}],
...     "edges": [{"src": "a", "dst": "b", "bytes": 16}]})
>>> graph_from_json(text).num_ops
2
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from meshplace.graph.groups import check_strict_colocation
from meshplace.graph.ir import (
    OP_KINDS,
    PHASES,
    GraphError,
    Op,
    OpGraph,
    dtype_size,
    known_dtypes,
)
from meshplace.graph.opdims import NotationError, OpDims
from meshplace.util import parse_json, read_text_file, short_repr, write_text_atomic

FORMAT = "meshplace.opgraph"
VERSION = 1
# Largest integer a graph may hold (bytes, shape dimensions): beyond any real tensor, and
# products of a few still convert to float64 for the simulator's arrays.
MAX_INT = 2**62


def json_number(value: Any) -> Any:
    """A pydantic before-validator for number fields of JSON files: refuses ``true``/
    ``false`` and strings, which pydantic's lax mode would read as 1 and as the number
    written in the string, silently (error type ``number_type``)."""
    if isinstance(value, bool):
        raise PydanticCustomError(
            "number_type", "must be a number, not {got}", {"got": "true" if value else "false"}
        )
    if isinstance(value, str):
        raise PydanticCustomError(
            "number_type", "must be a number, not the string {got}", {"got": short_repr(value)}
        )
    return value


_Number = BeforeValidator(json_number)
NonNegFloat = Annotated[float, _Number, Field(ge=0, allow_inf_nan=False)]
NonNegInt = Annotated[int, _Number, Field(ge=0, le=MAX_INT)]


class _OperandModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: Annotated[str, Field(min_length=1)]
    out: NonNegInt = 0
    shape: list[NonNegInt] = Field(default_factory=list)
    map: list[Annotated[int, _Number, Field(ge=-1, le=64)]] = Field(default_factory=list)


class _OpModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    name: Annotated[str, Field(min_length=1)]
    kind: Annotated[str, Field(min_length=1)]
    phase: Literal["forward", "backward", "update"] = "forward"
    module: str = ""
    target: str = ""
    output_shapes: list[list[NonNegInt]] = Field(default_factory=list)
    output_dtypes: list[str] = Field(default_factory=list)
    dim_names: list[list[str | None]] | None = None
    flops: NonNegFloat = 0.0
    bytes_read: NonNegFloat = 0.0
    bytes_written: NonNegFloat = 0.0
    param_bytes: NonNegInt = 0
    state_bytes: NonNegInt = 0
    memory_bytes: NonNegInt | None = None
    measured_time: dict[str, NonNegFloat] = Field(default_factory=dict)
    unsupported: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    colocation: str | None = None
    forward_op: str | None = None
    einsum: str | None = None
    operands: list[_OperandModel] | None = None


class _EdgeModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    src: str
    dst: str
    bytes: NonNegFloat = 0.0


class _GraphModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["meshplace.opgraph"]
    version: Annotated[int, _Number]
    name: Annotated[str, Field(min_length=1)]
    meta: dict[str, Any] = Field(default_factory=dict)
    ops: list[_OpModel]
    edges: list[_EdgeModel] = Field(default_factory=list)


_OP_FIELDS = list(_OpModel.model_fields)
_OP_DEFAULTS = {
    name: (f.default_factory() if f.default_factory is not None else f.default)
    for name, f in _OpModel.model_fields.items()
    if not f.is_required()
}


def graph_to_dict(graph: OpGraph) -> dict[str, Any]:
    """The JSON-ready dict of ``graph``; fields equal to their default are left out."""
    ops = []
    for o in graph.ops:
        d: dict[str, Any] = {}
        for name in _OP_FIELDS:
            value = getattr(o, name)
            if name in _OP_DEFAULTS and value == _OP_DEFAULTS[name]:
                continue
            d[name] = value
        ops.append(d)
    names = [o.name for o in graph.ops]
    edges = [{"src": names[s], "dst": names[d], "bytes": b} for s, d, b in graph.edges()]
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": graph.name,
        "meta": graph.meta,
        "ops": ops,
        "edges": edges,
    }


def graph_to_json(graph: OpGraph, indent: int | None = None) -> str:
    return json.dumps(graph_to_dict(graph), indent=indent, allow_nan=False)


def save_graph(graph: OpGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` atomically (a temp file renamed into place)."""
    write_text_atomic(path, graph_to_json(graph))


def graph_from_dict(data: Any, source: str = "graph") -> OpGraph:
    """Validate ``data`` (the parsed JSON) and build the OpGraph.

    Raises :class:`GraphError` with one sentence naming ``source``, the op and the field.
    """
    if not isinstance(data, dict):
        raise GraphError(f"{source}: the top level must be a JSON object, not {_kind(data)}")
    if data.get("format") == FORMAT and data.get("version") not in (None, VERSION):
        raise GraphError(
            f"{source}: unsupported graph format version {data.get('version')!r}; "
            f"this meshplace reads version {VERSION}"
        )
    try:
        model = _GraphModel.model_validate(data)
    except ValidationError as exc:
        raise GraphError(f"{source}: {_describe(exc, data)}") from None
    if model.version != VERSION:
        raise GraphError(
            f"{source}: unsupported graph format version {model.version}; "
            f"this meshplace reads version {VERSION}"
        )
    _check_meta(model.meta, source)
    graph = OpGraph(model.name, meta=model.meta)
    for om in model.ops:
        _check_op(om, source)
        try:
            graph.add_op(Op(**om.model_dump()))
        except GraphError as exc:
            raise GraphError(f"{source}: {exc}") from None
    for i, em in enumerate(model.edges):
        for end in (em.src, em.dst):
            if end not in graph:
                raise GraphError(
                    f"{source}: edge {i} ({em.src!r} -> {em.dst!r}) names op {end!r}, "
                    "which the graph does not have"
                )
        if em.src == em.dst:
            raise GraphError(f"{source}: edge {i} connects op {em.src!r} to itself")
        graph.add_edge(em.src, em.dst, em.bytes)
    for o in graph.ops:
        if o.forward_op is None:
            continue
        if o.forward_op == o.name:
            raise GraphError(
                f"{source}: op {o.name!r} field 'forward_op' names the op itself; it must name "
                "the forward op this backward op differentiates (or be null)"
            )
        if o.forward_op not in graph:
            raise GraphError(
                f"{source}: op {o.name!r} field 'forward_op' names op {o.forward_op!r}, "
                "which the graph does not have"
            )
    for o in graph.ops:
        _check_notation(graph, o, source)
    try:
        graph.check_acyclic()
    except GraphError as exc:
        raise GraphError(f"{source}: {exc}") from None
    for o in graph.ops:
        if o.kind not in _KIND_SET:
            raise GraphError(f"{source}: op {o.name!r} {unknown_kind_sentence(o.kind)}")
    try:
        check_strict_colocation(graph)
    except GraphError as exc:
        raise GraphError(f"{source}: {exc}") from None
    return graph


_KIND_SET = frozenset(OP_KINDS)


def unknown_kind_sentence(kind: str) -> str:
    """The end of the sentence that rejects op kind ``kind``: a "did you mean" (difflib's
    closest match, if any is close) and the allowed kinds.

    >>> unknown_kind_sentence("matmull")
    "has unknown kind 'matmull' (did you mean 'matmul'?); allowed kinds: matmul, conv, ..."
    """
    close = difflib.get_close_matches(kind.lower(), OP_KINDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"has unknown kind {short_repr(kind)}{hint}; allowed kinds: {', '.join(OP_KINDS)}"


def graph_from_json(text: str, source: str = "graph") -> OpGraph:
    """Parse graph JSON ``text`` (strictly: :func:`parse_json`) and build the OpGraph;
    errors are one-sentence :class:`GraphError` naming ``source``."""
    return graph_from_dict(parse_json(text, source, "graph", GraphError), source)


def load_graph(path: str | Path) -> OpGraph:
    """Read and validate a graph file (:func:`read_text_file`, :func:`graph_from_json`)."""
    text = read_text_file(path, "graph", GraphError)
    return graph_from_json(text, str(path))


# ------------------------------------------------------------------ strict file reading
# ------------------------------------------------------------------------ checks
def _check_op(om: _OpModel, source: str) -> None:
    where = f"{source}: op {om.name!r}"
    for k, shape in enumerate(om.output_shapes):
        if math.prod(shape) > MAX_INT:
            raise GraphError(
                f"{where} field 'output_shapes' gives output {k} more than 2^62 elements; "
                "no tensor is that large"
            )
    for dt in om.output_dtypes:
        try:
            dtype_size(dt)
        except GraphError:
            raise GraphError(
                f"{where} field 'output_dtypes' has unknown dtype {dt!r}; "
                f"allowed: {', '.join(known_dtypes())}"
            ) from None
    if om.output_dtypes and len(om.output_dtypes) != len(om.output_shapes):
        raise GraphError(
            f"{where} has {len(om.output_shapes)} output_shapes but "
            f"{len(om.output_dtypes)} output_dtypes"
        )
    if om.dim_names is not None:
        if len(om.dim_names) != len(om.output_shapes):
            raise GraphError(
                f"{where} has {len(om.output_shapes)} output_shapes but "
                f"{len(om.dim_names)} dim_names entries"
            )
        for shape, names in zip(om.output_shapes, om.dim_names, strict=True):
            if len(shape) != len(names):
                raise GraphError(
                    f"{where} field 'dim_names' gives {len(names)} names for a "
                    f"{len(shape)}-dimensional output"
                )


def _check_notation(graph: OpGraph, o: Op, source: str) -> None:
    """``operands`` name existing outputs with a map per dimension into them, and
    ``einsum`` parses and labels exactly those operands and the op's outputs."""
    where = f"{source}: op {o.name!r}"
    for k, rec in enumerate(o.operands or []):
        if rec["op"] not in graph:
            raise GraphError(
                f"{where} field 'operands' entry {k} names op {rec['op']!r}, which the graph "
                "does not have"
            )
        producer = graph.op(rec["op"])
        if rec["out"] >= max(len(producer.output_shapes), 1):
            raise GraphError(
                f"{where} field 'operands' entry {k} reads output {rec['out']} of "
                f"{rec['op']!r}, which has {len(producer.output_shapes)} outputs"
            )
        rank = len(producer.output_shapes[rec["out"]]) if producer.output_shapes else 0
        if len(rec["map"]) != len(rec["shape"]) or any(d >= rank for d in rec["map"]):
            raise GraphError(
                f"{where} field 'operands' entry {k} needs one map entry per dimension of "
                f"its shape, each -1 or a dimension of the producer's output (rank {rank})"
            )
    if o.einsum is None:
        return
    try:
        dims = OpDims.parse(o.einsum)
        dims.check_shapes([r["shape"] for r in o.operands or []], o.output_shapes)
    except NotationError as exc:
        raise GraphError(f"{where} field 'einsum': {exc}") from None


def _check_meta(meta: dict[str, Any], source: str) -> None:
    """The meta keys meshplace computes with must have the right type: ``batch`` (divides
    the throughput into time per sample) a positive integer, ``params`` a count."""
    for key, low in (("batch", 1), ("params", 0)):
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_INT:
            raise GraphError(
                f"{source}: field 'meta.{key}' must be an integer of at least {low} or null "
                f"(got {short_repr(value)})"
            )


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", type(None): "null"}.get(type(value), "a number")


def _describe(exc: ValidationError, data: dict) -> str:
    """One sentence for the first validation error, naming the op by its name."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    where = ""
    if len(loc) >= 2 and loc[0] == "ops" and isinstance(loc[1], int):
        ops = data.get("ops") or []
        raw = ops[loc[1]] if loc[1] < len(ops) else None
        name = raw.get("name") if isinstance(raw, dict) else None
        where = f"op {name!r}" if isinstance(name, str) and name else f"op #{loc[1]}"
        loc = loc[2:]
    elif len(loc) >= 2 and loc[0] == "edges" and isinstance(loc[1], int):
        where = f"edge {loc[1]}"
        loc = loc[2:]
    field_path = ".".join(str(x) for x in loc)
    etype = err["type"]
    if etype == "extra_forbidden":
        allowed = _OP_FIELDS if where.startswith("op") else _allowed_for(where)
        subject = f"{where} has" if where else "the graph has"
        return f"{subject} unknown field {field_path!r}; allowed: {', '.join(allowed)}"
    if etype == "missing":
        subject = where or "the graph"
        return f"{subject} is missing the required field {field_path!r}"
    if etype == "literal_error" and field_path == "format":
        return f"not a meshplace graph (field 'format' must be {FORMAT!r})"
    subject = f"{where} field {field_path!r}" if where else f"field {field_path!r}"
    if etype == "number_type":
        return f"{subject} {err['msg']}"
    value = err.get("input")
    got = ""
    if not isinstance(value, dict | list):
        if isinstance(value, float) and math.isnan(value):
            got = " (got NaN)"
        else:
            got = f" (got {short_repr(value)})"
    msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{subject}: {msg}{got}"


def _allowed_for(where: str) -> list[str]:
    if where.startswith("edge"):
        return list(_EdgeModel.model_fields)
    return list(_GraphModel.model_fields)


__all__ = [
    "FORMAT",
    "MAX_INT",
    "OP_KINDS",
    "PHASES",
    "VERSION",
    "graph_from_dict",
    "graph_from_json",
    "graph_to_dict",
    "graph_to_json",
    "json_number",
    "load_graph",
    "save_graph",
    "unknown_kind_sentence",
]
