"""What every placer shares: the problem it solves, how plans are scored, the registry.

A placer is a plain function ``place(problem, budget_s, seed) -> assignment`` where the
assignment gives a device index per **co-location group** (``problem.grouping``), or, for
placers that reason about single ops, an :class:`OpAssignment` with a device per op.
:func:`run_placer` times it, expands the assignment to ops, simulates it and reports the
step time, peak memory (OOM) and the number of simulator evaluations the search used.

Time: every placer, :class:`LearningCurve` and :func:`run_placer` read the clock through
:func:`now`, which is :func:`time.perf_counter` unless :func:`use_clock` injected another
(a test's :class:`ManualClock` makes a deadline pass on demand). Budgets are fixed amounts
of work; the clock only enforces the hard deadlines and measures ``search_time_s``.

Registry: the built-in placers register when :mod:`meshplace.placers` is imported; the
learned ones (torch policies, gymnasium) are listed in :data:`DEFERRED_PLACERS` by name,
family and module, and their module is imported only when one of them is looked up
(:func:`registry` ``[name]``) or run, so ``import meshplace.placers`` stays light.

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers import PlacementProblem, run_placer
>>> problem = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> result = run_placer("round_robin", problem, budget_s=1.0, seed=0)
>>> result.placer, result.step_time_s > 0
('round_robin', True)
"""

from __future__ import annotations

import difflib
import importlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshplace.errors import InputError
from meshplace.graph.groups import (
    DEFAULT_MAX_GROUPS,
    Grouping,
    group_ops,
    keep_strict_classes_together,
    strict_classes,
    tied_groups,
)
from meshplace.graph.ir import OpGraph
from meshplace.sim.simulator import OBJECTIVES, SimResult, Simulator

UNSUPPORTED_S = 1e6
"""Seconds a group costs, in the placers' own estimates, on a device that cannot run one of
its ops (``Op.unsupported``): large enough that no heuristic prefers it, finite so that
means, ranks and features stay numbers."""


class PlacerError(InputError):
    """An unknown placer, a bad budget, or a model that fits no device."""


# -------------------------------------------------------------------- clock
Clock = Callable[[], float]
"""A source of seconds (only differences matter), like :func:`time.perf_counter`."""

_clock: Clock = time.perf_counter


SIMULATED_OPS_PER_SECOND = 3.0e6
"""Simulated ops per second the searching placers assume when they turn a wall-clock
budget into a fixed number of simulations, so the same budget reproduces the same plan.
``benchmarks/simulator_speed.py`` measures 2.4-4 M on random op placements, and group-level
plans (fewer transfers) run faster, so most machines finish well inside the budget."""


def now() -> float:
    """Seconds on the placers' clock: :func:`time.perf_counter` unless :func:`use_clock`
    injected another."""
    return _clock()


@contextmanager
def use_clock(clock: Clock) -> Iterator[Clock]:
    """Make every placer, learned trainer and :func:`run_placer` read time from ``clock``
    inside the ``with`` block (tests use it to make a deadline pass, or never pass).

    >>> clock = ManualClock()
    >>> with use_clock(clock):
    ...     clock.advance(2.5)
    ...     now()
    2.5
    """
    global _clock
    previous, _clock = _clock, clock
    try:
        yield clock
    finally:
        _clock = previous


class ManualClock:
    """A clock that moves only when told: frozen at ``start`` until :meth:`advance`, plus
    ``tick`` seconds after every reading (to make time pass with the work done).

    >>> clock = ManualClock(tick=1.0)
    >>> clock(), clock(), clock.advance(10.0), clock()
    (0.0, 1.0, None, 12.0)
    """

    def __init__(self, start: float = 0.0, tick: float = 0.0) -> None:
        self.time = float(start)
        self.tick = float(tick)
        self.readings = 0

    def __call__(self) -> float:
        value = self.time
        self.time += self.tick
        self.readings += 1
        return value

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.time += float(seconds)


