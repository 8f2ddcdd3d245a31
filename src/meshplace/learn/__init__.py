"""Learned placement: the gymnasium environment and ColocRL's ``rl`` placer.

* :mod:`meshplace.learn.features` — fixed-width group features and batched scoring;
* :mod:`meshplace.learn.env` — :class:`PlacementEnv`, registered with gymnasium as
  ``meshplace/DevicePlacement-v0``;
* :mod:`meshplace.learn.policy` — ColocRL's seq2seq LSTM policy with attention;
* :mod:`meshplace.learn.rl` — REINFORCE training (:func:`train_rl`, checkpoints, resume)
  and the ``rl`` placer.

Importing this package registers the ``rl``, ``hrl`` and ``gnn`` placers and the gymnasium
environment (both idempotently). :mod:`meshplace.placers` knows the learned placers by name
and family without importing this package (``meshplace.placers.base.DEFERRED_PLACERS``)
and imports it when one of them is looked up or run; this package imports only
:mod:`meshplace.placers.base`, never the other way round. See ``docs/learn.md``.
"""

from meshplace.learn.env import ENV_ID, PlacementEnv, register_env
from meshplace.learn.features import FEATURE_NAMES, group_features, score_batch
from meshplace.learn.gnn import GNNConfig, GNNPolicy, load_weights
from meshplace.learn.hrl import HRLConfig, HRLResult, train_hrl
from meshplace.learn.rl import RLConfig, RLResult, planned_updates, train_rl

__all__ = [
    "ENV_ID",
    "FEATURE_NAMES",
    "GNNConfig",
    "GNNPolicy",
    "HRLConfig",
    "HRLResult",
    "PlacementEnv",
    "RLConfig",
    "RLResult",
    "group_features",
    "load_weights",
    "planned_updates",
    "register_env",
    "score_batch",
    "train_hrl",
    "train_rl",
]
