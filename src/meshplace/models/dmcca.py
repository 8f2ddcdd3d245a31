"""``dmcca``: deep multiset canonical correlation analysis over M modality-specific encoders.

Objective of Somandepalli et al. 2019, "Multimodal Representation Learning using Deep Multiset
Canonical Correlation" (arXiv:1904.01775), Section 2: M views are encoded by separate networks
into D-dimensional embeddings ``H_m``; with centred embeddings ``Hc_m`` over a batch of N,

* within-set covariance ``R_w = 1/(N-1) * sum_m Hc_m^T Hc_m``;
* between-set covariance ``R_b = 1/(N-1) * sum_{m != k} Hc_m^T Hc_k``
  (computed as ``S^T S / (N-1) - R_w`` with ``S = sum_m Hc_m``);

the generalised eigenvalues of ``(R_b, R_w)`` measure how correlated the views are.  Their sum is
``trace(L^-1 R_b L^-T)`` with ``L = cholesky(R_w + eps I)``, computed with
``torch.linalg.cholesky`` and ``torch.linalg.solve_triangular``; the training loss is its negative,
normalised by ``D (M - 1)`` so that it lies in ``[-1, 1/(M-1)]`` (all D eigenvalues are kept).

Config (our choice; the paper's encoders vary by task):

* sizes ``4view`` (default; input widths 784, 512, 1024, 300) and ``8view`` (adds 2048, 128,
  40, 256): an image, generic features, a wide feature vector, word vectors, and so on;
* each encoder ``encoders.m`` is an MLP with 3 hidden layers of 1024 ReLU units (``fc1``,
  ``fc2``, ``fc3``) and a linear output ``out`` to D = 64;
* eps = 1e-3, batch 256 (N must be at least 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, features

SIZES: tuple[str, ...] = ("4view", "8view")
DEFAULT_BATCH = 256
MIN_BATCH = 2  # covariances divide by N - 1

INPUT_DIMS = {
    "4view": (784, 512, 1024, 300),
    "8view": (784, 512, 1024, 300, 2048, 128, 40, 256),
}
HIDDEN = 1024
OUTPUT = 64
EPS = 1e-3


class Encoder(nn.Module):
    """Modality-specific MLP: three ReLU hidden layers then a linear projection."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int) -> None:
        """Create ``fc1``, ``fc2``, ``fc3`` (``hidden`` wide) and ``out`` (``out_dim`` wide)."""
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed ``x`` ``(N, in_dim)`` to ``(N, out_dim)``."""
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.out(x)


class DeepMultisetCCA(nn.Module):
    """M encoders plus the multiset CCA loss; ``forward(*views)`` returns the loss."""

    def __init__(self, input_dims: tuple[int, ...], hidden: int, out_dim: int, eps: float) -> None:
        """Create one encoder per entry of ``input_dims`` (at least two views)."""
        super().__init__()
        if len(input_dims) < 2:
            raise ValueError("Deep multiset CCA needs at least two views.")
        self.out_dim = out_dim
        self.eps = eps
        self.encoders = nn.ModuleList(Encoder(d, hidden, out_dim) for d in input_dims)

    def forward(self, *views: torch.Tensor) -> torch.Tensor:
        """Return ``-trace(L^-1 R_b L^-T) / (D (M - 1))`` for the batch of ``views``."""
        views_count = len(self.encoders)
        centred = []
        for encoder, x in zip(self.encoders, views, strict=True):
            h = encoder(x)
            centred.append(h - h.mean(dim=0, keepdim=True))
        scale = 1.0 / (centred[0].shape[0] - 1)
        within = sum(h.T @ h for h in centred) * scale
        total = sum(centred)
        between = (total.T @ total) * scale - within
        eye = torch.eye(self.out_dim, dtype=within.dtype, device=within.device)
        chol = torch.linalg.cholesky(within + self.eps * eye)
        half = torch.linalg.solve_triangular(chol, between, upper=False)
        whitened = torch.linalg.solve_triangular(chol, half.T, upper=False)
        return -torch.trace(whitened) / (self.out_dim * (views_count - 1))


def build(size: str = "4view", batch: int | None = None) -> Workload:
    """Build the ``dmcca`` workload (``4view`` or ``8view``) on the current device."""
    batch = DEFAULT_BATCH if batch is None else batch
    dims_in = INPUT_DIMS[size]
    model = DeepMultisetCCA(dims_in, HIDDEN, OUTPUT, EPS)
    inputs = tuple(features(batch, d) for d in dims_in)
    dims = {"batch": batch, "views": len(dims_in), "hidden": HIDDEN, "embedding": OUTPUT}
    dims |= {f"input_{i}": d for i, d in enumerate(dims_in)}
    return Workload(
        name="dmcca",
        size=size,
        model=model,
        example_inputs=inputs,
        dims=dims,
        tokens=None,
        description=(
            f"Deep multiset CCA: {len(dims_in)} MLP encoders (3x1024 ReLU -> 64) with a "
            "Cholesky-whitened multiset CCA loss."
        ),
        source="Somandepalli et al. 2019 (arXiv:1904.01775), Sec. 2 (multiset CCA objective)",
    )
