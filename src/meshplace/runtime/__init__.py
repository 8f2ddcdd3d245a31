"""Real execution of placements: trace a step into an executable fx graph, split it by
device, and run it in worker processes (``docs/runtime.md``)."""

from meshplace.runtime.executor import Fault, RunResult, WorkerFailure, run_placement, run_reference
from meshplace.runtime.program import ModelSpec, TracedStep, trace_step

__all__ = [
    "Fault",
    "ModelSpec",
    "RunResult",
    "TracedStep",
    "WorkerFailure",
    "run_placement",
    "run_reference",
    "trace_step",
]
