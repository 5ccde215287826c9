"""Hugging Face Qwen2 / Llama causal LMs as megatron-core ``GPTModel``s, and their weights both ways.

What the Megatron learner (``async_rl.learners.megatron``) builds on:

- ``init_model_parallel``: megatron's tensor/pipeline-parallel groups on the default process group
  (gloo on CPU, with ``async_rl.learners.megatron.cpu``'s adjustments), and its RNG seeds;
- ``transformer_config`` / ``build_model``: the ``TransformerConfig`` and this rank's pipeline
  stage of the ``GPTModel`` for a HF ``Qwen2Config`` or ``LlamaConfig``;
- ``load_hf_weights``: HF tensors (by HF name) into this rank's shard of the model;
- ``named_hf_weights`` / ``hf_weight_metadata``: the model's weights back as full HF-named tensors,
  one at a time, in HF's ``named_parameters()`` order (what weight sync publishes to engines).

Weight layout (measured on megatron-core 0.16.1; ``tests/test_megatron_model.py`` pins it by
comparing logits with HF at TP=1, TP=2 and PP=2). ``G`` KV groups, ``nq`` query heads, head
size ``d``, TP size ``t``, rank ``r``:

==========================================  ============================================  ==========
HF name (``model.layers.i.`` prefix)         megatron name (``decoder.layers.<local i>.``)  TP split
==========================================  ============================================  ==========
``self_attn.{q,k,v}_proj.{weight,bias}``     ``self_attention.linear_qkv.{weight,bias}``    dim 0
``self_attn.o_proj.weight``                  ``self_attention.linear_proj.weight``          dim 1
``mlp.{gate,up}_proj.weight``                ``mlp.linear_fc1.weight``                      dim 0 *
``mlp.down_proj.weight``                     ``mlp.linear_fc2.weight``                      dim 1
``input_layernorm.weight``                   ``input_layernorm.weight`` (local spec) or     replicated
                                             ``self_attention.linear_qkv.layer_norm_weight``
``post_attention_layernorm.weight``          ``pre_mlp_layernorm.weight`` (local spec) or   replicated
                                             ``mlp.linear_fc1.layer_norm_weight``
``model.embed_tokens.weight``                ``embedding.word_embeddings.weight``           dim 0 (vocab)
``model.norm.weight``                        ``decoder.final_layernorm.weight``             replicated
``lm_head.weight`` (or embed when tied)      ``output_layer.weight``                        dim 0 (vocab)
==========================================  ============================================  ==========

``linear_qkv`` rows are interleaved per KV group: ``[q heads of group 0 (nq/G*d rows), k_0 (d),
v_0 (d), q heads of group 1, ...]``, so a contiguous dim-0 split gives each TP rank ``G/t``
whole groups. ``*`` ``linear_fc1`` is ``[gate, up]`` *per TP shard*: rank ``r`` holds
``cat(gate.chunk(t)[r], up.chunk(t)[r])``. Vocab-parallel tensors are padded with zero rows to
``padded_vocab_size``. With tied embeddings and PP > 1 the last stage holds its own copy of the
output weight, loaded from ``embed_tokens`` (its gradient must be summed with the embedding's
over megatron's embedding group, as megatron's ``finalize_model_grads`` does).

Sources: megatron-core ``models/gpt/gpt_layer_specs.py``, ``transformer/attention.py``
(``get_query_key_value_tensors``), ``transformer/mlp.py`` (``glu``); HF ``modeling_qwen2.py``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from async_rl.learners.megatron.cpu import (
    apply_cpu_adjustments,
    cpu_model_construction,
    cpu_moe_construction,
    cpu_moe_dispatchers,
    define_missing_te_names,
    seed_model_parallel,
)

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
"""megatron-core token dispatchers this mapping offers (``flex`` needs DeepEP / HybridEP on CUDA)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Per-layer HF suffix -> (megatron suffix(es), how the tensor is split over TP).
_LAYER_NORMS = {"input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")}
# Replicated per-layer tensors of Qwen3 / Qwen3-MoE (QK norms over one head, the MoE router): HF
# suffix -> megatron suffix. Only present where the architecture has them.
_REPLICATED = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
               "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
               "mlp.gate.weight": "mlp.router.weight"}
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers >= 5 keeps a layer's experts fused in memory (``gate_up_proj`` [E, 2I, H], rows
# [gate; up] per expert, ``down_proj`` [E, H, I]); checkpoints and engines use per-expert names.
_HF_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def init_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, seed: int,
                        device: torch.device, expert_parallel_size: int = 1) -> None:
    """Create megatron's model-parallel groups on the default process group and seed its RNGs.

    Needs ``torch.distributed`` initialised (gloo on CPU, NCCL on GPU). On CPU applies
    ``async_rl.learners.megatron.cpu.apply_cpu_adjustments`` first. Re-initialises (``destroy_model_parallel``)
    when groups of other sizes already exist; a repeated call with the same sizes only reseeds.

    ``expert_parallel_size`` (EP) splits a mixture-of-experts layer's experts over that many ranks
    of the data-parallel dimension (megatron-core's expert groups; the experts' own tensor split
    is ``tensor_parallel_size``, megatron's default ``expert_tensor_parallel_size``), so the world
    must be a multiple of ``expert_parallel_size * tensor_parallel_size * pipeline_parallel_size``.

    Raises:
        ValueError: the world size is not a multiple of ``tensor_parallel_size * pipeline_parallel_size``
            (times ``expert_parallel_size``), or a size is < 1.
    """
    from megatron.core import parallel_state

    world = dist.get_world_size()
    model_parallel = tensor_parallel_size * pipeline_parallel_size
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1 or world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel_size * pipeline_parallel_size "
                         f"= {tensor_parallel_size} * {pipeline_parallel_size}")
    if expert_parallel_size < 1 or world % (model_parallel * expert_parallel_size):
        raise ValueError(f"world size {world} is not a multiple of expert_parallel_size * tensor_parallel_size * "
                         f"pipeline_parallel_size = {expert_parallel_size} * {tensor_parallel_size} * "
                         f"{pipeline_parallel_size}")
    if device.type == "cpu":
        apply_cpu_adjustments()
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel_size
                and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel_size
                and parallel_state.get_expert_model_parallel_world_size() == expert_parallel_size)
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                                 pipeline_model_parallel_size=pipeline_parallel_size,
                                                 expert_model_parallel_size=expert_parallel_size)
    seed_model_parallel(seed, device)


