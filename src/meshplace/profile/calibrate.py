"""Calibrate the cost model on this machine and build the ``local`` cluster.

Four measurements (all single-threaded, like the runtime's workers):

* **Device**: peak float32 FLOP/s from a repeated 384x384 matmul, memory bandwidth from a
  64 MiB copy, and dispatch overhead from a one-element add.
* **Ops**: every op of a traced training step timed *in the regime the workers run it*:
  :func:`time_ops_in_worker` runs the step on one runtime worker process (the executor's
  own interpreter loop, one thread) with its per-node timeline on, ``reps`` steps after a
  warm-up, median per op; a node's span runs from the previous node's end, so the
  interpreter's per-node dispatch work is charged to the ops (a view node's time to the op
  whose tensor it views). :func:`time_step_ops` is the same in this process. Times are
  keyed by an op *signature* (kind, exact operator, output shapes and dtypes, FLOPs, bytes
  read) and attached to any graph with the same signatures as ``measured_time[kind]``.
* **Link**: gloo ping-pong between two processes (:mod:`meshplace.profile.link`).
* **Messages**: the CPU a gloo message costs its sender and its receiver on this host
  (:func:`meshplace.profile.link.measure_message_cost`), which becomes the cost model's
  ``message_cpu`` for the ``local-cpu`` kind: workers are processes on shared cores with
  no DMA engine between them, so a transfer is not free for their compute. Its fixed
  part depends on the message's spacing (the time since the worker's previous message:
  bursts cost less each), measured by
  :func:`meshplace.profile.link.measure_message_spacing` into ``messages["spacing"]``,
  which :meth:`Calibration.predict` uses (docs/runtime.md, "Where the error came from").

Predictions (:meth:`Calibration.predict`) simulate with ``in_order=True``: a worker walks
the graph in one global order and blocks on a receive even when later nodes are ready.

From the op times — of the step at its batch and, by default, of the same step on one of
8 (4, 2) micro-batches (:func:`micro_step_of`) — :func:`fit_cost_model` fits the launch
overhead (median time of ops whose roofline time is negligible) and, per op kind and per
exact operator whose ops span two sizes, the roofline with a fixed cost,
``t ≈ fixed + max(flops / (peak e_c), bytes / (bandwidth e_m))``, by least squares
(:func:`fit_roofline`). This is the roofline (Williams et al., CACM 2009) with measured
per-kind efficiencies, as across-stack profiling (Li et al., XSP, IPDPS 2020) recommends
over datasheet peaks; the fixed cost per operator and the second size are what make it
hold at the small micro-batches of pipelines (one rate per kind fitted at the full batch
put them 30-40 % low: docs/runtime.md, session 39).

Example
-------
>>> spec = local_device_spec(peak=2e10, bandwidth=1e10, launch=3e-6)
>>> c = local_cluster(spec, bandwidth=1e9, latency=1e-4)
>>> c.device_names, round(c.transfer_time(0, 1, 1e6), 4)
(['cpu0', 'cpu1'], 0.0011)
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from meshplace.cost.compute import DEFAULT_EFFICIENCY, NON_KERNEL_KINDS, CostModel
from meshplace.errors import InputError
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import Cluster, Device, DeviceSpec, Link

LOCAL_KIND = "local-cpu"
LOCAL_GPU_KIND = "local-cuda"
# fixed-point rounds of the spacing-dependent message cost in Calibration.predict
SPACING_ROUNDS = 3
#: the most gradient bytes :func:`measure_gradient_accumulation` allocates twice over
ACCUMULATION_PROBE_BYTES = 256 * 2**20


# ------------------------------------------------------------------ device
def _median_time(fn: Any, reps: int, warmup: int = 2, sync: Any = None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gradient_accumulation(
    graph: OpGraph,
    device: str = "cpu",
    reps: int = 7,
    timer: Callable[..., float] | None = None,
) -> float:
    """Seconds per gradient byte of one pass adding a micro-batch's gradients into the held
    ones (``grad += new`` per trainable parameter, as autograd accumulates over
    micro-batches), measured on tensors of the sizes and dtypes of ``graph``'s trainable
    parameters (the first :data:`ACCUMULATION_PROBE_BYTES` of them) on ``device``: the
    median pass over ``reps`` at those sizes and at half of each, so the per-tensor fixed
    cost cancels, ``2 (t_full - t_half) / bytes`` (never below 0); 0 for a graph without
    trainable parameters. ``timer(fn, reps, sync=...)`` times one pass, the median of
    ``reps`` (default: this module's median timer; tests pass fixed times). O(parameters
    x reps).

    Why measured: a pass runs at whatever level of the memory hierarchy the stage's
    gradients fit in, which the device's streaming bandwidth does not say (a 4.2 MB stage
    of a deep MLP accumulated at 35 GB/s on a host whose 64 MiB copy streams at 16;
    docs/runtime.md), and the model's own sizes are what a stage holds.

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> _ = g.add_op(Op("w", "parameter", param_bytes=4 * 2**20, output_dtypes=["float32"]))
    >>> seconds = iter([3e-4, 1e-4])  # a pass at full size, then at half (fixed, not timed)
    >>> rate = measure_gradient_accumulation(g, timer=lambda fn, reps, sync: next(seconds))
    >>> round(rate * 4 * 2**20, 9)  # 2 x (full - half): a pass over the 4 MiB, seconds
    0.0004
    """
    dev = torch.device(device)
    sizes, total = [], 0
    for o in graph.ops:
        if o.kind != "parameter" or o.param_bytes <= 0:
            continue
        dtype = getattr(torch, o.output_dtypes[0] if o.output_dtypes else "float32", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        numel = max(int(o.param_bytes) // torch.empty((), dtype=dtype).element_size(), 2)
        if sizes and total + int(o.param_bytes) > ACCUMULATION_PROBE_BYTES:
            break
        sizes.append((numel, dtype))
        total += int(o.param_bytes)
    if not sizes:
        return 0.0
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    pairs = [
        (torch.zeros(n, dtype=t, device=dev), torch.ones(n, dtype=t, device=dev)) for n, t in sizes
    ]
    halves = [(held[: held.numel() // 2], new[: new.numel() // 2]) for held, new in pairs]

    def one_pass(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for held, new in tensors:
            held.add_(new)

    timer = timer or _median_time
    full = timer(lambda: one_pass(pairs), reps, sync=sync)
    half = timer(lambda: one_pass(halves), reps, sync=sync)
    return max(2.0 * (full - half), 0.0) / total


def measure_device(threads: int = 1, device: str = "cpu") -> dict[str, float]:
    """Peak float32 FLOP/s, memory bandwidth (bytes/s) and per-op dispatch time (s) of
    ``device``: this CPU with ``threads`` intra-op threads (~1 s), or a GPU ``cuda:i``
    (each timing between ``torch.cuda.synchronize`` calls, so it is execution time; a
    4096² matmul and a 256 MiB copy, since small ones would not fill a GPU)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 4096 if cuda else 384
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        out = torch.empty(n, n, device=dev)
        t_mm = _median_time(lambda: torch.mm(a, b, out=out), 7, sync=sync)
        big = torch.empty((64 if cuda else 16) * 2**20, device=dev)  # 256 / 64 MiB
        dst = torch.empty_like(big)
        t_copy = _median_time(lambda: dst.copy_(big), 5, 1, sync=sync)
        x, y = torch.ones(1, device=dev), torch.ones(1, device=dev)
        t_launch = _median_time(lambda: torch.add(x, y), 200, 20, sync=sync)
    finally:
        torch.set_num_threads(old)
    return {
        "peak_flops": 2 * n**3 / t_mm,
        "memory_bandwidth": 2 * big.numel() * 4 / t_copy,
        "launch_overhead_s": t_launch,
    }


def local_device_spec(
    peak: float,
    bandwidth: float,
    launch: float,
    *,
    gpu: bool = False,
    memory_bytes: float = 8 * 2**30,
) -> DeviceSpec:
    """The ``local-cpu`` device spec (one worker = one CPU thread), or with ``gpu`` the
    ``local-cuda`` one (one worker = one GPU of this host, ``memory_bytes`` each)."""
    return DeviceSpec(
        kind=LOCAL_GPU_KIND if gpu else LOCAL_KIND,
        description="this machine's GPUs, one per worker (measured)"
        if gpu
        else "this machine's CPU, one thread per worker (measured)",
        peak_flops={"float32": float(peak), "float64": float(peak) / 2},
        memory_bandwidth=float(bandwidth),
        memory_bytes=float(memory_bytes),
        launch_overhead_s=float(launch),
        source="measured by meshplace.profile.calibrate (matmul, copy, 1-element add)",
        category="gpu" if gpu else "cpu",
    )


def local_cluster(
    spec: DeviceSpec,
    bandwidth: float,
    latency: float,
    devices: int = 2,
    meta: Mapping[str, Any] | None = None,
) -> Cluster:
    """The ``local`` cluster: ``devices`` workers ``cpu0``… (``gpu0``… for a ``local-cuda``
    spec) of ``spec``, every pair joined by a direct link of the measured bandwidth and
    latency (loopback TCP through gloo)."""
    return mixed_cluster([spec] * devices, bandwidth, latency, meta or {})


# ------------------------------------------------------------------ ops
def signature(op: Op) -> str:
    """The key measured times are stored under: kind, operator, output shapes and dtypes,
    FLOPs and bytes read (which pin the input shapes for a given operator)."""
    shapes = ";".join("x".join(map(str, s)) for s in op.output_shapes)
    return (
        f"{op.kind}|{op.target}|{shapes}|{','.join(op.output_dtypes)}|"
        f"{op.flops:.0f}|{op.bytes_read:.0f}"
    )


