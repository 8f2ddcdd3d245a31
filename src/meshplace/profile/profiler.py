"""Leveled, across-stack profiling of a training step (model, module and op levels).

Following across-stack profiling (Li et al., "XSP: Across-Stack Profiling and Analysis of
Machine Learning Models on GPUs", IPDPS 2020), each level is measured in its own runs with
only that level and the ones above it enabled, so a lower level's instrumentation never
inflates a higher level's numbers:

* ``model`` — the whole eager step (forward, ``backward()``, Adam update), wall clock;
* ``module`` — plus global forward pre/post hooks timing every module's forward (inclusive);
* ``op`` — plus a ``TorchDispatchMode`` timing every aten op (forward, backward, update),
  attributed to the innermost running module, with FLOPs from :mod:`meshplace.graph.flops`;
* ``kernel`` (CUDA devices only) — plus ``torch.profiler`` with its CUDA activity: the
  device time of every GPU kernel, aggregated by kernel name.

Any torch device runs the step: ``cpu`` with ``threads`` intra-op threads, or ``cuda:i``.
Times come from one :class:`_Clock`: ``perf_counter`` on the CPU; on CUDA, CUDA events
recorded on the current stream around the step, each module and each op, read after a
``torch.cuda.synchronize`` at the end of the step — so they measure the GPU's execution,
not the asynchronous launches (a wall clock would see only those).

The overhead a level adds is its step time minus the step time of the level above. Every
statistic is a trimmed mean over the runs (the fastest and slowest fifth dropped). Cost:
``(runs + 1) x levels`` training steps.

The profile file (format ``meshplace.profile`` v1) is described in ``docs/runtime.md``; the
Chrome trace (``chrome://tracing`` / Perfetto) shows the op-level run with module spans.
:func:`compare_profiles` puts profiles of the same model from several devices or machines
side by side (levels, op kinds, modules, top ops), and :func:`save_profiles` writes them as
one combined file (format ``meshplace.profiles`` v1).

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
from meshplace.util import read_json_file, short_repr, write_text_atomic

LEVELS = ("model", "module", "op", "kernel")
FORMAT = "meshplace.profile"
COMBINED_FORMAT = "meshplace.profiles"
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


def local_devices() -> list[str]:
    """Every torch device of this machine: ``cpu``, then ``cuda:0`` … when CUDA is up."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(n)]


def parse_devices(text: str) -> list[str]:
    """``"cpu,cuda:0"`` → ``["cpu", "cuda:0"]``, each checked against this machine.

    >>> parse_devices("cpu")
    ['cpu']
    """
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ProfileError("name at least one device, e.g. --devices cpu,cuda:0")
    here = local_devices()
    out: list[str] = []
    for name in names:
        try:
            dev = torch.device(name)
        except (RuntimeError, ValueError):
            msg = f"unknown device {name!r}; this machine has {', '.join(here)}"
            raise ProfileError(msg) from None
        canon = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
        if canon not in here:
            raise ProfileError(f"device {name!r} is not on this machine; it has {', '.join(here)}")
        if canon in out:
            raise ProfileError(f"device {canon!r} is named twice")
        out.append(canon)
    return out


class _Clock:
    """Timestamps on one device: ``perf_counter`` on the CPU, recorded CUDA events on a
    GPU (read after :meth:`sync`, so they time execution rather than launches)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from stamp ``a`` to stamp ``b`` (after :meth:`sync` on CUDA)."""
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a


