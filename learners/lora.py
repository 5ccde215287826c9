"""LoRA through peft: the config, the wrapped policy, adapter-only weight sync and the merged export.

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
from dataclasses import dataclass, field
from typing import Iterator

import torch

ADAPTER = "default"
"""peft's name of the one adapter the policy carries (part of its parameter names)."""
PEFT_PREFIX = "base_model.model."
"""What peft puts before the wrapped model's own parameter names."""
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy (``learner.lora``); off unless ``rank > 0``.

    The generators are given the same settings by the trainer (``make_generator(..., lora=)``):
    they wrap their base model alike and receive only the adapters on each weight sync.
    """

    rank: int = 0
    """Adapter rank r (>= 0); 0 = no LoRA: every weight trains and syncs."""
    alpha: float = 16.0
    """Scale numerator (> 0): the update is ``(alpha / rank) * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1). Applied only in passes with gradients (training
    and warm-start steps), never in the no-grad proximal/reference passes or in generation, so
    behavior and proximal log-probs stay equal on-policy; > 0 makes the training log-probs noisy."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Module names (matched as dotted suffixes, as peft does) that get adapters: by default the
    attention and MLP projections of Llama/Qwen-style models."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"learner.lora.rank must be >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"learner.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(t, str) and t.strip() for t in self.target_modules):
            raise ValueError(f"learner.lora.target_modules must be a non-empty list of module names, "
                             f"got {self.target_modules!r}")

    @property
    def enabled(self) -> bool:
        """Whether adapters are on (``rank > 0``)."""
        return self.rank > 0


def lora_enabled(cfg: LoRAConfig | None) -> bool:
    """``cfg`` is given and has ``rank > 0`` (callers pass ``None`` for no LoRA)."""
    return cfg is not None and cfg.rank > 0


# ---------------------------------------------------------------------------------------- wrapping
def peft_config(cfg: LoRAConfig, base_model_path: str | None = None):
    """The ``peft.LoraConfig`` of ``cfg`` (causal LM, no bias adapters)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model_path)


class GradOnlyDropout(torch.nn.Module):
    """Dropout that is active exactly when autograd records (``torch.is_grad_enabled()``).

    The learner keeps its model in eval mode (no dropout in the proximal pass, see
    ``FSDPLearner._load_policy``); LoRA dropout is wanted in the gradient passes only.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with elements zeroed with probability ``p`` and rescaled, when grad is enabled."""
        return torch.nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def wrap(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """``model`` (a Hugging Face causal LM) with peft LoRA adapters (``get_peft_model``).

    Base parameters are frozen (``requires_grad=False``); adapters are initialised as peft does
    (``A`` Kaiming-uniform from the global torch RNG, ``B = 0``), so the wrapped model computes
    exactly what ``model`` did.

    Raises:
        ValueError: (from peft) no module of ``model`` matches ``cfg.target_modules``.
    """
    from peft import get_peft_model

    path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    peft_model = get_peft_model(model, peft_config(cfg, path))
    if cfg.dropout > 0:
        for module in lora_layers(peft_model).values():
            module.lora_dropout[ADAPTER] = GradOnlyDropout(cfg.dropout)
    return peft_model


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{module name: peft LoraLayer}`` of a peft-wrapped model (names as ``named_modules``)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


# ---------------------------------------------------------------------------------------- names
def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (peft or sync form) is a LoRA ``A`` or ``B`` matrix."""
    return ".lora_A." in name or ".lora_B." in name


def sync_name(param_name: str) -> str:
    """peft parameter name -> name on the wire (the adapter name dropped), e.g.
    ``base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight`` ->
    ``base_model.model.model.layers.0.mlp.up_proj.lora_B.weight``."""
    parts = param_name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("lora_A", "lora_B") and parts[i + 1] == ADAPTER:
            return ".".join(parts[: i + 1] + parts[i + 2 :])
    return param_name


