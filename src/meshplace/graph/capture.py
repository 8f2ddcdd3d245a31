"""Capture a PyTorch model's training (or inference) step as an :class:`OpGraph`.

The whole step — forward, backward and optimizer update — is traced at aten granularity
with ``make_fx`` on *fake* tensors, so shapes and dtypes are exact but no memory is allocated
(a 5-billion-parameter Transformer captures in seconds on a laptop). Three things are
recorded on every op while tracing:

* its **phase**, from ``torch.fx.traceback.annotate`` around the forward call, the
  ``torch.autograd.grad`` call and the optimizer update;
* its **module path**, from global forward pre/post hooks that annotate while a submodule
  of the model runs;
* for a backward op, the **forward op** it differentiates: a dispatch mode reads the
  autograd node being executed (``torch._C._current_autograd_node()``) and its sequence
  number, which equals the ``seq_nr`` make_fx stamped on the forward op that created it.

View and aliasing ops (``view``, ``t``, ``expand``, ``detach``, tuple indexing…) cost nothing
and move nothing, so they are folded away: a consumer of a view gets an edge from the op
that produced the underlying tensor, carrying the bytes of the view it actually reads.
Parameters, buffers and inputs become ``parameter``/``buffer``/``input`` ops that own their
bytes; the optimizer state (Adam's two moments, or momentum) is owned by the parameter op.

What training runs use is captured as it runs (``docs/architecture.md``, "Capture"):
keyword inputs and Hugging Face output objects with a ``loss`` (an output without one is
refused); activation checkpointing, both ``torch.utils.checkpoint`` variants, with the
recomputed forward ops in backward (``meta['recomputed']``); ``dtype`` casts and
``autocast``; attention with dropout as the fused kernel; ``torch.compile``d modules
through their original module.

Example
-------
>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
>>> g = capture(model, (torch.randn(4, 8),), training=True)
>>> sorted(g.count_by("phase"))
['backward', 'forward', 'update']
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from meshplace.errors import InputError
from meshplace.graph.decompositions import capture_kernels, expert_meta
from meshplace.graph.flops import flop_count, op_kind
from meshplace.graph.ir import Op, OpGraph
from meshplace.graph.opdims import alias_map, compose, op_einsum

OPTIMIZERS = ("adam", "momentum", "sgd")
_STATE_TENSORS = {"adam": 2, "momentum": 1, "sgd": 0}


class CaptureError(InputError):
    """The model cannot be captured (data-dependent control flow, unsupported op, bad input)."""


# Aliasing ops that neither compute nor move data; consumers read the producer directly.
_ALIAS_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "alias",
    "detach",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "narrow",
    "as_strided",
    "unfold",
    "diagonal",
    "view_as",
    "expand_as",
    "unbind",
    "split",
    "split_with_sizes",
    "chunk",
    "numpy_T",
    "lift_fresh",
    "_conj",
    "_neg_view",
    "real",
    "imag",
    "view_as_real",
    "view_as_complex",
}


def _packet_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def is_alias(target: Any) -> bool:
    """Whether aten op ``target`` makes no kernel: a view (every output aliases an input,
    nothing written in place) or one of the alias-like ops capture leaves out."""
    if target is operator.getitem:
        return True
    name = _packet_name(target)
    if name in _ALIAS_OPS:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    # A view: every tensor output aliases an input and nothing is written in place.
    returns = schema.returns
    if any(r.alias_info is None or r.alias_info.is_write for r in returns):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _outputs(value: Any) -> list[Any]:
    """An op's outputs in order, ``None`` kept where an output is not a tensor."""
    if isinstance(value, list | tuple):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    return [value] if isinstance(value, torch.Tensor) else []


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _BackwardTagger(TorchDispatchMode):
    """Stamps every op run by the autograd engine with the sequence number and name of the
    autograd node being executed, which identifies the forward op it differentiates.

    While ``backward`` is set (the gradient computation of the step), an op the engine
    runs with grad mode *on* is a recomputation: the autograd engine runs gradient formulas
    with grad mode off (``create_graph=False``), and both activation-checkpointing
    variants re-run the checkpointed forward under ``torch.enable_grad()``
    (``torch/utils/checkpoint.py``: the non-reentrant unpack hook and
    ``CheckpointFunction.backward``). Such ops are annotated ``recompute``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is None:  # not run by the autograd engine (the loss's seed gradient too)
            return func(*args, **(kwargs or {}))
        recompute = self.backward and torch.is_grad_enabled()
        tags = {"bwd_of": node._sequence_nr(), "bwd_node": node.name(), "recompute": recompute}
        with fx_traceback.annotate(tags):
            return func(*args, **(kwargs or {}))


_sdpa_lock = threading.Lock()
_sdpa_users = 0
_sdpa_original: Any = None
_sdpa_local = threading.local()  # .active: the _FusedAttention blocks of this thread


def _sdpa_fused(*args: Any, **kwargs: Any) -> Any:
    """``scaled_dot_product_attention`` with ``dropout_p`` set to 0 while this thread
    captures (:class:`_FusedAttention`); PyTorch's function unchanged otherwise."""
    active = getattr(_sdpa_local, "active", None)
    if active:
        if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
            if args[4]:
                args = (*args[:4], 0.0, *args[5:])
                active[-1].calls += 1
        elif kwargs.get("dropout_p"):
            kwargs["dropout_p"] = 0.0
            active[-1].calls += 1
    return _sdpa_original(*args, **kwargs)


