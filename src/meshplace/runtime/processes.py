"""The child processes meshplace starts (runtime workers, link micro-benchmark pairs):
they die with the process that started them, they are named, and the driver can tell a
stopped one from a busy one.

* :func:`die_with_parent` — called first thing in every child: asks the kernel to
  ``SIGKILL`` it when its parent dies (``prctl(PR_SET_PDEATHSIG)``; Linux), then checks
  that the parent is still the one that started it (the parent may have died between the
  start and the ``prctl``; the child then exits at once). So a ``SIGKILL`` of the
  ``meshplace run`` driver — which runs no clean-up — takes its workers with it, and the
  multiprocessing resource tracker, which exits when the last holder of its pipe is gone,
  follows them. The child's name (``ps -o comm``) becomes e.g. ``meshplace-w1``.
* :func:`process_state` / :func:`is_stopped` — the kernel's run state of a process
  (``/proc/PID/stat``): a worker stopped by ``SIGSTOP`` or a debugger (``T``/``t``) is
  named as such when the run stalls.
* :func:`stop_processes` — terminate, then kill, then join; stopped processes are killed
  at once (a stopped process cannot act on ``SIGTERM``).
* :func:`private_temp_folder` — a temporary folder removed with everything in it on every
  way out of the ``with`` block (success, error, ``KeyboardInterrupt``).
* :func:`one_rank_world` — this process as a gloo world of one on one thread, for the
  in-process measurements of an engine's own cost (DDP, FSDP2, DTensor, pipelining).

>>> process_state(os.getpid()) in ("R", "S", None)
True
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


class WorkerFailure(RuntimeError):
    """A worker process crashed, raised, hung or stopped. The message is one sentence
    naming the worker and the op; the attributes say the same for programs:

    ``worker`` (rank, or ``None`` when no single worker is to blame), ``device`` (the
    worker's device name), ``op`` (the fx node it was at, or ``None``), ``cause``
    (``"raised"``, ``"exited"``, ``"hung"``, ``"stopped"``, ``"setup"`` or ``"failed"``)
    and ``pids`` (the workers' process ids, all gone when the exception is raised).
    """

    def __init__(
        self,
        message: str,
        *,
        worker: int | None = None,
        device: str | None = None,
        op: str | None = None,
        cause: str = "failed",
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.device = device
        self.op = op
        self.cause = cause
        self.pids: list[int] = []

    def to_dict(self) -> dict[str, Any]:
        """The failure as a JSON object: ``error`` (the sentence), ``worker``, ``device``,
        ``op`` and ``cause``."""
        return {
            "error": str(self),
            "worker": self.worker,
            "device": self.device,
            "op": self.op,
            "cause": self.cause,
        }


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to load
        return None


def die_with_parent(parent_pid: int, name: str | None = None) -> bool:
    """Make this process receive ``SIGKILL`` when its parent ``parent_pid`` dies, and name
    it ``name`` (at most 15 bytes shown by ``ps``). Exits at once (``os._exit(1)``) if
    the parent is already gone. Returns ``False`` where the kernel has no parent-death
    signal (not Linux): the child then lives on if the parent is killed.

    Call it first thing in a child process. The signal follows the parent *thread* that
    started the child, so start children from a thread that outlives them (the runtime's
    driver joins its workers before it returns)."""
    libc = _libc()
    prctl = getattr(libc, "prctl", None) if libc is not None else None
    armed = False
    if prctl is not None:
        if name:
            prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        armed = prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    # the parent may have died before the prctl: then we have been re-parented already
    if os.getppid() != parent_pid:
        os._exit(1)
    return armed


def process_state(pid: int) -> str | None:
    """The kernel's one-letter run state of process ``pid`` (``R`` running, ``S``
    sleeping, ``D`` in uninterruptible I/O, ``T`` stopped by a signal, ``t`` stopped by a
    debugger, ``Z`` zombie), or ``None`` where ``/proc`` cannot tell (no such process, not
    Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the name (field 2) is in parentheses and may itself hold ") "; the state follows it
    after = stat.rpartition(b")")[2].split()
    return after[0].decode() if after else None


def is_stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP``, ``SIGTSTP`` or a debugger)."""
    return pid is not None and process_state(pid) in ("T", "t")


def stop_processes(procs: Sequence[Any], grace_s: float = 3.0) -> None:
    """Terminate, then kill, then join every started process of ``procs``
    (``multiprocessing.Process`` objects): none outlives the call. A stopped process is
    killed at once; the others get ``SIGTERM`` and ``grace_s`` seconds to exit."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if not p.is_alive():
            continue
        if is_stopped(p.pid):
            p.kill()
        else:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)


@contextlib.contextmanager
def private_temp_folder(prefix: str) -> Iterator[str]:
    """A new temporary folder (in ``$TMPDIR``), removed with its contents when the block
    ends, however it ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`KeyboardInterrupt` in the main thread,
    so ``finally`` clauses (stopping workers, removing temporary folders) run as they do
    for Ctrl-C. Outside the main thread the block changes nothing."""
    try:
        old = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def safe_start_method() -> str:
    """``fork`` (starts in milliseconds, imports nothing again) unless CUDA is initialised
    in this process, where only ``spawn`` is safe. Imports torch only when it already is
    (CUDA cannot be initialised otherwise)."""
    import sys

    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    if os.name != "posix" or cuda:
        return "spawn"
    return "fork"


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """This process as a ``torch.distributed`` world of one (gloo, a ``FileStore`` in a
    temporary folder) computing on one thread, for the ``with`` block; the process group
    destroyed and the thread count restored on every way out. What the engine-overhead
    measurements (``measure_ddp_overhead``, ``measure_fsdp_overhead``,
    ``measure_dispatch_overhead``, ``measure_engine_overhead``) run in: the engine's own
    work without another rank's. O(1).

    >>> import torch.distributed as dist
    >>> with one_rank_world():
    ...     dist.get_world_size()
    1
    >>> dist.is_initialized()
    False
    """
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            store = dist.FileStore(os.path.join(folder, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            try:
                yield
            finally:
                dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)
