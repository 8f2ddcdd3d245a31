"""Capture every reference workload and summarise it (``meshplace workloads``, ``make run``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import Progress

from meshplace import models
from meshplace.errors import InputError
from meshplace.graph.sources import workload_graph
from meshplace.graph.summary import summarize


def summarize_workloads(
    names: Sequence[str] = (), *, all_sizes: bool = False, console: Console | None = None
) -> list[dict[str, Any]]:
    """One summary per workload (default size, or every size), with its capture time:
    of the workloads ``names`` (default: every one). An unknown name is an
    :class:`InputError` naming the known ones."""
    available = models.available()
    unknown = [n for n in names if n not in available]
    if unknown:
        raise InputError(
            f"unknown workload {unknown[0]!r}; known workloads: {', '.join(sorted(available))}"
        )
    todo = [
        (name, size)
        for name in (dict.fromkeys(names) if names else available)  # the order asked for
        for size in (available[name] if all_sizes else available[name][:1])
    ]
    rows: list[dict[str, Any]] = []
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("capturing workloads", total=len(todo))
        for name, size in todo:
            progress.update(task, description=f"capturing {name} {size}")
            start = time.perf_counter()
            graph = workload_graph(name, size=size)
            elapsed = time.perf_counter() - start
            row = summarize(graph)
            row["capture_s"] = elapsed
            row["batch"] = graph.meta.get("batch")
            rows.append(row)
            progress.advance(task)
    return rows
