"""Fake-tensor kernels that capture needs beyond PyTorch's, and expert (MoE) parameters.

Capture traces on fake *CPU* tensors, so an op whose shape function (meta kernel) enforces
a device kernel's restrictions fails even though only its shape matters. PyTorch's meta
kernel for ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, the default expert
kernel of Hugging Face ``transformers`` 5 mixture-of-experts layers) copies the CUDA
kernel's checks: bf16 inputs only ("Expected inputs of BF16 type"), 16-byte aligned
strides, no bias. :func:`capture_kernels` registers, for the duration of a capture, a
fake kernel that computes the same output shape for any floating dtype and layout, so
an fp32 (or fp16, or oddly sized) MoE model captures with its ``_grouped_mm`` ops intact
and costed by :mod:`meshplace.graph.flops` (2·M·K·N over all routed rows).

Token routing depends on data; fake tensors have none. The grouped matmul's output has
one row per routed (token, expert) pair — tokens·top_k rows — whatever the routing, so
FLOPs are exact in aggregate; how the rows split among experts (the ``offs`` values) is
unknown, and anything per expert is costed at the expected load, tokens·top_k / experts
rows each.

:func:`expert_parameters` finds the parameters that hold experts, for expert parallelism:
stacked expert weights (a parameter of shape ``(experts, …)`` read by a grouped matmul,
or indexed per token by the ``batched_mm`` path) and per-expert modules named by
convention (``…experts.<i>.…``, as ``nn.ModuleList`` experts of Mixtral/Switch-style
models are).

Example
-------
>>> import torch
>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> with capture_kernels(), FakeTensorMode():
...     x = torch.empty(12, 16)  # fp32: PyTorch's own meta kernel refuses this
...     w = torch.empty(4, 16, 32)
...     offs = torch.empty(4, dtype=torch.int32)
...     tuple(torch._grouped_mm(x, w, offs=offs).shape)
(12, 32)
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from meshplace.graph.ir import OpGraph

_aten = torch.ops.aten
_lock = threading.Lock()
_depth = 0
_saved: dict[Any, Any] = {}

#: Fake kernels capture registers, keyed by the aten overload they replace.
FAKE_KERNELS: dict[Any, Any] = {}


def grouped_mm_shape(
    a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int], groups: int | None
) -> list[int]:
    """Output shape of ``_grouped_mm(a, b, offs)`` (``groups`` = ``len(offs)``).

    2D×3D ``(M, K) @ (G, K, N)`` → ``(M, N)``; 3D×2D ``(G, M, K) @ (K, N)`` → ``(M, N)``;
    2D×2D ``(M, K) @ (K, N)`` → ``(G, M, N)``; 3D×3D ``(G, M, K) @ (G, K, N)`` →
    ``(G, M, N)`` (PyTorch ``torch.nn.functional.grouped_mm`` docs).

    Raises:
        RuntimeError: the ranks or the contracted extents do not fit.
    """
    if len(a) not in (2, 3) or len(b) not in (2, 3):
        raise RuntimeError(f"grouped_mm: operands must be 2D or 3D, got {len(a)}D and {len(b)}D")
    if (len(a) == 3 or len(b) == 3) and a[-1] != b[-2]:
        raise RuntimeError(f"grouped_mm: contraction sizes differ ({a[-1]} vs {b[-2]})")
    if (len(a) == 2 or len(b) == 2) and groups is None:
        raise RuntimeError("grouped_mm: a 2D operand needs offs")
    if len(a) == 2 and len(b) == 2:
        return [int(groups or 0), a[0], b[1]]
    if len(a) == 2:
        return [a[0], b[-1]]
    if len(b) == 2:
        return [a[1], b[1]]
    if a[0] != b[0]:
        raise RuntimeError(f"grouped_mm: group counts differ ({a[0]} vs {b[0]})")
    return [a[0], a[1], b[-1]]


def _fake_grouped_mm(
    fake_mode: Any,
    func: Any,
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Shape-only ``_grouped_mm`` for fake tensors: any floating dtype, any strides."""
    groups = int(offs.shape[0]) if offs is not None else None
    shape = grouped_mm_shape(tuple(mat_a.shape), tuple(mat_b.shape), groups)
    with fake_mode:
        return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


