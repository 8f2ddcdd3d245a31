"""What a pipeline stage pays per micro-batch beyond its graph's kernels: the pipelining
engine, the messages' CPU at both ends, the two ranks' exchange at every cut
(:class:`HostCosts`), and adding each micro-batch's gradients into the held ones
(:class:`GradientAccumulation`).

One piece of the cost model that both pipeline models charge the same way: the hybrid
search's stage model (:mod:`meshplace.parallel.hybrid`) and the simulator's reading of an
op placement as a pipeline (:meth:`meshplace.sim.schedule.PipelineTotals.split`). Every
figure comes from the :class:`~meshplace.cost.compute.CostModel` (``pipeline_overhead``,
``message_cpu``, ``pipeline_exchange`` of a device kind), which a calibration file fills
(:func:`meshplace.cost.calibration.calibrated_cost_model`); a cost model without them
charges nothing, so uncalibrated predictions are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplace.cost.compute import CostModel, DeviceLike

#: the kernel that adds a micro-batch's parameter gradient into the one already held
ACCUMULATE_TARGET = "aten.add_.Tensor"


@dataclass(frozen=True)
class HostCosts:
    """What running a stage costs its host beyond the kernels, per micro-batch: the
    pipelining engine's ``engine_s`` (meshplace's hybrid runtime runs every plan as a
    ``torch.distributed.pipelining`` schedule but a one-stage 1F1B plan, whose
    micro-batches it accumulates on the model itself, so the hybrid search charges that
    one nothing; the cost model's ``pipeline_overhead``), half on the forward and half on
    the backward, and, for devices
    whose messages are staged through the host (the cost model's ``message_cpu``: send s,
    send s/byte, receive s, receive s/byte), each message between stages on its ends'
    compute: a stage's forward receives its activation and sends its output, its backward
    receives the output's gradient and sends its input's. The link's own time stays the
    schedule's wire time, less its latency where a measured exchange holds that
    (:meth:`wire_s`).

    ``exchange`` (the cost model's ``pipeline_exchange``: seconds per beat, seconds per
    further value), measured on two busy ranks
    (:func:`meshplace.runtime.pipeline_exchange.measure_pipeline_exchange`), is what a
    pipeline of more than one stage really pays per micro-batch beyond compute: the engine,
    the messages' fixed costs and the two ranks' meeting at every cut (a gloo send waits
    for the peer's receive). Where it is set, a pipeline's stages are charged it at each of
    their cuts (plus ``per value`` for each value crossing the cut besides the first, each
    a message of its own), half on the forward and half on the backward, instead of the
    engine and the messages' fixed CPU; the messages' per-byte CPU stays
    (:meth:`pipelined`).

    >>> host = HostCosts(2e-3, (1e-4, 0.0, 2e-4, 0.0))
    >>> into, out = host.stage_messages(1e6, True, True)  # (forward, backward) seconds
    >>> [float(x) for x in (*into, *out)]  # input cut: receive, send; output: send, receive
    [0.0002, 0.0001, 0.0001, 0.0002]
    >>> measured = HostCosts(2e-3, (1e-4, 0.0, 2e-4, 0.0), exchange=(5e-4, 4e-4))
    >>> two = measured.pipelined(2)
    >>> two.engine_s, two.message_cpu, round(float(two.cut_s(4)), 6)  # 3 further values
    (0.0, (0.0, 0.0, 0.0, 0.0), 0.0017)
    >>> measured.pipelined(1) == measured  # one stage: no cut, the engine as measured
    True

    ``data_parallel_s``: what a data-parallel engine wrapping the stage (meshplace's
    runtime runs a stage without ZeRO or tensor parallelism on DDP) adds per micro-batch
    (the cost model's ``ddp_overhead``, :meth:`of` with ``ddp=True``), half on the forward
    and half on the backward, with or without an exchange: DDP's hooks run on every stage.

    >>> HostCosts(exchange=(5e-4, 0.0), data_parallel_s=4e-4).pipelined(2).data_parallel_s
    0.0004

    ``sync_skew``: the fraction of a stage's local work that its ranks' meetings cost
    beyond the collectives where a stage spans more than one device (data or tensor
    parallelism: the cost model's ``sync_skew``, :func:`meshplace.profile.link.
    measure_sync_skew`); the hybrid search charges it to such a stage once per step, with
    its gradient synchronisation. It leaves the stage's times alone (:meth:`charge`).
    """

    engine_s: float = 0.0
    message_cpu: tuple[float, float, float, float] | None = None
    exchange: tuple[float, float] | None = None
    data_parallel_s: float = 0.0
    sync_skew: float = 0.0

    @classmethod
    def of(cls, cost_model: CostModel | None, kind: str, ddp: bool = False) -> HostCosts:
        """What ``cost_model`` says a stage on a device of ``kind`` pays (nothing when
        ``cost_model`` is ``None`` or has no figure for the kind); ``ddp``: the stage
        runs on DDP, which adds the cost model's ``ddp_overhead`` per micro-batch.

        >>> HostCosts.of(CostModel(pipeline_exchange={"local-cpu": (5e-4, 4e-4)}), "local-cpu")
        ... # doctest: +NORMALIZE_WHITESPACE
        HostCosts(engine_s=0.0, message_cpu=None, exchange=(0.0005, 0.0004),
                  data_parallel_s=0.0, sync_skew=0.0)
        """
        if cost_model is None:
            return cls()
        return cls(
            cost_model.pipeline_overhead.get(kind, 0.0),
            cost_model.message_cpu.get(kind),
            cost_model.pipeline_exchange.get(kind),
            cost_model.ddp_overhead.get(kind, 0.0) if ddp else 0.0,
            cost_model.sync_skew.get(kind, 0.0),
        )

    @property
    def charges_nothing(self) -> bool:
        """No engine, message, exchange or data-parallel cost: a stage's times stay its
        kernels'."""
        return (
            not self.engine_s
            and self.message_cpu is None
            and self.exchange is None
            and not self.data_parallel_s
        )

    def pipelined(self, stages: int) -> HostCosts:
        """These costs for a pipeline of ``stages`` stages: with a measured exchange and
        more than one stage, the exchange replaces the engine and the messages' fixed CPU
        (their per-byte CPU stays); otherwise unchanged."""
        if self.exchange is None or stages <= 1:
            return self
        cpu = self.message_cpu
        return HostCosts(
            0.0,
            None if cpu is None else (0.0, cpu[1], 0.0, cpu[3]),
            self.exchange,
            self.data_parallel_s,
            self.sync_skew,
        )

    def wire_s(self, transfer_s: Any, latency_s: Any) -> Any:
        """The wire time a micro-batch's message between two stages is charged, given its
        transfer time over the route (latency plus bytes over bandwidth) and the route's
        latency: with a measured exchange the latency is already in it (the probe's
        values crossed the same link, :meth:`cut_s`), so only the bytes' time; otherwise
        the whole transfer.

        >>> measured = HostCosts(exchange=(5e-4, 0.0))
        >>> round(float(measured.wire_s(3e-4, 1e-4)), 9), HostCosts().wire_s(3e-4, 1e-4)
        (0.0002, 0.0003)
        """
        if self.exchange is None:
            return transfer_s
        return np.maximum(np.asarray(transfer_s) - np.asarray(latency_s), 0.0)[()]

    def cut_s(self, values: Any) -> Any:
        """Seconds per micro-batch a stage pays at one of its cuts that ``values`` values
        cross: the measured exchange's beat plus its per-value cost for each value but
        the first; 0 without a measured exchange."""
        if self.exchange is None:
            return 0.0
        beat, per_value = self.exchange
        return beat + per_value * np.maximum(np.asarray(values, dtype=np.float64) - 1.0, 0.0)

    def stage_messages(
        self, nbytes: Any, receives: Any, sends: Any
    ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """``((forward, backward) at the stage's input cut, (forward, backward) at its
        output cut)``: at the input, the activation received and the gradient sent; at the
        output, the activation sent and the gradient received."""
        if self.message_cpu is None:
            return (0.0, 0.0), (0.0, 0.0)
        send_s, send_per_byte, recv_s, recv_per_byte = self.message_cpu
        send = send_s + send_per_byte * np.asarray(nbytes, dtype=np.float64)
        recv = recv_s + recv_per_byte * np.asarray(nbytes, dtype=np.float64)
        into, out = np.asarray(receives, dtype=np.float64), np.asarray(sends, dtype=np.float64)
        return (into * recv, into * send), (out * send, out * recv)

    def charge(
        self,
        model: dict[str, np.ndarray],
        in_bytes: np.ndarray,
        out_bytes: np.ndarray,
        in_values: Any = 1,
        out_values: Any = 1,
    ) -> dict[str, np.ndarray]:
        """``model`` (stage arrays ``[p, ...]``) with these costs on every stage; the
        bytes and values crossing each stage's input and output cut broadcast against
        it."""
        p = model["forward"].shape[0]
        host = self.pipelined(p)
        if host.charges_nothing:
            return model
        shape = (p,) + (1,) * (model["forward"].ndim - 1)
        stage = np.arange(p).reshape(shape)
        into, _ = host.stage_messages(in_bytes, stage > 0, stage > 0)
        _, out = host.stage_messages(out_bytes, stage < p - 1, stage < p - 1)
        cuts = (stage > 0) * host.cut_s(in_values) + (stage < p - 1) * host.cut_s(out_values)
        each = (host.engine_s + host.data_parallel_s + cuts) / 2
        return {
            **model,
            "forward": model["forward"] + each + into[0] + out[0],
            "backward": model["backward"] + each + into[1] + out[1],
        }


@dataclass(frozen=True)
class GradientAccumulation:
    """What adding one micro-batch's parameter gradients into those a device already holds
    costs it: per gradient tensor one in-place add (``grad += new``, autograd's
    ``AccumulateGrad``) that reads both and writes one, ``3 x bytes`` over the device's
    memory bandwidth at the elementwise memory efficiency plus the kernel's fixed cost.

    Source: the semantics of micro-batching in PyTorch (``torch.autograd`` accumulates
    into ``.grad``; ``torch.distributed.pipelining``'s stages and DDP's ``no_sync`` leave it
    so), which GPipe's bubble model (Huang et al., NeurIPS 2019, Sec. 2.2) leaves out: a
    training step of ``m`` micro-batches makes ``m - 1`` such passes over every stage's
    gradients (the first micro-batch's gradient becomes ``.grad`` without a copy). The
    captured graph of one micro-batch has no such op. Measured on this host (docs/
    runtime.md): 0.36 ms per pass over the 4.2 MB of four 512-wide layers, 2.8 ms over
    16.8 MB, about 6 % of a deep MLP stage's step at 8 micro-batches. On a GPU it is what
    Megatron-LM fuses into its weight-gradient kernels (gradient accumulation fusion).

    :meth:`per_micro_batch` spreads the ``m - 1`` passes over the ``m`` backwards, as
    the stage models charge a stage per micro-batch. O(1) per stage.

    >>> from meshplace.hardware import device_spec
    >>> cm = CostModel(efficiency={"elementwise": (1.0, 0.5)}, launch_overhead={"cpu": 1e-5})
    >>> spec = device_spec("cpu")
    >>> acc = GradientAccumulation.of(cm, "cpu", spec)
    >>> nbytes = spec.memory_bandwidth / 6  # 3 x bytes at half the bandwidth: 1 s
    >>> round(float(acc.seconds(nbytes, 2)), 6), round(float(acc.per_micro_batch(nbytes, 2, 4)), 6)
    (1.00002, 0.750015)
    >>> float(acc.per_micro_batch(nbytes, 2, 1))  # one micro-batch: nothing to add
    0.0
    """

    per_byte_s: float = 0.0
    per_tensor_s: float = 0.0

    @classmethod
    def of(
        cls, cost_model: CostModel | None, kind: str, spec: DeviceLike, dispatched: bool = True
    ) -> GradientAccumulation:
        """The accumulation on a ``kind`` device of ``spec`` under ``cost_model`` (the
        catalogue's efficiencies when ``None``): per byte, the measured rate where the
        cost model has one (``gradient_accumulation``, a calibration's), else the
        elementwise roofline; per tensor, the add kernel's fixed cost, with the engine's
        dispatch unless ``dispatched`` is false (an add on a DTensor gradient is
        dispatched like the graph's ops; a stage of plain tensors pays none).

        >>> measured = CostModel(gradient_accumulation={"cpu": 1e-10})
        >>> from meshplace.hardware import device_spec
        >>> GradientAccumulation.of(measured, "cpu", device_spec("cpu")).per_byte_s
        1e-10
        """
        model = cost_model or CostModel()
        per_byte = model.gradient_accumulation.get(kind, 0.0)
        if per_byte <= 0:
            memory_efficiency = model.efficiency_on(kind, "elementwise", ACCUMULATE_TARGET)[1]
            per_byte = 3.0 / (spec.memory_bandwidth * memory_efficiency)
        launch = model.kernel_launch if dispatched else model.kernel_fixed
        return cls(per_byte, launch(kind, spec, "elementwise", ACCUMULATE_TARGET))

    def seconds(self, gradient_bytes: Any, tensors: Any) -> Any:
        """One pass: adding ``gradient_bytes`` of new gradients in ``tensors`` tensors."""
        return self.per_byte_s * np.asarray(gradient_bytes, dtype=np.float64) + (
            self.per_tensor_s * np.asarray(tensors, dtype=np.float64)
        )

    def per_micro_batch(self, gradient_bytes: Any, tensors: Any, micro_batches: int) -> Any:
        """A step's ``micro_batches - 1`` passes spread over its ``micro_batches``
        backwards."""
        return self.spread(self.seconds(gradient_bytes, tensors), micro_batches)

    @staticmethod
    def spread(one_pass_s: Any, micro_batches: int) -> Any:
        """``micro_batches - 1`` passes of ``one_pass_s`` seconds each spread over the
        step's ``micro_batches`` backwards: per backward, ``one_pass_s (m - 1) / m``."""
        m = max(int(micro_batches), 1)
        return one_pass_s * ((m - 1) / m)

    def charge(self, model: dict[str, np.ndarray], micro_batches: int) -> dict[str, np.ndarray]:
        """``model`` (a stage model's arrays, with the gradient bytes each device holds,
        ``held_gradients``, and its ``tensors``) with each backward charged
        :meth:`per_micro_batch`; unchanged for one micro-batch."""
        if micro_batches <= 1 or (not self.per_byte_s and not self.per_tensor_s):
            return model
        added = self.per_micro_batch(model["held_gradients"], model["tensors"], micro_batches)
        return {**model, "backward": model["backward"] + added}
