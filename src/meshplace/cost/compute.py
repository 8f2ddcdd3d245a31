"""Per-op compute time on a device: measured when known, else a calibratable roofline.

For op *i* on a device of kind *k*:

* if the graph carries ``measured_time[k]`` (or, failing that, a time for the device's
  category such as ``"cpu"`` or ``"gpu"``), that is the time: it already includes the
  launch overhead, since it was measured end to end;
* otherwise ``max(flops / (peak(dtype) · e_c), bytes / (bandwidth · e_m)) + launch``
  (Williams et al., "Roofline", CACM 2009), where ``e_c`` and ``e_m`` are per-op-kind
  efficiencies (of the exact operator where calibration fitted one, else of the op kind)
  and ``launch`` the operator's or op kind's fixed cost where calibration measured one
  (``kernel_overhead``: a GELU of a few thousand elements on one CPU thread costs ~25 us
  whatever its size, an Adam ``mul`` of a bias ~8 us), else the device's. Real models
  reach at most ~52 % of peak (Li et al., across-stack profiling, IPDPS 2020), so the
  defaults below are deliberately below 1; calibration against a profile replaces them
  with measured ones;
* ops that are not kernels (``parameter``, ``buffer``, ``input``) take no time;
* an op whose ``unsupported`` lists the device's kind or category cannot run there: its
  time is infinite, so every plan that puts it there is infinitely slow and never chosen.

``message_cpu`` (per device kind; empty by default) says what a message costs the *compute*
of its two ends when devices have no DMA engine between them — CPU worker processes over
loopback TCP, where the kernel's TCP path and the transport's threads run on the workers'
cores: ``(send_s, send_s_per_byte, recv_s, recv_s_per_byte)``, measured by
:func:`meshplace.profile.link.measure_message_cost`. The simulator adds it to the ops at
the two ends of each transfer; GPUs with copy engines leave it empty.

``collectives`` (per device kind; empty by default) holds measured collectives: per
collective kind the latency and bandwidth with which the ring formula
(:func:`meshplace.cost.collectives.collective_time`) fits the transport's own all-reduce,
all-gather, reduce-scatter and all-to-all, as :func:`meshplace.profile.link.
measure_collectives` times them. A mesh of devices of that kind
(:meth:`meshplace.mesh.layout.Mesh.calibrated`) costs those collectives with them instead
of with the cluster's link latency and bandwidth: over loopback TCP a rank's send and
receive share its core, and gloo's all-reduce takes about three times the ring formula
on the link's figures.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("one")
>>> _ = g.add_op(Op("mm", "matmul", flops=2e9, bytes_read=1e6, output_dtypes=["float32"]))
>>> from meshplace.hardware import device_spec
>>> t = CostModel().op_times(g, {"k80": device_spec("k80")})["k80"][0]
>>> round(float(t) * 1e3, 3)  # 2 GFLOP at 4.37 TFLOP/s x 0.7, plus 5.7 us launch
0.66
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from meshplace.graph.ir import OpGraph

NON_KERNEL_KINDS = frozenset({"parameter", "buffer", "input"})


class DeviceLike(Protocol):
    """What the cost model needs from a device spec."""

    memory_bandwidth: float
    launch_overhead_s: float

    def peak(self, dtype: str) -> float: ...


# (compute efficiency, memory efficiency) per op kind. Dense matmul and convolution
# kernels reach 60-80 % of peak on large shapes (cuBLAS/cuDNN, XLA on TPU); attention and
# normalisation less; point-wise ops are memory bound and stream at ~70-80 % of bandwidth.
DEFAULT_EFFICIENCY: dict[str, tuple[float, float]] = {
    "matmul": (0.70, 0.70),
    "conv": (0.60, 0.70),
    "conv_grad": (0.55, 0.70),
    "attention": (0.50, 0.70),
    "attention_grad": (0.45, 0.70),
    "linalg": (0.30, 0.50),
    "batch_norm": (0.50, 0.70),
    "batch_norm_grad": (0.50, 0.70),
    "layer_norm": (0.50, 0.70),
    "layer_norm_grad": (0.50, 0.70),
    "embedding": (0.50, 0.50),
    "embedding_grad": (0.50, 0.40),
}
FALLBACK_EFFICIENCY = (0.50, 0.70)


@dataclass(frozen=True)
class KernelCosts:
    """One execution engine's fitted kernel costs on one device kind: the fixed seconds of
    a kernel (``launch_s``, overridden per operator or op kind by ``overhead``) and the
    (compute, memory) efficiencies per operator or op kind (others: the cost model's).

    >>> KernelCosts(5e-6, {"aten.mm.default": 2e-5}).fixed("matmul", "aten.mm.default")
    2e-05
    """

    launch_s: float
    overhead: dict[str, float] = field(default_factory=dict)
    efficiency: dict[str, tuple[float, float]] = field(default_factory=dict)

    def fixed(self, op_kind: str, target: str = "") -> float:
        """Fixed seconds of one kernel: the operator's, else the op kind's, else
        ``launch_s``."""
        own = self.overhead.get(target) if target else None
        return self.overhead.get(op_kind, self.launch_s) if own is None else own


@dataclass
class CostModel:
    """Turns an OpGraph's FLOPs and bytes into seconds on each device kind.

    Attributes:
        efficiency: op kind → (compute efficiency, memory efficiency), each in (0, 1].
        fallback: efficiency for kinds not in ``efficiency``.
        launch_overhead: device kind → seconds, overriding the device spec's value.
        kernel_overhead: device kind → op kind → seconds of fixed cost per kernel of that
            op kind, overriding ``launch_overhead`` for it (a calibration's fit over op
            times at two batch sizes, :func:`meshplace.profile.calibrate.fit_cost_model`).
        device_efficiency: device kind → op kind → (compute, memory) efficiency, overriding
            ``efficiency`` on that kind (a calibration file's fit,
            :func:`meshplace.cost.calibration.calibrated_cost_model`).
        use_measured: prefer ``Op.measured_time`` when the graph has one for the kind.
        message_cpu: device kind → (send s, send s/byte, receive s, receive s/byte) of
            compute a message costs its ends (host-staged transfers); absent: none.
        collectives: device kind → collective kind → (latency s, bandwidth bytes/s) of
            the ring formula fitted to the measured collective (module doc); absent: the
            cluster's links.
        c10d_collectives: the same, measured as the process group's own calls
            (``torch.distributed.all_reduce`` and the like, which DDP, FSDP2 and the
            runtime's bucketed gradient reductions and ZeRO gathers issue) where
            ``collectives`` holds them as DTensor's redistributions run them (on gloo
            between two CPU ranks about half the cost at 1 MiB, all-gathers at half the
            latency; :func:`meshplace.profile.link.measure_collectives` with
            ``engine="c10d"``); absent: ``collectives``.
        dispatch_overhead: device kind → seconds the execution engine adds to every
            kernel, whether its time is measured or the roofline's (DTensor's per-op
            dispatch: sharding propagation and placement checks on the host); absent: 0.
        split_dispatch_overhead: device kind → seconds DTensor's dispatch costs an op
            with an operand split or a partial sum over a mesh axis, measured apart
            (:func:`meshplace.runtime.dryrun.measure_dispatch_overhead`: on the model's
            step under Megatron's layout, more placements to propagate and redistribute);
            charged by the engine's recorded programs
            (:meth:`meshplace.runtime.dryrun.EngineProgram.predict`); absent:
            ``dispatch_overhead``.
        batch_dispatch_overhead: device kind → seconds DTensor's dispatch costs an op
            whose operands are split over the batch's mesh axes only (data parallelism
            on DTensor), measured the same way on that layout; absent:
            ``dispatch_overhead``.
        pipeline_overhead: device kind → seconds a pipelining engine adds per micro-batch
            on each stage (``torch.distributed.pipelining``'s schedule bookkeeping and
            stage input/output handling, measured by
            :func:`meshplace.runtime.pipelined.measure_engine_overhead`); absent: 0.
        pipeline_exchange: device kind → (seconds per beat, seconds per further value) that
            a pipeline of more than one stage costs two busy ranks per micro-batch beyond
            the slower stage's compute, with one value crossing each way, and for each
            further value crossing the cut (:func:`meshplace.runtime.pipeline_exchange.
            measure_pipeline_exchange`); where set, it replaces ``pipeline_overhead`` and
            the messages' fixed CPU for such pipelines; absent: those.
        fsdp_unit_overhead: device kind → seconds FSDP2 adds per unit (a module it gathers
            as one) per training step: its hooks, copies and the DTensor dispatch on its
            sharded parameters (:func:`meshplace.runtime.data_parallel.
            measure_fsdp_overhead`); absent: 0.
        ddp_overhead: device kind → seconds DDP adds per micro-batch on a data-parallel
            stage it runs (its forward's pre- and post-processing and a hook per
            parameter, :func:`meshplace.runtime.data_parallel.measure_ddp_overhead`);
            absent: 0.
        gradient_accumulation: device kind → seconds per gradient byte of one pass adding
            a micro-batch's gradients into the held ones, measured
            (:func:`meshplace.profile.calibrate.measure_gradient_accumulation`); absent: the
            elementwise roofline (:class:`meshplace.cost.pipeline.GradientAccumulation`).
        eager_kernels: device kind → the costs of kernels as eager PyTorch runs them
            (:class:`KernelCosts`, fitted to the kernels of the model's own eager step,
            :func:`meshplace.profile.calibrate.fit_eager_kernels`), which
            :meth:`kernel_seconds` prefers for an engine's recorded program: the op times
            ``kernel_overhead`` and the efficiencies were fitted to are fx nodes timed in
            meshplace's own runtime, each with its interpreter's work, which eager PyTorch
            does not pay (on the Llama example the graph's fit put the eager step at twice
            its measured time); absent: those.
        sync_skew: device kind → the fraction of a rank's local work that a step whose
            ranks meet in collectives takes beyond that work and the collectives: every
            meeting makes the early ranks wait for the late one
            (:func:`meshplace.profile.link.measure_sync_skew`), charged by the engine's
            recorded programs (:meth:`meshplace.runtime.dryrun.EngineProgram.predict`);
            absent: 0.
    """

    efficiency: dict[str, tuple[float, float]] = field(
        default_factory=lambda: dict(DEFAULT_EFFICIENCY)
    )
    fallback: tuple[float, float] = FALLBACK_EFFICIENCY
    launch_overhead: dict[str, float] = field(default_factory=dict)
    use_measured: bool = True
    message_cpu: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    device_efficiency: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    collectives: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    c10d_collectives: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    dispatch_overhead: dict[str, float] = field(default_factory=dict)
    split_dispatch_overhead: dict[str, float] = field(default_factory=dict)
    batch_dispatch_overhead: dict[str, float] = field(default_factory=dict)
    pipeline_overhead: dict[str, float] = field(default_factory=dict)
    pipeline_exchange: dict[str, tuple[float, float]] = field(default_factory=dict)
    fsdp_unit_overhead: dict[str, float] = field(default_factory=dict)
    ddp_overhead: dict[str, float] = field(default_factory=dict)
    kernel_overhead: dict[str, dict[str, float]] = field(default_factory=dict)
    gradient_accumulation: dict[str, float] = field(default_factory=dict)
    eager_kernels: dict[str, KernelCosts] = field(default_factory=dict)
    sync_skew: dict[str, float] = field(default_factory=dict)

    def efficiency_on(
        self, device_kind: str | None, op_kind: str, target: str = ""
    ) -> tuple[float, float]:
        """(compute, memory) efficiency of ``op_kind`` ops on ``device_kind`` devices: the
        device kind's calibrated value for the exact operator ``target``
        (``aten.gelu.default``), else for the op kind, else the model-wide one (operator,
        then kind), else the fallback.

        >>> cm = CostModel(device_efficiency={"cpu": {"matmul": (0.2, 0.3)}})
        >>> cm.efficiency_on("cpu", "matmul"), cm.efficiency_on("gpu", "matmul")
        ((0.2, 0.3), (0.7, 0.7))
        """
        own = self.device_efficiency.get(device_kind or "", {})
        return (
            (target and own.get(target))
            or own.get(op_kind)
            or (target and self.efficiency.get(target))
            or self.efficiency.get(op_kind, self.fallback)
        )

    def launch_on(self, device_kind: str, spec: DeviceLike) -> float:
        """Seconds of fixed cost per kernel on ``device_kind``: the calibrated launch
        overhead (else the device spec's) plus the engine's dispatch overhead.

        >>> from meshplace.hardware import device_spec
        >>> cm = CostModel(launch_overhead={"cpu": 5e-6}, dispatch_overhead={"cpu": 2e-5})
        >>> round(cm.launch_on("cpu", device_spec("cpu")) * 1e6, 6)
        25.0
        """
        launch = self.launch_overhead.get(device_kind, spec.launch_overhead_s)
        return launch + self.dispatch_overhead.get(device_kind, 0.0)

    def kernel_fixed(
        self, device_kind: str, spec: DeviceLike, op_kind: str, target: str = ""
    ) -> float:
        """Seconds of fixed cost of one ``op_kind`` kernel (exact operator ``target``) on
        ``device_kind``, the engine's dispatch not included: the operator's calibrated
        fixed cost (``kernel_overhead``), else the op kind's, else the device's launch
        overhead (calibrated, else the spec's).

        >>> from meshplace.hardware import device_spec
        >>> cm = CostModel(launch_overhead={"cpu": 5e-6},
        ...                kernel_overhead={"cpu": {"elementwise": 2.5e-5}})
        >>> [round(cm.kernel_fixed("cpu", device_spec("cpu"), k) * 1e6, 6)
        ...  for k in ("elementwise", "matmul")]
        [25.0, 5.0]
        """
        fixed = self.kernel_overhead.get(device_kind, {})
        own = fixed.get(target) if target else None
        own = fixed.get(op_kind) if own is None else own
        if own is None:
            return self.launch_overhead.get(device_kind, spec.launch_overhead_s)
        return own

    def kernel_launch(
        self, device_kind: str, spec: DeviceLike, op_kind: str, target: str = ""
    ) -> float:
        """:meth:`kernel_fixed` plus the engine's dispatch overhead: what an op of the
        graph pays beyond its roofline time."""
        return self.kernel_fixed(device_kind, spec, op_kind, target) + self.dispatch_overhead.get(
            device_kind, 0.0
        )

    def launches(self, graph: OpGraph, device_kind: str, spec: DeviceLike) -> np.ndarray:
        """Per op of ``graph``, :meth:`kernel_launch` on ``device_kind`` (0 for ops that
        are not kernels). O(V)."""
        memo: dict[tuple[str, str], float] = {}
        out = np.zeros(graph.num_ops)
        for i, o in enumerate(graph.ops):
            if o.kind in NON_KERNEL_KINDS:
                continue
            key = (o.kind, o.target)
            if key not in memo:
                memo[key] = self.kernel_launch(device_kind, spec, o.kind, o.target)
            out[i] = memo[key]
        return out

    def kernel_seconds(
        self,
        device_kind: str,
        spec: DeviceLike,
        op_kind: str,
        flops: float,
        nbytes: float,
        dtype: str = "float32",
        target: str = "",
    ) -> float:
        """The roofline time of one ``op_kind`` kernel of ``flops`` and ``nbytes`` on
        ``device_kind`` with its fixed cost (:meth:`kernel_fixed`; an engine's program
        counts its dispatch per dispatched op): what :meth:`op_times` charges an op
        without a measured time, for kernels that are not ops of a graph (an engine's
        recorded program, :mod:`meshplace.runtime.dryrun`). Where ``eager_kernels`` has
        the device kind, its fixed costs and efficiencies instead (those kernels run in
        eager PyTorch).

        >>> from meshplace.hardware import device_spec
        >>> cm = CostModel(efficiency={"matmul": (0.5, 0.5)}, launch_overhead={"cpu": 0.0})
        >>> spec = device_spec("cpu")
        >>> cm.kernel_seconds("cpu", spec, "matmul", spec.peak("float32"), 0.0)
        2.0
        """
        eager = self.eager_kernels.get(device_kind)
        if eager is not None:  # fitted to kernels as eager PyTorch runs them
            ec, em = (
                (target and eager.efficiency.get(target))
                or eager.efficiency.get(op_kind)
                or self.efficiency_on(device_kind, op_kind, target)
            )
            fixed = eager.fixed(op_kind, target)
        else:
            ec, em = self.efficiency_on(device_kind, op_kind, target)
            fixed = self.kernel_fixed(device_kind, spec, op_kind, target)
        roof = max(flops / (spec.peak(dtype) * ec), nbytes / (spec.memory_bandwidth * em))
        return roof + fixed

    def roofline_terms(self, graph: OpGraph, spec: DeviceLike) -> tuple[np.ndarray, np.ndarray]:
        """Per op, the two sides of the roofline on one device kind: seconds of arithmetic
        (``flops / (peak x e_c)``) and seconds per byte moved (``1 / (bandwidth x e_m)``).
        A fusing compiler's kernel is ``max(sum of arithmetic, bytes it moves x that rate)
        + one launch`` (:class:`meshplace.parallel.sharding.ShardingProblem`,
        ``compute="fused"``). O(V)."""
        ops = graph.ops
        flops = graph.arrays().flops
        arith = np.zeros(len(ops))
        per_byte = np.zeros(len(ops))
        peaks: dict[str, float] = {}
        device_kind = getattr(spec, "kind", None)
        for i, o in enumerate(ops):
            ec, em = self.efficiency_on(device_kind, o.kind, o.target)
            dt = o.output_dtypes[0] if o.output_dtypes else "float32"
            if dt not in peaks:
                peaks[dt] = spec.peak(dt)
            arith[i] = flops[i] / (peaks[dt] * ec)
            per_byte[i] = 1.0 / (spec.memory_bandwidth * em)
        return arith, per_byte

    def op_times(self, graph: OpGraph, kinds: Mapping[str, DeviceLike]) -> dict[str, np.ndarray]:
        """Seconds per op for each device kind in ``kinds`` (kind → spec). O(V · kinds)."""
        arrays = graph.arrays()
        ops = graph.ops
        n = len(ops)
        kind_names = [o.kind for o in ops]
        operators = [o.target for o in ops]
        kernel = np.array([k not in NON_KERNEL_KINDS for k in kind_names])
        dtypes = [o.output_dtypes[0] if o.output_dtypes else "float32" for o in ops]
        out: dict[str, np.ndarray] = {}
        for kind, spec in kinds.items():
            eff_c = np.empty(n)
            eff_m = np.empty(n)
            for i, k in enumerate(kind_names):
                eff_c[i], eff_m[i] = self.efficiency_on(kind, k, operators[i])
            peak_by_dtype = {dt: spec.peak(dt) for dt in set(dtypes)}
            peak = np.array([peak_by_dtype[dt] for dt in dtypes])
            launch = self.launches(graph, kind, spec)
            compute = arrays.flops / (peak * eff_c)
            memory = arrays.bytes_accessed / (spec.memory_bandwidth * eff_m)
            t = np.where(kernel, np.maximum(compute, memory) + launch, 0.0)
            if self.use_measured:
                # A time measured on this exact kind wins; else one measured on its category
                # (a graph profiled elsewhere may say just "cpu" or "gpu").
                category = getattr(spec, "category", None)
                for i, o in enumerate(ops):
                    m = o.measured_time.get(kind)
                    if m is None and category is not None:
                        m = o.measured_time.get(category)
                    if m is not None:
                        # measured with eager PyTorch: the engine's own cost comes on top
                        # (the roofline's ``launch`` above already holds it)
                        t[i] = m + self.dispatch_overhead.get(kind, 0.0)
            category = getattr(spec, "category", None)
            for i, o in enumerate(ops):
                if o.unsupported and (kind in o.unsupported or category in o.unsupported):
                    t[i] = np.inf  # the graph says this device cannot run it
            out[kind] = t
        return out
