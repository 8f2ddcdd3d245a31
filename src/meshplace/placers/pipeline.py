"""Pipeline placement: the optimal convex split of the model into stages for throughput.

PipeDream (Narayanan et al., SOSP 2019, §3.1) cuts the layers, in execution order, into
contiguous *stages*, one per device, and chooses the cuts by dynamic programming so that
the slowest stage — the pipeline's bottleneck, which sets the steady-state time per
(micro-)batch — is as fast as possible. Tarnawski et al. (NeurIPS 2020, "Efficient
algorithms for device placement of DNN graph operators", §3) make the DP optimal over every
split whose stages only send forward: the stages are differences of nested *ideals* of the
DAG (sets closed under predecessors), not runs of one topological order, and the CPU may
take a stage. meshplace does that on *forward units*:

1. the forward compute ops in topological order are the units; every other op is attributed
   to the unit :func:`complete_placement` would co-locate it with (a backward op to its
   forward op, a parameter and its update ops to its first forward consumer, …), so a
   unit's load is its forward, backward and update time (:func:`forward_units`);
2. units that must share a stage are merged (:func:`condense_units`: each strict
   co-location class and everything between its members), and the merged units are
   coarsened into at most 256 chunks of similar time along a topological order — both
   execution order and the order that finishes a module before starting the next
   (:func:`module_major_order`: an unrolled RNN's execution order interleaves its layers,
   and chunks that mix layers cannot be split by layer) are tried, the better kept;
3. the chunk DAG's ideals are listed (:func:`unit_ideals`); where there are more than
   :data:`MAX_IDEALS` (wide graphs such as Inception), the DP falls back to the prefixes of
   the topological order, i.e. PipeDream's contiguous split, and says so in its stats;
4. :func:`best_ideal_split` finds the best chain of ideals and devices: the accelerators
   in ``cluster.ring_order`` order, with one CPU inserted at any position or not at all
   (:func:`device_sequences`), minimising the bottleneck under each device's memory, with
   transfers charged as the cluster says (overlapping compute, or occupying the device);
5. forward ops go to their stage's device and :func:`complete_placement` places the rest;
6. under the ``throughput`` objective, a local search (:func:`improve_bottleneck`) then
   moves co-location groups off the bottleneck device while the simulator says it pays —
   the non-contiguous improvement: a stage's backward work, or one branch, elsewhere.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> r = run_placer("pipeline", p, budget_s=2.0, seed=0)
>>> r.stats["stages"] <= 3, r.stats["micro_batches"]  # 2 GPUs, a CPU; one step: 1
(True, 1)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from meshplace.placers.base import (
    SIMULATED_OPS_PER_SECOND,
    OpAssignment,
    PlacementProblem,
    PlacerOptions,
    register,
)
from meshplace.placers.baselines import accelerators, cpus
from meshplace.placers.colocate import complete_placement

MAX_CHUNKS = 256
# GPipe (Huang et al., NeurIPS 2019, §2.3): with M >= 4 x K micro-batches for K stages the
# pipeline's fill-and-drain bubble, (K - 1) / (M + K - 1) of the time, is negligible.
MICRO_BATCHES_PER_STAGE = 4

# ------------------------------------------------- the DP over ideals (issue 17)
MAX_IDEALS = 600
"""Above this many ideals of the stage-order DAG the DP falls back to the prefixes of one
topological order (the contiguous split PipeDream makes): the DP is O(K^2) per stage."""
MEMORY_ROUNDS = 4
"""The DP's memory is an estimate: at most this many rounds of DP, simulate, and shrink the
capacity of any device whose simulated peak is over (``pipeline_split``)."""


def unit_ideals(preds: list[list[int]], max_ideals: int = MAX_IDEALS) -> np.ndarray | None:
    """Every ideal (set of units closed under predecessors: a possible "everything before
    this stage") of the DAG whose unit ``u`` has predecessors ``preds[u]``, as a boolean
    matrix ``[ideals, units]`` sorted by size (so a subset comes before its supersets);
    ``None`` when there are more than ``max_ideals``. Breadth-first from the empty set,
    adding one unit whose predecessors are all in; O(K n) set operations for K ideals.

    >>> unit_ideals([[], [0], [0]]).astype(int).tolist()  # a fork: 0 then 1 and 2
    [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]]
    >>> unit_ideals([[], [], []], max_ideals=4) is None  # 8 ideals
    True
    """
    n = len(preds)
    need = [sum(1 << p for p in ps) for ps in preds]
    seen = {0}
    layer = [0]
    order = [0]
    while layer:
        nxt = []
        for ideal in layer:
            for u in range(n):
                bit = 1 << u
                if not ideal & bit and need[u] & ideal == need[u]:
                    grown = ideal | bit
                    if grown not in seen:
                        seen.add(grown)
                        nxt.append(grown)
                        if len(seen) > max_ideals:
                            return None
        nxt.sort()
        order.extend(nxt)
        layer = nxt
    return np.array([[(i >> u) & 1 for u in range(n)] for i in order], dtype=bool).reshape(
        len(order), n
    )


def prefix_ideals(n: int) -> np.ndarray:
    """The ``n + 1`` prefixes of the order 0..n-1 as ideals (the fallback: contiguous runs
    of one topological order).

    >>> prefix_ideals(2).astype(int).tolist()
    [[0, 0], [1, 0], [1, 1]]
    """
    return np.tri(n + 1, n, -1, dtype=bool)


def condense_units(
    n: int, edges: Sequence[tuple[int, int]], classes: Sequence[Sequence[int]] = ()
) -> np.ndarray:
    """Units that must share a stage, merged: each strict co-location class (units that
    must run on one device) together with every unit on a path between two of its members
    — a pipeline stage is convex, so those must join it too. Found as the strongly
    connected components of the stage-order DAG (``edges``) with each class joined into a
    cycle; the merged units are numbered in a topological order (smallest member first
    among ready ones). O(n + E).

    >>> condense_units(4, [(0, 1), (1, 2), (2, 3)], [[0, 2]]).tolist()  # 1 lies between
    [0, 0, 0, 1]
    """
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    for members in classes:
        for a, b in itertools.pairwise(members):
            g.add_edge(a, b)
            g.add_edge(b, a)
    dag = nx.condensation(g)
    first = {c: min(dag.nodes[c]["members"]) for c in dag.nodes}
    order = nx.lexicographical_topological_sort(dag, key=first.__getitem__)
    number = {c: i for i, c in enumerate(order)}
    return np.array([number[dag.graph["mapping"][u]] for u in range(n)], dtype=np.int64)


def module_major_order(modules: Sequence[str], edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """A topological order of units ``0..n-1`` (already numbered topologically) that
    finishes a module before it starts the next where the edges allow: among the ready
    units, the one sharing the longest module-path prefix with the unit just placed, then
    the lowest number. The position of each unit is returned.

    Why: execution order interleaves the layers of a recurrent network (step 1 of layer
    0, step 1 of layer 1, step 2 of layer 0, …), so runs of it mix layers and the chunks
    cut from them form a chain whose ideals cannot separate the layers; runs of this
    order can. Kahn's algorithm with a scan of the ready units: O(n · ready + E).

    >>> # two layers over two steps: execution order a0 b0 a1 b1; a1 needs a0, b1 needs b0, a1
    >>> module_major_order(["a", "b", "a", "b"], [(0, 1), (0, 2), (1, 3), (2, 3)]).tolist()
    [0, 2, 1, 3]
    """
    n = len(modules)
    parts = [tuple(m.split(".")) if m else () for m in modules]
    succ: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for u, v in edges:
        succ[u].append(v)
        indegree[v] += 1
    ready = sorted(u for u in range(n) if indegree[u] == 0)
    position = np.empty(n, dtype=np.int64)
    last: tuple[str, ...] = ()

    def shared(u: int, last: tuple[str, ...]) -> int:
        k = 0
        for a, b in zip(parts[u], last):
            if a != b:
                break
            k += 1
        return k

    for step in range(n):
        pick = min(ready, key=lambda u: (-shared(u, last), u))
        ready.remove(pick)
        position[pick] = step
        last = parts[pick]
        for v in succ[pick]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    return position


@dataclass(frozen=True)
class StageModel:
    """What a stage costs, for :func:`best_ideal_split`. ``D`` candidate devices.

    Attributes:
        loads: ``[D, n]`` seconds of each unit on each device.
        unit_bytes: ``[n, n]`` bytes unit ``u`` sends to unit ``v``.
        latency, seconds_per_byte: ``[D, D]`` the route from device ``p`` to device ``d``.
        occupy: ``[D]`` the device spends its transfers itself (``transfers: occupy``).
        memory: ``[n]`` bytes per unit, ``capacity``: ``[D]`` (both optional).
    """

    loads: np.ndarray
    unit_bytes: np.ndarray
    latency: np.ndarray
    seconds_per_byte: np.ndarray
    occupy: np.ndarray
    memory: np.ndarray | None = None
    capacity: np.ndarray | None = None


def best_ideal_split(
    ideals: np.ndarray, model: StageModel, sequences: list[list[int]]
) -> tuple[float, list[int], list[int]]:
    """The best pipeline over the ``ideals`` (``[K, n]`` booleans sorted by size, the empty
    set first and every unit last) and the device ``sequences`` (stage *j* on device
    ``sequence[j]``; a pipeline may stop early).

    A pipeline is a chain of ideals ``∅ = I_0 ⊂ I_1 ⊂ … ⊂ I_t = all``: stage *j* holds
    ``I_{j+1} \\ I_j``, so every stage receives activations only from earlier stages and
    gradients only from later ones (Tarnawski et al., NeurIPS 2020, §3: the DP over ideals
    that makes the split optimal among all such "contiguous" ones, not just along one
    topological order). Stage cost on device ``d``, previous stage's device ``p``, next
    ``q`` (either may be absent): with ``fwd_in`` the bytes from earlier stages, ``bwd_in``
    from later ones, ``fwd_out``/``bwd_out`` what it sends later/earlier, each timed on
    its route (latency + bytes x seconds per byte, 0 if no bytes),

    * ``max(compute, t(fwd_in, p→d), t(bwd_in, q→d))`` where transfers overlap compute;
    * ``compute + t(fwd_in, p→d) + t(bwd_in, q→d) + t(fwd_out, d→q) + t(bwd_out, d→p)``
      on a device whose transfers occupy it (as :mod:`meshplace.sim.engine` charges them,
      except that the simulator pays a route's latency once per tensor, the DP once per
      direction and boundary);
    * infinite where the stage's memory exceeds the device's capacity, or where a unit
      cannot run on the device (an infinite load: ``Op.unsupported``).

    Returns ``(bottleneck, ideal indices I_0..I_t, devices of the t stages)``: among
    optimal pipelines, the one with the fewest stages, then the first sequence; ``(inf,
    [], [])`` if none fits. Recurrence per sequence: ``f_j[J] = min over I ⊂ J of
    max(f_{j-1}[I], cost_j(I, J))``, vectorised over all ``(I, J)`` pairs: O(K^2 n) to
    set up and O(K^2) per stage and sequence.

    >>> chain = prefix_ideals(3)
    >>> flat = np.zeros((2, 2))
    >>> m = StageModel(np.ones((2, 3)), np.zeros((3, 3)), flat, flat, np.zeros(2, bool))
    >>> best_ideal_split(chain, m, [[0, 1]])
    (2.0, [0, 1, 3], [0, 1])
    """
    ind = ideals.astype(np.float64)
    k = len(ideals)
    full = k - 1
    # subset[I, J]: I is a proper subset of J
    outside = (~ideals).astype(np.float64)
    subset = (ind @ outside.T == 0) & ~np.eye(k, dtype=bool)
    b = np.asarray(model.unit_bytes, dtype=np.float64).copy()
    np.fill_diagonal(b, 0.0)
    x = ind @ b @ ind.T  # x[A, B]: bytes from units in ideal A to units in ideal B
    own = np.diagonal(x).copy()  # inside each ideal
    to_all = ind @ b.sum(axis=1)  # from A to every unit
    from_all = ind @ b.sum(axis=0)  # into A from every unit
    # for the stage S = J \ I, indexed [I, J]
    fwd_in = x - own[:, None]  # I -> S
    fwd_out = (to_all - own)[None, :] - (to_all[:, None] - x)  # S -> outside J
    bwd_out = x.T - own[:, None]  # S -> I
    bwd_in = (from_all - own)[None, :] - (from_all[:, None] - x.T)  # outside J -> S
    for arr in (fwd_in, fwd_out, bwd_out, bwd_in):
        np.maximum(arr, 0.0, out=arr)
    loads = np.asarray(model.loads, dtype=np.float64)
    blocked = np.isinf(loads)  # a unit a device cannot run (Op.unsupported)
    work = ind @ np.where(blocked, 0.0, loads).T  # [K, D]
    blocked_count = ind @ blocked.T.astype(np.float64)  # exact small integers
    mem = ind @ model.memory if model.memory is not None else None

    def t(nbytes: np.ndarray, src: int | None, dst: int | None) -> np.ndarray | float:
        if src is None or dst is None:
            return 0.0
        lat, per = model.latency[src, dst], model.seconds_per_byte[src, dst]
        return np.where(nbytes > 0, lat + nbytes * per, 0.0)

    @functools.lru_cache(maxsize=32)  # device sequences share most (d, p, q) triples
    def stage_cost(d: int, p: int | None, q: int | None) -> np.ndarray:
        compute = work[None, :, d] - work[:, None, d]
        recv_fwd, recv_bwd = t(fwd_in, p, d), t(bwd_in, q, d)
        if model.occupy[d]:
            cost = compute + recv_fwd + recv_bwd + t(fwd_out, d, q) + t(bwd_out, d, p)
        else:
            cost = np.maximum(np.maximum(compute, recv_fwd), recv_bwd)
        ok = subset & (blocked_count[None, :, d] == blocked_count[:, None, d])
        if mem is not None and model.capacity is not None:
            ok = ok & ((mem[None, :] - mem[:, None]) <= model.capacity[d])
        return np.where(ok, cost, np.inf)

    best: tuple[float, int, int, list[int], list[int]] = (np.inf, 0, 0, [], [])
    for seq_no, sequence in enumerate(sequences):
        f = np.full(k, np.inf)
        f[0] = 0.0
        parents: list[np.ndarray] = []
        for j, d in enumerate(sequence):
            p = sequence[j - 1] if j else None
            q = sequence[j + 1] if j + 1 < len(sequence) else None
            # (a stage that ends the pipeline sends nothing on and receives nothing back,
            # so its next device costs it nothing)
            cand = np.maximum(f[:, None], stage_cost(d, p, q))
            parent = np.argmin(cand, axis=0)  # smallest I among ties: deterministic
            f = cand[parent, np.arange(k)]
            f[0] = np.inf  # no empty stage
            parents.append(parent)
            key = (float(f[full]), j + 1, seq_no)
            if key < best[:3]:
                chain = [full]
                for back in reversed(parents):
                    chain.append(int(back[chain[-1]]))
                best = (*key, chain[::-1], list(sequence[: j + 1]))
    if not np.isfinite(best[0]):
        return float("inf"), [], []
    return best[0], best[3], best[4]


# --------------------------------------------------------------------- forward units
@dataclass(frozen=True)
class ForwardUnits:
    """The forward compute ops in execution order and what each op is attributed to.

    Attributes:
        ops: op indices of the forward compute ops (unit *u* is ``ops[u]``).
        unit_of_op: for every op of the graph, the unit it follows.
        time_by_kind: ``[device kinds, units]`` seconds attributed to each unit.
        memory: ``[units]`` bytes attributed to each unit (``problem.op_memory``).
    """

    ops: np.ndarray
    unit_of_op: np.ndarray
    time_by_kind: np.ndarray
    memory: np.ndarray


def forward_units(problem: PlacementProblem) -> ForwardUnits:
    """The forward units of ``problem.graph`` with everything attributed to them.

    Attribution is computed once by running :func:`complete_placement` with each unit's
    number as its "device": the co-location rules only look at which ops are placed, so the
    label an op receives is exactly the forward op it would share a device with. O(V + E).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> u = forward_units(p)
    >>> bool(np.isclose(u.time_by_kind.sum(axis=1), p.simulator.op_time_by_kind.sum(1)).all())
    True
    """
    graph = problem.graph
    ops = graph.ops
    order = graph.arrays().topo_order.tolist()
    fwd = np.array(
        [
            i
            for i in order
            if ops[i].phase == "forward" and ops[i].kind not in ("parameter", "buffer", "input")
        ],
        dtype=np.int64,
    )
    label = np.full(graph.num_ops, -1, dtype=np.int64)
    label[fwd] = np.arange(len(fwd))
    unit_of_op = complete_placement(graph, label, default=0) if len(fwd) else label + 1
    n_units = max(len(fwd), 1)
    sim = problem.simulator
    time_by_kind = np.stack(
        [
            np.bincount(unit_of_op, weights=sim.op_time_by_kind[k], minlength=n_units)
            for k in range(len(sim.kind_names))
        ]
    )
    memory = np.bincount(unit_of_op, weights=problem.op_memory, minlength=n_units)
    return ForwardUnits(fwd, unit_of_op, time_by_kind, memory)


def chunk_units(times: np.ndarray, max_chunks: int = MAX_CHUNKS) -> np.ndarray:
    """Chunk index per unit: contiguous runs of about ``total / max_chunks`` seconds each
    (a unit goes to the chunk its midpoint falls in; empty chunks are dropped).

    >>> chunk_units(np.array([1.0, 1.0, 1.0, 1.0, 4.0]), 2).tolist()
    [0, 0, 0, 0, 1]
    """
    n = len(times)
    if n <= max_chunks:
        return np.arange(n, dtype=np.int64)
    t = np.maximum(np.asarray(times, dtype=np.float64), 0.0)
    total = float(t.sum())
    if total <= 0:
        raw = np.arange(n) * max_chunks // n
    else:
        mid = np.cumsum(t) - t / 2.0
        raw = np.minimum((mid / (total / max_chunks)).astype(np.int64), max_chunks - 1)
    _, compact = np.unique(raw, return_inverse=True)
    return compact.astype(np.int64)


def _chunk_bytes(problem: PlacementProblem, chunk_of_op: np.ndarray, n: int) -> np.ndarray:
    """``[n, n]`` bytes from chunk to chunk. A producer sends its output once to each
    consuming chunk (the largest tensor any consumer there reads), as the simulator sends
    it once per consuming device."""
    a = problem.graph.arrays()
    m = np.zeros((n, n))
    if not len(a.edge_src):
        return m
    cs, cd = chunk_of_op[a.edge_src], chunk_of_op[a.edge_dst]
    cross = cs != cd
    src, dst_chunk, nbytes = a.edge_src[cross], cd[cross], a.edge_bytes[cross]
    if not len(src):
        return m
    key = src * n + dst_chunk
    order = np.lexsort((-nbytes, key))
    first = np.ones(len(order), dtype=bool)
    first[1:] = key[order][1:] != key[order][:-1]
    pick = order[first]
    np.add.at(m, (chunk_of_op[src[pick]], dst_chunk[pick]), np.rint(nbytes[pick]))
    return m


def _link(problem: PlacementProblem, src: int, dst: int) -> tuple[float, float]:
    """(latency, seconds per byte) of the route src -> dst, from ``transfer_time``."""
    c = problem.cluster
    latency = c.transfer_time(src, dst, 0.0)
    return latency, (c.transfer_time(src, dst, 1e9) - latency) / 1e9


def _stage_model(
    problem: PlacementProblem,
    devices: list[int],
    loads_by_kind: np.ndarray,
    chunk_bytes: np.ndarray,
    memory: np.ndarray | None,
    capacity: np.ndarray | None = None,
) -> StageModel:
    """The :class:`StageModel` of the chunks on the candidate ``devices`` (``capacity``:
    bytes per device, default their memory)."""
    kind_index = problem.simulator.device_kind_index
    n_dev = len(devices)
    latency = np.zeros((n_dev, n_dev))
    per_byte = np.zeros((n_dev, n_dev))
    for i, src in enumerate(devices):
        for j, dst in enumerate(devices):
            if src != dst:
                latency[i, j], per_byte[i, j] = _link(problem, src, dst)
    return StageModel(
        loads=np.stack([loads_by_kind[kind_index[d]] for d in devices]),
        unit_bytes=chunk_bytes,
        latency=latency,
        seconds_per_byte=per_byte,
        occupy=problem.simulator.occupy[devices],
        memory=memory,
        capacity=(
            (problem.device_memory[devices] if capacity is None else capacity)
            if memory is not None
            else None
        ),
    )


def _expand_stages(
    problem: PlacementProblem,
    graph: Any,
    units: ForwardUnits,
    chunk_of_unit: np.ndarray,
    ideals: np.ndarray,
    chain: list[int],
    stage_devices: list[int],
    candidates: list[int],
    model: StageModel,
    memory: np.ndarray,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The op-level plan of a chain of ideals on ``stage_devices`` (forward ops on their
    stage's device, the rest by :func:`complete_placement`) and each stage's detail."""
    device_of_chunk = np.zeros(len(memory), dtype=np.int64)
    detail = []
    for j, d in enumerate(stage_devices):
        members = ideals[chain[j + 1]] & ~ideals[chain[j]]
        device_of_chunk[members] = candidates[d]
        detail.append(
            {
                "device": problem.device_names[candidates[d]],
                "chunks": int(members.sum()),
                "compute_s": float(model.loads[d, members].sum()),
                "memory_bytes": float(memory[members].sum()),
            }
        )
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    partial[units.ops] = device_of_chunk[chunk_of_unit]
    return complete_placement(graph, partial, default=candidates[stage_devices[0]]), detail


