"""Hugging Face ``transformers`` models built from config objects: no weights, no network.

``transformers`` is not a meshplace dependency; install it beside meshplace to use this file
(``pip install transformers``). Each function constructs the config directly (no
``AutoConfig``, nothing downloaded), builds the model on the meta device (nothing allocated:
capture needs shapes only) and returns ``(model, (), {"input_ids": ..., "labels": ...})``;
the model computes its own loss from ``labels`` (``output.loss``, a real cross-entropy op in
the graph).

==============  ==========================================  =========  ===========
function        config (published shape)                    params     batch x seq
==============  ==========================================  =========  ===========
``gpt2``        GPT-2 small: 12 layers, d=768, 12 heads     124.4 M    1 x 1024
``llama``       Llama-2-7B: 32 layers, d=4096, FFN 11008    6.74 B     1 x 4096
``mixtral``     Mixtral-8x7B: 32 layers, 8 experts, top 2   46.7 B     1 x 4096
                (12.9 B active per token)
``t5``          T5-base v1.0: 12+12 layers, d=768           222.9 M    1 x 512 (+512)
==============  ==========================================  =========  ===========

Every function takes ``size="tiny"`` (and ``batch``/``seq``) for a model of the same family
that captures in a second or two (``tests/test_examples.py`` uses them).

Commands (from the repository root, with ``transformers`` importable)::

    meshplace graph examples/hf_models.py:gpt2              # ops, params, FLOPs, memory
    meshplace graph examples/hf_models.py:mixtral --json    # expert FLOPs at top-2 load
    meshplace graph examples/hf_models.py:llama --dtype bf16
    meshplace plan examples/hf_models.py:gpt2 --cluster colocrl-4gpu --placer heft,metis,pipeline
    meshplace plan examples/hf_models.py:llama --cluster dgx-h100 --dtype bf16 \\
        --objective throughput --placer pipeline --out llama.plan.json
    python examples/flops_check.py                          # params and FLOPs vs 6NT

A ``file.py:build`` capture is cached (the second ``plan`` of the same function and options
loads the graph). ``meshplace shard`` searches layouts of the reference workloads' named
dimensions only (``meshplace shard gpt --size 124m --cluster dgx-h100``); it does not take a
model file yet.

What is captured: attention is PyTorch's fused ``scaled_dot_product_attention`` (GPT-2's
attention dropout is captured as the fused kernel, ``meta['fused_attention_dropout']``);
Mixtral's experts run ``torch.nn.functional.grouped_mm`` (transformers' default expert
kernel), costed at the expected load, ``top_k / experts`` of the tokens per expert, with
the expert parameters listed in ``meta['expert_params']``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, tuple[()], dict[str, torch.Tensor]]


def _tokens(batch: int, seq: int, device: str) -> torch.Tensor:
    """Token ids of shape ``(batch, seq)`` (zeros: any valid id does for capture)."""
    return torch.zeros(batch, seq, dtype=torch.int64, device=device)


def _causal_lm(model_cls: Any, config: Any, batch: int, seq: int, device: str) -> Built:
    """A causal language model and its inputs; ``labels`` equal ``input_ids`` (Hugging Face
    shifts them inside the loss)."""
    with torch.device(device):
        model = model_cls(config)
    ids = _tokens(batch, seq, device)
    return model, (), {"input_ids": ids, "labels": ids.clone()}


def gpt2(
    *, size: str = "124m", batch: int = 1, seq: int | None = None, device: str = "meta"
) -> Built:
    """GPT-2 (Radford et al. 2019): ``124m`` (GPT-2 small, context 1024) or ``tiny``
    (2 layers, d=64); embeddings tied to the output projection, dropout 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shapes = {
        "124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "ctx": 1024},
        "tiny": {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 512,
            "ctx": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    }[size]
    ctx = shapes.pop("ctx")
    config = GPT2Config(n_positions=ctx, **shapes)
    return _causal_lm(GPT2LMHeadModel, config, batch, seq or ctx, device)


def llama(
    *, size: str = "7b", batch: int = 1, seq: int | None = None, device: str = "meta"
) -> Built:
    """Llama 2 (Touvron et al. 2023): ``7b`` (32 layers, d=4096, 32 heads, FFN 11008,
    vocabulary 32000, context 4096) or ``tiny`` (2 layers, d=64, grouped-query attention
    with 2 key/value heads); untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = {
        "7b": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 64,
        },
    }[size]
    config = LlamaConfig(tie_word_embeddings=False, **shapes)
    return _causal_lm(
        LlamaForCausalLM, config, batch, seq or shapes["max_position_embeddings"], device
    )


def mixtral(
    *, size: str = "8x7b", batch: int = 1, seq: int | None = None, device: str = "meta"
) -> Built:
    """Mixtral (Jiang et al. 2024): ``8x7b`` (32 layers, d=4096, 32 heads with 8 key/value
    heads, 8 SwiGLU experts of FFN 14336 per layer, top-2 routing, vocabulary 32000;
    sequence 4096 of its 32k context) or ``tiny`` (2 layers, d=64, 4 experts, top 2)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    shapes = {
        "8x7b": {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "vocab_size": 512,
            "max_position_embeddings": 64,
        },
    }[size]
    config = MixtralConfig(tie_word_embeddings=False, **shapes)
    default_seq = 4096 if size == "8x7b" else 64
    return _causal_lm(MixtralForCausalLM, config, batch, seq or default_seq, device)


def t5(
    *, size: str = "base", batch: int = 1, seq: int | None = None, device: str = "meta"
) -> Built:
    """T5 v1.0 (Raffel et al. 2020): ``base`` (12 encoder and 12 decoder layers, d=768,
    12 heads, FFN 3072, vocabulary 32128, 512 input and 512 target tokens) or ``tiny``
    (2+2 layers, d=64); the shared embedding is also the output projection.

    Returns ``(model, (), {"input_ids", "decoder_input_ids", "labels"})``: the decoder reads
    the targets shifted right by one (what T5 derives from ``labels`` when
    ``decoder_input_ids`` is absent), with encoder and decoder sequences of equal length.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    shapes = {
        "base": {
            "d_model": 768,
            "d_ff": 3072,
            "num_layers": 12,
            "num_heads": 12,
            "vocab_size": 32128,
        },
        "tiny": {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 512},
    }[size]
    length = seq or (512 if size == "base" else 64)
    config = T5Config(d_kv=shapes["d_model"] // shapes["num_heads"], **shapes)
    with torch.device(device):
        model = T5ForConditionalGeneration(config)
    ids = _tokens(batch, length, device)
    kwargs = {"input_ids": ids, "decoder_input_ids": ids.clone(), "labels": ids.clone()}
    return model, (), kwargs


def gpt2_tiny() -> Built:
    """:func:`gpt2` at ``size="tiny"``, on the CPU (for ``meshplace graph`` in tests)."""
    return gpt2(size="tiny", batch=2, seq=32, device="cpu")


def llama_tiny() -> Built:
    """:func:`llama` at ``size="tiny"``, on the CPU."""
    return llama(size="tiny", batch=2, seq=32, device="cpu")


def mixtral_tiny() -> Built:
    """:func:`mixtral` at ``size="tiny"``, on the CPU."""
    return mixtral(size="tiny", batch=2, seq=32, device="cpu")


def t5_tiny() -> Built:
    """:func:`t5` at ``size="tiny"``, on the CPU."""
    return t5(size="tiny", batch=4, seq=16, device="cpu")


#: The full-size functions, in the order ``flops_check.py`` reports them.
MODELS = ("gpt2", "llama", "mixtral", "t5")
