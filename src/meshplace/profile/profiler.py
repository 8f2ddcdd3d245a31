"""Leveled, across-stack profiling of a training step (model, module and op levels).

Following across-stack profiling (Li et al., "XSP: Across-Stack Profiling and Analysis of
Machine Learning Models on GPUs", IPDPS 2020), each level is measured in its own runs with
only that level and the ones above it enabled, so a lower level's instrumentation never
inflates a higher level's numbers:

* ``model`` — the whole eager step (forward, ``backward()``, Adam update), wall clock;
* ``module`` — plus global forward pre/post hooks timing every module's forward (inclusive);
* ``op`` — plus a ``TorchDispatchMode`` timing every aten op (forward, backward, update),
  attributed to the innermost running module, with FLOPs from :mod:`meshplace.graph.flops`.

The overhead a level adds is its step time minus the step time of the level above. Every
statistic is a trimmed mean over the runs (the fastest and slowest fifth dropped). Cost:
``(runs + 1) x levels`` training steps.

The profile file (format ``meshplace.profile`` v1) is described in ``docs/runtime.md``; the
Chrome trace (``chrome://tracing`` / Perfetto) shows the op-level run with module spans.

Example
-------
>>> trimmed_mean([1.0, 2.0, 3.0, 100.0, 2.5])
2.5
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshplace.errors import InputError
from meshplace.graph.flops import flop_count, op_kind
from meshplace.util import write_text_atomic

LEVELS = ("model", "module", "op")
FORMAT = "meshplace.profile"
VERSION = 1


class ProfileError(InputError):
    """Bad profiler options (unknown level, non-positive runs)."""


def trimmed_mean(values: Sequence[float], cut: float = 0.2) -> float:
    """Mean after dropping ``cut`` of the values at each end (at least one each end when
    there are five or more). O(n log n)."""
    v = sorted(values)
    if not v:
        return 0.0
    k = int(len(v) * cut) if len(v) >= 5 else 0
    v = v[k : len(v) - k] or v
    return sum(v) / len(v)


def parse_levels(text: str) -> list[str]:
    """``"model,op"`` → ``["model", "module", "op"]`` (a level implies those above it)."""
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    for w in wanted:
        if w not in LEVELS:
            raise ProfileError(f"unknown profiling level {w!r}; allowed: {', '.join(LEVELS)}")
    if not wanted:
        raise ProfileError(f"name at least one profiling level among {', '.join(LEVELS)}")
    deepest = max(LEVELS.index(w) for w in wanted)
    return list(LEVELS[: deepest + 1])


# ------------------------------------------------------------------ instruments
class _ModuleTimer:
    """Global forward hooks: inclusive forward time per module path, and the module stack."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.paths = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
        self.stack: list[tuple[str, float]] = []
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.handles: list[Any] = []
        self.record_spans = False

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            self.stack.append((path, time.perf_counter()))

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.paths and self.stack:
            path, t0 = self.stack.pop()
            t1 = time.perf_counter()
            self.times[path] = self.times.get(path, 0.0) + (t1 - t0)
            if self.record_spans:
                self.spans.append((path, t0, t1))

    def __enter__(self) -> _ModuleTimer:
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._pre),
            hooks.register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.stack.clear()


def _shape(x: Any) -> list[int] | None:
    return list(x.shape) if isinstance(x, torch.Tensor) else None


def _nbytes(ts: Sequence[Any]) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor)))


class _OpTimer(TorchDispatchMode):
    """Times every aten op; records (name, kind, module, seconds, flops, bytes, start)."""

    def __init__(self, modules: _ModuleTimer | None) -> None:
        super().__init__()
        self.modules = modules
        self.records: list[tuple[str, str, str, float, float, float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        name = func.overloadpacket.__name__
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        try:
            flops = flop_count(
                name, [_shape(a) for a in args], [list(o.shape) for o in outs], args, kwargs
            )
        except (IndexError, TypeError, AssertionError, ValueError):
            flops = 0.0
        module = self.modules.current() if self.modules is not None else ""
        self.records.append(
            (name, op_kind(name), module, dt, float(flops), _nbytes(ins) + _nbytes(outs), t0)
        )
        return out


# ------------------------------------------------------------------ profile
@dataclass
class Profile:
    """A leveled profile (see the module docstring); times in seconds."""

    name: str
    levels: list[str]
    runs: int
    step_s: dict[str, float]
    overhead_s: dict[str, float]
    modules: dict[str, dict[str, float]] = field(default_factory=dict)
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)
    device: dict[str, float] = field(default_factory=dict)
    trace_events: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "levels": self.levels,
            "runs": self.runs,
            "step_s": self.step_s,
            "overhead_s": self.overhead_s,
            "device": self.device,
            "modules": self.modules,
            "ops": self.ops,
            "kinds": self.kinds,
            "meta": self.meta,
        }

    def chrome_trace(self) -> dict[str, Any]:
        return {"traceEvents": self.trace_events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path, trace_path: str | Path | None = None) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))
        if trace_path is not None:
            write_text_atomic(trace_path, json.dumps(self.chrome_trace()))