def _architecture(hf_config) -> str:
    """``"qwen2"``, ``"llama"``, ``"qwen3"`` or ``"qwen3_moe"``; ValueError naming anything else."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:  # a config built in code has no architectures; its model_type says the same
        model_type = getattr(hf_config, "model_type", None)
        names = [_MODEL_TYPES.get(model_type, f"model_type={model_type!r}")]
    if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {names} for the Megatron learner; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return SUPPORTED_ARCHITECTURES[names[0]]


def _rope_theta(hf_config) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta``; ValueError on scaling."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params:
        params = dict(legacy)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"RoPE scaling type {rope_type!r} is not mapped to megatron-core; only 'default' is supported")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def is_moe(hf_config) -> bool:
    """Whether ``hf_config`` is a mixture-of-experts model this mapping builds (Qwen3-MoE).

    Raises:
        ValueError: an unsupported architecture.
    """
    return _architecture(hf_config) == "qwen3_moe"


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (``num_experts``; ``num_local_experts`` in the JSON), 0 for a dense model."""
    if not is_moe(hf_config):
        return 0
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def train_routers_only(model):
    """Put ``model`` in eval mode except its MoE routers, in train mode; returns ``model``.

    The learners train in eval mode (no dropout, as FSDP2). megatron-core applies a router's
    load-balancing auxiliary loss and z-loss only when the router is training and gradients are on
    (``TopKRouter.routing`` / ``apply_z_loss``); the router's ``training`` flag changes nothing
    else here (no input jitter, no expert bias, no sinkhorn). The ``MoELayer`` itself stays in eval
    mode: in train mode it refuses tensor parallelism without sequence parallelism (which the CPU
    path does not use; ``transformer/moe/moe_layer.py:379`` in megatron-core 0.16.1).
    """
    from megatron.core.transformer.moe.router import Router

    model.eval()
    for module in model.modules():
        if isinstance(module, Router):
            module.train()
    return model


