"""``resnet50``: ResNet-50 v1.5 image classifier.

Architecture of He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1 (the
50-layer column: bottleneck blocks [3, 4, 6, 3] with widths 64/128/256/512 and expansion 4), in
the "v1.5" variant used by torchvision's ``resnet50``: a downsampling block puts its stride on
the 3x3 convolution (not on the first 1x1), and projection shortcuts (1x1 conv + BN) are used only
where the shape changes.

* stem: 7x7/2 convolution to 64 channels, BN, ReLU, 3x3/2 max-pool;
* ``layer1`` .. ``layer4``: 3, 4, 6 and 3 bottlenecks (1x1, 3x3, 1x1 convolutions without bias,
  each followed by BatchNorm; ``downsample.0``/``downsample.1`` on the first block of a stage);
* global average pool and ``fc`` to 1000 classes: 25,557,032 parameters.

Workload: batch 32 (default) of 224x224 RGB images, softmax cross-entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, features, token_ids

SIZES: tuple[str, ...] = ("default",)
DEFAULT_BATCH = 32

IMAGE = 224
CLASSES = 1000
BLOCKS = (3, 4, 6, 3)
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (carrying the stride) -> 1x1 bottleneck with an identity or projection skip."""

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        """Create a block of inner width ``width`` and output width ``EXPANSION * width``."""
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the residual block."""
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + identity)


class ResNet50(nn.Module):
    """ResNet-50 v1.5; ``forward`` returns the cross-entropy training loss."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        """Create the stem, the four stages ``layer1`` .. ``layer4`` and ``fc``."""
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        channels = 64
        stages = []
        for i, (blocks, width) in enumerate(zip(BLOCKS, WIDTHS, strict=True)):
            stride = 1 if i == 0 else 2
            layers = []
            for b in range(blocks):
                layers.append(Bottleneck(channels, width, stride if b == 0 else 1))
                channels = width * EXPANSION
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(channels, num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Return class logits ``(B, num_classes)`` for ``images`` ``(B, 3, H, W)``."""
        x = F.relu(self.bn1(self.conv1(images)))
        x = F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of the logits against ``labels``."""
        return F.cross_entropy(self.logits(images), labels)


def build(size: str = "default", batch: int | None = None) -> Workload:
    """Build the ``resnet50`` workload (the only size is ``default``) on the current device."""
    del size
    batch = DEFAULT_BATCH if batch is None else batch
    model = ResNet50()
    inputs = (features(batch, 3, IMAGE, IMAGE), token_ids(batch))
    return Workload(
        name="resnet50",
        size="default",
        model=model,
        example_inputs=inputs,
        dims={"batch": batch, "channels": 3, "height": IMAGE, "width": IMAGE, "classes": CLASSES},
        tokens=None,
        description="ResNet-50 v1.5 (stride on the 3x3 conv) on 224x224 ImageNet images.",
        source="He et al. 2016, Table 1 (50-layer); torchvision v1.5 layout, 25,557,032 params",
    )
