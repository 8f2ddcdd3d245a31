"""Reference neural-network training workloads, built on the ``meta`` device.

Each workload is a ``torch.nn.Module`` whose ``forward(*example_inputs)`` runs a full forward
pass and returns a 0-dim training loss, so a training step can be traced (for example with
``make_fx`` through ``torch.autograd.grad``) without allocating any memory.

============  ==========================================  =====================================
name          sizes (first is the default)                source
============  ==========================================  =====================================
rnnlm         default                                     Mirhoseini et al. 2017; Zaremba 2014
nmt           2layer, 4layer                              Wu et al. 2016 (GNMT)
inception_v3  default                                     Szegedy et al. 2016
resnet50      default                                     He et al. 2016 (v1.5)
transformer   base, big, mtf-5b                           Vaswani 2017; Shazeer et al. 2018
gpt           124m, 350m, 774m, 1.5b, 2.7b, 6.7b, 13b     Radford 2019; Brown et al. 2020
dmcca         4view, 8view                                Somandepalli et al. 2019
============  ==========================================  =====================================

Usage::

    from meshplace.models import available, get

    w = get("gpt", size="1.5b", batch=4)
    loss = w.model(*w.example_inputs)  # 0-dim meta tensor
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from numbers import Integral
from types import ModuleType

import torch

from meshplace.models import dmcca, gpt, inception_v3, nmt, resnet50, rnnlm, transformer
from meshplace.models.base import UnknownWorkloadError, Workload

__all__ = ["UnknownWorkloadError", "Workload", "available", "get"]

_MODULES: dict[str, ModuleType] = {
    "rnnlm": rnnlm,
    "nmt": nmt,
    "inception_v3": inception_v3,
    "resnet50": resnet50,
    "transformer": transformer,
    "gpt": gpt,
    "dmcca": dmcca,
}


def available() -> dict[str, list[str]]:
    """Return every workload name mapped to its size names; the first size is the default."""
    return {name: list(module.SIZES) for name, module in _MODULES.items()}


def canonical_size(name: str, size: str | None) -> str | None:
    """The size name ``get(name, size=size)`` builds: an alias resolved, ``None`` the
    workload's first size; anything else (an unknown name or size) unchanged, for
    :func:`get` to refuse. Two spellings of one workload thus key one cache entry.

    >>> canonical_size("transformer", "5b"), canonical_size("gpt", None)
    ('mtf-5b', '124m')
    """
    module = _MODULES.get(name) if isinstance(name, str) else None
    if module is None:
        return size
    size = getattr(module, "SIZE_ALIASES", {}).get(size, size)
    return module.SIZES[0] if size is None else size


def get(
    name: str, *, batch: int | None = None, size: str | None = None, layers: int | None = None
) -> Workload:
    """Build workload ``name`` on the ``meta`` device.

    ``size`` defaults to the workload's first size and ``batch`` to its reference batch size.
    ``layers`` overrides the depth of a workload whose builder takes it (``gpt``); others
    raise :class:`UnknownWorkloadError`.
    Raises :class:`UnknownWorkloadError` for an unknown name or size, or a batch size that is not
    a positive integer (``dmcca`` needs at least 2: its covariances divide by ``batch - 1``).
    ``inception_v3`` builds at batch 1 but then only runs in ``eval()`` mode.
    """
    module = _MODULES.get(name) if isinstance(name, str) else None
    if module is None:
        raise UnknownWorkloadError(
            f"Unknown workload {name!r}; choose one of {_choices(_MODULES)}."
        )
    sizes: tuple[str, ...] = module.SIZES
    size = getattr(module, "SIZE_ALIASES", {}).get(size, size)
    if size is None:
        size = sizes[0]
    elif size not in sizes:
        raise UnknownWorkloadError(
            f"Unknown size {size!r} for workload {name!r}; choose one of {_choices(sizes)}."
        )
    if batch is not None:
        min_batch: int = getattr(module, "MIN_BATCH", 1)
        if isinstance(batch, bool) or not isinstance(batch, Integral) or batch < min_batch:
            wanted = "a positive integer" if min_batch == 1 else f"an integer >= {min_batch}"
            raise UnknownWorkloadError(
                f"Batch size for workload {name!r} must be {wanted}, not {batch!r}."
            )
        batch = int(batch)
    builder: Callable[..., Workload] = module.build
    if layers is not None:
        if "layers" not in inspect.signature(builder).parameters:
            raise UnknownWorkloadError(f"Workload {name!r} has no variable depth (layers).")
        if isinstance(layers, bool) or not isinstance(layers, Integral) or layers < 0:
            raise UnknownWorkloadError(f"Layers must be a non-negative integer, not {layers!r}.")
        with torch.device("meta"):
            return builder(size=size, batch=batch, layers=int(layers))
    with torch.device("meta"):
        return builder(size=size, batch=batch)


def varies_depth(name: str) -> bool:
    """Whether workload ``name`` can be built with another depth (``get(..., layers=)``).

    >>> varies_depth("gpt"), varies_depth("resnet50"), varies_depth("model.py:build")
    (True, False, False)
    """
    module = _MODULES.get(name)
    return module is not None and "layers" in inspect.signature(module.build).parameters


def _choices(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)
