"""Learned placement: the gymnasium environment, the ``rl`` placer, checkpoints and resume.

The placers' clock is frozen for every test here (budgets are fixed numbers of updates, so
nothing depends on how busy the machine is); deadline tests advance it by hand."""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from meshplace import learn
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.learn import PlacementEnv, RLConfig, RLResult, planned_updates, train_rl
from meshplace.learn.features import FEATURE_NAMES, group_features, score_batch
from meshplace.learn.training import TrainingRun
from meshplace.placers import (
    ManualClock,
    PlacementProblem,
    PlacerError,
    registry,
    run_placer,
    use_clock,
)
from tests.forked import killed_after_news


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the trainers: no deadline stop unless a test moves the clock."""
    with use_clock(ManualClock()) as clock:
        yield clock


def _one_second_per_update(clock: ManualClock) -> Callable[[int, int, float], None]:
    """A progress callback that makes every training update take one second."""
    return lambda done, total, best: clock.advance(1.0)


@functools.cache
def _problem(workload: str, cluster: str) -> PlacementProblem:
    return PlacementProblem.build(workload_graph(workload), load_cluster(cluster))


def test_env_passes_gymnasium_check_env() -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    check_env(PlacementEnv(problem), skip_render_check=True)
    padded = PlacementEnv(problem, max_groups=problem.num_groups + 7)
    check_env(padded, skip_render_check=True)
    obs, _ = padded.reset(seed=0)
    assert obs.shape == (problem.num_groups + 7, len(FEATURE_NAMES))
    assert not obs[problem.num_groups :].any()
    assert obs[: problem.num_groups, FEATURE_NAMES.index("valid")].all()


def test_env_is_registered_once_and_made_by_id() -> None:
    learn.register_env()  # idempotent: importing or registering twice must not fail
    learn.register_env()
    env = gym.make(learn.ENV_ID, workload="dmcca", cluster="colocrl-2gpu")
    _, info = env.reset(seed=1)
    action = np.zeros(info["num_groups"], dtype=np.int64) + 1
    _, reward, terminated, truncated, step_info = env.step(action)
    problem = env.unwrapped.problem
    expected = problem.score(problem.evaluate(action))
    assert reward == pytest.approx(-np.sqrt(expected))
    assert step_info["score_s"] == pytest.approx(expected)
    assert terminated and not truncated


def test_batch_evaluation_equals_problem_evaluate_one_by_one() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    env = PlacementEnv(problem)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, problem.num_devices, size=(6, problem.num_groups))
    batch[3] = batch[1]  # a repeated plan is simulated once and scored the same
    batch[4] = 0  # everything on the CPU
    rewards = env.evaluate_batch(batch)
    one_by_one = [-np.sqrt(problem.score(problem.evaluate(row))) for row in batch]
    np.testing.assert_allclose(rewards, one_by_one, rtol=0, atol=0)
    np.testing.assert_allclose(score_batch(problem, batch), np.square(one_by_one), rtol=1e-12)


def test_features_are_finite_bounded_and_fixed_width() -> None:
    problem = _problem("rnnlm", "colocrl-4gpu")
    x = group_features(problem, max_groups=300)
    assert x.shape == (300, len(FEATURE_NAMES)) and x.dtype == np.float32
    # Within the environment's observation box, Box(0, 4).
    assert np.isfinite(x).all()
    assert PlacementEnv(problem, max_groups=300).observation_space.contains(x)
    assert x.max() > 0
    kinds = [i for i, n in enumerate(FEATURE_NAMES) if n.startswith("kind:")]
    np.testing.assert_allclose(x[: problem.num_groups][:, kinds].sum(axis=1), 1.0, rtol=1e-5)
    with pytest.raises(ValueError):
        group_features(problem, max_groups=problem.num_groups - 1)


@pytest.mark.parametrize("workload", ["dmcca", "rnnlm"])
def test_rl_returns_a_valid_deterministic_plan_within_budget(workload: str) -> None:
    problem = _problem(workload, "colocrl-4gpu")
    assert registry()["rl"].family == "learned"
    budget = 1.0  # six updates of 16 samples: a curve to check, every step of training
    first = run_placer("rl", problem, budget, seed=0)
    again = run_placer("rl", problem, budget, seed=0)
    assert first.op_devices.shape == (problem.graph.num_ops,)
    assert np.array_equal(first.sim.placement, first.op_devices)
    stats = first.stats
    # Within budget as fixed work: the budget's number of updates, each of 16 samples.
    assert stats["stopped_by"] == "budget" and stats["finished"]
    assert (
        stats["updates"] == stats["planned_updates"] == planned_updates(problem, budget, RLConfig())
    )
    assert 0 < first.evaluations <= stats["updates"] * RLConfig().samples + 1
    assert stats["evaluations"] == first.evaluations
    assert problem.score(first.sim) == pytest.approx(stats["best_score_s"])
    curve = stats["learning_curve"]
    assert len(curve["evaluations"]) == len(curve["best_step_time_s"]) == len(curve["wall_s"])
    assert len(curve["evaluations"]) == stats["updates"] >= 1
    assert np.all(np.diff(curve["evaluations"]) > 0)
    assert np.array_equal(first.op_devices, again.op_devices)
    assert again.stats["learning_curve"]["evaluations"] == curve["evaluations"]


def _branches_problem(weights: list[float]) -> PlacementProblem:
    """An input feeding independent matmul branches (sinks) of the given relative weights."""
    g = OpGraph("branches")
    g.add_op(Op("x", "input", output_shapes=[[256, 256]]))
    for b, w in enumerate(weights):
        g.add_op(Op(f"b{b}", "matmul", flops=w * 2e10, output_shapes=[[256, 256]]))
        g.add_edge("x", f"b{b}", 256 * 256 * 4)
    return PlacementProblem.build(g, load_cluster("colocrl-2gpu"))


def _all_scores(problem: PlacementProblem) -> np.ndarray:
    plans = itertools.product(range(problem.num_devices), repeat=problem.num_groups)
    return score_batch(problem, np.array(list(plans)))


def test_rl_finds_the_known_optimum_of_independent_branches() -> None:
    problem = _branches_problem([10, 10, 10, 10])
    assert problem.num_groups == 5
    out = train_rl(problem, budget_s=20.0, seed=0, updates=30)
    assert out.best_score_s == pytest.approx(_all_scores(problem).min(), rel=1e-12)
    gpus = [i for i, n in enumerate(problem.device_names) if n.startswith("gpu")]
    # The optimum: two branches on each GPU.
    on_gpu = np.bincount(out.group_devices[1:], minlength=problem.num_devices)[gpus]
    assert sorted(on_gpu.tolist()) == [2, 2]


def test_rl_learns_a_near_optimal_partition_of_unequal_branches() -> None:
    # 8 branches (3^9 plans): the optimum balances them over both GPUs and the CPU; the
    # median plan is ~2.3x slower and 6 % of plans are within 17 % of it. After 100 updates
    # the best sample is within 0.1 % of the optimum and the policy's own greedy plan (what
    # it learned, not what sampling stumbled on) within 17 % (seeds 0-3: 11-16 %).
    problem = _branches_problem([9, 8, 7, 6, 5, 4, 3, 2])
    scores = _all_scores(problem)
    assert np.median(scores) > 2 * scores.min()
    assert np.mean(scores <= 1.17 * scores.min()) < 0.07
    out = train_rl(problem, budget_s=60.0, seed=0, updates=100)
    assert out.best_score_s <= scores.min() * 1.001
    assert out.stats["greedy_score_s"] <= scores.min() * 1.17


def _curves_equal(a: dict, b: dict) -> None:
    assert a["evaluations"] == b["evaluations"]
    assert a["best_step_time_s"] == b["best_step_time_s"]


def _final_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["stateful"]["policy"]


def test_interrupted_training_resumes_to_the_same_plan(tmp_path: Path) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    config = RLConfig(checkpoint_every=4)
    full_ckpt = tmp_path / "full.pt"
    full = train_rl(problem, 60.0, seed=5, updates=12, config=config, checkpoint=full_ckpt)
    ckpt = tmp_path / "rl.pt"
    part = train_rl(problem, 60.0, 5, updates=12, config=config, checkpoint=ckpt, stop_after=6)
    assert part.stats["updates"] == 6 and not part.stats["finished"] and ckpt.exists()
    assert part.stats["stopped_by"] == "stop_after"
    resumed = train_rl(problem, 60.0, 5, updates=12, config=config, checkpoint=ckpt, resume=True)
    assert resumed.stats["resumed_from_update"] == 6 and resumed.stats["updates"] == 12
    assert np.array_equal(resumed.group_devices, full.group_devices)
    assert resumed.best_score_s == full.best_score_s
    _curves_equal(resumed.stats["learning_curve"], full.stats["learning_curve"])
    # One torch thread makes training bit-reproducible (rl.py): the resumed policy's
    # final weights are bit-identical to the uninterrupted run's.
    final, resumed_final = _final_weights(full_ckpt), _final_weights(ckpt)
    assert final.keys() == resumed_final.keys()
    assert all(torch.equal(final[k], resumed_final[k]) for k in final)
    # A checkpoint from another seed (or problem, budget, config) is refused.
    with pytest.raises(PlacerError, match="checkpoint is for another"):
        train_rl(problem, 60.0, 6, updates=12, config=config, checkpoint=ckpt, resume=True)


def _train_until_update_7(news: int, checkpoint: str) -> None:
    """Trains, and after update 7 (its last checkpoint: update 6) says so on ``news`` and
    waits to be killed."""

    def hold(done: int, total: int, best: float) -> None:
        if done == 7:
            os.write(news, b"update 7\n")
            threading.Event().wait()

    p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    train_rl(p, 600.0, 7, updates=12, config=RLConfig(checkpoint_every=2),
             checkpoint=checkpoint, progress=hold)  # fmt: skip


def test_training_killed_with_sigkill_resumes_to_the_same_plan(tmp_path: Path) -> None:
    ckpt = tmp_path / "killed.pt"
    # The child is mid-training (update 7 made, its checkpoint holds update 6) when killed.
    assert killed_after_news(_train_until_update_7, str(ckpt)) == "update 7\n"
    assert torch.load(ckpt, weights_only=True)["done"] == 6
    problem = _problem("dmcca", "colocrl-2gpu")
    config = RLConfig(checkpoint_every=2)
    resumed = train_rl(problem, 600.0, 7, updates=12, config=config, checkpoint=ckpt, resume=True)
    assert resumed.stats["resumed_from_update"] == 6
    full = train_rl(problem, 600.0, 7, updates=12, config=config)
    assert np.array_equal(resumed.group_devices, full.group_devices)
    assert resumed.best_score_s == full.best_score_s
    _curves_equal(resumed.stats["learning_curve"], full.stats["learning_curve"])


def test_a_budget_too_small_for_the_updates_stops_at_the_deadline_and_says_so(
    frozen_clock: ManualClock,
) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    tick = _one_second_per_update(frozen_clock)
    out = train_rl(problem, 1e-3, seed=0, updates=50, progress=tick)
    assert out.stats["updates"] == 1 and out.stats["stopped_at_deadline"]
    assert out.stats["stopped_by"] == "deadline"
    assert not out.stats["finished"] and out.stats["greedy_score_s"] is None
    assert len(out.stats["learning_curve"]["evaluations"]) == 1


def test_the_deadline_stops_training_after_97_percent_of_the_budget(
    frozen_clock: ManualClock,
) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    tick = _one_second_per_update(frozen_clock)
    updates = 12  # two more than the deadline lets through
    out = train_rl(problem, 10.0, seed=0, updates=updates, progress=tick)
    # 9 s after 9 updates is within the 9.7 s deadline, 10 s after 10 is not.
    assert out.stats["stopped_by"] == "deadline" and out.stats["updates"] == 10
    assert out.stats["deadline_s"] == pytest.approx(9.7) and out.stats["wall_s"] == 10.0
    # Each curve point is recorded before its update's second passes.
    assert out.stats["learning_curve"]["wall_s"] == [float(k) for k in range(10)]
    # Without the clock moving the same run makes all of its updates.
    full = train_rl(problem, 10.0, seed=0, updates=updates).stats
    assert full["stopped_by"] == "budget" and full["updates"] == updates


def test_a_resumed_run_keeps_the_original_runs_deadline(tmp_path: Path) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    config = RLConfig(checkpoint_every=2)

    def train(clock: ManualClock, **kwargs) -> RLResult:
        return train_rl(
            problem, 10.0, 3, updates=50, config=config, progress=_one_second_per_update(clock),
            **kwargs,
        )  # fmt: skip

    with use_clock(ManualClock()) as clock:
        full = train(clock)
    assert full.stats["stopped_by"] == "deadline" and full.stats["updates"] == 10
    ckpt = tmp_path / "rl.pt"
    with use_clock(ManualClock()) as clock:
        part = train(clock, checkpoint=ckpt, stop_after=4)
    assert part.stats["stopped_by"] == "stop_after" and part.stats["updates"] == 4
    assert torch.load(ckpt, weights_only=True)["wall_s"] == 4.0
    # A later session's clock reads anything; only the 4 s already spent count, so the
    # run gets the 5.7 s left of its 9.7 s deadline, not a fresh 9.7 s.
    with use_clock(ManualClock(start=5000.0)) as clock:
        resumed = train(clock, checkpoint=ckpt, resume=True)
    assert resumed.stats["resumed_from_update"] == 4
    assert resumed.stats["stopped_by"] == "deadline" and resumed.stats["updates"] == 10
    assert np.array_equal(resumed.group_devices, full.group_devices)
    _curves_equal(resumed.stats["learning_curve"], full.stats["learning_curve"])
    assert resumed.stats["learning_curve"]["wall_s"] == full.stats["learning_curve"]["wall_s"]


def test_training_run_counts_the_seconds_of_earlier_sessions(tmp_path: Path) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    clock = ManualClock()
    plans = np.zeros((1, problem.num_groups), dtype=np.int64)

    def session(stop_after: int | None, resume: bool) -> TrainingRun:
        run = TrainingRun(
            problem,
            total=100,
            fingerprint={"seed": 0},
            fmt="test v1",
            best=plans[0],
            path=tmp_path / "run.ckpt",
            checkpoint_every=1,
            deadline_s=5.5,
            stop_after=stop_after,
            clock=clock,
        )
        if resume:
            run.resume({})
        while run.keep_going():
            run.offer(plans, np.array([1.0]), np.array([1.0]))
            clock.advance(1.0)
            run.finish_update()
        return run

    first = session(stop_after=3, resume=False)
    assert first.stopped_by == "stop_after" and first.wall_s() == 3.0
    clock.advance(1000.0)  # time between the sessions is not training time
    second = session(stop_after=None, resume=True)
    assert second.stopped_by == "deadline" and second.done == 6 and second.wall_s() == 6.0
    assert second.stats()["stopped_by"] == "deadline"
