"""The report's charts, each a function from result JSON to one ``<svg>`` string (plus an
HTML legend where colours carry meaning).

* :func:`comparison_chart` — placers as horizontal bars, the simulator's lower bound as a
  dashed line (the ColocRL/Placeto papers' comparison tables, drawn);
* :func:`timeline_chart` — one lane per device and per link, like Perfetto's track layout
  (one track per thread; https://perfetto.dev/docs/visualization/ui): ops merged into
  spans coloured by layer, transfers on the links they cross, idle time left blank;
* :func:`schedule_chart` — a pipeline schedule, one lane per stage, micro-batches coloured;
* :func:`memory_chart` — peak memory per device against its capacity, OOM in red;
* :func:`group_graph_chart` — the co-location group graph laid out by depth (x is the
  longest-path level from a source, as in a layered/Sugiyama drawing; Sugiyama, Tagawa
  and Toda, IEEE SMC 1981), nodes coloured by device, the heaviest edges drawn thicker;
* :func:`stacked_bar_chart`, :func:`bar_chart`, :func:`line_chart` — generic charts for the
  shard breakdown, runner-up layouts, scaling curves and learning curves.

Example
-------
>>> svg, _ = comparison_chart(
...     {"lower_bound_s": 0.5, "best": "a", "objective": "step",
...      "results": [{"placer": "a", "objective_value_s": 1.0, "oom": False}]})
>>> svg.startswith('<svg id="chart-comparison"') and "lower bound" in svg
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from meshplace.report.svg import (
    BOUND,
    OOM_RED,
    colour,
    esc,
    fmt_bytes,
    fmt_seconds,
    legend_html,
    line,
    nice_ticks,
    polyline,
    rect,
    svg_open,
    text,
    time_unit,
)

WIDTH = 1200
BEST = "#117733"
BAR = "#4477AA"
IDLE = "#F2F2F2"


def _x_axis(
    x0: float, x1: float, y_top: float, y_axis: float, t_max: float, label: str = "time"
) -> str:
    """A time axis from 0 to ``t_max`` seconds along ``[x0, x1]``, with grid lines."""
    unit, scale = time_unit(t_max)
    out = [line(x0, y_axis, x1, y_axis, "#888")]
    for t in nice_ticks(0.0, t_max / scale, 8):
        x = x0 + (x1 - x0) * (t * scale) / t_max if t_max > 0 else x0
        out.append(line(x, y_top, x, y_axis, "#e2e2e2"))
        out.append(line(x, y_axis, x, y_axis + 4, "#888"))
        out.append(text(x, y_axis + 16, f"{t:g}", anchor="middle", size=11))
    out.append(text((x0 + x1) / 2, y_axis + 32, f"{label} ({unit})", anchor="middle"))
    return "".join(out)


# --------------------------------------------------------------------- placers
def comparison_chart(result: dict[str, Any]) -> tuple[str, str]:
    """Placers' objective values as bars, fastest first; OOM plans in red."""
    rows = sorted(
        result.get("results", []),
        key=lambda r: (bool(r.get("oom")), float(r.get("objective_value_s") or 0.0)),
    )
    bound = float(result.get("lower_bound_s") or 0.0)
    best = result.get("best")
    left, right, top, bar_h, gap = 150, 250, 30, 22, 8
    height = top + len(rows) * (bar_h + gap) + 50
    x0, x1 = left, WIDTH - right
    vmax = max([float(r.get("objective_value_s") or 0.0) for r in rows] + [bound]) or 1.0
    title = f"Placers compared: {result.get('objective', 'step')} time per plan (lower is better)"
    out = [svg_open("chart-comparison", WIDTH, height, title)]
    y_axis = top + len(rows) * (bar_h + gap)
    out.append(_x_axis(x0, x1, top - 6, y_axis, vmax, f"{result.get('objective', 'step')} time"))
    for i, r in enumerate(rows):
        y = top + i * (bar_h + gap)
        v = float(r.get("objective_value_s") or 0.0)
        oom = bool(r.get("oom"))
        fill = OOM_RED if oom else BEST if r.get("placer") == best else BAR
        w = (x1 - x0) * v / vmax
        bits = [fmt_seconds(v)]
        if oom:
            bits.append("OOM on " + ", ".join(r.get("oom_devices") or []))
        for ref in ("single", "expert"):
            sp = r.get(f"speedup_vs_{ref}")
            if sp:
                bits.append(f"{sp:.2f}× vs {ref}")
        tip = f"{r.get('placer')}: " + "; ".join(bits)
        if r.get("search_time_s") is not None:
            tip += f"; search {r['search_time_s']:.2f} s, {r.get('evaluations', 0)} evaluations"
        out.append(text(x0 - 8, y + bar_h * 0.7, r.get("placer", "?"), anchor="end", size=13))
        out.append(rect(x0, y, w, bar_h, fill, tip))
        label = fmt_seconds(v) + ("  OOM" if oom else "")
        sp = r.get("speedup_vs_single")
        if sp and not oom:
            label += f"  ({sp:.2f}× vs single)"
        out.append(text(x0 + w + 6, y + bar_h * 0.7, label, size=12))
    if bound > 0:
        xb = x0 + (x1 - x0) * bound / vmax
        out.append(
            f'<line x1="{xb:.1f}" y1="{top - 12}" x2="{xb:.1f}" y2="{y_axis}" stroke="{BOUND}" '
            f'stroke-width="2" stroke-dasharray="6 4"><title>lower bound '
            f"{esc(fmt_seconds(bound))}</title></line>"
        )
        out.append(text(xb + 4, top - 14, f"lower bound {fmt_seconds(bound)}", size=12))
    out.append("</svg>")
    legend = legend_html(
        [(BEST, "best plan"), (BAR, "other plans"), (OOM_RED, "out of memory")]
        + ([(BOUND, "lower bound (dashed)")] if bound > 0 else []),
        "Colours:",
    )
    return "".join(out), legend