@dataclass
class OpTimes:
    """Measured seconds per op signature on one device kind."""

    device_kind: str
    times: dict[str, float] = field(default_factory=dict)

    def attach(self, graph: OpGraph) -> int:
        """Set ``measured_time[device_kind]`` on every op of ``graph`` whose signature was
        measured; returns how many ops matched. O(ops)."""
        hits = 0
        for op in graph.ops:
            if op.kind in NON_KERNEL_KINDS:
                continue
            t = self.times.get(signature(op))
            if t is not None:
                op.measured_time[self.device_kind] = t
                hits += 1
        return hits

    def to_dict(self) -> dict[str, Any]:
        return {"device_kind": self.device_kind, "times": self.times}


def time_step_ops(step: Any, reps: int = 5, warmup: int = 1, threads: int = 1) -> np.ndarray:
    """Seconds per OpGraph op of a :class:`~meshplace.runtime.program.TracedStep`, timed in
    situ: the fx graph is interpreted node by node with real tensors (the runtime's
    :class:`~meshplace.runtime.program.StepInterpreter`), each node timed from the previous
    node's end; median over ``reps`` runs after ``warmup``, rescaled so the ops sum to the
    median step total. Views are charged to their owner op.
    Cost: (reps + warmup) training steps."""
    from meshplace.runtime.program import StepInterpreter

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        interp = StepInterpreter(step.gm)
        params, bufs, states, inputs = step.initial_state()
        values = [*params, *bufs, *states, *inputs]
        samples = np.zeros((reps, step.graph.num_ops))
        owner = [step.node_op.get(n.name, -1) for n in interp.nodes]
        acc = np.zeros(step.graph.num_ops)
        last = [0.0]

        def charge(i: int, env: list) -> None:
            # the time since the previous node ended: the call plus the interpreter's own
            # per-node work, which the runtime's workers pay too
            now = time.perf_counter()
            if owner[i] >= 0:
                acc[owner[i]] += now - last[0]
            last[0] = now

        for r in range(warmup + reps):
            acc[:] = 0.0
            last[0] = time.perf_counter()
            interp.walk(values, each=charge)
            if r >= warmup:
                samples[r - warmup] = acc
    finally:
        torch.set_num_threads(old)
    out = np.median(samples, axis=0)
    # Noise is right-skewed, so the sum of per-op medians undershoots the typical step;
    # rescale so the ops add up to the median step total (the split among ops is kept).
    total = float(np.median(samples.sum(axis=1)))
    if out.sum() > 0:
        out *= total / float(out.sum())
    kinds = [o.kind for o in step.graph.ops]
    out[[i for i, k in enumerate(kinds) if k in NON_KERNEL_KINDS]] = 0.0
    return out


#: how many runs of a worker :func:`calibrate` times a CPU step's ops in (the link and the
#: message measurements between them): a slow spell of the host in one of them moves no
#: median (:func:`time_ops_in_worker`)
OP_TIMING_RUNS = 3


def time_ops_in_worker(
    step: Any,
    reps: int = 5,
    warmup: int = 2,
    *,
    device: str = "cpu",
    spec: Any = None,
    bursts: Sequence[Callable[[], Any]] = (),
) -> np.ndarray:
    """Seconds per OpGraph op of a traced step, timed on a runtime worker: the step runs
    ``warmup + reps`` times on one forked worker process (one intra-op thread) of
    :func:`meshplace.runtime.executor.run_placement` with its timeline on; each fx node's
    span (from the previous node's end: dispatch included) is charged to the op owning it;
    median per op over the timed steps, rescaled so the ops add up to the median step (the
    worker's per-step work outside the nodes, spread over the ops). Non-kernel ops get 0.
    Cost: ``warmup + reps`` steps plus a fork (~0.1 s).

    ``bursts``: work to do between further runs of as many steps, each on a new worker
    (``calibrate`` measures the link and the messages there): the medians are over the
    timed steps of all runs, so a slow spell of a shared host (other jobs; it lasts longer
    than one run's steps) makes at most one run slow and moves no median while most runs
    are not slow — one run in a slow spell had a model's calibrated step 4.5x its measured
    one (dmcca-small in ``benchmarks/fidelity.py``, session 48). Each run costs another
    ``warmup + reps`` steps and fork.

    With ``device="cuda:i"`` the worker runs on that GPU: it is spawned (a forked process
    cannot use CUDA), so ``spec`` (the step's :class:`~meshplace.runtime.program.ModelSpec`)
    is needed, and each node's span ends when the GPU's stream reaches the node's end (a
    CUDA event, resolved after the step: no synchronisation inside it, which moved kernels'
    time onto later nodes — on an H200, GPT-124M's layer norms took 26 ms of synchronised
    spans and 0.9 ms of events, its attention 4 ms and 33 ms). The ops are rescaled to the
    median step of a second run without the timeline."""
    from meshplace.runtime.executor import run_placement

    gpu = torch.device(device).type == "cuda"
    if gpu and spec is None:
        raise InputError("timing ops on a GPU worker needs the step's ModelSpec (spec=...)")
    names = [n.name for n in step.gm.graph.nodes]
    owner = [step.node_op.get(name, -1) for name in names]
    samples: list[np.ndarray] = []
    totals: list[float] = []
    for between in [None, *bursts]:
        if between is not None:
            between()
        run = run_placement(
            spec if gpu else None,
            ["w0"] * step.graph.num_ops,
            warmup + reps,
            warmup=warmup,
            step=step,
            start_method="spawn" if gpu else "fork",
            timeline=True,
            worker_devices=[device],
        )
        assert run.timelines is not None
        for spans in run.timelines[0][warmup:]:
            sample = np.zeros(step.graph.num_ops)
            for node, start, end in spans:
                if node >= 0 and owner[node] >= 0:
                    sample[owner[node]] += end - start
            samples.append(sample)
        totals += run.step_times[warmup:]
    out = np.median(np.stack(samples), axis=0)
    total = float(np.median(totals))
    if gpu:
        plain = run_placement(
            spec,
            ["w0"] * step.graph.num_ops,
            warmup + reps,
            warmup=warmup,
            step=step,
            start_method="spawn",
            worker_devices=[device],
        )
        total = float(np.median(plain.step_times[warmup:]))
    if out.sum() > 0:
        out *= total / float(out.sum())
    kinds = [o.kind for o in step.graph.ops]
    out[[i for i, k in enumerate(kinds) if k in NON_KERNEL_KINDS]] = 0.0
    return out


def op_times_table(graph: OpGraph, seconds: np.ndarray, device_kind: str = LOCAL_KIND) -> OpTimes:
    """An :class:`OpTimes` from per-op seconds (ops with one signature: their median)."""
    by_sig: dict[str, list[float]] = {}
    for op, t in zip(graph.ops, seconds.tolist()):
        if op.kind not in NON_KERNEL_KINDS:
            by_sig.setdefault(signature(op), []).append(t)
    return OpTimes(device_kind, {s: float(statistics.median(v)) for s, v in by_sig.items()})


# ------------------------------------------------------------------ fitting
#: An operator gets a fit of its own when its timed ops' roofline times span this ratio
#: (the step at two batch sizes gives each batch-dependent operator two sizes); else it
#: shares its op kind's fit.
OPERATOR_SPAN = 1.5
#: Fitted efficiencies relative to the measured peak and bandwidth lie in this range: the
#: probes (a 384x384 matmul, a 64 MiB copy) are not the device's true peaks, and a larger
#: matmul or a cache-resident operand beats them.
EFFICIENCY_RANGE = (1e-4, 4.0)


def fit_roofline(
    x_compute: np.ndarray, x_memory: np.ndarray, seconds: np.ndarray, launch: float
) -> dict[str, Any]:
    """One group's (an op kind's or an operator's) roofline with a fixed cost,
    ``t ≈ fixed + max(x_compute / e_c, x_memory / e_m)``, fitted to measured ``seconds``
    by least squares (:func:`scipy.optimize.least_squares`, residuals in units of the
    group's mean time, so the group's large ops weigh as much as they cost); ``x_*`` are
    each op's seconds at the measured peak and bandwidth. Starts from the device's
    ``launch`` and the group's total rate; an efficiency the data cannot see (every op
    compute-bound says nothing of ``e_m``) stays at that start. A group whose every op is
    launch-bound (its roofline under 5 % of its time beyond ``launch``) shows no rate: it
    keeps the default efficiency and its median time is its fixed cost
    (``launch_bound``). Returns ``fixed_s``, ``compute_efficiency``,
    ``memory_efficiency``, ``efficiency`` (= the compute one), ``ops`` and the fit's
    ``median_error`` (relative, per op). O(ops · iterations).

    >>> x = np.array([1e-5, 1e-4, 1e-5, 1e-4])
    >>> t = 2e-5 + x / 0.5
    >>> fit = fit_roofline(x, np.zeros(4), t, 1e-6)
    >>> round(fit["fixed_s"] * 1e6, 3), round(fit["compute_efficiency"], 3)
    (20.0, 0.5)
    """
    from scipy.optimize import least_squares

    x = np.maximum(x_compute, x_memory)
    if not (x >= 0.05 * np.maximum(seconds - launch, 0.0)).any() or not (x > 0).any():
        return {
            "ops": len(seconds),
            "fixed_s": float(np.median(seconds)),
            "launch_bound": True,
            "median_error": None,
        }
    fixed0 = min(launch, float(seconds.min()))
    rate0 = float(np.maximum(seconds - fixed0, 0.0).sum() / x.sum())
    low, high = (-np.log(EFFICIENCY_RANGE[1]), -np.log(EFFICIENCY_RANGE[0]))
    log_rate0 = float(np.clip(np.log(max(rate0, 1e-12)), low, high))
    scale = float(seconds.mean())

    def predicted(p: np.ndarray) -> np.ndarray:  # p: fixed / scale, log rates
        return p[0] * scale + np.maximum(x_compute * np.exp(p[1]), x_memory * np.exp(p[2]))

    fit = least_squares(
        lambda p: (predicted(p) - seconds) / scale,
        [fixed0 / scale, log_rate0, log_rate0],
        bounds=([0.0, low, low], [max(float(seconds.min()) / scale, 1e-12), high, high]),
        xtol=1e-12,
        ftol=1e-12,
    )
    err = np.abs(predicted(fit.x) - seconds) / np.maximum(seconds, 1e-12)
    e_c, e_m = float(np.exp(-fit.x[1])), float(np.exp(-fit.x[2]))
    return {
        "ops": len(seconds),
        "fixed_s": float(fit.x[0] * scale),
        "compute_efficiency": e_c,
        "memory_efficiency": e_m,
        "efficiency": e_c,
        "median_error": float(np.median(err)),
    }


