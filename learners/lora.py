"""LoRA through peft, learner side: adapter-only weight sync, the reference policy and the merged export.

The settings (``LoRAConfig``), the peft wrapping (``wrap``) and the adapter naming contract live
in ``async_rl.utils.lora``, which the engines import too.

With ``learner.lora.rank > 0`` the learner wraps its Hugging Face model with peft
(``get_peft_model``) before FSDP2 shards it: the base weights stay frozen and only the low-rank
adapters train (Hu et al. 2021, "LoRA", arXiv 2106.09685: ``W x + (alpha / r) B A x``, ``A``
``[r, in]``, ``B`` ``[out, r]``, ``B`` starting at zero so the adapted model starts as the base).
The generators load the same base checkpoint once and from then on receive only the adapters.

**Names on the wire** are peft's saved-adapter names, the names of ``adapter_model.safetensors``
(``get_peft_model_state_dict``: the adapter name removed), for example
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ``[r, 128]`` and
``...q_proj.lora_B.weight`` ``[128, r]``. peft parses them back (HF engine) and so does vLLM's LoRA
loader (``vllm.lora.utils.parse_fine_tuned_lora_name``), which fuses q/k/v and gate/up itself.

**Reference policy** (KL term): the policy RL started from. While the adapters are still at their
initialisation (every ``B == 0``) that is the base model, computed by the policy itself with its
adapters switched off (``AdapterDisabled``, peft's ``disable_adapter``), with no second copy. When
a warm start trained the adapters before RL, the reference is base + those adapters: then a
frozen plain copy holding the merged weights is kept, as without LoRA.

**Export**: ``export_merged`` writes a plain Hugging Face model with ``W + (alpha / r) B A`` folded
in (loadable without peft) and the adapter itself under ``<out_dir>/adapter``.
"""
from __future__ import annotations

import os
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from async_rl.learners.base import copy_matching_parameters, save_hf_model
from async_rl.utils.lora import (ADAPTER, PEFT_PREFIX, LoRAConfig, adapter_parameters, is_adapter_param, lora_layers,
                                 peft_config, plain_name)

# ---------------------------------------------------------------------------------------- learner side: gathering
def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def adapter_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(sync name, full tensor)`` of every adapter matrix (DTensors gathered one at a time:
    every rank must iterate), float32 on the learner: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``."""
    for name, param in adapter_parameters(model).items():
        yield name, _full(param)


def adapter_metadata(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(sync name, dtype, full shape)`` of what ``adapter_named_weights`` yields, in order,
    without gathering."""
    return [(n, p.dtype, tuple(p.shape)) for n, p in adapter_parameters(model).items()]


