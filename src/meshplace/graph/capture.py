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

Example
-------
>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
>>> g = capture(model, (torch.randn(4, 8),), training=True)
>>> sorted(g.count_by("phase"))
['backward', 'forward', 'update']
"""

from __future__ import annotations

import inspect
import math
import operator
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshplace.errors import InputError
from meshplace.graph.decompositions import capture_kernels, expert_meta
from meshplace.graph.flops import flop_count, op_kind
from meshplace.graph.ir import Op, OpGraph

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


def _is_alias(target: Any) -> bool:
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


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _BackwardTagger(TorchDispatchMode):
    """Stamps every op run by the autograd engine with the sequence number and name of the
    autograd node being executed, which identifies the forward op it differentiates."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is None:
            return func(*args, **(kwargs or {}))
        with fx_traceback.annotate({"bwd_of": node._sequence_nr(), "bwd_node": node.name()}):
            return func(*args, **(kwargs or {}))


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
            hooks.register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        while self.stack:
            self.stack.pop().__exit__(None, None, None)


def _optimizer_update(
    optimizer: str, p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor]
) -> torch.Tensor:
    """One optimizer step for one parameter, written out so every op is traced.

    Adam (Kingma & Ba 2015) with its bias corrections folded into the step size; momentum
    SGD (Polyak); plain SGD. Learning rates are placeholders: only the ops matter here.
    """
    if optimizer == "adam":
        m, v = state
        m = m.mul(0.9).add(g, alpha=0.1)
        v = v.mul(0.999).addcmul(g, g, value=0.001)
        return p.addcdiv(m, v.sqrt().add(1e-8), value=-1e-3)
    if optimizer == "momentum":
        (buf,) = state
        buf = buf.mul(0.9).add(g)
        return p.add(buf, alpha=-1e-2)
    return p.add(g, alpha=-1e-2)


def _as_loss(out: Any) -> torch.Tensor:
    tensors = [t for t in _tensors(out) if t.is_floating_point()]
    if not tensors:
        raise CaptureError(
            "the model's output has no floating-point tensor to differentiate; "
            "return a loss (or pass training=False)"
        )
    first = tensors[0]
    return first if first.dim() == 0 else first.float().mean()


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


def capture(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    training: bool = True,
    *,
    name: str | None = None,
    optimizer: str = "adam",
    dims: dict[str, int] | None = None,
    meta: dict[str, Any] | None = None,
) -> OpGraph:
    """Capture ``module(*example_inputs)`` as an OpGraph of one step.

    Args:
        module: any ``torch.nn.Module`` whose forward make_fx can trace; its parameters may
            live on the meta device (nothing is allocated either way).
        example_inputs: positional inputs; tensors only set shapes and dtypes.
        training: capture forward, backward and optimizer update (the model should return
            a scalar loss; otherwise the mean of its first floating-point output is used);
            ``False`` captures the inference forward pass under ``eval()`` and ``no_grad``.
        name: graph name (default: the module's class name).
        optimizer: ``adam`` (default), ``momentum`` or ``sgd`` — which update ops to emit and
            how much optimizer state each parameter owns.
        dims: named dimension sizes (``{"batch": 64, "seq": 128}``); output dimensions whose
            size matches exactly one name are labelled with it.
        meta: extra entries for the graph's ``meta`` dict.

    Returns:
        The OpGraph, ops in execution order. Cost: one trace, O(ops).

    Raises:
        CaptureError: one sentence naming the construct that could not be traced.
    """
    return capture_step(
        module, example_inputs, training, name=name, optimizer=optimizer, dims=dims, meta=meta
    ).graph


@dataclass
class CapturedStep:
    """A capture that keeps the executable trace: what the runtime needs to run a plan.

    Attributes:
        graph: the OpGraph (identical to :func:`capture`'s).
        gm: the traced fx GraphModule; its placeholders are (parameters, buffers, optimizer
            state, inputs), flattened in that order.
        node_op: fx node name → index of the OpGraph op that owns it (views and tuple
            indexing map to the op that produced the tensor they alias).
        param_names, buffer_names: names in placeholder order; ``n_state`` optimizer state
            tensors per parameter.
    """

    graph: OpGraph
    gm: torch.fx.GraphModule
    node_op: dict[str, int]
    param_names: list[str]
    buffer_names: list[str]
    n_state: int