def _train_step(model: torch.nn.Module, inputs: list[Any], opt: torch.optim.Optimizer) -> None:
    out = model(*inputs)
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    loss = flat[0] if flat[0].dim() == 0 else flat[0].float().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def profile_model(
    model: torch.nn.Module,
    inputs: list[Any],
    *,
    name: str = "model",
    levels: Sequence[str] = LEVELS,
    runs: int = 3,
    device: dict[str, float] | None = None,
) -> Profile:
    """Profile ``runs`` eager training steps of ``model(*inputs)`` (which returns a loss)
    at each of ``levels`` (after one warm-up step per level)."""
    levels = parse_levels(",".join(levels))
    if runs < 1:
        raise ProfileError(f"runs must be a positive integer, got {runs}")
    model.train(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    step_s: dict[str, float] = {}
    modules_t: dict[str, list[float]] = {}
    op_runs: list[list[tuple]] = []
    spans: list[tuple[str, float, float]] = []
    for level in levels:
        times = []
        for r in range(runs + 1):
            mt = _ModuleTimer(model) if level in ("module", "op") else None
            ot = _OpTimer(mt) if level == "op" else None
            if mt is not None:
                mt.record_spans = r == runs
                mt.__enter__()
            try:
                t0 = time.perf_counter()
                if ot is not None:
                    with ot:
                        _train_step(model, inputs, opt)
                else:
                    _train_step(model, inputs, opt)
                dt = time.perf_counter() - t0
            finally:
                if mt is not None:
                    mt.__exit__(None, None, None)
            if r == 0:
                continue  # warm-up
            times.append(dt)
            if level == "module" and mt is not None:
                for k, v in mt.times.items():
                    modules_t.setdefault(k, []).append(v)
            if level == "op" and ot is not None:
                op_runs.append(ot.records)
                if mt is not None and r == runs:
                    spans = mt.spans
        step_s[level] = trimmed_mean(times)
    overhead = {lv: step_s[lv] - step_s[levels[i - 1]] for i, lv in enumerate(levels) if i}
    prof = Profile(name, list(levels), runs, step_s, overhead, device=dict(device or {}))
    prof.meta["root_module"] = type(model).__name__
    prof.modules = {k: {"forward_s": trimmed_mean(v)} for k, v in modules_t.items()}
    if op_runs:
        _summarize_ops(prof, op_runs, spans)
    return prof


def _summarize_ops(prof: Profile, op_runs: list[list[tuple]], spans: list) -> None:
    n = len(op_runs)
    ops: dict[str, dict[str, Any]] = {}
    kinds: dict[str, dict[str, float]] = {}
    mod_flops: dict[str, float] = {}
    mod_op_time: dict[str, float] = {}
    per_run_totals: dict[str, list[float]] = {}
    for records in op_runs:
        totals: dict[str, float] = {}
        for name, _kind, _module, dt, _flops, _b, _t0 in records:
            totals[name] = totals.get(name, 0.0) + dt
        for k, v in totals.items():
            per_run_totals.setdefault(k, []).append(v)
    for name, kind, module, dt, flops, nbytes, _t0 in op_runs[-1]:
        o = ops.setdefault(name, {"kind": kind, "calls": 0, "flops": 0.0, "bytes": 0.0})
        o["calls"] += 1
        o["flops"] += flops
        o["bytes"] += nbytes
        k = kinds.setdefault(kind, {"time_s": 0.0, "flops": 0.0, "bytes": 0.0, "calls": 0})
        k["flops"] += flops
        k["bytes"] += nbytes
        k["calls"] += 1
        k["time_s"] += dt / 1.0
        mod_flops[module] = mod_flops.get(module, 0.0) + flops
        mod_op_time[module] = mod_op_time.get(module, 0.0) + dt
    for name, o in ops.items():
        o["time_s"] = trimmed_mean(per_run_totals.get(name, [0.0]))
    # kind times: scale the last run's split to the trimmed-mean op totals
    for kind, k in kinds.items():
        k["time_s"] = sum(o["time_s"] for o in ops.values() if o["kind"] == kind)
        peak = prof.device.get("peak_flops", 0.0)
        bw = prof.device.get("memory_bandwidth", 0.0)
        k["achieved_flops"] = k["flops"] / k["time_s"] if k["time_s"] > 0 else 0.0
        k["intensity"] = k["flops"] / k["bytes"] if k["bytes"] > 0 else 0.0
        roof = min(peak, k["intensity"] * bw) if peak and bw else 0.0
        k["roofline_flops"] = roof
        k["fraction_of_roofline"] = k["achieved_flops"] / roof if roof > 0 else 0.0
    # FLOPs and op time inclusive of submodules; ops run outside any forward (backward,
    # optimizer) are listed under "(outside forward)".
    root = prof.meta.get("root_module", "")
    for module, f in mod_flops.items():
        if not module:
            chain = ["(outside forward)"]
        else:
            parts = module.split(".") if module != root else []
            chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)] + [root]
        for path in chain:
            entry = prof.modules.setdefault(path, {})
            entry["flops"] = entry.get("flops", 0.0) + f
            entry["op_time_s"] = entry.get("op_time_s", 0.0) + mod_op_time.get(module, 0.0)
    prof.ops = ops
    prof.kinds = kinds
    prof.meta["op_runs"] = n
    # Chrome trace of the last op-level run: ops on thread 0, module spans on thread 1.
    last = op_runs[-1]
    origin = min([r[6] for r in last] + [s[1] for s in spans]) if last else 0.0
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": prof.name}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "aten ops"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "modules"}},
    ]
    for name, kind, module, dt, flops, nbytes, t0 in last:
        events.append(
            {
                "name": name,
                "cat": kind,
                "ph": "X",
                "pid": 0,
                "tid": 0,
                "ts": (t0 - origin) * 1e6,
                "dur": dt * 1e6,
                "args": {"module": module, "flops": flops, "bytes": nbytes},
            }
        )
    for path, a, b in spans:
        events.append(
            {
                "name": path,
                "cat": "module",
                "ph": "X",
                "pid": 0,
                "tid": 1,
                "ts": (a - origin) * 1e6,
                "dur": (b - a) * 1e6,
            }
        )
    prof.trace_events = events


