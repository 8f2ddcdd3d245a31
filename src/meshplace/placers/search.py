"""Simulator-guided search: simulated annealing over placements (FlexFlow-style MCMC).

FlexFlow (Jia, Zaharia & Aiken, SysML 2019, §6) searches its strategy space with a
Metropolis–Hastings walk scored by its execution simulator; ColocRL's lesson is that the
score should be the real (here: simulated) step time with a penalty for plans that run out
of memory. ``anneal`` does that over co-location-group placements:

* **seed**: the best plan among the cheap algorithmic placers (expert, single device, and
  the list schedulers and partitioners when they are registered), so the walk starts where
  algorithms already got — and the returned plan is never worse than that seed;
* **moves**: send one group to the device of one of its neighbours (it removes a
  transfer), to a random device — alone or together with the groups it is co-located with
  (its backward ops' groups, its parameter's update groups), which a backward pass needs
  to follow its forward pass without paying transfers — or swap the devices of two groups;
* **granularity**: two walks with half the simulations each — first over the problem's
  co-location groups, then over a grouping up to 4× finer (``FINE_GROUPS_FACTOR``), because
  coarse groups cut from a topological order lump parallel branches together and a
  simulator-scored search can afford more units once the coarse structure is right;
* **acceptance**: Metropolis with a temperature that falls geometrically from 0.5 % of the
  seed's score to 0.001 % of it (a good seed is rarely improved by a hot random walk);
* **budget**: fixed work, so a seed reproduces the plan exactly. The seeding counts
  against the budget: each seed placer has a cost estimate from the problem's size
  (:data:`SEED_COST_S`, fitted on the reference workloads), seeds run while their
  estimates fit 30 % of the budget (``expert`` and ``single`` always), and the walks get
  as many simulations (at 3 M simulated ops/s) as fill the rest of 60 % of the budget
  after the seeding and the walks' set-up. The wall-clock budget is also a hard stop,
  checked between seed placers and between simulations (only a machine several times
  slower than assumed reaches it; then the plan depends on timing and
  ``stats["stopped_by"]`` is ``"deadline"``). ``benchmarks/budgets.py`` measures how
  close to the budget the search really ends.

Complexity: O(evaluations × (V + E) log V).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem, run_placer
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> seed_value = run_placer("expert", p, 1.0, 0).value
>>> run_placer("anneal", p, 2.0, 0).value <= seed_value
True
"""

from __future__ import annotations

import math

import numpy as np

from meshplace.graph.groups import group_ops
from meshplace.placers.base import (
    SIMULATED_OPS_PER_SECOND,
    LearningCurve,
    OpAssignment,
    PlacementProblem,
    now,
    register,
    registry,
)
from meshplace.placers.baselines import accelerators
from meshplace.placers.pipeline import local_search_evaluations

SEED_PLACERS = ("expert", "single", "m_etf", "heft", "cpop", "m_sct", "metis", "mincut", "pipeline")
# Seconds a seed placer is assumed to take: (fixed, per group x device, per op). Least
# squares over every reference workload on colocrl-2gpu/-4gpu, dgx-h100 and h2-8xv100 on
# the 2-core development machine, times 1.5; plus one simulation each (below).
SEED_COST_S = {
    "expert": (0.0, 0.0, 6e-6),
    "single": (0.0, 0.0, 1e-6),
    "m_etf": (0.016, 1e-6, 1.3e-6),
    "heft": (0.010, 1.1e-6, 1.9e-6),
    "cpop": (0.013, 0.7e-6, 1.8e-6),
    "m_sct": (0.025, 0.0, 1e-5),
    "metis": (0.0, 1.8e-5, 4.8e-6),
    "mincut": (0.048, 4.8e-5, 1.7e-5),
    "pipeline": (0.0, 1.6e-6, 8.4e-6),
}
ALWAYS_SEED = ("expert", "single")  # cheap, and the references every result is compared to
SEED_SHARE = 0.3  # of the budget: seeds run while their cost estimates fit it
BUDGET_SHARE = 0.6  # of the budget: seeding, set-up and walks together, as estimated
DEADLINE_SHARE = 0.97  # the hard wall-clock stop
# The walks' set-up (a finer grouping, its group graph, co-location partners) per op.
WALK_SETUP_S_PER_OP = 3e-5
# Metropolis temperature, as a fraction of the seed's score, at the start and the end.
HOT = 0.005
COLD = 1e-5
# The walk's groups: up to this many times the problem's (see place_anneal).
FINE_GROUPS_FACTOR = 4


