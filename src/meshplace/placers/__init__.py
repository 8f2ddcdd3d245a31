"""Placers: every method of choosing a device per op, behind one registry.

``meshplace.placers.base.registry()`` lists them; ``run_placer(name, problem, budget, seed)``
runs one and scores its plan with the simulator. Importing this package registers the
built-in placers (one module per family).
"""

from meshplace import learn  # noqa: F401  (registers the learned placer "rl")
from meshplace.placers import (  # noqa: F401  (importing registers the placers)
    baselines,
    listsched,
    partition,
    pipeline,
    search,
)
from meshplace.placers.base import (
    OpAssignment,
    PlacementProblem,
    PlacerError,
    PlacerOptions,
    PlacerResult,
    best_result,
    registry,
    resolve,
    run_placer,
)

__all__ = [
    "OpAssignment",
    "PlacementProblem",
    "PlacerError",
    "PlacerOptions",
    "PlacerResult",
    "best_result",
    "registry",
    "resolve",
    "run_placer",
]