def _check_supported(hf_config, arch: str) -> None:
    """ValueError for HF options this mapping does not reproduce."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU with silu only)")
    if arch == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2 use_sliding_window=True is not supported by the Megatron learner")
    if arch == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        # HF Llama's attention_bias also gives o_proj a bias, which megatron only has together
        # with biases on every linear layer (add_bias_linear); that layout is not mapped here.
        raise ValueError("Llama attention_bias=True / mlp_bias=True is not supported by the Megatron learner")
    if arch in ("qwen3", "qwen3_moe"):
        if getattr(hf_config, "attention_bias", False):
            # Qwen3's attention_bias also gives o_proj a bias: the same unmapped layout as Llama's.
            raise ValueError(f"{arch} attention_bias=True is not supported by the Megatron learner")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{arch} use_sliding_window=True is not supported by the Megatron learner")
    if arch == "qwen3_moe":
        sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
        if list(getattr(hf_config, "mlp_only_layers", None) or []) or sparse_step != 1:
            # megatron's moe_layer_freq could express a mix, but the dense layers' width
            # (intermediate_size) differs from the experts', which one TransformerConfig cannot hold.
            raise ValueError(f"Qwen3-MoE with dense layers (mlp_only_layers={hf_config.mlp_only_layers}, "
                             f"decoder_sparse_step={sparse_step}) is not supported: every layer must be sparse")
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise ValueError("Qwen3-MoE shared experts are not mapped to megatron-core")


def _moe_options(hf_config, expert_parallel_size: int, moe_aux_loss_coeff: float, moe_z_loss_coeff: float,
                 moe_token_dispatcher: str) -> dict:
    """The ``TransformerConfig`` fields of a Qwen3-MoE layer (``{}`` for a dense model).

    Routing equal to HF's ``Qwen3MoeTopKRouter``: HF takes ``softmax`` over all experts, the top
    k, and with ``norm_topk_prob`` divides them by their sum, which is ``softmax`` over the top-k
    *logits* (the other experts' terms cancel): megatron's ``moe_router_pre_softmax=False``
    (top-k of the logits, then softmax over those k). Without ``norm_topk_prob`` HF keeps the
    full-softmax values: ``moe_router_pre_softmax=True``. No scaling factor, no expert bias, no
    token dropping (dropless, as HF). Experts: megatron's ``SequentialMLP`` (one local MLP per
    expert; its grouped-GEMM layouts need TransformerEngine or the ``grouped_gemm`` package).

    Raises:
        ValueError: ``expert_parallel_size`` > 1 for a dense model, or not dividing the experts; an
            unknown dispatcher; a negative coefficient.
    """
    if moe_token_dispatcher not in MOE_TOKEN_DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher must be one of {MOE_TOKEN_DISPATCHERS}, got {moe_token_dispatcher!r}")
    if moe_aux_loss_coeff < 0 or moe_z_loss_coeff < 0:
        raise ValueError(f"MoE loss coefficients must be >= 0, got aux {moe_aux_loss_coeff}, z {moe_z_loss_coeff}")
    experts = num_experts(hf_config)
    if not experts:
        if expert_parallel_size != 1:
            raise ValueError(f"expert_parallel_size={expert_parallel_size} needs a mixture-of-experts model; "
                             f"{_architecture(hf_config)} is dense")
        return {}
    if expert_parallel_size < 1 or experts % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} does not divide the {experts} experts")
    return dict(
        num_moe_experts=experts, moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_router_score_function="softmax", moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
        moe_router_topk_scaling_factor=None, moe_grouped_gemm=False,
        moe_token_dispatcher_type=moe_token_dispatcher, expert_model_parallel_size=expert_parallel_size,
        # "none" when off: megatron then skips the aux-loss bookkeeping (which allocates on CUDA).
        moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(moe_aux_loss_coeff), moe_z_loss_coeff=float(moe_z_loss_coeff) or None,
        moe_permute_fusion=False, moe_router_fusion=False,
    )


def transformer_config(hf_config, *, tensor_parallel_size: int, pipeline_parallel_size: int, device: torch.device,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       expert_parallel_size: int = 1, moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0,
                       moe_token_dispatcher: str = "alltoall"):
    """The megatron ``TransformerConfig`` equivalent to a HF Qwen2 / Llama / Qwen3 / Qwen3-MoE config.

    RMSNorm (``rms_norm_eps``), SwiGLU, grouped-query attention, q/k/v bias for Qwen2, RMSNorm
    over each query and key head for Qwen3 (``qk_layernorm``), no other bias, RoPE with the
    config's theta, zero dropout. On CPU every fusion is off and weights are initialised on the
    CPU. ``params_dtype`` bf16/fp16 also sets megatron's ``bf16``/``fp16`` flag (softmax in fp32).

    Qwen3-MoE (``_moe_options``): every layer's MLP is a megatron ``MoELayer`` with
    ``expert_parallel_size`` expert-parallel ranks, the token dispatcher ``moe_token_dispatcher``
    (``"alltoall"`` or ``"allgather"``), the load-balancing auxiliary loss with coefficient
    ``moe_aux_loss_coeff`` (0 = off; megatron's ``aux_loss``, Switch-Transformer style, added to
    the gradient of the routing probabilities) and the router z-loss with ``moe_z_loss_coeff``
    (0 = off; ST-MoE). These four are ignored-by-value for dense models, except that
    ``expert_parallel_size`` must then be 1.

    Raises:
        ValueError: an unsupported architecture (named), RoPE scaling type, activation or bias
            layout, or MoE option (see ``_moe_options``).
    """
    from megatron.core.transformer import TransformerConfig

    arch = _architecture(hf_config)
    _check_supported(hf_config, arch)
    _rope_theta(hf_config)  # refuse RoPE scaling here already, not only in build_model
    moe = _moe_options(hf_config, expert_parallel_size, moe_aux_loss_coeff, moe_z_loss_coeff, moe_token_dispatcher)
    on_cpu = device.type == "cpu"
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        kv_channels=_head_dim(hf_config), ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=(arch == "qwen2"),
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tensor_parallel_size, pipeline_model_parallel_size=pipeline_parallel_size,
        sequence_parallel=sequence_parallel and tensor_parallel_size > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=not on_cpu, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=not on_cpu, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False, qk_layernorm=arch in ("qwen3", "qwen3_moe"), **moe,
    )


def padded_vocab_size(hf_config, tensor_parallel_size: int) -> int:
    """The smallest multiple of ``tensor_parallel_size`` that is >= ``hf_config.vocab_size``."""
    return -(-hf_config.vocab_size // tensor_parallel_size) * tensor_parallel_size


def _layer_spec(tcfg):
    """Transformer Engine spec when it imports and the model lives on CUDA, else the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # MoE: SequentialMLP experts either way (moe_grouped_gemm=False); see _moe_options.
    moe = dict(num_experts=tcfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=tcfg.qk_layernorm)
    if not tcfg.use_cpu_initialization and torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pass
        else:
            return get_gpt_layer_with_transformer_engine_spec(**moe)
    return get_gpt_layer_local_spec(normalization="RMSNorm", **moe)


