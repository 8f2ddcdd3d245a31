"""What a beat of a pipeline costs two busy ranks beyond their stages' compute.

Source: the 1F1B schedule of Narayanan et al., "PipeDream" (SOSP 2019), as
``torch.distributed.pipelining.Schedule1F1B`` runs it, on the gloo transport.

Why it is measured, not derived: in the steady state of ``Schedule1F1B`` each rank
posts a micro-batch's sends together with its next receives and waits for all of them
(``_wait_batch_p2p(_batch_p2p(sends + recvs))``), and a gloo send completes only once the
peer has posted the matching receive (a send waited on before the receiver posts takes as
long as the receiver is late: 100 ms for a receive posted 100 ms later, on this host). So
two pipeline ranks meet once per micro-batch, and each meeting costs the round trip of
waking the other rank's transport thread, which on a host whose cores the ranks' compute
threads fill waits for a core (docs/runtime.md: a median of 60-80 us, a mean of 0.4-0.5 ms
per blocked receive on 2 cores). Neither the link's latency nor the messages' CPU nor the
engine measured on a world of one (:func:`meshplace.runtime.pipelined.measure_engine_overhead`)
contains it; a step of a 2-stage pipeline at 8 micro-batches of the Llama example spent
0.8 ms per micro-batch in such waits and 0.3 ms posting its sends (instrumented run,
session 35).

:func:`measure_pipeline_exchange` measures it on a fixed probe (not the model being
predicted): an MLP of eight 256-wide ``Linear`` + ``tanh`` layers cut into two stages of
four, one activation crossing forward and one gradient back per micro-batch, run by
``Schedule1F1B`` on two gloo processes (one thread each), interleaved with the same two
stages' forward and backward run eagerly on the same micro-batches at the same time (so
that both see the same contention). Per beat, the schedule's step over ``M + 1`` beats
less the slower stage's eager micro-batch. The result (the calibration file's
``pipeline_exchange_s``) contains the engine's own bookkeeping and one value each way;
the cost model charges it once per micro-batch at each cut of every stage of a pipeline
of more than one stage, in place of the world-of-one engine cost and the messages' fixed
CPU. A second probe, the same with ``EXTRA`` more values crossing the cut (each a message
of its own: torch's pipelining sends every value separately), gives what each further
value costs (``pipeline_message_s``). What one probe cannot see: the exchange grew with
the stages' width (0.55 ms a beat at 256 wide, 1.0 ms at 512, rows per micro-batch
changing nothing; docs/runtime.md).

Example::

    >>> from meshplace.runtime.pipeline_exchange import measure_pipeline_exchange
    >>> measured = measure_pipeline_exchange(micro_batches=2, reps=1)  # doctest: +SKIP
    >>> measured.beat_s, measured.message_s  # doctest: +SKIP
    (0.00051, 0.00033)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError

#: The probe: WIDTH-wide layers, LAYERS of them (half per stage), ROWS rows per micro-batch,
#: and the second probe's EXTRA values crossing the cut besides the activation.
WIDTH, LAYERS, ROWS, EXTRA = 256, 8, 32, 4


@dataclass(frozen=True)
class PipelineExchange:
    """What :func:`measure_pipeline_exchange` measured, seconds per micro-batch (beat).

    Attributes:
        beat_s: a beat's cost beyond the slower stage's compute, with one value crossing
            the cut each way (the engine's bookkeeping, the two messages, the ranks'
            meeting); the calibration file's ``pipeline_exchange_s``.
        message_s: each further value crossing the cut (a message of its own: torch's
            pipelining sends every value separately); ``pipeline_message_s``.
    """

    beat_s: float
    message_s: float


class ExchangeProbe(torch.nn.Module):
    """The probe model: ``LAYERS`` ``Linear`` + ``tanh`` layers and a mean-square loss;
    with ``extra`` values (copies of the first stage's activations, without gradients)
    that the second stage reads, so that they cross the cut."""

    def __init__(self, extra: int = 0, width: int = WIDTH) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(LAYERS))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The loss of input ``x`` (rows, WIDTH), as a 1-element tensor."""
        side = []
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i < LAYERS // 2 and len(side) < self.extra:
                side.append(x.detach() * 1.0)
        loss = x.pow(2).mean()
        for value in side:  # read after the cut, adding nothing
            loss = loss + value.mean() * 0.0
        return loss.reshape(1)


def _probe_rank(
    rank: int, folder: str, micro_batches: int, reps: int, rows: int, width: int, out: Any
) -> None:
    """One of :func:`measure_pipeline_exchange`'s two processes: its medians of the
    pipelined step (one value crossing, and ``EXTRA`` more) and of its stage's eager
    forward and backward over the micro-batches."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from meshplace.runtime.pipelined import run_stage_compiled

    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        batch = torch.randn(rows * micro_batches, width)
        chunks = batch.chunk(micro_batches)
        target = torch.zeros(micro_batches)
        runs = []
        for extra in (0, EXTRA):
            torch.manual_seed(0)
            model = ExchangeProbe(extra, width)
            pipe = pipeline(
                model,
                mb_args=(chunks[0],),
                split_spec={f"layers.{LAYERS // 2}": SplitPoint.BEGINNING},
            )
            stage = pipe.build_stage(rank, torch.device("cpu"))
            run_stage_compiled(stage.submod)
            schedule = Schedule1F1B(
                stage, n_microbatches=micro_batches, loss_fn=lambda out, _target: out.sum()
            )
            runs.append((stage, schedule))
        plain = runs[0][0].submod  # the one-value probe's stage
        # the eager reference: this rank's stage on what it receives in the pipeline (both
        # probes' layers are the same, built from the same seed)
        first_half = model.layers[: LAYERS // 2]
        with torch.no_grad():
            received = [c if rank == 0 else _through(first_half, c) for c in chunks]

        def piped(which: int) -> None:
            stage, schedule = runs[which]
            if rank == 0:
                schedule.step(batch)
            else:
                schedule.step(target=target, losses=[])
            stage.submod.zero_grad(set_to_none=True)

        def eager() -> None:
            for x in received:
                y = plain(x.detach().requires_grad_(rank == 1))
                if rank == 1:
                    (y.sum() / micro_batches).backward()
                else:
                    y.backward(torch.ones_like(y))
            plain.zero_grad(set_to_none=True)

        timed: dict[str, list[float]] = {"one": [], "extra": [], "eager": []}
        for i in range(reps + 2):  # interleaved, the first two rounds untimed
            for name, run in (
                ("one", lambda: piped(0)),
                ("eager", eager),
                ("extra", lambda: piped(1)),
            ):
                dist.barrier()
                start = time.perf_counter()
                run()
                if i >= 2:
                    timed[name].append(time.perf_counter() - start)
        out.put((rank, {name: statistics.median(t) for name, t in timed.items()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _through(layers: Any, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = torch.tanh(layer(x))
    return x


def measure_pipeline_exchange(
    micro_batches: int = 8,
    reps: int = 20,
    *,
    rows: int = ROWS,
    width: int = WIDTH,
    probes: int = 3,
) -> PipelineExchange:
    """What a beat of a 2-stage ``Schedule1F1B`` pipeline on two gloo processes of this
    host costs beyond its slower stage's forward and backward of one micro-batch (module
    docstring): ``beat_s = step / (M + 1) - max(stage eager) / M`` with one value crossing
    the cut, and ``message_s``, what each of ``EXTRA`` further values adds per beat;
    medians over ``reps / probes`` (rounded up) interleaved rounds of each of ``probes``
    pairs of processes, one after the other, never below 0; each of ``beat_s`` and
    ``message_s`` the median over the pairs. Why several pairs: one pair's rounds last
    about a second, and a slow spell of a shared host over all of them had a beat at
    5.41 ms against 0.78 ms before and after (the Llama's pipelines predicted 95 % slow in
    ``benchmarks/fidelity.py --family pipelined``, session 48). About 4 s a pair plus
    ``reps x 3`` probe steps of ~15 ms in all.

    >>> measure_pipeline_exchange(micro_batches=0)
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: a pipeline needs 1 micro-batch or more, not 0
    """
    if micro_batches < 1:
        raise InputError(f"a pipeline needs 1 micro-batch or more, not {micro_batches}")
    if reps < 1:
        raise InputError(f"the probe needs 1 repetition or more, not {reps}")
    if probes < 1:
        raise InputError(f"the exchange needs 1 probe or more, not {probes}")
    per_probe = -(-reps // probes)
    measured = [_probe_once(micro_batches, per_probe, rows, width) for _ in range(probes)]
    return PipelineExchange(
        beat_s=float(statistics.median(m.beat_s for m in measured)),
        message_s=float(statistics.median(m.message_s for m in measured)),
    )


def _probe_once(micro_batches: int, reps: int, rows: int, width: int) -> PipelineExchange:
    """One pair of :func:`_probe_rank` processes: the beat and the further values' cost
    from their medians over ``reps`` rounds."""
    import queue

    import torch.multiprocessing as mp

    from meshplace.runtime.processes import safe_start_method

    # fork, as the link and message probes start theirs (seconds less than spawn's fresh
    # interpreters importing torch again), unless CUDA is initialised here
    ctx = mp.get_context(safe_start_method())
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="meshplace-exchange-") as folder:
        procs = [
            ctx.Process(target=_probe_rank, args=(r, folder, micro_batches, reps, rows, width, out))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        results: list[dict[str, float]] = []
        try:
            while len(results) < len(procs):
                try:
                    results.append(out.get(timeout=1.0)[1])
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(
                            f"the pipeline exchange probe's process exited with {dead[0]}"
                        ) from None
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    beats = micro_batches + 1
    one, extra = (max(r[k] for r in results) for k in ("one", "extra"))
    slowest = max(r["eager"] for r in results)
    return PipelineExchange(
        beat_s=max(0.0, one / beats - slowest / micro_batches),
        message_s=max(0.0, (extra - one) / (beats * EXTRA)),
    )