def device_sequences(accelerators_in_order: int, cpu: bool) -> list[list[int]]:
    """Stage orders over candidate devices ``0..a-1`` (accelerators in ring order) and, if
    ``cpu``, device ``a`` (a CPU) inserted at any position of the pipeline or not at all.

    >>> device_sequences(2, cpu=True)
    [[0, 1], [2, 0, 1], [0, 2, 1], [0, 1, 2]]
    """
    base = list(range(accelerators_in_order))
    sequences = [base]
    if cpu:
        sequences += [[*base[:i], accelerators_in_order, *base[i:]] for i in range(len(base) + 1)]
    return sequences


@register(
    "pipeline",
    family="pipeline",
    description="optimal split of the forward units into pipeline stages that only send "
    "forward (DP over the DAG's ideals), on the accelerators and possibly a CPU "
    "(bottleneck objective, memory-aware, strict co-location kept)",
    source="Narayanan et al., PipeDream, SOSP 2019, §3.1; Tarnawski et al., NeurIPS 2020",
    takes_options=True,
)
def place_pipeline(
    problem: PlacementProblem,
    budget_s: float,
    seed: int,
    options: PlacerOptions | None = None,
) -> tuple[OpAssignment, dict[str, Any]]:
    """PipeDream's partitioning made optimal over ideals (Narayanan et al., SOSP 2019,
    §3.1; Tarnawski et al., NeurIPS 2020, §3; module docstring): the forward units, with
    their backward and update work, merged where strict co-location or convexity demands,
    coarsened to at most 256 chunks, are split into stages that only send forward, on the
    accelerators in ring order and possibly one CPU, by :func:`best_ideal_split`.

    Stage cost = max(its compute on its device, the time to receive the bytes crossing
    into it from earlier stages over the route from the previous device, and from later
    stages from the next device) — on a device whose transfers occupy it (``transfers:
    occupy``), its compute plus every send and receive, as the simulator charges them;
    each stage's memory must fit its device. If no split fits, memory is ignored
    (``stats["fits"]`` says so). Deterministic (``seed`` is unused).

    The DP chooses the plan for its steady-state time ``stats["bottleneck_s"]``. Under
    the ``throughput`` objective :func:`improve_bottleneck` then improves it with
    :func:`local_search_evaluations` simulations at most (``stats["local_search"]``; the
    stage detail describes the DP's plan before it); under ``step`` the DP's plan is
    returned as it is — a pipeline plan, which one step does not reward.

    A plan whose stages ``torch.distributed.pipelining`` can run (:func:`runs_as_stages`:
    contiguous in execution order, backward beside forward) carries ``stats[
    "micro_batches"]`` under the ``throughput`` objective: of the counts from 1 to 8 per
    stage that divide the batch (:func:`micro_batch_choices`), the one whose 1F1B schedule
    is fastest
    (``stats["schedule"]``, :func:`schedule_of`; GPipe's
    rule, Huang et al., NeurIPS 2019, §2.3, takes 4 per stage to make the fill and drain
    small, but each micro-batch also pays every op's launch again). The DP over ideals (an
    unrolled RNN split by layer) and the local search may return plans that are pipelines
    only for the max-load objective, with one micro-batch. ``options.runnable_stages``
    (``meshplace plan --runnable-stages``) restricts the DP to splits of execution order
    and skips the local search, so the plan runs stage by stage — unless a strict
    co-location class spans ops far apart in execution order and its merge makes a stage
    non-contiguous; ``stats["runs_as_stages"]`` says which.

    Complexity: O(V + E) for the attribution and merging, O(K C) to list K ≤ 600 ideals
    of C ≤ 256 chunks, and O(K² · S · (S + 1)) for the DP over S stage devices and the
    S + 2 device orders, twice (two unit orders); then the local search's simulations.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> plan, stats = place_pipeline(p, 2.0, seed=0)
    >>> len(plan.devices) == p.graph.num_ops, stats["fits"], stats["bottleneck_s"] > 0
    (True, True, True)
    """
    runnable = options is not None and options.runnable_stages
    # torch.distributed.pipelining cuts the forward in execution order: with
    # runnable_stages, PipeDream's contiguous split (the CPU may still take a stage)
    if problem.objective == "throughput":
        assignment, stats = split_by_objective(problem, over_ideals=not runnable)
    else:
        assignment, stats = pipeline_split(problem, over_ideals=not runnable)
    if problem.objective == "throughput" and not runnable:
        evaluations = local_search_evaluations(problem, budget_s)
        devices, search = improve_bottleneck(problem, assignment.devices, evaluations)
        assignment = OpAssignment(devices)
        stats["local_search"] = search
    stats["runs_as_stages"] = runs_as_stages(problem.graph, assignment.devices)
    stats["micro_batches"] = 1
    if problem.objective == "throughput":
        # the objective itself chooses the micro-batch count (Simulator.pipelined_step):
        # record it and its schedule so the plan file carries what was scored
        scored = problem.simulator.simulate(
            problem.keep_strict(assignment.devices)[0], objective="throughput"
        )
        stats["micro_batches"] = scored.micro_batches
        if scored.schedule is not None:
            stats["schedule"] = schedule_summary(scored.schedule)
    return assignment, stats