def _group_majority(
    problem: PlacementProblem, group_of: np.ndarray, n_groups: int, op_devices: np.ndarray
) -> np.ndarray:
    """The device running most of each group's time under an op-level placement."""
    weight = problem.simulator.op_times(op_devices) + 1e-12
    votes = np.zeros((n_groups, problem.num_devices))
    np.add.at(votes, (group_of, op_devices), weight)
    return votes.argmax(axis=1).astype(np.int64)


def _colocation_partners(
    problem: PlacementProblem, group_of: np.ndarray, n_groups: int
) -> list[np.ndarray]:
    """For each group, the other groups holding its ops' forward ops, backward ops or
    co-location-key partners."""
    graph = problem.graph
    links: list[set[int]] = [set() for _ in range(n_groups)]
    by_key: dict[str, set[int]] = {}
    for i, o in enumerate(graph.ops):
        g = int(group_of[i])
        if o.forward_op is not None:
            f = int(group_of[graph.index(o.forward_op)])
            if f != g:
                links[g].add(f)
                links[f].add(g)
        if o.colocation:
            by_key.setdefault(o.colocation, set()).add(g)
    for groups in by_key.values():
        for g in groups:
            links[g].update(groups - {g})
    return [np.array(sorted(x), dtype=np.int64) for x in links]


