"""One pipeline objective (issue 18, item 4): the throughput objective is the simulated
schedule of the placement read as a pipeline, at its fastest micro-batch count, or one
plain step; a graph without a batch is scored by the steady state."""

from __future__ import annotations

import numpy as np
import pytest

from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.sources import workload_graph
from meshplace.hardware import load_cluster
from meshplace.sim.schedule import (
    StageTimes,
    device_orders,
    micro_batch_choices,
    pipeline_of_placement,
    simulate_schedule,
)
from meshplace.sim.simulator import Simulator


def reference_pipeline(sim: Simulator, placement: np.ndarray, m: int):
    """The reading of a placement as a pipeline, op by op and edge by edge (the
    vectorised :class:`PipelineReader` must agree): stages in a topological order of the
    activations between them, ties to the first forward compute op (networkx); ``None``
    if activations flow both ways, a device outside the stages runs compute, or there is
    one stage."""
    import networkx as nx

    graph = sim.graph
    ops = graph.ops
    compute = [o.kind not in ("parameter", "buffer", "input") for o in ops]
    first: dict[int, int] = {}
    for position, i in enumerate(sim.arrays.topo_order.tolist()):
        if ops[i].phase == "forward" and compute[i]:
            first.setdefault(int(placement[i]), position)
    if len(first) < 2:
        return None
    flows = nx.DiGraph()
    flows.add_nodes_from(first)
    for s, d, _ in graph.edges():
        a, b = int(placement[s]), int(placement[d])
        forward = ops[s].phase == "forward" and ops[d].phase == "forward"
        if forward and a != b and a in first and b in first:
            flows.add_edge(a, b)
    if not nx.is_directed_acyclic_graph(flows):
        return None
    stages = list(nx.lexicographical_topological_sort(flows, key=first.__getitem__))
    if any(compute[i] and int(placement[i]) not in first for i in range(graph.num_ops)):
        return None
    j_of = {d: j for j, d in enumerate(stages)}
    p = len(stages)
    times = sim.op_times(placement)
    # what a micro-batch does not divide: compute no input reaches runs whole in each;
    # an op reading a weight (or such compute's output), or writing a gradient the
    # update reads, moves those bytes whole in each, and its roofline says the rest
    dag = graph.to_networkx()
    index = {o.name: i for i, o in enumerate(ops)}
    reached = set()
    for i, o in enumerate(ops):
        if o.kind == "input":
            reached |= {i} | {index[x] for x in nx.descendants(dag, o.name)}
    if not any(o.kind == "input" for o in ops):
        reached = set(range(len(ops)))
    per_step = [compute[i] and i not in reached and o.phase != "update" for i, o in enumerate(ops)]
    whole = np.zeros(len(ops))
    for s, d, nbytes in graph.edges():
        step_d = compute[d] and d in reached and ops[d].phase != "update"
        step_s = compute[s] and s in reached and ops[s].phase != "update"
        if step_d and (ops[s].kind in ("parameter", "buffer") or per_step[s]):
            whole[d] += nbytes
        if step_s and ops[d].phase == "update":
            whole[s] += nbytes
    terms = {}
    forward, backward, update = np.zeros(p), np.zeros(p), np.zeros(p)
    for i, o in enumerate(ops):
        j = j_of.get(int(placement[i]))
        if j is None:
            continue
        dev = sim.cluster.devices[int(placement[i])]
        launch = sim.cost_model.launch_on(dev.kind, dev.spec) if compute[i] else 0.0
        kernel = max(times[i] - launch, 0.0)
        if per_step[i]:
            share = kernel + launch
        elif compute[i] and whole[i] > 0 and o.phase != "update":
            if dev.kind not in terms:
                terms[dev.kind] = sim.cost_model.roofline_terms(graph, dev.spec)
            arith, per_byte = terms[dev.kind][0][i], terms[dev.kind][1][i]
            fixed = min(whole[i], sim.arrays.bytes_accessed[i]) * per_byte
            rest = sim.arrays.bytes_accessed[i] * per_byte - fixed
            batch, micro = max(arith, fixed + rest), max(arith / m, fixed + rest / m)
            share = kernel * (micro / batch if batch > 0 else 1 / m) + launch
        else:
            share = kernel / m + launch if compute[i] else 0.0
        if o.phase == "forward":
            forward[j] += share
        elif o.phase == "backward":
            backward[j] += share
        else:
            update[j] += times[i]
    # each micro-batch after the first adds its gradients into the held ones: per stage,
    # one in-place add per trainable parameter, 3 x its bytes at the elementwise memory rate
    for j, d in enumerate(stages):
        dev = sim.cluster.devices[d]
        mine = [o for i, o in enumerate(ops) if o.kind == "parameter" and placement[i] == d]
        rate = (
            dev.spec.memory_bandwidth
            * sim.cost_model.efficiency_on(dev.kind, "elementwise", "aten.add_.Tensor")[1]
        )
        launch = sim.cost_model.kernel_launch(dev.kind, dev.spec, "elementwise", "aten.add_.Tensor")
        one_pass = sum(3 * o.param_bytes / rate + launch for o in mine)
        backward[j] += one_pass * (m - 1) / m
    sent, returned = np.zeros(p - 1), np.zeros(p - 1)
    for s, d, nbytes in graph.edges():
        js, jd = j_of.get(int(placement[s])), j_of.get(int(placement[d]))
        if js is None or jd is None or js == jd:
            continue
        if ops[s].phase == "forward" and ops[d].phase == "forward":
            sent[js] += nbytes / m
        elif "update" not in (ops[s].phase, ops[d].phase) and jd < js:
            returned[jd] += nbytes / m

    def wire(src: int, dst: int, nbytes: float) -> float:
        return sim.cluster.transfer_time(src, dst, nbytes) if nbytes > 0 else 0.0

    activation = [wire(stages[j], stages[j + 1], sent[j]) for j in range(p - 1)]
    gradient = [wire(stages[j + 1], stages[j], returned[j]) for j in range(p - 1)]
    return stages, forward, backward, update, np.array(activation), np.array(gradient)


