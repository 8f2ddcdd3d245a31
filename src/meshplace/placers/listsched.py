"""List-scheduling placers: Baechi's m-TOPO, m-ETF and m-SCT, and HEFT and CPOP.

All five are classic *list schedulers* run on the acyclic group graph
(``problem.group_graph``): they walk the groups in some priority order and put each one on
a device at a start time, charging ``problem.group_time[d, g]`` seconds of compute and
``latency + bytes / bandwidth`` seconds (``cluster.path_matrices()``; 0 on one device) for
every edge whose ends sit on different devices.

How a schedule becomes a placement
----------------------------------
Only the *device* each group was scheduled on is kept: that is the placement (one device
index per co-location group). The start times are the scheduler's own estimate and are
thrown away; :func:`meshplace.placers.base.run_placer` expands the groups to ops and the
simulator re-times the plan with its own rules (one op at a time per device in topological
rank order, link contention along routes, the true peak memory). The list schedule's
makespan is still reported in the stats (``schedule_makespan_s``) as a cross-check.

Memory awareness (Baechi's "m-" rule, Jeon et al., SoCC 2020, §4)
-----------------------------------------------------------------
Every placer keeps the free memory of each device (``problem.device_memory`` minus the
``problem.group_memory`` of the groups already on it). When a group is placed, only the
*eligible* devices are considered: the accelerators (:func:`accelerators`) where it still
fits; if none fits, any device where it fits (this is the only way a CPU is used); if no
device fits at all, the one device with the most free memory. The stats count the groups
that needed either fallback (``memory_fallbacks``).

Every placer here is deterministic and ignores ``seed`` and ``budget_s`` (ties are broken
by fixed rules: priority, then group index, then device index).

Shared core
-----------
:class:`_Costs` (per-problem arrays: compute times, mean costs, the communication matrices),
:class:`_Schedule` (device timelines, data-ready times, memory, eligibility, commits),
:func:`_ready_list` (the ready-queue loop: pop the best ready group, let a rule pick its
device; used by m-TOPO, HEFT and CPOP) and :func:`_etf` (the earliest-start (group, device)
pair loop; used by m-ETF and m-SCT).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> r = run_placer("heft", p, 1.0, 0)
>>> r.oom, r.stats["schedule_makespan_s"] > 0
(False, True)
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from meshplace.placers.base import PlacementProblem, register
from meshplace.placers.baselines import accelerators

_FAMILY = "list scheduling"
# LP tie-break: a favourite edge saves its communication time; rewarding that with this
# relative weight picks, among the makespan-optimal LP vertices, one that zeroes heavy edges.
_LP_TIE_WEIGHT = 1e-4


# ---------------------------------------------------------------------------- shared core
def _mean_where_runs(time: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """Mean over devices (rows) of each group's time where it can run (inf elsewhere)."""
    count = runs.sum(axis=0)
    total = np.where(runs, time, 0.0).sum(axis=0)
    return np.where(count > 0, total / np.maximum(count, 1), np.inf)


