"""Tests for meshplace.hardware: catalogue, clusters, routes, generators, presets, YAML."""

from __future__ import annotations

import itertools
import json
import math
import re
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from meshplace.errors import InputError
from meshplace.hardware import (
    DTYPES,
    Cluster,
    ClusterError,
    Device,
    Link,
    UnknownDeviceError,
    UnknownPresetError,
    catalogue,
    cluster_from_yaml,
    cluster_to_dict,
    cluster_to_yaml,
    describe,
    device_spec,
    load_cluster,
    multi_host,
    nvlink_mesh,
    pcie_tree,
    presets,
    print_cluster,
    save_cluster,
    torus,
)
from meshplace.hardware.units import parse_quantity
from tests.forked_cli import run_meshplace

DOCS = Path(__file__).resolve().parent.parent / "docs" / "clusters.md"

EXPECTED_DEVICES = {
    "colocrl-2gpu": 3,
    "colocrl-4gpu": 5,
    "dgx-a100": 10,
    "dgx-h100": 10,
    "tpu-v3-8": 4,
    "tpu-v3-pod": 1024,
    "tpu-v4-pod": 4096,
    "h4-8xa100": 40,
    "h2-8xh100": 20,
}


def check_route(c: Cluster, i: int, j: int) -> tuple[int, ...]:
    """Assert the route from i to j is a valid directed path and return it."""
    r = c.route(i, j)
    if i == j:
        assert r == ()
        return r
    assert r, (i, j)
    links = [c.links[k] for k in r]
    assert links[0].src == c.devices[i].name
    assert links[-1].dst == c.devices[j].name
    for a, b in itertools.pairwise(links):
        assert a.dst == b.src
    return r


# ------------------------------------------------------------------ catalogue
def test_catalogue_has_required_kinds_with_sources():
    required = {
        "xeon",
        "k40",
        "k80",
        "p100",
        "v100",
        "a100-40gb",
        "a100-80gb",
        "h100",
        "h200",
        "tpu-v2",
        "tpu-v3",
        "tpu-v4",
        "accelerator",
    }
    cat = catalogue()
    assert required <= set(cat)
    for kind, spec in cat.items():
        assert spec.kind == kind
        assert spec.source and spec.description
        assert set(spec.peak_flops) <= set(DTYPES)
        assert all(v > 0 for v in spec.peak_flops.values())
        assert spec.memory_bandwidth > 0 and spec.memory_bytes > 0
        assert 0 < spec.launch_overhead_s < 1e-4
        assert spec.category in ("cpu", "gpu", "tpu", "accelerator")


def test_datasheet_numbers():
    assert device_spec("k40").peak("float32") == pytest.approx(4.29e12)
    assert device_spec("k80").peak("float32") == pytest.approx(4.368e12)
    assert device_spec("v100").peak("float16") == 125e12
    assert device_spec("a100-80gb").memory_bandwidth == 2039e9
    assert device_spec("a100-40gb").memory_bandwidth == 1555e9
    assert device_spec("h100").peak("bfloat16") == pytest.approx(989.4e12)
    assert device_spec("h200").memory_bytes == 141 * 2**30
    assert device_spec("tpu-v3").peak("bfloat16") == 123e12
    assert device_spec("tpu-v4").memory_bandwidth == 1.2e12
    assert device_spec("k80").launch_overhead_s == 5.7e-6


def test_peak_fallbacks():
    v100, tpu, a100 = device_spec("v100"), device_spec("tpu-v3"), device_spec("a100")
    assert v100.peak("bfloat16") == v100.peak("float32")  # no bf16 units: fp32 speed
    assert tpu.peak("float16") == tpu.peak("bfloat16")
    assert tpu.peak("float64") == tpu.peak("float32")
    assert a100.peak("tf32") == 156e12
    assert device_spec("k80").peak("tf32") == device_spec("k80").peak("float32")
    assert a100.peak("torch.bfloat16") == a100.peak("bf16") == 312e12
    assert a100.peak("int8") == a100.peak("float32")


def test_unknown_kind_lists_allowed():
    with pytest.raises(UnknownDeviceError, match=r"allowed kinds: .*v100") as e:
        device_spec("v1000")
    assert isinstance(e.value, InputError) and "\n" not in str(e.value)


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_loads(name):
    c = load_cluster(name)
    assert len(c) == EXPECTED_DEVICES[name]
    assert c.source
    json.dumps(describe(c))
    if len(c) <= 64:
        for i in range(len(c)):
            for j in range(len(c)):
                check_route(c, i, j)


