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

Two pieces every consumer of a traced step shares live here, below both the runtime and
the profiler: :class:`StepInterpreter`, the one node-by-node walker of the fx graph (the
runtime's workers, the unplaced reference run, calibration's op timing and message
micro-benchmarks all run it), and :func:`schedule_nodes`, which fx node runs on which
worker under a placement.

Example
-------
>>> spec = ModelSpec("mlp", batch=4)
>>> step = trace_step(spec)
>>> step.graph.num_ops == len(step.graph.ops) and step.graph.name
'mlp'
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import signal
import threading
import zlib
from collections.abc import Callable, Container, Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx.node import map_arg

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
#: The sizes each small model has (the first is the default).
SMALL_MODEL_SIZES: dict[str, tuple[str, ...]] = {
    "mlp": ("small", "medium", "large"),
    "nmt-small": ("small", "tiny"),
    "dmcca-small": ("small", "tiny"),
    "rnnlm-small": ("small",),
    "transformer-small": ("small",),
    "resnet-small": ("small",),
}
# dmcca's covariances divide by batch - 1
_SMALL_MIN_BATCH = {"dmcca-small": 2}
_SMALL_DEFAULT_BATCH = 4


@dataclass(frozen=True)
class ModelSpec:
    """A picklable name for a model: a small runtime model (:data:`SMALL_MODELS`), a
    reference workload (``resnet50``…, built on the meta device and materialized) or a
    ``file.py:fn`` whose ``fn()`` returns ``(model, example_inputs)``.

    ``build_timeout_s`` bounds the user's ``fn()`` (``None``: no bound); see
    :meth:`build`."""

    name: str
    batch: int | None = None
    size: str | None = None
    optimizer: str = "adam"
    seed: int = 0
    build_timeout_s: float | None = None

    def build(self) -> tuple[torch.nn.Module, tuple, str]:
        """``(model, example_inputs, graph_name)``; inputs may be on the meta device.

        Raises :class:`RuntimeInputError` (one sentence) for a size or batch the model does
        not have, and for a ``file.py:fn`` that fails: ``fn()`` raises, returns something
        else than a ``(model, example_inputs)`` pair, calls ``sys.exit`` (at import or in
        ``fn``), or does not return within ``build_timeout_s`` seconds (checked in the main
        thread only, where a timer signal can interrupt it)."""
        if self.name in SMALL_MODELS:
            self._check_small()
            batch = self.batch if self.batch is not None else _SMALL_DEFAULT_BATCH
            torch.manual_seed(self.seed)
            model, inputs = SMALL_MODELS[self.name](batch, self.size)
            return model, inputs, self.name
        if ".py:" in self.name:
            if self.batch is not None or self.size is not None:
                raise RuntimeInputError(
                    f"{self.name}: batch and size apply to named models; set them inside "
                    "your build function"
                )
            built = _from_python(self.name, self.build_timeout_s)
            return (*built, Path(self.name.rpartition(":")[0]).stem)
        from meshplace import models

        w = models.get(self.name, batch=self.batch, size=self.size)
        graph_name = (
            self.name if len(models.available()[self.name]) == 1 else (f"{self.name}-{w.size}")
        )
        return w.model, tuple(w.example_inputs), graph_name

    def _check_small(self) -> None:
        sizes = SMALL_MODEL_SIZES[self.name]
        if self.size is not None and self.size not in sizes:
            raise RuntimeInputError(
                f"model {self.name!r} has no size {self.size!r}; choose one of {', '.join(sizes)}"
            )
        least = _SMALL_MIN_BATCH.get(self.name, 1)
        if self.batch is not None and (
            isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < least
        ):
            wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise RuntimeInputError(
                f"the batch size of model {self.name!r} must be {wanted}, got {self.batch!r}"
            )


def known_models() -> list[str]:
    """Names :class:`ModelSpec` accepts besides ``file.py:fn``."""
    from meshplace import models

    return [*SMALL_MODELS, *models.available()]


