"""The ``hrl`` placer: the hierarchical planner (Grouper + Placer), checkpoints and resume.

The placers' clock is frozen for every test here (a budget is a fixed number of updates),
so no deadline cuts a run short on a busy machine; the deadline test moves it by hand."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from meshplace.cli import main
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.learn import HRLConfig, train_hrl
from meshplace.learn.features import layer_key
from meshplace.learn.hrl import (
    _OpTable,
    group_embedding_size,
    group_embeddings,
    op_feature_names,
    op_features,
    op_layer,
    sample_groups,
    score_ops_batch,
)
from meshplace.placers import (
    ManualClock,
    PlacementProblem,
    PlacerError,
    PlacerOptions,
    registry,
    run_placer,
    use_clock,
)
from tests.forked import killed_after_news

SMALL = HRLConfig(checkpoint_every=3)


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the trainers: no deadline stop unless a test moves the clock."""
    with use_clock(ManualClock()) as clock:
        yield clock


@functools.cache
def _problem(workload: str, cluster: str) -> PlacementProblem:
    return PlacementProblem.build(workload_graph(workload), load_cluster(cluster))


def _synthetic(n_forward: int) -> OpGraph:
    """A forward chain with skip edges and its backward chain: ``2 · n_forward − 1`` ops."""
    g = OpGraph(f"synthetic-{2 * n_forward - 1}")
    shape = [64, 256]
    nbytes = 64 * 256 * 4
    g.add_op(Op("x", "input", output_shapes=[shape]))
    for i in range(1, n_forward):
        kind = "matmul" if i % 3 == 0 else "elementwise"
        g.add_op(Op(f"f{i}", kind, flops=2e7 if i % 3 == 0 else 1e5, output_shapes=[shape]))
        g.add_edge(f"f{i - 1}" if i > 1 else "x", f"f{i}", nbytes)
        if i > 4:
            g.add_edge(f"f{i - 4}", f"f{i}", nbytes)
    prev = f"f{n_forward - 1}"
    for i in range(n_forward - 1, 0, -1):
        kind = "matmul" if i % 3 == 0 else "elementwise"
        g.add_op(
            Op(
                f"b{i}",
                kind,
                phase="backward",
                flops=2e7 if i % 3 == 0 else 1e5,
                output_shapes=[shape],
                forward_op=f"f{i}",
            )
        )
        g.add_edge(prev, f"b{i}", nbytes)
        g.add_edge(f"f{i}", f"b{i}", nbytes)
        prev = f"b{i}"
    return g


def test_features_and_group_embeddings_are_finite_and_consistent() -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    x = op_features(problem)
    assert x.shape == (problem.graph.num_ops, len(op_feature_names()))
    assert np.isfinite(x).all()
    for name in ("anchor", "layer", "depth"):
        column = x[:, op_feature_names().index(name)]
        assert column.min() >= 0 and column.max() <= 1, name
    # Ops of one module share a layer; a backward op takes its forward op's.
    layer = op_layer(problem)
    graph = problem.graph
    by_module: dict[str, set[float]] = {}
    for i, op in enumerate(graph.ops):
        if op.module:
            by_module.setdefault(layer_key(op.module), set()).add(float(layer[i]))
        if op.forward_op and not op.module:
            assert layer[i] == layer[graph.index(op.forward_op)]
    assert len(by_module) > 1 and all(len(v) == 1 for v in by_module.values())
    table = _OpTable(problem, x)
    groups = np.random.default_rng(0).integers(0, 7, size=(3, problem.graph.num_ops))
    e = group_embeddings(table, groups, 7)
    assert e.shape == (3, 7, group_embedding_size(7)) and np.isfinite(e).all()
    # Row k of a batch equals the embedding of grouping k alone.
    np.testing.assert_array_equal(e[1], group_embeddings(table, groups[1:2], 7)[0])
    # Inverse-CDF sampling draws groups in range with the policy's probabilities, and a
    # one-hot distribution exactly.
    logp = torch.log_softmax(torch.randn(50, 7, generator=torch.Generator().manual_seed(2)), 1)
    drawn = sample_groups(logp, 4000, torch.Generator().manual_seed(0))
    assert drawn.shape == (4000, 50) and int(drawn.max()) < 7
    frequency = np.stack([np.bincount(col, minlength=7) for col in drawn.T.numpy()]) / 4000
    np.testing.assert_allclose(frequency, logp.exp().numpy(), atol=0.035)
    sure = torch.full((5, 7), -1e9)
    sure[torch.arange(5), torch.tensor([0, 6, 3, 3, 1])] = 0.0
    drawn = sample_groups(torch.log_softmax(sure, 1), 2, torch.Generator().manual_seed(1))
    assert drawn.tolist() == [[0, 6, 3, 3, 1]] * 2


