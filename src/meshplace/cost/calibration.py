"""Calibration files: the cost model's constants as measured on one device kind.

A calibration (format ``meshplace.calibration``, version 1, ``docs/formats.md``) records
what measuring a device kind taught the roofline of :class:`~meshplace.cost.compute.
CostModel`: per op kind the fitted (compute, memory) efficiency, the fixed cost per kernel,
the peak FLOP/s and memory bandwidth those efficiencies are relative to, for devices
without copy engines the compute a message costs its two ends, and, where measured, the
transport's collectives (latency and bandwidth of the ring formula fitted to each). ``meshplace run
--calibration-out FILE`` writes one from the calibration it performs on the local workers
(:func:`calibration_from_fit`). ``meshplace plan``, ``simulate`` and ``shard`` take
``--calibration FILE`` and apply it the one way :func:`calibrated_cost_model` does, to the
devices of the file's kind in the cluster they are given, so the same measurement moves
every prediction alike.

Efficiencies are relative to the file's ``peak_flops`` and ``memory_bandwidth``; on a
cluster whose spec of that kind says other peaks, they are rescaled so that the calibrated
times stay the measured ones (``e' = e x peak_file / peak_spec``).

Example
-------
>>> cal = CostCalibration(device_kind="h100", peak_flops=6.7e13, memory_bandwidth=3.35e12,
...                   launch_overhead_s=8e-6, efficiency={"matmul": (0.35, 0.6)})
>>> from meshplace.hardware import load_cluster
>>> cm = calibrated_cost_model(cal, load_cluster("dgx-h100"))
>>> cm.launch_overhead["h100"], cm.efficiency_on("h100", "matmul")[1]
(8e-06, 0.6)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshplace.cost.compute import CostModel, KernelCosts
from meshplace.errors import InputError
from meshplace.util import parse_json, read_text_file, short_repr, write_text_atomic

FORMAT = "meshplace.calibration"
VERSION = 1

_Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class CalibrationError(InputError):
    """A calibration file that cannot be read, or that does not fit the cluster."""


class EagerKernels(BaseModel):
    """Kernel costs fitted to the kernels of the model's own eager training step
    (:func:`meshplace.profile.calibrate.fit_eager_kernels`): what torchrun's engines
    (DDP, FSDP2, DTensor, torch's pipelining) pay per kernel, without the interpreter's
    work per node in the op times the other fields were fitted to.

    Attributes:
        launch_overhead_s: fixed seconds per kernel.
        kernel_overhead_s: operator or op kind → fixed seconds per kernel of it.
        efficiency: operator or op kind → (compute, memory) efficiency.
    """

    model_config = ConfigDict(extra="forbid")

    launch_overhead_s: _NonNegative
    kernel_overhead_s: dict[str, _NonNegative] = Field(default_factory=dict)
    efficiency: dict[str, tuple[_Positive, _Positive]] = Field(default_factory=dict)


class CostCalibration(BaseModel):
    """One device kind's measured cost-model constants (the module doc).

    Attributes:
        device_kind: the cluster device kind measured (``local-cpu``, ``h100``...).
        peak_flops: float32 FLOP/s the compute efficiencies are relative to.
        memory_bandwidth: bytes/s the memory efficiencies are relative to.
        launch_overhead_s: fixed seconds per kernel.
        kernel_overhead_s: op kind → fixed seconds per kernel of that kind, where the fit
            measured one (:func:`meshplace.profile.calibrate.fit_cost_model`, from op times
            at two batch sizes); kinds not listed pay ``launch_overhead_s``.
        efficiency: op kind → (compute, memory) efficiency, fitted; op kinds not listed
            keep the cost model's defaults.
        message_cpu: (send s, send s/byte, receive s, receive s/byte) of compute a message
            costs its ends, for devices without copy engines; ``None``: none.
        collectives: collective kind (``all_reduce``, ``all_gather``, ``reduce_scatter``,
            ``all_to_all``) → (latency s, bandwidth bytes/s) with which the ring formula
            fits the measured collective (:func:`meshplace.profile.link.
            measure_collectives`); kinds not listed use the cluster's links.
        collectives_measured_on: how many processes the collectives were measured among
            (the formula carries them to other group sizes).
        collectives_c10d: the same kinds measured as the process group's own calls
            (``torch.distributed.all_reduce`` and the like), which DDP, FSDP2 and the
            runtime's bucketed gradient reductions and ZeRO gathers issue, where
            ``collectives`` times DTensor's redistributions (on gloo between two CPU
            ranks about twice the process group's all-reduce at 1 MiB and all-gather
            at 16 KiB, nearer at 4 MiB); kinds not listed cost as ``collectives``.
        dispatch_overhead_s: seconds the execution engine adds to every kernel, measured
            op times included (DTensor's per-op dispatch for sharded plans; 0 for eager
            PyTorch).
        split_dispatch_overhead_s: seconds DTensor's dispatch costs an op with a split or
            partial operand (measured on the model's step under Megatron's layout on a
            2-rank fake process group, :func:`meshplace.runtime.dryrun.
            measure_dispatch_overhead`); 0: not measured, such ops pay
            ``dispatch_overhead_s``.
        batch_dispatch_overhead_s: the same for an op whose operands are split over the
            batch's mesh axes only (data parallelism on DTensor: every input split along
            its rows, parameters whole); 0: not measured.
        pipeline_overhead_s: seconds the pipelining engine adds per micro-batch on each
            stage (:func:`meshplace.runtime.pipelined.measure_engine_overhead`), which the
            hybrid search charges every micro-batch of a plan meshplace's runtime pipelines,
            and the simulator every micro-batch of an op placement it reads as a pipeline
            (:class:`meshplace.cost.pipeline.HostCosts`).
        pipeline_exchange_s: seconds a beat (micro-batch) of a pipeline of more than one
            stage costs two busy ranks beyond the slower stage's compute, one value crossing
            each way: the engine, the two messages and the ranks' meeting (a gloo send
            completes when the peer posts its receive;
            :func:`meshplace.runtime.pipeline_exchange.measure_pipeline_exchange`). Charged
            instead of ``pipeline_overhead_s`` and the messages' fixed CPU where it is set.
        pipeline_message_s: seconds each further value crossing a pipeline's cut adds per
            beat (torch's pipelining sends every value as a message of its own).
        fsdp_unit_overhead_s: seconds FSDP2 adds per unit per step
            (:func:`meshplace.runtime.data_parallel.measure_fsdp_overhead`), which the
            prediction of a ZeRO-3 data-parallel plan charges for each unit.
        ddp_overhead_s: seconds DDP adds per micro-batch on a data-parallel stage it runs
            (:func:`meshplace.runtime.data_parallel.measure_ddp_overhead`), which the
            hybrid search charges every micro-batch of such a stage.
        gradient_accumulation_s_per_byte: seconds per gradient byte of one pass adding a
            micro-batch's gradients into the held ones, measured on the model's own
            parameter sizes (:func:`meshplace.profile.calibrate.
            measure_gradient_accumulation`), which every stage of ``m`` micro-batches pays
            ``m - 1`` times (:class:`meshplace.cost.pipeline.GradientAccumulation`); 0: the
            elementwise roofline at ``memory_bandwidth``.
        sync_skew: the fraction of a rank's local work that a step of ranks meeting in
            collectives takes beyond it and the collectives themselves: the late rank's
            lag that every meeting makes the others wait out (measured on the model's
            own eager step, :func:`meshplace.profile.link.measure_sync_skew`), which an
            engine's recorded program with collectives is charged
            (:meth:`meshplace.runtime.dryrun.EngineProgram.predict`); 0: not measured.
        eager: the kernels' costs in eager PyTorch (:class:`EagerKernels`), with which an
            engine's recorded program is priced (:meth:`meshplace.cost.compute.CostModel.
            kernel_seconds`); ``None``: not measured, those kernels cost as graph ops.
        source: how and where it was measured.
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal["meshplace.calibration"] = FORMAT
    version: Literal[1] = VERSION
    device_kind: Annotated[str, Field(min_length=1)]
    peak_flops: _Positive
    memory_bandwidth: _Positive
    launch_overhead_s: _NonNegative
    kernel_overhead_s: dict[str, _NonNegative] = Field(default_factory=dict)
    efficiency: dict[str, tuple[_Positive, _Positive]] = Field(default_factory=dict)
    message_cpu: tuple[_NonNegative, _NonNegative, _NonNegative, _NonNegative] | None = None
    collectives: dict[
        Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"],
        tuple[_NonNegative, _Positive],
    ] = Field(default_factory=dict)
    collectives_measured_on: Annotated[int, Field(ge=2)] | None = None
    collectives_c10d: dict[
        Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"],
        tuple[_NonNegative, _Positive],
    ] = Field(default_factory=dict)
    dispatch_overhead_s: _NonNegative = 0.0
    split_dispatch_overhead_s: _NonNegative = 0.0
    batch_dispatch_overhead_s: _NonNegative = 0.0
    pipeline_overhead_s: _NonNegative = 0.0
    pipeline_exchange_s: _NonNegative = 0.0
    pipeline_message_s: _NonNegative = 0.0
    fsdp_unit_overhead_s: _NonNegative = 0.0
    ddp_overhead_s: _NonNegative = 0.0
    gradient_accumulation_s_per_byte: _NonNegative = 0.0
    sync_skew: _NonNegative = 0.0
    eager: EagerKernels | None = None
    source: str = ""


def load_calibration(path: str | Path) -> CostCalibration:
    """Read and check a calibration file; every problem is one
    :class:`CalibrationError` sentence naming the file and the field."""
    text = read_text_file(path, "calibration", CalibrationError)
    data = parse_json(text, str(path), "calibration", CalibrationError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(
            f"{path}: not a calibration file (field 'format' must be {FORMAT!r}; write one "
            "with meshplace run --calibration-out)"
        )
    try:
        return CostCalibration.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "the top level"
        value = err.get("input")
        got = "" if isinstance(value, dict | list) else f" (got {short_repr(value)})"
        msg = err["msg"][0].lower() + err["msg"][1:]
        raise CalibrationError(f"{path}: field {loc!r}: {msg}{got}") from None


def save_calibration(calibration: CostCalibration, path: str | Path) -> None:
    """Write ``calibration`` atomically as indented JSON."""
    write_text_atomic(path, json.dumps(calibration.model_dump(mode="json"), indent=1))


def calibrated_cost_model(
    calibration: CostCalibration, cluster: Any, base: CostModel | None = None
) -> CostModel:
    """``base`` (default: the default :class:`CostModel`) with ``calibration`` applied to
    the devices of its kind in ``cluster``: their efficiencies (rescaled to the cluster's
    spec of that kind, the module doc), launch overhead, engine dispatch overhead, message
    CPU, measured collectives, pipelining engine overhead and the ranks'
    synchronisation skew. Other device
    kinds keep ``base``'s. Raises :class:`CalibrationError` when the cluster has no device
    of the calibration's kind. O(op kinds).
    """
    kinds = {d.kind: d.spec for d in cluster.devices}
    spec = kinds.get(calibration.device_kind)
    if spec is None:
        raise CalibrationError(
            f"the calibration measured device kind {calibration.device_kind!r}, and cluster "
            f"{cluster.name!r} has none (its kinds: {', '.join(sorted(kinds))})"
        )
    base = base or CostModel()
    scale_c = calibration.peak_flops / spec.peak("float32")
    scale_m = calibration.memory_bandwidth / spec.memory_bandwidth

    def rescaled(efficiency: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        return {op: (ec * scale_c, em * scale_m) for op, (ec, em) in efficiency.items()}

    fitted = rescaled(calibration.efficiency)
    kind = calibration.device_kind
    message_cpu = dict(base.message_cpu)
    if calibration.message_cpu is not None:
        message_cpu[kind] = tuple(calibration.message_cpu)
    return CostModel(
        efficiency=dict(base.efficiency),
        fallback=base.fallback,
        launch_overhead={**base.launch_overhead, kind: calibration.launch_overhead_s},
        kernel_overhead={
            **base.kernel_overhead,
            kind: {
                **base.kernel_overhead.get(kind, {}),
                **{k: float(v) for k, v in calibration.kernel_overhead_s.items()},
            },
        },
        use_measured=base.use_measured,
        message_cpu=message_cpu,
        device_efficiency={
            **base.device_efficiency,
            kind: {**base.device_efficiency.get(kind, {}), **fitted},
        },
        dispatch_overhead={
            **base.dispatch_overhead,
            **({kind: calibration.dispatch_overhead_s} if calibration.dispatch_overhead_s else {}),
        },
        split_dispatch_overhead={
            **base.split_dispatch_overhead,
            **(
                {kind: calibration.split_dispatch_overhead_s}
                if calibration.split_dispatch_overhead_s
                else {}
            ),
        },
        batch_dispatch_overhead={
            **base.batch_dispatch_overhead,
            **(
                {kind: calibration.batch_dispatch_overhead_s}
                if calibration.batch_dispatch_overhead_s
                else {}
            ),
        },
        pipeline_overhead={
            **base.pipeline_overhead,
            **({kind: calibration.pipeline_overhead_s} if calibration.pipeline_overhead_s else {}),
        },
        pipeline_exchange={
            **base.pipeline_exchange,
            **(
                {kind: (calibration.pipeline_exchange_s, calibration.pipeline_message_s)}
                if calibration.pipeline_exchange_s
                else {}
            ),
        },
        fsdp_unit_overhead={
            **base.fsdp_unit_overhead,
            **(
                {kind: calibration.fsdp_unit_overhead_s} if calibration.fsdp_unit_overhead_s else {}
            ),
        },
        ddp_overhead={
            **base.ddp_overhead,
            **({kind: calibration.ddp_overhead_s} if calibration.ddp_overhead_s else {}),
        },
        gradient_accumulation={
            **base.gradient_accumulation,
            **(
                {kind: calibration.gradient_accumulation_s_per_byte}
                if calibration.gradient_accumulation_s_per_byte
                else {}
            ),
        },
        sync_skew={
            **base.sync_skew,
            **({kind: calibration.sync_skew} if calibration.sync_skew else {}),
        },
        eager_kernels={
            **base.eager_kernels,
            **(
                {
                    kind: KernelCosts(
                        calibration.eager.launch_overhead_s,
                        {k: float(v) for k, v in calibration.eager.kernel_overhead_s.items()},
                        rescaled(calibration.eager.efficiency),
                    )
                }
                if calibration.eager is not None
                else {}
            ),
        },
        collectives={
            **base.collectives,
            kind: {
                **base.collectives.get(kind, {}),
                **{k: (float(a), float(b)) for k, (a, b) in calibration.collectives.items()},
            },
        },
        c10d_collectives={
            **base.c10d_collectives,
            kind: {
                **base.c10d_collectives.get(kind, {}),
                **{k: (float(a), float(b)) for k, (a, b) in calibration.collectives_c10d.items()},
            },
        },
    )


def calibration_from_fit(
    device_kind: str,
    device: dict[str, float],
    fit: dict[str, Any],
    message_cpu: tuple[float, float, float, float] | None,
    source: str,
) -> CostCalibration:
    """The :class:`CostCalibration` of a fit of measured op times
    (:func:`meshplace.profile.calibrate.fit_cost_model`'s report ``fit``: its launch
    overhead; per op kind its compute and memory efficiency, or one ``efficiency`` for
    both, and its fixed cost ``fixed_s`` where fitted) on a device measured at
    ``device``'s ``peak_flops`` and ``memory_bandwidth``.

    >>> fitted = calibration_from_fit("local-cpu", {"peak_flops": 1e11, "memory_bandwidth": 1e10},
    ...     {"launch_overhead_s": 4e-6, "kinds": {"matmul": {"efficiency": 0.5},
    ...      "elementwise": {"compute_efficiency": 0.2, "memory_efficiency": 0.4,
    ...                      "fixed_s": 2e-5}}}, None, "test")
    >>> fitted.efficiency, fitted.kernel_overhead_s
    ({'elementwise': (0.2, 0.4), 'matmul': (0.5, 0.5)}, {'elementwise': 2e-05})
    """
    kinds = sorted(fit.get("kinds", {}).items())
    return CostCalibration(
        device_kind=device_kind,
        peak_flops=float(device["peak_flops"]),
        memory_bandwidth=float(device["memory_bandwidth"]),
        launch_overhead_s=float(fit["launch_overhead_s"]),
        kernel_overhead_s={
            k: float(v["fixed_s"]) for k, v in kinds if v.get("fixed_s") is not None
        },
        efficiency={  # kinds the fit left at the default (launch-bound) stay default
            k: (
                float(v["compute_efficiency"] if "compute_efficiency" in v else v["efficiency"]),
                float(v["memory_efficiency"] if "memory_efficiency" in v else v["efficiency"]),
            )
            for k, v in kinds
            if not v.get("launch_bound")
        },
        message_cpu=message_cpu,
        gradient_accumulation_s_per_byte=float(device.get("gradient_accumulation_s_per_byte", 0.0)),
        source=source,
    )


def with_collectives(
    calibration: CostCalibration,
    measured: dict[str, Any],
    measured_c10d: dict[str, Any] | None = None,
) -> CostCalibration:
    """``calibration`` with the collectives :func:`meshplace.profile.link.
    measure_collectives` measured (its ``fits`` and ``world_size``) as DTensor runs them,
    and in ``measured_c10d`` as the process group's own calls, among as many processes
    (else :class:`InputError`); without it the calibration keeps no such rates (those
    it had were measured beside the DTensor ones replaced here).

    >>> cal = CostCalibration(device_kind="local-cpu", peak_flops=1e11,
    ...                       memory_bandwidth=1e10, launch_overhead_s=4e-6)
    >>> fits = {"all_reduce": {"latency_s": 1e-4, "bandwidth": 1e9}}
    >>> with_collectives(cal, {"fits": fits, "world_size": 2}).collectives
    {'all_reduce': (0.0001, 1000000000.0)}
    """
    ranks = int(measured["world_size"])
    if measured_c10d is not None and int(measured_c10d.get("world_size", ranks)) != ranks:
        raise InputError(
            f"the process group's collectives were measured among "
            f"{measured_c10d['world_size']} processes and DTensor's among {ranks}: "
            "measure both among the same"
        )

    def fitted(fits: dict[str, Any]) -> dict[str, tuple[float, float]]:
        return {k: (float(f["latency_s"]), float(f["bandwidth"])) for k, f in sorted(fits.items())}

    return calibration.model_copy(
        update={
            "collectives": fitted(measured["fits"]),
            "collectives_measured_on": ranks,
            "collectives_c10d": fitted(measured_c10d["fits"]) if measured_c10d else {},
        }
    )
