"""FLOPs for every aten op with real arithmetic, and mixture-of-experts capture (issue 16).

The capture tests use tiny models (fake tensors: their size costs nothing but their op
count does), and compare against closed forms: 8·(i + h)·h·T·B per LSTM layer-direction
(Hochreiter & Schmidhuber 1997; ``torch.nn.LSTM`` docs), 6·(i + h)·h·T·B for GRU,
2·(i + h)·h·T·B for a plain RNN, 2·tokens·top_k·d·d_ff per expert matmul.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshplace.graph.capture import capture
from meshplace.graph.decompositions import (
    capture_kernels,
    expert_parameters,
    grouped_mm_shape,
)
from meshplace.graph.flops import (
    ARITHMETIC_OPS,
    RNN_CELL_POINTWISE,
    flop_count,
    op_kind,
    rnn_layer_flops,
)
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.summary import summarize

T, B, D_IN, H = 6, 4, 96, 128  # time steps, batch, input and hidden sizes


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _forward_flops(graph: OpGraph, kind: str | None = None) -> float:
    return sum(
        o.flops for o in graph.ops if o.phase == "forward" and (kind is None or o.kind == kind)
    )


# ------------------------------------------------------------------ recurrent layers
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True)])
def test_lstm_flops_are_eight_i_plus_h_h_t_b_per_layer_direction(
    layers: int, bidirectional: bool
) -> None:
    model = nn.LSTM(D_IN, H, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    g = capture(model, (torch.randn(B, T, D_IN),))
    directions = 2 if bidirectional else 1
    fused = [o for o in g.ops if o.phase == "forward" and "rnn" in o.target]
    assert fused, "nn.LSTM on CPU captures as fused mkldnn_rnn_layer ops"
    assert {o.kind for o in fused} == {"matmul"}
    assert len(fused) == layers * directions
    # Each op is one layer-direction: layer 0 reads D_IN features, later layers D·H.
    sizes = sorted(o.output_shapes[0][-1] for o in fused)
    assert sizes == [H] * len(fused)
    expected_each = [
        8 * ((D_IN if n < directions else directions * H) + H) * H * T * B
        for n in range(len(fused))
    ]
    for op, expected in zip(fused, expected_each):
        assert op.flops == pytest.approx(expected, rel=0.05)
    total = _forward_flops(g)
    assert total == pytest.approx(sum(expected_each), rel=0.05)
    backward = [o for o in g.ops if o.phase == "backward" and "rnn" in o.target]
    assert {o.kind for o in backward} == {"matmul"}
    assert sum(o.flops for o in backward) == pytest.approx(2 * sum(o.flops for o in fused))


@pytest.mark.parametrize("cls,gates", [(nn.GRU, 3), (nn.RNN, 1)])
def test_gru_and_rnn_flops_match_their_gate_count(cls: type[nn.Module], gates: int) -> None:
    model = cls(D_IN, H, num_layers=2, bidirectional=True)
    g = capture(model, (torch.randn(T, B, D_IN),))
    expected = sum(2 * 2 * gates * (size + H) * H * T * B for size in (D_IN, 2 * H))
    assert _forward_flops(g, "matmul") == pytest.approx(expected, rel=0.05)


def test_fused_rnn_ops_are_costed_from_their_arguments() -> None:
    """The fused RNN ops of other back ends (cuDNN, MIOpen, the aten composites), which
    a CPU capture never emits, get the same closed forms."""
    rows = T * B
    lstm_2x2 = sum(2 * rnn_layer_flops(rows, size, H, 4) for size in (D_IN, 2 * H))
    x = _meta(T, B, D_IN)
    weights = [_meta(4 * H, D_IN)] * 8
    cudnn_args = (x, weights, 4, None, _meta(4, B, H), _meta(4, B, H), 2, H, 0, 2, False)
    cudnn_args += (0.0, True, True, [], None)
    out = [[T, B, 2 * H]]
    assert flop_count("_cudnn_rnn", [[T, B, D_IN]], out, cudnn_args) == pytest.approx(lstm_2x2)
    aten_args = (x, [_meta(4, B, H), _meta(4, B, H)], weights, True, 2, 0.0, True, True, False)
    assert flop_count("lstm", [[T, B, D_IN]], out, aten_args) == pytest.approx(lstm_2x2)
    packed = (_meta(rows, D_IN), _meta(T), [_meta(4, B, H), _meta(4, B, H)], weights)
    packed += (True, 2, 0.0, True, True)
    assert flop_count("lstm", [[rows, D_IN], [T]], out, packed) == pytest.approx(lstm_2x2)
    gru_args = (x, _meta(1, B, H), [], True, 1, 0.0, True, False, False)
    gru = flop_count("gru", [[T, B, D_IN], [1, B, H]], [[T, B, H]], gru_args)
    assert gru == pytest.approx(6 * (D_IN + H) * H * rows, rel=0.05)
    cell = flop_count(
        "lstm_cell", [[B, D_IN], None, [4 * H, D_IN], [4 * H, H], [4 * H], [4 * H]], []
    )
    assert cell == pytest.approx(8 * (D_IN + H) * H * B, rel=0.05)
    gates = flop_count("_thnn_fused_lstm_cell", [[B, 4 * H], [B, 4 * H], [B, H]], [[B, H]])
    assert gates == 28 * B * H  # 4 gate sums + 24 per unit, no biases
    assert op_kind("_thnn_fused_lstm_cell") == "elementwise"  # memory bound, but counted


# --------------------------------------------------------------- mixture of experts
class _Experts(nn.Module):
    """Stacked experts run with ``torch.nn.functional.grouped_mm`` as Hugging Face
    ``transformers`` 5 does (``integrations/moe.py``, the ``grouped_mm`` path)."""

    def __init__(self, experts: int, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * d_ff, d) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, d, d_ff) * 0.02)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        tokens, top_k = index.shape
        experts = self.gate_up_proj.shape[0]
        expert_ids = index.reshape(-1)
        token_ids = torch.arange(tokens).unsqueeze(1).expand(-1, top_k).reshape(-1)
        perm = torch.argsort(expert_ids, stable=True)
        inverse = torch.argsort(perm, stable=True)
        counts = torch.histc(expert_ids[perm].float(), bins=experts, min=0, max=experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.grouped_mm(x[token_ids][perm], self.gate_up_proj.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        out = (out * weight.reshape(-1)[perm].unsqueeze(-1))[inverse]
        return torch.zeros_like(x).index_add(0, token_ids, out.to(x.dtype))


class _MoE(nn.Module):
    def __init__(self, d: int = 64, d_ff: int = 96, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = _Experts(experts, d, d_ff)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weight, index = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        return self.experts(x, index, weight).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_with_grouped_mm_captures_with_routed_flops(dtype: torch.dtype) -> None:
    d, d_ff, top_k, tokens = 64, 96, 2, 2 * 16
    model = _MoE(d, d_ff, top_k=top_k).to(dtype)
    model(torch.randn(2, 16, d, dtype=dtype))  # runs for real (CPU has a grouped_mm)
    g = capture(model, (torch.randn(2, 16, d, dtype=dtype),))
    grouped = [o for o in g.ops if "grouped_mm" in o.target]
    assert {o.kind for o in grouped} == {"matmul"}
    assert {o.output_dtypes[0] for o in grouped} == {str(dtype).removeprefix("torch.")}
    forward = sum(o.flops for o in grouped if o.phase == "forward")
    # gate, up (fused gate_up_proj) and down: three d×d_ff matmuls per routed token.
    dense_equivalent = 3 * 2 * tokens * top_k * d * d_ff
    assert forward == pytest.approx(dense_equivalent, rel=0.05)
    backward = sum(o.flops for o in grouped if o.phase == "backward")
    # Weight gradients of all three (2D×2D grouped matmuls) and the input gradient of
    # down_proj; the routed tokens x need none.
    assert backward == pytest.approx(dense_equivalent * 4 / 3, rel=0.05)
    experts = {"experts": 8, "axis": 0}
    assert g.meta["expert_params"] == {
        "param:experts.gate_up_proj": experts,
        "param:experts.down_proj": experts,
    }


def test_grouped_mm_kernel_is_scoped_to_capture() -> None:
    shapes = ((12, 16), (4, 16, 32))
    with capture_kernels(), capture_kernels(), FakeTensorMode():  # re-entrant
        out = torch._grouped_mm(
            torch.empty(shapes[0]), torch.empty(shapes[1]), offs=torch.empty(4, dtype=torch.int32)
        )
        assert list(out.shape) == [12, 32] and out.dtype == torch.float32
    with FakeTensorMode(), pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(
            torch.empty(shapes[0]), torch.empty(shapes[1]), offs=torch.empty(4, dtype=torch.int32)
        )


def test_grouped_mm_layouts() -> None:
    g, m, k, n = 4, 24, 16, 32
    assert grouped_mm_shape((m, k), (g, k, n), g) == [m, n]
    assert grouped_mm_shape((g, m, k), (k, n), g) == [m, n]
    assert grouped_mm_shape((m, k), (k, n), g) == [g, m, n]
    assert grouped_mm_shape((g, m, k), (g, k, n), None) == [g, m, n]
    with pytest.raises(RuntimeError):
        grouped_mm_shape((m, k), (g, k + 1, n), g)
    dense = 2 * m * k * n
    assert flop_count("_grouped_mm", [[m, k], [g, k, n], [g]], [[m, n]]) == dense
    assert flop_count("_grouped_mm", [[g, m, k], [k, n], [g]], [[m, n]]) == dense
    assert flop_count("_grouped_mm", [[m, k], [k, n], [g]], [[g, m, n]]) == dense  # grad-weight
    assert flop_count("_grouped_mm", [[g, m, k], [g, k, n]], [[g, m, n]]) == g * dense
    scaled = [[m, k], [g, k, n], [m], [g, n], [g]]
    assert flop_count("_scaled_grouped_mm", scaled, [[m, n]]) == dense


def test_expert_parameters_by_module_path() -> None:
    g = OpGraph("listed")
    for name in ("param:moe.experts.0.w1.weight", "param:moe.experts.11.w2.weight"):
        g.add_op(Op(name, "parameter", output_shapes=[[8, 8]]))
    g.add_op(Op("param:attn.qkv.weight", "parameter", output_shapes=[[8, 8]]))
    assert expert_parameters(g) == {
        "param:moe.experts.0.w1.weight": {"expert": 0},
        "param:moe.experts.11.w2.weight": {"expert": 11},
    }


# ---------------------------------------------------------------- other arithmetic
def test_matmul_family() -> None:
    b, m, k, n = 3, 8, 16, 4
    assert (
        flop_count("addbmm", [[m, n], [b, m, k], [b, k, n]], [[m, n]]) == 2 * b * m * k * n + m * n
    )
    assert flop_count("baddbmm", [[b, m, n], [b, m, k], [b, k, n]], [[b, m, n]]) == (
        2 * b * m * k * n + b * m * n
    )
    scaled = [[m, k], [k, n], [], [], None]
    assert flop_count("_scaled_mm", scaled, [[m, n]]) == 2 * m * k * n
    assert op_kind("_scaled_mm") == op_kind("_grouped_mm") == "matmul"
    einsum = flop_count(
        "einsum", [None, None], [[b, m, n]], ("bmk,bkn->bmn", [_meta(b, m, k), _meta(b, k, n)])
    )
    assert einsum == 2 * b * m * k * n
    ellipsis = ("...mk,...kn->...mn", [_meta(b, m, k), _meta(b, k, n)])
    assert flop_count("einsum", [None, None], [[b, m, n]], ellipsis) == 2 * b * m * k * n
    chain = ("ij,jk,kl->il", [_meta(m, k), _meta(k, n), _meta(n, 2)])
    assert flop_count("einsum", [None, None], [[m, 2]], chain) == 2 * m * k * n + 2 * m * n * 2
    assert (
        flop_count("tensordot", [[m, k], [k, n]], [[m, n]], (None, None, [1], [0])) == 2 * m * k * n
    )


def test_bilinear_layer_is_a_contraction() -> None:
    model = nn.Bilinear(8, 12, 5)
    g = capture(model, (torch.randn(3, 8), torch.randn(3, 12)), training=False)
    (op,) = [o for o in g.ops if "trilinear" in o.target]
    assert op.kind == "matmul"
    assert op.flops == pytest.approx(2 * 3 * 5 * 8 * 12)


def test_attention_variants_agree() -> None:
    b, h, s, e = 2, 4, 64, 32
    bhse, bshe = [b, h, s, e], [b, s, h, e]
    dense = 2 * b * h * s * s * (e + e) + 5 * b * h * s * s
    forward = {
        "_scaled_dot_product_flash_attention_for_cpu": ([bhse] * 3, (None,) * 3 + (0.0, True)),
        "_scaled_dot_product_flash_attention": ([bhse] * 3, (None,) * 3 + (0.0, True)),
        "_scaled_dot_product_efficient_attention": (
            [bhse] * 3 + [None],
            (None,) * 4 + (True, 0.0, True),  # compute_log_sumexp=True is not is_causal
        ),
        "_scaled_dot_product_cudnn_attention": (
            [bhse] * 3 + [None],
            (None,) * 4 + (True, 0.0, True),
        ),
        "_flash_attention_forward": ([bshe] * 3, (None,) * 5 + (s, s, 0.0, True, False)),
        "_efficient_attention_forward": ([bshe] * 3, (None,) * 6 + (s, s, 0.0, 1)),
    }
    for name, (shapes, args) in forward.items():
        assert op_kind(name) == "attention"
        assert flop_count(name, shapes, [bhse], args) == pytest.approx(dense / 2), name
        not_causal = tuple(
            False if a is True else (0 if a == 1 and not isinstance(a, bool) else a) for a in args
        )
        assert flop_count(name, shapes, [bhse], not_causal) == pytest.approx(dense), name
    backward = {
        "_scaled_dot_product_flash_attention_for_cpu_backward": ([bhse] * 5, 7),
        "_scaled_dot_product_flash_attention_backward": ([bhse] * 5, 11),
        "_scaled_dot_product_efficient_attention_backward": ([bhse] * 5, 11),
        "_flash_attention_backward": ([bshe] * 5, 11),
    }
    grad = 2 * 2 * b * h * s * s * (e + e) + 3 * b * h * s * s
    for name, (shapes, causal_at) in backward.items():
        assert op_kind(name) == "attention_grad"
        args = [None] * (causal_at + 1)
        args[causal_at] = True
        assert flop_count(name, shapes, [bhse], tuple(args)) == pytest.approx(grad / 2), name
    varlen = flop_count(
        "_flash_attention_forward",
        [[b * s, h, e]] * 3 + [[b + 1], [b + 1]],
        [[b * s, h, e]],
        (None, None, None, _meta(b + 1), _meta(b + 1), s, s, 0.0, False, False),
    )
    assert varlen == pytest.approx(dense)  # every query against max_k keys: b·s·s per head


def test_convolution_variants_read_their_own_arguments() -> None:
    x, w, out = [1, 16, 8, 8], [32, 16, 3, 3], [1, 32, 8, 8]
    dense = 2 * 32 * 64 * 16 * 9
    # mkldnn_convolution(self, weight, bias, padding, stride, dilation, groups): groups
    # at 6 is not a "transposed" flag.
    assert flop_count("mkldnn_convolution", [x, w, None], [out], (None,) * 6 + (1,)) == dense
    # cudnn_convolution(..., groups, benchmark=True, ...): neither a bias nor transposed
    cudnn = (None, None, [1, 1], [1, 1], [1, 1], 1, True, False, True)
    assert flop_count("cudnn_convolution", [x, w], [out], cudnn) == dense
    mask = [True, True, False]
    overrideable = (None, None, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)
    assert (
        flop_count("convolution_backward_overrideable", [out, x, w], [x, w], overrideable)
        == 2 * dense
    )
    tbc = flop_count("conv_tbc", [[10, 2, 16], [3, 16, 32], [32]], [[8, 2, 32]], ())
    assert tbc == 2 * 8 * 2 * 32 * 3 * 16 + 8 * 2 * 32


def test_linalg_reads_the_factored_matrix() -> None:
    n, k = 64, 8
    # triangular_solve(B, A): B comes first
    assert flop_count("triangular_solve", [[n, k], [n, n]], [[n, k], [n, n]]) == n * n * k
    assert flop_count("cholesky_solve", [[n, k], [n, n]], [[n, k]]) == 2 * n * n * k
    assert flop_count("linalg_lu_factor_ex", [[n, n]], [[n, n], [n], []]) == pytest.approx(
        2 * n**3 / 3
    )
    assert flop_count("linalg_lu_solve", [[n, n], [n], [n, k]], [[n, k]]) == 2 * n * n * k
    assert flop_count("_linalg_eigh", [[n, n]], [[n], [n, n]], (None, "L", False)) == pytest.approx(
        4 * n**3 / 3
    )
    assert flop_count("_fft_c2c", [[n]], [[n]], (None, [0], 0, True)) == 5 * n * math.log2(n)


# ----------------------------------------------- nothing heavy falls back to element-wise
class _Attention(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)


def _representative_models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    conv = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, groups=8),
        nn.GroupNorm(2, 8),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.AdaptiveAvgPool2d(1),
    )
    seq = torch.randn(2, 8, 32)
    return {
        "lstm": (nn.LSTM(16, 32, num_layers=2, bidirectional=True), (torch.randn(5, 2, 16),)),
        "gru": (nn.GRU(16, 32), (torch.randn(5, 2, 16),)),
        "moe": (_MoE(32, 48, 4), (torch.randn(2, 8, 32),)),
        "attention": (_Attention(), (seq,)),
        "attention_dropout": (_Attention(0.1), (seq,)),
        "encoder": (nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), (seq,)),
        "conv": (conv, (torch.randn(2, 3, 12, 12),)),
        "conv3d": (
            nn.Sequential(nn.Conv3d(2, 4, 3), nn.AvgPool3d(2)),
            (torch.randn(1, 2, 6, 6, 6),),
        ),
        "mlp": (
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)),
            (torch.randn(4, 16),),
        ),
        "embedding_bag": (nn.EmbeddingBag(50, 16), (torch.randint(0, 50, (4, 5)),)),
    }


# Ops a capture may cost as element-wise although PyTorch does not tag them pointwise:
# the fused RNN gate kernels (several FLOPs per element, counted) and sparse matmuls
# (sparse tensors do not capture).
_ELEMENTWISE_BY_DESIGN = set(RNN_CELL_POINTWISE) | {
    "_sparse_mm_reduce_impl",
    "_sparse_mm_reduce_impl_backward",
    "_sparse_sparse_matmul",
}


def _packet(target: str) -> str:
    return target.split(".")[1] if target.startswith("aten.") else target


def _is_pointwise(target: str) -> bool:
    parts = target.split(".")
    packet = getattr(torch.ops.aten, parts[1], None) if len(parts) == 3 else None
    overload = getattr(packet, parts[2], None) if packet is not None else None
    return overload is not None and torch.Tag.pointwise in overload.tags


def test_no_arithmetic_op_is_costed_as_elementwise() -> None:
    """Capture representative models in training and inference: every op costed as
    element-wise must be a pointwise op (PyTorch's ``Tag.pointwise``), never an op with a
    contraction, recurrence or factorisation inside — and the summary lists them."""
    suspicious: dict[str, set[str]] = {}
    for name, (model, inputs) in _representative_models().items():
        for training in (True, False):
            g = capture(model, inputs, training=training)
            listed = summarize(g)["elementwise_targets"]
            counted = Counter(o.target for o in g.ops if o.kind == "elementwise")
            assert listed == dict(counted)
            for target in listed:
                assert _packet(target) not in ARITHMETIC_OPS, (name, target)
                if not _is_pointwise(target) and _packet(target) not in _ELEMENTWISE_BY_DESIGN:
                    suspicious.setdefault(target, set()).add(name)
    assert not suspicious, f"non-pointwise ops costed as element-wise: {suspicious}"


_HEAVY = re.compile(
    r"(^|_)(mm|bmm|matmul|gemm|conv\w*|convolution|attention|rnn|lstm|gru|linear|bilinear|"
    r"einsum|dot|addr|cdist|pdist|svd|qr|eig\w*|cholesky|solve|lu|inv|fft\w*)(_|$|\d)"
)


def test_every_aten_op_named_like_arithmetic_has_a_formula() -> None:
    """Sweep PyTorch's registered aten ops: any that looks like a matmul, convolution,
    attention, recurrence or factorisation and can reach a trace (i.e. is not a
    CompositeImplicitAutograd op that decomposes first) must not be element-wise. A new
    PyTorch op of that sort fails here until flops.py costs it."""
    by_packet: dict[str, list[str]] = {}
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::"):
            by_packet.setdefault(full.removeprefix("aten::").split(".")[0], []).append(full)
    missing = []
    for packet, overloads in sorted(by_packet.items()):
        if not _HEAVY.search(packet) or op_kind(packet) != "elementwise":
            continue
        if packet in _ELEMENTWISE_BY_DESIGN:
            continue
        if all(
            torch._C._dispatch_has_kernel_for_dispatch_key(o, "CompositeImplicitAutograd")
            for o in overloads
        ):
            continue
        missing.append(packet)
    assert not missing, f"aten ops with arithmetic costed as element-wise: {missing}"


def test_summary_lists_elementwise_targets_most_first() -> None:
    g = OpGraph("listed")
    for i in range(3):
        g.add_op(Op(f"a{i}", "elementwise", target="aten.add.Tensor", flops=4.0))
    g.add_op(Op("rnn", "elementwise", target="aten.mkldnn_rnn_layer.default", flops=4.0))
    g.add_op(Op("mm", "matmul", target="aten.mm.default", flops=8.0))
    listed = summarize(g)["elementwise_targets"]
    assert list(listed.items()) == [("aten.add.Tensor", 3), ("aten.mkldnn_rnn_layer.default", 1)]
