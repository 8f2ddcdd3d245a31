"""Collective communication: closed-form times, and the same collectives as point-to-point
schedules the simulator can run to check them.

Notation (Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 2005; Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms", JPDC 2009): ``p`` devices, ``n`` bytes per device, per-hop latency ``α`` and
link bandwidth ``B``.

=================  ===========  =========================================================
collective         algorithm    time
=================  ===========  =========================================================
all-reduce         ring         2(p−1)·(α + n/(pB))
reduce-scatter     ring         (p−1)·(α + n/(pB))           (n = full input per device)
all-gather         ring         (p−1)·(α + n/(pB))           (n = full output per device)
broadcast          ring         (p−1)·(α + n/B)              (chain, unpipelined)
all-to-all         ring         (p−1)·(α + n/(pB)) on a full mesh (pairwise exchange)
all-reduce         tree         2⌈log₂p⌉·(α + n/B)           (binomial reduce + broadcast)
broadcast          tree         ⌈log₂p⌉·(α + n/B)
all-reduce         torus        2(X−1)(α + n/(XB)) + 2(Y−1)(α + n/(XYB)) [+ Z term]
                                (reduce-scatter along each torus dimension, all-gather back;
                                Kumar et al. 2019, TPU-v3 pods)
=================  ===========  =========================================================

``schedule_graph`` writes the ring and torus algorithms as an :class:`OpGraph` of zero-cost
steps joined by chunk transfers, one device per rank, so the simulator (with its routes,
latencies and link contention) can be compared with the closed form.

Example
-------
>>> round(collective_time("all_reduce", "ring", 1e9, 8, bandwidth=1e11, latency=1e-6), 6)
0.017514
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplace.errors import InputError
from meshplace.graph.ir import Op, OpGraph

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: bytes of gradients one data-parallel all-reduce carries (DDP's default bucket; the
#: torchrun runtime buckets its gradient reductions the same way)
GRADIENT_BUCKET_BYTES = 25 * 2**20
ALGORITHMS = ("ring", "tree", "torus")


def collective_time(
    kind: str,
    algorithm: str,
    nbytes: float,
    p: int | None = None,
    *,
    bandwidth: float | Sequence[float],
    latency: float,
    dims: Sequence[int] | None = None,
) -> float:
    """Seconds for collective ``kind`` over ``p`` devices (or a torus of ``dims``).

    For a torus, ``bandwidth`` may give one value per dimension (a dimension of size 2 often
    has both of its links between the same two chips, i.e. twice the bandwidth)."""
    if kind not in COLLECTIVES:
        raise InputError(f"unknown collective {kind!r}; allowed: {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS:
        raise InputError(f"unknown algorithm {algorithm!r}; allowed: {', '.join(ALGORITHMS)}")
    per_dim = [float(b) for b in bandwidth] if isinstance(bandwidth, Sequence) else None
    if any(b <= 0 for b in (per_dim or [float(bandwidth)])):  # type: ignore[arg-type]
        raise InputError(f"bandwidth must be positive, got {bandwidth}")
    if algorithm == "torus":
        if not dims:
            raise InputError("a torus collective needs the torus dims, e.g. (32, 32)")
        if kind != "all_reduce":
            raise InputError("torus schedules are defined for all_reduce")
        bws = per_dim or [float(bandwidth)] * len(dims)  # type: ignore[arg-type]
        total = 0.0
        shard = float(nbytes)
        for size, bw in zip(dims, bws, strict=True):
            total += 2 * (size - 1) * (latency + shard / (size * bw))
            shard /= size
        return total
    if per_dim is not None:
        raise InputError("one bandwidth per dimension applies to torus collectives only")
    assert p is not None
    bandwidth = float(bandwidth)  # type: ignore[arg-type]
    if p <= 1:
        return 0.0
    step_shard = latency + nbytes / (p * bandwidth)
    step_full = latency + nbytes / bandwidth
    if algorithm == "ring":
        return {
            "all_reduce": 2 * (p - 1) * step_shard,
            "reduce_scatter": (p - 1) * step_shard,
            "all_gather": (p - 1) * step_shard,
            "all_to_all": (p - 1) * step_shard,
            "broadcast": (p - 1) * step_full,
        }[kind]
    rounds = math.ceil(math.log2(p))
    if kind == "all_reduce":
        return 2 * rounds * step_full
    if kind == "broadcast":
        return rounds * step_full
    raise InputError(f"the tree algorithm is defined for all_reduce and broadcast, not {kind}")


def schedule_graph(
    kind: str,
    nbytes: float,
    ranks: Sequence[str],
    *,
    device_kind: str,
    dims: Sequence[int] | None = None,
) -> tuple[OpGraph, list[str]]:
    """The ring (or, with ``dims``, torus) algorithm for ``kind`` as an OpGraph.

    Returns the graph and the device name for each of its ops. Every step is an op with a
    measured time of zero on ``device_kind`` (only communication is timed); each step
    depends on the rank's previous step and on the chunk its ring neighbour sent.
    """
    if dims:
        if kind != "all_reduce":
            raise InputError("torus schedules are defined for all_reduce")
        if math.prod(dims) != len(ranks):
            raise InputError(f"torus dims {tuple(dims)} do not cover {len(ranks)} ranks")
        return _torus_all_reduce(nbytes, ranks, device_kind, dims)
    p = len(ranks)
    phases = {
        "all_reduce": [("rs", p - 1, nbytes / p), ("ag", p - 1, nbytes / p)],
        "reduce_scatter": [("rs", p - 1, nbytes / p)],
        "all_gather": [("ag", p - 1, nbytes / p)],
        "broadcast": [("bc", p - 1, nbytes)],
    }
    if kind not in phases:
        raise InputError(f"no ring schedule for {kind!r}; allowed: {', '.join(phases)}")
    one_ring = [list(range(p))]
    chosen = phases[kind]
    return _ring_phases(chosen, ranks, [one_ring] * len(chosen), device_kind, kind)


def _ring_phases(phases, ranks, rings_per_phase, device_kind, name):
    graph = OpGraph(f"{name}-schedule")
    devices: list[str] = []
    last: list[int] = []
    for r, dev in enumerate(ranks):
        last.append(graph.add_op(Op(f"r{r}:start", "collective", measured_time={device_kind: 0})))
        devices.append(dev)
    for phase_idx, (label, steps, chunk) in enumerate(phases):
        successor = {}
        for ring in rings_per_phase[phase_idx]:
            for pos, r in enumerate(ring):
                successor[r] = ring[(pos + 1) % len(ring)]
        for step in range(steps):
            current = []
            for r, dev in enumerate(ranks):
                current.append(
                    graph.add_op(
                        Op(
                            f"r{r}:{label}{phase_idx}.{step}",
                            "collective",
                            measured_time={device_kind: 0},
                        )
                    )
                )
                devices.append(dev)
            for r in range(len(ranks)):
                graph.add_edge(last[r], current[r], 0)
                nxt = successor[r]
                if nxt != r:
                    graph.add_edge(last[r], current[nxt], chunk)
            last = current
    return graph, devices


def _torus_all_reduce(nbytes, ranks, device_kind, dims):
    """Reduce-scatter along each dimension in turn, then all-gather back in reverse."""
    coords = []
    for r in range(len(ranks)):
        c, rest = [], r
        for size in reversed(dims):
            c.append(rest % size)
            rest //= size
        coords.append(tuple(reversed(c)))
    index = {c: r for r, c in enumerate(coords)}

    def rings_along(axis):
        rings = []
        for c in coords:
            if c[axis] != 0:
                continue
            ring = []
            for k in range(dims[axis]):
                cc = list(c)
                cc[axis] = k
                ring.append(index[tuple(cc)])
            rings.append(ring)
        return rings

    phases, rings_per_phase = [], []
    shard = float(nbytes)
    for axis, size in enumerate(dims):
        phases.append((f"rs{axis}", size - 1, shard / size))
        rings_per_phase.append(rings_along(axis))
        shard /= size
    for axis in reversed(range(len(dims))):
        size = dims[axis]
        shard *= size
        phases.append((f"ag{axis}", size - 1, shard / size))
        rings_per_phase.append(rings_along(axis))
    return _ring_phases(phases, ranks, rings_per_phase, device_kind, "torus-all_reduce")