class _BuildTimeout(BaseException):
    """Raised by the timer signal in a build that runs too long (a ``BaseException``, so
    a user's ``except Exception`` cannot swallow it)."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None, what: str) -> Any:
    """``fn()``, interrupted after ``timeout_s`` seconds with a :class:`RuntimeInputError`
    saying ``"{what} did not return within ... s"``. The bound is a timer signal
    (``SIGALRM``), so it holds in the main thread of a POSIX process for Python code and
    sleeps; elsewhere, or with ``timeout_s=None``, ``fn()`` runs unbounded.

    >>> call_with_timeout(lambda: 42, 1.0, "f()")
    42
    """
    if (
        timeout_s is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        return fn()

    def on_alarm(signum: int, frame: Any) -> None:
        raise _BuildTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        return fn()
    except _BuildTimeout:
        raise RuntimeInputError(f"{what} did not return within {timeout_s:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _from_python(spec: str, timeout_s: float | None = None) -> tuple[torch.nn.Module, tuple]:
    """Import ``FILE.py``, call its build function (bounded by ``timeout_s``) and check
    what it returns; every failure of the user's code is one sentence.

    ``fn()`` returns ``(model, args)`` or ``(model, args, kwargs)``, unpacked as
    :mod:`meshplace.graph.sources` does (:func:`~meshplace.graph.sources.load_build_function`
    checks the shape); the runtime's step takes its inputs in order, so keyword inputs are
    passed by position (:func:`_by_position`)."""
    from meshplace.graph.sources import load_build_function

    path, _, fn_name = spec.rpartition(":")
    try:
        fn = call_with_timeout(lambda: load_build_function(spec), timeout_s, f"importing {path}")
    except SystemExit as exc:
        raise RuntimeInputError(
            f"{spec}: importing the file called sys.exit({exc.code!r}); a model file must "
            "define its build function without exiting"
        ) from None
    try:
        built = call_with_timeout(fn, timeout_s, f"{spec}: {fn_name}()")
    except SystemExit as exc:
        raise RuntimeInputError(
            f"{spec}: {fn_name}() called sys.exit({exc.code!r}) instead of returning "
            "(model, example_inputs)"
        ) from None
    except InputError:
        raise
    except Exception as exc:  # the user's builder failed: one sentence, no traceback
        text = str(exc).strip().splitlines()
        raise RuntimeInputError(
            f"{spec}: {fn_name}() failed with {type(exc).__name__}"
            + (f": {text[0]}" if text else "")
        ) from None
    model, inputs, *rest = built
    kwargs = rest[0] if rest else None
    if isinstance(inputs, Mapping) and kwargs is None:  # (model, {"input_ids": ...})
        inputs, kwargs = (), inputs
    args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    if kwargs:
        args = _by_position(model, args, dict(kwargs), f"{spec}: {fn_name}()")
    return model, args


def _by_position(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], where: str) -> tuple:
    """``model(*args, **kwargs)``'s inputs as one positional tuple, in the order of
    ``model.forward``'s parameters; a parameter skipped between them gets its default, which
    must be None (an absent input). A keyword that cannot be passed by position (keyword-only,
    ``**kwargs``) or a non-None default in a gap is one :class:`RuntimeInputError` sentence.

    >>> class M(torch.nn.Module):
    ...     def forward(self, x, mask=None, labels=None):
    ...         return x
    >>> _by_position(M(), (1,), {"labels": 2}, "f()")
    (1, None, 2)
    """
    import inspect

    name = f"{type(model).__name__}.forward"
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise RuntimeInputError(
            f"{where} returned inputs that {name} does not take: {exc}"
        ) from None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in signature.parameters.values() if p.kind in kinds]
    by_keyword = [k for k in kwargs if k not in {p.name for p in positional}]
    if by_keyword:
        raise RuntimeInputError(
            f"{where} returned keyword inputs {', '.join(by_keyword)} that {name} takes by "
            "keyword only; the runtime passes a step's inputs by position"
        )
    last = max(i for i, p in enumerate(positional) if p.name in bound.arguments)
    out = []
    for p in positional[: last + 1]:
        if p.name in bound.arguments:
            out.append(bound.arguments[p.name])
        elif p.default is None:
            out.append(None)
        else:
            raise RuntimeInputError(
                f"{where}: {name} parameter {p.name!r} lies between the given inputs and its "
                f"default {p.default!r} is not None; pass it in the build's inputs"
            )
    return tuple(out)


# ---------------------------------------------------------------- materialize
def initial_value(
    name: str, shape: Sequence[int], dtype: torch.dtype, *, parameter: bool, seed: int = 0
) -> torch.Tensor:
    """The initial value of parameter or buffer ``name``, from ``seed`` and the name alone,
    so a process can create just the tensors it holds and agree with every other process.

    Matrices (parameters of 2+ dimensions) get U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (PyTorch's Linear default) from a generator seeded by ``seed`` and a CRC-32 of the
    name; 1-d parameters named ``*weight`` one, other parameters zero; ``running_var``
    buffers one, other buffers zero. O(numel).

    >>> a = initial_value("fc.weight", (3, 4), torch.float32, parameter=True)
    >>> bool(torch.equal(a, initial_value("fc.weight", (3, 4), torch.float32, parameter=True)))
    True
    >>> initial_value("bn.running_var", (2,), torch.float32, parameter=False).tolist()
    [1.0, 1.0]
    """
    shape = tuple(int(n) for n in shape)
    if not parameter:
        return torch.full(shape, 1 if name.endswith("running_var") else 0, dtype=dtype)
    if len(shape) >= 2:
        gen = torch.Generator().manual_seed((int(seed) << 32) + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))
        return ((torch.rand(shape, generator=gen) * 2 - 1) * bound).to(dtype)
    return torch.full(shape, 1 if name.endswith("weight") else 0, dtype=dtype)


def materialize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give ``model`` real CPU parameters and buffers, each :func:`initial_value` of its
    name. Meta-device models are first moved with ``to_empty``, their tied parameters
    tied again. O(parameters).

    >>> with torch.device("meta"):
    ...     m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    >>> m[1].weight = m[0].weight
    >>> m = materialize(m)
    >>> m[1].weight is m[0].weight, len(list(m.parameters()))
    (True, 2)
    """
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        # to_empty gives each module its own tensor: tied weights (a language model's
        # embedding and head) would train as two, and the step would not be the one a
        # model built on the meta device elsewhere traces (a spawned worker's)
        tied: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        model = model.to_empty(device="cpu")
        for first, *aliases in tied.values():
            for alias in aliases:
                owner, _, leaf = alias.rpartition(".")
                setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial_value(name, p.shape, p.dtype, parameter=True, seed=seed))
        for name, b in model.named_buffers():
            b.copy_(initial_value(name, b.shape, b.dtype, parameter=False, seed=seed))
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


