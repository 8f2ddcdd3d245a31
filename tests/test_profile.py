"""Profiling and calibration: leveled profiler, op timing, fitting, local cluster, CLI."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import pytest
import torch

from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.graph.capture import capture
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import cluster_from_yaml, cluster_to_yaml
from meshplace.profile import (
    calibrate,
    fit_cost_model,
    format_tables,
    local_cluster,
    local_device_spec,
    predict_step,
    profile_model,
    signature,
    time_step_ops,
)
from meshplace.profile.calibrate import (
    EFFICIENCY_RANGE,
    Calibration,
    op_times_table,
    time_ops_in_worker,
)
from meshplace.profile.cli import add_profile_arguments, cmd_profile
from meshplace.profile.link import (
    fit_affine,
    fit_collective,
    fit_link,
    measure_collectives,
    measure_collectives_by_engine,
    measure_link,
    measure_message_cost,
)
from meshplace.profile.profiler import parse_levels, trimmed_mean
from meshplace.runtime.program import MLP, ModelSpec, trace_step

FAKE_LINK = {"bandwidth": 1e9, "latency": 1e-4, "samples": []}
FAKE_DEVICE = {"peak_flops": 5e10, "memory_bandwidth": 1e10, "launch_overhead_s": 2e-6}
FAKE_MESSAGES = {"send_s": 2e-5, "send_s_per_byte": 2e-10, "recv_s": 1e-5, "recv_s_per_byte": 2e-10}


def _plausible_message_costs(m: dict) -> None:
    """Fixed costs of microseconds, per-byte costs of well under 1 µs/B: a broken
    measurement (NaN, seconds per message) fails; the fit already clips negatives to 0."""
    for key in ("send_s", "recv_s"):
        assert 0 <= m[key] < 0.05, (key, m[key])
    for key in ("send_s_per_byte", "recv_s_per_byte"):
        assert 0 <= m[key] < 1e-6, (key, m[key])


def test_levels_and_trimmed_mean() -> None:
    assert parse_levels("op") == ["model", "module", "op"]
    assert parse_levels("model") == ["model"]
    with pytest.raises(InputError):
        parse_levels("kernel,bogus")
    assert trimmed_mean([5.0]) == 5.0
    assert trimmed_mean([1, 2, 3, 4, 1000]) == 3.0


def test_profile_levels_tables_and_trace(tmp_path) -> None:
    torch.manual_seed(0)
    model = MLP()
    inputs = [torch.randn(8, 16), torch.randn(8, 4)]
    prof = profile_model(model, inputs, name="mlp", runs=2, device=FAKE_DEVICE)
    assert prof.levels == ["model", "module", "op"]
    assert set(prof.overhead_s) == {"module", "op"}
    assert all(v > 0 for v in prof.step_s.values())
    assert "addmm" in prof.ops and prof.ops["addmm"]["flops"] > 0
    assert prof.modules["fc1"]["forward_s"] > 0 and prof.modules["fc1"]["flops"] > 0
    assert prof.modules["MLP"]["flops"] >= prof.modules["fc1"]["flops"]
    assert prof.kinds["matmul"]["intensity"] > 0
    text = format_tables(prof)
    assert "overhead" in text and "addmm" in text and "roofline" in text
    prof.save(tmp_path / "p.json", tmp_path / "p.trace.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["format"] == "meshplace.profile" and data["version"] == 1
    trace = json.loads((tmp_path / "p.trace.json").read_text())
    assert any(e.get("ph") == "X" and e.get("tid") == 1 for e in trace["traceEvents"])
    only_model = profile_model(model, inputs, levels=["model"], runs=1)
    assert only_model.levels == ["model"] and not only_model.ops


def test_calibration_fits_and_attaches_by_signature() -> None:
    step = trace_step(ModelSpec("mlp", batch=8))
    seconds = time_step_ops(step, reps=3)
    kernel = [o.kind not in ("parameter", "input", "buffer") for o in step.graph.ops]
    assert all(t > 0 for t, k in zip(seconds, kernel) if k)
    assert all(t == 0 for t, k in zip(seconds, kernel) if not k)
    spec = local_device_spec(FAKE_DEVICE["peak_flops"], FAKE_DEVICE["memory_bandwidth"], 0.0)
    cm, report = fit_cost_model(step.graph, seconds, spec)
    assert report["launch_overhead_s"] > 0
    # relative to the probes' peak and bandwidth, which a large matmul may beat
    low, high = EFFICIENCY_RANGE
    assert all(low <= e <= high and low <= m <= high for e, m in cm.efficiency.values())
    # the same model captured by meshplace.graph.capture has the same signatures
    torch.manual_seed(0)
    graph = capture(MLP(), (torch.zeros(8, 16), torch.zeros(8, 4)), training=True)
    table = op_times_table(step.graph, seconds)
    assert table.attach(graph) == sum(kernel)
    assert {signature(o) for o in graph.ops} == {signature(o) for o in step.graph.ops}
    assert all("local-cpu" in o.measured_time for o, k in zip(graph.ops, kernel) if k)


def test_calibrate_local_cluster_and_prediction() -> None:
    step = trace_step(ModelSpec("mlp", batch=8))
    cal = calibrate(step, reps=3, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    assert cal.cost_model.message_cpu["local-cpu"] == (2e-5, 2e-10, 1e-5, 2e-10)
    c = cal.cluster
    assert c.name == "local" and c.device_names == ["cpu0", "cpu1"]
    assert c.path_bandwidth(0, 1) == pytest.approx(1e9)
    again = cluster_from_yaml(cluster_to_yaml(c))
    assert again.device_names == c.device_names
    assert again.devices[0].spec.launch_overhead_s == pytest.approx(
        c.devices[0].spec.launch_overhead_s
    )
    n = step.graph.num_ops
    single = predict_step(step.graph, c, cal.cost_model, ["cpu0"] * n)
    measured = sum(o.measured_time.get("local-cpu", 0.0) for o in step.graph.ops)
    assert single == pytest.approx(measured, rel=1e-6)
    split = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    free = CostModel(cal.cost_model.efficiency, launch_overhead=cal.cost_model.launch_overhead)
    assert cal.predict(step.graph, split) > predict_step(step.graph, c, free, split)
    assert json.dumps(cal.to_dict())
    assert FAKE_DEVICE.keys() == {"peak_flops", "memory_bandwidth", "launch_overhead_s"}


def test_the_gradient_accumulation_is_measured_on_the_models_parameters(tmp_path) -> None:
    """Every calibration times ``grad += new`` over tensors of the model's trainable
    parameter sizes (:func:`measure_gradient_accumulation`: megabytes of gradients take
    measurable time, a graph without parameters 0); the calibration file carries the
    rate, and the cost model it makes prices a pass at it (per byte, plus the add
    kernel's fixed cost per tensor), not at the device's streaming bandwidth."""
    from meshplace.cost.calibration import (
        calibrated_cost_model,
        load_calibration,
        save_calibration,
    )
    from meshplace.cost.pipeline import GradientAccumulation
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.profile.calibrate import measure_gradient_accumulation

    big = OpGraph("big")
    for i in range(3):
        big.add_op(Op(f"w{i}", "parameter", param_bytes=2**22, output_dtypes=["float32"]))
    timed: list[float] = []

    def timer(fn, reps: int, sync=None) -> float:
        fn()  # the pass runs (over three 4 MiB tensors, then their halves)
        timed.append(reps)
        return [6e-3, 2e-3][len(timed) - 1]  # fixed seconds: the arithmetic, not the host

    assert measure_gradient_accumulation(big, timer=timer) == 2 * 4e-3 / (3 * 2**22)
    assert timed == [7, 7]
    late = iter([1e-3, 2e-3])  # the host slowed between the two timings: never below 0
    assert measure_gradient_accumulation(big, timer=lambda fn, reps, sync: next(late)) == 0.0
    empty = OpGraph("none")
    empty.add_op(Op("x", "input"))
    assert measure_gradient_accumulation(empty) == 0.0

    step = trace_step(ModelSpec("mlp", batch=8))
    measured = calibrate(step, reps=1, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    assert measured.device["gradient_accumulation_s_per_byte"] >= 0  # the mlp's: tiny
    rate = 1e-10
    device_with_rate = {**FAKE_DEVICE, "gradient_accumulation_s_per_byte": rate}
    cal = calibrate(step, reps=1, link=FAKE_LINK, device=device_with_rate, messages=FAKE_MESSAGES)
    assert cal.cost_model.gradient_accumulation["local-cpu"] == rate
    save_calibration(cal.cost_calibration(), tmp_path / "cal.json")
    written = load_calibration(tmp_path / "cal.json")
    assert written.gradient_accumulation_s_per_byte == rate
    model = calibrated_cost_model(written, cal.cluster)
    device = cal.cluster.devices[0]
    accumulation = GradientAccumulation.of(model, device.kind, device.spec)
    assert accumulation.per_byte_s == rate
    params = [o for o in step.graph.ops if o.kind == "parameter"]
    nbytes = sum(o.param_bytes for o in params)
    one_pass = float(accumulation.seconds(nbytes, len(params)))
    assert one_pass == pytest.approx(rate * nbytes + len(params) * accumulation.per_tensor_s)
    roofline = GradientAccumulation.of(CostModel(), device.kind, device.spec)
    streaming = (
        device.spec.memory_bandwidth * CostModel().efficiency_on(device.kind, "elementwise")[1]
    )
    assert roofline.per_byte_s == pytest.approx(3 / streaming)


def test_op_times_in_the_worker_regime() -> None:
    step = trace_step(ModelSpec("mlp", batch=8))
    seconds = time_ops_in_worker(step, reps=3, warmup=1)
    kernel = [o.kind not in ("parameter", "input", "buffer") for o in step.graph.ops]
    assert all(t > 0 for t, k in zip(seconds, kernel) if k)
    assert all(t == 0 for t, k in zip(seconds, kernel) if not k)
    # the worker's loop and the bare interpreter charge the same nodes to the same ops
    assert ((seconds > 0) == (time_step_ops(step, reps=1) > 0)).all()


def test_op_times_pool_runs_so_one_slow_run_moves_no_median(monkeypatch) -> None:
    """The runs between bursts pool their timed steps: with one of three runs 10x slow
    (a slow spell of the host), every op's time and the step are the fast runs'; each
    burst runs once, between runs."""
    import types

    import meshplace.runtime.executor as executor

    step = trace_step(ModelSpec("mlp", batch=8))
    owned = [k for k, n in enumerate(step.gm.graph.nodes) if step.node_op.get(n.name, -1) >= 0]
    order: list[str] = []

    def fake_run(spec, devices, steps, *, warmup, **_options):
        slow = 10.0 if not order else 1.0  # the first run: in a slow spell
        order.append("run")
        spans = [(node, 0.0, slow * 1e-6 * (1 + k)) for k, node in enumerate(owned)]
        total = sum(end for _, _, end in spans)
        return types.SimpleNamespace(timelines=[[spans] * steps], step_times=[total] * steps)

    monkeypatch.setattr(executor, "run_placement", fake_run)
    bursts = [lambda: order.append("burst")] * 2
    pooled = time_ops_in_worker(step, reps=3, warmup=1, bursts=bursts)
    assert order == ["run", "burst", "run", "burst", "run"]
    order.clear()
    order.append("no slow spell")  # every run fast
    fast = time_ops_in_worker(step, reps=3, warmup=1)
    assert np.array_equal(pooled, fast) and fast.sum() > 0


def _two_operator_graph(rows: int) -> OpGraph:
    """GELUs and Adam-like muls of one kind (elementwise), ``rows`` x 512 floats each, and
    a bias-sized mul that does not change with the batch."""
    g = OpGraph(f"rows{rows}")
    for i in range(4):
        n = rows * 512
        g.add_op(
            Op(
                f"gelu{i}",
                "elementwise",
                target="aten.gelu.default",
                flops=8.0 * n,
                bytes_read=4.0 * n,
                bytes_written=4.0 * n,
                output_dtypes=["float32"],
            )
        )
        g.add_op(
            Op(
                f"mul{i}",
                "elementwise",
                target="aten.mul.Tensor",
                flops=float(n),
                bytes_read=4.0 * n,
                bytes_written=4.0 * n,
                output_dtypes=["float32"],
            )
        )
    g.add_op(
        Op(
            "bias",
            "elementwise",
            target="aten.add.Tensor",
            flops=512.0,
            bytes_read=2048.0,
            bytes_written=2048.0,
            output_dtypes=["float32"],
        )
    )
    return g


def _two_operator_times(g: OpGraph, bandwidth: float) -> np.ndarray:
    """The GELU a fixed 25 us plus its bytes at half the bandwidth, the mul 8 us plus its
    bytes at the bandwidth, the bias add 8 us."""
    fixed = {"aten.gelu.default": 25e-6, "aten.mul.Tensor": 8e-6, "aten.add.Tensor": 8e-6}
    rate = {"aten.gelu.default": 2.0, "aten.mul.Tensor": 1.0, "aten.add.Tensor": 1.0}
    return np.array(
        [
            fixed[o.target] + rate[o.target] * (o.bytes_read + o.bytes_written) / bandwidth
            for o in g.ops
        ]
    )


def test_a_fit_over_two_batch_sizes_prices_each_operators_fixed_cost_at_a_third() -> None:
    """One rate per op kind at one batch size put a pipeline's small micro-batches 30-40 %
    low: the GELU's fixed cost is three times the mul's. Timed at two sizes, each operator
    gets its own fixed cost and rate, and a third size is priced as it runs."""
    from meshplace.profile.calibrate import fit_cost_model, local_device_spec

    bandwidth = 1e10
    spec = local_device_spec(peak=1e12, bandwidth=bandwidth, launch=1e-6)
    big, small, middle = (_two_operator_graph(r) for r in (64, 8, 16))
    cost, report = fit_cost_model(
        big,
        _two_operator_times(big, bandwidth),
        spec,
        [(small, _two_operator_times(small, bandwidth))],
    )
    assert report["kinds"]["aten.gelu.default"]["fixed_s"] == pytest.approx(25e-6, rel=1e-3)
    assert report["kinds"]["aten.mul.Tensor"]["fixed_s"] == pytest.approx(8e-6, rel=1e-3)
    assert "aten.add.Tensor" not in report["kinds"]  # one size: it shares its kind's fit
    predicted = cost.op_times(middle, {spec.kind: spec})[spec.kind]
    expected = _two_operator_times(middle, bandwidth)
    gelu = [i for i, o in enumerate(middle.ops) if o.target == "aten.gelu.default"]
    np.testing.assert_allclose(predicted[gelu], expected[gelu], rtol=1e-3)
    mul = [i for i, o in enumerate(middle.ops) if o.target == "aten.mul.Tensor"]
    np.testing.assert_allclose(predicted[mul], expected[mul], rtol=1e-3)
    # a calibration file carries the operators' fits to another process's cost model
    from meshplace.cost.calibration import calibrated_cost_model, calibration_from_fit
    from meshplace.hardware import Cluster, Device

    device = {"peak_flops": 1e12, "memory_bandwidth": bandwidth}
    file = calibration_from_fit(spec.kind, device, report, None, "test")
    assert file.kernel_overhead_s["aten.gelu.default"] == pytest.approx(25e-6, rel=1e-3)
    cluster = Cluster("one", [Device("cpu0", spec.kind, spec)], [])
    again = calibrated_cost_model(file, cluster)
    np.testing.assert_allclose(
        again.op_times(middle, {spec.kind: spec})[spec.kind], predicted, rtol=1e-9
    )
    # fitted at the large size only, the kind's one fixed cost and rate miss the GELUs
    alone, _ = fit_cost_model(big, _two_operator_times(big, bandwidth), spec)
    once = alone.op_times(middle, {spec.kind: spec})[spec.kind]
    assert np.abs(once[gelu] / expected[gelu] - 1).max() > 0.1


def test_calibrations_micro_batch_is_the_most_of_8_4_2_whose_micro_batch_the_model_takes() -> None:
    """DMCCA's covariance divides by batch - 1: its batch of 4 does not split into 4
    micro-batches it can take, so calibration times it on 2 of 2."""
    from meshplace.graph.capture import CaptureError
    from meshplace.profile.calibrate import micro_step_of

    step = trace_step(ModelSpec("dmcca-small", batch=4))
    with pytest.raises(CaptureError, match="division by zero"):
        micro_step_of(step, 4)
    assert micro_step_of(step).inputs[0].shape[0] == 2
    assert micro_step_of(step, 1) is None
    assert micro_step_of(trace_step(ModelSpec("mlp", batch=6))).inputs[0].shape[0] == 3
    assert micro_step_of(trace_step(ModelSpec("mlp", batch=5))) is None


def test_a_micro_batch_the_model_cannot_run_gives_way_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Traced on fake tensors, a micro-batch may still fail when run (a factorisation of
    a batch-of-one covariance): calibration tries the next count, and says what it timed."""
    import sys

    # the module (the package's attribute of the same name is the function)
    calibration = sys.modules["meshplace.profile.calibrate"]
    real = calibration.time_step_ops

    def fails_on_one_row(step: Any, reps: int = 5, warmup: int = 1, threads: int = 1) -> Any:
        if step.inputs[0].shape[0] == 1:
            raise RuntimeError("linalg.cholesky: the input is not positive-definite")
        return real(step, reps, warmup, threads)

    monkeypatch.setattr(calibration, "time_step_ops", fails_on_one_row)
    step = trace_step(ModelSpec("mlp", batch=8))
    cal = calibrate(
        step, reps=1, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES, in_worker=False
    )
    assert cal.fit["micro_step"].startswith("timed")
    assert len(cal.fit["sizes"]) == 2
    with pytest.raises(RuntimeError, match="positive-definite"):  # a count given: no other
        calibrate(step, reps=1, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES,
                  in_worker=False, micro_batches=8)  # fmt: skip
    alone = calibrate(step, reps=1, link=FAKE_LINK, device=FAKE_DEVICE,
                      messages=FAKE_MESSAGES, in_worker=False, micro_batches=1)  # fmt: skip
    assert alone.fit["micro_step"].startswith("none") and len(alone.fit["sizes"]) == 1


def test_a_kind_whose_ops_are_all_launch_bound_keeps_the_default_efficiency() -> None:
    """An 8-byte fill taking 60 us beyond the launch says nothing about the fill rate: a
    scale fitted to it would cost an 8 MB fill for seconds. The fitted kinds keep their
    totals."""
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.profile.calibrate import fit_cost_model, local_device_spec

    g = OpGraph("g")
    for i in range(4):
        g.add_op(Op(f"m{i}", "matmul", flops=1e6 * (i + 1), output_dtypes=["float32"]))
    for i in range(3):  # tiny ops taking just the launch: what the launch is fitted to
        g.add_op(Op(f"e{i}", "elementwise", bytes_written=8.0, output_dtypes=["float32"]))
    g.add_op(Op("seed", "fill", bytes_written=8.0, output_dtypes=["float32"]))
    spec = local_device_spec(peak=1e10, bandwidth=1e10, launch=1e-6)
    launch = 1e-6
    times = [launch + 2e-4 * (i + 1) for i in range(4)] + [launch] * 3 + [launch + 6e-5]
    cost, report = fit_cost_model(g, np.array(times), spec)
    assert report["kinds"]["fill"]["launch_bound"] is True
    assert cost.efficiency_on(None, "fill") == CostModel().efficiency_on(None, "fill")
    assert report["kinds"]["fill"]["efficiency"] == CostModel().efficiency_on(None, "fill")[1]
    assert report["kinds"]["matmul"]["efficiency"] == pytest.approx(0.5)


def test_message_cost_fit_and_measure() -> None:
    assert fit_affine([(0, 1e-5), (1e6, 1e-5 + 1e-4)]) == pytest.approx((1e-5, 1e-10))
    assert fit_affine([(4, 2e-5), (1e6, 1e-5)])[1] == 0.0  # never a negative slope
    m = measure_message_cost(sizes=(4, 1 << 16), iters=20, kernels=5, rounds=2)
    _plausible_message_costs(m)
    assert len(m["samples"]) == 2 and len(m["cpu_samples"]) == 2


def test_spacing_dependent_message_cost() -> None:
    from meshplace.errors import InputError
    from meshplace.profile.calibrate import message_gaps, runtime_messages, spacing_cost
    from meshplace.profile.link import measure_message_spacing

    # the cost grows with log spacing between the measured rows, constant beyond them
    rows = [(1e-5, 1e-5, 2e-5), (1e-3, 3e-5, 6e-5)]
    s, r = spacing_cost(rows, [0.0, 1e-4, 10.0])
    assert s == pytest.approx([1e-5, 2e-5, 3e-5]) and r == pytest.approx([2e-5, 4e-5, 6e-5])
    with pytest.raises(InputError):
        spacing_cost([], [1.0])
    # gaps count from the same worker's previous message, sent or received
    gs, gr = message_gaps(
        np.array([1.0, 4.0]), np.array([2.0, 4.5]), np.array([0, 1]), np.array([1, 0])
    )
    assert gs.tolist() == [1.0, 2.0] and gr.tolist() == [2.0, 3.5]
    # the prediction with a spacing table: bursts cheaper than the fixed cost, spaced
    # messages dearer; the same graph without a table predicts as before
    step = trace_step(ModelSpec("mlp", batch=8))
    cal = calibrate(step, reps=2, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    n = step.graph.num_ops
    split = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    msgs = runtime_messages(step, np.array([0 if d == "cpu0" else 1 for d in split]))
    assert len(msgs["bytes"]) > 0 and set(msgs["src"].tolist()) | set(msgs["dst"].tolist()) <= {
        0,
        1,
    }
    fixed = cal.predict(step.graph, split)
    cal.messages = {**FAKE_MESSAGES, "spacing": [(1e-6, 0.0, 0.0), (1e-5, 0.0, 0.0)]}
    cheap = cal.predict(step.graph, split)
    cal.messages = {**FAKE_MESSAGES, "spacing": [(1e-6, 1e-3, 1e-3), (1e-5, 1e-3, 1e-3)]}
    dear = cal.predict(step.graph, split)
    assert cheap < fixed < dear
    m = measure_message_spacing(kernels=(0, 5), iters=20, rounds=1)
    # spacing and costs of a 4-byte message: microseconds, not seconds (nor NaN)
    assert len(m["rows"]) == 2 and all(0 <= x < 0.05 for row in m["rows"] for x in row)
    assert m["rows"][0][0] <= m["rows"][1][0]
    with pytest.raises(InputError):
        measure_message_spacing(kernels=())


def test_local_cluster_shape() -> None:
    spec = local_device_spec(1e10, 1e10, 1e-6)
    c = local_cluster(spec, 2e9, 5e-5, devices=3)
    assert len(c) == 3 and len(c.links) == 6


def test_link_fit_and_measure() -> None:
    bw, lat = fit_link([(0, 2e-5), (1e6, 2e-5 + 5e-4), (4e6, 2e-5 + 2e-3)])
    assert bw == pytest.approx(2e9, rel=1e-6) and lat == pytest.approx(2e-5, rel=1e-6)
    link = measure_link(sizes=(4, 1 << 16, 1 << 20), reps=3)
    # loopback TCP: more than 1 MB/s, less than 50 ms (the fit clips at 0, so a broken
    # measurement shows as NaN, a huge latency or a tiny bandwidth)
    assert link["bandwidth"] > 1e6 and 0 <= link["latency"] < 0.05 and len(link["samples"]) == 3


def test_collectives_are_measured_and_fitted_to_the_ring_formula() -> None:
    """``measure_collectives`` times each collective among 3 gloo processes, as DTensor
    runs it and as the process group does, and fits the ring formula's latency and
    bandwidth; the fit recovers a formula's own constants."""
    # 2 (p - 1) steps of (alpha + n / (p B)) for an all-reduce: alpha 50 us, B 2 GB/s, p 3
    ring = [(n, 4 * (5e-5 + n / 3 / 2e9)) for n in (4096, 1 << 20, 4 << 20)]
    latency, bandwidth = fit_collective("all_reduce", 3, ring)
    assert latency == pytest.approx(5e-5) and bandwidth == pytest.approx(2e9)
    # both ways in one set of processes (what a calibration records), and one way alone
    both = measure_collectives_by_engine(world_size=3, sizes=(4096, 1 << 18), reps=2)
    assert set(both) == {"dtensor", "c10d"}
    alone = measure_collectives(world_size=3, sizes=(4096, 1 << 18), reps=2, engine="c10d")
    for engine, got in [*both.items(), ("c10d", alone)]:
        assert got["world_size"] == 3 and got["engine"] == engine
        assert set(got["fits"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
        for kind, fit in got["fits"].items():
            assert 0 <= fit["latency_s"] < 0.5 and fit["bandwidth"] > 1e5, (engine, kind, fit)
            # the bytes asked for, rounded down to float32 elements the group divides
            sizes = [n for n, _ in got["samples"][kind]]
            assert all(0 <= a - n < 4 * 3 for n, a in zip(sizes, (4096, 1 << 18), strict=True))
            assert all(t > 0 for _, t in got["samples"][kind])
    with pytest.raises(InputError, match="at least 2"):
        measure_collectives(world_size=1)
    with pytest.raises(InputError, match="choose one of"):
        measure_collectives(engine="nccl-ish")
    with pytest.raises(InputError, match="choose one of"):
        measure_collectives_by_engine(engines=())


def test_profile_cli(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)
    out = tmp_path / "prof.json"
    # one device, named: by default every local device is profiled (a GPU too, where
    # there is one), into a combined file and one trace per device
    args = parser.parse_args(["mlp", "--devices", "cpu", "--runs", "1", "--out", str(out)])
    assert cmd_profile(args) == 0
    text = capsys.readouterr().out
    assert "top" in text and out.exists() and (tmp_path / "prof.trace.json").exists()
    with pytest.raises(InputError):
        cmd_profile(parser.parse_args(["mlp", "--levels", "kernel2"]))
    with pytest.raises(InputError):
        cmd_profile(parser.parse_args(["no-such-model", "--out", str(out)]))
    assert np.isfinite(json.loads(out.read_text())["step_s"]["model"])


def test_profiles_side_by_side_from_two_thread_counts(tmp_path) -> None:
    from meshplace.profile.profiler import (
        ProfileError,
        compare_profiles,
        load_profiles,
        save_profiles,
    )

    torch.manual_seed(0)
    inputs = [torch.randn(8, 16), torch.randn(8, 4)]
    one = profile_model(MLP(), inputs, name="mlp", runs=1, on="cpu", threads=1)
    two = profile_model(MLP(), inputs, name="mlp", runs=1, on="cpu", threads=2)
    assert one.device["name"] == "cpu" and one.device["threads"] == 1
    assert two.device["threads"] == 2 and two.label == "cpu (2 threads)"
    text = compare_profiles([one, two])
    assert "A: cpu (1 thread)" in text and "B: cpu (2 threads)" in text and "B/A" in text
    assert "op kind" in text and "addmm" in text and "fc1" in text
    save_profiles([one, two], tmp_path / "both.json")
    back = load_profiles(tmp_path / "both.json")
    assert [p.device["threads"] for p in back] == [1, 2]
    assert back[0].kinds == json.loads(json.dumps(one.kinds))
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ProfileError):
        load_profiles(tmp_path / "bad.json")
    with pytest.raises(ProfileError):  # no CUDA activity to read on a CPU
        profile_model(MLP(), inputs, levels=["kernel"], runs=1, on="cpu")


def test_profile_cli_devices_and_compare(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)
    a, b, both = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "both.json"
    for path, threads in ((a, "1"), (b, "2")):
        args = ["mlp", "--devices", "cpu", "--threads", threads, "--runs", "1", "--out"]
        assert cmd_profile(parser.parse_args([*args, str(path)])) == 0
    capsys.readouterr()
    assert cmd_profile(parser.parse_args(["--compare", str(a), str(b), "--out", str(both)])) == 0
    text = capsys.readouterr().out
    assert "cpu (1 thread) [a.json]" in text and "cpu (2 threads) [b.json]" in text
    assert json.loads(both.read_text())["format"] == "meshplace.profiles"
    assert cmd_profile(parser.parse_args(["--compare", str(both), "--json"])) == 0
    assert len(json.loads(capsys.readouterr().out)["profiles"]) == 2
    for bad in (
        ["--compare", str(tmp_path / "missing.json")],
        ["mlp", "--compare", str(a)],
        [],
        ["mlp", "--devices", "cuda:7"],
        ["mlp", "--devices", "cpu,cpu"],
        ["mlp", "--devices", "cpu", "--levels", "kernel"],
    ):
        with pytest.raises(InputError):
            cmd_profile(parser.parse_args(bad))


def test_runtime_message_costs_count_the_executors_messages() -> None:
    from meshplace.profile.calibrate import runtime_message_costs, runtime_update_messages
    from meshplace.runtime import run_placement

    step = trace_step(ModelSpec("mlp", batch=4))
    n = step.graph.num_ops
    unit = {"send_s": 1.0, "send_s_per_byte": 0.0, "recv_s": 0.0, "recv_s_per_byte": 0.0}
    assert not runtime_message_costs(step, np.zeros(n, dtype=np.int64), unit).any()
    split = np.array([0 if i < n // 2 else 1 for i in range(n)])
    run = run_placement(None, [f"cpu{d}" for d in split], 1, step=step, start_method="fork")
    sends = runtime_message_costs(step, split, unit).sum()
    assert sends == run.messages > 0  # one per fx value, leaf and consuming worker
    # new parameters and Adam moments computed away from their owner go back at the end
    updates = runtime_update_messages(step, split)
    assert 0 < len(updates) <= 3 * len(step.param_names)
    assert all(src != dst and b > 0 for src, dst, b in updates)
    assert runtime_update_messages(step, np.zeros(n, dtype=np.int64)) == []
    recv = dict(unit, send_s=0.0, recv_s=1.0)
    assert runtime_message_costs(step, split, recv).sum() == sends
    cal = calibrate(step, reps=2, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    devices = [f"cpu{d}" for d in split]
    # the exact runtime messages cost at least what one message per transfer would
    assert cal.predict(step.graph, devices) >= 0.99 * predict_step(
        step.graph, cal.cluster, cal.cost_model, devices, in_order=True
    )


def test_kernel_level_reader_finds_no_gpu_kernels_on_a_cpu() -> None:
    from meshplace.profile.profiler import _kernel_profiler, _kernel_times

    prof = _kernel_profiler()
    with prof:
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
    assert _kernel_times(prof) == {}


def test_message_cost_inside_the_models_step() -> None:
    from meshplace.profile.link import measure_message_cost_in_step

    step = trace_step(ModelSpec("mlp", batch=4))
    m = measure_message_cost_in_step(step, sizes=(4, 4096), messages=10, rounds=1)
    _plausible_message_costs(m)
    assert len(m["samples"]) == 2 and m["messages_per_step"] >= 10


def test_in_situ_message_costs_from_probe_runs() -> None:
    from meshplace.profile.calibrate import (
        calibrate_in_situ,
        probe_placements,
        runtime_update_messages,
    )

    step = trace_step(ModelSpec("mlp", batch=8))
    cal = calibrate(step, reps=3, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    n = step.graph.num_ops
    lone = ["cpu0"] * n
    probes = probe_placements(step)
    # the probes are two-worker plans, each with messages
    assert sorted(probes) == ["blocks16", "blocks2", "blocks4", "scatter", "tail"]
    assert all(len(set(p)) == 2 and len(p) == n for p in probes.values())
    half = ["cpu0" if i < n // 2 else "cpu1" for i in range(n)]
    before = cal.predict(step.graph, half), cal.predict(step.graph, lone)
    report = calibrate_in_situ(cal, steps=3, warmup=1)
    assert cal.messages["in_situ"] is report
    keys = ("start_s", "send_s", "wake_s", "compute_slowdown")
    assert {*keys, "recv_s", "r2", "probes"} <= set(report)
    # non-negative by construction (the fit keeps them so) and finite; how large the
    # slowdown comes out is the machine's load, not the code's (a suite on 2 busy cores
    # measured 10x), so no bound on it is asserted
    assert all(np.isfinite(report[k]) and report[k] >= 0 for k in keys)
    # every probe puts messages on the wire: some worker of each sends
    for name in probes:
        assert any(r["sends"] > 0 for r in report["probes"] if r["placement"] == name), name
    assert 0 < report["recv_s"] < 0.01  # a receive whose data is there: microseconds
    assert len(report["probes"]) == 2 * len(probes)  # one row per probe and worker
    after = cal.predict(step.graph, half), cal.predict(step.graph, lone)
    assert after[1] == pytest.approx(before[1])  # one worker, no messages: unchanged
    # two workers: the in-situ costs replace the micro-benchmark's (and a split step still
    # takes at least half the lone one)
    assert after[0] != before[0] and after[0] > 0.5 * before[1]
    # the exchange that ends a step (new values sent to their owners after the walk) has
    # its own fitted cost per message, from every probe's measured walk ends and step
    assert 0 <= report["update_s"] <= 1e-3
    assert [e["placement"] for e in report["exchanges"]] == list(probes)
    assert any(e["update_messages"] > 0 for e in report["exchanges"])
    assert all(e["step_s"] >= e["walk_end_s"] > 0 for e in report["exchanges"])
    # and the prediction charges it: the half split sends values after its walk, so a
    # dearer exchange makes it dearer, while the lone worker's step stays as it was
    assert runtime_update_messages(step, np.array([int(d[-1]) for d in half]))
    cal.messages = {**cal.messages, "in_situ": {**report, "update_s": report["update_s"] + 1e-3}}
    assert cal.predict(step.graph, half) > after[0]
    assert cal.predict(step.graph, lone) == pytest.approx(after[1])
    # what a message took to a worker already waiting for it, inside the probes' steps
    # (every probe waits on some message: its later worker on its first value at least):
    # the links the predictions simulate on take it as their latency
    assert report["hops"] > 0 and report["hop_latency_s"] is not None
    assert report["hop_latency_p90_s"] >= report["hop_latency_median_s"]
    assert {lk.latency for lk in cal.simulated_cluster().links} == {report["hop_latency_s"]}
    assert {lk.latency for lk in cal.simulator().cluster.links} == {report["hop_latency_s"]}
    # a hop 10 ms slower makes the split step (whose second worker waits on the first at
    # least once) dearer by about that and leaves the lone worker's as it was; without
    # an in-situ report the calibrated latency stands
    cal.messages = {**cal.messages, "in_situ": report}
    now = cal.predict(step.graph, half)
    slower = report["hop_latency_s"] + 0.01
    cal.messages = {**cal.messages, "in_situ": {**report, "hop_latency_s": slower}}
    assert cal.predict(step.graph, half) > now + 0.009, (now, slower)
    assert cal.predict(step.graph, lone) == pytest.approx(after[1])
    assert cal.simulated_cluster().links[0].latency == slower
    cal.messages = {k: v for k, v in cal.messages.items() if k != "in_situ"}
    kept = cal.simulated_cluster()  # the calibrated latency, spent in flight
    assert [lk.latency for lk in kept.links] == [lk.latency for lk in cal.cluster.links]
    assert all(lk.latency_overlaps for lk in kept.links)
    with pytest.raises(InputError):
        calibrate_in_situ(Calibration(cal.cluster, cal.cost_model, cal.op_times, {}, {}, {}))
    with pytest.raises(InputError, match="at least one round"):
        calibrate_in_situ(cal, rounds=0)


def test_waited_hop_latencies_count_only_the_receives_that_waited() -> None:
    """A hop is a receive that began before the node it reads ended: its end minus that
    node's end, less the value's time on the wire, never below zero; a receive of a value
    already sent, of a value no timeline produced, or in a warm-up step is none."""
    from meshplace.profile.calibrate import waited_hop_latencies

    step = [
        [(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.0, 2.1)],  # worker 0 makes 0, 1 and 2
        [
            (-1, 0.5, 1.5),  # waited for 0 (ended 1.0): a hop of 0.5 less 0.1 on the wire
            (-2, 2.5, 2.6),  # asked for 1 after it was sent (2.0): no hop
            (-3, 1.9, 2.1),  # waited for 2 (ended 2.1), arrived as it ended: clamped to 0
            (-8, 0.0, 3.0),  # a value no worker's timeline made: no hop
        ],
    ]
    warm = [[(0, 0.0, 1.0)], [(-1, 0.0, 9.0)]]  # a warm-up step's hop of 8 s: not counted
    timelines = [[warm[0], step[0]], [warm[1], step[1]]]
    hops = waited_hop_latencies(timelines, 1, {0: 100.0, 1: 100.0, 2: 100.0}, 1000.0)
    assert hops == pytest.approx([0.4, 0.0])
    assert waited_hop_latencies(timelines, 2, {}, 1000.0) == []


def test_placers_search_with_the_calibrated_model() -> None:
    from meshplace.placers.base import PlacementProblem

    step = trace_step(ModelSpec("mlp", batch=8))
    cal = calibrate(step, reps=3, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    sim = cal.simulator()
    assert sim.in_order and sim.cost_model is cal.cost_model
    calibrated = PlacementProblem(step.graph, cal.cluster, simulator=sim)
    # the same links as the calibrated simulator's (latency in flight), so the two differ
    # only in what the calibration adds; against cal.cluster, whose links hold their
    # latency, the comparison would weigh that hold against the CPU and be a coin flip
    default = PlacementProblem(step.graph, cal.simulated_cluster())
    n = step.graph.num_ops
    half = np.array([0 if i < n // 2 else 1 for i in range(n)])
    # the calibrated model charges each transfer's CPU to the workers: a split costs more
    assert calibrated.evaluate_ops(half).step_time_s > default.evaluate_ops(half).step_time_s
    lone = np.zeros(n, dtype=np.int64)  # one worker: the same op times either way
    assert calibrated.evaluate_ops(lone).step_time_s == pytest.approx(
        default.evaluate_ops(lone).step_time_s
    )


def _profile_exits_2(argv: list[str], capsys) -> str:
    """``meshplace profile ARGV`` (in this process) exits 2 with one line on stderr."""
    from meshplace.cli import main

    code = main(["profile", *argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["mlp", "--runs", "0"], "argument --runs: expected a positive integer, got '0'"),
        (["mlp", "--threads", "-2"], "argument --threads: expected a positive integer"),
        (["mlp", "--batch", "0"], "argument --batch: expected a positive integer"),
        (["mlp", "--top", "-1"], "argument --top: expected a positive integer"),
        (
            ["mlp", "--build-timeout", "-1"],
            "argument --build-timeout: seconds must be finite and positive",
        ),
        (["mlp", "--out", "missing/p.json"], "--out missing/p.json: cannot write there"),
        (["mlp", "--out", "."], "--out .: is a folder, not a file"),
        (["mlp", "--trace", "missing/t.json"], "--trace missing/t.json: cannot write there"),
        (["mlp", "--out", "p.json", "--trace", "p.json"], "are the same file"),
    ],
)
def test_profile_checks_arguments_before_measuring(
    argv: list[str], expected: str, tmp_path, monkeypatch, capsys
) -> None:
    import meshplace.profile.cli as profile_cli

    monkeypatch.chdir(tmp_path)

    def no_work(*args: object) -> None:
        raise AssertionError("profiled before checking the arguments")

    monkeypatch.setattr(profile_cli, "_profile_on", no_work)
    line = _profile_exits_2(argv, capsys)
    assert expected in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        # the reading itself is meshplace.util.read_json_file's (its wording is its own)
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", ""),
        (b"step_s: 1\n", ""),
        (b"[" * 100_000 + b"]" * 100_000, ""),
        (
            b'{"format": "meshplace.profile", "version": 1, "name": "m", "levels": ["model"], '
            b'"runs": 1, "step_s": {"model": "fast"}}',
            "step_s['model'] must be a number",
        ),
        (b'{"format": "meshplace.profiles", "version": 1, "profiles": 3}', "'profiles' must"),
        (b'{"format": "meshplace.profile", "name": "m"}', "lacks the field 'levels'"),
        (b'{"format": "other"}', "not a profile file"),
    ],
)
def test_compare_names_a_file_that_is_no_profile(
    content: bytes, expected: str, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.json").write_bytes(content)
    line = _profile_exits_2(["--compare", "x.json"], capsys)
    assert "x.json" in line and expected in line, line


def test_compare_will_not_overwrite_an_input(tmp_path, monkeypatch, capsys) -> None:
    from meshplace.profile.profiler import Profile

    monkeypatch.chdir(tmp_path)
    Profile("m", ["model"], 1, {"model": 1e-3}, {}).save("a.json")
    before = (tmp_path / "a.json").read_text()
    line = _profile_exits_2(["--compare", "a.json", "--out", "a.json"], capsys)
    assert "is also an input" in line
    assert (tmp_path / "a.json").read_text() == before


def test_profile_of_a_failing_build_is_one_sentence(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text("def build():\n    raise KeyError('weights')\n")
    line = _profile_exits_2(["model.py:build", "--out", "p.json"], capsys)
    assert "model.py:build: build() failed with KeyError" in line, line
    assert not (tmp_path / "p.json").exists()


def test_link_measurements_leave_no_temporary_folder(tmp_path, monkeypatch) -> None:
    import tempfile

    from meshplace.profile.link import measure_message_spacing

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the stores' folders go here
    measure_link(sizes=(4, 4096), reps=2)
    measure_message_spacing(kernels=(0,), iters=5, rounds=1)
    # (torch may put its own caches there: torchinductor_<user>)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("meshplace-")] == []


def test_mixed_cpu_and_gpu_calibration_costs_each_kind_by_its_own_times() -> None:
    """combine_calibrations on this machine: the "GPU" calibration is the CPU one with its
    op times halved under the local-cuda kind, so a plan's prediction must follow the kind
    of the device each op is placed on."""
    import dataclasses

    from meshplace.profile.calibrate import (
        LOCAL_GPU_KIND,
        LOCAL_KIND,
        OpTimes,
        combine_calibrations,
    )

    step = trace_step(ModelSpec("mlp", batch=4))
    cpu = calibrate(step, reps=2, link=FAKE_LINK, device=FAKE_DEVICE, messages=FAKE_MESSAGES)
    gspec = local_device_spec(1e12, 1e11, 1e-6, gpu=True)
    halved = OpTimes(LOCAL_GPU_KIND, {s: t / 2 for s, t in cpu.op_times.times.items()})
    assert halved.attach(step.graph) > 0
    gpu = dataclasses.replace(
        cpu,
        cluster=local_cluster(gspec, FAKE_LINK["bandwidth"], FAKE_LINK["latency"]),
        cost_model=CostModel(
            launch_overhead={LOCAL_GPU_KIND: 1e-6},
            message_cpu={LOCAL_GPU_KIND: cpu.cost_model.message_cpu[LOCAL_KIND]},
            gradient_accumulation={LOCAL_GPU_KIND: 2e-11},
        ),
        op_times=halved,
        device={**FAKE_DEVICE, "peak_flops": 1e12},
        fit={"launch_overhead_s": 1e-6},
    )
    both = combine_calibrations(cpu, gpu, ["cuda:0", "cpu"])
    assert both.cluster.device_names == ["gpu0", "cpu0"]
    assert [d.kind for d in both.cluster.devices] == [LOCAL_GPU_KIND, LOCAL_KIND]
    assert both.cost_model.gradient_accumulation[LOCAL_GPU_KIND] == 2e-11  # each kind's own
    n = step.graph.num_ops
    on_cpu = both.predict(step.graph, ["cpu0"] * n)
    on_gpu = both.predict(step.graph, ["gpu0"] * n)
    assert on_cpu == pytest.approx(cpu.predict(step.graph, ["cpu0"] * n))
    assert on_gpu == pytest.approx(on_cpu / 2, rel=0.05)
    split = ["gpu0" if i < n // 2 else "cpu0" for i in range(n)]
    assert both.predict(step.graph, split) > on_gpu  # messages and the CPU's half
    # the calibration file of a mixed run describes its first worker's kind, with that
    # kind's own measurements
    written = both.cost_calibration()
    assert written.device_kind == LOCAL_GPU_KIND and written.peak_flops == 1e12
    with pytest.raises(InputError, match="CPU and GPU workers"):
        from meshplace.profile.calibrate import calibrate_mixed

        calibrate_mixed(step, ["cpu", "cpu"], spec=None)