FAKE_KERNELS[_aten._grouped_mm.default] = _fake_grouped_mm


def _impl_table() -> dict[Any, Any] | None:
    try:
        from torch._subclasses import fake_impls
    except ImportError:  # pragma: no cover - a torch without the fake-impl table
        return None
    table = getattr(fake_impls, "op_implementations_dict", None)
    return table if isinstance(table, dict) else None


def _forget_cached(ops: set[Any]) -> None:
    """Drop fake-tensor dispatch-cache entries our kernels made, so nothing outside a
    capture reuses them (the cache is class-wide; its key starts with the op)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        cache = FakeTensorMode.cache
        for key in [k for k in cache if getattr(k, "key", (None,))[0] in ops]:
            cache.pop(key, None)
    except Exception:  # pragma: no cover - cache layout is private to PyTorch
        pass


@contextmanager
def capture_kernels() -> Iterator[None]:
    """Register :data:`FAKE_KERNELS` with PyTorch's fake tensors while the block runs.

    Re-entrant and thread-safe (the outermost block registers, the last one out
    restores); PyTorch's own kernels are back in place on exit, and the fake-tensor
    dispatch cache forgets what ours produced. Uses the fake-op table
    (``torch._subclasses.fake_impls.op_implementations_dict``) that FakeTensorMode
    consults before meta kernels; on a PyTorch without it this does nothing.
    """
    global _depth
    table = _impl_table()
    if table is None:  # pragma: no cover
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _saved.clear()
            for op, kernel in FAKE_KERNELS.items():
                _saved[op] = table.get(op)
                table[op] = kernel
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for op, previous in _saved.items():
                    if previous is None:
                        table.pop(op, None)
                    else:
                        table[op] = previous
                _forget_cached(set(_saved))
                _saved.clear()


# ----------------------------------------------------------------- expert parameters
_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)(?:\.|$)")
_GATHERS = ("aten.index.", "aten._unsafe_index.", "aten.index_select.", "aten.embedding.")


def expert_parameters(graph: OpGraph) -> dict[str, dict[str, int]]:
    """Parameters of ``graph`` that hold mixture-of-experts experts.

    Returns ``{parameter op name: info}`` where info is ``{"experts": E, "axis": 0}`` for a
    stacked expert weight of shape ``(E, …)`` — a parameter with three or more dimensions
    that a forward grouped matmul (``_grouped_mm``/``_scaled_grouped_mm``) reads, or that
    a forward gather indexes per token (the ``batched_mm`` expert path, for a parameter
    whose name says ``expert``) — and
    ``{"expert": i}`` for a parameter of the i-th module of an ``experts`` list (module
    path ``….experts.<i>.…``). Sharding places experts by these (expert parallelism:
    split axis 0, or assign whole per-expert modules). O(V + E).
    """
    ops = graph.ops
    found: dict[str, dict[str, int]] = {}
    for src, dst, _ in graph.edges():
        param, reader = ops[src], ops[dst]
        if param.kind != "parameter" or reader.phase != "forward" or not param.output_shapes:
            continue
        shape = param.output_shapes[0]
        target = reader.target
        grouped = "grouped_mm" in target
        gathered = target.startswith(_GATHERS) and "expert" in param.name
        if len(shape) >= 3 and (grouped or gathered):
            found[param.name] = {"experts": int(shape[0]), "axis": 0}
    for op in ops:
        if op.kind == "parameter" and op.name not in found:
            match = _EXPERT_INDEX.search(op.name.removeprefix("param:"))
            if match:
                found[op.name] = {"expert": int(match.group(1))}
    return found


def expert_meta(graph: OpGraph) -> dict[str, Any]:
    """``{"expert_params": expert_parameters(graph)}`` for a graph with experts, else
    ``{}``: what capture merges into the graph's ``meta``."""
    experts = expert_parameters(graph)
    return {"expert_params": experts} if experts else {}
