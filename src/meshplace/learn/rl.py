"""The ``rl`` placer: ColocRL's policy trained with REINFORCE, with checkpoints and resume.

Mirhoseini et al., "Device Placement Optimization with Reinforcement Learning", ICML 2017,
§3: a seq2seq policy (:class:`meshplace.learn.policy.Seq2SeqPolicy`) samples placements of
the co-location groups; each is scored by its step time (here the simulator's, with
:meth:`PlacementProblem.score`'s OOM penalty), the reward is ``R = −√score``, and the policy
follows the REINFORCE gradient ``∇ E[R] ≈ 1/K Σₖ (Rₖ − b) ∇ log π(aₖ)`` with ``b`` an
exponential moving average of the rewards (decay 0.9), ``K`` placements sampled per update,
and Adam.

Hyper-parameters (:class:`RLConfig`): ``K = 16`` samples per update (ColocRL samples
several placements per policy and averages them; its exact count is not reproduced here),
hidden size 64 (the paper: 256; smaller to run on CPU), Adam learning rate 3e-3 (our
choice), baseline decay 0.9 (as in the brief for this placer); gradient norm clipped at 1.
Two additions of ours, because plain REINFORCE collapses to a near-deterministic policy
within ~75 updates on NMT (0.570 s on ``colocrl-4gpu``, where it then stays): advantages
are divided by the batch's reward standard deviation, and an entropy bonus (weight 0.02)
keeps the policy exploring (0.496 s after 1,500 updates). ``structure_features`` (layer
position, topological offsets of neighbours) stand in for ColocRL's adjacency embedding.

**Budget.** Like ``anneal``, the time budget becomes a fixed number of policy updates from
the graph size, so a seed reproduces its plan: an update is assumed to cost
``UPDATE_OVERHEAD_S + POLICY_S_PER_GROUP · G · H/64`` seconds of policy work (measured on
one CPU thread: ~0.07 s for 251 groups, hidden 64, 16 samples) plus ``K`` simulations at
``SIMULATED_OPS_PER_SECOND`` (3 M ops/s), and updates fill 60 % of the budget. A hard stop
after 97 % of the budget in training seconds (summed over resumed sessions: a resumed run
gets what is left, not a fresh budget) ends training early on a machine slower than
assumed; the stats say so (``stopped_by == "deadline"``, ``stopped_at_deadline``), and only
then does the plan depend on timing. Time is read from
:func:`meshplace.placers.base.now`, which tests replace. Training runs on one torch thread
(faster for these small matrices, and bit-reproducible: a resumed run ends with weights
``torch.equal`` to an uninterrupted run's, tested).

**Result.** The best placement ever sampled (or the policy's greedy one, scored at the end),
so the plan is never worse than any sample; ``stats["learning_curve"]`` holds the best step
time after every update against simulator evaluations and wall time.

**Checkpoints.** :func:`train_rl` with ``checkpoint=PATH`` saves the policy, the optimizer,
the baseline, the sampling generator's state, the best plan and the curve every
``checkpoint_every`` updates (``torch.save`` to a temp file + ``os.replace``: atomic); with
``resume=True`` it continues from that file and ends with the plan an uninterrupted run
with the same seed and budget would have ended with.

Complexity: O(updates × (K · G · (H² + G·H) + K · (V + E) log V)).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> out = train_rl(p, budget_s=5.0, seed=0, updates=3)
>>> out.group_devices.shape == (p.num_groups,), out.stats["updates"]
(True, 3)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshplace.learn.features import (
    NUM_FEATURES,
    STRUCTURE_NAMES,
    group_features,
    score_and_step_batch,
    structure_features,
)
from meshplace.learn.policy import Seq2SeqPolicy
from meshplace.learn.training import TrainingRun
from meshplace.placers.base import (
    SIMULATED_OPS_PER_SECOND,
    PlacementProblem,
    PlacerOptions,
    ProgressFn,
    check_budget,
    now,
    register,
)

UPDATE_OVERHEAD_S = 0.02
POLICY_S_PER_GROUP = 2.5e-4  # per group per update, 16 samples, hidden 64, one thread
BUDGET_SHARE = 0.6
DEADLINE_SHARE = 0.97
CHECKPOINT_FORMAT = "meshplace.rl-checkpoint v1"


@dataclass(frozen=True)
class RLConfig:
    """Hyper-parameters of :func:`train_rl` (see the module docstring for sources)."""

    hidden: int = 64
    samples: int = 16
    learning_rate: float = 3e-3
    baseline_decay: float = 0.9
    max_grad_norm: float = 1.0
    checkpoint_every: int = 20
    entropy_weight: float = 0.02
    normalize_advantage: bool = True
    structure: bool = True


@dataclass
class RLResult:
    """What :func:`train_rl` returns: the best plan (a device per group) and its stats."""

    group_devices: np.ndarray
    best_score_s: float
    stats: dict[str, Any] = field(default_factory=dict)


def planned_updates(problem: PlacementProblem, budget_s: float, config: RLConfig) -> int:
    """The number of policy updates ``budget_s`` buys on ``problem`` (at least 1).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> planned_updates(p, 10.0, RLConfig()) > planned_updates(p, 1.0, RLConfig())
    True
    """
    per_update = (
        UPDATE_OVERHEAD_S
        + POLICY_S_PER_GROUP * problem.num_groups * (config.samples / 16) * (config.hidden / 64)
        + config.samples * problem.graph.num_ops / SIMULATED_OPS_PER_SECOND
    )
    return max(1, int(BUDGET_SHARE * budget_s / per_update))


def _fingerprint(problem: PlacementProblem, seed: int, updates: int, config: RLConfig) -> dict:
    return {
        "graph": problem.graph.name,
        "ops": problem.graph.num_ops,
        "groups": problem.num_groups,
        "devices": problem.num_devices,
        "seed": seed,
        "updates": updates,
        "config": asdict(config),
    }


def train_rl(
    problem: PlacementProblem,
    budget_s: float,
    seed: int,
    *,
    config: RLConfig | None = None,
    updates: int | None = None,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: ProgressFn | None = None,
) -> RLResult:
    """Train ColocRL's policy on ``problem`` and return the best placement seen.

    Args:
        problem: the placement problem (its groups are the policy's sequence).
        budget_s: seconds; fixes the number of updates (:func:`planned_updates`) unless
            ``updates`` is given, and is enforced as a hard wall-clock stop.
        seed: seeds the policy's initial weights and the sampling generator.
        config: hyper-parameters (:class:`RLConfig`).
        updates: train for exactly this many updates instead of the budget's number.
        checkpoint: file to save training state to every ``config.checkpoint_every``
            updates and at the end.
        resume: continue from ``checkpoint`` if it exists (same problem, seed, updates
            and config, else :class:`PlacerError`).
        stop_after: stop (after checkpointing) once this session has done this many
            updates — a deliberate interruption, for tests of resuming.
        progress: called after every update with ``(done, total, best step time)``.

    Returns:
        :class:`RLResult` with the best group placement and stats (``evaluations``,
        ``best_score_s``, ``best_step_time_s``, ``updates``, ``planned_updates``,
        ``stopped_by`` — ``"budget"``, ``"deadline"`` or ``"stop_after"`` —,
        ``stopped_at_deadline``, ``learning_curve``...).
    """
    check_budget(budget_s)
    config = config or RLConfig()
    start = now()
    total = int(updates) if updates is not None else planned_updates(problem, budget_s, config)
    path = Path(checkpoint) if checkpoint is not None else None
    fingerprint = _fingerprint(problem, seed, total, config)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        columns = [group_features(problem)]
        if config.structure:
            columns.append(structure_features(problem))
        features = torch.from_numpy(np.concatenate(columns, axis=1))
        n_features = NUM_FEATURES + (len(STRUCTURE_NAMES) if config.structure else 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = Seq2SeqPolicy(n_features, problem.num_devices, config.hidden)
        optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
        generator = torch.Generator().manual_seed(seed)
        stateful = {"policy": policy, "optimizer": optimizer, "generator": generator}
        run = TrainingRun(
            problem,
            total=total,
            fingerprint=fingerprint,
            fmt=CHECKPOINT_FORMAT,
            best=np.zeros(problem.num_groups, dtype=np.int64),
            path=path,
            checkpoint_every=config.checkpoint_every,
            progress=progress,
            start=start,
            deadline_s=DEADLINE_SHARE * budget_s,
            stop_after=stop_after,
        )
        baseline: float | None = None
        if resume:
            scalars = run.resume(stateful)
            if scalars is not None:
                baseline = scalars["baseline"]

        while run.keep_going():
            actions = policy.sample(features, config.samples, generator)
            plans = actions.numpy()
            # Repeats within a batch are simulated once; no cache across updates, so the
            # evaluation count (the learning curve's x axis) survives a resume exactly.
            scores, steps, _ = run.count(lambda p=plans: score_and_step_batch(problem, p))
            run.offer(plans, scores, steps)
            rewards = -np.sqrt(scores)
            mean_reward = float(rewards.mean())
            if baseline is None:
                baseline = mean_reward
            advantage = torch.from_numpy(rewards - baseline).float()
            if config.normalize_advantage:
                advantage = advantage / (float(rewards.std()) + 1e-8)
            logp, entropy = policy.log_prob_entropy(features, actions)
            loss = -(advantage * logp).mean() - config.entropy_weight * entropy
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
            optimizer.step()
            baseline = config.baseline_decay * baseline + (1 - config.baseline_decay) * mean_reward
            run.finish_update(stateful, {"baseline": baseline})
        run.end_session(stateful, {"baseline": baseline})

        greedy_score = None
        if run.finished:
            greedy = policy.greedy(features).numpy()[None, :]
            g_score, g_step, _ = run.count(lambda: score_and_step_batch(problem, greedy))
            greedy_score = float(g_score[0])
            run.offer(greedy, g_score, g_step)
    finally:
        torch.set_num_threads(threads)

    stats: dict[str, Any] = {
        **run.stats(),
        "greedy_score_s": greedy_score,
        "samples_per_update": config.samples,
        "hidden": config.hidden,
        "learning_rate": config.learning_rate,
        "baseline_decay": config.baseline_decay,
        "entropy_weight": config.entropy_weight,
        "baseline": baseline,
    }
    return RLResult(run.best, run.best_score, stats)


@register(
    "rl",
    family="learned",
    description="ColocRL: seq2seq LSTM policy with attention over co-location groups, "
    "trained by REINFORCE on the simulated step time",
    source="Mirhoseini et al., Device Placement Optimization with RL, ICML 2017, §3",
    uses_budget=True,
    takes_options=True,
)
def place_rl(problem: PlacementProblem, budget_s: float, seed: int, options: PlacerOptions):
    out = train_rl(
        problem,
        budget_s,
        seed,
        checkpoint=options.checkpoint("rl"),
        resume=options.resume,
        progress=options.progress,
    )
    return out.group_devices, out.stats