def micro_batch_choices(graph: Any, stages: int) -> list[int]:
    """The micro-batch counts the throughput objective tries for a pipeline of ``stages``
    over ``graph`` (:func:`meshplace.sim.schedule.micro_batch_choices` at the traced batch).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("input:x", "input", output_shapes=[[32, 16]]))
    >>> micro_batch_choices(g, 3), micro_batch_choices(g, 64)
    ([4, 8, 16], [])
    """
    from meshplace.graph.summary import traced_batch
    from meshplace.sim.schedule import micro_batch_choices as choices

    return choices(traced_batch(graph), stages)


def schedule_summary(result: Any) -> dict[str, Any]:
    """What the ``plan`` table and ``stats["schedule"]`` show of a simulated schedule
    (:class:`meshplace.sim.schedule.ScheduleResult`)."""
    return {
        "schedule": result.schedule,
        "micro_batches": result.micro_batches,
        "step_s": result.step_s,
        "per_micro_batch_s": result.step_s / result.micro_batches,
        "bubble_fraction": result.bubble_fraction,
        "peak_in_flight": result.peak_in_flight,
    }


def schedule_of(
    problem: PlacementProblem, op_devices: np.ndarray, micro_batches: int, schedule: str = "1f1b"
) -> dict[str, Any] | None:
    """The plan run as a pipeline ``schedule`` of ``micro_batches`` — what ``meshplace
    simulate`` reports for the plan file (:func:`meshplace.sim.schedule.pipeline_of_placement`
    and :func:`~meshplace.sim.schedule.simulate_schedule`): time per step, per micro-batch,
    bubble and micro-batches held per stage; ``None`` if the plan is not a pipeline.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> plan, _ = pipeline_split(p, over_ideals=False)  # PipeDream's split: runs as stages
    >>> s = schedule_of(p, plan.devices, 4)
    >>> s["micro_batches"], s["step_s"] > 0
    (4, True)
    """
    from meshplace.sim.schedule import pipeline_of_placement, simulate_schedule

    pipeline = pipeline_of_placement(problem.simulator, op_devices, micro_batches)
    if pipeline is None:
        return None
    return schedule_summary(simulate_schedule(pipeline.times, schedule, micro_batches))


