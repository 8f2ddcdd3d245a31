"""Session-wide test settings.

The captured-graph cache (``meshplace.graph.sources``) lives in a temporary folder for the
whole run, so tests never read a graph cached by an earlier run (which could hide a capture
bug) nor write into the user's ``~/.cache``; subprocesses inherit the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshplace.graph.sources import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def private_capture_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("capture-cache")
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
