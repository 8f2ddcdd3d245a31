"""Assemble one self-contained HTML page from a result JSON.

The page has no script and loads nothing: styles are inline, charts are inline SVG from
:mod:`meshplace.report.charts`, tooltips are SVG ``<title>`` elements. Which sections it has
depends on what the JSON is (:func:`result_kind`):

* ``plan`` — ``meshplace plan --result`` / ``--json``: placer comparison, and for the best
  plan (key ``best_plan``, see :func:`meshplace.planning.best_plan_details`) its timeline,
  memory per device and the placed group graph; learning curves when the optional
  ``learning_curves`` key (``[{placer, evaluations[], best_step_time_s[]}]``) is present;
* ``shard`` — ``meshplace shard --json`` / ``--out``: mesh and layout, step-time and memory
  breakdowns, the collectives, runner-up layouts;
* ``mlperf_scaling`` / ``mesh_transformer`` — the benchmark JSON under
  ``benchmarks/results/``: scaling curves.

Example
-------
>>> page = render_html({"lower_bound_s": 1.0, "best": None, "graph": "g", "cluster": "c",
...                     "results": [{"placer": "single", "objective_value_s": 2.0,
...                                  "oom": True, "oom_devices": ["gpu0"]}]})
>>> page.startswith("<!DOCTYPE html>") and 'id="chart-comparison"' in page
True
>>> result_kind({"rows": []})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
meshplace.report.html.ReportError: the JSON is neither a plan result ...
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from meshplace import __version__
from meshplace.errors import InputError
from meshplace.report.charts import (
    BAR,
    BEST,
    bar_chart,
    comparison_chart,
    group_graph_chart,
    line_chart,
    memory_chart,
    schedule_chart,
    stacked_bar_chart,
    timeline_chart,
)
from meshplace.report.svg import FONT, OOM_RED, esc, fmt_bytes, fmt_seconds


class ReportError(InputError):
    """A JSON the report cannot draw."""


CSS = f"""
body {{ font-family: {FONT}; margin: 0; background: #fafafa; color: #222;
       font-size: 15px; line-height: 1.45; }}
