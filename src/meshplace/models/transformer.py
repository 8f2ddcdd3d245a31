"""``transformer``: the Transformer of Vaswani et al. 2017 and the Mesh-TensorFlow 5B LM.

Sizes ``base`` (default) and ``big`` follow Vaswani et al. 2017, "Attention Is All You Need",
Table 3 and Sections 3 and 5.4: an encoder-decoder with 6 encoder and 6 decoder layers,
post-norm residual sub-layers (``LayerNorm(x + Dropout(Sublayer(x)))``), ReLU feed-forward
networks, sinusoidal position encodings, embeddings scaled by ``sqrt(d_model)`` and one weight
matrix shared by the source embedding, the target embedding and the pre-softmax projection
(Section 3.4), over the 37,000-token shared BPE vocabulary of WMT 2014 English-German
(Section 5.1).  Training loss: cross-entropy with label smoothing 0.1 (Section 5.4).

* ``base``: d_model 512, d_ff 2048, 8 heads (d_kv 64), dropout 0.1: 63.1 M parameters (paper: 65 M);
* ``big``: d_model 1024, d_ff 4096, 16 heads (d_kv 64), dropout 0.3 (the EN-DE big model):
  214.2 M parameters (paper: 213 M);
* workload: batch 64 sentence pairs of 128 source and 128 target tokens (our choice; the paper
  batches about 25,000 source plus 25,000 target tokens).  Source and target have no padding, so
  attention uses ``scaled_dot_product_attention`` without masks, causal in decoder self-attention.

Size ``mtf-5b`` is the largest language model of Shazeer et al. 2018, "Mesh-TensorFlow: Deep
Learning for Supercomputers", Section 6 / Table 2 (tensor2tensor ``mtf_transformer_paper_lm(5)``
on ``languagemodel_lm1b32k_packed``): a decoder-only model with 6 layers, d_model 1024, d_ff
262,144, 256 heads with d_kv 256 (attention width 65,536, not d_model), a 32,000-token vocabulary,
separate (untied) input embedding and softmax weights, learned position embeddings, batch 256 of
256 tokens.  As in Mesh-TensorFlow's layer stack it is pre-norm with scale-only RMS normalisation
(and a final norm), its dense layers have no biases, and dropout is 0.1 on sub-layer outputs,
attention weights and the ReLU activations; no label smoothing: 4,897,649,664 parameters (paper:
4.9 B; 13 norm scales of 1024 are included).

Module paths: ``embedding``, ``encoder.layers.3.self_attn`` (with ``q_proj``/``k_proj``/
``v_proj``/``out_proj``), ``encoder.layers.3.ffn`` (``fc1``/``fc2``),
``decoder.layers.0.cross_attn``, ``decoder.layers.0.ffn``, ``softmax`` (and
``position_embedding``, ``decoder.norm`` for ``mtf-5b``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, token_ids

SIZES: tuple[str, ...] = ("base", "big", "mtf-5b")
# "5b" is how the Mesh-TensorFlow paper and `meshplace shard` users name mtf-5b.
SIZE_ALIASES: dict[str, str] = {"5b": "mtf-5b"}


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of one size."""

    d_model: int
    d_ff: int
    heads: int
    d_kv: int
    layers: int
    vocab: int
    dropout: float
    batch: int
    seq: int


