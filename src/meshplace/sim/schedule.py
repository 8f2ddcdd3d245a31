"""Pipeline schedules, simulated: GPipe, 1F1B and interleaved 1F1B over micro-batches.

A pipelined training step runs every micro-batch's forward pass through the stages, then
its backward pass back through them, each stage on its own device. What a schedule decides
is the *order* in which each device runs its forward and backward tasks; the step time,
the idle time (the "bubble") and how many micro-batches' activations a stage holds at once
all follow from that order:

* **GPipe** (Huang et al., NeurIPS 2019, §2.2): every forward, then every backward
  ("fill, drain"); a stage holds all ``m`` micro-batches' activations.
* **1F1B** (PipeDream-Flush; Narayanan et al., ICML 2021, §2.2): stage ``i`` (from 0) of
  ``p`` runs ``p - i - 1`` warm-up forwards, then alternates one forward and one backward,
  then drains its backwards; it holds at most ``min(p - i, m)`` micro-batches.
* **Interleaved 1F1B** (Narayanan et al., SC 2021, §2.2): each device holds ``v`` model
  chunks (virtual stages ``d, d + p, …``), forwards run in groups of ``p`` micro-batches
  per chunk, and the bubble shrinks by ``v`` at the price of ``v`` times as many transfers.

Each task starts when its device has finished the task before it in the device's order and
its input has arrived: a forward needs the previous (virtual) stage's forward of that
micro-batch plus the activation transfer, a backward the next stage's backward plus the
gradient transfer (the last stage's backward follows its own forward). Because every
device's order is fixed, the start times are the longest paths of one DAG (device order
plus data dependencies), computed in one topological pass — the same times an event-driven
run of the fixed orders gives. After its last backward a stage reduces its gradients over
its data-parallel group and steps its optimizer (``allreduce_s``, ``update_s``, optional);
the step ends when the last stage has.

With equal stages and free transfers the simulated bubble is the closed form
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B and ``(p - 1) / (v m + p - 1)`` interleaved
(:func:`closed_form_bubble`); the tests check both, and 1F1B's peak in-flight count.

Complexity: O(p v m) tasks, each visited once.

Example
-------
>>> t = StageTimes.uniform(stages=4, forward_s=1.0, backward_s=2.0)
>>> r = simulate_schedule(t, "1f1b", micro_batches=8)
>>> r.step_s, round(r.bubble_fraction, 4), closed_form_bubble("1f1b", 4, 8)
(33.0, 0.2727, 0.2727272727272727)
>>> r.peak_in_flight
[4, 3, 2, 1]
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from numba import njit

from meshplace.cost.pipeline import GradientAccumulation, HostCosts
from meshplace.errors import InputError
from meshplace.graph.ir import PHASE_INDEX

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class StageTimes:
    """Seconds per micro-batch of each (virtual) stage, in pipeline order.

    Attributes:
        forward_s, backward_s: ``[S]`` one micro-batch's forward and backward on stage
            ``s`` (``S = p v``: with interleaving, virtual stage ``s`` runs on device
            ``s mod p``).
        activation_s: ``[S - 1]`` sending one micro-batch's activation from stage ``s`` to
            ``s + 1`` (default free); ``gradient_s`` the gradient back (default: the same).
        allreduce_s, update_s: ``[p]`` per device, after its last backward: the
            data-parallel gradient reduction (not overlapped with other devices' work on
            the same device) and the optimizer step (default none).
    """

    forward_s: np.ndarray
    backward_s: np.ndarray
    activation_s: np.ndarray | None = None
    gradient_s: np.ndarray | None = None
    allreduce_s: np.ndarray | None = None
    update_s: np.ndarray | None = None

    @classmethod
    def uniform(
        cls, stages: int, forward_s: float, backward_s: float, transfer_s: float = 0.0
    ) -> StageTimes:
        """``stages`` equal stages, every transfer ``transfer_s``."""
        return cls(
            np.full(stages, float(forward_s)),
            np.full(stages, float(backward_s)),
            np.full(max(stages - 1, 0), float(transfer_s)),
        )


@dataclass
class ScheduleResult:
    """One simulated step of a pipeline schedule (seconds)."""

    schedule: str
    stages: int
    micro_batches: int
    virtual: int
    step_s: float
    busy_s: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    tasks: list[dict[str, Any]] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "virtual": self.virtual,
            "step_s": self.step_s,
            "busy_s": self.busy_s,
            "bubble_fraction": self.bubble_fraction,
            "peak_in_flight": self.peak_in_flight,
        }


def closed_form_bubble(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle share of each device with equal stages and free transfers:
    ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` for
    interleaved 1F1B (Narayanan et al., SC 2021, §2.2).

    >>> closed_form_bubble("interleaved", 4, 8, virtual=2)
    0.15789473684210525
    """
    p, m = stages, micro_batches
    v = virtual if schedule == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