def contiguous_cuts(sim: Simulator, devices: list[int], rng: np.random.Generator) -> np.ndarray:
    """A pipeline: the forward ops in execution order cut into runs over ``devices``, every
    other op beside the forward op it belongs to (complete_placement)."""
    from meshplace.placers.colocate import complete_placement

    graph = sim.graph
    forward = [
        i
        for i in sim.arrays.topo_order.tolist()
        if graph.ops[i].phase == "forward" and graph.ops[i].kind not in ("parameter", "input")
    ]
    cuts = np.sort(rng.choice(np.arange(1, len(forward)), len(devices) - 1, replace=False))
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    for run, members in enumerate(np.split(np.array(forward), cuts)):
        partial[members] = devices[run]
    return complete_placement(graph, partial, default=devices[0])


@pytest.fixture(scope="module")
def sims() -> dict[str, Simulator]:
    cluster = load_cluster("colocrl-4gpu")
    return {w: Simulator(workload_graph(w), cluster) for w in ("dmcca", "rnnlm", "resnet50")}


@pytest.mark.parametrize("workload", ["dmcca", "rnnlm", "resnet50"])
@pytest.mark.parametrize("seed", range(4))
def test_the_vectorised_reading_equals_the_op_by_op_one(sims, workload: str, seed: int) -> None:
    sim = sims[workload]
    rng = np.random.default_rng(seed)
    gpus = [1, 2, 3, 4]
    rng.shuffle(gpus)
    for placement in (
        contiguous_cuts(sim, gpus[: 2 + seed % 3], rng),  # a pipeline
        rng.integers(0, sim.num_devices, sim.graph.num_ops),  # almost never one
    ):
        for m in (1, 4):
            ours = pipeline_of_placement(sim, placement, m)
            ref = reference_pipeline(sim, placement, m)
            assert (ours is None) == (ref is None)
            if ours is None:
                continue
            stages, forward, backward, update, activation, gradient = ref
            assert ours.devices == stages
            for got, want in (
                (ours.times.forward_s, forward),
                (ours.times.backward_s, backward),
                (ours.times.update_s, update),
                (ours.times.activation_s, activation),
                (ours.times.gradient_s, gradient),
            ):
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("workload", ["dmcca", "rnnlm", "resnet50"])
def test_the_objective_is_the_fastest_schedule_or_one_step(sims, workload: str) -> None:
    sim = sims[workload]
    rng = np.random.default_rng(7)
    placement = contiguous_cuts(sim, [1, 2, 3], rng)
    step = sim.simulate(placement, "step")
    assert step.throughput_time_s is None and step.value == step.step_time_s
    result = sim.simulate(placement, "throughput")
    choices = micro_batch_choices(sim.traced_batch, 3)
    assert choices  # every reference workload knows its batch
    candidates = {1: result.step_time_s}
    for m in choices:  # never below the busiest device's or link's work for the batch
        candidates[m] = max(
            simulate_schedule(pipeline_of_placement(sim, placement, m).times, "1f1b", m).step_s,
            result.steady_state_s,
        )
    best = min(candidates, key=candidates.get)
    assert result.micro_batches == best
    assert result.value == result.throughput_time_s == pytest.approx(candidates[best], rel=1e-12)
    assert result.throughput_model == ("schedule" if best > 1 else "one step")
    assert (result.schedule is not None) == (best > 1)
    assert result.value >= result.lower_bound_s * (1 - 1e-12)
    assert result.value >= result.steady_state_s * (1 - 1e-12)
    # a plan's own count is kept, even where another would be faster
    for m in choices:
        forced = sim.simulate(placement, "throughput", micro_batches=m)
        assert forced.micro_batches == m
        assert forced.value == pytest.approx(candidates[m], rel=1e-12)
    # scaling every time scales the objective
    doubled = sim.simulate(placement, "throughput", time_scale=2.0)
    assert doubled.value == pytest.approx(2 * result.value, rel=1e-9)
    assert doubled.micro_batches == result.micro_batches