def test_hrl_returns_a_valid_deterministic_op_plan() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    spec = registry()["hrl"]
    assert spec.family == "learned" and spec.uses_budget and spec.takes_options
    first = run_placer("hrl", problem, 3.0, seed=0)
    again = run_placer("hrl", problem, 3.0, seed=0)
    assert first.op_devices.shape == (problem.graph.num_ops,)
    assert np.array_equal(first.sim.placement, first.op_devices)
    stats = first.stats
    assert stats["evaluations"] == first.evaluations > 0
    assert problem.score(first.sim) == pytest.approx(stats["best_score_s"])
    assert stats["groups"] == min(256, 20 * problem.num_devices)
    curve = stats["learning_curve"]
    assert len(curve["evaluations"]) == len(curve["best_step_time_s"]) == len(curve["wall_s"])
    assert len(curve["evaluations"]) == stats["updates"] >= 1
    assert np.all(np.diff(curve["evaluations"]) > 0)
    assert np.all(np.diff(curve["best_step_time_s"]) <= 0)
    assert stats["stopped_by"] == "budget"
    assert stats["updates"] == stats["planned_updates"]
    assert np.array_equal(first.op_devices, again.op_devices)
    assert again.stats["learning_curve"]["best_step_time_s"] == curve["best_step_time_s"]
    # Batched op-level scoring equals one-by-one evaluation and counts distinct plans.
    plans = np.stack([first.op_devices, first.op_devices, np.zeros_like(first.op_devices)])
    before = problem.evaluations
    scores, steps, ooms = score_ops_batch(problem, plans)
    assert problem.evaluations - before == 2
    assert scores[0] == scores[1] == problem.score(problem.evaluate_ops(plans[0]))
    assert steps[2] == problem.evaluate_ops(plans[2]).step_time_s and not ooms.any()


def _curves_equal(a: dict, b: dict) -> None:
    assert a["evaluations"] == b["evaluations"]
    assert a["best_step_time_s"] == b["best_step_time_s"]


def test_interrupted_training_resumes_to_the_same_plan(tmp_path: Path) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    full = train_hrl(problem, 60.0, 5, updates=8, config=SMALL)
    ckpt = tmp_path / "hrl.pt"
    part = train_hrl(problem, 60.0, 5, updates=8, config=SMALL, checkpoint=ckpt, stop_after=4)
    assert part.stats["updates"] == 4 and not part.stats["finished"] and ckpt.exists()
    resumed = train_hrl(problem, 60.0, 5, updates=8, config=SMALL, checkpoint=ckpt, resume=True)
    assert resumed.stats["resumed_from_update"] == 4 and resumed.stats["updates"] == 8
    assert np.array_equal(resumed.op_devices, full.op_devices)
    assert resumed.best_score_s == full.best_score_s
    assert resumed.stats["greedy_score_s"] == full.stats["greedy_score_s"]
    _curves_equal(resumed.stats["learning_curve"], full.stats["learning_curve"])
    # A checkpoint from another seed (or problem, budget, config) is refused.
    with pytest.raises(PlacerError, match="checkpoint is for another"):
        train_hrl(problem, 60.0, 6, updates=8, config=SMALL, checkpoint=ckpt, resume=True)


