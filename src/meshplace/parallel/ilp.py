"""Choosing one strategy per node of a graph: the integer program and a brute-force check.

Source: the intra-operator pass of Alpa (Zheng et al., OSDI 2022, Sec. 4.2), itself after
XLA's auto-sharding: a binary ``x[v, s]`` per node ``v`` and strategy ``s`` (exactly one
per node), node costs linear in ``x``, and an edge cost ``c[e](s, t)`` for each pair of
strategies at the two ends of an edge, linearised with continuous ``y[e, s, t] >= 0`` and
the transportation constraints ``sum_t y[e,s,t] = x[u,s]``, ``sum_s y[e,s,t] = x[v,t]``
(whose LP relaxation is tighter than ``y >= x[u,s] + x[v,t] - 1``). A memory limit is one
more linear row: ``sum memory[v,s] x[v,s] + T <= capacity`` with ``T >= transient[v,s]
x[v,s]`` for every node (the largest working set of one op, on top of what stays
resident). Solved by HiGHS (``highspy``) branch and bound. Least memory
(``minimise="memory"``) needs no branch and bound: :func:`least_memory` finds it exactly
in closed form, and proves a memory limit infeasible before the integer program is built.

Communication that overlaps compute enters as *exposures*: a continuous ``e >= 0`` added
to the objective with rows ``e >= R[k] . q`` for every row ``k``, where each ``q_j`` is a
linear form of the choice (a :class:`Quantity`: per node a value per strategy, per edge a
value per pair of strategies; one equality row defines it). Minimising makes
``e = max(0, max_k R[k] . q)`` — exactly the exposed tail of a collective stream that runs
beside compute (:meth:`meshplace.parallel.sharding.ShardingProblem.cost_tables`), whose
finish time is a maximum over the events it could start from. A ``Quantity`` is a value *per
instance* of a class, so a row sums counts of instances, not dense per-strategy terms.

Nodes here are *classes*: identical repeated blocks share one set of variables, their
costs and memory summed (the caller multiplies), so a 100-layer model costs one layer.

Complexity: variables ``sum_v S_v + sum_e S_u S_v``; rows ``V + sum_e (S_u + S_v) + V``.
Branch and bound is exponential in the worst case; the relaxation is usually integral.

Example
-------
>>> import numpy as np
>>> r = solve([np.array([1.0, 0.0]), np.array([0.0, 1.0])],
...           {(0, 1): np.array([[0.0, 5.0], [5.0, 0.0]])})
>>> r.choice, r.objective
([0, 0], 1.0)
>>> brute_force([np.array([1.0, 0.0]), np.array([0.0, 1.0])],
...             {(0, 1): np.array([[0.0, 5.0], [5.0, 0.0]])}).objective
1.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: weight of (scaled) memory beside (scaled) time in the objective: breaks ties only
TIE_BREAK = 1e-7
#: solver status words
OPTIMAL, INFEASIBLE, TIME_LIMIT = "optimal", "infeasible", "time_limit"


@dataclass
class Solution:
    """One strategy index per node, the objective, memory use and the solver's word."""

    choice: list[int]
    objective: float
    status: str
    memory: float = 0.0
    gap: float = 0.0
    variables: int = 0


@dataclass
class Quantity:
    """A linear form of the choice: ``sum node[v][s] x[v, s] + sum edge[e][s, t] y[e, s, t]``
    (``edge`` keys must be keys of the edge costs; a matrix of zeros there creates one)."""

    node: dict[int, np.ndarray] = field(default_factory=dict)
    edge: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def value(self, choice: Sequence[int]) -> float:
        v = sum(float(c[choice[k]]) for k, c in self.node.items())
        return v + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.edge.items())


