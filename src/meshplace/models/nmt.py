"""``nmt``: GNMT-style LSTM encoder-decoder with attention, unrolled with explicit cells.

Architecture after Wu et al. 2016, "Google's Neural Machine Translation System" (GNMT),
Sections 3-3.2 and Figure 1, at the depths used by the NMT benchmark of ColocRL (Mirhoseini et
al., ICML 2017, Section 4: 2-layer and 4-layer NMT with attention, batch 64):

* sizes ``2layer`` (default) and ``4layer``: that many encoder and that many decoder LSTM layers;
* LSTM width 1024 everywhere, embedding width 1024 (GNMT, Section 8.1);
* the bottom encoder layer is bidirectional (a forward and a backward cell of 1024 units whose
  outputs are concatenated to 2048); the other encoder layers are unidirectional;
* residual connections from the third layer up, in encoder and decoder (GNMT, Section 3.1);
* additive (Bahdanau) attention of width 1024 computed at every decoder step; the query is the
  bottom decoder layer's output of that step and the context vector is fed to every decoder
  layer above it (GNMT, Section 3 and Figure 1; the "GNMT v2" wiring of the TensorFlow NMT
  tutorial); the encoder's final states initialise the decoder's layers;
* separate source and target embeddings and a full softmax over a 32,000 wordpiece vocabulary
  (GNMT, Section 4.1, WMT En->De);
* source and target length 40 tokens (our choice; ColocRL does not give the lengths);
* loss: softmax cross-entropy over all target tokens.

Module paths: ``encoder.embedding``, ``encoder.lstm.0.fw``, ``encoder.lstm.0.bw``,
``encoder.lstm.1`` ..., ``decoder.embedding``, ``decoder.lstm.0`` ..., ``decoder.attention``
(with ``query_proj``, ``key_proj``, ``score``), ``decoder.softmax``.  Parameters: about 151 M
(``2layer``) and 193 M (``4layer``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, token_ids
from meshplace.models.lstm import LSTMCell

SIZES: tuple[str, ...] = ("2layer", "4layer")
DEFAULT_BATCH = 64

LAYERS = {"2layer": 2, "4layer": 4}
VOCAB = 32_000
HIDDEN = 1024
EMBED = 1024
ATTENTION = 1024
SRC_LEN = 40
TGT_LEN = 40
RESIDUAL_FROM = 2  # 0-based index of the first layer with a residual connection (GNMT: third)

State = tuple[torch.Tensor, torch.Tensor]


class BidirectionalLSTM(nn.Module):
    """The bidirectional bottom encoder layer: a forward cell ``fw`` and a backward cell ``bw``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        """Create the two direction cells, each ``hidden_size`` wide."""
        super().__init__()
        self.fw = LSTMCell(input_size, hidden_size)
        self.bw = LSTMCell(input_size, hidden_size)

    def forward(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], State]:
        """Run both directions over ``xs``; return the concatenated outputs and fw final state."""
        fw_state = self.fw.zero_state(xs[0])
        bw_state = self.bw.zero_state(xs[0])
        fw_out = []
        for x in xs:
            fw_state = self.fw(x, fw_state)
            fw_out.append(fw_state[0])
        bw_out = []
        for x in reversed(xs):
            bw_state = self.bw(x, bw_state)
            bw_out.append(bw_state[0])
        bw_out.reverse()
        outs = [torch.cat([f, b], dim=1) for f, b in zip(fw_out, bw_out, strict=True)]
        return outs, fw_state


