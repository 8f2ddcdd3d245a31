"""Pipeline schedules simulated (issue 18, item 1): the bubble of GPipe, 1F1B and
interleaved 1F1B equals its closed form with equal stages and free transfers, 1F1B holds
at most ``min(p - i, m)`` micro-batches on stage ``i``, and unequal stages, transfers and
the gradient reduction only ever lengthen a step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.errors import InputError
from meshplace.sim.schedule import (
    StageTimes,
    closed_form_bubble,
    device_orders,
    simulate_schedule,
)

_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(
    p=st.integers(1, 8),
    m=st.integers(1, 24),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    forward=st.floats(0.1, 10.0),
    ratio=st.floats(0.5, 3.0),
)
def test_the_bubble_is_the_closed_form(p, m, schedule, forward, ratio) -> None:
    r = simulate_schedule(StageTimes.uniform(p, forward, forward * ratio), schedule, m)
    assert r.bubble_fraction == pytest.approx(closed_form_bubble(schedule, p, m), abs=0.01)
    assert r.step_s == pytest.approx((m + p - 1) * forward * (1 + ratio), rel=1e-9)
    expected_peak = [min(p - i, m) for i in range(p)] if schedule == "1f1b" else [m] * p
    assert r.peak_in_flight == expected_peak


@_settings
@given(
    p=st.integers(1, 6),
    groups=st.integers(1, 4),
    v=st.integers(1, 4),
    forward=st.floats(0.1, 10.0),
)
def test_the_interleaved_bubble_shrinks_by_the_chunks(p, groups, v, forward) -> None:
    m = groups * p  # Megatron-LM's rule: micro-batches a multiple of the stages
    # each device's model split into v chunks: each chunk takes 1/v of the time
    times = StageTimes.uniform(p * v, forward / v, 2 * forward / v)
    r = simulate_schedule(times, "interleaved", m, virtual=v)
    closed = closed_form_bubble("interleaved", p, m, v)
    assert r.bubble_fraction == pytest.approx(closed, abs=0.01)
    assert r.bubble_fraction <= closed_form_bubble("1f1b", p, m) + 1e-9
    # every task ran once, each device ran only its own chunks
    assert len(r.tasks) == 2 * m * p * v
    assert all(t["stage"] % p == t["device"] for t in r.tasks)


@_settings
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 12),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_unequal_stages_transfers_and_reductions_only_lengthen_a_step(p, m, schedule, seed) -> None:
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.1, 3.0, p), rng.uniform(0.1, 6.0, p)
    free = simulate_schedule(StageTimes(f, b), schedule, m)
    # no device can finish before doing its own work, nor a micro-batch cross all stages
    assert free.step_s >= m * float((f + b).max()) * (1 - 1e-12)
    assert free.step_s >= float((f + b).sum()) * (1 - 1e-12)
    wires = StageTimes(f, b, rng.uniform(0, 1, p - 1), rng.uniform(0, 1, p - 1))
    assert simulate_schedule(wires, schedule, m).step_s >= free.step_s * (1 - 1e-12)
    reduce = rng.uniform(0, 2, p)
    reduced = simulate_schedule(StageTimes(f, b, allreduce_s=reduce), schedule, m)
    assert reduced.step_s >= free.step_s * (1 - 1e-12)
    assert reduced.step_s <= free.step_s + reduce.max() + 1e-9
    # the data dependencies hold: a forward after the previous stage's, a backward after
    # the next stage's (and the last stage's after its own forward)
    end = {(t["kind"], t["stage"], t["micro_batch"]): t for t in free.tasks}
    for (kind, s, mb), t in end.items():
        if kind == "F" and s > 0:
            assert t["start_s"] >= end[("F", s - 1, mb)]["end_s"] - 1e-12
        if kind == "B":
            before = end[("B", s + 1, mb)] if s < p - 1 else end[("F", s, mb)]
            assert t["start_s"] >= before["end_s"] - 1e-12


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe_for_the_same_time() -> None:
    times = StageTimes.uniform(4, 1.0, 2.0)
    gpipe, one = simulate_schedule(times, "gpipe", 16), simulate_schedule(times, "1f1b", 16)
    assert gpipe.step_s == one.step_s
    assert max(one.peak_in_flight) == 4 < max(gpipe.peak_in_flight) == 16


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("zigzag", 2, 4), "unknown pipeline schedule 'zigzag'"),
        (("1f1b", 0, 4), "at least 1 stage"),
        (("interleaved", 4, 6, 2), "a multiple of the stages"),
        (("gpipe", 2, 4, 2), "only the interleaved schedule"),
    ],
)
def test_bad_schedules_are_one_sentence(args, words) -> None:
    with pytest.raises(InputError, match=words):
        device_orders(*args)


def test_a_placed_pipeline_is_read_stage_by_stage_and_simulated_from_the_plan(
    tmp_path, capsys
) -> None:
    """Forward and backward chains split over two GPUs: stage times are each device's
    forward (backward) ops per micro-batch, the transfers a micro-batch's share of the
    crossing bytes; ``meshplace simulate`` of a plan with micro-batches runs the plan's
    schedule (its meta.schedule, default 1F1B)."""
    import json

    from meshplace.cli import main
    from meshplace.graph.io import save_graph
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.hardware import load_cluster
    from meshplace.plan.placement import Plan, save_plan
    from meshplace.sim.schedule import pipeline_of_placement
    from meshplace.sim.simulator import Simulator

    g = OpGraph("chain")
    for i in range(4):
        g.add_op(Op(f"f{i}", "matmul", flops=4e9, memory_bytes=8e6))
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}", 8e6)
    for i in reversed(range(4)):
        g.add_op(Op(f"b{i}", "matmul", phase="backward", flops=8e9, forward_op=f"f{i}"))
        g.add_edge(f"f{i}", f"b{i}", 8e6)
        if i < 3:
            g.add_edge(f"b{i + 1}", f"b{i}", 8e6)
    g.add_edge("f3", "b3", 8e6)
    devices = ["gpu0", "gpu0", "gpu1", "gpu1", "gpu1", "gpu1", "gpu0", "gpu0"]  # f0..f3, b3..b0
    cluster = load_cluster("colocrl-2gpu")
    sim = Simulator(g, cluster)
    placement = sim.placement_of(devices)
    pipe = pipeline_of_placement(sim, placement, 4)
    assert [sim.device_names[d] for d in pipe.devices] == ["gpu0", "gpu1"]
    t = sim.op_times(placement)
    launch = cluster.devices[1].spec.launch_overhead_s
    assert pipe.times.forward_s[0] == pytest.approx(2 * ((t[0] - launch) / 4 + launch))
    assert pipe.times.backward_s[1] == pytest.approx(2 * ((t[4] - launch) / 4 + launch))
    assert pipe.times.activation_s[0] == pytest.approx(cluster.transfer_time(1, 2, 2e6))
    assert pipe.times.gradient_s[0] == pytest.approx(cluster.transfer_time(2, 1, 2e6))
    assert pipeline_of_placement(sim, placement, 1) is not None
    assert pipeline_of_placement(sim, np.full(8, 1), 4) is None  # one stage
    # memory: each stage keeps its two forward outputs per micro-batch in flight (a
    # quarter of 8 MB each), or under full recomputation only the activation it received,
    # plus one micro-batch's outputs rebuilt for its backward
    assert list(pipe.activation_bytes) == [4e6, 4e6] and list(pipe.input_bytes) == [0, 2e6]
    one_f_one_b = simulate_schedule(pipe.times, "1f1b", 4)
    assert pipe.memory_bytes(one_f_one_b) == [8e6, 4e6]
    assert pipe.memory_bytes(one_f_one_b, "full") == [4e6, 6e6]
    assert pipe.memory_bytes(simulate_schedule(pipe.times, "gpipe", 4)) == [16e6, 16e6]
    with pytest.raises(InputError, match="unknown recomputation 'some'"):
        pipe.memory_bytes(one_f_one_b, "some")

    save_graph(g, tmp_path / "g.json")
    for meta, peak in (({}, [2, 1]), ({"schedule": "gpipe"}, [4, 4])):
        plan = Plan.from_devices(g, "colocrl-2gpu", devices, micro_batches=4, meta=meta)
        save_plan(plan, tmp_path / "p.json")
        argv = ["simulate", "--graph", str(tmp_path / "g.json"), "--cluster", "colocrl-2gpu"]
        assert main([*argv, "--plan", str(tmp_path / "p.json"), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)["pipeline"]
        assert out["peak_in_flight"] == peak and out["devices"] == ["gpu0", "gpu1"]
        assert out["memory_bytes"] == [p * 4e6 for p in peak]
        assert out["step_s"] > 0 and 0 < out["bubble_fraction"] < 1
    one = Plan.from_devices(g, "colocrl-2gpu", devices)
    save_plan(one, tmp_path / "p1.json")
    assert main([*argv, "--plan", str(tmp_path / "p1.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"] is None


def test_a_placed_pipeline_pays_the_calibrated_exchange_at_its_cut() -> None:
    """A cost model with a measured exchange (seconds per beat, per further value) charges
    each stage of an op placement read as a pipeline the beat plus the per-value cost for
    every value crossing its cut but the first, half on its forward and half on its
    backward — what the hybrid search charges a stage (``HostCosts``); the engine's cost
    alone where only that is calibrated; nothing without either (the uncalibrated
    simulator is unchanged). The exchange, measured over the link, holds the messages'
    latency: where it is charged, the wire between the stages keeps only the bytes'
    time."""
    from meshplace.cost.compute import CostModel
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.hardware import load_cluster
    from meshplace.sim.schedule import pipeline_of_placement
    from meshplace.sim.simulator import Simulator

    g = OpGraph("chain")
    for i in range(4):
        g.add_op(Op(f"f{i}", "matmul", flops=4e9, memory_bytes=8e6, output_shapes=[[8, 4]]))
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}", 8e6)
    g.add_edge("f0", "f2", 8e6)  # a second value crosses the cut: two messages a beat
    for i in reversed(range(4)):
        g.add_op(Op(f"b{i}", "matmul", phase="backward", flops=8e9, forward_op=f"f{i}"))
        g.add_edge(f"f{i}", f"b{i}", 8e6)
        if i < 3:
            g.add_edge(f"b{i + 1}", f"b{i}", 8e6)
    devices = ["gpu0", "gpu0", "gpu1", "gpu1", "gpu1", "gpu1", "gpu0", "gpu0"]
    cluster = load_cluster("colocrl-2gpu")
    kind = cluster.devices[1].kind
    beat, per_value, engine = 2e-3, 5e-4, 7e-4

    def read(cost_model: CostModel | None) -> tuple[Any, float]:
        sim = Simulator(g, cluster, cost_model)
        placement = sim.placement_of(devices)
        result = sim.simulate(placement, objective="throughput", micro_batches=4)
        return pipeline_of_placement(sim, placement, 4), result.throughput_time_s

    plain, plain_step = read(None)
    wire = cluster.transfer_time(1, 2, 2e6 * 2)  # two 8 MB values a quarter each
    latency = cluster.path_latency(1, 2)
    assert plain.times.activation_s[0] == pytest.approx(wire)
    for cost_model, per_stage in (
        (CostModel(pipeline_exchange={kind: (beat, per_value)}), beat + per_value),
        (CostModel(pipeline_overhead={kind: engine}), engine),
        (CostModel(pipeline_overhead={kind: engine}, pipeline_exchange={kind: (beat, 0.0)}), beat),
    ):
        charged, step = read(cost_model)
        # the measured exchange holds the messages' latency: the wire keeps the bytes' time
        held = latency if cost_model.pipeline_exchange else 0.0
        assert charged.times.activation_s[0] == pytest.approx(wire - held)
        assert charged.times.gradient_s[0] == pytest.approx(plain.times.gradient_s[0] - held)
        np.testing.assert_allclose(charged.times.forward_s - plain.times.forward_s, per_stage / 2)
        np.testing.assert_allclose(charged.times.backward_s - plain.times.backward_s, per_stage / 2)
        assert step > plain_step
    unchanged, step = read(CostModel())
    np.testing.assert_array_equal(unchanged.times.forward_s, plain.times.forward_s)
    assert step == plain_step


def test_weights_are_read_and_cast_whole_in_every_micro_batch() -> None:
    """Two stages of a memory-bound layer each (a 64 MB weight, a 1 MB activation): a
    micro-batch divides the activation's bytes, not the weight's, so a quarter of the batch
    costs nearly what the whole batch does (the roofline on the weight's bytes plus a
    quarter of the rest), and the stage whose weight goes through a cast (compute no
    input reaches, run again in each micro-batch's forward) pays the cast whole too. The
    backward reads the weight and writes its gradient whole in each as well (the chain
    above, without weights, divides everything), and each micro-batch after the first adds
    its gradient into the held one (3 x its bytes)."""
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.hardware import load_cluster
    from meshplace.sim.schedule import pipeline_of_placement
    from meshplace.sim.simulator import Simulator

    weight, activation = 64e6, 1e6

    def layered() -> OpGraph:
        g = OpGraph("weights")
        g.add_op(Op("x", "input", output_shapes=[[1]]))
        for i in range(2):
            g.add_op(Op(f"w{i}", "parameter", param_bytes=int(weight)))
            g.add_op(Op(f"c{i}", "elementwise", bytes_read=weight, bytes_written=weight))
            g.add_edge(f"w{i}", f"c{i}", weight)
            g.add_op(
                Op(f"f{i}", "matmul", flops=1e6, bytes_read=weight + activation,
                   bytes_written=activation)
            )  # fmt: skip
            g.add_edge(f"c{i}", f"f{i}", weight)
            g.add_edge("f0" if i else "x", f"f{i}", activation)
        for i in reversed(range(2)):
            g.add_op(
                Op(f"b{i}", "matmul", phase="backward", flops=2e6,
                   bytes_read=weight + activation, bytes_written=weight, forward_op=f"f{i}")
            )  # fmt: skip
            g.add_edge(f"f{i}", f"b{i}", activation)
            g.add_edge(f"c{i}", f"b{i}", weight)
            if i == 0:
                g.add_edge("b1", "b0", activation)
            g.add_op(Op(f"u{i}", "elementwise", phase="update", bytes_read=weight))
            g.add_edge(f"b{i}", f"u{i}", weight)
        return g

    cluster = load_cluster("colocrl-2gpu")
    g = layered()
    stage_of = {"0": "gpu0", "1": "gpu1"}
    sim = Simulator(g, cluster)
    placement = sim.placement_of([stage_of.get(o.name[-1], "gpu0") for o in g.ops])
    t = dict(zip([o.name for o in g.ops], sim.op_times(placement), strict=True))
    launch = cluster.devices[1].spec.launch_overhead_s
    pipe = pipeline_of_placement(sim, placement, 4)
    per_byte = (t["f1"] - launch) / (weight + 2 * activation)  # memory-bound
    # the weight (and its gradient) whole, the activations a quarter, the cast whole
    forward = t["c1"] + launch + per_byte * (weight + 2 * activation / 4)
    # ... and three of the four micro-batches add their 64 MB gradient into the held one
    spec = cluster.devices[1].spec
    rate = spec.memory_bandwidth * sim.cost_model.efficiency_on(spec.kind, "elementwise")[1]
    accumulate = (3 * weight / rate + launch) * 3 / 4
    backward = launch + per_byte * (2 * weight + activation / 4) + accumulate
    assert pipe.times.forward_s[1] == pytest.approx(forward, rel=1e-9)
    assert pipe.times.backward_s[1] == pytest.approx(backward, rel=1e-9)
    assert backward > 0.9 * t["b1"] and forward > 0.9 * (t["c1"] + t["f1"])


def test_the_exchange_is_the_median_of_its_probes(monkeypatch) -> None:
    """Each of the beat and the further values' cost is the median over the probes'
    pairs of processes, each pair timing its share of the rounds: one pair in a slow
    spell of the host (a beat 7x the others') moves neither."""
    from meshplace.runtime import pipeline_exchange

    seen: list[int] = []
    beats = iter([5.4e-3, 0.8e-3, 0.7e-3])  # the first pair: in a slow spell

    def one_pair(micro_batches: int, reps: int, rows: int, width: int):
        seen.append(reps)
        return pipeline_exchange.PipelineExchange(beat_s=next(beats), message_s=3e-4 * len(seen))

    monkeypatch.setattr(pipeline_exchange, "_probe_once", one_pair)
    measured = pipeline_exchange.measure_pipeline_exchange(reps=20)
    assert seen == [7, 7, 7]  # 20 rounds over 3 pairs, rounded up
    assert measured.beat_s == 0.8e-3 and measured.message_s == pytest.approx(6e-4)
    with pytest.raises(InputError, match="1 probe or more"):
        pipeline_exchange.measure_pipeline_exchange(probes=0)
