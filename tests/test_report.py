"""HTML reports: sections present, sizes, bad input, and a headless Chromium check."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshplace.errors import InputError
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers.base import PlacementProblem
from meshplace.planning import plan_report, run_placers
from meshplace.report import render_html, result_kind
from meshplace.report.cli import cmd_report, write_plan_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CHROMIUM = "/usr/bin/chromium"
PLAN_CHARTS = ("chart-comparison", "chart-timeline", "chart-memory", "chart-placement")
SHARD_CHARTS = ("chart-shard-breakdown", "chart-shard-memory", "chart-shard-runners")
MAX_BYTES = 5_000_000


def _plan(model: str) -> tuple[PlacementProblem, list, dict]:
    problem = PlacementProblem.build(workload_graph(model), load_cluster("colocrl-4gpu"))
    results = run_placers(problem, ["round_robin", "m_etf", "metis"], budget_s=1.0, seed=0)
    args = argparse.Namespace(budget=1.0, seed=0, out=None)
    return problem, results, plan_report(problem, results, args)


@pytest.fixture(scope="module")
def dmcca() -> tuple[PlacementProblem, list, dict]:
    return _plan("dmcca")


@pytest.fixture(scope="module")
def nmt() -> dict:
    return _plan("nmt")[2]


@pytest.fixture(scope="module")
def shard_result() -> dict:
    from meshplace.mesh.cli import shard

    ns = argparse.Namespace(
        model="transformer", size="base", batch=64, cluster="tpu-v3-8", mesh=None, chips=None
    )
    return shard(ns)[1]


def _svgs(page: str) -> dict[str, ET.Element]:
    """Every chart's ``<svg>`` parsed as XML (so each is well-formed), by id."""
    out = {}
    for m in re.finditer(r'<svg id="([^"]+)".*?</svg>', page, flags=re.S):
        out[m.group(1)] = ET.fromstring(m.group(0))
    return out


def _check_charts(page: str, ids: tuple[str, ...]) -> None:
    svgs = _svgs(page)
    for cid in ids:
        assert cid in svgs, f"{cid} missing"
        svg = svgs[cid]
        assert float(svg.get("width", 0)) > 0 and float(svg.get("height", 0)) > 0
        assert len(list(svg)) > 3, f"{cid} is empty"
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    assert "https://" not in page


def test_plan_report_json_keys(dmcca: tuple) -> None:
    _, _, report = dmcca
    assert {"lower_bound_s", "results", "best", "best_plan"} <= set(report)
    plan = report["best_plan"]
    assert plan["timeline"]["spans"] and plan["groups"] and plan["memory"]
    assert all(0 <= g["device"] < len(plan["devices"]) for g in plan["groups"])
    json.dumps(report)  # JSON-ready


def test_plan_report_sections(dmcca: tuple) -> None:
    page = render_html(dmcca[2])
    _check_charts(page, PLAN_CHARTS)
    assert len(page.encode()) < MAX_BYTES
    assert "lower bound" in page


def test_learning_curves_drawn_when_present(dmcca: tuple) -> None:
    curves = [{"placer": "rl", "evaluations": [1, 10, 100], "best_step_time_s": [3.0, 2.0, 1.5]}]
    page = render_html({**dmcca[2], "learning_curves": curves})
    _check_charts(page, (*PLAN_CHARTS, "chart-learning"))


