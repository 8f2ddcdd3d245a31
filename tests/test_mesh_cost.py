"""Collectives derived from layouts, weight-update sharding, halos, memory, overlap."""

from __future__ import annotations

import math

import pytest

from meshplace.errors import InputError
from meshplace.hardware import load_cluster
from meshplace.mesh.cost import evaluate
from meshplace.mesh.jax_export import dtensor_placements, partition_specs
from meshplace.mesh.layout import LayoutError, build_mesh
from meshplace.mesh.program import (
    ProgramBuilder,
    program_for,
    transformer_block,
    transformer_lm,
)
from meshplace.mesh.search import evaluate_layout


@pytest.fixture(scope="module")
def pod():
    return load_cluster("tpu-v3-pod")


def _matmul():
    b = ProgramBuilder("mm")
    x = b.input("x", [("batch", 64), ("d_model", 1024)])
    w = b.param("w", [("d_model", 1024), ("d_ff", 4096)])
    b.einsum("y", x, w, ["batch", "d_ff"])
    return b.build("adam", search_dims=("batch", "d_model", "d_ff"), samples=64)


def _by(cost, **match):
    return [c for c in cost.collectives if all(getattr(c, k) == v for k, v in match.items())]


def test_contraction_over_split_dim_is_one_all_reduce_of_the_output(pod):
    mesh = build_mesh(pod, (4, 4), chips=16)
    cost = evaluate(_matmul(), mesh, {"d_model": "x"})
    (ar,) = _by(cost, phase="forward")
    assert (ar.op, ar.kind, ar.axes) == ("y", "all_reduce", ("x",))
    assert ar.nbytes == 64 * 4096 * 2  # the local output: batch x d_ff, bfloat16
    assert ar.time_s == pytest.approx(mesh.collective_time("all_reduce", ar.nbytes, ["x"]))
    # the weight's gradient contracts only the (unsplit) batch: no gradient collective
    assert not _by(cost, category="gradient")


def test_split_output_dim_needs_no_collective(pod):
    cost = evaluate(_matmul(), build_mesh(pod, (4,), chips=4), {"d_ff": "x"})
    assert not cost.collectives


def test_data_parallel_gradient_all_reduce_and_weight_update_sharding(pod):
    mesh = build_mesh(pod, (16,), chips=16)
    off = evaluate(_matmul(), mesh, {"batch": "x"})
    on = evaluate(_matmul(), mesh, {"batch": "x"}, weight_update_sharding=True)
    (ar,) = off.collectives
    grad_bytes = 1024 * 4096 * 4
    assert (ar.kind, ar.axes, ar.nbytes, ar.category) == (
        "all_reduce",
        ("x",),
        grad_bytes,
        "gradient",
    )
    kinds = sorted((c.kind, c.category, c.nbytes) for c in on.collectives)
    assert kinds == [
        ("all_gather", "weight_gather", grad_bytes),
        ("reduce_scatter", "gradient", grad_bytes),
    ]
    # ring: all-reduce = reduce-scatter + all-gather
    assert sum(c.time_s for c in on.collectives) == pytest.approx(ar.time_s)
    # sharded update: 1/16 of the optimizer work and of the Adam state
    assert on.compute_s["update"] < off.compute_s["update"] / 4
    assert on.memory["optimizer"] == pytest.approx(off.memory["optimizer"] / 16)
    # gradients: 1/16 kept after the reduce-scatter, plus the largest layer's full one
    assert on.memory["gradients"] == pytest.approx(grad_bytes / 16 + grad_bytes)
    assert on.memory["weights"] == off.memory["weights"]


def test_weight_update_sharding_lowers_step_time_at_scale(pod):
    prog = program_for("transformer", size="big", batch=2048)
    off = evaluate_layout(prog, pod, (1024,), {"batch": "x"})
    on = evaluate_layout(prog, pod, (1024,), {"batch": "x"}, weight_update_sharding=True)
    assert on.step_time_s < 0.8 * off.step_time_s
    assert on.peak_memory_bytes < off.peak_memory_bytes


