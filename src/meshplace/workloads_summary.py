"""Capture every reference workload and summarise it (``meshplace workloads``, ``make run``)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import Progress

from meshplace import models
from meshplace.graph.sources import workload_graph
from meshplace.graph.summary import summarize


def summarize_workloads(
    *, all_sizes: bool = False, console: Console | None = None
) -> list[dict[str, Any]]:
    """One summary per workload (default size, or every size), with its capture time."""
    todo = [
        (name, size)
        for name, sizes in models.available().items()
        for size in (sizes if all_sizes else sizes[:1])
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
