"""The ``meshplace`` command run in a fork of the test's own process, for the tests that
check what a command prints, writes and exits with rather than how an interpreter starts.

A fresh ``meshplace`` process imports torch and the command line before its first line
of work: about 3 s of CPU, most of a small command's on this 2-core host, and the suite
ran some sixty of them. A fork starts with all of that imported. It is still a process
of its own: its standard output and error are file descriptors 1 and 2 of its own
(anything HiGHS or another library writes from C lands in them as it would from a fresh
process), its working folder and environment are the test's choice, it exits with the
command's status through :func:`os._exit`, and nothing it changes reaches the test's
process. What a fork cannot show is what a fresh interpreter does before the command
runs: the tests of importing (``tests/test_architecture.py``, the lazy-import tests), of
the console script and of signals (Ctrl-C, SIGTERM, SIGKILL) start real processes."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# What the commands import on their way (most of it lazily, inside functions): imported
# here once per test process, so that no fork of it imports them again
COMMAND_MODULES = (
    "torch",
    "highspy",
    "meshplace.cli",
    "meshplace.graph.sources",
    "meshplace.parallel.cli",
    "meshplace.placers",
    "meshplace.planning",
    "meshplace.profile.cli",
    "meshplace.report.cli",
    "meshplace.runtime.cli",
    "meshplace.sim.simulator",
)


def _child(
    entry: Callable[[list[str]], int],
    argv: list[str],
    cwd: str,
    env: dict[str, str] | None,
    logs: str,
) -> None:
    """The child: its own descriptors 0, 1 and 2, the test's folder and environment, then
    ``entry(argv)`` and out with its status without interpreter finalisation (the test's
    process was forked mid-run)."""
    status = 1
    try:
        out = open(Path(logs) / "out", "w")  # noqa: SIM115 - kept to os._exit
        err = open(Path(logs) / "err", "w")  # noqa: SIM115
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout, sys.stderr = out, err
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd)
        import torch

        # one thread: the parent's OpenMP pool does not survive the fork
        torch.set_num_threads(1)
        status = entry(argv)
    except SystemExit as exc:  # argparse's --help
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a crash: its traceback on the command's standard error
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_forked(
    entry: Callable[[list[str]], int],
    argv: Sequence[str],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> tuple[int | None, str, str]:
    """``entry(argv)`` (a command's ``main``) in a fork of this process, started in
    ``cwd`` (this process's working folder if ``None``) with environment ``env`` (this
    process's if ``None``): ``(exit status, standard output, standard error)``, the
    status ``None`` for a child that outlived ``timeout`` seconds and was killed."""
    with tempfile.TemporaryDirectory(prefix="meshplace-fork-") as logs:
        for name in ("out", "err"):  # there to read even if the child dies at once
            (Path(logs) / name).touch()
        child = multiprocessing.get_context("fork").Process(
            target=_child,
            args=(
                entry,
                list(argv),
                str(cwd or os.getcwd()),
                None if env is None else dict(env),
                logs,
            ),
        )
        child.start()
        child.join(timeout=timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            status = None
        else:
            status = child.exitcode
        return status, (Path(logs) / "out").read_text(), (Path(logs) / "err").read_text()


def _meshplace_main(argv: list[str]) -> int:
    from meshplace.cli import main

    return main(argv)


def run_meshplace(
    argv: Sequence[str | Path],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``meshplace ARGV`` (no program name) in a fork of this process (:func:`run_forked`),
    started in ``cwd`` (this process's working folder if ``None``) with environment
    ``env`` (this process's if ``None``): its exit status, standard output and standard
    error in the form ``subprocess.run`` returns with ``capture_output=True, text=True``.
    A command that outlives ``timeout`` seconds is killed and fails the test."""
    argv = [str(a) for a in argv]
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    started = time.monotonic()
    status, stdout, stderr = run_forked(_meshplace_main, argv, cwd=cwd, env=env, timeout=timeout)
    assert status is not None, (
        f"meshplace {' '.join(argv)} still running after {time.monotonic() - started:.0f} s:\n"
        f"{stderr[-3000:]}"
    )
    return subprocess.CompletedProcess(["meshplace", *argv], status, stdout, stderr)