def runs_as_stages(graph: Any, op_devices: np.ndarray) -> bool:
    """Whether a placement is a pipeline that ``torch.distributed.pipelining`` can run:
    the forward compute ops, in execution (graph) order, form one run per device, and every
    other op is where :func:`complete_placement` puts it (a backward op beside its forward
    op, an update beside its parameter's first reader). Plans the DP builds along another
    order (an unrolled RNN split by layer) or the local search made non-contiguous are
    pipelines for the max-load objective but not stage by stage. O(V + E).

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> for name in "abc":
    ...     _ = g.add_op(Op(name, "matmul"))
    >>> runs_as_stages(g, np.array([0, 0, 1])), runs_as_stages(g, np.array([0, 1, 0]))
    (True, False)
    """
    devices = np.asarray(op_devices, dtype=np.int64)
    forward = [
        i
        for i, o in enumerate(graph.ops)
        if o.phase == "forward" and o.kind not in ("parameter", "buffer", "input")
    ]
    if not forward:
        return True
    seen: set[int] = set()
    previous = -1
    for i in forward:
        d = int(devices[i])
        if d != previous:
            if d in seen:
                return False
            seen.add(d)
            previous = d
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    partial[forward] = devices[forward]
    expected = complete_placement(graph, partial, default=int(devices[forward[0]]))
    return bool(np.array_equal(expected, devices))


