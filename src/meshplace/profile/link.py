"""Measure the local inter-worker link: gloo ping-pong, and what a message costs the CPUs.

* :func:`measure_link` — a message of ``n`` bytes takes ``latency + n / bandwidth`` (the
  Hockney model, as the cluster's links assume); both are fitted by least squares to the
  median one-way time (half a round trip) of a few sizes. Cost: two processes,
  ~1-2 s.
* :func:`measure_message_cost` — on a host without a DMA engine between workers (CPU
  processes over loopback TCP) a message is not free for the two ends: the sender's
  ``isend`` runs the kernel's TCP path (on loopback, the receive side's too), and gloo's
  event-loop threads take CPU from the compute threads on a small host. Both workers run
  the runtime's pattern with the runtime's own message code
  (:func:`meshplace.runtime.executor.send_value`, ``post_receive``, ``finish_receive``) —
  a loop of small kernels, one message sent per iteration on one side, receives posted up
  front and finished a few iterations later on the other — and each end's wall-clock
  slowdown per iteration
  over the same loop without messages is what a message costs that end, fitted as
  ``a + b · bytes`` per end. Cost: two processes, ~1 s.

>>> bw, lat = fit_link([(0, 1e-5), (1e6, 1e-5 + 1e-3)])
>>> round(bw / 1e9, 6), round(lat * 1e6, 6)
(1.0, 10.0)
"""

from __future__ import annotations

import os
import queue
import shutil
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from meshplace.errors import InputError
from meshplace.runtime.processes import safe_start_method

SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)


