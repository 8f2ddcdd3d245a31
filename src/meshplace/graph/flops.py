"""Op kinds and FLOP counts for aten operators.

Each captured aten op gets a coarse *kind* (what a cost model keys its efficiency on) and a
FLOP count computed from its input and output shapes. Conventions:

* a multiply–add is 2 FLOPs (so ResNet-50's 4.1 G multiply–adds are 8.2 GFLOPs);
* matmul family (``mm``, ``addmm``, ``bmm``, ``baddbmm``): 2·m·k·n (+ m·n for the add);
* convolution: 2 · output elements · (C_in / groups) · kernel elements (+ bias);
  its backward counts the same for each of grad-input and grad-weight it computes;
* scaled-dot-product attention: 2·B·H·L·S·(E + E_v) for QKᵀ and PV plus 5 FLOPs per
  score for the softmax; **causal attention counts half** because fused kernels
  (FlashAttention and PyTorch's CPU flash kernel) skip the masked upper triangle;
  backward counts the four matmuls of the gradient (twice the forward) plus the softmax
  backward, without the recomputation some kernels do;
* normalisation per element: batch norm 4 forward / 8 backward, layer norm 5 / 10 (mean,
  variance, normalise, scale and shift, and their gradients);
* point-wise ops: 1 FLOP per output element, 4 for transcendental functions (exp, tanh,
  sigmoid, erf, sqrt…), 3 for their derivatives; reductions: 1 per input element;
* data movement (copies, concatenation, gathers, fills, views): 0 FLOPs, bytes only.

These are operation counts, not times: the cost model turns them into seconds with per-kind
efficiencies that calibration replaces with measured ones.

Example
-------
>>> flop_count("mm", [[64, 128], [128, 32]], [[64, 32]])
524288.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Shape = Sequence[int]

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear"}
CONV = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution"}
CONV_BACKWARD = {"convolution_backward"}
ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
}
ATTENTION_BACKWARD = {name + "_backward" for name in ATTENTION} | {
    "_flash_attention_backward",
    "_efficient_attention_backward",
}
SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"}
SOFTMAX_BACKWARD = {"_softmax_backward_data", "_log_softmax_backward_data"}
BATCH_NORM = {
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "batch_norm",
    "cudnn_batch_norm",
}
BATCH_NORM_BACKWARD = {"native_batch_norm_backward", "cudnn_batch_norm_backward"}
LAYER_NORM = {"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"}
LAYER_NORM_BACKWARD = {"native_layer_norm_backward", "_fused_rms_norm_backward"}
GROUP_NORM = {"native_group_norm"}
GROUP_NORM_BACKWARD = {"native_group_norm_backward"}
EMBEDDING = {"embedding", "index_select", "gather", "index", "take"}
EMBEDDING_BACKWARD = {
    "embedding_dense_backward",
    "embedding_backward",
    "index_add",
    "scatter_add",
    "index_put",
    "_index_put_impl",
}
LOSS = {"nll_loss_forward", "nll_loss2d_forward", "mse_loss", "binary_cross_entropy"}
LOSS_BACKWARD = {"nll_loss_backward", "nll_loss2d_backward", "mse_loss_backward"}
POOL = {
    "max_pool2d_with_indices",
    "max_pool2d",
    "avg_pool2d",
    "_adaptive_avg_pool2d",
    "adaptive_avg_pool2d",
    "max_pool3d_with_indices",
    "avg_pool3d",
}
POOL_BACKWARD = {
    "max_pool2d_with_indices_backward",
    "avg_pool2d_backward",
    "_adaptive_avg_pool2d_backward",
    "max_pool3d_with_indices_backward",
    "avg_pool3d_backward",
}
REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "var_mean",
    "prod",
    "norm",
    "linalg_vector_norm",
    "logsumexp",
    "argmax",
    "argmin",
    "cumsum",
    "all",
    "any",
}
TRANSCENDENTAL = {
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "tanh",
    "sigmoid",
    "erf",
    "erfc",
    "erfinv",
    "sqrt",
    "rsqrt",
    "pow",
    "sin",
    "cos",
    "tan",
    "gelu",
    "silu",
    "softplus",
    "elu",
    "mish",
    "logit",
    "atan",
    "asin",
    "acos",
    "sinh",
    "cosh",
}
TRANSCENDENTAL_BACKWARD = {
    "tanh_backward",
    "sigmoid_backward",
    "gelu_backward",
    "silu_backward",
    "softplus_backward",
    "elu_backward",
}
LINALG = {
    "linalg_cholesky_ex",
    "cholesky",
    "linalg_solve_triangular",
    "triangular_solve",
    "linalg_solve_ex",
    "_linalg_solve_ex",
    "linalg_inv_ex",
    "_linalg_eigh",
    "linalg_eigh",
    "cholesky_solve",
    "cholesky_inverse",
    "_linalg_det",
    "_linalg_slogdet",
    "linalg_lu_factor_ex",
    "linalg_lu_solve",
}
COPY = {
    "clone",
    "_to_copy",
    "copy",
    "copy_",
    "cat",
    "stack",
    "contiguous",
    "_unsafe_index",
    "constant_pad_nd",
    "flip",
    "roll",
    "repeat",
    "tril",
    "triu",
    "masked_fill",
    "index_fill",
    "scatter",
    "select_backward",
    "slice_backward",
    "_softmax_backward",
    "new_empty_strided",
    "as_strided_scatter",
    "select_scatter",
    "slice_scatter",
    "diagonal_backward",
}
FILL = {
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "empty_strided",
    "fill",
    "fill_",
    "zero_",
    "scalar_tensor",
    "arange",
    "rand",
    "randn",
    "rand_like",
    "randn_like",
    "bernoulli",
    "native_dropout",
    "lift_fresh_copy",
    "eye",
}


def op_kind(name: str) -> str:
    """The coarse kind of an aten op from its overload-packet name (``addmm`` → ``matmul``)."""
    base = name.rstrip("_") if name not in ("copy_", "fill_", "zero_") else name
    table: list[tuple[set[str], str]] = [
        (MATMUL, "matmul"),
        (CONV, "conv"),
        (CONV_BACKWARD, "conv_grad"),
        (ATTENTION, "attention"),
        (ATTENTION_BACKWARD, "attention_grad"),
        (SOFTMAX, "softmax"),
        (SOFTMAX_BACKWARD, "softmax_grad"),
        (BATCH_NORM, "batch_norm"),
        (BATCH_NORM_BACKWARD, "batch_norm_grad"),
        (LAYER_NORM, "layer_norm"),
        (LAYER_NORM_BACKWARD, "layer_norm_grad"),
        (GROUP_NORM, "group_norm"),
        (GROUP_NORM_BACKWARD, "group_norm_grad"),
        (EMBEDDING, "embedding"),
        (EMBEDDING_BACKWARD, "embedding_grad"),
        (LOSS, "loss"),
        (LOSS_BACKWARD, "loss_grad"),
        (POOL, "pool"),
        (POOL_BACKWARD, "pool_grad"),
        (REDUCTION, "reduction"),
        (LINALG, "linalg"),
        (COPY, "copy"),
        (FILL, "fill"),
    ]
    for names, kind in table:
        if name in names or base in names:
            return kind
    return "elementwise"


def _numel(shape: Shape) -> int:
    return math.prod(shape) if shape is not None else 0


def flop_count(
    name: str,
    in_shapes: Sequence[Shape | None],
    out_shapes: Sequence[Shape],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> float:
    """FLOPs of one execution of aten op ``name``.

    ``in_shapes`` are the shapes of the positional arguments (``None`` for non-tensors),
    ``out_shapes`` those of the outputs; ``args``/``kwargs`` give flags such as
    ``is_causal`` and convolution groups. O(rank) per call.
    """
    kwargs = kwargs or {}
    kind = op_kind(name)
    out0 = out_shapes[0] if out_shapes else ()
    if kind == "matmul":
        return _matmul_flops(name, in_shapes, out0)
    if kind == "conv":
        return _conv_flops(in_shapes, out0, args)
    if kind == "conv_grad":
        return _conv_backward_flops(in_shapes, args)
    if kind in ("attention", "attention_grad"):
        return _attention_flops(name, in_shapes, args, kwargs, backward=kind == "attention_grad")
    if kind == "linalg":
        return _linalg_flops(name, in_shapes, out_shapes)
    if kind in ("copy", "fill", "embedding"):
        return 0.0
    per_element = {
        "softmax": 5,
        "softmax_grad": 3,
        "batch_norm": 4,
        "batch_norm_grad": 8,
        "layer_norm": 5,
        "layer_norm_grad": 10,
        "group_norm": 5,
        "group_norm_grad": 10,
        "loss": 1,
        "loss_grad": 1,
        "pool_grad": 1,
        "embedding_grad": 1,
    }
    if kind in per_element:
        basis = out0 if kind not in ("loss", "embedding_grad") else _first(in_shapes)
        if kind == "batch_norm" and "no_training" in name:
            return 2.0 * _numel(basis)
        return float(per_element[kind] * _numel(basis))
    if kind == "pool":
        kernel = _pool_kernel(name, in_shapes, out0, args)
        return float(_numel(out0) * kernel)
    if kind == "reduction":
        return float(_numel(_first(in_shapes)))
    base = name.rstrip("_")
    if base in TRANSCENDENTAL:
        return 4.0 * _numel(out0)
    if base in TRANSCENDENTAL_BACKWARD:
        return 3.0 * _numel(out0)
    if base in ("addcmul", "addcdiv", "lerp", "where", "clamp", "hardtanh"):
        return 2.0 * _numel(out0)
    return float(_numel(out0))


def _first(in_shapes: Sequence[Shape | None]) -> Shape:
    for s in in_shapes:
        if s is not None:
            return s
    return ()


def _matmul_flops(name: str, in_shapes: Sequence[Shape | None], out: Shape) -> float:
    """2·k per output element, where k is the contracted length (+1 per element for a bias)."""
    tensors = [s for s in in_shapes if s is not None]
    has_bias = name in ("addmm", "baddbmm", "addmv") or (name == "linear" and len(tensors) > 2)
    a = tensors[1] if name in ("addmm", "baddbmm", "addmv") else tensors[0]
    k = a[-1] if len(a) >= 1 else 1
    return 2.0 * _numel(out) * k + (_numel(out) if has_bias else 0)


def _conv_flops(in_shapes: Sequence[Shape | None], out: Shape, args: Sequence[Any]) -> float:
    x, w = in_shapes[0], in_shapes[1]
    assert x is not None and w is not None
    transposed = bool(args[6]) if len(args) > 6 else False
    kernel = _numel(w[2:])
    has_bias = len(in_shapes) > 2 and in_shapes[2] is not None
    # w[1] is already C_in / groups (C_out / groups when transposed, where each input
    # element scatters into that many outputs per kernel tap).
    flops = 2.0 * (_numel(x) if transposed else _numel(out)) * w[1] * kernel
    return flops + (_numel(out) if has_bias else 0)


def _conv_backward_flops(in_shapes: Sequence[Shape | None], args: Sequence[Any]) -> float:
    grad_out, x, w = in_shapes[0], in_shapes[1], in_shapes[2]
    assert grad_out is not None and x is not None and w is not None
    transposed = bool(args[7]) if len(args) > 7 else False
    mask = args[10] if len(args) > 10 else [True, True, True]
    kernel = _numel(w[2:])
    one = 2.0 * (_numel(x) if transposed else _numel(grad_out)) * w[1] * kernel
    flops = 0.0
    if mask[0]:
        flops += one
    if mask[1]:
        flops += one
    if len(mask) > 2 and mask[2]:
        flops += _numel(grad_out)
    return flops


def _attention_flops(
    name: str,
    in_shapes: Sequence[Shape | None],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    backward: bool,
) -> float:
    offset = 1 if backward else 0  # backward ops take grad_out first
    q, k, v = in_shapes[offset], in_shapes[offset + 1], in_shapes[offset + 2]
    assert q is not None and k is not None and v is not None
    *batch, seq_q, e = q
    seq_k = k[-2]
    e_v = v[-1]
    heads = _numel(batch)
    causal = bool(kwargs.get("is_causal", False))
    if not causal:
        # Positional is_causal: forward (q, k, v, dropout_p, is_causal, ...); backward
        # (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, ...).
        pos = 7 if backward and "for_cpu" in name else (4 if not backward else None)
        if pos is not None and len(args) > pos and isinstance(args[pos], bool):
            causal = args[pos]
    scores = heads * seq_q * seq_k
    fraction = 0.5 if causal and seq_q == seq_k else 1.0
    matmuls = 2.0 * scores * (e + e_v)
    if backward:
        return fraction * (2.0 * matmuls + 3.0 * scores)
    return fraction * (matmuls + 5.0 * scores)


def _pool_kernel(name: str, in_shapes: Sequence[Shape | None], out: Shape, args: Sequence[Any]):
    if "adaptive" in name:
        x = in_shapes[0]
        assert x is not None
        return max(1, _numel(x) // max(1, _numel(out)))
    if len(args) > 1 and isinstance(args[1], list | tuple):
        return _numel(args[1])
    return 1


def _linalg_flops(
    name: str, in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape]
) -> float:
    a = _first(in_shapes)
    n = a[-1] if a else 0
    batch = _numel(a[:-2]) if len(a) > 2 else 1
    if "cholesky" in name and "solve" not in name and "inverse" not in name:
        return batch * n**3 / 3.0
    if "eigh" in name:
        return batch * 9.0 * n**3
    if "triangular" in name or "cholesky_solve" in name:
        b = in_shapes[1] if len(in_shapes) > 1 and in_shapes[1] is not None else a
        return batch * float(n) * n * b[-1]
    if "solve" in name or "lu" in name:
        b = in_shapes[1] if len(in_shapes) > 1 and in_shapes[1] is not None else a
        return batch * (2.0 * n**3 / 3.0 + 2.0 * n * n * b[-1])
    if "inv" in name:
        return batch * 2.0 * n**3
    return batch * float(n) ** 3
