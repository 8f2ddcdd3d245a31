"""Profiling and calibration: the leveled profiler, op timing, cost-model fitting, the
``local`` cluster (``docs/runtime.md``).

The names below load on first use (PEP 562), so importing this package — as
``meshplace profile --help`` and the command's early argument checks do — does not load
torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_CALIBRATE = "meshplace.profile.calibrate"
_PROFILER = "meshplace.profile.profiler"
_EXPORTS = {
    "Calibration": _CALIBRATE,
    "OpTimes": _CALIBRATE,
    "calibrate": _CALIBRATE,
    "fit_cost_model": _CALIBRATE,
    "local_cluster": _CALIBRATE,
    "local_device_spec": _CALIBRATE,
    "measure_device": _CALIBRATE,
    "predict_step": _CALIBRATE,
    "signature": _CALIBRATE,
    "time_step_ops": _CALIBRATE,
    "Profile": _PROFILER,
    "format_tables": _PROFILER,
    "profile_model": _PROFILER,
    "trimmed_mean": _PROFILER,
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


class _Package(types.ModuleType):
    """Keeps ``meshplace.profile.calibrate`` the *function*, as it always was: importing
    the submodule of the same name sets the package's attribute to the module, which is
    turned back into the function here."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