# -------------------------------------------------------------------- timeline
def layer_class(label: str) -> str:
    """The colour class of a timeline label: its first two module parts.

    >>> layer_class("decoder.attention.score"), layer_class("(update)")
    ('decoder.attention', '(update)')
    """
    return label if label.startswith("(") else ".".join(label.split(".")[:2])


def timeline_chart(plan: dict[str, Any]) -> tuple[str, str]:
    """One lane per device that runs ops and per link that carries bytes."""
    tl = plan["timeline"]
    labels: list[str] = tl["labels"]
    spans: list[list[float]] = tl["spans"]
    devices: list[str] = plan["devices"]
    transfers: dict[str, list[list[float]]] = plan.get("transfers", {})
    step = float(plan.get("step_time_s") or 0.0)
    t_max = max([step] + [s[2] for s in spans] + [t[1] for v in transfers.values() for t in v])
    t_max = t_max or 1.0
    classes: dict[str, int] = {}
    for s in spans:
        classes.setdefault(layer_class(labels[int(s[3])]), len(classes))
    cls_colour = {c: colour(i) for c, i in classes.items()}
    used = sorted({int(s[0]) for s in spans})
    lanes = [("device", d, devices[d]) for d in used] + [
        ("link", i, name) for i, name in enumerate(transfers)
    ]
    left, right, top, lane_h, pad = 270, 30, 24, 22, 5
    x0, x1 = left, WIDTH - right
    height = top + len(lanes) * (lane_h + pad) + 60
    title = f"Timeline of the best plan ({plan.get('placer')}): one lane per device and link"
    out = [svg_open("chart-timeline", WIDTH, height, title)]
    y_axis = top + len(lanes) * (lane_h + pad)
    out.append(_x_axis(x0, x1, top - 4, y_axis, t_max))
    sx = (x1 - x0) / t_max
    lane_y: dict[tuple[str, int], float] = {}
    for i, (kind, idx, name) in enumerate(lanes):
        y = top + i * (lane_h + pad)
        lane_y[(kind, idx)] = y
        busy = 0.0
        if kind == "device":
            busy = sum(s[2] - s[1] for s in spans if int(s[0]) == idx)
        else:
            busy = sum(t[1] - t[0] for t in transfers[name])
        tip = f"{name}: busy {fmt_seconds(busy)} of {fmt_seconds(t_max)}"
        tip += f" ({100 * busy / t_max:.0f}%)"
        out.append(rect(x0, y, x1 - x0, lane_h, IDLE, tip))
        tag = name if kind == "device" else f"⇄ {name}"
        short = tag if len(tag) <= 40 else "…" + tag[-39:]
        out.append(text(x0 - 8, y + lane_h * 0.68, short, anchor="end", size=12))
    parts: list[str] = []
    for s in spans:
        d, a, b, lab, n = int(s[0]), s[1], s[2], labels[int(s[3])], int(s[4])
        y = lane_y[("device", d)]
        w = max((b - a) * sx, 0.6)
        tip = f"{lab} on {devices[d]}: {fmt_seconds(a)}–{fmt_seconds(b)} "
        tip += f"({fmt_seconds(b - a)}, {n} op{'s' if n != 1 else ''})"
        parts.append(rect(x0 + a * sx, y, w, lane_h, cls_colour[layer_class(lab)], tip))
    for li, name in enumerate(transfers):
        y = lane_y[("link", li)]
        for a, b, nbytes, lab in transfers[name]:
            label = labels[int(lab)] if 0 <= int(lab) < len(labels) else "?"
            w = max((b - a) * sx, 0.6)
            tip = f"{label} over {name}: {fmt_bytes(nbytes)}, {fmt_seconds(a)}–{fmt_seconds(b)}"
            c = cls_colour.get(layer_class(label), "#777")
            parts.append(rect(x0 + a * sx, y + 4, w, lane_h - 8, c, tip))
    out.extend(parts)
    if step > 0:
        xs = x0 + step * sx
        out.append(
            f'<line x1="{xs:.1f}" y1="{top - 8}" x2="{xs:.1f}" y2="{y_axis}" stroke="{BOUND}" '
            f'stroke-width="1.5" stroke-dasharray="4 3"><title>step time '
            f"{esc(fmt_seconds(step))}</title></line>"
        )
        out.append(text(xs - 4, top - 10, f"step {fmt_seconds(step)}", anchor="end", size=11))
    out.append("</svg>")
    legend = legend_html(
        [(cls_colour[c], c) for c in classes] + [(IDLE, "idle")], "Layers (module prefix):"
    )
    return "".join(out), legend