def test_preset_list_is_documented():
    assert set(presets()) == set(EXPECTED_DEVICES)
    text = DOCS.read_text()
    for name in presets():
        assert f"`{name}`" in text


def test_family_names():
    c = load_cluster("h2-4xv100")
    assert len(c) == 2 * (4 + 2)
    assert {d.kind for d in c.devices} == {"v100", "xeon"}
    assert len(load_cluster("h3-2xk80")) == 3 * 3
    assert load_cluster("h1-8xa100").devices[2].kind == "a100-80gb"
    # Cross-host traffic from one GPU is limited by its own NIC (HDR 200 Gb/s).
    c = load_cluster("h2-8xa100")
    assert c.path_bandwidth("host0/gpu0", "host1/gpu3") == 25e9
    assert c.path_bandwidth("host0/gpu0", "host0/gpu3") == 300e9


def test_unknown_preset_and_family_kind():
    with pytest.raises(UnknownPresetError, match="allowed: colocrl-2gpu") as e:
        load_cluster("dgx-z100")
    assert "\n" not in str(e.value)
    with pytest.raises(UnknownPresetError, match="allowed kinds"):
        load_cluster("h2-8xtpu-v3")
    with pytest.raises(ClusterError, match="no such cluster file"):
        load_cluster("/nonexistent/cluster.yaml")


# ------------------------------------------------------------------ torus
def test_torus_hop_counts_32x32():
    c = load_cluster("tpu-v3-pod")
    assert c.dims == (32, 32)
    hops = [len(c.route(0, j)) for j in range(len(c))]
    assert max(hops) == 32  # 16 + 16 with wrap-around
    assert hops.count(32) == 1  # only the antipode (16, 16)
    assert len(c.route(0, 31)) == 1  # wrap-around neighbour
    assert len(c.route(0, 5 * 32 + 20)) == 5 + 12
    assert c.coords(5 * 32 + 20) == (5, 20)
    assert len(c.links) == 4 * 1024


def test_torus_routes_are_dimension_ordered_and_deterministic():
    a, b = load_cluster("tpu-v3-pod"), load_cluster("tpu-v3-pod")
    rng = np.random.default_rng(0)
    for i, j in rng.integers(0, 1024, size=(200, 2)).tolist():
        r = check_route(a, i, j)
        assert r == b.route(i, j) == a.route(i, j)
        # dimension 0 first: the row coordinate changes before the column does
        dims_used = [a.links[k].name.split()[-1][1] for k in r]
        assert dims_used == sorted(dims_used)
    # a tie (half-way round a ring of 4) goes the "+" way
    ring = torus((4,), link_bandwidth=1e9)
    assert [ring.links[k].dst for k in ring.route(0, 2)] == ["tpu1", "tpu2"]


def test_tpu_v4_pod_hops():
    c = load_cluster("tpu-v4-pod")
    assert c.dims == (16, 16, 16)
    far = 8 * 256 + 8 * 16 + 8
    assert len(check_route(c, 0, far)) == 24
    assert len(c.route(0, 15)) == 1


def test_route_table_matches_routes():
    for c in (
        torus((4, 3, 2), link_bandwidth=1e9),
        torus((5, 4), wrap=(True, False), link_bandwidth=1e9),
        load_cluster("colocrl-4gpu"),
        load_cluster("h2-8xh100"),
    ):
        fresh = Cluster.__new__(Cluster)
        fresh.__dict__.update(c.__dict__)
        fresh._table = None
        ptr, links = c.route_table()
        n = len(c)
        assert ptr.shape == (n * n + 1,) and links.dtype == np.int32
        for i in range(n):
            for j in range(n):
                k = i * n + j
                assert tuple(links[ptr[k] : ptr[k + 1]].tolist()) == fresh.route(i, j)
        latency, bandwidth = c.path_matrices()
        for i, j in [(0, n - 1), (n - 1, 0), (1 % n, 0)]:
            assert latency[i, j] == pytest.approx(c.path_latency(i, j))
            assert bandwidth[i, j] == c.path_bandwidth(i, j)


