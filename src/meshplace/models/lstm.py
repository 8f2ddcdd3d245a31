"""Explicit LSTM cell shared by the recurrent workloads (``rnnlm`` and ``nmt``).

The recurrent workloads never use ``torch.nn.LSTM``: they unroll the recurrence with a Python
loop over time steps and call :class:`LSTMCell` once per step and layer, so every cell of the
time x layer grid becomes its own group of ops in a traced graph (the structure that device
placement work such as Mirhoseini et al., ICML 2017, exploits).

The cell is the standard LSTM without peepholes (Hochreiter & Schmidhuber 1997; the formulation
of Zaremba et al. 2014, Section 3): one affine map computes the four gates from ``[x, h]``::

    i, f, g, o = split(W [x; h] + b, 4)
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')
"""

from __future__ import annotations

import torch
from torch import nn


class LSTMCell(nn.Module):
    """One LSTM cell step: a single ``nn.Linear`` (``gates``) on ``[x, h]`` then the gate math."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        """Create the cell for ``input_size``-wide inputs and a ``hidden_size``-wide state."""
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.gates = nn.Linear(input_size + hidden_size, 4 * hidden_size)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance one time step: ``x`` is ``(batch, input_size)``, ``state`` is ``(h, c)``."""
        h, c = state
        z = self.gates(torch.cat([x, h], dim=1))
        i, f, g, o = z.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c

    def zero_state(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return an all-zero ``(h, c)`` for the batch of ``like`` (on its device and dtype)."""
        batch = like.shape[0]
        h = like.new_zeros(batch, self.hidden_size)
        c = like.new_zeros(batch, self.hidden_size)
        return h, c

    def extra_repr(self) -> str:
        """Show the input and hidden widths in ``print(model)``."""
        return f"input_size={self.input_size}, hidden_size={self.hidden_size}"
