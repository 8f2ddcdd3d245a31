"""Named-dimension programs and the layout search (hand layouts, the 5B target)."""

from __future__ import annotations

import pytest

from meshplace.errors import InputError
from meshplace.hardware import load_cluster
from meshplace.mesh.program import program_for, transformer_lm
from meshplace.mesh.search import (
    _canonical,
    evaluate_layout,
    hand_layout,
    mesh_shapes,
    search,
)
from meshplace.models import get


@pytest.fixture(scope="module")
def pod():
    return load_cluster("tpu-v3-pod")


@pytest.fixture(scope="module")
def lm5b():
    return program_for("transformer", size="5b")


@pytest.mark.parametrize(
    ("model", "size"),
    [("transformer", "5b"), ("transformer", "base"), ("gpt", "1.5b"), ("resnet50", None)],
)
def test_programs_have_the_models_parameters(model, size):
    prog = program_for(model, size=size)
    torch_params = sum(p.numel() for p in get(model, size=size).model.parameters())
    assert prog.param_count() == torch_params


def test_backward_is_twice_the_forward_einsums(lm5b):
    rep = {i: u.repeat for i, u in enumerate(lm5b.units)}

    def flops(phase):
        return sum(
            o.flops * rep[o.unit] for o in lm5b.ops if o.phase == phase and o.kind == "einsum"
        )

    # the embedding's input ids need no gradient: backward is just under 2x
    assert 1.95 < flops("backward") / flops("forward") <= 2.0


def test_mesh_shapes():
    assert mesh_shapes(512, 2) == [(512,), (2, 256), (4, 128), (8, 64), (16, 32)]
    assert (8, 8, 8) in mesh_shapes(512, 3)
    assert mesh_shapes(1) == [(1,)]


def test_search_finds_the_hand_layout_on_a_4x4_mesh(pod):
    prog = transformer_lm(
        {
            "batch": 64,
            "seq": 256,
            "d_model": 1024,
            "d_ff": 8192,
            "heads": 16,
            "d_kv": 64,
            "layers": 2,
            "vocab": 32000,
        }
    )
    res = search(prog, pod, chips=16, mesh_shape=(4, 4), weight_update_sharding="off")
    hand = {"batch": "x", "d_ff": "y", "heads": "y", "vocab": "y"}
    assert _canonical((4, 4), res.best.rules) == _canonical((4, 4), hand)
    assert res.best.fits


def test_5b_transformer_on_512_chips_within_target(pod, lm5b):
    res = search(lm5b, pod, chips=512)
    # Within target as fixed work: each legal layout is costed at most twice (weight-update
    # sharding off and on), and legality prunes most of the mesh shapes x rules (seconds:
    # the search's own `seconds`, well under the 60 s target; no test times it).
    assert res.evaluated <= 2 * res.legal
    assert res.mesh_shapes == mesh_shapes(512, 2)
    rules_per_shape = [(len(shape) + 1) ** len(lm5b.search_dims) for shape in res.mesh_shapes]
    assert 4 * res.legal < sum(rules_per_shape)
    best = res.best
    assert best.fits and best.mesh.size == 512
    shape, rules = hand_layout(lm5b, 512)
    assert shape == (16, 32)
    assert rules == {"batch": "x", "d_ff": "y", "heads": "y", "vocab": "y"}
    hand = min(
        evaluate_layout(lm5b, pod, shape, rules, weight_update_sharding=w).step_time_s
        for w in (False, True)
    )
    assert best.step_time_s <= hand * (1 + 1e-9)
    # the best layouts are the hand layout's family: batch on one axis, the model on the other
    assert set(best.rules) == {"batch", "d_ff", "heads", "vocab"}
    assert len({best.rules["d_ff"], best.rules["heads"], best.rules["vocab"]}) == 1
    assert best.rules["batch"] != best.rules["d_ff"]


def test_data_parallel_5b_does_not_fit(pod, lm5b):
    cost = evaluate_layout(lm5b, pod, (256,), {"batch": "x"})
    assert not cost.fits


def test_pinned_rules_are_kept(pod):
    prog = transformer_lm(
        {
            "batch": 32,
            "seq": 64,
            "d_model": 256,
            "d_ff": 1024,
            "heads": 8,
            "d_kv": 32,
            "layers": 2,
            "vocab": 4096,
        }
    )
    res = search(prog, pod, chips=16, mesh_shape=(4, 4), pinned={"batch": "y", "heads": None})
    for cost in res.ranked:
        assert cost.rules["batch"] == "y" and "heads" not in cost.rules


def test_model_that_fits_no_layout_is_one_sentence(lm5b):
    with pytest.raises(InputError, match=r"fits no layout on 4 chips .* GiB per device"):
        search(lm5b, load_cluster("tpu-v3-8"))


def test_spatial_partitioning_beyond_the_batch(pod):
    prog = program_for("detection", batch=64)
    res = search(prog, pod, chips=256)
    assert {"height", "width"} & set(res.best.rules)
    assert res.best.comm_s["halo"] > 0