def pipeline_split(
    problem: PlacementProblem,
    *,
    over_ideals: bool = True,
    cpu_stage: bool = True,
    max_stages: int | None = None,
) -> tuple[OpAssignment, dict[str, Any]]:
    """The ``pipeline`` placer's plan and stats (:func:`place_pipeline`). ``over_ideals=
    False`` restricts the DP to the prefixes of one topological order and ``cpu_stage=
    False`` to the accelerators: both off is PipeDream's contiguous split, the reference
    ``benchmarks/profiled_graphs.py`` compares against. ``max_stages`` caps the number
    of stages (:func:`split_by_objective`).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("resnet50"), load_cluster("colocrl-4gpu"))
    >>> _, ours = pipeline_split(p)
    >>> _, pipedream = pipeline_split(p, over_ideals=False, cpu_stage=False)
    >>> ours["bottleneck_s"] <= pipedream["bottleneck_s"]
    True
    """
    graph = problem.graph
    acc = accelerators(problem)
    units = forward_units(problem)
    if len(units.ops) == 0:
        plan = complete_placement(graph, np.full(graph.num_ops, -1), default=acc[0])
        return OpAssignment(plan), {"stages": 1, "micro_batches": MICRO_BATCHES_PER_STAGE}
    # units that must share a stage (strict co-location classes and what lies between),
    # merged and numbered topologically
    arrays = graph.arrays()
    ops = graph.ops
    forward = np.array([o.phase == "forward" for o in ops])
    src_unit = units.unit_of_op[arrays.edge_src]
    dst_unit = units.unit_of_op[arrays.edge_dst]
    order_edge = forward[arrays.edge_src] & forward[arrays.edge_dst] & (src_unit != dst_unit)
    edges = sorted(set(zip(src_unit[order_edge].tolist(), dst_unit[order_edge].tolist())))
    classes = [
        sorted({int(units.unit_of_op[m]) for m in members})
        for members in problem.strict_classes.values()
    ]
    n_units = len(units.ops)
    label = condense_units(n_units, edges, classes)
    numberings = [("execution", label)]
    if over_ideals:
        merged_edges = {(int(label[u]), int(label[v])) for u, v in edges if label[u] != label[v]}
        first_op = np.full(int(label.max()) + 1, len(units.ops), dtype=np.int64)
        np.minimum.at(first_op, label, np.arange(n_units))
        modules = [ops[int(units.ops[u])].module or "" for u in first_op]
        module_major = module_major_order(modules, sorted(merged_edges))
        if not np.array_equal(module_major, np.arange(len(module_major))):
            numberings.append(("module", module_major[label]))
    acc_order = problem.cluster.ring_order(acc)
    extra = [c for c in cpus(problem) if c not in acc][:1] if cpu_stage else []
    best: _Split | None = None
    simulations = 0
    for order_name, numbering in numberings:
        split = _split_along(
            problem, units, numbering, edges, acc_order, extra, over_ideals, max_stages
        )
        split.stats["order"] = order_name
        simulations += split.stats["simulations"]
        if best is None or (not split.fits, split.bottleneck) < (not best.fits, best.bottleneck):
            best = split
    assert best is not None
    stats = {
        "units": n_units,
        **best.stats,
        "orders_tried": [name for name, _ in numberings],
        "dp_simulations": simulations,
    }
    return OpAssignment(best.plan), stats


