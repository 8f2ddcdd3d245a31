"""Meshes over clusters (axes aligned with torus rings) and Mesh-TensorFlow legality."""

from __future__ import annotations

import pytest

from meshplace.cost.collectives import collective_time
from meshplace.errors import InputError
from meshplace.hardware import load_cluster
from meshplace.mesh.layout import LayoutError, build_mesh, check_tensor, parse_mesh_shape


@pytest.fixture(scope="module")
def pod():
    return load_cluster("tpu-v3-pod")


def test_mesh_axes_follow_torus_dimensions(pod):
    mesh = build_mesh(pod, (16, 32), chips=512)
    x, y = mesh.axis("x"), mesh.axis("y")
    assert [s.size for s in x.stages] == [16] and [s.size for s in y.stages] == [32]
    # y is a whole 32-chip torus ring: two directions of 100 GB/s links, 1 hop per step
    assert y.stages[0].bandwidth == pytest.approx(200e9)
    assert y.stages[0].latency == pytest.approx(1e-6)
    # x is 16 chips of a 32-ring (a line): the folded ring keeps every step within 2 hops
    assert x.stages[0].bandwidth == pytest.approx(100e9)
    assert x.stages[0].latency == pytest.approx(2e-6)
    # neighbours along y are torus neighbours along one torus dimension
    a, b = (pod.coords(int(d)) for d in mesh.devices[3, 4:6])
    assert a[0] == b[0] and abs(a[1] - b[1]) == 1


def test_whole_pod_axis_is_the_2d_torus_all_reduce(pod):
    mesh = build_mesh(pod, (1024,))
    assert [s.size for s in mesh.axis("x").stages] == [32, 32]
    got = mesh.collective_time("all_reduce", 100e6, ["x"])
    want = collective_time(
        "all_reduce", "torus", 100e6, dims=(32, 32), bandwidth=200e9, latency=1e-6
    )
    assert got == pytest.approx(want)


def test_mesh_on_switched_cluster_skips_cpus():
    dgx = load_cluster("dgx-h100")
    mesh = build_mesh(dgx, (8,))
    assert all(dgx.devices[int(d)].spec.category == "gpu" for d in mesh.devices)
    (stage,) = mesh.axis("x").stages
    assert stage.size == 8 and stage.bandwidth == pytest.approx(450e9)


def test_mesh_shape_must_match_chip_count(pod):
    with pytest.raises(LayoutError, match="product of the mesh shape"):
        build_mesh(pod, (16, 16), chips=512)
    with pytest.raises(LayoutError, match="has 1024 accelerators"):
        build_mesh(pod, (64, 32))


def test_two_dims_of_one_tensor_on_one_axis_is_illegal():
    with pytest.raises(LayoutError) as err:
        check_tensor("scores", (("batch", 8), ("heads", 8)), {"batch": "x", "heads": "x"}, {"x": 4})
    msg = str(err.value)
    assert "'scores'" in msg and "'batch'" in msg and "'heads'" in msg and "'x'" in msg
    assert isinstance(err.value, InputError)


def test_uneven_division_is_illegal():
    with pytest.raises(LayoutError, match=r"tensor 'w1': dimension 'd_ff' of size 1000 does"):
        check_tensor("w1", (("d_model", 64), ("d_ff", 1000)), {"d_ff": "y"}, {"y": 16})


def test_unknown_axis_is_named():
    with pytest.raises(LayoutError, match="no axis 'z'"):
        check_tensor("x", (("batch", 8),), {"batch": "z"}, {"x": 2, "y": 4})


def test_legal_layout_maps_each_dimension():
    assert check_tensor(
        "q",
        (("batch", 8), ("seq", 4), ("heads", 8)),
        {"batch": "x", "heads": "y"},
        {"x": 2, "y": 4},
    ) == ("x", None, "y")


@pytest.mark.parametrize("text", ["16by32", "0x4", "", "1x2x3x4x5"])
def test_bad_mesh_shape_text(text):
    with pytest.raises(LayoutError):
        parse_mesh_shape(text)
