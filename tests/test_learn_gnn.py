"""The ``gnn`` placer: shipped weights, zero-shot placement, fine-tuning, resume, training.

The placers' clock is frozen for every test here: zero-shot is a fixed number of samples and
fine-tuning a fixed number of updates, so nothing depends on how busy the machine is."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshplace.cli import main
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.learn import gnn
from meshplace.learn.gnn import GNNConfig, GNNPolicy, PPOConfig, finetune, load_weights
from meshplace.learn.train_gnn import HELD_OUT, GraphSpec, family_clusters, train, training_specs
from meshplace.placers import (
    ManualClock,
    PlacementProblem,
    PlacerError,
    PlacerOptions,
    run_placer,
    use_clock,
)


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the placers: no deadline stop unless a test moves the clock."""
    with use_clock(ManualClock()) as clock:
        yield clock


@functools.cache
def _graph(name: str):
    return workload_graph(name)


@functools.cache
def _problem(workload: str, cluster: str) -> PlacementProblem:
    clusters = family_clusters()
    c = clusters[cluster] if cluster in clusters else load_cluster(cluster)
    return PlacementProblem.build(_graph(workload), c)


def test_shipped_weights_place_nmt_zero_shot_with_a_fixed_number_of_samples() -> None:
    problem = _problem("nmt", "colocrl-4gpu")
    _, training = load_weights()
    assert training["updates"] > 0 and "nmt-2layer@colocrl-4gpu" in training["held_out"]
    assert not any(label.startswith("nmt") for label in training["family"])
    result = run_placer("gnn", problem, 1.0, 0)
    # Zero-shot is fixed work, whatever the budget: 32 decodes per grouping, each simulated
    # at most once (how fast that is: benchmarks/budgets.py), and no training update.
    granularities = result.stats["granularities"]
    assert granularities[0]["groups"] == problem.num_groups
    assert result.stats["samples"] == gnn.ZERO_SHOT_SAMPLES * len(granularities)
    assert 0 < result.evaluations <= result.stats["samples"]
    assert result.stats["finetune_updates"] == 0 and result.stats["stopped_by"] == "budget"
    longer = run_placer("gnn", problem, 60.0, 0)
    assert longer.evaluations == result.evaluations
    assert np.array_equal(longer.op_devices, result.op_devices)
    assert result.step_time_s == min(g["step_time_s"] for g in granularities)
    assert result.step_time_s == pytest.approx(result.stats["zero_shot_step_time_s"])
    assert result.stats["learning_curve"]["best_step_time_s"] == [result.step_time_s]
    assert not result.oom
    assert result.step_time_s < run_placer("expert", problem, 1.0, 0).step_time_s


@pytest.mark.parametrize(
    ("cluster", "devices"),
    [("pcie-1xk80", 2), ("colocrl-2gpu", 3), ("colocrl-4gpu", 5), ("pcie-7xk80", 8)],
)
def test_plans_are_valid_on_two_to_eight_devices(cluster: str, devices: int) -> None:
    problem = _problem("dmcca", cluster)
    assert problem.num_devices == devices
    result = run_placer("gnn", problem, 1.0, 0)
    assert result.op_devices.shape == (problem.graph.num_ops,)
    assert np.array_equal(result.sim.placement, result.op_devices)
    assert not result.oom
    again = run_placer("gnn", problem, 1.0, 0)
    assert np.array_equal(result.op_devices, again.op_devices)


def test_finetune_is_never_worse_than_zero_shot_and_reports_a_curve() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    zero = run_placer("gnn", problem, 1.0, 0)
    tuned = run_placer("gnn", problem, 2.0, 0, PlacerOptions(finetune_s=2.0))
    stats = tuned.stats
    assert tuned.step_time_s <= zero.step_time_s
    assert stats["zero_shot_step_time_s"] == zero.step_time_s
    assert stats["finetune_updates"] == stats["planned_updates"] >= 1
    assert stats["stopped_by"] == "budget"
    curve = stats["learning_curve"]
    assert len(curve["evaluations"]) == stats["finetune_updates"] + 1
    assert curve["best_step_time_s"][0] == zero.step_time_s
    assert curve["best_step_time_s"][-1] == tuned.step_time_s == stats["best_step_time_s"]
    assert all(a >= b for a, b in zip(curve["best_step_time_s"], curve["best_step_time_s"][1:]))


def test_finetune_resumed_after_a_stop_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    problem = _problem("dmcca", "colocrl-2gpu")
    config = PPOConfig(samples=8, checkpoint_every=2)
    full = finetune(problem, load_weights()[0], 60.0, 1, config=config, updates=5)
    ckpt = tmp_path / "gnn.ckpt"
    first = finetune(
        problem,
        load_weights()[0],
        60.0,
        1,
        config=config,
        updates=5,
        checkpoint=ckpt,
        stop_after=3,
    )
    assert first.stats["finetune_updates"] == 3 and ckpt.exists()
    rest = finetune(
        problem,
        load_weights()[0],
        60.0,
        1,
        config=config,
        updates=5,
        checkpoint=ckpt,
        resume=True,
    )
    assert rest.stats["resumed_from_update"] == 3
    assert np.array_equal(rest.group_devices, full.group_devices)
    for key in ("evaluations", "best_step_time_s"):
        assert rest.stats["learning_curve"][key] == full.stats["learning_curve"][key]
    with pytest.raises(PlacerError, match="checkpoint is for another"):
        finetune(
            problem,
            load_weights()[0],
            60.0,
            2,
            config=config,
            updates=5,
            checkpoint=ckpt,
            resume=True,
        )


def test_a_tiny_training_run_writes_loadable_weights(tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    specs = [("dmcca@colocrl-2gpu", GraphSpec("dmcca", "4view"), "colocrl-2gpu")]
    record = train(
        out,
        1.0,
        0,
        updates=2,
        config=GNNConfig(hidden=16, rounds=1),
        specs=specs,
        log=lambda _: None,
    )
    policy, training = load_weights(out)
    assert training["updates"] == record["updates"] == 2
    assert policy.config == GNNConfig(hidden=16, rounds=1)
    assert out.stat().st_size < 2e6
    assert gnn.DEFAULT_WEIGHTS.stat().st_size < 2e6


def test_family_and_held_out_are_disjoint_and_span_two_to_eight_devices() -> None:
    trained = {spec.workload for _, spec, _ in training_specs()}
    held = {spec.workload for spec, _ in HELD_OUT}
    assert not trained & held and {"nmt", "inception_v3"} <= held
    sizes = {len(c.devices) for c in family_clusters().values()}
    assert min(sizes) == 2 and max(sizes) == 8


def test_missing_or_corrupt_weights_are_one_placer_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "gnn.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(PlacerError, match="unreadable"):
        load_weights(bad)
    monkeypatch.setattr(gnn, "DEFAULT_WEIGHTS", tmp_path / "missing.pt")
    with pytest.raises(PlacerError, match="missing"):
        run_placer("gnn", _problem("dmcca", "colocrl-2gpu"), 1.0, 0)


def test_policy_is_equivariant_to_device_order() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    x = gnn.problem_inputs(problem)
    policy = GNNPolicy(GNNConfig(hidden=16, rounds=2))
    static = policy.static_scores(x).detach().numpy()
    perm = [0, 3, 4, 1, 2]  # swap the two K80 boards
    x.device_x = x.device_x[perm]
    np.testing.assert_allclose(policy.static_scores(x).detach().numpy(), static[:, perm], atol=1e-5)


def test_cli_plan_with_finetune() -> None:
    args = ["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "gnn", "--finetune", "2"]
    assert main(args) == 0