def fit_cost_model(
    graph: OpGraph,
    seconds: np.ndarray,
    spec: DeviceSpec,
    more: Sequence[tuple[OpGraph, np.ndarray]] = (),
) -> tuple[CostModel, dict[str, Any]]:
    """Fit the roofline's fixed cost and efficiencies to measured op times (module doc):
    those of ``graph`` (``seconds`` per op) and of each ``(graph, seconds)`` of ``more``
    (the same step at a smaller batch: :func:`calibrate` times both).

    The device's launch overhead is the median time of the ops whose roofline time is
    negligible. Each op kind gets :func:`fit_roofline` over its ops of every graph: a
    fixed cost per kernel, a compute and a memory efficiency. An exact operator
    (``aten.gelu.default``) whose ops' roofline times span :data:`OPERATOR_SPAN` (two batch
    sizes give every batch-dependent operator that) gets a fit of its own, which the cost
    model prefers to its kind's: one kind holds operators of very different fixed costs (on
    one CPU thread a GELU of 4096 floats takes ~25 us, Adam's ``mul`` of a bias ~8 us),
    and a single rate fitted at one batch size put the small micro-batches of a pipeline
    30-40 % low (docs/runtime.md, session 39). A kind that is launch-bound at every size
    keeps the default efficiency (``launch_bound``; a scale fitted to an 8-byte fill would
    cost an 8 MB one for seconds).

    Returns the :class:`CostModel` (``use_measured`` left on) and a report:
    ``launch_overhead_s``, per kind and fitted operator (``kinds``) the fit of
    :func:`fit_roofline`, and ``sizes``, the graphs' op counts.

    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> for i in range(4):
    ...     _ = g.add_op(Op(f"m{i}", "matmul", flops=1e6 * (i + 1), output_dtypes=["float32"]))
    >>> spec = local_device_spec(peak=1e10, bandwidth=1e10, launch=1e-6)
    >>> cm, rep = fit_cost_model(g, np.array([1e-6 + 2e-4 * (i + 1) for i in range(4)]), spec)
    >>> round(cm.efficiency["matmul"][0], 3)
    0.5
    """
    kinds: list[str] = []
    targets: list[str] = []
    x_c: list[np.ndarray] = []
    x_m: list[np.ndarray] = []
    times: list[np.ndarray] = []
    for g, t in [(graph, seconds), *more]:
        arrays = g.arrays()
        dtypes = [o.output_dtypes[0] if o.output_dtypes else "float32" for o in g.ops]
        peak = np.array([spec.peak(d) for d in dtypes])
        x_c.append(arrays.flops / peak)
        x_m.append(arrays.bytes_accessed / spec.memory_bandwidth)
        times.append(np.asarray(t, dtype=float))
        kinds += [o.kind for o in g.ops]
        targets += [o.target for o in g.ops]
    xc, xm, t = np.concatenate(x_c), np.concatenate(x_m), np.concatenate(times)
    kind = np.array(kinds)
    target = np.array(targets)
    kernel = ~np.isin(kind, list(NON_KERNEL_KINDS)) & (t > 0)
    x = np.maximum(xc, xm)
    tiny = kernel & (x < 0.05 * np.maximum(t, 1e-12))
    launch = float(np.median(t[tiny])) if tiny.any() else spec.launch_overhead_s
    report: dict[str, Any] = {
        "launch_overhead_s": launch,
        "kinds": {},
        "sizes": [g.num_ops for g in (graph, *(m[0] for m in more))],
    }
    efficiency: dict[str, tuple[float, float]] = {}
    fixed: dict[str, float] = {}

    def record(key: str, sel: np.ndarray) -> None:
        fit = fit_roofline(xc[sel], xm[sel], t[sel], launch)
        if fit.get("launch_bound"):
            fit["efficiency"] = float(CostModel().efficiency_on(None, str(kind[sel][0]))[1])
        else:
            efficiency[key] = (fit["compute_efficiency"], fit["memory_efficiency"])
        fixed[key] = fit["fixed_s"]
        report["kinds"][key] = fit

    for k in sorted(set(kind[kernel].tolist())):
        of_kind = kernel & (kind == k)
        record(k, of_kind)
        for op in sorted(set(target[of_kind].tolist()) - {""}):
            sel = of_kind & (target == op)
            span = x[sel]
            if sel.sum() >= 2 and span.min() > 0 and span.max() >= OPERATOR_SPAN * span.min():
                record(op, sel)
    base = dict(DEFAULT_EFFICIENCY)
    base.update(efficiency)
    cm = CostModel(
        efficiency=base, launch_overhead={spec.kind: launch}, kernel_overhead={spec.kind: fixed}
    )
    return cm, report


def fit_eager_kernels(
    timed: Sequence[tuple[Sequence[Any], Sequence[float]]], calibration: Any
) -> Any:
    """``calibration`` (a :class:`meshplace.cost.calibration.CostCalibration`) with its
    ``eager`` kernel costs fitted to ``timed``: per input size, the kernels of the model's
    eager step and each one's seconds (:func:`meshplace.runtime.dryrun.time_eager_kernels`),
    by :func:`fit_cost_model` as the graph's op times are fitted — a launch overhead, and
    per op kind and operator (where its sizes span enough) a fixed cost and two
    efficiencies — relative to the calibration's measured peak and bandwidth. The kernels
    of an engine's recorded program are then priced as eager PyTorch runs them
    (:meth:`meshplace.cost.compute.CostModel.kernel_seconds`). O(kernels).

    >>> from meshplace.cost.calibration import CostCalibration
    >>> from meshplace.runtime.dryrun import LocalKernel
    >>> cal = CostCalibration(device_kind="local-cpu", peak_flops=1e10,
    ...                       memory_bandwidth=1e10, launch_overhead_s=3e-5)
    >>> kernels = [LocalKernel("mm", "matmul", 1e6 * (i + 1), 0.0, "float32") for i in range(4)]
    >>> fitted = fit_eager_kernels([(kernels, [4e-6 + 2e-4 * (i + 1) for i in range(4)])], cal)
    >>> round(fitted.eager.efficiency["matmul"][0], 2), fitted.launch_overhead_s
    (0.5, 3e-05)
    """
    from meshplace.cost.calibration import EagerKernels, calibration_from_fit

    spec = local_device_spec(
        calibration.peak_flops, calibration.memory_bandwidth, calibration.launch_overhead_s
    )
    graphs: list[tuple[OpGraph, np.ndarray]] = []
    for size, (kernels, seconds) in enumerate(timed):
        graph = OpGraph(f"eager{size}")
        for i, k in enumerate(kernels):
            graph.add_op(
                Op(
                    f"k{i}",
                    k.kind,
                    target=k.target,
                    flops=k.flops,
                    bytes_read=k.bytes,
                    output_dtypes=[k.dtype],
                )
            )
        graphs.append((graph, np.asarray(seconds, dtype=float)))
    if not graphs:
        return calibration
    _model, report = fit_cost_model(graphs[0][0], graphs[0][1], spec, graphs[1:])
    # the fit read as the calibration file reads the op times' fit
    fitted = calibration_from_fit(
        calibration.device_kind,
        {"peak_flops": calibration.peak_flops, "memory_bandwidth": calibration.memory_bandwidth},
        report,
        None,
        "",
    )
    eager = EagerKernels(
        launch_overhead_s=fitted.launch_overhead_s,
        kernel_overhead_s=fitted.kernel_overhead_s,
        efficiency=fitted.efficiency,
    )
    return calibration.model_copy(update={"eager": eager})


