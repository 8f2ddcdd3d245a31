"""What a user wants to know about a graph at a glance: ops, parameters, FLOPs, memory.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("two")
>>> _ = g.add_op(Op("w", "parameter", param_bytes=64, output_shapes=[[4, 4]]))
>>> _ = g.add_op(Op("mm", "matmul", flops=128.0, output_shapes=[[4, 4]]))
>>> g.add_edge("w", "mm", 64)
>>> summarize(g)["flops_forward"]
128.0
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from meshplace.graph.groups import DEFAULT_MAX_GROUPS, group_ops
from meshplace.graph.ir import OpGraph


def summarize(graph: OpGraph, max_groups: int | None = DEFAULT_MAX_GROUPS) -> dict[str, Any]:
    """A JSON-ready summary of ``graph``.

    Keys: ``name``, ``ops``, ``edges``, ``params`` (trainable parameter count; ``None``
    where the graph has parameter bytes but no parameter ops to count them from),
    ``param_bytes`` (parameters and buffers), ``state_bytes`` (optimizer state),
    ``flops_forward``/``flops_backward``/``flops_update``/``flops_total``,
    ``activation_bytes`` (forward outputs that backward ops read: what a training step keeps
    alive between its passes; for an inference graph, all forward outputs),
    ``ops_by_phase``, ``ops_by_kind``, ``elementwise_targets`` (captured aten target →
    number of its ops costed as element-wise by :mod:`meshplace.graph.flops`, a few FLOPs
    per output element; most first: an op with real arithmetic listed here is mis-costed),
    ``groups`` and ``meta``. O(V + E).
    """
    ops = graph.ops
    params = graph.meta.get("params")
    if params is None:
        params = sum(
            math.prod(o.output_shapes[0]) for o in ops if o.kind == "parameter" and o.output_shapes
        )
        if not params and graph.param_bytes():
            # a graph profiled elsewhere: parameter bytes on its ops but no parameter ops to
            # count elements of, and no dtype to divide by — unknown, not 0
            params = None
    phase_of = [o.phase for o in ops]
    training = any(p == "backward" for p in phase_of)
    saved: dict[int, float] = {}
    if training:
        for s, d, _ in graph.edges():
            if phase_of[s] == "forward" and phase_of[d] == "backward":
                src = ops[s]
                if src.kind not in ("parameter", "buffer", "input"):
                    saved[s] = float(src.output_bytes())
        activation = sum(saved.values())
    else:
        activation = float(
            sum(o.output_bytes() for o in ops if o.kind not in ("parameter", "buffer", "input"))
        )
    grouping = group_ops(graph, max_groups) if ops else None
    flops = {p: graph.total_flops(p) for p in ("forward", "backward", "update")}
    elementwise = Counter(o.target for o in ops if o.kind == "elementwise" and o.target)
    return {
        "name": graph.name,
        "ops": graph.num_ops,
        "edges": graph.num_edges,
        "params": int(params) if params is not None else None,
        "param_bytes": graph.param_bytes(),
        "state_bytes": int(sum(o.state_bytes for o in ops)),
        "flops_forward": flops["forward"],
        "flops_backward": flops["backward"],
        "flops_update": flops["update"],
        "flops_total": float(sum(flops.values())),
        "activation_bytes": activation,
        "ops_by_phase": graph.count_by("phase"),
        "ops_by_kind": graph.count_by("kind"),
        "elementwise_targets": dict(elementwise.most_common()),
        "groups": grouping.num_groups if grouping else 0,
        "max_groups": max_groups,
        "training": training,
        "meta": graph.meta,
    }


def traced_batch(graph: OpGraph) -> int | None:
    """The batch a captured graph was traced at: the leading dimension every input shares
    (``None`` when the inputs disagree, or one is a scalar, or there are none). O(V).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("input:ids", "input", output_shapes=[[4, 32]]))
    >>> traced_batch(g)
    4
    """
    shapes = [o.output_shapes[0] if o.output_shapes else [] for o in graph.ops if o.kind == "input"]
    if any(len(shape) == 0 for shape in shapes):
        return None  # a scalar input cannot be split into micro-batches
    leading = {int(shape[0]) for shape in shapes}
    return leading.pop() if len(leading) == 1 else None


def human(value: float, unit: str = "") -> str:
    """``1.23e9`` → ``"1.23 G"`` (decimal prefixes; bytes use binary ones)."""
    if unit == "B":
        for prefix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {prefix}B"
        return f"{value:.0f} B"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()
