"""Tiny models of the common decoder architectures, built locally: ``builtin:tiny-<arch>``.

Each is a randomly initialised causal LM of one Hugging Face architecture (Llama, Qwen3, Mistral,
Gemma2, Phi3, OLMo2; Qwen2 is ``builtin:tiny-qwen2`` in ``builtin``), built from transformers'
own config class with the project's tokenizer (``builtin.build_tokenizer``, 262 tokens, ChatML),
so every task, reward and engine that runs on tiny-qwen2 runs on them too. They exist to show
that the learners, the engines and the weight path handle what differs between architectures:
fused projections (Phi3's ``qkv_proj``/``gate_up_proj``), tied and untied heads (Gemma2's head
is always its embedding in vLLM), QK norms (Qwen3, OLMo2), logit soft-capping and sliding
windows (Gemma2), a model vLLM serves through its Transformers backend (OLMo2).

Shape: hidden 128, 4 heads of 32 (2 key/value heads), 2 layers, 256 positions: head size 32 is
the smallest vLLM's CPU attention serves (``CPUAttentionBackend.get_supported_head_sizes``:
32, 64, 80, ...). Their outputs mean nothing; they are for tests and for trying an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "seed": 0,
}

ARCH_SPECS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"config": "LlamaConfig", "model": "LlamaForCausalLM", **_SHAPE, "tie_word_embeddings": False},
    "tiny-qwen3": {"config": "Qwen3Config", "model": "Qwen3ForCausalLM", **_SHAPE, "head_dim": 32,
                   "tie_word_embeddings": True},
    "tiny-mistral": {"config": "MistralConfig", "model": "MistralForCausalLM", **_SHAPE, "head_dim": 32,
                     "sliding_window": None, "tie_word_embeddings": False},
    # Gemma2's head_dim and attention scale are fields of their own (defaults: 256 and 256); its
    # sliding window (defaults 4096) is kept shorter than the context so that path is exercised.
    "tiny-gemma2": {"config": "Gemma2Config", "model": "Gemma2ForCausalLM", **_SHAPE, "head_dim": 32,
                    "query_pre_attn_scalar": 32, "sliding_window": 128, "tie_word_embeddings": True},
    "tiny-phi3": {"config": "Phi3Config", "model": "Phi3ForCausalLM", **_SHAPE, "tie_word_embeddings": False},
    "tiny-olmo2": {"config": "Olmo2Config", "model": "Olmo2ForCausalLM", **_SHAPE, "tie_word_embeddings": False},
    # A mixture of experts: 8 routed experts a layer, 2 per token (top-k softmax routing,
    # renormalised over the 2 as Qwen3-MoE does), each expert half the dense width, so a token's
    # active MLP is as wide as the dense models'; 4 layers as tiny-qwen2, every one sparse.
    "tiny-qwen3-moe": {"config": "Qwen3MoeConfig", "model": "Qwen3MoeForCausalLM", **_SHAPE, "head_dim": 32,
                       "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
                       "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
}
"""``{builtin name: spec}``: the transformers config and model class names, the config fields,
and ``seed`` (of the initialisation). Part of each artefact's cache key: a change rebuilds it."""


def _head_size(config) -> int:
    """The attention head size of a Hugging Face config: its ``head_dim`` field where it has one
    (Gemma2, Qwen3, Mistral; ``None`` in some configs means the default), else
    ``hidden_size // num_attention_heads`` (the rule of Llama-style models)."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size) // int(config.num_attention_heads)


def build_arch(out_dir: Path, spec: dict[str, Any], build_tokenizer: Callable[[Path], Any]) -> None:
    """Write a randomly initialised model of ``spec`` (an ``ARCH_SPECS`` value), its generation
    config and the tokenizer ``build_tokenizer(out_dir)`` writes (``builtin.build_tokenizer``,
    passed in so this module imports nothing of ``builtin``, which registers it) to ``out_dir``;
    float32 weights, safetensors.

    Raises:
        ValueError: a spec whose head size differs from 32 would not be served by vLLM's CPU
            attention; this module promises models every engine serves.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    spec = dict(spec)
    seed = spec.pop("seed")
    config_cls, model_cls = getattr(transformers, spec.pop("config")), getattr(transformers, spec.pop("model"))
    tokenizer = build_tokenizer(out_dir)
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32", **spec)
    if _head_size(config) != 32:
        raise ValueError(f"{model_cls.__name__} spec has head size {_head_size(config)}, not 32")
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True,
                                               temperature=1.0, top_p=1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
