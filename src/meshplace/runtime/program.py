"""Trace a training step into an *executable* fx graph plus the OpGraph built from it.

:func:`meshplace.graph.capture.capture` keeps only the OpGraph. Executing a plan needs the
fx ``GraphModule`` too, and the map from every fx node to the OpGraph op that owns it (a
view node maps to the op that produced the tensor it views; an optimizer-state placeholder
to its parameter). :func:`trace_step` repeats capture's trace step for step (same fake
tensors, same annotations, same converter), so the OpGraph it returns is identical to
``capture()``'s — same op names, same fingerprint — and a plan made for one applies to the
other.

Models are named by a :class:`ModelSpec`, which is picklable, so each worker process can
rebuild and re-trace the model itself (make_fx is deterministic: node names match across
processes). Real parameters are created deterministically from a seed
(:func:`materialize`), whatever device the model was built on.

Example
-------
>>> spec = ModelSpec("mlp", batch=4)
>>> step = trace_step(spec)
>>> step.graph.num_ops == len(step.graph.ops) and step.graph.name
'mlp'
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshplace.errors import InputError
from meshplace.graph.ir import OpGraph

# the module, not the ``capture`` function that ``meshplace.graph`` re-exports under that name
_cap = importlib.import_module("meshplace.graph.capture")


class RuntimeInputError(InputError):
    """A model, plan or option the runtime cannot execute."""


# ---------------------------------------------------------------- small models
class MLP(torch.nn.Module):
    """A 2-layer perceptron with a mean-squared-error loss (the runtime's smallest test)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def _mlp(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    hidden = {"small": 32, "medium": 256, "large": 1024}.get(size or "small", 32)
    return MLP(16 if hidden == 32 else hidden, hidden, 4), (
        torch.zeros(batch, 16 if hidden == 32 else hidden),
        torch.zeros(batch, 4),
    )


def _nmt_small(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    from meshplace.models.nmt import GNMT

    seq = {"tiny": 3, "small": 8}.get(size or "small", 8)
    model = GNMT(256, 64, 64, 2, 64)
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    return model, (ids, ids.clone(), ids.clone())


def _dmcca_small(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    from meshplace.models.dmcca import DeepMultisetCCA

    dims = (24, 32, 16) if size != "tiny" else (8, 8)
    return DeepMultisetCCA(dims, 48, 8, 1e-3), tuple(torch.zeros(batch, d) for d in dims)


def _rnnlm_small(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    from meshplace.models.rnnlm import RNNLanguageModel

    model = RNNLanguageModel(512, 96, 96, 2)
    seq = 6
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    return model, (ids, ids.clone())


def _transformer_small(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    import torch.nn as nn

    class TinyTransformer(nn.Module):
        """Embedding, 2 post-norm encoder layers (no dropout), vocabulary projection."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.out = nn.Linear(64, 256)

        def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = self.out(self.encoder(self.embed(ids)))
            return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    ids = torch.zeros(batch, 12, dtype=torch.int64)
    return TinyTransformer(), (ids, ids.clone())


def _resnet_small(batch: int, size: str | None) -> tuple[torch.nn.Module, tuple]:
    import torch.nn as nn

    class TinyResNet(nn.Module):
        """Two residual conv blocks with batch norm and a linear classifier."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, padding=1)
            self.bn = nn.BatchNorm2d(16)
            self.block1 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
            self.block2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
            self.fc = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.stem(x)))
            h = h + self.block1(h)
            h = h + self.block2(h)
            return nn.functional.cross_entropy(self.fc(h.mean(dim=(2, 3))), y)

    return TinyResNet(), (torch.zeros(batch, 3, 16, 16), torch.zeros(batch, dtype=torch.int64))


#: Small configurations of the reference models, sized to run on one CPU thread.
SMALL_MODELS: dict[str, Callable[[int, str | None], tuple[torch.nn.Module, tuple]]] = {
    "mlp": _mlp,
    "nmt-small": _nmt_small,
    "dmcca-small": _dmcca_small,
    "rnnlm-small": _rnnlm_small,
    "transformer-small": _transformer_small,
    "resnet-small": _resnet_small,
}
_SMALL_DEFAULT_BATCH = 4


@dataclass(frozen=True)
class ModelSpec:
    """A picklable name for a model: a small runtime model (:data:`SMALL_MODELS`), a
    reference workload (``resnet50``…, built on the meta device and materialized) or a
    ``file.py:fn`` whose ``fn()`` returns ``(model, example_inputs)``."""

    name: str
    batch: int | None = None
    size: str | None = None
    optimizer: str = "adam"
    seed: int = 0

    def build(self) -> tuple[torch.nn.Module, tuple, str]:
        """``(model, example_inputs, graph_name)``; inputs may be on the meta device."""
        if self.name in SMALL_MODELS:
            batch = self.batch if self.batch is not None else _SMALL_DEFAULT_BATCH
            torch.manual_seed(self.seed)
            model, inputs = SMALL_MODELS[self.name](batch, self.size)
            return model, inputs, self.name
        if ".py:" in self.name:
            return (*_from_python(self.name), Path(self.name.rpartition(":")[0]).stem)
        from meshplace import models

        w = models.get(self.name, batch=self.batch, size=self.size)
        graph_name = (
            self.name if len(models.available()[self.name]) == 1 else (f"{self.name}-{w.size}")
        )
        return w.model, tuple(w.example_inputs), graph_name


def known_models() -> list[str]:
    """Names :class:`ModelSpec` accepts besides ``file.py:fn``."""
    from meshplace import models

    return [*SMALL_MODELS, *models.available()]


def _from_python(spec: str) -> tuple[torch.nn.Module, tuple]:
    from meshplace.graph.sources import load_build_function

    model, inputs = load_build_function(spec)()
    return model, tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)


# ---------------------------------------------------------------- materialize
def materialize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give ``model`` real CPU parameters, deterministically from ``seed``.

    Matrices get U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's Linear default), 1-d
    weights one, biases and other vectors zero; ``running_var`` buffers one, other buffers
    zero. Meta-device models are first moved with ``to_empty``. O(parameters).
    """
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                bound = 1.0 / math.sqrt(max(1, p[0].numel()))
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        for name, b in model.named_buffers():
            b.fill_(1 if name.endswith("running_var") else 0)
    return model


def real_inputs(inputs: tuple, seed: int = 0) -> list[Any]:
    """Real CPU tensors for ``inputs``: given real tensors are kept; meta floating tensors
    become N(0, 1) samples from ``seed``; meta integer tensors zeros (valid indices)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_meta:
            if x.is_floating_point():
                x = torch.randn(x.shape, generator=gen, dtype=x.dtype)
            else:
                x = torch.zeros(x.shape, dtype=x.dtype)
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            x = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        out.append(x)
    return out


# ---------------------------------------------------------------- tracing
@dataclass
class TracedStep:
    """A traced training step.

    Attributes:
        graph: the OpGraph (identical to what ``capture`` returns for the same model).
        gm: the executable fx graph; called as ``gm(params, buffers, states, inputs)`` it
            returns ``(loss, new_params)``.
        node_op: fx node name → index of the OpGraph op that owns it.
        param_names / buffer_names: the order of the ``params`` / ``buffers`` lists.
        n_state: optimizer-state tensors per parameter.
        model / inputs: the model (real parameters) and its example inputs.
        state_nodes: for each optimizer-state tensor (in ``states`` order), the fx node
            computing its value after the step (:func:`new_state_nodes`), so the runtime
            carries Adam's moments (or momentum) from step to step.
    """

    graph: OpGraph
    gm: torch.fx.GraphModule
    node_op: dict[str, int]
    param_names: list[str]
    buffer_names: list[str]
    n_state: int
    model: torch.nn.Module
    inputs: list[Any] = field(default_factory=list)
    state_nodes: list[str] = field(default_factory=list)

    def initial_state(self) -> tuple[list, list, list, list]:
        """Fresh ``(params, buffers, states, inputs)`` lists (copies) for ``gm``."""
        named = dict(self.model.named_parameters())
        named_b = {**dict(self.model.named_buffers()), **named}
        params = [named[n].detach().clone() for n in self.param_names]
        bufs = [named_b[n].detach().clone() for n in self.buffer_names]
        states = [torch.zeros_like(p) for p in params for _ in range(self.n_state)]
        return params, bufs, states, [x.clone() if torch.is_tensor(x) else x for x in self.inputs]


def trace_step(spec: ModelSpec) -> TracedStep:
    """Build, materialize and trace ``spec``'s training step. Cost: one make_fx trace.

    Raises :class:`RuntimeInputError` for an unknown model and
    :class:`~meshplace.graph.capture.CaptureError` for one that cannot be traced.
    """
    if not isinstance(spec.name, str) or not (
        spec.name in SMALL_MODELS or ".py:" in spec.name or spec.name in known_models()
    ):
        raise RuntimeInputError(
            f"unknown model {spec.name!r}; choose one of {', '.join(known_models())} "
            "or FILE.py:FUNCTION"
        )
    if spec.optimizer not in _cap.OPTIMIZERS:
        raise RuntimeInputError(
            f"unknown optimizer {spec.optimizer!r}; allowed: {', '.join(_cap.OPTIMIZERS)}"
        )
    model, example, name = spec.build()
    model = materialize(model, spec.seed)
    inputs = real_inputs(example, spec.seed)
    model.train(True)
    graph, gm, node_op, pnames, bnames, n_state = _trace(model, tuple(inputs), name, spec)
    states = new_state_nodes(gm, len(pnames), len(bnames), n_state)
    return TracedStep(graph, gm, node_op, pnames, bnames, n_state, model, inputs, states)


def new_state_nodes(gm: torch.fx.GraphModule, n_params: int, n_bufs: int, n_state: int) -> list:
    """The fx node computing each optimizer-state tensor's next value.

    The traced step reads the state (``capture``'s ``_optimizer_update``: Adam's
    ``m.mul(β1).add(g, …)`` and ``v.mul(β2).addcmul(g, g, …)``, momentum's
    ``buf.mul(μ).add(g)``) but returns only the loss and new parameters. Each state's new
    value is the node two steps down its chain: the state placeholder's only user is a
    ``mul`` reading it first, whose only user (reading the ``mul`` first) is the new
    state. Raises :class:`RuntimeInputError` if a state does not follow that pattern.
    O(nodes).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state_ph = placeholders[n_params + n_bufs : n_params + n_bufs + n_params * n_state]
    out = []
    for ph in state_ph:
        users = list(ph.users)
        mul = users[0] if len(users) == 1 else None
        nxt = list(mul.users) if mul is not None else []
        ok = (
            mul is not None
            and getattr(mul.target, "__name__", "").startswith("mul")
            and mul.args[0] is ph
            and len(nxt) == 1
            and nxt[0].args[0] is mul
        )
        if not ok:
            raise RuntimeInputError(
                f"optimizer state {ph.name!r} is not updated as m.mul(b).add(...) in the "
                "traced step; the runtime cannot carry it across steps"
            )
        out.append(nxt[0].name)
    return out


def _trace(model: torch.nn.Module, example: tuple, name: str, spec: ModelSpec) -> tuple:
    """:func:`meshplace.graph.capture.capture_step` in training mode: the same OpGraph as
    ``capture()``, plus the executable fx graph and which op owns each fx node."""
    step = _cap.capture_step(
        model, example, training=True, name=name, optimizer=spec.optimizer, meta={"runtime": True}
    )
    return step.graph, step.gm, step.node_op, step.param_names, step.buffer_names, step.n_state
