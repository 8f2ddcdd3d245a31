"""A torchrun job's ranks as forks of the test's own process, for the tests that check
what a plan computes rather than how torchrun starts and stops it.

``torchrun --standalone --nproc-per-node N -m meshplace.runtime ARGS`` starts torchrun's
agent and N fresh interpreters, each importing torch, DTensor and meshplace before its
first op: about 3 s of CPU a process, most of a small run's on this 2-core host. Here
each rank is a fork of the test's process (all of that already imported) that runs the
same entry point, :func:`meshplace.runtime.launch.main`, with the environment torchrun
gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...) and one thread, as ``meshplace run`` gives torchrun
(``OMP_NUM_THREADS=1``). The launch itself — ``meshplace run`` starting torchrun, its
rendezvous, two nodes, a rank killed mid-step — is tested through real torchrun
processes (tests/test_runtime_torchrun*.py)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _rank(rank: int, world: int, port: int, cwd: str, argv: list[str], logs: str) -> None:
    """One rank: torchrun's environment, its output to ``logs/rank{rank}.out|err``, then
    ``launch.main(argv)`` and out without interpreter finalisation (the test's process
    was forked mid-run; gloo's threads may still hold finished work)."""
    status = 1
    try:
        out = open(Path(logs) / f"rank{rank}.out", "w")  # noqa: SIM115 - kept to os._exit
        err = open(Path(logs) / f"rank{rank}.err", "w")  # noqa: SIM115
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = out, err
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        os.chdir(cwd)
        import torch

        # one thread: the host's cores are shared by the ranks, and the OpenMP pool of the
        # parent does not survive the fork
        torch.set_num_threads(1)
        from meshplace.runtime.launch import main

        status = main(argv)
    except BaseException:  # a rank's crash: its exit status and traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# What a rank imports on its way (most of it lazily, inside functions): imported here once
# per test process, so that no fork of it imports them again (torch's pipelining alone
# took ~3.7 s a rank)
RANK_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.export",
    "torch.nn.parallel",
    "meshplace.plan.placement",
    "meshplace.runtime.data_parallel",
    "meshplace.runtime.dryrun",
    "meshplace.runtime.hybrid",
    "meshplace.runtime.hybrid_plan",
    "meshplace.runtime.launch",
    "meshplace.runtime.pipelined",
    "meshplace.runtime.placed",
    "meshplace.runtime.sharded",
    "meshplace.runtime.spatial",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago (rank 0's store binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked_ranks(
    cwd: Path, world: int, *argv: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``python -m meshplace.runtime ARGV`` on ``world`` ranks of this host as torchrun
    would run it, each rank a fork of this process started in ``cwd``: the exit status
    (the first rank's in rank order that is not 0, else 0), rank 0's standard output (a
    report) and every rank's standard error, in the form ``subprocess.run`` returns. A
    job that outlives ``timeout`` seconds is killed and fails the test."""
    for module in RANK_MODULES:
        importlib.import_module(module)
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="meshplace-ranks-") as logs:
        port = free_port()
        ranks = [
            context.Process(target=_rank, args=(r, world, port, str(cwd), list(argv), logs))
            for r in range(world)
        ]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        for process in ranks:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, process in enumerate(ranks) if process.exitcode is None]
        for process in ranks:
            if process.exitcode is None:
                process.kill()
                process.join()
        read = [(Path(logs) / f"rank{r}.out", Path(logs) / f"rank{r}.err") for r in range(world)]
        stdout = read[0][0].read_text()
        stderr = "".join(err.read_text() for _out, err in read)
    assert not hung, f"ranks {hung} still running after {timeout} s:\n{stderr[-3000:]}"
    codes = [process.exitcode for process in ranks]
    status = next((code for code in codes if code != 0), 0)
    return subprocess.CompletedProcess(
        ["meshplace.runtime", *argv], status, stdout=stdout, stderr=stderr
    )
