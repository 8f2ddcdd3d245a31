"""Execute a placement for real: one worker process per device, send/recv between them.

Design (docs/runtime.md):

* Every worker re-traces the model from its picklable :class:`ModelSpec` (make_fx is
  deterministic, so fx node names agree) and owns the parameters, buffers, optimizer state
  and inputs of the ops placed on it.
* An fx node runs on the device of the OpGraph op that owns it; a view node runs where the
  tensor it views was produced, so what crosses devices is exactly the (view) tensor the
  consumer reads (:func:`~meshplace.runtime.program.schedule_nodes`).
* Workers walk the fx graph in the same global order, each its own nodes, with the one
  node-by-node interpreter of the project
  (:class:`~meshplace.runtime.program.StepInterpreter`). A value needed on another device
  is sent with a non-blocking ``isend`` as soon as it is produced; every receive is posted
  with ``irecv`` right after the step's barrier and waited for just before the first node
  that reads it. Tags are the producer's position in the graph, so messages match
  regardless of arrival order. Deadlock freedom: by induction on the global order, the
  producer of any awaited value never waits on anything later than it.
* Forward, backward and the optimizer update are one traced graph; a new parameter value
  computed on another device than the parameter's owner travels back at the end of the step.
* Step time: every worker stamps ``time.perf_counter()`` (CLOCK_MONOTONIC, shared by the
  processes of one host) after a barrier and after its last send completed; a step is
  ``max(end) - min(start)``; the result is the median over the steps after warm-up.

Faults: each worker publishes (current node, state, step, awaited node) in shared memory.
The driver ends the run when a worker raises (its message comes back over a queue), exits
(non-zero exit code) or makes no progress for ``hang_timeout`` seconds, and names the
worker and the op: a worker the kernel reports stopped (``SIGSTOP``, a debugger), else one
stuck computing, else the one the others' receives wait on. Every worker is then
terminated, killed if needed, and joined; workers also die with the driver if it is killed
(:mod:`meshplace.runtime.processes`), and the run's temporary folder is removed however
the run ends.

Cost: O(nodes) Python dispatch per step per worker plus the tensors' compute and transfer.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as mp
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshplace.errors import InputError
from meshplace.runtime.activity import (
    AWAITED,
    COMPUTE,
    DONE,
    NODE,
    RECV,
    SLOT,
    STATE,
    STATE_NAMES,
    STEP,
    SYNC,
)
from meshplace.runtime.processes import (
    WorkerFailure,
    die_with_parent,
    is_stopped,
    private_temp_folder,
    stop_processes,
)
from meshplace.runtime.program import (
    PORTABLE_DEFINITIONS,
    ModelSpec,
    NodeSchedule,
    RuntimeInputError,
    StepInterpreter,
    TracedStep,
    on_device_kwargs,
    schedule_nodes,
    trace_step,
)

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "RunResult",
    "WorkerFailure",
    "WorkerOutcome",
    "finish_receive",
    "held_placeholders",
    "natural_key",
    "on_device_kwargs",
    "ops_without_kernel",
    "post_receive",
    "resolve_worker_devices",
    "run_placement",
    "run_reference",
    "run_worker_steps",
    "send_value",
    "thread_ids",
    "transport_policy",
    "yield_transport_threads",
]

#: What :class:`Fault` can inject.
FAULT_KINDS = ("raise", "exit", "hang", "stop", "kill")


@dataclass(frozen=True)
class Fault:
    """A fault to inject (tests): ``kind`` is ``raise`` (an exception), ``exit``
    (``os._exit(3)``), ``hang`` (sleeps for an hour), ``stop`` (the worker sends itself
    ``SIGSTOP``) or ``kill`` (``SIGKILL``, as the kernel's OOM killer ends a process); it
    fires when the worker owning op ``op`` is about to run it at step
    ``step``."""

    op: str
    kind: str = "raise"
    step: int = 0


@dataclass
class RunResult:
    """What a run measured. Times in seconds."""

    step_times: list[float]
    warmup: int
    losses: list[float]
    devices: list[str]
    params: dict[str, torch.Tensor] | None = None
    bytes_sent: int = 0
    messages: int = 0
    worker_busy: list[float] = field(default_factory=list)
    worker_wait: list[float] = field(default_factory=list)
    #: with ``timeline=True``: per worker, per step, ``(node, start_s, end_s)`` relative to
    #: the step's start (the earliest worker's); ``node`` is the fx node's position, or
    #: ``-1 - j`` for the wait on the value of node ``j`` from another worker. A computed
    #: node's span runs from the previous event's end, so the interpreter's own per-node
    #: work is included, as in :func:`meshplace.profile.calibrate.time_step_ops`.
    timelines: list[list[list[tuple[int, float, float]]]] | None = None

    @property
    def step_time_s(self) -> float:
        """Median step time after warm-up."""
        timed = self.step_times[self.warmup :] or self.step_times
        return float(statistics.median(timed))

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "steps": len(self.step_times),
            "warmup": self.warmup,
            "step_time_s": self.step_time_s,
            "step_times_s": self.step_times,
            "losses": self.losses,
            "bytes_sent_per_step": self.bytes_sent,
            "messages_per_step": self.messages,
        }


# ------------------------------------------------------------------ worker
def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels: detached, contiguous, in host memory (gloo moves host
    buffers; a GPU worker's value is copied to the host here, which also waits for the
    kernels producing it), bool as uint8."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous()


def _empty_like_meta(v: Any) -> torch.Tensor:
    dtype = torch.uint8 if v.dtype == torch.bool else v.dtype
    return torch.empty(tuple(v.shape), dtype=dtype)


# The three message paths of a worker, shared with the message-cost micro-benchmark
# (meshplace.profile.link.measure_message_cost) so that it times exactly this code.
def send_value(
    value: Any, dst: int, tag: int, keep: list[torch.Tensor], pending: list[Any]
) -> tuple[int, int]:
    """``isend`` every tensor leaf of ``value`` to rank ``dst`` (tags ``tag + k``), keeping
    the wire tensors alive in ``keep`` and the works in ``pending``; (messages, bytes)."""
    import torch.distributed as dist

    messages = nbytes = 0
    for k, leaf in enumerate(tree_flatten(value)[0]):
        if isinstance(leaf, torch.Tensor):
            w = _wire(leaf)
            keep.append(w)
            pending.append(dist.isend(w, dst=dst, tag=tag + k))
            messages += 1
            nbytes += w.numel() * w.element_size()
    return messages, nbytes


def post_receive(example: Any, src: int, tag: int) -> list[tuple[Any, Any]]:
    """``irecv`` every tensor leaf of a value shaped like ``example`` (fx ``meta["val"]``)
    from rank ``src``: ``(buffer, work)`` per leaf (``(leaf, None)`` for a non-tensor)."""
    import torch.distributed as dist

    works: list[tuple[Any, Any]] = []
    for k, leaf in enumerate(tree_flatten(example)[0]):
        if isinstance(leaf, torch.Tensor):
            buf = _empty_like_meta(leaf)
            works.append((buf, dist.irecv(buf, src=src, tag=tag + k)))
        else:
            works.append((leaf, None))
    return works


def finish_receive(
    example: Any, posted: list[tuple[Any, Any]], device: torch.device | None = None
) -> Any:
    """Wait for the leaves :func:`post_receive` posted and rebuild the value, each tensor
    laid out with the producer's strides (so kernels take the same code path) and, for a
    worker on another device than the host (``device``, e.g. ``cuda:1``), copied there."""
    flat, spec_ = tree_flatten(example)
    on_host = device is None or device.type == "cpu"
    out = []
    for leaf, (buf, work) in zip(flat, posted):
        if work is None:
            out.append(leaf)
            continue
        work.wait()
        if leaf.dtype == torch.bool:
            buf = buf.bool()
        stride = tuple(leaf.stride())
        if buf.dim() and stride != tuple(buf.stride()) and 0 not in stride:
            laid = torch.empty_strided(
                tuple(leaf.shape), leaf.stride(), dtype=buf.dtype, device=device
            )
            buf = laid.copy_(buf)
        elif not on_host:
            buf = buf.to(device)
        out.append(buf)
    return tree_unflatten(out, spec_) if not isinstance(example, torch.Tensor) else out[0]


def check_same_trace(mine: list[str], driver: list[str]) -> None:
    """Raise :class:`RuntimeInputError` when a spawned worker's trace of the step (its fx
    node names, in order) is not the driver's: the placement and every node index the
    worker reports (timelines) refer to the driver's graph.

    >>> check_same_trace(["a", "b"], ["a", "b"])
    >>> try:  # doctest: +ELLIPSIS
    ...     check_same_trace(["a", "c"], ["a", "b"])
    ... except RuntimeInputError as e:
    ...     print(e)
    the worker traced another step than the driver (node 1: 'c', the driver's 'b'; 2 ...
    """
    if mine == driver:
        return
    k = next(
        (i for i, (a, b) in enumerate(zip(mine, driver)) if a != b), min(len(mine), len(driver))
    )
    here = mine[k] if k < len(mine) else "none"
    there = driver[k] if k < len(driver) else "none"
    raise RuntimeInputError(
        f"the worker traced another step than the driver (node {k}: {here!r}, the "
        f"driver's {there!r}; {len(mine)} nodes against {len(driver)})"
    )


def _worker(
    rank: int,
    world: int,
    spec: ModelSpec,
    op_device: list[int],
    steps: int,
    store_path: str,
    status: Any,
    results: Any,
    fault: Fault | None,
    want_params: bool,
    threads: int,
    timeout_s: float,
    traced: TracedStep | None = None,
    timeline: bool = False,
    device_name: str = "cpu",
    parent_pid: int | None = None,
    driver_nodes: list[str] | None = None,
) -> None:
    import datetime

    import torch.distributed as dist

    if parent_pid is not None:  # first: die with the driver, whatever happens next
        die_with_parent(parent_pid, f"meshplace-w{rank}")
    # a forked worker inherits the driver's handlers: SIGTERM from the driver ends it at
    # once, as it ends a spawned one, rather than raising in whatever it is doing
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(threads)
    sched: NodeSchedule | None = None
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # true float32, as on the host (TF32 would round matmuls and convolutions)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        step = traced if traced is not None else trace_step(spec, weights=False)
        if driver_nodes is not None:  # the driver's placement is of its own trace
            check_same_trace([n.name for n in step.gm.graph.nodes], driver_nodes)
        sched = schedule_nodes(step, op_device)
        store = dist.FileStore(store_path, world)
        before = thread_ids()
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        yield_transport_threads(threads=thread_ids() - before)  # the group's threads
        o = run_worker_steps(rank, step, sched, steps, status, fault, want_params, timeline, device)
        results.put(("ok", rank, o.records, o.params, o.bytes_sent, o.messages))
        dist.destroy_process_group()
    except BaseException as exc:  # report one sentence, then exit non-zero
        where = _node_at(sched, status, rank)
        results.put(("error", rank, where, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        results.put(("trace", rank, traceback.format_exc()))
        # wait until the queue's feeder thread has written both messages, then go
        results.close()
        results.join_thread()
        os._exit(1)


def _node_at(sched: NodeSchedule | None, status: Any, rank: int) -> str:
    """The name of the node worker ``rank`` is at, or ``setup`` before its first step."""
    base = SLOT * rank
    if sched is None or status[base + STEP] == 0:
        return "setup"
    idx = int(status[base + NODE])
    return sched.names[idx] if 0 <= idx < len(sched.names) else "setup"


TRANSPORT_POLICIES = ("auto", "idle", "nice", "normal")
#: ``auto`` picks ``idle`` only while the 1-minute load average is below this share of the
#: cores: an idle-class thread beside busy cores gets a sliver of one, and then messages
#: crawl and a killed worker takes seconds to exit (each of its threads must run to die).
QUIET_LOAD_SHARE = 0.75


def transport_policy() -> str:
    """The scheduling policy for the workers' gloo threads: ``MESHPLACE_TRANSPORT`` —
    ``auto`` (default: ``idle`` on a quiet host, ``nice`` on a busy one, by the load
    average), ``idle``, ``nice`` (nice 10) or ``normal`` (left alone). One sentence
    (:class:`~meshplace.errors.InputError`) for anything else.

    >>> transport_policy() in TRANSPORT_POLICIES
    True
    """
    value = os.environ.get("MESHPLACE_TRANSPORT", "auto").strip().lower() or "auto"
    if value not in TRANSPORT_POLICIES:
        raise InputError(
            f"MESHPLACE_TRANSPORT={value!r} is not one of {', '.join(TRANSPORT_POLICIES)}"
        )
    if value == "auto":
        quiet = os.getloadavg()[0] < QUIET_LOAD_SHARE * (os.cpu_count() or 1)
        return "idle" if quiet else "nice"
    return value


def thread_ids() -> set[int]:
    """The ids of this process's threads (empty where ``/proc`` does not exist)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def yield_transport_threads(policy: str | None = None, threads: Iterable[int] | None = None) -> int:
    """Put this process's gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) in the
    ``SCHED_IDLE`` class (nice 19 where that class does not exist), or at nice 10, or leave
    them, as ``policy`` (default :func:`transport_policy`) says; returns how many threads
    were changed (0 where ``/proc`` or the threads do not exist).

    ``threads`` names them by id: the threads that joining the process group started
    (:func:`thread_ids` after minus before ``init_process_group``), which is exact — a
    new thread names itself only once it runs, so right after the join, on a busy host,
    its name may still be its parent's. Without ``threads``, the threads already named
    ``gloo*`` / ``pt_gloo*`` are taken.

    Why: gloo's event-loop thread takes a pair's lock with ``try_lock`` and, when a worker's
    compute thread holds it (posting a receive, sending), calls ``epoll_wait`` again at once
    on the still-readable socket — it spins. With two one-thread workers on two cores the
    two loop threads and the two compute threads share the cores, the spinning loop thread
    takes a whole scheduler slice from a compute thread, and a call that should take 20 µs
    takes 2-5 ms (both workers at once: the peer waits on it). ``benchmarks/transport.py``
    on the 2-vCPU development VM (15 ``irecv`` posted, then waited, per round; 440 phases
    per policy): 35 phases slower than 1.5 ms at normal priority, 46 at nice 10, 2 in
    ``SCHED_IDLE`` (mean 709, 761, 434 µs). An idle-class thread runs when a core has
    nothing else to do — which is exactly when a worker waits for a message — and gets a
    sliver of a busy core otherwise, so it can never take a compute thread's slice. The
    training steps of 20 placements of 4 small models took 0.70× their time at normal
    priority (geometric mean; 0.81× at nice 10). Lowering one's own
    threads needs no privilege.

    The price: on a host whose cores are busy with *other* work, an idle-class thread only
    gets a sliver of a core, and messages crawl (the message micro-benchmark timed out
    with two CPU-bound processes beside it). ``MESHPLACE_TRANSPORT=nice`` or ``normal``
    is for such hosts.
    """
    policy = policy or transport_policy()
    if policy == "normal":
        return 0
    if threads is None:
        threads = [t for t in thread_ids() if _thread_name(t).startswith(("gloo", "pt_gloo"))]
    changed = 0
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in threads:
        try:
            if policy == "idle" and idle is not None:
                os.sched_setscheduler(int(tid), idle, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, int(tid), 10 if policy == "nice" else 19)
            changed += 1
        except OSError:  # the thread ended, or no permission: leave it
            continue
    return changed


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class _StepState:
    """What the hooks of a worker's walk share within one step."""

    __slots__ = ("bytes_sent", "events", "keep", "messages", "pending", "posted", "step", "wait")

    def __init__(self) -> None:
        self.step = 0
        self.posted: dict[int, list] = {}
        self.events: list[tuple[int, float, float]] | None = None
        self.keep: list[torch.Tensor] = []
        self.pending: list[Any] = []
        self.wait = 0.0
        self.messages = 0
        self.bytes_sent = 0


class WorkerOutcome(NamedTuple):
    """What :func:`run_worker_steps` returns.

    Attributes:
        records: per step ``(start, end, loss or None, compute_s, wait_s, events)``
            (``perf_counter`` stamps; ``events`` only with a timeline).
        params: with ``want_params``, the final values of the parameters the worker holds
            (name → numpy array), else ``None``.
        bytes_sent / messages: what the worker sent in the first step.
        held: the placeholder values the worker holds after the last step (position in
            ``params, buffers, states, inputs`` order → tensor).
    """

    records: list[tuple]
    params: dict[str, Any] | None
    bytes_sent: int
    messages: int
    held: dict[int, torch.Tensor]


def held_placeholders(step: TracedStep, sched: NodeSchedule, rank: int) -> set[int]:
    """The placeholder positions (``params, buffers, states, inputs`` order) whose nodes
    run on worker ``rank``: the parameters, buffers, optimizer state and inputs it holds.
    An optimizer-state placeholder belongs to its parameter's op. O(fx nodes).

    >>> step = trace_step(ModelSpec("mlp", batch=2))
    >>> len(held_placeholders(step, schedule_nodes(step, [0] * step.graph.num_ops), 0))
    14
    """
    placeholders = [i for i, n in enumerate(step.gm.graph.nodes) if n.op == "placeholder"]
    return {k for k, i in enumerate(placeholders) if sched.device[i] == rank}


def run_worker_steps(
    rank: int,
    step: TracedStep,
    sched: NodeSchedule,
    steps: int,
    status: Any | None,
    fault: Fault | None,
    want_params: bool,
    timeline: bool = False,
    device: torch.device | None = None,
) -> WorkerOutcome:
    """Run ``steps`` training steps of worker ``rank`` (``torch.distributed`` initialised,
    one rank per worker of ``sched``): its nodes in graph order, receiving what it reads
    from other ranks and sending what they read (see the module doc).

    The worker creates only the parameters, buffers, optimizer state and inputs it holds
    (:func:`held_placeholders`). ``status`` is a mutable sequence of ``16 * world`` ints
    where the worker publishes its progress (shared memory under :func:`run_placement`;
    ``None``: a private list). O(steps x (its nodes + its messages)).
    """
    import torch.distributed as dist

    device = device or torch.device("cpu")
    on_gpu = device.type == "cuda"
    if status is None:
        status = [0] * (SLOT * (rank + 1))
    nodes = list(step.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    params, bufs, states, inputs = (
        [_to_device(x, device) for x in group]
        for group in step.initial_state(held_placeholders(step, sched, rank))
    )
    n_p, n_b = len(params), len(bufs)
    placeholder_values: list[Any] = [*params, *bufs, *states, *inputs]
    out_nodes = tree_flatten(nodes[-1].args[0])[0]
    loss_pos = pos[out_nodes[0]]
    # Which parameter each new value replaces: its update op names the parameter.
    pidx = {n: i for i, n in enumerate(step.param_names)}
    updates: list[tuple[int, int]] = []  # (node position, placeholder index)
    for nn in out_nodes[1:]:
        pname = (nn.meta.get("custom") or {}).get("param")
        if pname in pidx:
            updates.append((pos[nn], pidx[pname]))
    # Optimizer state (Adam's moments): the node computing its next value replaces it too.
    by_name = {n.name: i for i, n in enumerate(nodes)}
    for k, name in enumerate(step.state_nodes):
        updates.append((by_name[name], n_p + n_b + k))
    # placeholder index -> node position (parameters first, then buffers, states, inputs)
    param_node_pos = dict(enumerate(i for i, n in enumerate(nodes) if n.op == "placeholder"))
    mine = [i for i, d in enumerate(sched.device) if d == rank and nodes[i].op != "output"]
    # Factory ops traced with ``device=cpu`` (zeros, arange, empty, ...) create their
    # tensors on this worker's device instead.
    interp = StepInterpreter(step.gm, mine, device=device)
    # Every remote value this worker reads is waited for just before the first of its
    # nodes that reads it.
    first_reader: dict[int, list[int]] = {}
    remote: set[int] = set()
    for i in mine:
        for a in nodes[i].all_input_nodes:
            j = pos[a]
            if sched.device[j] != rank and j not in remote:
                remote.add(j)
                first_reader.setdefault(i, []).append(j)
    examples = {j: nodes[j].meta.get("val") for j in remote}
    owned_updates = [
        (upos, p)
        for upos, p in updates
        if sched.device[param_node_pos[p]] == rank and sched.device[upos] != rank
    ]
    base = SLOT * rank
    records: list[tuple] = []
    st = _StepState()

    def post_receives() -> tuple[dict[int, list], dict[int, Any]]:
        # gloo is a rendezvous protocol: a send moves no data until the receiver has posted
        # the matching receive. Posting every receive with ``irecv`` right after the step's
        # barrier lets each transfer run as soon as its producer sends, overlapping with
        # compute here.
        posted = {j: post_receive(examples[j], sched.device[j], j * 16) for j in sorted(remote)}
        upd: dict[int, Any] = {}
        for upos, p in owned_updates:
            buf = torch.empty_like(placeholder_values[p], device="cpu")
            upd[p] = (buf, dist.irecv(buf, src=sched.device[upos], tag=(len(nodes) + p) * 16))
        return posted, upd

    def receive(i: int, env: list) -> None:
        for j in first_reader[i]:
            status[base + AWAITED] = j
            status[base + STATE] = RECV
            start, first = time.perf_counter(), gpu_mark()
            env[j] = finish_receive(examples[j], st.posted.pop(j), device)
            end = time.perf_counter()
            st.wait += end - start
            status[base + STATE] = COMPUTE
            if st.events is not None:
                st.events.append((-1 - j, first or start, gpu_mark() or end))

    def inject(i: int, env: list) -> None:
        assert fault is not None
        if st.step == fault.step:
            _inject(fault)

    def receive_then_inject(i: int, env: list) -> None:
        receive(i, env)
        inject(i, env)

    def send(i: int, env: list) -> None:
        value = env[i]
        for d in sched.consumers[i]:
            m, b = send_value(value, d, i * 16, st.keep, st.pending)
            if st.step == 0:
                st.messages += m
                st.bytes_sent += b

    def gpu_mark() -> Any:
        """On a GPU with a timeline, a CUDA event recorded on the stream (resolved to
        seconds after the step); else None."""
        if not on_gpu or st.events is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stamp(i: int, env: list) -> None:
        # a node's span on a GPU ends when the stream reaches its end (an event, not a
        # synchronisation: one per node moved kernels' time onto later nodes, measured on
        # an H200 — layer norms 26 ms where their kernels take 0.9 ms, docs/runtime.md)
        assert st.events is not None
        st.events.append((i, 0.0, gpu_mark() or time.perf_counter()))

    before: dict[int, Any] = {i: receive for i in first_reader}
    fault_pos = sched.names.index(fault.op) if fault is not None and fault.op in sched.names else -1
    if fault_pos in mine:
        before[fault_pos] = receive_then_inject if fault_pos in first_reader else inject
    after = {i: send for i in mine if sched.consumers[i]}

    for s in range(steps):
        st.step = s
        st.keep, st.pending, st.wait = [], [], 0.0
        st.events = [] if timeline else None
        status[base + STEP] = s + 1
        status[base + STATE] = SYNC
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        origin = gpu_mark()  # the GPU's clock of this step starts at t0
        status[base + STATE] = COMPUTE
        st.posted, upd = post_receives()
        env = interp.walk(
            placeholder_values,
            before=before,
            after=after,
            each=stamp if timeline else None,
            mark=(status, base + NODE),
        )
        # New parameter and optimizer-state values: to the owner of the placeholder.
        for upos, p in updates:
            owner = sched.device[param_node_pos[p]]
            if sched.device[upos] == rank and owner != rank:
                w = _wire(env[upos])
                st.keep.append(w)
                st.pending.append(dist.isend(w, dst=owner, tag=(len(nodes) + p) * 16))
        for upos, p in updates:
            owner = sched.device[param_node_pos[p]]
            if owner != rank:
                continue
            if sched.device[upos] == rank:
                new = env[upos]
            else:
                status[base + AWAITED] = upos
                status[base + STATE] = RECV
                new, work = upd[p]
                work.wait()
                new = _to_device(new, device)
            placeholder_values[p] = new.detach()
        status[base + STATE] = SYNC
        for w in st.pending:
            w.wait()
        if on_gpu:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if origin is not None and st.events is not None:  # GPU stamps: seconds after t0

            def seconds(mark: Any, origin: Any = origin, t0: float = t0) -> float:
                return t0 + origin.elapsed_time(mark) / 1e3

            st.events = [(n, seconds(a) if a else a, seconds(b)) for n, a, b in st.events]
        loss = float(env[loss_pos]) if sched.device[loss_pos] == rank else None
        records.append((t0, t1, loss, t1 - t0 - st.wait, st.wait, st.events))
    status[base + STATE] = DONE
    dist.barrier()
    params_out = None
    if want_params:
        params_out = {
            step.param_names[p]: placeholder_values[p].detach().cpu().numpy().copy()
            for p in range(n_p)
            if sched.device[param_node_pos[p]] == rank
        }
    held = {k: v for k, v in enumerate(placeholder_values) if isinstance(v, torch.Tensor)}
    return WorkerOutcome(records, params_out, st.bytes_sent, st.messages, held)


def _to_device(x: Any, device: torch.device) -> Any:
    return x.to(device) if torch.is_tensor(x) and x.device != device else x


def _inject(fault: Fault) -> None:
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind == "hang":
        time.sleep(3600)
    if fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault in op {fault.op!r}")


# ------------------------------------------------------------------ driver
def run_placement(
    spec: ModelSpec | None,
    devices: Sequence[str],
    steps: int = 5,
    *,
    warmup: int = 1,
    step: TracedStep | None = None,
    fault: Fault | None = None,
    want_params: bool = False,
    threads: int = 1,
    hang_timeout: float = 20.0,
    setup_timeout: float = 120.0,
    start_method: str = "spawn",
    timeline: bool = False,
    worker_devices: Sequence[str] | str | None = None,
) -> RunResult:
    """Run ``steps`` training steps of ``spec`` with op *i* on ``devices[i]`` (device names,
    one per OpGraph op; the distinct names, sorted, become worker ranks).

    ``worker_devices`` says where each worker computes (:func:`resolve_worker_devices`):
    ``None``/``"cpu"`` (every worker on the host), ``"cuda"`` (worker *r* on ``cuda:r``) or
    one torch device per worker, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cuda:0"]``. A
    GPU worker keeps its parameters, optimizer state and activations on its GPU; messages
    travel through host memory over gloo (copied to the host after the producing kernels,
    and to the receiver's GPU on arrival), and step times are stamped after
    ``torch.cuda.synchronize``.

    ``start_method="spawn"`` (default) starts clean interpreters that re-trace the model;
    ``"fork"`` (POSIX only) shares the traced step with the workers and starts in
    milliseconds — fine on CPU with one thread per worker, unsafe once CUDA is initialised.
    ``timeline=True`` records every node's span in every worker (``RunResult.timelines``;
    on a GPU worker the stream's time between CUDA events recorded after each node).
    ``spec`` may be ``None`` when ``step`` is given and the workers are forked.

    Raises :class:`WorkerFailure` (one sentence naming the worker and op; its attributes
    say the same) when a worker raises, exits, is stopped or makes no progress for
    ``hang_timeout`` seconds (``setup_timeout`` before the first step), and
    :class:`~meshplace.errors.InputError` for bad arguments. No worker outlives the call,
    nor the calling process if it is killed; the run's temporary folder is removed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer, got {steps}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InputError(f"warmup must be an integer >= 0, got {warmup}")
    for what, value in (("hang_timeout", hang_timeout), ("setup_timeout", setup_timeout)):
        if not (isinstance(value, int | float) and 0 < value < float("inf")):
            raise InputError(f"{what} must be a positive number of seconds, got {value}")
    if spec is None and (step is None or start_method != "fork"):
        raise InputError("run_placement needs a ModelSpec unless a traced step is forked")
    step = step or trace_step(spec)
    if len(devices) != step.graph.num_ops:
        raise InputError(
            f"the placement names {len(devices)} devices but graph {step.graph.name!r} has "
            f"{step.graph.num_ops} ops"
        )
    names = sorted(set(devices), key=natural_key)
    rank_of = {d: r for r, d in enumerate(names)}
    op_device = [rank_of[d] for d in devices]
    world = len(names)
    if fault is not None:
        if fault.op not in {n.name for n in step.gm.graph.nodes}:
            raise InputError(f"fault names op {fault.op!r}, which the traced graph does not have")
        if fault.kind not in FAULT_KINDS:
            raise InputError(f"fault kind {fault.kind!r} is not one of {', '.join(FAULT_KINDS)}")

    if start_method not in ("spawn", "fork"):
        raise InputError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
    transport_policy()  # a bad MESHPLACE_TRANSPORT: one sentence here, not in the workers
    requested = (
        worker_devices.split(",") if isinstance(worker_devices, str) else worker_devices or []
    )
    if start_method == "fork" and any(str(d).strip().startswith("cuda") for d in requested):
        # looking for the GPUs touches the CUDA driver here, and a forked child cannot use it
        raise InputError("GPU workers must be spawned, not forked; use start_method='spawn'")
    where = resolve_worker_devices(worker_devices, world)
    on_gpu = any(d.startswith("cuda") for d in where)
    if on_gpu:
        missing = ops_without_kernel(step, "CUDA")
        if missing:
            target = next(n.target for n in step.gm.graph.nodes if n.name == missing[0])
            raise InputError(
                f"{_count(len(missing), 'op')} of the traced step cannot run on a GPU "
                f"(first: {missing[0]!r}, {target}): the step was traced on the host"
            )
    sched = schedule_nodes(step, op_device)
    ctx = mp.get_context(start_method)
    status = ctx.Array("q", SLOT * world, lock=False)
    results = ctx.Queue()
    with private_temp_folder("meshplace-run-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world,
                    spec,
                    op_device,
                    steps,
                    store_path,
                    status,
                    results,
                    fault,
                    want_params,
                    threads,
                    max(hang_timeout, 5.0) * 4,
                    step if start_method == "fork" else None,
                    timeline,
                    where[r],
                    os.getpid(),
                    None if start_method == "fork" else sched.names,
                ),
                daemon=True,
                name=f"meshplace-worker-{r}",
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            # once every worker has joined the group the store is no longer read: remove it
            # then, so that not even a SIGKILL of this process leaves the folder behind
            ok = _collect(
                procs,
                status,
                results,
                names,
                sched,
                hang_timeout,
                setup_timeout,
                on_started=lambda: shutil.rmtree(tmp, ignore_errors=True),
            )
        except WorkerFailure as exc:
            exc.pids = [p.pid for p in procs if p.pid is not None]
            raise
        finally:
            stop_processes(procs)
            results.close()
    return _assemble(ok, names, steps, warmup, want_params)


def resolve_worker_devices(spec: Sequence[str] | str | None, world: int) -> list[str]:
    """One torch device string per worker rank from ``spec`` (see :func:`run_placement`),
    checked against this machine: raises :class:`~meshplace.errors.InputError` (one
    sentence) for a malformed device, a wrong count or a GPU this machine does not have.

    >>> resolve_worker_devices(None, 2), resolve_worker_devices("cpu,cpu", 2)
    (['cpu', 'cpu'], ['cpu', 'cpu'])
    """
    if spec is None or spec == "cpu":
        return ["cpu"] * world
    if spec == "cuda":
        names = [f"cuda:{r}" for r in range(world)]
    else:
        names = [d.strip() for d in (spec.split(",") if isinstance(spec, str) else spec)]
        if len(names) != world:
            raise InputError(
                f"{_count(len(names), 'worker device')} given ({', '.join(names)}) for "
                f"{_count(world, 'worker')}"
            )
    # only ask CUDA when a GPU is named: the query initialises the driver in this process
    wants_gpu = any(n.startswith("cuda") for n in names)
    available = torch.cuda.device_count() if wants_gpu and torch.cuda.is_available() else 0
    out = []
    for name in names:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise InputError(f"unknown worker device {name!r}; use cpu or cuda:N") from None
        if dev.type == "cpu":
            out.append("cpu")
        elif dev.type == "cuda":
            index = 0 if dev.index is None else dev.index
            if index >= available:
                raise InputError(
                    f"worker device {name!r} is not on this machine, which has "
                    f"{_count(available, 'CUDA device')}"
                )
            out.append(f"cuda:{index}")
        else:
            raise InputError(f"unknown worker device {name!r}; use cpu or cuda:N")
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def natural_key(name: str) -> tuple[str, int, str]:
    """Sort key putting ``cpu2`` before ``cpu10`` (worker ranks follow it).

    >>> sorted(["gpu10", "gpu2", "gpu1"], key=natural_key)
    ['gpu1', 'gpu2', 'gpu10']
    """
    stem = name.rstrip("0123456789")
    digits = name[len(stem) :]
    return (stem, int(digits) if digits else -1, name)


_COMPOSITE_KEYS = (
    "CompositeImplicitAutograd",
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
)


def ops_without_kernel(step: TracedStep, dispatch_key: str) -> list[str]:
    """Names of the traced step's nodes whose aten operator has no kernel for
    ``dispatch_key`` (e.g. ``"CUDA"``) nor a composite one: a step traced on the host can
    hold host-only operators, which a GPU worker cannot run unless it has their
    :data:`~meshplace.runtime.program.PORTABLE_DEFINITIONS` (the CPU flash attention
    ``_scaled_dot_product_flash_attention_for_cpu`` does). O(nodes).

    >>> from meshplace.runtime.program import ModelSpec, trace_step
    >>> ops_without_kernel(trace_step(ModelSpec("mlp", batch=2)), "CPU")
    []
    """
    missing = []
    for node in step.gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target in PORTABLE_DEFINITIONS:  # the workers run its portable definition
            continue
        name = target.name()
        if not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
            for key in (dispatch_key, *_COMPOSITE_KEYS)
        ):
            missing.append(node.name)
    return missing


def _collect(
    procs: list,
    status: Any,
    results: Any,
    names: list[str],
    sched: NodeSchedule,
    hang_timeout: float,
    setup_timeout: float,
    on_started: Callable[[], Any] | None = None,
) -> dict[int, tuple]:
    """Gather every worker's result; raise :class:`WorkerFailure` as soon as one fails,
    exits, or all stall (see :func:`_stall_failure`). ``on_started()`` runs once every
    worker has begun its first step."""
    world = len(procs)
    ok: dict[int, tuple] = {}
    errors: dict[int, tuple[str, str]] = {}
    traces: dict[int, str] = {}
    last: list[tuple[int, int]] = []
    last_change = time.monotonic()
    while len(ok) < world:
        try:
            msg = results.get(timeout=0.05)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[0] == "ok":
                ok[msg[1]] = msg
            elif msg[0] == "trace":
                traces[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors[msg[1]] = (msg[2], msg[3])
                _diagnose(procs, status, results, names, sched, errors, traces)
            continue
        if any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in ok):
            _diagnose(procs, status, results, names, sched, errors, traces)
        now = time.monotonic()
        progress = [(status[SLOT * r + NODE], status[SLOT * r + STEP]) for r in range(world)]
        if progress != last:
            last = progress
            last_change = now
            if on_started is not None and all(step >= 1 for _, step in progress):
                on_started()
                on_started = None
            continue
        in_setup = all(status[SLOT * r + STEP] == 0 for r in range(world))
        stalled = now - last_change
        if stalled > hang_timeout:
            # a stopped worker makes no progress, set up or not: name it at once
            for r, p in enumerate(procs):
                if r not in ok and is_stopped(p.pid):
                    raise _failure(
                        r,
                        names,
                        sched,
                        status,
                        "stopped",
                        f"hung: it is stopped (SIGSTOP or a debugger), no progress for "
                        f"{hang_timeout:g} s while {_doing(sched, status, r)}",
                    )
        limit = setup_timeout if in_setup else hang_timeout
        if stalled > limit:
            if in_setup:
                raise WorkerFailure(
                    f"the workers did not start within {limit:g} s (tracing or rendezvous hung)",
                    cause="setup",
                )
            running = [r for r in range(world) if r not in ok]
            raise _stall_failure(names, sched, status, running, limit)
    return ok


def _doing(sched: NodeSchedule, status: Any, rank: int) -> str:
    """What worker ``rank`` was doing, from its status words: ``computing op 'add_1'``,
    ``waiting to receive op 'mm'`` (the op it receives for), ``setting up``."""
    base = SLOT * rank
    if status[base + STEP] == 0:
        return "setting up"
    state = STATE_NAMES.get(int(status[base + STATE]), "running")
    return f"{state} op {_node_at(sched, status, rank)!r}"


def _failure(
    rank: int, names: list[str], sched: NodeSchedule, status: Any, cause: str, text: str
) -> WorkerFailure:
    op = _node_at(sched, status, rank)
    return WorkerFailure(
        f"worker {rank} ({names[rank]}) {text}",
        worker=rank,
        device=names[rank],
        op=None if op == "setup" else op,
        cause=cause,
    )


def _stall_failure(
    names: list[str], sched: NodeSchedule, status: Any, running: list[int], limit: float
) -> WorkerFailure:
    """Blame for a run in which no worker made progress: a worker stuck computing an op;
    else the worker that a waiting receiver's chain of awaited values ends at (a receiving
    worker waits on the producer of the value it awaits); else the worker furthest
    behind."""
    state = {r: int(status[SLOT * r + STATE]) for r in running}
    computing = [r for r in running if state[r] == COMPUTE]
    waiter: int | None = None
    if computing:
        culprit = computing[0]
    else:
        receiving = [r for r in running if state[r] == RECV]
        if receiving:
            culprit, chain = receiving[0], [receiving[0]]
            while state.get(culprit) == RECV:
                awaited = int(status[SLOT * culprit + AWAITED])
                producer = sched.device[awaited] if 0 <= awaited < len(sched.device) else culprit
                if producer in chain or producer not in state:
                    break
                waiter, culprit = culprit, producer
                chain.append(culprit)
        else:
            culprit = min(running, key=lambda r: (status[SLOT * r + STEP], r))
    text = f"hung: no progress for {limit:g} s while {_doing(sched, status, culprit)}"
    if waiter is not None:
        awaited = int(status[SLOT * waiter + AWAITED])
        text += f" (worker {waiter} waits for its value of {sched.names[awaited]!r})"
    return _failure(culprit, names, sched, status, "hung", text)


_COMM_WORDS = ("connection", "gloo", "closed", "timed out", "timeout", "distbackenderror", "peer")


def _diagnose(
    procs: list,
    status: Any,
    results: Any,
    names: list[str],
    sched: NodeSchedule,
    errors: dict[int, tuple[str, str]],
    traces: dict[int, str],
) -> None:
    """Find the worker that failed first and raise :class:`WorkerFailure` naming it.

    A worker that loses a peer fails too (its receive errors out), so gather every report
    and exit code until each worker has reported or exited (at most half a second), and
    prefer, in order: an error that is not a communication error, a worker that died
    without a report (``os._exit``, a signal), any error."""
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if all(r in errors or p.exitcode is not None for r, p in enumerate(procs)):
            break
        try:
            m = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if m[0] == "error":
            errors[m[1]] = (m[2], m[3])
        elif m[0] == "trace":
            traces[m[1]] = m[2]
    blamed: WorkerFailure | None = None
    for r, (where, text) in sorted(errors.items()):
        if not any(w in text.lower() for w in _COMM_WORDS):
            blamed = _reported(r, names, where, text)
            break
    if blamed is None:
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in errors:
                code = p.exitcode
                how = (
                    f"was killed by {signal.Signals(-code).name}"
                    if code < 0 and -code in signal.valid_signals()
                    else f"exited with code {code}"
                )
                blamed = _failure(
                    r,
                    names,
                    sched,
                    status,
                    "exited",
                    f"{how} while running op {_node_at(sched, status, r)!r}",
                )
                break
    if blamed is None and errors:
        r, (where, text) = sorted(errors.items())[0]
        blamed = _reported(r, names, where, text)
    if blamed is not None:
        if blamed.worker is not None and blamed.worker in traces:
            blamed.details = traces[blamed.worker]  # type: ignore[attr-defined]
        raise blamed


def _reported(rank: int, names: list[str], where: str, text: str) -> WorkerFailure:
    return WorkerFailure(
        f"worker {rank} ({names[rank]}) failed in op {where!r}: {text}",
        worker=rank,
        device=names[rank],
        op=None if where == "setup" else where,
        cause="raised",
    )


def _assemble(
    ok: dict[int, tuple], names: list[str], steps: int, warmup: int, want_params: bool
) -> RunResult:
    step_times, losses, busy = [], [], [0.0] * len(names)
    for s in range(steps):
        t0 = min(ok[r][2][s][0] for r in ok)
        t1 = max(ok[r][2][s][1] for r in ok)
        step_times.append(t1 - t0)
        loss = next((ok[r][2][s][2] for r in ok if ok[r][2][s][2] is not None), float("nan"))
        losses.append(loss)
    waits = [0.0] * len(names)
    for r in ok:
        busy[r] = statistics.median(rec[3] for rec in ok[r][2][warmup:] or ok[r][2])
        waits[r] = statistics.median(rec[4] for rec in ok[r][2][warmup:] or ok[r][2])
    timelines = None
    if any(ok[r][2] and ok[r][2][0][5] is not None for r in ok):
        timelines = [[] for _ in names]
        for s in range(steps):
            t0 = min(ok[r][2][s][0] for r in ok)
            for r in sorted(ok):
                rec = ok[r][2][s]
                spans, last = [], rec[0]
                for node, start, end in rec[5]:
                    spans.append((node, (start if node < 0 else last) - t0, end - t0))
                    last = end
                timelines[r].append(spans)
    params: dict[str, torch.Tensor] | None = None
    if want_params:
        params = {}
        for r in sorted(ok):
            params.update({k: torch.from_numpy(v) for k, v in (ok[r][3] or {}).items()})
    return RunResult(
        step_times=step_times,
        warmup=min(warmup, max(0, steps - 1)),
        losses=losses,
        devices=names,
        params=params,
        bytes_sent=sum(ok[r][4] for r in ok),
        messages=sum(ok[r][5] for r in ok),
        worker_busy=busy,
        worker_wait=waits,
        timelines=timelines,
    )


def run_reference(
    step: TracedStep, steps: int, threads: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Run the unplaced traced step in this process (``threads`` intra-op threads, like the
    workers, so reductions round alike), node by node with the workers' interpreter:
    losses per step and final parameters."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _reference(step, steps)
    finally:
        torch.set_num_threads(old)


def _reference(step: TracedStep, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    params, bufs, states, inputs = step.initial_state()
    losses = []
    index = {n: i for i, n in enumerate(step.param_names)}
    interp = StepInterpreter(step.gm)
    pos = interp.position
    out_nodes = tree_flatten(interp.nodes[-1].args[0])[0]
    order = [index[(n.meta.get("custom") or {}).get("param")] for n in out_nodes[1:]]
    by_name = {n.name: i for i, n in enumerate(interp.nodes)}
    state_pos = [by_name[name] for name in step.state_nodes]
    for _ in range(steps):
        # every value is kept: the new optimizer state is read from its nodes, since the
        # step does not return it
        env = interp.walk([*params, *bufs, *states, *inputs])
        losses.append(float(env[pos[out_nodes[0]]]))
        for k, nn in zip(order, out_nodes[1:]):
            params[k] = env[pos[nn]].detach()
        states = [env[j].detach() for j in state_pos]
    return losses, {n: params[i] for n, i in index.items()}
