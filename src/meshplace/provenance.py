"""Where a benchmark number came from: the commit, the command, the machine.

Every script in ``benchmarks/`` writes its JSON through :func:`write_result`, which adds a
``provenance`` object, so a number quoted in the README can be traced to the code and the
command line that produced it (and re-run).

Example
-------
>>> p = provenance(["benchmarks/simulator_speed.py", "--ops", "1000"])
>>> p["command"]
'python benchmarks/simulator_speed.py --ops 1000'
>>> sorted(p) == sorted(["command", "commit", "dirty", "date_utc", "meshplace", "python",
...                      "torch", "cpus", "load_average", "keeps_freed_memory"])
True
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meshplace import __version__
from meshplace.hostmemory import keeps_freed_memory
from meshplace.util import dumps_strict_json, write_text_atomic

_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _code_state() -> tuple[str | None, bool | None]:
    """The checked-out commit and whether tracked files differ from it."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "HEAD"), (bool(status) if status is not None else None)


#: The code a benchmark runs is the code when it started (it imports this module first):
#: a commit made while a long benchmark runs must not be stamped on its results.
_AT_IMPORT = _code_state()


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The commit (and whether the tree had uncommitted changes) when this module was
    imported — when the benchmark started —, the command line, the time, the versions and
    the machine's load that a result was measured under."""
    argv = list(sys.argv if argv is None else argv)
    commit, dirty = _AT_IMPORT
    try:
        from importlib.metadata import version

        torch_version: str | None = version("torch")
    except Exception:
        torch_version = None
    return {
        "command": "python " + shlex.join(argv),
        "commit": commit,
        "dirty": dirty,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "meshplace": __version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        # glibc's malloc told to keep freed memory (meshplace.hostmemory), as meshplace's
        # runs are
        "keeps_freed_memory": keeps_freed_memory(),
    }


def write_result(path: str | Path, payload: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """Write a benchmark's ``payload`` to ``path`` (atomically, strict JSON) with a
    ``provenance`` object first; a list payload goes under ``rows``. Returns what was
    written."""
    body = {"rows": payload} if isinstance(payload, list) else dict(payload)
    body.pop("provenance", None)
    data = {"provenance": provenance(), **body}
    write_text_atomic(path, dumps_strict_json(data) + "\n")
    return data
