"""Check the example models' parameter counts and training FLOPs against ``6 N T``.

For each ``FILE.py:FUNCTION`` it runs ``meshplace graph SPEC --json --out GRAPH`` (the
command line a user runs), builds the same model here to count ``sum(p.numel())``, and
prints one Markdown row: parameters (captured and counted, which must be equal), the N of
the rule of thumb, tokens per step, total FLOPs of the training step (forward, backward and
Adam update) over ``6 N T``, and the share of attention.

**Which N.** Kaplan et al. (2020, section 2.1) count training compute as ``6 N`` per token
with N the non-embedding parameters, because each multiplies every token once in the
forward pass (2 FLOPs) and twice in the backward pass (4 FLOPs). Here N is exactly that set
(:func:`active_params`): every parameter except the embedding tables that are only looked
up (input token and position embeddings); a table *tied* to the output projection is a
matmul weight for every output token and counts once; a mixture-of-experts expert's
weights count ``top_k / experts`` of their size (the active parameters). The ratio with all
parameters is printed too. What the rule leaves out, and so what a ratio above 1 is made
of: attention's score and value products (``6 n_layers seq d_attn`` per causal token,
Kaplan's Table 1; twice that for non-causal attention), norms, activations and the loss,
and the optimizer update (about 12 FLOPs per parameter per step, whatever the tokens).

Usage (``transformers`` importable for the Hugging Face models)::

    PYTHONPATH=/path/to/transformers python examples/flops_check.py
    python examples/flops_check.py examples/llama.py:build_7b examples/llama.py:build_70b
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

HERE = Path(__file__).resolve().parent

#: What ``python examples/flops_check.py`` checks without arguments.
DEFAULT_SPECS = (
    "examples/hf_models.py:gpt2",
    "examples/hf_models.py:llama",
    "examples/hf_models.py:mixtral",
    "examples/hf_models.py:t5",
    "examples/llama.py:build_7b",
    "examples/llama.py:build_70b",
)


def active_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts for ``6 N T``: ``total`` (every trainable parameter, what meshplace
    reports), ``matmul`` (without the embedding tables that are only looked up; a table
    shared with an ``nn.Linear``, a tied output projection, stays) and ``active``
    (``matmul`` with each expert weight — a parameter under a module path with an
    ``experts`` part — scaled by ``num_experts_per_tok / num_local_experts`` of the model's
    config)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear
    }
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = matmul = 0
    active = 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        total += p.numel()
        if id(p) in lookups:
            continue
        matmul += p.numel()
        expert = experts and top_k and "experts" in name.split(".")
        active += p.numel() * (top_k / experts if expert else 1.0)
    return {"total": total, "matmul": matmul, "active": round(active)}


def meshplace_command() -> list[str]:
    """The ``meshplace`` console script beside this Python (a virtualenv's ``bin``)."""
    script = Path(sys.executable).parent / "meshplace"
    return [str(script)] if script.exists() else ["meshplace"]


def graph_json(spec: str, out: Path | None = None, *, env: dict[str, str] | None = None) -> dict:
    """``meshplace graph SPEC --json [--out OUT]``'s JSON object (raises on failure)."""
    cmd = [*meshplace_command(), "graph", spec, "--json"]
    if out is not None:
        cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def attention_flops(graph: Any) -> float:
    """FLOPs of attention's score and value products, forward and backward: the fused
    attention ops, and the batched matmuls (``bmm``) inside an attention module — attention
    that runs unfused (T5's self-attention, whose trainable position bias the CPU kernel
    cannot take as a mask, or eager attention)."""
    total = 0.0
    for op in graph.ops:
        module = (op.module or "").lower()
        unfused = "bmm" in op.target and ("attn" in module or "attention" in module)
        if op.kind in ("attention", "attention_grad") or unfused:
            total += op.flops
    return total


def check(spec: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One row: ``spec`` captured through the CLI, its model built here and counted."""
    from meshplace.graph.io import load_graph
    from meshplace.graph.sources import load_build_function

    with tempfile.TemporaryDirectory(prefix="meshplace-flops-") as tmp:
        out = Path(tmp) / "graph.json"
        summary = graph_json(spec, out, env=env)
        graph = load_graph(out)
    model, _args, *rest = load_build_function(spec)()
    kwargs = rest[0] if rest else {}
    counts = active_params(model)
    labels = kwargs.get("labels") if isinstance(kwargs, dict) else None
    tokens = int(labels.numel()) if labels is not None else None
    total = float(summary["flops_total"])
    attention = attention_flops(graph)
    row: dict[str, Any] = {
        "spec": spec,
        "params": summary["params"],
        "params_counted": counts["total"],
        "params_exact": summary["params"] == counts["total"],
        "n_matmul": counts["matmul"],
        "n_active": counts["active"],
        "tokens": tokens,
        "flops_total": total,
        "flops_update": float(summary["flops_update"]),
        "flops_attention": attention,
        "capture_s": summary.get("capture_s"),
        "cache": (summary.get("cache") or {}).get("status"),
    }
    if tokens:
        six = 6.0 * counts["active"] * tokens
        row["ratio"] = total / six
        row["ratio_all_params"] = total / (6.0 * counts["total"] * tokens)
        row["ratio_without_attention"] = (total - attention) / six
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | params (captured) | = sum(numel) | N (active, no lookups) | tokens "
        "| total FLOPs | FLOPs / 6NT | with all params | attention share "
        "| without attention / 6NT | capture s |",
        "|---|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r["flops_attention"] / r["flops_total"] if r["flops_total"] else 0.0
        lines.append(
            f"| {r['spec']} | {r['params']:,} | {'yes' if r['params_exact'] else 'NO'} "
            f"| {r['n_active']:,} | {r['tokens'] or '–'} | {r['flops_total']:.4g} "
            f"| {_ratio(r, 'ratio')} | {_ratio(r, 'ratio_all_params')} | {share:.1%} "
            f"| {_ratio(r, 'ratio_without_attention')} | {r['capture_s']} |"
        )
    return "\n".join(lines)


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "–"


def main(argv: list[str]) -> int:
    """Check ``argv`` (or :data:`DEFAULT_SPECS`) and print the table; exit 1 when a
    parameter count differs or a ratio falls outside 1.0–1.15."""
    os.chdir(HERE.parent)
    rows = []
    for spec in argv or DEFAULT_SPECS:
        rows.append(check(spec))
        print(f"checked {spec}", file=sys.stderr)
    print(table(rows))
    bad = [
        r["spec"]
        for r in rows
        if not r["params_exact"] or ("ratio" in r and not 1.0 <= r["ratio"] <= 1.15)
    ]
    if bad:
        print(f"outside the acceptance: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
