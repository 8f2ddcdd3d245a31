"""``inception_v3``: Inception-v3 image classifier with its auxiliary classifier, for training.

Architecture of Szegedy et al. 2016, "Rethinking the Inception Architecture for Computer
Vision" (Table 1, Figures 5-7 and Section 4 for the auxiliary classifier), laid out exactly as
the widely used torchvision ``inception_v3(aux_logits=True, num_classes=1000)``:

* every convolution is ``Conv2d(bias=False)`` + ``BatchNorm2d(eps=0.001)`` + ReLU;
* stem ``Conv2d_1a_3x3`` ... ``Conv2d_4a_3x3`` with two 3x3/2 max-pools, then the blocks
  ``Mixed_5b/5c/5d`` (35x35), ``Mixed_6a`` (grid reduction), ``Mixed_6b/6c/6d/6e`` (17x17, 7x1
  factorisations with 128/160/160/192 channels), ``Mixed_7a`` (reduction), ``Mixed_7b/7c`` (8x8);
* ``AuxLogits`` on the 17x17x768 map (5x5/3 average pool, 1x1 conv to 128, 5x5 conv to 768,
  global pool, fully connected), global average pool, dropout 0.5 and ``fc`` to 1000 classes;
* 27,161,264 parameters; about 5.71 G multiply-accumulates per 299x299 image (main path).

Workload: batch 32 of 299x299 RGB images (the Inception-V3 benchmark of ColocRL, Mirhoseini et
al., ICML 2017), training loss ``CE(logits) + 0.4 * CE(aux_logits)`` (the 0.4 auxiliary weight of
the reference Inception training code).  Training needs a batch of at least 2 (the auxiliary
head's BatchNorm sees a 1x1 map, so one example has no batch statistics); inference in ``eval()``
mode works at batch 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, features, token_ids

SIZES: tuple[str, ...] = ("default",)
DEFAULT_BATCH = 32

IMAGE = 299
CLASSES = 1000
AUX_WEIGHT = 0.4

Kernel = int | tuple[int, int]


class BasicConv2d(nn.Module):
    """Convolution without bias, batch normalisation (eps 0.001) and ReLU."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Kernel,
        stride: int = 1,
        padding: Kernel = 0,
    ) -> None:
        """Create the ``conv`` and ``bn`` submodules."""
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply conv, batch norm and ReLU."""
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 block: 1x1, 5x5, double 3x3 and pooled branches (Figure 5 of the paper)."""

    def __init__(self, in_channels: int, pool_features: int) -> None:
        """Create the four branches; the pooled branch projects to ``pool_features`` channels."""
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, 1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the branch outputs along channels."""
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], dim=1)


class InceptionB(nn.Module):
    """Grid reduction 35x35 -> 17x17 (``Mixed_6a``)."""

    def __init__(self, in_channels: int) -> None:
        """Create the strided 3x3, the strided double 3x3 and (parameter-free) pool branches."""
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the branch outputs along channels."""
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], dim=1)


class InceptionC(nn.Module):
    """17x17 block with factorised 1x7/7x1 convolutions (Figure 6 of the paper)."""

    def __init__(self, in_channels: int, channels_7x7: int) -> None:
        """Create the branches; ``channels_7x7`` is the width inside the 7x7 factorisations."""
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, 1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the branch outputs along channels."""
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b7, bd, bp], dim=1)


class InceptionD(nn.Module):
    """Grid reduction 17x17 -> 8x8 (``Mixed_7a``)."""

    def __init__(self, in_channels: int) -> None:
        """Create the 3x3 and the 7x7-then-3x3 strided branches."""
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the branch outputs along channels."""
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], dim=1)


class InceptionE(nn.Module):
    """8x8 block with expanded 1x3/3x1 filter banks (Figure 7 of the paper)."""

    def __init__(self, in_channels: int) -> None:
        """Create the 1x1, split 3x3, split double 3x3 and pooled branches."""
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 320, 1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the branch outputs along channels."""
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], dim=1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], dim=1)
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b3, bd, bp], dim=1)


class InceptionAux(nn.Module):
    """Auxiliary classifier on the 17x17x768 feature map."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        """Create the 1x1 and 5x5 convolutions and the classifier."""
        super().__init__()
        self.conv0 = BasicConv2d(in_channels, 128, 1)
        self.conv1 = BasicConv2d(128, 768, 5)
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return auxiliary logits ``(B, num_classes)``."""
        x = F.avg_pool2d(x, kernel_size=5, stride=3)
        x = self.conv1(self.conv0(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class InceptionV3(nn.Module):
    """Inception-v3 with auxiliary logits; ``forward`` returns the training loss."""

    def __init__(self, num_classes: int = CLASSES, aux_weight: float = AUX_WEIGHT) -> None:
        """Create the stem, the eleven Inception blocks, ``AuxLogits`` and ``fc``."""
        super().__init__()
        self.aux_weight = aux_weight
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.AuxLogits = InceptionAux(768, num_classes)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048)
        self.dropout = nn.Dropout(p=0.5)
        self.fc = nn.Linear(2048, num_classes)

    def logits(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, aux_logits)``; ``aux_logits`` is ``None`` outside training mode."""
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(images)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6a(x)
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))
        aux = self.AuxLogits(x) if self.training else None
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(self.dropout(x)), aux

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return ``CE(logits) + aux_weight * CE(aux_logits)`` (just ``CE(logits)`` in eval)."""
        logits, aux = self.logits(images)
        loss = F.cross_entropy(logits, labels)
        if aux is not None:
            loss = loss + self.aux_weight * F.cross_entropy(aux, labels)
        return loss


def build(size: str = "default", batch: int | None = None) -> Workload:
    """Build the ``inception_v3`` workload (the only size is ``default``) on the current device."""
    del size
    batch = DEFAULT_BATCH if batch is None else batch
    model = InceptionV3()
    inputs = (features(batch, 3, IMAGE, IMAGE), token_ids(batch))
    return Workload(
        name="inception_v3",
        size="default",
        model=model,
        example_inputs=inputs,
        dims={"batch": batch, "channels": 3, "height": IMAGE, "width": IMAGE, "classes": CLASSES},
        tokens=None,
        description="Inception-v3 with auxiliary classifier on 299x299 ImageNet images.",
        source=(
            "Szegedy et al. 2016, Table 1 and Figs. 5-7 (torchvision layout, 27,161,264 params); "
            "Mirhoseini et al. 2017 (ColocRL), Sec. 4 (batch 32)"
        ),
    )