# ------------------------------------------------------------ pipeline schedule
def schedule_chart(
    tasks: Sequence[Sequence[float]],
    stages: int,
    step_s: float,
    title: str,
    tail_s: Sequence[float] | None = None,
) -> tuple[str, str]:
    """A pipeline schedule: one lane per stage (device), one box per forward or backward
    of a micro-batch, coloured by micro-batch (forward solid, backward pale), idle time
    blank — the figure of the GPipe and Megatron-LM papers, drawn from simulated tasks
    ``[device, virtual stage, 0 forward / 1 backward, micro-batch, start, end]``; ``tail_s``
    (per stage) is the gradient synchronisation and optimizer step after its last task.

    >>> svg, _ = schedule_chart([[0, 0, 0, 0, 0.0, 1.0], [0, 0, 1, 0, 1.0, 3.0]], 1, 3.0, "s")
    >>> svg.count("<rect") >= 3
    True
    """
    left, right, top, lane_h, pad = 120, 30, 24, 24, 6
    x0, x1 = left, WIDTH - right
    t_max = max([step_s] + [float(t[5]) for t in tasks]) or 1.0
    height = top + stages * (lane_h + pad) + 60
    out = [svg_open("chart-schedule", WIDTH, height, title)]
    y_axis = top + stages * (lane_h + pad)
    out.append(_x_axis(x0, x1, top - 4, y_axis, t_max))
    sx = (x1 - x0) / t_max
    for d in range(stages):
        y = top + d * (lane_h + pad)
        busy = sum(float(t[5]) - float(t[4]) for t in tasks if int(t[0]) == d)
        out.append(rect(x0, y, x1 - x0, lane_h, IDLE, f"stage {d}: busy {100 * busy / t_max:.0f}%"))
        out.append(text(x0 - 8, y + lane_h * 0.68, f"stage {d}", anchor="end", size=12))
    micro_batches = sorted({int(t[3]) for t in tasks})
    for t in tasks:
        d, virtual, backward, mb = int(t[0]), int(t[1]), int(t[2]), int(t[3])
        a, b = float(t[4]), float(t[5])
        y = top + d * (lane_h + pad)
        kind = "backward" if backward else "forward"
        tip = f"{kind} of micro-batch {mb} on stage {d}"
        tip += f" (chunk {virtual})" if virtual != d else ""
        tip += f": {fmt_seconds(a)}–{fmt_seconds(b)}"
        extra = ' fill-opacity="0.45"' if backward else ""
        out.append(
            rect(x0 + a * sx, y + 2, max((b - a) * sx, 0.6), lane_h - 4, colour(mb), tip, extra)
        )
    for d, tail in enumerate(tail_s or []):
        ends = [float(t[5]) for t in tasks if int(t[0]) == d]
        if tail > 0 and ends:
            a = max(ends)
            y = top + d * (lane_h + pad)
            tip = f"stage {d}: gradient synchronisation and optimizer step, {fmt_seconds(tail)}"
            out.append(rect(x0 + a * sx, y + 2, max(tail * sx, 0.6), lane_h - 4, "#888888", tip))
    xs = x0 + step_s * sx
    out.append(line(xs, top - 8, xs, y_axis, BOUND, 1.5))
    out.append(text(xs - 4, top - 10, f"batch {fmt_seconds(step_s)}", anchor="end", size=11))
    out.append("</svg>")
    shown = micro_batches[:12]
    items = [(colour(mb), f"micro-batch {mb}") for mb in shown]
    if len(micro_batches) > len(shown):
        items.append(("#FFFFFF", f"… {len(micro_batches) - len(shown)} more"))
    items += [("#888888", "gradient sync + optimizer"), (IDLE, "idle")]
    legend = legend_html(items, "Forward solid, backward pale:")
    return "".join(out), legend


