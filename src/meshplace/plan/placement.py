"""Placement plans: which device runs each op (or each co-location group).

A plan file is versioned JSON (``docs/formats.md``). It names the graph it was made for by
name, op count and a fingerprint of the op names, so a plan is never silently applied to a
different graph; every op or group it places must exist, and every device must be in the
cluster. Ops the plan does not name go to ``default_device`` if it sets one.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("g")
>>> _ = g.add_op(Op("a", "matmul")); _ = g.add_op(Op("b", "matmul"))
>>> plan = Plan.for_graph(g, "my-cluster", {"a": "gpu:0"}, default_device="cpu:0")
>>> plan.device_names(g)
['gpu:0', 'cpu:0']
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from meshplace.errors import InputError
from meshplace.graph.groups import split_strict_class
from meshplace.graph.io import json_number
from meshplace.graph.ir import OpGraph
from meshplace.util import (
    finite_or_none,
    parse_json,
    read_text_file,
    short_repr,
    write_text_atomic,
)

FORMAT = "meshplace.plan"
VERSION = 1


class PlanError(InputError):
    """A plan that does not match its graph or cluster, or a malformed plan file."""


def graph_fingerprint(graph: OpGraph) -> str:
    """A short hash of the op names in order and the edge count: equal for the same graph
    captured twice, different once an op is added, removed or renamed."""
    h = hashlib.sha256()
    for o in graph.ops:
        h.update(o.name.encode())
        h.update(b"\0")
    h.update(str(graph.num_edges).encode())
    return h.hexdigest()[:16]


_Int = Annotated[int, BeforeValidator(json_number)]


class _PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["meshplace.plan"]
    version: _Int
    graph: Annotated[str, Field(min_length=1)]
    graph_ops: Annotated[_Int, Field(ge=0)]
    graph_fingerprint: str | None = None
    cluster: str = ""
    by: Literal["op", "group"] = "op"
    max_groups: Annotated[_Int, Field(ge=1)] | None = None
    placement: dict[str, str] = Field(default_factory=dict)
    default_device: str | None = None
    objective: Literal["step", "throughput"] = "step"
    micro_batches: Annotated[_Int, Field(ge=1, le=1 << 20)] = 1
    meta: dict[str, Any] = Field(default_factory=dict)


@dataclass
class Plan:
    """A placement of a graph's ops (``by="op"``) or co-location groups (``by="group"``)."""

    graph: str
    graph_ops: int
    placement: dict[str, str]
    cluster: str = ""
    graph_fingerprint: str | None = None
    by: str = "op"
    max_groups: int | None = None
    default_device: str | None = None
    objective: str = "step"
    micro_batches: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_graph(
        cls,
        graph: OpGraph,
        cluster: str,
        placement: Mapping[str, str],
        **kwargs: Any,
    ) -> Plan:
        """A plan bound to ``graph`` (its name, op count and fingerprint)."""
        return cls(
            graph=graph.name,
            graph_ops=graph.num_ops,
            graph_fingerprint=graph_fingerprint(graph),
            cluster=cluster,
            placement=dict(placement),
            **kwargs,
        )

    @classmethod
    def from_devices(
        cls, graph: OpGraph, cluster: str, device_names: Sequence[str], **kwargs: Any
    ) -> Plan:
        """A per-op plan from one device name per op (in graph order)."""
        if len(device_names) != graph.num_ops:
            raise PlanError(
                f"a placement needs one device per op: got {len(device_names)} for "
                f"{graph.num_ops} ops"
            )
        return cls.for_graph(
            graph, cluster, {o.name: d for o, d in zip(graph.ops, device_names)}, **kwargs
        )

    # ------------------------------------------------------------------ checks
    def check_graph(self, graph: OpGraph, source: str = "plan") -> None:
        """Raise :class:`PlanError` unless this plan was made for ``graph``, saying what
        differs: the op count, else an op the plan places that the graph lacks, else the
        fingerprint (op names, their order or the edge count).

        >>> from meshplace.graph.ir import Op, OpGraph
        >>> a, b = OpGraph("tiny"), OpGraph("tiny")
        >>> _ = a.add_op(Op("x", "input")); _ = b.add_op(Op("y", "input"))
        >>> Plan.for_graph(a, "c", {"x": "gpu0"}).check_graph(b, "p.json")
        Traceback (most recent call last):
        ...
        meshplace.plan.placement.PlanError: p.json: was made for graph 'tiny' with 1 ops, but \
the graph given, 'tiny' (also 1 ops), has no op 'x', which the plan places; make the plan ...
        """
        fp = graph_fingerprint(graph)
        same_count = self.graph_ops == graph.num_ops
        if same_count and self.graph_fingerprint in (None, fp):
            return
        if not same_count:
            reason = f"the graph given, {graph.name!r}, has {graph.num_ops} ops"
        else:
            given = f"the graph given, {graph.name!r} (also {graph.num_ops} ops),"
            missing = None
            if self.by == "op":
                missing = next((n for n in self.placement if n not in graph), None)
            if missing is not None:
                reason = f"{given} has no op {missing!r}, which the plan places"
            else:
                reason = (
                    f"{given} differs in its op names, their order or its edge count "
                    f"(fingerprint {fp}, the plan's {self.graph_fingerprint})"
                )
        raise PlanError(
            f"{source}: was made for graph {self.graph!r} with {self.graph_ops} ops, but "
            f"{reason}; make the plan again for this graph"
        )

    def device_names(self, graph: OpGraph, source: str = "plan") -> list[str]:
        """One device name per op of ``graph`` (expanding groups and the default)."""
        self.check_graph(graph, source)
        if self.by == "group":
            return self._expand_groups(graph, source)
        names: list[str | None] = [None] * graph.num_ops
        for op_name, dev in self.placement.items():
            if op_name not in graph:
                raise PlanError(
                    f"{source}: places op {op_name!r}, which graph {graph.name!r} does not have"
                )
            names[graph.index(op_name)] = dev
        return self._fill_default(graph, names, source, "op")

    def _expand_groups(self, graph: OpGraph, source: str) -> list[str]:
        from meshplace.graph.groups import DEFAULT_MAX_GROUPS, group_ops

        grouping = group_ops(graph, self.max_groups or DEFAULT_MAX_GROUPS)
        index = {name: i for i, name in enumerate(grouping.names)}
        by_group: list[str | None] = [None] * grouping.num_groups
        for group_name, dev in self.placement.items():
            if group_name not in index:
                raise PlanError(
                    f"{source}: places group {group_name!r}, which graph {graph.name!r} "
                    f"grouped into {grouping.num_groups} groups does not have"
                )
            by_group[index[group_name]] = dev
        filled = self._fill_default(graph, by_group, source, "group", grouping.names)
        return [filled[g] for g in grouping.group_of.tolist()]

    def _fill_default(
        self,
        graph: OpGraph,
        names: list[str | None],
        source: str,
        unit: str,
        unit_names: Sequence[str] | None = None,
    ) -> list[str]:
        missing = [i for i, n in enumerate(names) if n is None]
        if missing and self.default_device is None:
            label = unit_names[missing[0]] if unit_names else graph.ops[missing[0]].name
            raise PlanError(
                f"{source}: leaves {len(missing)} {unit}s unplaced (first: {label!r}); place "
                "them or set default_device"
            )
        return [n if n is not None else str(self.default_device) for n in names]

    def device_indices(
        self, graph: OpGraph, device_index: Mapping[str, int], cluster_name: str, source: str
    ) -> np.ndarray:
        """Device index per op, checking every device exists in the cluster."""
        names = self.device_names(graph, source)
        out = np.empty(len(names), dtype=np.int64)
        for i, dev in enumerate(names):
            idx = device_index.get(dev)
            if idx is None:
                close = difflib.get_close_matches(dev, list(device_index), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                shown = ", ".join(list(device_index)[:8])
                more = ", …" if len(device_index) > 8 else ""
                raise PlanError(
                    f"{source}: places op {graph.ops[i].name!r} on device {dev!r}, which "
                    f"cluster {cluster_name!r} does not have (devices: {shown}{more}){hint}"
                )
            out[i] = idx
        by_index = sorted(device_index, key=device_index.__getitem__)  # by index
        check_strict_colocation_kept(graph, out, by_index, source)
        return out

    # ---------------------------------------------------------------------- IO
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "graph": self.graph,
            "graph_ops": self.graph_ops,
            "graph_fingerprint": self.graph_fingerprint,
            "cluster": self.cluster,
            "by": self.by,
            "max_groups": self.max_groups,
            "placement": self.placement,
            "default_device": self.default_device,
            "objective": self.objective,
            "micro_batches": self.micro_batches,
            "meta": self.meta,
        }


