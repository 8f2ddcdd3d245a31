"""``meshplace report RESULT.json [--html out.html]`` and ``meshplace plan … --html``.

:func:`cmd_report` reads a plan result, a shard result or a benchmark JSON, renders it
with :func:`meshplace.report.html.render_html` and writes the page atomically; bad input
(a missing file, text that is not JSON, a JSON of no known kind) is an
:class:`~meshplace.errors.InputError` of one sentence and nothing is written.
:func:`write_plan_report` is what ``meshplace plan --html`` calls.

Example
-------
>>> import argparse
>>> p = argparse.ArgumentParser()
>>> add_report_arguments(p)
>>> p.parse_args(["r.json"]).html is None
True
>>> default_html_path("out/nmt.result.json")
'out/nmt.result.html'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from meshplace.errors import InputError
from meshplace.report.html import ReportError, render_html
from meshplace.util import check_output_path, print_json, read_json_file, write_text_atomic


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` subcommand's arguments."""
    parser.add_argument(
        "result", help="plan result (plan --result), shard result (shard --json) or benchmark"
    )
    parser.add_argument("--html", help="where to write the report (default: RESULT with .html)")
    parser.add_argument(
        "--json", action="store_true", help="print a JSON object naming the report written"
    )


def default_html_path(result_path: str) -> str:
    """``RESULT.json`` -> ``RESULT.html`` (``.html`` appended to other names)."""
    return str(Path(result_path).with_suffix(".html"))


def load_result(path: str) -> dict[str, Any]:
    """Read a result JSON; every failure is a one-sentence :class:`ReportError`."""
    try:
        data = read_json_file(path, "result")
    except InputError as exc:
        raise ReportError(str(exc)) from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_report(result: dict[str, Any], html_path: str) -> str:
    """Render ``result`` and write it to ``html_path`` atomically; returns the path."""
    try:
        page = render_html(result)
    except ReportError as exc:
        raise ReportError(f"{html_path}: {exc}") from None
    write_text_atomic(html_path, page)
    return html_path


def cmd_report(args: argparse.Namespace) -> int:
    """``meshplace report``: write the HTML report and print a one-line pointer to it."""
    out = getattr(args, "html", None) or default_html_path(args.result)
    if Path(out).resolve() == Path(args.result).resolve():
        raise ReportError(f"{out}: the report would overwrite its input; pass --html")
    check_output_path(out, "--html")
    data = load_result(args.result)
    try:
        page = render_html(data)
    except ReportError as exc:
        raise ReportError(f"{args.result}: {exc}") from None
    write_text_atomic(out, page)
    size = len(page.encode())
    if getattr(args, "json", False):
        print_json({"report": out, "bytes": size, "source": args.result})
    else:
        print(f"report: {out} ({size / 1e6:.2f} MB) — open it in a browser")
    return 0


def write_plan_report(problem: Any, results: list[Any], report: dict[str, Any], args: Any) -> str:
    """``meshplace plan --html PATH``: write the report of ``report`` (from
    :func:`meshplace.planning.plan_report`), adding the best plan's details if missing,
    and print a one-line pointer (to stderr with ``--json``). Returns the path."""
    if "best_plan" not in report:
        from meshplace.placers.base import best_result
        from meshplace.planning import best_plan_details

        best = best_result(results)
        if best is not None:
            report = {**report, "best_plan": best_plan_details(problem, best)}
    path = write_report(report, args.html)
    # With --json, stdout is the JSON object: the pointer goes to stderr.
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    print(f"report: {path} — open it in a browser", file=stream)
    return path