def test_model_parallel_mlp_reduces_once_forward_and_once_backward(pod):
    prog = transformer_lm(
        {
            "batch": 16,
            "seq": 64,
            "d_model": 256,
            "d_ff": 1024,
            "heads": 8,
            "d_kv": 32,
            "layers": 3,
            "vocab": 1024,
        }
    )
    cost = evaluate(prog, build_mesh(pod, (4,), chips=4), {"d_ff": "x"})
    fc = [(c.op, c.phase, c.kind, c.count) for c in cost.collectives if ".fc" in c.op]
    assert sorted(fc) == [
        ("layer.fc1.d0", "backward", "all_reduce", 3),
        ("layer.fc2", "forward", "all_reduce", 3),
    ]


def test_partial_sums_of_q_k_v_are_reduced_once(pod):
    prog_lm = transformer_lm(
        {
            "batch": 8,
            "seq": 16,
            "d_model": 32,
            "d_ff": 64,
            "heads": 8,
            "d_kv": 8,
            "layers": 1,
            "vocab": 64,
        }
    )
    cost = evaluate(prog_lm, build_mesh(pod, (4,), chips=4), {"heads": "x"})
    attn_bwd = [c.op for c in cost.collectives if c.phase == "backward" and "attn" in c.op]
    assert attn_bwd == ["dlayer.attn_norm"]


def test_sequence_split_gathers_keys_and_scatters_their_gradient(pod):
    prog = transformer_lm(
        {
            "batch": 8,
            "seq": 64,
            "d_model": 64,
            "d_ff": 128,
            "heads": 4,
            "d_kv": 16,
            "layers": 1,
            "vocab": 64,
        }
    )
    cost = evaluate(prog, build_mesh(pod, (4,), chips=4), {"seq": "x"})
    kv = {(c.kind, c.phase) for c in cost.collectives if "kv_in" in c.op}
    assert kv == {("all_gather", "forward"), ("reduce_scatter", "backward")}
    (ag,) = [c for c in cost.collectives if c.kind == "all_gather" and "kv_in" in c.op]
    assert ag.nbytes == 8 * 64 * 64 * 2  # gathered: the whole sequence


def test_spatial_partitioning_exchanges_halos(pod):
    b = ProgramBuilder("conv")
    x = b.input("img", [("batch", 8), ("height", 64), ("width", 32), ("channels", 16)])
    w = b.param("w", [("kh", 3), ("kw", 3), ("in_channels", 16), ("channels", 16)])
    b.conv("c", x, w, channels=16, kernel=3)
    prog = b.build(
        "sgd",
        search_dims=("batch", "height", "width"),
        samples=8,
        splittable=("batch", "height", "width"),
    )
    cost = evaluate(prog, build_mesh(pod, (4,), chips=4), {"height": "x"})
    (halo,) = _by(cost, phase="forward", category="halo")
    # one row above and one below: 2 x width x channels x batch x 2 bytes
    assert (halo.kind, halo.axes, halo.nbytes) == (
        "collective_permute",
        ("x",),
        2 * 32 * 16 * 8 * 2,
    )
    # the weight gradient sums over the split height: a gradient reduction over x
    assert _by(cost, category="gradient")[0].axes == ("x",)
    # 1x1 convolutions need no halo
    b2 = ProgramBuilder("conv1")
    x2 = b2.input("img", [("batch", 8), ("height", 64), ("width", 32), ("channels", 16)])
    b2.conv(
        "c",
        x2,
        b2.param("w", [("kh", 1), ("kw", 1), ("in_channels", 16), ("channels", 16)]),
        channels=16,
        kernel=1,
    )
    p2 = b2.build("sgd", search_dims=("height",), samples=8, splittable=("height",))
    assert not _by(evaluate(p2, build_mesh(pod, (4,), chips=4), {"height": "x"}), category="halo")


def test_step_time_is_compute_plus_exposed_communication(pod):
    prog = program_for("transformer", size="5b")
    cost = evaluate_layout(
        prog,
        pod,
        (16, 32),
        {"batch": "x", "d_ff": "y", "heads": "y", "vocab": "y"},
        weight_update_sharding=True,
    )
    total = sum(cost.compute_s.values()) + cost.exposed_comm_s
    assert cost.step_time_s == pytest.approx(total)
    for cat, t in cost.comm_s.items():
        assert 0 <= cost.exposed_s[cat] <= t + 1e-12
    assert cost.overlapped_comm_s > 0  # gradient reduction hides behind backward compute
    assert math.isclose(cost.exposed_s["layout"], cost.comm_s["layout"])
    assert cost.fits and cost.peak_memory_bytes == pytest.approx(sum(cost.memory.values()))