# ---------------------------------------------------------------------- memory
def memory_chart(
    rows: Sequence[dict[str, Any]], chart_id: str = "chart-memory", title: str = ""
) -> tuple[str, str]:
    """Peak memory per device (bars) against capacity (outlined), OOM in red."""
    left, right, top, bar_h, gap = 200, 260, 20, 20, 8
    height = top + len(rows) * (bar_h + gap) + 50
    x0, x1 = left, WIDTH - right
    vmax = max([max(r["peak_bytes"], r["capacity_bytes"]) for r in rows] + [1.0])
    title = title or "Peak memory per device against its capacity"
    out = [svg_open(chart_id, WIDTH, height, title)]
    y_axis = top + len(rows) * (bar_h + gap)
    scale = 2**30
    for t in nice_ticks(0.0, vmax / scale, 8):
        x = x0 + (x1 - x0) * t * scale / vmax
        out.append(line(x, top - 4, x, y_axis, "#e2e2e2"))
        out.append(text(x, y_axis + 16, f"{t:g}", anchor="middle", size=11))
    out.append(line(x0, y_axis, x1, y_axis, "#888"))
    out.append(text((x0 + x1) / 2, y_axis + 32, "memory (GiB)", anchor="middle"))
    for i, r in enumerate(rows):
        y = top + i * (bar_h + gap)
        peak, cap = float(r["peak_bytes"]), float(r["capacity_bytes"])
        oom = peak > cap
        wc = (x1 - x0) * cap / vmax
        wp = (x1 - x0) * peak / vmax
        pct = 100 * peak / cap if cap else 0.0
        tip = f"{r['device']}: peak {fmt_bytes(peak)} of {fmt_bytes(cap)} ({pct:.0f}%)"
        if "ops" in r:
            tip += f", {r['ops']} ops"
        out.append(text(x0 - 8, y + bar_h * 0.72, r["device"], anchor="end", size=12))
        out.append(
            rect(x0, y, wc, bar_h, "#FFFFFF", f"capacity {fmt_bytes(cap)}", ' stroke="#555"')
        )
        out.append(rect(x0, y + 3, wp, bar_h - 6, OOM_RED if oom else BAR, tip))
        label = f"{fmt_bytes(peak)} / {fmt_bytes(cap)} ({pct:.0f}%)" + ("  OOM" if oom else "")
        out.append(text(x0 + max(wc, wp) + 6, y + bar_h * 0.72, label, size=12))
    out.append("</svg>")
    legend = legend_html(
        [(BAR, "peak memory"), ("#FFFFFF", "capacity (outline)"), (OOM_RED, "over capacity")],
        "Colours:",
    )
    return "".join(out), legend