@dataclass
class Tables:
    """Everything :func:`solve` reads, as one object (what a sharding problem hands over):
    node and edge costs, memory and transient per strategy, and the exposures (rows over
    ``quantities``, module docstring)."""

    node: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    memory: list[np.ndarray]
    transient: list[np.ndarray]
    quantities: list[Quantity] = field(default_factory=list)
    exposures: list[np.ndarray] = field(default_factory=list)

    def solve(
        self,
        capacity: float | None = None,
        *,
        time_limit_s: float = 60.0,
        minimise: str = "time",
    ) -> Solution:
        return solve(
            self.node,
            self.edges,
            self.memory,
            self.transient,
            capacity,
            time_limit_s=time_limit_s,
            minimise=minimise,
            quantities=self.quantities,
            exposures=self.exposures,
        )

    def evaluate(self, choice: Sequence[int]) -> float:
        return evaluate(choice, self.node, self.edges, self.quantities, self.exposures)


def _check(
    node_costs: Sequence[np.ndarray],
    edge_costs: Mapping[tuple[int, int], np.ndarray],
    quantities: Sequence[Quantity] = (),
    exposures: Sequence[np.ndarray] = (),
) -> None:
    for (a, b), m in edge_costs.items():
        if a == b or m.shape != (len(node_costs[a]), len(node_costs[b])):
            raise ValueError(f"edge ({a}, {b}) cost matrix has shape {m.shape}")
    for q in quantities:
        for k, m in q.edge.items():
            if k not in edge_costs or m.shape != edge_costs[k].shape:
                raise ValueError(f"quantity on edge {k} that the edge costs do not have")
        for v, c in q.node.items():
            if c.shape != (len(node_costs[v]),):
                raise ValueError(f"quantity on node {v} has shape {c.shape}")
    for r in exposures:
        if r.ndim != 2 or r.shape[1] != len(quantities):
            raise ValueError(f"exposure rows of shape {r.shape} for {len(quantities)} quantities")


def exposure(rows: np.ndarray, values: np.ndarray) -> float:
    """``max(0, max_k rows[k] . values)``: the exposed part of one overlapped stream."""
    if rows.shape[0] == 0:
        return 0.0
    return max(0.0, float(np.max(rows @ values)))