class Encoder(nn.Module):
    """GNMT encoder: embedding, one bidirectional layer, then unidirectional residual layers."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int) -> None:
        """Create the source embedding and ``layers`` LSTM layers (the first bidirectional)."""
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        cells: list[nn.Module] = [BidirectionalLSTM(embed, hidden)]
        cells += [LSTMCell(2 * hidden if i == 1 else hidden, hidden) for i in range(1, layers)]
        self.lstm = nn.ModuleList(cells)

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, list[State]]:
        """Encode ``src`` ``(B, S)``; return outputs ``(B, S, hidden)`` and final states."""
        xs = list(self.embedding(src).unbind(1))
        xs, state = self.lstm[0](xs)
        finals = [state]
        for i in range(1, len(self.lstm)):
            cell = self.lstm[i]
            state = cell.zero_state(xs[0])
            ys = []
            for x in xs:
                state = cell(x, state)
                ys.append(state[0] + x if i >= RESIDUAL_FROM else state[0])
            xs = ys
            finals.append(state)
        return torch.stack(xs, dim=1), finals


class AdditiveAttention(nn.Module):
    """Bahdanau attention: ``score(q, k) = v . tanh(W_q q + W_k k)``, softmax over source steps."""

    def __init__(self, query_size: int, key_size: int, width: int) -> None:
        """Create the query and key projections and the scoring vector."""
        super().__init__()
        self.query_proj = nn.Linear(query_size, width, bias=False)
        self.key_proj = nn.Linear(key_size, width, bias=False)
        self.score = nn.Linear(width, 1, bias=False)

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Return the context ``(B, value_size)`` for ``query`` ``(B, q)`` over projected ``keys``.

        ``keys`` is ``key_proj(encoder_outputs)``, computed once per sequence with
        :meth:`project_keys`; ``values`` is the encoder outputs ``(B, S, value_size)``.
        """
        energy = torch.tanh(keys + self.query_proj(query).unsqueeze(1))
        weights = torch.softmax(self.score(energy).squeeze(2), dim=1)
        return torch.bmm(weights.unsqueeze(1), values).squeeze(1)

    def project_keys(self, memory: torch.Tensor) -> torch.Tensor:
        """Project the encoder outputs ``(B, S, key_size)`` once for all decoder steps."""
        return self.key_proj(memory)


class Decoder(nn.Module):
    """GNMT decoder: attention from the bottom layer's output feeds every layer above it."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, attention: int) -> None:
        """Create the target embedding, ``layers`` LSTM cells, the attention and the softmax."""
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.ModuleList(
            LSTMCell(embed if i == 0 else 2 * hidden, hidden) for i in range(layers)
        )
        self.attention = AdditiveAttention(hidden, hidden, attention)
        self.softmax = nn.Linear(hidden, vocab)

    def forward(
        self, tgt_in: torch.Tensor, memory: torch.Tensor, init: list[State]
    ) -> torch.Tensor:
        """Return logits ``(B, T, vocab)`` for teacher-forced ``tgt_in`` ``(B, T)``."""
        keys = self.attention.project_keys(memory)
        states = list(init)
        outputs = []
        for x in self.embedding(tgt_in).unbind(1):
            states[0] = self.lstm[0](x, states[0])
            below = states[0][0]
            context = self.attention(below, keys, memory)
            for i in range(1, len(self.lstm)):
                states[i] = self.lstm[i](torch.cat([below, context], dim=1), states[i])
                out = states[i][0]
                below = out + below if i >= RESIDUAL_FROM else out
            outputs.append(below)
        return self.softmax(torch.stack(outputs, dim=1))


class GNMT(nn.Module):
    """Encoder-decoder translation model trained with teacher forcing."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, attention: int) -> None:
        """Create an encoder and a decoder of ``layers`` LSTM layers each."""
        super().__init__()
        self.encoder = Encoder(vocab, embed, hidden, layers)
        self.decoder = Decoder(vocab, embed, hidden, layers, attention)

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
    ) -> torch.Tensor:
        """Return the mean cross-entropy of predicting ``tgt_out`` from ``src`` and ``tgt_in``."""
        memory, finals = self.encoder(src)
        logits = self.decoder(tgt_in, memory, finals)
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())


def build(size: str = "2layer", batch: int | None = None) -> Workload:
    """Build the ``nmt`` workload (``2layer`` or ``4layer``) on the current device."""
    batch = DEFAULT_BATCH if batch is None else batch
    layers = LAYERS[size]
    model = GNMT(VOCAB, EMBED, HIDDEN, layers, ATTENTION)
    inputs = (token_ids(batch, SRC_LEN), token_ids(batch, TGT_LEN), token_ids(batch, TGT_LEN))
    return Workload(
        name="nmt",
        size=size,
        model=model,
        example_inputs=inputs,
        dims={
            "batch": batch,
            "seq": TGT_LEN,
            "src_seq": SRC_LEN,
            "tgt_seq": TGT_LEN,
            "vocab": VOCAB,
            "embed": EMBED,
            "hidden": HIDDEN,
            "attention": ATTENTION,
            "layers": layers,
        },
        tokens=batch * TGT_LEN,
        description=(
            f"GNMT-style {layers}+{layers}-layer LSTM-1024 encoder-decoder with additive "
            "attention, 40 source and 40 target steps."
        ),
        source=(
            "Wu et al. 2016 (GNMT), Sec. 3 and Fig. 1; Mirhoseini et al. 2017 (ColocRL), "
            "Sec. 4 NMT (2- and 4-layer, batch 64)"
        ),
    )