@pytest.mark.parametrize("dims", [(5, 4, 3), (2, 3), (1, 4), (2, 2, 2), (6,)])
def test_translated_table_equals_stepwise_table(dims):
    c = torus(dims, link_bandwidth=1e9)
    ptr, links = c.route_table()
    ptr2, links2 = c._torus_scatter()
    assert np.array_equal(ptr, ptr2) and np.array_equal(links, links2)


def test_pod_route_table_is_fast_and_consistent():
    c = load_cluster("tpu-v3-pod")
    ptr, links = c.route_table()
    assert ptr[-1] == links.size == 1024 * 1024 * 16  # mean hop count is exactly 16
    assert tuple(links[ptr[1000] : ptr[1001]].tolist()) == torus((32, 32)).route(0, 1000)


def test_tpu_v3_8_merges_two_rings():
    c = load_cluster("tpu-v3-8")
    assert len(c.links) == 8
    assert c.path_bandwidth(0, 1) == 200e9
    assert len(c.route(0, 3)) == 2


# ------------------------------------------------------------------ PCIe and NVLink
def test_pcie_tree_switch_sharing():
    c = load_cluster("colocrl-4gpu")
    root = "host0/pcie-root"
    same = [c.links[k] for k in c.route("gpu0", "gpu1")]
    assert all(root not in (lk.src, lk.dst) for lk in same)
    assert len(same) == 2
    r02 = set(c.route("gpu0", "gpu2"))
    r13 = set(c.route("gpu1", "gpu3"))
    shared = {c.links[k].name for k in r02 & r13}
    assert shared == {"host0/pcie-switch0->host0/pcie-root", "host0/pcie-root->host0/pcie-switch1"}
    assert c.meta["placeto_transfer_rate"] == 7.6e9


def test_transfer_time_formula():
    c = load_cluster("colocrl-2gpu")
    r = c.route("cpu0", "gpu1")
    lat = sum(c.links[k].latency for k in r)
    bw = min(c.links[k].bandwidth for k in r)
    assert c.path_latency("cpu0", "gpu1") == pytest.approx(lat)
    assert c.path_bandwidth("cpu0", "gpu1") == bw == 10e9
    assert c.transfer_time("cpu0", "gpu1", 1e6) == pytest.approx(lat + 1e6 / bw)
    assert c.transfer_time(1, 1, 1e9) == 0.0
    assert c.path_bandwidth(1, 1) == math.inf


def test_nvlink_preferred_and_no_relay_through_gpus():
    c = load_cluster("dgx-a100")
    assert {c.links[k].kind for k in c.route("gpu0", "gpu5")} == {"nvlink"}
    assert c.path_bandwidth("gpu0", "gpu5") == 300e9
    for g in range(8):
        route = [c.links[k] for k in c.route("cpu0", f"gpu{g}")]
        assert all(not lk.src.startswith("gpu") for lk in route)
    direct = nvlink_mesh(4, nvswitch=False, nvlink_bandwidth=50e9, cpus=1)
    assert len(direct.route("gpu0", "gpu3")) == 1


def test_device_relay_only_when_needed():
    spec = device_spec("v100")
    devs = [Device(f"g{i}", "v100", spec) for i in range(4)]
    links = []
    for i in range(4):
        a, b = f"g{i}", f"g{(i + 1) % 4}"
        links += [Link(f"{a}>{b}", a, b, 1e9, 1e-6), Link(f"{b}>{a}", b, a, 1e9, 1e-6)]
    c = Cluster("ring", devs, links)
    assert len(check_route(c, 0, 2)) == 2


def test_ring_order():
    c = load_cluster("tpu-v3-pod")
    order = c.ring_order()
    assert sorted(order) == list(range(1024))
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        assert len(c.route(a, b)) == 1  # a Hamiltonian cycle of neighbours
    d = load_cluster("colocrl-4gpu")
    assert d.ring_order() == [0, 1, 2, 3, 4]
    assert d.ring_order(["gpu3", "gpu0"]) == [1, 4]


def test_device_index_errors():
    c = load_cluster("dgx-h100")
    assert c.device_index("gpu3") == 5
    with pytest.raises(UnknownDeviceError, match="no device 'gpu9'") as e:
        c.device_index("gpu9")
    assert "gpu0" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnknownDeviceError, match="out of range"):
        c.route(0, 10)


