"""Self-contained HTML reports of plans, shard layouts and benchmarks (``meshplace report``).

See ``docs/report.md``. :func:`render_html` turns a result dict into one HTML page with
inline SVG charts; :mod:`meshplace.report.cli` reads and writes files.

Example
-------
>>> from meshplace.report import render_html
>>> "<svg" in render_html({"lower_bound_s": 0.1, "best": None, "results": []})
True
"""

from meshplace.report.html import ReportError, render_html, result_kind

__all__ = ["ReportError", "render_html", "result_kind"]