def test_layout_sharding_divides_weights_and_compute(pod):
    prog = program_for("transformer", size="5b")
    one = evaluate_layout(prog, pod, (32,), {"d_ff": "x", "heads": "x", "vocab": "x"})
    assert one.memory["weights"] < 4 * prog.param_count() / 32 * 1.01


def test_illegal_rules_raise_layout_error(pod):
    prog = program_for("transformer", size="5b")
    with pytest.raises(LayoutError, match=r"tensor 'layer\.q'"):
        evaluate_layout(prog, pod, (16, 32), {"batch": "x", "heads": "x"})
    with pytest.raises(LayoutError, match="does not have"):
        evaluate_layout(prog, pod, (16, 32), {"hidden": "x"})
    resnet = program_for("resnet50")
    with pytest.raises(LayoutError, match="cannot be split"):
        evaluate_layout(resnet, pod, (4,), {"channels": "x"})
    with pytest.raises(LayoutError, match="size 7 does not divide"):
        evaluate_layout(resnet, pod, (2,), {"height": "x"})


def test_exports_as_partition_specs_and_dtensor_placements():
    prog = transformer_block(
        {"batch": 8, "seq": 16, "d_model": 32, "d_ff": 64, "heads": 8, "d_kv": 8}
    )
    rules = {"batch": "x", "heads": "y", "d_ff": "y"}
    specs = partition_specs(prog, rules)
    assert specs["q_w"] == (None, "y", None) and specs["o_w"] == ("y", None, None)
    dt = dtensor_placements(prog, ("x", "y"), rules, (2, 4))
    assert dt["placements"]["x"] == ["Shard(0)", "Replicate()"]
    assert dt["placements"]["fc1_w"] == ["Replicate()", "Shard(1)"]
    assert dt["device_mesh"] == {"mesh_dim_names": ["x", "y"], "shape": [2, 4]}


SMALL_LM = {
    "batch": 8,
    "seq": 256,
    "d_model": 64,
    "d_ff": 128,
    "heads": 4,
    "d_kv": 16,
    "layers": 2,
    "vocab": 64,
}


def test_pytorch_kernels_keep_attention_scores_on_chip_and_cast_each_weight_once(pod):
    mesh_tf = transformer_lm(SMALL_LM, bias=True, norm="layer")
    torch_like = transformer_lm(SMALL_LM, bias=True, norm="layer", kernels="pytorch")
    # the default lowering is Mesh-TensorFlow's: every value materialised, nothing cast
    assert all(t.materialised for t in mesh_tf.tensors.values())
    assert not any(o.casts or o.epilogue for o in mesh_tf.ops)
    # FlashAttention: scores and probabilities (and their gradients) stay on chip
    on_chip = {n for n, t in torch_like.tensors.items() if not t.materialised}
    assert {"layer.scores", "layer.softmax"} <= on_chip
    assert all({"seq", "kv_seq"} <= set(torch_like.tensors[n].names) for n in on_chip)
    # autocast: each weight and bias a forward matmul reads is cast once per step, and its
    # gradient widened once; the norm's float32 output is cast once for q, k and v together
    for phase in ("forward", "backward"):
        cast = [x for o in torch_like.ops if o.phase == phase for x in o.casts]
        assert len(cast) == len(set(cast))
        assert {f"layer.{p}_w" for p in ("q", "k", "v", "o", "fc1", "fc2")} <= set(cast)
        assert {f"layer.{p}_bias" for p in ("q", "k", "v", "o", "fc1", "fc2")} <= set(cast)
    norm_casts = [(o.name, o.phase) for o in torch_like.ops if "layer.attn_norm" in o.casts]
    assert norm_casts == [("layer.q", "forward"), ("layer.q.d0", "backward")]
    readers = [o.name for o in torch_like.ops if "layer.attn_norm" in o.reads_cast]
    assert readers[:3] == ["layer.q", "layer.k", "layer.v"]
    # same layout, same FLOPs: the seq x seq scores no longer count as saved activations,
    # and the bias adds cost nothing of their own (addmm's epilogue)
    mesh = build_mesh(pod, (4,), chips=4)
    a = evaluate(mesh_tf, mesh, {"batch": "x"})
    b = evaluate(torch_like, mesh, {"batch": "x"})
    scores = 8 * 4 * 256 * 256 * 2 / 4  # bf16, batch split 4 ways
    assert a.memory["activations"] - b.memory["activations"] >= 2 * 2 * scores  # 2 layers
    assert mesh_tf.forward_flops() == torch_like.forward_flops()


