"""Op kinds and FLOP counts for aten operators.

Each captured aten op gets a coarse *kind* (what a cost model keys its efficiency on) and a
FLOP count computed from its input and output shapes. Conventions:

* a multiply–add is 2 FLOPs (so ResNet-50's 4.1 G multiply–adds are 8.2 GFLOPs);
* matmul family (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``, ``_scaled_mm``…):
  2·m·k·n (+ m·n for the add); ``addbmm`` sums over its batch, 2·b·m·k·n;
* grouped matmul (``torch.nn.functional.grouped_mm``, aten ``_grouped_mm`` and
  ``_scaled_grouped_mm``; the mixture-of-experts kernel of Hugging Face ``transformers``):
  2·M·K·N where M is the total rows over all groups — for the 2D×3D layout
  ``(M, K) @ (G, K, N)`` the output has M rows; for the 2D×2D layout (the expert
  weight gradient, output ``(G, M, N)``) the contracted K is split among the groups, so
  2·M·K·N again. The per-group sizes live in the ``offs`` tensor's *values*, which a fake
  tensor does not have: routing that depends on data is costed at its expected load
  (tokens·top_k / experts rows per expert), which is exact in aggregate because the
  groups partition M;
* recurrent layers (``mkldnn_rnn_layer``, ``_cudnn_rnn``, ``miopen_rnn``, ``lstm``,
  ``gru``, ``rnn_tanh``/``rnn_relu``, the ``*_cell`` ops): per layer, direction, time step
  and batch row, 2·G·h·(i + h) for the input and recurrent matmuls with G gates
  (LSTM 4, GRU 3, plain RNN 1; Hochreiter & Schmidhuber 1997, Cho et al. 2014; the gate
  equations of the ``torch.nn.LSTM``/``GRU`` docs), so an LSTM layer-direction costs
  8·(i + h)·h·T·B, a GRU 6·(i + h)·h·T·B and an RNN 2·(i + h)·h·T·B, plus the gate
  arithmetic (bias adds, sigmoids and tanhs at 4 FLOPs, the cell update: 24 FLOPs per
  hidden unit for LSTM, 18 for GRU, 4 for tanh RNN); a projection (``proj_size``) adds
  2·h·p. Their backward ops (``mkldnn_rnn_layer_backward``…) count twice the forward:
  the gradients of the input, the hidden state and both weights are four matmuls of the
  forward's two sizes;
* convolution: 2 · output elements · (C_in / groups) · kernel elements (+ bias);
  its backward counts the same for each of grad-input and grad-weight it computes;
* scaled-dot-product attention: 2·B·H·L·S·(E + E_v) for QKᵀ and PV plus 5 FLOPs per
  score for the softmax; **causal attention counts half** because fused kernels
  (FlashAttention and PyTorch's CPU flash kernel) skip the masked upper triangle;
  backward counts the four matmuls of the gradient (twice the forward) plus the softmax
  backward, without the recomputation some kernels do. The ``_scaled_dot_product_*``
  ops take ``(B, H, L, E)``; the low-level ``_flash_attention_*`` and
  ``_efficient_attention_*`` kernels take ``(B, L, H, E)`` (PyTorch transposes before
  calling them); variable-length (nested) inputs count every query against the longest
  key sequence, an upper bound;
* linear algebra (Golub & Van Loan, *Matrix Computations*, 4th ed.): Cholesky n³/3,
  LU 2n³/3, inverse 2n³, triangular solve n²·k, LU solve 2n²·k, Householder QR
  2mn² − 2n³/3 (twice that with Q), symmetric eigendecomposition 9n³ (4n³/3 values only),
  SVD 14mn² + 8n³ (4mn² − 4n³/3 values only), general eigendecomposition 25n³;
  FFTs 5·N·log₂N per complex transform of length N (half for real input or output);
* normalisation per element: batch norm 4 forward / 8 backward, layer norm 5 / 10 (mean,
  variance, normalise, scale and shift, and their gradients);
* resampling (``upsample_*``, ``grid_sampler_*``): 2 FLOPs per tap per output element
  (linear 2 taps, bilinear 4, trilinear 8, bicubic 16); nearest-neighbour is a copy;
* bags of embeddings: one add per gathered element (indices · D);
* point-wise ops: 1 FLOP per output element, 4 for transcendental functions (exp, tanh,
  sigmoid, erf, sqrt…), 3 for their derivatives; reductions, sorts and histograms: 1 per
  input element;
* data movement (copies, concatenation, gathers, fills, views): 0 FLOPs, bytes only.

Any op not named here is costed as ``elementwise`` (1 FLOP per output element);
:data:`ARITHMETIC_OPS` lists the ops whose cost is *not* that, and
``meshplace.graph.summary.summarize`` reports the targets a graph costs as element-wise.

These are operation counts, not times: the cost model turns them into seconds with per-kind
efficiencies that calibration replaces with measured ones.

Example
-------
>>> flop_count("mm", [[64, 128], [128, 32]], [[64, 32]])
524288.0
>>> flop_count("_grouped_mm", [[96, 64], [8, 64, 256], [8]], [[96, 256]])  # 96 routed rows
3145728.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Shape = Sequence[int]

MATMUL = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "dot",
    "vdot",
    "matmul",
    "linear",
    "_addmm_activation",
    "mkldnn_linear",
    "_int_mm",
    "_weight_int8pack_mm",
    "_weight_int4pack_mm",
    "_scaled_mm",
    "_scaled_mm_v2",
    "_weight_int4pack_mm_for_cpu",
    "_weight_int4pack_mm_with_scales_and_zeros",
    "_dyn_quant_matmul_4bit",
    "_mixed_dtypes_linear",
    "_sparse_semi_structured_linear",
}
# Matmul-dominated ops with their own formulas (all of kind ``matmul``).
GROUPED_MM = {"_grouped_mm", "_scaled_grouped_mm", "_scaled_grouped_mm_v2"}
MATMUL_OTHER = {
    "addr",
    "einsum",
    "tensordot",
    "bilinear",
    "_trilinear",
    "mkldnn_linear_backward",
    "linear_backward",
    "mkldnn_linear_backward_input",
    "mkldnn_linear_backward_weights",
    "matmul_backward",
    "_foreach_mm",
    "_cslt_sparse_mm",
    "_sparse_semi_structured_mm",
    "_compute_linear_combination",
    "cdist",
    "_cdist_forward",
    "_cdist_backward",
    "_pdist_forward",
    "_pdist_backward",
    "_transformer_encoder_layer_fwd",
}
RNN = {
    "mkldnn_rnn_layer",
    "_cudnn_rnn",
    "miopen_rnn",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "quantized_lstm",
    "quantized_gru",
    "_lstm_mps",
}
RNN_BACKWARD = {
    "mkldnn_rnn_layer_backward",
    "_cudnn_rnn_backward",
    "miopen_rnn_backward",
    "lstm_mps_backward",
}
# Fused gate arithmetic of one RNN step (the matmuls are separate ops): element-wise kind,
# several FLOPs per element.
RNN_CELL_POINTWISE = {
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "_thnn_fused_lstm_cell_backward_impl",
    "_thnn_fused_gru_cell_backward",
    "_thnn_differentiable_lstm_cell_backward",
    "_thnn_differentiable_gru_cell_backward",
}
CONV = {
    "convolution",
    "_convolution",
    "convolution_overrideable",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "miopen_convolution",
    "miopen_convolution_transpose",
    "miopen_depthwise_convolution",
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "slow_conv3d",
    "thnn_conv2d",
    "slow_conv_dilated2d",
    "slow_conv_dilated3d",
    "slow_conv_transpose2d",
    "slow_conv_transpose3d",
    "_conv_depthwise2d",
    "conv_depthwise3d",
    "conv_tbc",
    "_mps_convolution",
    "_mps_convolution_transpose",
    "_nnpack_spatial_convolution",
    "cudnn_convolution_relu",
    "cudnn_convolution_add_relu",
    "miopen_convolution_relu",
    "miopen_convolution_add_relu",
}
CONV_BACKWARD = {
    "convolution_backward",
    "convolution_backward_overrideable",
    "_slow_conv2d_backward",
    "mps_convolution_backward",
    "mps_convolution_transpose_backward",
    "conv_tbc_backward",
    "_convolution_double_backward",
}
ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_attention_forward",
    "_flash_attention_forward_no_dropout_inplace",
    "_scaled_dot_product_attention_math_for_mps",
    "_triton_scaled_dot_attention",
    "_native_multi_head_attention",
    "_triton_multi_head_attention",
}
ATTENTION_BACKWARD = {
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
    "_cudnn_attention_backward",
}
SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "_masked_softmax"}
SOFTMAX_BACKWARD = {
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "_masked_softmax_backward",
}
BATCH_NORM = {
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "_batch_norm_with_update",
    "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
    "batch_norm",
    "cudnn_batch_norm",
    "miopen_batch_norm",
}
BATCH_NORM_BACKWARD = {
    "native_batch_norm_backward",
    "batch_norm_backward",
    "cudnn_batch_norm_backward",
    "miopen_batch_norm_backward",
}
LAYER_NORM = {"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"}
LAYER_NORM_BACKWARD = {"native_layer_norm_backward", "_fused_rms_norm_backward"}
GROUP_NORM = {"native_group_norm"}
GROUP_NORM_BACKWARD = {"native_group_norm_backward"}
EMBEDDING = {"embedding", "index_select", "gather", "index", "take", "take_along_dim"}
EMBEDDING_BAG = {"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"}
EMBEDDING_BACKWARD = {
    "embedding_dense_backward",
    "embedding_backward",
    "index_add",
    "scatter_add",
    "scatter_reduce",
    "index_put",
    "_index_put_impl",
    "_unsafe_index_put",
}
EMBEDDING_BAG_BACKWARD = {
    "_embedding_bag_backward",
    "_embedding_bag_dense_backward",
    "_embedding_bag_sparse_backward",
    "_embedding_bag_per_sample_weights_backward",
}
LOSS = {
    "nll_loss_forward",
    "nll_loss2d_forward",
    "mse_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "huber_loss",
    "soft_margin_loss",
    "multi_margin_loss",
    "multilabel_margin_loss_forward",
    "_ctc_loss",
}
LOSS_BACKWARD = {
    "nll_loss_backward",
    "nll_loss2d_backward",
    "mse_loss_backward",
    "binary_cross_entropy_backward",
    "smooth_l1_loss_backward",
    "huber_loss_backward",
    "soft_margin_loss_backward",
    "multi_margin_loss_backward",
    "multilabel_margin_loss_backward",
    "_ctc_loss_backward",
}
POOL = {
    "max_pool1d",
    "max_pool1d_with_indices",
    "avg_pool1d",
    "max_pool2d_with_indices",
    "max_pool2d",
    "mkldnn_max_pool2d",
    "avg_pool2d",
    "_adaptive_avg_pool2d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "max_pool3d_with_indices",
    "max_pool3d",
    "avg_pool3d",
    "_adaptive_avg_pool3d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
}
POOL_BACKWARD = {
    "max_pool2d_with_indices_backward",
    "avg_pool2d_backward",
    "_adaptive_avg_pool2d_backward",
    "adaptive_max_pool2d_backward",
    "max_pool3d_with_indices_backward",
    "avg_pool3d_backward",
    "_adaptive_avg_pool3d_backward",
    "adaptive_max_pool3d_backward",
    "fractional_max_pool2d_backward",
    "fractional_max_pool3d_backward",
    "upsample_nearest1d_backward",
    "upsample_nearest2d_backward",
    "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward",
    "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward",
}
# Interpolation taps per output element (kind ``pool``: a fixed stencil over the input).
RESAMPLE_TAPS = {
    "upsample_linear1d": 2,
    "upsample_bilinear2d": 4,
    "_upsample_bilinear2d_aa": 4,
    "upsample_trilinear3d": 8,
    "upsample_bicubic2d": 16,
    "_upsample_bicubic2d_aa": 16,
    "grid_sampler_2d": 4,
    "cudnn_grid_sampler": 4,
    "grid_sampler_3d": 8,
}
RESAMPLE_BACKWARD = {name + "_backward" for name in RESAMPLE_TAPS}
REDUCTION = {
    "sum",
    "nansum",
    "mean",
    "nanmean",
    "amax",
    "amin",
    "aminmax",
    "max",
    "min",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "prod",
    "norm",
    "linalg_vector_norm",
    "logsumexp",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "logcumsumexp",
    "cummax",
    "cummin",
    "all",
    "any",
    "count_nonzero",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "mode",
    "histc",
    "bincount",
    "searchsorted",
    "bucketize",
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
    "linalg_eigvalsh",
    "cholesky_solve",
    "_cholesky_solve_helper",
    "cholesky_inverse",
    "_linalg_det",
    "_linalg_slogdet",
    "linalg_lu_factor_ex",
    "linalg_lu",
    "linalg_lu_solve",
    "linalg_ldl_factor_ex",
    "linalg_ldl_solve",
    "linalg_qr",
    "geqrf",
    "ormqr",
    "linalg_householder_product",
    "_linalg_svd",
    "linalg_svd",
    "linalg_eig",
    "_linalg_eigvals",
    "linalg_eigvals",
    "linalg_matrix_exp",
    "linalg_lstsq",
    "_fft_r2c",
    "_fft_c2r",
    "_fft_c2c",
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
    "reflection_pad1d",
    "reflection_pad2d",
    "reflection_pad3d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "flip",
    "roll",
    "repeat",
    "repeat_interleave",
    "tril",
    "triu",
    "masked_fill",
    "masked_scatter",
    "index_fill",
    "index_copy",
    "scatter",
    "select_backward",
    "slice_backward",
    "_softmax_backward",
    "new_empty_strided",
    "as_strided_scatter",
    "select_scatter",
    "slice_scatter",
    "diagonal_backward",
    "diagonal_scatter",
    "unsafe_split",
    "unsafe_split_with_sizes",
    "unsafe_chunk",
    "split_copy",
    "split_with_sizes_copy",
    "unbind_copy",
    "narrow_copy",
    "expand_copy",
    "permute_copy",
    "view_copy",
    "t_copy",
    "transpose_copy",
    "squeeze_copy",
    "unsqueeze_copy",
    "_reshape_copy",
    # in-place views (aliases that rewrite metadata): nothing is computed
    "transpose",
    "t",
    "squeeze",
    "unsqueeze",
    "as_strided",
    "swapdims",
    "swapaxes",
    "resize",
    "set",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
    "im2col",
    "col2im",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "max_unpool2d",
    "max_unpool3d",
    "lu_unpack",
    "_local_scalar_dense",
    # layout and format conversions of weights and indices
    "_convert_weight_to_int4pack",
    "_convert_weight_to_int4pack_for_cpu",
    "_convert_indices_from_coo_to_csr",
    "_convert_indices_from_csr_to_coo",
    "_cudnn_rnn_flatten_weight",
    "mkldnn_reorder_conv2d_weight",
    "mkldnn_reorder_conv3d_weight",
    "_cslt_sparse_mm_search",
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
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "bernoulli",
    "native_dropout",
    "lift_fresh_copy",
    "eye",
    "linspace",
    "fft_fftfreq",
    "fft_rfftfreq",
}

_KIND_TABLE: list[tuple[set[str], str]] = [
    (MATMUL, "matmul"),
    (GROUPED_MM, "matmul"),
    (MATMUL_OTHER, "matmul"),
    (RNN, "matmul"),
    (RNN_BACKWARD, "matmul"),
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
    (EMBEDDING_BAG, "embedding"),
    (EMBEDDING_BACKWARD, "embedding_grad"),
    (EMBEDDING_BAG_BACKWARD, "embedding_grad"),
    (LOSS, "loss"),
    (LOSS_BACKWARD, "loss_grad"),
    (POOL, "pool"),
    (set(RESAMPLE_TAPS), "pool"),
    (POOL_BACKWARD, "pool_grad"),
    (RESAMPLE_BACKWARD, "pool_grad"),
    (REDUCTION, "reduction"),
    (LINALG, "linalg"),
    (COPY, "copy"),
    (FILL, "fill"),
]
_KIND_OF: dict[str, str] = {}
for _names, _kind in reversed(_KIND_TABLE):  # earlier entries win
    for _name in _names:
        _KIND_OF[_name] = _kind

#: Every op whose FLOPs are *not* the element-wise fallback because real arithmetic
#: (a contraction, a recurrence, a factorisation) dominates it: such an op must never
#: be costed as ``elementwise``; ``tests/test_flops.py`` holds captures to that.
ARITHMETIC_OPS: frozenset[str] = frozenset(
    MATMUL
    | GROUPED_MM
    | MATMUL_OTHER
    | RNN
    | RNN_BACKWARD
    | CONV
    | CONV_BACKWARD
    | ATTENTION
    | ATTENTION_BACKWARD
    | LINALG
)


def op_kind(name: str) -> str:
    """The coarse kind of an aten op from its overload-packet name (``addmm`` → ``matmul``)."""
    kind = _KIND_OF.get(name)
    if kind is None and name.endswith("_") and name not in ("copy_", "fill_", "zero_"):
        kind = _KIND_OF.get(name.rstrip("_"))
    return kind or "elementwise"


def _numel(shape: Shape | None) -> int:
    return math.prod(shape) if shape is not None else 0


def shape_of(value: Any) -> list[int] | None:
    """The shape of a tensor-like argument: a tensor, or an fx node whose ``meta["val"]``
    is one (what capture passes as ``args``); ``None`` for anything else."""
    shape = getattr(value, "shape", None)
    if shape is None:
        meta = getattr(value, "meta", None)
        val = meta.get("val") if isinstance(meta, dict) else None
        shape = getattr(val, "shape", None)
    if shape is None:
        return None
    try:
        return [int(s) for s in shape]
    except (TypeError, ValueError):
        return None


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
    ``is_causal`` and convolution groups, and the tensors inside list arguments (RNN
    weights, ``einsum`` operands), read through :func:`shape_of`. O(rank) per call
    (O(layers) for a multi-layer RNN op).
    """
    kwargs = kwargs or {}
    base = name if name in _KIND_OF else name.rstrip("_")
    special = _SPECIAL.get(base)
    if special is not None:
        return float(special(base, in_shapes, out_shapes, args, kwargs))
    kind = op_kind(name)
    out0 = out_shapes[0] if out_shapes else ()
    if kind == "matmul":
        return _matmul_flops(base, in_shapes, out0)
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
        if kind == "batch_norm" and ("no_training" in name or "no_update" in name):
            return 2.0 * _numel(basis)
        return float(per_element[kind] * _numel(basis))
    if kind == "pool":
        kernel = _pool_kernel(name, in_shapes, out0, args)
        return float(_numel(out0) * kernel)
    if kind == "reduction":
        return float(_numel(_first(in_shapes)))
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


