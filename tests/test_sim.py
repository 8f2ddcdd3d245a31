"""The simulator: properties on random DAGs and clusters, collectives, traces."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplace.cost.collectives import collective_time, schedule_graph
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import load_cluster, nvlink_mesh, pcie_tree, torus
from meshplace.sim.simulator import Simulator
from meshplace.sim.trace import chrome_trace
from tests.forked_cli import run_meshplace

from .strategies import random_dags

CLUSTERS = {
    "pcie": lambda: pcie_tree(num_gpus=4, gpus_per_switch=2),
    "pcie-3": lambda: pcie_tree(num_gpus=3, gpus_per_switch=1),
    "nvlink": lambda: nvlink_mesh(gpus=4, cpus=1),
    "torus": lambda: torus((3, 3)),
    "ring": lambda: torus((5,)),
}
_built: dict[str, object] = {}


def _cluster(name: str):
    if name not in _built:
        _built[name] = CLUSTERS[name]()
    return _built[name]


def _dag_without_measured(graph: OpGraph) -> OpGraph:
    for o in graph.ops:
        o.measured_time = {}
        o.output_shapes = [[min(8, s) for s in shape] for shape in o.output_shapes]
        o.flops = float(o.flops % 1e12)
        o.bytes_read = float(o.bytes_read % 1e9)
        o.bytes_written = float(o.bytes_written % 1e9)
    return graph


def _scenario():
    return st.tuples(
        random_dags(max_ops=30, with_keys=False).map(_dag_without_measured),
        st.sampled_from(sorted(CLUSTERS)),
        st.randoms(use_true_random=False),
    )


_hypo = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_overlapping_latencies_pay_a_burst_of_messages_latency_once() -> None:
    """Four ops on cpu0 end at once, each sending 8 kB to its reader on cpu1 (link: 0.1 ms,
    1 GB/s). A link held for each message's latency delivers them 0.1 ms apart; with the
    latencies overlapping (``latency_overlaps``: the next message leaves while one is in
    flight) the k-th arrives after one latency and k messages' bytes, and the step (the
    last reader ends) is shorter by the three latencies the burst no longer queues."""
    g = OpGraph("burst")
    for i in range(4):
        _ = g.add_op(Op(f"a{i}", "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 0.0
    for i in range(4):
        _ = g.add_op(Op(f"b{i}", "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 1e-6
        g.add_edge(f"a{i}", f"b{i}", 8e3)
    cluster = _two_cpu_cluster()
    place = ["cpu0"] * 4 + ["cpu1"] * 4
    wire = 8e3 / 1e9
    held = Simulator(g, cluster)
    overlapping = Simulator(g, cluster, latency_overlaps=True)
    r_held = held.simulate(held.placement_of(place))
    r_over = overlapping.simulate(overlapping.placement_of(place))
    arrivals = [(k + 1) * (1e-4 + wire) for k in range(4)]
    assert sorted(r_held.transfer_end) == pytest.approx(arrivals)
    assert sorted(r_over.transfer_end) == pytest.approx([1e-4 + (k + 1) * wire for k in range(4)])
    assert r_held.step_time_s - r_over.step_time_s == pytest.approx(3e-4, rel=1e-6)
    # one message: nothing to overlap, the two models agree
    single = ["cpu0"] + ["cpu1"] * 7
    one_held = held.simulate(held.placement_of(single))
    one_over = overlapping.simulate(overlapping.placement_of(single))
    assert one_held.step_time_s == one_over.step_time_s
    assert one_held.transfer_end.tolist() == one_over.transfer_end.tolist()
    # the same as a property of the cluster's links (``latency_overlaps: true``, what
    # ``meshplace run --cluster-out`` writes for its loopback links): the cluster's file
    # says so, reads back so, and its simulation is the overlapping one, bit for bit;
    # ``latency_overlaps=False`` still holds every link for the latency
    from meshplace.hardware import cluster_from_yaml, cluster_to_yaml

    text = cluster_to_yaml(cluster.with_link_latency(None, latency_overlaps=True))
    assert text.count("latency_overlaps: true") == len(cluster.links) == 2
    flagged = cluster_from_yaml(text, "local.yaml")
    assert all(lk.latency_overlaps for lk in flagged.links)
    assert "latency_overlaps" not in cluster_to_yaml(cluster)  # off: written as before
    by_link = Simulator(g, flagged)
    r_link = by_link.simulate(by_link.placement_of(place))
    assert r_link.transfer_end.tolist() == r_over.transfer_end.tolist()
    assert r_link.step_time_s == r_over.step_time_s
    forced = Simulator(g, flagged, latency_overlaps=False)
    assert forced.simulate(forced.placement_of(place)).step_time_s == r_held.step_time_s


@_hypo
@given(_scenario())
def test_step_time_is_at_least_the_lower_bound(scenario) -> None:
    graph, cname, rnd = scenario
    sim = Simulator(graph, _cluster(cname))
    placement = np.array([rnd.randrange(sim.num_devices) for _ in graph.ops], dtype=np.int64)
    r = sim.simulate(placement)
    assert r.step_time_s >= r.lower_bound_s * (1 - 1e-9)
    # Deterministic: the same plan gives the same timeline.
    again = sim.simulate(placement)
    assert again.step_time_s == r.step_time_s
    assert np.array_equal(again.op_start, r.op_start)
    assert np.array_equal(again.peak_memory_bytes, r.peak_memory_bytes)
    # Peak memory covers the resident parameters and optimizer state on each device.
    resident = np.bincount(
        placement,
        weights=[o.param_bytes + o.state_bytes for o in graph.ops],
        minlength=sim.num_devices,
    )
    assert np.all(r.peak_memory_bytes >= resident - 1e-6)
    # Every op starts after each of its inputs has finished.
    for s, d, _ in graph.edges():
        assert r.op_start[d] >= r.op_end[s] - 1e-12


@_hypo
@given(_scenario())
def test_single_device_step_is_the_sum_of_op_times(scenario) -> None:
    graph, cname, rnd = scenario
    sim = Simulator(graph, _cluster(cname))
    device = rnd.randrange(sim.num_devices)
    placement = np.full(graph.num_ops, device, dtype=np.int64)
    r = sim.simulate(placement)
    op_times = sim.op_times(placement)  # each includes the device's launch overhead
    assert r.step_time_s == pytest.approx(op_times.sum(), rel=1e-9, abs=1e-15)
    assert len(r.transfer_bytes) == 0


@_hypo
@given(_scenario(), st.floats(min_value=0.1, max_value=50))
def test_scaling_all_times_scales_the_step(scenario, k: float) -> None:
    graph, cname, rnd = scenario
    sim = Simulator(graph, _cluster(cname))
    placement = np.array([rnd.randrange(sim.num_devices) for _ in graph.ops], dtype=np.int64)
    base = sim.simulate(placement).step_time_s
    scaled = sim.simulate(placement, time_scale=k).step_time_s
    assert scaled == pytest.approx(k * base, rel=1e-9, abs=1e-15)


def _chain(n: int, rnd) -> OpGraph:
    g = OpGraph("chain")
    for i in range(n):
        g.add_op(Op(f"c{i}", "matmul", flops=rnd.uniform(1e6, 1e10), bytes_read=1e6))
        if i:
            g.add_edge(i - 1, i, rnd.uniform(0, 1e8))
    return g


@_hypo
@given(st.integers(2, 40), st.sampled_from(sorted(CLUSTERS)), st.randoms(use_true_random=False))
def test_on_a_chain_more_bandwidth_or_a_faster_device_never_hurts(n, cname, rnd) -> None:
    graph = _chain(n, rnd)
    sim = Simulator(graph, _cluster(cname))
    placement = np.array([rnd.randrange(sim.num_devices) for _ in range(n)], dtype=np.int64)
    base = sim.simulate(placement).step_time_s
    sim.link_bw = sim.link_bw * 2
    wider = sim.simulate(placement).step_time_s
    assert wider <= base * (1 + 1e-12)
    kind = rnd.randrange(len(sim.kind_names))
    sim.op_time_by_kind = sim.op_time_by_kind.copy()
    sim.op_time_by_kind[kind] *= 0.5
    faster = sim.simulate(placement).step_time_s
    assert faster <= wider * (1 + 1e-12)


def test_transfers_on_a_shared_pcie_uplink_serialise() -> None:
    # Two GPUs under one PCIe switch each send 100 MB to the CPU: the uplink is shared.
    cluster = pcie_tree(num_gpus=2, gpus_per_switch=2)
    g = OpGraph("fan-in")
    for name in ("a", "b"):
        g.add_op(Op(name, "matmul", measured_time={"k80": 0.0}))
    g.add_op(Op("sink", "elementwise", measured_time={"xeon": 0.0}))
    g.add_edge("a", "sink", 1e8)
    g.add_edge("b", "sink", 1e8)
    sim = Simulator(g, cluster)
    r = sim.simulate(sim.placement_of(["gpu0", "gpu1", "cpu0"]))
    one = cluster.transfer_time("gpu0", "cpu0", 1e8)
    assert r.step_time_s == pytest.approx(2 * one, rel=1e-6)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
@pytest.mark.parametrize("p", [2, 5, 8])
def test_ring_collectives_match_their_closed_form(kind: str, p: int) -> None:
    cluster = torus((p,))
    link = cluster.links[cluster.route(0, 1)[0]]
    nbytes = 64e6
    graph, devices = schedule_graph(kind, nbytes, cluster.device_names, device_kind="tpu-v3")
    sim = Simulator(graph, cluster)
    simulated = sim.simulate(sim.placement_of(devices)).step_time_s
    closed = collective_time(
        kind, "ring", nbytes, p, bandwidth=link.bandwidth, latency=link.latency
    )
    assert simulated == pytest.approx(closed, rel=0.01)


@pytest.mark.parametrize("dims", [(4, 4), (2, 8), (3, 3, 2)])
def test_torus_all_reduce_matches_its_closed_form(dims) -> None:
    cluster = torus(dims)
    # Bandwidth of each dimension's link out of device 0 (size-2 rings have double links).
    per_dim = []
    for d in range(len(dims)):
        step = [0] * len(dims)
        step[d] = 1
        neighbour = int(np.ravel_multi_index(step, dims))
        per_dim.append(cluster.links[cluster.route(0, neighbour)[0]].bandwidth)
    link = cluster.links[0]
    nbytes = 256e6
    graph, devices = schedule_graph(
        "all_reduce", nbytes, cluster.device_names, device_kind="tpu-v3", dims=dims
    )
    sim = Simulator(graph, cluster)
    simulated = sim.simulate(sim.placement_of(devices)).step_time_s
    closed = collective_time(
        "all_reduce", "torus", nbytes, bandwidth=per_dim, latency=link.latency, dims=dims
    )
    assert simulated == pytest.approx(closed, rel=0.01)


def test_rnnlm_trace_is_valid_chrome_trace_with_a_track_per_device_and_link() -> None:
    from meshplace.graph.sources import workload_graph

    graph = workload_graph("rnnlm")  # an LSTM language model: small, and one op per step
    cluster = load_cluster("colocrl-4gpu")
    sim = Simulator(graph, cluster)
    # Expert-style split: embeddings on the CPU, each LSTM layer pair on its own GPU.
    names = []
    for o in graph.ops:
        m = o.module
        if "embedding" in m or o.kind == "input":
            names.append("cpu0")
        elif ".0" in m or m.endswith("0"):
            names.append("gpu0")
        elif ".1" in m:
            names.append("gpu1")
        else:
            names.append("gpu2")
    result = sim.simulate(sim.placement_of(names))
    trace = json.loads(json.dumps(chrome_trace(sim, result)))
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert len([k for k in threads if k[0] == 1]) == cluster.num_devices
    assert len([k for k in threads if k[0] == 2]) == len(cluster.links)
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e)
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["ts"] >= 0
            assert isinstance(e["dur"], float) and e["dur"] >= 0
            assert (e["pid"], e["tid"]) in threads
    transfers = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert transfers, "an op split over devices must move data"
    end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X")
    assert end == pytest.approx(result.step_time_s * 1e6, rel=1e-9)


def test_measured_times_win_over_the_roofline_by_kind_then_category() -> None:
    cluster = load_cluster("colocrl-2gpu")
    g = OpGraph("measured")
    g.add_op(Op("a", "matmul", flops=1e12, measured_time={"k80": 0.25, "cpu": 2.0}))
    g.add_op(Op("b", "matmul", flops=1e12, measured_time={"cpu": 3.0}))
    g.add_op(Op("c", "matmul", flops=1e12))
    sim = Simulator(g, cluster)
    gpu = sim.op_times(sim.placement_of(["gpu0", "gpu0", "gpu0"]))
    cpu = sim.op_times(sim.placement_of(["cpu0", "cpu0", "cpu0"]))
    assert gpu[0] == 0.25  # exact kind
    assert cpu[0] == 2.0 and cpu[1] == 3.0  # the xeon's category is "cpu"
    k80 = cluster.device("gpu0").spec
    assert gpu[2] == pytest.approx(1e12 / (k80.peak("float32") * 0.7) + k80.launch_overhead_s)


def _two_cpu_cluster():
    from meshplace.profile.calibrate import local_cluster, local_device_spec

    return local_cluster(local_device_spec(1e10, 1e10, 0.0), bandwidth=1e9, latency=1e-4)


def test_host_staged_messages_occupy_both_ends() -> None:
    from meshplace.cost.compute import CostModel

    g = OpGraph("chain")
    for name in ("a", "b", "c"):
        _ = g.add_op(Op(name, "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 1e-3
    g.add_edge("a", "b", 1e6)
    g.add_edge("b", "c", 8.0)
    cluster = _two_cpu_cluster()
    place = ["cpu0", "cpu1", "cpu1"]
    plain = Simulator(g, cluster)
    base = plain.simulate(plain.placement_of(place))
    # link only: 3 ms of ops + 0.1 ms latency + 1 ms of bytes, nothing on the devices
    assert base.step_time_s == pytest.approx(3e-3 + 1e-4 + 1e-3)
    cm = CostModel(message_cpu={"local-cpu": (2e-5, 1e-10, 3e-5, 2e-10)})
    sim = Simulator(g, cluster, cm)
    r = sim.simulate(sim.placement_of(place))
    send, recv = 2e-5 + 1e-10 * 1e6, 3e-5 + 2e-10 * 1e6
    assert r.step_time_s == pytest.approx(base.step_time_s + send + recv)
    assert r.busy_s.tolist() == pytest.approx([1e-3 + send, 2e-3 + recv])
    # one device: no messages, so the costs change nothing
    one = sim.simulate(sim.placement_of(["cpu0"] * 3))
    assert one.step_time_s == pytest.approx(3e-3)


def test_in_order_devices_wait_for_the_next_op_in_program_order() -> None:
    # a (cpu0) -> b (cpu1); c (cpu1) is independent but comes after b in priority order
    g = OpGraph("order")
    for name in ("a", "b", "c"):
        _ = g.add_op(Op(name, "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 1e-3
    g.add_edge("a", "b", 8.0)
    cluster = _two_cpu_cluster()
    place = ["cpu0", "cpu1", "cpu1"]
    free = Simulator(g, cluster)
    strict = Simulator(g, cluster, in_order=True)
    r_free = free.simulate(free.placement_of(place))
    r_strict = strict.simulate(strict.placement_of(place))
    # out of order, cpu1 runs c while a's output travels; in order it idles, then b, c
    assert r_free.op_start[2] == 0.0
    assert r_strict.op_start[2] == pytest.approx(r_strict.op_end[1])
    assert r_strict.step_time_s == pytest.approx(1e-3 + 1e-4 + 8e-9 + 2e-3)
    assert r_free.step_time_s < r_strict.step_time_s


@_hypo
@given(_scenario())
def test_in_order_single_device_is_the_sum_and_never_beats_the_lower_bound(scenario) -> None:
    graph, cname, rnd = scenario
    sim = Simulator(graph, _cluster(cname), in_order=True)
    placement = np.array([rnd.randrange(sim.num_devices) for _ in graph.ops], dtype=np.int64)
    r = sim.simulate(placement)
    assert r.step_time_s >= r.lower_bound_s * (1 - 1e-9)
    assert np.all(r.op_end >= r.op_start)
    one = np.zeros(graph.num_ops, dtype=np.int64)
    assert sim.simulate(one).step_time_s == pytest.approx(
        sim.op_times(one).sum(), rel=1e-9, abs=1e-15
    )


def test_extra_time_is_added_for_one_simulation_only() -> None:
    g = OpGraph("pair")
    for name in ("a", "b"):
        _ = g.add_op(Op(name, "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 1e-3
    g.add_edge("a", "b", 8.0)
    sim = Simulator(g, _two_cpu_cluster())
    place = sim.placement_of(["cpu0", "cpu0"])
    assert sim.simulate(place, extra_time=np.array([0.0, 5e-4])).step_time_s == pytest.approx(
        2.5e-3
    )
    assert sim.simulate(place).step_time_s == pytest.approx(2e-3)


def test_an_explicit_execution_order_sets_the_priority() -> None:
    from meshplace.errors import InputError

    g = OpGraph("fan")
    for name in ("a", "b", "c"):
        _ = g.add_op(Op(name, "matmul", output_dtypes=["float32"]))
        g.ops[-1].measured_time["local-cpu"] = 1e-3
    g.add_edge("a", "b", 8.0)
    g.add_edge("a", "c", 8.0)
    cluster = _two_cpu_cluster()
    sim = Simulator(g, cluster, in_order=True, order=np.array([0, 2, 1]))
    r = sim.simulate(sim.placement_of(["cpu0"] * 3))
    assert r.op_start[2] < r.op_start[1]  # c runs before b, as the order says
    with pytest.raises(InputError):
        Simulator(g, cluster, order=np.array([1, 0, 2]))  # b before its input a
    with pytest.raises(InputError):
        Simulator(g, cluster, order=np.array([0, 0, 1]))


# ------------------------------------------------------------------ large clusters (issue 13)
_RESULT_FIELDS = (
    "step_time_s",
    "throughput_time_s",
    "busy_s",
    "peak_memory_bytes",
    "link_busy_s",
    "link_bytes",
    "op_start",
    "op_end",
    "transfer_src_op",
    "transfer_dst_device",
    "transfer_bytes",
    "transfer_start",
    "transfer_end",
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenario(), st.booleans())
def test_routing_per_placement_gives_the_same_results_as_the_route_table(scenario, order) -> None:
    graph, cname, rnd = scenario
    cluster = _cluster(cname)
    dense = Simulator(graph, cluster, in_order=order, dense_routes=True)
    sparse = Simulator(graph, cluster, in_order=order, dense_routes=False)
    assert dense.route_ptr is not None and sparse.route_ptr is None
    for _ in range(3):
        placement = np.array([rnd.randrange(len(cluster)) for _ in graph.ops], dtype=np.int64)
        a, b = dense.simulate(placement), sparse.simulate(placement)
        for name in _RESULT_FIELDS:
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert a.to_dict() == b.to_dict()


def _five_ops(mm: str = "mm") -> OpGraph:
    g = OpGraph("five", meta={"batch": 8})
    g.add_op(Op("x", "input", output_shapes=[[8, 256]]))
    g.add_op(Op("w", "parameter", output_shapes=[[256, 256]], param_bytes=256 * 256 * 4))
    g.add_op(Op(mm, "matmul", flops=2 * 8 * 256 * 256, output_shapes=[[8, 256]]))
    g.add_op(Op("relu", "elementwise", flops=8 * 256, output_shapes=[[8, 256]]))
    g.add_op(Op("loss", "loss", flops=8 * 256))
    for src, dst, nbytes in (("x", mm, 8192), ("w", mm, 262144), (mm, "relu", 8192)):
        g.add_edge(src, dst, nbytes)
    g.add_edge("relu", "loss", 8192)
    return g


def test_a_2000_device_hand_written_cluster_simulates_a_small_plan() -> None:
    from meshplace.hardware import cluster_from_yaml

    from .test_hardware import hand_written_hosts

    big = cluster_from_yaml(hand_written_hosts(250), "big.yaml")
    small = cluster_from_yaml(hand_written_hosts(3), "small.yaml")
    g = _five_ops()
    sim = Simulator(g, big)
    assert not sim.dense_routes and big._table is None
    one = sim.simulate(np.full(5, big.device_index("h249/gpu7")))
    assert one.step_time_s == pytest.approx(float(sim.op_times(np.full(5, 0)).sum()), rel=1e-12)
    assert len(one.transfer_bytes) == 0 and len(big._trees) == 0  # nothing routed
    # across hosts: the same as the same plan on a 3-host copy, whose routes are all built
    names = ["h0/gpu0", "h0/gpu1", "h2/gpu3", "h1/gpu7", "h0/gpu0"]
    far = [n.replace("h2/", "h249/").replace("h1/", "h120/") for n in names]
    a = sim.simulate(np.array([big.device_index(n) for n in far]))
    small_sim = Simulator(g, small)
    assert small_sim.dense_routes
    b = small_sim.simulate(np.array([small.device_index(n) for n in names]))
    assert a.step_time_s == b.step_time_s and len(a.transfer_bytes) == 4
    assert a.to_dict()["devices"][big.device_index("h249/gpu3")]["ops"] == 1


def test_a_plan_for_another_graph_of_the_same_name_exits_2(tmp_path) -> None:

    from meshplace.graph.io import save_graph
    from meshplace.plan import Plan, save_plan

    plan = Plan.for_graph(_five_ops(), "colocrl-2gpu", {}, default_device="gpu0")
    save_plan(plan, tmp_path / "p.json")
    save_graph(_five_ops(mm="matmul"), tmp_path / "g.json")  # same name and size, other ops
    argv = ["simulate", "--graph", "g.json", "--cluster", "colocrl-2gpu"]
    argv += ["--plan", "p.json", "--trace", "t.json"]
    proc = run_meshplace(argv, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "p.json: was made for graph 'five' with 5 ops, but the graph given, 'five' (also 5 " in (
        proc.stderr
    )
    assert "differs in its op names" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json", "p.json"]


def _three_kinds():
    """A CPU, two V100s and a K80 under one switch: three device kinds, so the
    throughput bound's linear program is exercised."""
    from meshplace.hardware.catalogue import device_spec
    from meshplace.hardware.cluster import Cluster, Device, Link

    kinds = ["xeon-e5-2699v3", "v100", "v100", "k80"]
    devices = [Device(f"d{i}", k, device_spec(k)) for i, k in enumerate(kinds)]
    links = [Link(f"up{i}", d.name, "sw", 12e9, 5e-6) for i, d in enumerate(devices)]
    links += [Link(f"down{i}", "sw", d.name, 12e9, 5e-6) for i, d in enumerate(devices)]
    return Cluster("three-kinds", devices, links, switches=["sw"])


