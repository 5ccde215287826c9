"""What each learner backend can do, declared by the learner class and read by name.

Every learner class carries a ``capabilities`` class attribute (``LearnerCapabilities``); the
learner config's checks (``async_rl.learners.base``), the config's messages (``async_rl.config``)
and the rank launcher (``async_rl.learners.launch``) ask it instead of comparing backend names.

``LEARNERS`` maps a ``learner.backend`` name to the import path of its class: the class is
imported on first use only (``learner_class``); the Megatron module imports megatron-core inside
its functions, so reading its capabilities loads no optional dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from async_rl.utils.registry import BackendRegistry

__all__ = ["LEARNERS", "LearnerCapabilities", "learner_capabilities", "learner_class", "learners_that",
           "model_parallel_sizes"]


@dataclass(frozen=True)
class LearnerCapabilities:
    """What a learner backend can do; the ``capabilities`` class attribute of its learner class.

    Attributes:
        name: how messages name the backend (``Megatron``).
        lora: trains LoRA adapters (``learner.lora.rank > 0``); false = full weights only.
        cpu_offload: honours ``learner.cpu_offload`` (FSDP2's ``CPUOffloadPolicy``).
        hf_attention: runs the Hugging Face model, so ``learner.attn_implementation`` applies.
        parallel_settings: the ``learner.<field>`` holding its model-parallel sizes
            (``megatron``); empty = every rank is data parallel.
        model_parallel: the integer keys of ``parallel_settings`` whose product splits one model
            replica over ranks (``tensor_parallel_size``, ``pipeline_parallel_size``); the data
            parallel size is ``learner.world_size`` divided by that product.
        moe_aux_losses: adds a mixture-of-experts policy's load-balancing and z-losses
            (``algorithm.moe_aux_loss_coef``, ``moe_z_loss_coef``).
        vision_language: trains a vision-language policy on prompts with images.
    """

    name: str
    lora: bool
    cpu_offload: bool
    hf_attention: bool
    parallel_settings: str = ""
    model_parallel: tuple[str, ...] = ()
    moe_aux_losses: bool = False
    vision_language: bool = False


LEARNERS = BackendRegistry("learner backend", "learner.backend", LearnerCapabilities)
"""``learner.backend`` name -> learner class (registered as an import path, imported on use)."""
LEARNERS.register("fsdp2", "async_rl.learners.fsdp:FSDPLearner")
LEARNERS.register("megatron", "async_rl.learners.megatron:MegatronLearner")

learner_class = LEARNERS.backend_class
learner_capabilities = LEARNERS.capabilities
learners_that = LEARNERS.names_that


def model_parallel_sizes(cfg: Any) -> dict[str, int]:
    """The model-parallel sizes of a ``LearnerConfig``'s backend by key, e.g.
    ``{"tensor_parallel_size": 2, "pipeline_parallel_size": 1}``; empty for a backend whose
    ranks are all data parallel.

    Raises:
        ValueError: an unknown ``cfg.backend``.
    """
    caps = learner_capabilities(cfg.backend)
    if not caps.parallel_settings:
        return {}
    settings = getattr(cfg, caps.parallel_settings)
    return {key: getattr(settings, key) for key in caps.model_parallel}


def model_parallel_size(cfg: Any) -> int:
    """Ranks one model replica spans (the product of ``model_parallel_sizes``; 1 = none)."""
    return math.prod(model_parallel_sizes(cfg).values())
