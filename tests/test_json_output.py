"""``--json`` in a process of its own: stdout is exactly one strict JSON document for
every command, whatever solvers and libraries print (HiGHS writes a banner to the
process's stdout from C when a model is built), and the documents chain: plan → simulate
→ report. ``plan --placer all``, which loads every placer and solver, runs as the real
console script in a fresh interpreter (so a library that prints while it is imported
is caught too); the other commands run in forks of the test's process
(tests/forked_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.forked_cli import run_meshplace

MESHPLACE = str(Path(sys.executable).with_name("meshplace"))


def _no_constants(name: str) -> Any:
    raise AssertionError(f"{name} is not JSON")


def json_of(*argv: str, cwd: Path, fresh: bool = False) -> Any:
    """``meshplace ARGV --json``'s one document; ``fresh``: the real console script in a
    new interpreter, else a fork of this process."""
    if fresh:
        done = subprocess.run(
            [MESHPLACE, *argv, "--json"], cwd=cwd, capture_output=True, text=True, timeout=600
        )
    else:
        done = run_meshplace([*argv, "--json"], cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    # json.loads refuses a second document or a banner before it; NaN/Infinity refused too
    return json.loads(done.stdout, parse_constant=_no_constants)


def test_every_command_prints_one_json_document(tmp_path: Path) -> None:
    plan = json_of(
        "plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "all", "--budget", "0.05",
        "--out", "p.json", "--result", "r.json", cwd=tmp_path, fresh=True,
    )  # fmt: skip
    names = {r["placer"] for r in plan["results"]}
    assert {"m_sct", "anneal", "rl", "gnn", "metis", "pipeline"} <= names  # HiGHS ran
    assert plan["out"] == "p.json" and (tmp_path / "p.json").is_file()

    sim = json_of(
        "simulate", "--graph", "dmcca", "--cluster", "colocrl-2gpu", "--plan", "p.json",
        cwd=tmp_path,
    )  # fmt: skip
    best = next(r for r in plan["results"] if r["placer"] == plan["best"])
    assert abs(sim["step_time_s"] - best["step_time_s"]) <= 1e-9 * best["step_time_s"]

    report = json_of("report", "r.json", "--html", "r.html", cwd=tmp_path)
    assert report["report"] == "r.html" and report["bytes"] == (tmp_path / "r.html").stat().st_size

    graph = json_of("graph", "dmcca", "--inference", cwd=tmp_path)
    assert graph["training"] is False and graph["ops"] > 0

    cluster = json_of("cluster", "colocrl-2gpu", cwd=tmp_path)
    assert len(cluster["devices"]) == 3

    # at its own batch (64): the graph the placer and workload tests capture, cached once
    shard = json_of(
        "shard", "transformer", "--size", "base", "--cluster", "tpu-v3-8", "--mesh", "4",
        cwd=tmp_path,
    )  # fmt: skip
    assert shard["mesh"]["shape"] == [4] and shard["fits"] is True


def test_workloads_and_profile_print_one_json_document(tmp_path: Path) -> None:
    # two workloads at their default size (tests/test_workloads.py captures every one);
    # two of the quickest to capture (GPT-124M: ~2 s, rnnlm's unrolled LSTMs: ~4 s)
    rows = json_of("workloads", "dmcca", "gpt", cwd=tmp_path)
    assert [r["name"].split("-")[0] for r in rows] == ["dmcca", "gpt"]
    assert all(r["ops"] > 0 and r["flops_forward"] > 0 and r["capture_s"] > 0 for r in rows)
    profile = json_of("profile", "mlp", "--runs", "1", cwd=tmp_path)
    assert profile["format"] == "meshplace.profile" and profile["levels"]
