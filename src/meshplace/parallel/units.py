"""A model's pipeline units where its layers are not identical: ResNet's blocks, an
encoder's and a decoder's layers, the stem and head around them.

The hybrid search (:mod:`meshplace.parallel.hybrid`) prices a stack of identical layers by
one layer. A model without such a stack is cut between *units* instead: each member of a
numbered container (``layer1.0``, ``encoder.layers.3``) is a unit, and the ops between them
outside any numbered container (a stem, an embedding, a head and the loss) are one unit per
run. Units follow execution order, so a forward tensor only ever flows from a unit to a
later one, and any cut between units is a pipeline stage boundary that sends forward
(Alpa, Zheng et al., OSDI 2022, §5.2, cuts a model's operator sequence into contiguous
layers the same way, there by clustering operators). Each op is attributed to a unit:
a forward op by its module, a backward op beside its forward op, a parameter (its
optimizer state and update) beside its first forward reader.

:func:`best_unit_split` is the pipeline DP over (first unit, last unit) ranges — the
identical-layer DP of :func:`meshplace.parallel.hybrid.best_split` indexes a stage by its
layer count only.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("g")
>>> for m in ("conv1", "bn1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.conv1", "fc"):
...     _ = g.add_op(Op(m, "conv", module=m))
>>> op_units(g)[0]
['conv1…bn1', 'layer1.0', 'layer2.0', 'fc']
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph

NOT_COMPUTE = ("parameter", "buffer", "input")


def unit_key(module: str) -> str | None:
    """The numbered-container member an op's module lies in (``layer1.0`` for
    ``layer1.0.downsample.0``: the outermost), or ``None`` outside every numbered
    container (a top-level ``Sequential``'s index counts only below the top).

    >>> unit_key("encoder.layers.3.ffn.fc1"), unit_key("conv1"), unit_key("")
    ('encoder.layers.3', None, None)
    """
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if i > 0 and part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def op_units(graph: OpGraph) -> tuple[list[str], np.ndarray]:
    """The units of ``graph`` in execution order (their names) and each op's unit (module
    docstring). Consecutive forward ops outside numbered containers form one unit, named
    by its first and last top-level module. Raises :class:`InputError` (one sentence)
    when a container member's forward ops are not contiguous in execution order (an
    unrolled RNN's layers interleave time step by time step: no cut separates them) or
    when the graph has fewer than two units. O(V + E).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for name, m in (("a", "embed"), ("b", "enc.0"), ("c", "enc.1"), ("d", "head")):
    ...     _ = g.add_op(Op(name, "matmul", module=m))
    >>> names, unit = op_units(g)
    >>> names, unit.tolist()
    (['embed', 'enc.0', 'enc.1', 'head'], [0, 1, 2, 3])
    """
    ops = graph.ops
    n = len(ops)
    unit = np.full(n, -1, dtype=np.int64)
    names: list[str] = []
    runs: dict[str, int] = {}
    current: str | None = None
    open_run = False
    loose: list[str] = []  # top-level modules of the current unit outside containers
    for i, o in enumerate(ops):
        if o.kind in NOT_COMPUTE or o.phase != "forward":
            continue
        key = unit_key(o.module or "")
        if not open_run or key != current:
            if key is not None and key in runs:
                raise InputError(
                    f"graph {graph.name!r}: {key}'s forward ops are not contiguous in "
                    "execution order (its layers interleave, as an unrolled RNN's do), so no "
                    "pipeline cut separates them"
                )
            if loose:
                names[-1] = _run_name(loose)
            loose = []
            names.append(key or "")
            if key is not None:
                runs[key] = len(names) - 1
            current, open_run = key, True
        if key is None:
            top = (o.module or "(model)").split(".")[0]
            if not loose or loose[-1] != top:
                loose.append(top)
        unit[i] = len(names) - 1
    if loose:
        names[-1] = _run_name(loose)
    if len(names) < 2:
        raise InputError(
            f"graph {graph.name!r} has fewer than two pipeline units (numbered layers or "
            "the ops around them): nothing to cut into stages"
        )
    _attribute_rest(graph, unit, len(names))
    return names, unit


def _run_name(tops: Sequence[str]) -> str:
    """A unit outside numbered containers, by its first and last top-level module
    (functional ops at the top, ``(model)``, only when there is no module)."""
    named = [t for t in dict.fromkeys(tops) if t != "(model)"] or ["(model)"]
    return named[0] if len(named) == 1 else f"{named[0]}…{named[-1]}"


def _attribute_rest(graph: OpGraph, unit: np.ndarray, n_units: int) -> None:
    """Every op that is not a forward compute op, in place: a backward op beside its
    forward op (else beside its first attributed input), a parameter, buffer or input
    beside its first forward reader, an update op beside its module's first parameter;
    whatever is left, the last unit."""
    ops = graph.ops
    a = graph.arrays()
    index = {o.name: i for i, o in enumerate(ops)}
    succ: list[list[int]] = [[] for _ in ops]
    pred: list[list[int]] = [[] for _ in ops]
    for s, d in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True):
        succ[s].append(d)
        pred[d].append(s)
    for i in a.topo_order.tolist():
        o = ops[i]
        if unit[i] >= 0 or o.phase != "backward" or o.kind in NOT_COMPUTE:
            continue
        f = index.get(o.forward_op) if o.forward_op else None
        if f is not None and unit[f] >= 0:
            unit[i] = unit[f]
        else:
            known = [unit[p] for p in pred[i] if unit[p] >= 0]
            unit[i] = known[0] if known else n_units - 1
    for i, o in enumerate(ops):
        if unit[i] < 0 and o.kind in NOT_COMPUTE:
            readers = [d for d in succ[i] if ops[d].phase == "forward" and unit[d] >= 0]
            unit[i] = unit[min(readers)] if readers else n_units - 1
    owner: dict[str, int] = {}
    for i, o in enumerate(ops):
        if o.kind == "parameter":
            owner.setdefault(o.module or "", i)
    for i, o in enumerate(ops):
        if unit[i] < 0:
            j = owner.get(o.module or "")
            unit[i] = unit[j] if j is not None else n_units - 1


def boundary_bytes(graph: OpGraph, unit: np.ndarray, n_units: int) -> np.ndarray:
    """``[n_units + 1]``: the forward activation bytes that cross the cut before unit
    ``c`` (each tensor once, however many later units read it: a skip connection or an
    encoder's output read by every decoder layer is relayed stage to stage); zero at
    both ends. O(E).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for name in "abc":
    ...     _ = g.add_op(Op(name, "matmul", module=f"s.{'abc'.index(name)}"))
    >>> g.add_edge("a", "b", 10); g.add_edge("a", "c", 10); g.add_edge("b", "c", 5)
    >>> boundary_bytes(g, np.array([0, 1, 2]), 3).tolist()
    [0.0, 10.0, 15.0, 0.0]
    """
    return boundary_crossings(graph, unit, n_units)[0]


def boundary_crossings(
    graph: OpGraph, unit: np.ndarray, n_units: int
) -> tuple[np.ndarray, np.ndarray]:
    """``([n_units + 1] bytes, [n_units + 1] values)`` crossing the cut before unit
    ``c``: :func:`boundary_bytes` and how many tensors make them up (each a message of its
    own in torch's pipelining). O(E).

    >>> from meshplace.graph.ir import Op
    >>> g = OpGraph("g")
    >>> for name in "abc":
    ...     _ = g.add_op(Op(name, "matmul", module=f"s.{'abc'.index(name)}"))
    >>> g.add_edge("a", "b", 10); g.add_edge("a", "c", 10); g.add_edge("b", "c", 5)
    >>> boundary_crossings(g, np.array([0, 1, 2]), 3)[1].tolist()
    [0.0, 1.0, 2.0, 0.0]
    """
    ops = graph.ops
    a = graph.arrays()
    last_reader: dict[int, int] = {}
    size: dict[int, float] = {}
    for s, d, nbytes in zip(
        a.edge_src.tolist(), a.edge_dst.tolist(), a.edge_bytes.tolist(), strict=True
    ):
        if ops[s].phase != "forward" or ops[d].phase != "forward":
            continue
        if ops[s].kind in ("parameter", "buffer") or unit[d] <= unit[s]:
            continue
        last_reader[s] = max(last_reader.get(s, -1), int(unit[d]))
        size[s] = max(size.get(s, 0.0), float(nbytes))
    crossing = np.zeros(n_units + 1)
    values = np.zeros(n_units + 1)
    for s, last in last_reader.items():
        crossing[int(unit[s]) + 1 : last + 1] += size[s]
        values[int(unit[s]) + 1 : last + 1] += 1
    return crossing, values


def shared_parameters(graph: OpGraph, unit: np.ndarray) -> dict[int, list[int]]:
    """Parameters read in forward by more than one unit (a tied embedding): each one's
    reader units, in order; the first holds it, any stage holding another must keep a
    copy and exchange its gradient once per batch. O(E)."""
    ops = graph.ops
    a = graph.arrays()
    readers: dict[int, set[int]] = {}
    for s, d in zip(a.edge_src.tolist(), a.edge_dst.tolist(), strict=True):
        if ops[s].kind == "parameter" and ops[d].phase == "forward":
            readers.setdefault(s, set()).add(int(unit[d]))
    return {p: sorted(r) for p, r in readers.items() if len(r) > 1}


# ------------------------------------------------------------------ the pipeline DP
def best_unit_split(
    stage_time: np.ndarray, feasible: np.ndarray, micro_batches: int
) -> tuple[float, list[int], list[int]]:
    """The split of ``U`` units into ``p`` contiguous stages, with one option
    (recomputation) per stage, minimising ``Σ_i t_i + (m - 1) max_i t_i`` (Alpa, Zheng et
    al., OSDI 2022, §5.2).

    ``stage_time[i, s, e, r]``: seconds per micro-batch of stage ``i`` holding units
    ``s..e-1`` with option ``r`` (``s < e``); ``feasible`` the same shape. For each
    candidate bottleneck ``t_max`` a DP over (stage, units placed) minimises ``Σ t_i`` over
    stages no slower than it; the smallest feasible ``t_max`` is found by bisection, then
    larger ones are tried while ``(m - 1) t_max`` plus the unconstrained ``Σ`` can win.
    Returns ``(objective, stage boundaries [0, e_0, ..., U], option per stage)``, or
    ``(inf, [], [])``.

    Complexity: ``O(log(p U^2 R) + tried) x p U^2``.

    >>> t = np.full((2, 4, 4, 1), np.inf)
    >>> for s in range(4):
    ...     for e in range(s + 1, 4):
    ...         t[:, s, e, 0] = e - s  # a unit takes a second
    >>> best_unit_split(t, np.isfinite(t), micro_batches=4)  # 1 + 2 + 3 x 2
    (9.0, [0, 1, 3], [0, 0])
    """
    p, n_s, _, _ = stage_time.shape
    n_units = n_s - 1
    upper = np.triu(np.ones((n_s, n_s), dtype=bool), k=1)[None, :, :, None]
    ok = feasible & upper & np.isfinite(stage_time)
    finite = stage_time[ok]
    if not finite.size or p > n_units:
        return float("inf"), [], []
    candidates = np.unique(finite)

    def solve(t_max: float) -> tuple[float, list[int], list[int]]:
        masked = np.where(ok & (stage_time <= t_max), stage_time, np.inf)
        option = np.argmin(masked, axis=3)  # [p, s, e]
        cost = np.take_along_axis(masked, option[..., None], axis=3)[..., 0]
        f = np.full(n_s, np.inf)
        f[0] = 0.0
        back: list[np.ndarray] = []
        for i in range(p):
            total = f[:, None] + cost[i]
            arg = np.argmin(total, axis=0)
            f = total[arg, np.arange(n_s)]
            back.append(arg)
        if not np.isfinite(f[n_units]):
            return float("inf"), [], []
        bounds = [n_units]
        for i in reversed(range(p)):
            bounds.append(int(back[i][bounds[-1]]))
        bounds.reverse()
        options = [int(option[i, bounds[i], bounds[i + 1]]) for i in range(p)]
        return float(f[n_units]), bounds, options

    def slowest(bounds: list[int], options: list[int]) -> float:
        return max(float(stage_time[i, bounds[i], bounds[i + 1], options[i]]) for i in range(p))

    return bottleneck_search(candidates, solve, slowest, micro_batches)


def bottleneck_search(
    candidates: np.ndarray,
    solve: Callable[[float], tuple[float, list[int], list[int]]],
    slowest: Callable[[list[int], list[int]], float],
    micro_batches: int,
) -> tuple[float, list[int], list[int]]:
    """Alpa's outer loop (Zheng et al., OSDI 2022, §5.2) over the sorted candidate
    bottlenecks: ``solve(t_max)`` gives the least ``Σ t_i`` over stages no slower than
    ``t_max`` (``inf`` if none), with the split and options; ``slowest`` the real
    bottleneck of a split. Feasibility grows with ``t_max``, so the smallest feasible one
    is found by bisection; larger ones are tried while ``(m - 1) t_max`` plus the
    unconstrained ``Σ`` can still beat the best ``Σ + (m - 1) max``. One micro-batch:
    the unconstrained minimum is the optimum. O(log K + tried) solves."""
    lo, hi = 0, len(candidates) - 1
    loosest = solve(float(candidates[hi]))
    if not np.isfinite(loosest[0]):
        return float("inf"), [], []
    if micro_batches == 1:
        return loosest
    while lo < hi:  # the smallest feasible bottleneck
        mid = (lo + hi) // 2
        if np.isfinite(solve(float(candidates[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    floor_sum = loosest[0]  # Σ with no bottleneck limit: a lower bound
    best: tuple[float, list[int], list[int]] = (float("inf"), [], [])
    for t_max in candidates[lo:]:
        if (micro_batches - 1) * float(t_max) + floor_sum >= best[0]:
            break
        total, split, options = solve(float(t_max))
        if not np.isfinite(total):
            continue
        value = total + (micro_batches - 1) * slowest(split, options)
        if value < best[0] - 1e-15:
            best = (value, split, options)
    return best


def brute_force_unit_split(
    stage_time: np.ndarray, feasible: np.ndarray, micro_batches: int
) -> tuple[float, list[int], list[int]]:
    """:func:`best_unit_split` by enumerating every set of cuts and every option per
    stage (the tests' oracle; exponential)."""
    p, n_s, _, n_r = stage_time.shape
    n_units = n_s - 1
    best: tuple[float, list[int], list[int]] = (float("inf"), [], [])
    for cuts in itertools.combinations(range(1, n_units), p - 1):
        bounds = [0, *cuts, n_units]
        for options in itertools.product(range(n_r), repeat=p):
            cells = [(i, bounds[i], bounds[i + 1], options[i]) for i in range(p)]
            if not all(feasible[c] and np.isfinite(stage_time[c]) for c in cells):
                continue
            times = [float(stage_time[c]) for c in cells]
            value = sum(times) + (micro_batches - 1) * max(times)
            if value < best[0] - 1e-15:
                best = (value, bounds, list(options))
    return best
