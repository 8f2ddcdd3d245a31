"""``meshplace plan`` with learned placers: checkpoints, ``--resume``, progress, bad options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshplace.cli import main
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.learn import train_rl
from meshplace.placers import PlacementProblem, PlacerOptions, run_placer

PLAN = ["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "rl"]


def _one_sentence_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_bad_learning_options_are_one_sentence(capsys, tmp_path: Path) -> None:
    _one_sentence_error(capsys, [*PLAN, "--resume"], "--resume needs --checkpoint-dir")
    afile = tmp_path / "file"
    afile.write_text("x")
    _one_sentence_error(capsys, [*PLAN, "--checkpoint-dir", str(afile)], "is not a folder")
    _one_sentence_error(capsys, [*PLAN, "--finetune", "-1"], "--finetune must be non-negative")
    assert list(tmp_path.iterdir()) == [afile]


def test_progress_is_reported_after_every_update() -> None:
    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    seen: list[tuple[int, int, float]] = []
    result = run_placer("rl", problem, 2.0, 0, PlacerOptions(progress=lambda *a: seen.append(a)))
    assert [d for d, _, _ in seen] == list(range(1, result.stats["updates"] + 1))
    assert all(t == result.stats["planned_updates"] for _, t, _ in seen)
    best = [b for _, _, b in seen]
    assert best == sorted(best, reverse=True) and best[-1] >= result.step_time_s


def test_plan_killed_with_sigkill_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The CLI run is killed after its first checkpoint; ``--resume`` finishes the training
    and ends with the plan an uninterrupted run of the same length ends with."""
    ckpt_dir = tmp_path / "ckpt"
    budget = "5"
    command = [sys.executable, "-m", "meshplace.cli", *PLAN, "--budget", budget, "--json"]
    proc = subprocess.Popen(
        [*command, "--checkpoint-dir", str(ckpt_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    ckpt = ckpt_dir / "rl.ckpt"
    try:
        deadline = time.monotonic() + 120
        while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the plan finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and ckpt.exists()

    result = tmp_path / "result.json"
    argv = [*PLAN, "--budget", budget, "--checkpoint-dir", str(ckpt_dir), "--resume"]
    assert main([*argv, "--result", str(result)]) == 0
    row = next(r for r in json.loads(result.read_text())["results"] if r["placer"] == "rl")
    stats = row["stats"]
    assert stats["resumed_from_update"] >= 20  # the first checkpoint (every 20 updates)
    if stats["stopped_at_deadline"]:
        pytest.skip("this machine was too slow to finish the resumed training in its budget")
    assert stats["updates"] == stats["planned_updates"]
    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    full = train_rl(problem, 1e6, 0, updates=stats["planned_updates"])
    assert stats["best_score_s"] == full.best_score_s
    assert stats["learning_curve"]["best_step_time_s"] == pytest.approx(
        full.stats["learning_curve"]["best_step_time_s"], rel=0, abs=0
    )
    assert np.isclose(row["step_time_s"], full.stats["best_step_time_s"])
