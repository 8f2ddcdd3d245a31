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


def build_deep_mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """Eight 512-wide layers, batch 64: a model a pipeline cuts between layers (the
    pipelined family)."""
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    return torch.nn.Sequential(*layers), (torch.randn(64, 512),)


def build_llama_batch8() -> tuple[torch.nn.Module, tuple[torch.Tensor], dict]:
    """The Llama example's tiny configuration at batch 8 (the pipelined family: 8 splits
    into 2, 4 or 8 micro-batches)."""
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama

    cfg = dataclasses.replace(llama.CONFIGS["tiny"], batch=8)
    model = llama.Llama(cfg)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    return model, (ids,), {"labels": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))}


def build_gpt_124m() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-124M at batch 8 × 1024 tokens (``gpt --size 124m``), built on the meta device
    with meta inputs, as the GPU benchmark's eager and traced steps see it (``benchmarks/
    gpu.py --part torchrun``: a one-GPU sharding plan of it under torchrun and NCCL)."""
    from meshplace import models

    workload = models.get("gpt", size="124m", batch=8)
    return workload.model, tuple(workload.example_inputs)