def solve(
    node_costs: Sequence[np.ndarray],
    edge_costs: Mapping[tuple[int, int], np.ndarray],
    memory: Sequence[np.ndarray] | None = None,
    transient: Sequence[np.ndarray] | None = None,
    capacity: float | None = None,
    *,
    time_limit_s: float = 60.0,
    minimise: str = "time",
    quantities: Sequence[Quantity] = (),
    exposures: Sequence[np.ndarray] = (),
) -> Solution:
    """Minimise node + edge costs + exposures (``minimise="time"``) or memory
    (``"memory"``, exposures ignored) subject to ``memory + max transient <= capacity``
    (when given). See the module docstring."""
    import highspy

    _check(node_costs, edge_costs, quantities, exposures)
    if minimise != "time":
        return least_memory(node_costs, edge_costs, memory, transient, capacity)
    if capacity is not None:
        lean = least_memory(node_costs, edge_costs, memory, transient, capacity)
        if lean.status == INFEASIBLE:  # no choice fits: proved without branch and bound
            return lean
    n = len(node_costs)
    memory = memory if memory is not None else [np.zeros(len(c)) for c in node_costs]
    transient = transient if transient is not None else [np.zeros(len(c)) for c in node_costs]
    # HiGHS works in absolute tolerances: bring bytes and seconds to unit scale
    mem_scale = max(
        (float(np.max(np.abs(m))) for m in (*memory, *transient) if m.size), default=0.0
    )
    mem_scale = mem_scale or 1.0
    time_scale = max((float(np.max(np.abs(c))) for c in node_costs if c.size), default=0.0)
    edge_max = [float(np.max(m)) for m in edge_costs.values() if m.size]
    q_max = [
        float(np.max(np.abs(c)))
        for q in quantities
        for c in (*q.node.values(), *q.edge.values())
        if c.size
    ]
    time_scale = max([time_scale, *edge_max, *q_max]) or 1.0
    memory_s = [np.asarray(m, dtype=np.float64) / mem_scale for m in memory]
    transient_s = [np.asarray(t, dtype=np.float64) / mem_scale for t in transient]
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c) for c in node_costs])
    n_x = int(offsets[-1])
    edges = list(edge_costs.items())
    e_off = [n_x]
    for _, m in edges:
        e_off.append(e_off[-1] + m.size)
    t_var = e_off[-1]
    q_off = t_var + 1  # the quantities, then one exposure variable per stream
    x_off = q_off + len(quantities)
    n_var = x_off + len(exposures)
    edge_index = {key: k for k, (key, _) in enumerate(edges)}
    cost = np.zeros(n_var)
    if minimise == "time":
        for v, c in enumerate(node_costs):
            cost[offsets[v] : offsets[v + 1]] = c / time_scale
        for k, (_, m) in enumerate(edges):
            cost[e_off[k] : e_off[k + 1]] = m.reshape(-1) / time_scale
        # among plans of equal time, the one that needs less memory
        for v, mem in enumerate(memory_s):
            cost[offsets[v] : offsets[v + 1]] += TIE_BREAK * mem
        cost[x_off:] = 1.0  # quantities and exposures are in units of time_scale
    else:
        for v, mem in enumerate(memory_s):
            cost[offsets[v] : offsets[v + 1]] = mem
        cost[t_var] = 1.0
    lower = np.zeros(n_var)
    upper = np.ones(n_var)
    upper[t_var] = math.inf
    lower[q_off:x_off] = -math.inf
    upper[q_off:] = math.inf
    rows_lo: list[float] = []
    rows_hi: list[float] = []
    idx: list[np.ndarray] = []
    val: list[np.ndarray] = []

    def row(cols: np.ndarray, coefs: np.ndarray, lo: float, hi: float) -> None:
        idx.append(cols.astype(np.int32))
        val.append(coefs.astype(np.float64))
        rows_lo.append(lo)
        rows_hi.append(hi)

    for v in range(n):  # one strategy per node
        cols = np.arange(offsets[v], offsets[v + 1])
        row(cols, np.ones(len(cols)), 1.0, 1.0)
    for k, ((a, b), m) in enumerate(edges):
        sa, sb = m.shape
        base = e_off[k]
        for s in range(sa):
            cols = np.concatenate([[offsets[a] + s], base + s * sb + np.arange(sb)])
            row(cols, np.concatenate([[-1.0], np.ones(sb)]), 0.0, 0.0)
        for t in range(sb):
            cols = np.concatenate([[offsets[b] + t], base + np.arange(sa) * sb + t])
            row(cols, np.concatenate([[-1.0], np.ones(sa)]), 0.0, 0.0)
    for j, q in enumerate(quantities):  # q_j - (its linear form) = 0
        cols_l = [np.array([q_off + j])]
        coef_l = [np.array([1.0])]
        for v, c in q.node.items():
            cols_l.append(np.arange(offsets[v], offsets[v + 1]))
            coef_l.append(-np.asarray(c, dtype=np.float64) / time_scale)
        for key, m in q.edge.items():
            k = edge_index[key]
            cols_l.append(np.arange(e_off[k], e_off[k + 1]))
            coef_l.append(-np.asarray(m, dtype=np.float64).reshape(-1) / time_scale)
        row(np.concatenate(cols_l), np.concatenate(coef_l), 0.0, 0.0)
    for e, rows in enumerate(exposures):  # R[k] . q - e <= 0
        for r in rows:
            nz = np.flatnonzero(r)
            row(
                np.concatenate([q_off + nz, [x_off + e]]),
                np.concatenate([r[nz], [-1.0]]),
                -math.inf,
                0.0,
            )
    if capacity is not None or minimise == "memory":
        for v, tr in enumerate(transient_s):  # T >= transient of the chosen strategy
            if np.any(tr > 0):
                cols = np.concatenate([np.arange(offsets[v], offsets[v + 1]), [t_var]])
                row(cols, np.concatenate([tr, [-1.0]]), -math.inf, 0.0)
        if capacity is not None:
            cols = np.concatenate([np.arange(n_x), [t_var]])
            coefs = np.concatenate([np.concatenate(memory_s), [1.0]])
            row(cols, coefs, -math.inf, float(capacity) / mem_scale)

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-6)
    # One thread: deterministic, and these programs are small enough that parallel branch
    # and bound gains little. (HiGHS 1.16.0 segfaults on some sequences of these programs
    # whatever the thread count; pyproject.toml pins 1.15.1, which does not.)
    h.setOptionValue("threads", 1)
    lp = highspy.HighsLp()
    lp.num_col_ = n_var
    lp.num_row_ = len(rows_lo)
    lp.col_cost_ = cost
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.array(rows_lo)
    lp.row_upper_ = np.array(rows_hi)
    starts = np.zeros(len(idx) + 1, dtype=np.int32)
    starts[1:] = np.cumsum([len(i) for i in idx])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int32)
    lp.a_matrix_.value_ = np.concatenate(val) if val else np.zeros(0)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_x + [highspy.HighsVarType.kContinuous] * (
        n_var - n_x
    )
    if h.passModel(lp) == highspy.HighsStatus.kError:
        raise RuntimeError("HiGHS refused the integer program")
    if h.run() == highspy.HighsStatus.kError:
        # HiGHS's scheduler is global to the process: when something else here started it
        # with more threads, run() refuses one thread until the scheduler is reset
        highspy.Highs.resetGlobalScheduler(True)
        if h.run() == highspy.HighsStatus.kError:
            raise RuntimeError(f"HiGHS failed: {h.modelStatusToString(h.getModelStatus())}")
    status = h.getModelStatus()
    ms = highspy.HighsModelStatus
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return Solution([], math.inf, INFEASIBLE, variables=n_var)
    info = h.getInfo()
    feasible = info.primal_solution_status == 2  # kSolutionStatusFeasible
    sol = np.asarray(h.getSolution().col_value)
    if (status != ms.kOptimal and not feasible) or sol.size != n_var:
        # stopped (time limit) before any plan was found
        return Solution([], math.inf, TIME_LIMIT, variables=n_var)
    choice = [int(np.argmax(sol[offsets[v] : offsets[v + 1]])) for v in range(n)]
    word = OPTIMAL if status == ms.kOptimal else TIME_LIMIT
    return Solution(
        choice,
        evaluate(choice, node_costs, edge_costs, quantities, exposures),
        word,
        memory_of(choice, memory, transient),
        float(getattr(info, "mip_gap", 0.0) or 0.0) if word != OPTIMAL else 0.0,
        n_var,
    )


