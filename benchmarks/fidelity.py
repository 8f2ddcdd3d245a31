"""Fidelity of the simulator on this machine: measured vs predicted step time of many plans.

For small configurations of several reference models (``meshplace.runtime.program``'s
``*-small`` models), the local machine is calibrated once per model (device, op times on a
runtime worker, gloo link, message cost), each placer in :data:`PLACERS` places the graph
on the calibrated ``local`` cluster (2 CPU workers), and every distinct placement is run
for real (``run_placement``, 1 thread per worker) and simulated (``Calibration.predict``: the
runtime's messages at their measured cost, in-order workers, the end-of-step exchange;
docs/runtime.md). The load average is recorded before and after, since other jobs on the
host distort multi-worker runs. Reported per model and overall: median absolute
percentage error and Kendall's tau-b between the measured and predicted rankings
(computed here, O(n^2) pairs).

Each plan runs ``--passes`` times (default 2), the passes one after the other over all
plans, each run ``--warmup`` untimed then ``--steps`` timed steps; the measured step time
is the median of the timed steps of all passes, and the spread between the passes'
medians is reported as the measurement's own noise. The predictions use, as ``meshplace
run`` does, the message costs :func:`~meshplace.profile.calibrate.calibrate_in_situ`
measures inside steps of probe placements; every plan is also predicted with the
micro-benchmarks' message costs alone, on the same runs (an ablation; ``--no-in-situ``
predicts that way only), and with the in-situ prediction less one of what it models
(:data:`PLACED_ABLATIONS`: the end-of-step exchange's own cost, the hop latency measured
inside the probes' steps, latencies in flight rather than holding the link; columns
``*_{ablation}``).

``--family sharded`` measures sharding plans instead (``run_sharded_model``): for each
``FILE.py:build`` in :data:`SHARDED_MODELS`, the machine is calibrated as above, the two
local CPU workers become a 2-device mesh of the calibrated device kind joined by the
measured loopback link (:func:`mesh_of_workers`), and the plans are the sharding solver's
best and every Megatron grid point that fits (dp2 with ZeRO 0-3; tp2 with the matrices
split as the integer program prefers and as Megatron's layout splits them), each predicted as
DTensor runs it: a dry run of the runtime's step on a fake process group
(:func:`meshplace.runtime.dryrun.dry_run`) records rank 0's kernels and collectives, which
the calibrated cost model (``calibrated_cost_model``, as ``meshplace shard --calibration``
does) costs, with DTensor's dispatch per op (measured on a 1-rank mesh in this process,
:func:`meshplace.runtime.dryrun.measure_dispatch_overhead`, and at a rate of its own for
ops with a split operand, measured under Megatron's layout on a fake 2-rank group; the
ablation ``one_dispatch_rate`` charges every op the first); the solver's own estimate
of each plan is reported beside it (``predicted_solver_s``). Kernels cost as eager PyTorch
runs them: fitted to each kernel's own time on the model's eager step
(:func:`meshplace.runtime.dryrun.time_eager_kernels`, :func:`meshplace.profile.calibrate.
fit_eager_kernels`; the ablation ``graph_kernels`` prices them by the fit to the
runtime's op times instead). A plan with collectives also pays the ranks' synchronisation
skew, a fraction of its local work measured on the model's own eager step on two ranks
(:func:`meshplace.profile.link.measure_sync_skew`; the ablation ``no_skew`` leaves it
out; the ablation ``dtensor_rates`` prices the process group's own collectives — DDP's,
FSDP2's, the runtime's flat buckets of gradients and ZeRO shards — at the rates measured
for DTensor's redistributions, where the headline prices them at their own
(``CostModel.c10d_collectives``). Reported beside them too: a measurement
that tells the model's error on the rank's local work from the rest: the rank's step timed
alone in its dry run (``timed_alone_s``; the fake process group's collectives wait for
no peer, though their buffers' work is in it) plus the model's collectives
(``predicted_timed_local_s``). Each plan
runs under torchrun on 2 gloo ranks (``python -m meshplace.runtime``: DTensor, PyTorch's
own forward, backward and Adam); the measured step is the median of the timed steps (per
step, the slowest rank) over the passes.

``--family pipelined`` (``run_pipelined_model``): for each model of
:data:`PIPELINED_MODELS`, the pipeline placer's 2-stage plan on the calibrated workers runs
under torchrun as ``torch.distributed.pipelining`` stages with 2, 4 and 8 micro-batches,
1F1B and GPipe, against GPipe's bubble model on the calibrated op times of one micro-batch
and the exchange between two busy ranks measured on a probe (:func:`predict_pipeline`,
:func:`meshplace.runtime.pipeline_exchange.measure_pipeline_exchange`).

``--family hybrid`` (``run_hybrid_model``): the joint search (``meshplace shard --pipeline
auto``) on the calibrated workers' mesh with the sharded family's cost model, at the
model's own batch; every distinct configuration it scores (data, tensor or pipeline
parallelism over the 2 workers, micro-batch size and count) runs under torchrun
(``meshplace.runtime.hybrid``) against the search's prediction.

Usage: ``python benchmarks/fidelity.py [--family placed|sharded|pipelined|hybrid] [--models a,b]
[--steps N] [--passes P] [--out F.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from meshplace.hostmemory import keep_freed_memory
from meshplace.provenance import write_result

MODELS = ("mlp", "dmcca-small", "nmt-small", "rnnlm-small", "resnet-small", "transformer-small")
ROOT = Path(__file__).resolve().parents[1]
PIPELINED_MODELS = (
    f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_deep_mlp",
    f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_llama_batch8",
)
SHARDED_MODELS = (
    f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_mlp",
    f"{ROOT / 'examples' / 'llama.py'}:build_tiny",
)
HYBRID_MODELS = (f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_llama_batch8",)
# The placed family's ablations, each the in-situ prediction less one thing it models:
# name -> (calibrate_in_situ's report keys dropped, Calibration.latency_overlaps, words)
PLACED_ABLATIONS = {
    # the exchange after the walk at the walk's send cost (before session 41)
    "exchange_at_walk_send": (
        ("update_s",),
        True,
        "the end-of-step exchange at the walk's send cost",
    ),
    # every message at the ping-pong's latency (before session 45)
    "ping_pong_latency": (("hop_latency_s",), True, "messages at the ping-pong's latency"),
    # each message's latency holding the link (before session 46)
    "latency_holds_link": ((), False, "each message's latency holding the link"),
}
# The sharded family: steps of each plan's rank timed alone in its dry run (on the fake
# process group), the local work measured, set beside the model's prediction
TIMED_ALONE_STEPS = 7
PLACERS = (
    "single",
    "expert",
    "metis",
    "m_etf",
    "anneal",
    "random",
    "round_robin",
    "m_topo",
    "heft",
    "mincut",
    "pipeline",
    "m_sct",
)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two equally long score lists (ties counted as neither).

    >>> kendall_tau([1, 2, 3], [10, 20, 30]), kendall_tau([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    n = len(a)
    conc = disc = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def _median_abs(errors: Any) -> float | None:
    vals = [abs(e) for e in errors if e is not None]
    return statistics.median(vals) if vals else None


def run_model(
    name: str, steps: int, warmup: int, passes: int, budget: float, in_situ: bool = True
) -> dict:
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import calibrate, calibrate_in_situ
    from meshplace.runtime.executor import WorkerFailure, run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    spec = ModelSpec(name, batch=8)
    step = trace_step(spec)
    cal = calibrate(step)
    names = cal.cluster.device_names
    problem = PlacementProblem(step.graph, cal.cluster, simulator=cal.simulator())
    seen: dict[tuple, str] = {}
    plans: list[tuple[str, list[str], float]] = []
    micro: dict[str, float] = {}
    for placer in PLACERS:
        for seed in (0, 1) if placer == "random" else (0,):
            try:
                res = run_placer(placer, problem, budget, seed)
            except Exception as exc:  # a placer that cannot handle this graph: skip it
                print(f"  {placer}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
            devices = [names[i] for i in res.op_devices.tolist()]
            key = tuple(devices)
            label = placer if seed == 0 else f"{placer}#{seed}"
            if key in seen:
                print(f"  {label}: same placement as {seen[key]}", file=sys.stderr)
                continue
            seen[key] = label
            plans.append((label, devices, cal.predict(step.graph, devices)))
    ablations: dict[str, dict[str, float]] = {}
    if in_situ:  # the headline: in-situ costs; the micro-benchmark-only model alongside
        micro = {label: predicted for label, _, predicted in plans}
        situ = calibrate_in_situ(cal)
        plans = [(label, devices, cal.predict(step.graph, devices)) for label, devices, _ in plans]
        headline_overlaps = cal.latency_overlaps
        for ablation, (dropped, overlaps, _) in PLACED_ABLATIONS.items():
            cal.latency_overlaps = overlaps
            cal.messages = {
                **cal.messages,
                "in_situ": {k: v for k, v in situ.items() if k not in dropped},
            }
            ablations[ablation] = {
                label: cal.predict(step.graph, devices) for label, devices, _ in plans
            }
        cal.messages = {**cal.messages, "in_situ": situ}
        cal.latency_overlaps = headline_overlaps
    # Every plan runs once per pass, passes one after the other, so a slow spell of the
    # host spreads over all plans instead of landing on one; a plan's measured time is the
    # median of its timed steps pooled over the passes.
    timed: dict[str, list[float]] = {label: [] for label, _, _ in plans}
    per_pass: dict[str, list[float]] = {label: [] for label, _, _ in plans}
    messages: dict[str, int] = {}
    for _ in range(passes):
        for label, devices, _ in plans:
            try:
                run = run_placement(
                    spec, devices, warmup + steps, warmup=warmup, step=step, start_method="fork"
                )
            except WorkerFailure as exc:
                print(f"  {label}: run failed: {exc}", file=sys.stderr)
                continue
            timed[label] += run.step_times[warmup:]
            per_pass[label].append(run.step_time_s)
            messages[label] = run.messages
    rows = []
    for label, devices, predicted in plans:
        if not timed[label]:
            continue
        measured = statistics.median(timed[label])
        err = (predicted - measured) / measured
        spread = (max(per_pass[label]) - min(per_pass[label])) / measured
        rows.append(
            {
                "placement": label,
                "workers_used": len(set(devices)),
                "messages": messages[label],
                "measured_s": measured,
                "measured_per_pass_s": per_pass[label],
                "pass_spread": spread,
                "predicted_s": predicted,
                "error": err,
                "predicted_micro_s": micro.get(label),
                "error_micro": (micro[label] - measured) / measured if label in micro else None,
            }
        )
        for ablation, predictions in ablations.items():
            rows[-1][f"predicted_{ablation}_s"] = predictions[label]
            rows[-1][f"error_{ablation}"] = (predictions[label] - measured) / measured
        print(
            f"  {label:12} measured {measured * 1e3:9.2f} ms (passes spread {100 * spread:5.1f} %)"
            f"  predicted {predicted * 1e3:9.2f} ms  error {100 * err:+7.1f} %  "
            f"msgs {messages[label]}",
            file=sys.stderr,
        )
    return {
        "model": name,
        "ops": step.graph.num_ops,
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "message_cpu": {
            k: cal.messages[k]
            for k in (
                "send_s",
                "send_s_per_byte",
                "recv_s",
                "recv_s_per_byte",
                "spacing",
                "in_situ",
            )
            if k in cal.messages
        },
        "placements": rows,
        **_summary(rows),
    }


def mesh_of_workers(cal: Any, workers: int = 2) -> Any:
    """The calibrated local workers as a mesh: ``workers`` devices of the calibrated
    device kind (marked an accelerator, since each worker process is one mesh device, not
    a host CPU to avoid), every pair joined by the measured loopback link."""
    from meshplace.hardware import Cluster, Device, Link

    spec = cal.cluster.devices[0].spec.with_overrides(category="accelerator")
    names = [f"w{i}" for i in range(workers)]
    bandwidth, latency = float(cal.link["bandwidth"]), float(cal.link["latency"])
    links = [
        Link(f"lo{i}-{j}", a, b, bandwidth, latency, "loopback")
        for i, a in enumerate(names)
        for j, b in enumerate(names)
        if i != j
    ]
    devices = [Device(n, spec.kind, spec, host="localhost") for n in names]
    return Cluster(
        "local-workers", devices, links, topology="custom", source="benchmarks/fidelity.py"
    )


def _torchrun_step_times(
    plan: dict, source: str, steps: int, warmup: int, extra: tuple[str, ...] = ()
) -> list[float]:
    """The timed steps (per step, the slowest rank's) of ``plan`` on 2 torchrun ranks
    (``extra``: more ``python -m meshplace.runtime`` options)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(json.dumps(plan))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", "-m", "meshplace.runtime", "--plan", str(path)]
        command += ["--model", source, "--steps", str(warmup + steps)]
        command += ["--warmup", str(warmup), "--device", "cpu", "--json", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
    report = json.loads(done.stdout)
    return report["measured"]["step_times_s"][warmup:]


def _torchrun_passes(
    runs: dict[Any, tuple[dict, tuple[str, ...]]],
    source: str,
    steps: int,
    warmup: int,
    passes: int,
) -> tuple[dict[Any, list[float]], dict[Any, list[float]]]:
    """Each run of ``runs`` (label -> plan file and extra ``python -m meshplace.runtime``
    options) on 2 torchrun ranks once per pass, the runs interleaved within a pass (host
    drift then touches them alike). Returns every timed step and each pass's median, per
    label; a failed run is printed and left out."""
    timed: dict[Any, list[float]] = {label: [] for label in runs}
    per_pass: dict[Any, list[float]] = {label: [] for label in runs}
    for _ in range(passes):
        for label, (document, extra) in runs.items():
            try:
                times = _torchrun_step_times(document, source, steps, warmup, extra)
            except RuntimeError as exc:
                print(f"  {label}: run failed: {exc}", file=sys.stderr)
                continue
            timed[label] += times
            per_pass[label].append(statistics.median(times))
    return timed, per_pass


def _compare(
    label: str,
    timed: list[float],
    per_pass: list[float],
    predicted: float,
    ablation: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One row of a torchrun family: the median of the timed steps of all passes against
    the prediction (and the ablation's prediction, when given), the passes' spread,
    printed as it is made."""
    measured = statistics.median(timed)
    err = (predicted - measured) / measured
    spread = (max(per_pass) - min(per_pass)) / measured
    print(
        f"  {label:18} measured {measured * 1e3:9.2f} ms (passes spread {100 * spread:5.1f} %)"
        f"  predicted {predicted * 1e3:9.2f} ms  error {100 * err:+7.1f} %",
        file=sys.stderr,
    )
    return {
        "placement": label,
        "measured_s": measured,
        "measured_per_pass_s": per_pass,
        "pass_spread": spread,
        "predicted_s": predicted,
        "error": err,
        "predicted_micro_s": ablation,
        "error_micro": (ablation - measured) / measured if ablation is not None else None,
        **extra,
    }


def _short_name(source: str) -> str:
    """``fidelity_models:build_mlp`` for ``.../fidelity_models.py:build_mlp``."""
    path, _, function = source.rpartition(":")
    return f"{Path(path).stem}:{function}"


def dtensor_workers(source: str) -> tuple[Any, Any, Any, dict[str, Any], Any, Any]:
    """The machine calibrated on ``source`` as ``meshplace run --calibration-out`` does
    (the fit, and gloo's collectives among the 2 ranks, ``measure_collectives``), its 2
    workers as a mesh (:func:`mesh_of_workers`), and the calibrated cost model of the
    DTensor engine: the runtime dispatches every op through DTensor, so its measured
    per-op cost (:func:`meshplace.runtime.dryrun.measure_dispatch_overhead`) is the
    engine's dispatch overhead, added to every op's time, measured or roofline; and
    FSDP2's cost per unit per step (:func:`meshplace.runtime.data_parallel.
    measure_fsdp_overhead`), which a ZeRO-3 data-parallel plan pays on FSDP2.
    Returns ``(traced step, calibration, cluster, dispatch measurement (with ``fsdp``),
    engine calibration, cost model)``."""
    from meshplace.cost.calibration import calibrated_cost_model, with_collectives
    from meshplace.profile.calibrate import calibrate, fit_eager_kernels
    from meshplace.profile.link import measure_collectives_by_engine, measure_sync_skew
    from meshplace.runtime.data_parallel import measure_fsdp_overhead
    from meshplace.runtime.dryrun import measure_dispatch_overhead, time_eager_kernels
    from meshplace.runtime.program import ModelSpec, trace_step

    step = trace_step(ModelSpec(source))
    cal = calibrate(step)
    cluster = mesh_of_workers(cal)
    dispatch = measure_dispatch_overhead(source)
    fsdp = measure_fsdp_overhead(source)
    by_engine = measure_collectives_by_engine(world_size=2)
    collectives, c10d = by_engine["dtensor"], by_engine["c10d"]
    for how, measured in (("as DTensor runs them", collectives), ("as c10d calls", c10d)):
        print(
            f"  collectives {how} on 2 gloo ranks (ring formula fitted): "
            + "; ".join(
                f"{kind} {f['latency_s'] * 1e6:.0f} us, {f['bandwidth'] / 1e9:.2f} GB/s"
                for kind, f in measured["fits"].items()
            )
            + f" (link: {cal.link['latency'] * 1e6:.0f} us, "
            f"{cal.link['bandwidth'] / 1e9:.2f} GB/s)",
            file=sys.stderr,
        )
    fitted = with_collectives(cal.cost_calibration(), collectives, c10d)
    # the kernels as torchrun's engines run them: eager PyTorch, each kernel's own time on
    # the model's eager step (the op times above are fx nodes of meshplace's own runtime)
    fitted = fit_eager_kernels(time_eager_kernels(source), fitted)
    assert fitted.eager is not None
    print(
        f"  eager kernels: {fitted.eager.launch_overhead_s * 1e6:.1f} us launch (the "
        f"runtime's op times: {fitted.launch_overhead_s * 1e6:.1f} us)",
        file=sys.stderr,
    )
    # what the ranks' meeting costs a step beyond the collectives: the late rank's lag,
    # as a fraction of a rank's local work, on the model's own eager step
    skew = measure_sync_skew(source)
    print(
        f"  synchronisation skew: {100 * skew['skew']:.1f} % of a rank's local work (a "
        f"step {skew['free_step_s'] * 1e3:.2f} ms free, {skew['met_step_s'] * 1e3:.2f} ms "
        f"with a meeting, the meeting's all-reduce alone {skew['token_s'] * 1e3:.2f} ms)",
        file=sys.stderr,
    )
    engine = fitted.model_copy(
        update={
            "sync_skew": skew["skew"],
            "dispatch_overhead_s": dispatch["per_op_s"],
            "split_dispatch_overhead_s": dispatch["per_split_op_s"],
            "batch_dispatch_overhead_s": dispatch["per_batch_split_op_s"],
            "fsdp_unit_overhead_s": fsdp["per_unit_s"],
        }
    )
    dispatch = {**dispatch, "fsdp": fsdp}
    return step, cal, cluster, dispatch, engine, calibrated_cost_model(engine, cluster)


def links_only(engine: Any, cluster: Any) -> Any:
    """The ablation of the measured collectives: ``engine``'s cost model with collectives
    costed by the ring formula on the calibrated link's latency and bandwidth (DTensor's
    and the process group's own alike)."""
    from meshplace.cost.calibration import calibrated_cost_model

    unmeasured = engine.model_copy(update={"collectives": {}, "collectives_c10d": {}})
    return calibrated_cost_model(unmeasured, cluster)


def run_sharded_model(source: str, steps: int, warmup: int, passes: int) -> dict:
    """Sharding plans of ``source`` on the 2 calibrated workers: measured under torchrun
    vs predicted by the calibrated cost model (module doc)."""
    import json

    from meshplace.parallel.grid import megatron_grid
    from meshplace.parallel.search import shard_graph
    from meshplace.runtime.dryrun import dry_run, program_cost

    step, cal, cluster, dispatch, engine, cost_model = dtensor_workers(source)
    note = "".join(f", {dispatch[k]}" for k in ("split_note", "batch_note") if dispatch.get(k))
    print(
        f"  DTensor dispatch: {dispatch['per_op_s'] * 1e6:.1f} us per op (a step of "
        f"{dispatch['ops']} ops: {dispatch['plain_step_s'] * 1e3:.2f} ms plain, "
        f"{dispatch['dtensor_step_s'] * 1e3:.2f} ms on a 1-rank DTensor mesh); on split "
        f"operands {dispatch['per_split_op_s'] * 1e6:.1f} us per op "
        f"({dispatch['split_ops']} split and {dispatch['split_replicated_ops']} replicated "
        f"of Megatron's layout's forward and backward; batch-split "
        f"{dispatch['per_batch_split_op_s'] * 1e6:.1f} us per op, "
        f"{dispatch['batch_split_ops']} of data parallelism's{note}); FSDP2: "
        f"{dispatch['fsdp']['per_unit_s'] * 1e3:.2f} ms per unit ({dispatch['fsdp']['units']} "
        f"units: {dispatch['fsdp']['fsdp_step_s'] * 1e3:.2f} ms on a 1-rank mesh)",
        file=sys.stderr,
    )

    # The runtime runs every collective in the step's critical path (DTensor's
    # redistributions and the ZeRO gathers are synchronous): the solver's estimates count
    # them in full (overlap=False), as the dry run's prediction does.
    best = shard_graph(step.graph, cluster, chips=2, cost_model=cost_model, overlap=False)
    grid = megatron_grid(
        step.graph,
        cluster,
        chips=2,
        cost_model=cost_model,
        overlap=False,
        layouts=("free", "megatron"),
    )
    candidates = [("solver", best.best)] + [(p.label, p.plan) for p in grid.points if p.fits]

    def key(document: dict) -> str:
        return json.dumps([document["parameters"], document["inputs"]], sort_keys=True)

    plans: list[tuple[str, dict, float]] = []
    seen: dict[str, str] = {}
    for label, plan in candidates:
        document = plan.plan_file(source, cluster.name)
        if key(document) in seen:
            print(f"  {label}: same plan as {seen[key(document)]}", file=sys.stderr)
            continue
        seen[key(document)] = label
        plans.append((label, document, plan.step_time_s))
    # what DTensor runs for each plan (a dry run on a fake process group), costed by the
    # cost model and by its links-only ablation
    on_links = links_only(engine, cluster)
    # and by the ablation of the split operands' own dispatch rate (every DTensor op at
    # the replicated one, as before session 57)
    one_rate = dataclasses.replace(
        cost_model, split_dispatch_overhead={}, batch_dispatch_overhead={}
    )
    # and by the ablation of the eager kernel costs (every kernel at the costs fitted to
    # the runtime's op times, as before session 58)
    graph_kernels = dataclasses.replace(cost_model, eager_kernels={})
    # and by the ablation of the synchronisation skew (no wait for the slowest rank, as
    # before session 59)
    no_skew = dataclasses.replace(cost_model, sync_skew={})
    # and by the ablation of the process group's own collectives' rates (DDP's, FSDP2's,
    # the runtime's flat buckets at DTensor's redistributions' rates, as before session 60)
    dtensor_rates = dataclasses.replace(cost_model, c10d_collectives={})
    engine_predictions: dict[str, tuple[dict[str, Any], ...]] = {}
    timed_alone: dict[str, float] = {}
    for label, document, _ in plans:
        program = dry_run(document, source, timed_steps=TIMED_ALONE_STEPS)
        engine_predictions[label] = (
            program_cost(program, document, cluster, cost_model),
            program_cost(program, document, cluster, on_links),
            program_cost(program, document, cluster, one_rate),
            program_cost(program, document, cluster, graph_kernels),
            program_cost(program, document, cluster, no_skew),
            program_cost(program, document, cluster, dtensor_rates),
        )
        timed_alone[label] = program.timed_step_s
    timed, per_pass = _torchrun_passes(
        {label: (document, ()) for label, document, _ in plans}, source, steps, warmup, passes
    )
    rows = []
    for label, document, solver_s in plans:
        if not timed[label]:
            continue
        engine_s, links_s, one_rate_s, graph_kernels_s, no_skew_s, dtensor_rates_s = (
            engine_predictions[label]
        )
        parts = ("step_s", "compute_s", "dispatch_s", "communication_s", "sync_s")
        breakdown = {k: engine_s[k] for k in parts}
        program = {k: engine_s[k] for k in ("collectives", "kernels", "dispatched")}
        measured = statistics.median(timed[label])
        # not a prediction: the rank's step timed alone in the dry run (collectives
        # waiting for no peer), plus the model's collectives — what is left of the error
        # once the local work is measured rather than modelled
        alone = timed_alone[label] + engine_s["communication_s"]
        rows.append(
            _compare(
                label,
                timed[label],
                per_pass[label],
                engine_s["step_s"],
                links_s["step_s"],
                predicted_breakdown=breakdown,
                program=program,
                zero_stages=sorted({p["zero"] for p in document["parameters"].values()}),
                predicted_solver_s=solver_s,
                error_solver=(solver_s - measured) / measured,
                predicted_solver_compute_s=document["predicted"]["compute_s"],
                predicted_solver_communication_s=document["predicted"]["communication_s"],
                timed_alone_s=timed_alone[label],
                predicted_timed_local_s=alone,
                error_timed_local=(alone - measured) / measured,
                predicted_one_dispatch_rate_s=one_rate_s["step_s"],
                error_one_dispatch_rate=(one_rate_s["step_s"] - measured) / measured,
                predicted_graph_kernels_s=graph_kernels_s["step_s"],
                error_graph_kernels=(graph_kernels_s["step_s"] - measured) / measured,
                predicted_no_skew_s=no_skew_s["step_s"],
                error_no_skew=(no_skew_s["step_s"] - measured) / measured,
                predicted_dtensor_rates_s=dtensor_rates_s["step_s"],
                error_dtensor_rates=(dtensor_rates_s["step_s"] - measured) / measured,
            )
        )
    meas = [r["measured_s"] for r in rows]
    return {
        "model": _short_name(source),
        "ops": step.graph.num_ops,
        "kept": kept_plans(rows),
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "calibration": engine.model_dump(mode="json"),
        "dtensor_dispatch": dispatch,
        "placements": rows,
        **_summary(rows),
        "median_abs_error_solver": _median_abs(r["error_solver"] for r in rows),
        "kendall_tau_solver": kendall_tau(meas, [r["predicted_solver_s"] for r in rows])
        if len(rows) > 1
        else None,
    }


def kept_plans(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Which plan each way of choosing keeps, and how fast it ran against the fastest
    measured: ``shard`` keeps the solver's plan (its own estimate ranks the meshes it
    tried, and the grid's points are special cases of its search); ``shard
    --engine-costs`` the plan of least engine-priced step (``predicted_s``: the dry run of
    what the runtime runs, costed by the calibrated cost model) among all of them."""
    if not rows:
        return {}
    fastest = min(r["measured_s"] for r in rows)
    solver = next((r for r in rows if r["placement"] == "solver"), None)
    engine = min(rows, key=lambda r: r["predicted_s"])
    return {
        how: {
            "plan": r["placement"],
            "measured_s": r["measured_s"],
            "vs_fastest": r["measured_s"] / fastest,
        }
        for how, r in (("shard", solver), ("shard --engine-costs", engine))
        if r is not None
    }


def predict_pipeline(
    source: str,
    plan: Any,
    cal: Any,
    micro_batches: int,
    engine_s: float = 0.0,
    exchange: Any = None,
    accumulation: bool = True,
) -> tuple[float, dict[str, float]]:
    """A pipelined placement's step time on the calibrated workers, GPipe's model (Huang
    et al. 2019, Sec. 2.2): ``(M + S - 1)`` beats of the slowest stage's forward and
    backward on one micro-batch plus the messages between stages plus ``engine_s`` (the
    pipelining engine's own cost per micro-batch,
    :func:`meshplace.runtime.pipelined.measure_engine_overhead`), then
    each stage's optimizer update once. The micro-batch's op times come from the model
    captured at ``batch / M`` under the calibrated cost model; a message (one per value
    and receiving stage) costs latency, bytes over the measured bandwidth and its
    measured CPU at both ends; or, given ``exchange`` (a
    :class:`meshplace.runtime.pipeline_exchange.PipelineExchange` measured on two busy
    ranks), a beat costs the stage's compute plus the measured exchange (the engine and
    one message each way included) plus ``message_s`` for each further message, plus
    every message's bytes over the bandwidth, and ``engine_s`` is not charged again.
    Each stage's backward also pays its share of the step's ``M - 1`` passes adding a
    micro-batch's gradients into the held ones
    (:class:`meshplace.cost.pipeline.GradientAccumulation`, as the simulator and the
    hybrid search charge it); ``accumulation=False`` leaves them out (the ablation).
    1F1B has the same bubble (it saves memory, not time), so both schedules get this
    prediction."""
    import numpy as np
    import torch

    from meshplace.cost.calibration import calibrated_cost_model
    from meshplace.cost.pipeline import GradientAccumulation
    from meshplace.graph.capture import capture
    from meshplace.graph.sources import load_build_function
    from meshplace.sim.simulator import Simulator

    torch.manual_seed(0)
    built = load_build_function(source)()
    model, args = built[0], tuple(built[1])
    kwargs = dict(built[2]) if len(built) > 2 else {}

    def chunk(x: Any) -> Any:
        return x.chunk(micro_batches)[0] if isinstance(x, torch.Tensor) else x

    graph = capture(
        model,
        tuple(chunk(a) for a in args),
        example_kwargs={k: chunk(v) for k, v in kwargs.items()},
        training=True,
    )
    names = plan.device_names(graph, "the pipelined plan")
    cost_model = calibrated_cost_model(cal.cost_calibration(), cal.cluster)
    simulator = Simulator(graph, cal.cluster, cost_model)
    placement = simulator.placement_of(names)
    seconds = simulator.op_times(placement)
    stages = sorted(set(placement.tolist()))
    phase = np.array([o.phase for o in graph.ops])
    per_stage = {d: float(seconds[(placement == d) & (phase != "update")].sum()) for d in stages}
    trainable = np.array([o.kind == "parameter" for o in graph.ops])
    param_bytes = graph.arrays().param_bytes
    accumulate = {
        d: float(
            GradientAccumulation.of(
                cost_model, cal.cluster.devices[d].kind, cal.cluster.devices[d].spec
            ).per_micro_batch(
                param_bytes[trainable & (placement == d)].sum(),
                int((trainable & (placement == d)).sum()),
                micro_batches,
            )
        )
        if accumulation
        else 0.0
        for d in stages
    }
    update = max(float(seconds[(placement == d) & (phase == "update")].sum()) for d in stages)
    arrays = graph.arrays()
    src, dst = placement[arrays.edge_src], placement[arrays.edge_dst]
    # one message per value and receiving stage: a tensor two ops of the next stage read
    # (an activation and, for the weight gradient, the same activation) is sent once
    sent: dict[tuple[int, int], float] = {}
    for j in np.flatnonzero(src != dst).tolist():
        sent[(int(arrays.edge_src[j]), int(dst[j]))] = float(arrays.edge_bytes[j])
    bandwidth = float(cal.link["bandwidth"])
    if exchange is None:  # each message its latency and measured CPU at both ends
        latency = float(cal.link["latency"])
        fixed = float(cal.messages.get("send_s", 0.0)) + float(cal.messages.get("recv_s", 0.0))
        messages = sum(latency + nbytes / bandwidth + fixed for nbytes in sent.values())
    else:  # the ranks' measured exchange: the engine and one message each way, and more
        further = max(0, len(sent) - 2) * exchange.message_s
        messages = exchange.beat_s + further + sum(n / bandwidth for n in sent.values())
        engine_s = 0.0
    beat = max(per_stage[d] + accumulate[d] for d in stages) + messages + engine_s
    predicted = (micro_batches + len(stages) - 1) * beat + update
    return predicted, {
        "beat_s": beat,
        "messages_s": messages,
        "messages": len(sent),
        "engine_s": engine_s,
        "update_s": update,
        "accumulate_s": max(accumulate.values()),
    }


def simulated_pipeline(
    graph: Any, plan: Any, cal: Any, exchange: Any, variants: list[tuple[int, str]]
) -> dict[tuple[int, str], float]:
    """Each (micro-batches, schedule) of ``variants`` as the simulator's throughput
    objective predicts the pipelined placement ``plan`` of ``graph`` (the whole batch, its
    calibrated op times) on the calibrated workers, the cost model given the measured
    ``exchange`` as a calibration file carries it."""
    from meshplace.cost.calibration import calibrated_cost_model
    from meshplace.sim.simulator import Simulator

    fitted = cal.cost_calibration().model_copy(
        update={"pipeline_exchange_s": exchange.beat_s, "pipeline_message_s": exchange.message_s}
    )
    simulator = Simulator(graph, cal.cluster, calibrated_cost_model(fitted, cal.cluster))
    placement = simulator.placement_of(plan.device_names(graph, "the pipelined plan"))
    return {
        (m, sched): float(
            simulator.simulate(
                placement, objective="throughput", micro_batches=m, schedule=sched.lower()
            ).throughput_time_s
        )
        for m, sched in variants
    }


def run_pipelined_model(source: str, steps: int, warmup: int, passes: int) -> dict:
    """Pipelined placements of ``source`` on the 2 calibrated workers: the pipeline
    DP's split of execution order (PipeDream's, which torch's pipelining runs stage by
    stage) at 2, 4 and 8 micro-batches under 1F1B and GPipe, measured under torchrun
    (``torch.distributed.pipelining``) vs :func:`predict_pipeline`. The split is taken
    from the DP itself, not the placer: the placer's objective may rightly prefer one
    plain step for a small model, and this family measures pipelines."""

    from meshplace.placers.base import PlacementProblem
    from meshplace.placers.pipeline import pipeline_split
    from meshplace.plan import Plan
    from meshplace.profile.calibrate import calibrate
    from meshplace.runtime.pipeline_exchange import measure_pipeline_exchange
    from meshplace.runtime.pipelined import measure_engine_overhead
    from meshplace.runtime.program import ModelSpec, trace_step

    step = trace_step(ModelSpec(source))
    cal = calibrate(step)
    problem = PlacementProblem.build(step.graph, cal.cluster, "throughput")
    split, _ = pipeline_split(problem, over_ideals=False)  # a plan torch's pipelining runs
    plan = Plan.from_devices(
        step.graph,
        cal.cluster.name,
        [problem.device_names[d] for d in split.devices],
        objective="throughput",
        micro_batches=2,  # a pipeline; each run below names its own count
        meta={"placer": "pipeline"},
    )
    variants = [(m, sched) for m in (2, 4, 8) for sched in ("1F1B", "GPipe")]
    # the engine's cost per micro-batch is the engine's and the model's, not the count's:
    # measured once, at the most micro-batches (the largest signal over the noise)
    per_micro_batch = measure_engine_overhead(source, 8, reps=30)
    engine = {m: per_micro_batch for m in (2, 4, 8)}
    print(f"  pipelining engine per micro-batch: {1e3 * per_micro_batch:.2f} ms", file=sys.stderr)
    # what a beat costs the two busy ranks beyond compute, measured on a probe model
    exchange = measure_pipeline_exchange()
    print(
        f"  exchange between the two ranks: {1e3 * exchange.beat_s:.2f} ms a beat, "
        f"{1e3 * exchange.message_s:.2f} ms each further value",
        file=sys.stderr,
    )
    predictions = {m: predict_pipeline(source, plan, cal, m, exchange=exchange) for m in (2, 4, 8)}
    # the ablation of the gradient accumulation (session 44): the same without it
    unaccumulated = {
        m: predict_pipeline(source, plan, cal, m, exchange=exchange, accumulation=False)[0]
        for m in (2, 4, 8)
    }
    # the library's pipeline model on the same calibration: the simulator's throughput
    # objective (meshplace simulate --calibration), each op's whole-batch time split
    # over the micro-batches, the exchange charged per beat (HostCosts)
    simulated = simulated_pipeline(step.graph, plan, cal, exchange, variants)
    # the ablation: the engine measured on a world of one, each message its idle costs
    swapped = {m: predict_pipeline(source, plan, cal, m, engine[m])[0] for m in (2, 4, 8)}
    document = plan.to_dict()
    runs = {
        (m, sched): (document, ("--micro-batches", str(m), "--schedule", sched))
        for m, sched in variants
    }
    timed, per_pass = _torchrun_passes(runs, source, steps, warmup, passes)
    rows = [
        _compare(
            f"{sched} x{m}",
            timed[(m, sched)],
            per_pass[(m, sched)],
            predictions[m][0],
            swapped[m],
            **{f"predicted_{k}": v for k, v in predictions[m][1].items()},
            predicted_simulator_s=simulated[(m, sched)],
            predicted_without_accumulation_s=unaccumulated[m],
            error_without_accumulation=(unaccumulated[m] - statistics.median(timed[(m, sched)]))
            / statistics.median(timed[(m, sched)]),
            error_simulator=(simulated[(m, sched)] - statistics.median(timed[(m, sched)]))
            / statistics.median(timed[(m, sched)]),
        )
        for m, sched in variants
        if timed[(m, sched)]
    ]
    return {
        "model": _short_name(source),
        "ops": step.graph.num_ops,
        "median_abs_error_simulator": _median_abs(r["error_simulator"] for r in rows),
        "median_abs_error_without_accumulation": _median_abs(
            r["error_without_accumulation"] for r in rows
        ),
        "kendall_tau_without_accumulation": kendall_tau(
            [r["measured_s"] for r in rows], [r["predicted_without_accumulation_s"] for r in rows]
        )
        if len(rows) > 1
        else None,
        "kendall_tau_simulator": kendall_tau(
            [r["measured_s"] for r in rows], [r["predicted_simulator_s"] for r in rows]
        )
        if len(rows) > 1
        else None,
        "stages": sorted(set(plan.placement.values())),
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "calibration": cal.cost_calibration().model_dump(mode="json"),
        "engine_per_micro_batch_s": engine,
        "exchange_s": {"beat_s": exchange.beat_s, "message_s": exchange.message_s},
        "placements": rows,
        **_summary(rows),
    }


def run_hybrid_model(source: str, steps: int, warmup: int, passes: int) -> dict:
    """Hybrid plans of ``source`` on the 2 calibrated workers: the joint search
    (``meshplace shard --pipeline auto``'s ``hybrid_search``) on the workers' mesh with
    the calibrated cost model (DTensor's dispatch in the launch overhead, as for the
    sharded family: the hybrid runtime's parameters are DTensors), global batch = the
    model's own; every distinct configuration it scored (data, tensor or pipeline
    parallelism, micro-batch size and count; 1F1B, the lowest ZeRO stage of each) runs
    under torchrun (``meshplace.runtime.hybrid``) against the search's own prediction."""
    from meshplace.cost.calibration import calibrated_cost_model
    from meshplace.graph.sources import build_from_seed, graph_source
    from meshplace.parallel.cli import hybrid_plan_file
    from meshplace.parallel.hybrid import hybrid_search
    from meshplace.runtime.data_parallel import measure_ddp_overhead
    from meshplace.runtime.dryrun import engine_pricer
    from meshplace.runtime.pipeline_exchange import measure_pipeline_exchange
    from meshplace.runtime.pipelined import measure_engine_overhead

    step, cal, cluster, dispatch, engine, cost_model = dtensor_workers(source)
    _, args, _ = build_from_seed(source)
    batch = int(args[0].shape[0])
    # a hybrid plan of several stages (or GPipe's order) runs as a torch.distributed.
    # pipelining schedule: its cost per micro-batch and stage, as meshplace run
    # --calibration-out records it (a one-stage 1F1B plan accumulates without one)
    per_micro_batch = measure_engine_overhead(source, reps=30)
    print(f"  pipelining engine per micro-batch: {1e3 * per_micro_batch:.2f} ms", file=sys.stderr)
    # and what a pipeline's beat costs the two busy ranks beyond compute (a probe model),
    # which the search charges pipelines of two stages instead
    exchange = measure_pipeline_exchange()
    print(
        f"  exchange between the two ranks: {1e3 * exchange.beat_s:.2f} ms a beat, "
        f"{1e3 * exchange.message_s:.2f} ms each further value",
        file=sys.stderr,
    )
    # and what DDP adds per micro-batch on the data-parallel stages the runtime runs on it
    ddp = measure_ddp_overhead(source)["per_micro_batch_s"]
    print(f"  DDP per micro-batch: {1e3 * ddp:.2f} ms", file=sys.stderr)
    idle = engine.model_copy(update={"pipeline_overhead_s": per_micro_batch, "ddp_overhead_s": ddp})
    engine = idle.model_copy(
        update={
            "pipeline_exchange_s": exchange.beat_s,
            "pipeline_message_s": exchange.message_s,
        }
    )
    cost_model = calibrated_cost_model(engine, cluster)

    # tensor parallelism priced by the program DTensor runs (a dry run per tp and
    # micro-batch), not by the solver's strategies; the programs recorded once
    programs: dict[str, Any] = {}

    def search(model: Any) -> Any:
        return hybrid_search(
            source,
            None,
            cluster,
            global_batch=batch,
            chips=2,
            cost_model=model,
            autocast=None,  # the runtime trains in float32
            schedules=("1f1b",),
            simulate_top=1000,
            graphs=lambda b: graph_source(source, batch=b, training=True).graph,
            # the runtime reduces each gradient on its own after the schedule
            synchronous_gradients=True,
            engine=engine_pricer(source, cluster, model, global_batch=batch, programs=programs),
        )

    def label_of(plan: Any) -> str:
        c = plan.config
        return f"dp{c.dp} tp{c.tp} pp{c.pp} mb{c.micro_batch}x{c.micro_batches} zero{c.zero}"

    def key_of(plan: Any) -> str:
        # a tensor-parallel configuration is searched in the solver's layout and in
        # Megatron's: the ablations must score the layout the headline kept
        return label_of(plan) + (" megatron" if plan.tensor_layout == "megatron" else "")

    result = search(cost_model)
    # the ablation: the same configurations scored without the measured exchange (the
    # engine on a world of one, each message at its idle CPU), as before session 35
    without = calibrated_cost_model(idle, cluster)

    def first_of_each(plans: Any) -> dict[str, float]:
        # the headline keeps the first plan of each configuration in this order (the
        # search's grid pass may score one again, with equal stages): so must the ablations
        kept: dict[str, float] = {}
        for p in sorted(plans, key=lambda p: p.config.zero):
            kept.setdefault(key_of(p), p.time_per_batch_s)
        return kept

    on_links = first_of_each(search(without).plans)
    # and the ablation of the ranks' synchronisation skew (as before session 59)
    unskewed = calibrated_cost_model(engine.model_copy(update={"sync_skew": 0.0}), cluster)
    no_skew = first_of_each(search(unskewed).plans)
    # and of the process group's own collectives' rates (as before session 60)
    uniform = calibrated_cost_model(engine.model_copy(update={"collectives_c10d": {}}), cluster)
    dtensor_rates = first_of_each(search(uniform).plans)
    plans: dict[str, Any] = {}
    for plan in sorted(result.plans, key=lambda p: p.config.zero):
        label = label_of(plan).rsplit(" ", 1)[0]
        if plan.fits and label not in plans:
            plans[label] = plan
    runs = {
        label: (hybrid_plan_file(result, plan, cluster.name), ()) for label, plan in plans.items()
    }
    timed, per_pass = _torchrun_passes(runs, source, steps, warmup, passes)

    def error(predictions: dict[str, float], plan: Any, label: str) -> float | None:
        measured = statistics.median(timed[label])
        found = predictions.get(key_of(plan))
        return None if found is None else (found - measured) / measured

    rows = [
        _compare(
            key_of(plan),
            timed[label],
            per_pass[label],
            plan.time_per_batch_s,
            on_links.get(key_of(plan)),
            bubble_fraction=plan.bubble_fraction,
            predicted_no_skew_s=no_skew.get(key_of(plan)),
            error_no_skew=error(no_skew, plan, label),
            predicted_dtensor_rates_s=dtensor_rates.get(key_of(plan)),
            error_dtensor_rates=error(dtensor_rates, plan, label),
        )
        for label, plan in plans.items()
        if timed[label]
    ]
    return {
        "model": _short_name(source),
        "ops": step.graph.num_ops,
        "global_batch": batch,
        "link": {"bandwidth": cal.link["bandwidth"], "latency": cal.link["latency"]},
        "calibration": engine.model_dump(mode="json"),
        "dtensor_dispatch": dispatch,
        "placements": rows,
        **_summary(rows),
    }


def _summary(rows: list[dict]) -> dict[str, Any]:
    """Median absolute error and Kendall's tau of the predictions, and of the
    micro-benchmark-only ones (when in situ was on); the passes' spread."""
    meas = [r["measured_s"] for r in rows]
    micro = [r["predicted_micro_s"] for r in rows]
    return {
        "median_abs_error": _median_abs(r["error"] for r in rows),
        "kendall_tau": kendall_tau(meas, [r["predicted_s"] for r in rows])
        if len(rows) > 1
        else None,
        "median_abs_error_micro": _median_abs(r["error_micro"] for r in rows),
        "kendall_tau_micro": kendall_tau(meas, micro)
        if len(rows) > 1 and None not in micro
        else None,
        "median_pass_spread": _median_abs(r["pass_spread"] for r in rows),
        **{
            f"{measure}_{ablation}": value
            for ablation in (
                *PLACED_ABLATIONS,
                "timed_local",
                "one_dispatch_rate",
                "graph_kernels",
                "no_skew",
                "dtensor_rates",
            )
            if all(r.get(f"predicted_{ablation}_s") is not None for r in rows)
            for measure, value in (
                ("median_abs_error", _median_abs(r[f"error_{ablation}"] for r in rows)),
                (
                    "kendall_tau",
                    kendall_tau(meas, [r[f"predicted_{ablation}_s"] for r in rows])
                    if len(rows) > 1
                    else None,
                ),
            )
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family",
        choices=("placed", "sharded", "pipelined", "hybrid"),
        default="placed",
        help="placed: op placements on local workers (default); sharded: sharding plans "
        "under torchrun; pipelined: the pipeline placer's plans as torch pipelines; hybrid: "
        "the joint search's plans (shard --pipeline auto) under torchrun",
    )
    parser.add_argument("--models", default=None, help="comma-separated (default: the family's)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument(
        "--no-in-situ",
        action="store_true",
        help="predict with the micro-benchmarks' message costs only (no calibrate_in_situ)",
    )
    parser.add_argument("--passes", type=int, default=2, help="runs per plan, interleaved")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per placer")
    parser.add_argument("--out", default=None, help="default results/fidelity[_sharded].json")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as meshplace's own processes (meshplace.hostmemory)
    sharded = args.family == "sharded"
    family_models = {
        "placed": MODELS,
        "sharded": SHARDED_MODELS,
        "pipelined": PIPELINED_MODELS,
        "hybrid": HYBRID_MODELS,
    }
    models = args.models.split(",") if args.models else list(family_models[args.family])
    default_out = {
        "placed": "fidelity.json",
        "sharded": "fidelity_sharded.json",
        "pipelined": "fidelity_pipelined.json",
        "hybrid": "fidelity_hybrid.json",
    }[args.family]
    out = args.out or str(Path(__file__).parent / "results" / default_out)
    t0 = time.time()
    load_before = os.getloadavg()
    results = []
    for name in models:
        print(f"{name}:", file=sys.stderr)
        if sharded:
            results.append(run_sharded_model(name, args.steps, args.warmup, args.passes))
            continue
        if args.family == "pipelined":
            results.append(run_pipelined_model(name, args.steps, args.warmup, args.passes))
            continue
        if args.family == "hybrid":
            results.append(run_hybrid_model(name, args.steps, args.warmup, args.passes))
            continue
        results.append(
            run_model(name, args.steps, args.warmup, args.passes, args.budget, not args.no_in_situ)
        )
    rows = [r for m in results for r in m["placements"]]
    overall = {
        **_summary(rows),
        "placements": len(rows),
        "protocol": {
            "steps": args.steps,
            "warmup": args.warmup,
            "passes": args.passes,
            "in_situ": not args.no_in_situ and args.family == "placed",
            "family": args.family,
        },
        "seconds": time.time() - t0,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    # Kendall's tau overall: the mean of the per-model values (rankings within a model)
    taus = [
        "kendall_tau",
        "kendall_tau_micro",
        "kendall_tau_timed_local",
        "kendall_tau_one_dispatch_rate",
        "kendall_tau_graph_kernels",
        "kendall_tau_no_skew",
        "kendall_tau_dtensor_rates",
        *(f"kendall_tau_{a}" for a in PLACED_ABLATIONS),
    ]
    for key in taus:
        vals = [m[key] for m in results if m.get(key) is not None]
        overall[key] = statistics.mean(vals) if vals else None
    if args.family == "pipelined":  # the library simulator's prediction, beside the formula
        overall["median_abs_error_simulator"] = _median_abs(r["error_simulator"] for r in rows)
        taus = [m["kendall_tau_simulator"] for m in results if m["kendall_tau_simulator"]]
        overall["kendall_tau_simulator"] = statistics.mean(taus) if taus else None
        overall["median_abs_error_without_accumulation"] = _median_abs(
            r["error_without_accumulation"] for r in rows
        )
        taus = [m["kendall_tau_without_accumulation"] for m in results]
        overall["kendall_tau_without_accumulation"] = (
            statistics.mean([t for t in taus if t is not None]) if any(taus) else None
        )

    def pct(x: Any) -> str:
        return f"{100 * x:.1f}%" if x is not None else "-"

    def num(x: Any) -> str:
        return f"{x:.2f}" if x is not None else "-"

    ablation = {
        "placed": "micro only: |err|",
        "sharded": "links only: |err|",
        "pipelined": "idle msgs: |err|",
        "hybrid": "no exchange: |err|",
    }[args.family]
    print(
        f"\n{'model':26} {'plans':>5} {'median |err|':>13} {'tau':>6} {'pass spread':>12} "
        f"{ablation:>18} {'tau':>6}"
    )
    for name, m, plans in [(m["model"], m, len(m["placements"])) for m in results] + [
        ("overall (mean tau)", overall, len(rows))
    ]:
        print(
            f"{name:26} {plans:5d} {pct(m['median_abs_error']):>13} {num(m['kendall_tau']):>6} "
            f"{pct(m['median_pass_spread']):>12} {pct(m['median_abs_error_micro']):>18} "
            f"{num(m['kendall_tau_micro']):>6}"
        )
    print(
        "pass spread: (max - min) / measured of a plan's per-pass medians, median over plans "
        "(the measurement's own noise); "
        + {
            "sharded": "links only: the same plans' predictions with collectives costed by the "
            "ring formula on the link's latency and bandwidth instead of gloo's measured "
            "collectives (an ablation)",
            "placed": "micro only: the same runs predicted with the micro-benchmarks' message "
            "costs, without calibrate_in_situ (an ablation)",
            "pipelined": "1F1B and GPipe share one prediction (the same bubble), a beat "
            "charged the exchange measured on two busy ranks (a probe model); idle msgs: the "
            "same predictions with the engine measured on a world of one and each message at "
            "its idle latency and CPU (an ablation, the prediction before session 35)",
            "hybrid": "predictions are the joint search's own (its DP over stages and the "
            "simulated schedule), on the calibrated workers, pipelines charged the exchange "
            "measured on two busy ranks (a probe model); no exchange: the same "
            "configurations scored with the engine measured on a world of one and each "
            "message at its idle CPU (an ablation, the prediction before session 35)",
        }[args.family]
    )
    if sharded:
        for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
            print(
                f"the rank's step timed alone in the dry run + the model's collectives (a "
                f"measurement of the local work, not the model) {name}: median |err| "
                f"{pct(m.get('median_abs_error_timed_local'))}, "
                f"tau {num(m.get('kendall_tau_timed_local'))}"
            )
        for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
            print(
                f"every DTensor op at the replicated dispatch rate (an ablation: no rate of "
                f"its own for split operands) {name}: median |err| "
                f"{pct(m.get('median_abs_error_one_dispatch_rate'))}, "
                f"tau {num(m.get('kendall_tau_one_dispatch_rate'))}"
            )
        for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
            print(
                f"every kernel at the costs fitted to the runtime's op times (an ablation: no "
                f"eager kernel costs) {name}: median |err| "
                f"{pct(m.get('median_abs_error_graph_kernels'))}, "
                f"tau {num(m.get('kendall_tau_graph_kernels'))}"
            )
        for m in results:
            print(
                f"kept on {m['model']}: "
                + "; ".join(
                    f"{how}: {k['plan']}, measured {k['measured_s'] * 1e3:.2f} ms "
                    f"({k['vs_fastest']:.2f}x the fastest measured)"
                    for how, k in m["kept"].items()
                )
            )
    for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
        if args.family in ("sharded", "hybrid"):
            print(
                f"no wait for the slowest rank (an ablation: no synchronisation skew) "
                f"{name}: median |err| {pct(m.get('median_abs_error_no_skew'))}, "
                f"tau {num(m.get('kendall_tau_no_skew'))}"
            )
            print(
                f"every collective at DTensor's rates (an ablation: no rates of the process "
                f"group's own calls) {name}: median |err| "
                f"{pct(m.get('median_abs_error_dtensor_rates'))}, "
                f"tau {num(m.get('kendall_tau_dtensor_rates'))}"
            )
    for ablation, (_, _, words) in PLACED_ABLATIONS.items() if args.family == "placed" else ():
        for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
            if m.get(f"median_abs_error_{ablation}") is not None:
                print(
                    f"in situ, {words} (ablation) {name}: median |err| "
                    f"{pct(m[f'median_abs_error_{ablation}'])}, "
                    f"tau {num(m[f'kendall_tau_{ablation}'])}"
                )
    if args.family == "pipelined":
        for name, m in [(m["model"], m) for m in results] + [("overall", overall)]:
            print(
                f"simulator (meshplace simulate's pipeline model) {name}: median |err| "
                f"{pct(m['median_abs_error_simulator'])}, tau {num(m['kendall_tau_simulator'])}"
            )
            print(
                f"formula without the gradient accumulation (ablation) {name}: median |err| "
                f"{pct(m['median_abs_error_without_accumulation'])}, "
                f"tau {num(m['kendall_tau_without_accumulation'])}"
            )
    print(
        "load average (1, 5, 15 min) before "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_before"])
        + "; after "
        + ", ".join(f"{x:.2f}" for x in overall["load_average_after"])
    )
    write_result(out, {"family": args.family, "models": results, "overall": overall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