def device_orders(
    schedule: str, stages: int, micro_batches: int, virtual: int = 1
) -> list[list[tuple[str, int, int]]]:
    """Each device's tasks in the order the schedule runs them: ``("F" or "B", virtual
    stage, micro-batch)``. Raises :class:`InputError` for an unknown schedule, a count
    below 1, or an interleaved schedule whose micro-batches are not a multiple of the
    stages (Megatron-LM's requirement).

    >>> device_orders("1f1b", 2, 3)[0]
    [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
    """
    p, m, v = stages, micro_batches, virtual
    if schedule not in SCHEDULES:
        raise InputError(f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if min(p, m, v) < 1:
        raise InputError(
            f"a pipeline needs at least 1 stage, micro-batch and chunk, got {p}, {m}, {v}"
        )
    if schedule != "interleaved" and v != 1:
        raise InputError(
            f"only the interleaved schedule has virtual stages (got {v} with {schedule})"
        )
    orders: list[list[tuple[str, int, int]]] = []
    for d in range(p):
        if schedule == "gpipe":
            order = [("F", d, b) for b in range(m)] + [("B", d, b) for b in range(m)]
        elif schedule == "1f1b":
            warm = min(p - d - 1, m)
            order = [("F", d, b) for b in range(warm)]
            for k in range(m - warm):
                order += [("F", d, warm + k), ("B", d, k)]
            order += [("B", d, b) for b in range(m - warm, m)]
        else:
            order = _interleaved_order(d, p, m, v)
        orders.append(order)
    return orders


def _interleaved_order(d: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B on device ``d``: forward task ``k`` is micro-batch
    ``(k // (p v)) p + k mod p`` of chunk ``(k // p) mod v`` (virtual stage ``chunk p +
    d``), backward task ``k`` the same with the chunks in reverse; ``(p - d - 1) 2 + (v -
    1) p`` warm-up forwards (all of them if fewer), then one forward and one backward in
    turn, then the remaining backwards."""
    if m % p:
        raise InputError(
            f"the interleaved schedule needs micro-batches a multiple of the stages "
            f"(Megatron-LM's rule): {m} micro-batches over {p} stages"
        )
    total = m * v

    def forward(k: int) -> tuple[str, int, int]:
        chunk = (k // p) % v
        return ("F", chunk * p + d, (k // (p * v)) * p + k % p)

    def backward(k: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k // p) % v
        return ("B", chunk * p + d, (k // (p * v)) * p + k % p)

    warm = min((p - d - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        order += [forward(warm + k), backward(k)]
    order += [backward(k) for k in range(total - warm, total)]
    return order


@lru_cache(maxsize=512)
def _order_arrays(
    schedule: str, stages: int, micro_batches: int, virtual: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`device_orders` flattened for the compiled kernel: each device's tasks from
    ``ptr[d]`` to ``ptr[d + 1]``, with kind (0 forward, 1 backward), virtual stage and
    micro-batch. Cached: a search asks for the same few shapes again and again."""
    orders = device_orders(schedule, stages, micro_batches, virtual)
    ptr = np.zeros(stages + 1, np.int64)
    np.cumsum([len(o) for o in orders], out=ptr[1:])
    flat = [task for order in orders for task in order]
    kind = np.array([0 if k == "F" else 1 for k, _, _ in flat], np.int64)
    stage = np.array([s for _, s, _ in flat], np.int64)
    micro = np.array([b for _, _, b in flat], np.int64)
    for arr in (ptr, kind, stage, micro):
        arr.setflags(write=False)
    return ptr, kind, stage, micro


@njit(cache=True)
def _schedule_kernel(ptr, kind, stage, micro, forward, backward, act, grad, m):  # pragma: no cover
    """The longest-path pass over the fixed device orders (see the module docstring):
    each device runs its next task once the task it depends on has ended, sweeping the
    devices until all are done. Returns each task's start and end, each device's peak
    in-flight count and the time its last task ends. Compiled because a search runs it
    once per micro-batch count per plan it scores."""
    p = ptr.size - 1
    n_virtual = forward.size
    ends_f = np.full((n_virtual, m), -1.0)
    ends_b = np.full((n_virtual, m), -1.0)
    start = np.zeros(kind.size)
    end = np.zeros(kind.size)
    position = ptr[:-1].copy()
    device_free = np.zeros(p)
    in_flight = np.zeros(p, np.int64)
    peak = np.zeros(p, np.int64)
    pending = kind.size
    while pending > 0:
        progressed = False
        for d in range(p):
            while position[d] < ptr[d + 1]:
                t = position[d]
                s = stage[t]
                b = micro[t]
                if kind[t] == 0:
                    if s > 0:
                        if ends_f[s - 1, b] < 0.0:
                            break
                        ready = ends_f[s - 1, b] + act[s - 1]
                    else:
                        ready = 0.0
                    duration = forward[s]
                else:
                    if s < n_virtual - 1:
                        if ends_b[s + 1, b] < 0.0:
                            break
                        ready = ends_b[s + 1, b] + grad[s]
                    else:
                        if ends_f[s, b] < 0.0:
                            break
                        ready = ends_f[s, b]
                    duration = backward[s]
                begin = max(device_free[d], ready)
                start[t] = begin
                end[t] = begin + duration
                device_free[d] = begin + duration
                if kind[t] == 0:
                    ends_f[s, b] = begin + duration
                    in_flight[d] += 1
                else:
                    ends_b[s, b] = begin + duration
                    in_flight[d] -= 1
                peak[d] = max(peak[d], in_flight[d])
                position[d] += 1
                pending -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("internal: the pipeline schedule's orders deadlock")
    return start, end, peak, device_free


def simulate_schedule(
    times: StageTimes,
    schedule: str,
    micro_batches: int,
    virtual: int = 1,
    *,
    keep_tasks: bool = True,
) -> ScheduleResult:
    """Simulate one step of ``schedule`` with ``micro_batches`` over the stages of
    ``times`` (``p v`` virtual stages on ``p`` devices). See the module docstring for the
    model; returns the step time, each device's busy time, the bubble (idle share of the
    device time, averaged over devices) and each device's peak number of micro-batches
    whose forward has run and backward not yet; ``keep_tasks=False`` leaves out the
    per-task timeline (a search needs only the times). O(p v m), in compiled code."""
    if virtual < 1:
        raise InputError(f"a pipeline needs at least 1 chunk per device, got {virtual}")
    forward = np.asarray(times.forward_s, dtype=np.float64)
    backward = np.asarray(times.backward_s, dtype=np.float64)
    n_virtual = len(forward)
    if n_virtual < 1 or len(backward) != n_virtual or n_virtual % virtual:
        raise InputError(
            f"stage times: {len(forward)} forward and {len(backward)} backward times do not "
            f"make {virtual} chunk(s) per device"
        )
    p, m = n_virtual // virtual, micro_batches
    act = _per_boundary(times.activation_s, n_virtual, "activation_s")
    grad = (
        _per_boundary(times.gradient_s, n_virtual, "gradient_s")
        if times.gradient_s is not None
        else act
    )
    ptr, kind, stage, micro = _order_arrays(schedule, p, m, virtual)
    start, end, peak_arr, device_free = _schedule_kernel(
        ptr, kind, stage, micro, forward, backward, act, grad, m
    )
    peak = [int(x) for x in peak_arr]
    tasks: list[dict[str, Any]] = []
    if keep_tasks:
        for d in range(p):
            for t in range(ptr[d], ptr[d + 1]):
                tasks.append({"device": d, "kind": "F" if kind[t] == 0 else "B",
                              "stage": int(stage[t]), "micro_batch": int(micro[t]),
                              "start_s": float(start[t]), "end_s": float(end[t])})  # fmt: skip
    busy = [
        float(sum(forward[s] + backward[s] for s in range(d, n_virtual, p)) * m) for d in range(p)
    ]
    allreduce = _per_device(times.allreduce_s, p)
    update = _per_device(times.update_s, p)
    finish = [float(device_free[d]) + allreduce[d] + update[d] for d in range(p)]
    busy = [busy[d] + allreduce[d] + update[d] for d in range(p)]
    step = float(max(finish))
    bubble = float(np.mean([1.0 - b / step for b in busy])) if step > 0 else 0.0
    return ScheduleResult(schedule, p, m, virtual, step, busy, bubble, peak, tasks)


def _per_boundary(values: np.ndarray | None, n_virtual: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros(max(n_virtual - 1, 0))
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != (max(n_virtual - 1, 0),):
        raise InputError(f"stage times: {name} needs {n_virtual - 1} values, got {arr.shape}")
    return arr


def _per_device(values: np.ndarray | None, p: int) -> np.ndarray:
    if values is None:
        return np.zeros(p)
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != (p,):
        raise InputError(f"stage times: per-device values need {p} entries, got {arr.shape}")
    return arr


RECOMPUTE = ("none", "full")


def micro_batch_choices(batch: int | None, stages: int) -> list[int]:
    """Micro-batch counts a pipeline of ``stages`` is tried with: from one per stage
    (PyTorch's 1F1B needs at least as many micro-batches as stages) to 8 per stage, those
    that divide ``batch`` (the traced batch, :func:`meshplace.graph.summary.traced_batch`)
    so the runtime can split it; none when the batch is unknown or smaller than the
    stages. GPipe's rule (Huang et al., NeurIPS 2019, §2.3) takes 4 per stage to make the
    fill and drain small; the schedule decides here, because every micro-batch also pays
    each op's launch again.

    >>> micro_batch_choices(32, 3), micro_batch_choices(32, 64), micro_batch_choices(None, 2)
    ([4, 8, 16], [], [])
    """
    if batch is None:
        return []
    return [m for m in range(max(stages, 2), min(batch, 8 * stages) + 1) if batch % m == 0]


@dataclass(frozen=True)
class PipelineOfPlacement:
    """A placement read as a pipeline (:func:`pipeline_of_placement`): its stage devices
    in pipeline order, each stage's per-micro-batch times, and its memory: resident bytes
    (parameters, optimizer state, inputs), and per micro-batch the activations its
    backward reads (kept from forward to backward) and the activation it receives (all a
    stage keeps under full recomputation)."""

    devices: list[int]
    times: StageTimes
    resident_bytes: np.ndarray
    activation_bytes: np.ndarray
    input_bytes: np.ndarray

    def memory_bytes(self, result: ScheduleResult, recompute: str = "none") -> list[float]:
        """Each stage's peak memory under ``result``'s schedule (Korthikanti et al.,
        MLSys 2023, §4: a stage holds its in-flight micro-batches' activations): resident
        bytes plus, per micro-batch in flight, its kept activations (``recompute="none"``)
        or only its input (``"full"``: activation checkpointing per stage, plus one
        micro-batch's activations rebuilt for its backward). With interleaving, in-flight
        counts are per chunk, so each chunk is charged a ``1/v`` share. O(p)."""
        if recompute not in RECOMPUTE:
            raise InputError(
                f"unknown recomputation {recompute!r}; allowed: {', '.join(RECOMPUTE)}"
            )
        share = 1.0 / result.virtual
        if recompute == "none":
            held = np.asarray(result.peak_in_flight) * share * self.activation_bytes
        else:
            held = (
                np.asarray(result.peak_in_flight) * share * self.input_bytes + self.activation_bytes
            )
        return [float(x) for x in self.resident_bytes + held]


class PipelineReader:
    """Reads op placements of one simulator's (graph, cluster) as pipelines: the arrays
    that do not depend on the placement (phases, which ops are compute, which forward
    outputs a backward op reads, each device's launch overhead), so that reading a
    placement is a few ``bincount`` passes — the throughput objective does it for every
    plan a search scores (:meth:`meshplace.sim.simulator.Simulator.simulate`).
    Get one from ``Simulator.pipeline_reader``."""

    def __init__(self, sim: Any) -> None:
        a = sim.arrays
        ops = sim.graph.ops
        self.sim = sim
        self.phase = a.phase.astype(np.int64)
        self.compute = np.array([o.kind not in ("parameter", "buffer", "input") for o in ops])
        forward_compute = (self.phase == PHASE_INDEX["forward"]) & self.compute
        order = a.topo_order
        self.forward_in_order = order[forward_compute[order]]
        # [device kind, op]: each op's fixed cost per kernel (its operator's or kind's,
        # where calibration fitted one), the part of its time that splitting it into
        # micro-batches repeats
        specs_by_kind = {d.kind: d.spec for d in sim.cluster.devices}
        self.launch_by_kind = np.stack(
            [sim.cost_model.launches(sim.graph, k, specs_by_kind[k]) for k in sim.kind_names]
        )
        # what each device's host pays per micro-batch beyond kernels (the calibrated
        # engine, message CPU and exchange; nothing for an uncalibrated cost model)
        self.host_by_kind = {
            kind: HostCosts.of(sim.cost_model, kind) for kind in set(sim.device_kinds)
        }
        # each micro-batch after the first adds its gradients into the held ones: a
        # stage's trainable parameters' bytes and tensors, priced on its device kind
        self.accumulation_by_kind = {
            kind: GradientAccumulation.of(sim.cost_model, kind, specs_by_kind[kind])
            for kind in set(sim.device_kinds)
        }
        trainable = np.array([o.kind == "parameter" for o in sim.graph.ops], dtype=bool)
        self.gradient_bytes_per_op = np.where(trainable, a.param_bytes, 0.0)
        self.gradient_tensors_per_op = trainable.astype(np.float64)
        src, dst = a.edge_src, a.edge_dst
        fwd, bwd, upd = (PHASE_INDEX[k] for k in ("forward", "backward", "update"))
        self.edge_src, self.edge_dst, self.edge_bytes = src, dst, a.edge_bytes
        self.forward_edge = (self.phase[src] == fwd) & (self.phase[dst] == fwd)
        self.gradient_edge = (
            ~self.forward_edge & (self.phase[src] != upd) & (self.phase[dst] != upd)
        )
        # forward outputs that some backward op reads: kept from one pass to the other
        self._routes: dict[tuple[int, int], tuple[float, float]] = {}
        reads = (self.phase[src] == fwd) & (self.phase[dst] == bwd) & self.compute[src]
        self.kept_ops = np.unique(src[reads])
        self._read_per_micro_batch(sim)

    def _read_per_micro_batch(self, sim: Any) -> None:
        """What a micro-batch does not divide: compute that no input reaches (a weight's
        cast or copy, run again in every micro-batch's forward) is paid whole each time,
        and an op reading a weight (or writing a weight's gradient, accumulated over the
        micro-batches) moves those bytes whole each time while only its other bytes and
        its arithmetic shrink with the micro-batch — on each device kind's roofline,
        kept here for the ops that do (:meth:`PipelineTotals.split`). O(V + E)."""
        a = sim.arrays
        n = len(self.phase)
        kinds = [o.kind for o in sim.graph.ops]
        weight = np.array([k in ("parameter", "buffer") for k in kinds], dtype=bool)
        update = self.phase == PHASE_INDEX["update"]
        inputs = np.array([k == "input" for k in kinds], dtype=bool)
        # which ops the batch reaches; a graph that names no input: all of them
        data = _reached_from(inputs, a) if inputs.any() else np.ones(n, dtype=bool)
        self.per_step_work = self.compute & ~data & ~update
        src, dst, nbytes = a.edge_src, a.edge_dst, a.edge_bytes
        step = self.compute & data & ~update
        read = (weight | self.per_step_work)[src] & step[dst]
        written = step[src] & update[dst]
        # (as float: numpy's bincount of no values is int64, whatever the weights)
        whole = np.bincount(dst[read], weights=nbytes[read], minlength=n).astype(np.float64)
        whole += np.bincount(src[written], weights=nbytes[written], minlength=n)
        whole = np.minimum(whole, a.bytes_accessed)
        self.rereads = np.flatnonzero((whole > 0) & step)
        rest = a.bytes_accessed[self.rereads] - whole[self.rereads]
        specs = {d.kind: d.spec for d in sim.cluster.devices}
        arith, per_byte = zip(
            *(sim.cost_model.roofline_terms(sim.graph, specs[k]) for k in sim.kind_names),
            strict=True,
        )
        # [kind, reread op]: seconds of arithmetic, of the whole bytes, of the other bytes
        self.reread_arith_s = np.stack([x[self.rereads] for x in arith])
        self.reread_whole_s = np.stack([b[self.rereads] * whole[self.rereads] for b in per_byte])
        self.reread_rest_s = np.stack([b[self.rereads] * rest for b in per_byte])

    def route(self, src: int, dst: int) -> tuple[float, float]:
        """(latency, bottleneck bandwidth) of the route from device ``src`` to ``dst``, as
        :meth:`meshplace.hardware.cluster.Cluster.transfer_time` times it; cached."""
        key = (src, dst)
        found = self._routes.get(key)
        if found is None:
            cluster = self.sim.cluster
            links = list(cluster.route(src, dst))
            found = (
                (
                    float(cluster.link_latency[links].sum()),
                    float(cluster.link_bandwidth[links].min()),
                )
                if links
                else (0.0, float("inf"))
            )
            self._routes[key] = found
        return found

    def stage_order(self, placement: np.ndarray, by_first_op: np.ndarray) -> np.ndarray | None:
        """The stage devices in pipeline order: a topological order of the graph of
        forward activations between them (Kahn's algorithm, ties to the device whose
        first forward op runs first — branches split over devices may start in any
        order), or ``None`` where activations flow both ways. O(E + p log p)."""
        n = self.sim.num_devices
        is_stage = np.zeros(n, dtype=bool)
        is_stage[by_first_op] = True
        src, dst = placement[self.edge_src], placement[self.edge_dst]
        cross = self.forward_edge & (src != dst) & is_stage[src] & is_stage[dst]
        pairs = np.unique(src[cross] * n + dst[cross])
        rank = np.full(n, -1, dtype=np.int64)
        rank[by_first_op] = np.arange(by_first_op.size)
        succ: dict[int, list[int]] = {}
        indegree = np.zeros(n, dtype=np.int64)
        for key in pairs.tolist():
            a, b = divmod(key, n)
            succ.setdefault(a, []).append(b)
            indegree[b] += 1
        ready = [(int(rank[d]), int(d)) for d in by_first_op.tolist() if indegree[d] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, d = heapq.heappop(ready)
            order.append(d)
            for b in succ.get(d, []):
                indegree[b] -= 1
                if indegree[b] == 0:
                    heapq.heappush(ready, (int(rank[b]), b))
        if len(order) < by_first_op.size:
            return None
        return np.array(order, dtype=np.int64)

    def read(self, placement: np.ndarray, times: np.ndarray | None = None) -> PipelineTotals | None:
        """The placement's per-stage totals for the whole batch (see
        :func:`pipeline_of_placement`), or ``None`` when it is not a pipeline; ``times``
        replaces the simulator's op times. O(V + E)."""
        sim = self.sim
        placement = np.asarray(placement, dtype=np.int64)
        on = placement[self.forward_in_order]
        devices, first = np.unique(on, return_index=True)
        if devices.size < 2:
            return None
        stages = self.stage_order(placement, devices[np.argsort(first, kind="stable")])
        if stages is None:
            return None  # activations flow both ways between stages: not a pipeline
        p = stages.size
        stage_of = np.full(sim.num_devices, -1, np.int64)
        stage_of[stages] = np.arange(p)
        op_stage = stage_of[placement]
        js, jd = op_stage[self.edge_src], op_stage[self.edge_dst]
        crossing = (js >= 0) & (jd >= 0) & (js != jd)
        forward_cross = crossing & self.forward_edge
        # every op's work is some stage's: compute on a device that runs no forward
        # compute would overlap the whole pipeline for free in the stage model
        if np.any(self.compute & (op_stage < 0)):
            return None
        gradient_cross = crossing & self.gradient_edge & (jd < js)
        if times is None:
            times = sim.op_times(placement)
        launch = (
            self.launch_by_kind[sim.device_kind_index[placement], np.arange(len(placement))]
            * self.compute
        )
        staged = op_stage >= 0
        fwd, bwd = PHASE_INDEX["forward"], PHASE_INDEX["backward"]

        def per_stage(mask: np.ndarray, weights: np.ndarray) -> np.ndarray:
            return np.bincount(op_stage[mask], weights=weights[mask], minlength=p)

        work = np.where(self.compute, times, 0.0)
        is_forward, is_backward = staged & (self.phase == fwd), staged & (self.phase == bwd)
        is_update = staged & ~is_forward & ~is_backward
        kept_stage = op_stage[self.kept_ops]
        held = kept_stage >= 0
        hosts = [self.host_by_kind[sim.device_kinds[int(d)]] for d in stages]
        gradients = np.bincount(
            placement, weights=self.gradient_bytes_per_op, minlength=sim.num_devices
        )
        tensors = np.bincount(
            placement, weights=self.gradient_tensors_per_op, minlength=sim.num_devices
        )
        accumulate = np.array(
            [
                float(
                    self.accumulation_by_kind[sim.device_kinds[int(d)]].seconds(
                        gradients[d], tensors[d]
                    )
                )
                for d in stages
            ]
        )
        kernel = np.maximum(work - launch, 0.0)
        whole_forward = is_forward & self.per_step_work
        whole_backward = is_backward & self.per_step_work
        r = self.rereads
        on_stage = op_stage[r] >= 0
        r, columns = r[on_stage], np.flatnonzero(on_stage)
        kind = sim.device_kind_index[placement[r]]
        rereads = MicroBatchRereads(
            stage=op_stage[r],
            forward=self.phase[r] == fwd,
            kernel_s=kernel[r],
            arith_s=self.reread_arith_s[kind, columns],
            whole_s=self.reread_whole_s[kind, columns],
            rest_s=self.reread_rest_s[kind, columns],
        )
        # each value crossing forward is a message of its own (and its gradient one back)
        crossing_values = np.unique(self.edge_src[forward_cross] * p + jd[forward_cross])
        activation_values = np.bincount(op_stage[crossing_values // p], minlength=p)[
            : p - 1
        ].astype(np.float64)
        ahead = [self.route(int(stages[j]), int(stages[j + 1])) for j in range(p - 1)]
        back = [self.route(int(stages[j + 1]), int(stages[j])) for j in range(p - 1)]
        return PipelineTotals(
            devices=[int(d) for d in stages],
            forward_s=per_stage(is_forward, work),
            forward_launch_s=per_stage(is_forward, launch),
            backward_s=per_stage(is_backward, work),
            backward_launch_s=per_stage(is_backward, launch),
            update_s=per_stage(is_update, times),
            activation_bytes=np.bincount(
                js[forward_cross], weights=self.edge_bytes[forward_cross], minlength=p
            )[: p - 1],
            gradient_bytes=np.bincount(
                jd[gradient_cross], weights=self.edge_bytes[gradient_cross], minlength=p
            )[: p - 1],
            resident_bytes=np.bincount(placement, weights=sim.resident_per_op)[stages],
            kept_bytes=np.bincount(
                kept_stage[held], weights=sim.transient_bytes[self.kept_ops][held], minlength=p
            ),
            activation_route=np.array(ahead, dtype=np.float64).reshape(p - 1, 2),
            gradient_route=np.array(back, dtype=np.float64).reshape(p - 1, 2),
            activation_values=activation_values,
            hosts=hosts if any(not h.charges_nothing for h in hosts) else None,
            forward_whole_s=per_stage(whole_forward, kernel),
            backward_whole_s=per_stage(whole_backward, kernel),
            rereads=rereads,
            accumulate_s=accumulate,
        )


@dataclass(frozen=True)
class MicroBatchRereads:
    """The ops of a pipeline's stages that move bytes whole in every micro-batch (a
    weight they read, a weight gradient they accumulate): each one's stage, whether it
    runs forward, its kernel seconds for the whole batch, and, on its device's roofline,
    the seconds of its arithmetic, of its whole bytes and of its other bytes."""

    stage: np.ndarray
    forward: np.ndarray
    kernel_s: np.ndarray
    arith_s: np.ndarray
    whole_s: np.ndarray
    rest_s: np.ndarray

    def kernel_share(self, micro_batches: int) -> np.ndarray:
        """Each op's kernel seconds in one of ``micro_batches`` micro-batches: its
        roofline ``max(arithmetic, bytes)`` with the arithmetic and the other bytes
        divided, the whole bytes not, as a share of its kernel time (measured or the
        roofline's) for the whole batch. O(ops)."""
        m = float(micro_batches)
        batch = np.maximum(self.arith_s, self.whole_s + self.rest_s)
        micro = np.maximum(self.arith_s / m, self.whole_s + self.rest_s / m)
        share = np.divide(micro, batch, out=np.full(batch.shape, 1.0 / m), where=batch > 0)
        return self.kernel_s * share


@dataclass(frozen=True)
class PipelineTotals:
    """A placement read as a pipeline, for the whole batch: per stage (in pipeline order)
    its forward, backward and update seconds, the launch overhead inside the forward and
    backward seconds (paid again per micro-batch), the bytes it sends to the next stage
    (activations) and to the previous one (gradients), its resident and kept bytes, and
    the (latency, bandwidth) of the routes between consecutive stages, both ways, and
    one pass of adding a micro-batch's gradients into the held ones on each stage
    (``accumulate_s``, :class:`~meshplace.cost.pipeline.GradientAccumulation`).
    :meth:`split` divides it into micro-batches."""

    devices: list[int]
    forward_s: np.ndarray
    forward_launch_s: np.ndarray
    backward_s: np.ndarray
    backward_launch_s: np.ndarray
    update_s: np.ndarray
    activation_bytes: np.ndarray
    gradient_bytes: np.ndarray
    resident_bytes: np.ndarray
    kept_bytes: np.ndarray
    activation_route: np.ndarray
    gradient_route: np.ndarray
    activation_values: np.ndarray | None = None
    hosts: list[HostCosts] | None = None
    forward_whole_s: np.ndarray | None = None
    backward_whole_s: np.ndarray | None = None
    rereads: MicroBatchRereads | None = None
    accumulate_s: np.ndarray | None = None

    def split(self, micro_batches: int) -> PipelineOfPlacement:
        """The pipeline of ``micro_batches``: each op's time split over the micro-batches
        with its launch paid once per micro-batch, except that work no input reaches
        (``forward_whole_s``, ``backward_whole_s``) is paid whole in each and an op
        moving a weight's bytes divides only the rest (:class:`MicroBatchRereads`; the
        weight re-reads of GPipe's micro-batches, Huang et al. 2019 §2.2), each transfer a
        micro-batch's share
        over its route (latency plus bytes over the bottleneck bandwidth, nothing when
        nothing crosses), and each stage charged what its host pays per micro-batch
        beyond its kernels (:meth:`meshplace.cost.pipeline.HostCosts.charge`: the
        pipelining engine, the messages' CPU, or the measured exchange at each of its
        cuts plus each further value crossing it; nothing for a cost model without
        them), and each stage's backward its share of the ``m - 1`` gradient
        accumulations of a step (``accumulate_s (m - 1) / m``). O(p)."""
        m = int(micro_batches)
        forward = self._per_micro_batch(
            self.forward_s, self.forward_launch_s, self.forward_whole_s, True, m
        )
        backward = self._per_micro_batch(
            self.backward_s, self.backward_launch_s, self.backward_whole_s, False, m
        )
        forward, backward = self._host_charged(forward, backward, m)
        if self.accumulate_s is not None:
            backward = backward + GradientAccumulation.spread(self.accumulate_s, m)
        activation = self._cut_wire(self.activation_bytes / m, self.activation_route)
        gradient = self._cut_wire(self.gradient_bytes / m, self.gradient_route)
        return PipelineOfPlacement(
            list(self.devices),
            StageTimes(forward, backward, activation, gradient, update_s=self.update_s.copy()),
            self.resident_bytes.copy(),
            self.kept_bytes / m,
            np.concatenate([[0.0], self.activation_bytes / m]),
        )

    def _cut_wire(self, nbytes: np.ndarray, route: np.ndarray) -> np.ndarray:
        """Each cut's transfer of ``nbytes`` per micro-batch over its ``route`` (``[p - 1,
        2]``: latency, bandwidth) as the cost model charges it: without the latency where
        either stage's host has a measured exchange, which holds it
        (:meth:`meshplace.cost.pipeline.HostCosts.wire_s`, as the hybrid search charges
        its stages' messages)."""
        transfer = _wire(nbytes, route)
        if not self.hosts:
            return transfer
        measured = np.array([h.exchange is not None for h in self.hosts])
        held = measured[:-1] | measured[1:]
        return np.where(held & (nbytes > 0), np.maximum(transfer - route[:, 0], 0.0), transfer)

    def _per_micro_batch(
        self,
        total: np.ndarray,
        launch: np.ndarray,
        whole: np.ndarray | None,
        forward: bool,
        m: int,
    ) -> np.ndarray:
        """Each stage's seconds for one of ``m`` micro-batches of one pass (``total`` for
        the whole batch, ``launch`` of it paid per micro-batch, ``whole`` paid whole)."""
        fixed = launch if whole is None else launch + whole
        if self.rereads is None:
            return (total - fixed) / m + fixed
        mine = self.rereads.forward == forward
        stage = self.rereads.stage[mine]
        p = total.shape[0]
        batch = np.bincount(stage, weights=self.rereads.kernel_s[mine], minlength=p)
        micro = np.bincount(stage, weights=self.rereads.kernel_share(m)[mine], minlength=p)
        return (total - fixed - batch) / m + fixed + micro

    def _host_charged(
        self, forward: np.ndarray, backward: np.ndarray, m: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``forward`` and ``backward`` per micro-batch with each stage's host costs."""
        if not self.hosts:
            return forward, backward
        p = forward.shape[0]
        cut_bytes = self.activation_bytes / m
        values = (
            self.activation_values
            if self.activation_values is not None
            else (self.activation_bytes > 0).astype(np.float64)
        )
        in_bytes, out_bytes = np.r_[0.0, cut_bytes], np.r_[cut_bytes, 0.0]
        in_values, out_values = np.r_[0.0, values], np.r_[values, 0.0]
        model = {"forward": forward, "backward": backward}
        charged_forward, charged_backward = forward.copy(), backward.copy()
        for host in set(self.hosts):
            mine = np.array([h == host for h in self.hosts])
            charged = host.charge(model, in_bytes, out_bytes, in_values, out_values)
            charged_forward[mine] = np.broadcast_to(charged["forward"], (p,))[mine]
            charged_backward[mine] = np.broadcast_to(charged["backward"], (p,))[mine]
        return charged_forward, charged_backward


def pipeline_of_placement(
    sim: Any, placement: np.ndarray, micro_batches: int
) -> PipelineOfPlacement | None:
    """Read an op placement as a pipeline of ``micro_batches``: the devices that run
    forward compute ops are the stages, in a topological order of the activations they
    send each other (:meth:`PipelineReader.stage_order`); a
    stage's forward (backward) time per micro-batch is its forward (backward) ops' time
    for the whole batch split over the micro-batches, each op still paying its launch
    overhead once per micro-batch; its update ops run once per step (``update_s``); the
    activation (gradient) transfer between consecutive stages is the forward (backward)
    bytes crossing from one to the next, a micro-batch's share, over their route. ``None``
    when the placement is not a pipeline: activations flow both ways between two stages,
    a device that runs no forward compute runs other compute (a backward or update op
    away from every stage), or there is one stage only. Gradients a stage sends to a
    later one (a weight shared by both accumulating its gradient) are exchanged once per
    step, not per micro-batch, and are not charged here; nor is contention of transfers
    on a shared link: the throughput objective floors the schedule at the busiest
    device's and link's work for that reason (``Simulator.pipelined_step``). O(V + E)
    (:class:`PipelineReader`)."""
    totals = sim.pipeline_reader.read(placement)
    return None if totals is None else totals.split(micro_batches)


def _reached_from(start: np.ndarray, arrays: Any) -> np.ndarray:
    """Which ops some op in ``start`` (a mask) reaches over the graph's edges, itself
    included: the edges in topological order of their source, each passing its source's
    mark on (every edge into a source comes first). O(E log E)."""
    rank = np.empty(start.shape[0], np.int64)
    rank[arrays.topo_order] = np.arange(start.shape[0])
    order = np.argsort(rank[arrays.edge_src], kind="stable")
    return _reach_kernel(
        start.copy(),
        arrays.edge_src[order].astype(np.int64),
        arrays.edge_dst[order].astype(np.int64),
    )


@njit(cache=True)
def _reach_kernel(reached, src, dst):  # pragma: no cover - compiled
    # sequential by nature (a mark travels down a chain of edges); numba, not a Python loop
    for j in range(src.shape[0]):
        if reached[src[j]]:
            reached[dst[j]] = True
    return reached


def _wire(nbytes: np.ndarray, route: np.ndarray) -> np.ndarray:
    """Seconds to send ``nbytes[j]`` over route ``j`` (``[latency, bandwidth]`` rows)."""
    return np.where(nbytes > 0, route[:, 0] + nbytes / route[:, 1], 0.0)
