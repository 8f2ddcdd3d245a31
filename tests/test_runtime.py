"""Real execution of placements: correctness against the unplaced step, and faults."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from meshplace.errors import InputError
from meshplace.runtime import Fault, ModelSpec, WorkerFailure, run_placement, run_reference
from meshplace.runtime.program import StepInterpreter, TracedStep, schedule_nodes, trace_step

STEPS = 3


@functools.cache
def _traced(name: str, batch: int | None = None, size: str | None = None) -> TracedStep:
    """``trace_step(ModelSpec(name, batch=batch, size=size))``, traced once for this module:
    every test here only reads the step (runs start from its ``initial_state()``, the
    workers fork or re-trace), so tracing the same model again would test nothing more."""
    return trace_step(ModelSpec(name, batch=batch, size=size))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process reused the pid
        return True
    return True


def _placements(n: int, ops) -> dict[str, list[str]]:
    half = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    alternate = ["cpu0" if i % 2 == 0 else "cpu1" for i in range(n)]
    # by phase: forward on one worker, backward and update on the other
    phase = ["cpu0" if o.phase == "forward" else "cpu1" for o in ops]
    return {"half": half, "alternate": alternate, "phase": phase}


@pytest.mark.parametrize("name", ["mlp", "dmcca-small"])
def test_placed_matches_unplaced(name: str) -> None:
    spec = ModelSpec(name, batch=4)
    step = _traced(name, 4)
    ref_losses, ref_params = run_reference(step, STEPS)
    placements = _placements(step.graph.num_ops, step.graph.ops)
    chosen = ["half", "alternate"] if name == "mlp" else ["phase"]
    for key in chosen:
        # spawn (clean interpreters that re-trace) once; fork (fast) otherwise
        method = "spawn" if key == "half" else "fork"
        res = run_placement(
            spec, placements[key], STEPS, step=step, want_params=True, start_method=method
        )
        assert res.devices == ["cpu0", "cpu1"]
        # bit-identical: received tensors keep the producer's strides, so every kernel
        # runs the same code path on the same values
        assert res.losses == ref_losses, key
        assert res.params is not None and set(res.params) == set(ref_params)
        for pname, value in ref_params.items():
            assert torch.equal(res.params[pname], value), (key, pname)
        assert res.messages > 0 and len(res.step_times) == STEPS and res.step_time_s > 0


def test_nmt_small_placed_matches_unplaced() -> None:
    spec = ModelSpec("nmt-small", batch=4, size="tiny")
    step = _traced("nmt-small", 4, "tiny")
    ref_losses, ref_params = run_reference(step, 2)
    n = step.graph.num_ops
    # encoder modules on one worker, the rest on the other
    devices = ["cpu1" if o.module.startswith("encoder") else "cpu0" for o in step.graph.ops]
    assert len(set(devices)) == 2 and n == len(devices)
    res = run_placement(spec, devices, 2, step=step, want_params=True, start_method="fork")
    assert res.losses == ref_losses  # bit-identical
    for pname, value in ref_params.items():
        assert torch.equal(res.params[pname], value), pname


def _fault_run(kind: str, hang_timeout: float = 20.0) -> WorkerFailure:
    """A run of the MLP on two forked workers with ``kind`` injected into an op of worker
    1: the failure must name worker 1 and the op, and leave no worker alive."""
    spec = ModelSpec("mlp", batch=4)
    step = _traced("mlp", 4)
    n = step.graph.num_ops
    devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    target = next(
        o.name
        for o, d in zip(step.graph.ops, devices)
        if d == "cpu1" and o.kind not in ("parameter", "input", "buffer")
    )
    with pytest.raises(WorkerFailure) as info:
        run_placement(
            spec,
            devices,
            3,
            step=step,
            fault=Fault(target, kind),
            hang_timeout=hang_timeout,
            start_method="fork",
        )
    exc = info.value
    msg = str(exc)
    assert msg.startswith("worker 1 (cpu1) ") and repr(target) in msg, msg
    assert "\n" not in msg
    assert (exc.worker, exc.device, exc.op) == (1, "cpu1", target)
    assert len(exc.pids) == 2 and not any(_alive(p) for p in exc.pids)
    return exc


def test_worker_exception_is_reported() -> None:
    exc = _fault_run("raise")
    assert "injected fault" in str(exc) and exc.cause == "raised"


def test_worker_crash_is_reported() -> None:
    exc = _fault_run("exit")
    assert "exited with code 3" in str(exc) and exc.cause == "exited"


def test_worker_hang_names_the_hung_worker() -> None:
    # a short injected timeout; what is checked is whom the diagnosis blames, not how fast
    exc = _fault_run("hang", hang_timeout=1.0)
    assert "hung: no progress for 1 s while computing op" in str(exc)
    assert exc.cause == "hung"


def test_stopped_worker_is_named_not_its_waiting_peer() -> None:
    # worker 1 stops itself (SIGSTOP); worker 0 then waits on it: the blame is worker 1's
    exc = _fault_run("stop", hang_timeout=1.0)
    assert "is stopped (SIGSTOP or a debugger)" in str(exc), str(exc)
    assert exc.cause == "stopped"


@pytest.mark.parametrize(
    ("name", "size"), [("mlp", None), ("dmcca-small", None), ("nmt-small", "tiny")]
)
def test_step_interpreter_is_the_fx_interpreter_bit_for_bit(name: str, size: str | None) -> None:
    # dmcca-small: factory ops with a device argument; nmt-small: nodes whose arguments
    # nest other nodes in a list (cat, stack), which take the general path
    step = _traced(name, 4, size)
    params, bufs, states, inputs = step.initial_state()
    interp = StepInterpreter(step.gm)
    walked = interp.output(interp.walk([*params, *bufs, *states, *inputs]))
    for expected in (
        torch.fx.Interpreter(step.gm).run(params, bufs, states, inputs),
        step.gm(params, bufs, states, inputs),
    ):
        loss, new_params = expected
        assert torch.equal(walked[0], loss)
        assert len(walked[1]) == len(new_params)
        assert all(torch.equal(a, b) for a, b in zip(walked[1], new_params))


def test_step_interpreter_hooks_and_subsets() -> None:
    step = _traced("mlp", 2)
    nodes = list(step.gm.graph.nodes)
    values = [x for group in step.initial_state() for x in group]
    interp = StepInterpreter(step.gm)
    calls: list[tuple[str, int]] = []
    seen_before: list[bool] = []
    first = next(i for i, n in enumerate(nodes) if n.op == "call_function")
    published = [-1]

    def before(i: int, env: list) -> None:
        calls.append(("before", i))
        seen_before.append(env[i] is None and published[0] == i)

    def after(i: int, env: list) -> None:
        calls.append(("after", i))
        assert env[i] is not None

    env = interp.walk(
        values,
        before={first: before},
        after={first: after},
        each=lambda i, env: calls.append(("each", i)),
        mark=(published, 0),
    )
    walked = [i for kind, i in calls if kind == "each"]
    assert walked == [i for i, n in enumerate(nodes) if n.op != "output"]  # graph order
    k = calls.index(("before", first))
    assert calls[k : k + 3] == [("before", first), ("after", first), ("each", first)]
    assert seen_before == [True] and published[0] == walked[-1]
    assert env[-1] is None  # the output node is not walked; output() assembles it
    # a subset (a worker's own nodes): others stay empty unless a hook fills them in
    sched = schedule_nodes(step, [i % 2 for i in range(step.graph.num_ops)])
    mine = [i for i, d in enumerate(sched.device) if d == 0 and nodes[i].op != "output"]
    full = interp.walk(values)
    # the other worker's values given up front, as a worker's receives would fill them
    given = [None if d == 0 else v for d, v in zip(sched.device, full)]
    part = StepInterpreter(step.gm, mine).walk(values, env=given)
    assert all(torch.equal(part[i], full[i]) for i in mine if torch.is_tensor(full[i]))
    assert any(torch.is_tensor(full[i]) for i in mine)


def test_bad_arguments() -> None:
    spec = ModelSpec("mlp")
    step = _traced("mlp")
    with pytest.raises(InputError):
        run_placement(spec, ["cpu0"], 1, step=step)
    with pytest.raises(InputError):
        run_placement(spec, ["cpu0"] * step.graph.num_ops, 0, step=step)
    with pytest.raises(InputError):
        trace_step(ModelSpec("no-such-model"))
    with pytest.raises(InputError):  # no spec: only a forked, already traced step runs
        run_placement(None, ["cpu0"] * step.graph.num_ops, 1, step=step, start_method="spawn")


def test_timeline_covers_every_node_and_receive() -> None:
    step = _traced("mlp", 4)
    n = step.graph.num_ops
    devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    res = run_placement(None, devices, 2, step=step, start_method="fork", timeline=True)
    assert res.timelines is not None and len(res.timelines) == 2
    nodes = list(step.gm.graph.nodes)
    computed, receives = set(), 0
    for steps in res.timelines:
        assert len(steps) == 2
        spans = steps[-1]
        assert all(0 <= a <= b for _, a, b in spans)
        computed |= {i for i, _, _ in spans if i >= 0}
        received = [-1 - i for i, _, _ in spans if i < 0]
        assert len(received) == len(set(received))  # one wait per remote value
        receives += len(received)
    assert receives > 0
    runnable = {i for i, x in enumerate(nodes) if x.op in ("placeholder", "call_function")}
    assert computed == runnable


def _shorter_measurements(monkeypatch) -> None:
    """Every measurement ``meshplace run`` makes for its calibration, on fewer samples (the
    sizes and repetitions tests/test_profile.py measures with): the link, the messages'
    CPU cost and its spacing, the probe runs in a step and the collectives are all still
    measured and fitted, and what the test checks is what the run does with them (its
    report, the calibration file, the cost model that file gives), not their precision.
    The pipeline exchange keeps its defaults: its cost is the probe's start, not its reps.
    """
    import importlib

    # (the package's ``calibrate`` is the function; the module is needed here)
    calibrate = importlib.import_module("meshplace.profile.calibrate")
    link = importlib.import_module("meshplace.profile.link")

    quick = {
        "measure_link": {"sizes": (4, 1 << 16, 1 << 20), "reps": 3},
        "measure_message_cost": {"iters": 20, "kernels": 5, "rounds": 2},
        "measure_message_spacing": {"kernels": (0, 5, 30), "iters": 20, "rounds": 1},
        "measure_collectives_by_engine": {"sizes": (4096, 1 << 18), "reps": 2},
    }
    for name, options in quick.items():
        monkeypatch.setattr(link, name, functools.partial(getattr(link, name), **options))
    in_situ = functools.partial(calibrate.calibrate_in_situ, steps=3, warmup=1)
    monkeypatch.setattr(calibrate, "calibrate_in_situ", in_situ)


def test_run_cli_prints_measured_and_predicted(tmp_path, capsys, monkeypatch) -> None:
    import argparse
    import json
    import math

    from meshplace.plan.placement import Plan, save_plan
    from meshplace.runtime.cli import add_run_arguments, cmd_run

    _shorter_measurements(monkeypatch)
    step = _traced("mlp")
    n = step.graph.num_ops
    # device names of another cluster: mapped onto the two local workers
    plan = Plan.from_devices(
        step.graph, "colocrl-2gpu", ["gpu0"] * (n // 2) + ["gpu1"] * (n - n // 2)
    )
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(
        [
            "--plan",
            str(path),
            "--graph",
            "mlp",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--json",
            "--cluster-out",
            str(tmp_path / "local.yaml"),
            "--calibration-out",
            str(tmp_path / "calibration.json"),
        ]
    )
    assert cmd_run(args) == 0
    out = json.loads(capsys.readouterr().out)
    # the calibration file: what plan, simulate and shard --calibration apply, on the
    # calibrated cluster's device kind as the run's own prediction did
    from meshplace.cost.calibration import calibrated_cost_model, load_calibration
    from meshplace.hardware import load_cluster

    saved = load_calibration(tmp_path / "calibration.json")
    local = load_cluster(str(tmp_path / "local.yaml"))
    assert saved.device_kind == local.devices[0].kind
    # the cluster file's loopback links spend their latency in flight, as the run's
    # prediction simulated them: plan and simulate on the file do the same
    assert local.links and all(lk.latency_overlaps for lk in local.links)
    assert saved.launch_overhead_s == out["calibration"]["launch_overhead_s"]
    assert saved.peak_flops == out["calibration"]["device"]["peak_flops"]
    applied = calibrated_cost_model(saved, local)
    for kind, (e, m) in saved.efficiency.items():  # an op kind's or an operator's
        assert applied.efficiency_on(saved.device_kind, kind) == pytest.approx((e, m))
    for kind, fixed in saved.kernel_overhead_s.items():
        assert applied.kernel_fixed(saved.device_kind, local.devices[0].spec, kind) == fixed
    # and the transport's collectives, measured as DTensor runs them among the workers
    assert set(saved.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert saved.collectives_measured_on == 2
    assert applied.collectives[saved.device_kind] == saved.collectives
    # and as the process group's own calls (DDP's, FSDP2's, the runtime's flat buckets)
    assert set(saved.collectives_c10d) == set(saved.collectives)
    assert applied.c10d_collectives[saved.device_kind] == saved.collectives_c10d
    # and what a pipeline's micro-batch costs two busy ranks, which the hybrid search
    # charges instead of the engine and the messages' fixed costs
    assert saved.pipeline_exchange_s > 0
    assert applied.pipeline_exchange[saved.device_kind] == (
        saved.pipeline_exchange_s,
        saved.pipeline_message_s,
    )
    assert out["measured_step_s"] > 0 and out["predicted_step_s"] > 0
    in_situ = out["calibration"]["in_situ"]  # probe runs measured the costs
    assert {"start_s", "send_s", "wake_s", "compute_slowdown", "r2"} <= set(in_situ)
    assert all(math.isfinite(in_situ[k]) for k in ("send_s", "wake_s", "r2"))
    assert out["run"]["devices"] == ["cpu0", "cpu1"]
    assert (tmp_path / "local.yaml").exists()
    with pytest.raises(InputError):
        cmd_run(parser.parse_args(["--graph", "mlp"]))


def _eager_adam(step, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager training with the traced step's Adam rule (capture's ``_optimizer_update``:
    m ← 0.9·m + 0.1·g, v ← 0.999·v + 0.001·g², p ← p − 1e-3·m / (√v + 1e-8)), moments
    kept from step to step, on one thread like the workers."""
    from torch.func import functional_call

    params, bufs, _, inputs = step.initial_state()
    names = step.param_names
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    losses = []
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            leaves = [p.detach().requires_grad_(True) for p in params]
            tensors = {**dict(zip(step.buffer_names, bufs)), **dict(zip(names, leaves))}
            loss = functional_call(step.model, tensors, tuple(inputs), strict=False)
            grads = torch.autograd.grad(loss, leaves)
            losses.append(float(loss.detach()))
            with torch.no_grad():
                for i, g in enumerate(grads):
                    m[i] = m[i].mul(0.9).add(g, alpha=0.1)
                    v[i] = v[i].mul(0.999).addcmul(g, g, value=0.001)
                    params[i] = params[i].addcdiv(m[i], v[i].sqrt().add(1e-8), value=-1e-3)
    finally:
        torch.set_num_threads(old)
    return losses, dict(zip(names, params))