# ------------------------------------------------------------------ instruments
class _ModuleTimer:
    """Global forward hooks: inclusive forward time per module path, and the module stack."""

    def __init__(self, model: torch.nn.Module, clock: _Clock | None = None) -> None:
        self.paths = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
        self.clock = clock or _Clock("cpu")
        self.stack: list[tuple[str, Any]] = []
        self.stamps: list[tuple[str, Any, Any]] = []  # resolved after the step by times()
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, Any, Any]] = []
        self.handles: list[Any] = []
        self.record_spans = False

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            self.stack.append((path, self.clock.now()))

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.paths and self.stack:
            path, t0 = self.stack.pop()
            self.stamps.append((path, t0, self.clock.now()))

    def resolve(self) -> None:
        """Turn the step's stamps into per-module seconds (after the clock's sync)."""
        for path, t0, t1 in self.stamps:
            self.times[path] = self.times.get(path, 0.0) + self.clock.seconds(t0, t1)
            if self.record_spans:
                self.spans.append((path, t0, t1))
        self.stamps = []

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

    def __init__(self, modules: _ModuleTimer | None, clock: _Clock | None = None) -> None:
        super().__init__()
        self.modules = modules
        self.clock = clock or _Clock("cpu")
        self.records: list[list[Any]] = []

    def resolve(self) -> None:
        """Replace each record's (start, end) stamps by (seconds, start stamp)."""
        for rec in self.records:
            t0, t1 = rec[3], rec[6]
            rec[3], rec[6] = self.clock.seconds(t0, t1), t0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = self.clock.now()
        out = func(*args, **kwargs)
        t1 = self.clock.now()
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
            [name, op_kind(name), module, t0, float(flops), _nbytes(ins) + _nbytes(outs), t1]
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
    device: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)
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
            "kernels": self.kernels,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """A profile read back from :meth:`to_dict`'s JSON (no trace events). Raises
        ``KeyError`` for a missing field and ``ValueError`` (one sentence) for one of the
        wrong type, e.g. a time that is not a number."""
        if not isinstance(data.get("name"), str):
            raise ValueError(f"'name' must be a string, got {short_repr(data.get('name'))}")
        levels = data["levels"]
        if not (isinstance(levels, list) and all(isinstance(x, str) for x in levels)):
            raise ValueError(f"'levels' must be a list of level names, got {short_repr(levels)}")
        runs = data["runs"]
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"'runs' must be a positive integer, got {short_repr(runs)}")
        return cls(
            name=data["name"],
            levels=list(levels),
            runs=runs,
            step_s=_seconds_table(data["step_s"], "step_s"),
            overhead_s=_seconds_table(data.get("overhead_s", {}), "overhead_s"),
            modules=_rows(data.get("modules", {}), "modules", ()),
            ops=_rows(data.get("ops", {}), "ops", ("time_s",)),
            kinds=_rows(data.get("kinds", {}), "kinds", ("time_s",)),
            device=_mapping(data.get("device", {}), "device"),
            kernels=_rows(data.get("kernels", {}), "kernels", ("time_s",)),
            meta=_mapping(data.get("meta", {}), "meta"),
        )

    @property
    def label(self) -> str:
        """A short name of where this profile ran, e.g. ``cpu (2 threads)`` or
        ``cuda:0 (NVIDIA H100)``."""
        dev = str(self.device.get("name", "cpu"))
        if dev == "cpu":
            t = self.device.get("threads")
            return f"cpu ({t} thread{'s' if t != 1 else ''})" if t else "cpu"
        model = self.device.get("model")
        return f"{dev} ({model})" if model else dev

    def chrome_trace(self) -> dict[str, Any]:
        return {"traceEvents": self.trace_events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path, trace_path: str | Path | None = None) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))
        if trace_path is not None:
            write_text_atomic(trace_path, json.dumps(self.chrome_trace()))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what!r} must be an object, got {short_repr(value)}")
    return dict(value)


def _seconds_table(value: Any, what: str) -> dict[str, float]:
    """``{name: seconds}`` with every value a number."""
    table = _mapping(value, what)
    for key, x in table.items():
        if not _is_number(x):
            raise ValueError(f"{what}[{key!r}] must be a number of seconds, got {short_repr(x)}")
    return table