def _train_until_update_5(news: int, checkpoint: str) -> None:
    """Trains, and after update 5 (its last checkpoint: update 4) says so on ``news`` and
    waits to be killed."""

    def hold(done: int, total: int, best: float) -> None:
        if done == 5:
            os.write(news, b"update 5\n")
            threading.Event().wait()

    p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    train_hrl(p, 600.0, 7, updates=16, config=HRLConfig(checkpoint_every=2),
              checkpoint=checkpoint, progress=hold)  # fmt: skip


def test_training_killed_with_sigkill_resumes_to_the_same_plan(tmp_path: Path) -> None:
    ckpt = tmp_path / "killed.pt"
    # The child is mid-training (update 5 made, its checkpoint holds update 4) when killed.
    assert killed_after_news(_train_until_update_5, str(ckpt)) == "update 5\n"
    assert torch.load(ckpt, weights_only=True)["done"] == 4
    problem = _problem("dmcca", "colocrl-2gpu")
    config = HRLConfig(checkpoint_every=2)
    resumed = train_hrl(problem, 600.0, 7, updates=16, config=config, checkpoint=ckpt, resume=True)
    assert resumed.stats["resumed_from_update"] == 4
    full = train_hrl(problem, 600.0, 7, updates=16, config=config)
    assert np.array_equal(resumed.op_devices, full.op_devices)
    assert resumed.best_score_s == full.best_score_s
    _curves_equal(resumed.stats["learning_curve"], full.stats["learning_curve"])


def test_a_10k_op_graph_trains_without_hand_made_groups() -> None:
    graph = _synthetic(5001)
    assert graph.num_ops >= 10_000
    problem = PlacementProblem.build(graph, load_cluster("colocrl-4gpu"))
    out = train_hrl(problem, 120.0, 0, updates=2)
    assert out.op_devices.shape == (graph.num_ops,) and out.stats["updates"] == 2
    assert out.stats["groups"] == 100 and np.isfinite(out.best_score_s)
    # One update is 16 sampled plans: at most 16 simulations of the 10k ops.
    evaluations = out.stats["learning_curve"]["evaluations"]
    assert 0 < evaluations[1] - evaluations[0] <= HRLConfig().samples


def test_the_deadline_stops_hrl_and_the_stats_say_so(frozen_clock: ManualClock) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    one_second_per_update = lambda done, total, best: frozen_clock.advance(1.0)  # noqa: E731
    out = train_hrl(problem, 3.0, 0, updates=20, config=SMALL, progress=one_second_per_update)
    # 2 s after 2 updates is within the 2.91 s deadline, 3 s after 3 is not.
    assert out.stats["stopped_by"] == "deadline" and out.stats["stopped_at_deadline"]
    assert out.stats["updates"] == 3 and not out.stats["finished"]


def test_progress_is_reported_after_every_update() -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    seen: list[tuple[int, int, float]] = []
    result = run_placer("hrl", problem, 2.0, 0, PlacerOptions(progress=lambda *a: seen.append(a)))
    assert [d for d, _, _ in seen] == list(range(1, result.stats["updates"] + 1))
    assert all(t == result.stats["planned_updates"] for _, t, _ in seen)
    best = [b for _, _, b in seen]
    assert best == sorted(best, reverse=True) and best[-1] >= result.step_time_s


def test_meshplace_plan_runs_hrl(tmp_path: Path, capsys) -> None:
    result = tmp_path / "result.json"
    argv = ["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "hrl", "--budget", "3"]
    assert main([*argv, "--result", str(result), "--checkpoint-dir", str(tmp_path)]) == 0
    assert "hrl" in capsys.readouterr().out
    row = next(r for r in json.loads(result.read_text())["results"] if r["placer"] == "hrl")
    assert row["step_time_s"] > 0 and row["stats"]["updates"] >= 1
    assert (tmp_path / "hrl.ckpt").exists()