def test_adam_moments_carry_across_steps_like_eager_adam() -> None:
    step = _traced("mlp", 4)
    assert len(step.state_nodes) == 2 * len(step.param_names)  # m and v per parameter
    steps = 4
    eager_losses, eager_params = _eager_adam(step, steps)
    ref_losses, ref_params = run_reference(step, steps)
    n = step.graph.num_ops
    alternate = ["cpu0" if i % 2 == 0 else "cpu1" for i in range(n)]
    res = run_placement(None, alternate, steps, step=step, want_params=True, start_method="fork")
    for losses in (ref_losses, res.losses):
        assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    assert res.losses == ref_losses  # the placed run carries the moments bit for bit
    assert res.params is not None
    assert all(torch.equal(res.params[k], v) for k, v in ref_params.items())
    for pname, value in eager_params.items():
        torch.testing.assert_close(ref_params[pname], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res.params[pname], value, rtol=1e-5, atol=1e-6)


def test_worker_devices_are_checked() -> None:
    from meshplace.runtime.executor import resolve_worker_devices

    assert resolve_worker_devices(None, 2) == ["cpu", "cpu"]
    assert resolve_worker_devices(["cpu", "cpu:0"], 2) == ["cpu", "cpu"]
    with pytest.raises(InputError, match=r"1 worker device given \(cpu\) for 2 workers"):
        resolve_worker_devices(["cpu"], 2)
    with pytest.raises(InputError, match="unknown worker device 'tpu:0'"):
        resolve_worker_devices("tpu:0,cpu", 2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(InputError, match=f"not on this machine, which has {gpus} CUDA"):
        resolve_worker_devices([f"cuda:{gpus}", "cpu"], 2)
    spec = ModelSpec("mlp")
    step = _traced("mlp")
    with pytest.raises(InputError, match="not on this machine"):
        run_placement(spec, ["cpu0"] * step.graph.num_ops, 1, step=step, worker_devices="cuda:9")
    with pytest.raises(InputError, match="must be spawned"):  # checked before any GPU is
        run_placement(  # looked for, so this holds on any machine
            spec,
            ["cpu0"] * step.graph.num_ops,
            1,
            step=step,
            start_method="fork",
            worker_devices="cuda",
        )


def test_explicit_cpu_worker_devices_match_unplaced() -> None:
    # its graph builds tensors with device=cpu (eye, zeros, arange)
    step = _traced("dmcca-small", 4)
    ref_losses, ref_params = run_reference(step, 2)
    n = step.graph.num_ops
    devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    res = run_placement(
        None,
        devices,
        2,
        step=step,
        want_params=True,
        start_method="fork",
        worker_devices=["cpu", "cpu"],
    )
    assert res.losses == ref_losses  # bit-identical
    for pname, value in ref_params.items():
        assert torch.equal(res.params[pname], value), pname


def test_run_cli_rejects_a_gpu_this_machine_lacks(tmp_path, capsys) -> None:
    from meshplace.cli import main

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = tmp_path / "local.yaml"
    code = main(
        [
            "run",
            "--graph",
            "mlp",
            "--placer",
            "single",
            "--worker-devices",
            f"cuda:{gpus},cpu",
            "--cluster-out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "not on this machine" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_gpu_workers_match_unplaced() -> None:  # pragma: no cover - no GPU in CI
    # mlp: matmuls; dmcca-small: factory ops traced with device=cpu; resnet-small:
    # convolutions and batch-norm buffers. GPU kernels round differently from the host's:
    # float tolerance, wider where Adam (lr 1e-3) can turn a rounding-level gradient around
    for name, rtol, atol in (
        ("mlp", 1e-4, 1e-5),
        ("dmcca-small", 1e-3, 2e-3),
        ("resnet-small", 1e-3, 2e-3),
    ):
        spec = ModelSpec(name, batch=4)
        step = trace_step(spec)
        ref_losses, ref_params = run_reference(step, STEPS)
        n = step.graph.num_ops
        devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
        for where in ("cuda", "cuda:0,cpu"):
            res = run_placement(spec, devices, STEPS, want_params=True, worker_devices=where)
            assert res.losses == pytest.approx(ref_losses, rel=rtol, abs=atol), (name, where)
            for pname, value in ref_params.items():
                torch.testing.assert_close(res.params[pname], value, rtol=rtol, atol=atol)
    # a step traced on the host can hold host-only operators: one sentence, before any run
    spec = ModelSpec("transformer-small", batch=4)
    step = trace_step(spec)
    with pytest.raises(InputError, match="cannot run on a GPU"):
        run_placement(spec, ["cpu0"] * step.graph.num_ops, 1, step=step, worker_devices="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_and_a_cpu_worker_match_unplaced() -> None:  # pragma: no cover - no GPU in CI
    # the ColocRL setting on one GPU: half the ops on cuda:0, half on the host
    for name, rtol, atol in (("mlp", 1e-4, 1e-5), ("nmt-small", 1e-3, 2e-3)):
        spec = ModelSpec(name, batch=4)
        step = trace_step(spec)
        ref_losses, ref_params = run_reference(step, STEPS)
        n = step.graph.num_ops
        devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
        res = run_placement(spec, devices, STEPS, want_params=True, worker_devices="cuda:0,cpu")
        assert res.losses == pytest.approx(ref_losses, rel=rtol, abs=atol), name
        for pname, value in ref_params.items():
            torch.testing.assert_close(res.params[pname], value, rtol=rtol, atol=atol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_run_predicts_a_cpu_and_gpu_placement(tmp_path) -> None:  # pragma: no cover
    import json
    import subprocess
    import sys

    cluster = tmp_path / "local.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "meshplace.cli", "run", "--graph", "nmt-small", "--placer",
         "m_etf", "--worker-devices", "cuda:0,cpu", "--steps", "4", "--cluster-out",
         str(cluster), "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["predicted_step_s"] > 0 and report["measured_step_s"] > 0
    text = cluster.read_text()
    assert "local-cuda" in text and "local-cpu" in text  # each worker its own kind


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_auto_transport_policy_follows_the_load_average(monkeypatch) -> None:
    from meshplace.runtime.executor import QUIET_LOAD_SHARE, transport_policy

    cores = os.cpu_count() or 1
    monkeypatch.delenv("MESHPLACE_TRANSPORT", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert transport_policy() == "idle"  # a quiet host: idle-class gloo threads
    busy = QUIET_LOAD_SHARE * cores + 0.01
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    assert transport_policy() == "nice"  # busy cores would starve idle-class threads
    monkeypatch.setenv("MESHPLACE_TRANSPORT", "idle")
    assert transport_policy() == "idle"  # an explicit choice wins


def test_transport_threads_policy(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist

    from meshplace.runtime.executor import thread_ids, yield_transport_threads

    monkeypatch.setenv("MESHPLACE_TRANSPORT", "fast")
    step = _traced("mlp")
    with pytest.raises(InputError, match="MESHPLACE_TRANSPORT='fast' is not one of"):
        run_placement(None, ["cpu0"] * step.graph.num_ops, 1, step=step, start_method="fork")
    monkeypatch.delenv("MESHPLACE_TRANSPORT")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    before = thread_ids()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    started = thread_ids() - before  # the group's threads, exactly (as the workers do)
    try:
        assert started
        assert yield_transport_threads("normal", threads=started) == 0
        assert yield_transport_threads("idle", threads=started) == len(started)
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in started)

        def names() -> list[str]:
            return [_comm(t) for t in started]

        # they are gloo's: each names itself once it runs (wait for that, not a sleep)
        deadline = time.monotonic() + 30
        while not all(n.startswith(("gloo", "pt_gloo")) for n in names()):
            assert time.monotonic() < deadline, names()
            time.sleep(0.01)
        # by name, once named, the same threads (and any of an earlier group)
        named = [t for t in thread_ids() if _comm(t).startswith(("gloo", "pt_gloo"))]
        assert started <= set(named) and yield_transport_threads("idle") == len(named)
        # and back, so this process's later gloo use is not slowed
        for t in named:
            os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
    finally:
        dist.destroy_process_group()


def _one_sentence_exit_2(argv: list[str], capsys) -> str:
    """``meshplace ARGV`` (in this process) exits 2 with one line on stderr; returns it."""
    from meshplace.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("meshplace: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--batch", "-3"], "argument --batch: expected a positive integer, got '-3'"),
        (["--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
        (["--steps", "4", "--warmup", "4"], "--warmup 4 leaves none of --steps 4 to time"),
        (["--steps", "0"], "argument --steps: expected a positive integer"),
        (["--workers", "0"], "argument --workers: expected a positive integer"),
        (["--hang-timeout", "0"], "argument --hang-timeout: seconds must be finite and positive"),
        (
            ["--build-timeout", "nan"],
            "argument --build-timeout: seconds must be finite and positive",
        ),
        (["--placer", "singel"], "unknown placer 'singel'"),
        (["--placer", ""], "unknown placer ''"),
        (["--plan", "p.json"], "give either --plan or --placer, not both"),
        (["--no-predict"], "--no-predict needs --plan"),
        (["--cluster-out", "."], "--cluster-out .: is a folder, not a file"),
        (["--cluster-out", "missing/c.yaml"], "folder 'missing' does not exist"),
        (["--size", "huge"], "model 'mlp' has no size 'huge'"),
    ],
)
def test_run_rejects_bad_arguments_before_any_work(
    extra: list[str], expected: str, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    if "--size" not in extra:  # every other check comes before the model is even traced
        import meshplace.runtime.program as program

        def no_work(*args: object, **kwargs: object) -> None:
            raise AssertionError("traced the model before checking the arguments")

        monkeypatch.setattr(program, "trace_step", no_work)
    placer = [] if "--placer" in extra else ["--placer", "single"]
    line = _one_sentence_exit_2(["run", "--graph", "mlp", *placer, *extra], capsys)
    assert expected in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_run_rejects_an_output_that_is_its_input(tmp_path, monkeypatch, capsys) -> None:
    from meshplace.plan.placement import Plan, save_plan

    monkeypatch.chdir(tmp_path)
    step = _traced("mlp")
    save_plan(Plan.from_devices(step.graph, "local", ["cpu0"] * step.graph.num_ops), "p.json")
    before = (tmp_path / "p.json").read_text()
    argv = ["run", "--graph", "mlp", "--plan", "p.json", "--cluster-out", "p.json"]
    assert "is also an input" in _one_sentence_exit_2(argv, capsys)
    assert (tmp_path / "p.json").read_text() == before


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("def build():\n    raise ValueError('boom')\n", "build() failed with ValueError: boom"),
        ("import sys\n\ndef build():\n    sys.exit(0)\n", "build() called sys.exit(0)"),
        ("import sys\nsys.exit(0)\n\ndef build():\n    pass\n", "sys.exit(0)"),
        ("def build():\n    return 42\n", "must return (model, example_inputs)"),
    ],
)
def test_run_with_a_failing_build_is_one_sentence(
    body: str, expected: str, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(body)
    argv = ["run", "--graph", "model.py:build", "--placer", "single", "--cluster-out", "c.yaml"]
    line = _one_sentence_exit_2(argv, capsys)
    assert "model.py" in line and expected in line, line
    assert not (tmp_path / "c.yaml").exists()


def test_build_timeout_interrupts_a_build_that_does_not_return(tmp_path) -> None:
    import threading

    from meshplace.runtime.program import RuntimeInputError, call_with_timeout

    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        pytest.skip("the timer signal needs the main thread")
    (tmp_path / "slow.py").write_text("import time\n\ndef build():\n    time.sleep(3600)\n")
    spec = ModelSpec(f"{tmp_path / 'slow.py'}:build", build_timeout_s=0.2)
    with pytest.raises(RuntimeInputError, match=r"build\(\) did not return within 0.2 s"):
        spec.build()
    assert call_with_timeout(lambda: "done", 0.2, "f()") == "done"


def test_runs_leave_no_temporary_folder(tmp_path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's store goes here
    step = _traced("mlp", 4)
    n = step.graph.num_ops
    devices = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    run_placement(None, devices, 2, step=step, start_method="fork")
    target = next(o.name for o, d in zip(step.graph.ops, devices) if d == "cpu1")
    with pytest.raises(WorkerFailure):
        run_placement(None, devices, 2, step=step, start_method="fork", fault=Fault(target))
    # (torch may put its own caches there: torchinductor_<user>)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("meshplace-")] == []


def test_host_only_attention_runs_as_its_portable_definition() -> None:
    # a GPU worker runs the host's flash attention as PORTABLE_DEFINITIONS says; forcing
    # that path on the host must train like the traced operator, views and all
    from meshplace.runtime.executor import ops_without_kernel
    from meshplace.runtime.program import PORTABLE_DEFINITIONS

    step = _traced("transformer-small", 4)
    flash = [n for n in step.gm.graph.nodes if n.target in PORTABLE_DEFINITIONS]
    assert len(flash) >= 2  # forward and backward
    assert not {n.name for n in flash} & set(ops_without_kernel(step, "CUDA"))
    params, bufs, states, inputs = step.initial_state()
    ref = StepInterpreter(step.gm).walk([*params, *bufs, *states, *inputs])
    portable = StepInterpreter(step.gm, portable=True)
    assert all(entry[2] is not n.target for entry in portable._program for n in flash[:1])
    env = portable.walk([*params, *bufs, *states, *inputs])
    loss_ref, new_ref = StepInterpreter(step.gm).output(ref)
    loss, new = portable.output(env)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for node in flash:  # the attention's outputs and gradients, before Adam amplifies
        pos = portable.position[node]  # rounding-level differences of tiny gradients
        for a, b in zip(env[pos], ref[pos]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(new, new_ref):  # Adam moves a weight by at most ~lr per step
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    for node in flash:  # the traced layout, which the graph's later views rely on
        got = env[portable.position[node]]
        assert [t.stride() for t in got] == [t.stride() for t in node.meta["val"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_host_only_attention_runs_the_fused_kernel_on_a_gpu() -> None:
    """On CUDA the portable attention runs the memory-efficient fused kernel (forward) and
    its autograd (backward): the host operator's outputs and gradients, to rounding."""
    from meshplace.runtime.program import (
        flash_attention_for_cpu,
        flash_attention_for_cpu_backward,
    )

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 100, 64) for _ in range(3))  # 100: lse padded to 128
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    g = torch.randn_like(out)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, True
    )
    on = [t.cuda() for t in (q, k, v)]
    out_gpu, lse_gpu = flash_attention_for_cpu(*on, is_causal=True)
    assert lse_gpu.shape == lse.shape
    torch.testing.assert_close(out_gpu.cpu(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse_gpu.cpu(), lse, rtol=1e-4, atol=1e-5)
    mine = flash_attention_for_cpu_backward(g.cuda(), *on, out_gpu, lse_gpu, 0.0, True)
    for a, b in zip(mine, grads, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
    # without the score matrix: the fused kernel's memory, not B*H*L*S floats
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flash_attention_for_cpu(*on, is_causal=True)
    assert torch.cuda.max_memory_allocated() - base < 2 * 4 * 100 * 100 * 4