CLUSTERS["three-kinds"] = _three_kinds


@_hypo
@given(_scenario(), st.sampled_from(["step", "throughput"]))
def test_no_placement_beats_the_lower_bound_of_its_objective(scenario, objective) -> None:
    graph, cname, rnd = scenario
    sim = Simulator(graph, _cluster(cname))
    bound = sim.lower_bound(objective)
    assert bound == sim.simulate(np.zeros(graph.num_ops, np.int64), objective).lower_bound_s
    for _ in range(4):
        placement = np.array([rnd.randrange(sim.num_devices) for _ in graph.ops], np.int64)
        assert sim.simulate(placement, objective).value >= bound * (1 - 1e-9)
    if objective == "throughput" and graph.num_ops <= 6:
        # brute force: no assignment of the ops' compute time does better, transfers aside
        times = sim.op_time_by_kind[sim.device_kind_index]  # [device, op]
        n_dev, n = times.shape
        best = min(
            np.bincount(np.array(p), weights=times[list(p), np.arange(n)], minlength=n_dev).max()
            for p in itertools.product(range(n_dev), repeat=n)
        )
        assert best >= bound * (1 - 1e-9)


def test_the_throughput_bound_is_the_work_split_over_the_devices_and_the_largest_op() -> None:
    graph = _chain(8, random.Random(1))
    for cname in ("pcie", "nvlink", "three-kinds"):
        sim = Simulator(graph, _cluster(cname))
        times = sim.op_time_by_kind
        bound = sim.throughput_lower_bound()
        # at least the uniform weights' value (total fastest work / devices) and the
        # largest op; at most the best single device's total
        assert bound >= times.min(axis=0).sum() / sim.num_devices * (1 - 1e-12)
        assert bound >= times.min(axis=0).max()
        assert bound <= times.sum(axis=1).min()
    homogeneous = Simulator(graph, _cluster("pcie"))
    t = homogeneous.op_time_by_kind[0]
    assert homogeneous.throughput_lower_bound() == pytest.approx(max(t.sum() / 4, t.max()))


