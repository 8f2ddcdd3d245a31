"""Every registered placer on every reference workload and three clusters; `meshplace plan`.

The learned placers (family ``learned``) run on the same grid in test_placers_learned.py,
so pytest-xdist's ``--dist loadfile`` can put the two halves on different workers; their
determinism and resume are tested in test_learn*.py.

No test here reads the wall clock: budgets are fixed amounts of work, so the checks are on
the work (simulations, the plan a seed gives), with the placers' clock frozen so that no
deadline can cut a run short on a busy machine; the deadline paths are tested by making an
injected clock jump. How long placers really take against their budget is measured by
``benchmarks/budgets.py``."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from meshplace import models
from meshplace.cli import main
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.placers import (
    ManualClock,
    PlacementProblem,
    PlacerError,
    registry,
    resolve,
    run_placer,
    use_clock,
)
from meshplace.placers.base import SIMULATED_OPS_PER_SECOND
from meshplace.placers.search import BUDGET_SHARE
from meshplace.plan.placement import load_plan

WORKLOADS = list(models.available())
CLUSTERS = ["colocrl-4gpu", "dgx-h100", "h2-8xv100"]  # the last: 16 GPUs on 2 hosts
BUDGET_S = 0.5  # fixed work: a quarter of the default
# The grid of every placer on every workload and cluster checks validity and the budget
# as fixed work, which hold at any budget: an eighth of the default keeps it affordable
# (determinism and anneal's seeding keep BUDGET_S in their own tests below).
GRID_BUDGET_S = 0.25


@pytest.fixture(autouse=True)
def frozen_clock() -> Iterator[ManualClock]:
    """Time stands still for the placers: no deadline stop, so every run is exact work."""
    with use_clock(ManualClock()) as clock:
        yield clock


def _not_learned() -> list[str]:
    known = registry()
    return [name for name in known if known.family(name) != "learned"]


@functools.cache
def _graph(name: str) -> OpGraph:
    return workload_graph(name)


@functools.cache
def _cluster(name: str):
    return load_cluster(name)


@functools.cache
def _problem(workload: str, cluster: str) -> PlacementProblem:
    """One problem per workload and cluster for the tests that only run placers on it
    (run_placer changes nothing in a problem but its evaluation count, which it resets
    first, and its one-off warm-up): built once, not once per test."""
    return PlacementProblem.build(_graph(workload), _cluster(cluster))


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_placer_returns_a_valid_plan_within_budget(workload: str, cluster: str) -> None:
    problem = _problem(workload, cluster)
    for name in _not_learned():
        result = run_placer(name, problem, GRID_BUDGET_S, seed=0)
        devices = result.op_devices
        assert devices.shape == (problem.graph.num_ops,), name
        # The reported simulation is the simulation of the returned plan.
        assert np.array_equal(result.sim.placement, devices), name
        # Within budget as fixed work: the budget, not a deadline, ended the search, and
        # its simulations fit the budget's share at the simulator speed assumed.
        assert result.stats.get("stopped_by", "budget") == "budget", name
        simulated_s = result.evaluations * problem.graph.num_ops / SIMULATED_OPS_PER_SECOND
        assert simulated_s <= BUDGET_SHARE * GRID_BUDGET_S, (name, result.evaluations)
        assert result.step_time_s >= problem.simulator.lower_bound() * (1 - 1e-9), name
    # (determinism, the same plan and evaluations for a seed, has its own test below)


@pytest.mark.parametrize("workload", ["dmcca", "rnnlm", "resnet50"])
def test_placers_are_deterministic_for_a_seed(workload: str) -> None:
    # At BUDGET_S random_search draws 415-2,050 plans in batches of 64, and anneal runs
    # seven or eight of its nine seed placers (dmcca: all but mincut; rnnlm and resnet50
    # skip metis or pipeline too, each checked on its own below) and then its two walks,
    # 131-1,213 simulations in all: every random choice the placers make, at half the
    # work of twice the budget.
    problem = _problem(workload, "colocrl-4gpu")
    for name in _not_learned():
        first = run_placer(name, problem, BUDGET_S, seed=3)
        again = run_placer(name, problem, BUDGET_S, seed=3)
        assert np.array_equal(first.op_devices, again.op_devices), name
        assert first.evaluations == again.evaluations, name


@pytest.mark.parametrize("workload", ["dmcca", "nmt", "inception_v3"])
def test_anneal_never_returns_a_plan_worse_than_its_seed(workload: str) -> None:
    problem = _problem(workload, "colocrl-4gpu")
    result = run_placer("anneal", problem, BUDGET_S, seed=1)
    assert result.stats["best_score_s"] <= result.stats["seed_score_s"]
    assert problem.score(result.sim) == pytest.approx(result.stats["best_score_s"])
    seed = run_placer(result.stats["seed_placer"], problem, BUDGET_S, seed=1)
    assert problem.score(result.sim) <= problem.score(seed.sim) * (1 + 1e-12)


@pytest.mark.parametrize("kind", ["input", "parameter", "buffer"])
def test_anneal_walks_a_graph_whose_every_plan_takes_no_time(kind: str) -> None:
    """A graph of one op that costs nothing scores 0 s under every plan: the walk's
    temperatures are then 0 too (it divided the two by each other), and it returns a
    plan of that score."""
    graph = OpGraph("nothing")
    graph.add_op(Op("a", kind))
    problem = PlacementProblem.build(graph, _cluster("colocrl-4gpu"))
    # a budget of 2 ms: a one-op graph's simulations are so cheap that it buys ~2,000 of
    # them, each walk's temperatures divided by a 0 s score 1,000 times (50 ms bought
    # 38,571, ~5 s of the suite for each kind)
    result = run_placer("anneal", problem, 0.002, seed=0)
    assert result.op_devices.shape == (1,) and result.step_time_s == 0.0
    assert result.stats["best_score_s"] == 0.0
    assert all(walk["accepted"] >= 100 for walk in result.stats["walks"])


def test_anneal_charges_its_seeding_to_the_budget() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    n_ops = problem.graph.num_ops
    # (anneal is deterministic for a seed: the checks of the small and the large budget
    # below read these two runs rather than running them again)
    results = {budget: run_placer("anneal", problem, budget, seed=0) for budget in (0.1, 2.0)}
    for budget, result in results.items():
        stats = result.stats
        # The seeding's estimated cost and the walks together fill the budget's share, so
        # the walks get fewer simulations than the whole share would buy.
        assert stats["estimated_work_s"] <= BUDGET_SHARE * budget * (1 + 1e-12)
        assert stats["estimated_seed_s"] > 0
        whole_share = int(BUDGET_SHARE * budget * SIMULATED_OPS_PER_SECOND / n_ops)
        assert stats["planned_simulations"] < whole_share
        # Exactly the planned work: every walk iteration, every seed's simulation.
        walks = stats["walks"]
        assert sum(w["iterations"] for w in walks) == stats["planned_simulations"]
        scored = sum(1 + w["proposals_scored"] for w in walks)
        assert result.evaluations == stats["seed_evaluations"] + scored
        assert stats["seed_evaluations"] >= len(stats["seed_placers"])
        assert stats["stopped_by"] == "budget"
    # A small budget runs only the seeds whose estimates fit it (expert and single always).
    small = results[0.1].stats
    assert small["seed_placers"][:2] == ["expert", "single"] and small["seeds_skipped_for_budget"]
    # 2 s is enough for every seed's estimate on dmcca
    assert not results[2.0].stats["seeds_skipped_for_budget"]


def _clock_jumping_after(problem: PlacementProblem, evaluations: int):
    """A clock that stands still until ``problem`` has run ``evaluations`` simulations,
    then reads a day later: past any deadline."""
    return lambda: 0.0 if problem.evaluations < evaluations else 86_400.0


def test_anneal_stops_at_its_deadline_and_says_so() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    seed_plan = run_placer("expert", problem, BUDGET_S, seed=0)
    # Time runs out during the first walk, after 30 simulations (9 seeds, then the walk).
    with use_clock(_clock_jumping_after(problem, 30)):
        result = run_placer("anneal", problem, BUDGET_S, seed=0)
    stats = result.stats
    assert stats["stopped_by"] == "deadline" and stats["stopped_at_deadline"]
    assert result.evaluations == 30 and len(stats["walks"]) == 1
    assert stats["walks"][0]["stopped_at_deadline"]
    assert result.search_time_s == 86_400.0  # run_placer reads the same clock
    assert problem.score(result.sim) <= problem.score(seed_plan.sim)
    # Time runs out during the seeding: the seeds run so far are the plan's candidates.
    with use_clock(_clock_jumping_after(problem, 2)):
        result = run_placer("anneal", problem, BUDGET_S, seed=0)
    assert result.stats["stopped_by"] == "deadline"
    assert result.stats["seed_placers"] == ["expert", "single"] and result.stats["walks"] == []
    assert result.evaluations == result.stats["seed_evaluations"] >= 2


def test_random_search_stops_at_its_deadline_and_says_so() -> None:
    problem = _problem("dmcca", "colocrl-4gpu")
    full = run_placer("random_search", problem, BUDGET_S, seed=0).stats
    assert full["stopped_by"] == "budget" and full["simulations"] == full["planned_simulations"]
    with use_clock(_clock_jumping_after(problem, 10)):
        result = run_placer("random_search", problem, BUDGET_S, seed=0)
    # The deadline is checked before every simulation.
    assert result.stats["stopped_by"] == "deadline" and result.stats["simulations"] == 10
    assert result.evaluations == 10 and result.stats["planned_simulations"] > 10


def test_warm_up_is_paid_before_the_timed_region_and_reported_apart(
    frozen_clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = PlacementProblem.build(_graph("dmcca"), _cluster("colocrl-2gpu"))
    simulate = problem.simulator.simulate

    def slow_simulate(*args, **kwargs):
        frozen_clock.advance(5.0)  # every simulation "takes" 5 s
        return simulate(*args, **kwargs)

    monkeypatch.setattr(problem.simulator, "simulate", slow_simulate)
    first = run_placer("round_robin", problem, BUDGET_S, seed=0)
    # One untimed simulation (numba's load in a fresh process) is the warm-up, counted
    # as neither search time nor an evaluation; the final scoring is not timed either.
    assert first.warmup_s == 5.0 and first.search_time_s == 0.0 and first.evaluations == 0
    assert first.to_dict()["warmup_s"] == 5.0
    again = run_placer("round_robin", problem, BUDGET_S, seed=0)
    assert again.warmup_s == 0.0 and again.search_time_s == 0.0


def test_importing_the_placers_imports_no_learned_placer() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        import meshplace.placers
        from meshplace.placers import registry, resolve

        names = resolve("all")
        families = {n: registry().family(n) for n in names}
        heavy = ("gymnasium", "meshplace.learn")
        before = sorted(m for m in sys.modules if m.startswith(heavy))
        spec = registry()["rl"]
        loaded = "meshplace.learn.rl" in sys.modules
        print(json.dumps([names, families, before, spec.family, loaded]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    names, families, before, rl_family, rl_loaded = json.loads(out)
    assert before == []  # neither gymnasium nor any torch.nn policy
    assert {"rl", "hrl", "gnn"} <= set(names) and len(names) == len(set(names))
    assert {families[n] for n in ("rl", "hrl", "gnn")} == {"learned"}
    assert rl_family == "learned" and rl_loaded  # looking one up loads it


def test_expert_places_rnn_layers_one_per_gpu_and_embeddings_on_the_cpu() -> None:
    problem = _problem("nmt", "colocrl-4gpu")
    result = run_placer("expert", problem, BUDGET_S, seed=0)
    names = problem.device_names
    where: dict[str, set[str]] = {}
    for o, d in zip(problem.graph.ops, result.op_devices.tolist()):
        if o.phase == "forward" and o.kind not in ("parameter", "buffer", "input"):
            where.setdefault(o.module.split(".fw")[0].split(".bw")[0], set()).add(names[d])
    assert where["encoder.lstm.0"] == {"gpu0"}
    assert where["encoder.lstm.1"] == {"gpu1"}
    assert where["decoder.lstm.0"] == {"gpu2"}
    assert where["decoder.lstm.1"] == {"gpu3"}
    assert where["decoder.attention"] == {"gpu3"}
    assert where["decoder.softmax"] == {"gpu3"}
    assert where["encoder.embedding"] == {"cpu0"}
    # Backward ops follow their forward op.
    for o, d in zip(problem.graph.ops, result.op_devices.tolist()):
        if o.forward_op is not None:
            assert d == result.op_devices[problem.graph.index(o.forward_op)]


def test_a_model_that_fits_no_device_is_one_sentence(capsys, tmp_path) -> None:
    g = OpGraph("huge")
    g.add_op(Op("w", "parameter", param_bytes=10 * 2**40, output_shapes=[[1]]))
    g.add_op(Op("mm", "matmul", flops=1e9))
    g.add_edge("w", "mm", 4)
    from meshplace.graph.io import save_graph

    path = tmp_path / "huge.json"
    save_graph(g, path)
    code = main(["plan", str(path), "--cluster", "colocrl-4gpu", "--placer", "single"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fits no device" in err and "largest device has" in err
    assert "'g0:" in err  # names the group
    assert err.count("\n") == 1


def test_an_empty_graph_has_nothing_to_place() -> None:
    with pytest.raises(PlacerError, match="has no ops to place"):
        PlacementProblem.build(OpGraph("empty"), _cluster("colocrl-2gpu"))


def test_unknown_placer_lists_the_known_ones(capsys) -> None:
    code = main(["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "gurobi"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown placer 'gurobi'" in err
    for name in ("single", "expert", "anneal"):
        assert name in err
    problem = PlacementProblem.build(_graph("dmcca"), _cluster("colocrl-2gpu"))
    for budget in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(PlacerError, match="time budget must be positive, finite"):
            run_placer("single", problem, budget, 0)


def test_resolve_suggests_a_close_name_and_refuses_an_empty_list() -> None:
    with pytest.raises(PlacerError, match="did you mean 'anneal'"):
        resolve("aneal")
    with pytest.raises(PlacerError, match="no placer given"):
        resolve(" , ")
    assert resolve("expert, single,expert") == ["expert", "single"]
    assert resolve("all")[-3:] == ["rl", "hrl", "gnn"]


def test_plan_command_json_and_best_plan(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    result_file = tmp_path / "result.json"
    code = main(
        [
            "plan",
            "dmcca",
            "--cluster",
            "colocrl-4gpu",
            "--placer",
            "round_robin,anneal",
            "--budget",
            "2",
            "--out",
            str(out),
            "--result",
            str(result_file),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lower_bound_s"] > 0
    placers = [r["placer"] for r in report["results"]]
    assert placers == ["round_robin", "anneal", "single", "expert"]
    for r in report["results"]:
        assert {"placer", "step_time_s", "oom", "search_time_s", "evaluations"} <= set(r)
    best = min((r for r in report["results"] if not r["oom"]), key=lambda r: r["step_time_s"])
    assert report["best"] == best["placer"]
    plan = load_plan(out)
    assert plan.meta["placer"] == best["placer"]
    assert len(plan.device_names(_graph("dmcca"))) == _graph("dmcca").num_ops
    assert json.loads(result_file.read_text())["best"] == report["best"]
    # The written plan simulates to the reported time.
    code = main(
        ["simulate", "--graph", "dmcca", "--cluster", "colocrl-4gpu", "--plan", str(out), "--json"]
    )
    assert code == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-12)
