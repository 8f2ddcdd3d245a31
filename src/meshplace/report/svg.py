"""Small SVG building blocks for the HTML report: escaping, units, ticks, colours, legends.

Everything is plain strings: a chart is an ``<svg>`` element written by Python, with
tooltips as SVG ``<title>`` children (SVG 1.1, §5.4 "The 'desc' and 'title' elements":
browsers show the title of the element under the pointer). No script, no external file.

The categorical palette is Paul Tol's "muted" and "light" schemes
(https://personal.sron.nl/~pault/, colour-blind safe), extended with the "bright" scheme
for more than 18 categories; beyond that, colours repeat.

Example
-------
>>> fmt_seconds(0.0123)
'12.3 ms'
>>> fmt_bytes(3 * 2**30)
'3.00 GiB'
>>> nice_ticks(0.0, 0.95, 5)
[0.0, 0.2, 0.4, 0.6000000000000001, 0.8]
>>> esc('<a & "b">')
'&lt;a &amp; &quot;b&quot;&gt;'
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from html import escape

PALETTE = (
    "#332288",
    "#88CCEE",
    "#44AA99",
    "#117733",
    "#999933",
    "#DDCC77",
    "#CC6677",
    "#882255",
    "#AA4499",
    "#77AADD",
    "#EE8866",
    "#EEDD88",
    "#FFAABB",
    "#99DDFF",
    "#44BB99",
    "#BBCC33",
    "#AAAA00",
    "#4477AA",
    "#EE6677",
    "#228833",
    "#CCBB44",
    "#66CCEE",
    "#AA3377",
    "#BBBBBB",
)
OOM_RED = "#D62728"
BOUND = "#111111"
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"


def esc(text: object) -> str:
    """Text escaped for SVG/HTML content and attribute values."""
    return escape(str(text), quote=True)


def colour(i: int) -> str:
    """The ``i``-th categorical colour."""
    return PALETTE[i % len(PALETTE)]


def fmt_seconds(s: float) -> str:
    """Seconds with a readable unit (s, ms, µs, ns) and three significant digits."""
    a = abs(s)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns" if a else "0 s"


def fmt_bytes(b: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB)."""
    a = abs(b)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About ``n`` round tick values (1, 2, 5 × 10^k steps) covering ``[lo, hi]``."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out = []
    k = 0
    while first + k * step <= hi + 1e-12 * step:
        out.append(first + k * step)
        k += 1
    return out


def time_unit(span_s: float) -> tuple[str, float]:
    """The unit to label an axis spanning ``span_s`` seconds, and its size in seconds."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if span_s >= 2 * scale:
            return unit, scale
    return "ns", 1e-9


def svg_open(chart_id: str, width: float, height: float, title: str) -> str:
    """The opening ``<svg>`` tag of a chart, with an accessible title."""
    return (
        f'<svg id="{esc(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'role="img" aria-label="{esc(title)}" font-family="{esc(FONT)}" font-size="12">'
        f"<title>{esc(title)}</title>"
    )


def text(
    x: float,
    y: float,
    s: object,
    *,
    anchor: str = "start",
    size: int = 12,
    weight: str = "normal",
    fill: str = "#222",
    extra: str = "",
) -> str:
    """One ``<text>`` element."""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-weight="{weight}" fill="{fill}"{extra}>{esc(s)}</text>'
    )


def rect(
    x: float,
    y: float,
    w: float,
    h: float,
    fill: str,
    tip: str | None = None,
    extra: str = "",
) -> str:
    """One ``<rect>``, with a tooltip when ``tip`` is given."""
    body = f"<title>{esc(tip)}</title>" if tip else ""
    attrs = f'x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" fill="{fill}"'
    if body:
        return f"<rect {attrs}{extra}>{body}</rect>"
    return f"<rect {attrs}{extra}/>"


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#ccc", w: float = 1) -> str:
    """One ``<line>``."""
    return (
        f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" '
        f'stroke="{stroke}" stroke-width="{w:g}"/>'
    )


def legend_html(items: Iterable[tuple[str, str]], title: str = "") -> str:
    """An HTML legend: one swatch and label per ``(colour, label)``."""
    parts = [f'<div class="legend"><span class="legend-title">{esc(title)}</span>']
    for c, label in items:
        parts.append(
            f'<span class="key"><span class="swatch" style="background:{esc(c)}"></span>'
            f"{esc(label)}</span>"
        )
    parts.append("</div>")
    return "".join(parts)


def polyline(points: Sequence[tuple[float, float]], stroke: str, w: float = 2) -> str:
    """An open polyline through ``points``."""
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline points="{pts}" fill="none" stroke="{stroke}" stroke-width="{w:g}"/>'
