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

Writes ``benchmarks/results/mesh_transformer.json`` and prints a Markdown table.

Usage::

    .venv/bin/python benchmarks/mesh_transformer.py [--max-axes 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from meshplace.hardware import load_cluster
from meshplace.mesh.program import transformer_lm
from meshplace.mesh.search import evaluate_layout, hand_layout, search
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
        }
        rows.append(row)
        print(
            f"{chips} chips: hand {hand.step_time_s * 1e3:.1f} ms, ours "
            f"{best.step_time_s * 1e3:.1f} ms ({best.mesh.label} {best.rules_label()}) "
            f"in {seconds:.2f} s",
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


if __name__ == "__main__":
    main()
