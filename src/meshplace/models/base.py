"""Shared types for the reference workloads: :class:`Workload` and :class:`UnknownWorkloadError`.

Kept apart from ``meshplace.models.__init__`` so that the per-workload modules can import these
names without a circular import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshplace.errors import InputError


class UnknownWorkloadError(InputError):
    """Raised by :func:`meshplace.models.get` for an unknown workload, size or a bad batch size."""


@dataclass(frozen=True)
class Workload:
    """A reference training workload: a model plus example inputs for one training step.

    ``model(*example_inputs)`` runs the full forward pass and returns a 0-dim training loss.
    The model and the inputs live on whatever device was current when the workload was built
    (``meshplace.models.get`` always builds on the ``meta`` device).
    """

    name: str
    size: str
    model: torch.nn.Module
    example_inputs: tuple
    dims: dict[str, int]
    tokens: int | None
    description: str
    source: str


def token_ids(*shape: int) -> torch.Tensor:
    """Return an int64 tensor of token ids (all zeros, so also valid off the meta device)."""
    return torch.zeros(*shape, dtype=torch.int64)


def features(*shape: int) -> torch.Tensor:
    """Return a float32 tensor of input features or images (zeros off the meta device)."""
    return torch.zeros(*shape, dtype=torch.float32)
