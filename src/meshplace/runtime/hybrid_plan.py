"""What the torchrun runtime checks of a hybrid plan before any process group exists (no
torch import: a refusal costs nothing): the plan file of ``meshplace shard --pipeline auto
--out`` (docs/formats.md), its stages' layer ranges as module paths to cut at, the world
it needs, its memory against a budget. :mod:`meshplace.runtime.hybrid` runs it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from meshplace.errors import InputError

#: The schedules a hybrid plan names and the torch schedule classes that run them.
HYBRID_RUNTIME_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved": "ScheduleInterleaved1F1B",
}


def is_hybrid(plan: Mapping[str, Any]) -> bool:
    """Whether a ``meshplace.parallel_plan`` is a hybrid plan (it has pipeline stages)."""
    return bool(plan.get("stages")) and "pipeline" in plan


def stage_splits(plan: Mapping[str, Any]) -> list[str]:
    """The module path where each (virtual) stage after the first begins, in pipeline
    order: the first layer of its range in the plan's layer stack (``layers.4``). Under
    the interleaved schedule a device's ``chunks`` are its virtual stages ``i, i + pp,
    ...``. One sentence when the plan is cut between units (a model without one stack of
    identical layers), names no stack, or its ranges do not cover the stack in order.

    >>> stage_splits({"graph": {"layer_container": "layers"},
    ...               "stages": [{"layers": [0, 2]}, {"layers": [2, 4]}]})
    ['layers.2']
    >>> stage_splits({"graph": {"layer_container": "h"},
    ...               "stages": [{"layers": [0, 1], "chunks": [[0, 1], [2, 3]]},
    ...                          {"layers": [1, 2], "chunks": [[1, 2], [3, 4]]}]})
    ['h.1', 'h.2', 'h.3']
    """
    container = (plan.get("graph") or {}).get("layer_container")
    stages = plan["stages"]
    if any("units" in s for s in stages) or not container:
        raise InputError(
            "the plan is cut between the units of a model without one stack of identical "
            "layers; the torchrun runtime runs hybrid plans of a layer stack only"
        )
    pp = len(stages)
    owned = [
        (int(r[0]), int(r[1]), i)
        for i, s in enumerate(stages)
        for r in s.get("chunks") or [s["layers"]]
    ]
    runs = sorted(owned)
    chained = all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    round_robin = all(device == k % pp for k, (_, _, device) in enumerate(runs))
    if runs[0][0] != 0 or not chained or not round_robin:
        raise InputError("the plan's stages do not cover the layer stack in order")
    return [f"{container}.{first}" for first, _, _ in runs[1:]]


def check_hybrid_memory_budget(plan: Mapping[str, Any], budget: int) -> None:
    """Refuse a hybrid plan in which a rank would hold more than ``budget`` bytes of
    parameters and optimizer state between steps (its stage's ``held_bytes``).

    >>> check_hybrid_memory_budget({"stages": [{"held_bytes": {"parameters": 4,
    ...     "optimizer_state": 8}}]}, 12)
    """
    for k, stage in enumerate(plan["stages"]):
        held = stage.get("held_bytes") or {}
        total = int(float(held.get("parameters", 0)) + float(held.get("optimizer_state", 0)))
        if total > budget:
            raise InputError(
                f"a rank of stage {k} would hold {total:,} bytes of parameters and optimizer "
                f"state under this plan, over --memory-budget {budget:,}"
            )


def check_hybrid_world(plan: Mapping[str, Any], world_size: int) -> None:
    """One sentence unless torchrun started ``pp * dp * tp`` processes."""
    pp, dp, tp = (int(x) for x in plan["mesh"]["shape"])
    if pp * dp * tp != world_size:
        raise InputError(
            f"the plan is {pp} stages x {dp} data x {tp} tensor = {pp * dp * tp} devices; "
            f"torchrun started {world_size} processes (--nproc-per-node x --nnodes)"
        )
    schedule = plan["pipeline"]["schedule"]
    if schedule not in HYBRID_RUNTIME_SCHEDULES:
        raise InputError(
            f"the plan's schedule {schedule!r} is not one the torchrun runtime runs; "
            f"choose one of {', '.join(HYBRID_RUNTIME_SCHEDULES)}"
        )
    chunked = any(s.get("chunks") for s in plan["stages"])
    if (schedule == "interleaved") != chunked:
        raise InputError(
            "the plan's interleaved schedule needs each stage's layer chunks (`chunks`, "
            "written by meshplace shard --pipeline auto --out), and only it has them"
        )


def check_hybrid_plan(plan: Mapping[str, Any], world_size: int, budget: int | None) -> None:
    """Every check of a hybrid plan that needs no process: its stages cut a layer stack in
    order (:func:`stage_splits`), its schedule and the world (:func:`check_hybrid_world`),
    and with ``budget`` its memory (:func:`check_hybrid_memory_budget`); one sentence
    (:class:`InputError`) for the first that fails."""
    stage_splits(plan)
    check_hybrid_world(plan, world_size)
    if budget is not None:
        check_hybrid_memory_budget(plan, budget)


def held_bytes(stage: Mapping[str, Any], kind: str) -> int | None:
    """A stage's predicted per-device bytes of ``kind`` (``parameters``, ``gradients``,
    ``optimizer_state``) as a whole number, or None for a plan that does not say.

    >>> held_bytes({"held_bytes": {"parameters": 512.0}}, "parameters")
    512
    """
    value = (stage.get("held_bytes") or {}).get(kind)
    return None if value is None else round(float(value))
