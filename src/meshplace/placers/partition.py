"""Graph-partitioning placers: balanced k-way min-cut partitions of the co-location groups.

ColocRL (Mirhoseini et al., ICML 2017, §4 "Baselines") compares against Scotch, a static
mapper that splits the op graph into balanced parts with few cut edges, and against a
MinCut heuristic. meshplace has two such baselines:

* ``metis``: one k-way call to METIS (Karypis & Kumar, SIAM J. Sci. Comput. 1998) through
  ``pymetis`` — the modern, widely available stand-in for Scotch;
* ``mincut``: recursive min-cut bisection refined with Fiduccia–Mattheyses moves (a
  Kernighan–Lin variant that balances vertex *weights*).

Both see the group graph as undirected: vertex weight = a group's compute time on a
reference accelerator (the fastest one), edge weight = bytes between the two groups. Both
use the accelerators only (``accelerators``) and, where the plan's memory estimate
(``problem.group_memory``) overloads a device, repair it with :func:`repair_memory`.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> r = run_placer("metis", p, budget_s=2.0, seed=0)
>>> sorted({p.device_names[d] for d in r.op_devices.tolist()})
['gpu0', 'gpu1']
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pymetis

from meshplace.placers.base import PlacementProblem, register
from meshplace.placers.baselines import accelerators, cpus

# METIS takes 32-bit integer weights: scale so that all vertex (edge) weights sum to about
# this, keeping every weight >= 1 and far from overflow.
_VERTEX_SCALE = 1_000_000
_EDGE_SCALE = 10_000_000
# METIS' allowed imbalance, in thousandths (its default for k-way is 30, i.e. 3 %).
_UFACTOR = 30
# METIS partitions this many times (from different random starts) and keeps the smallest cut.
_NCUTS = 8
# Largest number of parts whose mapping to devices is searched exhaustively (8! = 40,320).
_MAX_PERMUTED = 8


# ------------------------------------------------------------------- shared helpers
def reference_device(problem: PlacementProblem, devices: list[int]) -> int:
    """The device of ``devices`` that runs the whole graph fastest (lowest index on ties)."""
    totals = problem.group_time[devices].sum(axis=1)
    return devices[int(np.argmin(totals))]


def device_speeds(problem: PlacementProblem, devices: list[int]) -> np.ndarray:
    """Relative speed of each device (1 / its total group time), normalised to sum 1."""
    totals = problem.group_time[devices].sum(axis=1)
    speed = 1.0 / np.maximum(totals, 1e-30)
    return speed / speed.sum()


def useful_parts(weights: np.ndarray) -> int:
    """``ceil(total / heaviest)``: no part can weigh less than the heaviest vertex, so more
    parts than this cannot shorten the slowest one and only add communication (and METIS
    fails to fill them: it reports "too many parts"). At least 1.

    >>> useful_parts(np.array([4.0, 1.0, 1.0, 1.0]))
    2
    """
    heaviest = float(np.max(weights, initial=0.0))
    if heaviest <= 0:
        return max(1, len(weights))
    return max(1, int(np.ceil(float(np.sum(weights)) / heaviest - 1e-9)))


def undirected_bytes(problem: PlacementProblem) -> np.ndarray:
    """Dense symmetric ``[groups, groups]`` matrix of bytes between every pair of groups."""
    n = problem.num_groups
    m = np.zeros((n, n))
    for s, d, b in problem.group_graph.edges():
        m[s, d] += b
        m[d, s] += b
    return m


def repair_memory(
    problem: PlacementProblem, assignment: np.ndarray, preferred: list[int]
) -> tuple[np.ndarray, int]:
    """Move the smallest groups off every device whose memory estimate overflows.

    For each overloaded device (most overloaded first), its groups that hold memory are
    taken smallest first and each is moved to the device of ``preferred`` with the most free
    memory that can hold it — or, if no such device can, to the CPU with the most free
    memory — until the device fits. Moving the smallest groups first keeps the compute
    balance the partitioner found as intact as possible. Groups that fit nowhere stay.
    Returns the new assignment and the number of groups moved. O(groups · devices).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> p.device_memory[1] = p.group_memory.sum() * 0.6  # gpu0 holds 60 % of the model
    >>> a, moved = repair_memory(p, np.full(p.num_groups, 1), [1, 2])
    >>> p.fits(a), moved > 0
    (True, True)
    """
    out = np.array(assignment, dtype=np.int64, copy=True)
    mem = problem.group_memory
    cap = problem.device_memory
    load = np.bincount(out, weights=mem, minlength=problem.num_devices)
    fallback = [c for c in cpus(problem) if c not in preferred]
    moved = 0
    overloaded = sorted(np.flatnonzero(load > cap).tolist(), key=lambda d: (cap[d] - load[d], d))
    for d in overloaded:
        members = np.flatnonzero((out == d) & (mem > 0))
        for g in members[np.argsort(mem[members], kind="stable")].tolist():
            if load[d] <= cap[d]:
                break
            target = _roomiest(load, cap, [x for x in preferred if x != d], mem[g])
            if target is None:
                target = _roomiest(load, cap, [x for x in fallback if x != d], mem[g])
            if target is None:
                continue
            out[g] = target
            load[d] -= mem[g]
            load[target] += mem[g]
            moved += 1
    return out, moved


def _roomiest(load: np.ndarray, cap: np.ndarray, devices: list[int], need: float) -> int | None:
    best, room = None, -np.inf
    for x in devices:
        free = cap[x] - load[x]
        if free >= need and free > room:
            best, room = x, free
    return best


def _part_bytes(parts: np.ndarray, k: int, adjacency: np.ndarray) -> np.ndarray:
    """``[k, k]`` bytes between parts (symmetric, zero diagonal)."""
    onehot = np.zeros((len(parts), k))
    onehot[np.arange(len(parts)), parts] = 1.0
    between = onehot.T @ adjacency @ onehot
    np.fill_diagonal(between, 0.0)
    return between


def _map_parts(problem: PlacementProblem, between: np.ndarray, devices: list[int]) -> list[int]:
    """A device per part: when the devices are all of one kind and there are at most
    ``_MAX_PERMUTED`` of them, the permutation that minimises the summed uncontended transfer
    time of the bytes between parts (so chatty parts share a PCIe switch); else in order."""
    k = len(devices)
    kinds = {problem.cluster.devices[d].kind for d in devices}
    if k < 3 or k > _MAX_PERMUTED or len(kinds) > 1 or not between.any():
        return list(devices)
    cluster = problem.cluster
    lat = np.zeros((k, k))
    per_byte = np.zeros((k, k))
    for i, j in itertools.product(range(k), repeat=2):
        if i != j:
            lat[i, j] = cluster.transfer_time(devices[i], devices[j], 0.0)
            gigabyte = cluster.transfer_time(devices[i], devices[j], 1e9)
            per_byte[i, j] = (gigabyte - lat[i, j]) / 1e9
    perms = np.array(list(itertools.permutations(range(k))), dtype=np.int64)
    used = between > 0
    cost = np.zeros(len(perms))
    for p, q in zip(*np.nonzero(used)):
        a, b = perms[:, p], perms[:, q]
        cost += lat[a, b] + between[p, q] * per_byte[a, b]
    best = perms[int(np.argmin(cost))]  # first minimum: deterministic
    return [devices[i] for i in best.tolist()]


def _finish(
    problem: PlacementProblem, assignment: np.ndarray, acc: list[int], stats: dict[str, Any]
) -> tuple[np.ndarray, dict[str, Any]]:
    moved = 0
    if not problem.fits(assignment):
        assignment, moved = repair_memory(problem, assignment, acc)
    adjacency_cut = 0.0
    for s, d, b in problem.group_graph.edges():
        if assignment[s] != assignment[d]:
            adjacency_cut += b
    ref = reference_device(problem, acc)
    load = np.bincount(assignment, weights=problem.group_time[ref], minlength=problem.num_devices)
    stats.update(
        {
            "cut_bytes": float(adjacency_cut),
            "compute_s": {
                problem.device_names[d]: float(load[d]) for d in sorted(set(assignment.tolist()))
            },
            "memory_moves": moved,
            "fits": problem.fits(assignment),
        }
    )
    return assignment, stats


# ---------------------------------------------------------------------------- metis
@register(
    "metis",
    family="partition",
    description="METIS k-way partition of the group graph: compute-balanced parts, minimum "
    "bytes cut, one part per accelerator",
    source="Mirhoseini et al., ICML 2017, §4 (Scotch baseline); Karypis & Kumar, SIAM J. Sci. "
    "Comput. 1998 (METIS)",
)
def place_metis(
    problem: PlacementProblem, budget_s: float, seed: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """A compute-balanced, minimum-cut k-way partition of the group graph by METIS, one part
    per accelerator — the modern stand-in for ColocRL's Scotch baseline (Mirhoseini et al.,
    ICML 2017, §4; Karypis & Kumar, SIAM J. Sci. Comput. 1998).

    * Graph: the group graph made undirected. Vertex weight: the group's seconds on the
      fastest accelerator, scaled to integers summing to ~10⁶ (each ≥ 1). Edge weight:
      bytes between the groups, scaled to integers summing to ~10⁷ (each ≥ 1).
    * k = number of accelerators, capped by :func:`useful_parts` (on a cluster with more
      accelerators than the groups can fill, the fastest k); target part weights are
      proportional to each accelerator's speed (equal on a homogeneous cluster); METIS' own
      3 % imbalance tolerance; the best cut of 8 METIS runs (``ncuts``), its random
      generator seeded with ``seed`` (deterministic).
    * Parts go to devices by the permutation that minimises transfer time between parts
      (exhaustive up to 8 accelerators of one kind), so chatty parts share a switch.
    * If the memory estimate does not fit, :func:`repair_memory` moves the smallest groups
      off each overloaded device.

    Complexity: METIS is O(V + E) per level of its multilevel scheme; building the graph
    O(V + E); the part-to-device search O(k! · k²) for k ≤ 8.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> a, stats = place_metis(p, 2.0, seed=0)
    >>> len(a) == p.num_groups, stats["fits"], sorted(set(a.tolist()))
    (True, True, [1, 2])
    """
    acc = accelerators(problem)
    n = problem.num_groups
    ref = reference_device(problem, acc)
    t = problem.group_time[ref]
    k = min(len(acc), n, useful_parts(t))
    # The k fastest accelerators (all of them on a homogeneous cluster), in ring order.
    fastest = sorted(acc, key=lambda d: (problem.group_time[d].sum(), d))[:k]
    devices = problem.cluster.ring_order(fastest)
    stats: dict[str, Any] = {"parts": k}
    if k <= 1:
        return _finish(problem, np.full(n, devices[0], dtype=np.int64), acc, stats)
    vweights = np.maximum(1, np.rint(t / max(t.sum(), 1e-30) * _VERTEX_SCALE)).astype(np.int64)

    adjacency = undirected_bytes(problem)
    rows, cols = np.nonzero(adjacency)  # row-major: CSR order
    xadj = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int64)
    ebytes = adjacency[rows, cols]
    eweights = np.maximum(1, np.rint(ebytes / max(ebytes.sum(), 1e-30) * _EDGE_SCALE)).astype(
        np.int64
    )

    speeds = device_speeds(problem, devices)
    tpwgts = None
    if not np.allclose(speeds, speeds[0]):
        tpwgts = (speeds * (1.0 - 1e-6)).tolist()  # METIS wants them to sum to <= 1
    options = pymetis.Options(seed=int(seed) % (2**31 - 1), ufactor=_UFACTOR, ncuts=_NCUTS)
    _, membership = pymetis.part_graph(
        k,
        pymetis.CSRAdjacency(adj_starts=xadj.tolist(), adjacent=cols.tolist()),
        vweights=vweights.tolist(),
        eweights=eweights.tolist() if len(eweights) else None,
        tpwgts=tpwgts,
        recursive=False,
        options=options,
    )
    parts = np.asarray(membership, dtype=np.int64)
    if tpwgts is None:
        devices = _map_parts(problem, _part_bytes(parts, k, adjacency), devices)
    assignment = np.asarray(devices, dtype=np.int64)[parts]
    return _finish(problem, assignment, acc, stats)


# --------------------------------------------------------------------------- mincut
_FM_PASSES = 8
_FM_RANDOM_STARTS = 3
_BALANCE = 0.03  # allowed deviation from a side's target weight, as a fraction of the total


def fm_bisect(
    adjacency: np.ndarray,
    weights: np.ndarray,
    fraction: float,
    rng: np.random.Generator,
    starts: int = _FM_RANDOM_STARTS,
    tolerance: float = _BALANCE,
) -> np.ndarray:
    """A min-cut bisection: ``side[v]`` is 0 or 1, side 0 holding about ``fraction`` of the
    total weight (within ``tolerance`` of the total, or no worse than the start allows).

    Starts: the index-order prefix that reaches ``fraction`` (a topological cut when vertices
    are numbered topologically) and ``starts`` graph-growing starts (breadth-first from a
    random vertex, heaviest edges first; Karypis & Kumar 1998, §3). Each is refined by
    Fiduccia–Mattheyses passes (Fiduccia & Mattheyses, DAC 1982): move the unlocked vertex
    of highest gain whose move keeps the balance, lock it, and keep the best prefix of the
    pass. The smallest cut among the balanced results wins (then the best balance, then
    the first start); if none is balanced, the least unbalanced.
    O(starts · passes · V²) with a dense adjacency matrix.

    >>> a = np.array([[0, 9, 1, 0], [9, 0, 0, 1], [1, 0, 0, 9], [0, 1, 9, 0]], float)
    >>> fm_bisect(a, np.ones(4), 0.5, np.random.default_rng(0)).tolist()
    [0, 0, 1, 1]
    """
    n = len(weights)
    w = np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    target = total * fraction
    candidates = [_prefix_start(w, target)]
    for _ in range(starts):
        candidates.append(_growing_start(adjacency, w, target, rng))
    best: tuple[float, float, float, int] | None = None
    best_side = candidates[0]
    for idx, side in enumerate(candidates):
        side = _fm_refine(adjacency, w, side, target, tolerance * total)
        cut = float(adjacency[side == 0][:, side == 1].sum())
        imbalance = abs(float(w[side == 0].sum()) - target)
        key = (max(0.0, imbalance - tolerance * total), cut, imbalance, idx)
        if best is None or key < best:
            best, best_side = key, side
    if n and not (best_side == 0).any() and fraction > 0:
        best_side[0] = 0
    return best_side


def _prefix_start(w: np.ndarray, target: float) -> np.ndarray:
    cum = np.cumsum(w)
    cut = int(np.searchsorted(cum, target))
    if cut < len(w) and cut > 0 and abs(cum[cut - 1] - target) <= abs(cum[cut] - target):
        cut -= 1
    side = np.ones(len(w), dtype=np.int64)
    side[: cut + 1] = 0
    return side


def _growing_start(
    adjacency: np.ndarray, w: np.ndarray, target: float, rng: np.random.Generator
) -> np.ndarray:
    """Grow side 0 from a random vertex, always adding the outside vertex most strongly
    connected to it (a random unvisited vertex when none is), until it reaches ``target``."""
    n = len(w)
    side = np.ones(n, dtype=np.int64)
    weight = 0.0
    pull = np.zeros(n)
    v = int(rng.integers(n))
    while True:
        side[v] = 0
        weight += w[v]
        pull += adjacency[v]
        if weight >= target or weight + 1e-12 >= w.sum():
            break
        outside = side == 1
        if not outside.any():
            break
        scores = np.where(outside, pull, -1.0)
        v = int(np.argmax(scores))
        if scores[v] <= 0:
            free = np.flatnonzero(outside)
            v = int(free[rng.integers(len(free))])
        # stop before overshooting further than the current gap
        if weight + w[v] - target > target - weight:
            break
    return side


def _fm_refine(
    adjacency: np.ndarray, w: np.ndarray, side: np.ndarray, target: float, tolerance: float
) -> np.ndarray:
    side = side.copy()
    n = len(w)
    if n < 2:
        return side
    for _ in range(_FM_PASSES):
        sign = np.where(side == 0, 1.0, -1.0)
        # gain of moving v: (bytes to the other side) - (bytes to its own side)
        same = adjacency @ (side == 0).astype(float)
        other = adjacency.sum(axis=1) - same
        gain = np.where(side == 0, other - same, same - other)
        left = float(w[side == 0].sum())
        limit = max(tolerance, abs(left - target))
        locked = np.zeros(n, dtype=bool)
        moves: list[int] = []
        cumulative, best_cum, best_len = 0.0, 0.0, 0
        best_imb = abs(left - target)
        for _step in range(n):
            new_left = left - sign * w  # moving v changes side 0's weight by -sign·w
            ok = (~locked) & (np.abs(new_left - target) <= limit)
            if not ok.any():
                break
            v = int(np.argmax(np.where(ok, gain, -np.inf)))
            cumulative += gain[v]
            left = float(new_left[v])
            old = side[v]
            side[v] = 1 - old
            locked[v] = True
            # neighbours on v's old side gain (their edge to v is now external), the others lose
            delta = 2.0 * adjacency[v] * np.where(side == old, 1.0, -1.0)
            gain += delta
            gain[v] = -gain[v] - delta[v]
            sign[v] = -sign[v]
            moves.append(v)
            imb = abs(left - target)
            if cumulative > best_cum + 1e-9 or (
                abs(cumulative - best_cum) <= 1e-9 and imb < best_imb - 1e-12
            ):
                best_cum, best_len, best_imb = cumulative, len(moves), imb
        for v in moves[best_len:]:
            side[v] = 1 - side[v]
        if best_len == 0:
            break
    return side


@register(
    "mincut",
    family="partition",
    description="recursive compute-balanced min-cut bisection (Fiduccia–Mattheyses) of the "
    "group graph down to one part per accelerator",
    source="Mirhoseini et al., ICML 2017, §4 (MinCut baseline); Fiduccia & Mattheyses, DAC 1982",
)
def place_mincut(
    problem: PlacementProblem, budget_s: float, seed: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """Recursive min-cut bisection of the undirected group graph (edge weight = bytes)
    down to one part per accelerator — ColocRL's MinCut baseline (Mirhoseini et al., ICML
    2017, §4).

    The accelerators (capped like ``metis`` by :func:`useful_parts`: the fastest k), in
    ring order (so that halves are near each other: GPUs under one PCIe switch stay
    together), are split into a first half of ⌊k/2⌋ and a second of
    ⌈k/2⌉; the groups are bisected by :func:`fm_bisect` so that each side's compute (seconds
    on the fastest accelerator) is proportional to its devices' speed — this handles
    non-powers of two — and each side recurses on its own devices. Vertex weights are
    balanced to 3 % of the total; networkx's Kernighan–Lin bisection swaps vertex *pairs*,
    which keeps vertex counts equal but not compute, hence Fiduccia–Mattheyses moves here.
    Seeded by ``seed`` (deterministic). Memory is then repaired like ``metis``.

    Complexity: O(log k · starts · passes · V²), about 0.1–0.5 s for 256 groups.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> a, stats = place_mincut(p, 2.0, seed=0)
    >>> len(a) == p.num_groups, stats["fits"], sorted(set(a.tolist()))
    (True, True, [1, 2])
    """
    acc = accelerators(problem)
    n = problem.num_groups
    ref = reference_device(problem, acc)
    weights = problem.group_time[ref]
    k = min(len(acc), max(n, 1), useful_parts(weights))
    fastest = sorted(acc, key=lambda d: (problem.group_time[d].sum(), d))[:k]
    devices = problem.cluster.ring_order(fastest)
    speed = dict(zip(devices, device_speeds(problem, devices).tolist()))
    adjacency = undirected_bytes(problem)
    rng = np.random.default_rng(seed)
    assignment = np.full(n, devices[0], dtype=np.int64)

    def split(members: np.ndarray, devs: list[int]) -> None:
        if len(devs) == 1 or len(members) == 0:
            assignment[members] = devs[0]
            return
        if len(members) == 1:
            assignment[members] = devs[0]
            return
        first, second = devs[: len(devs) // 2], devs[len(devs) // 2 :]
        fraction = sum(speed[d] for d in first) / sum(speed[d] for d in devs)
        sub = adjacency[np.ix_(members, members)]
        side = fm_bisect(sub, weights[members], fraction, rng)
        split(members[side == 0], first)
        split(members[side == 1], second)

    split(np.arange(n), devices)
    return _finish(problem, assignment, acc, {"parts": len(devices)})