def check_strict_colocation_kept(
    graph: OpGraph, op_devices: np.ndarray, device_names: Sequence[str], source: str
) -> None:
    """Raise :class:`PlanError` (one sentence naming the class, two of its ops and their
    devices) when ``op_devices`` (device index per op into ``device_names``) splits a
    strict co-location class of ``graph``.

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g", meta={"strict_colocation": True})
    >>> for name in ("f", "b"):
    ...     _ = g.add_op(Op(name, "matmul", colocation="k"))
    >>> g.add_edge("f", "b", 4)
    >>> check_strict_colocation_kept(g, np.array([0, 1]), ["gpu0", "gpu1"], "p.json")
    Traceback (most recent call last):
    ...
    meshplace.plan.placement.PlanError: p.json: splits strict co-location class 'k': op 'f' \
is on gpu0 but op 'b' on gpu1; a strict class runs on one device
    """
    split = split_strict_class(graph, op_devices)
    if split is not None:
        key, a, b = split
        raise PlanError(
            f"{source}: splits strict co-location class {key!r}: op {graph.ops[a].name!r} "
            f"is on {device_names[int(op_devices[a])]} but op {graph.ops[b].name!r} on "
            f"{device_names[int(op_devices[b])]}; a strict class runs on one device"
        )


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` atomically."""
    # strict JSON: an infinitely slow plan's times become null
    write_text_atomic(path, json.dumps(finite_or_none(plan.to_dict()), indent=1, allow_nan=False))


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise PlanError(f"{source}: the top level must be a JSON object")
    try:
        m = _PlanModel.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise PlanError(
                f"{source}: unknown field {loc!r}; allowed: {', '.join(_PlanModel.model_fields)}"
            ) from None
        if err["type"] == "literal_error" and loc == "format":
            raise PlanError(
                f"{source}: not a meshplace plan (field 'format' must be {FORMAT!r})"
            ) from None
        if err["type"] == "number_type":
            raise PlanError(f"{source}: field {loc!r} {err['msg']}") from None
        if err["type"] == "missing":
            raise PlanError(f"{source}: is missing the required field {loc!r}") from None
        msg = err["msg"][0].lower() + err["msg"][1:]
        value = err.get("input")
        got = "" if isinstance(value, dict | list) else f" (got {short_repr(value)})"
        raise PlanError(f"{source}: field {loc!r}: {msg}{got}") from None
    if m.version != VERSION:
        raise PlanError(
            f"{source}: unsupported plan format version {m.version}; this meshplace reads "
            f"version {VERSION}"
        )
    if m.by == "group" and m.max_groups is None:
        raise PlanError(f"{source}: a plan by group must say max_groups")
    return Plan(
        graph=m.graph,
        graph_ops=m.graph_ops,
        graph_fingerprint=m.graph_fingerprint,
        cluster=m.cluster,
        by=m.by,
        max_groups=m.max_groups,
        placement=m.placement,
        default_device=m.default_device,
        objective=m.objective,
        micro_batches=m.micro_batches,
        meta=m.meta,
    )


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; every problem (a missing file, a folder, a binary
    file, bad or ambiguous JSON, a bad field) is one :class:`PlanError` sentence."""
    text = read_text_file(path, "plan", PlanError)
    return plan_from_dict(parse_json(text, str(path), "plan", PlanError), str(path))
