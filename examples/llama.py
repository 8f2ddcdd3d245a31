"""A Llama-style decoder in plain PyTorch: meshplace's model-file example.

RMSNorm before attention and MLP, rotary position embeddings, grouped-query attention
through ``scaled_dot_product_attention`` (``enable_gqa``, causal), a SwiGLU MLP, untied
(Llama 2) or tied input and output embeddings, and a next-token cross-entropy loss: a
``build`` function returns ``(model, args, kwargs)`` with the token ids as ``args`` and the
``labels`` as a keyword input, and the model returns the loss, as Hugging Face models do.

Sizes (:data:`CONFIGS`): ``tiny`` (for tests: 2 layers, d=64, 0.13 M parameters),
``llama2-7b`` (Touvron et al. 2023, Table 1 / the released ``config.json``: d=4096, 32
layers, 32 heads, FFN 11008, vocabulary 32000; 6.74 B parameters) and ``llama2-70b`` (d=8192,
80 layers, 64 heads with 8 key/value heads, FFN 28672; 68.98 B). The large ones are built
on the meta device, so capturing them allocates no parameter memory.

Commands (from the repository root)::

    meshplace graph examples/llama.py:build_tiny              # ops, params, FLOPs, memory
    meshplace graph examples/llama.py:build_7b --json         # Llama-2-7B, batch 1 x 4096
    meshplace graph examples/llama.py:build_70b --dtype bf16  # 70B, costed in bf16
    meshplace plan examples/llama.py:build_tiny --cluster colocrl-4gpu --placer heft,metis
    meshplace plan examples/llama.py:build_7b --cluster dgx-h100 --dtype bf16 \\
        --objective throughput --placer pipeline --out llama7b.plan.json
    meshplace simulate --graph examples/llama.py:build_7b --cluster dgx-h100 \\
        --plan llama7b.plan.json --dtype bf16 --objective throughput

The first capture of a ``file.py:build`` is cached, so the ``plan`` and ``simulate`` after a
``graph`` load the graph instead of tracing it again (``--no-cache`` re-captures).
``meshplace shard`` searches Mesh-TensorFlow layouts of the reference workloads' named
dimensions (``meshplace shard gpt --size 6.7b --cluster dgx-h100``) and does not take a model
file yet; the closest reference model to this one is ``gpt``.

From Python::

    >>> import meshplace
    >>> model, args, kwargs = build_tiny()
    >>> graph = meshplace.capture(model, args, example_kwargs=kwargs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder's shape and the example batch.

    Attributes:
        vocab: vocabulary size.
        d_model: hidden size.
        n_layers: decoder blocks.
        n_heads: query heads; ``d_model`` must divide by it.
        n_kv_heads: key/value heads (grouped-query attention; ``n_heads`` for multi-head).
        d_ff: SwiGLU hidden size.
        seq: sequence length of the example batch (and of the rotary tables).
        batch: sequences in the example batch.
        tie_embeddings: use the input embedding as the output projection.
        rope_theta: rotary embedding base.
        norm_eps: RMSNorm epsilon.
    """

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    seq: int
    batch: int = 1
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.n_heads

    @property
    def tokens(self) -> int:
        """Tokens in the example batch (``batch * seq``)."""
        return self.batch * self.seq


#: The sizes :func:`build` knows.
CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq=32, batch=2
    ),
    "llama2-7b": LlamaConfig(
        vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, seq=4096
    ),
    "llama2-70b": LlamaConfig(
        vocab=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, seq=4096
    ),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019) with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dimension."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(seq, head_dim)`` for rotary embeddings (Su et al. 2021),
    in the half-split layout Llama's Hugging Face port uses."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, seq, head_dim) by the position angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output for ``x`` (batch, seq, d_model)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """The gated MLP of Llama: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output for ``x``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm decoder block: attention and MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x``."""
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    """A Llama-style causal language model that returns its training loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.seq, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``labels`` (batch, seq) given ``input_ids``
        (labels are already shifted: ``labels[:, t]`` is the token after ``input_ids[:,
        t]``)."""
        s = input_ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(
    size: str = "tiny", *, device: str | torch.device | None = None
) -> tuple[Llama, tuple[torch.Tensor], dict[str, Any]]:
    """``(model, (input_ids,), {"labels": labels})`` for the :data:`CONFIGS` entry ``size``.

    ``device`` defaults to ``meta`` for every size but ``tiny`` (real parameters): a meta
    model allocates nothing, and capture needs only shapes.
    """
    cfg = CONFIGS[size]
    device = device if device is not None else ("cpu" if size == "tiny" else "meta")
    with torch.device(device):
        model = Llama(cfg)
        input_ids = torch.zeros(cfg.batch, cfg.seq, dtype=torch.int64)
        labels = torch.zeros(cfg.batch, cfg.seq, dtype=torch.int64)
    return model, (input_ids,), {"labels": labels}


def build_tiny() -> tuple[Llama, tuple[torch.Tensor], dict[str, Any]]:
    """The ``tiny`` size: 2 layers, d=64, batch 2 x 32 tokens (for tests)."""
    return build("tiny")


def build_7b() -> tuple[Llama, tuple[torch.Tensor], dict[str, Any]]:
    """Llama-2-7B on the meta device, one sequence of 4096 tokens."""
    return build("llama2-7b")


def build_70b() -> tuple[Llama, tuple[torch.Tensor], dict[str, Any]]:
    """Llama-2-70B (grouped-query attention, 8 KV heads) on the meta device, one sequence of
    4096 tokens."""
    return build("llama2-70b")


def parameter_count(cfg: LlamaConfig) -> int:
    """Parameters of :class:`Llama` for ``cfg`` in closed form (the tests compare it with
    the capture)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    attn = cfg.d_model * (cfg.n_heads * cfg.head_dim) * 2 + cfg.d_model * kv * 2
    block = attn + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model
    embeddings = cfg.vocab * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * block + cfg.d_model + embeddings


def flops_estimate(cfg: LlamaConfig) -> dict[str, float]:
    """The rule-of-thumb training FLOPs of one step: ``6 N T`` with N the parameters that
    multiply every token (all but the input embedding, a lookup; a tied table is the
    output projection and counts), and Kaplan et al. (2020, Table 1)'s attention term,
    ``6 n_layers seq d_attn`` per token for causal attention (half the score matrix)."""
    n = parameter_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab * cfg.d_model)
    six_nt = 6.0 * n * cfg.tokens
    attention = 6.0 * cfg.n_layers * cfg.seq * cfg.n_heads * cfg.head_dim * cfg.tokens
    return {"n": float(n), "six_nt": six_nt, "with_attention": six_nt + attention}


if __name__ == "__main__":  # pragma: no cover - a quick look without the CLI
    for name, config in CONFIGS.items():
        print(f"{name}: {parameter_count(config):,} parameters, {config.tokens} tokens")
