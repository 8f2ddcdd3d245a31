"""MLPerf-0.6-style scaling on a simulated TPU-v3 pod: weight-update sharding, spatial partitioning.

Kumar et al., "Scale MLPerf-0.6 models on Google TPU-v3 Pods" (2019), scaled ResNet-50 and
Transformer data-parallel to 1,024 chips with **weight-update sharding** (reduce-scatter the
gradients, update 1/N of the weights and optimizer state, all-gather the weights) and SSD /
Mask R-CNN with **spatial partitioning** (image height split over chips, halo exchange).
This script reproduces the shape of those studies with meshplace's cost model on the
``tpu-v3-pod`` preset (32x32 torus, 100 GB/s links) — **simulated** step times:

- ResNet-50 (LARS), 32 images per chip (32,768 at 1,024 chips, the MLPerf batch), data
  parallel over all chips, weight-update sharding off and on;
- Transformer-big (Adam), a fixed global batch of 2,048 sentence pairs of 128 + 128 tokens
  (the "limited data parallelism" case: fewer sentences per chip as chips grow), data
  parallel, weight-update sharding off and on;
- a detection-style conv net (1024x1024 images, global batch 128: see
  :func:`meshplace.mesh.program.detection`): data parallel only (impossible beyond 128
  chips) vs the best layout found over batch, height and width on 1-2 mesh axes
  (weight-update sharding on or off).

Per-chip throughput is samples / step / chips; scaling efficiency is the per-chip
throughput relative to the same configuration on 16 chips.

ResNet-50 and Transformer-big also get the **hybrid plan** of each row (issue 18,
:func:`meshplace.parallel.hybrid.hybrid_search`): the PyTorch model captured at a few
micro-batch sizes (ResNet-50: 8, 16, 32 images; Transformer-big: 2 to 32 sentence pairs),
sharded over tensor-parallel groups of up to 8 chips, cut into pipeline stages between its
units (ResNet's bottleneck blocks, the encoder's and the decoder's layers, and the ops
around them), with data parallelism, ZeRO, micro-batches, schedule and recomputation
chosen jointly — and the best of those plans with one stage beside it, so the table shows
where a pipeline axis or recomputation helps. The hybrid plans are costed on the captured
graph by the sharding solver's model, the rows above on the named dimensions
(``meshplace.mesh.cost``): compare within a table, not across them. The detection net
exists only as a named-dimension program and gets no hybrid plan.

Writes
``benchmarks/results/mlperf_scaling.json`` and prints Markdown tables.

Usage::

    .venv/bin/python benchmarks/mlperf_scaling.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph
from meshplace.graph.sources import graph_source
from meshplace.hardware import load_cluster
from meshplace.mesh.program import program_for
from meshplace.mesh.search import evaluate_layout, search
from meshplace.parallel.hybrid import hybrid_search, simulate_plan
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
CHIPS = (16, 32, 64, 128, 256, 512, 1024)


def _point(cost, chips: int) -> dict:
    return {
        "mesh": cost.mesh.label,
        "rules": dict(sorted(cost.rules.items())),
        "weight_update_sharding": cost.weight_update_sharding,
        "step_time_s": cost.step_time_s,
        "samples_per_s_per_chip": cost.samples / cost.step_time_s / chips,
        "update_s": cost.compute_s["update"],
        "exposed_comm_s": cost.exposed_comm_s,
        "peak_memory_bytes": cost.peak_memory_bytes,
        "fits": cost.fits,
    }


HYBRID_MICRO_BATCHES = {"resnet50": (8, 16, 32), "transformer": (2, 4, 8, 16, 32)}


def hybrid_rows(model: str, size: str | None, batch_of) -> list[dict]:
    """The hybrid plan of every row (module docstring), the sharding solves shared by the
    rows (they depend on the tensor-parallel group and the micro-batch only)."""
    pod = load_cluster("tpu-v3-pod")

    @functools.cache
    def graph_at(batch: int) -> OpGraph:
        return graph_source(model, batch=batch, size=size, training=True, autocast="bf16").graph

    solved: dict = {}
    rows = []
    for chips in CHIPS:
        start = time.perf_counter()
        result = hybrid_search(
            model, size, pod, global_batch=batch_of(chips), chips=chips,
            micro_batch_sizes=HYBRID_MICRO_BATCHES[model], graphs=graph_at, solved=solved,
        )  # fmt: skip
        best = result.best
        flat = sorted(
            (p for p in result.plans if p.pp == 1), key=lambda p: (not p.fits, p.closed_form_s)
        )
        one_stage = simulate_plan(flat[0]) if flat else None
        rows.append(
            {
                "chips": chips,
                "batch": batch_of(chips),
                "units": len(result.units),
                "best": _hybrid_point(best, batch_of(chips), chips),
                "one_stage": _hybrid_point(one_stage, batch_of(chips), chips)
                if one_stage
                else None,
                "search_s": time.perf_counter() - start,
                "sharding_solves": result.solves,
            }
        )
        print(
            f"{model} {chips} hybrid: {best.config.label} "
            f"{best.time_per_batch_s * 1e3:.2f} ms ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
        )
    return rows


def _hybrid_point(plan, batch: int, chips: int) -> dict:
    entry = {k: v for k, v in plan.to_dict().items() if k != "schedule_tasks"}
    entry["samples_per_s_per_chip"] = batch / plan.time_per_batch_s / chips
    return entry


def data_parallel(model: str, size: str | None, batch_of) -> list[dict]:
    pod = load_cluster("tpu-v3-pod")
    rows = []
    for chips in CHIPS:
        prog = program_for(model, size=size, batch=batch_of(chips))
        row = {"chips": chips, "batch": batch_of(chips)}
        for wus in (False, True):
            cost = evaluate_layout(prog, pod, (chips,), {"batch": "x"}, weight_update_sharding=wus)
            row["wus" if wus else "no_wus"] = _point(cost, chips)
        row["wus_gain"] = 1 - row["wus"]["step_time_s"] / row["no_wus"]["step_time_s"]
        rows.append(row)
        print(
            f"{model} {chips}: {row['no_wus']['step_time_s'] * 1e3:.2f} -> "
            f"{row['wus']['step_time_s'] * 1e3:.2f} ms",
            file=sys.stderr,
        )
    _efficiency(rows, ("no_wus", "wus"))
    return rows


def spatial(batch: int = 128) -> list[dict]:
    pod = load_cluster("tpu-v3-pod")
    prog = program_for("detection", batch=batch)
    rows = []
    for chips in CHIPS:
        row: dict = {"chips": chips, "batch": batch}
        if batch % chips == 0:
            dp = min(
                (
                    evaluate_layout(prog, pod, (chips,), {"batch": "x"}, weight_update_sharding=w)
                    for w in (False, True)
                ),
                key=lambda c: c.step_time_s,
            )
            row["data_parallel"] = _point(dp, chips)
        else:
            row["data_parallel"] = None
        try:
            best = search(prog, pod, chips=chips, max_axes=2).best
            row["spatial"] = _point(best, chips)
        except InputError as exc:
            row["spatial"] = None
            row["error"] = str(exc)
        rows.append(row)
        print(f"detection {chips}: {row.get('spatial')}", file=sys.stderr)
    _efficiency(rows, ("data_parallel", "spatial"))
    return rows


def _efficiency(rows: list[dict], keys: tuple[str, ...]) -> None:
    for key in keys:
        base = next((r[key] for r in rows if r.get(key)), None)
        for r in rows:
            if r.get(key) and base:
                r[key]["efficiency"] = (
                    r[key]["samples_per_s_per_chip"] / base["samples_per_s_per_chip"]
                )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    results = {
        "cluster": "tpu-v3-pod",
        "resnet50": data_parallel("resnet50", None, lambda n: 32 * n),
        "transformer_big": data_parallel("transformer", "big", lambda n: 2048),
        "detection": spatial(),
        "hybrid": {
            "resnet50": hybrid_rows("resnet50", None, lambda n: 32 * n),
            "transformer_big": hybrid_rows("transformer", "big", lambda n: 2048),
        },
    }
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "mlperf_scaling.json", results)
    _markdown(results)
    _hybrid_markdown(results)


def _ms(p: dict | None) -> str:
    return f"{p['step_time_s'] * 1e3:.2f} ms" if p else "–"


def _thr(p: dict | None) -> str:
    return f"{p['samples_per_s_per_chip']:,.1f}" if p else "–"


def _eff(p: dict | None) -> str:
    return f"{p['efficiency'] * 100:.0f}%" if p and "efficiency" in p else "–"


def _hybrid_markdown(res: dict) -> None:
    print(
        "\n**Hybrid plans** (the captured PyTorch model; data x tensor x pipeline x ZeRO x "
        "micro-batches x schedule x recomputation; the sharding solver's cost model)\n"
    )
    print(
        "| model | chips | batch | hybrid plan | stages (units) | recompute | step | "
        "samples/s/chip | one stage: plan | step | pipeline gain | search |"
    )
    print("|---|---:|---:|---|---|---|---:|---:|---|---:|---:|---:|")
    for key, title in (("resnet50", "ResNet-50"), ("transformer_big", "Transformer-big")):
        for r in res["hybrid"][key]:
            b, flat = r["best"], r["one_stage"]
            gain = flat["time_per_batch_s"] / b["time_per_batch_s"] if flat else float("nan")
            print(
                f"| {title} | {r['chips']} | {r['batch']:,} | {b['label']} | "
                f"{'+'.join(map(str, b['layers_per_stage']))} | "
                f"{','.join(sorted(set(b['recompute'])))} | {_ms_batch(b)} | {_thr(b)} | "
                f"{flat['label'] if flat else '–'} | {_ms_batch(flat)} | {gain:.2f}x | "
                f"{r['search_s']:.1f} s |"
            )


def _ms_batch(p: dict | None) -> str:
    return f"{p['time_per_batch_s'] * 1e3:.2f} ms" if p else "–"


def _markdown(res: dict) -> None:
    print("Simulated on tpu-v3-pod (meshplace cost model); efficiency = per-chip throughput")
    print("relative to 16 chips; WUS = weight-update sharding.\n")
    for key, title, unit in (
        ("resnet50", "ResNet-50, 32 images per chip, data parallel", "images/s/chip"),
        (
            "transformer_big",
            "Transformer-big, global batch 2,048, data parallel",
            "sentences/s/chip",
        ),
    ):
        print(f"**{title}**\n")
        print(
            f"| chips | batch | step (no WUS) | step (WUS) | WUS gain | {unit} (no WUS) | "
            f"{unit} (WUS) | efficiency (no WUS) | efficiency (WUS) | update no WUS -> WUS |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res[key]:
            a, b = r["no_wus"], r["wus"]
            print(
                f"| {r['chips']} | {r['batch']:,} | {_ms(a)} | {_ms(b)} | "
                f"{r['wus_gain'] * 100:.1f}% | {_thr(a)} | {_thr(b)} | {_eff(a)} | {_eff(b)} | "
                f"{a['update_s'] * 1e3:.2f} -> {b['update_s'] * 1e3:.2f} ms |"
            )
        print()
    print("**Detection-style net (1024x1024 images), global batch 128**\n")
    print(
        "| chips | step (data parallel) | images/s/chip | efficiency | best layout | "
        "step (best) | images/s/chip | efficiency | exposed comm |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in res["detection"]:
        dp, sp = r["data_parallel"], r["spatial"]
        layout = "–"
        if sp:
            by_axis: dict[str, list[str]] = {}
            for dim, axis in sp["rules"].items():
                by_axis.setdefault(axis, []).append(dim)
            layout = (
                sp["mesh"]
                + " ("
                + "; ".join(f"{a}: {', '.join(d)}" for a, d in sorted(by_axis.items()))
                + ")"
                + (" +WUS" if sp["weight_update_sharding"] else "")
            )
        print(
            f"| {r['chips']} | {_ms(dp)} | {_thr(dp)} | {_eff(dp)} | {layout} | {_ms(sp)} | "
            f"{_thr(sp)} | {_eff(sp)} | "
            f"{(sp['exposed_comm_s'] * 1e3 if sp else 0):.2f} ms |"
        )


if __name__ == "__main__":
    main()
