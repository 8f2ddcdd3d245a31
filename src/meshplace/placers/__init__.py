"""Placers: every method of choosing a device per op, behind one registry.

``meshplace.placers.base.registry()`` lists them; ``run_placer(name, problem, budget, seed)``
runs one and scores its plan with the simulator. Importing this package registers the
built-in placers (one module per family); the learned placers (``rl``, ``hrl``, ``gnn`` in
:mod:`meshplace.learn`, which need torch policies and gymnasium) are known by name and
family at once but imported only when one of them is looked up or run
(``meshplace.placers.base.DEFERRED_PLACERS``).
"""

from meshplace.placers import (  # noqa: F401  (importing registers the placers)
    baselines,
    listsched,
    partition,
    pipeline,
    search,
)
from meshplace.placers.base import (
    DEFERRED_PLACERS,
    ManualClock,
    OpAssignment,
    PlacementProblem,
    PlacerError,
    PlacerOptions,
    PlacerResult,
    best_result,
    now,
    registry,
    resolve,
    run_placer,
    use_clock,
)

__all__ = [
    "DEFERRED_PLACERS",
    "ManualClock",
    "OpAssignment",
    "PlacementProblem",
    "PlacerError",
    "PlacerOptions",
    "PlacerResult",
    "best_result",
    "now",
    "registry",
    "resolve",
    "run_placer",
    "use_clock",
]