class _FusedAttention:
    """Captures ``scaled_dot_product_attention`` with dropout as the fused kernel.

    On CPU fake tensors PyTorch has no fused attention kernel with dropout, so SDPA with
    ``dropout_p > 0`` falls back to its math path: two batched matmuls, a softmax and a
    dropout over the full (seq × seq) score matrix, written to memory — not what a GPU
    runs (FlashAttention and the memory-efficient kernel apply dropout inside the kernel,
    Dao et al. 2022). While this block is active, ``torch.nn.functional.
    scaled_dot_product_attention`` is called with ``dropout_p=0``, so the fused op (kind
    ``attention``) is captured; the in-kernel dropout's few operations per score are not
    costed. ``calls`` counts the calls it changed.

    The function is replaced in ``torch.nn.functional`` (re-entrant and thread-safe, only
    this thread's calls change) rather than intercepted by a ``TorchFunctionMode``, because
    function modes are not active inside the autograd engine, where activation
    checkpointing recomputes the forward: a recomputation without the change would differ
    from the forward (and checkpointing refuses that). Code that bound the function
    before the capture (``from torch.nn.functional import scaled_dot_product_attention``)
    keeps the CPU fallback.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> _FusedAttention:
        global _sdpa_users, _sdpa_original
        with _sdpa_lock:
            if _sdpa_users == 0:
                _sdpa_original = torch.nn.functional.scaled_dot_product_attention
                torch.nn.functional.scaled_dot_product_attention = _sdpa_fused
            _sdpa_users += 1
        if not hasattr(_sdpa_local, "active"):
            _sdpa_local.active = []
        _sdpa_local.active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        global _sdpa_users
        _sdpa_local.active.remove(self)
        with _sdpa_lock:
            _sdpa_users -= 1
            if _sdpa_users == 0:
                torch.nn.functional.scaled_dot_product_attention = _sdpa_original


class _ModulePaths:
    """Global forward hooks that annotate ops with the path of the module running them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.paths = {id(m): name for name, m in model.named_modules()}
        self.stack: list[Any] = []
        self.handles: list[Any] = []

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            ctx = fx_traceback.annotate({"module": path})
            ctx.__enter__()
            self.stack.append(ctx)

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.paths and self.stack:
            self.stack.pop().__exit__(None, None, None)

    def __enter__(self) -> _ModulePaths:
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._pre),
            # always_call: a forward that raises still leaves its module (non-reentrant
            # checkpointing stops a recomputation early by raising inside the module)
            hooks.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        while self.stack:
            self.stack.pop().__exit__(None, None, None)


def _overwrites(value: str) -> contextlib.AbstractContextManager:
    """Marks the ops making a parameter's new weight (``value="weight"``) or optimizer
    state (``"state0"``...): ``optimizer.step()`` writes the last of them over the old
    value in place (``graph.meta["in_place_updates"]``, for memory liveness)."""
    return fx_traceback.annotate({"overwrites": value})


def _optimizer_update(
    optimizer: str, p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor]
) -> torch.Tensor:
    """One optimizer step for one parameter, written out so every op is traced.

    Adam (Kingma & Ba 2015) with its bias corrections folded into the step size; momentum
    SGD (Polyak); plain SGD. Learning rates are placeholders: only the ops matter here.
    """
    if optimizer == "adam":
        m, v = state
        m = m.mul(0.9)
        with _overwrites("state0"):
            m = m.add(g, alpha=0.1)
        v = v.mul(0.999)
        with _overwrites("state1"):
            v = v.addcmul(g, g, value=0.001)
        denominator = v.sqrt().add(1e-8)
        with _overwrites("weight"):
            return p.addcdiv(m, denominator, value=-1e-3)
    if optimizer == "momentum":
        (buf,) = state
        buf = buf.mul(0.9)
        with _overwrites("state0"):
            buf = buf.add(g)
        with _overwrites("weight"):
            return p.add(buf, alpha=-1e-2)
    with _overwrites("weight"):
        return p.add(g, alpha=-1e-2)


_NO_LOSS = (
    "pass labels with the inputs (for a Hugging Face model, labels=... in the keyword inputs "
    "build() returns as (model, args, kwargs)), return a loss from forward, or give "
    "capture() a loss_fn"
)


def _loss_attribute(out: Any) -> tuple[bool, Any]:
    """``(has a loss slot, its value)`` for a mapping or an output object (Hugging Face
    ``ModelOutput`` is both: an ordered dict whose ``loss`` attribute is None, and no key,
    without labels)."""
    if hasattr(out, "loss"):
        return True, out.loss
    if isinstance(out, Mapping):
        return "loss" in out, out.get("loss")
    return False, None


