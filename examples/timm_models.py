"""``timm`` image models built from their registered configs (``pretrained=False``: no
weights, no network).

``timm`` is not a meshplace dependency; install it beside meshplace to use this file
(``pip install timm``). ``build`` (ResNet-50) and ``vit`` (ViT-B/16) return ``(model,
(images,))`` with a batch of 224x224 RGB images: the model returns logits, not a loss, so
meshplace differentiates the logits' mean, a stand-in it notes on stderr (``meshplace:
note: ...``) and records in ``meta['loss'] == 'mean'`` — the step then has no loss op (a
1000-class cross-entropy is a few MFLOP beside ResNet-50's 25 GFLOP per image). A build
file cannot pass ``capture``'s ``loss_fn``; ``build_with_loss`` and ``vit_with_loss`` wrap
the model with a cross-entropy over ``labels`` instead (parameter names gain a ``model.``
prefix).

=======================  ===============================  ==========  ================
function                 model                            params      forward / image
=======================  ===============================  ==========  ================
``build``                ResNet-50 (timm ``resnet50``)    25.56 M     4.1 GMAC
``vit``                  ViT-B/16 (``vit_base_patch16``)  86.57 M     16.9 GMAC
=======================  ===============================  ==========  ================

(GMACs as timm's model tables give them; meshplace counts 2 FLOPs per multiply-add.)

Commands (from the repository root, with ``timm`` importable)::

    meshplace graph examples/timm_models.py:build                 # training step, batch 32
    meshplace graph examples/timm_models.py:vit --inference --json
    meshplace plan examples/timm_models.py:build_with_loss --cluster colocrl-4gpu \\
        --placer heft,metis,anneal --budget 30
    meshplace plan examples/timm_models.py:vit_with_loss --cluster dgx-h100 --dtype bf16 \\
        --objective throughput --placer pipeline

``meshplace shard`` searches layouts of the reference workloads only (``meshplace shard
resnet50 --cluster tpu-v3-pod --chips 1024`` is the reference ResNet-50); it does not take a
model file yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Images per example batch.
BATCH = 32


def _images(batch: int, size: int) -> torch.Tensor:
    """A batch of RGB images on the meta device (capture reads only the shape)."""
    return torch.empty(batch, 3, size, size, device="meta")


def _create(name: str, image: int) -> nn.Module:
    """``timm.create_model(name)`` without weights, on the meta device: nothing is
    allocated or initialised (ViT-B's initialisation alone takes seconds on a CPU)."""
    import timm

    kwargs = {"img_size": image} if name.startswith("vit") else {}
    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, **kwargs)


def build(batch: int = BATCH, image: int = 224) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """timm's ResNet-50 (He et al. 2016, v1.5 strides) and a batch of images."""
    return _create("resnet50", image), (_images(batch, image),)


def vit(batch: int = BATCH, image: int = 224) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """timm's ViT-B/16 (Dosovitskiy et al. 2021): 12 layers, d=768, 16x16 patches."""
    return _create("vit_base_patch16_224", image), (_images(batch, image),)


class WithLoss(nn.Module):
    """A classifier and its cross-entropy: ``forward(images, labels)`` returns the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the model's logits for ``images`` against ``labels``."""
        return F.cross_entropy(self.model(images), labels)


def _with_labels(
    built: tuple[nn.Module, tuple[torch.Tensor]],
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model, (images,) = built
    labels = torch.zeros(images.shape[0], dtype=torch.int64, device=images.device)
    return WithLoss(model), (images, labels)


def build_with_loss(
    batch: int = BATCH, image: int = 224
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`build` with a cross-entropy loss over ``labels``."""
    return _with_labels(build(batch, image))


def vit_with_loss(
    batch: int = BATCH, image: int = 224
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`vit` with a cross-entropy loss over ``labels``."""
    return _with_labels(vit(batch, image))