@dataclass(frozen=True)
class OpAssignment:
    """A per-op device assignment, for placers that do not work on groups."""

    devices: np.ndarray


class PlacementProblem:
    """A graph, a cluster, an objective, and everything placers need precomputed.

    Attributes:
        graph, cluster, objective: as given.
        grouping: the co-location groups (``group_ops(graph, max_groups)``).
        group_graph: the acyclic group graph (one op per group, costs summed).
        simulator: scores op-level placements.
        group_time: ``[n_devices, n_groups]`` seconds of each group on each device
            (:data:`UNSUPPORTED_S` where it cannot run: ``group_runs`` is False there).
        group_memory: bytes each group needs wherever it is placed: resident parameters,
            optimizer state and inputs plus the forward outputs it keeps for the backward
            pass (a memory-aware placer's budget; the simulator measures the true peak).
        device_memory: capacity per device (bytes).
    """

    def __init__(
        self,
        graph: OpGraph,
        cluster: Any,
        objective: str = "step",
        grouping: Grouping | None = None,
        simulator: Simulator | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise PlacerError(f"unknown objective {objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if graph.num_ops == 0:
            raise PlacerError(f"graph {graph.name!r} has no ops to place")
        self.graph = graph
        self.cluster = cluster
        self.objective = objective
        self.grouping = grouping or group_ops(graph, DEFAULT_MAX_GROUPS)
        self.group_graph = self.grouping.group_graph()
        self.simulator = simulator or Simulator(graph, cluster)
        self.group_of = self.grouping.group_of
        self.num_groups = self.grouping.num_groups
        self.num_devices = self.simulator.num_devices
        sim = self.simulator
        op_time = sim.op_time_by_kind[sim.device_kind_index]  # [n_devices, n_ops]
        # a group with an op a device cannot run (Op.unsupported) cannot run there either;
        # the heuristics see UNSUPPORTED_S seconds rather than infinity (the simulator,
        # which scores every plan, charges infinity)
        runs = np.isfinite(op_time)
        self.group_runs = np.ones((self.num_devices, self.num_groups), dtype=bool)
        self.group_time = np.zeros((self.num_devices, self.num_groups))
        for d in range(self.num_devices):
            self.group_time[d] = np.bincount(
                self.group_of, weights=np.where(runs[d], op_time[d], 0.0), minlength=self.num_groups
            )
            blocked = np.bincount(self.group_of, weights=~runs[d], minlength=self.num_groups)
            self.group_runs[d] = blocked == 0
        self.group_time[~self.group_runs] = UNSUPPORTED_S
        self.op_memory = _op_memory(graph, sim)
        self.group_memory = np.bincount(
            self.group_of, weights=self.op_memory, minlength=self.num_groups
        )
        self.device_memory = sim.memory_capacity.copy()
        # strict co-location: each class is placed as a unit, so groups holding one class's
        # ops follow one decider (the first of them) wherever a placement is expanded
        self.strict_classes = strict_classes(graph)
        self.group_decider = tied_groups(self.grouping, self.strict_classes)
        self._tied = bool(np.any(self.group_decider != np.arange(self.num_groups)))
        self.evaluations = 0
        self._warm = False

    @classmethod
    def build(
        cls,
        graph: OpGraph,
        cluster: Any,
        objective: str = "step",
        max_groups: int | None = None,
        *,
        cost_model: Any = None,
    ) -> PlacementProblem:
        """A problem with ``graph`` coarsened to at most ``max_groups`` groups, simulated
        with ``cost_model`` (default: the roofline's defaults)."""
        grouping = group_ops(graph, max_groups or DEFAULT_MAX_GROUPS)
        simulator = Simulator(graph, cluster, cost_model) if cost_model is not None else None
        return cls(graph, cluster, objective, grouping, simulator=simulator)

    # ---------------------------------------------------------------- helpers
    @property
    def device_names(self) -> list[str]:
        return self.simulator.device_names

    def tie(self, group_devices: np.ndarray) -> np.ndarray:
        """``group_devices`` with every group tied by a strict co-location class on its
        decider's device (unchanged where the graph has no strict class)."""
        group_devices = np.asarray(group_devices, dtype=np.int64)
        return group_devices[self.group_decider] if self._tied else group_devices

    def expand(self, group_devices: np.ndarray) -> np.ndarray:
        """Op-level placement from a device per group (strict classes kept whole)."""
        return self.tie(group_devices)[self.group_of]

    def keep_strict(self, op_devices: np.ndarray) -> tuple[np.ndarray, int]:
        """An op-level placement with every strict co-location class on the device of its
        first op, and how many ops that moved (0 without strict classes)."""
        if not self.strict_classes:
            return np.asarray(op_devices, dtype=np.int64), 0
        return keep_strict_classes_together(op_devices, self.strict_classes)

    def evaluate_ops(self, op_devices: np.ndarray) -> SimResult:
        """Simulate an op-level placement (counts one evaluation); strict co-location
        classes are kept whole first."""
        self.evaluations += 1
        return self.simulator.simulate(self.keep_strict(op_devices)[0], objective=self.objective)

    def evaluate(self, group_devices: np.ndarray) -> SimResult:
        """Simulate a group-level placement (counts one evaluation)."""
        return self.evaluate_ops(self.expand(group_devices))

    def warm_up(self) -> float:
        """Pay the simulator's one-off costs (numba loading its compiled kernels on the
        first call in a process, the lower bound) outside any timed region: one
        simulation of every op on the first device, not counted as an evaluation.
        Returns the seconds it took (0 once done for this problem)."""
        if self._warm:
            return 0.0
        start = now()
        self.simulator.simulate(np.zeros(self.graph.num_ops, dtype=np.int64))
        self.simulator.lower_bound()
        self._warm = True
        return now() - start

    def score(self, result: SimResult) -> float:
        """What searches minimise: the objective, with ColocRL's penalty for OOM plans
        (Mirhoseini et al. 2017 assign failed placements a large fixed runtime; here the
        objective times 10 plus 100 s so an OOM plan always loses to a fitting one). A plan
        that puts an op where it cannot run (an infinite time) scores ``10 x``
        :data:`UNSUPPORTED_S`: finite, so that rewards and means stay numbers, and worse
        than any plan that runs."""
        if not math.isfinite(result.value):
            return 10.0 * UNSUPPORTED_S
        return result.value * 10.0 + 100.0 if result.oom else result.value

    def fits(self, group_devices: np.ndarray) -> bool:
        """Whether the memory-demand estimate fits every device."""
        load = np.bincount(
            self.tie(group_devices), weights=self.group_memory, minlength=self.num_devices
        )
        return bool(np.all(load <= self.device_memory))

    def check_fits_somewhere(self) -> None:
        """Raise :class:`PlacerError` if the model cannot fit the cluster at all."""
        biggest = int(np.argmax(self.group_memory)) if self.num_groups else 0
        largest_device = float(self.device_memory.max())
        if self.num_groups and self.group_memory[biggest] > largest_device:
            raise PlacerError(
                f"graph {self.graph.name!r} fits no device: group "
                f"{self.grouping.names[biggest]!r} alone needs "
                f"{self.group_memory[biggest] / 2**30:.2f} GiB but the largest device has "
                f"{largest_device / 2**30:.2f} GiB"
            )
        total = float(self.group_memory.sum())
        if total > float(self.device_memory.sum()):
            raise PlacerError(
                f"graph {self.graph.name!r} fits no placement: it needs {total / 2**30:.2f} GiB "
                f"but the cluster's {self.num_devices} devices have "
                f"{self.device_memory.sum() / 2**30:.2f} GiB in all (largest device "
                f"{largest_device / 2**30:.2f} GiB)"
            )


def _op_memory(graph: OpGraph, sim: Simulator) -> np.ndarray:
    """Resident bytes plus forward outputs that a backward op reads (kept alive between
    the passes) — the part of memory that placement moves around."""
    mem = sim.resident_per_op.copy()
    ops = graph.ops
    kept = np.zeros(len(ops))
    for s, d, _ in graph.edges():
        if ops[s].phase == "forward" and ops[d].phase == "backward":
            kept[s] = sim.transient_bytes[s]
    return mem + kept


class LearningCurve:
    """The best step time found so far against simulator evaluations and wall seconds.

    Search and learned placers record a point whenever they want (every update, or every
    improvement); :meth:`to_dict` is what they put in ``stats["learning_curve"]`` and what
    ``benchmarks/learned.py`` and the HTML report plot.

    >>> class _P:
    ...     evaluations = 0
    >>> problem = _P()
    >>> curve = LearningCurve(problem)
    >>> problem.evaluations = 5
    >>> curve.record(0.5)
    >>> curve.to_dict()["evaluations"], curve.to_dict()["best_step_time_s"]
    ([5.0], [0.5])
    """

    def __init__(self, problem: Any, start: float | None = None) -> None:
        self.problem = problem
        self.start = now() if start is None else start
        self.evaluations: list[float] = []
        self.best_step_time_s: list[float] = []
        self.wall_s: list[float] = []

    def record(self, best_step_time_s: float) -> None:
        self.evaluations.append(float(self.problem.evaluations))
        self.best_step_time_s.append(float(best_step_time_s))
        self.wall_s.append(now() - self.start)

    def to_dict(self) -> dict[str, list[float]]:
        return {
            "evaluations": list(self.evaluations),
            "best_step_time_s": list(self.best_step_time_s),
            "wall_s": list(self.wall_s),
        }


# ----------------------------------------------------------------- registry
PlaceFn = Callable[..., "np.ndarray | OpAssignment | tuple"]
ProgressFn = Callable[[int, int, float], None]
"""``progress(done, total, best_step_time_s)``: a learned placer's training progress."""


@dataclass(frozen=True)
class PlacerOptions:
    """Run-time options for the placers registered with ``takes_options=True`` (the
    learned ones, and ``pipeline``); others ignore them.

    Attributes:
        checkpoint_dir: folder where a training placer keeps its checkpoint
            (``<checkpoint_dir>/<placer>.ckpt``, rewritten atomically at intervals).
        resume: continue from that checkpoint if it exists; the run then ends with the plan
            an uninterrupted run with the same seed and budget would have ended with.
        finetune_s: seconds a pretrained policy (``gnn``) may train on this graph after
            placing it zero-shot; ``None`` or 0 = zero-shot only.
        progress: called after every training update with ``(done, total, best step time)``.
        runnable_stages: ``pipeline`` returns only a split that ``torch.distributed.
            pipelining`` runs stage by stage (contiguous in execution order, no
            non-contiguous local search).
    """

    checkpoint_dir: Path | None = None
    resume: bool = False
    finetune_s: float | None = None
    progress: ProgressFn | None = None
    runnable_stages: bool = False

    def checkpoint(self, placer: str) -> Path | None:
        """The checkpoint file for ``placer`` (``None`` without a checkpoint folder)."""
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / f"{placer}.ckpt"


@dataclass(frozen=True)
class PlacerSpec:
    """A registered placer: its function and what the CLI, docs and benchmarks show.

    ``warmup`` (optional) pays the placer's own one-off costs (e.g. numba loading its
    kernels) once per process, before :func:`run_placer` starts timing it."""

    name: str
    fn: PlaceFn
    family: str
    description: str
    source: str
    uses_budget: bool = False
    takes_options: bool = False
    warmup: Callable[[], None] | None = None


@dataclass(frozen=True)
class DeferredPlacer:
    """A placer known by name and family before its module is imported."""

    module: str
    family: str


DEFERRED_PLACERS: dict[str, DeferredPlacer] = {
    # torch.nn policies and gymnasium: imported only when one of these is asked for.
    "rl": DeferredPlacer("meshplace.learn.rl", "learned"),
    "hrl": DeferredPlacer("meshplace.learn.hrl", "learned"),
    "gnn": DeferredPlacer("meshplace.learn.gnn", "learned"),
}
"""Placers whose modules :func:`registry` imports on first lookup, by name."""

_REGISTRY: dict[str, PlacerSpec] = {}
_WARMED_UP: set[str] = set()


def register(
    name: str,
    family: str,
    description: str,
    source: str,
    uses_budget: bool = False,
    takes_options: bool = False,
    warmup: Callable[[], None] | None = None,
) -> Callable[[PlaceFn], PlaceFn]:
    """Decorator adding a placer to the registry under ``name``.

    A placer is called ``fn(problem, budget_s, seed)``, or, with ``takes_options=True``,
    ``fn(problem, budget_s, seed, options)`` with a :class:`PlacerOptions`. A name listed
    in :data:`DEFERRED_PLACERS` must register with the family declared there.
    """
    deferred = DEFERRED_PLACERS.get(name)
    if deferred is not None and deferred.family != family:
        raise ValueError(
            f"placer {name!r} is declared as family {deferred.family!r} in DEFERRED_PLACERS "
            f"but registers as {family!r}"
        )

    def wrap(fn: PlaceFn) -> PlaceFn:
        _REGISTRY[name] = PlacerSpec(
            name, fn, family, description, source, uses_budget, takes_options, warmup
        )
        return fn

    return wrap


class PlacerRegistry(Mapping[str, PlacerSpec]):
    """Every placer by name, read-only: the built-in ones in registration order, then the
    deferred ones (:data:`DEFERRED_PLACERS`) in their declared order.

    Iterating, ``in`` and :meth:`family` never import a deferred placer's module; looking
    one up (``registry()["rl"]``, ``.items()``, ``.values()``) does.

    >>> reg = registry()
    >>> "rl" in reg, reg.family("rl"), reg.family("anneal")
    (True, 'learned', 'search')
    """

    def __getitem__(self, name: str) -> PlacerSpec:
        if name not in _REGISTRY and name in DEFERRED_PLACERS:
            importlib.import_module(DEFERRED_PLACERS[name].module)
        return _REGISTRY[name]

    def __iter__(self) -> Iterator[str]:
        eager = [name for name in _REGISTRY if name not in DEFERRED_PLACERS]
        return iter([*eager, *DEFERRED_PLACERS])

    def __len__(self) -> int:
        return len(set(_REGISTRY) | set(DEFERRED_PLACERS))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY or name in DEFERRED_PLACERS

    def family(self, name: str) -> str:
        """The family of placer ``name`` (without importing a deferred module)."""
        spec = _REGISTRY.get(name)
        if spec is not None:
            return spec.family
        if name in DEFERRED_PLACERS:
            return DEFERRED_PLACERS[name].family
        raise KeyError(name)

    def names(self, family: str | None = None) -> list[str]:
        """Every placer name (of ``family`` if given), in registry order."""
        return [n for n in self if family is None or self.family(n) == family]


def registry() -> PlacerRegistry:
    """Every placer by name (see :class:`PlacerRegistry`; deferred ones load on lookup)."""
    from meshplace import placers  # noqa: F401  (importing registers the built-in placers)

    return PlacerRegistry()


def resolve(names: str | list[str]) -> list[str]:
    """Placer names from ``"all"``, ``"a,b"`` or a list; unknown names are an error (with
    the closest known name when there is one), and so is an empty list. Imports nothing."""
    known = registry()
    if isinstance(names, str):
        if names.strip() == "all":
            names = list(known)
        else:
            names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise PlacerError(f"no placer given; known placers: {', '.join(known)}")
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlacerError(f"unknown placer {n!r}{hint}; known placers: {', '.join(known)}")
    return list(dict.fromkeys(names))


@dataclass
class PlacerResult:
    """One placer's outcome on one problem.

    ``search_time_s`` is the placer's own time; ``warmup_s`` the one-off costs paid before
    it (numba loading the simulator's kernels in a fresh process, a placer's own warm-up),
    which no budget is charged for."""

    placer: str
    op_devices: np.ndarray
    sim: SimResult
    search_time_s: float
    evaluations: int
    stats: dict[str, Any] = field(default_factory=dict)
    warmup_s: float = 0.0

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s

    @property
    def value(self) -> float:
        return self.sim.value

    @property
    def oom(self) -> bool:
        return self.sim.oom

    def to_dict(self) -> dict[str, Any]:
        return {
            "placer": self.placer,
            "step_time_s": self.sim.step_time_s,
            "throughput_time_s": self.sim.throughput_time_s,
            "micro_batches": self.sim.micro_batches,
            "objective_value_s": self.sim.value,
            "oom": self.sim.oom,
            "oom_devices": self.sim.oom_devices,
            "search_time_s": self.search_time_s,
            "warmup_s": self.warmup_s,
            "evaluations": self.evaluations,
            "peak_memory_bytes": {
                n: float(m)
                for n, m, used in zip(
                    self.sim.device_names,
                    self.sim.peak_memory_bytes,
                    np.bincount(self.op_devices, minlength=len(self.sim.device_names)) > 0,
                )
                if used
            },
            "bytes_moved": float(self.sim.transfer_bytes.sum()),
            **({"stats": self.stats} if self.stats else {}),
        }


def warm_up(problem: PlacementProblem, spec: PlacerSpec) -> float:
    """Pay the one-off costs of running ``spec`` on ``problem`` now, untimed: the
    simulator's (:meth:`PlacementProblem.warm_up`) and, once per process, the placer's own
    ``warmup``. Returns the seconds spent."""
    start = now()
    problem.warm_up()
    if spec.warmup is not None and spec.name not in _WARMED_UP:
        spec.warmup()
        _WARMED_UP.add(spec.name)
    return now() - start


def check_budget(budget_s: float) -> None:
    """A budget must be a finite, positive number of seconds (:class:`PlacerError`)."""
    try:
        value = float(budget_s)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise PlacerError(f"the time budget must be positive, finite seconds, got {budget_s!r}")


def run_placer(
    name: str,
    problem: PlacementProblem,
    budget_s: float,
    seed: int,
    options: PlacerOptions | None = None,
) -> PlacerResult:
    """Run placer ``name`` on ``problem`` and score its plan with the simulator.

    One-off costs (:func:`warm_up`) are paid first and reported as ``warmup_s``, apart from
    ``search_time_s``. ``options`` reach only placers registered with
    ``takes_options=True`` (the learned ones and ``pipeline``).
    """
    check_budget(budget_s)
    spec = registry()[resolve([name])[0]]
    warmup_s = warm_up(problem, spec)
    problem.evaluations = 0
    start = now()
    if spec.takes_options:
        out = spec.fn(problem, budget_s, seed, options or PlacerOptions())
    else:
        out = spec.fn(problem, budget_s, seed)
    elapsed = now() - start
    stats: dict[str, Any] = {}
    if isinstance(out, tuple):
        out, stats = out
    if isinstance(out, OpAssignment):
        op_devices = np.asarray(out.devices, dtype=np.int64)
    else:
        op_devices = problem.expand(np.asarray(out, dtype=np.int64))
    op_devices, moved = problem.keep_strict(op_devices)
    if problem.strict_classes:  # what keeping them whole changed in the placer's own plan
        stats = {**stats, "strict_ops_moved": moved}
    evaluations = problem.evaluations
    result = problem.simulator.simulate(op_devices, objective=problem.objective)
    return PlacerResult(name, op_devices, result, elapsed, evaluations, stats, warmup_s)


def best_result(results: list[PlacerResult]) -> PlacerResult | None:
    """The fastest plan that fits in memory and runs every op where it can run (``None``
    if there is none)."""
    fitting = [r for r in results if not r.oom and math.isfinite(r.value)]
    return min(fitting, key=lambda r: (r.value, r.placer)) if fitting else None