def _direct_mesh(kinds: list[str], seed: int, transfers: str):
    """Devices joined pairwise by direct links of random speed, no switches: every
    route is one link that only its sender uses."""
    from meshplace.hardware.catalogue import device_spec
    from meshplace.hardware.cluster import Cluster, Device, Link

    rnd = random.Random(seed)
    devices = [Device(f"d{i}", k, device_spec(k)) for i, k in enumerate(kinds)]
    links = [
        Link(f"{a.name}>{b.name}", a.name, b.name, rnd.uniform(1e9, 20e9), rnd.uniform(0, 1e-5))
        for a in devices
        for b in devices
        if a is not b
    ]
    return Cluster("direct", devices, links).with_transfers(transfers)


CLUSTERS["direct-occupy"] = lambda: _direct_mesh(["xeon", "v100", "v100"], 0, "occupy")


def test_a_pipeline_of_a_graph_without_weights_reads_only_the_updates_gradient_whole() -> None:
    """A graph with no weight, whose last op is an optimizer update reading a gradient
    (hypothesis found one): read as a pipeline, only the op writing that gradient moves
    bytes whole in every micro-batch (it is accumulated over them)."""
    g = _chain(4, random.Random(0))
    g.ops[3].phase = "update"
    reader = Simulator(g, _cluster("nvlink")).pipeline_reader
    assert reader.rereads.tolist() == [2]
    assert reader.per_step_work.sum() == 0