def split_by_objective(
    problem: PlacementProblem, *, over_ideals: bool = True
) -> tuple[OpAssignment, dict[str, Any]]:
    """The DP's split with the stage count the problem's objective prefers.

    The DP (:func:`pipeline_split`) minimises the slowest stage, which more stages never
    make worse. The pipelined step that the throughput objective simulates
    (:meth:`meshplace.sim.simulator.Simulator.pipelined_step`) also pays the fill and
    drain, each micro-batch's kernel launches and the optimizer step after the last
    backward, so fewer stages — one, the plain step — can be faster. For each count
    ``k`` up to the DP's own, the DP's best split into at most ``k`` stages is simulated
    and the best score kept (``stats["stage_counts_tried"]``), the way Alpa (Zheng et
    al., OSDI 2022, §5.2) enumerates stage counts around its DP. A graph without a batch
    is scored by the steady state, which the DP minimises itself: its split is kept.

    Complexity: ``k`` DP runs (each with its memory rounds' simulations) and ``k``
    simulations.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(
    ...     workload_graph("dmcca"), load_cluster("colocrl-4gpu"), objective="throughput"
    ... )
    >>> _, stats = split_by_objective(p)
    >>> [t["max_stages"] for t in stats["stage_counts_tried"]]
    [1, 2, 3, 4, 5]
    """
    assignment, stats = pipeline_split(problem, over_ideals=over_ideals)
    if problem.simulator.traced_batch is None:
        # no batch to split: the objective is the steady state, the slowest stage, which
        # the DP itself minimises over every stage count
        return assignment, {**stats, "stage_counts_tried": []}
    most = int(stats["stages"])
    tried: list[dict[str, Any]] = []
    best: tuple[float, OpAssignment, dict[str, Any]] | None = None
    for k in range(1, most + 1):
        if k == most:
            split, split_stats = assignment, stats
        else:
            split, split_stats = pipeline_split(problem, over_ideals=over_ideals, max_stages=k)
        result = problem.evaluate_ops(split.devices)
        score = problem.score(result)
        tried.append(
            {
                "max_stages": k,
                "stages": int(split_stats["stages"]),
                "score_s": score,
                "micro_batches": result.micro_batches,
                "dp_simulations": int(split_stats["dp_simulations"]),
            }
        )
        if best is None or score < best[0]:
            best = (score, split, split_stats)
    assert best is not None
    chosen = {**best[2], "stage_counts_tried": tried}
    return best[1], chosen