def as_loss(out: Any, loss_fn: Callable[[Any], Any] | None = None) -> tuple[torch.Tensor, str]:
    """The scalar to differentiate and how it was chosen (``graph.meta['loss']``).

    * ``loss_fn`` given: ``loss_fn(out)`` (``"loss_fn"``);
    * a mapping or output object with a ``loss`` (Hugging Face ``ModelOutput``): that loss
      (``"output.loss"``); one whose loss is missing or None is refused — it has logits but
      no loss, and a step without its loss op (a 50k-vocabulary cross-entropy for a
      language model) is mis-costed;
    * a tensor, or a tuple/list whose first floating-point tensor is taken: a 0-dim tensor
      is the loss (``"output"``); a larger one is reduced by its mean (``"mean"``), a
      stand-in loss of a few FLOPs per element that the graph's ``meta['notes']`` states —
      the reference workloads return 0-dim losses, a plain ``nn.Sequential`` does not.

    A loss with more than one element (a per-sample loss) is reduced by its mean.
    """
    if loss_fn is not None:
        loss, how = loss_fn(out), "loss_fn"
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise CaptureError(
                f"loss_fn returned a {type(loss).__name__}; it must return a floating-point "
                "tensor (the loss)"
            )
    elif not isinstance(out, torch.Tensor | tuple | list):
        has, loss = _loss_attribute(out)
        what = type(out).__name__
        if not has or loss is None:
            state = "has loss None" if has else "has no loss"
            raise CaptureError(
                f"the model's output ({what}) {state}, so a training step has nothing to "
                f"differentiate; {_NO_LOSS}"
            )
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise CaptureError(
                f"the model's {what}.loss is a {type(loss).__name__}, not a floating-point tensor"
            )
        how = "output.loss"
    else:
        tensors = [t for t in _tensors(out) if t.is_floating_point()]
        if not tensors:
            raise CaptureError(
                "the model's output has no floating-point tensor to differentiate; "
                "return a loss (or pass training=False)"
            )
        loss = tensors[0]
        how = "output" if loss.dim() == 0 else "mean"
    return (loss if loss.dim() == 0 else loss.float().mean()), how


def _named_dims(shape: Sequence[int], dims: dict[str, int]) -> list[str | None]:
    names: list[str | None] = []
    for axis, size in enumerate(shape):
        matches = [n for n, v in dims.items() if v == size]
        if len(matches) == 1:
            names.append(matches[0])
        elif "batch" in matches and axis == 0:
            names.append("batch")
        else:
            names.append(None)
    return names


def _user_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame outside torch and meshplace, if any."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        path = fr.filename.replace("\\", "/")
        if "/torch/" not in path and "/meshplace/graph/" not in path and "<" not in path:
            return f" at {fr.filename}:{fr.lineno} ({(fr.line or '').strip()})"
    return ""


def _describe_failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    name = type(exc).__name__
    if "DataDependent" in name or "data-dependent" in str(exc) or "GuardOnDataDependent" in name:
        construct = "data-dependent control flow or .item() on a tensor value"
    elif "Unsupported" in name or "NotImplemented" in name:
        construct = "an operator without a shape (fake/meta) implementation"
    else:
        construct = f"{name}"
    return f"cannot capture the model: {construct}{_user_frame(exc)}: {first[:300]}"