def _arg(args: Sequence[Any], kwargs: dict[str, Any], pos: int, key: str, default: Any) -> Any:
    """Argument ``key`` at position ``pos`` (keyword wins), or ``default``."""
    if key in kwargs:
        return kwargs[key]
    return args[pos] if len(args) > pos else default


def _in_shape(in_shapes: Sequence[Shape | None], args: Sequence[Any], pos: int) -> Shape | None:
    if pos < len(in_shapes) and in_shapes[pos] is not None:
        return in_shapes[pos]
    return shape_of(args[pos]) if pos < len(args) else None


# ------------------------------------------------------------------------- matmul
def _matmul_flops(name: str, in_shapes: Sequence[Shape | None], out: Shape) -> float:
    """2·k per output element, where k is the contracted length (+1 per element for a bias)."""
    tensors = [s for s in in_shapes if s is not None]
    with_self = name in ("addmm", "baddbmm", "addbmm", "addmv", "_addmm_activation")
    if with_self:
        has_bias = True
    elif name in ("linear", "mkldnn_linear"):
        has_bias = len(in_shapes) > 2 and in_shapes[2] is not None
    elif name == "_scaled_mm":
        has_bias = len(in_shapes) > 4 and in_shapes[4] is not None
    else:
        has_bias = False
    a = tensors[1] if with_self else tensors[0]
    k = a[-1] if len(a) >= 1 else 1
    if name == "addbmm" and len(a) == 3:  # (b, n, m) @ (b, m, p) summed over b into (n, p)
        k *= a[0]
    return 2.0 * _numel(out) * k + (_numel(out) if has_bias else 0)