@dataclass
class _Split:
    plan: np.ndarray
    bottleneck: float
    fits: bool
    stats: dict[str, Any]


def _split_along(
    problem: PlacementProblem,
    units: ForwardUnits,
    label: np.ndarray,
    edges: Sequence[tuple[int, int]],
    order: list[int],
    extra: list[int],
    over_ideals: bool,
    max_stages: int | None = None,
) -> _Split:
    """The DP's pipeline for one numbering of the merged units (``label``: merged unit of
    each forward unit, numbered topologically): chunks are runs of that numbering."""
    graph = problem.graph
    n_merged = int(label.max()) + 1
    time_by_kind = np.stack(
        [np.bincount(label, weights=t, minlength=n_merged) for t in units.time_by_kind]
    )
    kind_index = problem.simulator.device_kind_index
    # chunks balanced by the reference accelerator's times, or, for a unit it cannot run
    # (an infinite time), by the unit's fastest time anywhere
    reference = time_by_kind[kind_index[order[0]]]
    reference = np.where(np.isfinite(reference), reference, time_by_kind.min(axis=0))
    chunk_of_unit = chunk_units(reference)[label]
    n_chunks = int(chunk_of_unit.max()) + 1
    loads_by_kind = np.stack(
        [np.bincount(chunk_of_unit, weights=t, minlength=n_chunks) for t in units.time_by_kind]
    )
    memory = np.bincount(chunk_of_unit, weights=units.memory, minlength=n_chunks)
    chunk_of_op = chunk_of_unit[units.unit_of_op]
    chunk_bytes = _chunk_bytes(problem, chunk_of_op, n_chunks)
    preds: list[set[int]] = [set() for _ in range(n_chunks)]
    for u, v in edges:
        if chunk_of_unit[u] != chunk_of_unit[v]:
            preds[int(chunk_of_unit[v])].add(int(chunk_of_unit[u]))
    ideals = unit_ideals([sorted(p) for p in preds]) if over_ideals else None
    fallback = over_ideals and ideals is None
    if ideals is None:  # too many (or not asked for): runs of the topological chunk order
        ideals = prefix_ideals(n_chunks)

    candidates = order + extra
    sequences = device_sequences(len(order), cpu=bool(extra))
    if max_stages is not None:  # the same sequences, cut short (each once)
        sequences = [list(t) for t in dict.fromkeys(tuple(q[:max_stages]) for q in sequences)]
    capacity = problem.device_memory[candidates].astype(np.float64)
    rounds = simulated = 0
    while rounds < MEMORY_ROUNDS:
        rounds += 1
        model = _stage_model(problem, candidates, loads_by_kind, chunk_bytes, memory, capacity)
        bottleneck, chain, stage_devices = best_ideal_split(ideals, model, sequences)
        fits = bool(chain)
        if not fits:  # nothing fits: the best pipeline by time alone (stats say so)
            loose = _stage_model(problem, candidates, loads_by_kind, chunk_bytes, None)
            bottleneck, chain, stage_devices = best_ideal_split(ideals, loose, sequences)
        if not chain:  # no stage can run some unit anywhere: one stage, infinitely slow
            bottleneck, chain, stage_devices = float("inf"), [0, len(ideals) - 1], [0]
        plan, detail = _expand_stages(
            problem,
            graph,
            units,
            chunk_of_unit,
            ideals,
            chain,
            stage_devices,
            candidates,
            model,
            memory,
        )
        if not fits:
            break
        # the DP's memory is an estimate (resident bytes and kept activations); where the
        # simulated peak (transient tensors, received copies) exceeds a device, that
        # device's capacity in the DP shrinks to its stage's estimate scaled down by the
        # overshoot, and the DP runs again
        peak = problem.evaluate_ops(plan).peak_memory_bytes[candidates]
        simulated += 1
        real = problem.device_memory[candidates]
        used = np.zeros(len(candidates), dtype=bool)
        used[stage_devices] = True
        over = used & (peak > real)
        if not over.any():
            break
        estimate = np.zeros(len(candidates))
        for stage, d in zip(detail, stage_devices, strict=True):
            estimate[d] = stage["memory_bytes"]
        scaled = estimate * real / np.maximum(peak, 1.0) * 0.99
        capacity = np.where(over, np.minimum(capacity, scaled), capacity)
    else:
        fits = False  # still over after the last round

    stages = len(stage_devices)
    stats = {
        "chunks": n_chunks,
        "ideals": len(ideals),
        "ideal_fallback": (
            f"more than {MAX_IDEALS} ideals: contiguous runs of one topological order"
            if fallback
            else None
        ),
        "stages": stages,
        "cpu_stage": any(candidates[d] in extra for d in stage_devices),
        "bottleneck_s": bottleneck,
        "micro_batches": MICRO_BATCHES_PER_STAGE * stages,
        "stage_detail": detail,
        "memory_rounds": rounds,
        "simulations": simulated,
        "fits": fits,
    }
    return _Split(plan, float(bottleneck), fits, stats)


