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

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplace.errors import InputError

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


def simulate_schedule(
    times: StageTimes, schedule: str, micro_batches: int, virtual: int = 1
) -> ScheduleResult:
    """Simulate one step of ``schedule`` with ``micro_batches`` over the stages of
    ``times`` (``p v`` virtual stages on ``p`` devices). See the module docstring for the
    model; returns the step time, each device's busy time, the bubble (idle share of the
    device time, averaged over devices) and each device's peak number of micro-batches
    whose forward has run and backward not yet. O(p v m)."""
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
    orders = device_orders(schedule, p, m, virtual)

    end: dict[tuple[str, int, int], float] = {}
    position = [0] * p
    device_free = [0.0] * p
    pending = sum(len(o) for o in orders)
    tasks: list[dict[str, Any]] = []
    in_flight = [0] * p
    peak = [0] * p
    while pending:
        progressed = False
        for d in range(p):
            while position[d] < len(orders[d]):
                kind, s, b = orders[d][position[d]]
                if kind == "F":
                    dep = ("F", s - 1, b) if s > 0 else None
                    wire = act[s - 1] if s > 0 else 0.0
                    dur = forward[s]
                else:
                    dep = ("B", s + 1, b) if s < n_virtual - 1 else ("F", s, b)
                    wire = grad[s] if s < n_virtual - 1 else 0.0
                    dur = backward[s]
                if dep is not None and dep not in end:
                    break  # waits for another device
                ready = end[dep] + wire if dep is not None else 0.0
                start = max(device_free[d], ready)
                end[(kind, s, b)] = device_free[d] = start + dur
                tasks.append({"device": d, "kind": kind, "stage": s, "micro_batch": b,
                              "start_s": start, "end_s": start + dur})  # fmt: skip
                in_flight[d] += 1 if kind == "F" else -1
                peak[d] = max(peak[d], in_flight[d])
                position[d] += 1
                pending -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError(f"internal: the {schedule} orders deadlock")
    busy = [
        float(sum(forward[s] + backward[s] for s in range(d, n_virtual, p)) * m) for d in range(p)
    ]
    allreduce = _per_device(times.allreduce_s, p)
    update = _per_device(times.update_s, p)
    finish = [device_free[d] + allreduce[d] + update[d] for d in range(p)]
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


def pipeline_of_placement(
    sim: Any, placement: np.ndarray, micro_batches: int
) -> PipelineOfPlacement | None:
    """Read an op placement as a pipeline of ``micro_batches``: the devices that run
    forward compute ops are the stages, in the order their first forward op runs; a
    stage's forward (backward) time per micro-batch is its forward (backward) ops' time
    for the whole batch split over the micro-batches, each op still paying its launch
    overhead once per micro-batch; its update ops run once per step (``update_s``); the
    activation (gradient) transfer between consecutive stages is the forward (backward)
    bytes crossing from one to the next, a micro-batch's share, over their route. ``None``
    when the placement is not a pipeline: a stage sends activations to an earlier stage
    (or, for one stage, nothing to pipeline). O(V + E)."""
    graph = sim.graph
    ops = graph.ops
    a = sim.arrays
    placement = np.asarray(placement, dtype=np.int64)
    m = int(micro_batches)
    phase = np.array([o.phase for o in ops])
    compute = np.array([o.kind not in ("parameter", "buffer", "input") for o in ops])
    first: dict[int, int] = {}
    for position, i in enumerate(a.topo_order.tolist()):
        if phase[i] == "forward" and compute[i]:
            first.setdefault(int(placement[i]), position)
    stages = sorted(first, key=first.__getitem__)
    if len(stages) < 2:
        return None
    stage_of = {d: j for j, d in enumerate(stages)}
    times = sim.op_times(placement)
    launch = (
        np.array(
            [
                sim.cost_model.launch_on(sim.device_kinds[d], sim.cluster.devices[d].spec)
                for d in range(sim.num_devices)
            ]
        )[placement]
        * compute
    )
    per_micro_batch = np.where(compute, (times - launch) / m + launch, 0.0)
    p = len(stages)
    forward_s, backward_s, update_s = np.zeros(p), np.zeros(p), np.zeros(p)
    for i, d in enumerate(placement.tolist()):
        j = stage_of.get(d)
        if j is None:
            continue  # a device with no forward compute: its ops are not pipelined
        if phase[i] == "forward":
            forward_s[j] += per_micro_batch[i]
        elif phase[i] == "backward":
            backward_s[j] += per_micro_batch[i]
        else:
            update_s[j] += times[i]
    fwd_bytes, bwd_bytes = np.zeros(p - 1), np.zeros(p - 1)
    for s, d, nbytes in graph.edges():
        js, jd = stage_of.get(int(placement[s])), stage_of.get(int(placement[d]))
        if js is None or jd is None or js == jd:
            continue
        if phase[s] == "forward" and phase[d] == "forward":
            if jd < js:
                return None  # activations flowing back: not a pipeline
            fwd_bytes[js] += nbytes / m  # leaves at the boundary after its stage
        elif phase[s] != "update" and phase[d] != "update" and jd < js:
            bwd_bytes[jd] += nbytes / m
    # memory: resident bytes on each stage's device; per micro-batch the forward outputs
    # its backward reads (kept between the passes) and the activation it receives
    resident = np.array([float(sim.resident_per_op[placement == d].sum()) for d in stages])
    kept = np.zeros(p)
    seen = set()
    for s, d, _ in graph.edges():
        j = stage_of.get(int(placement[s]))
        reads_forward = phase[s] == "forward" and phase[d] == "backward" and compute[s]
        if j is not None and reads_forward and s not in seen:
            kept[j] += float(sim.transient_bytes[s]) / m
            seen.add(s)
    received = np.concatenate([[0.0], fwd_bytes])
    activation = np.array(
        [_wire(sim, stages[j], stages[j + 1], fwd_bytes[j]) for j in range(p - 1)]
    )
    gradient = np.array([_wire(sim, stages[j + 1], stages[j], bwd_bytes[j]) for j in range(p - 1)])
    return PipelineOfPlacement(
        stages,
        StageTimes(forward_s, backward_s, activation, gradient, update_s=update_s),
        resident,
        kept,
        received,
    )


def _wire(sim: Any, src: int, dst: int, nbytes: float) -> float:
    return float(sim.cluster.transfer_time(src, dst, nbytes)) if nbytes > 0 else 0.0
