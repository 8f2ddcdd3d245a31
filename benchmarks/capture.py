"""Capture benchmark: time, peak memory, op and group counts for every reference workload.

Each workload is captured in a fresh Python process so its peak resident memory
(``ru_maxrss`` of that process) is its own. Writes ``benchmarks/results/capture.json`` and
prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/capture.py            # every workload and size
    .venv/bin/python benchmarks/capture.py gpt:124m   # just these
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, sys, time
start = time.perf_counter()
from meshplace.graph.sources import workload_graph
from meshplace.graph.summary import summarize
name, size = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
graph = workload_graph(name, size=size)
t1 = time.perf_counter()
s = summarize(graph)
t2 = time.perf_counter()
print(json.dumps({
    "workload": name, "size": size, "batch": graph.meta.get("batch"),
    "params": s["params"], "ops": s["ops"], "edges": s["edges"], "groups": s["groups"],
    "ops_by_phase": s["ops_by_phase"],
    "flops_forward": s["flops_forward"], "flops_total": s["flops_total"],
    "tokens": graph.meta.get("tokens"),
    "capture_s": t1 - t0, "group_s": t2 - t1, "import_s": t0 - start,
}))
"""


def run_one(name: str, size: str) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, size], stdout=subprocess.PIPE, text=True
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"capturing {name} {size} failed (exit {proc.returncode})")
    row = json.loads(out.strip().splitlines()[-1])
    row["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux reports KiB
    return row


def main(argv: list[str]) -> None:
    from meshplace import models

    wanted = [a.split(":", 1) for a in argv]
    todo = [
        (name, size)
        for name, sizes in models.available().items()
        for size in sizes
        if not wanted or [name, size] in wanted or [name] in wanted
    ]
    rows = []
    for name, size in todo:
        row = run_one(name, size)
        rows.append(row)
        print(f"captured {name} {size}: {row['capture_s']:.1f} s", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "capture.json", rows)
    print(
        "| workload | size | batch | params | ops (fwd/bwd/upd) | groups | fwd GFLOP "
        "| total/fwd | 6ND ratio | capture s | group s | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        phases = r["ops_by_phase"]
        split = "/".join(str(phases.get(p, 0)) for p in ("forward", "backward", "update"))
        six = f"{r['flops_total'] / (6 * r['params'] * r['tokens']):.3f}" if r["tokens"] else "–"
        print(
            f"| {r['workload']} | {r['size']} | {r['batch']} | {r['params'] / 1e6:,.2f} M "
            f"| {r['ops']:,} ({split}) | {r['groups']} | {r['flops_forward'] / 1e9:,.1f} "
            f"| {r['flops_total'] / r['flops_forward']:.3f} | {six} | {r['capture_s']:.2f} "
            f"| {r['group_s']:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} GiB |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
