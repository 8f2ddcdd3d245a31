"""Capturing PyTorch models: phases, module paths, backward links, FLOPs, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplace.graph import CaptureError, OpGraph, capture
from meshplace.graph.flops import flop_count, op_kind


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.relu(self.norm(self.fc1(x)))), y)


def _mlp_inputs(batch: int = 16):
    return (torch.randn(batch, 32), torch.zeros(batch, dtype=torch.long))


def test_training_graph_has_forward_backward_and_update_with_true_dependencies() -> None:
    g = capture(_MLP(), _mlp_inputs(), training=True, dims={"batch": 16})
    phases = g.count_by("phase")
    assert set(phases) == {"forward", "backward", "update"}
    names = [o.name for o in g.ops]
    nxg = g.to_networkx()
    import networkx as nx

    # The update of fc1.weight depends on the loss, which depends on fc1's forward matmul.
    updates = [o for o in g.ops if o.phase == "update" and o.colocation == "param:fc1.weight"]
    update = updates[-1]  # the op that writes the new weight
    fwd_mm = next(o for o in g.ops if o.kind == "matmul" and o.module == "fc1")
    assert nx.has_path(nxg, fwd_mm.name, update.name)
    assert nx.has_path(nxg, "param:fc1.weight", fwd_mm.name)
    assert names.index(fwd_mm.name) < names.index(update.name)


def test_backward_ops_link_to_their_forward_op_and_module() -> None:
    g = capture(_MLP(), _mlp_inputs(), training=True)
    backward = [o for o in g.ops if o.phase == "backward" and o.kind == "matmul"]
    assert backward, "expected gradient matmuls"
    for o in backward:
        assert o.forward_op is not None
        fwd = g.op(o.forward_op)
        assert fwd.phase == "forward"
        assert fwd.kind == "matmul"
        assert o.module == fwd.module in ("fc1", "fc2")
    ln_grad = next(o for o in g.ops if o.kind == "layer_norm_grad")
    assert g.op(ln_grad.forward_op).kind == "layer_norm"
    assert ln_grad.module == "norm"


def test_parameters_own_their_bytes_and_optimizer_state() -> None:
    g = capture(_MLP(), _mlp_inputs(), training=True, optimizer="adam")
    p = g.op("param:fc1.weight")
    assert p.kind == "parameter"
    assert p.param_bytes == 64 * 32 * 4
    assert p.state_bytes == 2 * 64 * 32 * 4
    total = sum(q.numel() for q in _MLP().parameters())
    assert g.meta["params"] == total
    assert g.param_bytes() == total * 4
    sgd = capture(_MLP(), _mlp_inputs(), training=True, optimizer="sgd")
    assert sgd.op("param:fc1.weight").state_bytes == 0
    assert sgd.count_by("phase")["update"] < g.count_by("phase")["update"]
    # optimizer.step() writes the new moments and weight over the old: per parameter the
    # three ops doing so (Adam), one (SGD), each an update op of that parameter
    n_params = len(list(_MLP().parameters()))
    for graph, per_param in ((g, 3), (sgd, 1)):
        written = [graph.op(n) for n in graph.meta["in_place_updates"]]
        assert len(written) == per_param * n_params
        assert {o.phase for o in written} == {"update"}
    adam_ops = sorted(o.target.split(".")[1] for o in written_ops(g, "fc1.weight"))
    assert adam_ops == ["add", "addcdiv", "addcmul"]


def written_ops(graph: OpGraph, param: str) -> list:
    """The in-place-update ops of one parameter."""
    ops = [graph.op(n) for n in graph.meta["in_place_updates"]]
    return [o for o in ops if o.colocation == f"param:{param}"]


def test_inference_graph_has_only_forward_ops() -> None:
    g = capture(_MLP(), _mlp_inputs(), training=False)
    assert set(g.count_by("phase")) == {"forward"}
    assert all(o.state_bytes == 0 for o in g.ops)


def test_matmul_flops_are_exact() -> None:
    g = capture(_MLP(), _mlp_inputs(16), training=False)
    fc1 = next(o for o in g.ops if o.kind == "matmul" and o.module == "fc1")
    assert fc1.flops == 2 * 16 * 32 * 64 + 16 * 64  # addmm: matmul plus bias


def test_views_are_folded_and_edges_carry_bytes() -> None:
    g = capture(_MLP(), _mlp_inputs(), training=False)
    kinds = {o.target for o in g.ops}
    assert not any(t.startswith(("aten.t.", "aten.view.", "aten.detach.")) for t in kinds)
    fc1 = next(o for o in g.ops if o.kind == "matmul" and o.module == "fc1")
    assert g.edge_bytes("input:x", fc1.name) == 16 * 32 * 4
    assert g.edge_bytes("param:fc1.weight", fc1.name) == 64 * 32 * 4


def test_named_dimensions_label_matching_sizes() -> None:
    g = capture(_MLP(), _mlp_inputs(16), training=False, dims={"batch": 16, "hidden": 64})
    fc1 = next(o for o in g.ops if o.kind == "matmul" and o.module == "fc1")
    assert fc1.dim_names == [["batch", "hidden"]]


def test_meta_device_models_capture_without_allocating() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192))
        x = torch.empty(4, 8192)
    g = capture(model, (x,), training=True)
    assert g.meta["params"] == 2 * (8192 * 8192 + 8192)
    # Backward: fc2's grad-input and grad-weight, fc1's grad-weight only (the input needs no
    # gradient), so three matmuls against the forward pass's two.
    assert g.total_flops("backward") == pytest.approx(1.5 * g.total_flops("forward"), rel=0.02)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent branch: cannot be traced with fake tensors
            return y.mean()
        return -y.mean()


def test_data_dependent_control_flow_is_one_clear_sentence() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    message = str(info.value)
    assert message.startswith("cannot capture the model: data-dependent control flow")
    assert "test_capture.py" in message
    assert "\n" not in message


def test_bad_arguments() -> None:
    with pytest.raises(CaptureError, match="unknown optimizer 'lion'"):
        capture(_MLP(), _mlp_inputs(), optimizer="lion")
    with pytest.raises(CaptureError, match="has no trainable parameters"):
        capture(nn.ReLU(), (torch.randn(2),), training=True)
    with pytest.raises(CaptureError, match=r"needs a torch\.nn\.Module"):
        capture(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).mean()


def test_causal_attention_counts_half_the_scores() -> None:
    q = torch.randn(2, 4, 128, 64)
    g = capture(_Attention(), (q,), training=True)
    fwd = next(o for o in g.ops if o.kind == "attention")
    bwd = next(o for o in g.ops if o.kind == "attention_grad")
    scores = 2 * 4 * 128 * 128
    assert fwd.flops == pytest.approx(0.5 * (2 * scores * (64 + 64) + 5 * scores))
    assert bwd.forward_op == fwd.name
    assert bwd.flops / fwd.flops == pytest.approx(2.0, rel=0.05)


def test_conv_flops_follow_the_multiply_add_convention() -> None:
    # 3x3 conv, 16 -> 32 channels, 8x8 output: 2 * 32*8*8 * 16*9 FLOPs (+ bias).
    flops = flop_count(
        "convolution",
        [[1, 16, 8, 8], [32, 16, 3, 3], [32]],
        [[1, 32, 8, 8]],
        ([], [], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    )
    assert flops == 2 * 32 * 64 * 16 * 9 + 32 * 64
    assert op_kind("addmm") == "matmul"
    assert op_kind("native_batch_norm_backward") == "batch_norm_grad"
    assert op_kind("relu_") == "elementwise"
    assert math.isclose(flop_count("tanh", [[10]], [[10]]), 40)