def concrete_inputs(inputs: Sequence[Any], seed: int = 0) -> list[Any]:
    """``inputs`` with every meta-device tensor made real as :func:`real_inputs` makes it
    (floating: N(0, 1) from ``seed``; integer: zeros) and every other value kept: the
    inputs a torchrun rank trains on when a ``FILE.py:build`` returns shapes only.

    >>> concrete_inputs([torch.empty(2, device="meta", dtype=torch.long), torch.ones(1)])
    [tensor([0, 0]), tensor([1.])]
    """
    made = iter(real_inputs(tuple(inputs), seed))
    return [
        real if isinstance(x, torch.Tensor) and x.is_meta else x
        for x, real in zip(inputs, made, strict=True)
    ]


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
        model / inputs: the model (real parameters, or on the meta device when traced
            with ``weights=False``) and its example inputs (real).
        state_nodes: for each optimizer-state tensor (in ``states`` order), the fx node
            computing its value after the step (:func:`new_state_nodes`), so the runtime
            carries Adam's moments (or momentum) from step to step.
        seed: the seed of the initial parameter values (:func:`initial_value`).
        optimizer: the optimizer whose update the step holds (``adam``...).
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
    seed: int = 0
    optimizer: str = "adam"

    def initial_state(self, held: Container[int] | None = None) -> tuple[list, list, list, list]:
        """Fresh ``(params, buffers, states, inputs)`` lists for ``gm``: parameters and
        buffers are :func:`initial_value` of their names (what :func:`materialize` gives
        the model), optimizer state zeros, inputs copies of :attr:`inputs`.

        ``held``: the placeholder positions (in ``params, buffers, states, inputs`` order)
        to create; every other slot is ``None`` and allocates nothing, so a process
        holding one device's share of the model never builds the rest. O(elements
        created)."""
        buffers = {n for n, _ in self.model.named_buffers()}
        shapes = {
            **{n: (b.shape, b.dtype) for n, b in self.model.named_buffers()},
            **{n: (p.shape, p.dtype) for n, p in self.model.named_parameters()},
        }
        n_p, n_b = len(self.param_names), len(self.buffer_names)

        def wanted(k: int) -> bool:
            return held is None or k in held

        def value(name: str) -> torch.Tensor:
            shape, dtype = shapes[name]
            # frozen parameters travel with the buffers but start as parameters do
            parameter = name not in buffers
            return initial_value(name, shape, dtype, parameter=parameter, seed=self.seed)

        params = [value(n) if wanted(k) else None for k, n in enumerate(self.param_names)]
        bufs = [value(n) if wanted(n_p + k) else None for k, n in enumerate(self.buffer_names)]
        states = []
        for k, name in enumerate(self.param_names):
            for j in range(self.n_state):
                slot = n_p + n_b + k * self.n_state + j
                shape, dtype = shapes[name]
                states.append(torch.zeros(tuple(shape), dtype=dtype) if wanted(slot) else None)
        first_input = n_p + n_b + len(states)
        inputs = [
            (x.clone() if torch.is_tensor(x) else x) if wanted(first_input + k) else None
            for k, x in enumerate(self.inputs)
        ]
        return params, bufs, states, inputs


