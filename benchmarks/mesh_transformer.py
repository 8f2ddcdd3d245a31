"""Mesh-TensorFlow's Transformer LMs on TPU-v3 meshes: our searched layout vs the hand layout.

Shazeer et al. (NeurIPS 2018, Sec. 6) grew the LM's feed-forward width and head count with
the number of cores (d_ff = 512 per core and heads = cores / 2 give their 4.9B model at 512:
d_ff 262,144, 256 heads of 256; d_model 1024, 6 layers, 32k vocabulary, batch 256 x 256
tokens) and laid it out by hand: batch over the mesh rows; d_ff, heads and vocabulary over
the columns (16x32 at 512). This script builds that family for 8 to 512 devices of the
simulated ``tpu-v3-pod`` (meshplace's devices are TPU-v3 *chips*, two cores each: "512" here is
512 chips, twice the paper's 512 cores), costs the hand layout (no weight-update sharding:
Mesh-TensorFlow had none) and runs :func:`meshplace.mesh.search` (1-2 mesh axes, with and
without weight-update sharding) — **simulated** step times from meshplace's cost model, not
measurements.

Each row also gets the **hybrid plan** (issue 18, :func:`meshplace.parallel.hybrid.hybrid_search`):
the same LM built in PyTorch (:class:`meshplace.models.transformer.MeshTransformerLM`,
the row's d_ff and heads), captured at micro-batches of 1, 2, 4 and 8 sequences, sharded
over tensor-parallel groups of up to 8 chips by the integer program, with data parallelism,
ZeRO, pipeline stages, micro-batches, schedule and recomputation chosen jointly; beside it
the best of those plans without a pipeline axis (one stage), scored by the same model, so
the table shows where a pipeline axis or recomputation helps. The hybrid plan is costed on
the captured graph (the sharding solver's cost model), the layouts above on the named
dimensions (``meshplace.mesh.cost``): the two columns are not the same model, and their
gap is reported as it is.

Writes ``benchmarks/results/mesh_transformer.json`` and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/mesh_transformer.py [--max-axes 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from meshplace.graph.capture import capture
from meshplace.graph.ir import OpGraph
from meshplace.hardware import load_cluster
from meshplace.mesh.program import transformer_lm
from meshplace.mesh.search import evaluate_layout, hand_layout, search
from meshplace.parallel.hybrid import HybridPlan, hybrid_search, simulate_plan
from meshplace.provenance import write_result

RESULTS = Path(__file__).resolve().parent / "results"
CHIPS = (8, 32, 128, 512)


def config(chips: int) -> dict[str, int]:
    """The paper's scaling: d_ff and heads grow with the device count (4.9B at 512)."""
    return {
        "batch": 256,
        "seq": 256,
        "d_model": 1024,
        "d_ff": 512 * chips,
        "heads": max(chips // 2, 1),
        "d_kv": 256,
        "layers": 6,
        "vocab": 32000,
    }


def lm_graph(chips: int, batch: int) -> OpGraph:
    """The row's LM in PyTorch on the meta device, one training step with Adam under bf16
    autocast, captured at ``batch`` sequences."""
    import torch

    from meshplace.models.base import token_ids
    from meshplace.models.transformer import Config, MeshTransformerLM

    c = config(chips)
    cfg = Config(
        c["d_model"], c["d_ff"], c["heads"], c["d_kv"], c["layers"], c["vocab"], 0.1, batch,
        c["seq"],
    )  # fmt: skip
    with torch.device("meta"):
        model = MeshTransformerLM(cfg, max_len=c["seq"])
    ids = (token_ids(batch, c["seq"]), token_ids(batch, c["seq"]))
    dims = {**c, "batch": batch}
    return capture(
        model, ids, training=True, name=f"mtf-lm-{chips}-b{batch}", dims=dims, autocast="bf16"
    )


def hybrid(chips: int, pod) -> dict:
    """The joint search's best plan for the row, and its best plan with one stage."""
    cfg = config(chips)
    graphs: dict[int, OpGraph] = {}

    def graph_at(batch: int) -> OpGraph:
        if batch not in graphs:
            graphs[batch] = lm_graph(chips, batch)
        return graphs[batch]

    start = time.perf_counter()
    result = hybrid_search(
        f"mtf-lm-{chips}",
        None,
        pod,
        global_batch=cfg["batch"],
        chips=chips,
        graphs=graph_at,
        layers=cfg["layers"],
    )
    seconds = time.perf_counter() - start
    one_stage = [p for p in result.plans if p.pp == 1]
    one_stage.sort(key=lambda p: (not p.fits, p.closed_form_s))
    flat = simulate_plan(one_stage[0]) if one_stage else None
    return {
        "best": _hybrid_entry(result.best),
        "one_stage": _hybrid_entry(flat) if flat is not None else None,
        "search_s": seconds,
        "sharding_solves": result.solves,
        "configurations": result.configurations,
    }


def _hybrid_entry(plan: HybridPlan) -> dict:
    entry = plan.to_dict()
    entry.pop("schedule_tasks", None)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-axes", type=int, default=2)
    args = parser.parse_args()
    pod = load_cluster("tpu-v3-pod")
    rows = []
    for chips in CHIPS:
        cfg = config(chips)
        prog = transformer_lm(cfg, name=f"mtf-lm-{chips}")
        shape, rules = hand_layout(prog, chips)
        hand = evaluate_layout(prog, pod, shape, rules)
        start = time.perf_counter()
        res = search(prog, pod, chips=chips, max_axes=args.max_axes)
        seconds = time.perf_counter() - start
        best = res.best
        no_wus = search(
            prog, pod, chips=chips, max_axes=args.max_axes, weight_update_sharding="off"
        ).best
        row = {
            "chips": chips,
            "params": prog.param_count(),
            "config": cfg,
            "hand": _entry(hand),
            "ours": _entry(best),
            "ours_without_wus": _entry(no_wus),
            "speedup": hand.step_time_s / best.step_time_s,
            "search_s": seconds,
            "layouts": res.legal,
            "hybrid": hybrid(chips, pod),
        }
        rows.append(row)
        print(
            f"{chips} chips: hand {hand.step_time_s * 1e3:.1f} ms, ours "
            f"{best.step_time_s * 1e3:.1f} ms ({best.mesh.label} {best.rules_label()}) "
            f"in {seconds:.2f} s; hybrid {row['hybrid']['best']['label']} "
            f"{row['hybrid']['best']['time_per_batch_s'] * 1e3:.1f} ms "
            f"in {row['hybrid']['search_s']:.1f} s",
            file=sys.stderr,
        )
    RESULTS.mkdir(exist_ok=True)
    write_result(
        RESULTS / "mesh_transformer.json",
        {"cluster": "tpu-v3-pod", "max_axes": args.max_axes, "rows": rows},
    )
    _markdown(rows)


def _entry(cost) -> dict:
    return {
        "mesh": cost.mesh.label,
        "rules": dict(sorted(cost.rules.items())),
        "weight_update_sharding": cost.weight_update_sharding,
        "step_time_s": cost.step_time_s,
        "peak_memory_bytes": cost.peak_memory_bytes,
        "fits": cost.fits,
        "exposed_comm_s": cost.exposed_comm_s,
    }


def _rules(e: dict) -> str:
    by_axis: dict[str, list[str]] = {}
    for dim, axis in e["rules"].items():
        by_axis.setdefault(axis, []).append(dim)
    text = "; ".join(f"{a}: {', '.join(d)}" for a, d in sorted(by_axis.items()))
    return f"{e['mesh']} ({text})" + (" +WUS" if e["weight_update_sharding"] else "")


def _markdown(rows: list[dict]) -> None:
    print("Mesh-TensorFlow Transformer LM on simulated TPU-v3 chips (tpu-v3-pod): step time,")
    print("peak memory per chip (32 GiB), fits; hand = batch over rows, d_ff/heads/vocab over")
    print("columns, no weight-update sharding (WUS); ours = best of the layout search (WUS")
    print('on or off); "ours w/o WUS" = the best layout with WUS off; search = seconds.\n')
    print(
        "| chips | params | hand layout | hand step | hand mem | fits | our layout | "
        "our step | our mem | fits | speed-up | ours w/o WUS | search |"
    )
    print("|---:|---:|---|---:|---:|:-:|---|---:|---:|:-:|---:|---:|---:|")
    for r in rows:
        h, o = r["hand"], r["ours"]
        print(
            f"| {r['chips']} | {r['params'] / 1e9:.2f} B | {_rules(h)} | "
            f"{h['step_time_s'] * 1e3:.1f} ms | {h['peak_memory_bytes'] / 2**30:.1f} GiB | "
            f"{'yes' if h['fits'] else 'no'} | {_rules(o)} | {o['step_time_s'] * 1e3:.1f} ms | "
            f"{o['peak_memory_bytes'] / 2**30:.1f} GiB | {'yes' if o['fits'] else 'no'} | "
            f"{r['speedup']:.2f}x | {r['ours_without_wus']['step_time_s'] * 1e3:.1f} ms | "
            f"{r['search_s']:.2f} s |"
        )
    print(
        "\nHybrid plans (the captured LM; pipeline x data x tensor x ZeRO x micro-batches x "
        "schedule x recomputation, tensor parallelism within 8 chips; the sharding solver's "
        "cost model): the best, and the best with one stage.\n"
    )
    print(
        "| chips | hybrid plan | stages (layers) | recompute | time per batch | MFU | "
        "memory / chip | one stage: plan | time per batch | pipeline gain | search |"
    )
    print("|---:|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        h = r["hybrid"]
        b, flat = h["best"], h["one_stage"]
        spans = "+".join(str(k) for k in b["layers_per_stage"])
        recompute = ",".join(sorted(set(b["recompute"])))
        gain = flat["time_per_batch_s"] / b["time_per_batch_s"] if flat else float("nan")
        print(
            f"| {r['chips']} | {b['label']} | {spans} | {recompute} | "
            f"{b['time_per_batch_s'] * 1e3:.1f} ms | {b['mfu'] * 100:.1f}% | "
            f"{max(b['stage_memory_bytes']) / 2**30:.1f} GiB | "
            f"{flat['label'] if flat else '–'} | "
            f"{flat['time_per_batch_s'] * 1e3 if flat else float('nan'):.1f} ms | "
            f"{gain:.2f}x | {h['search_s']:.1f} s |"
        )


if __name__ == "__main__":
    main()