# ----------------------------------------------------------------- group graph
def group_graph_chart(plan: dict[str, Any]) -> tuple[str, str]:
    """The group graph by depth: x = topological level, nodes coloured by device."""
    groups: list[dict[str, Any]] = plan["groups"]
    edges: list[list[float]] = plan.get("group_edges", [])
    devices: list[str] = plan["devices"]
    n_levels = max([int(g["level"]) for g in groups] + [0]) + 1
    used = sorted({int(g["device"]) for g in groups})
    band_of = {d: i for i, d in enumerate(used)}
    cells: dict[tuple[int, int], list[int]] = {}
    for g, info in enumerate(groups):
        cells.setdefault((int(info["device"]), int(info["level"])), []).append(g)
    widest = max((len(v) for v in cells.values()), default=1)
    band_h = max(50.0, min(140.0, widest * 12.0))
    left, right, top, bottom = 120, 40, 20, 50
    height = top + bottom + band_h * max(1, len(used))
    x0, x1 = left, WIDTH - right
    pos: dict[int, tuple[float, float]] = {}
    for (dev, lv), members in cells.items():
        members.sort(key=lambda g: groups[g]["start_s"])
        x = x0 + (x1 - x0) * (lv / (n_levels - 1) if n_levels > 1 else 0.5)
        y_band = top + band_of[dev] * band_h
        for k, g in enumerate(members):
            pos[g] = (x, y_band + band_h * (k + 0.5) / len(members))
    busy_max = max([float(g["busy_s"]) for g in groups] + [1e-30])
    bmax = max([float(e[2]) for e in edges] + [1.0])
    title = (
        f"Placement: {len(groups)} co-location groups by depth, one band and colour per device "
        f"(the {len(edges)} heaviest of {plan.get('group_edges_total', len(edges))} edges)"
    )
    out = [svg_open("chart-placement", WIDTH, height, title)]
    for d in used:
        y_band = top + band_of[d] * band_h
        if band_of[d] % 2 == 0:
            out.append(rect(x0 - 10, y_band, x1 - x0 + 20, band_h, "#F6F6F6"))
        out.append(text(x0 - 16, y_band + band_h / 2 + 4, devices[d], anchor="end", size=12))
    for s, d, b in sorted(edges, key=lambda e: e[2]):
        (xa, ya), (xb, yb) = pos[int(s)], pos[int(d)]
        cross = groups[int(s)]["device"] != groups[int(d)]["device"]
        w = 0.4 + 6.0 * math.sqrt(float(b) / bmax)
        stroke = "#444" if cross else "#BBBBBB"
        mx = (xa + xb) / 2
        tip = f"{groups[int(s)]['name']} → {groups[int(d)]['name']}: {fmt_bytes(float(b))}" + (
            " (crosses devices)" if cross else ""
        )
        out.append(
            f'<path d="M{xa:.1f},{ya:.1f} C{mx:.1f},{ya:.1f} {mx:.1f},{yb:.1f} {xb:.1f},{yb:.1f}" '
            f'fill="none" stroke="{stroke}" stroke-opacity="0.55" stroke-width="{w:.2f}">'
            f"<title>{esc(tip)}</title></path>"
        )
    for g, info in enumerate(groups):
        x, y = pos[g]
        r = 2.5 + 5.0 * math.sqrt(float(info["busy_s"]) / busy_max)
        dev = int(info["device"])
        tip = (
            f"{info['name']} ({info.get('module') or 'no module'}): {devices[dev]}, level "
            f"{info['level']}, {info['ops']} ops, busy {fmt_seconds(float(info['busy_s']))}, "
            f"starts {fmt_seconds(float(info['start_s']))}"
        )
        out.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{colour(dev)}" '
            f'stroke="#222" stroke-width="0.5"><title>{esc(tip)}</title></circle>'
        )
    out.append(
        text(
            (x0 + x1) / 2,
            height - 18,
            f"topological level (0 – {n_levels - 1}), longest path from a source group",
            anchor="middle",
        )
    )
    out.append("</svg>")
    legend = legend_html(
        [(colour(d), devices[d]) for d in used]
        + [("#444", "edge between devices"), ("#BBBBBB", "edge within a device")],
        "Devices:",
    )
    return "".join(out), legend