class _Costs:
    """Everything about a problem that the schedulers read: adjacency (CSR, from
    ``group_graph.arrays()``), compute times, memory, communication matrices, and the
    mean costs (over the accelerators) that HEFT, CPOP and the SCT LP rank with."""

    def __init__(self, problem: PlacementProblem) -> None:
        a = problem.group_graph.arrays()
        self.n = problem.num_groups
        self.num_devices = problem.num_devices
        self.device_names = list(problem.device_names)
        self.succ_ptr = a.succ_ptr
        self.succ_idx = a.succ_idx
        self.succ_edge = a.succ_edge
        self.pred_ptr = a.pred_ptr
        self.pred_idx = a.pred_idx
        self.pred_edge = a.pred_edge
        self.edge_bytes = np.asarray(a.edge_bytes, dtype=np.float64)
        self.edge_src = np.asarray(a.edge_src, dtype=np.int64)
        self.edge_dst = np.asarray(a.edge_dst, dtype=np.int64)
        self.topo_order = np.asarray(a.topo_order, dtype=np.int64)
        self.topo_pos = np.empty(self.n, dtype=np.int64)
        self.topo_pos[self.topo_order] = np.arange(self.n)
        self.time = np.asarray(problem.group_time, dtype=np.float64)
        self.memory = np.asarray(problem.group_memory, dtype=np.float64)
        self.capacity = np.asarray(problem.device_memory, dtype=np.float64)
        self.acc = np.array(accelerators(problem), dtype=np.int64)
        self.is_acc = np.zeros(self.num_devices, dtype=bool)
        self.is_acc[self.acc] = True
        latency, bandwidth = problem.cluster.path_matrices()
        same = np.eye(self.num_devices, dtype=bool)
        self.latency = np.where(same, 0.0, latency)
        with np.errstate(divide="ignore"):
            self.inv_bw = np.where(same, 0.0, 1.0 / bandwidth)
        # Mean costs over the accelerators (HEFT's w-bar and c-bar = L-bar + data / B-bar);
        # over the devices that can run a group where an accelerator cannot (Op.unsupported)
        self.runs = np.asarray(problem.group_runs, dtype=bool)
        self.mean_time = _mean_where_runs(self.time[self.acc], self.runs[self.acc])
        unsupported = ~self.runs[self.acc].any(axis=0)
        self.mean_time[unsupported] = _mean_where_runs(self.time, self.runs)[unsupported]
        if len(self.acc) > 1:
            off = ~np.eye(len(self.acc), dtype=bool)
            sub = np.ix_(self.acc, self.acc)
            mean_lat = float(self.latency[sub][off].mean())
            mean_bw = float(bandwidth[sub][off].mean())
            self.mean_comm = mean_lat + self.edge_bytes / mean_bw
        else:
            self.mean_comm = np.zeros_like(self.edge_bytes)

    def succs(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.succ_ptr[g], self.succ_ptr[g + 1]
        return self.succ_idx[s:e], self.succ_edge[s:e]

    def preds(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.pred_ptr[g], self.pred_ptr[g + 1]
        return self.pred_idx[s:e], self.pred_edge[s:e]

    def upward_rank(self, comm: bool = True) -> np.ndarray:
        """HEFT's rank_u: mean compute plus the longest mean-cost path to an exit
        (``comm=False`` gives the static level that ETF breaks ties with). O(V + E)."""
        rank = np.zeros(self.n)
        for g in self.topo_order[::-1].tolist():
            succ, edges = self.succs(g)
            tail = 0.0
            if len(succ):
                tail = float((rank[succ] + (self.mean_comm[edges] if comm else 0.0)).max())
            rank[g] = self.mean_time[g] + tail
        return rank

    def downward_rank(self) -> np.ndarray:
        """CPOP's rank_d: the longest mean-cost path from an entry to the group, excluding
        the group's own compute. O(V + E)."""
        rank = np.zeros(self.n)
        for g in self.topo_order.tolist():
            pred, edges = self.preds(g)
            if len(pred):
                rank[g] = float((rank[pred] + self.mean_time[pred] + self.mean_comm[edges]).max())
        return rank


def _eligible(
    free: np.ndarray, need: np.ndarray, is_acc: np.ndarray, runs: np.ndarray
) -> np.ndarray:
    """Baechi's memory rule for ``k`` groups at once, among the devices that can run each
    (``runs``: ``[k, devices]``, False where the graph marks an op unsupported): a ``[k,
    devices]`` mask of the accelerators where each group fits; else of any device where it
    fits; else of the one device with the most free memory. O(k · devices)."""
    fit = (free[None, :] >= need[:, None]) & runs
    acc_fit = fit & is_acc[None, :]
    out = np.where(acc_fit.any(axis=1, keepdims=True), acc_fit, fit)
    for row in np.flatnonzero(~out.any(axis=1)).tolist():
        out[row, int(np.argmax(np.where(runs[row], free, -np.inf)))] = True
    return out


class _Schedule:
    """Device timelines being built by a list scheduler.

    ``insertion=True`` keeps each device's busy intervals so a group may start in an idle
    gap before the device's last group (HEFT's insertion policy); otherwise a group starts
    no earlier than the device's last finish (ETF, m-TOPO)."""

    def __init__(self, costs: _Costs, insertion: bool) -> None:
        self.c = costs
        self.insertion = insertion
        d = costs.num_devices
        self.device = np.full(costs.n, -1, dtype=np.int64)
        self.start = np.zeros(costs.n)
        self.finish = np.zeros(costs.n)
        self.free = costs.capacity.copy()
        self.avail = np.zeros(d)
        self.last = np.full(d, -1, dtype=np.int64)
        self.intervals: list[list[tuple[float, float]]] = [[] for _ in range(d)]
        self.ends: list[list[float]] = [[] for _ in range(d)]
        self.fallbacks = 0

    def data_ready(self, g: int) -> np.ndarray:
        """Per device, when all of ``g``'s inputs could be there (each predecessor's finish
        plus latency + bytes / bandwidth from its device; no contention). O(preds · D)."""
        c = self.c
        pred, edges = c.preds(g)
        if not len(pred):
            return np.zeros(c.num_devices)
        src = self.device[pred]
        arrive = (
            self.finish[pred][:, None]
            + c.latency[src]
            + c.edge_bytes[edges][:, None] * c.inv_bw[src]
        )
        return arrive.max(axis=0)

    def eligible(self, g: int) -> np.ndarray:
        """Device indices where ``g`` may go under the memory rule (and can run at all)."""
        runs = self.c.runs[:, g : g + 1].T
        return np.flatnonzero(
            _eligible(self.free, self.c.memory[g : g + 1], self.c.is_acc, runs)[0]
        )

    def earliest_start(self, g: int, d: int, ready: float) -> float:
        """When ``g`` can start on ``d`` given its data-ready time there."""
        if not self.insertion:
            return max(ready, float(self.avail[d]))
        w = float(self.c.time[d, g])
        t = ready
        iv = self.intervals[d]
        for k in range(bisect.bisect_right(self.ends[d], ready), len(iv)):
            s, e = iv[k]
            if s >= t + w:
                break
            t = max(t, e)
        return t

    def best_finish(self, g: int, devices: np.ndarray, ready: np.ndarray) -> tuple[int, float]:
        """The device among ``devices`` where ``g`` finishes first (lowest index on ties),
        and its start time."""
        best = (np.inf, -1, 0.0)
        for d in devices.tolist():
            s = self.earliest_start(g, d, float(ready[d]))
            f = s + float(self.c.time[d, g])
            if f < best[0]:
                best = (f, d, s)
        return best[1], best[2]

    def commit(self, g: int, d: int, start: float) -> None:
        c = self.c
        if not c.is_acc[d] or self.free[d] < c.memory[g]:
            self.fallbacks += 1
        end = start + float(c.time[d, g])
        self.device[g] = d
        self.start[g] = start
        self.finish[g] = end
        self.free[d] -= c.memory[g]
        self.avail[d] = max(self.avail[d], end)
        self.last[d] = g
        if self.insertion:
            pos = bisect.bisect_right(self.intervals[d], (start, end))
            self.intervals[d].insert(pos, (start, end))
            self.ends[d].insert(pos, end)

    def result(self, name: str, **extra: Any) -> tuple[np.ndarray, dict[str, Any]]:
        stats: dict[str, Any] = {
            "algorithm": name,
            "schedule_makespan_s": float(self.finish.max(initial=0.0)),
            "devices_used": len(set(self.device.tolist())),
            "memory_fallbacks": self.fallbacks,
        }
        stats.update(extra)
        return self.device.copy(), stats


DeviceRule = Callable[[_Schedule, int, np.ndarray], tuple[int, float]]


def _ready_list(costs: _Costs, key: np.ndarray, rule: DeviceRule, insertion: bool) -> _Schedule:
    """The ready-queue loop: repeatedly take the ready group with the smallest ``key``
    (ties: topological position) and place it where ``rule(schedule, g, data_ready)``
    says (a device and a start time). O(V log V + E · D) plus the rule's cost."""
    sched = _Schedule(costs, insertion)
    remaining = np.diff(costs.pred_ptr).astype(np.int64)
    heap = [(float(key[g]), int(costs.topo_pos[g]), g) for g in np.flatnonzero(remaining == 0)]
    heapq.heapify(heap)
    while heap:
        _, _, g = heapq.heappop(heap)
        ready = sched.data_ready(g)
        d, start = rule(sched, g, ready)
        sched.commit(g, d, start)
        for s in costs.succs(g)[0].tolist():
            remaining[s] -= 1
            if remaining[s] == 0:
                heapq.heappush(heap, (float(key[s]), int(costs.topo_pos[s]), s))
    return sched


def _eft_rule(sched: _Schedule, g: int, ready: np.ndarray) -> tuple[int, float]:
    """Earliest finish time over the eligible devices."""
    return sched.best_finish(g, sched.eligible(g), ready)


def _etf(costs: _Costs, favourite_child: np.ndarray | None = None) -> _Schedule:
    """Earliest Task First (Hwang, Chow, Anger & Lee, SIAM J. Comput. 1989): among every
    ready group and eligible device, schedule the pair that can start first (ties: higher
    static level, lower group index, earlier finish, lower device index); no insertion.

    With favourites (m-SCT), a device whose last group ``p`` has a ready, unscheduled
    favourite child ``f`` is *reserved*: ``f`` may only go there (if it fits) and other
    groups may not, unless that leaves them no eligible device.

    O(V · (R · D + P · D)) for R ready groups and P predecessors: O(V² · D) at worst.
    """
    sched = _Schedule(costs, insertion=False)
    level = costs.upward_rank(comm=False)
    remaining = np.diff(costs.pred_ptr).astype(np.int64)
    ready: list[int] = np.flatnonzero(remaining == 0).tolist()
    drt = np.zeros((costs.n, costs.num_devices))
    while ready:
        rows = np.array(ready, dtype=np.int64)
        elig = _eligible(sched.free, costs.memory[rows], costs.is_acc, costs.runs[:, rows].T)
        if favourite_child is not None:
            elig = _reserve(sched, rows, elig, favourite_child)
        est = np.where(elig, np.maximum(drt[rows], sched.avail[None, :]), np.inf)
        best = est.min()
        cand = np.flatnonzero((est == best).any(axis=1))
        # Ties: highest static level, then lowest group index.
        r = int(cand[np.lexsort((rows[cand], -level[rows[cand]]))[0]])
        g = int(rows[r])
        devices = np.flatnonzero(est[r] == best)
        d = int(devices[np.argmin(costs.time[devices, g])])
        sched.commit(g, d, float(best))
        ready.remove(g)
        for s in costs.succs(g)[0].tolist():
            remaining[s] -= 1
            if remaining[s] == 0:
                drt[s] = sched.data_ready(s)
                ready.append(s)
    return sched


def _reserve(
    sched: _Schedule, rows: np.ndarray, elig: np.ndarray, favourite_child: np.ndarray
) -> np.ndarray:
    """Apply SCT's favourite-child reservations to an eligibility mask (see :func:`_etf`)."""
    row_of = {int(g): k for k, g in enumerate(rows.tolist())}
    forced: list[tuple[int, int]] = []
    for d in np.flatnonzero(sched.last >= 0).tolist():
        f = int(favourite_child[sched.last[d]])
        k = row_of.get(f, -1)
        if k >= 0 and elig[k, d]:
            forced.append((k, d))
    if not forced:
        return elig
    out = elig.copy()
    for _, d in forced:
        out[:, d] = False
    for k, d in forced:
        out[k] = False
        out[k, d] = True
    empty = ~out.any(axis=1)
    out[empty] = elig[empty]
    return out


def favourite_lp(costs: _Costs, time_limit_s: float = 1.0) -> tuple[str, np.ndarray, float, float]:
    """Solve the LP relaxation of Hanen & Munier's favourite-child ILP with HiGHS.

    Variables: a start time ``s_i ≥ 0`` per group, ``x_e ∈ [0, 1]`` per edge (1: the child
    is the parent's favourite, so no communication) and the makespan ``M``. Constraints:
    ``s_j ≥ s_i + p_i + c_e (1 - x_e)`` per edge ``e = (i, j)``; at most one favourite
    child per group and one favourite parent per group; ``M ≥ s_i + p_i`` per exit group.
    Minimise ``M`` (minus a tiny reward for zeroed communication as a tie-break).
    ``p`` and ``c`` are the mean costs over the accelerators, scaled to order 1 for the
    solver. (V + E + 1) columns, at most E + 2V rows.

    Returns (status, x per edge, makespan in seconds, solve seconds); ``status`` is
    ``"optimal"`` or why not.
    """
    import highspy

    n, m = costs.n, len(costs.edge_bytes)
    p = costs.mean_time
    c = costs.mean_comm
    scale = float(max(p.max(initial=0.0), c.max(initial=0.0)))
    scale = scale if scale > 0 else 1.0
    p, c = p / scale, c / scale
    ncol = n + m + 1
    mcol = n + m
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    src, dst = costs.edge_src, costs.edge_dst
    e_idx = np.arange(m)
    # s_j - s_i + c_e x_e >= p_i + c_e
    rows += [e_idx, e_idx, e_idx]
    cols += [dst, src, n + e_idx]
    vals += [np.ones(m), -np.ones(m), c]
    lower.append(p[src] + c)
    upper.append(np.full(m, np.inf))
    r0 = m
    # one favourite child per parent, one favourite parent per child
    for group_of_edge in (src, dst):
        counts = np.bincount(group_of_edge, minlength=n)
        many = np.flatnonzero(counts > 1)
        row_of = np.full(n, -1)
        row_of[many] = r0 + np.arange(len(many))
        sel = np.flatnonzero(counts[group_of_edge] > 1)
        rows.append(row_of[group_of_edge[sel]])
        cols.append(n + sel)
        vals.append(np.ones(len(sel)))
        lower.append(np.full(len(many), -np.inf))
        upper.append(np.ones(len(many)))
        r0 += len(many)
    # M - s_i >= p_i for exits
    exits = np.flatnonzero(np.diff(costs.succ_ptr) == 0)
    k = np.arange(len(exits))
    rows += [r0 + k, r0 + k]
    cols += [np.full(len(exits), mcol), exits]
    vals += [np.ones(len(exits)), -np.ones(len(exits))]
    lower.append(p[exits])
    upper.append(np.full(len(exits), np.inf))
    nrow = r0 + len(exits)

    r = np.concatenate(rows).astype(np.int64)
    col = np.concatenate(cols).astype(np.int64)
    v = np.concatenate(vals).astype(np.float64)
    order = np.lexsort((r, col))
    r, col, v = r[order], col[order], v[order]
    start = np.zeros(ncol + 1, dtype=np.int64)
    np.cumsum(np.bincount(col, minlength=ncol), out=start[1:])

    cost = np.zeros(ncol)
    cost[mcol] = 1.0
    c_total = float(c.sum())
    if c_total > 0:
        cost[n : n + m] = -_LP_TIE_WEIGHT * c / c_total
    col_lower = np.zeros(ncol)
    col_upper = np.full(ncol, np.inf)
    col_upper[n : n + m] = 1.0

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    inf = h.getInfinity()
    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = nrow
    lp.col_cost_ = cost
    lp.col_lower_ = col_lower
    lp.col_upper_ = np.where(np.isinf(col_upper), inf, col_upper)
    row_lower = np.concatenate(lower)
    row_upper = np.concatenate(upper)
    lp.row_lower_ = np.where(np.isinf(row_lower), -inf, row_lower)
    lp.row_upper_ = np.where(np.isinf(row_upper), inf, row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = r
    lp.a_matrix_.value_ = v
    t0 = time.perf_counter()
    h.passModel(lp)
    h.run()
    elapsed = time.perf_counter() - t0
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        return h.modelStatusToString(status), np.zeros(m), 0.0, elapsed
    values = np.asarray(h.getSolution().col_value)
    x = np.clip(values[n : n + m], 0.0, 1.0) + 0.0  # (+ 0.0 turns -0.0 into 0.0)
    makespan = float(values[mcol]) * scale
    return "optimal", x, makespan, elapsed


def _round_favourites(costs: _Costs, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges with ``x ≥ 0.5`` become favourites, largest ``x`` first (then heavier edge,
    then lower edge index), keeping at most one favourite child and parent per group."""
    child = np.full(costs.n, -1, dtype=np.int64)
    parent = np.full(costs.n, -1, dtype=np.int64)
    for e in np.lexsort((np.arange(len(x)), -costs.mean_comm, -x)).tolist():
        if x[e] < 0.5 - 1e-9:
            break
        i, j = int(costs.edge_src[e]), int(costs.edge_dst[e])
        if child[i] < 0 and parent[j] < 0:
            child[i], parent[j] = j, i
    return child, parent


# ---------------------------------------------------------------------------- schedulers
# Each returns the finished schedule and the algorithm's own stats; the placers below wrap
# them. Kept apart so tests can check the schedules themselves (precedence, communication,
# no overlap on a device).
Stats = dict[str, Any]


def _schedule_m_topo(costs: _Costs) -> tuple[_Schedule, Stats]:
    acc = costs.acc.tolist()
    weight = costs.mean_time
    total = float(weight.sum())
    share = total / len(acc) if total > 0 else 0.0
    state = {"k": 0, "done": 0.0}

    def rule(sched: _Schedule, g: int, ready: np.ndarray) -> tuple[int, float]:
        mid = state["done"] + float(weight[g]) / 2
        state["done"] += float(weight[g])
        # Share k holds the midpoints in (k·share, (k+1)·share]; a boundary goes left.
        target = min(math.ceil(mid / share) - 1, len(acc) - 1) if share > 0 else 0
        k = max(state["k"], target)
        while k < len(acc) and sched.free[acc[k]] < costs.memory[g]:
            k += 1  # does not fit: move on to the next device for good
        if k < len(acc) and not costs.runs[acc[k], g]:  # cannot run there: skip, this once
            elig = sched.eligible(g)
            starts = [sched.earliest_start(g, int(e), float(ready[e])) for e in elig]
            pick = int(np.argmin(starts))
            return int(elig[pick]), starts[pick]
        if k < len(acc):
            state["k"] = k
            d = acc[k]
        else:  # past the last accelerator: the memory rule, most free memory first
            state["k"] = len(acc) - 1
            elig = sched.eligible(g)
            d = int(elig[np.argmax(sched.free[elig])])
        return d, sched.earliest_start(g, d, float(ready[d]))

    sched = _ready_list(costs, costs.topo_pos.astype(np.float64), rule, insertion=False)
    return sched, {"share_s": share}


def _schedule_m_etf(costs: _Costs) -> tuple[_Schedule, Stats]:
    return _etf(costs), {}


def _schedule_m_sct(costs: _Costs) -> tuple[_Schedule, Stats]:
    try:
        status, x, lp_makespan, lp_time = favourite_lp(costs)
    except Exception as exc:  # highspy missing or failing: the documented m-ETF fallback
        status, x, lp_makespan, lp_time = f"failed: {type(exc).__name__}: {exc}", None, 0.0, 0.0
    if status != "optimal" or x is None:
        return _etf(costs), {"lp_status": status, "fallback": "m_etf"}
    child, _ = _round_favourites(costs, x)
    sched = _etf(costs, child)
    has = np.flatnonzero(child >= 0)
    return sched, {
        "lp_status": status,
        "lp_makespan_s": lp_makespan,
        "lp_time_s": lp_time,
        "lp_x_min": float(x.min(initial=0.0)),
        "lp_x_max": float(x.max(initial=0.0)),
        "lp_fractional_edges": int(np.count_nonzero((x > 1e-6) & (x < 1 - 1e-6))),
        "favourite_edges": len(has),
        "favourites_kept_together": int(
            np.count_nonzero(sched.device[has] == sched.device[child[has]])
        ),
    }


def _schedule_heft(costs: _Costs) -> tuple[_Schedule, Stats]:
    rank = costs.upward_rank()
    return _ready_list(costs, -rank, _eft_rule, insertion=True), {}


def _critical_path(costs: _Costs, rank_u: np.ndarray, prio: np.ndarray) -> np.ndarray:
    """CPOP's critical path as a mask: from the highest-priority entry, follow the
    successor that realises each group's upward rank (mean communication + its rank_u) to
    an exit. Every group on it has priority |CP|; a shortcut edge to a group further down
    the path (same priority) is not followed. Ties: lowest group index. O(V + E)."""
    on_path = np.zeros(costs.n, dtype=bool)
    if not costs.n:
        return on_path
    entries = np.flatnonzero(np.diff(costs.pred_ptr) == 0)
    g = int(entries[np.argmax(prio[entries])])
    while True:
        on_path[g] = True
        succ, edges = costs.succs(g)
        if not len(succ):
            return on_path
        tail = costs.mean_comm[edges] + rank_u[succ]
        g = int(succ[np.lexsort((succ, -tail))[0]])


def _schedule_cpop(costs: _Costs) -> tuple[_Schedule, Stats]:
    rank_u = costs.upward_rank()
    prio = rank_u + costs.downward_rank()
    on_path = _critical_path(costs, rank_u, prio)
    path = np.flatnonzero(on_path)
    cp_device = int(costs.acc[np.argmin(costs.time[np.ix_(costs.acc, path)].sum(axis=1))])

    def rule(sched: _Schedule, g: int, ready: np.ndarray) -> tuple[int, float]:
        elig = sched.eligible(g)
        if on_path[g] and cp_device in elig:
            return cp_device, sched.earliest_start(g, cp_device, float(ready[cp_device]))
        return sched.best_finish(g, elig, ready)

    sched = _ready_list(costs, -prio, rule, insertion=True)
    return sched, {
        "critical_path_groups": len(path),
        "critical_path_device": costs.device_names[cp_device],
    }


_SCHEDULERS: dict[str, tuple[str, Callable[[_Costs], tuple[_Schedule, Stats]]]] = {
    "m_topo": ("m-TOPO", _schedule_m_topo),
    "m_etf": ("m-ETF", _schedule_m_etf),
    "m_sct": ("m-SCT", _schedule_m_sct),
    "heft": ("HEFT", _schedule_heft),
    "cpop": ("CPOP", _schedule_cpop),
}


def _place(name: str, problem: PlacementProblem) -> tuple[np.ndarray, Stats]:
    label, scheduler = _SCHEDULERS[name]
    sched, extra = scheduler(_Costs(problem))
    return sched.result(label, **extra)


# ------------------------------------------------------------------------------ placers
@register(
    "m_topo",
    family=_FAMILY,
    description="topological order cut into one run per accelerator of about equal compute, "
    "moving on to the next device when memory runs out",
    source="Jeon et al., Baechi, SoCC 2020, §4.1 (m-TOPO)",
)
def place_m_topo(problem: PlacementProblem, budget_s: float, seed: int):
    """Baechi's m-TOPO (Jeon et al., SoCC 2020, §4.1).

    Walk the groups in topological order and fill the accelerators one after another, each
    up to an even share of the total compute (mean over the accelerators): a group goes to
    the device whose share holds the midpoint of its compute in the running total, never
    back to an earlier device. A group that does not fit the current device moves the walk
    on to the next one for good; past the last accelerator, the memory rule picks the
    eligible device with the most free memory. O(V log V + E · D).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> devices, stats = place_m_topo(p, 1.0, 0)
    >>> sorted({p.device_names[d] for d in devices.tolist()}), p.fits(devices)
    (['gpu0', 'gpu1'], True)
    """
    return _place("m_topo", problem)


@register(
    "m_etf",
    family=_FAMILY,
    description="earliest task first: repeatedly start the (ready group, device) pair that "
    "can start soonest, with communication from other devices, within memory",
    source="Hwang et al., SIAM J. Comput. 1989 (ETF); Jeon et al., Baechi, SoCC 2020, §4.2",
)
def place_m_etf(problem: PlacementProblem, budget_s: float, seed: int):
    """Baechi's m-ETF (Jeon et al., SoCC 2020, §4.2; ETF: Hwang, Chow, Anger & Lee,
    SIAM J. Comput. 18(2), 1989).

    Each step schedules, among all ready groups and their eligible devices, the pair with
    the earliest start time: a group's data reaches a device ``latency + bytes /
    bandwidth`` after each predecessor on another device finishes, and a device is free
    after its last group (no insertion). Ties go to the higher static level, then the
    lower group index, the earlier finish and the lower device index. Memory is reserved
    as groups are placed. O(V² · D) at worst (V groups, D devices).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> devices, stats = place_m_etf(p, 1.0, 0)
    >>> len(devices) == p.num_groups, p.fits(devices), stats["algorithm"]
    (True, True, 'm-ETF')
    """
    return _place("m_etf", problem)


@register(
    "m_sct",
    family=_FAMILY,
    description="favourite children from the LP relaxation of the small-communication-time "
    "ILP (HiGHS), then ETF that keeps a favourite child on its parent's device, within memory",
    source="Hanen & Munier 1995 (SCT); Jeon et al., Baechi, SoCC 2020, §4.3 (m-SCT)",
)
def place_m_sct(problem: PlacementProblem, budget_s: float, seed: int):
    """Baechi's m-SCT (Jeon et al., SoCC 2020, §4.3; Hanen & Munier, "An approximation
    algorithm for scheduling dependent tasks on m processors with small communication
    delays", 1995).

    1. Solve the LP relaxation of the favourite-child scheduling ILP with HiGHS
       (:func:`favourite_lp`) and round it: ``x ≥ 0.5`` makes the child its parent's
       favourite (at most one each way, largest ``x`` first).
    2. List-schedule as m-ETF, except that a device whose last group has a *ready*
       favourite child is kept for that child: the child may only go there (if it fits)
       and no other group may, unless that leaves it no eligible device. So a favourite
       child runs right after its parent, on the parent's device, and their edge is free.

    If HiGHS is missing or finds no optimum the result is m-ETF's, and the stats say so
    (``lp_status``, ``fallback: m_etf``). O(LP) + O(V² · D); the LP has V + E + 1
    columns and at most E + 2V rows (milliseconds for 256 groups).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> devices, stats = place_m_sct(p, 1.0, 0)
    >>> stats["lp_status"], 0 <= stats["lp_x_min"] <= stats["lp_x_max"] <= 1, p.fits(devices)
    ('optimal', True, True)
    """
    return _place("m_sct", problem)


@register(
    "heft",
    family=_FAMILY,
    description="upward rank with mean costs, then each group on the device with the "
    "earliest finish time (inserting into idle gaps), within memory",
    source="Topcuoglu, Hariri & Wu, IEEE TPDS 13(3), 2002, §4.1 (HEFT)",
)
def place_heft(problem: PlacementProblem, budget_s: float, seed: int):
    """HEFT (Topcuoglu, Hariri & Wu, IEEE TPDS 13(3), 2002, §4.1).

    Priority: upward rank ``rank_u(i) = w̄_i + max_j (c̄_ij + rank_u(j))`` with mean
    compute ``w̄`` over the accelerators and mean communication ``c̄ = L̄ + bytes / B̄``
    (mean latency and bandwidth between distinct accelerators). In decreasing rank order
    (a topological order; ties by topological position), each group goes to the eligible
    device where it finishes first, starting in the earliest idle gap long enough after
    its data arrives (insertion policy). O(E · D + V² + V · D) for V groups, E edges and
    D devices.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> devices, stats = place_heft(p, 1.0, 0)
    >>> len(devices) == p.num_groups, p.fits(devices), stats["memory_fallbacks"]
    (True, True, 0)
    """
    return _place("heft", problem)


@register(
    "cpop",
    family=_FAMILY,
    description="critical path on a processor: the critical path's groups on the one "
    "device fastest for them, the rest by earliest finish time, within memory",
    source="Topcuoglu, Hariri & Wu, IEEE TPDS 13(3), 2002, §4.2 (CPOP)",
)
def place_cpop(problem: PlacementProblem, budget_s: float, seed: int):
    """CPOP (Topcuoglu, Hariri & Wu, IEEE TPDS 13(3), 2002, §4.2).

    Priority ``rank_u + rank_d`` (mean costs as in HEFT). The critical path
    (:func:`_critical_path`) runs from the highest-priority entry group to an exit; the
    critical-path device is the accelerator that minimises the path's total compute. A
    ready queue releases groups by priority: critical-path groups go to that device (if
    they fit), the others to the eligible device with the earliest finish time (insertion
    policy). O(E · D + V² + V · D).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> devices, stats = place_cpop(p, 1.0, 0)
    >>> p.fits(devices), stats["critical_path_groups"] > 0
    (True, True)
    """
    return _place("cpop", problem)