#: ``--dtype``/``--autocast`` names → torch dtypes (what capture casts to).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
_DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16``; None stays None.

    Raises:
        CaptureError: a name that is not one of :data:`DTYPES` (or their long names).
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in DTYPES.values():
            raise CaptureError(f"{what} {value} is not one of {', '.join(DTYPES)}")
        return value
    key = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if key not in DTYPES:
        raise CaptureError(f"unknown {what} {value!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[key]


def capture(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    training: bool = True,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    optimizer: str = "adam",
    dims: dict[str, int] | None = None,
    meta: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    dtype: str | torch.dtype | None = None,
    autocast: str | torch.dtype | None = None,
    fused_attention: bool = True,
) -> OpGraph:
    """Capture ``module(*example_inputs, **example_kwargs)`` as an OpGraph of one step.

    Args:
        module: any ``torch.nn.Module`` whose forward make_fx can trace; its parameters may
            live on the meta device (nothing is allocated either way). A ``torch.compile``d
            module is captured through its original module (``_orig_mod``), with a note.
        example_inputs: positional inputs; tensors only set shapes and dtypes. Nested
            tuples, lists and dicts of tensors are fine; a dict alone (with no
            ``example_kwargs``) is taken as the keyword inputs.
        training: capture forward, backward and optimizer update (see ``loss_fn`` for how
            the loss is chosen); ``False`` captures the inference forward pass under
            ``eval()`` and ``no_grad``.
        example_kwargs: keyword inputs (``input_ids=..., labels=...`` for a Hugging Face
            model).
        name: graph name (default: the module's class name).
        optimizer: ``adam`` (default), ``momentum`` or ``sgd`` — which update ops to emit and
            how much optimizer state each parameter owns.
        dims: named dimension sizes (``{"batch": 64, "seq": 128}``); output dimensions whose
            size matches exactly one name are labelled with it.
        meta: extra entries for the graph's ``meta`` dict.
        loss_fn: ``loss_fn(output) -> loss``. Without it the loss is the output's ``loss``
            (an output object or dict without one is an error), a 0-dim output itself, or —
            for a larger tensor output — its mean, a stand-in noted in ``meta['notes']``
            (:func:`as_loss`).
        dtype: cast floating-point parameters, buffers and inputs to this dtype (``bf16``,
            ``fp16``, ``fp32``) before capture, as ``model.to(dtype)`` would; None keeps the
            dtypes the model was built with. Optimizer state has the parameters' dtype.
        autocast: run the forward under ``torch.autocast("cpu", dtype=autocast)`` (``bf16``
            or ``fp16``): matmuls, convolutions and attention run — and are costed — in that
            dtype, losses in fp32, other ops in their inputs' dtype (PyTorch's CPU
            autocast lists; CUDA's also keep softmax and layer norm in fp32).
        fused_attention: capture ``scaled_dot_product_attention`` with dropout as the fused
            kernel a GPU runs, not the CPU math fallback (:class:`_FusedAttention`).

    Returns:
        The OpGraph, ops in execution order. Cost: one trace, O(ops). Activation
        checkpointing (``torch.utils.checkpoint``, either variant) is captured with its
        recomputation: the ops it re-runs during backward are backward-phase ops listed in
        ``meta['recomputed']``.

    Raises:
        CaptureError: one sentence naming the construct that could not be traced.
    """
    return capture_step(
        module,
        example_inputs,
        training,
        example_kwargs=example_kwargs,
        name=name,
        optimizer=optimizer,
        dims=dims,
        meta=meta,
        loss_fn=loss_fn,
        dtype=dtype,
        autocast=autocast,
        fused_attention=fused_attention,
    ).graph


@dataclass
class CapturedStep:
    """A capture that keeps the executable trace: what the runtime needs to run a plan.

    Attributes:
        graph: the OpGraph (identical to :func:`capture`'s).
        gm: the traced fx GraphModule; its placeholders are (parameters, buffers, optimizer
            state, inputs), flattened in that order — the inputs as the leaves of
            ``(example_inputs, example_kwargs)`` (for positional tensors alone: the inputs
            in order).
        node_op: fx node name → index of the OpGraph op that owns it (views and tuple
            indexing map to the op that produced the tensor they alias).
        param_names, buffer_names: names in placeholder order; ``n_state`` optimizer state
            tensors per parameter.
        input_names: one name per input placeholder (``x``, ``input_ids``, ``batch.0``).
    """

    graph: OpGraph
    gm: torch.fx.GraphModule
    node_op: dict[str, int]
    param_names: list[str]
    buffer_names: list[str]
    n_state: int
    input_names: list[str] = field(default_factory=list)


def _unwrap_compiled(module: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``) and a note, or
    ``module`` itself. make_fx cannot trace a dynamo-optimized module; the original module
    runs the same computation (what inductor fuses is not modelled either way)."""
    orig = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(orig, torch.nn.Module):
        note = (
            f"{type(orig).__name__} is torch.compile'd; captured its original module "
            "(_orig_mod): ops are costed unfused, as eager PyTorch runs them"
        )
        return orig, [note]
    return module, []


def capture_step(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    training: bool = True,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    optimizer: str = "adam",
    dims: dict[str, int] | None = None,
    meta: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    dtype: str | torch.dtype | None = None,
    autocast: str | torch.dtype | None = None,
    fused_attention: bool = True,
) -> CapturedStep:
    """:func:`capture`, also returning the fx trace and which op owns each fx node."""
    if optimizer not in OPTIMIZERS:
        raise CaptureError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    if not isinstance(module, torch.nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(module).__name__}")
    if isinstance(example_inputs, Mapping) and example_kwargs is None:
        example_inputs, example_kwargs = (), example_inputs  # {"input_ids": ...}: keywords
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise CaptureError(
            f"keyword inputs must be a dict of name → value, got {type(example_kwargs).__name__}"
        )
    options = _Options(
        training=training,
        optimizer=optimizer,
        loss_fn=loss_fn,
        dtype=parse_dtype(dtype),
        autocast=parse_dtype(autocast, "autocast dtype"),
        fused_attention=fused_attention,
    )
    if options.autocast is torch.float32:
        raise CaptureError("autocast to fp32 changes nothing; give bf16 or fp16")
    module, notes = _unwrap_compiled(module)
    was_training = module.training
    module.train(training)
    try:
        return _capture(
            module,
            tuple(example_inputs),
            dict(example_kwargs or {}),
            options,
            name,
            dict(dims or {}),
            meta,
            notes,
        )
    finally:
        module.train(was_training)


@dataclass
class _Options:
    """What one capture does (see :func:`capture`'s arguments)."""

    training: bool
    optimizer: str
    loss_fn: Callable[[Any], torch.Tensor] | None
    dtype: torch.dtype | None
    autocast: torch.dtype | None
    fused_attention: bool


class _Step(torch.nn.Module):
    """Runs one step of ``model`` as its own forward, so that ``functional_call`` keeps the
    fake parameters in the model for the whole step — forward *and* backward.

    Activation checkpointing re-runs forward code during backward; if the model's own
    (real or meta) ``Parameter`` objects were back in place by then, as after a
    ``functional_call`` of the forward alone, the recomputation would read them and fake
    tensors would refuse the mix ("Please convert all Tensors to FakeTensors first").
    """

    def __init__(self, model: torch.nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


def _uses_reentrant_checkpoint(loss: torch.Tensor) -> bool:
    """Whether the autograd graph behind ``loss`` holds a reentrant checkpoint node
    (``CheckpointFunctionBackward``), which refuses ``torch.autograd.grad``. O(nodes)."""
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CheckpointFunction" in node.name():
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _capture(
    module: torch.nn.Module,
    example_inputs: tuple,
    example_kwargs: dict[str, Any],
    opts: _Options,
    name: str | None,
    dims: dict[str, int],
    meta: dict[str, Any] | None,
    notes: list[str],
) -> CapturedStep:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    training, optimizer = opts.training, opts.optimizer
    all_params = list(module.named_parameters())
    trainable_names = [n for n, p in all_params if p.requires_grad and training]
    n_state = _STATE_TENSORS[optimizer] if training else 0
    if training and not trainable_names:
        raise CaptureError(
            f"{type(module).__name__} has no trainable parameters, so a training step has "
            "nothing to update; capture it with training=False (--inference)"
        )

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(t: Any, grad: bool = False) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dtype = opts.dtype if opts.dtype is not None and t.is_floating_point() else t.dtype
        with fake_mode:
            out = torch.empty(tuple(t.shape), dtype=dtype, device="cpu")
        return out.requires_grad_(grad) if grad else out

    # Parameters, buffers and inputs become fake CPU tensors (cast to ``dtype`` if given);
    # the converter reads shapes, dtypes and bytes from these, not from the model.
    trainable = [(n, fake(p, grad=True)) for n, p in all_params if n in set(trainable_names)]
    frozen = [(n, fake(p)) for n, p in all_params if n not in set(trainable_names)]
    buffers = [(n, fake(b)) for n, b in module.named_buffers()] + frozen
    f_params = [t for _, t in trainable]
    f_buffers = [t for _, t in buffers]
    f_states = [fake(t) for t in f_params for _ in range(n_state)]
    leaves, spec = tree_flatten((example_inputs, example_kwargs))
    f_inputs = [fake(x) for x in leaves]
    param_names = [n for n, _ in trainable]
    buffer_names = [n for n, _ in buffers]
    tagger = _BackwardTagger()
    attention = _FusedAttention() if opts.fused_attention else None
    found: dict[str, Any] = {}

    def run_forward(inputs: list) -> Any:
        """The model's forward on the (unflattened) inputs, under autocast if asked."""
        args, kwargs = tree_unflatten(list(inputs), spec)
        with contextlib.ExitStack() as stack:
            if opts.autocast is not None:
                stack.enter_context(torch.autocast("cpu", dtype=opts.autocast))
            return module(*args, **kwargs)

    def train_step(inputs: list, params: list) -> tuple[Any, list]:
        with tagger:
            with fx_traceback.annotate({"phase": "forward"}):
                loss, found["loss"] = as_loss(run_forward(inputs), opts.loss_fn)
            reentrant = _uses_reentrant_checkpoint(loss)
            tagger.backward = True
            try:
                with fx_traceback.annotate({"phase": "backward"}):
                    if reentrant:  # CheckpointFunction refuses autograd.grad; accumulate
                        loss.backward()
                        grads = [p.grad for p in params]
                    else:
                        grads = torch.autograd.grad(loss, params, allow_unused=True)
            finally:
                tagger.backward = False
        found["reentrant"] = reentrant
        return loss, list(grads)

    def step(params: list, bufs: list, states: list, inputs: list) -> Any:
        tensors = {**dict(zip(param_names, params)), **dict(zip(buffer_names, bufs))}
        if not training:
            with torch.no_grad(), fx_traceback.annotate({"phase": "forward"}):
                return functional_call(
                    _Step(module, run_forward), _prefixed(tensors), (inputs,), strict=False
                )
        loss, grads = functional_call(
            _Step(module, train_step), _prefixed(tensors), (inputs, params), strict=False
        )
        new_params = []
        for i, (pname, p, g) in enumerate(zip(param_names, params, grads)):
            if g is None:
                continue
            state = states[i * n_state : (i + 1) * n_state]
            with fx_traceback.annotate({"phase": "update", "param": pname}):
                new_params.append(_optimizer_update(optimizer, p.detach(), g, state))
        return loss, new_params

    try:
        with (
            fx_traceback.preserve_node_meta(),
            _ModulePaths(module),
            capture_kernels(),
            attention or contextlib.nullcontext(),
        ):
            gm = make_fx(step, tracing_mode="fake")(f_params, f_buffers, f_states, f_inputs)
    except InputError:
        raise
    except Exception as exc:  # any tracing failure becomes one sentence, not a traceback
        raise CaptureError(_describe_failure(exc)) from None

    input_names = _input_names(module, example_inputs, example_kwargs)
    graph_meta: dict[str, Any] = {
        "training": training,
        "optimizer": optimizer if training else None,
        "params": int(sum(p.numel() for _, p in all_params if p.requires_grad)),
        "dims": dims,
        "dtype": _dtype_name(opts.dtype) if opts.dtype is not None else None,
        "autocast": _dtype_name(opts.autocast) if opts.autocast is not None else None,
        **(meta or {}),
    }
    if training:
        graph_meta["loss"] = found.get("loss")
        if found.get("loss") == "mean":
            notes.append(
                f"{type(module).__name__} returns a tensor, not a loss: the step "
                "differentiates its mean, a stand-in with no loss op (return the loss, or "
                "pass labels, to cost the real one)"
            )
    if attention is not None and attention.calls:
        graph_meta["fused_attention_dropout"] = attention.calls
    graph = OpGraph(name or type(module).__name__, meta=graph_meta)
    converter = _Converter(graph, dims, n_state)
    converter.run(
        gm,
        trainable,
        buffers,
        len(f_inputs),
        input_names,
        frozen_names={n for n, _ in frozen},
    )
    graph.meta.update(expert_meta(graph))  # stacked/listed MoE experts, for sharding
    if converter.overwrites:
        graph.meta["in_place_updates"] = sorted(converter.overwrites.values())
    if converter.recomputed:
        graph.meta["recomputed"] = converter.recomputed
        graph.meta["checkpoint"] = "reentrant" if found.get("reentrant") else "non-reentrant"
    if notes:
        graph.meta["notes"] = [*graph.meta.get("notes", []), *notes]
    node_op = {n.name: idx for n, (idx, _) in converter.source.items()}
    for node in gm.graph.nodes:  # aliases of non-tensors: follow their first input
        if node.op == "call_function" and node.name not in node_op:
            first = next(
                (
                    a
                    for a in tree_flatten((node.args, node.kwargs))[0]
                    if isinstance(a, torch.fx.Node)
                ),
                None,
            )
            if first is not None and first.name in node_op:
                node_op[node.name] = node_op[first.name]
    return CapturedStep(
        graph, gm, node_op, param_names, [n for n, _ in buffers], n_state, input_names
    )


def _prefixed(tensors: dict[str, Any]) -> dict[str, Any]:
    """Parameter and buffer names as seen from :class:`_Step` (the model is ``model``)."""
    return {f"model.{k}": v for k, v in tensors.items()}


def _input_names(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """One name per leaf of ``(args, kwargs)``: a positional input takes its parameter
    name in ``forward``'s signature (or its position), a keyword input its key, and a leaf
    inside a nested input adds its path (``batch.0``, ``inputs.mask``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        keys = [getattr(k, "idx", getattr(k, "key", getattr(k, "name", "?"))) for k in path]
        top, rest = keys[1], keys[2:]
        if keys[0] == 0:
            top = positional[top] if isinstance(top, int) and top < len(positional) else top
        names.append(".".join(str(k) for k in (top, *rest)))
    return names


class _Converter:
    """Turns the traced fx graph into OpGraph ops and edges (one pass, O(nodes + args))."""

    def __init__(self, graph: OpGraph, dims: dict[str, int], n_state: int) -> None:
        self.graph = graph
        self.dims = dims
        self.n_state = n_state
        # fx node -> (index of the op that produced it, bytes it carries)
        self.source: dict[torch.fx.Node, tuple[int, int]] = {}
        # fx node -> which output of its producer it is and the dimension map into it
        # (meshplace.graph.opdims); a tuple-valued node holds one such pair per element
        self.where: dict[torch.fx.Node, Any] = {}
        self.forward_by_seq: dict[int, list[tuple[torch.fx.Node, int]]] = {}
        self.pending_links: list[tuple[int, int, str]] = []
        self.op_phase: list[str] = []
        # activation checkpointing: forward ops by (module, target, shapes), in order, and
        # the recomputed ops (backward phase) with the forward op each one re-runs
        self.forward_by_key: dict[tuple, list[int]] = {}
        self.key_cursor: dict[tuple, int] = {}
        self.recompute_of: dict[int, int | None] = {}
        self.recompute_by_seq: dict[int, list[tuple[torch.fx.Node, int]]] = {}
        #: recomputed op name -> name of the forward op it recomputes (None: not found)
        self.recomputed: dict[str, str | None] = {}
        #: (parameter, "weight" | "state<k>") -> the op writing its new value in place
        self.overwrites: dict[tuple[str, str], str] = {}

    def _locate(self, node: torch.fx.Node, val: Any) -> None:
        """Record that ``node`` is its op's own output(s), dimensions unchanged."""
        if isinstance(val, torch.Tensor):
            self.where[node] = (0, list(range(val.dim())))
        elif isinstance(val, list | tuple):
            k, parts = 0, []
            for v in val:
                if isinstance(v, torch.Tensor):
                    parts.append((k, list(range(v.dim()))))
                    k += 1
                else:
                    parts.append(None)
            self.where[node] = parts

    def _locate_alias(self, node: torch.fx.Node, src_node: torch.fx.Node, val: Any) -> None:
        """Where an alias of ``src_node`` sits in its producer's outputs, and its map."""
        parent = self.where.get(src_node)
        if parent is None:
            return
        if node.target is operator.getitem:
            k = node.args[1] if len(node.args) > 1 else None
            if (
                isinstance(parent, list)
                and isinstance(k, int)
                and 0 <= k < len(parent)
                and parent[k] is not None
            ):
                self.where[node] = parent[k]
            return
        if isinstance(parent, list):
            return
        src_val = src_node.meta.get("val")
        if not isinstance(src_val, torch.Tensor):
            return
        outs = [list(t.shape) for t in _tensors(val)]
        rest = [a for a in node.args[1:]]
        try:
            maps = alias_map(_packet_name(node.target), rest, list(src_val.shape), outs)
        except (IndexError, TypeError, ValueError):
            maps = [[-1] * len(o) for o in outs]
        out_idx, parent_map = parent
        if isinstance(val, torch.Tensor):
            self.where[node] = (out_idx, compose(maps[0], parent_map))
        else:
            self.where[node] = [(out_idx, compose(m, parent_map)) for m in maps]

    def _operands(self, node: torch.fx.Node) -> tuple[list[dict], list[Any], list[Any]]:
        """Operand records (see ``Op.operands``), the op's arguments with tensors
        replaced by shapes, and the shapes of its tensor arguments for
        :func:`meshplace.graph.opdims.op_einsum` (positional, lists spliced, then keyword
        tensors)."""
        records: list[dict] = []
        shapes: list[Any] = []

        def visit(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                v = a.meta.get("val")
                if not isinstance(v, torch.Tensor):
                    shapes.append(None)
                    return None
                shape = list(v.shape)
                shapes.append(shape)
                loc = self.where.get(a)
                if a in self.source and isinstance(loc, tuple):
                    src = self.graph.ops[self.source[a][0]].name
                    records.append({"op": src, "out": loc[0], "shape": shape, "map": loc[1]})
                return shape
            if isinstance(a, list | tuple) and any(isinstance(x, torch.fx.Node) for x in a):
                return [visit(x) for x in a]
            shapes.append(None)
            return a

        args = [visit(a) for a in node.args]
        for v in node.kwargs.values():
            if isinstance(v, torch.fx.Node):
                visit(v)
        return records, args, shapes

    def _add(self, op: Op) -> int:
        idx = self.graph.add_op(op)
        self.op_phase.append(op.phase)
        return idx

    def _tensor_op(self, name: str, kind: str, t: torch.Tensor, module: str = "", **kw: Any) -> Op:
        shape = list(t.shape)
        return Op(
            name=name,
            kind=kind,
            phase="forward",
            module=module,
            output_shapes=[shape],
            output_dtypes=[_dtype_name(t.dtype)],
            dim_names=[_named_dims(shape, self.dims)] if self.dims else None,
            bytes_written=0.0,
            **kw,
        )

    def run(
        self,
        gm: torch.fx.GraphModule,
        trainable: list[tuple[str, torch.Tensor]],
        buffers: list[tuple[str, torch.Tensor]],
        n_inputs: int,
        input_names: list[str],
        frozen_names: set[str],
    ) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        n_params, n_bufs = len(trainable), len(buffers)
        n_states = n_params * self.n_state
        expected = n_params + n_bufs + n_states + n_inputs
        if len(placeholders) != expected:  # pragma: no cover - guards a make_fx change
            raise CaptureError(
                f"internal: traced {len(placeholders)} inputs but expected {expected}"
            )
        param_ops: list[int] = []
        for (pname, p), node in zip(trainable, placeholders[:n_params]):
            nbytes = _nbytes(p)
            op = self._tensor_op(
                f"param:{pname}",
                "parameter",
                p,
                module=pname.rpartition(".")[0],
                param_bytes=nbytes,
                state_bytes=nbytes * self.n_state,
                colocation=f"param:{pname}",
            )
            idx = self._add(op)
            param_ops.append(idx)
            self.source[node] = (idx, nbytes)
            self._locate(node, node.meta.get("val"))
        for (bname, b), node in zip(buffers, placeholders[n_params : n_params + n_bufs]):
            kind = "parameter" if bname in frozen_names else "buffer"
            op = self._tensor_op(
                f"buffer:{bname}" if kind == "buffer" else f"param:{bname}",
                kind,
                b,
                module=bname.rpartition(".")[0],
                param_bytes=_nbytes(b),
            )
            self.source[node] = (self._add(op), _nbytes(b))
            self._locate(node, node.meta.get("val"))
        state_nodes = placeholders[n_params + n_bufs : n_params + n_bufs + n_states]
        for k, node in enumerate(state_nodes):
            owner = param_ops[k // self.n_state]
            self.source[node] = (owner, _nbytes(node.meta["val"]))
            self._locate(node, node.meta.get("val"))
        for i, node in enumerate(placeholders[n_params + n_bufs + n_states :]):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                op = self._tensor_op(f"input:{input_names[i]}", "input", val)
                self.source[node] = (self._add(op), _nbytes(val))
                self._locate(node, val)

        for node in gm.graph.nodes:
            if node.op == "call_function":
                self._call(node)
        self._link_backward()

    # -------------------------------------------------------------- op nodes
    def _call(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if is_alias(node.target):
            src_node = node.args[0] if node.args else None
            if isinstance(src_node, torch.fx.Node) and src_node in self.source:
                src, src_bytes = self.source[src_node]
                own = _tensors(val)
                nbytes = _nbytes(own[0]) if len(own) == 1 else src_bytes
                self.source[node] = (src, min(nbytes, src_bytes) if src_bytes else nbytes)
                self._locate_alias(node, src_node, val)
            return

        custom = node.meta.get("custom") or {}
        pname = _packet_name(node.target)
        outs = _tensors(val)
        inputs: dict[torch.fx.Node, None] = {}
        for arg in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(arg, torch.fx.Node) and arg in self.source:
                inputs[arg] = None
        in_shapes: list[list[int] | None] = []
        for arg in node.args:
            v = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            in_shapes.append(list(v.shape) if isinstance(v, torch.Tensor) else None)
        out_shapes = [list(t.shape) for t in outs]

        phase = custom.get("phase")
        if phase is None:  # e.g. gradient accumulation: inherit the latest input phase
            order = {"forward": 0, "backward": 1, "update": 2}
            phases = [self.op_phase[self.source[a][0]] for a in inputs]
            phase = max(phases, key=order.__getitem__) if phases else "forward"
        module = custom.get("module", "")
        param = custom.get("param")
        if param is not None:
            module = param.rpartition(".")[0]
        try:
            flops = flop_count(pname, in_shapes, out_shapes, node.args, dict(node.kwargs))
        except (IndexError, TypeError, AssertionError):
            flops = float(sum(math.prod(s) for s in out_shapes))
        operands, shaped_args, arg_shapes = self._operands(node)
        tags = getattr(node.target, "tags", ())
        notation = op_einsum(
            pname,
            shaped_args,
            arg_shapes,
            [list(t.shape) if isinstance(t, torch.Tensor) else None for t in _outputs(val)],
            pointwise=torch.Tag.pointwise in tags,
        )
        if notation is not None:
            try:
                notation.check_shapes([r["shape"] for r in operands], out_shapes)
            except InputError:
                notation = None
        op = Op(
            name=node.name,
            kind=op_kind(pname),
            phase=phase,
            module=module,
            target=str(node.target),
            output_shapes=out_shapes,
            output_dtypes=[_dtype_name(t.dtype) for t in outs],
            dim_names=[_named_dims(s, self.dims) for s in out_shapes] if self.dims else None,
            flops=flops,
            bytes_read=float(sum(self.source[a][1] for a in inputs)),
            bytes_written=float(sum(_nbytes(t) for t in outs)),
            colocation=f"param:{param}" if param is not None else None,
            einsum=str(notation) if notation is not None else None,
            operands=operands or None,
        )
        idx = self._add(op)
        if param is not None and "overwrites" in custom:  # the last op marked is the write
            self.overwrites[(param, custom["overwrites"])] = op.name
        self._locate(node, val)
        for a in inputs:
            src, nbytes = self.source[a]
            self.graph.add_edge(src, idx, nbytes)
        self.source[node] = (idx, int(op.bytes_written))
        key = (module, op.target, tuple(map(tuple, out_shapes)))
        if phase == "forward":
            if "seq_nr" in node.meta:
                self.forward_by_seq.setdefault(node.meta["seq_nr"], []).append((node, idx))
            self.forward_by_key.setdefault(key, []).append(idx)
        elif phase == "backward" and custom.get("recompute"):
            self.recompute_of[idx] = self._recomputed_forward(key)
            if "seq_nr" in node.meta:
                self.recompute_by_seq.setdefault(node.meta["seq_nr"], []).append((node, idx))
        elif phase == "backward" and "bwd_of" in custom:
            self.pending_links.append((idx, custom["bwd_of"], custom.get("bwd_node", "")))

    def _recomputed_forward(self, key: tuple) -> int | None:
        """The forward op a recomputed op re-runs: the next forward op of the same module,
        target and output shapes, in execution order (recomputation replays a checkpointed
        region's ops in their forward order; a region recomputed again starts over)."""
        candidates = self.forward_by_key.get(key)
        if not candidates:
            return None
        k = self.key_cursor.get(key, 0)
        self.key_cursor[key] = k + 1
        return candidates[k % len(candidates)]

    def _link_backward(self) -> None:
        """Point each backward op at the forward op whose autograd node produced it, and
        each recomputed op at the forward op it re-runs. A gradient op of a recomputed op
        (reentrant checkpointing differentiates the recomputation) links to the forward
        op that was recomputed."""
        ops = self.graph.ops
        for idx, fwd in self.recompute_of.items():
            ops[idx].forward_op = ops[fwd].name if fwd is not None else None
            self.recomputed[ops[idx].name] = ops[idx].forward_op
        for idx, seq, node_name in self.pending_links:
            candidates = self.forward_by_seq.get(seq)
            if not candidates:
                candidates = [
                    (n, self.recompute_of[i])
                    for n, i in self.recompute_by_seq.get(seq, [])
                    if self.recompute_of[i] is not None
                ]
            if not candidates:
                continue
            wanted = node_name.split("Backward")[0].replace("_", "").lower()
            chosen = candidates[0][1]
            for fx_node, op_idx in candidates:
                if _packet_name(fx_node.target).replace("_", "").lower() == wanted:
                    chosen = op_idx
                    break
            fwd = ops[chosen]
            ops[idx].forward_op = fwd.name
            if not ops[idx].module:
                ops[idx].module = fwd.module


def capture_callable(fn: Callable[[], tuple[Any, ...]], **kwargs: Any) -> OpGraph:
    """Capture what ``fn()`` returns: ``(model, example_inputs)`` or
    ``(model, example_inputs, example_kwargs)``; ``kwargs`` go to :func:`capture`."""
    try:
        built = fn()
    except Exception as exc:  # the user's builder failed: one sentence, no traceback
        raise CaptureError(
            f"{getattr(fn, '__name__', 'the build function')}() failed with "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not (
        isinstance(built, tuple | list)
        and (len(built) == 2 or (len(built) == 3 and isinstance(built[2], Mapping)))
    ):
        raise CaptureError(
            f"{getattr(fn, '__name__', 'the function')} must return (model, example_inputs) "
            f"or (model, example_inputs, example_kwargs), got {type(built).__name__}"
        )
    model, inputs, *rest = built
    return capture(model, inputs, example_kwargs=rest[0] if rest else None, **kwargs)
