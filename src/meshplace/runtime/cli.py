"""``meshplace run``: execute a plan for real on local workers and compare with the simulator.

The command checks everything it can before any work (numbers, the placer's name, the plan
file, the model, output paths), traces the model, calibrates the local machine (device,
per-op times on a worker, gloo link and message costs, then — for CPU workers — what
messages cost inside a step, from probe runs), runs the plan for ``--steps`` steps on one
worker process per device, and prints the measured median step time beside the
simulator's prediction on the calibrated ``local`` cluster (``--no-predict``: the
measurement alone, no calibration).

A worker that fails, hangs or is stopped is one sentence on stderr naming the worker and
the op, exit status 1 (with ``--json``, the JSON object carries it: ``error``, ``worker``,
``device``, ``op``, ``cause``). The workers die with the command if it is killed, and its
temporary folders are removed however it ends.

This module imports nothing heavy at import time: ``meshplace run --help`` and early
errors do not load torch.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplace.argtypes import non_negative_int, positive_int, positive_seconds
from meshplace.errors import InputError

#: Seconds a ``FILE.py:FUNCTION`` build may take before ``run`` and ``profile`` give up.
DEFAULT_BUILD_TIMEOUT_S = 120.0
#: Seconds without progress in any worker before ``run`` reports a hang.
DEFAULT_HANG_TIMEOUT_S = 20.0


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshplace run``."""
    parser.add_argument(
        "--plan",
        help="plan JSON to execute: a placement (meshplace.plan) on local workers, or a "
        "sharding or hybrid plan (meshplace.parallel_plan, from meshplace shard --out) under "
        "torchrun, one process per mesh device",
    )
    parser.add_argument(
        "--graph",
        help="model: a small runtime model (mlp, nmt-small, dmcca-small, rnnlm-small, "
        "transformer-small, resnet-small), a reference workload, or FILE.py:FUNCTION "
        "(a sharding plan's own model by default)",
    )
    parser.add_argument("--placer", help="instead of --plan: place with this placer first")
    parser.add_argument(
        "--launcher",
        choices=("local", "torchrun"),
        default="local",
        help="for a placement plan: local worker processes with a calibrated prediction "
        "(default), or torchrun, one process per device the plan uses, each building only "
        "its own ops' parameters and optimizer state (sharding plans always use torchrun)",
    )
    parser.add_argument(
        "--memory-budget",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="--launcher torchrun or a sharding plan: refuse the plan if a rank's share "
        "(parameters, optimizer state, inputs) exceeds this many bytes",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="--launcher torchrun or a sharding plan: after the last step write the "
        "parameters to DIR (each placement rank its own and their optimizer state, each "
        "pipeline stage its own: DIR/rankR.pt; a sharding plan every parameter whole: "
        "DIR/rank0.pt)",
    )
    parser.add_argument(
        "--micro-batches",
        type=positive_int,
        default=None,
        help="--launcher torchrun, a pipelined plan (objective throughput): micro-batches "
        "per step (default: the plan's)",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        help="--launcher torchrun, a pipelined plan: 1F1B (default) or GPipe",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="local devices (default 2)")
    parser.add_argument("--batch", type=positive_int, default=None)
    parser.add_argument("--size", default=None)
    parser.add_argument(
        "--steps", type=positive_int, default=10, help="training steps (default 10)"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        help="steps not timed, fewer than --steps (default 2, or --steps - 1 if smaller)",
    )
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
    parser.add_argument(
        "--no-predict",
        action="store_true",
        help="only run the plan and measure it: no calibration (which takes tens of "
        "seconds) and no prediction; needs --plan",
    )
    parser.add_argument(
        "--hang-timeout",
        type=positive_seconds,
        default=DEFAULT_HANG_TIMEOUT_S,
        metavar="SECONDS",
        help="report a hang when no worker makes progress for this long (default "
        f"{DEFAULT_HANG_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--build-timeout",
        type=positive_seconds,
        default=DEFAULT_BUILD_TIMEOUT_S,
        metavar="SECONDS",
        help="give up on a FILE.py:FUNCTION model whose import or build function does not "
        f"return within this long (default {DEFAULT_BUILD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="a sharding plan: predict the step as its engine runs it on this cluster's devices; "
        "a placement with --launcher torchrun: as the simulator runs it there (preset or "
        "YAML; default: the plan's cluster)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="a sharding plan: predict the step as its engine runs it with this calibration's "
        "cost model; a placement with --launcher torchrun: as the simulator runs it with "
        "that cost model (meshplace profile --out, run --calibration-out; default: the "
        "catalogue's figures)",
    )
    parser.add_argument(
        "--engine",
        choices=("auto", "dtensor"),
        default=None,
        help="a sharding or hybrid plan: auto (default) runs pure data parallelism on DDP "
        "(ZeRO 0) or FSDP2 (ZeRO 3), a hybrid plan's data-parallel stages without tensor "
        "parallelism or ZeRO on DDP, and everything else on DTensor; dtensor runs every plan "
        "on DTensor",
    )
    parser.add_argument("--cluster-out", help="write the calibrated local cluster (YAML)")
    parser.add_argument(
        "--calibration-out",
        help="write the calibration (fitted efficiencies, launch and message costs of the "
        "workers' device kind, and its gloo collectives, measured after the run) for plan, "
        "simulate and shard --calibration",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def check_run_arguments(args: argparse.Namespace) -> Any:
    """Every check of ``meshplace run``'s arguments that needs no work, each failure one
    :class:`~meshplace.errors.InputError` sentence: the numbers (also when ``args`` was
    built by hand), ``--plan`` xor ``--placer``, the placer's name, the plan file (read
    and returned, or ``None``), ``--no-predict``'s limits, the worker devices and the
    output path (writable, not an input). Called before the model is traced."""
    from meshplace.util import check_output_paths

    if not args.plan and args.placer is None:
        raise InputError("meshplace run needs --plan PLAN.json or --placer NAME")
    if args.plan and args.placer is not None:
        raise InputError("give either --plan or --placer, not both")
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--workers", args.workers, 1),
        ("--batch", args.batch, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value is None and flag in ("--batch", "--warmup"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            wanted = "a positive integer" if least else "an integer >= 0"
            raise InputError(f"{flag} must be {wanted}, got {value}")
    if args.warmup is not None and args.warmup >= args.steps:
        raise InputError(
            f"--warmup {args.warmup} leaves none of --steps {args.steps} to time; use fewer "
            "warm-up steps or more steps"
        )
    for flag in ("hang_timeout", "build_timeout"):
        value = getattr(args, flag, None)
        if value is not None and not (
            isinstance(value, int | float) and math.isfinite(value) and value > 0
        ):
            name = "--" + flag.replace("_", "-")
            raise InputError(f"{name} must be a positive, finite number of seconds, got {value}")
    for flag in ("memory_budget", "checkpoint_dir", "micro_batches", "schedule"):
        if getattr(args, flag, None) is not None:
            name = "--" + flag.replace("_", "-")
            raise InputError(f"{name} applies to --launcher torchrun")
    for flag in ("cluster", "calibration", "engine"):
        if getattr(args, flag, None) is not None:
            raise InputError(
                f"--{flag} applies to sharding plans (meshplace shard --out)"
                + ("" if flag == "engine" else " and placements run with --launcher torchrun")
            )
    if getattr(args, "no_predict", False):
        if not args.plan:
            raise InputError("--no-predict needs --plan: placers search the calibrated model")
        if args.cluster_out:
            raise InputError("--cluster-out writes the calibrated cluster; drop --no-predict")
        if getattr(args, "calibration_out", None):
            raise InputError("--calibration-out writes the calibration; drop --no-predict")
    plan = None
    if args.placer is not None:
        from meshplace.placers.base import resolve

        resolve([args.placer])  # a typo: one sentence now, not after the calibration
    else:
        from meshplace.plan.placement import load_plan

        plan = load_plan(args.plan)
    check_output_paths(
        {
            "--cluster-out": args.cluster_out,
            "--calibration-out": getattr(args, "calibration_out", None),
        },
        inputs=[args.plan, args.graph],
    )
    from meshplace.runtime.executor import resolve_worker_devices

    resolve_worker_devices(args.worker_devices, args.workers)
    return plan


def _devices_for(
    args: argparse.Namespace, plan: Any, step: Any, local: list[str], cal: Any
) -> tuple[list[str], str]:
    if plan is not None:
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
    problem = PlacementProblem(step.graph, cal.simulated_cluster(), simulator=cal.simulator())
    res = run_placer(args.placer, problem, 10.0, 0)
    return [local[i] for i in res.op_devices.tolist()], f"placer {args.placer}"


def _sharding_plan(path: str | None) -> dict[str, Any] | None:
    """The plan at ``path`` when it is a sharding plan (``meshplace.parallel_plan``)."""
    import json
    from pathlib import Path

    if not path:
        return None
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None  # the placement-plan reader says what is wrong with it
    is_sharding = isinstance(plan, dict) and plan.get("format") == "meshplace.parallel_plan"
    return plan if is_sharding else None


def run_sharding_plan(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """``meshplace run --plan SHARDING_PLAN``: start torchrun with one process per mesh
    device on this host, each running :mod:`meshplace.runtime.launch`; its exit status.
    Every check that needs no process is made first (one sentence, exit 2)."""
    from meshplace.runtime.hybrid_plan import check_hybrid_plan, is_hybrid
    from meshplace.runtime.launch import check_prediction_options, model_source, read_plan

    read_plan(args.plan)  # what is wrong with the file, before any process starts
    for flag, value in (
        ("--placer", args.placer),
        ("--cluster-out", args.cluster_out),
        ("--calibration-out", getattr(args, "calibration_out", None)),
        ("--batch", args.batch),
        ("--size", args.size),
        ("--micro-batches", getattr(args, "micro_batches", None)),
        ("--schedule", getattr(args, "schedule", None)),
    ):
        if value is not None:
            raise InputError(f"{flag} does not apply to a sharding plan ({args.plan})")
    checkpoint_dir = getattr(args, "checkpoint_dir", None)
    if checkpoint_dir is not None and Path(checkpoint_dir).is_file():
        raise InputError(f"--checkpoint-dir {checkpoint_dir!r} is a file")
    source = model_source(plan, args.graph)
    nproc = math.prod(int(s) for s in plan["mesh"]["shape"])
    if is_hybrid(plan):  # what every rank would refuse, refused before any starts
        check_hybrid_plan(plan, nproc, getattr(args, "memory_budget", None))
    check_prediction_options(args, plan, sharding=not is_hybrid(plan))
    extra = ["--model", source]
    for flag, value in (
        ("--memory-budget", getattr(args, "memory_budget", None)),
        ("--checkpoint-dir", getattr(args, "checkpoint_dir", None)),
        ("--cluster", getattr(args, "cluster", None)),
        ("--calibration", getattr(args, "calibration", None)),
        ("--engine", getattr(args, "engine", None)),
    ):
        if value is not None:
            extra += [flag, str(value)]
    return run_with_torchrun(args, nproc, extra)


def run_placement_with_torchrun(args: argparse.Namespace, plan: Any) -> int:
    """``meshplace run --plan PLACEMENT --launcher torchrun``: one torchrun process per
    device the plan uses, each holding only the parameters and optimizer state of its ops
    (:mod:`meshplace.runtime.placed`); its exit status."""
    for flag, value in (
        ("--placer", args.placer),
        ("--cluster-out", args.cluster_out),
        ("--calibration-out", getattr(args, "calibration_out", None)),
        ("--engine", getattr(args, "engine", None)),
    ):
        if value is not None:
            raise InputError(f"{flag} does not apply to --launcher torchrun")
    cluster, calibration = getattr(args, "cluster", None), getattr(args, "calibration", None)
    if cluster is not None or calibration is not None:  # refused before any rank starts
        from meshplace.runtime.launch import prediction_cost_model

        prediction_cost_model(plan.to_dict(), cluster, calibration)
    devices = set(plan.placement.values())
    if plan.default_device is not None and len(plan.placement) < plan.graph_ops:
        devices.add(plan.default_device)
    extra = ["--model", args.graph or plan.graph]
    for flag, value in (
        ("--batch", args.batch),
        ("--size", args.size),
        ("--memory-budget", args.memory_budget),
        ("--checkpoint-dir", args.checkpoint_dir),
        ("--micro-batches", getattr(args, "micro_batches", None)),
        ("--schedule", getattr(args, "schedule", None)),
        ("--cluster", cluster),
        ("--calibration", calibration),
    ):
        if value is not None:
            extra += [flag, str(value)]
    return run_with_torchrun(args, len(devices), extra)


def run_with_torchrun(args: argparse.Namespace, nproc: int, runtime_args: list[str]) -> int:
    """Start ``torchrun --standalone`` with ``nproc`` processes on this host, each running
    ``python -m meshplace.runtime --plan args.plan RUNTIME_ARGS``; pass rank 0's report
    through (``--json``: its one document) and end a failure with one sentence naming
    the rank. Returns the exit status."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from meshplace.runtime.activity import ACTIVITY_ENV
    from meshplace.util import print_json

    devices = args.worker_devices
    if devices not in ("cpu", "cuda"):
        raise InputError(
            f"--worker-devices {devices!r}: torchrun runs one process per device on cpu or cuda"
        )
    if args.warmup is not None and args.warmup >= args.steps:
        raise InputError(f"--warmup {args.warmup} must be fewer than --steps {args.steps}")
    warmup = args.warmup if args.warmup is not None else min(2, args.steps - 1)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", "meshplace.runtime", "--plan", args.plan]
    command += [*runtime_args, "--steps", str(args.steps), "--warmup", str(warmup)]
    command += ["--device", devices] + (["--json"] if args.json else [])
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    # torchrun's elastic agent ends every rank when one dies; its messages (and the ranks')
    # pass through on stderr, and a failure ends with one sentence naming the rank and
    # what it was running, which each rank publishes in this folder (runtime/activity.py)
    with tempfile.TemporaryDirectory(prefix="meshplace-activity-") as activity:
        env[ACTIVITY_ENV] = activity
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
        error = None
        if done.returncode != 0 and "meshplace: error: " not in done.stderr:
            error = failed_rank_sentence(done.stderr, done.returncode, activity)
    sys.stderr.write(done.stderr)
    lines = done.stdout.splitlines()
    documents = [line for line in lines if args.json and line.startswith("{")]
    for line in lines:
        if line not in documents:
            print(line, file=sys.stderr if args.json else sys.stdout)
    if done.returncode == 0:
        if args.json and len(documents) == 1:
            print_json(json.loads(documents[0]))
        return 0
    if error is None:  # a rank refused the plan in one sentence
        error = done.stderr.rsplit("meshplace: error: ", 1)[1].splitlines()[0]
    print(f"meshplace: error: {error}", file=sys.stderr)  # the last line, after torchrun's
    if args.json:
        print_json({"error": error, "exit_status": done.returncode or 1})
    return done.returncode or 1


def failed_rank_sentence(stderr: str, status: int, activity: str | None = None) -> str:
    """One sentence on a torchrun job that failed, naming the first rank torchrun reports
    as failed (``exitcode: -9 ... local_rank: 1``), how it ended and — from the status
    that rank published in the folder ``activity`` (:mod:`meshplace.runtime.activity`) —
    what it was running.

    >>> failed_rank_sentence("... failed (exitcode: -9) local_rank: 1 (pid: 7) of ...", 1)
    'rank 1 was killed by SIGKILL; torchrun stopped the other ranks (exit status 1)'
    >>> failed_rank_sentence("", 1)
    "torchrun ended with exit status 1 (the ranks' messages are above)"
    """
    import re
    import signal

    from meshplace.runtime.activity import last_activity

    found = re.search(r"exitcode: (-?\d+)\)? local_rank: (\d+)", stderr)
    if found is None:
        return f"torchrun ended with exit status {status} (the ranks' messages are above)"
    code, rank = int(found.group(1)), found.group(2)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    doing = last_activity(activity, int(rank)) if activity is not None else None
    if doing is not None:
        how += f" while {doing}"
    return f"rank {rank} {how}; torchrun stopped the other ranks (exit status {status})"


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``meshplace run``; returns the exit code (1 when a worker fails)."""
    import sys

    from meshplace.runtime.processes import WorkerFailure, interrupt_on_sigterm
    from meshplace.util import print_json

    sharding = _sharding_plan(args.plan)
    if sharding is not None:
        return run_sharding_plan(args, sharding)
    if getattr(args, "launcher", "local") == "torchrun":
        if not args.plan:
            raise InputError("--launcher torchrun runs a plan: give --plan PLAN.json")
        from meshplace.plan.placement import load_plan

        return run_placement_with_torchrun(args, load_plan(args.plan))
    if not args.graph:
        raise InputError("meshplace run needs --graph MODEL for a placement plan or --placer")
    plan = check_run_arguments(args)
    # SIGTERM unwinds like Ctrl-C: workers stopped, temporary folders removed
    with interrupt_on_sigterm():
        try:
            return _run(args, plan)
        except WorkerFailure as exc:
            print(f"meshplace: error: {exc}", file=sys.stderr)
            if args.json:
                print_json({**exc.to_dict(), "exit_status": 1})
            return 1


def _run(args: argparse.Namespace, plan: Any) -> int:
    from meshplace.runtime.executor import natural_key, resolve_worker_devices, run_placement
    from meshplace.runtime.processes import safe_start_method
    from meshplace.runtime.program import ModelSpec, trace_step
    from meshplace.util import print_json

    # one torch device per local worker (cluster order)
    worker_list = resolve_worker_devices(args.worker_devices, args.workers)
    gpus = [d for d in worker_list if d.startswith("cuda")]
    spec = ModelSpec(
        args.graph,
        batch=args.batch,
        size=args.size,
        build_timeout_s=getattr(args, "build_timeout", DEFAULT_BUILD_TIMEOUT_S),
    )
    step = trace_step(spec)
    warmup = args.warmup if args.warmup is not None else min(2, args.steps - 1)
    cal = None
    if getattr(args, "no_predict", False):
        prefix = "gpu" if gpus else "cpu"
        local = [f"{prefix}{i}" for i in range(args.workers)]
    else:
        cal = _calibrate(args, step, spec, gpus)
        local = cal.cluster.device_names
    devices, source = _devices_for(args, plan, step, local, cal)
    predicted = cal.predict(step.graph, devices) if cal is not None else None
    # the workers the plan uses, in rank order, each on its local device's torch device
    index = {d: i for i, d in enumerate(local)}
    used = sorted(set(devices), key=natural_key)
    where = [worker_list[index[d]] for d in used]
    res = run_placement(
        spec,
        devices,
        args.steps,
        warmup=warmup,
        step=step,
        worker_devices=where,
        hang_timeout=getattr(args, "hang_timeout", DEFAULT_HANG_TIMEOUT_S),
        # host workers are forks of this process, which has imported torch and traced the
        # step: they start in milliseconds rather than importing and tracing it again
        # (~3 s of CPU each); GPU workers must be spawned
        start_method="spawn" if gpus else safe_start_method(),
    )
    if args.cluster_out and cal is not None:
        from meshplace.hardware import save_cluster

        save_cluster(cal.simulated_cluster(), args.cluster_out)  # in-situ hop latency
    if getattr(args, "calibration_out", None) and cal is not None:
        from meshplace.cost.calibration import save_calibration, with_collectives
        from meshplace.profile.link import measure_collectives_by_engine

        # the transport's own collectives, among as many processes as there are workers
        # (two at least), for the sharding plans that plan, simulate and shard cost: as
        # DTensor's redistributions run them, and as the process group's own calls
        # (DDP's, FSDP2's, the runtime's flat buckets), which cost less
        by_engine = measure_collectives_by_engine(world_size=max(2, len(local)))
        measured = with_collectives(cal.cost_calibration(), by_engine["dtensor"], by_engine["c10d"])
        if not gpus:
            from meshplace.runtime.pipeline_exchange import measure_pipeline_exchange

            # what a pipeline's micro-batch costs two busy ranks of this host beyond
            # compute (the engine, the messages, the ranks' meeting), on a probe model
            exchange = measure_pipeline_exchange()
            measured = measured.model_copy(
                update={
                    "pipeline_exchange_s": exchange.beat_s,
                    "pipeline_message_s": exchange.message_s,
                }
            )
        path, _, function = str(args.graph).rpartition(":")
        if path.endswith(".py") and function and not gpus:
            from meshplace.profile.calibrate import fit_eager_kernels
            from meshplace.profile.link import measure_sync_skew
            from meshplace.runtime.data_parallel import (
                measure_ddp_overhead,
                measure_fsdp_overhead,
            )
            from meshplace.runtime.dryrun import measure_dispatch_overhead, time_eager_kernels
            from meshplace.runtime.pipelined import measure_engine_overhead

            # what DTensor's dispatch adds per op on this model's own step, which the
            # sharding runtime pays, and what torch's pipelining adds per micro-batch,
            # which the hybrid runtime pays (a FILE.py:FUNCTION model: built again here)
            dispatch = measure_dispatch_overhead(str(args.graph))
            for key, which in (("split_note", "model-parallel"), ("batch_note", "batch")):
                if dispatch.get(key):
                    print(
                        f"meshplace: note: DTensor's dispatch on {which}-split operands was "
                        f"not measured ({dispatch[key]}); the calibration file says 0 (such "
                        "ops pay the replicated rate)",
                        file=sys.stderr,
                    )
            # (torch's pipelining cannot trace every model)
            engine = measured_or_zero(
                "the pipelining engine's", lambda: measure_engine_overhead(str(args.graph))
            )
            # and what FSDP2 adds per unit, which a ZeRO-3 data-parallel plan pays (a model
            # FSDP2 cannot shard or run: 0), and DDP per micro-batch, which a data-parallel
            # stage on DDP pays
            fsdp = measured_or_zero(
                "FSDP2's", lambda: measure_fsdp_overhead(str(args.graph))["per_unit_s"]
            )
            ddp = measured_or_zero(
                "DDP's", lambda: measure_ddp_overhead(str(args.graph))["per_micro_batch_s"]
            )
            # the kernels' costs as torchrun's engines run them (eager PyTorch), fitted to
            # each kernel's own time on the model's eager step (a model DDP cannot wrap or
            # run: none, its kernels priced as graph ops)
            measured = measured_or(
                "the eager kernels' costs",
                lambda: fit_eager_kernels(time_eager_kernels(str(args.graph)), measured),
                measured,
                "null",
            )
            # and what the ranks' meeting in collectives costs a step beyond the
            # collectives, as a fraction of a rank's local work (two ranks of this host)
            skew = float(
                measured_or(
                    "the ranks' synchronisation skew",
                    lambda: measure_sync_skew(str(args.graph), world_size=max(2, len(local))),
                    {"skew": 0.0},
                    "0",
                )["skew"]
            )
            measured = measured.model_copy(
                update={
                    "sync_skew": skew,
                    "dispatch_overhead_s": dispatch["per_op_s"],
                    "split_dispatch_overhead_s": dispatch["per_split_op_s"],
                    "batch_dispatch_overhead_s": dispatch["per_batch_split_op_s"],
                    "pipeline_overhead_s": engine,
                    "fsdp_unit_overhead_s": fsdp,
                    "ddp_overhead_s": ddp,
                }
            )
        save_calibration(measured, args.calibration_out)
    error = None if predicted is None else (predicted - res.step_time_s) / res.step_time_s
    out = {
        "graph": step.graph.name,
        "ops": step.graph.num_ops,
        "placement": source,
        "measured_step_s": res.step_time_s,
        "predicted_step_s": predicted,
        "error": error,
        "run": res.to_dict(),
        "calibration": _calibration_summary(cal) if cal is not None else None,
    }
    if args.json:
        print_json(out)
        return 0
    print(
        f"{step.graph.name}: {step.graph.num_ops} ops, {source}, workers "
        + ", ".join(f"{d} on {w}" for d, w in zip(res.devices, where))
    )
    if cal is not None:
        for kind, device in (cal.device.get("by_kind") or {"": cal.device}).items():
            print(
                f"calibrated local cluster{' ' + kind if kind else ''}: "
                f"{device['peak_flops'] / 1e9:.1f} GFLOP/s, "
                f"{device['memory_bandwidth'] / 1e9:.1f} GB/s per worker"
            )
        print(f"link {cal.link['bandwidth'] / 1e9:.2f} GB/s, {cal.link['latency'] * 1e6:.0f} us")
    print(
        f"measured step  {res.step_time_s * 1e3:9.2f} ms  (median of "
        f"{args.steps - res.warmup} after {res.warmup} warm-up; {res.messages} messages, "
        f"{res.bytes_sent / 1e6:.2f} MB per step)"
    )
    if predicted is not None and error is not None:
        print(
            f"predicted step {predicted * 1e3:9.2f} ms  (simulator, calibrated local cluster; "
            f"error {100 * error:+.1f} %)"
        )
    return 0


def _calibrate(args: argparse.Namespace, step: Any, spec: Any, gpus: list[str]) -> Any:
    """The calibration of this machine for ``step`` (see the module doc), its cluster
    resized to ``--workers``."""
    from meshplace.profile.calibrate import (
        calibrate,
        calibrate_in_situ,
        calibrate_mixed,
        local_cluster,
    )
    from meshplace.runtime.executor import resolve_worker_devices

    workers = resolve_worker_devices(args.worker_devices, args.workers)
    if gpus and len(gpus) < len(workers):
        # CPU and GPU workers (the ColocRL setting): each kind timed on its own worker
        return calibrate_mixed(step, workers, spec=spec)
    # the simulator's local devices are all calibrated like the first GPU worker, if any
    # the run's own prediction prices the step's ops by their measured times; the fit of
    # the cost model at a micro-batch too is for the calibration file other plans read
    written = bool(getattr(args, "calibration_out", None))
    cal = calibrate(
        step,
        worker_device=gpus[0] if gpus else "cpu",
        spec=spec,
        micro_batches=None if written else 1,
    )
    if not gpus and not args.no_in_situ:
        calibrate_in_situ(cal)  # message costs inside a step, from probe runs (~1-14 s)
    if args.workers != 2:
        cal.cluster = local_cluster(
            cal.cluster.devices[0].spec,
            cal.link["bandwidth"],
            cal.link["latency"],
            args.workers,
            cal.cluster.meta,
        )
    return cal


def _calibration_summary(cal: Any) -> dict[str, Any]:
    return {
        "device": cal.device,
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "launch_overhead_s": cal.fit["launch_overhead_s"],
        "message_cpu": {
            k: cal.messages[k] for k in ("send_s", "send_s_per_byte", "recv_s", "recv_s_per_byte")
        },
        "in_situ": {
            k: v
            for k, v in (cal.messages.get("in_situ") or {}).items()
            if k not in ("probes", "exchanges")
        },
    }


def measured_or_zero(what: str, measure: Callable[[], float]) -> float:
    """``measure()``'s seconds, or 0 with a note on stderr naming ``what`` overhead was not
    measured and why (a model an engine cannot trace, wrap or run): the calibration file
    then says 0 for it, and the run goes on.

    >>> measured_or_zero("DDP's", lambda: 1e-3)
    0.001
    >>> measured_or_zero("DDP's", lambda: 1 / 0)  # the note goes to stderr
    0.0
    """
    return float(measured_or(f"{what} overhead", measure, 0.0, "0"))


def measured_or(what: str, measure: Callable[[], Any], default: Any, says: str) -> Any:
    """``measure()``, or ``default`` with a note on stderr that ``what`` was not measured
    and why, and that the calibration file ``says`` its default instead.

    >>> measured_or("the eager kernels' costs", lambda: 1 / 0, None, "null") is None
    True
    """
    try:
        return measure()
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"meshplace: note: {what} was not measured ({type(exc).__name__}: "
            f"{reason}); the calibration file says {says}",
            file=sys.stderr,
        )
        return default
