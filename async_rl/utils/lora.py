"""LoRA's shared contract: the adapter settings and the names adapters travel under.

Both sides of a LoRA run use this module: the learner (``async_rl.learners.lora`` trains, merges
and exports the adapters) and the engines (``async_rl.generators``: the HF engine wraps its base
model alike and loads adapters by these names; vLLM's worker checks updates against the adapter
names its LoRA modules expect). Keeping it outside ``learners/`` lets the generator side import it
without depending on the learner.

**Names on the wire** are peft's saved-adapter names, the names of ``adapter_model.safetensors``
(``get_peft_model_state_dict``: the adapter name removed), for example
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ``[r, 128]`` and
``...q_proj.lora_B.weight`` ``[128, r]``. peft parses them back (HF engine) and so does vLLM's LoRA
loader (``vllm.lora.utils.parse_fine_tuned_lora_name``), which fuses q/k/v and gate/up itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


__all__ = ["LoRAConfig", "lora_enabled", "peft_config", "GradOnlyDropout", "wrap", "lora_layers", "is_adapter_param",
           "sync_name", "plain_name", "adapter_parameters", "targets", "expected_vllm_adapter_names",
           "check_adapter_names", "vllm_max_lora_rank", "spec", "ADAPTER", "PEFT_PREFIX", "DEFAULT_TARGET_MODULES",
           "VLLM_LORA_RANKS"]