@_hypo
@given(_scenario(), st.integers(0, 3))
def test_occupying_transfers_make_throughput_the_closed_form(scenario, seed) -> None:
    graph, _, rnd = scenario
    cluster = _direct_mesh(["xeon", "v100", "k80", "v100"], seed, "occupy")
    sim = Simulator(graph, cluster)
    placement = np.array([rnd.randrange(sim.num_devices) for _ in graph.ops], np.int64)
    r = sim.simulate(placement, "throughput")
    # closed form: one transfer per (producer, other consuming device), of the largest
    # tensor read there, costing latency + bytes / bandwidth at both of its ends
    load = np.bincount(placement, weights=sim.op_times(placement), minlength=sim.num_devices)
    sent: dict[tuple[int, int], float] = {}
    for s, d, nbytes in graph.edges():
        if placement[s] != placement[d]:
            key = (s, int(placement[d]))
            sent[key] = max(sent.get(key, 0.0), nbytes)
    for (s, dst), nbytes in sent.items():
        src = int(placement[s])
        (link,) = cluster.route(src, dst)
        seconds = cluster.links[link].latency + nbytes / cluster.links[link].bandwidth
        load[src] += seconds
        load[dst] += seconds
    assert r.steady_state_s == pytest.approx(load.max(), rel=1e-9, abs=1e-15)
    assert np.allclose(r.busy_s, load, rtol=1e-9, atol=1e-15)
    # with copy engines the same plan's devices are busy only computing
    overlap = Simulator(graph, cluster.with_transfers("overlap")).simulate(placement)
    compute = np.bincount(placement, weights=sim.op_times(placement), minlength=sim.num_devices)
    assert np.allclose(overlap.busy_s, compute, rtol=1e-9, atol=1e-15)
