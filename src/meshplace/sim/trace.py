"""Chrome trace export of a simulation: one track per device and per link.

The Trace Event Format (Google, "Trace Event Format" document) is what ``chrome://tracing``
and Perfetto (ui.perfetto.dev) open: complete events (``"ph": "X"``) with microsecond
timestamps, grouped into processes and threads named by metadata events. Devices are
threads of process 1, links threads of process 2; an op is named by its module path
(falling back to its op name), a transfer by the op whose output it carries.

Example
-------
>>> trace = {"traceEvents": []}
>>> sorted(trace)
['traceEvents']
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshplace.sim.simulator import SimResult, Simulator
from meshplace.util import write_text_atomic

DEVICES_PID = 1
LINKS_PID = 2


def chrome_trace(sim: Simulator, result: SimResult) -> dict[str, Any]:
    """The trace as a JSON-ready dict."""
    ops = sim.graph.ops
    events: list[dict[str, Any]] = [
        _meta("process_name", DEVICES_PID, 0, {"name": "devices"}),
        _meta("process_name", LINKS_PID, 0, {"name": "links"}),
    ]
    for d, name in enumerate(result.device_names):
        events.append(
            _meta("thread_name", DEVICES_PID, d, {"name": f"{name} ({sim.device_kinds[d]})"})
        )
        events.append(_meta("thread_sort_index", DEVICES_PID, d, {"sort_index": d}))
    for li, name in enumerate(result.link_names):
        events.append(_meta("thread_name", LINKS_PID, li, {"name": name}))
        events.append(_meta("thread_sort_index", LINKS_PID, li, {"sort_index": li}))
    start_us = result.op_start * 1e6
    dur_us = (result.op_end - result.op_start) * 1e6
    for i, o in enumerate(ops):
        if dur_us[i] <= 0:
            continue
        events.append(
            {
                "name": o.module or o.name,
                "cat": o.phase,
                "ph": "X",
                "pid": DEVICES_PID,
                "tid": int(result.placement[i]),
                "ts": float(start_us[i]),
                "dur": float(dur_us[i]),
                "args": {"op": o.name, "kind": o.kind, "flops": o.flops},
            }
        )
    cluster = sim.cluster
    for x in range(len(result.transfer_bytes)):
        src_op = int(result.transfer_src_op[x])
        src_dev = int(result.placement[src_op])
        dst_dev = int(result.transfer_dst_device[x])
        ts = float(result.transfer_start[x] * 1e6)
        dur = float((result.transfer_end[x] - result.transfer_start[x]) * 1e6)
        label = ops[src_op].module or ops[src_op].name
        for link in cluster.route(src_dev, dst_dev):
            events.append(
                {
                    "name": f"{label} → {result.device_names[dst_dev]}",
                    "cat": "transfer",
                    "ph": "X",
                    "pid": LINKS_PID,
                    "tid": int(link),
                    "ts": ts,
                    "dur": dur,
                    "args": {"op": ops[src_op].name, "bytes": float(result.transfer_bytes[x])},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "graph": sim.graph.name,
            "cluster": getattr(cluster, "name", ""),
            "step_time_s": result.step_time_s,
            "lower_bound_s": result.lower_bound_s,
            "peak_memory_bytes": np.asarray(result.peak_memory_bytes).tolist(),
        },
    }


def write_chrome_trace(sim: Simulator, result: SimResult, path: str | Path) -> None:
    """Write the trace atomically to ``path``."""
    write_text_atomic(path, json.dumps(chrome_trace(sim, result)))


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