CONFIGS = {
    "base": Config(512, 2048, 8, 64, 6, 37_000, 0.1, 64, 128),
    "big": Config(1024, 4096, 16, 64, 6, 37_000, 0.3, 64, 128),
    "mtf-5b": Config(1024, 262_144, 256, 256, 6, 32_000, 0.1, 256, 256),
}
LABEL_SMOOTHING = 0.1


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate q/k/v/out projections and fused SDPA.

    The attention width is ``heads * d_kv``, which may differ from ``d_model``.
    """

    def __init__(
        self, d_model: int, heads: int, d_kv: int, *, bias: bool = True, dropout: float = 0.0
    ) -> None:
        """Create the four projections; ``dropout`` applies to the attention weights."""
        super().__init__()
        self.heads = heads
        self.d_kv = d_kv
        self.dropout = dropout
        inner = heads * d_kv
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.d_kv).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, *, causal: bool = False
    ) -> torch.Tensor:
        """Attend from ``x`` ``(B, T, d)`` to ``memory`` (``x`` itself for self-attention)."""
        memory = x if memory is None else memory
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(memory))
        v = self._split(self.v_proj(memory))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        batch, length, _ = x.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, length, self.heads * self.d_kv))


class FeedForward(nn.Module):
    """Position-wise ``fc2(dropout(relu(fc1(x))))``."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = True, dropout: float = 0.0) -> None:
        """Create ``fc1`` (d_model -> d_ff) and ``fc2`` (d_ff -> d_model)."""
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the two linear maps with a ReLU between them."""
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class EncoderLayer(nn.Module):
    """Post-norm encoder layer: self-attention and feed-forward sub-layers."""

    def __init__(self, cfg: Config) -> None:
        """Create the sub-layers and their layer norms."""
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_kv)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``LayerNorm(x + Dropout(Sublayer(x)))`` for both sub-layers."""
        x = self.self_attn_norm(x + self.dropout(self.self_attn(x)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Post-norm decoder layer: causal self-attention, cross-attention and feed-forward."""

    def __init__(self, cfg: Config) -> None:
        """Create the sub-layers and their layer norms."""
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_kv)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_kv)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Apply the three sub-layers to ``x`` given the encoder output ``memory``."""
        x = self.self_attn_norm(x + self.dropout(self.self_attn(x, causal=True)))
        x = self.cross_attn_norm(x + self.dropout(self.cross_attn(x, memory)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class Encoder(nn.Module):
    """A stack of :class:`EncoderLayer` (``encoder.layers.N``)."""

    def __init__(self, cfg: Config) -> None:
        """Create ``cfg.layers`` encoder layers."""
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the layers in order."""
        for layer in self.layers:
            x = layer(x)
        return x


class Decoder(nn.Module):
    """A stack of :class:`DecoderLayer` (``decoder.layers.N``)."""

    def __init__(self, cfg: Config) -> None:
        """Create ``cfg.layers`` decoder layers."""
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Run the layers in order, each attending to ``memory``."""
        for layer in self.layers:
            x = layer(x, memory)
        return x


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """Return the ``(length, d_model)`` sine/cosine position encodings of Section 3.5."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


class Transformer(nn.Module):
    """Encoder-decoder Transformer; ``forward`` returns the label-smoothed training loss."""

    def __init__(self, cfg: Config, max_len: int, label_smoothing: float = LABEL_SMOOTHING) -> None:
        """Create the shared embedding, the encoder, the decoder and the tied softmax."""
        super().__init__()
        self.d_model = cfg.d_model
        self.label_smoothing = label_smoothing
        self.embedding = nn.Embedding(cfg.vocab, cfg.d_model)
        self.register_buffer(
            "positional_encoding", sinusoidal_positions(max_len, cfg.d_model), persistent=False
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.softmax = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.softmax.weight = self.embedding.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embedding plus position encoding, with dropout."""
        x = self.embedding(ids) * math.sqrt(self.d_model)
        return self.dropout(x + self.positional_encoding[: ids.shape[1]])

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
    ) -> torch.Tensor:
        """Return the cross-entropy of predicting ``tgt_out`` from ``src`` and ``tgt_in``."""
        memory = self.encoder(self.embed(src))
        logits = self.softmax(self.decoder(self.embed(tgt_in), memory))
        return F.cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), label_smoothing=self.label_smoothing
        )


class PreNormDecoderLayer(nn.Module):
    """Mesh-TensorFlow layer pair: ``x + Dropout(Attn(Norm(x)))`` then the same with the FFN."""

    def __init__(self, cfg: Config) -> None:
        """Create bias-free attention and feed-forward sub-layers with RMS norms."""
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.self_attn = MultiHeadAttention(
            cfg.d_model, cfg.heads, cfg.d_kv, bias=False, dropout=cfg.dropout
        )
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, bias=False, dropout=cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the causal self-attention and the feed-forward sub-layers."""
        x = x + self.dropout(self.self_attn(self.self_attn_norm(x), causal=True))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class PreNormDecoder(nn.Module):
    """Stack of :class:`PreNormDecoderLayer` (``decoder.layers.N``) with a final ``norm``."""

    def __init__(self, cfg: Config) -> None:
        """Create ``cfg.layers`` layers and the final RMS norm."""
        super().__init__()
        self.layers = nn.ModuleList(PreNormDecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the layers, then the final norm and dropout."""
        for layer in self.layers:
            x = layer(x)
        return self.dropout(self.norm(x))


class MeshTransformerLM(nn.Module):
    """Decoder-only language model of Mesh-TensorFlow; ``forward`` returns the training loss."""

    def __init__(self, cfg: Config, max_len: int) -> None:
        """Create untied input embedding and softmax, learned positions and the decoder."""
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.d_model)
        self.position_embedding = nn.Embedding(max_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.decoder = PreNormDecoder(cfg)
        self.softmax = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of ``targets`` given ``ids`` (both ``(B, T)``)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.embedding(ids) + self.position_embedding(positions))
        logits = self.softmax(self.decoder(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(size: str = "base", batch: int | None = None) -> Workload:
    """Build the ``transformer`` workload (``base``, ``big``, ``mtf-5b``) on the current device."""
    cfg = CONFIGS[size]
    batch = cfg.batch if batch is None else batch
    dims = {
        "batch": batch,
        "seq": cfg.seq,
        "d_model": cfg.d_model,
        "d_ff": cfg.d_ff,
        "heads": cfg.heads,
        "d_kv": cfg.d_kv,
        "layers": cfg.layers,
        "vocab": cfg.vocab,
    }
    if size == "mtf-5b":
        model: nn.Module = MeshTransformerLM(cfg, max_len=cfg.seq)
        inputs: tuple = (token_ids(batch, cfg.seq), token_ids(batch, cfg.seq))
        description = (
            "Mesh-TensorFlow 4.9B decoder-only LM: 6 layers, d_model 1024, d_ff 262144, "
            "256 heads x 256."
        )
        source = (
            "Shazeer et al. 2018 (Mesh-TensorFlow), Sec. 6 and Table 2; "
            "tensor2tensor mtf_transformer_paper_lm(5)"
        )
    else:
        model = Transformer(cfg, max_len=cfg.seq)
        inputs = tuple(token_ids(batch, cfg.seq) for _ in range(3))
        dims |= {"src_seq": cfg.seq, "tgt_seq": cfg.seq}
        description = (
            f"Transformer-{size} encoder-decoder ({cfg.layers}+{cfg.layers} layers, d_model "
            f"{cfg.d_model}), 128 source and 128 target tokens."
        )
        source = "Vaswani et al. 2017, Table 3 (Transformer " + size + ") and Sec. 3, 5.4"
    return Workload(
        name="transformer",
        size=size,
        model=model,
        example_inputs=inputs,
        dims=dims,
        tokens=batch * cfg.seq,
        description=description,
        source=source,
    )