def test_pytorch_kernels_project_keys_before_gathering_the_sequence(pod):
    prog = transformer_lm(SMALL_LM, kernels="pytorch")
    cost = evaluate(prog, build_mesh(pod, (4,), chips=4), {"seq": "x"})
    gathered = {c.op for c in cost.collectives if c.kind == "all_gather"}
    assert gathered == {"layer.k_all", "layer.v_all"}  # k and v, not the layer's input
    (ag,) = [c for c in cost.collectives if c.op == "layer.k_all"]
    assert ag.nbytes == 8 * 256 * 4 * 16 * 2  # the whole sequence of keys, bf16


def test_unknown_kernels_is_an_input_error():
    with pytest.raises(InputError, match="kernels 'xla'"):
        transformer_lm(SMALL_LM, kernels="xla")


def test_pytorch_fused_kernels_run_a_pointwise_chain_as_one_kernel(pod):
    def program(kernels: str):
        b = ProgramBuilder("chain", kernels=kernels)
        x = b.input("x", [("batch", 512), ("d_model", 1024)])
        a = b.pointwise("a", [x])  # read only by b: stays inside the fused kernel
        c = b.pointwise("c", [a])
        w = b.param("w", [("d_model", 1024), ("d_ff", 1024)])
        b.einsum("y", c, w, ["batch", "d_ff"])
        return b.build("sgd", search_dims=("batch", "d_model", "d_ff"), samples=512)

    mesh = build_mesh(pod, (4,), chips=4)
    eager = evaluate(program("pytorch"), mesh, {"batch": "x"})
    fused = evaluate(program("pytorch-fused"), mesh, {"batch": "x"})
    assert program("pytorch-fused").meta["kernels"] == "pytorch-fused"
    a_bytes = 512 * 1024 * 2 / 4  # bf16, batch split 4 ways
    assert eager.memory["activations"] - fused.memory["activations"] == a_bytes
    assert fused.compute_s["forward"] < eager.compute_s["forward"]
    assert fused.compute_s["backward"] == eager.compute_s["backward"]  # nothing to fuse


def test_a_fused_qkv_projection_is_split_free_and_its_gradient_concatenated_once(pod):
    separate = transformer_lm(SMALL_LM, bias=True, norm="layer", kernels="pytorch")
    fused = transformer_lm(SMALL_LM, bias=True, norm="layer", kernels="pytorch", fused_qkv=True)
    assert fused.param_count() == separate.param_count()
    assert fused.tensors["layer.qkv_w"].names == ("d_model", "qkv", "heads", "d_kv")
    splits = [o for o in fused.ops if o.kind == "split"]
    assert [o.output for o in splits] == ["layer.q", "layer.k", "layer.v"]
    # backward: the three gradients meet in one op writing the whole projection's gradient
    (concat,) = [o for o in fused.ops if o.kind == "accumulate" and o.output == "dlayer.qkv_b"]
    assert len(concat.inputs) == 3
    assert fused.forward_flops() == separate.forward_flops()
    mesh = build_mesh(pod, (4,), chips=4)
    cost = evaluate(fused, mesh, {"seq": "x"})
    gathered = {c.op for c in cost.collectives if c.kind == "all_gather"}
    assert gathered == {"layer.k_all", "layer.v_all"}
    # fewer kernels: one projection, one cast of its weight and bias, one update each
    assert cost.compute_s["update"] < evaluate(separate, mesh, {"seq": "x"}).compute_s["update"]
