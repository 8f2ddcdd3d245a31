"""``meshplace plan`` with learned placers: checkpoints, ``--resume``, progress, bad options.

The placers' clock is frozen for every test here (in the killed subprocess too): a budget
is a fixed number of updates, so no deadline cuts a run short on a busy machine."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from meshplace.cli import main
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.learn import train_rl
from meshplace.placers import ManualClock, PlacementProblem, PlacerOptions, run_placer, use_clock
from tests.forked import killed_after_news

PLAN = ["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "rl"]


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the placers: no deadline stop, so every run is exact work."""
    with use_clock(ManualClock()) as clock:
        yield clock


def _one_sentence_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_bad_learning_options_are_one_sentence(capsys, tmp_path: Path) -> None:
    _one_sentence_error(capsys, [*PLAN, "--resume"], "--resume needs --checkpoint-dir")
    afile = tmp_path / "file"
    afile.write_text("x")
    _one_sentence_error(capsys, [*PLAN, "--checkpoint-dir", str(afile)], "is not a folder")
    _one_sentence_error(capsys, [*PLAN, "--finetune", "-1"], "non-negative")
    assert list(tmp_path.iterdir()) == [afile]


def test_progress_is_reported_after_every_update() -> None:
    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    seen: list[tuple[int, int, float]] = []
    result = run_placer("rl", problem, 2.0, 0, PlacerOptions(progress=lambda *a: seen.append(a)))
    assert [d for d, _, _ in seen] == list(range(1, result.stats["updates"] + 1))
    assert all(t == result.stats["planned_updates"] for _, t, _ in seen)
    best = [b for _, _, b in seen]
    assert best == sorted(best, reverse=True) and best[-1] >= result.step_time_s


def _plan_until_its_first_checkpoint(news: int, argv: list[str]) -> None:
    """``meshplace plan ARGV`` with the placers' clock frozen, which after writing its first
    checkpoint says so on ``news`` (its stdout, the CLI's, goes nowhere) and waits to be
    killed."""
    from meshplace.learn import training

    save = training.save_checkpoint

    def save_then_hold(path: Path, state: dict) -> None:
        save(path, state)
        os.write(news, f"checkpoint {state['done']}\n".encode())
        threading.Event().wait()

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    training.save_checkpoint = save_then_hold
    with use_clock(ManualClock()):
        main(argv)


def test_plan_killed_with_sigkill_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The CLI run is killed after its first checkpoint; ``--resume`` finishes the training
    and ends with the plan an uninterrupted run of the same length ends with."""
    ckpt_dir = tmp_path / "ckpt"
    budget = "4"  # 27 updates: a checkpoint at 20 (every 20), then 7 more to resume
    argv = [*PLAN, "--budget", budget, "--json", "--checkpoint-dir", str(ckpt_dir)]
    ckpt = ckpt_dir / "rl.ckpt"
    # The first checkpoint (every 20 updates) is on disk and training still runs.
    assert killed_after_news(_plan_until_its_first_checkpoint, argv) == "checkpoint 20\n"
    assert torch.load(ckpt, weights_only=True)["done"] == 20

    result = tmp_path / "result.json"
    argv = [*PLAN, "--budget", budget, "--checkpoint-dir", str(ckpt_dir), "--resume"]
    assert main([*argv, "--result", str(result)]) == 0
    row = next(r for r in json.loads(result.read_text())["results"] if r["placer"] == "rl")
    stats = row["stats"]
    assert stats["resumed_from_update"] == 20  # the first checkpoint (every 20 updates)
    assert stats["stopped_by"] == "budget"
    assert stats["updates"] == stats["planned_updates"]
    problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    full = train_rl(problem, 1e6, 0, updates=stats["planned_updates"])
    assert stats["best_score_s"] == full.best_score_s
    assert stats["learning_curve"]["best_step_time_s"] == pytest.approx(
        full.stats["learning_curve"]["best_step_time_s"], rel=0, abs=0
    )
    assert np.isclose(row["step_time_s"], full.stats["best_step_time_s"])