# ------------------------------------------------------------------ tables
def _fmt_s(s: float) -> str:
    return f"{s * 1e3:9.3f} ms"


def _fmt_num(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return "0"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.2f}"


def format_tables(prof: Profile, top: int = 15) -> str:
    """The profile as plain-text tables: levels, top ops, modules, op kinds vs roofline."""
    lines = [f"profile of {prof.name} ({prof.runs} runs per level, trimmed mean)", ""]
    lines.append(f"{'level':8} {'step':>12} {'overhead vs level above':>26}")
    for lv in prof.levels:
        ov = prof.overhead_s.get(lv)
        rel = f"{_fmt_s(ov)} ({100 * ov / prof.step_s[LEVELS[0]]:+.1f} %)" if ov is not None else ""
        lines.append(f"{lv:8} {_fmt_s(prof.step_s[lv]):>12} {rel:>26}")
    if prof.ops:
        total = sum(o["time_s"] for o in prof.ops.values()) or 1.0
        lines += ["", f"top {top} aten ops by time"]
        lines.append(f"{'op':32} {'kind':14} {'calls':>6} {'time':>12} {'%':>6} {'FLOPs':>9}")
        for name, o in sorted(prof.ops.items(), key=lambda kv: -kv[1]["time_s"])[:top]:
            lines.append(
                f"{name[:32]:32} {o['kind'][:14]:14} {o['calls']:6d} {_fmt_s(o['time_s'])} "
                f"{100 * o['time_s'] / total:6.1f} {_fmt_num(o['flops']):>9}"
            )
    if prof.modules:
        lines += ["", f"modules (top {top} by forward time; FLOPs include submodules)"]
        lines.append(f"{'module':40} {'forward':>12} {'FLOPs':>9}")
        rows = sorted(prof.modules.items(), key=lambda kv: -kv[1].get("forward_s", 0.0))
        for path, m in rows[:top]:
            lines.append(
                f"{path[:40]:40} {_fmt_s(m.get('forward_s', 0.0))} {_fmt_num(m.get('flops', 0)):>9}"
            )
    if prof.kinds:
        peak = prof.device.get("peak_flops", 0.0)
        bw = prof.device.get("memory_bandwidth", 0.0)
        lines += [
            "",
            f"op kinds vs roofline (peak {_fmt_num(peak)}FLOP/s, {_fmt_num(bw)}B/s)",
            f"{'kind':16} {'time':>12} {'FLOP/s':>9} {'FLOP/B':>8} {'roofline':>9} {'of roof':>8}",
        ]
        for kind, k in sorted(prof.kinds.items(), key=lambda kv: -kv[1]["time_s"]):
            lines.append(
                f"{kind[:16]:16} {_fmt_s(k['time_s'])} {_fmt_num(k['achieved_flops']):>9} "
                f"{k['intensity']:8.2f} {_fmt_num(k['roofline_flops']):>9} "
                f"{100 * k['fraction_of_roofline']:7.1f}%"
            )
    return "\n".join(lines)
