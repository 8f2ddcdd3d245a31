"""Score a placement of an OpGraph on a Cluster: step time, memory, bytes moved, timeline.

:class:`Simulator` does the per-(graph, cluster) work once — op times per device kind from
the cost model, adjacency arrays, the cluster's route table — so each ``simulate`` call is
only the compiled event loop (:mod:`meshplace.sim.engine`). That is what lets a search score
thousands of plans a second.

Routes: on clusters of at most :data:`DENSE_ROUTE_DEVICES` devices the table of all n²
routes is built once (:meth:`Cluster.route_table`), so a search pays nothing per call. On
larger clusters that table is what made a hand-written 1,000-device cluster take 39 s
before the first simulation (issue 13; 10,000 devices never finished), so there each ``simulate``
routes only the device pairs the placement sends data between (:meth:`Cluster.route`, one
Dijkstra per source device, cached) — a 5-op plan on one device of a 10,000-device cluster
routes nothing. Both give the same routes, so results are identical.

Objectives:

* ``step`` — the makespan of one synchronous training (or inference) step;
* ``throughput`` — one training step when the batch may be split into micro-batches that
  stream through the stages: a placement that reads as a pipeline (its stages only send
  activations forward, :func:`meshplace.sim.schedule.pipeline_of_placement`) is run as
  the simulated 1F1B schedule (:func:`~meshplace.sim.schedule.simulate_schedule`) at the
  micro-batch count that makes it fastest (:func:`~meshplace.sim.schedule.micro_batch_choices`,
  or the plan's own count), and any other placement — or one where a single micro-batch
  is faster — as one step of the event simulation. The same number is what ``meshplace
  simulate`` reports for the written plan and what the hybrid search
  (:mod:`meshplace.parallel.hybrid`) ranks by: one pipeline objective (issue 18, item 4).
  It is never below the max-load *steady state*, the largest busy time over devices and
  links for the whole batch (:attr:`SimResult.steady_state_s`), which a stream of
  infinitely many micro-batches would approach; a graph whose batch is unknown (no
  batched inputs: a graph profiled elsewhere, its times per micro-batch) cannot be split,
  and is scored by the steady state itself (:data:`THROUGHPUT_MODELS`).

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> from meshplace.hardware import load_cluster
>>> g = OpGraph("two")
>>> _ = g.add_op(Op("a", "matmul", flops=1e9)); _ = g.add_op(Op("b", "matmul", flops=1e9))
>>> g.add_edge("a", "b", 4e6)
>>> sim = Simulator(g, load_cluster("colocrl-2gpu"))
>>> r = sim.simulate(sim.placement_of(["gpu0", "gpu1"]))
>>> r.step_time_s > r.lower_bound_s > 0
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.graph.summary import traced_batch
from meshplace.sim.engine import simulate_kernel
from meshplace.sim.schedule import (
    PipelineReader,
    ScheduleResult,
    micro_batch_choices,
    simulate_schedule,
)

OBJECTIVES = ("step", "throughput")
THROUGHPUT_MODELS = ("schedule", "one step", "steady state")
"""How the throughput objective ran a plan (``SimResult.throughput_model``): as a pipeline
schedule over micro-batches, as one plain step, or — for a graph whose batch is unknown —
as the steady state of an unbounded stream of micro-batches."""
_HUGE = 1e30  # seconds: stands for "cannot run here" inside the throughput bound
# Up to this many devices the simulator builds every route up front; above it, per plan.
DENSE_ROUTE_DEVICES = 256
_PAIR_CACHE_LIMIT = 1 << 20


@dataclass
class SimResult:
    """Everything one simulation measured. Times in seconds, memory in bytes."""

    objective: str
    step_time_s: float
    throughput_time_s: float | None
    lower_bound_s: float
    device_names: list[str]
    device_kinds: list[str]
    busy_s: np.ndarray
    peak_memory_bytes: np.ndarray
    memory_capacity_bytes: np.ndarray
    link_names: list[str]
    link_busy_s: np.ndarray
    link_bytes: np.ndarray
    placement: np.ndarray
    op_start: np.ndarray
    op_end: np.ndarray
    transfer_src_op: np.ndarray
    transfer_dst_device: np.ndarray
    transfer_bytes: np.ndarray
    transfer_start: np.ndarray
    transfer_end: np.ndarray
    batch: int | None = None
    steady_state_s: float = 0.0
    micro_batches: int = 1
    schedule: ScheduleResult | None = None
    throughput_model: str | None = None

    @property
    def value(self) -> float:
        """The objective's value (seconds): the step time, or under ``throughput`` the
        step pipelined over :attr:`micro_batches` (:attr:`schedule`)."""
        if self.objective == "step" or self.throughput_time_s is None:
            return self.step_time_s
        return self.throughput_time_s

    @property
    def oom_devices(self) -> list[str]:
        over = self.peak_memory_bytes > self.memory_capacity_bytes
        return [n for n, o in zip(self.device_names, over.tolist()) if o]

    @property
    def oom(self) -> bool:
        return bool(np.any(self.peak_memory_bytes > self.memory_capacity_bytes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-op timeline)."""
        ops_on = np.bincount(self.placement, minlength=len(self.device_names)).tolist()
        devices = []
        for d in range(len(self.device_names)):
            devices.append(
                {
                    "name": self.device_names[d],
                    "kind": self.device_kinds[d],
                    "ops": int(ops_on[d]),
                    "busy_s": float(self.busy_s[d]),
                    "idle_s": float(self.step_time_s - self.busy_s[d]) if ops_on[d] else None,
                    "peak_memory_bytes": float(self.peak_memory_bytes[d]),
                    "memory_capacity_bytes": float(self.memory_capacity_bytes[d]),
                    "oom": bool(self.peak_memory_bytes[d] > self.memory_capacity_bytes[d]),
                }
            )
        links = [
            {"name": n, "bytes": float(b), "busy_s": float(t)}
            for n, b, t in zip(self.link_names, self.link_bytes, self.link_busy_s)
            if b > 0
        ]
        return {
            "objective": self.objective,
            "objective_value_s": self.value,
            "step_time_s": self.step_time_s,
            "throughput_time_s": self.throughput_time_s,
            "micro_batches": self.micro_batches,
            "throughput_model": self.throughput_model,
            "steady_state_s": self.steady_state_s,
            "time_per_sample_s": (
                self.throughput_time_s / self.batch
                if self.batch and self.throughput_time_s is not None
                else None
            ),
            "lower_bound_s": self.lower_bound_s,
            "oom": self.oom,
            "oom_devices": self.oom_devices,
            "transfers": len(self.transfer_bytes),
            "bytes_moved": float(self.transfer_bytes.sum()),
            "devices": devices,
            "links": links,
        }