# ------------------------------------------------------------------ properties
@st.composite
def small_tori(draw):
    ndim = draw(st.integers(1, 3))
    dims = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    wrap = tuple(draw(st.booleans()) for _ in range(ndim))
    return torus(dims, wrap=wrap, link_bandwidth=draw(st.floats(1e6, 1e12)))


@st.composite
def small_trees(draw):
    gpus = draw(st.integers(0, 6))
    cpus = draw(st.integers(0 if gpus else 1, 2))
    per_switch = draw(st.integers(1, 4))
    hosts = draw(st.integers(1, 3))

    def host(h: str) -> Cluster:
        return pcie_tree(gpus, per_switch, cpus=cpus, host=h)

    if hosts == 1:
        return host("host0")
    return multi_host(hosts, host, nic_bandwidth=12.5e9, nic_per_device=draw(st.booleans()))


@settings(max_examples=40, deadline=None)
@given(small_tori(), st.data())
def test_torus_routes_valid_and_minimal(c, data):
    n = len(c)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1))
    r = check_route(c, i, j)
    expected = 0
    for d, (a, b) in enumerate(zip(c.coords(i), c.coords(j), strict=True)):
        size, wraps = c.dims[d], c._torus.wrap[d]
        expected += min((b - a) % size, (a - b) % size) if wraps else abs(b - a)
    assert len(r) == expected
    assert c.transfer_time(i, j, 1e6) == pytest.approx(
        c.path_latency(i, j) + (1e6 / c.path_bandwidth(i, j) if i != j else 0.0)
    )


@settings(max_examples=40, deadline=None)
@given(small_trees(), st.data())
def test_tree_routes_valid(c, data):
    n = len(c)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1))
    check_route(c, i, j)
    assert sorted(c.ring_order()) == list(range(n))


# ------------------------------------------------------------------ YAML
def docs_example() -> str:
    text = DOCS.read_text()
    m = re.search(r"### Full example\s+```yaml\n(.*?)```", text, re.S)
    assert m
    return m.group(1)


def test_docs_example_loads_and_round_trips(tmp_path):
    c = cluster_from_yaml(docs_example(), "example.yaml")
    assert c.device_names == ["cpu0", "gpu0", "gpu1", "npu0", "npu1"]
    assert c.device("gpu0").spec.memory_bytes == 32 * 2**30
    assert c.device("gpu1").spec.launch_overhead_s == 7e-6
    assert c.device("npu1").spec.peak("bfloat16") == 400e12
    assert c.path_bandwidth("npu0", "npu1") == 25e9
    assert c.path_bandwidth("gpu0", "gpu1") == 50e9  # the bridge beats PCIe
    path = tmp_path / "out.yaml"
    save_cluster(c, path)
    again = load_cluster(str(path))
    assert describe(again) == describe(c)
    assert cluster_to_yaml(again) == path.read_text()
    for i in range(len(c)):
        for j in range(len(c)):
            assert again.route(i, j) == c.route(i, j)


@pytest.mark.parametrize("name", ["tpu-v3-8", "colocrl-4gpu", "h2-8xh100"])
def test_presets_round_trip(name):
    c = load_cluster(name)
    data = cluster_to_dict(c)
    assert "topology" in data
    again = cluster_from_yaml(cluster_to_yaml(c), "rt.yaml")
    assert describe(again) == describe(c)
    assert again.dims == c.dims
    assert [again.route(0, j) for j in range(len(c))] == [c.route(0, j) for j in range(len(c))]


def test_topology_blocks():
    doc = DOCS.read_text()
    blocks = re.findall(r"```yaml\n(name: .*?)```", doc, re.S)
    assert len(blocks) == 2
    v4 = cluster_from_yaml(blocks[0], "v4.yaml")
    assert len(v4) == 128 and v4.dims == (4, 4, 8)
    dgx2 = cluster_from_yaml(blocks[1], "two.yaml")
    assert len(dgx2) == 20 and dgx2.path_bandwidth(2, 12) == 25e9


