"""How much slower a kernel runs on one worker while the host's other workers compute too.

Why: meshplace calibrates op times on one process at a time (``meshplace.profile.
calibrate``), but a run of a sharded or pipelined plan on this host keeps every rank busy
at once, and the ranks share the host's caches and memory bandwidth (a GPU has its own
memory; CPU "devices" do not). If a kernel is slower while the others run, every
multi-rank prediction built on lone-process op times is low by that much (docs/runtime.md,
session 43, which also found that the placed family's in-situ ``compute_slowdown`` is not
this: its probes' workers seldom compute at the same time).

What: for each kernel below (one thread, torch), the median time per call in the main
process alone and while ``--workers - 1`` forked processes run the same kernel in a loop,
in ``--pairs`` alternating pairs (the host's speed drifts within seconds here); the
slowdown is the median of the pairs' ratios minus one. Kernels: a 256 x 256 matmul
(compute-bound), an element-wise ``x * 1.5 + x`` over 4 MiB (larger than a core's L2:
memory-bound), the same over 256 KiB (inside L2) and over 16 floats (Python and
dispatch-bound).

Usage: ``.venv/bin/python benchmarks/host_contention.py [--workers 2] [--pairs 5]
[--out F.json]`` (about 30 s); writes ``benchmarks/results/host_contention.json`` and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshplace.provenance import write_result


def _kernel(name: str) -> Callable[[], object]:
    torch.set_num_threads(1)
    if name == "matmul 256x256":
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        return lambda: a @ b
    floats = {
        "elementwise 4 MiB": 1 << 20,
        "elementwise 256 KiB": 1 << 16,
        "elementwise 16 floats": 16,
    }
    x = torch.randn(floats[name])
    return lambda: x * 1.5 + x


KERNELS = ("matmul 256x256", "elementwise 4 MiB", "elementwise 256 KiB", "elementwise 16 floats")


def _spin(name: str, stop: object) -> None:
    run = _kernel(name)
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(20):
            run()


def _time_per_call(run: Callable[[], object], seconds: float = 0.3) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            run()
        calls += 10
    return (time.perf_counter() - start) / calls


def measure(name: str, workers: int, pairs: int) -> dict:
    """Alone and busy times of kernel ``name`` (module doc)."""
    context = mp.get_context("fork")
    run = _kernel(name)
    _time_per_call(run, 0.2)  # warm up
    alone, busy = [], []
    for _ in range(pairs):
        alone.append(_time_per_call(run))
        stop = context.Event()
        others = [context.Process(target=_spin, args=(name, stop)) for _ in range(workers - 1)]
        for p in others:
            p.start()
        time.sleep(0.2)  # the others reach their loop
        busy.append(_time_per_call(run))
        stop.set()
        for p in others:
            p.join()
    return {
        "kernel": name,
        "alone_s": statistics.median(alone),
        "busy_s": statistics.median(busy),
        "slowdown": statistics.median(b / a for a, b in zip(alone, busy, strict=True)) - 1,
        "pairs_alone_s": alone,
        "pairs_busy_s": busy,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="busy workers, this one included")
    parser.add_argument("--pairs", type=int, default=5, help="alternating alone/busy pairs")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "host_contention.json")
    )
    args = parser.parse_args(argv)
    if args.workers < 2 or args.pairs < 1:
        print(
            "host_contention.py: --workers must be at least 2 and --pairs at least 1",
            file=sys.stderr,
        )
        return 2
    rows = [measure(name, args.workers, args.pairs) for name in KERNELS]
    print(f"| kernel (one thread) | alone | {args.workers} workers busy | slowdown |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['alone_s'] * 1e6:.1f} us | {r['busy_s'] * 1e6:.1f} us "
            f"| {100 * r['slowdown']:+.0f} % |"
        )
    write_result(args.out, {"workers": args.workers, "pairs": args.pairs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
