"""``rnnlm``: a 2-layer LSTM language model, unrolled over time with explicit cells.

Config (size ``default``), after the RNNLM benchmark of ColocRL (Mirhoseini et al., "Device
Placement Optimization with Reinforcement Learning", ICML 2017, Section 4), which trains the
multi-layer LSTM language models of Zaremba et al. 2014 and Jozefowicz et al. 2016:

* batch 64 (ColocRL);
* 2 LSTM layers of 2048 hidden units (the LSTM-2048 width of Jozefowicz et al. 2016, Table 1,
  here without the projection layer);
* embedding width 2048 (equal to the hidden width);
* 35 unrolled time steps (Zaremba et al. 2014, medium and large models);
* vocabulary 40,000 words (our choice: ColocRL does not give the vocabulary, and the 793k-word
  LM1B vocabulary of Jozefowicz et al. needs a sampled softmax that this workload does not model);
* full softmax cross-entropy over every step, averaged over ``batch * seq`` tokens.

Module paths: ``embedding``, ``lstm.0``, ``lstm.1`` (each an :class:`LSTMCell` called once per
step), ``softmax``.  About 231 M parameters.  The recurrence is a Python loop, so a traced graph
holds ``layers * seq`` cell instances arranged as a grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, token_ids
from meshplace.models.lstm import LSTMCell

SIZES: tuple[str, ...] = ("default",)
DEFAULT_BATCH = 64

VOCAB = 40_000
EMBED = 2048
HIDDEN = 2048
LAYERS = 2
SEQ = 35


class RNNLanguageModel(nn.Module):
    """Stacked-LSTM language model unrolled over ``seq`` steps with explicit :class:`LSTMCell`s."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int) -> None:
        """Create the embedding, ``layers`` LSTM cells and the output softmax layer."""
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.ModuleList(
            LSTMCell(embed if i == 0 else hidden, hidden) for i in range(layers)
        )
        self.softmax = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of ``targets`` given ``ids`` (both ``(B, T)``)."""
        x = self.embedding(ids)
        states = [cell.zero_state(x) for cell in self.lstm]
        outputs = []
        for x_t in x.unbind(1):
            h = x_t
            for i, cell in enumerate(self.lstm):
                states[i] = cell(h, states[i])
                h = states[i][0]
            outputs.append(h)
        logits = self.softmax(torch.stack(outputs, dim=1))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(size: str = "default", batch: int | None = None) -> Workload:
    """Build the ``rnnlm`` workload (the only size is ``default``) on the current device."""
    del size
    batch = DEFAULT_BATCH if batch is None else batch
    model = RNNLanguageModel(VOCAB, EMBED, HIDDEN, LAYERS)
    inputs = (token_ids(batch, SEQ), token_ids(batch, SEQ))
    return Workload(
        name="rnnlm",
        size="default",
        model=model,
        example_inputs=inputs,
        dims={
            "batch": batch,
            "seq": SEQ,
            "vocab": VOCAB,
            "embed": EMBED,
            "hidden": HIDDEN,
            "layers": LAYERS,
        },
        tokens=batch * SEQ,
        description="2-layer LSTM-2048 language model unrolled over 35 steps, full softmax.",
        source=(
            "Mirhoseini et al. 2017 (ColocRL), Sec. 4 RNNLM; Zaremba et al. 2014 (35 steps); "
            "Jozefowicz et al. 2016, Table 1 (LSTM-2048)"
        ),
    )