def fit_link(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` from ``(bytes, seconds)`` samples: least squares of
    the *relative* error (rows weighted by 1/time), so small messages fix the latency and
    large ones the bandwidth."""
    x = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    a = np.vstack([np.ones_like(x), x]).T * w[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    inv_bw = max(float(inv_bw), 1e-12)
    return 1.0 / inv_bw, max(float(lat), 0.0)


def _join_pair(rank: int, store_path: str, world_size: int = 2, yield_threads: bool = True) -> None:
    """Join the gloo group of a link micro-benchmark (two processes unless told), one
    thread per process (as the runtime's workers run); ``yield_threads``: the transport
    threads get the runtime workers' scheduling policy (torchrun's ranks leave them)."""
    import datetime

    import torch.distributed as dist

    from meshplace.runtime.executor import thread_ids, yield_transport_threads

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    before = thread_ids()
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    transport = thread_ids() - before  # the group's threads

    # both have joined once past a barrier; the store is not read again, so its folder
    # goes now (not even a SIGKILL of the driver then leaves it behind)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
    # The same transport-thread priority as the runtime's workers: what is measured here
    # is their regime.
    if yield_threads:
        yield_transport_threads(threads=transport)


def _pingpong(rank: int, store_path: str, sizes: Sequence[int], reps: int, out: Any) -> None:
    import torch.distributed as dist

    _join_pair(rank, store_path)
    res = []
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)
        buf2 = torch.zeros_like(buf)
        times = []
        for r in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            # isend + blocking recv, as the runtime's workers do
            if rank == 0:
                w = dist.isend(buf, 1, tag=r)
                dist.recv(buf2, 1, tag=r)
            else:
                dist.recv(buf2, 0, tag=r)
                w = dist.isend(buf, 0, tag=r)
            w.wait()
            if r >= 2:
                times.append((time.perf_counter() - t0) / 2)
        res.append((float(n), statistics.median(times)))
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _pair_main(parent_pid: int, target: Any, rank: int, *args: Any) -> None:
    """A link micro-benchmark process: dies with the process that started it
    (:func:`~meshplace.runtime.processes.die_with_parent`), then runs ``target``."""
    from meshplace.runtime.processes import die_with_parent

    die_with_parent(parent_pid, f"meshplace-link{rank}")
    target(rank, *args)


def _run_pair(
    target: Any,
    args: tuple,
    results: int,
    timeout: float,
    start_method: str,
    world_size: int = 2,
) -> list[Any]:
    """Run ``target(rank, store_path, *args, out)`` in ``world_size`` processes (ranks 0
    and 1 unless told, a fresh FileStore in a private temporary folder) and return the
    first ``results`` items they put on ``out``. The processes die with this one, are
    killed on the way out, and the folder is removed, whatever happens. Raises
    :class:`~meshplace.runtime.processes.WorkerFailure` (one sentence) if a process exits
    early or the results take longer than ``timeout`` seconds."""
    from meshplace.runtime.executor import transport_policy
    from meshplace.runtime.processes import (
        WorkerFailure,
        private_temp_folder,
        stop_processes,
    )

    transport_policy()  # a bad MESHPLACE_TRANSPORT: one sentence here, not in the children
    what = getattr(target, "__name__", "link").strip("_")
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    with private_temp_folder("meshplace-link-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_pair_main, args=(os.getpid(), target, r, path, *args, out), daemon=True
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            got: list[Any] = []
            deadline = time.monotonic() + timeout
            while len(got) < results:
                try:
                    got.append(out.get(timeout=0.1))
                    continue
                except queue.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerFailure(
                        f"the {what} measurement's process {dead[0]} exited with code "
                        f"{procs[dead[0]].exitcode} before reporting",
                        worker=dead[0],
                        cause="exited",
                    )
                if time.monotonic() > deadline:
                    raise WorkerFailure(
                        f"the {what} measurement did not finish within {timeout:g} s",
                        cause="hung",
                    )
            for p in procs:
                p.join(10)
        finally:
            stop_processes(procs, grace_s=0.0)
            out.close()
    return got


def measure_link(
    sizes: Sequence[int] = SIZES,
    reps: int = 20,
    timeout: float = 60.0,
    start_method: str | None = None,
) -> dict[str, Any]:
    """Ping-pong between two gloo worker processes; returns ``bandwidth``, ``latency`` and
    the ``samples``. ``start_method`` defaults to :func:`safe_start_method`. Raises
    ``RuntimeError`` if the workers do not finish within ``timeout``."""
    (samples,) = _run_pair(
        _pingpong, (list(sizes), reps), 1, timeout, start_method or safe_start_method()
    )
    bw, lat = fit_link(samples)
    return {"bandwidth": bw, "latency": lat, "samples": samples}


# ------------------------------------------------------------------ message CPU cost
MESSAGE_SIZES = (4, 65536, 1 << 20)


def fit_affine(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` with ``y ≈ a + b·x``, least squares on the relative error (weights
    ``1/max(y, tiny)``), both clipped at 0 (a cost is never negative).

    >>> a, b = fit_affine([(0, 2e-5), (1e6, 2e-5 + 1e-3)])
    >>> round(a * 1e6, 6), round(b * 1e9, 6)
    (20.0, 1.0)
    """
    x = np.array([s[0] for s in samples], dtype=float)
    y = np.array([max(s[1], 0.0) for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-7)
    m = np.vstack([np.ones_like(x), x]).T * w[:, None]
    (a, b), *_ = np.linalg.lstsq(m, y * w, rcond=None)
    if b < 0:  # no per-byte cost: the mean of the fixed cost alone
        return max(float(np.median(y)), 0.0), 0.0
    if a < 0:  # no fixed cost: the slope through the origin
        return 0.0, max(float(np.median(y[x > 0] / x[x > 0])) if (x > 0).any() else 0.0, 0.0)
    return float(a), float(b)


def _spin(x: torch.Tensor, y: torch.Tensor, kernels: int) -> None:
    for _ in range(kernels):
        torch.add(x, y)


def _message_worker(
    rank: int,
    store_path: str,
    sizes: Sequence[int],
    iters: int,
    kernels: int,
    rounds: int,
    out: Any,
) -> None:
    import torch.distributed as dist

    from meshplace.runtime.executor import finish_receive, post_receive, send_value

    _join_pair(rank, store_path)
    x, y = torch.ones(64), torch.ones(64)
    lag = 4  # the receiver finishes message i - lag in iteration i: normally arrived by then
    res: dict[int, list[tuple[float, float]]] = {}
    for n in sizes:
        # iterations long enough for the wire (~1 GB/s assumed at worst), so the receiver
        # rarely waits; the baseline loop of this size is the same without messages
        spin = kernels * max(1, -(-n // 65536))
        example = torch.zeros(max(1, n // 4))
        res[n], res[-n - 1] = [], []
        for rep in range(rounds + 1):  # the first round warms up
            for with_messages in (False, True):  # paired: host drift cancels
                key = n if with_messages else -n - 1
                dist.barrier()
                keep: list[torch.Tensor] = []
                pending: list[Any] = []
                c0 = time.process_time()  # every thread of this process (gloo's too)
                t0 = time.perf_counter()
                posted = []
                if with_messages and rank == 1:  # posted up front, as the workers do
                    posted = [post_receive(example, 0, i * 16) for i in range(iters)]
                for i in range(iters):
                    _spin(x, y, spin)
                    if with_messages and rank == 0:
                        send_value(example, 1, i * 16, keep, pending)
                    elif with_messages and i >= lag:
                        finish_receive(example, posted[i - lag])
                wall = time.perf_counter() - t0
                if with_messages and rank == 1:
                    for i in range(max(0, iters - lag), iters):
                        finish_receive(example, posted[i])
                for w in pending:
                    w.wait()
                cpu = time.process_time() - c0
                if rep:
                    res[key].append((wall / iters, cpu / iters))
    out.put((rank, res))
    dist.barrier()
    dist.destroy_process_group()


def measure_message_cost(
    sizes: Sequence[int] = MESSAGE_SIZES,
    iters: int = 100,
    kernels: int = 40,
    rounds: int = 5,
    timeout: float = 60.0,
    start_method: str | None = None,
) -> dict[str, Any]:
    """What a message costs the compute of its sender and its receiver on this host, in
    the runtime's pattern (module doc): ``send_s`` + ``send_s_per_byte`` · bytes and
    ``recv_s`` + ``recv_s_per_byte`` · bytes. Each size's cost is the mean wall time per
    loop iteration with a message minus that without (median over ``rounds``): the time
    the end's compute thread loses — the ``isend`` call, CPU taken by gloo's event-loop
    thread and the kernel's TCP path, waits for gloo's per-peer lock while that thread
    holds it, hand-offs between threads on shared cores — in the regime the workers run
    in (two busy single-threaded processes), through the executor's own send and receive
    code. Waiting for the wire is excluded as far as possible (each receive is finished
    ``lag`` iterations after its send, and iterations are long enough for the message's
    bytes; the link's latency and bandwidth model the wire).
    Rounds with and without messages alternate, so slow drifts of the host cancel.
    ``spacing_s`` is the loop's mean wall time per iteration with messages (the time from
    one message to the next at each end; :func:`measure_message_spacing`).
    ``samples`` holds ``(bytes, send_s, recv_s)`` per size and ``cpu_samples`` the same in
    process CPU time (every thread), which is lower where the loss is waiting rather than
    work; on a host loaded by other jobs the wall cost also holds the scheduler slices the
    worker loses, so calibrate on an otherwise idle host.
    ``start_method`` defaults to :func:`safe_start_method`. Raises ``RuntimeError`` if the
    workers do not finish in ``timeout``.
    """
    got = dict(
        _run_pair(
            _message_worker,
            (list(sizes), iters, kernels, rounds),
            2,
            timeout,
            start_method or safe_start_method(),
        )
    )

    def per_size(col: int) -> list[tuple[float, float, float]]:
        rows = []
        for n in sizes:
            cost = [
                statistics.median(v[col] for v in got[r][n])
                - statistics.median(v[col] for v in got[r][-n - 1])
                for r in range(2)
            ]
            rows.append((float(n), max(cost[0], 0.0), max(cost[1], 0.0)))
        return rows

    samples, cpu_samples = per_size(0), per_size(1)
    send = fit_affine([(n, s) for n, s, _ in samples])
    recv = fit_affine([(n, r) for n, _, r in samples])
    spacing = statistics.mean(
        statistics.median(v[0] for v in got[r][n]) for r in range(2) for n in sizes
    )
    return {
        "send_s": send[0],
        "send_s_per_byte": send[1],
        "recv_s": recv[0],
        "recv_s_per_byte": recv[1],
        "samples": samples,
        "cpu_samples": cpu_samples,
        "spacing_s": spacing,
    }


# ------------------------------------------------------------------ in the model's own step
def _step_message_worker(
    rank: int,
    store_path: str,
    step: Any,
    sizes: Sequence[int],
    messages: int,
    rounds: int,
    out: Any,
) -> None:
    import torch.distributed as dist

    from meshplace.runtime.executor import finish_receive, post_receive, send_value
    from meshplace.runtime.program import StepInterpreter

    _join_pair(rank, store_path)
    params, bufs, states, inputs = step.initial_state()
    values = [*params, *bufs, *states, *inputs]
    interp = StepInterpreter(step.gm)
    # the k-th computed node's position: the hook runs after it, as ``hook(k)``
    computed_at = [i for i, n in enumerate(interp.nodes) if n.op == "call_function"]
    computed = len(computed_at)
    current: list[Any] = [None]  # this round's hook
    after = {i: (lambda i, env, k=k: current[0](k)) for k, i in enumerate(computed_at)}
    every = max(1, computed // messages)
    res: dict[int, list[float]] = {}
    for n in sizes:
        example = torch.zeros(max(1, n // 4))
        res[n], res[-n - 1] = [], []
        for rep in range(rounds + 1):  # the first round warms up
            for with_messages in (False, True):  # paired: host drift cancels
                key = n if with_messages else -n - 1
                dist.barrier()
                keep: list[torch.Tensor] = []
                pending: list[Any] = []
                c0 = time.process_time()  # every thread of this process (gloo's too)
                count = computed // every if with_messages else 0
                posted = [post_receive(example, 0, i * 16) for i in range(count)] if rank else []

                done: set[int] = set()

                def hook(
                    k: int,
                    count=count,
                    posted=posted,
                    keep=keep,
                    pending=pending,
                    x=example,
                    done=done,
                ) -> None:
                    if not count or k % every:
                        return
                    i = k // every  # send message i; finish message i - 1 (sent a while ago)
                    if rank == 0 and i < count:
                        send_value(x, 1, i * 16, keep, pending)
                    elif rank == 1 and 0 < i <= count:
                        finish_receive(x, posted[i - 1])
                        done.add(i - 1)

                current[0] = hook
                interp.walk(values, after=after)
                for i in range(count if rank == 1 else 0):
                    if i not in done:  # a gloo work is waited for once only
                        finish_receive(example, posted[i])
                for w in pending:
                    w.wait()
                cpu = time.process_time() - c0
                if rep:
                    res[key].append(cpu / max(count, 1))
    out.put((rank, res, computed // every))
    dist.barrier()
    dist.destroy_process_group()


def measure_message_cost_in_step(
    step: Any,
    sizes: Sequence[int] = (4, 65536, 1 << 18),
    messages: int = 40,
    rounds: int = 5,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """What a message costs each worker *inside the model's own training step*: two forked
    processes each run ``step`` on one thread, node by node as a worker does; one sends
    about ``messages`` messages spread evenly over its nodes, through the executor's own
    code (``send_value``), and the other has posted the receives up front and finishes each
    one message-interval after its send position (``finish_receive``). Each end's extra
    process CPU time per message over the same step without messages (median of
    ``rounds``) is its cost, fitted as ``a + b · bytes`` — the same result keys as
    :func:`measure_message_cost`. Unlike that isolated loop it sees what a message does to
    the model's own kernels (caches, the event-loop thread between them); CPU time, so
    waiting for the wire is not counted. Uses fork (the step is shared, not re-traced).
    Cost: ``2 · (rounds + 1) · len(sizes)`` training steps in each process."""
    pairs = _run_pair(
        _step_message_worker, (step, list(sizes), messages, rounds), 2, timeout, "fork"
    )
    got = {rank: res for rank, res, _ in pairs}
    count = pairs[-1][2]
    rows = []
    for n in sizes:
        cost = [
            statistics.median(got[r][n]) - statistics.median(got[r][-n - 1]) / max(count, 1)
            for r in range(2)
        ]
        rows.append((float(n), max(cost[0], 0.0), max(cost[1], 0.0)))
    send = fit_affine([(n, s) for n, s, _ in rows])
    recv = fit_affine([(n, r) for n, _, r in rows])
    return {
        "send_s": send[0],
        "send_s_per_byte": send[1],
        "recv_s": recv[0],
        "recv_s_per_byte": recv[1],
        "samples": rows,
        "messages_per_step": count,
    }


# ------------------------------------------------------------------ cost against spacing
SPACING_KERNELS = (0, 3, 10, 30, 100, 300)


def measure_message_spacing(
    kernels: Sequence[int] = SPACING_KERNELS,
    size: int = 4,
    iters: int = 60,
    rounds: int = 9,
    timeout: float = 60.0,
    start_method: str | None = None,
) -> dict[str, Any]:
    """What a message costs its sender and its receiver as a function of its *spacing*,
    the wall time since the same worker's previous message: :func:`measure_message_cost`'s
    loop (the executor's own send and receive code, two busy single-threaded processes)
    with ``k`` one-element kernels between messages for each ``k`` in ``kernels`` — 0 is a
    back-to-back burst. Each row is ``(spacing_s, send_s, recv_s)``: the spacing is the
    loop's wall time per iteration with messages (mean of both ends), the costs the
    ``size``-byte message's extra wall time per iteration at each end, as in
    :func:`measure_message_cost`. Rows are sorted by spacing. On this testbed a message in
    a burst costs its ends less than an isolated one (gloo's event-loop thread and the
    kernel's TCP path are woken once for many messages; docs/runtime.md).
    Cost: ``len(kernels)`` runs of that loop (~0.5-2 s each)."""
    if not kernels or any(int(k) < 0 for k in kernels):
        raise InputError("kernels must be a non-empty list of counts >= 0.")
    rows = []
    for k in kernels:
        m = measure_message_cost(
            sizes=(size,),
            iters=iters,
            kernels=int(k),
            rounds=rounds,
            timeout=timeout,
            start_method=start_method,
        )
        _, send, recv = m["samples"][0]
        rows.append((float(m["spacing_s"]), float(send), float(recv)))
    rows.sort()
    return {"rows": rows, "kernels": [int(k) for k in kernels], "size": int(size)}


# ------------------------------------------------------------------ collectives
#: bytes per device the collectives are timed at: up to 16 MiB, the range of the messages
#: plans send (a model's gradients in one bucket of DDP's 25 MB, ZeRO's gathers); a fit on
#: at most 4 MiB put an 8 MiB all-reduce of two gloo ranks at 9.7 ms, measured 14.9
COLLECTIVE_SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)
MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def ring_terms(kind: str, p: int) -> tuple[float, float]:
    """``(steps, byte factor)`` of the ring formula for ``kind`` over ``p`` devices
    (:func:`meshplace.cost.collectives.collective_time`): its time is
    ``steps · α + factor · n / B`` for ``n`` bytes per device.

    >>> ring_terms("all_reduce", 4)
    (6.0, 1.5)
    """
    steps = float(p - 1)
    factor = (p - 1) / p
    if kind == "all_reduce":
        return 2 * steps, 2 * factor
    return steps, factor


def fit_collective(
    kind: str, p: int, samples: Sequence[tuple[float, float]]
) -> tuple[float, float]:
    """``(latency α s, bandwidth B bytes/s)`` of the ring formula for ``kind`` over ``p``
    devices that best fits ``(bytes per device, seconds)`` samples (relative least squares,
    :func:`fit_link` on the samples divided by the formula's step count).

    >>> lat, bw = fit_collective("all_reduce", 2, [(0, 2e-5), (1e6, 2e-5 + 1e-3)])
    >>> round(lat * 1e6, 6), round(bw / 1e9, 6)
    (10.0, 1.0)
    """
    steps, factor = ring_terms(kind, p)
    bw, lat = fit_link([(n * factor / steps, t / steps) for n, t in samples])
    return lat, bw


COLLECTIVE_ENGINES = ("dtensor", "c10d")


def _redistribution(
    kind: str, full: torch.Tensor, block: torch.Tensor, mesh: Any
) -> tuple[Any, list[Any]]:
    """A DTensor and the placements whose redistribution runs one ``kind`` collective at
    ``full``'s bytes per device on a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if kind == "all_reduce":  # a partial sum made whole
        have, local, want = Partial(), full, Replicate()
    elif kind == "all_gather":  # blocks made whole
        have, local, want = Shard(0), block, Replicate()
    elif kind == "reduce_scatter":  # a partial sum made blocks
        have, local, want = Partial(), full, Shard(0)
    else:  # blocks of rows re-split into blocks of columns
        p = mesh.size()
        have, local, want = Shard(0), full.view(p, -1), Shard(1)
    return DTensor.from_local(local, mesh, [have], run_check=False), [want]


def _one_collective(
    kind: str, full: torch.Tensor, block: torch.Tensor, gathered: torch.Tensor
) -> None:
    """One ``kind`` collective at ``full``'s bytes per device (``block``: its share of
    the group; ``gathered``: the whole group's ``full``) as c10d runs it."""
    import torch.distributed as dist

    if kind == "all_reduce":  # n bytes in, n bytes out
        dist.all_reduce(full)
    elif kind == "all_gather":  # n bytes out: the blocks of n / p
        dist.all_gather_single(full, block)
    elif kind == "reduce_scatter":  # n bytes in
        dist.reduce_scatter_single(block, full)
    else:
        # n bytes per device re-split over the group. gloo has no all-to-all: DTensor runs
        # it as an all-gather of the whole local block and keeps its slice ("falling back
        # with allgather + chunk"), so that is what is timed.
        dist.all_gather_single(gathered, full)


def _collective_worker(
    rank: int,
    store_path: str,
    world_size: int,
    sizes: Sequence[int],
    reps: int,
    engines: Sequence[str],
    out: Any,
) -> None:
    import torch.distributed as dist

    # torchrun's ranks leave gloo's threads at their priority: measure that regime
    _join_pair(rank, store_path, world_size, yield_threads=False)
    p = world_size
    mesh = None
    if "dtensor" in engines:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (p,))
    by_engine: dict[str, dict[str, list[tuple[float, list[float]]]]] = {}
    for engine in engines:
        res: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in MEASURED_COLLECTIVES}
        on_mesh = engine == "dtensor"
        for n in sizes:
            elems = max(p, (n // 4) // p * p)  # float32, divisible by the group
            full = torch.ones(elems)
            block = torch.ones(elems // p)
            gathered = torch.empty(elems * p)

            for kind in MEASURED_COLLECTIVES:
                times = []
                for r in range(reps + 2):  # two warm-up calls
                    if on_mesh:
                        placed, want = _redistribution(kind, full, block, mesh)
                    dist.barrier()
                    t0 = time.perf_counter()
                    if on_mesh:
                        result = placed.redistribute(mesh, want).to_local()
                        float(result.reshape(-1)[0])  # a functional collective: waited on use
                    else:
                        _one_collective(kind, full, block, gathered)
                    if r >= 2:
                        times.append(time.perf_counter() - t0)
                res[kind].append((float(elems * 4), times))
        by_engine[engine] = res
    out.put((rank, by_engine))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(
    world_size: int = 2,
    sizes: Sequence[int] = COLLECTIVE_SIZES,
    reps: int = 20,
    engine: str = "dtensor",
    timeout: float = 120.0,
    start_method: str | None = None,
) -> dict[str, Any]:
    """Time the all-reduce, all-gather, reduce-scatter and all-to-all of gloo among
    ``world_size`` one-thread CPU processes, at ``n`` bytes per device for each ``n`` in
    ``sizes``, and fit each to the ring formula (:func:`fit_collective`): the effective
    latency and bandwidth per collective that the cost model then uses on that device
    kind (``CostModel.collectives``). ``engine``: ``"dtensor"`` times each as the
    sharded runtime runs it, a DTensor redistribution on a 1-D mesh (Partial to
    Replicate, Shard to Replicate, Partial to Shard, Shard(0) to Shard(1): gloo has no
    all-to-all, DTensor all-gathers and slices); ``"c10d"`` the process group's own call
    (DDP's, FSDP2's and the runtime's flat buckets: ``CostModel.c10d_collectives``).
    Each call's time is the slowest rank's (a collective ends when its last rank does),
    the mean over ``reps`` calls after two warm-ups, each call after a barrier. The mean,
    not the median: a step pays the sum of its collectives, tail included, and on shared
    cores the tail is heavy (a 64 KiB DTensor all-reduce between two gloo ranks here:
    median 0.8-0.9 ms, mean 1.3-1.7 ms over 35 calls).

    Why not the link's ping-pong: over loopback TCP a rank's send and receive share its
    core, so a gloo all-reduce costs about three times the ring formula with the link's
    latency and bandwidth (docs/runtime.md), and a DTensor redistribution about twice
    the gloo call again on small tensors (0.57 against 0.30 ms at 1 KiB); measuring the
    collectives themselves is NCCL-tests' approach (``all_reduce_perf``'s ``busbw``).
    Cost: ``world_size`` processes, ``4 · len(sizes) · (reps + 2)`` collectives (~5-8 s
    for the defaults on 2 ranks). Returns ``{"world_size", "engine", "fits": {kind:
    {"latency_s", "bandwidth"}}, "samples": {kind: [(bytes, seconds)]}}``."""
    return measure_collectives_by_engine(
        world_size, sizes, reps, (engine,), timeout=timeout, start_method=start_method
    )[engine]


def measure_collectives_by_engine(
    world_size: int = 2,
    sizes: Sequence[int] = COLLECTIVE_SIZES,
    reps: int = 20,
    engines: Sequence[str] = COLLECTIVE_ENGINES,
    timeout: float = 180.0,
    start_method: str | None = None,
) -> dict[str, dict[str, Any]]:
    """:func:`measure_collectives` for each of ``engines`` (default both: DTensor's
    redistributions and the process group's own calls, what a calibration file's
    ``collectives`` and ``collectives_c10d`` hold), one after the other in one set of
    ``world_size`` processes (one start and one process group where a measurement per
    engine pays each: ~1.5 s less for two on this host); per engine its result.

    Example::

        measured = measure_collectives_by_engine()
        measured["c10d"]["fits"]["all_reduce"]["latency_s"]  # ~0.6-1.0 ms on gloo here
    """
    if world_size < 2:
        raise InputError(f"collectives need at least 2 processes, got {world_size}")
    if not sizes or any(int(n) <= 0 for n in sizes) or reps < 1:
        raise InputError("sizes must be positive byte counts and reps at least 1")
    unknown = [e for e in engines if e not in COLLECTIVE_ENGINES]
    if unknown or not engines:
        raise InputError(
            f"engine {(unknown or [''])[0]!r}: choose one of {', '.join(COLLECTIVE_ENGINES)}"
        )
    got = _run_pair(
        _collective_worker,
        (world_size, [int(n) for n in sizes], int(reps), list(engines)),
        world_size,
        timeout,
        start_method or safe_start_method(),
        world_size=world_size,
    )
    per_rank = [res for _, res in sorted(got, key=lambda item: item[0])]
    out: dict[str, dict[str, Any]] = {}
    for engine in engines:
        samples: dict[str, list[tuple[float, float]]] = {}
        fits: dict[str, dict[str, float]] = {}
        for kind in MEASURED_COLLECTIVES:
            rows = []
            for k, (n, _) in enumerate(per_rank[0][engine][kind]):
                slowest = np.max([res[engine][kind][k][1] for res in per_rank], axis=0)
                rows.append((n, float(np.mean(slowest))))
            samples[kind] = rows
            latency, bandwidth = fit_collective(kind, world_size, rows)
            fits[kind] = {"latency_s": latency, "bandwidth": bandwidth}
        out[engine] = {"world_size": world_size, "engine": engine, "fits": fits, "samples": samples}
    return out


# ------------------------------------------------------------------ ranks meeting in a step
def _sync_skew_worker(
    rank: int,
    store_path: str,
    world_size: int,
    source: str,
    steps: int,
    budget_s: float,
    out: Any,
) -> None:
    import torch.distributed as dist

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed

    # torchrun's ranks leave gloo's threads at their priority: measure that regime
    _join_pair(rank, store_path, world_size, yield_threads=False)
    model, args, kwargs = build_from_seed(source)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    token = torch.zeros(1)

    def step(meet: bool) -> float:
        dist.barrier()  # every step after a barrier, as the torchrun runtime times them
        start = time.perf_counter()
        loss, _how = as_loss(model(*args, **kwargs))
        loss.backward()
        if meet:
            dist.all_reduce(token)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    pair = torch.zeros(1, dtype=torch.float64)
    for _ in range(3):  # Adam's state, the allocator's pools
        pair[0] = step(False) + step(True)
    # as many pairs as the budget buys at the slowest rank's last warm-up pair (every
    # rank runs the same number: each step meets at a barrier)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX)
    steps = max(2, min(steps, int(budget_s / max(float(pair[0]), 1e-9))))
    free, met = [], []
    for _ in range(steps):  # paired: host drift touches both kinds alike
        free.append(step(False))
        met.append(step(True))
    alone = []
    for _ in range(steps + 2):  # the token's all-reduce on its own, as the collectives are
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(token)
        alone.append(time.perf_counter() - start)
    out.put((rank, free, met, alone[2:], steps))
    dist.barrier()
    dist.destroy_process_group()


def measure_sync_skew(
    source: str,
    world_size: int = 2,
    steps: int = 80,
    budget_s: float = 20.0,
    timeout: float = 300.0,
    start_method: str | None = None,
) -> dict[str, Any]:
    """What making the ranks meet costs a training step beyond the collective itself: the
    *synchronisation skew*, as a fraction of one rank's local work.

    ``world_size`` one-thread gloo processes each build the ``FILE.py:build`` model and
    run its eager training step (forward, backward, foreach Adam), every step after a
    barrier as the torchrun runtime times its steps, alternating two kinds: *free* (no
    collective) and *met* (a 4-byte all-reduce between the backward and the optimizer's
    step, where a data-parallel step reduces its gradients); then the same all-reduce on
    its own after a barrier (``token_s``: the median of the slowest rank's times).
    ``skew = (met − free − token) / free``, where ``met`` is the median over steps of the
    slowest rank's time (a step ends when its last rank does; what the runtime reports)
    and ``free`` the median of every rank's own free steps (one rank's local work, beside
    busy peers: what the eager kernel costs price, :func:`meshplace.runtime.dryrun.
    time_eager_kernels`); floored at 0.

    Why: ranks sharing a host do not progress at one rate, and every collective makes
    the early ones wait for the late one, so a step of synchronised ranks takes the
    slowest rank's local work, not the typical one's, and each meeting costs more than
    the same collective between idle ranks. Measured on this project's 2-core host (two
    ranks, ``/tmp`` experiments, session 59): a 4-byte all-reduce after the backward
    added 1.7-2.8 ms to the Llama example's 9 ms step and 4.9-5.8 ms to the fidelity MLP's
    35 ms step against 0.3-0.9 ms on its own, an excess that grows with the work between
    meetings; the same all-reduce at 16 points of the Llama's forward added 0.7-0.9 ms
    each. ``skew`` 0.1-0.25 over several runs of each (runs of 40 steps: 0.08-0.48 on the
    Llama, whose step is short and noisy). :meth:`meshplace.runtime.dryrun.EngineProgram.
    predict` charges ``skew`` times a rank's local work to a step that has collectives.

    Cost: ``world_size`` processes, ``2 · (steps + 3)`` training steps each (~9 s for the
    fidelity MLP at the default 80), fewer where the pairs would outlast ``budget_s``
    (at least 2; a model of 1 s steps runs 10 pairs). Returns ``{"skew", "free_step_s",
    "met_step_s", "token_s", "steps" (the pairs run), "world_size"}``. Raises
    :class:`InputError` for fewer than 2 processes or steps or a budget that is not
    positive, :class:`~meshplace.runtime.processes.WorkerFailure` if a rank fails or the
    measurement outlasts ``timeout``.

    Example::

        measure_sync_skew("examples/llama.py:build_tiny")["skew"]  # ~0.1-0.25 here
    """
    if world_size < 2:
        raise InputError(f"ranks meet among at least 2 processes, got {world_size}")
    if steps < 2:
        raise InputError(f"the skew needs at least 2 steps of each kind, got {steps}")
    if not budget_s > 0:
        raise InputError(f"the skew's budget must be positive seconds, got {budget_s}")
    got = _run_pair(
        _sync_skew_worker,
        (world_size, source, int(steps), float(budget_s)),
        world_size,
        timeout,
        start_method or safe_start_method(),
        world_size=world_size,
    )
    per_rank = [res for _, *res in sorted(got, key=lambda item: item[0])]
    free = statistics.median(t for rank_free, *_ in per_rank for t in rank_free)
    met = statistics.median(np.max([rank_met for _, rank_met, *_ in per_rank], axis=0).tolist())
    token = statistics.median(np.max([alone for _, _, alone, _ in per_rank], axis=0).tolist())
    return {
        "skew": max(0.0, (met - free - token) / free),
        "free_step_s": free,
        "met_step_s": met,
        "token_s": token,
        "steps": int(per_rank[0][3]),
        "world_size": world_size,
    }