def least_memory(
    node_costs: Sequence[np.ndarray],
    edge_costs: Mapping[tuple[int, int], np.ndarray],
    memory: Sequence[np.ndarray] | None = None,
    transient: Sequence[np.ndarray] | None = None,
    capacity: float | None = None,
) -> Solution:
    """The choice of least memory (resident plus the largest transient, as
    :func:`memory_of`), exactly, without the integer program: memory depends on each
    node's own strategy and one maximum, and the edges' transportation rows are met by any
    choice, so for each candidate bound ``tau`` on the largest transient (zero or one of
    the transients) every node takes its least resident memory among the strategies whose
    transient is at most ``tau``, and the best ``tau`` wins. Ties go to the strategy of
    least node cost, then the first. ``INFEASIBLE`` when even that exceeds ``capacity``.

    Complexity: ``O(K * sum_v S_v)`` for ``K`` distinct transients (vectorised over a
    ``V x max S`` table); HiGHS's branch and bound on the same program took seconds on a
    400-node Llama (``T`` couples every node).

    Example
    -------
    >>> import numpy as np
    >>> r = least_memory([np.zeros(2), np.zeros(2)], {}, [np.array([1.0, 4.0]),
    ...     np.array([2.0, 3.0])], [np.array([9.0, 0.0]), np.array([0.0, 0.0])])
    >>> r.choice, r.memory  # node 0's 1 byte would bring a 9-byte transient
    ([1, 0], 6.0)
    """
    _check(node_costs, edge_costs)
    n = len(node_costs)
    memory = memory if memory is not None else [np.zeros(len(c)) for c in node_costs]
    transient = transient if transient is not None else [np.zeros(len(c)) for c in node_costs]
    width = max((len(c) for c in node_costs), default=0)
    resident = np.full((n, width), math.inf)
    working = np.full((n, width), math.inf)
    cost = np.full((n, width), math.inf)
    for v, (c, m, t) in enumerate(zip(node_costs, memory, transient, strict=True)):
        resident[v, : len(c)] = m
        working[v, : len(c)] = np.maximum(np.asarray(t, dtype=np.float64), 0.0)
        cost[v, : len(c)] = c
    # the largest transient is at least every node's least one
    floor = float(np.max(np.min(working, axis=1))) if n else 0.0
    bounds = np.unique(working[np.isfinite(working)])
    bounds = np.concatenate([[floor], bounds[bounds > floor]])
    best_total, best_bound = math.inf, floor
    for bound in bounds:
        allowed = np.where(working <= bound, resident, math.inf)
        total = float(np.sum(np.min(allowed, axis=1))) + bound
        if total < best_total:
            best_total, best_bound = total, float(bound)
    allowed = np.where(working <= best_bound, resident, math.inf)
    least = np.min(allowed, axis=1, keepdims=True)
    # among the strategies of least memory, the cheapest in time (an infinite cost still
    # ranks below any strategy of more memory)
    finite = np.nan_to_num(cost, posinf=np.finfo(np.float64).max)
    choice = np.argmin(np.where(allowed == least, finite, math.inf), axis=1).tolist()
    mem = memory_of(choice, memory, transient)
    variables = int(sum(map(len, node_costs)))
    if capacity is not None and mem > capacity * (1 + 1e-9):
        return Solution([], math.inf, INFEASIBLE, variables=variables)
    return Solution(choice, evaluate(choice, node_costs, edge_costs), OPTIMAL, mem, 0.0, variables)