def capture_step(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    training: bool = True,
    *,
    name: str | None = None,
    optimizer: str = "adam",
    dims: dict[str, int] | None = None,
    meta: dict[str, Any] | None = None,
) -> CapturedStep:
    """:func:`capture`, also returning the fx trace and which op owns each fx node."""
    if optimizer not in OPTIMIZERS:
        raise CaptureError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    if not isinstance(module, torch.nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    was_training = module.training
    module.train(training)
    try:
        return _capture(
            module, tuple(example_inputs), training, name, optimizer, dict(dims or {}), meta
        )
    finally:
        module.train(was_training)


def _capture(
    module: torch.nn.Module,
    example_inputs: tuple,
    training: bool,
    name: str | None,
    optimizer: str,
    dims: dict[str, int],
    meta: dict[str, Any] | None,
) -> CapturedStep:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    all_params = list(module.named_parameters())
    trainable = [(n, p) for n, p in all_params if p.requires_grad and training]
    frozen = [(n, p) for n, p in all_params if not (p.requires_grad and training)]
    buffers = list(module.named_buffers()) + frozen
    n_state = _STATE_TENSORS[optimizer] if training else 0
    if training and not trainable:
        raise CaptureError(
            f"{type(module).__name__} has no trainable parameters, so a training step has "
            "nothing to update; capture it with training=False (--inference)"
        )

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(t: Any, grad: bool = False) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with fake_mode:
            out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
        return out.requires_grad_(grad) if grad else out

    f_params = [fake(p, grad=True) for _, p in trainable]
    f_buffers = [fake(b) for _, b in buffers]
    f_states = [fake(p) for _, p in trainable for _ in range(n_state)]
    f_inputs = [fake(x) for x in example_inputs]
    param_names = [n for n, _ in trainable]
    buffer_names = [n for n, _ in buffers]

    def step(params: list, bufs: list, states: list, inputs: list) -> Any:
        tensors = {**dict(zip(param_names, params)), **dict(zip(buffer_names, bufs))}
        if not training:
            with torch.no_grad(), fx_traceback.annotate({"phase": "forward"}):
                return functional_call(module, tensors, tuple(inputs), strict=False)
        with _BackwardTagger():
            with fx_traceback.annotate({"phase": "forward"}):
                loss = _as_loss(functional_call(module, tensors, tuple(inputs), strict=False))
            with fx_traceback.annotate({"phase": "backward"}):
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        new_params = []
        for i, (pname, p, g) in enumerate(zip(param_names, params, grads)):
            if g is None:
                continue
            state = states[i * n_state : (i + 1) * n_state]
            with fx_traceback.annotate({"phase": "update", "param": pname}):
                new_params.append(_optimizer_update(optimizer, p.detach(), g, state))
        return loss, new_params

    try:
        with fx_traceback.preserve_node_meta(), _ModulePaths(module), capture_kernels():
            gm = make_fx(step, tracing_mode="fake")(f_params, f_buffers, f_states, f_inputs)
    except InputError:
        raise
    except Exception as exc:  # any tracing failure becomes one sentence, not a traceback
        raise CaptureError(_describe_failure(exc)) from None

    input_names = _input_names(module, len(example_inputs))
    graph_meta = {
        "training": training,
        "optimizer": optimizer if training else None,
        "params": int(sum(p.numel() for _, p in all_params if p.requires_grad)),
        "dims": dims,
        **(meta or {}),
    }
    graph = OpGraph(name or type(module).__name__, meta=graph_meta)
    converter = _Converter(graph, dims, n_state)
    converter.run(
        gm,
        trainable,
        buffers,
        len(example_inputs),
        input_names,
        frozen_names={n for n, _ in frozen},
    )
    graph.meta.update(expert_meta(graph))  # stacked/listed MoE experts, for sharding
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
    return CapturedStep(graph, gm, node_op, param_names, [n for n, _ in buffers], n_state)


def _input_names(module: torch.nn.Module, n: int) -> list[str]:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]
    return [names[i] if i < len(names) else str(i) for i in range(n)]


class _Converter:
    """Turns the traced fx graph into OpGraph ops and edges (one pass, O(nodes + args))."""

    def __init__(self, graph: OpGraph, dims: dict[str, int], n_state: int) -> None:
        self.graph = graph
        self.dims = dims
        self.n_state = n_state
        # fx node -> (index of the op that produced it, bytes it carries)
        self.source: dict[torch.fx.Node, tuple[int, int]] = {}
        self.forward_by_seq: dict[int, list[tuple[torch.fx.Node, int]]] = {}
        self.pending_links: list[tuple[int, int, str]] = []
        self.op_phase: list[str] = []

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
        state_nodes = placeholders[n_params + n_bufs : n_params + n_bufs + n_states]
        for k, node in enumerate(state_nodes):
            owner = param_ops[k // self.n_state]
            self.source[node] = (owner, _nbytes(node.meta["val"]))
        for i, node in enumerate(placeholders[n_params + n_bufs + n_states :]):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                op = self._tensor_op(f"input:{input_names[i]}", "input", val)
                self.source[node] = (self._add(op), _nbytes(val))

        for node in gm.graph.nodes:
            if node.op == "call_function":
                self._call(node)
        self._link_backward()

    # -------------------------------------------------------------- op nodes
    def _call(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if _is_alias(node.target):
            src_node = node.args[0] if node.args else None
            if isinstance(src_node, torch.fx.Node) and src_node in self.source:
                src, src_bytes = self.source[src_node]
                own = _tensors(val)
                nbytes = _nbytes(own[0]) if len(own) == 1 else src_bytes
                self.source[node] = (src, min(nbytes, src_bytes) if src_bytes else nbytes)
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
        )
        idx = self._add(op)
        for a in inputs:
            src, nbytes = self.source[a]
            self.graph.add_edge(src, idx, nbytes)
        self.source[node] = (idx, int(op.bytes_written))
        if phase == "forward" and "seq_nr" in node.meta:
            self.forward_by_seq.setdefault(node.meta["seq_nr"], []).append((node, idx))
        if phase == "backward" and "bwd_of" in custom:
            self.pending_links.append((idx, custom["bwd_of"], custom.get("bwd_node", "")))

    def _link_backward(self) -> None:
        """Point each backward op at the forward op whose autograd node produced it."""
        ops = self.graph.ops
        for idx, seq, node_name in self.pending_links:
            candidates = self.forward_by_seq.get(seq)
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


def capture_callable(
    fn: Callable[[], tuple[torch.nn.Module, Sequence[Any]]], **kwargs: Any
) -> OpGraph:
    """Capture the ``(model, example_inputs)`` pair that ``fn()`` returns."""
    try:
        built = fn()
    except Exception as exc:  # the user's builder failed: one sentence, no traceback
        raise CaptureError(
            f"{getattr(fn, '__name__', 'the build function')}() failed with "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not (isinstance(built, tuple | list) and len(built) == 2):
        raise CaptureError(
            f"{getattr(fn, '__name__', 'the function')} must return (model, example_inputs), "
            f"got {type(built).__name__}"
        )
    model, inputs = built
    return capture(model, inputs, **kwargs)