# ------------------------------------------------------------------ all together
@dataclass
class Calibration:
    """Everything calibration measured: the cluster, the fitted cost model, op times."""

    cluster: Cluster
    cost_model: CostModel
    op_times: OpTimes
    device: dict[str, float]
    link: dict[str, Any]
    fit: dict[str, Any]

    messages: dict[str, Any] = field(default_factory=dict)
    step: Any = None
    #: whether the simulated cluster's links let a message's latency overlap the next
    #: message's (``Link.latency_overlaps``): the workers' loopback TCP holds no link for it
    latency_overlaps: bool = True

    def predict(self, graph: OpGraph, devices: list[str]) -> float:
        """Predicted step time of ``devices`` (one per op) on the calibrated cluster, with
        workers that run their nodes in the one global order (``in_order``). Messages cost
        their measured CPU at both ends: for the calibrated step's own graph, exactly the
        runtime's messages (:func:`runtime_message_costs`: one per fx value and leaf and
        consuming worker, views included) and the exchange of new parameter and optimizer
        state values that ends each step (:func:`end_of_step`), which the OpGraph has no
        edges for; for any other graph, one per transfer (the cost model's
        ``message_cpu``). With a spacing table (``messages["spacing"]``), each message's
        fixed cost is :func:`spacing_cost` at the time since its worker's previous message
        in the simulated step, refined over :data:`SPACING_ROUNDS` further simulations,
        and the end-of-step exchange is charged as a burst. With ``latency_overlaps`` (the
        default) a message's latency does not hold the link: a burst of messages between
        the workers pays it once, as their loopback TCP connection does."""
        if self.step is None or graph is not self.step.graph or not self.messages:
            return predict_step(
                graph,
                self.simulated_cluster(),
                self.cost_model,
                devices,
                in_order=True,
            )
        from meshplace.sim.simulator import Simulator

        # messages are charged below, each at its runtime cost, not per transfer
        free = dataclasses.replace(self.cost_model, message_cpu={})
        order = runtime_order(self.step)
        situ = self.messages.get("in_situ")
        sim = Simulator(
            graph,
            self.simulated_cluster(),
            free,
            in_order=True,
            order=order,
        )
        placement = sim.placement_of(devices)
        msgs = runtime_messages(self.step, placement)
        n = graph.num_ops
        if situ:
            return self._predict_in_situ(sim, placement, msgs, situ)
        extra = charge_messages(
            n, msgs, float(self.messages["send_s"]), float(self.messages["recv_s"]), self.messages
        )
        res = sim.simulate(placement, extra_time=extra)
        rows = self.messages.get("spacing")
        end_costs: Mapping[str, Any] = self.messages
        if rows and len(msgs["bytes"]):
            # the cost of a message depends on the time since its worker's previous one,
            # which depends on the costs: a few fixed-point rounds (docs/runtime.md)
            for _ in range(SPACING_ROUNDS):
                t_send = res.op_end[np.maximum(msgs["src_op"], 0)]
                t_recv = res.op_start[np.maximum(msgs["dst_op"], 0)]
                gap_s, gap_r = message_gaps(t_send, t_recv, msgs["src"], msgs["dst"])
                send_fixed = spacing_cost(rows, gap_s)[0]
                recv_fixed = spacing_cost(rows, gap_r)[1]
                extra = charge_messages(n, msgs, send_fixed, recv_fixed, self.messages)
                res = sim.simulate(placement, extra_time=extra)
        if rows:
            # the end-of-step exchange is one burst per sender
            burst = spacing_cost(rows, [0.0])
            end_costs = {
                **self.messages,
                "send_s": float(burst[0][0]),
                "recv_s": float(burst[1][0]),
            }
        return self._end_of_step(sim, placement, res, end_costs)

    def _predict_in_situ(
        self, sim: Any, placement: np.ndarray, msgs: Mapping[str, np.ndarray], situ: Mapping
    ) -> float:
        """:meth:`predict` with the in-situ costs of :func:`calibrate_in_situ`: each message
        costs its sender ``send_s`` and its reader ``recv_s`` (plus the per-byte costs), a
        reader whose simulated start waited on a message pays ``wake_s`` (fixed-point
        rounds: waiting depends on the costs), and when several workers run, each one's
        first op pays ``start_s`` (the step's start: barrier, posting the receives) and
        every op takes ``1 + compute_slowdown`` times its lone-worker time."""
        n = len(placement)
        costs = {**self.messages, "send_s": situ["send_s"], "recv_s": situ["recv_s"]}
        extra = charge_messages(n, msgs, float(situ["send_s"]), float(situ["recv_s"]), costs)
        workers = np.unique(placement)
        if len(workers) > 1:
            extra = extra + float(situ.get("compute_slowdown", 0.0)) * sim.op_times(placement)
        if len(workers) > 1 and float(situ.get("start_s", 0.0)) > 0:
            order = runtime_order(self.step)
            first = {int(w): int(next(o for o in order if placement[o] == w)) for w in workers}
            extra[list(first.values())] += float(situ["start_s"])
        res = sim.simulate(placement, extra_time=extra)
        wake = float(situ["wake_s"])
        if wake > 0 and len(msgs["bytes"]):
            readers = np.unique(msgs["dst_op"][msgs["dst_op"] >= 0])
            for _ in range(SPACING_ROUNDS):
                blocked = blocked_ops(res.op_start, res.op_end, placement, readers)
                woken = extra.copy()
                woken[blocked] += wake
                res = sim.simulate(placement, extra_time=woken)
        if "update_s" in situ:  # the exchange after the walk, at its own fitted cost
            costs = {**costs, "send_s": float(situ["update_s"]), "recv_s": 0.0}
        return self._end_of_step(sim, placement, res, costs)

    def simulator(self) -> Any:
        """The simulator placers should search with on the calibrated cluster: the fitted
        cost model (measured op times, the measured message CPU per transfer) and workers
        that run their ops in the runtime's order (``in_order``) — the model of
        :meth:`predict` less its exact per-message accounting, at the speed of one
        simulation. (With the default simulator, messages cost only link time and any ready
        op may run, so a search prefers splits the workers then run slower than one worker.)
        """
        from meshplace.sim.simulator import Simulator

        if self.step is None:
            raise InputError("this calibration has no traced step to simulate")
        return Simulator(
            self.step.graph,
            self.simulated_cluster(),
            self.cost_model,
            in_order=True,
            order=runtime_order(self.step),
        )

    def simulated_cluster(self) -> Cluster:
        """The cluster predictions simulate on, and ``meshplace run --cluster-out``
        writes: the calibrated one, its links' latency the in-situ hop latency where
        :func:`calibrate_in_situ` measured one (what a message took to a worker already
        waiting for it, inside steps: on the 2-core development VM a median near the
        ping-pong's but a tail to milliseconds, which the ping-pong between two otherwise
        idle processes does not see), and spent in flight (``Link.latency_overlaps``) as
        :attr:`latency_overlaps` says."""
        hop = (self.messages.get("in_situ") or {}).get("hop_latency_s")
        return self.cluster.with_link_latency(
            None if hop is None else float(hop), latency_overlaps=self.latency_overlaps
        )

    def _end_of_step(
        self, sim: Any, placement: np.ndarray, res: Any, end_costs: Mapping[str, Any]
    ) -> float:
        device_end = np.zeros(sim.num_devices)
        np.maximum.at(device_end, placement, res.op_end)
        updates = runtime_update_messages(self.step, placement)
        # the ping-pong's latency, not the in-situ hop's: update_s was fitted with it
        bandwidth, latency = float(self.link["bandwidth"]), float(self.link["latency"])
        return end_of_step(device_end, updates, end_costs, latency, bandwidth)

    def cost_calibration(self) -> Any:
        """What this calibration measured as a calibration file
        (:class:`meshplace.cost.calibration.CostCalibration`) for the workers' device kind:
        the fitted efficiencies and launch overhead relative to the measured peak and
        bandwidth, and the measured message CPU per transfer."""
        from meshplace.cost.calibration import calibration_from_fit

        kind = self.cluster.devices[0].kind
        message_cpu = self.cost_model.message_cpu.get(kind)
        return calibration_from_fit(
            kind,
            # a mixed calibration (combine_calibrations) keeps each kind's own
            self.device.get("by_kind", {}).get(kind, self.device),
            self.fit.get("by_kind", {}).get(kind, self.fit),
            tuple(message_cpu) if message_cpu is not None else None,
            f"meshplace run on {platform.node() or 'this machine'}, fitted to the op times "
            f"of {self.step.graph.name if self.step is not None else 'a model'}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "link": {k: v for k, v in self.link.items()},
            "fit": self.fit,
            "messages": self.messages,
            "op_times": self.op_times.to_dict(),
        }


def micro_step_of(step: Any, micro_batches: int | None = None) -> Any:
    """The traced ``step`` on one of ``micro_batches`` micro-batches
    (:func:`meshplace.runtime.program.micro_batch_step`), by default on the most of 8, 4
    and 2 that divide its batch and whose micro-batch the model takes (a batch of one may
    not: a sample covariance divides by ``batch - 1``, batch norm needs two samples);
    ``None`` for ``micro_batches=1``, a batch that does not split, or none that
    captures (a :class:`~meshplace.graph.capture.CaptureError` for a count given)."""
    return next(micro_steps(step, micro_batches), None)


def micro_steps(step: Any, micro_batches: int | None = None) -> Iterator[Any]:
    """:func:`micro_step_of`'s candidates, most micro-batches first (one for a count
    given)."""
    from meshplace.graph.capture import CaptureError
    from meshplace.runtime.program import micro_batch_step

    if micro_batches is not None and micro_batches < 1:
        raise InputError(f"micro_batches must be at least 1, got {micro_batches}")
    for count in (8, 4, 2) if micro_batches is None else (micro_batches,):
        try:
            micro = micro_batch_step(step, count) if count > 1 else None
        except CaptureError:
            if micro_batches is not None:
                raise
            continue
        if micro is not None:
            yield micro