def _grouped_mm_flops(
    name: str,
    in_shapes: Sequence[Shape | None],
    out_shapes: Sequence[Shape],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> float:
    """2·M·K·N summed over the groups of ``_grouped_mm``/``_scaled_grouped_mm``.

    Layouts (PyTorch ``torch.nn.functional.grouped_mm`` docs): 2D×3D ``(M, K) @ (G, K, N)``
    → ``(M, N)``; 3D×2D ``(G, M, K) @ (K, N)`` → ``(M, N)``; 3D×3D is a batched matmul;
    2D×2D ``(M, K) @ (K, N)`` with K split by ``offs`` → ``(G, M, N)``. In every layout
    the FLOPs are 2·(output elements)·K, except 2D×2D where each group contracts only its
    slice of K: 2·M·K·N in total. ``offs`` values (rows per group) are never read, so the
    count is exact for any routing.
    """
    a = _in_shape(in_shapes, args, 0)
    b = _in_shape(in_shapes, args, 1)
    out = out_shapes[0] if out_shapes else ()
    if a is None or b is None or not a:
        return float(_numel(out))
    k = a[-1]
    flops = 2.0 * _numel(out) * k
    if len(a) == 2 and len(b) == 2 and len(out) == 3 and out[0]:
        flops /= out[0]
    bias_pos = 3 if name == "_grouped_mm" else 5
    if _in_shape(in_shapes, args, bias_pos) is not None or kwargs.get("bias") is not None:
        flops += _numel(out)
    return flops


def _addr_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``addr``: β·self + α·(x ⊗ y), a rank-1 update (BLAS ``ger``): 3 per element."""
    return 3.0 * _numel(out_shapes[0] if out_shapes else ())


def _einsum_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``einsum`` contracted left to right as ``torch.einsum`` does without opt_einsum:
    each pairwise step costs 2 FLOPs per point of the joint index space; one operand
    (a sum or a transpose) 1 per input element."""
    equation = args[0] if args else kwargs.get("equation", "")
    operands = args[1] if len(args) > 1 else kwargs.get("tensors", [])
    shapes = [shape_of(t) for t in operands] if isinstance(operands, list | tuple) else []
    out = out_shapes[0] if out_shapes else ()
    if not isinstance(equation, str) or not shapes or any(s is None for s in shapes):
        return float(_numel(out))
    lhs, arrow, out_spec = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return float(_numel(out))
    # Ellipses become fresh letters, aligned from the right as broadcasting does.
    widest = max(
        (len(s or ()) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0
    )
    fresh = [chr(0x100 + i) for i in range(widest)]
    terms = [
        t.replace("...", "".join(fresh[widest - (len(s or ()) - (len(t) - 3)) :]))
        for t, s in zip(terms, shapes)
    ]
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for letter, size in zip(term, shape or ()):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    if arrow:
        out_spec = out_spec.replace("...", "".join(fresh))
    else:
        joined = "".join(terms)
        out_spec = "".join(fresh) + "".join(
            sorted(c for c in sizes if joined.count(c) == 1 and c not in fresh)
        )
    if len(terms) == 1:
        return float(math.prod(sizes[c] for c in terms[0]))
    flops = 0.0
    current = set(terms[0])
    for i, term in enumerate(terms[1:], start=1):
        joint = current | set(term)
        flops += 2.0 * math.prod(sizes[c] for c in joint)
        later = set(out_spec).union(*(set(t) for t in terms[i + 1 :]))
        current = {c for c in joint if c in later}
    return flops


def _tensordot_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``tensordot``: 2 · output elements · product of the contracted extents."""
    a = _in_shape(in_shapes, args, 0) or ()
    dims = _arg(args, kwargs, 2, "dims_self", [])
    k = math.prod(a[d] for d in dims) if dims else 1
    return 2.0 * _numel(out_shapes[0] if out_shapes else ()) * k


def _trilinear_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``_trilinear`` (``nn.Bilinear``): Σ over ``sumdim`` of x1·W·x2 with broadcasting,
    evaluated as two contractions: 2 FLOPs per point of the broadcast index space."""
    if name == "bilinear":  # bilinear(x1 (.., I), x2 (.., J), W (O, I, J))
        x1, w = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 2)
        if x1 is None or w is None:
            return 0.0
        return 2.0 * _numel(x1[:-1]) * _numel(w) + _numel(out_shapes[0] if out_shapes else ())
    shapes = [_in_shape(in_shapes, args, i) for i in range(3)]
    expands = [_arg(args, kwargs, 3 + i, f"expand{i + 1}", []) for i in range(3)]
    rank = max(len(s or ()) + len(e) for s, e in zip(shapes, expands))
    full = [1] * rank
    for shape, expand in zip(shapes, expands):
        dims = list(shape or ())
        for d in sorted(expand):
            dims.insert(d, 1)
        for i, size in enumerate(dims[:rank]):
            full[i] = max(full[i], size)
    return 2.0 * math.prod(full)


def _linear_backward_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Gradients of a linear layer y = x·Wᵀ: grad-input and grad-weight are 2·m·k·n each
    (as ``output_mask`` asks), grad-bias 1 per grad-output element."""
    if name == "mkldnn_linear_backward_input":  # (input_size, grad_output, weight)
        grad_out, w = _in_shape(in_shapes, args, 1), _in_shape(in_shapes, args, 2)
        return 2.0 * _numel(grad_out) * (w[-1] if w else 1)
    if name == "mkldnn_linear_backward_weights":  # (grad_output, input, weight, bias)
        grad_out, x = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 1)
        with_bias = bool(_arg(args, kwargs, 3, "bias_defined", False))
        return 2.0 * _numel(grad_out) * (x[-1] if x else 1) + (_numel(grad_out) if with_bias else 0)
    if name == "matmul_backward":  # (grad, self, other, mask)
        grad, a = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 1)
        mask = _arg(args, kwargs, 3, "mask", [True, True])
        return 2.0 * _numel(grad) * (a[-1] if a else 1) * sum(bool(m) for m in mask)
    # linear_backward / mkldnn_linear_backward: (self, grad_output, weight, output_mask)
    x = _in_shape(in_shapes, args, 0) or ()
    w = _in_shape(in_shapes, args, 2) or ()
    mask = _arg(args, kwargs, 3, "output_mask", [True, True, True])
    one = 2.0 * _numel(x) * (w[0] if w else 1)
    grad_out = _in_shape(in_shapes, args, 1)
    return one * (bool(mask[0]) + bool(mask[1])) + (_numel(grad_out) if mask[2] else 0)


def _other_matmul_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Matmuls whose contracted length is read off another operand: 2·(output)·k.

    ``_foreach_mm`` sums its pairs; ``_cslt_sparse_mm``/``_sparse_semi_structured_mm``
    (2:4 sparse A) count the dense-equivalent product, k from the dense B;
    ``_compute_linear_combination`` (``matrix_exp``) mixes n inputs per output.
    """
    out = out_shapes[0] if out_shapes else ()
    if name == "_foreach_mm":
        lhs, rhs = (args[0], args[1]) if len(args) > 1 else ([], [])
        total = 0.0
        for a, b in zip(lhs, rhs):
            sa, sb = shape_of(a), shape_of(b)
            if sa and sb:
                total += 2.0 * _numel(sa[:-1]) * sa[-1] * sb[-1]
        return total
    pos = {"_cslt_sparse_mm": 1, "_sparse_semi_structured_mm": 2}.get(name)
    if pos is not None:
        b = _in_shape(in_shapes, args, pos)
        return 2.0 * _numel(out) * (b[-2] if b and len(b) >= 2 else 1)
    coefficients = _in_shape(in_shapes, args, 1)  # _compute_linear_combination
    return 2.0 * _numel(out) * (coefficients[-1] if coefficients else 1)


def _cdist_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Pairwise distances (P, R) over M features: 3 FLOPs per term (difference, power,
    sum); the Euclidean case runs as a matmul, 2 per term. Backward: the same again."""
    backward = name == "_cdist_backward"
    x1 = _in_shape(in_shapes, args, 1 if backward else 0) or ()
    p = _arg(args, kwargs, 3 if backward else 2, "p", 2.0)
    per = 2.0 if p == 2.0 else 3.0
    pairs = _in_shape(in_shapes, args, 0) if backward else (out_shapes[0] if out_shapes else ())
    return per * _numel(pairs) * (x1[-1] if x1 else 1)


def _pdist_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Condensed pairwise distances of N rows of M features (N(N−1)/2 pairs): 3 FLOPs
    per term; backward the same again."""
    backward = name == "_pdist_backward"
    x = _in_shape(in_shapes, args, 1 if backward else 0) or ()
    pairs = _in_shape(in_shapes, args, 0) if backward else (out_shapes[0] if out_shapes else ())
    return 3.0 * _numel(pairs) * (x[-1] if x else 1)


def _encoder_layer_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``_transformer_encoder_layer_fwd`` (the ``nn.TransformerEncoderLayer`` inference
    fast path): QKV and output projections, attention, two norms and the feed-forward."""
    src = _in_shape(in_shapes, args, 0) or ()
    heads = int(_arg(args, kwargs, 2, "num_heads", 1))
    ffn = _in_shape(in_shapes, args, 14) or ()
    if len(src) < 2:
        return 0.0
    e = src[-1]
    tokens = _numel(src[:-1])
    seq = src[-2]
    batch = tokens // max(1, seq)
    proj = 2.0 * tokens * e * (3 * e) + 2.0 * tokens * e * e
    scores = batch * heads * seq * seq
    attention = 2.0 * scores * (2 * e // max(1, heads)) + 5.0 * scores
    feed_forward = 2.0 * 2.0 * tokens * e * (ffn[0] if ffn else 4 * e)
    return proj + attention + feed_forward + 10.0 * tokens * e


# ---------------------------------------------------------------------------- RNN
# Gate arithmetic per hidden unit and step besides the bias adds (see module docstring):
# LSTM 3 sigmoids + 2 tanh (20) + c' = f·c + i·g (3) + h' = o·tanh(c') (1);
# GRU 2 sigmoids + tanh (12) + r·(W_hn h + b_hn) (1) + n add (1) + (1−z)·n + z·h (4).
_CELL_POINTWISE = {4: 24, 3: 18, 1: 4}
_CUDNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # cuDNN/MIOpen mode: RNN_RELU, RNN_TANH, LSTM, GRU


def rnn_layer_flops(
    rows: int, input_size: int, hidden: int, gates: int, bias: bool = True, proj: int = 0
) -> float:
    """Forward FLOPs of one RNN layer-direction over ``rows`` = T·B (time steps × batch).

    2·G·h·(i + r) per row for the input and recurrent matmuls, where r is the recurrent
    width (``proj`` when projected, else h), plus the projection 2·h·p, the G·h sums of
    the two products, 2·G·h bias adds and the gate arithmetic (``_CELL_POINTWISE``).
    LSTM (G = 4) without the small terms is the textbook 8·(i + h)·h·T·B.
    """
    recurrent = proj or hidden
    matmuls = 2.0 * rows * gates * hidden * (input_size + recurrent)
    if proj:
        matmuls += 2.0 * rows * hidden * proj
    pointwise = rows * hidden * (gates * (1 + (2 if bias else 0)) + _CELL_POINTWISE.get(gates, 4))
    return matmuls + pointwise


def _rnn_stack_flops(
    rows: int,
    input_size: int,
    hidden: int,
    gates: int,
    layers: int,
    bidirectional: bool,
    bias: bool = True,
    proj: int = 0,
) -> float:
    """A multi-layer (bi)directional RNN: layer l > 0 reads D·(p or h) features."""
    directions = 2 if bidirectional else 1
    total = 0.0
    size = input_size
    for _ in range(max(1, layers)):
        total += directions * rnn_layer_flops(rows, size, hidden, gates, bias, proj)
        size = directions * (proj or hidden)
    return total


def _rows(x: Shape | None, packed: bool) -> tuple[int, int]:
    """(T·B rows, feature size) of an RNN input; packed inputs are (ΣT, features)."""
    if not x:
        return 0, 0
    return (x[0] if packed else _numel(x[:-1])), x[-1]


def _mkldnn_rnn_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``mkldnn_rnn_layer`` (one layer-direction of ``nn.LSTM``/``GRU``/``RNN`` on CPU):
    input (T, B, i), ``weight0`` the (G·h, i) input weights; backward twice the forward."""
    backward = name.endswith("_backward")
    x = _in_shape(in_shapes, args, 0)
    w_ih = _in_shape(in_shapes, args, 1)
    hidden_pos, bias_pos = (15, 17) if backward else (10, 12)
    hidden = int(_arg(args, kwargs, hidden_pos, "hidden_size", 0) or 0)
    w_hh = _in_shape(in_shapes, args, 2)
    if not hidden and w_hh:
        hidden = w_hh[-1]
    if not (x and w_ih and hidden):
        return float(_numel(out_shapes[0] if out_shapes else ()))
    rows, size = _rows(x, False)
    gates = max(1, w_ih[0] // hidden)
    bias = bool(_arg(args, kwargs, bias_pos, "has_biases", True))
    forward = rnn_layer_flops(rows, w_ih[-1] or size, hidden, gates, bias)
    return 2.0 * forward if backward else forward


# name → positions of (mode, hidden_size, proj_size, num_layers, bidirectional,
# batch_sizes, output_mask) in the aten schema.
_CUDNN_RNN_ARGS: dict[str, tuple[int, int, int | None, int, int, int, int | None]] = {
    "_cudnn_rnn": (6, 7, 8, 9, 13, 14, None),
    "miopen_rnn": (5, 6, None, 7, 11, 12, None),
    "_cudnn_rnn_backward": (10, 11, 12, 13, 17, 18, 21),
    "miopen_rnn_backward": (10, 11, None, 12, 16, 17, 20),
}


def _cudnn_rnn_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``_cudnn_rnn``/``miopen_rnn`` (all layers in one op); their backward ops count
    twice the forward (once when ``output_mask`` asks for no weight gradients)."""
    mode_at, hidden_at, proj_at, layers_at, bidi_at, sizes_at, mask_at = _CUDNN_RNN_ARGS[name]
    x = _in_shape(in_shapes, args, 0)
    mode = int(_arg(args, kwargs, mode_at, "mode", 2))
    hidden = int(_arg(args, kwargs, hidden_at, "hidden_size", 0))
    proj = int(_arg(args, kwargs, proj_at, "proj_size", 0)) if proj_at is not None else 0
    layers = int(_arg(args, kwargs, layers_at, "num_layers", 1))
    bidirectional = bool(_arg(args, kwargs, bidi_at, "bidirectional", False))
    batch_sizes = _arg(args, kwargs, sizes_at, "batch_sizes", [])
    if not (x and hidden):
        return float(_numel(out_shapes[0] if out_shapes else ()))
    rows, size = _rows(x, bool(batch_sizes) and len(x) == 2)
    gates = _CUDNN_GATES.get(mode, 4)
    forward = _rnn_stack_flops(rows, size, hidden, gates, layers, bidirectional, True, proj)
    if mask_at is None:
        return forward
    mask = _arg(args, kwargs, mask_at, "output_mask", [True, True, True, True])
    return forward * (2.0 if len(mask) > 3 and mask[3] else 1.0)


# name → positions of (input, hx, has_biases, num_layers, bidirectional) for ``.input``
# overloads; packed ``.data`` overloads insert batch_sizes after the input.
_ATEN_RNN_ARGS: dict[str, tuple[int, int, int, int, int]] = {
    **dict.fromkeys(
        ("lstm", "gru", "rnn_tanh", "rnn_relu", "quantized_lstm", "quantized_gru", "_lstm_mps"),
        (0, 1, 3, 4, 7),
    ),
    "lstm_mps_backward": (5, 7, 9, 10, 13),
}


def _aten_rnn_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (``.input`` and packed ``.data``), their
    quantized and MPS forms; ``lstm_mps_backward`` twice the forward."""
    x_at, hx_at, bias_at, layers_at, bidi_at = _ATEN_RNN_ARGS[name]
    backward = name.endswith("_backward")
    packed = not backward and not (len(args) > 3 and isinstance(args[3], bool))
    shift = 1 if packed else 0
    x = _in_shape(in_shapes, args, x_at)
    hx = args[hx_at + shift] if len(args) > hx_at + shift else None
    if "lstm" in name:
        states = [shape_of(t) for t in hx] if isinstance(hx, list | tuple) else []
        h_shape = states[0] if states else None
        c_shape = states[1] if len(states) > 1 else h_shape
        hidden = c_shape[-1] if c_shape else 0
        proj = h_shape[-1] if h_shape and h_shape[-1] != hidden else 0
        gates = 4
    else:
        h_shape = shape_of(hx)
        hidden, proj = (h_shape[-1] if h_shape else 0), 0
        gates = 3 if "gru" in name else 1
    bias = bool(_arg(args, kwargs, bias_at + shift, "has_biases", True))
    layers = int(_arg(args, kwargs, layers_at + shift, "num_layers", 1))
    bidirectional = bool(_arg(args, kwargs, bidi_at + shift, "bidirectional", False))
    if not (x and hidden):
        return float(_numel(out_shapes[0] if out_shapes else ()))
    rows, size = _rows(x, packed)
    forward = _rnn_stack_flops(rows, size, hidden, gates, layers, bidirectional, bias, proj)
    return 2.0 * forward if backward else forward


def _rnn_cell_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """``lstm_cell``/``gru_cell``/``rnn_*_cell``: one step, input (B, i), ``w_ih`` (G·h, i)."""
    x = _in_shape(in_shapes, args, 0)
    w_ih, w_hh = _in_shape(in_shapes, args, 2), _in_shape(in_shapes, args, 3)
    if not (x and w_ih and w_hh):
        return float(_numel(out_shapes[0] if out_shapes else ()))
    hidden = w_hh[-1]
    bias = _in_shape(in_shapes, args, 4) is not None
    rows, _ = _rows(x, False)
    return rnn_layer_flops(rows, w_ih[-1], hidden, max(1, w_ih[0] // hidden), bias)


def _fused_cell_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Fused gate arithmetic of one LSTM/GRU step (the matmuls are separate ``addmm``s):
    the sums and bias adds per gate element plus ``_CELL_POINTWISE`` per hidden unit;
    backward ops count twice that."""
    gates = 3 if "gru" in name else 4
    if name in ("_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"):
        gate_shape = _in_shape(in_shapes, args, 0)
        bias = _in_shape(in_shapes, args, 3) is not None
        if not gate_shape:
            return 0.0
        units = _numel(gate_shape) // gates
        return float(units * (gates * (1 + (2 if bias else 0)) + _CELL_POINTWISE[gates]))
    # backward: the first output of every variant is the (B, G·h) gate gradient, except
    # _thnn_fused_gru_cell_backward whose first output is (B, 3h) too.
    out0 = out_shapes[0] if out_shapes else ()
    units = _numel(out0) // gates
    return 2.0 * units * (3 * gates + _CELL_POINTWISE[gates])


# ---------------------------------------------------------------------- convolution
_CONV_BIAS_AT_3 = {
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "slow_conv3d",
    "thnn_conv2d",
    "slow_conv_dilated2d",
    "slow_conv_dilated3d",
    "slow_conv_transpose2d",
    "slow_conv_transpose3d",
    "_conv_depthwise2d",
    "conv_depthwise3d",
}


def _conv_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """2 · output elements · (C_in / groups) · kernel elements, + 1 per element for a bias.

    A transposed convolution scatters each *input* element into C_out / groups outputs per
    kernel tap, so it counts input elements instead. ``conv_tbc`` takes (T, B, C) input
    and (k, C_in, C_out) weights.
    """
    x, w = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 1)
    out = out_shapes[0] if out_shapes else ()
    assert x is not None and w is not None
    if name == "conv_tbc":
        return 2.0 * _numel(out) * w[0] * w[1] + _numel(out)
    if name in ("convolution", "_convolution", "convolution_overrideable"):
        transposed = bool(_arg(args, kwargs, 6, "transposed", False))
    else:
        transposed = "transpose" in name
    bias_pos = 3 if name in _CONV_BIAS_AT_3 else 2
    has_bias = _in_shape(in_shapes, args, bias_pos) is not None
    kernel = _numel(w[2:])
    # w[1] is already C_in / groups (C_out / groups when transposed).
    flops = 2.0 * (_numel(x) if transposed else _numel(out)) * w[1] * kernel
    return flops + (_numel(out) if has_bias else 0)


# name → positions of (grad_output, input, weight, transposed flag or a fixed value,
# output_mask).
_CONV_BACKWARD_ARGS: dict[str, tuple[int, int, int, int | bool, int]] = {
    "convolution_backward": (0, 1, 2, 7, 10),
    "convolution_backward_overrideable": (0, 1, 2, 6, 9),
    "_slow_conv2d_backward": (0, 1, 2, False, 6),
    "mps_convolution_backward": (1, 0, 2, False, 7),
    "mps_convolution_transpose_backward": (1, 0, 2, True, 8),
    "_convolution_double_backward": (3, 5, 4, 9, 12),
}


def _conv_backward_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """The forward's count for each of grad-input and grad-weight in ``output_mask``
    (+ 1 per grad-output element for grad-bias). ``_convolution_double_backward`` (a
    gradient of a gradient) counts one convolution per requested output plus one."""
    if name == "conv_tbc_backward":  # (grad (T, B, C_out), input, weight (k, C_in, C_out))
        grad_out, w = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 2)
        assert grad_out is not None and w is not None
        return 2.0 * 2.0 * _numel(grad_out) * w[0] * w[1] + _numel(grad_out)
    grad_at, x_at, w_at, transposed_at, mask_at = _CONV_BACKWARD_ARGS[name]
    grad_out = _in_shape(in_shapes, args, grad_at)
    x = _in_shape(in_shapes, args, x_at)
    w = _in_shape(in_shapes, args, w_at)
    assert grad_out is not None and x is not None and w is not None
    if isinstance(transposed_at, bool):
        transposed = transposed_at
    else:
        transposed = bool(_arg(args, kwargs, transposed_at, "transposed", False))
    mask = list(_arg(args, kwargs, mask_at, "output_mask", [True, True, True]))
    kernel = _numel(w[2:])
    one = 2.0 * (_numel(x) if transposed else _numel(grad_out)) * w[1] * kernel
    if name == "_convolution_double_backward":
        return one * (1 + sum(bool(m) for m in mask))
    flops = 0.0
    if mask[0]:
        flops += one
    if len(mask) > 1 and mask[1]:
        flops += one
    if len(mask) > 2 and mask[2]:
        flops += _numel(grad_out)
    return flops


# ------------------------------------------------------------------------ attention
# name → (position of the query, query layout is (B, L, H, E), position of is_causal,
# position of the cumulative query lengths of variable-length (nested) inputs, position
# of max_seqlen_k); ``_efficient_attention_*`` give a custom_mask_type (1, 2: causal)
# for is_causal. Backward ops take grad_out first, so their query is at 1.
_ATTENTION_ARGS: dict[str, tuple[int, bool, int | None, int | None, int | None]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (0, False, 4, None, None),
    "_scaled_dot_product_flash_attention": (0, False, 4, None, None),
    "_scaled_dot_product_efficient_attention": (0, False, 6, None, None),
    "_scaled_dot_product_cudnn_attention": (0, False, 6, None, None),
    "_scaled_dot_product_fused_attention_overrideable": (0, False, 5, None, None),
    "_scaled_dot_product_attention_math_for_mps": (0, False, 5, None, None),
    "_triton_scaled_dot_attention": (0, False, None, None, None),
    "_flash_attention_forward": (0, True, 8, 3, 6),
    "_flash_attention_forward_no_dropout_inplace": (1, True, 9, 4, 7),
    "_efficient_attention_forward": (0, True, 9, 4, 7),
    "_cudnn_attention_forward": (0, False, 10, 4, 7),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (1, False, 7, None, None),
    "_scaled_dot_product_flash_attention_backward": (1, False, 11, None, None),
    "_scaled_dot_product_efficient_attention_backward": (1, False, 11, None, None),
    "_scaled_dot_product_cudnn_attention_backward": (1, False, 14, None, None),
    "_scaled_dot_product_fused_attention_overrideable_backward": (1, False, 13, None, None),
    "_flash_attention_backward": (1, True, 11, 6, 9),
    "_efficient_attention_backward": (1, True, 14, 6, 9),
    "_cudnn_attention_backward": (1, False, 14, 9, 12),
}


def _attention_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """QKᵀ and PV (2·scores·(E + E_v)) plus softmax (5 per score); backward twice the
    matmuls plus 3 per score; causal halves it (see the module docstring)."""
    if name in ("_native_multi_head_attention", "_triton_multi_head_attention"):
        return _native_mha_flops(in_shapes, args, kwargs)
    backward = name.endswith("_backward")
    default = (1 if backward else 0, False, None, None, None)
    offset, seq_first, causal_at, cum_q_at, max_k_at = _ATTENTION_ARGS.get(name, default)
    q = _in_shape(in_shapes, args, offset)
    k = _in_shape(in_shapes, args, offset + 1)
    v = _in_shape(in_shapes, args, offset + 2)
    assert q is not None and k is not None and v is not None
    e, e_v = q[-1], v[-1]
    varlen = cum_q_at is not None and len(args) > cum_q_at and args[cum_q_at] is not None
    if varlen:  # (total tokens, H, E) (or (1, total, H, E)) with cumulative lengths
        seq_q, heads = q[-3], q[-2]
        seq_k = int(_arg(args, kwargs, max_k_at, "max_k", k[-3]) or k[-3])
    elif seq_first:  # (B, L, H, E)
        seq_q, seq_k = q[-3], k[-3]
        heads = _numel(q[:-3]) * q[-2]
    else:  # (B, H, L, E)
        seq_q, seq_k = q[-2], k[-2]
        heads = _numel(q[:-2])
    causal = bool(kwargs.get("is_causal", False))
    flag = kwargs.get("custom_mask_type")
    if flag is None and causal_at is not None and len(args) > causal_at:
        flag = args[causal_at]
    if name.startswith("_efficient_attention"):
        causal = causal or (not isinstance(flag, bool) and flag in (1, 2))
    elif isinstance(flag, bool):
        causal = causal or flag
    scores = heads * seq_q * seq_k
    fraction = 0.5 if causal and (seq_q == seq_k or varlen) else 1.0
    matmuls = 2.0 * scores * (e + e_v)
    if backward:
        return fraction * (2.0 * matmuls + 3.0 * scores)
    return fraction * (matmuls + 5.0 * scores)


def _native_mha_flops(in_shapes, args, kwargs) -> float:
    """``_native_multi_head_attention`` (the ``nn.MultiheadAttention`` inference fast
    path): input projections, attention and output projection."""
    q = _in_shape(in_shapes, args, 0) or ()
    k = _in_shape(in_shapes, args, 1) or ()
    heads = int(_arg(args, kwargs, 4, "num_head", 1))
    if len(q) < 2 or len(k) < 2:
        return 0.0
    e = q[-1]
    tokens_q, tokens_k = _numel(q[:-1]), _numel(k[:-1])
    seq_k = k[-2]
    projections = 2.0 * e * e * (2 * tokens_q + 2 * tokens_k)  # q, k, v and output
    scores = tokens_q * seq_k * heads
    return projections + 2.0 * scores * (2 * e // max(1, heads)) + 5.0 * scores


# ------------------------------------------------------------------- linear algebra
def _linalg_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """Dense linear algebra (Golub & Van Loan) and FFTs; see the module docstring."""
    if name.startswith("_fft"):
        return _fft_flops(name, in_shapes, out_shapes, args, kwargs)
    # The factored matrix: ``triangular_solve`` and ``cholesky_solve`` take B first.
    a_pos = 1 if name in ("triangular_solve", "cholesky_solve") else 0
    a = _in_shape(in_shapes, args, a_pos) or _first(in_shapes)
    if not a:
        return 0.0
    m, n = (a[-2], a[-1]) if len(a) >= 2 else (a[-1], a[-1])
    batch = _numel(a[:-2]) if len(a) > 2 else 1
    rhs_pos = {
        "linalg_solve_triangular": 1,
        "triangular_solve": 0,
        "cholesky_solve": 0,
        "linalg_solve_ex": 1,
        "_linalg_solve_ex": 1,
        "linalg_lu_solve": 2,
        "linalg_ldl_solve": 2,
        "ormqr": 2,
        "linalg_lstsq": 1,
    }.get(name)
    rhs = 0
    if rhs_pos is not None:
        b = _in_shape(in_shapes, args, rhs_pos) or a
        if name == "linalg_lstsq":
            rhs = b[-1] if len(b) >= 2 else 1
        else:  # B is (n, k) for a left solve, (k, n) for a right one
            rhs = max(1, _numel(b[-2:]) // max(1, n)) if len(b) >= 2 else 1
    small, big = min(m, n), max(m, n)
    qr = 2.0 * big * small**2 - 2.0 * small**3 / 3.0
    if name in ("linalg_cholesky_ex", "cholesky", "linalg_ldl_factor_ex"):
        flops = n**3 / 3.0
    elif name in ("linalg_lu_factor_ex", "linalg_lu", "_linalg_det", "_linalg_slogdet"):
        flops = 2.0 * n**3 / 3.0
    elif name in ("linalg_solve_ex", "_linalg_solve_ex"):
        flops = 2.0 * n**3 / 3.0 + 2.0 * n * n * rhs
    elif name in ("linalg_solve_triangular", "triangular_solve"):
        flops = float(n) * n * rhs
    elif name in ("linalg_lu_solve", "linalg_ldl_solve", "cholesky_solve"):
        flops = 2.0 * n * n * rhs
    elif name == "linalg_inv_ex":
        flops = 2.0 * n**3
    elif name == "cholesky_inverse":
        flops = float(n) ** 3
    elif name in ("_linalg_eigh", "linalg_eigh", "linalg_eigvalsh"):
        vectors = name != "linalg_eigvalsh" and bool(_arg(args, kwargs, 2, "compute_v", True))
        flops = 9.0 * n**3 if vectors else 4.0 * n**3 / 3.0
    elif name == "geqrf":
        flops = qr
    elif name == "linalg_qr":
        mode = _arg(args, kwargs, 1, "mode", "reduced")
        flops = qr if mode == "r" else 2.0 * qr
    elif name in ("ormqr", "linalg_householder_product"):
        tau = _in_shape(in_shapes, args, 1) or (small,)
        reflectors = tau[-1]
        if name == "ormqr":
            flops = 4.0 * _numel(_in_shape(in_shapes, args, 2) or a) / batch * reflectors
        else:
            flops = 4.0 * m * n * reflectors - 2.0 * (m + n) * reflectors**2
            flops += 4.0 * reflectors**3 / 3.0
    elif name in ("_linalg_svd", "linalg_svd"):
        compute_uv = bool(_arg(args, kwargs, 2, "compute_uv", True))
        if name == "linalg_svd":
            compute_uv = True
        flops = 14.0 * big * small**2 + 8.0 * small**3 if compute_uv else 2.0 * qr
    elif name == "linalg_eig":
        flops = 25.0 * n**3
    elif name == "_linalg_eigvals":
        flops = 10.0 * n**3
    elif name == "linalg_matrix_exp":
        # Padé-13 with scaling and squaring (Higham 2005): ~6 matmuls and one solve.
        flops = 6 * 2.0 * n**3 + 2.0 * n**3 / 3.0 + 2.0 * n**3
    elif name == "linalg_lstsq":
        flops = qr + 4.0 * big * small * rhs
    else:
        flops = float(n) ** 3
    return batch * max(0.0, flops)


def _fft_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """5·N·log₂N per complex transform of length N (Cooley–Tukey); real-input (``r2c``)
    and real-output (``c2r``) transforms cost half."""
    x = _in_shape(in_shapes, args, 0) or ()
    dims = _arg(args, kwargs, 1, "dim", [])
    signal = list(out_shapes[0]) if name == "_fft_c2r" and out_shapes else list(x)
    if not signal:
        return 0.0
    length = math.prod(signal[d] for d in dims) if dims else signal[-1]
    per = 2.5 if name in ("_fft_r2c", "_fft_c2r") else 5.0
    return per * _numel(signal) * math.log2(max(2, length))


# ----------------------------------------------------------------- other special ops
def _embedding_bag_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """One add per gathered element: indices × embedding width (sum and mean bags);
    the backward scatters the same number."""
    if name in EMBEDDING_BAG:
        weight, indices = _in_shape(in_shapes, args, 0), _in_shape(in_shapes, args, 1)
        width = weight[-1] if weight else 1
    else:
        grad = _in_shape(in_shapes, args, 0)
        idx_pos = 2 if name == "_embedding_bag_per_sample_weights_backward" else 1
        indices = _in_shape(in_shapes, args, idx_pos)
        width = grad[-1] if grad else 1
    return float(_numel(indices) * width)


def _resample_flops(name, in_shapes, out_shapes, args, kwargs) -> float:
    """2 FLOPs (weight and accumulate) per interpolation tap per output element; the
    backward scatters each grad-output element the same way."""
    base = name.removesuffix("_backward")
    taps = RESAMPLE_TAPS[base]
    if name.endswith("_backward"):
        basis = _in_shape(in_shapes, args, 0)
    else:
        basis = out_shapes[0] if out_shapes else ()
    return 2.0 * taps * _numel(basis)


_Formula = Callable[
    [str, Sequence[Shape | None], Sequence[Shape], Sequence[Any], dict[str, Any]], float
]
_SPECIAL: dict[str, _Formula] = {
    **dict.fromkeys(GROUPED_MM, _grouped_mm_flops),
    "addr": _addr_flops,
    "einsum": _einsum_flops,
    "tensordot": _tensordot_flops,
    "bilinear": _trilinear_flops,
    "_trilinear": _trilinear_flops,
    **dict.fromkeys(
        (
            "mkldnn_linear_backward",
            "linear_backward",
            "mkldnn_linear_backward_input",
            "mkldnn_linear_backward_weights",
            "matmul_backward",
        ),
        _linear_backward_flops,
    ),
    **dict.fromkeys(
        ("_foreach_mm", "_cslt_sparse_mm", "_sparse_semi_structured_mm"), _other_matmul_flops
    ),
    "_compute_linear_combination": _other_matmul_flops,
    "_pdist_forward": _pdist_flops,
    "_pdist_backward": _pdist_flops,
    "cdist": _cdist_flops,
    "_cdist_forward": _cdist_flops,
    "_cdist_backward": _cdist_flops,
    "_transformer_encoder_layer_fwd": _encoder_layer_flops,
    "mkldnn_rnn_layer": _mkldnn_rnn_flops,
    "mkldnn_rnn_layer_backward": _mkldnn_rnn_flops,
    **dict.fromkeys(
        ("_cudnn_rnn", "_cudnn_rnn_backward", "miopen_rnn", "miopen_rnn_backward"),
        _cudnn_rnn_flops,
    ),
    **dict.fromkeys(_ATEN_RNN_ARGS, _aten_rnn_flops),
    **dict.fromkeys(("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"), _rnn_cell_flops),
    **dict.fromkeys(RNN_CELL_POINTWISE, _fused_cell_flops),
    **dict.fromkeys(CONV, _conv_flops),
    **dict.fromkeys(CONV_BACKWARD, _conv_backward_flops),
    **dict.fromkeys(ATTENTION | ATTENTION_BACKWARD, _attention_flops),
    **dict.fromkeys(LINALG, _linalg_flops),
    **dict.fromkeys(EMBEDDING_BAG | EMBEDDING_BAG_BACKWARD, _embedding_bag_flops),
    **dict.fromkeys(set(RESAMPLE_TAPS) | RESAMPLE_BACKWARD, _resample_flops),
}


def _pool_kernel(name: str, in_shapes: Sequence[Shape | None], out: Shape, args: Sequence[Any]):
    if "adaptive" in name:
        x = in_shapes[0]
        assert x is not None
        return max(1, _numel(x) // max(1, _numel(out)))
    if len(args) > 1 and isinstance(args[1], list | tuple):
        return _numel(args[1])
    return 1