def _rows(value: Any, what: str, required: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{name: {field: value}}`` whose numeric fields (and the ``required`` ones, which
    must be there) are numbers."""
    table = _mapping(value, what)
    for key, row in table.items():
        if not isinstance(row, dict):
            raise ValueError(f"{what}[{key!r}] must be an object, got {short_repr(row)}")
        for name in required:
            if name not in row:
                raise ValueError(f"{what}[{key!r}] lacks {name!r}")
        for name, x in row.items():
            if name in _NUMERIC_FIELDS and not _is_number(x):
                raise ValueError(f"{what}[{key!r}][{name!r}] must be a number, got {short_repr(x)}")
    return table


# the per-row fields the tables and comparisons compute with
_NUMERIC_FIELDS = frozenset(
    {
        "time_s",
        "forward_s",
        "op_time_s",
        "flops",
        "bytes",
        "calls",
        "achieved_flops",
        "intensity",
        "roofline_flops",
        "fraction_of_roofline",
    }
)


def _train_step(model: torch.nn.Module, inputs: list[Any], opt: torch.optim.Optimizer) -> None:
    out = model(*inputs)
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    loss = flat[0] if flat[0].dim() == 0 else flat[0].float().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def profile_model(
    model: torch.nn.Module,
    inputs: list[Any],
    *,
    name: str = "model",
    levels: Sequence[str] = LEVELS[:3],
    runs: int = 3,
    device: dict[str, Any] | None = None,
    on: str = "cpu",
    threads: int | None = None,
) -> Profile:
    """Profile ``runs`` eager training steps of ``model(*inputs)`` (which returns a loss)
    at each of ``levels`` (after one warm-up step per level) on torch device ``on``
    (``cpu`` with ``threads`` intra-op threads, default unchanged, or ``cuda:i``; the
    model and inputs are moved there). ``device`` is the measured peak/bandwidth record
    stored with the profile. The ``kernel`` level needs a CUDA device."""
    levels = parse_levels(",".join(levels))
    if runs < 1:
        raise ProfileError(f"runs must be a positive integer, got {runs}")
    dev = torch.device(on)
    if "kernel" in levels and dev.type != "cuda":
        raise ProfileError(
            f"the kernel level needs a CUDA device (torch.profiler's CUDA activity); "
            f"{on} stops at the op level"
        )
    old_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ProfileError(f"threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
    try:
        model = model.to(dev)
        inputs = _to_device(list(inputs), dev)
        prof = _profile(model, inputs, name, levels, runs, _Clock(on))
    finally:
        torch.set_num_threads(old_threads)
    prof.device = {**dict(device or {}), **prof.device}
    return prof


def _profile(
    model: torch.nn.Module,
    inputs: list[Any],
    name: str,
    levels: list[str],
    runs: int,
    clock: _Clock,
) -> Profile:
    model.train(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    step_s: dict[str, float] = {}
    modules_t: dict[str, list[float]] = {}
    op_runs: list[list[list[Any]]] = []
    spans: list[tuple[str, Any, Any]] = []
    kernel_runs: list[dict[str, tuple[int, float]]] = []
    for level in levels:
        times = []
        for r in range(runs + 1):
            mt = _ModuleTimer(model, clock) if level != "model" else None
            ot = _OpTimer(mt, clock) if level in ("op", "kernel") else None
            if mt is not None:
                mt.record_spans = r == runs
                mt.__enter__()
            kp = _kernel_profiler() if level == "kernel" else None
            try:
                if kp is not None:
                    kp.__enter__()
                clock.sync()
                t0 = clock.now()
                if ot is not None:
                    with ot:
                        _train_step(model, inputs, opt)
                else:
                    _train_step(model, inputs, opt)
                t1 = clock.now()
                clock.sync()
                dt = clock.seconds(t0, t1)
            finally:
                if kp is not None:
                    kp.__exit__(None, None, None)
                if mt is not None:
                    mt.__exit__(None, None, None)
            if mt is not None:
                mt.resolve()
            if ot is not None:
                ot.resolve()
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
            if kp is not None:
                kernel_runs.append(_kernel_times(kp))
        step_s[level] = trimmed_mean(times)
    overhead = {lv: step_s[lv] - step_s[levels[i - 1]] for i, lv in enumerate(levels) if i}
    prof = Profile(name, list(levels), runs, step_s, overhead)
    prof.device = _device_identity(clock.device)
    prof.meta["root_module"] = type(model).__name__
    prof.modules = {k: {"forward_s": trimmed_mean(v)} for k, v in modules_t.items()}
    if op_runs:
        _summarize_ops(prof, op_runs, spans, clock)
    if kernel_runs:
        names = {k for run in kernel_runs for k in run}
        prof.kernels = {
            k: {
                "calls": kernel_runs[-1].get(k, (0, 0.0))[0],
                "time_s": trimmed_mean([run.get(k, (0, 0.0))[1] for run in kernel_runs]),
            }
            for k in sorted(names)
        }
    return prof


def _device_identity(dev: torch.device) -> dict[str, Any]:
    """Which device a profile ran on: name, model (GPU or CPU model name), threads."""
    import platform

    out: dict[str, Any] = {"name": "cpu" if dev.type == "cpu" else str(dev)}
    out["threads"] = torch.get_num_threads()
    out["host"] = platform.node()
    if dev.type == "cuda":
        out["model"] = torch.cuda.get_device_name(dev)
    else:
        out["model"] = _cpu_model()
    return out


def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernel_profiler() -> Any:
    """``torch.profiler`` recording CPU and CUDA activity (the kernel level)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _kernel_times(prof: Any) -> dict[str, tuple[int, float]]:
    """GPU kernel name → (calls, seconds of device time) from a finished torch.profiler."""
    out: dict[str, tuple[int, float]] = {}
    from torch.autograd import DeviceType

    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:  # a kernel (or memcpy) on the GPU's timeline
            us = float(ev.time_range.elapsed_us())
            calls, total = out.get(ev.name, (0, 0.0))
            out[ev.name] = (calls + 1, total + us / 1e6)
    return out


def _summarize_ops(
    prof: Profile, op_runs: list[list[list[Any]]], spans: list, clock: _Clock
) -> None:
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
    stamps = [r[6] for r in last] + [s[1] for s in spans]
    origin = min(stamps, key=lambda t: clock.seconds(stamps[0], t)) if stamps else 0.0
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
                "ts": clock.seconds(origin, t0) * 1e6,
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
                "ts": clock.seconds(origin, a) * 1e6,
                "dur": clock.seconds(a, b) * 1e6,
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
    if prof.kernels:
        lines += ["", f"top {top} GPU kernels by device time"]
        rows = sorted(prof.kernels.items(), key=lambda kv: -kv[1]["time_s"])[:top]
        for kname, k in rows:
            lines.append(f"{kname[:60]:60} {int(k['calls']):6d} {_fmt_s(k['time_s'])}")
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


# ------------------------------------------------------------------ comparison
def save_profiles(profiles: Sequence[Profile], path: str | Path) -> None:
    """Write several profiles as one combined file (format ``meshplace.profiles`` v1:
    ``{"format", "version", "profiles": [profile, ...]}``, each as in the single file)."""
    data = {
        "format": COMBINED_FORMAT,
        "version": VERSION,
        "profiles": [p.to_dict() for p in profiles],
    }
    write_text_atomic(path, json.dumps(data, indent=1))


def load_profiles(path: str | Path) -> list[Profile]:
    """The profiles in a single (``meshplace.profile``) or combined (``meshplace.profiles``)
    file. Raises :class:`ProfileError` (one sentence naming the file) for a missing,
    unreadable, binary or malformed file (:func:`meshplace.util.read_json_file`), another
    format, or a field missing or of the wrong type."""
    p = Path(path)
    try:
        data = read_json_file(p, "profile")
    except ProfileError:
        raise
    except InputError as exc:
        raise ProfileError(str(exc)) from None
    fmt = data.get("format") if isinstance(data, dict) else None
    try:
        if fmt == FORMAT:
            return [Profile.from_dict(data)]
        if fmt == COMBINED_FORMAT:
            entries = data["profiles"]
            if not isinstance(entries, list) or not all(isinstance(d, dict) for d in entries):
                raise ValueError("'profiles' must be a list of profile objects")
            if not entries:
                raise ValueError("'profiles' is empty")
            return [Profile.from_dict(d) for d in entries]
    except KeyError as exc:
        raise ProfileError(f"{p}: the profile lacks the field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{p}: not a usable profile ({exc})") from None
    raise ProfileError(
        f"{p}: not a profile file (format {short_repr(fmt)}; expected {FORMAT!r} or "
        f"{COMBINED_FORMAT!r})"
    )


def _ratio(a: float, b: float) -> str:
    return f"{b / a:7.2f}x" if a > 0 and b > 0 else f"{'-':>8}"


def _side_by_side(
    title: str, keys: list[str], values: list[dict[str, float]], width: int = 32
) -> list[str]:
    """Rows ``key | value per profile | ratio of each later profile to the first``."""
    n = len(values)
    head = f"{title[:width]:{width}} " + " ".join(f"{chr(65 + i):>12}" for i in range(n))
    head += "".join(f" {chr(65 + i) + '/A':>8}" for i in range(1, n))
    lines = [head]
    for k in keys:
        row = [v.get(k, 0.0) for v in values]
        line = f"{k[:width]:{width}} " + " ".join(_fmt_s(x) if x else f"{'-':>12}" for x in row)
        line += "".join(f" {_ratio(row[0], x)}" for x in row[1:])
        lines.append(line)
    return lines


def compare_profiles(
    profiles: Sequence[Profile], labels: Sequence[str] | None = None, top: int = 15
) -> str:
    """Profiles of one model from several devices or machines side by side: step time per
    level, time per op kind (with achieved FLOP/s), per module (forward, inclusive), the
    top ops and, where present, GPU kernels; each later profile also as a ratio to the
    first (``B/A`` < 1: B is faster). Rows are ordered by the first profile's times.
    O(rows · profiles).

    >>> a = Profile("m", ["model"], 1, {"model": 2e-3}, {}, device={"name": "cpu"})
    >>> b = Profile("m", ["model"], 1, {"model": 1e-3}, {}, device={"name": "cuda:0"})
    >>> print(compare_profiles([a, b]).splitlines()[5])
    model                                2.000 ms     1.000 ms    0.50x
    """
    if len(profiles) < 1:
        raise ProfileError("compare at least one profile")
    labels = list(labels or [p.label for p in profiles])
    names = sorted({p.name for p in profiles})
    lines = [f"comparison of {', '.join(names)} on {len(profiles)} devices"]
    for i, (p, lab) in enumerate(zip(profiles, labels)):
        host = p.device.get("host")
        lines.append(f"  {chr(65 + i)}: {lab}" + (f" on {host}" if host else ""))
    lines.append("")
    levels = [lv for lv in LEVELS if any(lv in p.step_s for p in profiles)]
    lines += _side_by_side("step time per level", levels, [p.step_s for p in profiles])

    def first_order(tables: list[dict[str, float]]) -> list[str]:
        keys = {k for t in tables for k in t}
        return sorted(keys, key=lambda k: (-tables[0].get(k, 0.0), k))

    kinds = [{k: v["time_s"] for k, v in p.kinds.items()} for p in profiles]
    if any(kinds):
        lines += [""]
        lines += _side_by_side("op kind (time)", first_order(kinds), kinds, 20)
        flops = [{k: v.get("achieved_flops", 0.0) for k, v in p.kinds.items()} for p in profiles]
        lines += ["", "achieved FLOP/s per op kind"]
        for k in first_order(kinds):
            row = " ".join(f"{_fmt_num(f.get(k, 0.0)):>12}" for f in flops)
            lines.append(f"{k[:20]:20} {row}")
    mods = [{k: v.get("forward_s", 0.0) for k, v in p.modules.items()} for p in profiles]
    if any(any(m.values()) for m in mods):
        lines += [""]
        keys = [k for k in first_order(mods) if any(m.get(k) for m in mods)][:top]
        lines += _side_by_side(f"module (forward, top {top})", keys, mods, 40)
    ops = [{k: v["time_s"] for k, v in p.ops.items()} for p in profiles]
    if any(ops):
        lines += [""]
        lines += _side_by_side(f"aten op (top {top})", first_order(ops)[:top], ops)
    kernels = [{k: v["time_s"] for k, v in p.kernels.items()} for p in profiles]
    if any(kernels):
        lines += [""]
        lines += _side_by_side(f"GPU kernel (top {top})", first_order(kernels)[:top], kernels, 48)
    return "\n".join(lines)
