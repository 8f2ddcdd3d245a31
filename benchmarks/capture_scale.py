"""Capture at scale: CPU time and peak memory to capture Llama-style 7B and 70B configs.

Issue 16's targets: a 7B-parameter model captures in at most 10 s of CPU and 1 GiB, a 70B
config in at most 30 s and 2 GiB. Each config (``examples/llama.py``: Llama-2-7B and
Llama-2-70B shapes, built on the meta device, one sequence of 4096 tokens, training step
with Adam) is captured in a fresh Python process, and that process's own resource usage is
read when it ends (``os.wait4``): CPU seconds (user + system) and peak resident memory
(``ru_maxrss``). The whole process is what a user waits for (importing torch and meshplace
included); the child also reports the CPU seconds of the build and of ``capture()`` alone.
CPU time moves with the load on a shared machine (caches, frequency, hyper-threads), so each
config runs ``--repeat`` times (default 3): the table shows the median (judged against the
target) and the range, the JSON every run.

Writes ``benchmarks/results/capture_scale.json`` (with provenance) and prints a Markdown
table.

Usage::

    .venv/bin/python benchmarks/capture_scale.py                 # 7B and 70B
    .venv/bin/python benchmarks/capture_scale.py build_7b        # just one
    .venv/bin/python benchmarks/capture_scale.py --repeat 5      # more runs per config
    .venv/bin/python benchmarks/capture_scale.py --profile       # cProfile the 7B capture
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from meshplace.provenance import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = ROOT / "examples" / "llama.py"

#: (build function in examples/llama.py, label, CPU-seconds target, peak-RSS target in GiB)
CONFIGS: tuple[tuple[str, str, float, float], ...] = (
    ("build_7b", "Llama-2-7B", 10.0, 1.0),
    ("build_70b", "Llama-2-70B", 30.0, 2.0),
)

CHILD = r"""
import json, resource, sys, time

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

start = cpu()
from meshplace.graph.capture import capture
from meshplace.graph.sources import load_build_function
spec, profile = sys.argv[1], sys.argv[2] == "1"
t0 = cpu()
model, args, kwargs = load_build_function(spec)()
t1 = cpu()
if profile:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
graph = capture(model, args, example_kwargs=kwargs, name="llama")
if profile:
    prof.disable()
    stats = pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime")
    stats.print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
t2 = cpu()
print(json.dumps({
    "params": graph.meta["params"], "ops": graph.num_ops,
    "flops_total": float(sum(op.flops for op in graph.ops)),
    "import_cpu_s": t0 - start, "build_cpu_s": t1 - t0, "capture_cpu_s": t2 - t1,
}))
"""


def run_one(fn: str, *, profile: bool = False) -> dict[str, Any]:
    """Capture ``examples/llama.py:fn`` in a child process; its result and resource use."""
    spec = f"{EXAMPLE}:{fn}"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, spec, "1" if profile else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"capturing {spec} failed (exit {code})")
    row = json.loads(out.strip().splitlines()[-1])
    row["cpu_s"] = usage.ru_utime + usage.ru_stime
    row["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux reports KiB
    return row


def main(argv: list[str]) -> None:
    """Capture the configs named in ``argv`` (default: all) ``--repeat N`` times each,
    write the JSON, print the table; ``--profile`` prints cProfile's top functions of the
    7B capture instead."""
    if "--profile" in argv:
        run_one("build_7b", profile=True)
        return
    repeat = 3
    if "--repeat" in argv:
        at = argv.index("--repeat")
        repeat = max(1, int(argv[at + 1]))
        argv = argv[:at] + argv[at + 2 :]
    wanted = [c for c in CONFIGS if not argv or c[0] in argv]
    rows = []
    for fn, label, cpu_target, rss_target in wanted:
        runs = [run_one(fn) for _ in range(repeat)]
        row = dict(runs[0])
        for key in ("cpu_s", "capture_cpu_s", "import_cpu_s", "build_cpu_s", "peak_rss_bytes"):
            row[key] = statistics.median(r[key] for r in runs)
        row.update(
            config=label,
            spec=f"examples/llama.py:{fn}",
            cpu_s_runs=[r["cpu_s"] for r in runs],
            peak_rss_bytes_runs=[r["peak_rss_bytes"] for r in runs],
            target_cpu_s=cpu_target,
            target_peak_rss_gib=rss_target,
            meets_target=row["cpu_s"] <= cpu_target and row["peak_rss_bytes"] <= rss_target * 2**30,
        )
        rows.append(row)
        print(f"captured {label}: {row['cpu_s']:.1f} s CPU (median)", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "capture_scale.json", rows)
    print(
        "| config | params | ops | CPU s (process, median) | range | of which capture() "
        "| import | build | peak RSS | target | meets |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|:-:|")
    for r in rows:
        print(
            f"| {r['config']} | {r['params'] / 1e9:.2f} B | {r['ops']:,} | {r['cpu_s']:.1f} "
            f"| {min(r['cpu_s_runs']):.1f}–{max(r['cpu_s_runs']):.1f} "
            f"| {r['capture_cpu_s']:.1f} | {r['import_cpu_s']:.1f} | {r['build_cpu_s']:.1f} "
            f"| {r['peak_rss_bytes'] / 2**30:.2f} GiB "
            f"| ≤ {r['target_cpu_s']:g} s, ≤ {r['target_peak_rss_gib']:g} GiB "
            f"| {'yes' if r['meets_target'] else 'no'} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
