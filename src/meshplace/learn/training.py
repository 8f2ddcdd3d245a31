"""The bookkeeping every learned placer shares: best plan, learning curve, checkpoints.

A learned placer (``rl``, ``hrl``, ``gnn`` fine-tuning) runs a fixed number of updates
(fixed by its budget, so a seed reproduces the plan), keeps the best plan any update
sampled, records one learning-curve point per update, reports progress, and — with a
checkpoint file — saves everything needed to continue exactly where it stopped: the
learner's own stateful objects (policy, optimizer, sampling generator) and scalars (a
baseline), plus this run's counters, best plan and curve. :class:`TrainingRun` holds that
state so each learner only writes its update rule.

Checkpoints are written with ``torch.save`` to a temp file in the same folder and renamed
into place (:func:`save_checkpoint`), so a SIGKILL never leaves a torn file; a checkpoint
whose format or fingerprint (problem, seed, number of updates, hyper-parameters) differs
from the run's is refused with a :class:`~meshplace.placers.base.PlacerError`.

**Deadline.** Besides its fixed number of updates a run has a hard wall-clock limit,
``deadline_s`` seconds of training in all (a machine much slower than the budget assumed
stops there). The checkpoint stores the training seconds spent so far, so a resumed run
gets only the rest of that limit, not a fresh one: a run killed and resumed three times
stops at the same deadline as one never interrupted (up to the seconds after the last
checkpoint before each kill, which the resumed run does again). ``stats()["stopped_by"]``
says what ended the run: ``"budget"`` (every planned update made), ``"deadline"``, or
``"stop_after"`` (a deliberate interruption). Time is read from
:func:`meshplace.placers.base.now` (or the ``clock`` given), so tests inject a clock.

Complexity: O(1) per update besides the checkpoint writes (the size of the state).

Example
-------
>>> import numpy as np, torch
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> run = TrainingRun(p, total=2, fingerprint={"seed": 0}, fmt="demo v1",
...                   best=np.zeros(p.num_groups, dtype=np.int64))
>>> plans = np.zeros((3, p.num_groups), dtype=np.int64)
>>> run.offer(plans, np.array([3.0, 1.0, 2.0]), np.array([3.0, 1.0, 2.0]))
>>> run.finish_update()
>>> run.done, run.best_score, run.curve["best_step_time_s"]
(1, 1.0, [1.0])
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshplace.placers.base import Clock, PlacementProblem, PlacerError, ProgressFn, now


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temp file in the same folder, then an atomic rename."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise PlacerError(f"{path}: cannot write a checkpoint there, folder does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _state_of(obj: Any) -> Any:
    """What to save of a stateful object: a module's or optimizer's ``state_dict``, a
    generator's RNG state."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return obj.state_dict()


