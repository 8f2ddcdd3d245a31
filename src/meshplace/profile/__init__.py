"""Profiling and calibration: the leveled profiler, op timing, cost-model fitting, the
``local`` cluster (``docs/runtime.md``)."""

from meshplace.profile.calibrate import (
    Calibration,
    OpTimes,
    calibrate,
    fit_cost_model,
    local_cluster,
    local_device_spec,
    measure_device,
    predict_step,
    signature,
    time_step_ops,
)
from meshplace.profile.profiler import Profile, format_tables, profile_model, trimmed_mean

__all__ = [
    "Calibration",
    "OpTimes",
    "Profile",
    "calibrate",
    "fit_cost_model",
    "format_tables",
    "local_cluster",
    "local_device_spec",
    "measure_device",
    "predict_step",
    "profile_model",
    "signature",
    "time_step_ops",
    "trimmed_mean",
]
