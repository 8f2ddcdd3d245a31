"""Models of the sharded-plan fidelity benchmark (``benchmarks/fidelity.py --family
sharded``): ``FILE.py:build`` functions as a user writes them."""

from __future__ import annotations

import torch


def build_mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A two-layer perceptron wide enough that its matmuls, not Python, dominate a step on
    one CPU thread: 512 → 2048 → 512, batch 64."""
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    )
    return model, (torch.randn(64, 512),)