class Simulator:
    """Precomputes everything about (graph, cluster) that does not depend on the plan."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Any,
        cost_model: CostModel | None = None,
        *,
        in_order: bool = False,
        order: np.ndarray | None = None,
        dense_routes: bool | None = None,
        latency_overlaps: bool | None = None,
    ) -> None:
        """``in_order``: each device runs its ops strictly in priority order (an
        interpreter's fixed program order) instead of starting any ready op; ``order``
        (op indices, a topological order) replaces the graph's topological order as the
        priority — e.g. the order a runtime executes the ops in; the cost model's
        ``message_cpu`` charges transfers to the devices' compute; ``latency_overlaps``: a
        transfer holds a link for its bytes only, its latency spent in flight while the
        next one leaves (:mod:`meshplace.sim.engine`) — ``None`` (default) where the
        cluster's link says so (``Link.latency_overlaps``), ``True``/``False`` on every
        link. The others default to the original model.
        ``dense_routes``: build every route up front (True) or route per placement (False);
        the default picks by size (:data:`DENSE_ROUTE_DEVICES`). Results are identical."""
        self.graph = graph
        self.in_order = bool(in_order)
        self.link_overlaps = np.array(
            [
                link.latency_overlaps if latency_overlaps is None else bool(latency_overlaps)
                for link in cluster.links
            ],
            dtype=np.bool_,
        )
        self.cluster = cluster
        self.cost_model = cost_model or CostModel()
        a = graph.arrays()
        self.arrays = a
        n = graph.num_ops
        devices = cluster.devices
        self.device_names = [d.name for d in devices]
        self.device_kinds = [d.kind for d in devices]
        self.device_index = {name: i for i, name in enumerate(self.device_names)}
        kinds = sorted(set(self.device_kinds))
        specs = {d.kind: d.spec for d in devices}
        times = self.cost_model.op_times(graph, {k: specs[k] for k in kinds})
        # op_time_by_kind[k, i]: seconds of op i on a device of kind k (infinite where the
        # graph marks the op unsupported there)
        self.kind_names = kinds
        self.op_time_by_kind = np.stack([times[k] for k in kinds]) if n else np.zeros((1, 0))
        nowhere = np.flatnonzero(np.all(np.isinf(self.op_time_by_kind), axis=0)) if n else []
        if len(nowhere):
            op = graph.ops[int(nowhere[0])]
            raise InputError(
                f"op {op.name!r} can run on no device of cluster {cluster.name!r}: the graph "
                f"marks it unsupported on {', '.join(op.unsupported)} (device kinds here: "
                f"{', '.join(kinds)})"
            )
        kind_pos = {k: i for i, k in enumerate(kinds)}
        self.device_kind_index = np.array([kind_pos[k] for k in self.device_kinds], np.int64)
        self.memory_capacity = np.array([float(d.spec.memory_bytes) for d in devices])
        # per device: CPU seconds a message costs it (send, per byte, receive, per byte)
        self.msg_cpu = np.zeros((len(devices), 4))
        for i, dev in enumerate(devices):
            cost = self.cost_model.message_cpu.get(dev.kind)
            if cost is not None:
                self.msg_cpu[i] = cost
        # devices that spend a transfer's time themselves (no copy engine): the cluster's
        # ``transfers: occupy`` (meshplace.sim.engine)
        self.occupy = np.array([d.spec.transfers == "occupy" for d in devices], dtype=np.bool_)

        self.priority = np.empty(n, np.int64)
        if order is None:
            self.priority[a.topo_order] = np.arange(n)
        else:
            order = np.asarray(order, dtype=np.int64)
            if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
                raise InputError(f"an execution order must list each of the {n} ops once")
            self.priority[order] = np.arange(n)
            if np.any(self.priority[a.edge_src] >= self.priority[a.edge_dst]):
                raise InputError(
                    "the execution order is not topological: an op runs before its input"
                )
        kinds_of_ops = [o.kind for o in graph.ops]
        resident_kind = np.array([k in ("parameter", "buffer") for k in kinds_of_ops], bool)
        is_input = np.array([k == "input" for k in kinds_of_ops], bool)
        # Parameters and buffers are resident (param_bytes + optimizer state); inputs are
        # resident batches; every other op's outputs are transient.
        self.resident_per_op = a.param_bytes + a.state_bytes + np.where(is_input, a.output_bytes, 0)
        self.transient_bytes = np.where(resident_kind | is_input, 0.0, a.output_bytes)
        # all routes up front on small clusters; on large ones per placement (_routes_for)
        if dense_routes is None:
            dense_routes = len(devices) <= DENSE_ROUTE_DEVICES
        self.dense_routes = bool(dense_routes)
        self.route_ptr: np.ndarray | None = None
        self.route_links: np.ndarray | None = None
        if self.dense_routes:
            self.route_ptr, self.route_links = cluster.route_table()
        self._no_keys = np.zeros(0, np.int64)
        self._pair_routes: dict[int, np.ndarray] = {}
        self.link_bw = np.array([link.bandwidth for link in cluster.links], dtype=np.float64)
        self.link_lat = np.array([link.latency for link in cluster.links], dtype=np.float64)
        self.link_names = [link.name for link in cluster.links]
        self._lower_bound: float | None = None
        self._throughput_bound: float | None = None
        self._pipeline_reader: PipelineReader | None = None
        self.traced_batch = traced_batch(graph)

    # ----------------------------------------------------------------- helpers
    @property
    def num_devices(self) -> int:
        return len(self.device_names)

    @property
    def pipeline_reader(self) -> PipelineReader:
        """Reads this simulator's placements as pipelines (built on first use)."""
        if self._pipeline_reader is None:
            self._pipeline_reader = PipelineReader(self)
        return self._pipeline_reader

    def pipelined_step(
        self,
        placement: np.ndarray,
        step_s: float,
        micro_batches: int | None = None,
        times: np.ndarray | None = None,
        schedule: str = "1f1b",
        floor_s: float = 0.0,
    ) -> tuple[float, int, ScheduleResult | None]:
        """The throughput objective of ``placement`` whose one-micro-batch step takes
        ``step_s``: (seconds per step, micro-batches, the 1F1B schedule or ``None``).

        If the placement reads as a pipeline, each micro-batch count of
        :func:`micro_batch_choices` (one to eight per stage that divide the traced batch;
        only ``micro_batches`` when given and above one) is simulated as ``schedule``
        (1F1B unless the plan names another), never below ``floor_s`` (the busiest
        device's or link's work for the whole batch: the stage model charges transfers
        as delays, not as load on a shared link, and gradients exchanged once per step
        not at all); the fastest wins unless one step (``step_s``) is faster — except
        that a given ``micro_batches`` is kept (it is the plan's). Otherwise ``(step_s,
        1, None)``. ``times`` replaces the op times (e.g. with a calibration's extra
        costs). An interleaved ``schedule`` tries only counts its stages divide. O(V + E)
        plus O(p m) per count.

        >>> from meshplace.graph.ir import Op, OpGraph
        >>> from meshplace.hardware import load_cluster
        >>> g = OpGraph("g")
        >>> _ = g.add_op(Op("input:x", "input", output_shapes=[[8, 4]]))
        >>> for i in range(2):
        ...     _ = g.add_op(Op(f"f{i}", "matmul", flops=1e11, output_shapes=[[8, 4]]))
        >>> g.add_edge("input:x", "f0", 128); g.add_edge("f0", "f1", 128)
        >>> sim = Simulator(g, load_cluster("colocrl-2gpu"))
        >>> one = sim.simulate(sim.placement_of(["gpu0", "gpu0", "gpu1"]))
        >>> value, m, schedule = sim.pipelined_step(one.placement, one.step_time_s)
        >>> m, value < one.step_time_s
        (8, True)
        """
        totals = self.pipeline_reader.read(placement, times)
        if totals is None:
            return step_s, 1, None
        p = len(totals.devices)
        forced = micro_batches is not None and micro_batches > 1
        counts = [int(micro_batches)] if forced else micro_batch_choices(self.traced_batch, p)
        if schedule == "interleaved":  # Megatron-LM's rule: a multiple of the stages
            counts = [m for m in counts if m % p == 0]
        best: tuple[float, int, ScheduleResult | None] = (step_s, 1, None)
        for m in counts:
            result = simulate_schedule(totals.split(m).times, schedule, m, keep_tasks=False)
            value = max(result.step_s, floor_s)
            if forced or value < best[0]:
                best = (value, m, result)
        return best

    def placement_of(self, device_names: Sequence[str]) -> np.ndarray:
        """Device indices from device names (one per op)."""
        out = np.empty(len(device_names), np.int64)
        for i, name in enumerate(device_names):
            idx = self.device_index.get(name)
            if idx is None:
                raise InputError(
                    f"unknown device {name!r}; cluster {self.cluster.name!r} has "
                    f"{', '.join(self.device_names[:8])}{', …' if self.num_devices > 8 else ''}"
                )
            out[i] = idx
        return out

    def check_runnable(self, placement: np.ndarray, source: str = "plan") -> None:
        """Raise :class:`InputError` (one sentence naming ``source``, the op and the
        device) when ``placement`` puts an op on a device the graph says cannot run it
        (``Op.unsupported``)."""
        bad = np.flatnonzero(np.isinf(self.op_times(np.asarray(placement, dtype=np.int64))))
        if len(bad):
            op = self.graph.ops[int(bad[0])]
            d = int(placement[bad[0]])
            raise InputError(
                f"{source}: places op {op.name!r} on {self.device_names[d]} (a "
                f"{self.device_kinds[d]}), which it cannot run: the graph marks it unsupported "
                f"on {', '.join(op.unsupported)}"
            )

    def op_times(self, placement: np.ndarray) -> np.ndarray:
        """Seconds per op under ``placement``."""
        return self.op_time_by_kind[self.device_kind_index[placement], np.arange(len(placement))]

    def _routes_for(self, placement: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(route_ptr, route_links, pair_keys) for the kernel: the all-pairs table on small
        clusters (``pair_keys`` empty), else the routes of just the (source device,
        destination device) pairs that some edge crosses under ``placement``, keyed by
        ``src * n + dst`` in sorted order. O(E log E) plus one route per new pair."""
        if self.route_ptr is not None and self.route_links is not None:
            return self.route_ptr, self.route_links, self._no_keys
        a = self.arrays
        n_dev = self.num_devices
        src = placement[a.edge_src]
        dst = placement[a.edge_dst]
        cross = src != dst
        keys = np.unique(src[cross] * n_dev + dst[cross])
        if keys.size == 0:  # nothing is sent: no route is read
            return np.zeros(1, np.int64), np.zeros(0, np.int32), self._no_keys
        cache = self._pair_routes
        if len(cache) > _PAIR_CACHE_LIMIT:
            cache.clear()
        chunks = []
        for key in keys.tolist():
            route = cache.get(key)
            if route is None:
                i, j = divmod(key, n_dev)
                route = np.asarray(self.cluster.route(i, j), dtype=np.int32)
                cache[key] = route
            chunks.append(route)
        ptr = np.zeros(keys.size + 1, np.int64)
        np.cumsum([c.size for c in chunks], out=ptr[1:])
        return ptr, np.concatenate(chunks), keys

    def lower_bound(self, objective: str = "step") -> float:
        """A bound no placement beats under ``objective``.

        ``step``: max(critical path with every op on its fastest device and free
        communication, total of each op's fastest time / number of devices).

        ``throughput``: :meth:`throughput_lower_bound`. The critical path is *not* a bound
        there (a pipeline overlaps consecutive steps), which is why the step bound printed
        beside a throughput plan used to exceed the best plan."""
        if objective not in OBJECTIVES:
            raise InputError(f"unknown objective {objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if objective == "throughput":
            return self.throughput_lower_bound()
        if self._lower_bound is None:
            fastest = self.op_time_by_kind.min(axis=0)
            a = self.arrays
            cp = _critical_path(a.topo_order, a.pred_ptr, a.pred_idx, fastest)
            self._lower_bound = float(max(cp, fastest.sum() / self.num_devices))
        return self._lower_bound

    def throughput_lower_bound(self) -> float:
        """The most loaded resource's busy time can be no less than this, whatever the
        placement: max(the slowest op on its fastest device, the work bound).

        The work bound is the LP relaxation of "share the ops' times among the devices"
        in its dual (Lagrangian) form: for any weights ``w_k >= 0`` over device kinds with
        ``sum w_k = 1``, every placement's bottleneck ``T`` satisfies
        ``T >= sum_k (w_k / n_k) * busy(kind k) >= sum_i min_k (w_k / n_k) * t[k, i]``
        (``n_k`` devices of kind ``k``, ``t[k, i]`` op ``i``'s time there). One kind gives
        total work / number of devices; two kinds are solved exactly (the function is
        concave and piecewise linear in ``w``, so its maximum is at a breakpoint, found by
        sorting); with three or more, HiGHS solves the linear program for ``w`` and the
        bound is evaluated at that ``w`` exactly (any ``w`` gives a valid bound).

        Transfers add nothing unavoidable: one device holding everything sends nothing.
        Memory capacity is not used (a bound that ignores a constraint stays a bound).
        O(n log n) for one or two device kinds, one LP of n K rows for more; cached."""
        if self._throughput_bound is None:
            times = self.op_time_by_kind
            counts = np.bincount(self.device_kind_index, minlength=times.shape[0]).astype(float)
            # t[k, i] / n_k; an op a kind cannot run costs it "huge" rather than infinite:
            # a smaller time only lowers the bound, which stays a bound
            per_device = np.minimum(times / counts[:, None], _HUGE)
            if times.shape[1] == 0:
                work = 0.0
            elif len(counts) == 1:
                work = float(per_device[0].sum())
            elif len(counts) == 2:
                work = _best_two_kind_split(per_device[0], per_device[1])
            else:
                work = _lp_work_bound(per_device)
            single = float(times.min(axis=0).max(initial=0.0))
            self._throughput_bound = max(single, work)
        return self._throughput_bound

    # -------------------------------------------------------------- simulation
    def simulate(
        self,
        placement: np.ndarray,
        objective: str = "step",
        time_scale: float = 1.0,
        extra_time: np.ndarray | None = None,
        micro_batches: int | None = None,
        pipelined: bool | None = None,
        schedule: str = "1f1b",
    ) -> SimResult:
        """Simulate one step under ``placement`` (device index per op). ``extra_time``
        (seconds per op, optional) is added to the ops' times for this simulation only —
        e.g. the exact message costs of a runtime whose messages the graph does not show.

        The throughput objective's pipelined step (:meth:`pipelined_step`, at
        ``micro_batches`` when given, as ``schedule``) is computed under
        ``objective="throughput"`` or when ``pipelined`` is true; otherwise
        ``throughput_time_s`` is ``None`` (a step-objective search does not pay for it)."""
        if objective not in OBJECTIVES:
            raise InputError(f"unknown objective {objective!r}; allowed: {', '.join(OBJECTIVES)}")
        placement = np.ascontiguousarray(placement, dtype=np.int64)
        n = self.graph.num_ops
        if placement.shape != (n,):
            raise InputError(f"a placement needs one device per op: got {placement.shape}, n={n}")
        if n and (placement.min() < 0 or placement.max() >= self.num_devices):
            raise InputError(f"placement names device indices outside 0..{self.num_devices - 1}")
        a = self.arrays
        route_ptr, route_links, pair_keys = self._routes_for(placement)
        op_times = self.op_times(placement)
        if extra_time is not None:
            op_times = op_times + extra_time
        resident = np.bincount(placement, weights=self.resident_per_op, minlength=self.num_devices)
        (
            makespan,
            op_start,
            op_end,
            x_src,
            x_dev,
            x_bytes,
            x_start,
            x_end,
            busy,
            peak,
            link_busy,
            link_bytes,
        ) = simulate_kernel(
            self.num_devices,
            placement,
            op_times,
            self.priority,
            a.succ_ptr,
            a.succ_idx,
            a.succ_edge,
            a.pred_ptr,
            a.pred_idx,
            a.pred_edge,
            a.edge_bytes,
            self.transient_bytes,
            resident.astype(np.float64),
            route_ptr,
            route_links,
            pair_keys,
            self.link_bw,
            self.link_lat,
            float(time_scale),
            self.msg_cpu,
            self.in_order,
            self.occupy,
            self.link_overlaps,
        )
        steady = float(max(busy.max(initial=0.0), link_busy.max(initial=0.0)))
        throughput, m, scheduled, model = None, 1, None, None
        forced = micro_batches is not None and micro_batches > 1
        # a graph whose batch is unknown is not split, unless a plan names its micro-batches
        # (then the graph is the whole batch, split as the plan says)
        if (objective == "throughput" or pipelined) and self.traced_batch is None and not forced:
            # no batch to split (a graph profiled elsewhere, per micro-batch): the stream
            # of micro-batches is unbounded, and its limit is the busiest resource
            throughput, model = steady, THROUGHPUT_MODELS[2]
        elif objective == "throughput" or pipelined:
            # the schedule is in unscaled seconds: scale the step to compare, then back
            unscaled_step = float(makespan) / time_scale if time_scale else 0.0
            floor = steady / time_scale if time_scale else 0.0
            value, m, scheduled = self.pipelined_step(
                placement, unscaled_step, micro_batches, op_times, schedule, floor
            )
            throughput = value * time_scale
            model = THROUGHPUT_MODELS[0] if scheduled is not None else THROUGHPUT_MODELS[1]
        return SimResult(
            objective=objective,
            step_time_s=float(makespan),
            throughput_time_s=throughput,
            lower_bound_s=self.lower_bound(objective) * time_scale,
            device_names=self.device_names,
            device_kinds=self.device_kinds,
            busy_s=busy,
            peak_memory_bytes=peak,
            memory_capacity_bytes=self.memory_capacity,
            link_names=self.link_names,
            link_busy_s=link_busy,
            link_bytes=link_bytes,
            placement=placement,
            op_start=op_start,
            op_end=op_end,
            transfer_src_op=x_src,
            transfer_dst_device=x_dev,
            transfer_bytes=x_bytes,
            transfer_start=x_start,
            transfer_end=x_end,
            batch=self.graph.meta.get("batch"),
            steady_state_s=steady,
            micro_batches=m,
            schedule=scheduled,
            throughput_model=model,
        )


def _best_two_kind_split(a: np.ndarray, b: np.ndarray) -> float:
    """max over ``w`` in [0, 1] of ``sum_i min(w a_i, (1 - w) b_i)`` (``a, b >= 0``). The
    function is concave and piecewise linear with breakpoints ``w_i = b_i / (a_i + b_i)``
    (zero at both ends), so its maximum is the largest value at a breakpoint; all are
    evaluated at once with sorted prefix sums. O(n log n)."""
    total = a + b
    useful = total > 0
    a, b, total = a[useful], b[useful], total[useful]
    if a.size == 0:
        return 0.0
    order = np.argsort(b / total)
    a, b = a[order], b[order]
    breaks = b / (a + b)
    # at w = breaks[j]: ops up to j pay (1 - w) b_i (their b side is the smaller), the
    # rest w a_i
    b_upto = np.cumsum(b)
    a_after = np.concatenate([np.cumsum(a[::-1])[::-1][1:], [0.0]])
    return float(((1.0 - breaks) * b_upto + breaks * a_after).max())


def _lp_work_bound(per_device: np.ndarray) -> float:
    """max over the simplex of ``f(w) = sum_i min_k w_k per_device[k, i]``: HiGHS solves
    the linear program (max ``sum_i s_i`` with ``s_i <= w_k per_device[k, i]``,
    ``sum_k w_k = 1``) for ``w``, and ``f`` is then evaluated at that ``w`` exactly, so a
    solver tolerance can never lift the result above a true bound."""
    import highspy

    kinds, n = per_device.shape
    # columns: w_0..w_{K-1}, s_0..s_{n-1}; rows: s_i - w_k t[k, i] <= 0, then sum w = 1
    # (a kind that cannot run op i, t = _HUGE, bounds nothing: no row)
    op = np.repeat(np.arange(n), kinds)
    kind = np.tile(np.arange(kinds), n)
    keep = per_device[kind, op] < _HUGE
    op, kind = op[keep], kind[keep]
    pairs = len(op)
    index = np.empty(2 * pairs, np.int32)
    index[0::2] = kinds + op
    index[1::2] = kind
    value = np.empty(2 * pairs)
    value[0::2] = 1.0
    value[1::2] = -per_device[kind, op]
    lp = highspy.HighsLp()
    lp.num_col_ = kinds + n
    lp.num_row_ = pairs + 1
    lp.col_cost_ = np.concatenate([np.zeros(kinds), -np.ones(n)])  # HiGHS minimises
    lp.col_lower_ = np.zeros(kinds + n)
    lp.col_upper_ = np.full(kinds + n, highspy.kHighsInf)
    lp.row_lower_ = np.concatenate([np.full(pairs, -highspy.kHighsInf), [1.0]])
    lp.row_upper_ = np.concatenate([np.zeros(pairs), [1.0]])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.concatenate(
        [np.arange(0, 2 * pairs + 1, 2), [2 * pairs + kinds]]
    ).astype(np.int32)
    lp.a_matrix_.index_ = np.concatenate([index, np.arange(kinds, dtype=np.int32)])
    lp.a_matrix_.value_ = np.concatenate([value, np.ones(kinds)])
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    if h.run() == highspy.HighsStatus.kError:
        highspy.Highs.resetGlobalScheduler(True)  # see meshplace.parallel.ilp
        h.run()
    w = np.clip(np.asarray(h.getSolution().col_value, float)[:kinds], 0.0, None)
    if w.size != kinds or w.sum() <= 0:  # no solution: equal weights 1 / K (still a bound)
        return float(per_device.min(axis=0).sum()) / kinds
    w /= w.sum()
    return float((w[:, None] * per_device).min(axis=0).sum())


@njit(cache=True)
def _critical_path(topo_order, pred_ptr, pred_idx, weight):
    finish = np.zeros(weight.shape[0])
    best = 0.0
    for u in topo_order:
        start = 0.0
        for k in range(pred_ptr[u], pred_ptr[u + 1]):
            p = pred_idx[k]
            if finish[p] > start:
                start = finish[p]
        finish[u] = start + weight[u]
        if finish[u] > best:
            best = finish[u]
    return best
