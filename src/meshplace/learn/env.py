"""``PlacementEnv``: device placement as a one-step gymnasium environment.

The formulation is ColocRL's (Mirhoseini et al., ICML 2017, §3): the observation describes
the graph's co-location groups, the action places every group at once, and the reward is
the negative square root of the (simulated) step time, ``−√t``, with a plan that runs out of
memory given a large penalty runtime. Here the penalty is :meth:`PlacementProblem.score`'s
(``value × 10 + 100`` seconds, so an OOM plan always loses to a fitting one), and the
reward is ``−√score``. Episodes last one step.

* observation: ``Box(0, FEATURE_HIGH, (max_groups, NUM_FEATURES), float32)`` — one row of
  :func:`meshplace.learn.features.group_features` per group, zero rows as padding (their
  ``valid`` column is 0);
* action: ``MultiDiscrete([num_devices] * max_groups)`` — a device per group; entries for
  padding rows are ignored;
* info after a step: ``step_time_s``, ``score_s``, ``oom``.

:meth:`PlacementEnv.evaluate_batch` scores ``[B, num_groups]`` placements in one call
(rewards, identical rows simulated once), for learners that sample many placements per
update. Registered with gymnasium as ``meshplace/DevicePlacement-v0``.

Complexity: construction O(V + E) plus the problem's; a step is one simulation,
O((V + E) log V).

Example
-------
>>> import gymnasium as gym
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> env = gym.make("meshplace/DevicePlacement-v0", problem=p)
>>> obs, info = env.reset(seed=0)
>>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
>>> bool(reward < 0), terminated, truncated
(True, True, False)
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from meshplace.learn.features import (
    FEATURE_HIGH,
    NUM_FEATURES,
    group_features,
    score_and_step_batch,
)
from meshplace.placers.base import PlacementProblem

ENV_ID = "meshplace/DevicePlacement-v0"


def reward_of_score(score: np.ndarray | float) -> np.ndarray | float:
    """ColocRL's reward ``−√score`` (score in seconds, OOM penalty included)."""
    return -np.sqrt(score)


class PlacementEnv(gym.Env):
    """Place every co-location group of ``problem`` on a device in one step.

    Args:
        problem: the graph, cluster and objective; built from ``workload`` and ``cluster``
            names (``PlacementProblem.build``) when not given.
        max_groups: rows of the observation and length of the action (padding beyond
            ``problem.num_groups``); defaults to ``problem.num_groups``.
        workload, cluster: names for :func:`meshplace.graph.sources.workload_graph` and
            :func:`meshplace.hardware.load_cluster`, used only without ``problem``.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012  (gymnasium's convention)

    def __init__(
        self,
        problem: PlacementProblem | None = None,
        max_groups: int | None = None,
        *,
        workload: str | None = None,
        cluster: str | None = None,
    ) -> None:
        if problem is None:
            if workload is None or cluster is None:
                raise ValueError("PlacementEnv needs a problem, or a workload and a cluster")
            from meshplace.graph.sources import workload_graph
            from meshplace.hardware import load_cluster

            problem = PlacementProblem.build(workload_graph(workload), load_cluster(cluster))
        self.problem = problem
        self.num_groups = problem.num_groups
        self.num_devices = problem.num_devices
        self.max_groups = int(max_groups or problem.num_groups)
        self.features = group_features(problem, self.max_groups)
        self.observation_space = spaces.Box(
            0.0, FEATURE_HIGH, (self.max_groups, NUM_FEATURES), dtype=np.float32
        )
        self.action_space = spaces.MultiDiscrete(
            np.full(self.max_groups, self.num_devices, dtype=np.int64)
        )
        self.cache: dict[bytes, tuple[float, float, bool]] = {}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        info = {"num_groups": self.num_groups, "num_devices": self.num_devices}
        return self.features.copy(), info

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        devices = np.asarray(action, dtype=np.int64).reshape(-1)[: self.num_groups]
        if len(devices) != self.num_groups:
            raise ValueError(f"an action needs a device for each of {self.num_groups} groups")
        scores, steps, ooms = score_and_step_batch(self.problem, devices[None, :], self.cache)
        score = float(scores[0])
        info = {"step_time_s": float(steps[0]), "score_s": score, "oom": bool(ooms[0])}
        return self.features.copy(), float(reward_of_score(score)), True, False, info

    def evaluate_batch(self, assignments: np.ndarray) -> np.ndarray:
        """Rewards (``−√score``) of ``[B, G]`` placements, ``G`` = ``num_groups`` or
        ``max_groups`` (padding columns ignored); identical rows are simulated once."""
        batch = np.asarray(assignments, dtype=np.int64)
        if batch.ndim != 2:
            raise ValueError(f"assignments must be a [B, groups] array, got {batch.shape}")
        scores = score_and_step_batch(self.problem, batch[:, : self.num_groups], self.cache)[0]
        return np.asarray(reward_of_score(scores), dtype=np.float64)


def register_env() -> None:
    """Register :class:`PlacementEnv` as ``meshplace/DevicePlacement-v0`` (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="meshplace.learn.env:PlacementEnv")


register_env()