# -------------------------------------------------------------- generic charts
def stacked_bar_chart(
    chart_id: str,
    title: str,
    bars: Sequence[tuple[str, Sequence[tuple[str, float]]]],
    unit: str = "s",
    marker: tuple[str, float] | None = None,
) -> tuple[str, str]:
    """Horizontal stacked bars: ``bars`` is ``[(bar label, [(part, value), ...]), ...]``;
    ``unit`` ``"s"`` or ``"B"``; ``marker`` an optional labelled vertical line."""
    fmt = fmt_seconds if unit == "s" else fmt_bytes
    parts_order: dict[str, int] = {}
    for _, parts in bars:
        for name, _v in parts:
            parts_order.setdefault(name, len(parts_order))
    left, right, top, bar_h, gap = 200, 200, 30, 26, 12
    height = top + len(bars) * (bar_h + gap) + 50
    x0, x1 = left, WIDTH - right
    totals = [sum(v for _, v in parts) for _, parts in bars]
    vmax = max([*totals, marker[1] if marker else 0.0, 1e-30])
    out = [svg_open(chart_id, WIDTH, height, title)]
    y_axis = top + len(bars) * (bar_h + gap)
    if unit == "s":
        out.append(_x_axis(x0, x1, top - 4, y_axis, vmax, "time"))
    else:
        for t in nice_ticks(0.0, vmax / 2**30, 8):
            x = x0 + (x1 - x0) * t * 2**30 / vmax
            out.append(line(x, top - 4, x, y_axis, "#e2e2e2"))
            out.append(text(x, y_axis + 16, f"{t:g}", anchor="middle", size=11))
        out.append(line(x0, y_axis, x1, y_axis, "#888"))
        out.append(text((x0 + x1) / 2, y_axis + 32, "memory (GiB)", anchor="middle"))
    for i, (label, parts) in enumerate(bars):
        y = top + i * (bar_h + gap)
        x = x0
        out.append(text(x0 - 8, y + bar_h * 0.68, label, anchor="end", size=12))
        for name, v in parts:
            w = (x1 - x0) * v / vmax
            pct = 100 * v / totals[i] if totals[i] else 0.0
            out.append(
                rect(x, y, w, bar_h, colour(parts_order[name]), f"{name}: {fmt(v)} ({pct:.0f}%)")
            )
            x += w
        out.append(text(x + 6, y + bar_h * 0.68, fmt(totals[i]), size=12))
    if marker:
        xm = x0 + (x1 - x0) * marker[1] / vmax
        out.append(
            f'<line x1="{xm:.1f}" y1="{top - 10}" x2="{xm:.1f}" y2="{y_axis}" stroke="{OOM_RED}" '
            f'stroke-width="2" stroke-dasharray="6 4"><title>{esc(marker[0])}</title></line>'
        )
        out.append(text(xm - 4, top - 12, marker[0], anchor="end", size=11, fill=OOM_RED))
    out.append("</svg>")
    legend = legend_html([(colour(i), n) for n, i in parts_order.items()], "Parts:")
    return "".join(out), legend