def calibrate(
    step: Any,
    *,
    reps: int = 10,
    link: dict[str, Any] | None = None,
    device: dict[str, float] | None = None,
    messages: dict[str, Any] | None = None,
    in_worker: bool = True,
    spacing: bool = True,
    worker_device: str = "cpu",
    spec: Any = None,
    micro_batches: int | None = None,
) -> Calibration:
    """Measure the device, time ``step``'s ops (on forked runtime workers, or in this
    process with ``in_worker=False``), measure the link and the message CPU cost (unless
    given; with ``spacing``, also its dependence on spacing, ~2.5 s more), fit the cost
    model and attach the op times to ``step.graph``. Starts two
    processes for the link and two for the messages (~1-2 s each) unless given. On CPU
    workers the ops are timed in :data:`OP_TIMING_RUNS` runs of ``reps`` steps, one before
    and the others after the link's and the messages' measurements, so that the runs
    spread over the calibration's seconds (:func:`time_ops_in_worker`); the micro-batch
    step's too, the device's measurement between its first and second runs.

    ``worker_device="cuda:i"`` calibrates GPU workers (``local-cuda`` devices ``gpu0``…):
    the device is measured and the ops timed on that GPU (a spawned worker: pass the
    step's ``spec``); the link and message costs are the host's gloo ones, which is how the
    runtime's GPU workers exchange values (staged through host memory; the copies between
    GPU and host are not in them).

    ``micro_batches``: the step is also traced and timed on one micro-batch
    (:func:`meshplace.runtime.program.micro_batch_step`) and the cost model fitted to both
    sizes (:func:`fit_cost_model`), so that it prices the small micro-batches of pipelines
    and data-parallel shards as measured; by default the most of 8, 4 and 2 that divide
    the batch (the widest span of sizes) whose micro-batch the model traces and runs (the
    report's ``micro_step`` says what was timed, or why not), 1 for the full batch only; a
    count given that fails raises. GPU calibrations time
    the full batch only (their worker rebuilds the step from ``spec``). Cost: ``reps +
    warmup`` more steps at the micro-batch, and one trace."""
    from meshplace.profile.link import measure_link, measure_message_cost, measure_message_spacing

    gpu = torch.device(worker_device).type == "cuda"
    if gpu:
        from meshplace.runtime.executor import resolve_worker_devices

        worker_device = resolve_worker_devices([worker_device], 1)[0]
        if not in_worker:
            raise InputError("GPU calibration times the ops on a GPU worker (in_worker=True)")
        if spec is None:
            raise InputError("GPU calibration needs the step's ModelSpec (spec=...)")
    measured: dict[str, Any] = {"link": link, "messages": messages}

    def measure_the_link() -> None:
        measured["link"] = measure_link()

    def measure_the_messages() -> None:
        costs = measure_message_cost()
        if spacing:
            costs["spacing"] = measure_message_spacing()["rows"]
        measured["messages"] = costs

    work = [
        measure
        for measure, given in ((measure_the_link, link), (measure_the_messages, messages))
        if not given
    ]
    if in_worker and not gpu:
        # the ops timed in OP_TIMING_RUNS runs, the link and message measurements between
        # them: the runs spread over the seconds those take (time_ops_in_worker's bursts)
        between = [*work, *[lambda: None] * (OP_TIMING_RUNS - 1 - len(work))]
        seconds = time_ops_in_worker(step, reps=reps, bursts=between)
    else:
        for measure in work:
            measure()
        seconds = (
            # before measure_device, which initialises CUDA in this process for a GPU
            time_ops_in_worker(step, reps=reps, device=worker_device, spec=spec)
            if in_worker
            else time_step_ops(step, reps)
        )
    link, messages = measured["link"], measured["messages"]
    measured["device"] = None

    def measure_the_device() -> None:  # once, however many micro-batch runs ask
        if measured["device"] is not None:
            return
        found = dict(device or measure_device(device=worker_device))
        if "gradient_accumulation_s_per_byte" not in found:
            found["gradient_accumulation_s_per_byte"] = measure_gradient_accumulation(
                step.graph, worker_device
            )
        measured["device"] = found

    more = []
    micro_note = "none: the full batch only"
    for micro in [] if gpu else micro_steps(step, micro_batches):
        try:
            # as the full batch's: runs with the device's measurement between them
            between = [measure_the_device, *[lambda: None] * (OP_TIMING_RUNS - 2)]
            timed = (
                time_ops_in_worker(micro, reps=reps, bursts=between)
                if in_worker
                else time_step_ops(micro, reps)
            )
        except (RuntimeError, ValueError) as exc:  # traced, yet the model cannot run it
            if micro_batches is not None:
                raise
            micro_note = f"skipped: {str(exc).strip().splitlines()[-1][:200]}"
            continue
        more.append((micro.graph, timed))
        micro_note = f"timed: {micro.graph.num_ops} ops"
        break
    measure_the_device()
    device = measured["device"]
    memory = 8 * 2**30
    if gpu:
        memory = torch.cuda.get_device_properties(torch.device(worker_device)).total_memory
        torch.cuda.empty_cache()  # the measurement's buffers: the workers need the memory
    dspec = local_device_spec(
        device["peak_flops"], device["memory_bandwidth"], 0.0, gpu=gpu, memory_bytes=memory
    )
    cost_model, fit = fit_cost_model(step.graph, seconds, dspec, more)
    if device["gradient_accumulation_s_per_byte"] > 0:
        cost_model.gradient_accumulation[dspec.kind] = float(
            device["gradient_accumulation_s_per_byte"]
        )
    cost_model.message_cpu[dspec.kind] = (
        float(messages["send_s"]),
        float(messages["send_s_per_byte"]),
        float(messages["recv_s"]),
        float(messages["recv_s_per_byte"]),
    )
    dspec = dspec.with_overrides(launch_overhead_s=fit["launch_overhead_s"])
    table = op_times_table(step.graph, seconds, dspec.kind)
    table.attach(step.graph)
    cluster = local_cluster(
        dspec,
        link["bandwidth"],
        link["latency"],
        meta={
            "calibrated": True,
            "worker_device": worker_device,
            "efficiency": {k: v[0] for k, v in cost_model.efficiency.items()},
            "message_cpu": list(cost_model.message_cpu[dspec.kind]),
        },
    )
    fit["micro_step"] = micro_note
    fit["ops_timed"] = int(np.count_nonzero(seconds))
    fit["step_sum_s"] = float(seconds.sum())
    return Calibration(cluster, cost_model, table, device, link, fit, messages, step)


def mixed_cluster(
    specs: Sequence[DeviceSpec], bandwidth: float, latency: float, meta: Mapping[str, Any]
) -> Cluster:
    """The ``local`` cluster of workers, one per entry of ``specs`` in worker order
    (:func:`local_cluster` when they are all of one kind): ``local-cuda`` workers named
    ``gpu0``…, ``local-cpu`` ones ``cpu0``…, every pair joined by the measured host link
    (the runtime stages a GPU's values through host memory and sends them by gloo).

    >>> cpu = local_device_spec(peak=2e10, bandwidth=1e10, launch=3e-6)
    >>> gpu = local_device_spec(peak=5e13, bandwidth=3e12, launch=8e-6, gpu=True)
    >>> mixed_cluster([gpu, cpu], 1e9, 1e-4, {}).device_names
    ['gpu0', 'cpu0']
    """
    counts = {"gpu": 0, "cpu": 0}
    devs = []
    for spec in specs:
        prefix = "gpu" if spec.kind == LOCAL_GPU_KIND else "cpu"
        devs.append(Device(f"{prefix}{counts[prefix]}", spec.kind, spec, host="localhost"))
        counts[prefix] += 1
    links = [
        Link(f"lo{i}-{j}", a.name, b.name, float(bandwidth), float(latency), "loopback")
        for i, a in enumerate(devs)
        for j, b in enumerate(devs)
        if i != j
    ]
    return Cluster(
        "local",
        devs,
        links,
        topology="custom",
        source="measured on this machine by meshplace.profile.calibrate",
        meta=dict(meta),
    )


def combine_calibrations(
    cpu: Calibration, gpu: Calibration, worker_devices: Sequence[str]
) -> Calibration:
    """One calibration for workers on CPUs and GPUs at once (the ColocRL paper's setting:
    one CPU and the host's GPUs), from a calibration of each kind on the same step, link
    and message costs (:func:`calibrate_mixed`). Each device kind keeps its own fitted
    efficiencies (``CostModel.device_efficiency``), launch overhead and op times (both
    are attached to the step's graph, keyed by kind); ``worker_devices`` (``cpu`` or
    ``cuda:i`` per worker) orders the cluster's devices. O(ops + workers²).

    >>> from types import SimpleNamespace
    >>> cpu = SimpleNamespace(
    ...     cluster=local_cluster(local_device_spec(2e10, 1e10, 3e-6), 1e9, 1e-4),
    ...     cost_model=CostModel(launch_overhead={LOCAL_KIND: 3e-6}), op_times=None,
    ...     device={"peak_flops": 2e10}, link={"bandwidth": 1e9, "latency": 1e-4},
    ...     fit={"launch_overhead_s": 3e-6}, messages={}, step=None)
    >>> gspec = local_device_spec(5e13, 3e12, 8e-6, gpu=True)
    >>> gpu = SimpleNamespace(
    ...     cluster=local_cluster(gspec, 1e9, 1e-4),
    ...     cost_model=CostModel(launch_overhead={LOCAL_GPU_KIND: 8e-6}), op_times=None,
    ...     device={"peak_flops": 5e13}, fit={"launch_overhead_s": 8e-6})
    >>> both = combine_calibrations(cpu, gpu, ["cuda:0", "cpu"])
    >>> both.cluster.device_names, both.cost_model.launch_overhead[LOCAL_GPU_KIND]
    (['gpu0', 'cpu0'], 8e-06)
    """
    cpu_spec = cpu.cluster.devices[0].spec
    gpu_spec = gpu.cluster.devices[0].spec
    specs = [gpu_spec if torch.device(w).type == "cuda" else cpu_spec for w in worker_devices]
    kinds = {cpu_spec.kind: cpu, gpu_spec.kind: gpu}
    cost_model = CostModel(
        efficiency=dict(cpu.cost_model.efficiency),
        launch_overhead={k: c.cost_model.launch_overhead[k] for k, c in kinds.items()},
        message_cpu={**cpu.cost_model.message_cpu, **gpu.cost_model.message_cpu},
        device_efficiency={k: dict(c.cost_model.efficiency) for k, c in kinds.items()},
        kernel_overhead={
            k: dict(c.cost_model.kernel_overhead.get(k, {})) for k, c in kinds.items()
        },
        gradient_accumulation={
            k: c.cost_model.gradient_accumulation[k]
            for k, c in kinds.items()
            if k in c.cost_model.gradient_accumulation
        },
    )
    meta = {
        "calibrated": True,
        "worker_devices": list(worker_devices),
        "efficiency": {
            k: {op: v[0] for op, v in c.cost_model.efficiency.items()} for k, c in kinds.items()
        },
    }
    cluster = mixed_cluster(specs, cpu.link["bandwidth"], cpu.link["latency"], meta)
    fit = {**cpu.fit, "by_kind": {k: c.fit for k, c in kinds.items()}}
    device = {**cpu.device, "by_kind": {k: c.device for k, c in kinds.items()}}
    return Calibration(
        cluster, cost_model, cpu.op_times, device, cpu.link, fit, cpu.messages, cpu.step
    )