def build_model(hf_config, tcfg):
    """This rank's pipeline stage of the ``GPTModel`` for ``hf_config``, in inference mode (dropout off).

    ``pre_process`` (embedding) on the first pipeline stage, ``post_process`` (final norm and
    output layer) on the last, as ``parallel_state`` says. Weights are randomly initialised;
    ``load_hf_weights`` fills them. Parameters are on the CPU when ``tcfg.use_cpu_initialization``
    (move the model with ``.cuda()`` otherwise megatron already allocates on the current GPU).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    on_cpu = tcfg.use_cpu_initialization
    if tcfg.num_moe_experts:
        define_missing_te_names()  # the router needs them defined (None) without TransformerEngine
    with contextlib.ExitStack() as stack:
        if on_cpu:
            stack.enter_context(cpu_model_construction())  # tied + PP: megatron moves the output copy with .cuda()
            stack.enter_context(cpu_moe_construction())  # the alltoall dispatcher makes a CUDA stream
        model = GPTModel(
            config=tcfg, transformer_layer_spec=_layer_spec(tcfg),
            vocab_size=padded_vocab_size(hf_config, tcfg.tensor_model_parallel_size),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope", rotary_base=_rope_theta(hf_config),
        )
    if on_cpu:
        cpu_moe_dispatchers(model)
    _mark_tensor_parallel_gradients(model, tcfg)
    return model.eval()


def _mark_tensor_parallel_gradients(model, tcfg) -> None:
    """Flag the parameters whose gradient megatron-core leaves incomplete at TP > 1 without sequence
    parallelism, for ``ops.model_parallel_step`` (measured against HF gradients at TP=2 on CPU):

    - ``tp_partial_grad``: Qwen3's ``q_layernorm`` / ``k_layernorm`` weights are replicated but each
      TP rank normalises only its own heads, so each holds a partial gradient (to be summed over
      TP; megatron sums it only for sequence-parallel runs, as a layer-norm grad);
    - ``tp_duplicated_tokens``: MoE expert weights. The dispatchers treat each TP rank's tokens as
      its sequence-parallel slice (gathered over TP before the experts, reduce-scattered after).
      Without sequence parallelism every TP rank holds *all* tokens, so each expert shard sees every
      token ``tp`` times: the forward is exact (the reduce-scatter hands each rank its own copy),
      the expert weights' gradient is ``tp`` times too large (to be divided by ``tp``). megatron
      refuses this layout in training mode (``moe_layer.py:379``); the learner keeps the MoE layers
      in eval mode (``train_routers_only``) and corrects the gradient instead.
    """
    tp = tcfg.tensor_model_parallel_size
    if tp == 1 or tcfg.sequence_parallel:
        return
    for name, param in model.named_parameters():
        if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
            param.tp_partial_grad = True
        elif ".mlp.experts." in name:
            param.tp_duplicated_tokens = tp


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Fuse HF q/k/v (weights ``[heads*d, h]`` or biases ``[heads*d]``) into megatron's per-group rows."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a full (all TP shards) megatron ``linear_qkv`` tensor back into HF q, k, v."""
    d, groups = _head_dim(hf_config), hf_config.num_key_value_heads
    per_group = hf_config.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _fc1_to_hf(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a full megatron ``linear_fc1`` (``tp`` shards of ``[gate_r, up_r]``) into gate, up."""
    pairs = [shard.chunk(2, dim=0) for shard in fc1.chunk(tp, dim=0)]
    return torch.cat([g for g, _ in pairs]), torch.cat([u for _, u in pairs])


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])]) \
        if padded > weight.shape[0] else weight


def _hf_get(state: Mapping[str, torch.Tensor], name: str, param_name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"HF weight {name!r} (for megatron parameter {param_name!r}) is missing")
    return state[name]


class _Layout(NamedTuple):
    """This rank's place in the parallel groups the weight mapping cuts along."""

    tp: int  # tensor-parallel size (dense layers)
    tp_rank: int
    etp: int  # expert tensor-parallel size (megatron's default: tp)
    etp_rank: int
    ep: int  # expert-parallel size
    ep_rank: int

    @staticmethod
    def current() -> "_Layout":
        """The layout of megatron's ``parallel_state`` (initialised)."""
        from megatron.core import parallel_state as ps

        return _Layout(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                       ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                       ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank())


def _expert_shard(suffix: str, prefix: str, get, hf_config, layout: _Layout) -> torch.Tensor | None:
    """This rank's shard of a local expert's ``linear_fc1``/``linear_fc2`` (None: not an expert)."""
    match = _LOCAL_EXPERT.match(suffix)
    if not match:
        return None
    per_rank = num_experts(hf_config) // layout.ep
    expert = layout.ep_rank * per_rank + int(match.group(1))  # SequentialMLP: contiguous blocks per EP rank
    e = f"{prefix}mlp.experts.{expert}."
    if match.group(2) == "linear_fc1":
        gate, up = get(e + "gate_proj.weight"), get(e + "up_proj.weight")
        return torch.cat([gate.chunk(layout.etp, dim=0)[layout.etp_rank], up.chunk(layout.etp, dim=0)[layout.etp_rank]])
    return get(e + "down_proj.weight").chunk(layout.etp, dim=1)[layout.etp_rank]


def _shard_for(param_name: str, global_layer: int | None, hf_config, state, layout: _Layout) -> torch.Tensor:
    """The HF-derived tensor for this rank's shard of megatron parameter ``param_name``."""
    get = lambda n: _hf_get(state, n, param_name)
    tp, rank = layout.tp, layout.tp_rank
    if global_layer is None:
        if param_name == "embedding.word_embeddings.weight" or (
                param_name == "output_layer.weight" and hf_config.tie_word_embeddings):
            full = _pad_vocab(get("model.embed_tokens.weight"), padded_vocab_size(hf_config, tp))
            return full.chunk(tp, dim=0)[rank]
        if param_name == "output_layer.weight":
            return _pad_vocab(get("lm_head.weight"), padded_vocab_size(hf_config, tp)).chunk(tp, dim=0)[rank]
        if param_name == "decoder.final_layernorm.weight":
            return get("model.norm.weight")
        raise ValueError(f"megatron parameter {param_name!r} has no HF counterpart in this mapping")
    prefix = f"model.layers.{global_layer}."
    suffix = _MEGATRON_LAYER.match(param_name).group(2)
    for hf_suffix, megatron_suffixes in _LAYER_NORMS.items():
        if suffix in megatron_suffixes:
            return get(prefix + hf_suffix)
    for hf_suffix, megatron_suffix in _REPLICATED.items():
        if suffix == megatron_suffix:
            return get(prefix + hf_suffix)
    expert = _expert_shard(suffix, prefix, get, hf_config, layout)
    if expert is not None:
        return expert
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rpartition(".")[2]
        q, k, v = (get(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
        return _qkv_to_megatron(q, k, v, hf_config.num_key_value_heads).chunk(tp, dim=0)[rank]
    if suffix == "self_attention.linear_proj.weight":
        return get(prefix + "self_attn.o_proj.weight").chunk(tp, dim=1)[rank]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if suffix == "mlp.linear_fc2.weight":
        return get(prefix + "mlp.down_proj.weight").chunk(tp, dim=1)[rank]
    raise ValueError(f"megatron parameter {param_name!r} has no HF counterpart in this mapping")


def _local_to_global_layers(model) -> dict[int, int]:
    """Local decoder layer index -> global (HF) layer index, from megatron's 1-based layer_number."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)} if hasattr(model, "decoder") \
        else {}


def load_hf_weights(model, hf_config, state: Mapping[str, torch.Tensor]) -> int:
    """Copy this rank's TP shard of its pipeline stage's weights from full HF tensors, in place.

    Mixture of experts: the router from ``mlp.gate.weight``, and this expert-parallel rank's
    experts (global experts ``ep_rank * E/ep ...``, megatron's ``SequentialMLP`` order) from the
    per-expert checkpoint names ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
    each cut over the expert tensor-parallel ranks as a dense MLP is over TP.

    Args:
        model: a ``GPTModel`` from ``build_model`` (this rank's stage).
        hf_config: its HF config.
        state: full HF tensors by HF checkpoint name (``load_hf_checkpoint``); ``lm_head.weight``
            may be absent when the embeddings are tied. Any dtype/device; copied into the
            parameters' own.

    Returns:
        The number of megatron parameters written (every parameter of ``model``).

    Raises:
        ValueError: one line naming the parameter, for a missing HF weight, a shape mismatch or a
            megatron parameter without a mapping.
    """
    layout = _Layout.current()
    layers = _local_to_global_layers(model)
    written = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            match = _MEGATRON_LAYER.match(name)
            global_layer = layers[int(match.group(1))] if match else None
            src = _shard_for(name, global_layer, hf_config, state, layout)
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for megatron parameter {name!r} (global layer {global_layer}): "
                                 f"HF gives {tuple(src.shape)}, the model has {tuple(param.shape)}")
            param.copy_(src.to(device=param.device, dtype=param.dtype))
            written += 1
    return written


def load_hf_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in HF directory ``path``, as full fp32 CPU tensors.

    Raises:
        ValueError: no ``*.safetensors`` file in ``path``.
    """
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file in {path!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(f, device="cpu").items()})
    return state


def hf_weight_metadata(hf_config, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(HF name, dtype, full HF shape)`` of every HF parameter, in HF ``named_parameters()`` order.

    The order is read from the HF model built on the meta device (no memory); a tied
    ``lm_head.weight`` is not listed (``named_parameters`` lists a shared tensor once). Shapes
    use the unpadded vocabulary. This is the order ``named_hf_weights`` yields.

    Mixture of experts: where transformers keeps a layer's experts fused in memory
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``,
    transformers >= 5), the checkpoint's per-expert names are listed instead, at the place of
    ``gate_up_proj``, expert by expert: ``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
    ``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]`` (the names on disk and what engines load).

    Raises:
        ValueError: an unsupported architecture.
    """
    from transformers import AutoModelForCausalLM

    _architecture(hf_config)
    # Every weight sync asks: build the (meta) model once per config, not once per update.
    key = hf_config.to_json_string()
    if key not in _METADATA_CACHE:
        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(hf_config)
        _METADATA_CACHE[key] = _checkpoint_names([(name, tuple(p.shape)) for name, p in hf_model.named_parameters()])
    return [(name, dtype, shape) for name, shape in _METADATA_CACHE[key]]


def _checkpoint_names(params: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """In-memory HF ``(name, shape)`` list with fused expert stacks replaced by per-expert names."""
    out = []
    for name, shape in params:
        fused = _HF_FUSED_EXPERTS.match(name)
        if not fused:
            out.append((name, shape))
        elif fused.group(2) == "gate_up_proj":  # [E, 2I, H]; down_proj [E, H, I] follows in the same layer
            experts, two_i, hidden = shape
            for e in range(experts):
                out += [(f"{fused.group(1)}.{e}.gate_proj.weight", (two_i // 2, hidden)),
                        (f"{fused.group(1)}.{e}.up_proj.weight", (two_i // 2, hidden)),
                        (f"{fused.group(1)}.{e}.down_proj.weight", (hidden, two_i // 2))]
    return out


def fuse_expert_weights(state: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors stacked into the names of transformers' in-memory MoE model.

    ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (``[I, H]``, ``[I, H]``,
    ``[H, I]``) become ``model.layers.{L}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``...down_proj`` ``[E, H, I]`` when the HF model of ``hf_config`` has those fused
    parameters (transformers >= 5); otherwise ``state`` is returned unchanged (as a new dict).
    Other tensors pass through. For ``load_state_dict`` of an in-memory HF model (``export_hf``).

    Raises:
        ValueError: an expert of a layer is missing.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        names = {n for n, _ in AutoModelForCausalLM.from_config(hf_config).named_parameters()}
    out = {k: v for k, v in state.items() if not _HF_EXPERT.match(k)}
    experts = num_experts(hf_config)
    layers = sorted({int(m.group(1)) for k in state if (m := _HF_EXPERT.match(k))})
    for layer in layers:
        base = f"model.layers.{layer}.mlp.experts"
        if f"{base}.gate_up_proj" not in names:
            out.update({k: v for k, v in state.items() if k.startswith(base + ".")})
            continue
        try:
            out[f"{base}.gate_up_proj"] = torch.stack(
                [torch.cat([state[f"{base}.{e}.gate_proj.weight"], state[f"{base}.{e}.up_proj.weight"]]) for e in
                 range(experts)])
            out[f"{base}.down_proj"] = torch.stack([state[f"{base}.{e}.down_proj.weight"] for e in range(experts)])
        except KeyError as missing:
            raise ValueError(f"expert weight {missing.args[0]!r} is missing (layer {layer} has {experts} experts)") \
                from None
    return out


_METADATA_CACHE: dict[str, list[tuple[str, tuple[int, ...]]]] = {}


def _stage_layers(model) -> list[list[int]]:
    """The global layer indices of every pipeline stage (collective over the pipeline group)."""
    from megatron.core import parallel_state

    mine = sorted(_local_to_global_layers(model).values())
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return [mine]
    from async_rl.learners import wire

    group = parallel_state.get_pipeline_model_parallel_group()
    return wire.all_gather(mine, group=group)


def _owner_stage(hf_name: str, stages: list[list[int]]) -> int:
    """The pipeline stage that holds HF weight ``hf_name`` (embed: first; norm, lm_head: last)."""
    match = _LAYER.match(hf_name)
    if match:
        layer = int(match.group(1))
        return next(s for s, layers in enumerate(stages) if layer in layers)
    return 0 if hf_name == "model.embed_tokens.weight" else len(stages) - 1


def _gather_tp(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """A new tensor: all TP shards of ``tensor`` concatenated along ``dim`` (collective over the TP group)."""
    from megatron.core import parallel_state

    return _gather(tensor, dim, parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_group)


def _gather(tensor: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    """A new tensor: the ``size`` ranks' ``tensor`` of process group ``group()`` concatenated along
    ``dim`` in rank order (collective over that group; ``group`` is only called when ``size > 1``)."""
    if size == 1:
        return tensor.detach().clone()  # a copy either way: callers keep it past optimizer steps
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group())
    return torch.cat(shards, dim=dim)


def _experts_to_hf(params: dict[str, torch.Tensor], m: str, h: str) -> dict[str, torch.Tensor]:
    """Full per-expert HF tensors of one MoE layer: this rank's local experts stacked, their expert
    tensor-parallel shards gathered (collective over the expert TP group), then every expert-parallel
    rank's experts gathered (collective over the EP group), in global expert order."""
    from megatron.core import parallel_state as ps

    local = sorted({int(x.group(1)) for n in params if n.startswith(m)
                    and (x := _LOCAL_EXPERT.match(n[len(m):]))})
    if not local:
        return {}
    etp, ep = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    full = {}
    for kind, dim in (("linear_fc1", 1), ("linear_fc2", 2)):
        stacked = torch.stack([params[f"{m}mlp.experts.local_experts.{j}.{kind}.weight"].detach() for j in local])
        stacked = _gather(stacked, dim, etp, ps.get_expert_tensor_parallel_group)  # [E/ep, rows, cols]
        full[kind] = _gather(stacked, 0, ep, ps.get_expert_model_parallel_group)  # [E, rows, cols]
    out = {}
    for e in range(full["linear_fc1"].shape[0]):
        gate, up = _fc1_to_hf(full["linear_fc1"][e], etp)
        out[f"{h}mlp.experts.{e}.gate_proj.weight"] = gate
        out[f"{h}mlp.experts.{e}.up_proj.weight"] = up
        out[f"{h}mlp.experts.{e}.down_proj.weight"] = full["linear_fc2"][e].contiguous()
    return out


def _param(params: dict[str, torch.Tensor], *names: str) -> torch.Tensor:
    for n in names:
        if n in params:
            return params[n]
    raise KeyError(f"none of {names} in the model")  # internal: build_model made the model


def _layer_to_hf(params: dict[str, torch.Tensor], local: int, global_layer: int, hf_config) -> dict[str, torch.Tensor]:
    """Full HF tensors of one decoder layer (TP shards gathered; collective over the TP group)."""
    from megatron.core import parallel_state

    m, h = f"decoder.layers.{local}.", f"model.layers.{global_layer}."
    out = {h + hf: _param(params, *(m + s for s in ms)).detach().clone()  # replicated over TP
           for hf, ms in _LAYER_NORMS.items()}
    for kind in ("weight", "bias"):
        if m + f"self_attention.linear_qkv.{kind}" in params:
            qkv = _gather_tp(params[m + f"self_attention.linear_qkv.{kind}"], 0)
            for p, t in zip("qkv", _qkv_to_hf(qkv, hf_config)):
                out[f"{h}self_attn.{p}_proj.{kind}"] = t.contiguous()
    out[h + "self_attn.o_proj.weight"] = _gather_tp(params[m + "self_attention.linear_proj.weight"], 1)
    out.update({h + hf: params[m + ms].detach().clone() for hf, ms in _REPLICATED.items() if m + ms in params})
    if m + "mlp.linear_fc1.weight" in params:
        gate, up = _fc1_to_hf(_gather_tp(params[m + "mlp.linear_fc1.weight"], 0),
                              parallel_state.get_tensor_model_parallel_world_size())
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = _gather_tp(params[m + "mlp.linear_fc2.weight"], 1)
    out.update(_experts_to_hf(params, m, h))
    return out


def _owned_to_hf(hf_name: str, params: dict[str, torch.Tensor], layers: dict[int, int], hf_config,
                 cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """Full HF tensor ``hf_name`` from this stage's parameters (collective over the TP group)."""
    if hf_name in cache:
        return cache.pop(hf_name)
    match = _LAYER.match(hf_name)
    if match:
        global_layer = int(match.group(1))
        local = next(i for i, g in layers.items() if g == global_layer)
        cache.clear()
        cache.update(_layer_to_hf(params, local, global_layer, hf_config))
        return cache.pop(hf_name)
    if hf_name == "model.norm.weight":
        return params["decoder.final_layernorm.weight"].detach().clone()
    source = "embedding.word_embeddings.weight" if hf_name == "model.embed_tokens.weight" else "output_layer.weight"
    return _gather_tp(params[source], 0)[: hf_config.vocab_size]


def named_hf_weights(model, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, full tensor)`` for every HF parameter, in ``hf_weight_metadata`` order.

    Collective over this rank's tensor-, pipeline- and (MoE) expert-parallel groups: every rank
    of those groups must iterate it to the end. TP shards are all-gathered, ``linear_qkv``
    is split back into q/k/v, ``linear_fc1`` into gate/up, vocabulary padding is removed; a
    MoE layer's experts come out under their per-expert checkpoint names (``hf_weight_metadata``),
    each expert-parallel rank's local experts all-gathered like TP shards; a
    tensor held by another pipeline stage is broadcast from it, so every rank yields the same
    tensors. A tied ``lm_head`` is not yielded (``embed_tokens`` once, from the first stage).
    Tensors are detached copies on the parameters' device in the parameters' dtype; one layer's
    tensors are held at a time (the caller buckets them).
    """
    from megatron.core import parallel_state

    params = dict(model.named_parameters())
    some = next(iter(params.values()))
    layers = _local_to_global_layers(model)
    stages = _stage_layers(model)
    pp = len(stages)
    stage = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
    group = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None
    cache: dict[str, torch.Tensor] = {}
    for name, _, shape in hf_weight_metadata(hf_config, some.dtype):
        owner = _owner_stage(name, stages)
        if owner == stage:
            tensor = _owned_to_hf(name, params, layers, hf_config, cache)
            assert tuple(tensor.shape) == shape, (name, tuple(tensor.shape), shape)
        else:
            tensor = torch.empty(shape, dtype=some.dtype, device=some.device)
        if pp > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(group, owner), group=group)
        yield name, tensor


def hf_state_from_megatron_tensors(tensors: Mapping[str, torch.Tensor], hf_config,
                                   tensor_parallel_size: int,
                                   expert_tensor_parallel_size: int | None = None) -> dict[str, torch.Tensor]:
    """HF state dict from full (TP-gathered) megatron tensors named with *global* layer indices.

    ``tensors`` uses megatron names (``decoder.layers.<global i>.self_attention.linear_qkv.weight``,
    ...) holding all TP shards concatenated on the split dimension, as a distributed checkpoint
    of the whole model would. ``tensor_parallel_size`` is needed because ``linear_fc1`` is laid
    out per shard. Vocab padding is removed; a tied ``lm_head`` is omitted. Pure (no collectives).

    Mixture of experts: experts are named by *global* expert index
    (``decoder.layers.<i>.mlp.experts.local_experts.<global e>.linear_fc1.weight``, the key
    megatron's ``SequentialMLP.sharded_state_dict`` gives them), each ``linear_fc1`` laid out per
    expert tensor-parallel shard (``expert_tensor_parallel_size``, default
    ``tensor_parallel_size`` as megatron's); they come out under the per-expert checkpoint names.
    """
    etp = tensor_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    out: dict[str, torch.Tensor] = {}
    vocab = hf_config.vocab_size
    for name, t in tensors.items():
        match = _MEGATRON_LAYER.match(name)
        if not match:
            hf = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                  "output_layer.weight": None if hf_config.tie_word_embeddings else "lm_head.weight",
                  "decoder.final_layernorm.weight": "model.norm.weight"}[name]
            if hf is not None:
                out[hf] = t[:vocab] if hf != "model.norm.weight" else t
            continue
        h, suffix = f"model.layers.{match.group(1)}.", match.group(2)
        norms = {m: hf for hf, ms in _LAYER_NORMS.items() for m in ms}
        replicated = {m: hf for hf, m in _REPLICATED.items()}
        if suffix in norms:
            out[h + norms[suffix]] = t
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rpartition(".")[2]
            for p, part in zip("qkv", _qkv_to_hf(t, hf_config)):
                out[f"{h}self_attn.{p}_proj.{kind}"] = part
        elif suffix == "self_attention.linear_proj.weight":
            out[h + "self_attn.o_proj.weight"] = t
        elif suffix == "mlp.linear_fc1.weight":
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = _fc1_to_hf(t, tensor_parallel_size)
        elif suffix == "mlp.linear_fc2.weight":
            out[h + "mlp.down_proj.weight"] = t
        elif suffix in replicated:
            out[h + replicated[suffix]] = t
        elif expert := _LOCAL_EXPERT.match(suffix):
            e = f"{h}mlp.experts.{expert.group(1)}."
            if expert.group(2) == "linear_fc1":
                out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = _fc1_to_hf(t, etp)
            else:
                out[e + "down_proj.weight"] = t
        else:
            raise ValueError(f"megatron tensor {name!r} has no HF counterpart in this mapping")
    return out
