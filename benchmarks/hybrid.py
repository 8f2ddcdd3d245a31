"""Hybrid parallelism chosen jointly vs a Megatron-style grid, GPT 1.5B to 175B on 8 to
1,024 GPUs (issue 18).

For each GPT size, cluster (``h{N}-8xa100`` / ``h{N}-8xh100``: DGX-style hosts of 8 GPUs
behind NVSwitch, one 200 Gb/s NIC per GPU) and fixed global batch (sequences of 1,024
tokens, forward under bf16 autocast, Adam), :func:`meshplace.parallel.hybrid.hybrid_search`
(``compute="fused"``: point-wise chains and the optimizer fused, as Megatron-LM's kernels
and torch.compile run them) chooses data / tensor / pipeline degrees, the ZeRO stage, the
micro-batch size and count, the schedule and recomputation per stage. The same function
with ``style="megatron"`` is the grid a Megatron-LM user searches by hand: Megatron's
tensor-parallel pattern, equal stages, one recomputation for every stage, ZeRO 0 or 1,
scored by the same cost model and memory accounting. Columns: the chosen plan, its
simulated time per global batch, model FLOPs utilisation (the model's FLOPs per batch
without recomputation over time x GPUs x dense bf16 peak), the largest per-GPU memory
against capacity, and search seconds. **Simulated** by meshplace's cost model (roofline
with default efficiencies), not measured.

The two-layer captures each model needs are shared between rows (``--cold`` re-captures
every row); a separate, cold measurement runs the user's command for GPT-175B on 1,024
H100s (``meshplace shard gpt --size 175b --cluster h128-8xh100 --pipeline auto
--global-batch 1536 --compute fused --json``) in a subprocess and records its wall seconds.

Writes ``benchmarks/results/hybrid.json`` and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/hybrid.py [--quick] [--cold]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshplace.hardware import load_cluster
from meshplace.parallel.hybrid import HybridPlan, capture_layers, hybrid_search
from meshplace.parallel.sharding import ShardingError
from meshplace.provenance import write_result

# (size, hosts of 8 GPUs, global batch in sequences of 1,024 tokens)
ROWS = [
    ("1.5b", 1, 64),
    ("1.5b", 8, 512),
    ("6.7b", 8, 512),
    ("6.7b", 32, 1024),
    ("13b", 16, 1024),
    ("13b", 64, 1024),
    ("175b", 64, 1536),
    ("175b", 128, 1536),
]
QUICK_ROWS = [("1.5b", 1, 64), ("175b", 128, 1536)]
GPUS = ("a100", "h100")
OUT = Path(__file__).parent / "results" / "hybrid.json"


@functools.cache
def _graph(size: str, batch: int) -> Any:
    return capture_layers("gpt", size, 2, batch, "bf16")


def _point(plan: HybridPlan, search_s: float) -> dict[str, Any]:
    """The row's view of a plan: :meth:`HybridPlan.to_dict` without the per-stage lists,
    recomputation summarised, the largest memory per GPU and the search's seconds."""
    d = plan.to_dict()
    keep = ("dp", "tp", "pp", "micro_batch", "micro_batches", "schedule", "zero")
    keep += ("layers_per_stage", "time_per_batch_s", "mfu", "bubble_fraction", "capacity_bytes")
    kinds = sorted(set(plan.recompute))
    return {
        **{k: d[k] for k in keep},
        "recompute": kinds[0] if len(kinds) == 1 else "mixed",
        "recompute_stages": plan.recompute.count("full"),
        "max_memory_bytes": max(plan.stage_memory_bytes),
        "search_s": search_s,
    }