def calibrate_mixed(
    step: Any, worker_devices: Sequence[str], *, spec: Any, reps: int = 10
) -> Calibration:
    """Calibrate workers on CPUs and GPUs together: the step's ops are timed on a CPU
    worker and on the first GPU worker (both kinds' times attached to ``step.graph``),
    the link and message costs measured once (the host's gloo: GPU values are staged
    through host memory; the copies between GPU and host are not in them), then
    :func:`combine_calibrations`. ``spec``: the step's ModelSpec (the GPU worker is
    spawned and rebuilds it). Costs two calibrations less one link and message
    measurement."""
    gpus = [w for w in worker_devices if torch.device(w).type == "cuda"]
    if not gpus or len(gpus) == len(worker_devices):
        raise InputError("a mixed calibration needs CPU and GPU workers")
    cpu = calibrate(step, reps=reps)
    gpu = calibrate(
        step, reps=reps, link=cpu.link, messages=cpu.messages, worker_device=gpus[0], spec=spec
    )
    return combine_calibrations(cpu, gpu, worker_devices)


# a receive span longer than this waited for its data (blocked); shorter ones only
# finished a receive whose data was there (median span of those: the in-situ recv_s)
BLOCKED_RECEIVE_S = 40e-6


def probe_placements(step: Any, seed: int = 1000) -> dict[str, list[str]]:
    """Placements of ``step``'s ops on two workers (``cpu0``/``cpu1``) for
    :func:`calibrate_in_situ`, none of them a placer's: ``tail`` (only the last op in the
    runtime order on ``cpu1``: a handful of messages, so the step's fixed start cost
    shows), the runtime order cut into 2, 4 and 16 contiguous runs alternating between the
    workers (few messages, most receives blocking; then more of both) and ``scatter``
    (each op on ``cpu1`` with probability 0.3: many messages, sends in bursts). O(n).

    >>> from types import SimpleNamespace
    >>> from meshplace.graph.ir import Op, OpGraph
    >>> g = OpGraph("g")
    >>> for i in range(8):
    ...     _ = g.add_op(Op(f"o{i}", "elementwise"))
    >>> p = probe_placements(SimpleNamespace(graph=g, gm=None), seed=0)
    >>> sorted(p), p["blocks4"], p["tail"].count("cpu1")
    (['blocks16', 'blocks2', 'blocks4', 'scatter', 'tail'], ['cpu0', 'cpu0', 'cpu1', \
'cpu1', 'cpu0', 'cpu0', 'cpu1', 'cpu1'], 1)
    """
    n = step.graph.num_ops
    order = runtime_order(step) if step.gm is not None else np.arange(n)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    out = {f"blocks{k}": [f"cpu{(int(r) * k // max(n, 1)) % 2}" for r in rank] for k in (2, 4, 16)}
    out["tail"] = ["cpu1" if r == n - 1 else "cpu0" for r in rank]
    rng = np.random.default_rng(seed)
    out["scatter"] = [f"cpu{int(x)}" for x in (rng.random(n) < 0.3)]
    return out


def waited_hop_latencies(
    timelines: Sequence[Sequence[Sequence[tuple[int, float, float]]]],
    warmup: int,
    value_bytes: Mapping[int, float],
    bandwidth: float,
) -> list[float]:
    """How long a message took from its sender to a worker that was already waiting for
    it: the latencies of :func:`waited_hops`. Only these hops matter to a step: a message
    that arrives before its reader asks for it costs no waiting, whatever it took.

    >>> timelines = [[[(0, 0.0, 1.0)]], [[(-1, 0.5, 1.4), (1, 1.4, 2.0)]]]
    >>> [round(x, 6) for x in waited_hop_latencies(timelines, 0, {0: 100.0}, 1000.0)]
    [0.3]
    """
    return [latency for _, latency in waited_hops(timelines, warmup, value_bytes, bandwidth)]


def waited_hops(
    timelines: Sequence[Sequence[Sequence[tuple[int, float, float]]]],
    warmup: int,
    value_bytes: Mapping[int, float],
    bandwidth: float,
) -> list[tuple[float, float]]:
    """Every receive in a run's per-node ``timelines`` (``RunResult.timelines``: per
    worker, per step, ``(node, start, end)`` on one clock; a receive of fx node *j*'s value
    is the span ``(-1 - j, start, end)``, a node's span ends after its sends were posted)
    that began before the node it reads ended on its worker, as ``(wait, latency)``: how
    long the reader had waited when that node ended (the node's end minus the receive's
    start), and the receive's end minus the node's end less the value's
    ``value_bytes[j] / bandwidth`` on the wire (at least 0). The timed steps (after
    ``warmup``) only. O(spans).

    >>> timelines = [[[(0, 0.0, 1.0)]], [[(-1, 0.5, 1.4), (1, 1.4, 2.0)]]]
    >>> [(round(w, 6), round(x, 6)) for w, x in waited_hops(timelines, 0, {0: 100.0}, 1000.0)]
    [(0.5, 0.3)]
    """
    hops: list[tuple[float, float]] = []
    steps = min(len(worker) for worker in timelines) if timelines else 0
    for s in range(warmup, steps):
        ended = {node: end for worker in timelines for node, _, end in worker[s] if node >= 0}
        for worker in timelines:
            for node, start, end in worker[s]:
                value = -1 - node
                if node < 0 and value in ended and ended[value] > start:
                    wire = value_bytes.get(value, 0.0) / bandwidth
                    hops.append((ended[value] - start, max(0.0, end - ended[value] - wire)))
    return hops


def node_value_bytes(step: Any) -> dict[int, float]:
    """The bytes of every fx node's value in ``step`` (its tensor leaves), by position."""
    nodes = list(step.gm.graph.nodes)
    return {
        i: float(sum(t.numel() * t.element_size() for t in flatten_values(n.meta.get("val"))))
        for i, n in enumerate(nodes)
    }


def _node_medians(run: Any, worker: int, warmup: int) -> dict[int, float]:
    """Median span per fx node (from the previous event's end) over the timed steps."""
    per: dict[int, list[float]] = {}
    for spans in run.timelines[worker][warmup:]:
        prev = 0.0
        for node, _, end in spans:
            if node >= 0:
                per.setdefault(node, []).append(end - prev)
            prev = end
    return {node: statistics.median(v) for node, v in per.items()}


def pooled_runs(runs: Sequence[Any], warmup: int) -> Any:
    """Runs of one placement (:func:`meshplace.runtime.executor.run_placement` results
    with timelines) as one: each worker's timed steps of every run, in order, without
    the ``warmup`` steps each run began with, and ``step_time_s`` the median of all those
    steps. A slow spell of the host over one run of three moves no median taken over
    the pooled steps. O(steps x nodes).

    >>> from types import SimpleNamespace as Run
    >>> times = {1: 1.0, 2: 5.0, 3: 2.0}  # round -> its timed step; each began with 9.0
    >>> runs = [Run(timelines=[["w", f"t{r}"]], step_times=[9.0, t]) for r, t in times.items()]
    >>> pooled = pooled_runs(runs, 1)
    >>> pooled.timelines, pooled.step_time_s
    ([['t1', 't2', 't3']], 2.0)
    """
    from types import SimpleNamespace

    workers = len(runs[0].timelines)
    timelines = [
        [spans for run in runs for spans in run.timelines[w][warmup:]] for w in range(workers)
    ]
    steps = [t for run in runs for t in run.step_times[warmup:]]
    return SimpleNamespace(timelines=timelines, step_time_s=float(statistics.median(steps)))