def test_plan_html_written(dmcca: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    problem, results, report = dmcca
    slim = {k: v for k, v in report.items() if k != "best_plan"}
    out = tmp_path / "plan.html"
    write_plan_report(problem, results, slim, argparse.Namespace(html=str(out)))
    assert str(out) in capsys.readouterr().out
    _check_charts(out.read_text(), PLAN_CHARTS)


def test_nmt_report_small(nmt: dict, tmp_path: Path) -> None:
    result = tmp_path / "nmt.result.json"
    result.write_text(json.dumps(nmt, indent=1))
    assert result.stat().st_size < MAX_BYTES
    assert cmd_report(argparse.Namespace(result=str(result), html=None)) == 0
    page = (tmp_path / "nmt.result.html").read_text()
    _check_charts(page, PLAN_CHARTS)
    assert len(page.encode()) < MAX_BYTES


def test_shard_report(shard_result: dict) -> None:
    assert result_kind(shard_result) == "shard"
    page = render_html(shard_result)
    _check_charts(page, SHARD_CHARTS)
    assert len(page.encode()) < MAX_BYTES
    assert 'id="collectives"' in page and 'id="layout"' in page


@pytest.mark.parametrize(
    ("name", "charts"),
    [
        (
            "mlperf_scaling.json",
            (
                "chart-scaling-resnet50",
                "chart-scaling-transformer_big",
                "chart-scaling-detection",
            ),
        ),
        (
            "mesh_transformer.json",
            ("chart-scaling-mesh-transformer", "chart-speedup-mesh-transformer"),
        ),
    ],
)
def test_benchmark_reports(name: str, charts: tuple[str, ...], tmp_path: Path) -> None:
    out = tmp_path / "x.html"
    assert cmd_report(argparse.Namespace(result=str(RESULTS / name), html=str(out))) == 0
    _check_charts(out.read_text(), charts)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such result file"),
        ("not json {", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"a": 1}', "neither a plan result"),
        ('{"results": [], "rows": [{"x": 1}]}', "neither a plan result"),
    ],
)
def test_bad_input(content: str | None, message: str, tmp_path: Path) -> None:
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out.html"
    with pytest.raises(InputError, match=message) as info:
        cmd_report(argparse.Namespace(result=str(src), html=str(out)))
    assert "\n" not in str(info.value)
    assert not out.exists()


# ----------------------------------------------------------------- chromium
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e)));
const _err = console.error.bind(console);
console.error = (...a) => { window.__errors.push(a.join(' ')); _err(...a); };
</script>"""

MEASURE = """<script>
const charts = {};
for (const el of document.querySelectorAll('svg.chart')) {
  const r = el.getBoundingClientRect();
  charts[el.id] = [r.width, r.height];
}
const pre = document.createElement('pre');
pre.id = 'probe-result';
pre.textContent = JSON.stringify({charts, errors: window.__errors,
  resources: performance.getEntriesByType('resource').length});
document.body.appendChild(pre);
</script>"""

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]


def _chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason="chromium is not installed (make test installs Debian's chromium package)",
)
def test_chromium_renders_reports(nmt: dict, shard_result: dict, tmp_path: Path) -> None:
    pages = {
        "nmt": (render_html(nmt), PLAN_CHARTS),
        "shard": (render_html(shard_result), SHARD_CHARTS),
    }
    for name, (page, ids) in pages.items():
        path = tmp_path / f"{name}.html"
        path.write_text(page)
        probe = tmp_path / f"{name}.probe.html"
        probe.write_text(
            page.replace("<head>", "<head>" + PROBE, 1).replace("</body>", MEASURE + "</body>")
        )
        done = _chromium(
            [
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=3000",
                "--dump-dom",
                probe.as_uri(),
            ],
            tmp_path / f"profile-{name}",
        )
        assert done.returncode == 0, done.stderr[-2000:]
        m = re.search(r'<pre id="probe-result">(.*?)</pre>', done.stdout, flags=re.S)
        assert m, f"{name}: the probe did not run: {done.stdout[-500:]}"
        got = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
        assert got["errors"] == [], f"{name}: console errors {got['errors']}"
        assert got["resources"] == 0, f"{name}: the page loaded {got['resources']} resources"
        console = [ln for ln in done.stderr.splitlines() if "CONSOLE" in ln]
        assert not console, f"{name}: console output {console}"
        for cid in ids:
            w, h = got["charts"].get(cid, (0, 0))
            assert w > 0 and h > 0, f"{name}: chart {cid} has size {w}x{h}"
    shot = tmp_path / "report_nmt.png"  # the test never writes into the repository

    done = _chromium(
        ["--window-size=1400,3000", f"--screenshot={shot}", (tmp_path / "nmt.html").as_uri()],
        tmp_path / "profile-shot",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.stat().st_size > 10_000


def test_a_learned_placer_s_learning_curve_reaches_the_report() -> None:
    from meshplace.graph.sources import workload_graph
    from meshplace.hardware import load_cluster
    from meshplace.placers import PlacementProblem
    from meshplace.planning import plan_report, run_placers

    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    results = run_placers(problem, ["rl"], budget_s=2.0, seed=0)
    report = plan_report(problem, results, None)
    (curve,) = report["learning_curves"]
    assert curve["placer"] == "rl"
    assert len(curve["evaluations"]) == len(curve["best_step_time_s"]) > 0
    assert curve["best_step_time_s"] == sorted(curve["best_step_time_s"], reverse=True)
    _check_charts(render_html(report), (*PLAN_CHARTS, "chart-learning"))