main {{ max-width: 1240px; margin: 0 auto; padding: 24px 20px 60px; }}
h1 {{ font-size: 26px; margin: 0 0 6px; }}
h2 {{ font-size: 20px; margin: 34px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }}
p.note {{ color: #555; margin: 4px 0 10px; max-width: 1000px; }}
section {{ background: #fff; border: 1px solid #e4e4e4; border-radius: 6px;
          padding: 8px 16px 14px; margin: 18px 0; overflow-x: auto; }}
figure {{ margin: 6px 0; }}
svg.chart {{ display: block; max-width: 100%; height: auto; }}
.legend {{ margin: 6px 0 2px; font-size: 13px; }}
.legend-title {{ font-weight: 600; margin-right: 8px; }}
.key {{ display: inline-block; margin: 2px 14px 2px 0; white-space: nowrap; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; border: 1px solid #666;
          vertical-align: -1px; margin-right: 5px; }}
table {{ border-collapse: collapse; font-size: 14px; margin: 6px 0; }}
th, td {{ text-align: left; padding: 3px 12px 3px 0; border-bottom: 1px solid #eee; }}
th {{ color: #444; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.bad {{ color: {OOM_RED}; font-weight: 600; }}
footer {{ color: #777; font-size: 12px; margin-top: 30px; }}
"""

SCALING_KEYS = ("resnet50", "transformer_big", "detection")


def result_kind(result: Any) -> str:
    """``plan``, ``shard``, ``hybrid``, ``mlperf_scaling`` or ``mesh_transformer``; else
    ReportError."""
    if isinstance(result, dict):
        if result.get("method") == "hybrid" and isinstance(result.get("best"), dict):
            return "hybrid"
        if isinstance(result.get("results"), list) and "lower_bound_s" in result:
            return "plan"
        if {"mesh", "rules", "step_time_s", "collectives"} <= set(result):
            return "shard"
        if any(_rows_with(result.get(k), "chips") for k in SCALING_KEYS):
            return "mlperf_scaling"
        rows = result.get("rows")
        if _rows_with(rows, "chips") and all("ours" in r for r in rows):
            return "mesh_transformer"
    raise ReportError(
        "the JSON is neither a plan result (meshplace plan --result), a shard result "
        "(meshplace shard --json, with or without --pipeline auto) nor a known benchmark "
        "(mlperf_scaling.json, mesh_transformer.json)"
    )


def _rows_with(rows: Any, key: str) -> bool:
    return (
        isinstance(rows, list)
        and bool(rows)
        and all(isinstance(r, dict) and key in r for r in rows)
    )


def _section(sid: str, title: str, note: str, body: str) -> str:
    return (
        f'<section id="{esc(sid)}"><h2>{esc(title)}</h2>'
        + (f'<p class="note">{note}</p>' if note else "")
        + f"<figure>{body}</figure></section>"
    )


def _page(title: str, subtitle: str, sections: list[str]) -> str:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>"
        f'<h1>{esc(title)}</h1><p class="note">{subtitle}</p>'
        + "".join(sections)
        + f"<footer>meshplace {esc(__version__)} · generated {stamp} · self-contained: "
        "no scripts, no network. Hover a bar, span or node for details.</footer>"
        "</main></body></html>\n"
    )


def render_html(result: dict[str, Any]) -> str:
    """The report for ``result`` (any kind :func:`result_kind` accepts) as one HTML page."""
    kind = result_kind(result)
    if kind == "plan":
        return _plan_page(result)
    if kind == "shard":
        return _shard_page(result)
    if kind == "hybrid":
        return _hybrid_page(result)
    if kind == "mlperf_scaling":
        return _mlperf_page(result)
    return _mesh_transformer_page(result)


# ------------------------------------------------------------------------ plan
def _plan_page(r: dict[str, Any]) -> str:
    title = f"{r.get('graph', '?')} on {r.get('cluster', '?')}"
    best = r.get("best")
    by_name = {row.get("placer"): row for row in r.get("results", [])}
    bound = float(r.get("lower_bound_s") or 0.0)
    sub = (
        f"{r.get('ops', '?'):,} ops in {r.get('groups', '?')} co-location groups · objective "
        f"<b>{esc(r.get('objective', 'step'))}</b> · lower bound {esc(fmt_seconds(bound))}"
        if isinstance(r.get("ops"), int)
        else f"lower bound {esc(fmt_seconds(bound))}"
    )
    if best in by_name:
        v = float(by_name[best].get("objective_value_s") or 0.0)
        gap = f" ({v / bound:.2f}× the bound)" if bound > 0 else ""
        sub += f" · best: <b>{esc(best)}</b> at {esc(fmt_seconds(v))}{gap}"
    else:
        sub += ' · <span class="bad">no plan fits in memory</span>'
    sections = []
    svg, legend = comparison_chart(r)
    sections.append(
        _section(
            "comparison",
            "Placers compared",
            "Simulated time of each placer's plan; the dashed line is the lower bound no "
            "placement can beat (critical path on the fastest devices, or total work spread "
            "evenly). Speed-ups are over the best single device.",
            svg + legend,
        )
    )
    plan = r.get("best_plan")
    if isinstance(plan, dict) and plan.get("timeline"):
        svg, legend = timeline_chart(plan)
        sections.append(
            _section(
                "timeline",
                f"Timeline of the best plan ({plan.get('placer')})",
                "One lane per device and per link (Perfetto-style tracks). Consecutive ops "
                "of one layer on one device are merged into a span; grey is idle time. "
                "Links show the transfers routed over them, coloured by the producing layer.",
                svg + legend,
            )
        )
        mem = [m for m in plan["memory"] if m.get("ops", 1) or m["peak_bytes"] > 0]
        svg, legend = memory_chart(mem or plan["memory"])
        sections.append(
            _section(
                "memory",
                "Memory per device",
                "Simulated peak (resident parameters, optimizer state, inputs and live "
                "activations) against each device's capacity. Devices the plan leaves unused are "
                "not shown.",
                svg + legend,
            )
        )
        svg, legend = group_graph_chart(plan)
        sections.append(
            _section(
                "placement",
                "Placement of the co-location groups",
                "Each circle is a group (area ~ its compute time), placed left to right at its "
                "depth in the group graph, in the band and colour of its device; edges are "
                "the bytes between groups, thicker for heavier, dark where they cross devices.",
                svg + legend,
            )
        )
    if r.get("learning_curves"):
        sections.append(_learning_section(r["learning_curves"]))
    return _page(title, sub, sections)


def _learning_section(curves: list[dict[str, Any]]) -> str:
    series = []
    for c in curves:
        pts = list(zip(c.get("evaluations", []), c.get("best_step_time_s", [])))
        series.append((str(c.get("placer", "?")), [(float(a), float(b)) for a, b in pts]))
    svg, legend = line_chart(
        "chart-learning",
        "Learning curves: best step time found against simulator evaluations",
        series,
        "simulator evaluations",
        "best step time (s)",
        y_zero=False,
    )
    return _section("learning", "Learning curves", "Best plan so far per placer.", svg + legend)


# ----------------------------------------------------------------------- shard
LABELS = {
    "weight_gather": "weights",
    "forward": "fwd",
    "backward": "bwd",
}


def _shard_page(r: dict[str, Any]) -> str:
    mesh = r.get("mesh", {})
    shape = "x".join(map(str, mesh.get("shape", []))) or "?"
    title = f"{r.get('program', r.get('model', '?'))} on {r.get('chips', '?')} chips of "
    title += str(r.get("cluster", "?"))
    step = float(r.get("step_time_s") or 0.0)
    sub = (
        f"mesh <b>{esc(shape)}</b> ({esc(mesh.get('mapping', ''))}) · step "
        f"<b>{esc(fmt_seconds(step))}</b> · {float(r.get('samples_per_s') or 0):,.1f} samples/s"
    )
    rules = r.get("rules") or {}
    rows = [
        ("mesh", f"{shape} — axes {', '.join(mesh.get('axes', []))}"),
        ("mapping", mesh.get("mapping", "")),
        ("layout rules", ", ".join(f"{k} → {v}" for k, v in rules.items()) or "(replicated)"),
        ("weight-update sharding", "on" if r.get("weight_update_sharding") else "off"),
        ("parameters", f"{int(r.get('parameters') or 0):,}"),
        ("optimizer", str(r.get("optimizer", ""))),
        ("step time", fmt_seconds(step)),
        (
            "peak memory",
            f"{fmt_bytes(float(r.get('peak_memory_bytes') or 0))} of "
            f"{fmt_bytes(float(r.get('memory_capacity_bytes') or 0))}"
            + ("" if r.get("fits", True) else " — does not fit"),
        ),
    ]
    for ax, links in (mesh.get("axis_links") or {}).items():
        desc = "; ".join(
            f"{lk.get('ring', '')}: {float(lk.get('bandwidth', 0)) / 1e9:,.0f} GB/s" for lk in links
        )
        rows.append((f"axis {ax}", desc))
    search = r.get("search") or {}
    if search:
        rows.append(
            (
                "search",
                f"{search.get('layouts_legal', '?')} legal layouts, "
                f"{search.get('evaluations', '?')} evaluations in "
                f"{float(search.get('seconds') or 0):.2f} s",
            )
        )
    table = (
        "<table>"
        + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
        + "</table>"
    )
    sections = [f'<section id="layout"><h2>Layout and mesh</h2><figure>{table}</figure></section>']
    compute = [(f"compute {k}", float(v)) for k, v in (r.get("compute_s") or {}).items() if v]
    exposed = [
        (f"exposed {LABELS.get(k, k)}", float(v))
        for k, v in (r.get("exposed_s") or {}).items()
        if v
    ]
    comm = [
        (f"{LABELS.get(k, k)} communication", float(v))
        for k, v in (r.get("communication_s") or {}).items()
        if v
    ]
    bars = [("step time", compute + exposed)]
    if comm:
        bars.append(("all communication", comm))
    svg, legend = stacked_bar_chart(
        "chart-shard-breakdown", "Step time breakdown: compute and exposed communication", bars
    )
    sections.append(
        _section(
            "breakdown",
            "Cost breakdown",
            "The step is compute plus the communication that compute cannot hide; the second "
            "bar is all communication per category, most of it overlapped.",
            svg + legend,
        )
    )
    mem = [(k, float(v)) for k, v in (r.get("memory_bytes") or {}).items() if v]
    if mem:
        cap = float(r.get("memory_capacity_bytes") or 0.0)
        svg, legend = stacked_bar_chart(
            "chart-shard-memory",
            "Memory per device by kind, against the capacity",
            [("per device", mem)],
            unit="B",
            marker=(f"capacity {fmt_bytes(cap)}", cap) if cap else None,
        )
        sections.append(_section("shard-memory", "Memory per device", "", svg + legend))
    colls = sorted(
        r.get("collectives") or [],
        key=lambda c: -float(c.get("time_s", 0)) * float(c.get("count", 1)),
    )
    if colls:
        head = "<tr><th>op</th><th>collective</th><th>axes</th><th>phase</th>"
        head += "<th>bytes</th><th>count</th><th>time</th></tr>"
        body = "".join(
            f"<tr><td>{esc(c.get('op', ''))}</td><td>{esc(c.get('kind', ''))}</td>"
            f"<td>{esc(','.join(c.get('axes', [])))}</td><td>{esc(c.get('phase', ''))}</td>"
            f'<td class="num">{esc(fmt_bytes(float(c.get("bytes", 0))))}</td>'
            f'<td class="num">{int(c.get("count", 1))}</td>'
            f'<td class="num">{esc(fmt_seconds(float(c.get("time_s", 0))))}</td></tr>'
            for c in colls[:20]
        )
        more = f"; the {len(colls) - 20} smaller ones are left out" if len(colls) > 20 else ""
        sections.append(
            f'<section id="collectives"><h2>Collectives</h2><p class="note">The '
            f"{min(20, len(colls))} most expensive of {len(colls)} collectives per step"
            f"{more}.</p><figure><table>{head}{body}</table></figure></section>"
        )
    runners = r.get("runners_up") or []
    rows_b = [
        (
            f"{shape} · {', '.join(f'{k}:{v}' for k, v in rules.items()) or 'replicated'}"
            + (" · wus" if r.get("weight_update_sharding") else ""),
            step,
            BEST,
            f"chosen layout: {fmt_seconds(step)}",
        )
    ]
    for u in runners:
        label = f"{u.get('mesh')} · "
        label += ", ".join(f"{k}:{v}" for k, v in (u.get("rules") or {}).items()) or "replicated"
        if u.get("weight_update_sharding"):
            label += " · wus"
        fits = u.get("fits", True)
        tip = (
            f"{label}: {fmt_seconds(float(u.get('step_time_s', 0)))}, "
            f"{float(u.get('slowdown') or 0):.2f}× slower, peak "
            f"{fmt_bytes(float(u.get('peak_memory_bytes') or 0))}"
            + ("" if fits else " (does not fit)")
        )
        rows_b.append((label, float(u.get("step_time_s") or 0), BAR if fits else OOM_RED, tip))
    svg = bar_chart("chart-shard-runners", "Chosen layout and runner-ups: step time", rows_b)
    from meshplace.report.svg import legend_html

    legend = legend_html(
        [(BEST, "chosen layout"), (BAR, "runner-up"), (OOM_RED, "does not fit")], "Colours:"
    )
    sections.append(
        _section(
            "runners-up",
            "Runner-up layouts",
            "wus = weight-update sharding (the optimizer update sharded over data-parallel "
            "replicas).",
            svg + legend,
        )
    )
    return _page(title, sub, sections)


# ------------------------------------------------------------------ benchmarks
def _hybrid_page(r: dict[str, Any]) -> str:
    """``meshplace shard --pipeline auto --json``: the plan, its schedule, memory per stage."""
    b = r["best"]
    title = f"{r.get('model', '?')} on {r.get('chips', '?')} chips of {r.get('cluster', '?')}"
    step = float(b.get("time_per_batch_s") or 0.0)
    sub = (
        f"data {esc(b['dp'])} × tensor {esc(b['tp'])} × pipeline {esc(b['pp'])} · "
        f"{esc(b['micro_batches'])} micro-batches, {esc(b['schedule'])} · "
        f"<b>{esc(fmt_seconds(step))}</b> per batch of {esc(r.get('global_batch', '?'))} · "
        f"MFU {100 * float(b.get('mfu') or 0):.1f}%"
    )
    first = 0
    stage_rows = []
    named = b.get("stage_units")  # a model cut between units: their names
    for i, k in enumerate(b["layers_per_stage"]):
        span = esc(named[i]) if named else f"{first}–{first + k - 1}"
        stage_rows.append(
            f"<tr><td>{i}</td><td>{span}</td><td>{esc(b['recompute'][i])}</td>"
            f'<td class="num">{esc(fmt_seconds(b["stage_forward_s"][i]))}</td>'
            f'<td class="num">{esc(fmt_seconds(b["stage_backward_s"][i]))}</td>'
            f'<td class="num">{esc(fmt_bytes(b["stage_memory_bytes"][i]))}</td></tr>'
        )
        first += k
    table = (
        f"<table><tr><th>stage</th><th>{'units' if named else 'layers'}</th><th>recompute</th>"
        "<th>forward</th>"
        "<th>backward</th><th>memory</th></tr>" + "".join(stage_rows) + "</table>"
    )
    note = (
        f"ZeRO-{b['zero']}, {b['micro_batch']} sequence(s) per micro-batch per replica; "
        f"bubble {100 * float(b.get('bubble_fraction') or 0):.1f}% of the devices' time "
        "(simulated schedule)."
    )
    sections = [_section("stages", "Stages", esc(note), table)]
    tasks = b.get("schedule_tasks") or []
    if tasks:
        tail = [a + u for a, u in zip(b.get("sync_s", []), b.get("update_s", []), strict=False)]
        svg, legend = schedule_chart(
            tasks, int(b["pp"]), step, "Pipeline schedule: one lane per stage", tail
        )
        sections.append(_section("schedule", "Pipeline schedule", "", svg + legend))
    else:
        sections.append(
            _section(
                "schedule",
                "Pipeline schedule",
                "Too many tasks to draw (more than 20,000 micro-batch passes).",
                "",
            )
        )
    rows = [
        {"device": f"stage {i}", "peak_bytes": m, "capacity_bytes": b["capacity_bytes"]}
        for i, m in enumerate(b["stage_memory_bytes"])
    ]
    svg, legend = memory_chart(rows, "chart-stage-memory", "Memory per device of each stage")
    sections.append(_section("memory", "Memory per stage", "", svg + legend))
    runners = r.get("runners_up") or []
    if runners:
        body = "".join(
            f"<tr><td>{esc(p['label'])}</td><td>{esc(','.join(map(str, p['layers_per_stage'])))}"
            f'</td><td class="num">{esc(fmt_seconds(p["time_per_batch_s"]))}</td>'
            f'<td class="num">{100 * float(p["mfu"]):.1f}%</td>'
            f"<td>{'yes' if p['fits'] else 'no'}</td></tr>"
            for p in runners
        )
        sections.append(
            _section(
                "runners-up",
                "Runners-up",
                "",
                "<table><tr><th>plan</th><th>layers per stage</th><th>time per batch</th>"
                f"<th>MFU</th><th>fits</th></tr>{body}</table>",
            )
        )
    return _page(title, sub, sections)


def _mlperf_page(r: dict[str, Any]) -> str:
    sections = []
    names = {
        "no_wus": "without weight-update sharding",
        "wus": "with weight-update sharding",
        "data_parallel": "data parallel",
        "spatial": "spatial partitioning",
    }
    for key in SCALING_KEYS:
        rows = r.get(key)
        if not _rows_with(rows, "chips"):
            continue
        variants = [k for k, v in rows[0].items() if isinstance(v, dict) and "step_time_s" in v]
        series = []
        for v in variants:
            pts = [
                (float(row["chips"]), float(row[v].get("samples_per_s_per_chip") or 0.0))
                for row in rows
                if isinstance(row.get(v), dict)
            ]
            series.append((names.get(v, v), pts))
        svg, legend = line_chart(
            f"chart-scaling-{key}",
            f"{key}: throughput per chip as the pod slice grows",
            series,
            "chips (log scale)",
            "samples/s per chip",
            log_x=True,
        )
        sections.append(
            _section(
                f"scaling-{key}",
                f"Scaling: {key}",
                "Flat lines mean linear scaling (weak scaling: the global batch grows with the "
                "chips).",
                svg + legend,
            )
        )
    title = f"MLPerf-style scaling on {r.get('cluster', '?')}"
    return _page(title, "Simulated throughput per chip against the number of chips.", sections)


def _mesh_transformer_page(r: dict[str, Any]) -> str:
    rows = r["rows"]
    series = []
    for key, name in (
        ("hand", "hand layout (Mesh-TensorFlow paper)"),
        ("ours", "searched layout"),
        ("ours_without_wus", "searched, no weight-update sharding"),
    ):
        pts = [
            (float(row["chips"]), float(row[key]["step_time_s"]))
            for row in rows
            if isinstance(row.get(key), dict) and "step_time_s" in row[key]
        ]
        if pts:
            series.append((name, pts))
    svg, legend = line_chart(
        "chart-scaling-mesh-transformer",
        "Mesh Transformer: step time of hand and searched layouts",
        series,
        "chips (log scale)",
        "step time (s)",
        log_x=True,
    )
    sections = [
        _section(
            "scaling-mesh-transformer",
            "Scaling: Mesh-TensorFlow Transformer",
            "The model grows with the chip count (the paper's weak-scaling table).",
            svg + legend,
        )
    ]
    sp = [(float(row["chips"]), float(row.get("speedup") or 0.0)) for row in rows]
    svg, legend = line_chart(
        "chart-speedup-mesh-transformer",
        "Speed-up of the searched layout over the hand layout",
        [("speed-up", sp)],
        "chips (log scale)",
        "speed-up (×)",
        log_x=True,
    )
    sections.append(_section("speedup-mesh-transformer", "Speed-up", "", svg + legend))
    title = f"Mesh Transformer layouts on {r.get('cluster', '?')}"
    return _page(title, "Searched against hand-written layouts.", sections)
