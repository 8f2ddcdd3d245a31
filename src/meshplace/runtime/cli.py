"""``meshplace run``: execute a plan for real on local workers and compare with the simulator.

The command traces the model, checks the plan against the traced graph, calibrates the
local machine (device, per-op times on a worker, gloo link and message costs, then — for
CPU workers — what messages cost inside a step, from probe runs), runs the plan for ``--steps``
steps on one worker process per device, and prints the measured median step time beside
the simulator's prediction on the calibrated ``local`` cluster.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from meshplace.errors import InputError


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshplace run``."""
    parser.add_argument("--plan", help="plan JSON (meshplace.plan) to execute")
    parser.add_argument(
        "--graph",
        required=True,
        help="model: a small runtime model (mlp, nmt-small, dmcca-small, rnnlm-small, "
        "transformer-small, resnet-small), a reference workload, or FILE.py:FUNCTION",
    )
    parser.add_argument("--placer", help="instead of --plan: place with this placer first")
    parser.add_argument("--workers", type=int, default=2, help="local devices (default 2)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", default=None)
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (default 2)")
    parser.add_argument(
        "--worker-devices",
        default="cpu",
        help="where the workers compute: cpu (default: one CPU thread each), cuda (worker i "
        "on cuda:i) or one torch device per worker (as many as --workers), e.g. "
        "cuda:0,cuda:1",
    )
    parser.add_argument(
        "--no-in-situ",
        action="store_true",
        help="skip the probe runs that measure message costs inside a step (CPU workers; "
        "they take a few seconds) and predict with the micro-benchmarks' costs",
    )
    parser.add_argument("--cluster-out", help="write the calibrated local cluster (YAML)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _devices_for(args: argparse.Namespace, step: Any, cal: Any) -> tuple[list[str], str]:
    from meshplace.plan.placement import load_plan

    local = cal.cluster.device_names
    if args.plan:
        plan = load_plan(args.plan)
        names = plan.device_names(step.graph, str(args.plan))
        distinct = sorted(set(names), key=names.index)
        if all(d in local for d in distinct):
            return names, f"plan {args.plan}"
        if len(distinct) > len(local):
            raise InputError(
                f"{args.plan}: uses {len(distinct)} devices but the local testbed has "
                f"{len(local)} workers; pass --workers {len(distinct)}"
            )
        mapping = dict(zip(distinct, local))
        return [mapping[d] for d in names], f"plan {args.plan} (devices mapped to workers)"
    from meshplace.placers.base import PlacementProblem, run_placer

    # search with the calibrated model of the workers, not the default simulator
    problem = PlacementProblem(step.graph, cal.cluster, simulator=cal.simulator())
    res = run_placer(args.placer, problem, 10.0, 0)
    return [local[i] for i in res.op_devices.tolist()], f"placer {args.placer}"


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``meshplace run``; returns the exit code (1 when a worker fails)."""
    from meshplace.hardware import save_cluster
    from meshplace.profile.calibrate import calibrate, calibrate_in_situ, local_cluster
    from meshplace.runtime.executor import (
        WorkerFailure,
        natural_key,
        resolve_worker_devices,
        run_placement,
    )
    from meshplace.runtime.program import ModelSpec, trace_step

    if not args.plan and not args.placer:
        raise InputError("meshplace run needs --plan PLAN.json or --placer NAME")
    if args.steps is None or args.steps < 1:
        raise InputError(f"--steps must be a positive integer, got {args.steps}")
    if args.workers < 1:
        raise InputError(f"--workers must be a positive integer, got {args.workers}")
    # one torch device per local worker (cluster order), checked before calibrating
    worker_list = resolve_worker_devices(args.worker_devices, args.workers)
    gpus = [d for d in worker_list if d.startswith("cuda")]
    spec = ModelSpec(args.graph, batch=args.batch, size=args.size)
    step = trace_step(spec)
    # the simulator's local devices are all calibrated like the first GPU worker, if any
    cal = calibrate(step, worker_device=gpus[0] if gpus else "cpu", spec=spec)
    if not gpus and not args.no_in_situ:
        calibrate_in_situ(cal)  # message costs inside a step, from probe runs (~1-6 s)
    if args.workers != 2:
        cal.cluster = local_cluster(
            cal.cluster.devices[0].spec,
            cal.link["bandwidth"],
            cal.link["latency"],
            args.workers,
            cal.cluster.meta,
        )
    devices, source = _devices_for(args, step, cal)
    predicted = cal.predict(step.graph, devices)
    # the workers the plan uses, in rank order, each on its local device's torch device
    index = {d: i for i, d in enumerate(cal.cluster.device_names)}
    used = sorted(set(devices), key=natural_key)
    where = [worker_list[index[d]] for d in used]
    try:
        res = run_placement(
            spec, devices, args.steps, warmup=args.warmup, step=step, worker_devices=where
        )
    except WorkerFailure as exc:
        print(f"error: {exc}")
        return 1
    if args.cluster_out:
        save_cluster(cal.cluster, args.cluster_out)
    out = {
        "graph": step.graph.name,
        "ops": step.graph.num_ops,
        "placement": source,
        "measured_step_s": res.step_time_s,
        "predicted_step_s": predicted,
        "error": (predicted - res.step_time_s) / res.step_time_s,
        "run": res.to_dict(),
        "calibration": {
            "device": cal.device,
            "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
            "launch_overhead_s": cal.fit["launch_overhead_s"],
            "message_cpu": {
                k: cal.messages[k]
                for k in ("send_s", "send_s_per_byte", "recv_s", "recv_s_per_byte")
            },
            "in_situ": {
                k: v for k, v in (cal.messages.get("in_situ") or {}).items() if k != "probes"
            },
        },
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{step.graph.name}: {step.graph.num_ops} ops, {source}, workers "
        + ", ".join(f"{d} on {w}" for d, w in zip(res.devices, where))
    )
    if gpus and len(gpus) < len(worker_list):
        print("note: the prediction simulates every worker as the first GPU (mixed CPU/GPU)")
    print(
        f"calibrated local cluster: {cal.device['peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"{cal.device['memory_bandwidth'] / 1e9:.1f} GB/s per worker; link "
        f"{cal.link['bandwidth'] / 1e9:.2f} GB/s, {cal.link['latency'] * 1e6:.0f} us"
    )
    print(
        f"measured step  {res.step_time_s * 1e3:9.2f} ms  (median of {args.steps - res.warmup} "
        f"after {res.warmup} warm-up; {res.messages} messages, "
        f"{res.bytes_sent / 1e6:.2f} MB per step)"
    )
    print(
        f"predicted step {predicted * 1e3:9.2f} ms  (simulator, calibrated local cluster; "
        f"error {100 * out['error']:+.1f} %)"
    )
    return 0