@register(
    "anneal",
    family="search",
    description="simulated annealing over group placements scored by the simulator, "
    "seeded with the best algorithmic plan",
    source="Jia et al., FlexFlow, SysML 2019, §6 (MCMC search over a simulator)",
    uses_budget=True,
)
def place_anneal(problem: PlacementProblem, budget_s: float, seed: int):
    start = now()
    deadline = start + DEADLINE_SHARE * budget_s
    curve = LearningCurve(problem, start)
    rng = np.random.default_rng(seed)
    known = registry()
    plan = anneal_plan(problem, budget_s, [n for n in SEED_PLACERS if n in known])
    best_ops: np.ndarray | None = None
    best_score = math.inf
    seed_name = ""
    seeded: list[str] = []
    stopped_at_deadline = False
    for name in plan["seed_placers"]:
        if seeded and now() > deadline:
            stopped_at_deadline = True
            break
        out = known[name].fn(problem, SEED_SHARE * budget_s, seed)
        if isinstance(out, tuple):
            out = out[0]
        ops = (
            np.asarray(out.devices, np.int64)
            if isinstance(out, OpAssignment)
            else problem.expand(np.asarray(out, np.int64))
        )
        sim = problem.evaluate_ops(ops)
        seeded.append(name)
        score = problem.score(sim)
        if score < best_score:
            best_ops, best_score, seed_name, best_step = ops, score, name, sim.step_time_s
            curve.record(best_step)
    assert best_ops is not None
    seed_score = best_score
    seed_evaluations = problem.evaluations  # the seeds' own simulations and one each

    # A fixed number of simulations for a given budget and problem (not "until the clock
    # runs out"), so the same seed reproduces the same plan.
    evaluations = plan["simulations"]
    # Two walks, half the simulations each: first over the problem's groups (few units, fast
    # to converge), then over a finer grouping (coarse groups cut from a topological order
    # lump parallel branches, such as Inception's towers, together).
    fine = group_ops(problem.graph, FINE_GROUPS_FACTOR * problem.num_groups)
    walks = [(problem.group_of, problem.num_groups), (fine.group_of, fine.num_groups)]
    graphs = [problem.group_graph, None]
    stats: dict = {
        "seed_placer": seed_name,
        "seed_score_s": seed_score,
        "seed_placers": seeded,
        "seed_evaluations": seed_evaluations,
        "seeds_skipped_for_budget": plan["seeds_skipped"],
        "estimated_seed_s": plan["estimated_seed_s"],
        "estimated_work_s": plan["estimated_work_s"],
        "walks": [],
    }
    for k, (group_of, n_groups) in enumerate(walks):
        if stopped_at_deadline:
            break
        group_graph = graphs[k] or fine.group_graph()
        best_ops, best_score, walk = _walk(
            problem,
            group_of,
            n_groups,
            group_graph,
            best_ops,
            best_score,
            evaluations // 2,
            rng,
            deadline,
            curve,
        )
        stats["walks"].append(walk)
        stopped_at_deadline |= walk["stopped_at_deadline"]
    curve.record(curve.best_step_time_s[-1])
    stats.update(
        best_score_s=best_score,
        planned_simulations=2 * (evaluations // 2),
        stopped_at_deadline=stopped_at_deadline,
        stopped_by="deadline" if stopped_at_deadline else "budget",
        learning_curve=curve.to_dict(),
    )
    return OpAssignment(best_ops), stats


def seed_cost_s(problem: PlacementProblem, name: str, budget_s: float = 0.0) -> float:
    """Estimated seconds of seed placer ``name`` on ``problem`` given ``budget_s``, its
    simulation included (:data:`SEED_COST_S`; a placer without an entry is assumed to cost
    like ``mincut``). ``pipeline``'s local search under the throughput objective runs a
    number of simulations fixed by its budget (:func:`local_search_evaluations`)."""
    fixed, per_group_device, per_op = SEED_COST_S.get(name, SEED_COST_S["mincut"])
    n_ops = problem.graph.num_ops
    simulations = 1
    if name == "pipeline" and problem.objective == "throughput":
        simulations += local_search_evaluations(problem, budget_s)
    return (
        fixed
        + per_group_device * problem.num_groups * problem.num_devices
        + per_op * n_ops
        + simulations * n_ops / SIMULATED_OPS_PER_SECOND
    )


def anneal_plan(
    problem: PlacementProblem, budget_s: float, candidates: list[str] | None = None
) -> dict:
    """What ``anneal`` will do with ``budget_s`` on ``problem``, from sizes alone (so it is
    the same on every machine): the seed placers it runs (of ``candidates``, by default
    :data:`SEED_PLACERS`), those skipped because their estimates do not fit
    :data:`SEED_SHARE` of the budget, and the number of walk simulations that fill the rest
    of :data:`BUDGET_SHARE` of it.

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> small, large = anneal_plan(p, 0.1), anneal_plan(p, 2.0)
    >>> small["seeds_skipped"], large["seeds_skipped"]
    (['heft', 'cpop', 'm_sct', 'metis', 'mincut'], [])
    >>> round(small["estimated_work_s"] / 0.1, 2), round(large["estimated_work_s"] / 2.0, 2)
    (0.6, 0.6)
    """
    seeds, skipped, seed_s = [], [], 0.0
    for name in SEED_PLACERS if candidates is None else candidates:
        cost = seed_cost_s(problem, name, SEED_SHARE * budget_s)
        if name in ALWAYS_SEED or seed_s + cost <= SEED_SHARE * budget_s:
            seeds.append(name)
            seed_s += cost
        else:
            skipped.append(name)
    n_ops = max(problem.graph.num_ops, 1)
    setup_s = WALK_SETUP_S_PER_OP * n_ops
    walk_s = BUDGET_SHARE * budget_s - seed_s - setup_s
    simulations = max(2, int(walk_s * SIMULATED_OPS_PER_SECOND / n_ops))
    return {
        "seed_placers": seeds,
        "seeds_skipped": skipped,
        "estimated_seed_s": seed_s,
        "simulations": simulations,
        "estimated_work_s": seed_s
        + setup_s
        + 2 * (simulations // 2) * n_ops / SIMULATED_OPS_PER_SECOND,
    }


def _walk(
    problem: PlacementProblem,
    group_of: np.ndarray,
    n_groups: int,
    group_graph,
    best_ops: np.ndarray,
    best_score: float,
    evaluations: int,
    rng: np.random.Generator,
    deadline: float,
    curve: LearningCurve,
) -> tuple[np.ndarray, float, dict]:
    """One Metropolis walk over the groups ``group_of``, starting from ``best_ops``; every
    improvement of the best plan is a point on ``curve``."""
    current = _group_majority(problem, group_of, n_groups, best_ops)
    sim = problem.evaluate_ops(current[group_of])
    current_score = problem.score(sim)
    if current_score < best_score:
        best_ops, best_score = current[group_of], current_score
        curve.record(sim.step_time_s)
    acc = np.array(accelerators(problem), dtype=np.int64)
    devices = np.arange(problem.num_devices, dtype=np.int64)
    ga = group_graph.arrays()
    neighbours = [
        np.concatenate(
            [
                ga.succ_idx[ga.succ_ptr[g] : ga.succ_ptr[g + 1]],
                ga.pred_idx[ga.pred_ptr[g] : ga.pred_ptr[g + 1]],
            ]
        )
        for g in range(n_groups)
    ]
    partners = _colocation_partners(problem, group_of, n_groups)
    t_hot = HOT * current_score
    accepted = 0
    done = 0
    stopped_at_deadline = False
    iterations = 0
    for it in range(evaluations):
        if now() > deadline:
            stopped_at_deadline = True
            break
        iterations += 1
        # geometric from t_hot to COLD * the seed's score; the ratio of the constants, not
        # of the two temperatures, so that a seed scoring 0 s (a graph of inputs only) walks cold
        # rather than dividing by zero
        temperature = t_hot * (COLD / HOT) ** (it / max(evaluations - 1, 1))
        proposal = current.copy()
        move = rng.random()
        g = int(rng.integers(n_groups))
        if move < 0.45 and len(neighbours[g]):
            proposal[g] = current[int(rng.choice(neighbours[g]))]
        elif move < 0.85:
            pool = acc if rng.random() < 0.9 else devices
            proposal[g] = int(rng.choice(pool))
            if move >= 0.6 and len(partners[g]):
                # Move the group together with the groups it is co-located with (its
                # backward ops, its forward op, its parameter's updates).
                proposal[partners[g]] = proposal[g]
        else:
            h = int(rng.integers(n_groups))
            proposal[g], proposal[h] = current[h], current[g]
        if np.array_equal(proposal, current):
            continue
        sim = problem.evaluate_ops(proposal[group_of])
        score = problem.score(sim)
        done += 1
        if score < current_score or rng.random() < math.exp(
            -(score - current_score) / max(temperature, 1e-300)
        ):
            current, current_score = proposal, score
            accepted += 1
            if score < best_score:
                best_ops, best_score = current[group_of], score
                curve.record(sim.step_time_s)
    walk = {
        "groups": n_groups,
        "iterations": iterations,
        "proposals_scored": done,
        "accepted": accepted,
        "best_score_s": best_score,
        "stopped_at_deadline": stopped_at_deadline,
    }
    return best_ops, best_score, walk


@register(
    "random_search",
    family="search",
    description="uniformly random group placements on the accelerators, scored by the "
    "simulator; the best one wins (the budget fixes how many)",
    source="Bergstra & Bengio, Random Search for Hyper-Parameter Optimization, JMLR 2012; "
    "the search baseline of Addanki et al., Placeto, NeurIPS 2019, §5",
    uses_budget=True,
)
def place_random_search(problem: PlacementProblem, budget_s: float, seed: int):
    """Random search: the reference a learned or annealing search must beat per simulation.

    Samples placements of the co-location groups uniformly over the accelerators (the
    ``random`` baseline, many times), scores them in batches of 64 and keeps the best. Like
    ``anneal``, the budget buys a fixed number of simulations (60 % of it at
    :data:`SIMULATED_OPS_PER_SECOND`), so a seed reproduces the plan.

    Complexity: O(samples × (V + E) log V).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> from meshplace.placers.base import run_placer
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> r = run_placer("random_search", p, 1.0, 0)
    >>> r.evaluations == r.stats["simulations"], r.value <= r.stats["first_score_s"]
    (True, True)
    """
    start = now()
    curve = LearningCurve(problem, start)
    rng = np.random.default_rng(seed)
    acc = np.array(accelerators(problem), dtype=np.int64)
    n_ops = max(problem.graph.num_ops, 1)
    total = max(1, int(BUDGET_SHARE * budget_s * SIMULATED_OPS_PER_SECOND / n_ops))
    deadline = start + DEADLINE_SHARE * budget_s
    best = acc[rng.integers(0, len(acc), problem.num_groups)]
    best_score, first_score = math.inf, math.inf
    done, stopped_at_deadline = 0, False
    while done < total and not stopped_at_deadline:
        # Plans are drawn 64 at a time (the draws, hence the plans, do not depend on where
        # a deadline stops the search); the deadline is checked before every simulation.
        batch = acc[rng.integers(0, len(acc), (min(64, total - done), problem.num_groups))]
        for plan in batch:
            if done and now() > deadline:
                stopped_at_deadline = True
                break
            sim = problem.evaluate(plan)
            score = problem.score(sim)
            first_score = min(first_score, score) if done == 0 else first_score
            done += 1
            if score < best_score or done == 1:  # (every plan may be infinitely slow)
                best, best_score = plan, score
                curve.record(sim.step_time_s)
    curve.record(curve.best_step_time_s[-1])
    stats = {
        "planned_simulations": total,
        "simulations": done,
        "first_score_s": first_score,
        "best_score_s": best_score,
        "stopped_at_deadline": stopped_at_deadline,
        "stopped_by": "deadline" if stopped_at_deadline else "budget",
        "learning_curve": curve.to_dict(),
    }
    return best, stats
