"""Session-wide test settings.

The captured-graph cache (``meshplace.graph.sources``) lives in a temporary folder of this
run, shared by its xdist workers, so tests never read a graph cached by an earlier run
(which could hide a capture bug) nor write into the user's ``~/.cache``, while the suite
captures each reference workload once; subprocesses inherit the variable.
``tests/test_workloads.py`` captures with ``cache=False``, so capture itself always runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshplace.graph.sources import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def private_capture_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one folder for the run's workers (their base folders share a parent), so each
        # reference workload is captured once per run, not once per test file and worker
        folder = tmp_path_factory.getbasetemp().parent / "capture-cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("capture-cache")
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