# ------------------------------------------- local search after the DP (issue 17)
LOCAL_SEARCH_SHARE = 0.2
"""Share of the placer's budget the local search may spend, as a fixed number of
simulations at :data:`meshplace.placers.base.SIMULATED_OPS_PER_SECOND` (fixed work, so a
budget reproduces the plan exactly)."""
LOCAL_SEARCH_MAX_EVALUATIONS = 2000


def local_search_evaluations(problem: PlacementProblem, budget_s: float) -> int:
    """How many simulations :func:`improve_bottleneck` may run within ``budget_s``.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> local_search_evaluations(p, 0.0), local_search_evaluations(p, 1e6)
    (0, 2000)
    """
    n_ops = max(problem.graph.num_ops, 1)
    work = LOCAL_SEARCH_SHARE * budget_s * SIMULATED_OPS_PER_SECOND / n_ops
    return int(min(LOCAL_SEARCH_MAX_EVALUATIONS, max(0.0, work)))


def improve_bottleneck(
    problem: PlacementProblem,
    op_devices: np.ndarray,
    max_evaluations: int,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Non-contiguous improvement of a plan under the problem's objective: first-improvement
    hill climbing over moves of one co-location group (with the groups a strict class ties
    to it) to another device that can run it, each move scored by the simulator.

    The DP's pipelines are convex — every stage only sends forward — and keep each unit's
    backward and update work beside its forward op. The simulated objective has no such
    rule: moving the backward of a heavy layer, or one branch of a layer, to a lightly
    loaded device can cut the bottleneck (Tarnawski et al., NeurIPS 2020, §5, improve
    their contiguous optimum the same way). Where the objective is the steady state (max
    over devices and links of their busy time: a graph without a batch) only groups on the
    bottleneck device are tried (moves elsewhere cannot lower it); otherwise — the
    pipelined step, one step — every group is a candidate; the heaviest first, each
    towards the least busy devices first. Never worse than the start (a move is kept only
    if the score falls). Deterministic.

    Complexity: at most ``max_evaluations`` simulations, O((V + E) log V) each.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(
    ...     workload_graph("rnnlm"), load_cluster("colocrl-4gpu"), objective="throughput"
    ... )
    >>> start = pipeline_split(p)[0].devices
    >>> better, stats = improve_bottleneck(p, start, 200)
    >>> stats["score_after_s"] < stats["score_before_s"], stats["evaluations"] <= 200
    (True, True)
    """
    current = np.array(op_devices, dtype=np.int64)
    if max_evaluations < 1:
        return current, {"evaluations": 0, "moves": 0, "converged": False}
    group_of = problem.group_of
    unit_of_group = problem.group_decider
    unit_of_op = unit_of_group[group_of]
    n_units = int(unit_of_group.max()) + 1 if len(unit_of_group) else 0
    members = [np.flatnonzero(unit_of_op == u) for u in range(n_units)]
    members_of = [m for m in members if len(m)]
    runs = np.ones((problem.num_devices, len(members_of)), dtype=bool)
    unit_groups = [np.unique(group_of[m]) for m in members_of]
    for i, groups in enumerate(unit_groups):
        runs[:, i] = problem.group_runs[:, groups].all(axis=1)
    op_time = problem.simulator.op_time_by_kind[problem.simulator.device_kind_index]
    result = problem.evaluate_ops(current)
    score = problem.score(result)
    start_score = score
    evaluations, moves = 1, 0
    while evaluations < max_evaluations:
        busy = result.busy_s
        candidates = list(range(len(members_of)))
        # in the steady state (no batch to split) only groups on the bottleneck device
        # can lower it (where a link is the bottleneck, any group may); the pipelined or
        # plain step also pays transfers and the critical path: every group may
        steady = problem.objective == "throughput" and result.throughput_model == "steady state"
        if steady and busy.max(initial=0.0) >= result.link_busy_s.max(initial=0.0):
            worst = int(np.argmax(busy))
            candidates = [i for i in candidates if np.any(current[members_of[i]] == worst)]
        weight = {
            i: float(np.where(np.isfinite(t := op_time[current[m], m]), t, 0.0).sum())
            for i, m in ((i, members_of[i]) for i in candidates)
        }
        candidates.sort(key=lambda i: (-weight[i], i))
        targets = [int(d) for d in np.argsort(busy, kind="stable")]
        improved = False
        for i in candidates:
            m = members_of[i]
            for d in targets:
                if not runs[d, i] or np.all(current[m] == d):
                    continue
                if evaluations >= max_evaluations:
                    break
                trial = current.copy()
                trial[m] = d
                trial_result = problem.evaluate_ops(trial)
                evaluations += 1
                trial_score = problem.score(trial_result)
                if trial_score < score * (1.0 - 1e-9):
                    current, result, score = trial, trial_result, trial_score
                    moves += 1
                    improved = True
                    break
            if improved or evaluations >= max_evaluations:
                break
        if not improved:
            break
    return current, {
        "evaluations": evaluations,
        "moves": moves,
        "score_before_s": start_score,
        "score_after_s": score,
        "converged": evaluations < max_evaluations,
    }
