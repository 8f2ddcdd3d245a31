"""``gpt``: GPT-2 / GPT-3 style decoder-only language models.

Architecture of Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"
(Section 2.3 and Table 2) as also used by Brown et al. 2020, "Language Models are Few-Shot
Learners" (Table 2.1): learned token and position embeddings, pre-LayerNorm blocks
(``x + Attn(LN(x))``, ``x + MLP(LN(x))``) with a final LayerNorm, causal multi-head
self-attention with a fused q/k/v projection, a 4x GELU (tanh approximation) MLP, and an output
softmax tied to the token embedding.  Vocabulary 50,257, context 1024, dropout 0.1 on the
residual branches and embeddings as in GPT-2, default batch 8 sequences of 1024 tokens.

One deliberate difference from GPT-2: no dropout on the attention *weights* (GPT-2 used 0.1).
With it, PyTorch (and most kernels) cannot use a fused causal attention kernel and fall back
to materialising the full score matrix, mask and dropout mask; fused kernels
(FlashAttention) are how these models are trained today, and they skip the masked half of
the scores, which the FLOP count reflects.

| size | layers | d_model | heads | source                       | parameters    |
|------|--------|---------|-------|------------------------------|---------------|
| 124m | 12     | 768     | 12    | GPT-2 small, Radford Table 2 | 124,439,808   |
| 350m | 24     | 1024    | 16    | GPT-2 medium                 | 354,823,168   |
| 774m | 36     | 1280    | 20    | GPT-2 large                  | 774,030,080   |
| 1.5b | 48     | 1600    | 25    | GPT-2 XL                     | 1,557,611,200 |
| 2.7b | 32     | 2560    | 32    | GPT-3 2.7B, Brown Table 2.1  | 2,648,931,840 |
| 6.7b | 32     | 4096    | 32    | GPT-3 6.7B, Brown Table 2.1  | 6,654,210,048 |
| 13b  | 40     | 5120    | 40    | GPT-3 13B, Brown Table 2.1   | 12,853,534,720 |
| 175b | 96     | 12288   | 96    | GPT-3 175B, Brown Table 2.1  | 174,591,676,416 |

GPT-3 trains with a 2048-token context (Table 2.1); here every size uses context 1024 so that the
sizes share one sequence length (a 2048 context would add 2.6 M / 4.2 M position-embedding
parameters to ``2.7b`` / ``6.7b``).  GPT-3 13B's table row prints ``d_model`` 5140 beside 40
heads of 128; ``13b`` uses 5120 = 40 x 128, as OPT-13B and Megatron-LM's 13B configuration
do.  GPT-3's alternating sparse attention is not modelled (dense attention everywhere).

Module paths: ``embedding``, ``position_embedding``, ``layers.N.ln_1``, ``layers.N.attn``
(``qkv``, ``proj``), ``layers.N.ln_2``, ``layers.N.mlp`` (``fc``, ``proj``), ``ln_f``, ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshplace.models.base import Workload, token_ids

SIZES: tuple[str, ...] = ("124m", "350m", "774m", "1.5b", "2.7b", "6.7b", "13b", "175b")
DEFAULT_BATCH = 8

VOCAB = 50_257
CONTEXT = 1024
DROPOUT = 0.1


@dataclass(frozen=True)
class Config:
    """Depth and width of one size."""

    layers: int
    d_model: int
    heads: int


CONFIGS = {
    "124m": Config(12, 768, 12),
    "350m": Config(24, 1024, 16),
    "774m": Config(36, 1280, 20),
    "1.5b": Config(48, 1600, 25),
    "2.7b": Config(32, 2560, 32),
    "6.7b": Config(32, 4096, 32),
    "13b": Config(40, 5120, 40),
    "175b": Config(96, 12288, 96),
}


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention: fused ``qkv`` projection, SDPA, output ``proj``."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        """Create the projections for ``heads`` heads of width ``d_model // heads``."""
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally within ``x`` ``(B, T, d_model)``."""
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with a 4x hidden width."""

    def __init__(self, d_model: int) -> None:
        """Create ``fc`` (d -> 4d) and ``proj`` (4d -> d)."""
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        """Create ``ln_1``, ``attn``, ``ln_2`` and ``mlp``."""
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        # No dropout on the attention weights: it keeps attention one fused kernel
        # (FlashAttention-style), which is how it is trained today; see the module docstring.
        self.attn = CausalSelfAttention(d_model, heads, 0.0)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the residual attention and MLP sub-blocks."""
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only language model; ``forward`` returns the next-token cross-entropy."""

    def __init__(self, cfg: Config, vocab: int = VOCAB, context: int = CONTEXT) -> None:
        """Create embeddings, ``cfg.layers`` blocks, the final norm and the tied ``lm_head``."""
        super().__init__()
        self.embedding = nn.Embedding(vocab, cfg.d_model)
        self.position_embedding = nn.Embedding(context, cfg.d_model)
        self.dropout = nn.Dropout(DROPOUT)
        self.layers = nn.ModuleList(
            Block(cfg.d_model, cfg.heads, DROPOUT) for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of ``targets`` given ``ids`` (both ``(B, T)``)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.embedding(ids) + self.position_embedding(positions))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(size: str = "124m", batch: int | None = None, layers: int | None = None) -> Workload:
    """Build the ``gpt`` workload of the given size on the current device; ``layers``
    overrides the size's depth (the hybrid search captures a few layers of a deep model
    and scales them, :mod:`meshplace.parallel.hybrid`)."""
    cfg = CONFIGS[size]
    if layers is not None:
        cfg = Config(int(layers), cfg.d_model, cfg.heads)
    batch = DEFAULT_BATCH if batch is None else batch
    model = GPT(cfg)
    inputs = (token_ids(batch, CONTEXT), token_ids(batch, CONTEXT))
    return Workload(
        name="gpt",
        size=size,
        model=model,
        example_inputs=inputs,
        dims={
            "batch": batch,
            "seq": CONTEXT,
            "d_model": cfg.d_model,
            "d_ff": 4 * cfg.d_model,
            "heads": cfg.heads,
            "d_kv": cfg.d_model // cfg.heads,
            "layers": cfg.layers,
            "vocab": VOCAB,
        },
        tokens=batch * CONTEXT,
        description=(
            f"GPT-{size} decoder-only LM: {cfg.layers} layers, d_model {cfg.d_model}, "
            f"{cfg.heads} heads, context {CONTEXT}."
        ),
        source=(
            "Radford et al. 2019, Table 2 (GPT-2 sizes); Brown et al. 2020, Table 2.1 "
            "(GPT-3 2.7B, 6.7B, 13B and 175B)"
        ),
    )
