"""Co-location groups and coarsening: the units a placer assigns to devices.

Placing 20,000 aten ops one by one is neither necessary nor learnable, so meshplace places
*groups*, built in three steps, every one of which keeps the **group graph acyclic** (a group
graph with a cycle could not be executed or pipelined in any order):

1. **Explicit co-location keys** (Mirhoseini et al., ICML 2017, §3 "co-location groups",
   after TensorFlow's colocation constraints): ops that share :attr:`Op.colocation` are
   merged when that creates no cycle. A parameter and its optimizer-update ops share a key,
   but the parameter feeds the forward pass whose gradient feeds the update, so merging
   them would close a cycle; such keys stay on the groups as a placement preference.
2. **Merging an op into its only consumer** (same paper): a group whose outputs all go to a
   single group joins it. Contracting the only out-edge of a node can never close a cycle.
   ``max_groups`` is a *target*, not only a cap: where the whole pass would leave fewer
   groups than ``min(max_groups, groups so far)`` — it turns a chain of 177 layers into
   one group and leaves a placer no choice — only the lightest such merges are made, down
   to that number.
3. **Coarsening to at most ``max_groups``** (default 256, the hierarchical planner's group
   count): first, greedy contraction of edges that are provably safe — the producer has a
   single consumer group or the consumer a single producer group — lightest pair first so
   groups stay balanced; if that is not enough, the groups are laid out in a topological
   order (ties broken by execution order) and cut into contiguous runs of balanced weight.
   Edges only point forward in a topological order, so runs of it form an acyclic quotient
   (the "acyclic partitioning by topological order" argument of Herrmann et al., SIAM J.
   Sci. Comput. 2019).

What is balanced is each op's measured time where the graph has measured times (a graph
profiled elsewhere may carry no FLOPs), else its FLOPs (:func:`op_weights`).

Complexity: O((V + E) log V) with union–find and per-group adjacency sets merged
small-into-large; the key check in step 1 is a breadth-first search bounded by topological
positions.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("chain")
>>> for i in range(6):
...     _ = g.add_op(Op(f"op{i}", "matmul", flops=10.0))
>>> for i in range(5):
...     g.add_edge(f"op{i}", f"op{i + 1}", 4)
>>> group_ops(g, max_groups=2).num_groups  # the target, not one group
2
>>> group_ops(g, max_groups=None).num_groups  # ColocRL's rule alone: a chain is one group
1
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from meshplace.graph.ir import GraphError, Op, OpGraph

DEFAULT_MAX_GROUPS = 256


class _Quotient:
    """Union–find over ops with the adjacency of the contracted (quotient) graph."""

    def __init__(self, graph: OpGraph, weight: np.ndarray) -> None:
        n = graph.num_ops
        # ops merge only with ops the same devices can run (equal Op.unsupported)
        marks: dict[frozenset[str], int] = {}
        self.runs_on = [marks.setdefault(frozenset(o.unsupported), len(marks)) for o in graph.ops]
        self.parent = list(range(n))
        self.size = [1] * n
        self.weight = weight.astype(float).tolist()
        self.first = list(range(n))  # smallest op index in the group: execution order
        self.succ: list[set[int]] = [set() for _ in range(n)]
        self.pred: list[set[int]] = [set() for _ in range(n)]
        for s, d, _ in graph.edges():
            self.succ[s].add(d)
            self.pred[d].add(s)
        self.alive = n

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def copy(self) -> _Quotient:
        """An independent copy (O(V + E)), to try a pass and keep it or not."""
        other = object.__new__(_Quotient)
        other.parent = list(self.parent)
        other.size = list(self.size)
        other.weight = list(self.weight)
        other.first = list(self.first)
        other.succ = [set(x) for x in self.succ]
        other.pred = [set(x) for x in self.pred]
        other.alive = self.alive
        other.runs_on = list(self.runs_on)
        return other

    def compatible(self, a: int, b: int) -> bool:
        """Roots ``a`` and ``b`` may share a group: the same devices can run their ops."""
        return self.runs_on[a] == self.runs_on[b]

    def merge(self, a: int, b: int) -> int:
        """Contract roots ``a`` and ``b``; the caller guarantees this closes no cycle."""
        if a == b:
            return a
        if self.size[a] < self.size[b]:
            a, b = b, a
        self.parent[b] = a
        self.size[a] += self.size[b]
        self.weight[a] += self.weight[b]
        self.first[a] = min(self.first[a], self.first[b])
        for x in self.succ[b]:
            self.pred[x].discard(b)
            if x != a:
                self.pred[x].add(a)
                self.succ[a].add(x)
        for x in self.pred[b]:
            self.succ[x].discard(b)
            if x != a:
                self.succ[x].add(a)
                self.pred[a].add(x)
        self.succ[a].discard(a)
        self.pred[a].discard(a)
        self.succ[a].discard(b)
        self.pred[a].discard(b)
        self.succ[b] = set()
        self.pred[b] = set()
        self.alive -= 1
        return a

    def roots(self) -> list[int]:
        return [i for i in range(len(self.parent)) if self.parent[i] == i]

    def topological_roots(self) -> list[int]:
        """Roots in topological order, earliest execution first among ready groups."""
        roots = self.roots()
        indeg = {r: len(self.pred[r]) for r in roots}
        ready = [(self.first[r], r) for r in roots if indeg[r] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, r = heapq.heappop(ready)
            order.append(r)
            for s in self.succ[r]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, (self.first[s], s))
        if len(order) != len(roots):  # pragma: no cover - would be a bug in the merges
            raise GraphError("internal: grouping produced a cyclic group graph")
        return order


def _merge_set_if_acyclic(q: _Quotient, members: list[int], position: dict[int, int]) -> None:
    """Merge the groups of ``members`` when no path leaves the set and comes back."""
    roots = sorted({q.find(m) for m in members}, key=position.__getitem__)
    # ``position`` maps each group root to its index in a topological order of the quotient.
    if len(roots) < 2:
        return
    inside = set(roots)
    last = position[roots[-1]]
    # Any path that leaves the set and re-enters it starts at a member's outside successor
    # and stays before the last member in topological order.
    frontier = [s for r in roots for s in q.succ[r] if s not in inside and position[s] < last]
    seen = set(frontier)
    while frontier:
        x = frontier.pop()
        for s in q.succ[x]:
            if s in inside:
                return  # merging would close a cycle through x
            if s not in seen and position[s] < last:
                seen.add(s)
                frontier.append(s)
    merged = roots[0]
    for r in roots[1:]:
        merged = q.merge(merged, r)
    # Positions must stay a topological order of the quotient for the pruning above.
    position.clear()
    position.update({r: i for i, r in enumerate(q.topological_roots())})


@dataclass
class Grouping:
    """An assignment of every op of ``graph`` to a group, groups numbered topologically."""

    graph: OpGraph
    group_of: np.ndarray
    names: list[str]

    @property
    def num_groups(self) -> int:
        return len(self.names)

    def members(self) -> list[list[int]]:
        """Op indices of each group, in execution order."""
        out: list[list[int]] = [[] for _ in self.names]
        for op_idx, g in enumerate(self.group_of.tolist()):
            out[g].append(op_idx)
        return out

    def group_graph(self) -> OpGraph:
        """The quotient as an OpGraph: one op per group with summed costs, edges with the
        summed bytes that cross between groups. Always acyclic."""
        ops = self.graph.ops
        gg = OpGraph(f"{self.graph.name}:groups", meta={"groups_of": self.graph.name})
        for gid, members in enumerate(self.members()):
            gg.add_op(_summarise(self.names[gid], [ops[i] for i in members]))
        crossing: dict[tuple[int, int], float] = {}
        group_of = self.group_of
        for s, d, b in self.graph.edges():
            gs, gd = int(group_of[s]), int(group_of[d])
            if gs != gd:
                crossing[(gs, gd)] = crossing.get((gs, gd), 0.0) + b
        for (gs, gd), b in crossing.items():
            gg.add_edge(gs, gd, b)
        gg.check_acyclic()
        return gg


def _summarise(name: str, members: list[Op]) -> Op:
    by_flops = max(members, key=lambda o: (o.flops, -len(o.module)))
    phases = Counter(o.phase for o in members)
    modules = [o.module for o in members]
    common = _common_module(modules)
    measured: dict[str, float] = {}
    kinds = set.intersection(*(set(o.measured_time) for o in members)) if members else set()
    for k in sorted(kinds):
        measured[k] = float(sum(o.measured_time[k] for o in members))
    keys = sorted({o.colocation for o in members if o.colocation})
    return Op(
        name=name,
        kind=by_flops.kind,
        phase=phases.most_common(1)[0][0],
        module=common,
        flops=float(sum(o.flops for o in members)),
        bytes_read=float(sum(o.bytes_read for o in members)),
        bytes_written=float(sum(o.bytes_written for o in members)),
        param_bytes=int(sum(o.param_bytes for o in members)),
        state_bytes=int(sum(o.state_bytes for o in members)),
        memory_bytes=int(sum(o.output_bytes() for o in members)),
        measured_time=measured,
        unsupported=sorted({u for o in members for u in o.unsupported}),
        colocation=keys[0] if len(keys) == 1 else None,
    )


def _common_module(modules: Iterable[str]) -> str:
    parts = [m.split(".") for m in modules if m]
    if not parts:
        return ""
    prefix = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix)


def group_ops(
    graph: OpGraph,
    max_groups: int | None = DEFAULT_MAX_GROUPS,
    *,
    colocate: bool = True,
    merge_single_consumer: bool = True,
) -> Grouping:
    """Group ``graph``'s ops into at most ``max_groups`` acyclic co-location groups.

    Args:
        graph: the op graph (must be acyclic).
        max_groups: the number of groups to aim for: at most this many, and no merge of
            step 2 takes the count below it (or below the ops' count, if smaller);
            ``None`` skips coarsening and applies step 2 in full.
        colocate: merge ops that share a co-location key where that keeps the graph acyclic.
        merge_single_consumer: ColocRL's rule, merge an op into its only consumer.

    Returns:
        A :class:`Grouping`; ``grouping.group_graph()`` is the acyclic quotient.
    """
    if max_groups is not None and max_groups < 1:
        raise GraphError(f"max_groups must be at least 1, got {max_groups}")
    arrays = graph.arrays()  # validates acyclicity
    n = graph.num_ops
    if n == 0:
        return Grouping(graph, np.zeros(0, dtype=np.int64), [])
    q = _Quotient(graph, op_weights(graph))

    if colocate:
        position = {r: i for i, r in enumerate(q.topological_roots())}
        keyed: dict[str, list[int]] = {}
        for i, o in enumerate(graph.ops):
            if o.colocation:
                keyed.setdefault(o.colocation, []).append(i)
        for members in keyed.values():
            by_devices: dict[int, list[int]] = {}
            for m in members:
                by_devices.setdefault(q.runs_on[m], []).append(m)
            for same in by_devices.values():
                if len(same) > 1:
                    _merge_set_if_acyclic(q, same, position)

    if merge_single_consumer:
        # ColocRL's pass, kept whole where it leaves at least the target; where it would
        # collapse the graph (a chain becomes one group), the lightest such merges only,
        # down to the target, so the placers keep their choices
        floor = 1 if max_groups is None else min(max_groups, q.alive)
        merged = q.copy()
        for op in reversed(arrays.topo_order.tolist()):
            r = merged.find(op)
            if len(merged.succ[r]) == 1:
                (s,) = merged.succ[r]
                if merged.compatible(r, s):
                    merged.merge(r, s)
        if merged.alive >= floor:
            q = merged
        else:
            _contract_safe_edges(q, floor, consumer_side=False)

    if max_groups is not None and q.alive > max_groups:
        _contract_safe_edges(q, max_groups)
    if max_groups is not None and q.alive > max_groups:
        _chunk_topological(q, max_groups)

    order = q.topological_roots()
    label = {r: i for i, r in enumerate(order)}
    group_of = np.array([label[q.find(i)] for i in range(n)], dtype=np.int64)
    return Grouping(graph, group_of, _group_names(graph, group_of, len(order)))


def op_weights(graph: OpGraph) -> np.ndarray:
    """What grouping balances: each op's measured time (the mean over the device kinds it
    was measured on) where the graph has measured times — a graph profiled elsewhere may
    have no FLOPs at all — and its FLOPs otherwise. Ops with no measurement (or no FLOPs)
    still cost a launch: they weigh the mean op's weight. O(V).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("a", "matmul", flops=0.0, measured_time={"gpu": 3.0, "cpu": 5.0}))
    >>> _ = g.add_op(Op("b", "relu"))
    >>> op_weights(g).tolist()
    [4.0, 4.0]
    """
    measured = np.array(
        [
            float(np.mean(list(o.measured_time.values()))) if o.measured_time else 0.0
            for o in graph.ops
        ]
    )
    if np.any(measured > 0):
        return np.where(measured > 0, measured, measured[measured > 0].mean())
    flops = graph.arrays().flops
    return flops + max(float(flops.mean()) if len(flops) else 0.0, 1.0)


# ------------------------------------------------------------- strict co-location
STRICT_KEY = "strict_colocation"
"""``graph.meta[STRICT_KEY]``: ``true`` (every co-location key is strict) or a list of the
keys that are. A strict class must run on one device (docs/formats.md)."""


def check_strict_colocation(graph: OpGraph) -> None:
    """Raise :class:`GraphError` (one sentence) unless ``graph.meta["strict_colocation"]``
    is absent, a boolean, or a list of co-location keys that some op carries."""
    spec = graph.meta.get(STRICT_KEY, False)
    if isinstance(spec, bool):
        return
    if not isinstance(spec, list) or not all(isinstance(k, str) for k in spec):
        raise GraphError(
            f"field 'meta.{STRICT_KEY}' must be true, false or a list of co-location keys, "
            f"not {spec!r}"
        )
    known = {o.colocation for o in graph.ops if o.colocation}
    unknown = next((k for k in spec if k not in known), None)
    if unknown is not None:
        raise GraphError(
            f"field 'meta.{STRICT_KEY}' names co-location key {unknown!r}, which no op carries"
        )


def strict_classes(graph: OpGraph) -> dict[str, list[int]]:
    """The strict co-location classes of ``graph``: key -> its ops' indices in execution
    (topological) order, for the keys ``graph.meta["strict_colocation"]`` makes strict.
    O(V).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g", meta={"strict_colocation": True})
    >>> for name, key in (("f", "k"), ("x", None), ("b", "k")):
    ...     _ = g.add_op(Op(name, "matmul", colocation=key))
    >>> g.add_edge("f", "x", 4); g.add_edge("x", "b", 4)
    >>> strict_classes(g)
    {'k': [0, 2]}
    """
    spec = graph.meta.get(STRICT_KEY, False)
    if spec is False or not graph.num_ops:
        return {}
    keys = None if spec is True else set(spec)
    classes: dict[str, list[int]] = {}
    for i in graph.arrays().topo_order.tolist():
        key = graph.ops[i].colocation
        if key and (keys is None or key in keys):
            classes.setdefault(key, []).append(i)
    return classes


def split_strict_class(
    graph: OpGraph, op_devices: np.ndarray, classes: dict[str, list[int]] | None = None
) -> tuple[str, int, int] | None:
    """The first strict class that ``op_devices`` (device per op) puts on two devices, as
    ``(key, an op, an op on another device)``; ``None`` when every class is whole. O(V)."""
    for key, members in (strict_classes(graph) if classes is None else classes).items():
        first = int(op_devices[members[0]])
        other = next((m for m in members if int(op_devices[m]) != first), None)
        if other is not None:
            return key, members[0], other
    return None


def keep_strict_classes_together(
    op_devices: np.ndarray, classes: dict[str, list[int]]
) -> tuple[np.ndarray, int]:
    """``op_devices`` with every strict class moved onto the device of its first op in
    execution order (a backward op follows its forward op, as TensorFlow's
    ``colocate_gradients_with_ops`` does), and how many ops moved. O(V).

    >>> keep_strict_classes_together(np.array([0, 1, 1]), {"k": [0, 2]})
    (array([0, 1, 0]), 1)
    """
    out = np.array(op_devices, dtype=np.int64, copy=True)
    moved = 0
    for members in classes.values():
        idx = np.asarray(members, dtype=np.int64)
        moved += int(np.count_nonzero(out[idx] != out[idx[0]]))
        out[idx] = out[idx[0]]
    return out, moved


def tied_groups(grouping: Grouping, classes: dict[str, list[int]]) -> np.ndarray:
    """For each group, the group that decides its device: groups holding ops of one strict
    class are *tied* (the class is placed as a unit even where its ops cannot share an
    acyclic group, e.g. a forward op and its backward op), and every tied set follows its
    first group. Without strict classes, each group decides for itself. O(V α(V)).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g", meta={"strict_colocation": True})
    >>> for name, key in (("f", "k"), ("x", None), ("b", "k")):
    ...     _ = g.add_op(Op(name, "matmul", flops=1.0, colocation=key))
    >>> g.add_edge("f", "x", 4); g.add_edge("x", "b", 4)
    >>> grouping = group_ops(g, max_groups=3, merge_single_consumer=False)
    >>> grouping.num_groups, tied_groups(grouping, strict_classes(g)).tolist()
    (3, [0, 1, 0])
    """
    parent = list(range(grouping.num_groups))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for members in classes.values():
        groups = sorted({int(grouping.group_of[m]) for m in members})
        root = find(groups[0])
        for g in groups[1:]:
            other = find(g)
            if other != root:
                parent[max(root, other)] = min(root, other)
                root = min(root, other)
    return np.array([find(g) for g in range(grouping.num_groups)], dtype=np.int64)


def _contract_safe_edges(q: _Quotient, max_groups: int, *, consumer_side: bool = True) -> None:
    """Contract edges whose producer has one consumer group or (``consumer_side``) whose
    consumer has one producer group, lightest resulting group first, between groups the
    same devices can run, until ``max_groups`` remain or no such edge is left. With
    ``consumer_side=False`` this is ColocRL's merge-into-the-only-consumer rule, lightest
    first (step 2's fallback). O((V + E) log V)."""
    heap: list[tuple[float, int, int]] = []

    def push_candidates(r: int) -> None:
        if len(q.succ[r]) == 1:
            (s,) = q.succ[r]
            if q.compatible(r, s):
                heapq.heappush(heap, (q.weight[r] + q.weight[s], r, s))
        if consumer_side and len(q.pred[r]) == 1:
            (p,) = q.pred[r]
            if q.compatible(p, r):
                heapq.heappush(heap, (q.weight[r] + q.weight[p], p, r))

    for r in q.roots():
        push_candidates(r)
    while heap and q.alive > max_groups:
        w, a, b = heapq.heappop(heap)
        if q.parent[a] != a or q.parent[b] != b or b not in q.succ[a]:
            continue
        if not (len(q.succ[a]) == 1 or (consumer_side and len(q.pred[b]) == 1)):
            continue
        if w != q.weight[a] + q.weight[b]:
            continue  # stale entry; a fresh one was pushed when the weight changed
        r = q.merge(a, b)
        push_candidates(r)
        for x in (list(q.succ[r]) if consumer_side else []) + list(q.pred[r]):
            push_candidates(x)


def _chunk_topological(q: _Quotient, max_groups: int) -> None:
    """Cut a topological order of the groups into at most ``max_groups`` contiguous runs of
    about equal weight (each then cut where the ops' ``unsupported`` marks change)."""
    order = q.topological_roots()
    total = sum(q.weight[r] for r in order)
    target = total / max_groups
    runs: list[list[int]] = [[]]
    acc = 0.0
    for r in order:
        w = q.weight[r]
        if runs[-1] and acc + w > target * len(runs) and len(runs) < max_groups:
            runs.append([])
        runs[-1].append(r)
        acc += w
    for run in runs:
        # a run holding ops different devices can run is cut where the mark changes (so
        # the count can then exceed max_groups)
        merged = run[0]
        for r in run[1:]:
            merged = q.merge(merged, r) if q.compatible(merged, r) else r


def _group_names(graph: OpGraph, group_of: np.ndarray, count: int) -> list[str]:
    best: list[tuple[float, int]] = [(-1.0, -1)] * count
    for i, o in enumerate(graph.ops):
        g = int(group_of[i])
        if o.flops > best[g][0]:
            best[g] = (o.flops, i)
    names = []
    for g, (_, i) in enumerate(best):
        o = graph.ops[i]
        label = o.module or o.kind
        names.append(f"g{g}:{label}:{o.phase}")
    return names
