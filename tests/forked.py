"""A training process killed with SIGKILL part-way, for the resume tests of
tests/test_learn.py, tests/test_learn_hrl.py and tests/test_cli_learn.py.

The process is a fork of the test's own: it starts with torch and meshplace imported,
where a fresh interpreter importing them again was most of those tests' time. It is
killed as a crashed or OOM-killed process ends: no clean-up at all."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any


def _child(target: Callable[..., None], news: int, args: tuple[Any, ...]) -> None:
    import torch

    # one thread: the parent's OpenMP pool does not survive the fork
    torch.set_num_threads(1)
    target(news, *args)
    os._exit(0)  # no interpreter finalisation (the test's process was forked mid-run)


def killed_after_news(target: Callable[..., None], *args: Any) -> str:
    """Run ``target(news, *args)`` in a forked process, read the first line it writes to
    the file descriptor ``news`` (``""`` if it ends without one), then kill it with
    SIGKILL; that line. The process must end by that signal."""
    news, child_end = os.pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(target, child_end, args)
    )
    child.start()
    os.close(child_end)  # so that the read below ends if the child dies without a word
    try:
        with os.fdopen(news) as messages:
            line = messages.readline()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL, (child.exitcode, line)
    return line