def trace_step(spec: ModelSpec, *, weights: bool = True) -> TracedStep:
    """Build, materialize and trace ``spec``'s training step. Cost: one make_fx trace.

    ``weights=False`` builds a small runtime model on the meta device and materializes
    nothing (the trace runs on fake tensors either way): the model holds no memory, and
    :meth:`TracedStep.initial_state` creates just the tensors a process holds. A
    ``FILE.py:FUNCTION`` model is built as its function builds it (build it under
    ``torch.device("meta")`` to avoid real weights) and then moved to the meta device.

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
    if weights or ".py:" in spec.name:
        model, example, name = spec.build()
    else:
        with torch.device("meta"):
            model, example, name = spec.build()
    model = materialize(model, spec.seed) if weights else model.to("meta")
    inputs = real_inputs(example, spec.seed)
    model.train(True)
    graph, gm, node_op, pnames, bnames, n_state = _trace(model, tuple(inputs), name, spec.optimizer)
    states = new_state_nodes(gm, len(pnames), len(bnames), n_state)
    return TracedStep(
        graph,
        gm,
        node_op,
        pnames,
        bnames,
        n_state,
        model,
        inputs,
        states,
        seed=spec.seed,
        optimizer=spec.optimizer,
    )


def micro_batch_step(step: TracedStep, micro_batches: int) -> TracedStep | None:
    """``step``'s model traced on one micro-batch: each input whose first dimension is the
    batch (the first tensor input's) cut into ``micro_batches`` along it and the first
    piece kept, as a pipeline feeds its stages; ``None`` when the batch does not split
    into ``micro_batches``. :func:`meshplace.profile.calibrate.calibrate` times both, so
    that the cost model's fixed costs and rates hold at the micro-batch sizes plans run.
    Cost: one make_fx trace.

    >>> step = trace_step(ModelSpec("mlp", batch=8))
    >>> micro_batch_step(step, 4).inputs[0].shape[0], micro_batch_step(step, 3)
    (2, None)
    """
    tensors = [x for x in step.inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or micro_batches < 2:
        return None
    batch = int(tensors[0].shape[0])
    if batch % micro_batches:
        return None

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x.chunk(micro_batches)[0].clone()
        return x

    inputs = [cut(x) for x in step.inputs]
    graph, gm, node_op, pnames, bnames, n_state = _trace(
        step.model, tuple(inputs), step.graph.name, step.optimizer
    )
    states = new_state_nodes(gm, len(pnames), len(bnames), n_state)
    return dataclasses.replace(
        step,
        graph=graph,
        gm=gm,
        node_op=node_op,
        param_names=pnames,
        buffer_names=bnames,
        n_state=n_state,
        inputs=inputs,
        state_nodes=states,
    )


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


def _trace(model: torch.nn.Module, example: tuple, name: str, optimizer: str) -> tuple:
    """:func:`meshplace.graph.capture.capture_step` in training mode: the same OpGraph as
    ``capture()``, plus the executable fx graph and which op owns each fx node."""
    step = _cap.capture_step(
        model, example, training=True, name=name, optimizer=optimizer, meta={"runtime": True}
    )
    return step.graph, step.gm, step.node_op, step.param_names, step.buffer_names, step.n_state


# ---------------------------------------------------------------- schedule
@dataclass
class NodeSchedule:
    """Where every fx node of a traced step runs under a placement: computed identically
    in the driver, in every worker and in the calibration's message accounting.

    Attributes:
        names: fx node names, in graph order.
        device: per node, the worker (rank) that runs it: the worker of the OpGraph op
            that owns it; a node no op owns (the output node, an orphan) follows its first
            input, else worker 0.
        consumers: per node, the other workers that read its value (sorted).
    """

    names: list[str]
    device: list[int]
    consumers: list[list[int]]


def schedule_nodes(step: TracedStep, op_device: Sequence[int]) -> NodeSchedule:
    """The :class:`NodeSchedule` of ``step`` with OpGraph op *i* on worker
    ``op_device[i]``. O(fx nodes + fx edges).

    >>> step = trace_step(ModelSpec("mlp", batch=2))
    >>> sched = schedule_nodes(step, [0] * step.graph.num_ops)
    >>> set(sched.device), any(sched.consumers)
    ({0}, False)
    """
    nodes = list(step.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    device = [0] * len(nodes)
    for i, n in enumerate(nodes):
        op = step.node_op.get(n.name)
        if op is not None:
            device[i] = int(op_device[op])
        else:  # output node, or an orphan: follow the first input
            ins = n.all_input_nodes
            device[i] = device[pos[ins[0]]] if ins else 0
    consumers: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        for a in n.all_input_nodes:
            j = pos[a]
            if device[j] != device[i] and device[i] not in consumers[j]:
                consumers[j].append(device[i])
    for c in consumers:
        c.sort()
    return NodeSchedule([n.name for n in nodes], device, consumers)


# ---------------------------------------------------------------- interpreter
#: A per-node hook of :meth:`StepInterpreter.walk`: called with the node's position and
#: the list of values (``env[i]`` is node *i*'s value once it has run).
NodeHook = Callable[[int, list], Any]


def _attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, float]:
    """Scaled, masked attention scores in float32 and the scale used."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if is_causal:
        length, source = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return scores, scale


def _fused_on_device(query: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether the portable attention runs the device's fused kernel: on a CUDA device,
    without a mask (a mask's bias layout is the kernel's own constraint; the generic
    definition takes any)."""
    return query.device.type == "cuda" and attn_mask is None


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            "the portable definition of the host's flash attention has no dropout "
            f"(dropout_p={dropout_p}); trace the step with attention dropout off"
        )


def flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` in device-generic operators:
    ``(softmax(q kᵀ · scale + mask) v, logsumexp of the scores)`` (Dao et al.,
    FlashAttention, NeurIPS 2022, Algorithm 1's outputs, computed unblocked). A step traced
    on the host holds this host-only operator; a GPU worker runs this instead — on CUDA
    without a mask, the memory-efficient fused kernel (aten's efficient attention, Rabe &
    Staats 2021; what eager's ``scaled_dot_product_attention`` picks for float32), its
    padded logsumexp cut to the traced length. O(B·H·L·S·E) time; the
    unblocked definition O(B·H·L·S) memory (the full score matrix), the fused one
    O(B·H·L).

    >>> q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    >>> out, lse = flash_attention_for_cpu(q, k, v, is_causal=True)
    >>> ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    >>> torch.allclose(out, ref[0], atol=1e-5), torch.allclose(lse, ref[1], atol=1e-5)
    (True, True)
    """
    _no_dropout(dropout_p)
    if _fused_on_device(query, attn_mask):
        try:  # the device's fused kernel, as eager's scaled_dot_product_attention runs it
            out, padded, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, 0.0, is_causal, scale=scale
            )
            return out, padded[..., : query.shape[-2]]
        except RuntimeError:  # a shape or dtype the kernel does not take
            pass
    scores, _ = _attention_scores(query, key, is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, value.float()).to(query.dtype), lse


def flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` in device-generic
    operators: the probabilities recomputed from the saved logsumexp, then ``dV = Pᵀ dO``,
    ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``
    (FlashAttention's backward, Dao et al. 2022, Algorithm 2, unblocked). On CUDA without a
    mask: the fused forward recomputed under autograd and its gradients taken (one more
    fused forward, against the unblocked score matrices). Same cost as
    :func:`flash_attention_for_cpu`.

    >>> q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    >>> out, lse = flash_attention_for_cpu(q, k, v, is_causal=True)
    >>> g = torch.randn_like(out)
    >>> mine = flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, True)
    >>> ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
    ...     g, q, k, v, out, lse, 0.0, True)
    >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(mine, ref))
    True
    """
    _no_dropout(dropout_p)
    if _fused_on_device(query, attn_mask):
        try:  # recompute with the fused kernel and take its gradients (autograd's own)
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
                again = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, scale=scale
                )
                return torch.autograd.grad(again, (q, k, v), grad_out)
        except RuntimeError:
            pass
    scores, scale = _attention_scores(query, key, is_causal, attn_mask, scale)
    probs = torch.exp(scores - logsumexp.float().unsqueeze(-1))
    d_out = grad_out.float()
    grad_value = torch.matmul(probs.transpose(-2, -1), d_out)
    d_probs = torch.matmul(d_out, value.float().transpose(-2, -1))
    row = (d_out * out.float()).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - row)
    grad_query = torch.matmul(d_scores, key.float()) * scale
    grad_key = torch.matmul(d_scores.transpose(-2, -1), query.float()) * scale
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


# Host-only operators a step traced on the host may hold, each with a definition in
# operators every device has, which workers on other devices run instead.
PORTABLE_DEFINITIONS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        flash_attention_for_cpu_backward
    ),
}


def _strided_like_traced(fn: Callable[..., Any], node: torch.fx.Node) -> Callable[..., Any]:
    """``fn`` with its tensors laid out with the strides the traced operator had (the
    graph's later views rely on them)."""
    traced = node.meta.get("val")
    if not isinstance(traced, tuple | list):
        return fn
    strides = [t.stride() if isinstance(t, torch.Tensor) else None for t in traced]

    def call(*args: Any, **kwargs: Any) -> tuple:
        outs = fn(*args, **kwargs)
        return tuple(
            torch.empty_strided(o.shape, st, dtype=o.dtype, device=o.device).copy_(o)
            if st is not None and o.stride() != st
            else o
            for o, st in zip(outs, strides)
        )

    return call


_CALL, _PLACEHOLDER, _GENERIC = 0, 1, 2
_NO_HOOKS: Mapping[int, NodeHook] = {}


def on_device_kwargs(kwargs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``kwargs`` of a traced node with any ``device`` argument (factory ops traced on the
    host: ``zeros``, ``arange``, ``empty``, ...) replaced by ``device``.

    >>> on_device_kwargs({"dtype": torch.float32, "device": torch.device("cpu")},
    ...                  torch.device("meta"))["device"]
    device(type='meta')
    >>> on_device_kwargs({"dim": 0}, torch.device("meta"))
    {'dim': 0}
    """
    if "device" not in kwargs or kwargs["device"] is None:
        return dict(kwargs)
    return {**kwargs, "device": device}


class StepInterpreter(torch.fx.Interpreter):
    """Run a traced step's fx graph node by node, in graph order, with per-node hooks:
    the one interpreter behind the runtime's workers (each runs its own nodes, receiving
    and sending around them), the unplaced reference run, and calibration's op timing and
    message micro-benchmarks.

    It is a :class:`torch.fx.Interpreter` and keeps its semantics — placeholders take the
    step's flattened arguments in order (``params, buffers, states, inputs``), ``get_attr``,
    ``call_module`` and ``call_method`` nodes go through the Interpreter's methods, and the
    inherited :meth:`~torch.fx.Interpreter.run` works unchanged — but :meth:`walk`, the
    hot path, does not pay ``Interpreter.run_node``'s per-node bookkeeping (a metadata
    context, a progress bar, ``map_arg`` over a dict keyed by node: ~2.5x the time per
    node of a small model). Each ``call_function`` node is compiled once into its target,
    an argument template and the positions of the values to fill in; values live in a
    list indexed by node position. Nodes whose arguments nest other nodes in a list
    (``cat``) take the general path (``map_arg``), as do the rare other node kinds.

    ``positions`` restricts the walk to those nodes (a worker's own; by default every node
    but the output), and ``device`` replaces the ``device`` argument of factory ops traced
    on the host (:func:`on_device_kwargs`), for a worker computing on a GPU, whose walk
    runs host-only operators as their :data:`PORTABLE_DEFINITIONS` (``portable``: by
    default when ``device`` is not the CPU).

    >>> step = trace_step(ModelSpec("mlp", batch=2))
    >>> params, bufs, states, inputs = step.initial_state()
    >>> interp = StepInterpreter(step.gm)
    >>> env = interp.walk([*params, *bufs, *states, *inputs])
    >>> loss, new_params = interp.output(env)
    >>> bool(torch.equal(loss, step.gm(params, bufs, states, inputs)[0]))
    True
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        positions: Iterable[int] | None = None,
        *,
        device: torch.device | None = None,
        portable: bool | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.nodes: list[torch.fx.Node] = list(self.graph.nodes)
        # host-only operators run as their PORTABLE_DEFINITIONS away from the host
        self.portable = (
            portable if portable is not None else device is not None and device.type != "cpu"
        )
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.device = device
        placeholder = {n: k for k, n in enumerate(n for n in self.nodes if n.op == "placeholder")}
        self._placeholder_index = placeholder
        chosen = (
            range(len(self.nodes)) if positions is None else sorted({int(i) for i in positions})
        )
        self._program = [self._compile(i) for i in chosen if self.nodes[i].op != "output"]

    def _compile(self, i: int) -> tuple:
        """One entry of the walk: ``(position, kind, target, template, fills, kwargs)``."""
        node = self.nodes[i]
        if node.op == "placeholder":
            return (i, _PLACEHOLDER, self._placeholder_index[node], None, None, None)
        kwargs = node.kwargs if self.device is None else on_device_kwargs(node.kwargs, self.device)
        flat = not any(isinstance(v, torch.fx.Node) for v in kwargs.values()) and not any(
            isinstance(a, list | tuple | dict) and _holds_node(a) for a in node.args
        )
        if node.op != "call_function" or not flat:
            return (i, _GENERIC, node, None, None, kwargs)
        template = list(node.args)
        fills = tuple(
            (k, self.position[a]) for k, a in enumerate(template) if isinstance(a, torch.fx.Node)
        )
        target = node.target
        if self.portable and target in PORTABLE_DEFINITIONS:
            target = _strided_like_traced(PORTABLE_DEFINITIONS[target], node)
        return (i, _CALL, target, template, fills, dict(kwargs))

    def new_env(self) -> list[Any]:
        """An empty list of values, one slot per node."""
        return [None] * len(self.nodes)

    def walk(
        self,
        inputs: Sequence[Any],
        env: list[Any] | None = None,
        *,
        before: Mapping[int, NodeHook] | None = None,
        after: Mapping[int, NodeHook] | None = None,
        each: NodeHook | None = None,
        mark: tuple[MutableSequence[int], int] | None = None,
    ) -> list[Any]:
        """Run the nodes once; returns ``env``, the list of values by node position (a new
        one unless given: a hook may fill slots in ahead, e.g. a received value).

        ``inputs`` are the placeholders' values in placeholder order (the whole flattened
        argument list, even when only some placeholders are walked). Hooks, each called as
        ``hook(position, env)``: ``before[i]`` just before node *i* runs, ``after[i]`` just
        after it, ``each`` after every node (after ``after[i]``). ``mark = (array, slot)``
        writes each node's position to ``array[slot]`` before the node runs (the runtime
        publishes its progress in shared memory that way). Cost per node: one call of its
        target plus a list copy, a few checks, and the hooks given.
        """
        if env is None:
            env = [None] * len(self.nodes)
        before = before or _NO_HOOKS
        after = after or _NO_HOOKS
        array, slot = mark if mark is not None else (None, 0)
        for i, kind, target, template, fills, kwargs in self._program:
            if array is not None:
                array[slot] = i
            hook = before.get(i)
            if hook is not None:
                hook(i, env)
            if kind == _CALL:
                if fills:
                    args = template.copy()
                    for k, j in fills:
                        args[k] = env[j]
                    env[i] = target(*args, **kwargs)
                else:
                    env[i] = target(*template, **kwargs)
            elif kind == _PLACEHOLDER:
                env[i] = inputs[target]
            else:
                env[i] = self._run_general(target, kwargs, env)
            hook = after.get(i)
            if hook is not None:
                hook(i, env)
            if each is not None:
                each(i, env)
        return env

    def _run_general(self, node: torch.fx.Node, kwargs: Mapping[str, Any], env: list) -> Any:
        """A node through the Interpreter's own method for its kind (``call_function``,
        ``get_attr``, ``call_module``, ``call_method``), arguments read from ``env``."""
        position = self.position

        def load(a: torch.fx.Node) -> Any:
            return env[position[a]]

        args = map_arg(node.args, load)
        kw = map_arg(dict(kwargs), load)
        return getattr(self, node.op)(node.target, args, kw)

    def output(self, env: Sequence[Any]) -> Any:
        """The step's result from the values of a walk over every node: what the
        inherited :meth:`~torch.fx.Interpreter.run` returns (for a traced step,
        ``(loss, new_params)``)."""
        out = self.nodes[-1]
        return self.graph.process_outputs(map_arg(out.args[0], lambda a: env[self.position[a]]))


def _holds_node(value: Any) -> bool:
    """Whether a (nested) argument holds an fx node."""
    found = []
    map_arg(value, lambda a: found.append(a) or a)
    return bool(found)