def bar_chart(
    chart_id: str,
    title: str,
    rows: Sequence[tuple[str, float, str, str]],
    unit: str = "s",
) -> str:
    """Horizontal bars ``(label, value, colour, tooltip)``."""
    fmt = fmt_seconds if unit == "s" else fmt_bytes
    left, right, top, bar_h, gap = 330, 160, 20, 20, 8
    height = top + len(rows) * (bar_h + gap) + 50
    x0, x1 = left, WIDTH - right
    vmax = max([r[1] for r in rows] + [1e-30])
    out = [svg_open(chart_id, WIDTH, height, title)]
    y_axis = top + len(rows) * (bar_h + gap)
    out.append(_x_axis(x0, x1, top - 4, y_axis, vmax, "step time"))
    for i, (label, v, fill, tip) in enumerate(rows):
        y = top + i * (bar_h + gap)
        short = label if len(label) <= 48 else label[:47] + "…"
        out.append(text(x0 - 8, y + bar_h * 0.72, short, anchor="end", size=12))
        w = (x1 - x0) * v / vmax
        out.append(rect(x0, y, w, bar_h, fill, tip))
        out.append(text(x0 + w + 6, y + bar_h * 0.72, fmt(v), size=12))
    out.append("</svg>")
    return "".join(out)


def line_chart(
    chart_id: str,
    title: str,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    x_label: str,
    y_label: str,
    log_x: bool = False,
    y_zero: bool = True,
) -> tuple[str, str]:
    """Lines with point markers; ``log_x`` puts x on a base-2 log scale (chip counts)."""
    width, height = 900, 360
    left, right, top, bottom = 80, 30, 20, 60
    x0, x1, y0, y1 = left, width - right, top, height - bottom
    pts = [p for _, s in series for p in s]
    xs = [p[0] for p in pts] or [1.0]
    ys = [p[1] for p in pts] or [1.0]

    def fx(v: float) -> float:
        return math.log2(v) if log_x else v

    xlo, xhi = fx(min(xs)), fx(max(xs))
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    ylo = 0.0 if y_zero else min(ys)
    yhi = max(ys) * 1.05 if max(ys) > 0 else 1.0
    if yhi <= ylo:
        yhi = ylo + 1.0

    def px(v: float) -> float:
        return x0 + (x1 - x0) * (fx(v) - xlo) / (xhi - xlo)

    def py(v: float) -> float:
        return y1 - (y1 - y0) * (v - ylo) / (yhi - ylo)

    out = [svg_open(chart_id, width, height, title)]
    for t in nice_ticks(ylo, yhi, 6):
        out.append(line(x0, py(t), x1, py(t), "#e6e6e6"))
        out.append(text(x0 - 6, py(t) + 4, f"{t:.4g}", anchor="end", size=11))
    xticks = sorted(set(xs)) if log_x else nice_ticks(min(xs), max(xs), 8)
    for t in xticks:
        out.append(line(px(t), y1, px(t), y1 + 4, "#888"))
        out.append(text(px(t), y1 + 17, f"{t:g}", anchor="middle", size=11))
    out.append(line(x0, y1, x1, y1, "#888"))
    out.append(line(x0, y0, x0, y1, "#888"))
    out.append(text((x0 + x1) / 2, height - 14, x_label, anchor="middle"))
    out.append(
        text(
            16,
            (y0 + y1) / 2,
            y_label,
            anchor="middle",
            extra=f' transform="rotate(-90 16 {(y0 + y1) / 2:.1f})"',
        )
    )
    for i, (name, s) in enumerate(series):
        c = colour(i)
        pts_px = [(px(a), py(b)) for a, b in s]
        if len(pts_px) > 1:
            out.append(polyline(pts_px, c))
        if len(s) <= 200:
            for (a, b), (qx, qy) in zip(s, pts_px):
                out.append(
                    f'<circle cx="{qx:.1f}" cy="{qy:.1f}" r="3.5" fill="{c}">'
                    f"<title>{esc(name)}: {x_label} {a:g}, {esc(y_label)} {b:.4g}</title></circle>"
                )
    out.append("</svg>")
    legend = legend_html([(colour(i), n) for i, (n, _) in enumerate(series)], "Series:")
    return "".join(out), legend