def test_work_outside_the_stages_makes_a_placement_one_step(sims) -> None:
    """A backward op moved to a GPU that runs no forward compute would overlap the whole
    pipeline for free in the stage model: such a placement is scored as one step."""
    sim = sims["rnnlm"]
    placement = contiguous_cuts(sim, [1, 2], np.random.default_rng(0))
    assert pipeline_of_placement(sim, placement, 4) is not None
    backward = next(i for i, o in enumerate(sim.graph.ops) if o.phase == "backward")
    placement[backward] = 3
    assert pipeline_of_placement(sim, placement, 4) is None
    result = sim.simulate(placement, "throughput")
    assert result.micro_batches == 1 and result.throughput_model == "one step"
    assert result.value == result.step_time_s


def test_a_graph_without_a_batch_is_scored_by_the_steady_state() -> None:
    """No batched inputs (a graph profiled elsewhere, times per micro-batch): the stream
    of micro-batches has no end, and the objective is its limit, the busiest resource."""
    g = OpGraph("layers")
    for i in range(4):
        g.add_op(Op(f"f{i}", "matmul", flops=1e10))
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}", 1e6)
    sim = Simulator(g, load_cluster("colocrl-2gpu"))
    placement = sim.placement_of(["gpu0", "gpu0", "gpu1", "gpu1"])
    result = sim.simulate(placement, "throughput")
    assert sim.traced_batch is None
    assert result.throughput_model == "steady state" and result.micro_batches == 1
    assert result.value == result.steady_state_s
    assert result.steady_state_s == pytest.approx(result.busy_s.max(), rel=1e-12)
    # a plan that names its micro-batches is run as that schedule all the same
    forced = sim.simulate(placement, "throughput", micro_batches=4)
    assert forced.throughput_model == "schedule" and forced.micro_batches == 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_schedule_is_the_event_loop(schedule: str, seed: int) -> None:
    """The compiled longest-path pass gives each task the start an event loop over the
    same device orders gives (written out here, task by task)."""
    rng = np.random.default_rng(seed)
    p, v = 3, 2 if schedule == "interleaved" else 1
    m = 6
    forward, backward = rng.uniform(0.5, 2, p * v), rng.uniform(0.5, 3, p * v)
    act, grad = rng.uniform(0, 0.3, p * v - 1), rng.uniform(0, 0.3, p * v - 1)
    times = StageTimes(forward, backward, act, grad)
    result = simulate_schedule(times, schedule, m, virtual=v)
    end: dict[tuple, float] = {}
    free = [0.0] * p
    orders = device_orders(schedule, p, m, v)
    position = [0] * p
    while any(position[d] < len(orders[d]) for d in range(p)):
        before = sum(position)
        for d in range(p):
            while position[d] < len(orders[d]):
                kind, s, b = orders[d][position[d]]
                if kind == "F":
                    dep, wire = (("F", s - 1, b), act[s - 1]) if s else (None, 0.0)
                elif s < p * v - 1:
                    dep, wire = ("B", s + 1, b), grad[s]
                else:
                    dep, wire = ("F", s, b), 0.0
                if dep is not None and dep not in end:
                    break
                start = max(free[d], end[dep] + wire if dep else 0.0)
                end[(kind, s, b)] = free[d] = start + (forward[s] if kind == "F" else backward[s])
                position[d] += 1
        assert sum(position) > before, "the reference event loop deadlocked"
    assert result.step_s == pytest.approx(max(free), rel=1e-12)
    for task in result.tasks:
        key = (task["kind"], task["stage"], task["micro_batch"])
        assert task["end_s"] == pytest.approx(end[key], rel=1e-12)