def run_row(size: str, hosts: int, batch: int, gpu: str, cold: bool) -> dict[str, Any]:
    cluster = load_cluster(f"h{hosts}-8x{gpu}")
    layers = {"1.5b": 48, "6.7b": 32, "13b": 40, "175b": 96}[size]
    row: dict[str, Any] = {
        "model": f"gpt {size}",
        "cluster": cluster.name,
        "gpus": hosts * 8,
        "global_batch": batch,
    }
    for style in ("joint", "megatron"):
        graphs = (
            (lambda b: capture_layers("gpt", size, 2, b, "bf16"))
            if cold
            else (lambda b: _graph(size, b))
        )
        start = time.perf_counter()
        try:
            result = hybrid_search(
                "gpt", size, cluster, global_batch=batch, style=style, graphs=graphs,
                layers=layers, compute="fused",
            )  # fmt: skip
            row[style] = _point(result.best, time.perf_counter() - start)
        except ShardingError as exc:
            row[style] = {"error": str(exc), "search_s": time.perf_counter() - start}
        print(f"{row['model']} {cluster.name} {style}: {row[style]}", file=sys.stderr)
    if "time_per_batch_s" in row["joint"] and "time_per_batch_s" in row["megatron"]:
        row["gain"] = 1 - row["joint"]["time_per_batch_s"] / row["megatron"]["time_per_batch_s"]
    return row


def cold_cli() -> dict[str, Any]:
    """The user's command for GPT-175B on 1,024 H100s, in a fresh process."""
    argv = [sys.executable, "-m", "meshplace.cli", "shard", "gpt", "--size", "175b"]
    argv += ["--cluster", "h128-8xh100", "--pipeline", "auto", "--global-batch", "1536"]
    argv += ["--compute", "fused", "--json"]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    data = json.loads(done.stdout)
    return {
        "command": " ".join(["meshplace", *argv[3:]]),
        "wall_s": wall,
        "search_s": data["search"]["seconds"],
        "best": data["best"]["label"],
    }


def _plan_text(p: dict[str, Any]) -> str:
    if "error" in p:
        return "no plan fits"
    rec = p["recompute"] if p["recompute"] != "mixed" else f"{p['recompute_stages']} stages"
    return (
        f"dp{p['dp']} tp{p['tp']} pp{p['pp']}, {p['micro_batches']}x{p['micro_batch']}, "
        f"{p['schedule']}, ZeRO-{p['zero']}, recompute {rec}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | GPUs | batch | joint plan | time / batch | MFU | memory / GPU | search | "
        "Megatron-style grid | time / batch | MFU | joint vs grid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        j, m = r["joint"], r["megatron"]

        def t(p: dict[str, Any]) -> str:
            return f"{p['time_per_batch_s']:.3f} s" if "time_per_batch_s" in p else "-"

        def u(p: dict[str, Any]) -> str:
            return f"{p['mfu']:.1%}" if "mfu" in p else "-"

        mem = (
            f"{j['max_memory_bytes'] / 2**30:.1f} / {j['capacity_bytes'] / 2**30:.0f} GiB"
            if "max_memory_bytes" in j
            else "-"
        )
        gain = f"{r['gain']:+.1%}" if "gain" in r else "-"
        lines.append(
            f"| {r['model']} | {r['gpus']} {r['cluster'].split('x')[-1].upper()} | "
            f"{r['global_batch']} | {_plan_text(j)} | {t(j)} | {u(j)} | {mem} | "
            f"{j['search_s']:.1f} s | {_plan_text(m)} | {t(m)} | {u(m)} | {gain} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rows, H100 only")
    parser.add_argument("--cold", action="store_true", help="capture afresh for every row")
    args = parser.parse_args()
    rows = []
    for size, hosts, batch in QUICK_ROWS if args.quick else ROWS:
        for gpu in ("h100",) if args.quick else GPUS:
            rows.append(run_row(size, hosts, batch, gpu, args.cold))
    cold = cold_cli()
    print(f"cold CLI: {cold}", file=sys.stderr)
    write_result(OUT, {"rows": rows, "cold_cli": cold})
    print(table(rows))
    print(
        f"\nCold command (`{cold['command']}`): {cold['wall_s']:.1f} s wall, "
        f"{cold['search_s']:.1f} s search; best {cold['best']}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