def plain_name(name: str) -> str:
    """A parameter or module name without the ``_checkpoint_wrapped_module.`` level that activation
    checkpointing inserts (``learner.activation_checkpointing``)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{sync name: parameter}`` of every adapter matrix of a peft-wrapped model, in module
    order (plain or DTensor parameters)."""
    return {sync_name(plain_name(n)): p for n, p in model.named_parameters() if is_adapter_param(n)}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def adapter_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(sync name, full tensor)`` of every adapter matrix (DTensors gathered one at a time:
    every rank must iterate), float32 on the learner: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``."""
    for name, param in adapter_parameters(model).items():
        yield name, _full(param)


def adapter_metadata(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(sync name, dtype, full shape)`` of what ``adapter_named_weights`` yields, in order,
    without gathering."""
    return [(n, p.dtype, tuple(p.shape)) for n, p in adapter_parameters(model).items()]


def targets(module_name: str, target_modules: list[str]) -> bool:
    """peft's rule for a list of target modules: the name equals one or ends with ``.<one>``."""
    return any(module_name == t or module_name.endswith("." + t) for t in target_modules)


def expected_vllm_adapter_names(lora_modules: list[str], packed: dict[str, list[str]],
                                target_modules: list[str]) -> list[str]:
    """The sync names an adapter for a vLLM model must consist of.

    Args:
        lora_modules: vLLM's LoRA-wrapped module names, e.g. ``model.layers.0.self_attn.qkv_proj``.
        packed: the model's ``packed_modules_mapping`` (``{"qkv_proj": ["q_proj", "k_proj",
            "v_proj"], ...}``): a fused module takes one adapter per HF projection.
        target_modules: ``LoRAConfig.target_modules`` (HF module names).

    Returns:
        ``base_model.model.<prefix>.<proj>.lora_{A,B}.weight`` for each targeted HF projection,
        e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
    """
    out = []
    for module in lora_modules:
        prefix, _, last = module.rpartition(".")
        for part in packed.get(last, [last]):
            hf = f"{prefix}.{part}" if prefix else part
            if targets(hf, target_modules):
                out += [f"{PEFT_PREFIX}{hf}.lora_A.weight", f"{PEFT_PREFIX}{hf}.lora_B.weight"]
    return out


def check_adapter_names(names: list[str], expected: list[str]) -> None:
    """Raise unless ``names`` are exactly ``expected``, each once.

    Raises:
        KeyError: names the engine has no adapter slot for (listed).
        ValueError: a name sent twice, or expected adapters left out (listed).
    """
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"adapter weight {n!r} listed twice in one update")
        seen.add(n)
    unknown = sorted(seen - set(expected))
    if unknown:
        raise KeyError(f"{len(unknown)} adapter weights match no LoRA module of the engine: {unknown[:4]} "
                       "(learner.lora.target_modules must be modules the engine supports LoRA on)")
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"adapter update leaves {len(missing)} LoRA weights of the engine without a tensor: {missing[:4]}")


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
    from async_rl.learners.critic import copy_matching_parameters

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
    plain = _plain_like(model)
    plain.save_pretrained(out_dir, state_dict=merged, safe_serialization=True)
    save_adapter(adapter, cfg, os.path.join(out_dir, "adapter"), base_model_path)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def _plain_like(model: torch.nn.Module) -> torch.nn.Module:
    # A weightless plain model of the same config: save_pretrained then writes its config and the
    # given state dict under plain names (the peft-wrapped model would describe its LoRA layers).
    from transformers import AutoModelForCausalLM

    config = model.get_base_model().config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)


# ---------------------------------------------------------------------------------------- vLLM
def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``.

    Raises:
        ValueError: ``rank`` above vLLM's largest (512).
    """
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"learner.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")


def spec(cfg: LoRAConfig) -> dict:
    """``cfg`` as a plain dict (it crosses process boundaries through vLLM's ``collective_rpc``)."""
    return {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout, "target_modules": list(cfg.target_modules)}


__all__ = ["LoRAConfig", "AdapterDisabled", "GradOnlyDropout", "wrap", "adapter_parameters",
           "adapter_named_weights", "adapter_metadata", "merged_named_weights", "merge_lora_state",
           "reference_policy", "export_merged", "save_adapter", "check_adapter_names",
           "expected_vllm_adapter_names", "vllm_max_lora_rank"]