def calibrate_in_situ(
    cal: Calibration, *, steps: int = 9, warmup: int = 2, seed: int = 1000, rounds: int = 3
) -> dict[str, Any]:
    """Measure what messages cost *inside* a training step, from per-node timelines, and
    make :meth:`Calibration.predict` use it (``cal.messages["in_situ"]``).

    The step runs on one worker and under each :func:`probe_placements` on two, timelines
    on, in ``rounds`` rounds (each placement once a round, ``warmup`` then
    ``steps / rounds`` steps, rounded up), each placement's timed steps pooled
    (:func:`pooled_runs`): the rounds spread every placement's steps over the
    calibration's seconds, so that a slow spell of a shared host inflates no message
    cost (one run each had mlp's send cost at 5x and its exchange's at 20x in a slow
    spell: ``benchmarks/fidelity.py``, session 48). For every worker and timed step of a
    probe, its *excess* — the time its nodes took minus what the same nodes took on the
    lone worker — is regressed (least squares, coefficients kept non-negative) on the
    messages it sent and the receives it blocked in (a receive span over
    :data:`BLOCKED_RECEIVE_S`) and the lone-worker time of its nodes:
    ``excess ≈ start_s + send_s · sends + wake_s · blocked + compute_slowdown · lone``
    (``start_s``: what starting a step costs each worker of a multi-worker run; medians
    over the steps per worker and probe). ``recv_s`` is the median span of the receives
    that did not block. Per-byte costs stay those of
    :func:`meshplace.profile.link.measure_message_cost`. The exchange after the walk (new
    parameter and state values to their owners) gets its own cost per message,
    ``update_s`` (:func:`fit_update_cost`, from each probe's walk ends and step time;
    ``exchanges`` in the report). ``hop_latency_s`` is the mean time a message took to a
    worker already waiting for it (:func:`waited_hop_latencies`, over every probe's timed
    steps; its median and 90th percentile beside it) less ``recv_s`` (charged to the
    reader besides), which predictions of the walk then take as the links' latency
    (:meth:`Calibration.simulated_cluster`) in place of the ping-pong's; ``None`` where no
    probe waited on a message.

    Why: the isolated micro-benchmarks time a message in a loop of small kernels, and the
    predictions built on them were mostly low for plans with few messages (whose
    receives all block) and high for plans that send in long bursts. On the 2-core
    development VM the timelines of 11 placements × 5 small models gave ~65 µs per send,
    ~110 µs after each blocking receive (the woken worker's next node), no extra cost for
    a receive whose data is there, and nodes 10-20 % slower in a two-worker run than on a
    lone worker, R² 0.9 (docs/runtime.md). The probes are separate runs of placements no
    placer makes, so benchmarks of placers' plans stay out of sample. Cost: ``5 x rounds``
    runs of ``warmup + steps / rounds`` steps. Returns the report, also stored.

    Measured effect (``benchmarks/fidelity.py``, which predicts every plan both ways on the
    same runs, gloo threads in ``SCHED_IDLE``): median error 12.3 % / tau 0.79 against
    15.5 % / 0.76, and 14.9 % / 0.83 against 18.0 % / 0.79 (session 33); session 45's,
    with the hop latency, on a host 2-4x slower: 12.2 % / 0.87 against 12.3 % / 0.87, and
    against 14.7 % / 0.88 with the ping-pong's latency instead of the hop's.
    ``meshplace run`` calls it for CPU workers unless ``--no-in-situ``.
    """
    from meshplace.runtime.executor import run_placement
    from meshplace.runtime.program import schedule_nodes

    if cal.step is None or not cal.messages:
        raise InputError("in-situ calibration needs the calibrated step and its message costs")
    if rounds < 1:
        raise InputError(f"in-situ calibration needs at least one round, not {rounds}")
    step = cal.step
    n = step.graph.num_ops
    placements = {"lone": ["cpu0"] * n, **probe_placements(step, seed)}
    per_round = -(-steps // rounds)  # the timed steps, spread over the rounds
    ran: dict[str, list[Any]] = {name: [] for name in placements}
    for _ in range(rounds):  # round after round of every placement: time spreads them
        for name, devices in placements.items():
            run = run_placement(
                None,
                devices,
                warmup + per_round,
                warmup=warmup,
                step=step,
                start_method="fork",
                timeline=True,
            )
            assert run.timelines is not None
            ran[name].append(run)
    pooled = {name: pooled_runs(runs, warmup) for name, runs in ran.items()}
    warmup = 0  # the pooled runs hold timed steps only
    lone = pooled.pop("lone")
    lone_node = _node_medians(lone, 0, warmup)
    value_bytes = node_value_bytes(step)
    hops: list[float] = []
    rows, features, excess, quick = [], [], [], []
    exchanges: list[tuple[list[float], list[tuple[int, int, float]], float, str]] = []
    for name, run in pooled.items():
        devices = placements[name]
        hops += waited_hop_latencies(
            run.timelines, warmup, value_bytes, float(cal.link["bandwidth"])
        )
        sched = schedule_nodes(step, [int(d[-1]) for d in devices])
        placement = np.array([int(d[-1]) for d in devices])
        # each worker's walk ends at its last event; the step ends after the exchange
        walk_ends = [
            float(np.median([spans[-1][2] if spans else 0.0 for spans in tl[warmup:]]))
            for tl in run.timelines
        ]
        exchanges.append(
            (walk_ends, runtime_update_messages(step, placement), run.step_time_s, name)
        )
        for worker in range(len(run.timelines)):
            per_step = []
            for spans in run.timelines[worker][warmup:]:
                prev = busy = alone = 0.0  # alone: what these nodes took on the lone worker
                sends = blocked = 0
                for node, start, end in spans:
                    if node < 0:
                        if end - start > BLOCKED_RECEIVE_S:
                            blocked += 1
                        else:
                            quick.append(end - start)
                    else:
                        busy += end - prev
                        alone += lone_node.get(node, 0.0)
                        sends += len(sched.consumers[node])
                    prev = end
                per_step.append((busy - alone, sends, blocked, alone))
            ex, sends, blocked, alone = np.median(np.array(per_step), axis=0).tolist()
            features.append([1.0, sends, blocked, alone])
            excess.append(ex)
            rows.append(
                {
                    "placement": name,
                    "worker": worker,
                    "excess_s": ex,
                    "sends": sends,
                    "blocked": blocked,
                    "lone_s": alone,
                    "step_s": run.step_time_s,
                }
            )
    a = np.array(features, dtype=float)
    y = np.array(excess, dtype=float)
    coef = _nonnegative_lstsq(a, y)
    fitted = a @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    latency, bandwidth = float(cal.link["latency"]), float(cal.link["bandwidth"])
    update_s = fit_update_cost(
        [(ends, updates, measured) for ends, updates, measured, _ in exchanges],
        cal.messages,
        latency,
        bandwidth,
    )
    recv_s = float(statistics.median(quick)) if quick else float(cal.messages["recv_s"])
    report = {
        "start_s": float(coef[0]),
        "update_s": update_s,
        "exchanges": [
            {
                "placement": name,
                "update_messages": len(updates),
                "walk_end_s": max(ends),
                "step_s": measured,
                "predicted_step_s": end_of_step(
                    ends,
                    updates,
                    {**cal.messages, "send_s": update_s, "recv_s": 0.0},
                    latency,
                    bandwidth,
                ),
            }
            for ends, updates, measured, name in exchanges
        ],
        "send_s": float(coef[1]),
        "wake_s": float(coef[2]),
        "compute_slowdown": float(coef[3]),
        "recv_s": recv_s,
        # the mean, not the median: a step waits for the sum of its hops, tail included;
        # less the quick receive, which the prediction charges the reader besides
        "hop_latency_s": max(0.0, float(np.mean(hops)) - recv_s) if hops else None,
        "hop_latency_median_s": float(np.median(hops)) if hops else None,
        "hop_latency_p90_s": float(np.percentile(hops, 90)) if hops else None,
        "hops": len(hops),
        "r2": 1.0 - float(((y - fitted) ** 2).sum()) / ss if ss > 0 else 0.0,
        "lone_step_s": lone.step_time_s,
        "probes": rows,
    }
    cal.messages = {**cal.messages, "in_situ": report}
    return report


def fit_update_cost(
    exchanges: Sequence[tuple[Sequence[float], Sequence[tuple[int, int, float]], float]],
    messages: Mapping[str, Any],
    latency: float,
    bandwidth: float,
) -> float:
    """The cost per message of the exchange that ends a step (new parameter and optimizer
    state values sent to their owners after the walk), fitted to measured steps: the
    ``send_s`` (``recv_s`` 0, the per-byte costs of ``messages``) for which
    :func:`end_of_step` from each step's measured walk ends ``(ends, updates, step_s)``
    best matches its measured step time, least squares over ``[0, 1 ms]`` (Brent's
    bounded method). The exchange's sends leave back to back after the walk, not one
    between nodes, so what one costs is measured here rather than taken from the walk's
    ``send_s`` (docs/runtime.md, "Session 41"). 0 when no step had such messages.
    O(iterations x messages).

    >>> cost = {"send_s_per_byte": 0.0, "recv_s_per_byte": 0.0}
    >>> # worker 1 ends its walk at 0.5 s and sends 4 values; the step ended at 0.5009 s
    >>> measured = [([0.0, 0.5], [(1, 0, 0.0)] * 4, 0.5009)]
    >>> round(fit_update_cost(measured, cost, latency=1e-4, bandwidth=1e9), 6)
    0.0002
    """
    from scipy.optimize import minimize_scalar

    used = [(ends, updates, step_s) for ends, updates, step_s in exchanges if updates]
    if not used:
        return 0.0

    def squared_error(update_s: float) -> float:
        costs = {**messages, "send_s": update_s, "recv_s": 0.0}
        return sum(
            (end_of_step(ends, updates, costs, latency, bandwidth) - step_s) ** 2
            for ends, updates, step_s in used
        )

    return float(minimize_scalar(squared_error, bounds=(0.0, 1e-3), method="bounded").x)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients for a few columns: drop the most
    negative coefficient and refit until none is negative (exact for these small, well
    conditioned problems; an active-set NNLS would be overkill). O(k² · fits).

    >>> _nonnegative_lstsq(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])).tolist()
    [2.0, 0.0]
    """
    keep = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    return coef


def flatten_values(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of a nested value (helper shared with the profiler)."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------ prediction
def runtime_order(step: Any) -> np.ndarray:
    """The OpGraph ops in the order the runtime's workers execute them: by the position of
    each op's first fx node (a topological order, since the fx graph is one). O(nodes)."""
    n = step.graph.num_ops
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    for i, node in enumerate(step.gm.graph.nodes):
        op = step.node_op.get(node.name)
        if op is not None and i < first[op]:
            first[op] = i
    return np.argsort(first, kind="stable")