def _restore(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


class TrainingRun:
    """One learned placer's training run: counters, best plan, curve, checkpoints.

    Args:
        problem: the placement problem (its ``evaluations`` counter is read by
            :meth:`count`).
        total: the number of updates the run will make.
        fingerprint: what a checkpoint must match to be resumed (problem, seed, updates,
            hyper-parameters...).
        fmt: the checkpoint format string of the learner.
        best: the initial best plan (any valid plan of the right shape).
        path: the checkpoint file, or ``None`` for none.
        checkpoint_every: save after every this many updates (and at the end).
        progress: called after every update with ``(done, total, best step time)``.
        start: the ``clock`` reading at which this session's wall time starts (default:
            now).
        deadline_s: training seconds (summed over resumed sessions, counted from
            ``start``) after which :meth:`keep_going` stops the run — a hard stop on a
            machine slower than the budget assumed; ``None`` for none.
        stop_after: :meth:`keep_going` stops once this session has made this many updates
            (a deliberate interruption, for tests of resuming).
        clock: where time is read (default :func:`meshplace.placers.base.now`).

    Attributes:
        done, evaluations, best, best_score, best_step, curve, resumed_from: the run's
        state; ``session`` counts the updates made since this process started;
        ``wall_before`` the training seconds of earlier sessions (from the checkpoint).
    """

    def __init__(
        self,
        problem: PlacementProblem,
        *,
        total: int,
        fingerprint: dict[str, Any],
        fmt: str,
        best: np.ndarray,
        path: Path | None = None,
        checkpoint_every: int = 20,
        progress: ProgressFn | None = None,
        start: float | None = None,
        deadline_s: float | None = None,
        stop_after: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.problem = problem
        self.total = int(total)
        self.fingerprint = fingerprint
        self.fmt = fmt
        self.path = path
        self.checkpoint_every = max(1, int(checkpoint_every))
        self.progress = progress
        self.clock: Clock = clock or now
        self.start = self.clock() if start is None else start
        self.wall_before = 0.0
        self.done = 0
        self.session = 0
        self.evaluations = 0
        self.best = np.asarray(best, dtype=np.int64).copy()
        self.best_score = math.inf
        self.best_step = math.inf
        self.curve: dict[str, list[float]] = {
            "evaluations": [],
            "best_step_time_s": [],
            "wall_s": [],
        }
        self.resumed_from: int | None = None
        self.deadline_s = deadline_s
        self.stop_after = stop_after
        self.stopped_at_deadline = False
        self.stopped_after_session = False

    # ------------------------------------------------------------ bookkeeping
    def count(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` and add the simulations it ran to :attr:`evaluations`."""
        before = self.problem.evaluations
        out = fn()
        self.evaluations += self.problem.evaluations - before
        return out

    def offer(self, plans: np.ndarray, scores: np.ndarray, steps: np.ndarray) -> None:
        """Keep the best of ``plans`` (rows) if it beats the best so far."""
        k = int(np.argmin(scores))
        if scores[k] < self.best_score:
            self.best = np.asarray(plans[k], dtype=np.int64).copy()
            self.best_score, self.best_step = float(scores[k]), float(steps[k])

    def wall_s(self) -> float:
        """Training seconds so far, across resumed sessions."""
        return self.wall_before + self.clock() - self.start

    def record(self) -> None:
        """Add a learning-curve point (best step time so far) without counting an update."""
        self.curve["evaluations"].append(float(self.evaluations))
        self.curve["best_step_time_s"].append(self.best_step)
        self.curve["wall_s"].append(self.wall_s())

    def finish_update(
        self, stateful: dict[str, Any] | None = None, scalars: dict[str, Any] | None = None
    ) -> None:
        """Count one update: curve point, progress, and a checkpoint every
        ``checkpoint_every`` updates (and after the last) of ``stateful`` objects and
        ``scalars``."""
        self.done += 1
        self.session += 1
        self.record()
        if self.progress is not None:
            self.progress(self.done, self.total, self.best_step)
        if self.done % self.checkpoint_every == 0 or self.done == self.total:
            self.save(stateful or {}, scalars or {})

    def end_session(self, stateful: dict[str, Any], scalars: dict[str, Any]) -> None:
        """An interrupted session leaves its latest state behind."""
        if self.session and self.done % self.checkpoint_every and self.done < self.total:
            self.save(stateful, scalars)

    def keep_going(self) -> bool:
        """Whether to make another update: not yet at ``total``, not past the deadline
        (``deadline_s`` training seconds across sessions; checked after at least one update,
        and :attr:`stopped_at_deadline` then records it), and not past ``stop_after``
        updates in this session."""
        if self.done >= self.total:
            return False
        past = self.deadline_s is not None and self.wall_s() > self.deadline_s
        if past and (self.session > 0 or self.done > 0):
            self.stopped_at_deadline = True
            return False
        if self.stop_after is not None and self.session >= self.stop_after:
            self.stopped_after_session = True
            return False
        return True

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    @property
    def stopped_by(self) -> str | None:
        """What ended the run: ``"budget"`` (all planned updates made), ``"deadline"``,
        ``"stop_after"``, or ``None`` while it runs."""
        if self.finished:
            return "budget"
        if self.stopped_at_deadline:
            return "deadline"
        return "stop_after" if self.stopped_after_session else None

    # ------------------------------------------------------------ checkpoints
    def save(self, stateful: dict[str, Any], scalars: dict[str, Any]) -> None:
        """Write the run's state and the learner's to :attr:`path` (atomically)."""
        if self.path is None:
            return
        save_checkpoint(
            self.path,
            {
                "format": self.fmt,
                "fingerprint": self.fingerprint,
                "stateful": {k: _state_of(v) for k, v in stateful.items()},
                "scalars": dict(scalars),
                "done": self.done,
                "evaluations": self.evaluations,
                "wall_s": self.wall_s(),
                "best": self.best.tolist(),
                "best_score_s": self.best_score,
                "best_step_s": self.best_step,
                "learning_curve": self.curve,
            },
        )

    def resume(self, stateful: dict[str, Any]) -> dict[str, Any] | None:
        """Continue from :attr:`path` if it exists: restore ``stateful`` objects in place
        and the run's state; return the saved scalars (``None`` when there is nothing to
        resume). A checkpoint of another format or fingerprint is a :class:`PlacerError`."""
        if self.path is None or not self.path.exists():
            return None
        try:
            state = torch.load(self.path, weights_only=True)
        except Exception as exc:
            raise PlacerError(f"{self.path}: not a readable checkpoint ({exc})") from None
        if (
            not isinstance(state, dict)
            or state.get("format") != self.fmt
            or state.get("fingerprint") != self.fingerprint
        ):
            found = state.get("fingerprint") if isinstance(state, dict) else None
            raise PlacerError(
                f"{self.path}: checkpoint is for another problem, seed, budget, config or "
                f"weights "
                f"({found}), not {self.fingerprint}"
            )
        for key, obj in stateful.items():
            _restore(obj, state["stateful"][key])
        self.done = self.resumed_from = int(state["done"])
        self.evaluations = int(state["evaluations"])
        self.wall_before = float(state["wall_s"])
        self.best = np.array(state["best"], dtype=np.int64)
        self.best_score = float(state["best_score_s"])
        self.best_step = float(state["best_step_s"])
        self.curve = {k: list(v) for k, v in state["learning_curve"].items()}
        return dict(state["scalars"])

    def stats(self) -> dict[str, Any]:
        """The run's part of a placer's stats."""
        return {
            "evaluations": self.evaluations,
            "best_score_s": self.best_score,
            "best_step_time_s": self.best_step,
            "updates": self.done,
            "planned_updates": self.total,
            "finished": self.finished,
            "resumed_from_update": self.resumed_from,
            "stopped_at_deadline": self.stopped_at_deadline,
            "stopped_by": self.stopped_by,
            "deadline_s": self.deadline_s,
            "wall_s": self.wall_s(),
            "learning_curve": self.curve,
        }