def evaluate(
    choice: Sequence[int],
    node_costs: Sequence[np.ndarray],
    edge_costs: Mapping[tuple[int, int], np.ndarray],
    quantities: Sequence[Quantity] = (),
    exposures: Sequence[np.ndarray] = (),
) -> float:
    """Node plus edge cost of ``choice``, plus each exposure."""
    total = sum(float(c[s]) for c, s in zip(node_costs, choice, strict=True))
    total += sum(float(m[choice[a], choice[b]]) for (a, b), m in edge_costs.items())
    if exposures:
        values = np.array([q.value(choice) for q in quantities])
        total += sum(exposure(r, values) for r in exposures)
    return total


def memory_of(
    choice: Sequence[int], memory: Sequence[np.ndarray], transient: Sequence[np.ndarray]
) -> float:
    """Resident memory plus the largest transient of ``choice``."""
    resident = sum(float(m[s]) for m, s in zip(memory, choice, strict=True))
    peak = max((float(t[s]) for t, s in zip(transient, choice, strict=True)), default=0.0)
    return resident + max(peak, 0.0)


def brute_force(
    node_costs: Sequence[np.ndarray],
    edge_costs: Mapping[tuple[int, int], np.ndarray],
    memory: Sequence[np.ndarray] | None = None,
    transient: Sequence[np.ndarray] | None = None,
    capacity: float | None = None,
    quantities: Sequence[Quantity] = (),
    exposures: Sequence[np.ndarray] = (),
) -> Solution:
    """Every combination (the product of strategy counts): the oracle for :func:`solve`."""
    _check(node_costs, edge_costs, quantities, exposures)
    memory = memory if memory is not None else [np.zeros(len(c)) for c in node_costs]
    transient = transient if transient is not None else [np.zeros(len(c)) for c in node_costs]
    best = Solution([], math.inf, INFEASIBLE)
    for combo in itertools.product(*(range(len(c)) for c in node_costs)):
        mem = memory_of(combo, memory, transient)
        if capacity is not None and mem > capacity * (1 + 1e-9):
            continue
        obj = evaluate(combo, node_costs, edge_costs, quantities, exposures)
        if obj < best.objective:
            best = Solution(list(combo), obj, OPTIMAL, mem)
    return best