def runtime_messages(step: Any, placement: np.ndarray) -> dict[str, np.ndarray]:
    """The runtime's messages when it executes ``step`` with op *i* on worker
    ``placement[i]``, from the executor's own schedule: one per tensor leaf of every fx
    value sent to every other worker that reads it. Arrays ``src_op`` (the OpGraph op that
    produces it, -1 if none), ``dst_op`` (the op of the first node on the receiving worker
    that reads it, -1 if none), ``src``, ``dst`` (workers) and ``bytes``. (New parameter
    and state values sent back to their owners end the step:
    :func:`runtime_update_messages`.) O(fx nodes + fx edges)."""
    from meshplace.runtime.program import schedule_nodes

    sched = schedule_nodes(step, [int(d) for d in placement])
    nodes = list(step.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    owner = [step.node_op.get(n.name, -1) for n in nodes]

    def leaves(i: int) -> list[float]:
        flat = tree_flatten(nodes[i].meta.get("val"))[0]
        return [float(t.numel() * t.element_size()) for t in flat if isinstance(t, torch.Tensor)]

    first_reader: dict[tuple[int, int], int] = {}
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        for a in n.all_input_nodes:
            j = pos[a]
            if sched.device[j] != sched.device[i]:
                first_reader.setdefault((j, sched.device[i]), i)
    rows = []
    for (j, dev), i in first_reader.items():
        for b in leaves(j):
            rows.append((owner[j], owner[i], sched.device[j], dev, b))
    arr = np.array(rows, dtype=float).reshape(-1, 5)
    return {
        "src_op": arr[:, 0].astype(np.int64),
        "dst_op": arr[:, 1].astype(np.int64),
        "src": arr[:, 2].astype(np.int64),
        "dst": arr[:, 3].astype(np.int64),
        "bytes": arr[:, 4],
    }


def charge_messages(
    num_ops: int,
    msgs: Mapping[str, np.ndarray],
    send_fixed: Any,
    recv_fixed: Any,
    messages: Mapping[str, Any],
) -> np.ndarray:
    """Seconds of message CPU per op: each message of ``msgs`` (:func:`runtime_messages`)
    costs ``send_fixed + send_s_per_byte · bytes`` to the op producing it and
    ``recv_fixed + recv_s_per_byte · bytes`` to the first op reading it (the fixed parts
    scalars or one per message). O(ops + messages)."""
    extra = np.zeros(num_ops)
    nbytes = msgs["bytes"]
    send = np.broadcast_to(send_fixed, nbytes.shape) + float(messages["send_s_per_byte"]) * nbytes
    recv = np.broadcast_to(recv_fixed, nbytes.shape) + float(messages["recv_s_per_byte"]) * nbytes
    s_ok, r_ok = msgs["src_op"] >= 0, msgs["dst_op"] >= 0
    np.add.at(extra, msgs["src_op"][s_ok], send[s_ok])
    np.add.at(extra, msgs["dst_op"][r_ok], recv[r_ok])
    return extra


def runtime_message_costs(step: Any, placement: np.ndarray, messages: Mapping[str, Any]) -> Any:
    """Seconds of message CPU per OpGraph op when the runtime executes ``step`` with op
    *i* on worker ``placement[i]``: every message of :func:`runtime_messages` costs
    ``send_s + send_s_per_byte · bytes`` to the op that produces it, and
    ``recv_s + recv_s_per_byte · bytes`` to the op of the first node on the receiving
    worker that reads it. O(fx nodes + fx edges)."""
    msgs = runtime_messages(step, placement)
    return charge_messages(
        step.graph.num_ops,
        msgs,
        float(messages["send_s"]),
        float(messages["recv_s"]),
        messages,
    )


def spacing_cost(rows: Sequence[Sequence[float]], gap: Any) -> tuple[np.ndarray, np.ndarray]:
    """Fixed CPU cost ``(send_s, recv_s)`` of a message ``gap`` seconds after its worker's
    previous one, from :func:`meshplace.profile.link.measure_message_spacing`'s rows
    ``(spacing_s, send_s, recv_s)``: per end, the least-squares line ``a + b · log
    spacing`` through the rows (it smooths the single rows' noise), evaluated at the gap
    clamped to the measured spacings and clipped at 0. O(rows + len(gap)).

    >>> s, r = spacing_cost([(1e-5, 1.0, 2.0), (1e-3, 3.0, 6.0)], [0.0, 1e-4, 1.0])
    >>> s.round(6).tolist(), r.round(6).tolist()
    ([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    """
    if not rows:
        raise InputError("the spacing table has no rows; measure it with measure_message_spacing")
    table = np.array(sorted((float(a), float(b), float(c)) for a, b, c in rows))
    x = np.log(np.maximum(table[:, 0], 1e-9))
    g = np.clip(np.log(np.maximum(np.asarray(gap, dtype=float), 1e-9)), x[0], x[-1])
    out = []
    for col in (1, 2):
        if len(table) > 1 and np.ptp(x) > 0:
            b, a = np.polyfit(x, table[:, col], 1)
        else:
            b, a = 0.0, float(table[0, col])
        out.append(np.maximum(a + b * g, 0.0))
    return out[0], out[1]


def blocked_ops(
    op_start: np.ndarray, op_end: np.ndarray, placement: np.ndarray, candidates: np.ndarray
) -> np.ndarray:
    """The ``candidates`` (op indices) that start later than their device's previous op
    ended in a simulated schedule — they waited on an input from another device, which a
    runtime worker does by blocking in a receive; a device's first op counts from 0 (the
    step's start). Assumes a device runs one op at a time. O(n log n).

    >>> blocked_ops(np.array([0.0, 1.0, 3.0, 0.5]), np.array([1.0, 2.0, 4.0, 0.7]),
    ...             np.array([0, 0, 0, 1]), np.array([1, 2, 3])).tolist()
    [2, 3]
    """
    n = len(op_start)
    order = np.lexsort((op_end, op_start, placement))
    dev = placement[order]
    prev_end = np.zeros(n)
    prev_end[1:] = np.where(dev[1:] == dev[:-1], op_end[order][:-1], 0.0)
    waited = np.zeros(n, dtype=bool)
    waited[order] = op_start[order] > prev_end + 1e-9 * np.maximum(1.0, prev_end)
    cand = np.asarray(candidates, dtype=np.int64)
    return cand[waited[cand]]


def message_gaps(
    times_send: np.ndarray, times_recv: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For every message, the time since the previous message (sent or received) on its
    sending worker and on its receiving worker, given when each end handles it; a
    worker's first message counts from the step's start (time 0). O(m log m).

    >>> gs, gr = message_gaps(np.array([1.0, 1.0, 5.0]), np.array([2.0, 3.0, 6.0]),
    ...                       np.array([0, 0, 0]), np.array([1, 1, 1]))
    >>> gs.tolist(), gr.tolist()
    ([1.0, 0.0, 4.0], [2.0, 1.0, 3.0])
    """
    m = len(times_send)
    t = np.concatenate([times_send, times_recv])
    dev = np.concatenate([src, dst])
    order = np.lexsort((np.arange(2 * m), t, dev))
    ts, ds = t[order], dev[order]
    prev = np.empty_like(ts)
    prev[0] = 0.0
    prev[1:] = np.where(ds[1:] == ds[:-1], ts[:-1], 0.0)
    gap = np.empty_like(t)
    gap[order] = np.maximum(ts - prev, 0.0)
    return gap[:m], gap[m:]


def runtime_update_messages(step: Any, placement: np.ndarray) -> list[tuple[int, int, float]]:
    """The messages that end the runtime's step: every new parameter and optimizer-state
    value computed away from its owner's worker is sent there after the sender's last
    node. ``(sender worker, owner worker, bytes)`` each, in the executor's order. O(nodes).
    """
    from meshplace.runtime.program import schedule_nodes

    sched = schedule_nodes(step, [int(d) for d in placement])
    nodes = list(step.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: i for i, n in enumerate(nodes)}
    placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
    pidx = {name: k for k, name in enumerate(step.param_names)}
    pairs = []  # (node computing the new value, placeholder it replaces)
    for nn in tree_flatten(nodes[-1].args[0])[0][1:]:
        p = pidx.get((nn.meta.get("custom") or {}).get("param"))
        if p is not None:
            pairs.append((pos[nn], placeholders[p]))
    first_state = len(step.param_names) + len(step.buffer_names)
    for k, name in enumerate(step.state_nodes):
        pairs.append((by_name[name], placeholders[first_state + k]))
    out = []
    for u, ph in pairs:
        if sched.device[u] != sched.device[ph]:
            val = nodes[u].meta.get("val")
            out.append((sched.device[u], sched.device[ph], float(val.numel() * val.element_size())))
    return out


def end_of_step(
    device_end: Sequence[float],
    updates: Sequence[tuple[int, int, float]],
    messages: Mapping[str, Any],
    latency: float,
    bandwidth: float,
) -> float:
    """When the step ends once every worker has sent its new parameter and state values
    to their owners (after its last op, ``device_end``) and each owner has received them:
    each sender pays ``send_s + send_s_per_byte · bytes`` per message in turn, a message
    then takes ``latency + bytes / bandwidth`` on a link that carries one at a time, and
    each owner pays the receive cost per message in arrival order. O(messages log).

    >>> cost = {"send_s": 1.0, "send_s_per_byte": 0.0, "recv_s": 2.0, "recv_s_per_byte": 0.0}
    >>> end_of_step([10.0, 3.0], [(0, 1, 100.0)], cost, latency=1.0, bandwidth=100.0)
    15.0
    """
    t = [float(x) for x in device_end]
    a_s, b_s = float(messages["send_s"]), float(messages["send_s_per_byte"])
    a_r, b_r = float(messages["recv_s"]), float(messages["recv_s_per_byte"])
    link_free: dict[tuple[int, int], float] = {}
    arrivals: list[tuple[float, int, float]] = []
    for src, dst, nbytes in updates:
        t[src] += a_s + b_s * nbytes
        start = max(t[src], link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = start + nbytes / bandwidth
        arrivals.append((start + latency + nbytes / bandwidth, dst, nbytes))
    done = list(t)
    for arrive, dst, nbytes in sorted(arrivals):
        done[dst] = max(done[dst], arrive) + a_r + b_r * nbytes
    return max(done) if done else 0.0


def predict_step(
    graph: OpGraph,
    cluster: Cluster,
    cost_model: CostModel,
    devices: list[str],
    *,
    in_order: bool = False,
    latency_overlaps: bool | None = None,
) -> float:
    """Simulated step time of ``devices`` (one device name per op) on ``cluster`` with
    ``cost_model`` (whose ``message_cpu`` charges messages to the workers' compute);
    ``in_order`` and ``latency_overlaps`` (``None``: as the cluster's links say) as in
    :class:`~meshplace.sim.simulator.Simulator`. One simulation."""
    from meshplace.sim.simulator import Simulator

    sim = Simulator(
        graph, cluster, cost_model, in_order=in_order, latency_overlaps=latency_overlaps
    )
    return float(sim.simulate(sim.placement_of(devices)).step_time_s)