_TWO = "name: x\ndevices: [{name: a, kind: v100}, {name: b, kind: v100}]\n"
BAD_YAML = [
    (_TWO + "links: [{src: a, dst: b, bandwidth: 0}]", ClusterError, r"links\[0\]\.bandwidth"),
    (_TWO + "links: [{src: a, dst: b, bandwidth: -5 GB/s}]", ClusterError, "greater than 0"),
    (_TWO + "links: [{src: a, dst: b, bandwidth: 5 GHz}]", ClusterError, "unknown unit 'GHz'"),
    (_TWO + "links: [{src: a, dst: b, bandwidth: 1e9, latency: -1 us}]", ClusterError, "latency"),
    ("name: x\ndevices: [{name: a, kind: v1000}]", UnknownDeviceError, "allowed kinds: .*v100"),
    (_TWO + "links: [{src: a, dst: c, bandwidth: 1e9}]", ClusterError, "names node 'c'"),
    ("name: x\ndevices: [{name: a, kind: v100}, {name: a, kind: k80}]", ClusterError, "two dev"),
    ("name: x\ndevices: [{name: a, kind: v100}\n  links: :", ClusterError, "not valid YAML"),
    ("- a\n- b\n", ClusterError, "must be a mapping"),
    (_TWO + "links: []", ClusterError, "unreachable from device 'a'"),
    (
        _TWO + "links: [{src: a, dst: b, bandwidth: 1e9, bidirectional: false}]",
        ClusterError,
        "no route back",
    ),
    ("name: x\ndevices: [{name: a, kind: v100, colour: red}]", ClusterError, "unknown field"),
    ("name: x\ntopology: {generator: ring}", ClusterError, "allowed generators: pcie_tree"),
    ("name: x\ntopology: {generator: torus, dims: [0, 4]}", ClusterError, r"dims\[0\]"),
    (
        "name: x\ntopology: {generator: torus, dims: [2], device_kind: x}",
        UnknownDeviceError,
        "kind .x.",
    ),
    (
        "name: x\ndevices: [{name: a, kind: v100, peak_flops: {int4: 1}}]",
        ClusterError,
        "unknown dtype 'int4'",
    ),
    ("name: x\n", ClusterError, "'devices' is empty"),
    (_TWO + "transfers: always\nlinks: []", ClusterError, "transfers"),
    ("name: x\ndevices: [{name: a, kind: v100, transfers: yes}]", ClusterError, "transfers"),
]


def test_transfers_occupy_per_cluster_kind_and_device_and_round_trip():
    text = (
        "name: fpga\ntransfers: occupy\n"
        "device_kinds: {card: {base: v100, transfers: overlap}}\n"
        "devices: [{count: 2, kind: v100}, {name: host, kind: xeon, transfers: overlap},"
        " {name: c, kind: card}]\n"
        "switches: [sw]\n"
        "links: [{src: gpu0, dst: sw, bandwidth: 1e9}, {src: gpu1, dst: sw, bandwidth: 1e9},"
        " {src: host, dst: sw, bandwidth: 1e9}, {src: c, dst: sw, bandwidth: 1e9}]\n"
    )
    c = cluster_from_yaml(text, "fpga.yaml")
    # the cluster's default, unless a device or its kind says otherwise
    assert [d.spec.transfers for d in c.devices] == ["occupy", "occupy", "overlap", "overlap"]
    again = cluster_from_yaml(cluster_to_yaml(c), "rt.yaml")
    assert describe(again) == describe(c)
    assert {d.spec.transfers for d in c.with_transfers("occupy").devices} == {"occupy"}
    with pytest.raises(ClusterError, match="allowed: overlap, occupy"):
        c.with_transfers("sometimes")


@pytest.mark.parametrize(("text", "error", "pattern"), BAD_YAML)
def test_bad_yaml_one_sentence(text, error, pattern):
    with pytest.raises(error, match=pattern) as e:
        cluster_from_yaml(text, "bad.yaml")
    msg = str(e.value)
    assert isinstance(e.value, InputError)
    assert msg.startswith("bad.yaml: ")
    assert "\n" not in msg and ". " not in msg.replace("e.g. ", "")


def test_bad_link_in_python_api():
    spec = device_spec("k80")
    devs = [Device("a", "k80", spec), Device("b", "k80", spec)]
    with pytest.raises(ClusterError, match="greater than 0"):
        Cluster("x", devs, [Link("l", "a", "b", 0.0, 0.0), Link("m", "b", "a", 1.0, 0.0)])


