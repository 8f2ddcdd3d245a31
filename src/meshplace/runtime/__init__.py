"""Real execution of placements: trace a step into an executable fx graph, split it by
device, and run it in worker processes (``docs/runtime.md``).

The names below load on first use (PEP 562), so importing this package — as
``meshplace run --help`` and the command's early argument checks do — does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Fault": "meshplace.runtime.executor",
    "RunResult": "meshplace.runtime.executor",
    "WorkerFailure": "meshplace.runtime.processes",
    "run_placement": "meshplace.runtime.executor",
    "run_reference": "meshplace.runtime.executor",
    "ModelSpec": "meshplace.runtime.program",
    "NodeSchedule": "meshplace.runtime.program",
    "StepInterpreter": "meshplace.runtime.program",
    "TracedStep": "meshplace.runtime.program",
    "schedule_nodes": "meshplace.runtime.program",
    "trace_step": "meshplace.runtime.program",
    "apply_sharding_plan": "meshplace.runtime.sharded",
    "distribute_inputs": "meshplace.runtime.sharded",
    "device_mesh": "meshplace.runtime.sharded",
    "local_parameter_bytes": "meshplace.runtime.sharded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