def test_branches_split_over_devices_are_read_in_the_order_their_activations_flow() -> None:
    """Two branches: b on gpu3 runs first in execution order, c on gpu2 after it, and both
    feed d on gpu3. Ordered by first op the stages would be gpu0, gpu3, gpu2, with c's
    activation flowing back; the activations say gpu0, gpu2, gpu3, a pipeline."""
    g = OpGraph("branches")
    g.add_op(Op("input:x", "input", output_shapes=[[8, 4]]))
    for name in ("a", "b", "c", "d"):
        g.add_op(Op(name, "matmul", flops=1e10, output_shapes=[[8, 4]]))
    for s, d in (("input:x", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")):
        g.add_edge(s, d, 128)
    sim = Simulator(g, load_cluster("colocrl-4gpu"))
    placement = sim.placement_of(["gpu0", "gpu0", "gpu3", "gpu2", "gpu3"])
    pipe = pipeline_of_placement(sim, placement, 4)
    assert pipe is not None
    assert [sim.device_names[d] for d in pipe.devices] == ["gpu0", "gpu2", "gpu3"]
    ref = reference_pipeline(sim, placement, 4)
    assert ref is not None and ref[0] == pipe.devices
    assert sim.simulate(placement, "throughput").throughput_model == "schedule"
    # activations both ways between gpu0 and gpu1: not a pipeline
    both = sim.placement_of(["gpu0", "gpu0", "gpu1", "gpu1", "gpu0"])
    assert pipeline_of_placement(sim, both, 4) is None
    assert reference_pipeline(sim, both, 4) is None


def test_a_placement_plan_with_an_interleaved_schedule_is_one_sentence(tmp_path, capsys) -> None:
    from meshplace.cli import main
    from meshplace.graph.io import save_graph
    from meshplace.plan.placement import Plan, save_plan

    g = workload_graph("dmcca")
    save_graph(g, tmp_path / "g.json")
    plan = Plan.from_devices(
        g, "colocrl-2gpu", ["gpu0"] * g.num_ops, objective="throughput", micro_batches=4,
        meta={"schedule": "interleaved"},
    )  # fmt: skip
    save_plan(plan, tmp_path / "p.json")
    argv = ["simulate", "--graph", str(tmp_path / "g.json"), "--cluster", "colocrl-2gpu"]
    assert main([*argv, "--plan", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "'interleaved' is not a schedule a placement plan runs" in err
    assert err.count("\n") == 1