# ------------------------------------------------------------------ describe / units
def test_describe_totals():
    c = load_cluster("dgx-a100")
    d = describe(c)
    assert d["totals"]["devices"] == 10
    assert d["totals"]["peak_flops"]["bfloat16"] == pytest.approx(
        8 * 312e12 + 2 * device_spec("epyc-7742").peak("float32")
    )
    assert d["totals"]["memory_bytes"] == 8 * 80 * 2**30 + 2 * 1024 * 2**30
    assert set(d["devices"][0]) >= {"name", "kind", "host", "peak_flops", "memory_bytes"}
    assert set(d["links"][0]) >= {"name", "src", "dst", "bandwidth", "latency"}


def test_print_cluster_is_compact_for_pods():
    out = StringIO()
    print_cluster(Console(file=out, width=140), load_cluster("tpu-v3-pod"))
    text = out.getvalue()
    assert "tpu-v3" in text and "1024" in text
    assert text.count("\n") < 40
    out = StringIO()
    print_cluster(Console(file=out, width=140), load_cluster("colocrl-4gpu"))
    assert "gpu3" in out.getvalue()


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("100 Gb/s", "bandwidth", 12.5e9),
        ("12 GB/s", "bandwidth", 12e9),
        ("1 GiB/s", "bandwidth", 2**30),
        ("5 us", "time", 5e-6),
        ("5 µs", "time", 5e-6),
        ("2 ms", "time", 2e-3),
        ("1e9", "bandwidth", 1e9),
        (3, "time", 3.0),
        ("16 GiB", "bytes", 16 * 2**30),
        ("15.7 TFLOP/s", "flops", 15.7e12),
    ],
)
def test_units(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


def test_units_reject_nonsense():
    for bad in ("fast", "5 parsecs", True, "nan GB/s"):
        with pytest.raises(ValueError):
            parse_quantity(bad, "bandwidth")


# ------------------------------------------------------------------ hostile YAML (issue 13)
ALIAS_BOMB = """name: bomb
devices: [{name: gpu0, kind: v100}]
meta:
  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
  i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""
_ONE = "name: x\ndevices: [{name: a, kind: v100}]\n"

HOSTILE_YAML = [
    (ALIAS_BOMB, "YAML aliases expand 39 written values to 490,329,075"),
    (_ONE + "meta: &m {self: [*m]}\n", "refers to a collection that contains it"),
    (_ONE + "name: y\n", "key 'name' appears twice in one mapping (line 3)"),
    (_ONE + "meta: {x: " + "[" * 100_000 + "]" * 100_000 + "}\n", "nested more than 64 levels"),
    (_ONE + "meta: {x: " + "[" * 70 + "]" * 70 + "}\n", "nested more than 64 levels"),
    (_ONE + "meta:\n  x:\n    " + "- " * 80 + "1\n", "nested more than 64 levels"),
    (_ONE.replace("v100}", "v100, memory_bytes: " + "9" * 5001 + "}"), "too many digits"),
    (_ONE.replace("v100}", "v100, memory_bytes: " + "9" * 400 + "}"), "finite value"),
    (_ONE.replace("{name: a,", "{count: true,"), "'devices[0].count': expected an integer"),
    (_ONE.replace("{name: a,", "{count: '2',"), "expected an integer, not '2'"),
    (_TWO + "links: [{src: a, dst: b, bandwidth: 1e9, bidirectional: 'no'}]", "valid boolean"),
    (_ONE.replace("v100", "V100s"), "unknown device kind 'V100s' (did you mean 'v100'?)"),
    ("name: x\ntopology: {generator: nvlink_mesh, gpus: 65536, nvswitch: false}", "all-to-all"),
    (
        "name: x\ntopology: {generator: multi_host, hosts: 65536, nic_bandwidth: 1e9,\n"
        "  per_host: {generator: nvlink_mesh}}",
        "65536 hosts x 10 devices give 655,360 devices; at most 131,072 allowed",
    ),
    ("name: x\ndevices:\n" + "  - {count: 65536, kind: v100}\n" * 3, "196,608 devices"),
]


@pytest.mark.parametrize(("text", "pattern"), HOSTILE_YAML)
def test_hostile_yaml_is_one_sentence_naming_the_file(text, pattern):
    with pytest.raises(ClusterError) as e:
        cluster_from_yaml(text, "bad.yaml")
    msg = str(e.value)
    assert pattern in msg, msg
    assert msg.startswith("bad.yaml: ") and "\n" not in msg


def test_yaml_aliases_and_merge_keys_still_work():
    text = _TWO + "links:\n  - &l {src: a, dst: b, bandwidth: 1e9}\n  - {<<: *l, src: b, dst: a}\n"
    c = cluster_from_yaml(text, "ok.yaml")
    assert [(lk.src, lk.dst) for lk in c.links] == [("a", "b"), ("b", "a"), ("b", "a"), ("a", "b")]


def test_cluster_files_that_are_not_yaml_text(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\x00\x01name: x")
    (tmp_path / "latin.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "plain").mkdir()
    cases = {
        "bin.yaml": "is a binary file",
        "latin.yaml": "is not a UTF-8 text file",
        "dir.yaml": "is a folder, not a cluster file",
        "plain": "is a folder, not a cluster file",
        "gone.yaml": "no such cluster file",
    }
    for name, expected in cases.items():
        with pytest.raises(ClusterError, match=expected):
            load_cluster(tmp_path / name if name != "plain" else str(tmp_path / name))
    with pytest.raises(UnknownPresetError, match=r"did you mean 'colocrl-4gpu'\?"):
        load_cluster("colocrl-4gp")


def test_alias_bomb_through_the_command_line_exits_2(tmp_path):
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    proc = run_meshplace(["cluster", "bomb.yaml"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "bomb.yaml: YAML aliases expand" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["bomb.yaml"]


# ------------------------------------------------------------------ accelerators, routes
def test_accelerators_leave_out_host_cpus():
    assert load_cluster("colocrl-2gpu").accelerators() == [1, 2]
    assert load_cluster("tpu-v3-8").accelerators() == [0, 1, 2, 3]
    c = load_cluster("dgx-a100")
    assert [c.devices[i].kind for i in c.accelerators()] == ["a100-80gb"] * 8
    cpus = cluster_from_yaml(
        "name: cpus\ndevices: [{count: 2, kind: xeon}]\nswitches: [sw]\n"
        "links: [{src: cpu0, dst: sw, bandwidth: 1e9}, {src: cpu1, dst: sw, bandwidth: 1e9}]\n"
    )
    assert cpus.accelerators() == []


def test_routes_of_some_pairs_match_route():
    for c in (load_cluster("h2-8xh100"), torus((4, 4), link_bandwidth=1e9)):
        n = len(c)
        src, dst = [0, n - 1, 3, 5], [n - 1, 0, 3, 1]
        ptr, links = c.routes(src, dst)
        assert ptr.shape == (5,) and links.dtype == np.int32
        for k, (i, j) in enumerate(zip(src, dst)):
            assert tuple(links[ptr[k] : ptr[k + 1]].tolist()) == c.route(i, j)


def hand_written_hosts(hosts: int, per_host: int = 8) -> str:
    """A cluster file as a user writes it: every device and link listed, no generator."""
    lines = ["name: lab", "devices:"]
    lines += [
        f"  - {{name: h{h}/gpu{g}, kind: a100, host: h{h}}}"
        for h in range(hosts)
        for g in range(per_host)
    ]
    lines += ["switches:", "  - network", *(f"  - h{h}/sw" for h in range(hosts)), "links:"]
    for h in range(hosts):
        lines += [
            f"  - {{src: h{h}/gpu{g}, dst: h{h}/sw, bandwidth: 300 GB/s, latency: 0.5 us}}"
            for g in range(per_host)
        ]
        lines.append(f"  - {{src: h{h}/sw, dst: network, bandwidth: 25 GB/s, latency: 5 us}}")
    return "\n".join(lines) + "\n"


def test_a_2000_device_hand_written_cluster_routes_only_what_is_asked():
    c = cluster_from_yaml(hand_written_hosts(250), "lab.yaml")
    assert len(c) == 2000 and len(c.links) == 2 * 250 * 9
    r = check_route(c, c.device_index("h0/gpu1"), c.device_index("h249/gpu7"))
    assert [c.links[k].dst for k in r] == ["h0/sw", "network", "h249/sw", "h249/gpu7"]
    r = check_route(c, c.device_index("h3/gpu0"), c.device_index("h3/gpu5"))
    assert [c.links[k].dst for k in r] == ["h3/sw", "h3/gpu5"]
    assert c._table is None and len(c._trees) == 2  # one shortest-path tree per source
