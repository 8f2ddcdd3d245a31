"""GPU checks of the runtime and the cost model (issue 15's GPU items), in one run.

``--part gpt``: one training step of GPT-124M (``gpt --size 124m``, batch 8, context 1024,
float32, Adam) on one GPU, measured three ways and predicted three ways:

* measured: plain PyTorch eager (``loss.backward(); opt.step()``) with Adam's per-parameter
  loop (``foreach=False``: the update ops meshplace's captured step has) and with its
  default multi-tensor update; and meshplace's own runtime running the captured step on
  that GPU (``run_placement``, one worker: the runtime's overhead over eager);
* predicted: the catalogue roofline of the matching preset (``h1-1xh200`` for an H200,
  ``h1-1xh100`` for an H100; datasheet peaks, default efficiencies), then calibrated on
  this GPU (:func:`meshplace.profile.calibrate.calibrate` with ``worker_device``): the
  calibration *file* (fitted per-kind efficiencies and launch overhead) applied to the
  preset the way ``meshplace simulate --calibration`` applies it, and the measured op
  times themselves (``Calibration.predict``).

``--part placed``: the ColocRL paper's setting, one CPU worker and one GPU worker:
:func:`meshplace.profile.calibrate.calibrate_mixed` times the step's ops on each kind, the
placers place the graph on the mixed ``local`` cluster, and every distinct placement (plus
the step's runtime order cut in half between the two, which no placer makes) runs for real
(``run_placement``, values staged through host memory) against ``Calibration.predict``:
median |error| and Kendall's tau over the placements.

Each part writes its rows as soon as it ends. Usage (on a machine with a GPU)::

    python benchmarks/gpu.py [--part gpt,placed] [--out benchmarks/results/gpu.json]

``--device cpu`` runs the same code on the CPU (two CPU workers, the catalogue's Xeon
instead of a GPU preset): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from meshplace.provenance import write_result

ROOT = Path(__file__).resolve().parents[1]
PLACERS = ("m_etf", "heft", "metis", "expert", "anneal")
sys.path.insert(0, str(ROOT / "benchmarks"))


def preset_for(device: str) -> str:
    """The cluster preset of a host with a GPU like ``device``: ``h1-1xh200`` for an H200,
    ``h1-1xh100`` for an H100, ``h1-1xa100-80gb`` for an A100 80 GB (a CPU smoke run uses
    the H200 host's CPU)."""
    if torch.device(device).type != "cuda":
        return "h1-1xh200"
    name = torch.cuda.get_device_name(torch.device(device))
    for key, kind in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if key in name:
            return f"h1-1x{kind}"
    raise SystemExit(f"no catalogue entry for {name!r}; add it to hardware/catalogue.py")


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def eager_step_times(spec: Any, device: str, steps: int, warmup: int, foreach: bool) -> list:
    """Seconds of each timed training step of ``spec``'s model in plain PyTorch eager on
    ``device`` (forward, backward, Adam, gradients set to None), synchronised per step."""
    from meshplace.runtime.program import materialize, real_inputs

    model, inputs, _ = spec.build()
    model = materialize(model, seed=spec.seed).to(device)
    args = [x.to(device) if isinstance(x, torch.Tensor) else x for x in real_inputs(inputs)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(*args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del model, opt, args
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return times


def gpt_part(device: str, batch: int, steps: int, warmup: int, out_dir: Path) -> dict:
    from meshplace.cost.calibration import calibrated_cost_model, save_calibration
    from meshplace.cost.compute import CostModel
    from meshplace.hardware import load_cluster
    from meshplace.profile.calibrate import calibrate, predict_step
    from meshplace.runtime.executor import run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    spec = ModelSpec("gpt", size="124m", batch=batch)
    step = trace_step(spec)
    n = step.graph.num_ops
    preset = preset_for(device)
    cluster = load_cluster(preset)
    category = "gpu" if torch.device(device).type == "cuda" else "cpu"
    target = next(d for d in cluster.devices if d.spec.category == category)
    one = [target.name] * n
    # before calibration attaches measured op times to the graph
    roofline = predict_step(step.graph, cluster, CostModel(use_measured=False), one)
    print(f"gpt-124m: {n} ops; catalogue roofline ({preset}) {roofline * 1e3:.1f} ms", flush=True)
    eager_loop = statistics.median(eager_step_times(spec, device, steps, warmup, foreach=False))
    eager_foreach = statistics.median(eager_step_times(spec, device, steps, warmup, foreach=True))
    print(
        f"  eager {eager_loop * 1e3:.1f} ms (Adam loop), {eager_foreach * 1e3:.1f} ms (foreach)",
        flush=True,
    )
    run = run_placement(
        spec,
        ["gpu0"] * n,
        warmup + steps,
        warmup=warmup,
        step=step,
        start_method="spawn",
        worker_devices=[device],
    )
    print(f"  meshplace runtime {run.step_time_s * 1e3:.1f} ms", flush=True)
    cal = calibrate(step, worker_device=device, spec=spec, reps=5)
    worker = cal.cluster.device_names[0]
    op_times = cal.predict(step.graph, [worker] * n)
    file = cal.cost_calibration().model_copy(update={"device_kind": target.kind})
    save_calibration(file, out_dir / "gpu_calibration.json")
    fitted_model = calibrated_cost_model(file, cluster)
    fitted_model.use_measured = False  # the fitted roofline alone, as on any other graph
    fitted = predict_step(step.graph, cluster, fitted_model, one)
    print(
        f"  calibrated: file on {preset} {fitted * 1e3:.1f} ms, op times {op_times * 1e3:.1f} ms",
        flush=True,
    )

    def err(p: float) -> float:
        return (p - eager_loop) / eager_loop

    return {
        "model": "gpt-124m",
        "batch": batch,
        "ops": n,
        "device": torch.cuda.get_device_name(torch.device(device))
        if torch.device(device).type == "cuda"
        else "cpu",
        "preset": preset,
        "measured_eager_adam_loop_s": eager_loop,
        "measured_eager_adam_foreach_s": eager_foreach,
        "measured_runtime_s": run.step_time_s,
        "runtime_overhead_vs_eager": (run.step_time_s - eager_loop) / eager_loop,
        "predicted_catalogue_roofline_s": roofline,
        "predicted_calibration_file_s": fitted,
        "predicted_op_times_s": op_times,
        "error_catalogue_roofline": err(roofline),
        "error_calibration_file": err(fitted),
        "error_op_times": err(op_times),
        # the calibration times the runtime's own ops: against the runtime's step too
        "error_calibration_file_vs_runtime": (fitted - run.step_time_s) / run.step_time_s,
        "error_op_times_vs_runtime": (op_times - run.step_time_s) / run.step_time_s,
        "calibration": {
            "device": cal.device,
            "launch_overhead_s": cal.fit["launch_overhead_s"],
            "kinds": cal.fit["kinds"],
        },
    }


def placed_part(
    model: str, device: str, batch: int, steps: int, warmup: int, budget: float
) -> dict:
    from fidelity import kendall_tau
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import calibrate, calibrate_mixed, runtime_order
    from meshplace.runtime.executor import natural_key, run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    spec = ModelSpec(model, batch=batch)
    step = trace_step(spec)
    n = step.graph.num_ops
    gpu = torch.device(device).type == "cuda"
    workers = [device, "cpu"]
    cal = calibrate_mixed(step, workers, spec=spec) if gpu else calibrate(step)
    names = cal.cluster.device_names
    where = dict(zip(names, workers))
    problem = PlacementProblem(step.graph, cal.cluster, simulator=cal.simulator())
    order = runtime_order(step)
    half = [""] * n
    for rank, op in enumerate(order):
        half[int(op)] = names[0] if rank < n // 2 else names[1]
    plans: dict[tuple, tuple[str, list[str]]] = {}
    candidates = [(f"single {names[0]}", [names[0]] * n), (f"single {names[1]}", [names[1]] * n)]
    candidates.append(("half/half in runtime order", half))
    for placer in PLACERS:
        try:
            res = run_placer(placer, problem, budget, 0)
        except Exception as exc:  # a placer that cannot place this graph
            print(f"  {placer}: skipped ({type(exc).__name__}: {exc})", flush=True)
            continue
        candidates.append((placer, [names[i] for i in res.op_devices.tolist()]))
    same: dict[tuple, list[str]] = {}
    for label, devices in candidates:
        plans.setdefault(tuple(devices), (label, devices))
        same.setdefault(tuple(devices), []).append(label)
    rows = []
    for label, devices in plans.values():
        predicted = cal.predict(step.graph, devices)
        used = sorted(set(devices), key=natural_key)
        run = run_placement(
            spec,
            devices,
            warmup + steps,
            warmup=warmup,
            step=step,
            start_method="spawn",
            worker_devices=[where[d] for d in used],
        )
        measured = run.step_time_s
        on = {d: devices.count(d) for d in used}
        rows.append(
            {
                "placement": label,
                "same_placement_from": same[tuple(devices)][1:],
                "ops_per_device": on,
                "messages": run.messages,
                "measured_s": measured,
                "predicted_s": predicted,
                "error": (predicted - measured) / measured,
            }
        )
        print(
            f"  {label:28} {on}  measured {measured * 1e3:8.2f} ms  predicted "
            f"{predicted * 1e3:8.2f} ms  error {100 * rows[-1]['error']:+6.1f} %",
            flush=True,
        )
    errors = [abs(r["error"]) for r in rows]
    return {
        "model": model,
        "batch": batch,
        "ops": n,
        "workers": dict(zip(names, workers)),
        "placements": rows,
        "median_abs_error": statistics.median(errors),
        "kendall_tau": kendall_tau(
            [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
        ),
    }


def torchrun_part(device: str, steps: int, warmup: int, out_dir: Path, gpt: dict | None) -> dict:
    """GPT-124M (batch 8 × 1024) as a one-chip sharding plan (``meshplace shard --chips 1``
    on the GPU's preset: catalogue figures, and with the ``--part gpt`` calibration file
    when this run made one) run by ``meshplace run --plan --worker-devices cuda``: torchrun,
    NCCL, the model built on the meta device and created on the GPU parameter by parameter,
    DTensor's forward, backward and foreach Adam. Measured step (median after warm-up)
    beside the plan's prediction, the prediction of the step as DTensor ran it, plain
    eager's step (from ``--part gpt``), and CUDA's peak memory beside the plan's."""
    import json
    import subprocess
    import tempfile

    preset = preset_for(device)
    source = f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_gpt_124m"
    calibration = out_dir / "gpu_calibration.json"
    work = Path(tempfile.mkdtemp(prefix="meshplace-gpu-"))
    cli = [sys.executable, "-m", "meshplace.cli"]

    def meshplace(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([*cli, *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"meshplace {' '.join(args)}: {done.stderr[-3000:]}")
        return done

    plans = {}
    for label, extra in (("catalogue", []), ("calibrated", ["--calibration", str(calibration)])):
        if extra and not calibration.exists():
            continue
        out = work / f"plan_{label}.json"
        meshplace("shard", source, "--cluster", preset, "--chips", "1", "--out", str(out), *extra)
        plans[label] = json.loads(out.read_text())
    label = "calibrated" if "calibrated" in plans else "catalogue"
    run_args = ["--calibration", str(calibration)] if label == "calibrated" else []
    kind = torch.device(device).type  # cuda; cpu for the smoke run
    t0 = time.perf_counter()
    done = meshplace(
        "run", "--plan", str(work / f"plan_{label}.json"), "--worker-devices", kind,
        "--steps", str(warmup + steps), "--warmup", str(warmup), "--json", *run_args,
    )  # fmt: skip
    report = json.loads(done.stdout)
    measured = report["measured"]["step_time_s"]
    predicted = {k: p["predicted"]["step_time_s"] for k, p in plans.items()}
    engine = report["predicted"]["engine"]
    eager = gpt["measured_eager_adam_foreach_s"] if gpt else None
    row = {
        "model": "gpt-124m",
        "source": source,
        "preset": preset,
        "device": report["device"],
        "engine": report["engine"],
        "wall_s": time.perf_counter() - t0,
        "measured_step_s": measured,
        "losses": report["measured"]["losses"],
        "predicted_plan_s": predicted,
        "error_plan": {k: (v - measured) / measured for k, v in predicted.items()},
        "predicted_engine": engine,
        "error_engine": (engine["step_s"] - measured) / measured,
        "eager_adam_foreach_s": eager,
        "overhead_vs_eager": (measured - eager) / eager if eager else None,
        "memory_per_rank": report["memory_per_rank"],
        "peak_bytes": report["peak_bytes_per_rank"][0],
        "peak_kind": report["peak_kind"],
        "predicted_peak_bytes": report["predicted"]["peak_memory_bytes"],
        "predicted_live_peak_bytes": report["predicted"].get("live_peak_bytes"),
        "notes": report["notes"],
    }
    plan_ms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in predicted.items())
    eager_ms = f"{eager * 1e3:.1f}" if eager else "-"
    print(
        f"gpt-124m under torchrun ({report['device']}, {report['engine']}): measured "
        f"{measured * 1e3:.1f} ms; plan {plan_ms} ms; as run {engine['step_s'] * 1e3:.1f} ms; "
        f"eager {eager_ms} ms; "
        f"peak {row['peak_bytes'] / 2**30:.2f} GiB (predicted: live tensors "
        f"{(row['predicted_live_peak_bytes'] or 0) / 2**30:.2f}, the solver's bound "
        f"{row['predicted_peak_bytes'] / 2**30:.2f})",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", default="gpt,torchrun,placed", help="comma-separated: gpt, torchrun, placed"
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=8, help="GPT-124M's batch")
    parser.add_argument("--models", default="nmt-small,rnnlm-small", help="placed part")
    parser.add_argument("--placed-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per placer")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "torch": torch.__version__}
    for part in args.part.split(","):
        try:
            if part == "gpt":
                result["gpt"] = gpt_part(
                    args.device, args.batch, args.steps, args.warmup, out.parent
                )
            elif part == "torchrun":
                result["torchrun"] = torchrun_part(
                    args.device, args.steps, args.warmup, out.parent, result.get("gpt")
                )
            elif part == "placed":
                result["placed"] = []
                for model in args.models.split(","):
                    print(f"{model}:", flush=True)
                    result["placed"].append(
                        placed_part(
                            model, args.device, args.placed_batch, args.steps, args.warmup,
                            args.budget,
                        )
                    )  # fmt: skip
                    write_result(out, result)
            else:
                parser.error(f"unknown part {part!r}")
        except Exception as exc:  # keep what the other parts measured
            import traceback

            traceback.print_exc()
            result[f"{part}_error"] = f"{type(exc).__name__}: {exc}"
        write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