# ---------------------------------------------------------------------------------------- merging
def merge_lora_state(state: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A peft model's full state as a plain Hugging Face state dict with the adapters folded in.

    ``W' = W + (B @ A) * scaling`` for each adapted module (peft's own ``merge`` arithmetic,
    computed in float32), ``base_layer`` and the ``base_model.model.`` prefix dropped from names,
    adapter tensors left out.

    Args:
        state: ``{peft parameter name: full tensor}``, e.g. ``base_model.model.model.layers.0.
            self_attn.q_proj.base_layer.weight`` ``[out, in]``, ``...q_proj.lora_A.default.weight``
            ``[r, in]``, ``...q_proj.lora_B.default.weight`` ``[out, r]``.
        scalings: ``{adapted module name: alpha / r}``, e.g. ``{"base_model.model.model.layers.0.
            self_attn.q_proj": 2.0}`` (``lora_scalings``).

    Returns:
        ``{HF name: tensor}`` (``model.layers.0.self_attn.q_proj.weight``), base dtypes kept.

    Raises:
        KeyError: an adapted module whose ``lora_A``/``lora_B`` is not in ``state``.
    """
    out = {}
    for name, t in state.items():
        if is_adapter_param(name):
            continue
        module, sep, leaf = name.rpartition(".base_layer.")
        if sep and leaf == "weight" and module in scalings:
            a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
            t = (t.float() + (b @ a) * scalings[module]).to(t.dtype)
        out[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = t
    return out


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """``{adapted module name: alpha / r}`` of a peft-wrapped model (peft's own ``scaling``)."""
    return {plain_name(name): float(m.scaling[ADAPTER]) for name, m in lora_layers(model).items()}


def merged_named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of base + adapters under plain Hugging Face names (``merge_lora_state``),
    each tied parameter once. Gathers every DTensor (collective: every rank must call) and holds
    one full copy of the model; the policy is left untouched."""
    state = {plain_name(n): _full(p) for n, p in model.named_parameters()}
    return merge_lora_state(state, lora_scalings(model))


def adapter_is_zero(model: torch.nn.Module) -> bool:
    """Whether every ``lora_B`` is exactly 0 (the adapters add nothing: policy == base model)."""
    return all(not bool(_full(p).any()) for n, p in adapter_parameters(model).items() if ".lora_B." in n)


# ---------------------------------------------------------------------------------------- reference
class AdapterDisabled:
    """The policy with its adapters switched off (peft's ``disable_adapter``): the base model as
    the frozen reference policy, sharing the policy's weights.

    Called like the model (``ref(input_ids=..., attention_mask=...)``). Deliberately not an
    ``nn.Module``: it owns no parameters, so nothing iterating modules or state dicts sees the
    policy twice.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        """The wrapped model's forward output with every adapter disabled."""
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


def reference_policy(model: torch.nn.Module, current, load_plain):
    """The frozen reference for a KL term: the LoRA policy as it is now (called at ``begin_rl``).

    Args:
        model: the peft-wrapped (sharded) policy.
        current: the previous reference (``None``, an ``AdapterDisabled`` or a plain copy to reuse).
        load_plain: ``() -> nn.Module``: a sharded plain copy of the base model, built only when
            needed.

    Returns:
        ``AdapterDisabled(model)`` when the adapters are still zero (reference == base model, no
        copy); otherwise a frozen plain model holding the merged weights (base + current adapters).
    """
    if adapter_is_zero(model):
        return AdapterDisabled(model)
    ref = current if isinstance(current, torch.nn.Module) else load_plain()
    copy_matching_parameters(merged_named_weights(model).items(), ref)
    return ref.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------- export
def save_adapter(tensors: dict[str, torch.Tensor], cfg: LoRAConfig, out_dir: str,
                 base_model_path: str | None = None) -> None:
    """Write a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    from ``{sync name: full tensor}``; peft's ``PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` load it."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    peft_config(cfg, base_model_path).save_pretrained(out_dir)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(out_dir, "adapter_model.safetensors"))


def export_merged(model: torch.nn.Module, cfg: LoRAConfig, out_dir: str, tokenizer=None,
                  base_model_path: str | None = None) -> None:
    """Write the LoRA policy as a plain Hugging Face model with the adapters merged in (loadable
    with ``AutoModelForCausalLM`` alone), plus the adapter itself under ``<out_dir>/adapter``.

    Collective under FSDP2 (every rank gathers); rank 0 writes.
    """
    import torch.distributed as dist

    merged = merged_named_weights(model)
    adapter = dict(adapter_named_weights(model))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    save_hf_model(_plain_like(model), out_dir, tokenizer, state_dict=merged)
    save_adapter(adapter, cfg, os.path.join(out_dir, "adapter"), base_model_path)


def _plain_like(model: torch.nn.Module) -> torch.nn.Module:
    # A weightless plain model of the same config: save_pretrained then writes its config and the
    # given state dict under plain names (the peft-wrapped model would describe its LoRA layers).
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = model.get_base_model().config
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, dtype=config.dtype or torch.float32)


__all__ = ["AdapterDisabled", "adapter_named_weights", "adapter_metadata", "adapter_is_zero", "merged_named_weights",
           "merge_lora_state", "lora_scalings", "reference_policy", "export_merged", "save_adapter"]
